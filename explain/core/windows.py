"""Backward passes that compute only the window of a map a score reaches.

A convolutional head maps each position of its input from a small neighbourhood: a YOLO head's class branch
gives every cell's class scores from the cells within two of it. One detection's score reaches one cell of one
branch, so its gradient reaches that branch's input only within the cell's receptive field; autograd still
differentiates the whole map. Here such a module runs without autograd, and its output is joined to its input by
:class:`WindowRecomputed`. Its backward takes, per image, the window of positions whose incoming gradient is not
zero, widens it by the module's reach, and recomputes the module with autograd on that part of its input alone.
A window the gradient does not reach at all passes no gradient on, so autograd skips what made the input.

A module is local when its forward, traced once per module, input shape and training flags (:func:`reach`),
runs only these operations:

- convolutions of stride one, zero-padded to keep their size;
- batch norms in eval mode;
- element-wise operations on tensors made from the input, or on constants spread over space;
- reads of a tensor's shape; and calls that do not read the input (they make constants).

Its reach along an axis is the sum of its convolutions' half kernels (times their dilation): no path from an
output position reads farther.

The recomputed gradients are those autograd gives. An output position the gradient reaches reads only input
positions of the widened window; at the map's edges, the window's padding is the map's own zero padding. Output
positions the gradient does not reach add nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .hooks import Hooks
from .maps import bounding_boxes, nonzero

_CONVOLUTIONS = {"conv1d", "conv2d", "conv3d"}
ELEMENTWISE = {
    "silu", "relu", "relu6", "gelu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "leaky_relu", "elu", "mish",
    "softplus", "hardtanh", "add", "sub", "mul", "div", "neg", "clamp",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__neg__",
}  # fmt: skip
_METADATA = {"dim", "size", "numel", "ndimension", "__get__", "__len__"}  # reads a tensor's shape, not its values


def argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str, default: Any) -> Any:
    """A torch call's argument, given by position or by name."""
    return args[position] if len(args) > position else kwargs.get(name, default)


def operands(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """A torch call's arguments, those in a list or a tuple (a concatenation's tensors) one by one."""
    return [v for arg in (*args, *kwargs.values()) for v in (arg if isinstance(arg, (list, tuple)) else (arg,))]


class _LocalityTrace(TorchFunctionMode):
    """Watch one forward of a module: whether each call keeps it local, and the convolutions' reach."""

    def __init__(self, x: Tensor) -> None:
        super().__init__()
        self.spatial = x.dim() - 2
        self.reach = [0] * self.spatial
        self.local = True
        self._made = {id(x)}  # the tensors made from the input
        self._kept: list[Tensor] = [x]  # held, so that no id is reused during the trace

    def _spread(self, value: Any) -> bool:
        """Whether an operand is made from the input, or the same at every position of the map: its axes that
        broadcast against the spatial axes are all of size one."""
        if not isinstance(value, Tensor) or id(value) in self._made:
            return True
        return all(size == 1 for size in value.shape[max(0, value.dim() - self.spatial) :])

    def _keeps_local(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> bool:
        if not isinstance(result, Tensor):
            return name in _METADATA
        if name in _CONVOLUTIONS:
            x, weight = args[0], args[1]
            if id(x) not in self._made or weight.dim() != self.spatial + 2:
                return False
            kernel = weight.shape[2:]
            stride, padding, dilation = (
                argument(args, kwargs, position, key, default)
                for position, key, default in ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1))
            )
            stride, dilation = (v if isinstance(v, (tuple, list)) else (v,) * self.spatial for v in (stride, dilation))
            if isinstance(padding, int):
                padding = (padding,) * self.spatial
            spans = [d * (k - 1) for d, k in zip(dilation, kernel)]
            if any(s != 1 for s in stride) or any(span % 2 for span in spans):
                return False
            if padding != "same" and list(padding) != [span // 2 for span in spans]:
                return False
            self.reach = [r + span // 2 for r, span in zip(self.reach, spans)]
            return True
        if name == "batch_norm":
            return id(args[0]) in self._made and not argument(args, kwargs, 5, "training", False)
        if name in ELEMENTWISE:
            return all(self._spread(v) for v in (*args, *kwargs.values()))
        return False

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not any(isinstance(v, Tensor) and id(v) in self._made for v in operands(args, kwargs)):
            return result  # a constant, made without the input: its use tells whether it is spread over space
        name = getattr(func, "__name__", "")
        if self.local and not self._keeps_local(name, args, kwargs, result):
            self.local = False
        if isinstance(result, Tensor):
            self._made.add(id(result))
            self._kept.append(result)
        return result


_REACHES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], tuple[int, ...] | None]] = (
    weakref.WeakKeyDictionary()
)


def reach(module: nn.Module, x: Tensor) -> tuple[int, ...] | None:
    """How far, along each spatial axis of ``x`` (N, C, *spatial), an output position of ``module`` reads its
    input; None when the module is not local (see the module's docstring). Traced once per module, input shape
    and training flags, on the first image."""
    key = (tuple(x.shape[1:]), x.dtype, x.device, tuple(m.training for m in module.modules()))
    known = _REACHES.setdefault(module, {})
    if key not in known:
        probe = x[:1].detach()
        with torch.no_grad(), _LocalityTrace(probe) as trace:
            output = module.forward(probe)
        local = trace.local and isinstance(output, Tensor) and output.shape[2:] == probe.shape[2:]
        known[key] = tuple(trace.reach) if local else None
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
        images = nonzero(grad.flatten(1), dim=1).nonzero()[:, 0].tolist()  # a branch the score misses: all zeros
        if not images:
            return None, None, None, None
        found = torch.zeros_like(x)
        for i in images:
            reached = nonzero(grad[i], dim=0)  # (*spatial)
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


def _detached(inputs: dict[nn.Module, tuple[Tensor, tuple[int, ...]]], module: nn.Module, args: tuple[Any, ...]):
    """Forward pre-hook: a local module's input that requires grad is detached, and kept for its output's join."""
    x = args[0] if len(args) == 1 else None
    if not isinstance(x, Tensor) or not x.requires_grad or not torch.is_grad_enabled() or x.dim() < 3:
        return None
    if any(p.requires_grad for p in module.parameters()):
        return None
    span = reach(module, x)
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
    try:
        with Hooks() as hooks:
            for head in heads:
                hooks.forward_pre(head, partial(_detached, inputs))
                hooks.forward(head, partial(_joined, inputs))
            yield
    finally:
        inputs.clear()
