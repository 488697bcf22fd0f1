"""How a vision-language model reads an image: the picture explain explains (N, 3, H, W), the model's image inputs
made of it, and the map of the vision tokens as the language model reads them.

- :class:`HeldImage`: the processor's ``pixel_values`` are the picture, its other image inputs held as given; the
  readings below that take the picture whole build on it.
- :class:`WholeImage`: a vision tower reads the whole picture (LLaVA 1.5, PaliGemma); the layer is searched as in
  any model, and the count of tokens the projector makes is checked at every forward.
- :class:`MergedPatches`: the processor cuts the picture into patches, flattened in groups that the vision tower
  merges into one token each (Qwen2-VL, Qwen2.5-VL: ``pixel_values`` (patches, features) and ``image_grid_thw``).
  The picture is put back together from the patches, and cut again inside the forward, so that every method
  (the pixel attributions too) sees an image. The tower's tokens, as the language model receives them, are laid
  out as a map (:class:`VisionTokens`): each in the cell the language model's own position ids (its rotary index
  of height and width) give it. Qwen2.5-VL's windows reorder the patches inside the tower; the tower undoes
  that before the language model reads them, and the map is taken after it.
- :class:`Rows`: image tokens in rows, a separator token closing each (Mistral 3, Pixtral): the grid is the runs
  of the image token in the text, and the map is taken at the language model's input embeddings.
  :class:`PatchRows`: the same rows where the patches themselves are the image's input (Fuyu).
- :class:`Queried`: a Q-Former's queries stand for the image (BLIP-2, InstructBLIP); the map is of the vision
  tower's patch tokens that they read.
- Tiles of the image beside a base image (LLaVA-NeXt, LLaVA-OneVision, Idefics3): :mod:`explain.models.tiles`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..core.hooks import Hooks
from ..errors import ExplainError

PROJECTOR = "multi_modal_projector"  # LLaVA's: the vision tokens as the language model reads them
VISION_TOWER = "visual"  # Qwen2-VL's: the tower that cuts, embeds and merges the patches


def image_token_id(model: nn.Module) -> int:
    """The id of the token that stands for one vision token in the model's text (its config's).

    Raises:
        ExplainError: The config names none: not a model of the supported kind.
    """
    config = getattr(model, "config", None)
    for key in ("image_token_id", "image_token_index"):
        found = getattr(config, key, None)
        if isinstance(found, int):
            return found
    raise ExplainError(
        f"{type(model).__name__} names no image token in its config (image_token_id / image_token_index): explain "
        "explains vision-language models that put the image's tokens into the text (LLaVA 1.5 and its kind)"
    )


def submodule(model: nn.Module, short_name: str, kind: str) -> nn.Module:
    """The model's first module whose own name is ``short_name``.

    Raises:
        ExplainError: The model has none; the message names what explain reads there (``kind``).
    """
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == short_name:
            return module
    raise ExplainError(f"{type(model).__name__} has no {short_name}: explain reads {kind} there")


def count_error(made: int, expected: int, token: int) -> ExplainError:
    """The error of a vision tower that made another number of tokens per image than the text holds."""
    return ExplainError(
        f"the vision tower made {made} tokens per image, but the text holds {expected} image tokens (id {token}): "
        "build the text with the model's own processor, for an image of the size it expects"
    )


class HeldImage(nn.Module):
    """The processor's ``pixel_values`` (1, 3, H, W) are the picture; its other image inputs (Mistral 3's
    ``image_sizes``, InstructBLIP's text for its Q-Former) are held as given, one copy per picture.

    Args:
        inputs: The processor's output for one image and one prompt.
    """

    inputs = ("pixel_values", "image_sizes", "qformer_input_ids", "qformer_attention_mask")

    def __init__(self, inputs: Mapping[str, Tensor]) -> None:
        super().__init__()
        self.held = {name: inputs[name] for name in self.inputs[1:] if name in inputs}

    @staticmethod
    def picture(inputs: Mapping[str, Tensor]) -> Tensor:
        """The picture of a processor's output: its ``pixel_values``.

        Raises:
            ExplainError: Not one image (1, 3, H, W).
        """
        pixel_values = inputs["pixel_values"]
        if pixel_values.dim() != 4 or len(pixel_values) != 1:
            raise ExplainError(
                f"the processor gives pixel_values of shape {tuple(pixel_values.shape)}, not one image (1, 3, H, W): "
                "images cut into tiles are explained with what their processor gives beside them (LLaVA-NeXt's "
                "image_sizes, Idefics3's pixel_attention_mask): pass its whole output"
            )
        return pixel_values

    def model_inputs(self, picture: Tensor) -> dict[str, Tensor]:
        """The model's image inputs for pictures (N, 3, H, W): them, and the other image inputs as given."""
        n = len(picture)
        held = {name: value.to(picture.device).expand(n, *value.shape[1:]) for name, value in self.held.items()}
        return {"pixel_values": picture, **held}


