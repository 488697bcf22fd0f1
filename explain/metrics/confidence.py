"""Metrics of the score on the image seen through its map: Average Drop, Increase in Confidence (Chattopadhyay et
al., WACV 2018, Grad-CAM++) and Average Gain (Zhang et al., Opti-CAM, 2023).

The explanation image is the normalized input multiplied by the map, upsampled to the input and min-max
normalized to [0, 1]: where the map is 0 the input becomes 0, the dataset's mean colour for inputs normalized
by its statistics. With Y the explained score of the image and O that of its explanation image (the class's
softmax probability by default):

- drop = max(0, Y - O) / Y x 100 (lower is better);
- increase = 100 where O > Y, else 0 (its mean over images is the percentage; higher is better);
- gain = max(0, O - Y) / (1 - Y) x 100 (higher is better; a probability's, so ``score="probability"`` only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core.maps import normalize_maps
from ..errors import ExplainError
from ..targets import TargetLike
from .scoring import MetricScore, Scorer, input_maps, scorer


@dataclass(frozen=True)
class ConfidenceChange:
    """A score change per image.

    Attributes:
        value: The metric per image, (N,), in percent; its mean over images is the metric's usual figure.
        original: The explained score of each image, (N,).
        explained: The score of each image multiplied by its map, (N,).
    """

    value: Tensor
    original: Tensor
    explained: Tensor


def _scores(metric: str, scoring: Scorer, maps: Tensor) -> tuple[Tensor, Tensor]:
    """The explained score of each image and of the image multiplied by its normalized map."""
    x = scoring.x
    weights = normalize_maps(input_maps(maps.to(x.device), len(x), x.shape[2:], metric), x.dim() - 2)[:, None]
    images = torch.arange(len(x), device=x.device)
    return scoring.original, scoring.copies(images, lambda rows: x[rows] * weights[rows])


def average_drop(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    score: MetricScore = "probability",
    batch_size: int = 16,
    model_kwargs: Mapping[str, Any] | None = None,
) -> ConfidenceChange:
    """Average Drop: max(0, Y - O) / Y x 100 per image; lower is better (see the module's docstring).

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The normalized images the maps explain, (N, C, H, W).
        maps: One map per image, (N, h, w) at any resolution.
        target: What the maps explain, as for :func:`explain.metrics.deletion`.
        score: ``"probability"`` (the paper's), ``"logit"`` or ``"target"``.
        batch_size: Most images per forward.
        model_kwargs: Further keyword arguments of the model's forward.
    """
    return average_drop_of(scorer(model, x, target, score, "average_drop", batch_size, model_kwargs), maps)


def average_drop_of(scoring: Scorer, maps: Tensor) -> ConfidenceChange:
    """:func:`average_drop` with a scorer built for the images and their target (see :func:`scorer`)."""
    original, explained = _scores("average_drop", scoring, maps)
    drop = (original - explained).clamp_min(0) / original.abs().clamp_min(torch.finfo(original.dtype).tiny)
    return ConfidenceChange(100 * drop, original, explained)


def increase_in_confidence(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    score: MetricScore = "probability",
    batch_size: int = 16,
    model_kwargs: Mapping[str, Any] | None = None,
) -> ConfidenceChange:
    """Increase in Confidence: 100 where the explanation image scores higher than the image, else 0; its mean is
    the percentage of images; higher is better. Arguments as for :func:`average_drop`."""
    scoring = scorer(model, x, target, score, "increase_in_confidence", batch_size, model_kwargs)
    return increase_in_confidence_of(scoring, maps)


def increase_in_confidence_of(scoring: Scorer, maps: Tensor) -> ConfidenceChange:
    """:func:`increase_in_confidence` with a scorer built for the images and their target (see :func:`scorer`)."""
    original, explained = _scores("increase_in_confidence", scoring, maps)
    return ConfidenceChange(100 * (explained > original).float(), original, explained)


def average_gain(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    batch_size: int = 16,
    model_kwargs: Mapping[str, Any] | None = None,
) -> ConfidenceChange:
    """Average Gain (Opti-CAM): max(0, O - Y) / (1 - Y) x 100 per image, on the class's softmax probability;
    higher is better. Arguments as for :func:`average_drop`.

    Raises:
        ExplainError: An image's probability is 1, where the gain is not defined.
    """
    return average_gain_of(scorer(model, x, target, "probability", "average_gain", batch_size, model_kwargs), maps)


def average_gain_of(scoring: Scorer, maps: Tensor) -> ConfidenceChange:
    """:func:`average_gain` with a scorer of softmax probabilities built for the images and their target (see
    :func:`scorer`).

    Raises:
        ExplainError: The scorer's scores are not probabilities, or an image's probability is 1.
    """
    if scoring.score != "probability":
        raise ExplainError(f"average_gain is a gain of probability; the scorer scores by {scoring.score!r}")
    original, explained = _scores("average_gain", scoring, maps)
    room = 1 - original
    if bool((room <= 0).any()):
        raise ExplainError(f"average_gain: image {int((room <= 0).nonzero()[0])} scores probability 1; no gain")
    return ConfidenceChange(100 * (explained - original).clamp_min(0) / room, original, explained)
