"""Which configuration to trust: each configuration's mean per metric with a bootstrap interval over the images,
and a ranking by the mean rank over the metrics, itself bootstrapped. A configuration is recommended only where
its interval of mean rank lies wholly below the runner-up's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BOOTSTRAP = 1000  # resamples of the images
LEVEL = 0.95  # the intervals' coverage


@dataclass(frozen=True)
class Summary:
    """One configuration's score on one metric.

    Attributes:
        mean: The mean over the images scored.
        low: The interval's lower end.
        high: Its upper end.
        images: How many images were scored.
    """

    mean: float
    low: float
    high: float
    images: int


@dataclass(frozen=True)
class Ranking:
    """The configurations by mean rank over the metrics (1: best on every metric).

    Attributes:
        order: The configurations, best first.
        rank: Each one's mean rank, with its interval, in that order.
        recommended: The best configuration where its interval separates from the runner-up's, else None.
    """

    order: list[str]
    rank: list[Summary]
    recommended: str | None


def _interval(samples: np.ndarray) -> tuple[float, float]:
    tail = (1 - LEVEL) / 2 * 100
    return float(np.nanpercentile(samples, tail)), float(np.nanpercentile(samples, 100 - tail))


def summarize(values: np.ndarray, seed: int = 0) -> Summary:
    """The mean of one configuration's per-image values on one metric, with its bootstrap interval."""
    values = values[np.isfinite(values)]
    if not len(values):
        return Summary(float("nan"), float("nan"), float("nan"), 0)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (BOOTSTRAP, len(values)))].mean(axis=1)
    return Summary(float(values.mean()), *_interval(means), len(values))


def rank(
    scores: dict[str, np.ndarray], configurations: Sequence[str], higher: dict[str, bool], seed: int = 0
) -> Ranking:
    """Rank configurations by their mean rank over the metrics, bootstrapped over the images.

    Args:
        scores: Per metric, the values (configurations, images), NaN where not scored.
        configurations: Their names, in the rows' order.
        higher: Per metric, whether higher is better.
        seed: The resamples' seed.
    """
    rng = np.random.default_rng(seed)
    images = next(iter(scores.values())).shape[1]
    picks = [np.arange(images), *rng.integers(0, images, (BOOTSTRAP, images))]
    ranks = np.stack([_mean_rank(scores, higher, pick) for pick in picks])  # (1 + B, configurations)
    order = np.argsort(ranks[0], kind="stable")
    summaries = [Summary(float(ranks[0, i]), *_interval(ranks[1:, i]), images) for i in order]
    separated = len(order) > 1 and summaries[0].high < summaries[1].low
    best = configurations[order[0]] if separated or len(order) == 1 else None
    return Ranking([configurations[i] for i in order], summaries, best)


def _mean_rank(scores: dict[str, np.ndarray], higher: dict[str, bool], pick: np.ndarray) -> np.ndarray:
    """Each configuration's rank (1 best) on each metric's mean over the picked images, averaged over the metrics."""
    found = []
    for metric, values in scores.items():
        picked = values[:, pick]
        counts = np.isfinite(picked).sum(axis=1)
        means = np.where(counts > 0, np.nansum(picked, axis=1) / np.maximum(counts, 1), np.nan)
        means = -means if higher[metric] else means
        found.append(np.argsort(np.argsort(np.nan_to_num(means, nan=np.inf), kind="stable"), kind="stable") + 1)
    return np.mean(found, axis=0)
