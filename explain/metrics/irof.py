"""Iterative removal of features (IROF, Rieger and Hansen, "IROF: a low resource evaluation metric for explanation
methods", 2020): superpixels removed one at a time, most relevant first, the score followed down.

Superpixels are the user's (a label image per input) or scikit-image's SLIC with its defaults, as Quantus makes
them (``pip install "explain[superpixels]"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ExplainError
from ..targets import TargetLike
from .perturbation import Baseline, ranks, substrate, turned
from .scoring import MetricScore, input_maps, scorer


@dataclass(frozen=True)
class IrofResult:
    """IROF's curve per image.

    Attributes:
        aoc: The area over each curve, 1 - AUC over the fraction of superpixels removed, (N,); higher is better.
        curve: The score after each removal over the plain image's, (N, S + 1), S the most superpixels of an
            image; column 0 is the plain image (1), an image with fewer superpixels repeats its last value.
        fractions: The fraction of each image's superpixels removed at each column, (N, S + 1).
    """

    aoc: Tensor
    curve: Tensor
    fractions: Tensor


def superpixels(x: Tensor) -> Tensor:
    """Each image's SLIC superpixels (scikit-image's ``slic`` with its defaults, as Quantus' IROF), (N, H, W).

    Raises:
        ExplainError: scikit-image is not installed (the message names the install).
    """
    try:
        from skimage.segmentation import slic
    except ImportError:
        raise ExplainError(
            'irof draws SLIC superpixels with scikit-image: pip install "explain[superpixels]", or pass segments='
        ) from None
    images = x.detach().double().movedim(1, -1).cpu().numpy()
    return torch.stack([torch.from_numpy(slic(image, start_label=0)).long() for image in images]).to(x.device)


def _labels(x: Tensor, segments: Tensor | None) -> Tensor:
    """The superpixels numbered 0..S_n - 1 in each image, (N, H * W).

    Raises:
        ExplainError: Segments of another shape than the images'.
    """
    segments = superpixels(x) if segments is None else torch.as_tensor(segments, device=x.device)
    if tuple(segments.shape) != (len(x), *x.shape[2:]):
        raise ExplainError(
            f"irof: segments must be one label image per input, {(len(x), *x.shape[2:])}, got {tuple(segments.shape)}"
        )
    return torch.stack([row.unique(return_inverse=True)[1] for row in segments.flatten(1)])


def irof(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    segments: Tensor | None = None,
    baseline: Baseline = "mean",
    score: MetricScore = "probability",
    batch_size: int = 64,
    model_kwargs: Mapping[str, Any] | None = None,
) -> IrofResult:
    """IROF: each image's superpixels ranked by their mean of the map, highest first, and replaced by the baseline
    one more at a time; the curve is the explained score over the plain image's, from 1 at no superpixel
    removed; IROF is the area over it, 1 - AUC, the x axis the fraction of superpixels removed (the paper's).

    Quantus 0.6.0 leaves the plain image out and steps by 1: its value is ``S - trapz(curve[:, 1:], dx=1)``, S
    the image's superpixels.

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The images the maps explain, (N, C, H, W).
        maps: One map per image, (N, h, w), any resolution.
        target: What the maps explain (see :func:`explain.metrics.deletion`).
        segments: Superpixel labels per image, (N, H, W), any integers; None: SLIC (:func:`superpixels`).
        baseline: What removed superpixels become (Quantus' ``"mean"``: each image's mean value).
        score: The explained class's ``"probability"`` (Quantus' softmax), ``"logit"``, or the target's own.
        batch_size: Most perturbed copies per forward.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        The area over each curve, the curves and their x axes.
    """
    scoring = scorer(model, x, target, score, "irof", batch_size, model_kwargs)
    upsampled = input_maps(maps.to(x.device), len(x), x.shape[2:], "irof").flatten(1)
    labels = _labels(x, segments)
    counts = labels.amax(dim=1) + 1
    sums = torch.zeros(len(x), int(counts.max()), device=x.device).scatter_add_(1, labels, upsampled)
    sizes = torch.zeros_like(sums).scatter_add_(1, labels, torch.ones_like(upsampled))
    means = torch.where(sizes > 0, sums / sizes.clamp_min(1), torch.full_like(sums, -torch.inf))
    order = ranks(means).gather(1, labels)  # each pixel's superpixel's place, most relevant first
    removed = torch.minimum(torch.arange(sums.shape[1] + 1, device=x.device), counts[:, None])
    curve = turned(scoring, order, removed, x, substrate(x, baseline, "irof"), 0) / scoring.original[:, None]
    fractions = removed.float() / counts[:, None]
    return IrofResult(1 - torch.trapezoid(curve, fractions, dim=1), curve, fractions)
