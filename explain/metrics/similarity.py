"""How alike two batches of maps or values are, row by row: Pearson's and Spearman's correlations and the
structural similarity (SSIM), each batched on the maps' device."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .imputation import gaussian_line, separable_filter


def pearson(a: Tensor, b: Tensor) -> Tensor:
    """Pearson's correlation of each row of ``a`` with the same row of ``b``, (N,); NaN where a row is constant."""
    a, b = a.double() - a.double().mean(dim=1, keepdim=True), b.double() - b.double().mean(dim=1, keepdim=True)
    spread = (a.square().sum(dim=1) * b.square().sum(dim=1)).sqrt()
    return torch.where(spread > 0, (a * b).sum(dim=1) / spread, torch.full_like(spread, float("nan"))).float()


def average_ranks(values: Tensor) -> Tensor:
    """The rank of each value in its row (0-based), ties given their mean rank, (N, M) float64."""
    n, m = values.shape
    ordered, order = values.sort(dim=1, stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    group = starts.flatten().cumsum(0) - 1  # ties share a group, numbered across rows
    places = torch.arange(m, device=values.device, dtype=torch.float64).repeat(n)
    sums = torch.zeros(int(group[-1]) + 1, device=values.device, dtype=torch.float64).index_add_(0, group, places)
    sizes = torch.zeros_like(sums).index_add_(0, group, torch.ones_like(places))
    return torch.empty_like(places).view(n, m).scatter_(1, order, (sums / sizes)[group].view(n, m))


def _centred_ranks(t: Tensor) -> tuple[Tensor, Tensor]:
    """Each map's average ranks less their mean, (N, M) float64, and their norm, (N,)."""
    ranks = average_ranks(t.flatten(1))
    ranks = ranks - ranks.mean(dim=1, keepdim=True)
    return ranks, ranks.norm(dim=1)


def spearman_to(reference: Tensor) -> Callable[[Tensor], Tensor]:
    """Spearman's rank correlation with the maps ``reference`` (N, ...), as a function of other maps (N, ...): the
    reference ranked once, for comparisons with many (see :func:`spearman`)."""
    ra, spread_a = _centred_ranks(reference)

    def correlation(b: Tensor) -> Tensor:
        rb, spread_b = _centred_ranks(b)
        flat = torch.where((spread_a == 0) & (spread_b == 0), 1.0, 0.0).to(ra.dtype)
        spread = spread_a * spread_b
        return torch.where(spread > 0, (ra * rb).sum(dim=1) / spread.clamp_min(1e-300), flat).float()

    return correlation


def spearman(a: Tensor, b: Tensor) -> Tensor:
    """Spearman's rank correlation of each pair of maps (N, H, W), (N,); where a map is flat, 1 if the other is
    flat too (nothing changed) and 0 if not."""
    return spearman_to(a)(b)


def ssim_to(
    reference: Tensor, window: int = 11, sigma: float | None = 1.5, data_range: float | Tensor = 1.0
) -> Callable[[Tensor], Tensor]:
    """The mean structural similarity with the maps ``reference`` (N, *spatial), as a function of other maps:
    the reference's local means and variances computed once (see :func:`ssim`)."""
    a = reference.double()
    sizes = [min(window, side - 1 + side % 2) for side in a.shape[1:]]
    if sigma is None:
        lines = [torch.full((size,), 1.0 / size, dtype=a.dtype, device=a.device) for size in sizes]
        samples = math.prod(sizes)
        correction = samples / (samples - 1) if samples > 1 else 1.0
    else:
        lines, correction = [gaussian_line(size, sigma, a) for size in sizes], 1.0

    def local(t: Tensor) -> Tensor:
        return separable_filter(t, lines, padding=0)

    mean_a = local(a)
    var_a = correction * (local(a * a) - mean_a**2)
    spread = torch.as_tensor(data_range, dtype=a.dtype, device=a.device).reshape(-1, *[1] * (a.dim() - 1))
    c1, c2 = (0.01 * spread) ** 2, (0.03 * spread) ** 2

    def similarity(other: Tensor) -> Tensor:
        b = other.double()
        mean_b = local(b)
        var_b, cov = correction * (local(b * b) - mean_b**2), correction * (local(a * b) - mean_a * mean_b)
        index = ((2 * mean_a * mean_b + c1) * (2 * cov + c2)) / ((mean_a**2 + mean_b**2 + c1) * (var_a + var_b + c2))
        return index.flatten(1).mean(dim=1).float()

    return similarity


def ssim(a: Tensor, b: Tensor, window: int = 11, sigma: float | None = 1.5, data_range: float | Tensor = 1.0) -> Tensor:
    """The mean structural similarity of each pair of maps (N, *spatial), (N,): Wang et al. 2004, C1 = (0.01 R)²,
    C2 = (0.03 R)² for the data range R (a number, or one per pair), over the windows that fit inside the map.

    The window: a Gaussian of ``sigma`` (11 wide, sigma 1.5, as the paper), or, with ``sigma`` None, a uniform one
    with the sample covariance (scikit-image's ``structural_similarity`` default, 7 wide). An axis shorter than
    the window (a volume's few slices) gets the window cut to its length.
    """
    return ssim_to(a, window, sigma, data_range)(b)
