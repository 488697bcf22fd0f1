"""Metrics that remove pixels in the order a map ranks them and watch the explained score: deletion and insertion
(RISE) and ROAD.

Pixels are ranked by the map upsampled (bilinearly) to the input, highest first; equal values keep raster order.
Every perturbed copy of every image is built on the input's device, a chunk of ``batch_size`` at a time, and
scored by the metric's target (see :func:`explain.metrics.scoring.scorer`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ExplainError
from ..targets import TargetLike
from .imputation import gaussian_blur, noisy_linear_imputation
from .scoring import MetricScore, Scorer, input_maps, scorer

Baseline = float | Tensor | str


@dataclass(frozen=True)
class CurveResult:
    """A deletion or insertion curve per image.

    Attributes:
        auc: The area under each curve by the trapezoid rule over the fraction of pixels changed, (N,); in
            [0, 1] for probabilities.
        curve: The explained score after each step, (N, steps + 1); column 0 is before any pixel changed.
        fractions: The fraction of pixels changed at each step, (steps + 1,), from 0 to 1.
    """

    auc: Tensor
    curve: Tensor
    fractions: Tensor


# The metrics' defaults (RISE's and ROAD's), for the functions here and the export's reports.
STEPS = 50
DELETION_BASELINE = 0.0
INSERTION_BASELINE = "blur"
ROAD_PERCENTILES = (10, 20, 30, 40, 50, 60, 70, 80, 90)
ROAD_NOISE = 0.01
ROAD_SEED = 0


def ranks(maps: Tensor) -> Tensor:
    """Each position's place in its map's order, highest value first (0) and ties in raster order, (N, positions)."""
    flat = maps.flatten(1)
    order = flat.argsort(dim=1, descending=True, stable=True)
    places = torch.arange(flat.shape[1], device=flat.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, places)


def substrate(x: Tensor, baseline: Baseline, metric: str) -> Tensor:
    """What removed pixels show: a constant, a tensor broadcast to x, ``"blur"`` (see :func:`gaussian_blur`), or
    each image's own ``"black"``, ``"white"`` or ``"mean"`` (its least, greatest or mean value, as Quantus'
    baselines of those names)."""
    if isinstance(baseline, str):
        own = {"black": torch.amin, "white": torch.amax, "mean": torch.mean}.get(baseline)
        if own is not None:
            return own(x, dim=tuple(range(1, x.dim())), keepdim=True).expand_as(x)
        if baseline != "blur":
            raise ExplainError(
                f"{metric}: baseline must be a number, a tensor, 'blur', 'black', 'white' or 'mean', got {baseline!r}"
            )
        return gaussian_blur(x)
    if isinstance(baseline, Tensor):
        try:
            return baseline.to(x.device, x.dtype).expand_as(x)
        except RuntimeError:
            raise ExplainError(
                f"{metric}: a baseline of shape {tuple(baseline.shape)} does not broadcast to the images' "
                f"{tuple(x.shape)}"
            ) from None
    return torch.full_like(x, float(baseline))


def _curve(
    metric: str, scoring: Scorer, maps: Tensor, start: Baseline | None, end: Baseline | None, steps: int
) -> CurveResult:
    """Pixels turned, in the map's order, from ``start`` to ``end`` (None: the image itself) in ``steps`` equal
    steps, the explained score after each."""
    x = scoring.x
    if steps < 1:
        raise ExplainError(f"{metric}: steps must be >= 1, got {steps}")
    order = ranks(input_maps(maps.to(x.device), len(x), x.shape[2:], metric))
    pixels = order.shape[1]
    counts = torch.round(torch.arange(steps + 1, device=x.device) * pixels / steps).long()
    before = x if start is None else substrate(x, start, metric)
    after = x if end is None else substrate(x, end, metric)
    # The step whose copy is the image itself (deletion's first, insertion's last) takes its plain score.
    curve = turned(scoring, order, counts.expand(len(x), -1), before, after, 0 if start is None else steps)
    fractions = counts.float() / pixels
    return CurveResult(torch.trapezoid(curve, fractions, dim=1), curve, fractions)


def turned(scoring: Scorer, order: Tensor, counts: Tensor, before: Tensor, after: Tensor, own: int | None) -> Tensor:
    """The explained score of each image at each step, (N, S): at step s, the positions of each image whose place
    in ``order`` (N, positions) is below ``counts[n, s]`` (N, S) show ``after``, the others ``before``. Step
    ``own`` (whose copy is the image itself) takes the plain score without a forward; None: every step runs. A
    step whose count repeats the step before it (an image with fewer regions than the others) is that step's
    copy again: it takes that step's score, without a forward."""
    x = scoring.x
    runs = torch.ones_like(counts, dtype=torch.bool)
    runs[:, 1:] = counts[:, 1:] != counts[:, :-1]
    if own is not None:
        runs[:, own] = False
    images, step = runs.nonzero(as_tuple=True)

    def make(rows: Tensor) -> Tensor:
        changed = (order[images[rows]] < counts[images[rows], step[rows], None]).view(len(rows), 1, *x.shape[2:])
        return torch.where(changed, after[images[rows]], before[images[rows]])

    curve = torch.full(counts.shape, torch.nan, device=x.device)
    if own is not None:
        curve[:, own] = scoring.original
    curve[images, step] = scoring.copies(images, make)
    filled = torch.where(runs | (torch.arange(counts.shape[1], device=x.device) == (own if own is not None else -1)),
                         torch.arange(counts.shape[1], device=x.device), 0).cummax(dim=1).values  # fmt: skip
    return curve.gather(1, filled)


