"""Layer outputs as image maps (N, C, h, w): correctly, or not at all.

A CAM needs a layer's output as channels over a grid of the image. Three layouts are read:

- channels first, (N, C, h, w): convolutional networks;
- channels last, (N, h, w, C): Swin, ConvNeXt's inner layers, anything after a ``LayerNorm`` or
  ``Linear`` over the last axis; permuted;
- tokens, (N, T, C): vision transformers (ViT, DeiT, BEiT, EVA, CLIP's vision tower,
  register-token ViTs); the prefix tokens (class, distillation, registers) are dropped and the
  patch tokens laid out on the grid of the model's patch embedding, recorded in the same
  forward pass: the grid comes from the model and the input, never from T alone.

Which one a 4-D output is follows from its shape against the image the layers see: the
grid's aspect must be the image's (a grid fits when its width is the image's aspect times
its height, within a cell and 10%, and neither side exceeds the image's). When both readings
fit (C close to w), the module decides: a last convolution or batch norm means channels
first, a last ``Linear`` or ``LayerNorm`` channels last. Outputs of modules inside an
attention module (attention weights, q/k/v heads) are never maps. Anything else is an error
that names ``reshape=``, a callable the caller passes to lay the output out itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor, nn

from ..errors import LayerError
from .hooks import Hooks, layer_entry

Reshape = Callable[[Tensor], Tensor]
MAX_PREFIX_TOKENS = 16  # class + distillation + registers: 10 in the largest models known here

_CHANNELS_FIRST = (nn.Conv1d, nn.Conv2d, nn.ConvTranspose2d, nn.BatchNorm2d, nn.GroupNorm, nn.InstanceNorm2d)
_CHANNELS_LAST = (nn.Linear, nn.LayerNorm)


@dataclass(frozen=True)
class Geometry:
    """What the layers of one forward pass see.

    Attributes:
        size: The (H, W) of the picture the network sees (a detector's padded canvas, else the input).
        grid: The (h, w) grid of the model's patch embedding in this pass, or None without one.
    """

    size: tuple[int, int]
    grid: tuple[int, int] | None = None


@dataclass(frozen=True)
class Layout:
    """How a layer's output becomes a map (N, C, h, w).

    Attributes:
        kind: ``"channels_first"``, ``"channels_last"``, ``"tokens"``, ``"reshape"`` (the caller's), or
            ``"attention"`` (attention probabilities, kept as recorded for the rollout methods).
        prefix: Tokens before the patch tokens (class, distillation, registers), for ``"tokens"``.
        grid: The patch grid (h, w), for ``"tokens"``.
        reshape: The caller's callable, for ``"reshape"``.
    """

    kind: Literal["channels_first", "channels_last", "tokens", "reshape", "attention"]
    prefix: int = 0
    grid: tuple[int, int] | None = None
    reshape: Reshape | None = None

    def __call__(self, output: Tensor) -> Tensor:
        """The output (or its gradient) as (N, C, h, w)."""
        if self.kind == "channels_last":
            return output.permute(0, 3, 1, 2)
        if self.kind == "tokens":
            patches = output[:, self.prefix :]
            return patches.transpose(1, 2).reshape(len(output), output.shape[-1], *self.grid)
        if self.kind == "reshape":
            mapped = self.reshape(output)
            if not isinstance(mapped, Tensor) or mapped.dim() != 4:
                shape = tuple(mapped.shape) if isinstance(mapped, Tensor) else type(mapped).__name__
                raise LayerError(f"reshape= must return a (N, C, h, w) map, returned {shape}")
            return mapped
        return output

    def describe(self) -> str:
        """The layout in a few words (``--layers``)."""
        if self.kind == "tokens":
            return f"tokens: {self.prefix} prefix, {self.grid[0]}x{self.grid[1]} patches"
        return self.kind.replace("_", " ")


def is_attention(module: nn.Module) -> bool:
    """Whether a module is an attention module: ``nn.MultiheadAttention``, or a class named ``...Attention...``."""
    return isinstance(module, nn.MultiheadAttention) or "Attention" in type(module).__name__


def _fits(height: int, width: int, size: Sequence[int]) -> bool:
    """Whether an (h, w) grid can cover a picture of ``size``: same aspect within a cell and 10%, not larger."""
    expected = height * size[1] / size[0]
    return 1 <= height <= size[0] and 1 <= width <= size[1] and abs(width - expected) <= 1 + 0.1 * expected


def _channels_last_module(module: nn.Module) -> bool | None:
    """Whether the module's last layer of a telling kind works over the last axis (True), over channels
    first (False), or the module has none (None)."""
    kinds = [m for m in module.modules() if isinstance(m, _CHANNELS_FIRST + _CHANNELS_LAST)]
    return None if not kinds else isinstance(kinds[-1], _CHANNELS_LAST)


WAY_OUT = (
    "choose another layer (explain --layers lists them), or pass reshape=, a callable from the output to (N, C, h, w)"
)


def find_layout(model: nn.Module, name: str, shape: Sequence[int], geometry: Geometry) -> Layout:
    """How the output of layer ``name`` of ``model`` (per-image ``shape``, batch axis left out) becomes a map.

    Raises:
        LayerError: The layer lies inside an attention module, its output is no map of the
            image, or its layout cannot be told; the message names ``reshape=``.
    """
    module_name = layer_entry(name)[0]
    for outer in (module_name.rsplit(".", depth)[0] for depth in range(1, module_name.count(".") + 1)):
        if is_attention(model.get_submodule(outer)):
            raise LayerError(
                f"layer {name!r} lies inside the attention module {outer!r}: its outputs are attention weights "
                f"or heads, not a map of the image; {WAY_OUT}"
            )
    shape = tuple(shape)
    if len(shape) == 3:
        first, last = _fits(shape[1], shape[2], geometry.size), _fits(shape[0], shape[1], geometry.size)
        if first and last:
            telling = _channels_last_module(model.get_submodule(module_name))
            if telling is None:
                raise LayerError(f"layer {name!r} outputs {shape}, which reads as channels first or last; {WAY_OUT}")
            first = not telling
        if first or last:
            return Layout("channels_first" if first else "channels_last")
    if len(shape) == 2 and geometry.grid is not None:
        cells = geometry.grid[0] * geometry.grid[1]
        if 0 <= shape[0] - cells <= MAX_PREFIX_TOKENS:
            return Layout("tokens", prefix=shape[0] - cells, grid=geometry.grid)
        raise LayerError(
            f"layer {name!r} outputs {shape[0]} tokens, which do not fit the model's "
            f"{geometry.grid[0]}x{geometry.grid[1]} patch grid; {WAY_OUT}"
        )
    if len(shape) == 2:
        raise LayerError(f"layer {name!r} outputs {shape}: tokens without a patch embedding to lay them out; {WAY_OUT}")
    raise LayerError(f"layer {name!r} outputs {shape}, not a map of the image (N, C, h, w); {WAY_OUT}")


def patch_embedding(model: nn.Module) -> nn.Module | None:
    """The model's patch embedding: its first convolution, if that cuts the image into patches
    (kernel equal to stride, larger than 1)."""
    first = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if first is None or first.kernel_size != first.stride or max(first.stride) < 2:
        return None
    return first


@contextmanager
def grids_recorded(model: nn.Module) -> Iterator[list[tuple[int, int]]]:
    """For the block, record the (h, w) grid of the model's patch embedding at each forward (none without one)."""
    grids: list[tuple[int, int]] = []
    embedding = patch_embedding(model)

    def record(module: nn.Module, inputs: Any, output: Tensor) -> None:
        grids.append(tuple(output.shape[-2:]))

    with Hooks() as hooks:
        if embedding is not None:
            hooks.forward(embedding, record)
        yield grids
