"""Images read as tiles beside a base image: LLaVA-NeXt's "any resolution" input and Idefics3's split images
(SmolVLM's too).

The processor resizes the image, cuts it into square tiles of side s (row by row) and adds a base image: the whole
image squeezed into one square (``pixel_values`` (1, tiles + 1, 3, s, s)).

- **LLaVA-NeXt** (:class:`AnyResolution`) resizes the image into the best of its resolutions keeping its aspect,
  pads it to that canvas, and puts the base tile first; ``image_sizes`` gives the image's size.
- **Idefics3** (:class:`SplitImage`) resizes the image to whole tiles, and puts the base image last; its tiles'
  rows and columns are the image processor's (``return_row_col_info=True``), never guessed from their count.

The picture explain explains is the image's part of the canvas: the tiles put back together, the padding cut off.
Inside the forward it is padded again (bit for bit) and cut into the tiles; the base image is the processor's,
held fixed. The projector's tokens pass through two layers of explain's own: ``reading.tiles``, every tile's tokens
where the tile came from on the canvas, and ``reading.base``, the base's tokens on its square. Each layer module
says which canvas its map covers (:func:`explain.core.maps.covered`): the tiles' map is cut to the image, the
base's stretched back over it, and the two are fused.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..core.hooks import Hooks
from ..core.maps import Canvas
from ..errors import ExplainError
from .image_readings import PROJECTOR, VisionTokens, count_error, image_token_id, submodule

Box = tuple[int, int, int, int]  # top, left, height, width on the canvas


class TileTokens(nn.Module):
    """The tokens of a grid of square tiles as one map (N, C, rows * g, columns * g), each tile where it lies.

    Args:
        tiles: The tiles' (rows, columns), row by row.
        side: The tokens on a tile's side (g).
        covers: The canvas the map covers (see :func:`explain.core.maps.covered`).
    """

    def __init__(self, tiles: tuple[int, int], side: int, covers: Canvas) -> None:
        super().__init__()
        self.tiles, self.side, self.covers = tiles, side, covers

    def forward(self, tokens: Tensor) -> Tensor:
        """The map of tokens (N, rows * columns, g * g, C), each tile's row by row."""
        (rows, columns), g = self.tiles, self.side
        n, channels = len(tokens), tokens.shape[-1]
        cells = tokens.reshape(n, rows, columns, g, g, channels).permute(0, 5, 1, 3, 2, 4)
        return cells.reshape(n, channels, rows * g, columns * g)

    def tokens(self, mapped: Tensor) -> Tensor:
        """The tokens (N, rows * columns, g * g, C) of a map."""
        (rows, columns), g = self.tiles, self.side
        n, channels = mapped.shape[:2]
        cells = mapped.reshape(n, channels, rows, g, columns, g).permute(0, 2, 4, 3, 5, 1)
        return cells.reshape(n, rows * columns, g * g, channels)