class WholeImage(HeldImage):
    """The whole picture is read by a vision tower whose tokens a projector hands to the text: LLaVA 1.5,
    PaliGemma, Gemma 3 and their kind (see :class:`HeldImage` for the picture and the inputs held).

    Args:
        model: The model; its projector (``multi_modal_projector``), where it has one, makes the vision tokens the
            language model reads. The layer is searched as in any model.
        inputs: The processor's output for one image and one prompt.
        image_tokens: The image tokens of the text, one per vision token.
        projector: The name of the projector's module.
    """

    def __init__(
        self, model: nn.Module, inputs: Mapping[str, Tensor], image_tokens: int, projector: str = PROJECTOR
    ) -> None:
        super().__init__(inputs)
        self.projector = next((m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == projector), None)
        self.image_tokens, self.token = image_tokens, image_token_id(model)

    def watch(self, hooks: Hooks, images: int) -> None:
        """Check, in the forward of ``images`` pictures, the count of tokens the projector makes (a model without
        one checks it itself, where it puts them at the image tokens)."""

        def check(module: nn.Module, inputs: Any, projected: Tensor) -> None:
            made = projected.shape[:-1].numel() // images
            if made != self.image_tokens:
                raise count_error(made, self.image_tokens, self.token)

        if self.projector is not None:
            hooks.forward(self.projector, check)


QUERIES_PROJECTOR = "language_projection"  # BLIP-2's: the Q-Former's queries as the language model reads them
VISION_MODEL = "vision_model"  # BLIP-2's vision tower, whose patch tokens the queries read


class Queried(WholeImage):
    """A Q-Former's queries stand for the image in the text (BLIP-2, InstructBLIP): the queries are no grid, so the
    map is of the vision tower's patch tokens that they read, its last block's output.

    Args:
        model: The model: its ``language_projection`` (the queries' count is checked there) and ``vision_model``.
        inputs: The processor's output for one image and one prompt.
        image_tokens: The image tokens of the text, one per query.
    """

    def __init__(self, model: nn.Module, inputs: Mapping[str, Tensor], image_tokens: int) -> None:
        super().__init__(model, inputs, image_tokens, QUERIES_PROJECTOR)
        tower = submodule(model, VISION_MODEL, "the patch tokens the queries read (BLIP-2 and its kind)")
        names = {module: name for name, module in model.named_modules()}
        blocks = max((m for m in tower.modules() if isinstance(m, nn.ModuleList)), key=len, default=None)
        if not blocks:
            raise ExplainError(f"{type(model).__name__}'s {VISION_MODEL} has no blocks: explain maps its last one")
        self.levels = (f"model.{names[blocks[-1]]}",)  # its last block, as the wrapper (VisionLanguage) names it


