"""Forwards of copies of an image that differ from it inside one window (an occluded window, an ablated segment),
their shared prefix computed once.

A convolutional network's first operations are local: each output position reads a box of input positions, its
receptive field. A copy of an image that differs from it inside a window differs, after such operations, only at
the positions whose field meets the window. :class:`SharedPrefix` finds, in one traced forward, the operation
after which the rest of the model reads nothing of the prefix but that operation's result (the cut); computes
the cut's result on each image once; and runs each copy's prefix on a crop around its window alone, the crop's
result pasted into its image's, the rest of the model on the whole.

The prefix may hold only these operations, each position's field followed through them (per spatial axis: a
stride, where the field starts and how far it reaches):

- convolutions (any stride, dilation and zero padding that does not depend on the input's size), and max or
  average pooling without ``ceil_mode``;
- batch norms and dropouts in eval mode;
- element-wise operations on tensors made from the input, or with constants spread over space (a bias per
  channel); a concatenation of channels.

A prefix that reads its input's size (a padding computed from it), or calls anything else, ends there. The cut is
chosen where the prefix's work saved is largest (a crop's share of the map, by the convolutions' multiply-adds);
below a tenth of the whole forward's work, none is made. A crop starts at a multiple of the cut's stride, so that
its positions lie on the image's grid; the positions pasted are those whose field meets the window, and each
reads the crop alone, or the image's own border: their values are the whole copy's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor
from torch.overrides import TorchFunctionMode

from .folding import ScoringForwards
from .windows import ELEMENTWISE, argument, operands

_IN_PLACE = {"relu_", "add_", "mul_", "sub_", "div_", "clamp_", "hardtanh_", "__iadd__", "__imul__", "__isub__"}
_PASSING = {"contiguous", "clone", "float", "to", "type_as"}
_HARMLESS = {"dim", "ndimension"}  # reads that do not depend on the input's size
_HARMLESS_ATTRIBUTES = {"dtype", "device", "ndim", "layout", "is_cuda", "requires_grad", "is_sparse", "is_quantized"}
MIN_SAVING = 0.1  # the least share of the forward's work a cut must save


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


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    return f"{getattr(getattr(func, '__self__', None), '__name__', '')}.get" if name == "__get__" else name


class _PrefixTrace(TorchFunctionMode):
    """Watch one forward: each call's ordinal, the fields of the prefix's results, and where each tensor made from
    the input is last used."""

    def __init__(self, x: Tensor) -> None:
        super().__init__()
        self.rank = x.dim() - 2
        self.calls = 0
        self.fields: dict[int, tuple[Field, ...]] = {id(x): (Field(),) * self.rank}
        self.born: dict[int, int] = {id(x): -1}
        self.last_use: dict[int, int] = {}
        self.kept: list[Any] = [x]  # held, so that no id is reused during the trace
        self.ends: int | None = None  # the first call that is not local
        self.costs: list[float] = []  # the work of each call, by ordinal
        self.cuts: list[tuple[int, str, Tensor]] = []  # the local results: (ordinal, name, result)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        index = self.calls
        self.calls += 1
        result = func(*args, **kwargs)
        made = [v for v in operands(args, kwargs) if isinstance(v, Tensor) and id(v) in self.born]
        name = _name(func)
        self.costs.append(_cost(name, args, result) if made else 0.0)
        if not made:
            return result
        for v in made:
            self.last_use[id(v)] = index
        if not isinstance(result, (Tensor, tuple, list)):  # a read of a tensor: its size ends the prefix
            if self.ends is None and name not in _HARMLESS and name.removesuffix(".get") not in _HARMLESS_ATTRIBUTES:
                self.ends = index
            return result
        if self.ends is None:
            try:
                fields = self._local(name, args, kwargs, result)
            except Exception:  # arguments the analysis cannot read: the call ends the prefix, the forward goes on
                fields = None
            if fields is None:
                self.ends = index
            else:
                self.fields[id(result)] = fields
                self.cuts.append((index, name, result))
        for tensor in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(tensor, Tensor) and id(tensor) not in self.born:
                self.born[id(tensor)] = index
                self.kept.append(tensor)
        return result

    def _local(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> tuple[Field, ...] | None:
        """The fields of a local call's result, or None: the call ends the prefix."""
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


