"""What a model does with its layers' outputs, read from the operations of one forward pass.

A module's class name says neither how its output is laid out nor whether it computes attention; the
operations the model runs say both. During a traced pass, :class:`OpTrace` (a
:class:`torch.overrides.TorchFunctionMode`) watches every torch function the model calls:

- **The feature axis of an output of the input's rank** (4-D for images, 5-D for volumes and clips, 3-D for
  signals). The first operation that consumes the output (after any element-wise operations and permutes)
  tells which axis holds the features: axis 1 of a convolution, a batch, group or instance norm, a pooling
  or resampling, or a flatten of all the spatial axes; the last axis of a linear layer or a layer norm; the
  one axis a mean or variance is taken over; the axis kept when all the others but the batch are pooled.
- **Tokens of a grid.** A map of the input's rank flattened into tokens (a patch embedding's convolution, a
  stage's output) marks the tokens with their grid ((h, w) for an image, (t, h, w) for a clip); a signal's
  convolution marks its output's positions (axis 2) as the signal's grid, which a transpose makes tokens (a 1-D
  transformer's patch embedding). The mark follows the tokens through permutes, element-wise operations,
  reshapes of the axes after the token axis, operations over the last axis (linear layers, layer norms),
  attention (its rows are its queries' tokens), a concatenation of tokens in front (a class token: the prefix;
  never another grid's tokens, as a pyramid's levels flattened one after another are), a slice of the prefix,
  and through any module whose first input carries the mark and whose output keeps its token count (an
  attention block, an MLP). Tokens without the mark (a detector's object queries) are never laid out on a grid,
  whatever their count.
- **Tokens moved about.** Where a call moves marked tokens in a way the mark cannot follow (split into windows,
  reordered across the batch axis, pooled in groups), each element's grid cell is followed instead: the same
  call runs on a tensor of cell numbers. A pooling over groups of tokens gives a coarser grid when each group
  is one cell of it. When the tokens come back as rows of one image, each row one cell and every cell once,
  they are marked again, with their order: Hiera's unrolled tokens.
- **Attention.** A module is an attention module when a softmax over an axis of a tensor of three or more axes
  (the last in most attention, the tokens in factorized attention, the branches in selective kernels), or a
  scaled dot-product attention, runs in its own forward. The outputs of the modules inside it
  (attention weights, heads, talking-heads projections) are never maps.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

# Operations whose input's feature axis is axis 1 (channels first).
_AXIS_ONE = {
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "batch_norm", "group_norm", "instance_norm", "interpolate",
    *(f"{pool}{rank}d" for rank in (1, 2, 3) for pool in (
        "adaptive_avg_pool", "adaptive_max_pool", "avg_pool", "max_pool", "lp_pool", "max_pool",
    )),
}  # fmt: skip
_LAST_AXIS = {"linear", "layer_norm", "rms_norm"}  # operations over the input's last axis
_REDUCTIONS = {"mean", "sum", "var", "std", "amax", "amin", "var_mean", "std_mean", "logsumexp"}
_PERMUTES = {"permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis"}
_ATTENTION = {"scaled_dot_product_attention", "multi_head_attention_forward"}
_RESHAPES = {"flatten", "reshape", "view", "reshape_as", "view_as", "unflatten"}
_PRODUCTS = {"matmul", "bmm", "scaled_dot_product_attention"}  # the first operand's rows are the result's
# Calls that pass a tensor on reshaped, resampled or converted, not read: their result is still that tensor.
_PASSING = {
    "flatten", "reshape", "view", "squeeze", "unsqueeze", "contiguous", "float", "to", "type_as", "clone",
    "interpolate", "upsample",
}  # fmt: skip
# Calls that only move elements about: run on a tensor of grid cells, they tell where each element lies.
_MOVES = _RESHAPES | _PERMUTES | {
    "getitem", "contiguous", "squeeze", "unsqueeze", "expand", "expand_as", "split", "chunk", "unbind", "tensor_split",
}  # fmt: skip
_POOLS = _REDUCTIONS | {"max", "min"}
_NEUTRAL = {"softmax", "log_softmax", "cumsum", "cumprod", "flip", "roll"}  # same shape, but not element-wise


@dataclass(frozen=True)
class TokenMark:
    """Tokens of a grid of the image.

    Attributes:
        axis: The tensor's token axis.
        grid: The grid the tokens were flattened from, in row-major order: (h, w) for an image, (t, h, w) for a
            clip or a volume.
        prefix: Tokens in front of the grid's (class, distillation, registers).
        order: The grid cell of each token after the prefix, when they are not in row-major order.
    """

    axis: int
    grid: tuple[int, ...]
    prefix: int = 0
    order: tuple[int, ...] | None = None

    def moved(self, order: Sequence[int]) -> TokenMark | None:
        """The mark after a permute whose output axis i is input axis ``order[i]``."""
        return replace(self, axis=list(order).index(self.axis)) if self.axis in order else None

    def cells(self, like: Tensor) -> Tensor:
        """The grid cell of each element of a tensor with this mark, -1 for the prefix's tokens."""
        rows = torch.arange(math.prod(self.grid)) if self.order is None else torch.tensor(self.order)
        rows = torch.cat([torch.full((self.prefix,), -1), rows]).int()  # int32: half the memory of the default
        shape = [1] * like.dim()
        shape[self.axis] = len(rows)
        return rows.view(shape).expand(like.shape)


