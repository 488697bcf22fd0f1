"""What explain learns about a model, in one object per model: :class:`ModelContext`. Nothing learned lives
elsewhere: :func:`forget` clears it all.

A call learns facts that later calls reuse: the layers' trace at an input signature, the automatic layers for
a kind of target, the folded copy for scoring forwards, how far a head's branches read, which layers' outputs the
model modifies in place or computes from another target layer. Each lives in the model's
context under a key that holds everything that decides it:

- the **structure** of the model, checked once per call (on entering
  :func:`explain.core.model_state.untouched`) or at a look-up outside a call: the identity of each module in
  order, how many attributes and children each has, the shape, dtype and device of each parameter and buffer,
  and each module's switches (its attributes that are booleans, strings, whole numbers or tuples of them, as
  ``global_pool = "avg"``, ``aux_logits = True`` or a convolution's ``stride``, and any function set on the
  module itself, as a patched ``forward``; the ``training`` and ``inplace`` flags aside, which explain's calls
  change for their length: the traces run in eval mode, the backward rules out of place). A change to any of
  them drops every learned entry, so that a replaced stage, a swapped head, a switched branch or a new stride is
  traced afresh. The check reads the learned structure, module by module, without walking the model or building
  the structure again (:func:`walked`);
- per entry, the **input signature** (:func:`input_signature`: the shape of one input without its batch axis,
  dtype and device, and the model's further keyword arguments), and for the automatic layers the **target's
  kind** (:func:`target_kind`).

The context also holds the model's lock (see :func:`explain.core.model_state.exclusive`), which outlives
:func:`forget`. Contexts are held weakly: a model the user lets go is freed with its context.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

_SWITCHES = (bool, str, int)  # the attribute types that switch a module's branches or shapes
_NO_SWITCHES = {"training", "inplace"}  # flags explain's own calls change for their length (eval mode, the rules)
_MISSING = object()  # an attribute a module no longer has


@dataclass(eq=False)
class ModelContext:
    """Everything explain learns about one model, each entry under its own key (see the module's docstring).

    Attributes:
        lock: The re-entrant lock that calls on the model hold.
        structure: The structure the entries were learned on.
        traces: The traced layers, by input signature.
        layouts: The layouts of given layers read without a trace, by input signature and layer name.
        sequences: The modules whose output is a sequence (N, T, C), read without a trace, by input signature.
        automatic: The automatic layers' names, by input signature and target kind.
        folded: The folded copy for scoring forwards (see :mod:`explain.core.speedups.folding`), or None.
        reaches: How far a local module reads its input, by module, then by input signature (see
            :func:`explain.core.speedups.windows.reach`).
        modified_in_place: The modules whose output the model modifies in place, found by earlier calls: their
            recorders start on the tensor-hook path (see :class:`explain.core.hooks.ActivationGradientRecorder`).
        downstream: The target modules found computed from another target module's output: their gradient is
            caught by a tensor hook.
        families: The model families whose passes spare part of the backward (see :mod:`explain.core.families`),
            or None until asked.
        names: The model's modules by dotted name, the model itself aside, as its structure has them (held
            weakly), or None until asked.
    """

    lock: threading.RLock = field(default_factory=threading.RLock)
    structure: tuple[Any, ...] | None = None
    traces: dict[Hashable, Any] = field(default_factory=dict)
    layouts: dict[Hashable, dict[str, Any]] = field(default_factory=dict)
    sequences: dict[Hashable, set[str]] = field(default_factory=dict)
    automatic: dict[Hashable, list[str]] = field(default_factory=dict)
    folded: Any = None
    reaches: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, Any]] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    modified_in_place: weakref.WeakSet[nn.Module] = field(default_factory=weakref.WeakSet)
    downstream: weakref.WeakSet[nn.Module] = field(default_factory=weakref.WeakSet)
    families: tuple[Any, ...] | None = None
    names: weakref.WeakValueDictionary[str, nn.Module] | None = None

    def clear(self) -> None:
        """Drop every learned entry; the lock stays."""
        self.structure = None
        self.traces.clear()
        self.layouts.clear()
        self.sequences.clear()
        self.automatic.clear()
        self.folded = None
        self.reaches.clear()
        self.modified_in_place.clear()
        self.downstream.clear()
        self.families = None
        self.names = None

    def holds(self) -> bool:
        """Whether anything is learned (the structure it was learned on aside)."""
        kept = (self.traces, self.layouts, self.sequences, self.automatic, self.reaches, self.modified_in_place)
        return any(len(entries) for entries in (*kept, self.downstream)) or self.folded is not None


_CONTEXTS: weakref.WeakKeyDictionary[nn.Module, ModelContext] = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()


def structure(modules: Sequence[nn.Module]) -> tuple[Any, ...]:
    """The structure of a model walked as ``modules``: per module, a weak reference to it, how many attributes it
    has, its children, its switches (and any function set on it, as a patched ``forward``), and the shape, dtype
    and device of each of its parameters and buffers."""
    return tuple(_entry(module) for module in modules)


def _entry(module: nn.Module) -> tuple[Any, ...]:
    """One module's part of :func:`structure`."""
    found = module.__dict__
    keys = [key for key, value in found.items() if key[:1] != "_" and _switch(key, value)]  # "_": no switch
    values = [found[key] for key in keys]
    children = [*map(id, found["_modules"].values())]
    return weakref.ref(module), len(found), children, keys, [*map(type, values)], values, _tensors(found)