@dataclass(frozen=True)
class _Cut:
    """Where the prefix is cut: the call's ordinal and name, its result's fields, the crops' sides and the result's
    spatial size on the whole input."""

    index: int
    name: str
    fields: tuple[Field, ...]
    crop: tuple[int, ...]
    size: tuple[int, ...]


class _Replaced(TorchFunctionMode):
    """Count the calls of a forward; the result of call ``index`` goes through ``replace``."""

    def __init__(self, cut: _Cut, replace: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.cut, self.replace, self.calls = cut, replace, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        index = self.calls
        self.calls += 1
        result = func(*args, **(kwargs or {}))
        if index != self.cut.index:
            return result
        if _name(func) != self.cut.name or not isinstance(result, Tensor):
            raise _Unmatched
        return self.replace(result)


class _Unmatched(Exception):
    """The forward did not run the traced calls."""


class _Captured(Exception):
    """The cut's result is kept: the forward ends there."""


class SharedPrefix:
    """Forwards of copies of images that differ from their image inside one window each, the prefix shared (see
    the module's docstring).

    The model is traced once; :meth:`saving` weighs windows of several sides against that trace, and :meth:`fit`
    chooses the cut for one of them and computes the images' results there. A model with a module in training
    mode gets no cut: its batch norms mix the copies of a batch.

    Args:
        forwards: The model's forwards without gradient.
        x: The images (N, C, *spatial).
        window: The window's side along each spatial axis; None: choose it later (:meth:`fit`).
        model_kwargs: The model's keyword arguments.
    """

    def __init__(
        self, forwards: ScoringForwards, x: Tensor, window: Sequence[int] | None, model_kwargs: dict[str, Any]
    ) -> None:
        self.forwards, self.model_kwargs, self.x = forwards, model_kwargs, x
        self.spatial = tuple(x.shape[2:])
        self.window: tuple[int, ...] = ()
        self.cut: _Cut | None = None
        self.features: Tensor | None = None
        training = any(m.training for m in forwards.model.modules())  # batch statistics: no copy is its own
        self._candidates = [] if training else self._traced(x[:1])
        if window is not None:
            self.fit(window)

    def _traced(self, probe: Tensor) -> list[tuple[float, _Cut]]:
        """The calls after which the prefix may be cut, each with the work done up to it (a share of the whole
        forward's); their crops' sides are set by :meth:`_chosen`."""
        layout = self.forwards.channels_last
        with _PrefixTrace(probe) as trace:
            self.forwards(probe, **self.model_kwargs)
        if self.forwards.channels_last != layout:  # the model refused channels-last inputs: the trace ran twice
            with _PrefixTrace(probe) as trace:
                self.forwards(probe, **self.model_kwargs)
        ends = trace.ends if trace.ends is not None else trace.calls
        total = sum(trace.costs) or 1.0
        cuts = {index: (name, result) for index, name, result in trace.cuts}
        found, done = [], 0.0
        for index, cost in enumerate(trace.costs[:ends]):
            done += cost
            if index not in cuts:
                continue
            name, result = cuts[index]
            if min(result.shape[2:]) < 2 or not self._alone(trace, index, result):
                continue
            found.append((done / total, _Cut(index, name, trace.fields[id(result)], (), tuple(result.shape[2:]))))
        return found

    def _chosen(self, window: Sequence[int]) -> tuple[float, _Cut | None]:
        """The cut that saves the most of the forward's work for windows of these sides, and that share (0 and
        None below :data:`MIN_SAVING`)."""
        best, saved = None, MIN_SAVING
        for done, cut in self._candidates:
            crop = tuple(_crop_side(f, size, w) for f, size, w in zip(cut.fields, self.spatial, window))
            share = math.prod(c / size for c, size in zip(crop, self.spatial))
            if done * (1 - share) > saved:
                best, saved = replace(cut, crop=crop), done * (1 - share)
        return (saved, best) if best is not None else (0.0, None)

    def saving(self, window: Sequence[int]) -> float:
        """The share of a whole forward's work that a copy differing inside a window of these sides saves (0
        where no cut serves)."""
        return self._chosen(window)[0]

    def fit(self, window: Sequence[int]) -> None:
        """Cut for windows of these sides, and compute the images' results at the cut (none: no cut)."""
        self.window = tuple(window)
        self.cut = self._chosen(self.window)[1]
        self.features = None
        if self.cut is None:
            return
        kept: list[Tensor] = []

        def keep(result: Tensor) -> Tensor:
            kept.append(result)
            raise _Captured  # the rest of the forward is not needed

        try:
            with _Replaced(self.cut, keep):
                self.forwards(self.x, **self.model_kwargs)
        except (_Captured, _Unmatched):
            pass
        if not kept or tuple(kept[0].shape[2:]) != self.cut.size:
            self.cut = None
        self.features = kept[0] if kept and self.cut is not None else None

    @staticmethod
    def _alone(trace: _PrefixTrace, index: int, result: Tensor) -> bool:
        """Whether, after call ``index``, the forward reads nothing made before it but its result."""
        return all(
            trace.last_use.get(key, born) <= index
            for key, born in trace.born.items()
            if born <= index and key != id(result)
        )

    def __call__(self, crops_of: Callable[[list[tuple[slice, ...]]], Tensor], images: Tensor, starts: Tensor) -> Any:
        """The model's output on copies of images ``images`` (rows,), copy r differing from its image inside the
        window that starts at ``starts[r]`` (rank,); None where the prefix cannot serve them (no cut, a window
        outside its crop, a forward that ran other calls than traced): the copies are then scored whole.

        Args:
            crops_of: The copies (rows, C, *crop) within one region each (a slice per spatial axis).
            images: Each copy's image.
            starts: Each copy's window start.
        """
        if self.cut is None or self.features is None:
            return None
        cut, features = self.cut, self.features
        boxes = [self._boxes(cut, [int(s) for s in start]) for start in starts.tolist()]
        if None in boxes:
            return None
        crops = crops_of([tuple(slice(c, c + side) for (c, _, _), side in zip(box, cut.crop)) for box in boxes])

        def pasted(cropped: Tensor) -> Tensor:
            full = features[images]  # a copy: indexing by a tensor
            for r, box in enumerate(boxes):
                into = tuple(slice(low, high) for _, low, high in box)
                out_of = tuple(slice(low - c // f.stride, high - c // f.stride) for (c, low, high), f in
                               zip(box, cut.fields))  # fmt: skip
                full[(r, slice(None), *into)] = cropped[(r, slice(None), *out_of)]
            return full

        try:
            with _Replaced(cut, pasted):
                return self.forwards(crops, **self.model_kwargs)
        except _Unmatched:
            return None

    def _boxes(self, cut: _Cut, start: Sequence[int]) -> list[tuple[int, int, int]] | None:
        """Per axis: where the crop starts in the input, and the cut's positions [low, high) the window reaches;
        None where they fall outside the crop."""
        box = []
        for f, size, side, w, s, outputs in zip(cut.fields, self.spatial, cut.crop, self.window, start, cut.size):
            low = max(math.ceil((s - f.start - f.reach) / f.stride), 0)
            high = min((s + w - 1 - f.start) // f.stride + 1, outputs)
            first = max(low * f.stride + f.start, 0)
            crop = min(first // f.stride * f.stride, size - side)
            if max(0, high - 1) * f.stride + f.start + f.reach >= crop + side and crop + side < size:
                return None
            box.append((crop, low, high))
        return box


def _crop_side(field: Field, size: int, window: int) -> int:
    """The crop's side along one axis: the input positions that a window's reached positions read, with a stride's
    slack for the crop's start on the grid; such that every crop start on the grid up to the input's end is a
    multiple of the stride. The whole axis where that is no shorter."""
    need = window + 2 * field.reach + 2 * field.stride
    if need >= size:
        return size
    return size - field.stride * ((size - need) // field.stride)