class VisionTokens(nn.Module):
    """The vision tokens of N pictures as a map (N, C, h, w): a module of its own, so that it is a layer to hook.

    Args:
        grid: The map's (h, w).
        cells: The cell (row-major) of each token, in the order the tower makes them.
    """

    def __init__(self, grid: tuple[int, int], cells: Tensor) -> None:
        super().__init__()
        self.grid = grid
        raster = torch.equal(cells, torch.arange(len(cells)))
        self.register_buffer("cells", None if raster else cells, persistent=False)
        self.register_buffer("by_cell", None if raster else torch.argsort(cells), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        """The map (N, C, h, w) of tokens (N * h * w, C) in the tower's order."""
        rows = tokens.reshape(-1, self.grid[0] * self.grid[1], tokens.shape[-1])
        if self.by_cell is not None:
            rows = rows.index_select(1, self.by_cell)
        return rows.transpose(1, 2).reshape(len(rows), tokens.shape[-1], *self.grid)

    def tokens(self, mapped: Tensor) -> Tensor:
        """The tokens (N * h * w, C) of a map, back in the tower's order."""
        rows = mapped.flatten(2).transpose(1, 2)
        if self.cells is not None:
            rows = rows.index_select(1, self.cells)
        return rows.reshape(-1, mapped.shape[1])


class MergedPatches(nn.Module):
    """Patches flattened in merged groups: Qwen2-VL and Qwen2.5-VL (see the module's docstring).

    Args:
        model: The model: its config's ``vision_config`` (patch, temporal patch and merge sizes), its vision tower
            (``visual``) and its rotary index (``get_rope_index``).
        text: The text's inputs (1, T), with the image tokens.
        grid_thw: The processor's ``image_grid_thw`` (1, 3) of one image: 1 frame, h and w patches.

    Raises:
        ExplainError: A video, or positions of the image tokens that are no grid of the merged patches.
    """

    inputs = ("pixel_values", "image_grid_thw")

    def __init__(self, model: nn.Module, text: Mapping[str, Tensor], grid_thw: Tensor) -> None:
        super().__init__()
        vision = model.config.vision_config
        self.patch, self.frames, self.merge = vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size
        frames, height, width = (int(v) for v in grid_thw.reshape(-1, 3)[0])
        if grid_thw.numel() != 3 or frames != 1:
            raise ExplainError(
                f"image_grid_thw {grid_thw.tolist()} is not one image of 1 frame: videos are not explained"
            )
        self.grid_thw = grid_thw.reshape(1, 3).cpu()
        self.patches = (height, width)
        self.tower = submodule(model, VISION_TOWER, "the merged vision tokens (Qwen2-VL and its kind)")
        self.token = image_token_id(model)
        grid = (height // self.merge, width // self.merge)
        self.tokens = VisionTokens(grid, token_cells(model, text, self.grid_thw, grid))

    def picture(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """The picture (1, 3, H, W) the processor cut into ``pixel_values`` (patches, features).

        Raises:
            ExplainError: Patches that are not this grid's, or frames that differ (a video).
        """
        (height, width), m, p = self.patches, self.merge, self.patch
        patches = inputs["pixel_values"]
        if patches.dim() != 2 or len(patches) != height * width or patches.shape[1] % (self.frames * p * p):
            raise ExplainError(
                f"pixel_values {tuple(patches.shape)} are not the {height}x{width} patches of image_grid_thw"
            )
        cut = patches.reshape(height // m, width // m, m, m, -1, self.frames, p, p)
        if not torch.equal(cut, cut[..., :1, :, :].expand_as(cut)):
            raise ExplainError("pixel_values hold frames that differ: a video, which is not explained")
        picture = cut[..., 0, :, :].permute(4, 0, 2, 5, 1, 3, 6)  # C, h/m, m, p, w/m, m, p
        return picture.reshape(1, -1, height * p, width * p)

    def model_inputs(self, picture: Tensor) -> dict[str, Tensor]:
        """The model's image inputs for pictures (N, 3, H, W): their patches and each one's grid.

        Raises:
            ExplainError: Pictures of another size than the processor's.
        """
        (height, width), m, p = self.patches, self.merge, self.patch
        n, channels = picture.shape[:2]
        if tuple(picture.shape[2:]) != (height * p, width * p):
            raise ExplainError(f"pictures {tuple(picture.shape)} are not of the processor's {height * p}x{width * p}")
        cut = picture.reshape(n, channels, height // m, m, p, width // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
        cut = cut.unsqueeze(6).expand(*cut.shape[:6], self.frames, p, p)  # every frame the one picture
        patches = cut.reshape(n * height * width, channels * self.frames * p * p)
        return {"pixel_values": patches, "image_grid_thw": self.grid_thw.to(picture.device).expand(n, 3)}

    def watch(self, hooks: Hooks, images: int) -> None:
        """In the forward of ``images`` pictures, pass the tower's merged tokens through :attr:`tokens` (the map),
        checking their count."""

        def as_map(module: nn.Module, inputs: Any, output: Any) -> Any:
            merged = output.pooler_output
            cells = self.tokens.grid[0] * self.tokens.grid[1]
            if len(merged) != images * cells:
                raise count_error(len(merged) // images, cells, self.token)
            output.pooler_output = self.tokens.tokens(self.tokens(merged))
            return output

        hooks.forward(self.tower, as_map)


def token_cells(model: nn.Module, text: Mapping[str, Tensor], grid_thw: Tensor, grid: tuple[int, int]) -> Tensor:
    """The cell (row-major, on the merged grid) of each image token of the text, as the language model places it:
    its rotary index's height and width positions.

    Raises:
        ExplainError: The model has no rotary index, or its positions are not the grid, each cell once.
    """
    owner = next((m for m in (model, getattr(model, "model", None)) if hasattr(m, "get_rope_index")), None)
    if owner is None:
        raise ExplainError(
            f"{type(model).__name__} has no get_rope_index: explain reads where the language model places each "
            "merged vision token there (Qwen2-VL and its kind)"
        )
    image = text["input_ids"].reshape(-1) == image_token_id(model)
    if int(image.sum()) != grid[0] * grid[1]:
        raise count_error(grid[0] * grid[1], int(image.sum()), image_token_id(model))
    given = {"input_ids": text["input_ids"], "image_grid_thw": grid_thw.to(text["input_ids"].device), **text}
    accepted = inspect.signature(owner.get_rope_index).parameters
    missing = [
        name for name, p in accepted.items() if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD and name
        not in given
    ]  # fmt: skip
    if missing:
        raise ExplainError(
            f"the text lacks {', '.join(missing)}, which the model reads to place the image's tokens: pass the "
            "processor's whole output"
        )
    positions = owner.get_rope_index(**{k: v for k, v in given.items() if k in accepted})[0]  # (3, 1, T)
    rows, columns = (positions[axis].reshape(-1)[image].cpu() for axis in (1, 2))
    rows, columns = rows - rows.min(), columns - columns.min()
    cells = rows * grid[1] + columns
    every = torch.arange(grid[0] * grid[1])
    if len(cells) != len(every) or not torch.equal(cells.sort().values, every):
        raise ExplainError(
            f"the language model places the text's {len(cells)} image tokens otherwise than on the "
            f"{grid[0]}x{grid[1]} grid of merged patches: build the text with the model's own processor"
        )
    return cells


LANGUAGE_MODEL = "language_model"  # the module that reads the text's embeddings, the image's tokens among them


def image_runs(input_ids: Tensor, token: int) -> list[tuple[int, int]]:
    """Where each run of consecutive image tokens starts in the text, and its length, in order."""
    image = (input_ids.reshape(-1) == token).to(torch.int8)
    edges = torch.diff(torch.nn.functional.pad(image, (1, 1)))
    starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
    return list(zip(starts.tolist(), (ends - starts).tolist()))


class Rows(HeldImage):
    """Image tokens in rows, a separator token closing each (Mistral 3's and Pixtral's ``[IMG_BREAK]``).

    The rows are the runs of the image token in the text, so the grid is the text's own. The map is taken where
    the image enters the language model: its input embeddings at the image tokens, laid out row by row
    (:attr:`tokens`). The picture is the processor's ``pixel_values``; its other image inputs (Mistral 3's
    ``image_sizes``) are held as given.

    Args:
        model: The model: its config's image token and its ``language_model``.
        inputs: The processor's output for one image and one prompt.
        runs: Each row's start and length in the text (see :func:`image_runs`).

    Raises:
        ExplainError: Rows of different lengths, or a grid whose cells are not square on the picture.
    """

    def __init__(self, model: nn.Module, inputs: Mapping[str, Tensor], runs: list[tuple[int, int]]) -> None:
        super().__init__(inputs)
        lengths = sorted({length for _, length in runs})
        if len(lengths) != 1:
            raise ExplainError(
                f"the text's image tokens come in {len(runs)} rows of {lengths} tokens, which is not a grid: build "
                "the text with the model's own processor, for this image"
            )
        rows, columns = len(runs), lengths[0]
        height, width = HeldImage.picture(inputs).shape[-2:]
        if height * columns != width * rows or height % rows:
            raise ExplainError(
                f"the text's {rows}x{columns} image tokens do not lie on the {height}x{width} image in square cells: "
                "build the text with the model's own processor, for this image"
            )
        self.language = submodule(model, LANGUAGE_MODEL, "the image's tokens as the text reads them")
        self.runs = runs
        self.tokens = VisionTokens((rows, columns), torch.arange(rows * columns))
        self.levels = ("reading.tokens",)

    def watch(self, hooks: Hooks, images: int) -> None:
        """In the forward of ``images`` pictures, pass the image tokens the language model reads through
        :attr:`tokens` (the map)."""

        def as_map(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
            embeds = kwargs.get("inputs_embeds")
            if embeds is None or len(embeds) != images:
                raise ExplainError(
                    f"{type(module).__name__} is not given the text's embeddings (inputs_embeds) of {images} "
                    "pictures: explain reads the image's tokens there"
                )
            found = torch.cat([embeds[:, start : start + length] for start, length in self.runs], dim=1)
            mapped = self.tokens.tokens(self.tokens(found.reshape(-1, found.shape[-1]))).reshape(found.shape)
            rows = mapped.split([length for _, length in self.runs], dim=1)
            ends = [0] + [start + length for start, length in self.runs]  # the text between rows, and after them
            parts = [p for (start, _), end, row in zip(self.runs, ends, rows) for p in (embeds[:, end:start], row)]
            parts.append(embeds[:, ends[-1] :])
            return args, {**kwargs, "inputs_embeds": torch.cat(parts, dim=1)}  # slices and joins: every method's

        hooks.forward_pre(self.language, as_map, with_kwargs=True)


class PatchRows(Rows):
    """Image patches given as tokens, in rows closed by a separator token (Fuyu's newline): no vision tower, each
    patch's pixels (p, p, C) flattened into ``pixel_values`` (1, patches, p * p * C), row by row.

    The picture is put back together from the patches on the text's grid, and cut again inside the forward.

    Args:
        model: The model: its config's ``patch_size`` and ``num_channels``, its image token, its
            ``language_model``.
        inputs: The processor's output for one image and one prompt.
        runs: Each row's start and length in the text (see :func:`image_runs`).

    Raises:
        ExplainError: Patches that are not the text's grid of the config's patch size.
    """

    def __init__(self, model: nn.Module, inputs: Mapping[str, Tensor], runs: list[tuple[int, int]]) -> None:
        patches, config = inputs["pixel_values"], model.config
        patch, channels = int(config.patch_size), int(config.num_channels)
        rows, columns = len(runs), runs[0][1]
        if patches.shape != (1, rows * columns, patch * patch * channels):
            raise ExplainError(
                f"pixel_values {tuple(patches.shape)} are not the text's {rows}x{columns} patches of "
                f"{patch}x{patch}x{channels} pixels: pass the processor's output for this image"
            )
        super().__init__(model, {**inputs, "pixel_values": _joined(patches, (rows, columns), patch, channels)}, runs)
        self.patch, self.channels = patch, channels

    def picture(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """The picture (1, C, rows * p, columns * p) whose patches the processor gives."""
        return _joined(inputs["pixel_values"], self.tokens.grid, self.patch, self.channels)

    def model_inputs(self, picture: Tensor) -> dict[str, Tensor]:
        """The model's patches (N, patches, p * p * C) of pictures (N, C, H, W), row by row."""
        (rows, columns), p, n = self.tokens.grid, self.patch, len(picture)
        cut = picture.reshape(n, self.channels, rows, p, columns, p).permute(0, 2, 4, 3, 5, 1)
        return {"pixel_values": cut.reshape(n, rows * columns, -1)}


def _joined(patches: Tensor, grid: tuple[int, int], patch: int, channels: int) -> Tensor:
    """The picture (1, C, rows * p, columns * p) of patches (1, rows * columns, p * p * C) given row by row."""
    rows, columns = grid
    cut = patches.reshape(1, rows, columns, patch, patch, channels)
    return cut.permute(0, 5, 1, 3, 2, 4).reshape(1, channels, rows * patch, columns * patch)