def _switch(key: str, value: Any) -> bool:
    """Whether a module's attribute decides its branches or its shapes: a boolean, a string (``global_pool =
    "avg"``), a whole number or a tuple of them (a convolution's ``stride``), or a function set on the module
    itself (a patched ``forward``); the flags explain's own calls change aside."""
    if key.startswith("_") or key in _NO_SWITCHES:
        return False
    kind = type(value)
    if kind in _SWITCHES or (kind is tuple and all(type(item) in _SWITCHES for item in value)):
        return True
    return callable(value) and not isinstance(value, (nn.Module, Tensor, type))



def _tensors(found: Mapping[str, Any]) -> list[Any]:
    """The shape, dtype and device of a module's parameters and buffers (its ``__dict__`` is ``found``)."""
    return [(t.shape, t.dtype, t.device) for store in (found["_parameters"], found["_buffers"]) for t in store.values()
            if t is not None]  # fmt: skip


def walked(model: nn.Module, known: tuple[Any, ...] | None) -> list[nn.Module] | None:
    """The model's modules in the order :meth:`nn.Module.modules` walks them, read from its learned structure
    ``known`` without walking it, where the model still has that structure (each module alive, with the same
    children in the same order, attributes, switches, parameters and buffers: so the walk is the same); else
    None."""
    if known is None:
        return None
    modules = []
    for reference, size, children, keys, types, values, tensors in known:
        module = reference()
        found = getattr(module, "__dict__", None)
        if found is None or len(found) != size or [*map(id, found["_modules"].values())] != children:
            return None
        now = [found.get(key, _MISSING) for key in keys]
        if [*map(type, now)] != types or now != values or _tensors(found) != tensors:  # equal types: plain ==
            return None
        modules.append(module)
    return modules if modules and modules[0] is model else None


def context_of(model: nn.Module) -> ModelContext:
    """The model's context, made at first use; its lock only, without checking what it learned."""
    with _GUARD:
        found = _CONTEXTS.get(model)
        if found is None:
            found = _CONTEXTS[model] = ModelContext()
        return found


def learned(model: nn.Module) -> tuple[ModelContext, list[nn.Module]]:
    """The model's context, its learned entries dropped if the model's structure changed since they were learned,
    and the model's modules in walk order (read from the structure where it holds, else walked)."""
    context = context_of(model)
    modules = walked(model, context.structure)
    if modules is None:
        modules = list(model.modules())
        context.clear()
        context.structure = structure(modules)
    return context, modules


def forget(model: nn.Module) -> None:
    """Drop all that explain learned about a model: its traces, automatic layers, folded copy; the next call learns
    them again. A call running on the model meanwhile finishes first.

    Args:
        model: The model.
    """
    with _GUARD:
        found = _CONTEXTS.get(model)
    if found is not None:
        with found.lock:
            found.clear()


def knows(model: nn.Module) -> bool:
    """Whether explain holds anything learned about the model (a trace, automatic layers, a folded copy, a
    module's reach or output path)."""
    with _GUARD:
        found = _CONTEXTS.get(model)
    return found is not None and found.holds()


def _signature(value: Any) -> Hashable:
    """What of one keyword argument decides a trace: a tensor's shape, dtype and device; a plain value itself;
    anything else its type."""
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_signature(item) for item in value)
    return type(value).__qualname__


def input_signature(x: Tensor, model_kwargs: Mapping[str, Any] | None = None) -> Hashable:
    """The key of what one input decides: one input's shape (without the batch axis), dtype and device, and the
    model's keyword arguments by name (see :func:`_signature`)."""
    kwargs = tuple(sorted((name, _signature(value)) for name, value in (model_kwargs or {}).items()))
    return tuple(x.shape[1:]), x.dtype, x.device, kwargs


def target_kind(target: Any) -> Hashable:
    """What of a call's target decides the automatic layers: its class, where it reads the model's output, and for
    a callable target the code it runs (never the classes or boxes, which every target of a kind reaches alike)."""
    if target is None or isinstance(target, (int, str)):
        return "default"
    function = getattr(target, "function", None) or getattr(target, "score", None)
    code = getattr(function, "__code__", function)
    output = getattr(target, "output", None)
    return type(target).__qualname__, output if isinstance(output, (str, int, type(None))) else id(output), id(code)
