"""Promptable segmenters (Hugging Face's SAM, SAM-HQ, SlimSAM: ``SamModel`` and its kind) with their prompt fixed,
so that explain calls them on images as it calls any model.

:class:`SamPrompted` takes [0, 1] RGB images of any size, resizes and pads them as SAM's image processor does (the
longest side to the model's image size, normalized, padded at the bottom and right), scales the prompt (points and
boxes in the input's pixels) onto the resized image, and returns the model's own output: ``pred_masks`` (N, 1,
masks, h, w), the low-resolution mask logits, and ``iou_scores`` (N, 1, masks). The resize records its canvas, so
a map of the image encoder is cut to the image and brought back to the input's pixels
(:func:`explain.core.detectors.canvas_recorded`). The image encoder's last layer (its neck) is the automatic layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ExplainError
from .spec import IMAGENET_PREPROCESSING
from .yolo import Letterboxed

IMAGENET_MEAN, IMAGENET_STD = IMAGENET_PREPROCESSING.mean, IMAGENET_PREPROCESSING.std  # SAM's processor's


class SamResize(nn.Module):
    """SAM's preprocessing of [0, 1] images (N, 3, H, W), in torch: the longest side resized to ``size``
    (bilinear, antialiased; the processor resizes with PIL), normalized, zero-padded at the bottom and right to a
    ``size`` x ``size`` canvas."""

    def __init__(self, size: int, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        super().__init__()
        self.size = size
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The image's size on the canvas: its longest side ``size``, the other rounded as SAM's processor does."""
        scale = self.size / max(height, width)
        return int(height * scale + 0.5), int(width * scale + 0.5)

    def forward(self, x: Tensor) -> Letterboxed:
        height, width = self.resized(*x.shape[-2:])
        resized = F.interpolate(x, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
        normalized = (resized - self.mean.to(x)) / self.std.to(x)
        canvas = F.pad(normalized, (0, self.size - width, 0, self.size - height))
        return Letterboxed(canvas, [(height, width)] * len(x), (0, 0), height / x.shape[-2])


def _per_image(value: Any, n: int, shape: Sequence[int], what: str) -> Tensor:
    """A prompt for every image, or one per image, as (N, *shape) float."""
    tensor = torch.as_tensor(value, dtype=torch.float32)
    if tuple(tensor.shape) == tuple(shape):
        tensor = tensor.expand(n, *shape)
    if tuple(tensor.shape[1:]) != tuple(shape) or len(tensor) != n:
        raise ExplainError(f"{what} must be {tuple(shape)} for every image or one per image, got {tuple(tensor.shape)}")
    return tensor


class SamPrompted(nn.Module):
    """A promptable segmenter with its prompt: images in, the model's masks for the prompt out.

    Args:
        model: A Hugging Face ``SamModel`` (or SAM-HQ, SlimSAM: a model taking ``pixel_values``,
            ``input_points``, ``input_labels`` and ``input_boxes``), in eval mode.
        points: Points ``(x, y)`` in the input's pixels: (P, 2) for every image or (N, P, 2).
        point_labels: Each point's label, 1 on the object and 0 off it: (P,) or (N, P); default all 1.
        box: A box ``(x1, y1, x2, y2)`` in the input's pixels: (4,) for every image or (N, 4).
        multimask: Ask for the model's several masks (SAM's three) rather than one.

    Raises:
        ExplainError: No prompt, or a prompt of the wrong shape.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        points: Any = None,
        point_labels: Any = None,
        box: Any = None,
        multimask: bool = True,
    ) -> None:
        super().__init__()
        if points is None and box is None:
            raise ExplainError("a promptable segmenter needs a prompt: points=[(x, y)] or box=(x1, y1, x2, y2)")
        self.model, self.multimask = model, multimask
        self.points, self.point_labels, self.box = points, point_labels, box
        size = int(model.config.vision_config.image_size)
        self.transform = SamResize(size)
        self.feature_levels = ["model.vision_encoder.neck"]  # the image encoder's last layer

    def prompts(self, n: int, scale: tuple[float, float], device: torch.device) -> dict[str, Tensor]:
        """The model's prompt arguments for ``n`` images, scaled by ``scale`` (x, y) onto the resized image."""
        found: dict[str, Tensor] = {}
        factors = torch.tensor(scale, device=device)
        if self.points is not None:
            points = torch.as_tensor(self.points, dtype=torch.float32)
            count = points.shape[-2] if points.dim() >= 2 else 0
            points = _per_image(points, n, (count, 2), "points").to(device) * factors
            labels = torch.ones(n, count) if self.point_labels is None else self.point_labels
            found["input_points"] = points[:, None]
            found["input_labels"] = _per_image(labels, n, (count,), "point_labels").long().to(device)[:, None]
        if self.box is not None:
            found["input_boxes"] = (_per_image(self.box, n, (4,), "box").to(device) * factors.repeat(2))[:, None]
        return found

    def forward(self, x: Tensor) -> Any:
        boxed = self.transform(x)
        height, width = boxed.image_sizes[0]
        scale = (width / x.shape[-1], height / x.shape[-2])
        prompts = self.prompts(len(x), scale, x.device)
        return self.model(pixel_values=boxed.tensors, multimask_output=self.multimask, **prompts)