class Tiles(nn.Module):
    """Tiles of an image on a canvas, and a base image (see the module's docstring): what the tiled models share.

    Args:
        projector: The module whose output is each tile's tokens, (tiles + 1, g * g, C) per image.
        pixel_values: The processor's tiles and base image, (1, tiles + 1, 3, s, s).
        grid: The tiles' (rows, columns).
        tokens: The tokens on a tile's side (g).
        base: Where the base image is among the tiles: 0 (first), -1 (last), or None (the image is one tile).
        placed: Where the image lies on the canvas, and the padding's value per channel (1, 3, 1, 1).
    """

    def __init__(
        self,
        projector: nn.Module,
        pixel_values: Tensor,
        grid: tuple[int, int],
        tokens: int,
        base: int | None,
        placed: tuple[Box, Tensor],
    ) -> None:
        super().__init__()
        (rows, columns), side = grid, pixel_values.shape[-1]
        self.projector, self.side, self.base_at = projector, side, base
        self.box, self.pad = placed
        top, left, height, width = self.box
        canvas = _canvas(_tiles_of(pixel_values, grid, base), grid)
        self.register_buffer("image", canvas[..., top : top + height, left : left + width].detach(), persistent=False)
        self.register_buffer("base_image", None if base is None else pixel_values[:, base].detach(), persistent=False)
        covers = Canvas((rows * side, columns * side), (height, width), (top, left))
        self.tiles = TileTokens(grid, tokens, covers)
        self.base = VisionTokens((tokens, tokens), torch.arange(tokens * tokens))
        self.base.covers = Canvas((tokens, tokens), (tokens, tokens))  # the whole image, squeezed into a square

    @property
    def levels(self) -> tuple[str, ...]:
        """The layers of the maps, fused (as the wrapper names them): the tiles', and the base's where it has one."""
        return ("reading.tiles",) if self.base_at is None else ("reading.tiles", "reading.base")

    def picture(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """The picture (1, 3, h, w): the image's part of the tiles' canvas."""
        return self.image

    def more_inputs(self, images: int, device: torch.device) -> dict[str, Tensor]:
        """The model's image inputs besides the tiles, for ``images`` pictures: none here."""
        return {}

    def model_inputs(self, picture: Tensor) -> dict[str, Tensor]:
        """The model's image inputs for pictures (N, 3, h, w): the canvas's tiles and the base image.

        Raises:
            ExplainError: Pictures of another size than the image's on the canvas.
        """
        top, left, height, width = self.box
        (rows, columns), s, n = self.tiles.tiles, self.side, len(picture)
        if tuple(picture.shape[2:]) != (height, width):
            raise ExplainError(f"pictures {tuple(picture.shape)} are not of the image's {height}x{width} on its tiles")
        canvas = self.pad.to(picture).expand(n, -1, rows * s, columns * s).clone()
        canvas[..., top : top + height, left : left + width] = picture  # the padding's values kept bit for bit
        tiles = canvas.reshape(n, -1, rows, s, columns, s).permute(0, 2, 4, 1, 3, 5)
        parts = [tiles.reshape(n, rows * columns, -1, s, s)]
        if self.base_at is not None:
            base = self.base_image.to(picture).expand(n, *self.base_image.shape[1:])[:, None]
            parts.insert(0 if self.base_at == 0 else 1, base)
        return {"pixel_values": torch.cat(parts, dim=1), **self.more_inputs(n, picture.device)}

    def watch(self, hooks: Hooks, images: int) -> None:
        """In the forward of ``images`` pictures, pass the projector's tokens through the tiles' and the base's maps
        (:attr:`tiles`, :attr:`base`)."""

        def as_maps(module: nn.Module, inputs: Any, projected: Tensor) -> Tensor:
            g, count = self.tiles.side, math.prod(self.tiles.tiles)
            if projected.shape[1] != g * g:
                raise ExplainError(
                    f"the projector makes {projected.shape[1]} tokens per tile, not the {g}x{g} of a tile's patches: "
                    "explain reads tiles without a class token (LLaVA-NeXt's vision_feature_select_strategy 'default')"
                )
            per_image = projected.reshape(images, -1, *projected.shape[1:])
            start = 1 if self.base_at == 0 else 0
            parts = [self.tiles.tokens(self.tiles(per_image[:, start : start + count]))]
            if self.base_at is not None:
                base = self.base.tokens(self.base(per_image[:, self.base_at].reshape(-1, projected.shape[-1])))
                parts.insert(0 if self.base_at == 0 else 1, base.reshape(images, 1, g * g, -1))
            return torch.cat(parts, dim=1).reshape(projected.shape)

        hooks.forward(self.projector, as_maps)


def _tiles_of(pixel_values: Tensor, grid: tuple[int, int], base: int | None) -> Tensor:
    """The tiles (rows * columns, 3, s, s) of the processor's ``pixel_values``, the base image left out.

    Raises:
        ExplainError: Not one image's tiles and base image of that grid.
    """
    count = math.prod(grid) + (base is not None)
    if pixel_values.dim() != 5 or len(pixel_values) != 1 or pixel_values.shape[1] < count:
        raise ExplainError(
            f"pixel_values {tuple(pixel_values.shape)} are not the {grid[0]}x{grid[1]} tiles and the base image the "
            "model reads for this image: pass the processor's output for one image"
        )
    tiles = pixel_values[0, :count]
    return tiles[1:] if base == 0 else tiles[: math.prod(grid)]


def _canvas(tiles: Tensor, grid: tuple[int, int]) -> Tensor:
    """The canvas (1, 3, rows * s, columns * s) that the tiles (row by row) were cut from."""
    (rows, columns), side = grid, tiles.shape[-1]
    canvas = tiles.reshape(rows, columns, -1, side, side).permute(2, 0, 3, 1, 4)
    return canvas.reshape(1, -1, rows * side, columns * side)


class AnyResolution(Tiles):
    """LLaVA-NeXt's tiles on a padded canvas, the base tile first (see the module's docstring).

    Args:
        model: The model: its config (the tiles' resolutions, the vision tower's patch size), its projector, and its
            rules for the tiles' grid and the features it reads (``get_anyres_image_grid_shape``,
            ``pack_image_features``).
        inputs: The processor's output for one image: ``pixel_values`` (1, 1 + tiles, 3, s, s), ``image_sizes``.
        image_tokens: The image tokens of the text.

    Raises:
        ExplainError: The tiles are not the model's grid for the image, their padding is not where the processor
            puts it, or the text's image tokens are not as many as the features the model reads.
    """

    inputs = ("pixel_values", "image_sizes", "batch_num_images")  # the last: one image per picture, as by default

    def __init__(self, model: nn.Module, inputs: Mapping[str, Tensor], image_tokens: int) -> None:
        projector = submodule(model, PROJECTOR, "the tiles' tokens (LLaVA-NeXt and models built as it is)")
        pixel_values, sizes = inputs["pixel_values"], inputs["image_sizes"].reshape(1, 2).cpu()
        side = pixel_values.shape[-1]
        grid = _tile_grid(model, sizes[0], side)
        canvas = _canvas(_tiles_of(pixel_values, grid, 0), grid)
        g = side // model.config.vision_config.patch_size
        super().__init__(projector, pixel_values, grid, g, 0, _image_on(canvas, [int(v) for v in sizes[0]]))
        self.image_sizes = sizes
        _check_count(model, pixel_values[0, : 1 + math.prod(grid)], sizes, g, image_tokens)

    def more_inputs(self, images: int, device: torch.device) -> dict[str, Tensor]:
        """The image's size, for ``images`` pictures."""
        return {"image_sizes": self.image_sizes.to(device).expand(images, 2)}


def _tile_grid(model: nn.Module, image_size: Tensor, side: int) -> tuple[int, int]:
    """The (rows, columns) of tiles the model reads for an image of ``image_size`` (H, W), by its own rule.

    Raises:
        ExplainError: The model has no such rule.
    """
    rule = getattr(sys.modules.get(type(model).__module__), "get_anyres_image_grid_shape", None)
    pinpoints = getattr(model.config, "image_grid_pinpoints", None)
    if rule is None or pinpoints is None:
        raise ExplainError(
            f"{type(model).__name__} has no rule for its tiles' grid (get_anyres_image_grid_shape and "
            "image_grid_pinpoints): explain reads tiles of LLaVA-NeXt and models built as it is"
        )
    rows, columns = rule(image_size.tolist(), pinpoints, side)
    return int(rows), int(columns)


def _image_on(canvas: Tensor, size: list[int]) -> tuple[Box, Tensor]:
    """Where LLaVA-NeXt's processor put the image (H, W) on the tiles' canvas (1, 3, Hc, Wc): resized to fit, its
    aspect kept, centred; and the padding's value per channel (1, 3, 1, 1).

    Raises:
        ExplainError: The canvas is not padded so around the image.
    """
    (height, width), (rows, columns) = size, canvas.shape[2:]
    if columns / width < rows / height:
        box = (min(math.ceil(height * columns / width), rows), columns)
    else:
        box = (rows, min(math.ceil(width * rows / height), columns))
    top, left = (rows - box[0]) // 2, (columns - box[1]) // 2
    outside = torch.ones(rows, columns, dtype=torch.bool)
    outside[top : top + box[0], left : left + box[1]] = False
    padding = canvas[0][:, outside]
    pad = padding[:, :1] if padding.numel() else canvas.new_zeros(canvas.shape[1], 1)
    if not torch.equal(padding, pad.expand_as(padding)):
        raise ExplainError(
            f"the tiles' canvas is not padded around the {height}x{width} image where the processor puts it: pass "
            "the processor's output for this image"
        )
    return (top, left, *box), pad.reshape(1, -1, 1, 1)


def _check_count(model: nn.Module, tiles: Tensor, sizes: Tensor, side: int, image_tokens: int) -> None:
    """The features LLaVA-NeXt reads of the tiles (its own ``pack_image_features``: the base, then the tiles'
    tokens with their padding cut and a token closing each row) must be the text's image tokens, one for one.

    Raises:
        ExplainError: They are not, or the model has no such rule.
    """
    owner = next((m for m in (getattr(model, "model", None), model) if hasattr(m, "pack_image_features")), None)
    if owner is None:
        raise ExplainError(f"{type(model).__name__} has no pack_image_features: explain reads its tiles' count there")
    holders = (owner, getattr(model, "model", None))
    newline = next((m.image_newline for m in holders if hasattr(m, "image_newline")), None)
    given = {"image_features": [tiles.new_zeros(len(tiles), side * side, 1)], "image_sizes": sizes,
             "vision_feature_select_strategy": "default", "image_newline": None if newline is None else newline[:1]}
    accepted = inspect.signature(owner.pack_image_features).parameters  # LLaVA-OneVision's differ from NeXt's
    with torch.no_grad():
        packed = owner.pack_image_features(**{name: value for name, value in given.items() if name in accepted})
    made = int(packed[1][0]) if isinstance(packed, tuple) else len(packed[0])
    if made != image_tokens:
        raise count_error(made, image_tokens, image_token_id(model))


CONNECTOR = "connector"  # Idefics3's: the tiles' tokens, shuffled into fewer, as the language model reads them
ROWS_AND_COLUMNS = ("rows", "cols")  # what the image processor tells explain of a split image, not the model


class SplitImage(Tiles):
    """Idefics3's split image, the base image last (see the module's docstring).

    Args:
        model: The model: its config (the vision tower's patch size, the connector's ``scale_factor``) and its
            ``connector``.
        inputs: The processor's output for one image: ``pixel_values`` (1, tiles + 1, 3, s, s), and
            ``pixel_attention_mask``; with ``rows`` and ``cols`` from the image processor
            (``return_row_col_info=True``) where the image was split.
        image_tokens: The image tokens of the text.

    Raises:
        ExplainError: The rows and columns are missing where the image was split, the tiles are not theirs, some
            of the tiles' pixels are masked, or the text's image tokens are not as many as the tiles' tokens.
    """

    inputs = ("pixel_values", "pixel_attention_mask", *ROWS_AND_COLUMNS)

    def __init__(self, model: nn.Module, inputs: Mapping[str, Tensor], image_tokens: int) -> None:
        projector = submodule(model, CONNECTOR, "the tiles' tokens (Idefics3 and models built as it is)")
        pixel_values, mask = inputs["pixel_values"], inputs.get("pixel_attention_mask")
        grid = _split_grid(inputs, pixel_values.shape[1])
        base = None if grid == (1, 1) and pixel_values.shape[1] == 1 else -1
        side = pixel_values.shape[-1]
        g = side // model.config.vision_config.patch_size // model.config.scale_factor
        count = math.prod(grid) + (base is not None)
        if mask is not None and not bool(mask[:, :count].all()):
            raise ExplainError("pixel_attention_mask masks pixels of the tiles: explain one image, unpadded")
        if count * g * g != image_tokens:
            raise count_error(count * g * g, image_tokens, image_token_id(model))
        nothing = pixel_values.new_zeros(1, pixel_values.shape[2], 1, 1)  # no padding
        super().__init__(projector, pixel_values, grid, g, base, ((0, 0, grid[0] * side, grid[1] * side), nothing))
        self.count = count

    def more_inputs(self, images: int, device: torch.device) -> dict[str, Tensor]:
        """Every pixel of every tile unmasked, for ``images`` pictures."""
        return {"pixel_attention_mask": torch.ones(images, self.count, self.side, self.side, dtype=torch.bool,
                                                   device=device)}  # fmt: skip


def _split_grid(inputs: Mapping[str, Any], parts: int) -> tuple[int, int]:
    """The (rows, columns) of an Idefics3 image's tiles: (1, 1) where it is one squeezed image.

    Raises:
        ExplainError: The image was split, and the inputs do not say into how many rows and columns.
    """
    if parts == 1:
        return 1, 1
    if "rows" not in inputs or "cols" not in inputs:
        raise ExplainError(
            f"the image is split into {parts - 1} tiles, and the inputs do not say into how many rows and columns: "
            "add the image processor's rows and cols (processor.image_processor(images, return_row_col_info=True))"
        )
    rows, columns = (int(torch.as_tensor(inputs[key]).reshape(-1)[0]) for key in ("rows", "cols"))
    if rows * columns != parts - 1:
        raise ExplainError(f"rows {rows} and cols {columns} are not the image's {parts - 1} tiles")
    return rows, columns


class CrossTiles(nn.Module):
    """Mllama's tiles, which the language model reads by cross-attention, not as tokens of the text.

    The processor resizes the image, pads it onto a canvas of square tiles of side s (``aspect_ratio_ids`` names
    the canvas's rows and columns among the model's ``supported_aspect_ratios``), and fills the tiles it does not
    use with zeros (``pixel_values`` (1, 1, max tiles, 3, s, s)). The picture is the canvas as the processor
    padded it. The map is of the vision states the cross-attention layers read (the projector's output): each
    used tile's patch tokens where the tile lies, its class token left out (layer ``reading.tiles``).

    Args:
        model: The model: its vision config (patch size, ``supported_aspect_ratios``) and its projector.
        inputs: The processor's output for one image: ``pixel_values``, ``aspect_ratio_ids``, ``aspect_ratio_mask``.

    Raises:
        ExplainError: Not one image, or tiles the aspect ratio and its mask do not agree on.
    """

    inputs = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "num_tiles")  # the last: its processor's note

    def __init__(self, model: nn.Module, inputs: Mapping[str, Tensor]) -> None:
        super().__init__()
        pixel_values, vision = inputs["pixel_values"], model.config.vision_config
        if pixel_values.dim() != 6 or tuple(pixel_values.shape[:2]) != (1, 1) or "aspect_ratio_ids" not in inputs:
            raise ExplainError(
                f"pixel_values {tuple(pixel_values.shape)} are not one image's tiles (1, 1, tiles, 3, s, s) with "
                "their aspect_ratio_ids: pass the processor's whole output for one image"
            )
        rows, columns = vision.supported_aspect_ratios[int(inputs["aspect_ratio_ids"].reshape(-1)[0]) - 1]
        used = torch.arange(pixel_values.shape[2]) < rows * columns
        mask = inputs.get("aspect_ratio_mask")
        if mask is not None and not torch.equal(mask.reshape(-1).cpu().bool(), used):
            raise ExplainError(
                f"aspect_ratio_mask {mask.reshape(-1).tolist()} does not mark the {rows}x{columns} tiles its "
                "aspect_ratio_ids name: pass the processor's output for this image"
            )
        self.projector = submodule(model, PROJECTOR, "the vision states its cross-attention reads (Mllama)")
        self.side, self.max_tiles = pixel_values.shape[-1], pixel_values.shape[2]
        self.register_buffer("image", _canvas(pixel_values[0, 0, : rows * columns], (rows, columns)), persistent=False)
        canvas = (rows * self.side, columns * self.side)
        self.tiles = TileTokens((rows, columns), self.side // vision.patch_size, Canvas(canvas, canvas))
        self.held = {name: inputs[name] for name in self.inputs[1:] if name in inputs}
        self.levels = ("reading.tiles",)

    def picture(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """The picture (1, 3, rows * s, columns * s): the tiles' canvas."""
        return self.image

    def model_inputs(self, picture: Tensor) -> dict[str, Tensor]:
        """The model's image inputs for pictures (N, 3, rows * s, columns * s): their tiles, the unused ones zero.

        Raises:
            ExplainError: Pictures of another size than the canvas.
        """
        (rows, columns), s, n = self.tiles.tiles, self.side, len(picture)
        if tuple(picture.shape[2:]) != (rows * s, columns * s):
            raise ExplainError(f"pictures {tuple(picture.shape)} are not of the tiles' {rows * s}x{columns * s}")
        tiles = picture.reshape(n, -1, rows, s, columns, s).permute(0, 2, 4, 1, 3, 5)
        tiles = tiles.reshape(n, rows * columns, -1, s, s)
        unused = tiles.new_zeros(n, self.max_tiles - rows * columns, *tiles.shape[2:])
        held = {name: value.to(picture.device).expand(n, *value.shape[1:]) for name, value in self.held.items()}
        return {"pixel_values": torch.cat([tiles, unused], dim=1)[:, None], **held}

    def watch(self, hooks: Hooks, images: int) -> None:
        """In the forward of ``images`` pictures, pass the used tiles' patch tokens of the projector's output
        (N, 1, max tiles, 1 + g * g, C) through :attr:`tiles` (the map)."""

        def as_map(module: nn.Module, inputs: Any, projected: Tensor) -> Tensor:
            g, count = self.tiles.side, math.prod(self.tiles.tiles)
            if projected.dim() != 5 or projected.shape[-2] != 1 + g * g:
                raise ExplainError(
                    f"the projector makes {tuple(projected.shape)}, not each tile's class token and {g}x{g} patch "
                    "tokens: explain reads Mllama's vision states"
                )
            states = projected[:, 0]
            mapped = self.tiles.tokens(self.tiles(states[:, :count, 1:]))
            tiles = torch.cat([states[:, :count, :1], mapped], dim=2)
            return torch.cat([tiles, states[:, count:]], dim=1)[:, None]

        hooks.forward(self.projector, as_map)
