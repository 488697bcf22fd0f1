"""Hugging Face dense models by folder: depth estimators (DPT, GLPN, Depth Anything, ZoeDepth) and promptable
segmenters (SAM and its kind), loaded offline from a ``save_pretrained`` folder (or the Hub's local cache).

Both take [0, 1] RGB images at the photo's own size, so that a region or a prompt given in the photo's pixels is
in the input's: a depth estimator is wrapped in :class:`DepthEstimator` (its image processor's resize and
normalization in torch, its depth brought back to the input's size, as the processor's post-processing does),
a promptable segmenter in :class:`explain.models.sam.SamPrompted` once its prompt is known.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ModelLoadError, first_line
from .spec import UNIT_PREPROCESSING, ModelSpec
from .yolo import Letterboxed

DEPTH_TYPES = ("dpt", "glpn", "depth_anything", "zoedepth")
SAM_TYPES = ("sam", "sam_hq")
MODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL's resampling filters as torch's modes


def dense_kind(name: str) -> str | None:
    """``"depth"`` or ``"prompted"`` where ``name`` is a folder holding a depth estimator's or a promptable
    segmenter's config, else None."""
    path = Path(name) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return None
    kind = config.get("model_type") if isinstance(config, dict) else None
    return "depth" if kind in DEPTH_TYPES else "prompted" if kind in SAM_TYPES else None


class ProcessorResize(nn.Module):
    """An image processor's resize and normalization of [0, 1] images (N, 3, H, W), in torch: each resized to the
    size the processor gives a photo of that size (asked once per size), antialiased, and normalized as it
    normalizes. The canvas it returns is the resized image whole, so that a layer's map is brought back to the
    photo by proportion (:func:`explain.core.detectors.canvas_recorded`)."""

    def __init__(self, processor: Any) -> None:
        super().__init__()
        self.processor = processor
        normalize = bool(getattr(processor, "do_normalize", False))
        mean, std = getattr(processor, "image_mean", None), getattr(processor, "image_std", None)
        self.mean = tuple(mean) if normalize and mean is not None else None
        self.std = tuple(std) if normalize and std is not None else None
        self.mode = MODES.get(int(getattr(processor, "resample", 2)), "bilinear")
        self._sizes: dict[tuple[int, int], tuple[int, int]] = {}

    def input_size(self, height: int, width: int) -> tuple[int, int]:
        """The size the processor resizes a photo of ``height`` x ``width`` to."""
        if (height, width) not in self._sizes:
            blank = np.zeros((height, width, 3), dtype=np.uint8)
            shape = self.processor(images=blank, return_tensors="pt")["pixel_values"].shape[-2:]
            self._sizes[(height, width)] = (int(shape[0]), int(shape[1]))
        return self._sizes[(height, width)]

    def forward(self, x: Tensor) -> Letterboxed:
        size = self.input_size(*x.shape[-2:])
        smooth = self.mode != "nearest"
        resized = F.interpolate(x, size=size, mode=self.mode, antialias=smooth, align_corners=False if smooth else None)
        if self.mean is not None and self.std is not None:
            mean, std = resized.new_tensor(self.mean).view(1, 3, 1, 1), resized.new_tensor(self.std).view(1, 3, 1, 1)
            resized = (resized - mean) / std
        return Letterboxed(resized, [size] * len(x), (0, 0), size[0] / x.shape[-2])


class DepthEstimator(nn.Module):
    """A depth estimator on [0, 1] images of any size: each resized and normalized as its image processor does
    (:class:`ProcessorResize`), and the predicted depth (N, h, w) resized back to the input's size (bicubic, as
    the processor's post-processing). The resize is torch's (antialiased), not the processor's PIL resize of
    8-bit pixels: the values differ by the rounding of those pixels. Its automatic layer is the model's last
    fusion of features before its head (:attr:`feature_levels`).

    Args:
        model: A ``...ForDepthEstimation`` model whose output holds ``predicted_depth``.
        processor: Its image processor.
    """

    def __init__(self, model: nn.Module, processor: Any) -> None:
        super().__init__()
        self.model, self.transform = model, ProcessorResize(processor)
        self.config = model.config  # what the model says of itself (its depth's direction: nearer_sign)
        level = _last_fusion(model)
        if level is not None:
            self.feature_levels = [level]

    def forward(self, x: Tensor) -> Tensor:
        depth = self.model(pixel_values=self.transform(x).tensors).predicted_depth
        return F.interpolate(depth[:, None], size=x.shape[-2:], mode="bicubic", align_corners=False)[:, 0]


def _last_fusion(model: nn.Module) -> str | None:
    """The layer of a depth estimator that fuses its features last, before the head: DPT's, Depth Anything's and
    ZoeDepth's last fusion stage, GLPN's last decoder stage; None for another architecture."""
    fusion = getattr(getattr(getattr(model, "neck", None), "fusion_stage", None), "layers", None)
    if isinstance(fusion, nn.ModuleList) and len(fusion):
        return f"model.neck.fusion_stage.layers.{len(fusion) - 1}"
    stages = getattr(getattr(model, "decoder", None), "stages", None)
    if isinstance(stages, nn.ModuleList) and len(stages):
        return f"model.decoder.stages.{len(stages) - 1}"
    return None


def load_dense_model(name: str, device: str | torch.device = "cpu") -> ModelSpec:
    """A depth estimator (task ``"depth"``, wrapped in :class:`DepthEstimator`) or a promptable segmenter (task
    ``"prompted"``, the bare model: :class:`explain.models.sam.SamPrompted` takes its prompt) from a folder.

    Raises:
        ModelLoadError: transformers is missing, or the folder's model or processor cannot be loaded.
    """
    try:
        import transformers
    except ImportError:
        raise ModelLoadError(f"{name}: a Hugging Face model needs transformers: pip install transformers") from None
    kind = dense_kind(name)
    try:
        if kind == "prompted":
            model = transformers.AutoModel.from_pretrained(name, local_files_only=True).eval()  # SAM, SAM-HQ
            return ModelSpec(model.to(device), Path(name).name, ["mask"], UNIT_PREPROCESSING, "prompted")
        model = transformers.AutoModelForDepthEstimation.from_pretrained(name, local_files_only=True).eval()
        processor = transformers.AutoImageProcessor.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"{name}: cannot load its model and image processor: {first_line(err)}") from None
    return ModelSpec(
        DepthEstimator(model, processor).to(device), Path(name).name, ["depth"], UNIT_PREPROCESSING, "depth"
    )
