"""Context managers that leave a user's model exactly as they found it.

A CAM call switches parameter gradients off (so autograd records nothing before
the target layer and computes no weight gradient), may briefly switch the model
to eval mode (automatic layer search) and, in train mode, runs a forward pass
that updates BatchNorm statistics. Each change is undone here, on success and on
exception alike.

Calls on one model from several threads run one after another: each holds the model's lock (:func:`exclusive`)
for its whole length, since the hooks, the frozen flags and the eval mode of one call would otherwise change what
another computes and restores. The lock is re-entrant, so a call made inside another on the same thread (Guided
Grad-CAM's Grad-CAM, a metric's forwards inside an export) goes through; but a call made while one of the
model's passes runs (from a hook on the model, or a target's score) is refused: its hooks and flags would mix
with those of the pass around it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import ExplainError
from .context import ModelContext, context_of, learned

_PASSES = threading.local()  # .models: the ids of the models whose pass this thread is running


@contextmanager
def running(model: nn.Module) -> Iterator[None]:
    """Mark the block as a pass of the model on this thread (its forward, backward and scoring)."""
    models = _PASSES.__dict__.setdefault("models", [])
    models.append(id(model))
    try:
        yield
    finally:
        models.pop()


@contextmanager
def exclusive(model: nn.Module) -> Iterator[None]:
    """For the block, this thread alone works on the model: other threads' calls on it wait (the re-entrant lock
    of the model's context, kept while the model lives).

    Raises:
        ExplainError: This thread is running a pass of the model: the call comes from a hook or a target.
    """
    if id(model) in _PASSES.__dict__.get("models", ()):
        raise ExplainError(
            "explain was called on a model from inside a pass of another explain call on it (a hook on the model, "
            "or a target's score): the two calls' hooks and flags would mix; call it after the first call returns"
        )
    with context_of(model).lock:
        yield


def _parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of these modules, each once (a parameter may be shared)."""
    return list({id(p): p for m in modules for p in m._parameters.values() if p is not None}.values())


@contextmanager
def frozen_parameters(model: nn.Module, modules: list[nn.Module] | None = None) -> Iterator[None]:
    """Switch ``requires_grad`` off on every parameter, restoring each flag on exit. ``modules``: the model's
    modules, when the caller has walked them already."""
    params = [(p, p.requires_grad) for p in _parameters(list(model.modules()) if modules is None else modules)]
    try:
        for p, flag in params:
            if flag:
                p.requires_grad_(False)
        yield
    finally:
        for p, flag in params:
            if flag:
                p.requires_grad_(True)


@contextmanager
def training_flags_kept(model: nn.Module, modules: list[nn.Module] | None = None) -> Iterator[None]:
    """Restore every submodule's ``training`` flag on exit. ``modules``: as for :func:`frozen_parameters`."""
    flags = [(m, m.training) for m in (model.modules() if modules is None else modules)]
    try:
        yield
    finally:
        for m, flag in flags:
            if m.training != flag:
                m.training = flag


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put the model in eval mode for the block, then restore every module's flag; other threads' calls on the
    model wait meanwhile."""
    with exclusive(model), training_flags_kept(model):
        model.eval()
        yield


@contextmanager
def buffers_kept(model: nn.Module, modules: list[nn.Module] | None = None) -> Iterator[None]:
    """Restore buffers (e.g. BatchNorm running statistics) that a train-mode forward changes. ``modules``: as for
    :func:`frozen_parameters`.

    Only the buffers of modules in training mode are copied: in eval mode the layers of torch.nn leave their
    buffers alone.
    """
    walked = model.modules() if modules is None else modules
    saved = [(b, b.clone()) for m in walked if m.training for b in m._buffers.values() if b is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)


@contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Everything a CAM call must leave as it was: parameter flags, training flags, buffers; other threads' calls
    on the model wait meanwhile. The model's modules are found once, on entry, and serve :func:`modules_of`
    within the block: on the outermost entry, read from the structure explain learned, checked module by module
    (see :func:`explain.core.context.learned`), before any rule changes a module's flags."""
    with exclusive(model):
        walks = _PASSES.__dict__.setdefault("walks", {})
        outer = walks.get(id(model))
        modules = learned(model)[1] if outer is None else list(model.modules())
        walks[id(model)] = modules
        try:
            with frozen_parameters(model, modules), training_flags_kept(model, modules), buffers_kept(model, modules):
                yield
        finally:
            if outer is None:
                del walks[id(model)]
            else:
                walks[id(model)] = outer


def model_context(model: nn.Module) -> ModelContext:
    """The model's context (see :mod:`explain.core.context`): within :func:`untouched` on this thread, as checked
    against the model's structure on entry, once per call; else checked now."""
    if id(model) in _PASSES.__dict__.get("walks", {}):
        return context_of(model)
    return learned(model)[0]


def modules_of(model: nn.Module) -> list[nn.Module]:
    """The model's modules: within :func:`untouched` on this thread, its walk on entry (the model, locked, keeps
    them); else a new walk."""
    walked = _PASSES.__dict__.get("walks", {}).get(id(model))
    return list(model.modules()) if walked is None else walked


def module_names(model: nn.Module) -> Mapping[str, nn.Module]:
    """The model's modules by dotted name, the model itself aside: found once per structure (see
    :func:`model_context`), then kept in its context."""
    context = model_context(model)
    if context.names is None:
        context.names = weakref.WeakValueDictionary((name, m) for name, m in model.named_modules() if name)
    return context.names
