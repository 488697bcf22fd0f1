"""How a pass's recorded layers become maps, read where it costs least.

The full trace (:func:`explain.core.layers.trace_layers`) runs the model on one image under the operation trace
(:mod:`explain.core.op_trace`), and on noise: what the automatic layers' search needs. A pass whose layers are
known needs of it only their layouts, and the operation trace can run during the pass's own forward
(:class:`PassWatch`): the feature axes of the recorded outputs, the attention modules around them, their token
marks. On a batch of several images, tokens are not laid out there (Hiera's unrolled tokens, moved across the
batch axis, would keep the mark of a grid they no longer follow). A layout the forward does not tell is read from
the full trace, run then, after the pass. What a pass learns is kept in the model's context (see
:mod:`explain.core.context`), per input signature.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

from torch import Tensor, nn

from ..errors import LayerError
from .context import input_signature
from .hooks import Hooks, layer_entry
from .layers import LayerInfo, is_probabilities, traced_layers
from .layouts import Geometry, Layout, find_layout, grid_fits
from .model_state import model_context
from .op_trace import OpTrace
from .speedups.narrow_watch import watched_modules


class PassWatch(OpTrace):
    """The operation trace (see :mod:`explain.core.op_trace`) run during a call's own forward, on the whole batch:
    the feature axes of the recorded layers' outputs, their token marks, the modules that compute attention, and the
    modules whose output is a sequence (N, T, C). What a batch of several images cannot tell (tokens moved about,
    whose cells are followed on one image only) is left untold, for the full trace.

    Args:
        model: The model; every named module (or each of ``hooked``) gets a forward pre-hook and a forward hook for
            the block, registered after the recorder's, so that they see the outputs the model goes on with.
        x: The pass's input.
        names: The recorded layers.
        hooked: The modules hooked, where not every one is (see :mod:`explain.core.speedups.narrow_watch`).
    """

    def __init__(
        self, model: nn.Module, x: Tensor, names: Collection[str], hooked: Collection[str] | None = None
    ) -> None:
        super().__init__(partial(grid_fits, size=tuple(x.shape[2:])), rank=x.dim() - 2)
        self.model, self.names, self.hooked = model, set(names), hooked
        self.sequences: set[str] = set()

    @contextmanager
    def watching(self) -> Iterator[PassWatch]:
        """For the block, the model's forwards are watched."""
        with Hooks() as hooks:
            for name, module in self.model.named_modules():
                if name and (self.hooked is None or name in self.hooked):
                    hooks.forward_pre(module, lambda module, args, name=name: self.stack.append(name))
                    hooks.forward(module, partial(self._finished, name), with_kwargs=True)
            with self:
                yield self

    def _finished(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self.stack.pop()
        self.module_output(name, args, kwargs, output)
        first = output[0] if isinstance(output, (tuple, list)) and output else output  # nn.MultiheadAttention's
        if isinstance(first, Tensor) and first.dim() == 3:
            self.sequences.add(name)
        if name in self.names and isinstance(output, Tensor):
            self.watch(name, output)

    def layout(self, name: str, activation: Tensor, geometry: Geometry) -> Layout | None:
        """The layer's layout from what the forward told, or None where it did not tell (the full trace must).
        Tokens are laid out from a pass of one image only: on several, tokens moved across the batch axis (Hiera's
        unrolling) would keep a mark of the grid they no longer follow."""
        try:
            found = find_layout(
                self.model, name, tuple(activation.shape[1:]), geometry, self.observed, is_probabilities(activation)
            )
        except LayerError:
            return None
        return None if found.kind == "tokens" and len(activation) != 1 else found


class PassLayouts:
    """The layouts of one pass's recorded layers: learned at this input signature, read from the pass's own
    forward, or taken from the full trace, run where the forward cannot tell (after the pass, whose hooks would
    record the trace's forwards).

    Args:
        model: The model.
        x: The pass's input.
        model_kwargs: The model's further keyword arguments.
        names: The layers the pass records.
    """

    def __init__(self, model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any], names: Collection[str]) -> None:
        self.model, self.x, self.model_kwargs = model, x, model_kwargs
        self._context, self._key = model_context(model), input_signature(x, model_kwargs)
        self._traced: Mapping[str, LayerInfo] | None = self._context.traces.get(self._key)
        self._known = self._context.layouts.setdefault(self._key, {})
        unknown = self._traced is None and not set(names) <= set(self._known)
        self.watch = PassWatch(model, x, names, watched_modules(model, names)) if unknown else None

    @property
    def sequences(self) -> set[str] | None:
        """The modules whose output is a sequence (T, C) per image (an entry of ``nn.MultiheadAttention``'s by its
        module), or None where not known yet."""
        if self._traced is not None:
            found = self._traced.items()
            return {layer_entry(name)[0] for name, info in found if info.shape is not None and len(info.shape) == 2}
        return self._context.sequences.get(self._key)

    @contextmanager
    def watched(self) -> Iterator[None]:
        """The context the pass's forward runs in: watched where a layout is unknown, its sequences kept after."""
        if self.watch is None:
            yield
            return
        with self.watch.watching():
            yield
        self._context.sequences[self._key] = set(self.watch.sequences)

    def layout(self, name: str, activation: Tensor, geometry: Geometry) -> Layout:
        """How a recorded layer's output becomes a map (see the module's docstring).

        Raises:
            LayerError: The full trace found the output no map of the image.
        """
        if self._traced is not None:
            return _traced_layout(self.model, name, activation, geometry, self._traced)
        if name in self._known:
            return self._known[name]
        found = None if self.watch is None else self.watch.layout(name, activation, geometry)
        if found is None:
            return _traced_layout(self.model, name, activation, geometry, self.traced())
        self._known[name] = found
        return found

    def traced(self) -> Mapping[str, LayerInfo]:
        """The full trace at the pass's input signature, run now where it has not run yet (outside any pass of the
        model: its hooks would record the trace's forwards)."""
        if self._traced is None:
            self._traced = traced_layers(self.model, self.x, self.model_kwargs)
        return self._traced


def _traced_layout(
    model: nn.Module, name: str, activation: Tensor, geometry: Geometry, traced: Mapping[str, LayerInfo]
) -> Layout:
    """A layer's layout as the full trace read it.

    Raises:
        LayerError: The trace found the output no map of the image.
    """
    info = traced.get(name)
    if info is None or info.shape != tuple(activation.shape[1:]):  # not run alike in the traced pass
        return find_layout(model, name, activation.shape[1:], geometry)
    if info.layout is None:
        raise LayerError(info.refusal or f"layer {name!r} outputs {info.shape}, not a map of the image")
    return info.layout