def deletion(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    steps: int = STEPS,
    baseline: Baseline = DELETION_BASELINE,
    score: MetricScore = "probability",
    batch_size: int = 16,
    model_kwargs: Mapping[str, Any] | None = None,
) -> CurveResult:
    """Deletion (Petsiuk et al., BMVC 2018, RISE): the map's pixels, highest first, replaced by the baseline in
    ``steps`` equal steps; a faithful map makes the score fall fast (a low AUC is better).

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The normalized images the maps explain, (N, C, H, W).
        maps: One map per image, (N, h, w) at any resolution (``result.cams`` or ``result.raw``).
        target: What the maps explain: None for each image's top class, a class or one per image, a
            ``ClassTarget``, a result's bound target (``result.target``), or with ``score="target"`` any target.
        steps: How many steps; each changes 1/steps of the pixels. 50 by default (2% a step); RISE's code
            changes 224 pixels a step at 224x224, ``steps=224``.
        baseline: What deleted pixels become in the normalized input: 0 (the dataset's mean colour, as RISE's
            code), another number, a tensor broadcast to x, or ``"blur"``.
        score: The explained class's softmax ``"probability"`` (RISE's), its ``"logit"``, or the target's own
            score (``"target"``).
        batch_size: Most perturbed copies per forward.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        The AUC, the curve and the fraction deleted at each step.
    """
    return deletion_of(scorer(model, x, target, score, "deletion", batch_size, model_kwargs), maps, steps, baseline)


def deletion_of(scoring: Scorer, maps: Tensor, steps: int, baseline: Baseline) -> CurveResult:
    """:func:`deletion` with a scorer built for the images and their target (see :func:`scorer`)."""
    return _curve("deletion", scoring, maps, None, baseline, steps)


def insertion(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    steps: int = STEPS,
    baseline: Baseline = INSERTION_BASELINE,
    score: MetricScore = "probability",
    batch_size: int = 16,
    model_kwargs: Mapping[str, Any] | None = None,
) -> CurveResult:
    """Insertion (Petsiuk et al., BMVC 2018, RISE): starting from the baseline, the map's pixels, highest first,
    revealed in ``steps`` equal steps; a faithful map makes the score rise fast (a high AUC is better). The
    arguments not named here are those of :func:`deletion`.

    Args:
        baseline: The start: ``"blur"`` (RISE's: an 11x11 Gaussian of sigma 5 over the normalized input, zero
            padded), a number or a tensor broadcast to x.

    Returns:
        The AUC, the curve and the fraction revealed at each step.
    """
    return insertion_of(scorer(model, x, target, score, "insertion", batch_size, model_kwargs), maps, steps, baseline)


