"""Properties an attribution should have whatever the model: completeness (its sum is the score's change from the
baseline) and non-sensitivity (the features it gives nothing are those the score ignores)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..targets import TargetLike
from .faithfulness import replaced_copies
from .infidelity import per_element
from .perturbation import Baseline, substrate
from .scoring import MetricScore, scorer


def completeness(
    model: nn.Module,
    x: Tensor,
    attributions: Tensor,
    target: TargetLike = None,
    *,
    baseline: Baseline = 0.0,
    score: MetricScore = "logit",
    relative: bool = False,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """Completeness (Sundararajan et al., "Axiomatic attribution for deep networks", ICML 2017): how far the
    attribution's sum is from the score's change from the baseline, sum(R) - (f(x) - f(x')). Integrated Gradients
    and DeepLift are complete by construction, up to their numerical error (their result's ``completeness``).

    Quantus 0.6.0 tests the max-normalized attribution's sum for exact equality with the change, which almost
    never holds in floating point; this reports the gap itself.

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The images, (N, C, H, W).
        attributions: Per element (N, C, H, W), or one map per image (N, h, w) shared by the channels.
        target: What the attributions explain (see :func:`explain.metrics.deletion`).
        baseline: The baseline x' (the number, tensor or per-image ``"black"``, ``"white"`` or ``"mean"``).
        score: The explained class's ``"logit"``, ``"probability"``, or the target's own.
        relative: Divide the gap by |f(x) - f(x')|.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        Each image's gap, (N,).
    """
    scoring = scorer(model, x, target, score, "completeness", 1, model_kwargs)
    reference = substrate(x, baseline, "completeness")
    at_baseline = scoring.copies(torch.arange(len(x), device=x.device), lambda rows: reference[rows])
    change = scoring.original - at_baseline
    gap = per_element(attributions, x, "completeness").flatten(1).double().sum(dim=1) - change.double()
    return (gap / change.double().abs() if relative else gap).float()


def non_sensitivity(
    model: nn.Module,
    x: Tensor,
    attributions: Tensor,
    target: TargetLike = None,
    *,
    eps: float = 1e-5,
    features_in_step: int = 1,
    baseline: Baseline = "black",
    score: MetricScore = "probability",
    batch_size: int = 64,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """Non-sensitivity (Nguyen and Martinez, "On quantitative aspects of model interpretability", 2020): the count
    of pixels where the attribution and the model disagree: a pixel with an attribution below ``eps`` whose
    replacement moves the score by ``eps`` or more, or one above it whose replacement does not. Lower is better.

    Pixels are replaced ``features_in_step`` at a time, in raster order; each pixel of a group counts the group's
    move (Quantus 0.6.0 fails for groups of more than one feature).

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The images, (N, C, H, W).
        attributions: One map per image (N, h, w), or per element (N, C, H, W) (summed over the channels).
        target: What the attributions explain (see :func:`explain.metrics.deletion`).
        eps: The least attribution, and the least move of the score, that count.
        features_in_step: Pixels replaced together.
        baseline: What replaced pixels become (Quantus' ``"black"``).
        score: The explained class's ``"probability"`` (Quantus' softmax), ``"logit"``, or the target's own.
        batch_size: Most perturbed copies per forward.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        Each image's count of disagreeing pixels, (N,).
    """
    scoring = scorer(model, x, target, score, "non_sensitivity", batch_size, model_kwargs)
    spread = per_element(attributions, x, "non_sensitivity")
    values = (spread.sum(dim=1) if attributions.shape == x.shape else spread[:, 0]).flatten(1).abs()
    pixels = values.shape[1]
    group = torch.arange(pixels, device=x.device) // max(features_in_step, 1)
    groups = math.ceil(pixels / max(features_in_step, 1))
    after = substrate(x, baseline, "non_sensitivity")
    scores = replaced_copies(scoring, groups, lambda i, k: group[None] == k[:, None], after)
    still = (scores - scoring.original[:, None]).abs() < eps  # (N, groups)
    return (still[:, group] ^ (values < eps)).sum(dim=1)
