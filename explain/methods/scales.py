"""SESS: any method's maps over windows slid across the image at several scales, weighed by their scores and
fused."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.engine import CAM, Capture, Needs
from ..core.layers import LayerSpec
from ..core.maps import upsample
from ..core.model_state import running
from ..errors import ExplainError, TargetError
from ..targets.base import read_output


def slide(length: int, step: int, window: int) -> list[int]:
    """Where windows of ``window`` start along an axis of ``length``, every ``step``; the last one shifted back
    inside the image, so that every window is whole."""
    starts = []
    for start in range(0, length, step):
        if start + window >= length:
            starts.append(max(length - window, 0))
            break
        starts.append(start)
    return starts


def gaussian_blur(maps: Tensor, size: int = 11, sigma: float = 5.0) -> Tensor:
    """Maps (N, H, W) blurred by a ``size`` x ``size`` Gaussian of ``sigma``, borders reflected without repeating
    the edge (OpenCV's ``GaussianBlur``)."""
    offsets = torch.arange(size, dtype=maps.dtype, device=maps.device) - (size - 1) / 2
    kernel = torch.exp(-(offsets**2) / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    padded = F.pad(maps[:, None], (size // 2,) * 4, mode="reflect")
    rows = F.conv2d(padded, kernel.view(1, 1, 1, -1))
    return F.conv2d(rows, kernel.view(1, 1, -1, 1))[:, 0]


class SESS(CAM):
    r"""SESS, Saliency Enhancing with Scaling and Sliding: Tyagi et al., "SESS: Saliency Enhancing with Scaling
    and Sliding", ECCV 2022 (arXiv:2207.01769), as pytorch-grad-cam's ``SESS``.

    The image's shorter side is resized to each of ``scales`` (default: twelve, from the window up by 2/7 of it
    each), windows of ``window`` slide over each every ``step``; each window's class probability (its softmax,
    clipped at 0) is its weight, relative to the largest. The ``base`` method explains every window for the call's
    class, each map normalized, weighted and pasted back where the window came from; the maps are fused by a mean
    over the windows whose value at a pixel is above ``theta`` (or their maximum), and blurred (an 11 x 11
    Gaussian, σ = 5). ``pre_filter`` drops that share of the lowest-scoring windows first. Images only (two
    spatial axes); the target is each image's class of a classifier.

    Args:
        model: A classifier; left as it was.
        layer: The base method's layer (None: automatic).
        labels: Class names, to accept a class name as target.
        base: The name of the method explaining each window (``explain.METHODS``).
        scales: The shorter side's sizes; None: the default above.
        window: The window's side; None: the image's shorter side (its smallest scale is the image itself).
        step: How far windows move; None: a window (no overlap).
        pre_filter: The share of windows, lowest scores first, left out.
        theta: A window counts at a pixel only where its weighted map is above this.
        pool: ``"mean"`` or ``"max"``.
        smooth: Blur the fused map.
        batch_size: Windows per pass.
        **options: The base method's options.
    """

    name = "sess"
    title = "SESS, a method over scaled, slid windows (Tyagi et al. 2022)"
    fast = False
    cost = "the base method on every window at every scale"
    needs = Needs(gradients=False, map_of_input=True)  # the plain pass binds; the base method explains the windows

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec | Sequence[str | nn.Module] = None,
        *,
        labels: Sequence[str] | None = None,
        base: str = "gradcam",
        scales: Sequence[int] | None = None,
        window: int | None = None,
        step: int | None = None,
        pre_filter: float = 0.0,
        theta: float = 0.0,
        pool: Literal["mean", "max"] = "mean",
        smooth: bool = True,
        batch_size: int = 32,
        **options: Any,
    ) -> None:
        from . import create_method

        super().__init__(model, None, labels=labels, batch_size=batch_size)
        if pool not in ("mean", "max") or not 0 <= pre_filter < 1:
            raise ExplainError(f"pool must be 'mean' or 'max' and 0 <= pre_filter < 1, got {pool!r} and {pre_filter}")
        if base == self.name:
            raise ExplainError("SESS's base method cannot be SESS")
        self.base = create_method(base, model, layer, labels=labels, batch_size=batch_size, **options)
        self.scales, self.window, self.step = scales, window, step
        self.pre_filter, self.theta, self.pool, self.smooth = pre_filter, theta, pool, smooth

    @property
    def layer(self) -> str:
        """The base method's layer."""
        return self.base.layer or ""

    def windows(self, image: Tensor) -> tuple[Tensor, list[tuple[int, int, int, int]]]:
        """The windows of one image (1, C, H, W) over its scales, (P, C, w, w), and where each came from:
        (left, top, scaled width, scaled height).

        Raises:
            ExplainError: A scale smaller than the window.
        """
        from torchvision.transforms.functional import resize

        height, width = image.shape[-2:]
        window = self.window or min(height, width)
        step = self.step or window
        scales = self.scales or [window + round(window * 2 / 7) * i for i in range(12)]
        patches, places = [], []
        for scale in scales:
            if scale < window:
                raise ExplainError(f"every SESS scale must be at least the window {window}, got {scale}")
            scaled = resize(image, [scale], antialias=True)
            sh, sw = scaled.shape[-2:]
            for top in slide(sh, step, window):
                for left in slide(sw, step, window):
                    patches.append(scaled[:, :, top : top + window, left : left + window])
                    places.append((left, top, sw, sh))
        return torch.cat(patches), places

    def compute(self, capture: Capture) -> Tensor:
        x = capture.x
        if x.dim() != 4:
            raise ExplainError("SESS rescales and slides over images (N, C, H, W); this input has another rank")
        if capture.classes is None:
            raise TargetError("SESS explains every window for a classifier's class; this target is not one")
        return torch.stack([self.enhanced(x[n : n + 1], int(capture.classes[n]), capture) for n in range(len(x))])

    def enhanced(self, image: Tensor, label: int, capture: Capture) -> Tensor:
        """One image's fused map (H, W)."""
        height, width = image.shape[-2:]
        patches, places = self.windows(image)
        read = capture.target.read or read_output  # the classifier's scores in its output (a logits field, ...)
        with torch.no_grad(), running(self.model):
            scores = torch.cat([
                read(self.model(patches[i : i + self.batch_size], **capture.model_kwargs)).softmax(dim=1)[:, label]
                for i in range(0, len(patches), self.batch_size)
            ]).clamp(min=0)  # fmt: skip
        order = scores.argsort()[math.floor(len(scores) * self.pre_filter) :]
        top = scores[order[-1]]
        weights = scores[order] / top if top > 0 else torch.ones(len(order), device=scores.device)
        total = image.new_zeros(height, width, dtype=torch.float32)
        counts = torch.zeros_like(total)
        for start in range(0, len(order), self.batch_size):
            chosen = order[start : start + self.batch_size]
            cams = self.base(patches[chosen], label, model_kwargs=capture.model_kwargs).cams
            for cam, weight, index in zip(cams, weights[start : start + self.batch_size], chosen.tolist()):
                left, top_, sw, sh = places[index]
                canvas = cam.new_zeros(sh, sw)
                canvas[top_ : top_ + cam.shape[0], left : left + cam.shape[1]] = cam * weight
                pasted = upsample(canvas, (height, width))
                if self.pool == "max":
                    total = torch.maximum(total, pasted)
                else:
                    counted = pasted > self.theta
                    total, counts = total + torch.where(counted, pasted, 0.0), counts + counted
        fused = total if self.pool == "max" else torch.where(counts > 0, total / counts.clamp_min(1), 0.0)
        return gaussian_blur(fused[None])[0] if self.smooth else fused
