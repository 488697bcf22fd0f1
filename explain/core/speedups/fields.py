"""What each position of a tensor reads of a forward's input, traced through the forward: its receptive field.

A convolutional network's first operations are local: each output position reads a box of input positions.
:class:`FieldTrace` watches one forward (a TorchFunctionMode) and follows each position's field through these
operations, per spatial axis (a stride, where the field starts and how far it reaches):

- convolutions (any stride, dilation and zero padding that does not depend on the input's size), and max or
  average pooling without ``ceil_mode``;
- batch norms and dropouts in eval mode;
- element-wise operations on tensors made from the input, or with constants spread over space (a bias per
  channel); a concatenation of channels.

The first call that is anything else, or that reads the input's size (a padding computed from it), ends the
local part of the forward (:attr:`FieldTrace.ends`); the forward itself goes on. The shared prefix of masked copies
(:mod:`explain.core.prefix`) and the window-restricted backward of a convolutional head
(:mod:`explain.core.windows`) both read their locality from this trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.overrides import TorchFunctionMode

ELEMENTWISE = {
    "silu", "relu", "relu6", "gelu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "leaky_relu", "elu", "mish",
    "softplus", "hardtanh", "add", "sub", "mul", "div", "neg", "clamp",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__neg__",
}  # fmt: skip


def argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str, default: Any) -> Any:
    """A torch call's argument, given by position or by name."""
    return args[position] if len(args) > position else kwargs.get(name, default)


