"""Faithfulness by perturbation: in the map's order, step by step (pixel flipping, region perturbation,
selectivity, monotonicity), group by group (faithfulness estimate) or in random subsets (faithfulness
correlation). Deletion, insertion and ROAD are in :mod:`explain.metrics.perturbation`, whose machinery these share:
every perturbed copy of every image is built on the input's device and scored a chunk of ``batch_size`` at a time
(Quantus runs one forward per step of its loop).

Maps are upsampled (bilinearly) to the input first. Positions are ranked by the map, highest first (ties in raster
order); regions by the sum of the map over them. Baselines: a number, a tensor broadcast to x, or each image's own
``"black"`` (its least value), ``"white"`` (its greatest) or ``"mean"``, as Quantus names them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..errors import ExplainError
from ..targets import TargetLike
from .perturbation import Baseline, CurveResult, ranks, substrate, turned
from .scoring import MetricScore, Scorer, input_maps, scorer
from .similarity import pearson, spearman


def pixel_flipping(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    features_in_step: int = 1,
    baseline: Baseline = "black",
    score: MetricScore = "probability",
    batch_size: int = 64,
    model_kwargs: Mapping[str, Any] | None = None,
) -> CurveResult:
    """Pixel flipping (Bach et al., "On pixel-wise explanations for non-linear classifier decisions by layer-wise
    relevance propagation", PLoS ONE 2015): the map's pixels, highest first, replaced by the baseline
    ``features_in_step`` at a time; a faithful map makes the score fall fast.

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The images the maps explain, (N, C, H, W).
        maps: One map per image, (N, h, w), any resolution.
        target: What the maps explain (see :func:`explain.metrics.deletion`).
        features_in_step: Pixels replaced per step (every channel of a pixel at once).
        baseline: What replaced pixels become (Quantus' ``"black"``: each image's least value).
        score: The explained class's ``"probability"`` (Quantus' softmax), ``"logit"``, or the target's own.
        batch_size: Most perturbed copies per forward.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        The curve (N, steps + 1), column 0 the plain image, each next column the score after one more step (what
        Quantus returns, without column 0); its AUC over the fraction of pixels replaced; the fractions.
    """
    if features_in_step < 1:
        raise ExplainError(f"pixel_flipping: features_in_step must be >= 1, got {features_in_step}")
    scoring = scorer(model, x, target, score, "pixel_flipping", batch_size, model_kwargs)
    order = ranks(input_maps(maps.to(x.device), len(x), x.shape[2:], "pixel_flipping"))
    pixels = order.shape[1]
    counts = stepped(pixels, features_in_step, x.device)
    curve = turned(scoring, order, counts.expand(len(x), -1), x, substrate(x, baseline, "pixel_flipping"), 0)
    fractions = counts.float() / pixels
    return CurveResult(torch.trapezoid(curve, fractions, dim=1), curve, fractions)


def stepped(pixels: int, features_in_step: int, device: torch.device) -> Tensor:
    """How many pixels are changed after each step of ``features_in_step``, from 0 to all, (steps + 1,)."""
    steps = math.ceil(pixels / features_in_step)
    return (torch.arange(steps + 1, device=device) * features_in_step).clamp_max(pixels)


Order = Literal["morf", "lerf", "random"]


def region_ranks(maps: Tensor, patch: int, order: Order, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Square regions of ``patch`` pixels a side, on a grid centred on the image (where the image is not a whole
    number of regions, those at its edges are cut, alike on both sides), ranked by the sum of the map over them:
    ``"morf"`` most relevant first, ``"lerf"`` least relevant first, or a random order per image.

    Args:
        maps: The maps at the input's size, (N, H, W).
        patch: A region's side.
        order: How regions are ranked.
        generator: The random order's generator.

    Returns:
        Each pixel's place (N, H * W), a region's pixels taking consecutive places in the regions' order; and how
        many pixels the first k regions hold, (N, regions + 1).
    """
    n, (height, width) = len(maps), maps.shape[1:]
    rows, columns = math.ceil(height / patch), math.ceil(width / patch)
    # the grid centred on the image: the regions at both edges are cut alike (Quantus pads so)
    ys = (torch.arange(height, device=maps.device) + (rows * patch - height) // 2) // patch
    xs = (torch.arange(width, device=maps.device) + (columns * patch - width) // 2) // patch
    region = (ys[:, None] * columns + xs[None, :]).flatten()  # each pixel's region, row-major
    sizes = torch.bincount(region, minlength=rows * columns)
    sums = torch.zeros(n, rows * columns, device=maps.device).index_add_(1, region, maps.flatten(1).float())
    if order == "random":
        ranked = torch.rand(n, rows * columns, generator=generator).argsort(dim=1).to(maps.device)
    elif order in ("morf", "lerf"):
        ranked = sums.argsort(dim=1, descending=order == "morf", stable=True)
    else:
        raise ExplainError(f"order must be 'morf', 'lerf' or 'random', got {order!r}")
    held = sizes[ranked].cumsum(dim=1)  # (N, regions): pixels of the first k + 1 regions
    start = torch.empty_like(held).scatter_(1, ranked, held - sizes[ranked])  # each region's first place
    by_region = region.argsort(stable=True)  # the pixels region by region, each region's in raster order
    offsets = torch.empty_like(region)
    offsets[by_region] = torch.arange(len(region), device=maps.device) - (sizes.cumsum(0) - sizes)[region[by_region]]
    return start[:, region] + offsets, torch.cat([held.new_zeros(n, 1), held], dim=1)


@dataclass(frozen=True)
class RegionResult:
    """Region perturbation's scores per image.

    Attributes:
        drops: The explained score's drop after each of the first regions replaced, f(x) - f(x_k), (N, regions).
        aopc: The area over the perturbation curve, the mean drop over k = 0 (no region, no drop) to the last
            region, (N,): higher is better for MoRF.
    """

    drops: Tensor
    aopc: Tensor


def region_perturbation(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    patch_size: int = 8,
    order: Order = "morf",
    regions: int = 100,
    baseline: Baseline = "black",
    score: MetricScore = "probability",
    seed: int | None = 0,
    batch_size: int = 64,
    model_kwargs: Mapping[str, Any] | None = None,
) -> RegionResult:
    """Region perturbation (Samek et al., "Evaluating the visualization of what a deep neural network has
    learned", IEEE TNNLS 2017): square regions, ranked by the map's sum over them, replaced one more at a time;
    AOPC = 1 / (L + 1) sum_{k=0}^{L} (f(x) - f(x_k)). Samek et al. fill a region with uniform noise; Quantus' and
    this default is each image's least value (``"black"``); any baseline can be given.

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The images the maps explain, (N, C, H, W).
        maps: One map per image, (N, h, w), any resolution.
        target: What the maps explain (see :func:`explain.metrics.deletion`).
        patch_size: A region's side, in pixels.
        order: ``"morf"`` (most relevant first), ``"lerf"`` or ``"random"``.
        regions: How many regions are replaced, at most all.
        baseline: What replaced pixels become.
        score: The explained class's ``"probability"`` (Quantus' softmax), ``"logit"``, or the target's own.
        seed: The random order's seed (None: PyTorch's global generator).
        batch_size: Most perturbed copies per forward.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        The drops after each region (what Quantus returns) and the AOPC.
    """
    scoring = scorer(model, x, target, score, "region_perturbation", batch_size, model_kwargs)
    places, held = _regions(x, maps, patch_size, order, seed, "region_perturbation")
    held = held[:, : regions + 1]
    after = turned(scoring, places, held, x, substrate(x, baseline, "region_perturbation"), 0)
    drops = scoring.original[:, None] - after
    return RegionResult(drops[:, 1:], drops.mean(dim=1))


def _regions(
    x: Tensor, maps: Tensor, patch_size: int, order: Order, seed: int | None, metric: str
) -> tuple[Tensor, Tensor]:
    """The regions' places and sizes (see :func:`region_ranks`) of maps brought to the input."""
    if patch_size < 1:
        raise ExplainError(f"{metric}: patch_size must be >= 1, got {patch_size}")
    if x.dim() != 4:
        raise ExplainError(f"{metric} perturbs square regions of an image (N, C, H, W), got {tuple(x.shape)}")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return region_ranks(input_maps(maps.to(x.device), len(x), x.shape[2:], metric), patch_size, order, generator)


def selectivity(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    patch_size: int = 8,
    baseline: Baseline = "black",
    score: MetricScore = "probability",
    batch_size: int = 64,
    model_kwargs: Mapping[str, Any] | None = None,
) -> CurveResult:
    """Selectivity (Montavon et al., "Methods for interpreting and understanding deep neural networks", Digital
    Signal Processing 2018): square regions, most relevant first, replaced one more at a time until none is left;
    a faithful map makes the score fall fast (a low AUC is better).

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The images the maps explain, (N, C, H, W).
        maps: One map per image, (N, h, w), any resolution.
        target: What the maps explain (see :func:`explain.metrics.deletion`).
        patch_size: A region's side, in pixels.
        baseline: What replaced pixels become (Quantus' ``"black"``).
        score: The explained class's ``"probability"`` (Quantus' softmax), ``"logit"``, or the target's own.
        batch_size: Most perturbed copies per forward.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        The curve (N, regions + 1), column 0 the plain image (Quantus returns the others); its AUC over the
        fraction of regions replaced; the fractions.
    """
    scoring = scorer(model, x, target, score, "selectivity", batch_size, model_kwargs)
    places, held = _regions(x, maps, patch_size, "morf", None, "selectivity")
    curve = turned(scoring, places, held, x, substrate(x, baseline, "selectivity"), 0)
    fractions = torch.linspace(0, 1, held.shape[1], device=x.device)
    return CurveResult(torch.trapezoid(curve, fractions, dim=1), curve, fractions)


def replaced_copies(
    scoring: Scorer,
    per_image: int,
    changed: Callable[[Tensor, Tensor], Tensor],
    after: Tensor | Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    """The explained score of ``per_image`` copies of each image, (N, per_image): copy j of image i shows ``after``
    (an image per image, or ``after(images, columns)``, an image per row) where ``changed(images, columns)`` (the
    rows' image and copy numbers) is True, (rows, H * W), the image elsewhere."""
    x = scoring.x
    images = torch.arange(len(x), device=x.device).repeat_interleave(per_image)
    columns = torch.arange(per_image, device=x.device).repeat(len(x))

    def make(rows: Tensor) -> Tensor:
        mask = changed(images[rows], columns[rows]).view(len(rows), 1, *x.shape[2:])
        shown = after(images[rows], columns[rows]) if callable(after) else after[images[rows]]
        return torch.where(mask, shown, x[images[rows]])

    return scoring.copies(images, make).view(len(x), per_image)


def faithfulness_estimate(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    features_in_step: int = 1,
    baseline: Baseline = "black",
    score: MetricScore = "logit",
    batch_size: int = 64,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """Faithfulness estimate (Alvarez-Melis and Jaakkola, "Towards robust interpretability with self-explaining
    neural networks", NeurIPS 2018): the map's pixels, highest first, taken ``features_in_step`` at a time, each
    group alone replaced by the baseline in a copy of the image; Pearson's correlation between each group's sum of
    the map and the score's drop, f(x) - f(x without the group). Higher is better.

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The images the maps explain, (N, C, H, W).
        maps: One map per image, (N, h, w), any resolution.
        target: What the maps explain (see :func:`explain.metrics.deletion`).
        features_in_step: Pixels per group.
        baseline: What replaced pixels become (Quantus' ``"black"``).
        score: The explained class's ``"logit"`` (Quantus' default), ``"probability"``, or the target's own.
        batch_size: Most perturbed copies per forward.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        Each image's correlation, (N,).
    """
    scoring = scorer(model, x, target, score, "faithfulness_estimate", batch_size, model_kwargs)
    upsampled = input_maps(maps.to(x.device), len(x), x.shape[2:], "faithfulness_estimate").flatten(1)
    order, pixels = ranks(upsampled), upsampled.shape[1]
    groups = math.ceil(pixels / max(features_in_step, 1))
    group = order // max(features_in_step, 1)  # each pixel's group, highest values first
    after = substrate(x, baseline, "faithfulness_estimate")
    scores = replaced_copies(scoring, groups, lambda i, k: group[i] == k[:, None], after)
    sums = torch.zeros(len(x), groups, device=x.device).scatter_add_(1, group, upsampled)
    return pearson(sums, scoring.original[:, None] - scores)


def faithfulness_correlation(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    runs: int = 100,
    subset_size: int = 224,
    subsets: Tensor | None = None,
    baseline: Baseline = "black",
    score: MetricScore = "logit",
    seed: int | None = 0,
    batch_size: int = 64,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """Faithfulness correlation (Bhatt et al., "Evaluating and aggregating feature-based model explanations", IJCAI
    2020): ``runs`` random subsets of ``subset_size`` pixels, each replaced by the baseline in a copy of the
    image; Pearson's correlation between a subset's sum of the map and the score's drop. Higher is better.

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The images the maps explain, (N, C, H, W).
        maps: One map per image, (N, h, w), any resolution.
        target: What the maps explain (see :func:`explain.metrics.deletion`).
        runs: How many subsets per image.
        subset_size: Pixels per subset.
        subsets: The subsets themselves, pixel indices (row-major) of shape (N, runs, subset_size), drawn here
            when None (without replacement, from ``seed``).
        baseline: What replaced pixels become (Quantus' ``"black"``).
        score: The explained class's ``"logit"`` (Quantus' default), ``"probability"``, or the target's own.
        seed: The subsets' seed (None: PyTorch's global generator).
        batch_size: Most perturbed copies per forward.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        Each image's correlation, (N,).
    """
    scoring = scorer(model, x, target, score, "faithfulness_correlation", batch_size, model_kwargs)
    upsampled = input_maps(maps.to(x.device), len(x), x.shape[2:], "faithfulness_correlation").flatten(1)
    subsets = _subsets(subsets, len(x), runs, subset_size, upsampled.shape[1], seed).to(x.device)
    chosen = torch.zeros(len(x), subsets.shape[1], upsampled.shape[1], dtype=torch.bool, device=x.device)
    chosen.scatter_(2, subsets, True)
    after = substrate(x, baseline, "faithfulness_correlation")
    scores = replaced_copies(scoring, subsets.shape[1], lambda i, k: chosen[i, k], after)
    sums = upsampled.gather(1, subsets.flatten(1)).view(subsets.shape).sum(dim=2)
    return pearson(sums, scoring.original[:, None] - scores)


def _subsets(given: Tensor | None, n: int, runs: int, size: int, pixels: int, seed: int | None) -> Tensor:
    """Random subsets of pixels, (N, runs, size), each without repetition: the ones given, checked, or drawn.

    Raises:
        ExplainError: Subsets of another shape, or pixels outside the image.
    """
    if given is None:
        if not 0 < size <= pixels:
            raise ExplainError(f"subset_size must lie in 1..{pixels} (the image's pixels), got {size}")
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        return torch.rand(n, runs, pixels, generator=generator).argsort(dim=2)[..., :size]
    given = torch.as_tensor(given).long()
    if given.dim() != 3 or len(given) != n or not bool(((given >= 0) & (given < pixels)).all()):
        raise ExplainError(f"subsets must be pixel indices (N, runs, size) with N = {n}, each in 0..{pixels - 1}")
    return given


def monotonicity(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    features_in_step: int = 1,
    baseline: Baseline = "black",
    score: MetricScore = "probability",
    batch_size: int = 64,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """Monotonicity (Arya et al., "One explanation does not fit all", 2019): from the baseline, the image's pixels
    added back ``features_in_step`` at a time in the order of the map's magnitude, least first; the explanation is
    monotonic where the score never falls as pixels come back.

    Quantus 0.6.0 writes the baseline over the baseline instead of adding the image's pixels back, so its scores
    never change and every map is monotonic there; this follows the paper.

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The images the maps explain, (N, C, H, W).
        maps: One map per image, (N, h, w), any resolution; ranked by their absolute values.
        target: What the maps explain (see :func:`explain.metrics.deletion`).
        features_in_step: Pixels added back per step.
        baseline: The start (Quantus' ``"black"``: each image's least value).
        score: The explained class's ``"probability"`` (Quantus' softmax), ``"logit"``, or the target's own.
        batch_size: Most perturbed copies per forward.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        Whether each image's scores rise monotonically, (N,) bool.
    """
    scoring = scorer(model, x, target, score, "monotonicity", batch_size, model_kwargs)
    magnitude = input_maps(maps.to(x.device), len(x), x.shape[2:], "monotonicity").abs()
    order = ranks(-magnitude)  # least first
    counts = stepped(order.shape[1], max(features_in_step, 1), x.device)[1:]
    start = substrate(x, baseline, "monotonicity")
    curve = turned(scoring, order, counts.expand(len(x), -1), start, x, len(counts) - 1)
    return (curve.diff(dim=1) >= 0).all(dim=1)


def monotonicity_correlation(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    target: TargetLike = None,
    *,
    features_in_step: int = 1,
    samples: int = 100,
    low: float = 0.0,
    high: float = 1.0,
    perturbations: Tensor | None = None,
    seed: int | None = 0,
    score: MetricScore = "probability",
    batch_size: int = 64,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """Monotonicity correlation (Nguyen and Martinez, "On quantitative aspects of model interpretability", 2020):
    the pixels, least relevant first, taken ``features_in_step`` at a time; each group alone is replaced by
    ``samples`` random values from the prior (uniform in [low, high]) and the score's variance around f(x),
    E[(f(x) - f(x with the group replaced))²], recorded. Spearman's correlation between each group's sum of |map|
    and that variance. Higher is better: a relevant group moves the score more.

    Quantus 0.6.0 replaces a group by one uniform value per draw (not one per element) and divides each variance
    by f(x)², which leaves the correlation unchanged; its draws are passed as ``perturbations`` to reproduce it.

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The images the maps explain, (N, C, H, W).
        maps: One map per image, (N, h, w), any resolution; ranked by their absolute values.
        target: What the maps explain (see :func:`explain.metrics.deletion`).
        features_in_step: Pixels per group (every channel of a pixel goes with it).
        samples: Draws per group.
        low: The prior's least value, in the input's units.
        high: The prior's greatest value.
        perturbations: The values themselves, (N, samples, C, H, W): draw s shows them where the group is
            replaced; drawn from ``seed`` when None.
        seed: The draws' seed (None: PyTorch's global generator).
        score: The explained class's ``"probability"`` (Quantus' softmax), ``"logit"``, or the target's own.
        batch_size: Most perturbed copies per forward.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        Each image's correlation, (N,).
    """
    scoring = scorer(model, x, target, score, "monotonicity_correlation", batch_size, model_kwargs)
    magnitude = input_maps(maps.to(x.device), len(x), x.shape[2:], "monotonicity_correlation").abs().flatten(1)
    step = max(features_in_step, 1)
    group, groups = ranks(-magnitude) // step, math.ceil(magnitude.shape[1] / step)  # least relevant first
    if perturbations is None:
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        perturbations = torch.rand((len(x), samples, *x.shape[1:]), generator=generator) * (high - low) + low
    if perturbations.shape[0] != len(x) or perturbations.shape[2:] != x.shape[1:]:
        raise ExplainError(f"perturbations must be (N, samples, *x.shape[1:]), got {tuple(perturbations.shape)}")
    drawn, samples = perturbations.to(x.device, x.dtype), perturbations.shape[1]
    scores = replaced_copies(
        scoring, groups * samples, lambda i, k: group[i] == (k // samples)[:, None], lambda i, k: drawn[i, k % samples]
    ).view(len(x), groups, samples)
    variance = (scores - scoring.original[:, None, None]).square().mean(dim=2)
    sums = torch.zeros(len(x), groups, device=x.device).scatter_add_(1, group, magnitude)
    return spearman(sums, variance)