@dataclass(frozen=True)
class Cells:
    """Where the elements of tokens moved about lie: the grid cell of each (-1: none), and the grid."""

    cells: Tensor
    grid: tuple[int, ...]

    def as_mark(self) -> TokenMark | None:
        """The mark of one image's tokens whose rows (axis 1 of 3) are each one cell, every cell once, or None."""
        cells = self.cells
        if cells.dim() != 3 or len(cells) != 1 or not bool((cells == cells[..., :1]).all()):
            return None
        rows = cells[0, :, 0]
        prefix = int((rows < 0).long().cumprod(0).sum())
        order = rows[prefix:]
        every = torch.arange(len(order), dtype=order.dtype)
        if len(order) != math.prod(self.grid) or not torch.equal(order.sort().values, every):
            return None
        raster = torch.equal(order, every)
        return TokenMark(1, self.grid, prefix, None if raster else tuple(order.tolist()))

    def pooled(self, dims: tuple[int, ...], keepdim: bool) -> Cells | None:
        """The cells after a reduction over ``dims``: the same, when each reduced group is one cell (the
        features), or the cells of a coarser grid, when each group is one cell of it (a pooling of tokens)."""
        group = math.prod(self.cells.shape[dim] for dim in dims)
        for strides in [(1,) * len(self.grid), *_factorizations(group, self.grid)]:
            coarse_grid = tuple(side // stride for side, stride in zip(self.grid, strides))
            coordinates = torch.stack(torch.unravel_index(self.cells.clamp(min=0), self.grid))
            steps = torch.tensor(strides).view(-1, *(1,) * self.cells.dim())
            coarse = torch.where(self.cells < 0, -1, _ravel(coordinates // steps, coarse_grid))
            low, high = torch.amin(coarse, dims, keepdim), torch.amax(coarse, dims, keepdim)
            if torch.equal(low, high):
                return Cells(high, coarse_grid)
        return None


def _factorizations(group: int, grid: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """The strides, one per axis of ``grid`` and each dividing it, whose product is ``group``."""
    if not grid:
        if group == 1:
            yield ()
        return
    for stride in range(1, group + 1):
        if group % stride == 0 and grid[0] % stride == 0:
            for rest in _factorizations(group // stride, grid[1:]):
                yield (stride, *rest)


def _ravel(coordinates: Tensor, grid: tuple[int, ...]) -> Tensor:
    """The row-major index of each cell of ``grid`` given by its coordinates (stacked along axis 0)."""
    index = torch.zeros_like(coordinates[0])
    for axis, side in enumerate(grid):
        index = index * side + coordinates[axis]
    return index


@dataclass
class Observed:
    """What the operations of a traced pass told.

    Attributes:
        feature_axes: For each watched output (two axes more than the input's rank), by layer name, the axis
            (counting the batch axis as 0) the first consumer treats as features.
        attention_modules: Names of the modules in whose own forward attention is computed.
        tokens: For each 3-D output laid out as tokens of a grid, by layer name, its mark.
    """

    feature_axes: dict[str, int] = field(default_factory=dict)
    attention_modules: set[str] = field(default_factory=set)
    tokens: dict[str, TokenMark] = field(default_factory=dict)


def attention_call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a torch call named ``name`` computes attention: a softmax over any axis but the first of a tensor of
    three or more axes, or a scaled dot-product attention."""
    if name in ("softmax", "log_softmax"):
        first, dim = args[0] if args else None, _dims(args, kwargs, "dim")
        return isinstance(first, Tensor) and first.dim() >= 3 and dim is not None and dim[0] % first.dim() != 0
    return name in _ATTENTION


def _dims(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> tuple[int, ...] | None:
    """The ``dim`` argument of a reduction or a permute, as a tuple, or None when absent."""
    value = kwargs.get(name, args[1] if len(args) > 1 else None)
    if isinstance(value, int):
        return (value,)
    if isinstance(value, Sequence) and all(isinstance(v, int) for v in value):
        return tuple(value)
    return None


def _permutation(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], ndim: int) -> list[int] | None:
    """For a permute-like call, which input axis each output axis is; None when it cannot be read."""
    if name == "permute":
        dims = kwargs.get("dims", args[1:] if len(args) > 2 else (args[1] if len(args) > 1 else None))
        dims = list(dims) if isinstance(dims, Sequence) else None
        return [d % ndim for d in dims] if dims and len(dims) == ndim else None
    if name in ("transpose", "swapaxes", "swapdims"):
        pair = [*args[1:3], *(kwargs.get(k) for k in ("dim0", "dim1", "axis0", "axis1") if k in kwargs)]
        if len(pair) != 2 or not all(isinstance(d, int) for d in pair):
            return None
        order = list(range(ndim))
        a, b = (d % ndim for d in pair)
        order[a], order[b] = order[b], order[a]
        return order
    source, destination = (
        kwargs.get(k, args[i] if len(args) > i else None) for i, k in ((1, "source"), (2, "destination"))
    )
    if not (isinstance(source, int) and isinstance(destination, int)):
        return None
    order = list(range(ndim))
    order.insert(destination % ndim, order.pop(source % ndim))
    return order


def _feature_axis(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], ndim: int) -> int | None:
    """The axis of the call's first argument that the call treats as features, or None when it tells none."""
    if name in _AXIS_ONE:
        return 1
    if name in _LAST_AXIS:
        shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else None)
        return ndim - 1 if name == "linear" or (isinstance(shape, Sequence) and len(shape) == 1) else None
    if name == "flatten":
        start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
        end = kwargs.get("end_dim", args[2] if len(args) > 2 else -1)
        return 1 if isinstance(start, int) and start % ndim == 2 and end % ndim == ndim - 1 and ndim >= 4 else None
    if name in _REDUCTIONS:
        dims = _dims(args, kwargs, "dim")
        reduced = {d % ndim for d in dims} if dims else set()
        if len(reduced) == 1 and 0 not in reduced:
            return reduced.pop()
        if len(reduced) == ndim - 2 and 0 not in reduced:
            return ({*range(1, ndim)} - reduced).pop()
    return None


def _sliced(mark: TokenMark, index: Any) -> TokenMark | None:
    """The mark of ``tokens[index]`` when the index drops prefix tokens only (``x[:, 1:]``), else None."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) <= mark.axis or any(item != slice(None) for item in index[: mark.axis]):
        return None
    cut = index[mark.axis]
    if not isinstance(cut, slice) or cut.step not in (None, 1) or cut.stop is not None:
        return None
    start = cut.start or 0
    if not 0 <= start <= mark.prefix or not all(
        isinstance(item, slice) or item is Ellipsis for item in index[mark.axis + 1 :]
    ):
        return None
    return replace(mark, prefix=mark.prefix - start)


class OpTrace(TorchFunctionMode):
    """Watch the torch functions of a forward pass (see the module's docstring).

    Args:
        grid_fits: Whether an (h, w) grid can be a grid of the image; tokens are marked only with such grids.
        rank: How many spatial axes the input has; the outputs watched for their feature axis have two more.

    The caller's module hooks keep :attr:`stack` (the running modules' names, innermost last) and hand each
    layer's output to :meth:`watch`.
    """

    def __init__(self, grid_fits: Callable[[Sequence[int]], bool] = lambda grid: min(grid) > 1, rank: int = 2) -> None:
        super().__init__()
        self._grid_fits = grid_fits
        self.rank = rank
        self.stack: list[str] = []
        self.observed = Observed()
        # id -> (tensor, its mark), and id -> (tensor, its elements' cells) for tokens moved about; held weakly, so
        # that the trace keeps no tensor alive that the model let go
        self._marks: dict[int, tuple[weakref.ref[Tensor], TokenMark]] = {}
        self._cells: dict[int, tuple[weakref.ref[Tensor], Cells]] = {}
        self._outputs: dict[int, tuple[weakref.ref[Tensor], list[str]]] = {}  # id -> (layers' output, names)
        self.read: set[str] = set()  # the layers whose output a later operation read, not only passed on
        self.free_modules: set[str] = set()  # the modules without parameters, filled by the caller
        self._derived: dict[int, tuple[weakref.ref[Tensor], set[str]]] = {}  # id -> (tensor, layers it is made of)
        # id -> (tensor, [(layer name, which output axis each of the tensor's axes is)])
        self._watched: dict[int, tuple[Tensor, list[tuple[str, list[int]]]]] = {}

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """For the block, the calls are not watched: the caller's own reading of a tensor tells nothing. They skip
        every ``__torch_function__`` (PyTorch's ``DisableTorchFunction``), this mode's included, so that reading
        costs no dispatch through it."""
        with torch._C.DisableTorchFunction():
            yield

    def producer(self, output: Tensor) -> str | None:
        """The first layer noted (:meth:`produced`) whose output is this very tensor, or None."""
        known = self._outputs.get(id(output))
        return known[1][0] if known is not None and known[0]() is output else None

    def produced(self, name: str, output: Tensor) -> None:
        """Note a layer's output, to tell later whether any operation of the pass read it (:attr:`read`)."""
        known = self._outputs.get(id(output))
        if known is not None and known[0]() is output:
            known[1].append(name)
        else:
            self._outputs[id(output)] = (weakref.ref(output), [name])

    def returned(self, tensors: Sequence[Tensor]) -> set[str]:
        """The layers that make the model's output (``tensors``): those whose output, as it is or only passed on
        (:meth:`_note_reads`), is one of them and was read by no operation, and those it is computed from without
        parameters (a mask classifier's mask logits, combined with its class probabilities into the scores)."""
        found, derived = set(), set()
        for tensor in tensors:
            known, made = self._outputs.get(id(tensor)), self._derived.get(id(tensor))
            if known is not None and known[0]() is tensor:
                found.update(known[1])
            if made is not None and made[0]() is tensor:
                derived.update(made[1])
        return (found - self.read) | derived

    def watch(self, name: str, output: Tensor) -> None:
        """Find the feature axis of a layer's output of two axes more than the input's rank (batch, features and
        one per spatial axis) from the operations that consume it."""
        if output.dim() == self.rank + 2 and name not in self.observed.feature_axes:
            self._add(output, [(name, list(range(output.dim())))])

    def mark_of(self, value: Any) -> TokenMark | None:
        """The token mark a tensor carries, or None."""
        known = self._marks.get(id(value)) if isinstance(value, Tensor) else None
        return known[1] if known is not None and known[0]() is value else None

    def _mark(self, tensor: Tensor, mark: TokenMark | None) -> None:
        if mark is not None and 0 < mark.axis < tensor.dim():
            self._marks[id(tensor)] = (weakref.ref(tensor), mark)

    def module_output(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """A module's output keeps the mark of its first input when it keeps its token count; a 3-D output
        with a mark of axis 1 is recorded as the layer's tokens."""
        first = next((a for a in args if isinstance(a, Tensor)), kwargs.get("hidden_states", kwargs.get("x")))
        mark = self.mark_of(first)
        entries = (
            output.items()
            if isinstance(output, Mapping)
            else enumerate(output)
            if isinstance(output, (list, tuple))
            else []
        )
        for key, value in [(None, output), *entries]:
            if not isinstance(value, Tensor):
                continue
            own = self.mark_of(value)
            if (
                own is None
                and mark is not None
                and value.dim() > mark.axis
                and value.shape[mark.axis] == first.shape[mark.axis]
            ):
                self._mark(value, own := mark)
            if own is not None and own.axis == 1 and value.dim() == 3:
                self.observed.tokens.setdefault(name if key is None else f"{name}:{key}", own)

    def _tokens(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        """Mark the tokens a call makes of a map of the input's rank, or carry the mark of tokens on."""
        if name in ("cat", "concat", "concatenate"):
            if isinstance(result, Tensor):
                self._concatenated(args, kwargs, result)
            return
        first = args[0] if args else None
        if not isinstance(first, Tensor):
            return
        mark, cells = self.mark_of(first), self._cells_of(first)
        if self.rank == 1 and name == "conv1d" and isinstance(result, Tensor) and result.dim() == 3:
            # a signal's convolution: its positions are a grid of the signal, channels first (tokens on axis 2)
            self._mark(result, TokenMark(2, (result.shape[2],)) if self._grid_fits((result.shape[2],)) else None)
            return
        carried = self._carried(name, args, kwargs, result, mark) if mark is not None else None
        if carried is not None:
            self._mark(result, carried)
        elif (mark is not None and (name in _MOVES or name in _POOLS)) or cells is not None:
            self._move(func, name, args, kwargs, result, first, cells or Cells(mark.cells(first), mark.grid))
        flattened = name in _RESHAPES and first.dim() == self.rank + 2 and isinstance(result, Tensor)
        if flattened and 2 < result.dim() < first.dim() and self.mark_of(result) is None:
            # a map's grid flattened, or a view of tokens sliced (LeViT)
            self._mark(result, self._flattened(tuple(first.shape), tuple(result.shape)))

    def _carried(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any, mark: TokenMark
    ) -> TokenMark | None:
        """The mark of a call's result, from its first input's mark, where the token axis stays whole."""
        first = args[0]
        if not isinstance(result, Tensor):
            return None
        if name == "getitem":
            return _sliced(mark, args[1] if len(args) > 1 else None)
        if name in _PERMUTES:
            order = _permutation(name, args, kwargs, first.dim())
            return mark.moved(order) if order is not None else None
        if name in _RESHAPES:  # axes split or merged after the token axis keep it
            keeps = result.dim() > mark.axis and result.shape[: mark.axis + 1] == first.shape[: mark.axis + 1]
            return mark if keeps else None
        if name in _PRODUCTS and mark.axis == first.dim() - 2:  # attention's rows are its queries' tokens
            return replace(mark, axis=result.dim() - 2)
        if result.shape == first.shape or (name in _LAST_AXIS and mark.axis < first.dim() - 1):
            return mark
        return None

    def _cells_of(self, value: Any) -> Cells | None:
        known = self._cells.get(id(value)) if isinstance(value, Tensor) else None
        return known[1] if known is not None and known[0]() is value else None

    def _move(
        self,
        func: Any,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: Any,
        first: Tensor,
        cells: Cells,
    ) -> None:
        """Follow the cells of tokens moved about (see the module's docstring) into the call's result."""
        moved: Any = None
        if name in _MOVES:
            replay = {"view": Tensor.reshape, "view_as": Tensor.reshape_as}.get(name, func)  # cells may not be viewable
            try:
                moved = replay(cells.cells, *args[1:], **kwargs)
            except (RuntimeError, TypeError, ValueError, IndexError):  # a view as another dtype, say
                moved = None
        elif (name in _POOLS and not isinstance(result, Tensor)) or name in _REDUCTIONS:
            dims = _dims(args, kwargs, "dim")
            if dims is not None:
                positional = (
                    args[2] if len(args) > 2 and name in ("mean", "sum", "amax", "amin", "max", "min") else False
                )
                keepdim = bool(kwargs.get("keepdim", positional))
                pooled = cells.pooled(tuple(d % first.dim() for d in dims), keepdim)
                result = result if isinstance(result, Tensor) else result[0]  # max's values, not its indices
                moved, cells = (pooled.cells, pooled) if pooled is not None else (None, cells)
        elif isinstance(result, Tensor) and result.shape == first.shape:
            moved = cells.cells
        elif isinstance(result, Tensor) and (name in _LAST_AXIS or name in _PRODUCTS):
            rows = cells.cells[..., :1]  # each row's cell, when the row is one cell
            if bool((cells.cells == rows).all()) and result.dim() == rows.dim():
                moved = rows.expand(result.shape) if rows.shape[:-1] == result.shape[:-1] else None
        pairs = (
            zip(result, moved)
            if isinstance(moved, (list, tuple)) and isinstance(result, (list, tuple))
            else [(result, moved)]
        )
        for tensor, where in pairs:
            if isinstance(tensor, Tensor) and isinstance(where, Tensor) and where.shape == tensor.shape:
                found = Cells(where, cells.grid)
                mark = found.as_mark()
                if mark is not None and self._grid_fits(mark.grid):
                    self._mark(tensor, mark)
                else:
                    self._cells[id(tensor)] = (weakref.ref(tensor), found)

    def _flattened(self, before: tuple[int, ...], after: tuple[int, ...]) -> TokenMark | None:
        """The mark of tokens flattened from a map of the input's rank: (N, C, *grid) to (..., C, cells) or
        (N, *grid, C) to (..., cells, C), the axes in front holding N, where the grid is a grid of the input
        (an image's (h, w), a clip's (t, h, w))."""
        batch, first, last = before[0], before[2:], before[1:-1]
        ahead = math.prod(after[:-2])
        if after[-2:] == (before[1], math.prod(first)) and ahead == batch and self._grid_fits(first):
            return TokenMark(len(after) - 1, first)
        if after[-2:] == (math.prod(last), before[-1]) and ahead == batch and self._grid_fits(last):
            return TokenMark(len(after) - 2, last)
        return None

    def _concatenated(self, args: tuple[Any, ...], kwargs: dict[str, Any], result: Tensor) -> None:
        """Tokens concatenated after others along their token axis: the others become their prefix."""
        parts = args[0] if args else kwargs.get("tensors", ())
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if not isinstance(parts, (list, tuple)) or not parts or not isinstance(dim, int):
            return
        mark = self.mark_of(parts[-1])
        if mark is None and len(parts) > 1:  # registers after the patches: no grid of the image then
            return
        if any(self.mark_of(part) is not None for part in parts[:-1]):  # the levels of a pyramid, one after another
            return
        if mark is not None and dim % result.dim() == mark.axis:
            before = sum(part.shape[mark.axis] for part in parts[:-1])
            self._mark(result, replace(mark, prefix=mark.prefix + before))

    def _add(self, tensor: Tensor, entries: list[tuple[str, list[int]]]) -> None:
        known = self._watched.get(id(tensor))
        if known is not None and known[0] is tensor:
            known[1].extend(entries)
        else:
            self._watched[id(tensor)] = (tensor, list(entries))

    def _inputs(self, args: tuple[Any, ...]) -> Iterator[tuple[int, Tensor, list[tuple[str, list[int]]]]]:
        """The watched tensors among the call's arguments, with their position."""
        for position, arg in enumerate(args):
            for value in arg if isinstance(arg, (list, tuple)) else (arg,):
                known = self._watched.get(id(value)) if isinstance(value, Tensor) else None
                if known is not None and known[0] is value:
                    yield position, value, known[1]

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "").strip("_")
        if self._outputs:
            self._note_reads(name, args, kwargs, result)
        self._attention(name, args, kwargs)
        self._tokens(func, name, args, kwargs, result)
        if self._watched:
            self._follow(name, args, kwargs, result)
        return result

    def _note_reads(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        """Note the layers' outputs the call reads; a call that only reshapes or resamples one (a flatten of
        pooled logits, logits upsampled to the input) passes its layers on to its result instead. A call without
        parameters, run by a module without them (or the model's own forward), makes its result of its inputs'
        layers (:meth:`returned`)."""
        values = [
            value
            for arg in (*args, *kwargs.values())
            for value in (arg if isinstance(arg, (list, tuple)) else (arg,))
            if isinstance(value, Tensor)
        ]
        if (not self.stack or self.stack[-1] in self.free_modules) and not any(
            isinstance(value, nn.Parameter) for value in values
        ):
            made = set()
            for value in values:
                for store in (self._outputs, self._derived):
                    known = store.get(id(value))
                    if known is not None and known[0]() is value:
                        made.update(known[1])
            for tensor in result if isinstance(result, (list, tuple)) else (result,):
                if made and isinstance(tensor, Tensor):
                    self._derived[id(tensor)] = (weakref.ref(tensor), made)
        for position, arg in enumerate((*args, *kwargs.values())):
            for value in arg if isinstance(arg, (list, tuple)) else (arg,):
                known = self._outputs.get(id(value)) if isinstance(value, Tensor) else None
                if known is None or known[0]() is not value:
                    continue
                if position == 0 and name in _PASSING and isinstance(result, Tensor):
                    if result is not value:  # contiguous() and to() may return the tensor itself
                        for layer in list(known[1]):
                            self.produced(layer, result)
                else:
                    self.read.update(known[1])

    def _attention(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Note the attention computed by the innermost running module (the model itself is never one)."""
        if self.stack and self.stack[-1] and attention_call(name, args, kwargs):
            self.observed.attention_modules.add(self.stack[-1])

    def _follow(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        """Decide the feature axis of the watched outputs this call consumes, or watch what it makes of them."""
        for position, tensor, entries in list(self._inputs(args)):
            ndim = tensor.dim()
            axis = _feature_axis(name, args, kwargs, ndim) if position == 0 else None
            if axis is not None:
                for layer, axes in entries:
                    self.observed.feature_axes.setdefault(layer, axes[axis])
                self._watched.pop(id(tensor), None)
            elif not isinstance(result, Tensor) or name in _NEUTRAL:
                continue
            elif name in _PERMUTES and position == 0:
                order = _permutation(name, args, kwargs, ndim)
                if order is not None:
                    self._add(result, [(layer, [axes[i] for i in order]) for layer, axes in entries])
            elif result.shape == tensor.shape and result is not tensor:  # element-wise: the same axes
                self._add(result, [(layer, list(axes)) for layer, axes in entries])