def operands(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """A torch call's arguments, those in a list or a tuple (a concatenation's tensors) one by one."""
    return [v for arg in (*args, *kwargs.values()) for v in (arg if isinstance(arg, (list, tuple)) else (arg,))]


_IN_PLACE = {"relu_", "add_", "mul_", "sub_", "div_", "clamp_", "hardtanh_", "__iadd__", "__imul__", "__isub__"}
_PASSING = {"contiguous", "clone", "float", "to", "type_as"}
_HARMLESS = {"dim", "ndimension"}  # reads that do not depend on the input's size
_HARMLESS_ATTRIBUTES = {"dtype", "device", "ndim", "layout", "is_cuda", "requires_grad", "is_sparse", "is_quantized"}


@dataclass(frozen=True)
class Field:
    """Along one axis, the input positions that position o of a tensor reads: o * stride + start, and ``reach``
    more after it."""

    stride: int = 1
    start: int = 0
    reach: int = 0

    def after(self, stride: int, padding: int, dilation: int, kernel: int) -> Field:
        """The field after a sliding window (a convolution's, a pooling's) over a tensor with this field."""
        return Field(
            self.stride * stride, self.start - padding * self.stride, self.reach + dilation * (kernel - 1) * self.stride
        )

    def union(self, other: Field) -> Field | None:
        """The field of an element-wise result of two tensors on the same grid; None when the grids differ."""
        if other.stride != self.stride:
            return None
        start = min(self.start, other.start)
        return Field(self.stride, start, max(self.start + self.reach, other.start + other.reach) - start)


def per_axis(value: Any, rank: int) -> tuple[int, ...] | None:
    """One int per spatial axis, from one int for all or a sequence of ``rank`` ints; None from anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * rank
    if isinstance(value, (tuple, list)) and len(value) == rank and all(isinstance(v, int) for v in value):
        return tuple(value)
    return None


def name_of(func: Any) -> str:
    """A torch call's name; an attribute's read is its name and ``.get``."""
    name = getattr(func, "__name__", "")
    return f"{getattr(getattr(func, '__self__', None), '__name__', '')}.get" if name == "__get__" else name


class FieldTrace(TorchFunctionMode):
    """Watch one forward: each call's ordinal and work, the fields of the local part's results (each a candidate
    cut, in order), where each tensor made from the input is last used, and the first call that is not local."""

    def __init__(self, x: Tensor) -> None:
        super().__init__()
        self.rank = x.dim() - 2
        self.spatial = tuple(x.shape[2:])
        self.resized = False  # whether a local result's map differs in size from the input's
        self.calls = 0
        self.fields: dict[int, tuple[Field, ...]] = {id(x): (Field(),) * self.rank}
        self.born: dict[int, int] = {id(x): -1}
        self.last_use: dict[int, int] = {}
        self.kept: list[Any] = [x]  # held, so that no id is reused during the trace
        self.ends: int | None = None  # the first call that is not local
        self.costs: list[float] = []  # the work of each call, by ordinal
        self.local_results: list[tuple[int, str, Tensor]] = []  # (ordinal, name, result), in order

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        index = self.calls
        self.calls += 1
        result = func(*args, **kwargs)
        made = [v for v in operands(args, kwargs) if isinstance(v, Tensor) and id(v) in self.born]
        name = name_of(func)
        self.costs.append(_cost(name, args, result) if made else 0.0)
        if not made:
            return result
        for v in made:
            self.last_use[id(v)] = index
        if not isinstance(result, (Tensor, tuple, list)):  # a read of a tensor: its size ends the local part
            if self.ends is None and name not in _HARMLESS and name.removesuffix(".get") not in _HARMLESS_ATTRIBUTES:
                self.ends = index
            return result
        if self.ends is None:
            try:
                fields = self._local(name, args, kwargs, result)
            except Exception:  # arguments the analysis cannot read: the call ends the local part, the forward goes on
                fields = None
            if fields is None:
                self.ends = index
            else:
                self.fields[id(result)] = fields
                self.local_results.append((index, name, result))
                self.resized |= tuple(result.shape[2:]) != self.spatial
        for tensor in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(tensor, Tensor) and id(tensor) not in self.born:
                self.born[id(tensor)] = index
                self.kept.append(tensor)
        return result

    def _local(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> tuple[Field, ...] | None:
        """The fields of a local call's result, or None: the call ends the local part."""
        if not isinstance(result, Tensor) or result.dim() != self.rank + 2:
            return None
        x = args[0] if args else None
        if isinstance(x, Tensor) and id(x) in self.fields and name in _WINDOWED:
            return self._windowed(name, args, kwargs, self.fields[id(x)])
        if name == "batch_norm" or name == "dropout":
            training = (
                argument(args, kwargs, 5, "training", False)
                if name == "batch_norm"
                else kwargs.get("training", args[2] if len(args) > 2 else True)
            )
            return self.fields.get(id(x)) if not training and isinstance(x, Tensor) else None
        if name in ("cat", "concat", "concatenate"):
            if argument(args, kwargs, 1, "dim", 0) not in (1, -self.rank - 1):
                return None
            tensors = args[0] if args else kwargs.get("tensors", ())
            return self._joined(list(tensors), result, require_made=True)
        if name in ELEMENTWISE or name in _IN_PLACE or name in _PASSING:
            tensors = [v for v in operands(args, kwargs) if isinstance(v, Tensor)]
            return self._joined(tensors, result, require_made=False)
        return None

    def _windowed(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], fields: tuple[Field, ...]
    ) -> tuple[Field, ...] | None:
        rank = self.rank
        if name.startswith("conv"):
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if not isinstance(weight, Tensor) or id(weight) in self.born or weight.dim() != rank + 2:
                return None
            kernel = tuple(weight.shape[2:])
            stride = per_axis(argument(args, kwargs, 3, "stride", 1), rank)
            dilation = per_axis(argument(args, kwargs, 5, "dilation", 1), rank)
            padding: Any = argument(args, kwargs, 4, "padding", 0)
            if padding == "valid":
                padding = 0
            elif padding == "same" and dilation is not None:
                spans = [d * (k - 1) for d, k in zip(dilation, kernel)]
                padding = tuple(s // 2 for s in spans) if all(s % 2 == 0 for s in spans) else None
            padding = per_axis(padding, rank)
        else:  # max or average pooling
            kernel = per_axis(argument(args, kwargs, 1, "kernel_size", None), rank)
            stride = per_axis(argument(args, kwargs, 2, "stride", None) or kernel, rank)
            padding = per_axis(argument(args, kwargs, 3, "padding", 0), rank)
            is_max = name.startswith("max")
            dilation = per_axis(argument(args, kwargs, 4, "dilation", 1) if is_max else 1, rank)
            if argument(args, kwargs, 5 if is_max else 4, "ceil_mode", False):
                return None
        if None in (kernel, stride, padding, dilation):
            return None
        return tuple(f.after(s, p, d, k) for f, s, p, d, k in zip(fields, stride, padding, dilation, kernel))

    def _joined(self, tensors: list[Tensor], result: Tensor, require_made: bool) -> tuple[Field, ...] | None:
        """The fields of an element-wise result (or a concatenation of channels) of these operands: every operand
        made from the input on the result's grid, every other one spread over space."""
        spatial = tuple(result.shape[2:])
        joined: tuple[Field, ...] | None = None
        for v in tensors:
            if id(v) in self.fields:
                if tuple(v.shape[2:]) != spatial:
                    return None
                own = self.fields[id(v)]
                joined = own if joined is None else _union(joined, own)
                if joined is None:
                    return None
            elif id(v) in self.born or require_made:
                return None  # made from the input, but not locally
            elif any(size != 1 for size in v.shape[max(0, v.dim() - self.rank) :]):
                return None
        return joined


_WINDOWED = {
    *(f"conv{r}d" for r in (1, 2, 3)),
    *(f"{kind}_pool{r}d" for kind in ("max", "avg") for r in (1, 2, 3)),
}


def _union(a: tuple[Field, ...], b: tuple[Field, ...]) -> tuple[Field, ...] | None:
    joined = [f.union(g) for f, g in zip(a, b)]
    return None if None in joined else tuple(joined)  # type: ignore[arg-type]


def _cost(name: str, args: tuple[Any, ...], result: Any) -> float:
    """A call's work: a convolution's or a product's multiply-adds, else its result's size."""
    if not isinstance(result, Tensor):
        return 0.0
    if name in _WINDOWED and name.startswith("conv") and len(args) > 1 and isinstance(args[1], Tensor):
        return float(result.numel() * math.prod(args[1].shape[1:]))
    if name in ("linear", "matmul", "bmm", "mm") and len(args) > 1 and isinstance(args[1], Tensor):
        return float(result.numel() * args[1].shape[-1 if name == "linear" else -2])
    return float(result.numel())
