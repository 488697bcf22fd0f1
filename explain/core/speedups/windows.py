"""Backward passes that compute only the window of a map a score reaches.

A convolutional head maps each position of its input from a small neighbourhood: a YOLO head's class branch
gives every cell's class scores from the cells within two of it. One detection's score reaches one cell of one
branch, so its gradient reaches that branch's input only within the cell's receptive field; autograd still
differentiates the whole map. Here such a module runs without autograd, and its output is joined to its input by
:class:`WindowRecomputed`. Its backward takes, per image, the window of positions whose incoming gradient is not
zero, widens it by the module's reach, and recomputes the module with autograd on that part of its input alone.
A window the gradient does not reach at all passes no gradient on, so autograd skips what made the input.

A module is local when its forward, traced once per module, input shape and training flags (:func:`reach`), runs
only the local operations of :mod:`explain.core.fields` (convolutions, poolings, eval-mode batch norms, element-wise
calls, concatenations of channels; no read of the input's size), each on the input's grid and keeping its size:
stride one, padded to keep it. Its reach along an axis is how far its output's field extends on either side of a
position (the sum of its convolutions' half kernels, times their dilation): no path from an output position reads
farther.

The recomputed gradients are those autograd gives. An output position the gradient reaches reads only input
positions of the widened window; at the map's edges, the window's padding is the map's own zero padding. Output
positions the gradient does not reach add nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, MutableMapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..hooks import Hooks
from ..maps import bounding_boxes, has_nonzero
from ..model_state import model_context
from .fields import FieldTrace

Reaches = MutableMapping[nn.Module, dict[Any, Any]]  # how far each local module reads, by input: the context's


def reach(module: nn.Module, x: Tensor, reaches: Reaches | None = None) -> tuple[int, ...] | None:
    """How far, along each spatial axis of ``x`` (N, C, *spatial), an output position of ``module`` reads its
    input; None when the module is not local (see the module's docstring). Traced on the first image, once per
    module, input shape and training flags where ``reaches`` (the model's context's) keeps what is found."""
    key = (tuple(x.shape[1:]), x.dtype, x.device, tuple(m.training for m in module.modules()))
    known = {} if reaches is None else reaches.setdefault(module, {})
    if key not in known:
        probe = x[:1].detach()
        with torch.no_grad(), FieldTrace(probe) as trace:
            output = module.forward(probe)
        fields = trace.fields.get(id(output)) if isinstance(output, Tensor) else None
        on_grid = fields is not None and trace.ends is None and not trace.resized
        if on_grid and all(f.stride == 1 for f in fields):  # every local result keeps the input's size
            known[key] = tuple(max(-f.start, f.start + f.reach) for f in fields)
        else:
            known[key] = None
    return known[key]


class WindowRecomputed(torch.autograd.Function):
    """A local module's output, computed without autograd, joined to its input ``x``.

    The output comes in a one-element tuple, not as a tensor argument: the function's output is then no view of
    an input, and the model may modify it in place. The backward recomputes the module, per image, on the window
    of ``x`` that the reached output positions read (see the module's docstring).
    """

    @staticmethod
    def forward(ctx: Any, module: nn.Module, reach: tuple[int, ...], output: tuple[Tensor], x: Tensor) -> Tensor:
        ctx.module, ctx.reach = module, reach
        ctx.save_for_backward(x)
        return output[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        images = has_nonzero(grad.flatten(1), dim=1).nonzero()[:, 0].tolist()  # a branch the score misses: all zeros
        if not images:
            return None, None, None, None
        found = torch.zeros_like(x)
        for i in images:
            reached = has_nonzero(grad[i], dim=0)  # (*spatial)
            window = (slice(i, i + 1), slice(None), *_window(reached, ctx.reach))
            part = x[window].detach().requires_grad_(True)
            with torch.enable_grad():
                recomputed = ctx.module.forward(part)
            (found[window],) = torch.autograd.grad(recomputed, part, grad[window])
        return None, None, None, found


def _window(reached: Tensor, reach: tuple[int, ...]) -> list[slice]:
    """The slices, one per axis, of the box around the reached positions, widened by the reach and cut to the
    map."""
    starts, sides = (values[0].tolist() for values in bounding_boxes(reached[None]))
    return [
        slice(max(start - widen, 0), min(start + side + widen, size))
        for start, side, widen, size in zip(starts, sides, reach, reached.shape)
    ]


def _detached(
    inputs: dict[nn.Module, tuple[Tensor, tuple[int, ...]]],
    reaches: Reaches,
    module: nn.Module,
    args: tuple[Any, ...],
):
    """Forward pre-hook: a local module's input that requires grad is detached, and kept for its output's join."""
    x = args[0] if len(args) == 1 else None
    if not isinstance(x, Tensor) or not x.requires_grad or not torch.is_grad_enabled() or x.dim() < 3:
        return None
    if any(p.requires_grad for p in module.parameters()):
        return None
    span = reach(module, x, reaches)
    if span is None:
        return None
    inputs[module] = (x, span)
    return (x.detach(),)


def _joined(inputs: dict[nn.Module, tuple[Tensor, tuple[int, ...]]], module: nn.Module, args: Any, output: Any):
    """Forward hook: the output of a module whose input :func:`_detached` kept, joined to that input."""
    kept = inputs.pop(module, None)
    if kept is None or not isinstance(output, Tensor):
        return None
    x, span = kept
    return WindowRecomputed.apply(module, span, (output,), x)


def has_local_heads(model: nn.Module) -> bool:
    """Whether the model declares local heads (its ``local_heads`` attribute, as a YOLO detector's)."""
    return bool(getattr(model, "local_heads", ()))


@contextmanager
def windowed_heads(model: nn.Module, skip: Collection[nn.Module] = ()) -> Iterator[None]:
    """For the block, differentiate each of the model's local heads only over the windows its gradient reaches.

    The heads are those a model declares in its ``local_heads`` attribute (a YOLO detector's head branches, see
    :class:`explain.models.yolo.YoloDetector`); a head that holds a module of ``skip`` (the modules a recorder
    hooks), or that is not local, is differentiated as autograd does. A model without the attribute is left
    alone.
    """
    heads = [head for head in getattr(model, "local_heads", ()) if set(skip).isdisjoint(head.modules())]
    inputs: dict[nn.Module, tuple[Tensor, tuple[int, ...]]] = {}
    reaches = model_context(model).reaches
    try:
        with Hooks() as hooks:
            for head in heads:
                hooks.forward_pre(head, partial(_detached, inputs, reaches))
                hooks.forward(head, partial(_joined, inputs))
            yield
    finally:
        inputs.clear()
