"""Layer outputs as maps of the input (N, C, *spatial): correctly, or not at all.

A CAM needs a layer's output as channels over a grid of the input: an image's (h, w), a volume's or a clip's
(d, h, w), a signal's (l,), of the input's rank. Three layouts are read:

- channels first, (N, C, *grid): convolutional networks, in every rank;
- channels last, (N, *grid, C): Swin, ConvNeXt's inner layers, Video Swin; permuted (images and volumes);
- tokens, (N, T, C): vision transformers (ViT, DeiT, BEiT, EVA, CLIP's vision tower,
  register-token ViTs); the prefix tokens (class, distillation, registers) are dropped and the
  patch tokens laid out on the grid of the model's patch embedding, recorded in the same
  forward pass: the grid comes from the model and the input, never from T alone.

Which one an output of the input's rank is follows from the model, not from its sizes: the first operation that
consumes the output tells its feature axis (a convolution or batch norm reads axis 1, a linear layer or
layer norm the last axis; see :mod:`explain.core.op_trace`). The reading must then fit the input the
layers see (:func:`grid_fits`).
Without such an operation (the model's last output, say), the sizes decide only when one reading alone
fits. Attention is never a map: neither an output of a module inside an attention module (one whose
forward computes a softmax over tokens or a scaled dot-product attention), nor probabilities (a
non-negative tensor whose last axis sums to one). Anything else is an error that names ``reshape=``, a
callable the caller passes to lay the output out itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..errors import LayerError
from .hooks import Hooks, layer_entry
from .maps import covered
from .op_trace import Observed, TokenMark

Reshape = Callable[[Tensor], Tensor]
MAX_PREFIX_TOKENS = 16  # class + distillation + registers: 10 in the largest models known here


@dataclass(frozen=True)
class Geometry:
    """What the layers of one forward pass see.

    Attributes:
        size: The spatial size of the input the network sees, (L,), (H, W) or (D, H, W) (for a detector,
            its padded canvas).
        grid: The grid of the model's patch embedding in this pass, one side per spatial axis of the input, or
            None without one.
    """

    size: tuple[int, ...]
    grid: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Layout:
    """How a layer's output becomes a map (N, C, h, w).

    Attributes:
        kind: ``"channels_first"``, ``"channels_last"``, ``"tokens"``, ``"reshape"`` (the caller's), or
            ``"attention"`` (attention probabilities, kept as recorded for the rollout methods).
        prefix: Tokens before the patch tokens (class, distillation, registers), for ``"tokens"``.
        grid: The patch grid (h, w), for ``"tokens"``.
        order: The grid cell of each patch token, when the tokens are not in row-major order (unrolled
            tokens), for ``"tokens"``.
        reshape: The caller's callable, for ``"reshape"``.
    """

    kind: Literal["channels_first", "channels_last", "tokens", "reshape", "attention"]
    prefix: int = 0
    grid: tuple[int, ...] | None = None
    order: tuple[int, ...] | None = None
    reshape: Reshape | None = None

    def __call__(self, output: Tensor) -> Tensor:
        """The output (or its gradient) as (N, C, h, w)."""
        if self.kind == "channels_last":
            return output.movedim(-1, 1)
        if self.kind == "tokens":
            patches = output[:, self.prefix :]
            if self.order is not None:
                patches = patches.index_select(1, self.tokens_by_cell.to(output.device))
            return patches.transpose(1, 2).reshape(len(output), output.shape[-1], *self.grid)
        if self.kind == "reshape":
            mapped = self.reshape(output)
            if not isinstance(mapped, Tensor) or not 3 <= mapped.dim() <= 5:
                shape = tuple(mapped.shape) if isinstance(mapped, Tensor) else type(mapped).__name__
                raise LayerError(f"reshape= must return a map (N, C, *spatial), returned {shape}")
            return mapped
        return output

    def map_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape (C, *grid) of one image's map from its output's ``shape`` (batch axis left out), as
        :meth:`__call__` lays it out (channels first, channels last or tokens).

        Raises:
            LayerError: The layout is the caller's ``reshape`` or attention, whose shape only a call tells.
        """
        shape = tuple(shape)
        if self.kind == "channels_first":
            return shape
        if self.kind == "channels_last":
            return shape[-1], *shape[:-1]
        if self.kind == "tokens":
            return shape[-1], *self.grid
        raise LayerError(f"a layer laid out by {self.describe()} tells its map's shape only when called")

    def placed(self, output: Tensor, maps: Tensor) -> Tensor:
        """The layout undone: ``maps`` (N, C, *grid) laid out as the layer's ``output`` is, which gives what the
        maps leave out (a transformer's prefix tokens, kept as they are).

        Raises:
            LayerError: The layout is the caller's ``reshape`` or attention, which cannot be undone.
        """
        if self.kind == "channels_first":
            return maps
        if self.kind == "channels_last":
            return maps.movedim(1, -1)
        if self.kind == "tokens":
            patches = maps.flatten(2).transpose(1, 2)  # (N, cells, C), the cells row-major
            if self.order is not None:
                patches = patches.index_select(1, torch.tensor(self.order, device=maps.device))
            prefix = output[:, : self.prefix]  # one image's, for copies of it that share its forward: expanded
            return torch.cat([prefix.expand(len(patches), *prefix.shape[1:]), patches], dim=1)
        raise LayerError(f"a layer laid out by {self.describe()} cannot be given maps in its place")

    @cached_property
    def tokens_by_cell(self) -> Tensor:
        """For unrolled tokens, the patch token in each grid cell, row-major: ``order``'s inverse, made once."""
        tokens = torch.empty(len(self.order), dtype=torch.long)
        tokens[list(self.order)] = torch.arange(len(self.order))
        return tokens

    def describe(self) -> str:
        """The layout in a few words (``--layers``)."""
        if self.kind == "tokens":
            unrolled = ", unrolled" if self.order is not None else ""
            return f"tokens: {self.prefix} prefix, {'x'.join(map(str, self.grid))} patches{unrolled}"
        return self.kind.replace("_", " ")


def grid_fits(grid: Sequence[int], size: Sequence[int]) -> bool:
    """Whether a grid can cover an input of spatial ``size``: as many axes, none larger than the input's, and in
    the image plane (the last two axes) the input's aspect within a cell and 10%. A volume's depth and a clip's
    time, and a signal's length, are only bounded: networks downsample them at rates of their own."""
    if len(grid) != len(size) or not all(1 <= side <= limit for side, limit in zip(grid, size)):
        return False
    if len(grid) < 2:
        return True
    (height, width), (rows, columns) = grid[-2:], size[-2:]
    expected = height * columns / rows
    return abs(width - expected) <= 1 + 0.1 * expected


_MAP = {1: "the signal (N, C, l)", 2: "the image (N, C, h, w)", 3: "the volume or clip (N, C, d, h, w)"}  # by rank
WAY_OUT = (
    "choose another layer (explain --layers lists them), or pass reshape=, a callable from the output to (N, C, h, w)"
)


def find_layout(
    model: nn.Module,
    name: str,
    shape: Sequence[int],
    geometry: Geometry,
    observed: Observed | None = None,
    probabilities: bool = False,
) -> Layout:
    """How the output of layer ``name`` of ``model`` (per-image ``shape``, batch axis left out) becomes a map.

    Args:
        model: The model.
        name: The layer's name.
        shape: Its output's shape without the batch axis.
        geometry: What the pass's layers saw (for a layer whose module says which canvas its map covers, see
            :func:`explain.core.maps.covered`: that canvas).
        observed: What the operations of a traced pass told (feature axes, attention); without it, only
            the sizes speak, and an output that reads both ways is refused.
        probabilities: Whether the output is non-negative and sums to one over its last axis.

    Raises:
        LayerError: The output is attention, no map of the image, or its layout cannot be told; the message
            names ``reshape=``.
    """
    traced = observed is not None
    observed = observed or Observed()
    module_name = layer_entry(name)[0]
    covers = covered(_module(model, module_name))
    if covers is not None:  # a map of a picture of its own: laid out on that one's canvas
        geometry = Geometry(covers.size)
    for outer in (module_name.rsplit(".", depth)[0] for depth in range(1, module_name.count(".") + 1)):
        if outer in observed.attention_modules:
            raise LayerError(
                f"layer {name!r} lies inside the attention module {outer!r}: its outputs are attention weights "
                f"or heads, not a map of the image; {WAY_OUT}"
            )
    shape = tuple(shape)
    if probabilities:
        raise LayerError(f"layer {name!r} outputs attention {shape}, not a map of the image; {WAY_OUT}")
    rank = len(geometry.size)
    if rank == 1 and len(shape) == 2 and name in observed.tokens:  # a 1-D transformer's tokens (L, C), or (1 + L, C)
        return _token_layout(name, shape, geometry, observed.tokens[name])
    if len(shape) == rank + 1:
        return _grid_layout(name, shape, geometry, observed.feature_axes.get(name))
    if len(shape) != 2 or rank == 1:
        raise LayerError(f"layer {name!r} outputs {shape}, not a map of {_MAP[rank]}; {WAY_OUT}")
    if traced:
        return _token_layout(name, shape, geometry, observed.tokens.get(name))
    if geometry.grid is not None and len(geometry.grid) == rank:
        cells = math.prod(geometry.grid)
        if 0 <= shape[0] - cells <= MAX_PREFIX_TOKENS:
            return Layout("tokens", prefix=shape[0] - cells, grid=geometry.grid)
        raise LayerError(
            f"layer {name!r} outputs {shape[0]} tokens, which do not fit the model's "
            f"{'x'.join(map(str, geometry.grid))} patch grid; {WAY_OUT}"
        )
    raise LayerError(f"layer {name!r} outputs {shape}: tokens without a patch embedding to lay them out; {WAY_OUT}")


def _module(model: nn.Module, name: str) -> nn.Module | None:
    """The model's module of that dotted name, or None: looked up in each module's children, as
    ``get_submodule`` does without its checks (called for every layer of a trace)."""
    found: Any = model
    for atom in name.split(".") if name else ():
        found = found._modules.get(atom) if isinstance(found, nn.Module) else None
        if found is None:
            return None
    return found


def _token_layout(name: str, shape: tuple[int, int], geometry: Geometry, mark: TokenMark | None) -> Layout:
    """Tokens laid out on the grid they were flattened from, after their prefix.

    Raises:
        LayerError: The tokens carry no grid of the image (object queries, unrolled tokens), or more tokens
            follow the grid's.
    """
    if mark is None:
        raise LayerError(
            f"layer {name!r} outputs {shape[0]} tokens that the model did not flatten from a grid of the image "
            f"(object queries, say); {WAY_OUT}"
        )
    prefix, grid = mark.prefix, "x".join(map(str, mark.grid))
    if shape[0] != prefix + math.prod(mark.grid) or not grid_fits(mark.grid, geometry.size):
        raise LayerError(
            f"layer {name!r} outputs {shape[0]} tokens, not {prefix} + the {grid} grid they were flattened from; "
            f"{WAY_OUT}"
        )
    return Layout("tokens", prefix=prefix, grid=mark.grid, order=mark.order)


def _grid_layout(name: str, shape: tuple[int, ...], geometry: Geometry, feature_axis: int | None) -> Layout:
    """Channels first or last for a per-image output of one axis more than the input's rank, from the model's
    own feature axis when an operation told it, else from the one reading that fits the input.

    A signal's channels-last output (N, l, C) is refused: nothing but its length would tell its positions from
    tokens with a class token in front (a 1-D transformer's, laid out as tokens when the trace marks them).

    Raises:
        LayerError: The reading the model implies does not fit the input, none fits, or, untold, both do.
    """
    last_axis = len(shape)
    first = grid_fits(shape[1:], geometry.size)
    last = grid_fits(shape[:-1], geometry.size) and len(shape) > 2
    if feature_axis in (1, last_axis):
        told = "first" if feature_axis == 1 else "last"
        if (first, last)[feature_axis == last_axis]:
            return Layout(f"channels_{told}")
        size = "x".join(map(str, geometry.size))
        raise LayerError(
            f"layer {name!r} outputs {shape}, channels {told} as the model reads it, which is no grid of the "
            f"{size} input; {WAY_OUT}"
        )
    if first and last:
        raise LayerError(
            f"layer {name!r} outputs {shape}, which reads as channels first or last, and no operation of the "
            f"model tells which; {WAY_OUT}"
        )
    if first or last:
        return Layout("channels_first" if first else "channels_last")
    raise LayerError(f"layer {name!r} outputs {shape}, not a map of {_MAP[len(geometry.size)]}; {WAY_OUT}")


def patch_embedding(model: nn.Module) -> nn.Module | None:
    """The model's patch embedding: its first convolution (of any rank: a signal's, an image's, a clip's
    tubelets), if that cuts the input into patches (kernel equal to stride, larger than 1)."""
    convolutions = (m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd) and not m.transposed)
    first = next(convolutions, None)
    if first is None or first.kernel_size != first.stride or max(first.stride) < 2:
        return None
    return first


@contextmanager
def grids_recorded(model: nn.Module) -> Iterator[list[tuple[int, ...]]]:
    """For the block, record the grid of the model's patch embedding at each forward, every spatial axis of its
    output ((h, w) for an image, (t, h, w) for a clip); none without one."""
    grids: list[tuple[int, ...]] = []
    embedding = patch_embedding(model)

    def record(module: nn.Module, inputs: Any, output: Tensor) -> None:
        grids.append(tuple(output.shape[2:]))

    with Hooks() as hooks:
        if embedding is not None:
            hooks.forward(embedding, record)
        yield grids