def insertion_of(scoring: Scorer, maps: Tensor, steps: int, baseline: Baseline) -> CurveResult:
    """:func:`insertion` with a scorer built for the images and their target (see :func:`scorer`)."""
    return _curve("insertion", scoring, maps, baseline, None, steps)


@dataclass(frozen=True)
class RoadResult:
    """ROAD's scores per image and percentile.

    Attributes:
        percentiles: The percentages of pixels removed, (P,).
        morf: The explained score with the map's most relevant pixels removed, (N, P): lower is better.
        lerf: The score with its least relevant pixels removed, (N, P): higher is better.
    """

    percentiles: Tensor
    morf: Tensor
    lerf: Tensor

    @property
    def combined(self) -> Tensor:
        """(LeRF - MoRF) / 2 averaged over the percentiles, (N,): higher is better."""
        return (self.lerf - self.morf).mean(dim=1) / 2


def road(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    percentiles: Sequence[float] = ROAD_PERCENTILES,
    noise: float = ROAD_NOISE,
    score: MetricScore = "probability",
    batch_size: int = 16,
    seed: int | None = ROAD_SEED,
    model_kwargs: Mapping[str, Any] | None = None,
) -> RoadResult:
    """ROAD, RemOve And Debias (Rong et al., ICML 2022): at each percentile p, the map's p% most relevant pixels
    (MoRF) or its p% least relevant (LeRF) are removed and filled by the noisy linear imputer (see
    :func:`explain.metrics.imputation.noisy_linear_imputation`), which leaves little trace of the removed
    shape for the model to read. The arguments not named here are those of :func:`deletion`.

    Args:
        percentiles: Percentages of pixels removed, each in (0, 100).
        noise: The imputer's noise, standard deviation in the normalized input's units (ROAD's 0.01).
        seed: Seed of the noise, drawn on the input's device; None uses PyTorch's global generator.

    Returns:
        The scores per image and percentile, MoRF and LeRF.
    """
    scoring = scorer(model, x, target, score, "road", batch_size, model_kwargs)
    return road_of(scoring, maps, percentiles, noise, seed)


def road_of(scoring: Scorer, maps: Tensor, percentiles: Sequence[float], noise: float, seed: int | None) -> RoadResult:
    """:func:`road` with a scorer built for the images and their target (see :func:`scorer`)."""
    x = scoring.x
    shares = torch.tensor([float(p) for p in percentiles], device=x.device)
    if shares.dim() != 1 or len(shares) == 0 or not bool(((shares > 0) & (shares < 100)).all()):
        raise ExplainError(f"road: percentiles must lie strictly between 0 and 100, got {list(percentiles)}")
    if x.dim() != 4:
        raise ExplainError(
            "road imputes removed pixels from their 8 neighbours in the image plane, which signals and volumes lack; "
            "use deletion or insertion"
        )
    order = ranks(input_maps(maps.to(x.device), len(x), x.shape[2:], "road"))
    pixels = order.shape[1]
    counts = torch.round(shares / 100 * pixels).long()
    generator = None if seed is None else torch.Generator(device=x.device).manual_seed(seed)
    p = len(shares)
    images = torch.arange(len(x), device=x.device).repeat_interleave(2 * p)  # per image: MoRF then LeRF
    column = torch.arange(2 * p, device=x.device).repeat(len(x))

    def make(rows: Tensor) -> Tensor:
        place, count = order[images[rows]], counts[column[rows] % p, None]
        most = column[rows, None] < p
        removed = torch.where(most, place < count, place >= pixels - count)
        return noisy_linear_imputation(x[images[rows]], removed, noise, generator)

    scores = scoring.copies(images, make).view(len(x), 2, p)
    return RoadResult(shares, scores[:, 0], scores[:, 1])
