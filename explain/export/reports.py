"""The command line's metrics: each image's value of each named metric, and their summary over images
(``metrics.json``, ``metrics.csv``, ``metrics.png``); the randomization test's (``sanity.json``, ``sanity.csv``,
``sanity.png``)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..catalog import METRIC_CATALOG
from ..io.atomic import write_atomically
from ..metrics.confidence import average_drop_of, average_gain_of, increase_in_confidence_of
from ..metrics.perturbation import (
    DELETION_BASELINE,
    INSERTION_BASELINE,
    ROAD_NOISE,
    ROAD_PERCENTILES,
    ROAD_SEED,
    STEPS,
    deletion_of,
    insertion_of,
    road_of,
)
from ..metrics.sanity import SanityResult
from ..metrics.scoring import Scorer, scorer
from ..targets import TargetLike

CURVES = ("deletion", "insertion")  # the metrics whose curves the summary plots


# Each --metrics name's measure of a batch's maps, with the scorer all of them share, and its default settings.
_MEASURES: dict[str, Callable[[Scorer, Tensor], Any]] = {
    "deletion": lambda scoring, maps: deletion_of(scoring, maps, STEPS, DELETION_BASELINE),
    "insertion": lambda scoring, maps: insertion_of(scoring, maps, STEPS, INSERTION_BASELINE),
    "road": lambda scoring, maps: road_of(scoring, maps, ROAD_PERCENTILES, ROAD_NOISE, ROAD_SEED),
    "drop": average_drop_of,
    "increase": increase_in_confidence_of,
    "gain": average_gain_of,
}


def image_metrics(
    names: Sequence[str], model: nn.Module, x: Tensor, maps: Tensor, target: TargetLike, batch_size: int
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Each named metric's value per image (N,), and the deletion and insertion curves (N, steps + 1) among them,
    every metric scored by one scorer of the class's softmax probability (one plain forward for them all).
    A guided method's maps (N, C, *spatial) are scored as saliency maps: each point's largest absolute channel."""
    if maps.dim() == x.dim():
        maps = maps.abs().amax(dim=1)
    scoring = scorer(model, x, target, "probability", "--metrics", batch_size, None)
    values: dict[str, Tensor] = {}
    curves: dict[str, Tensor] = {}
    for name in names:
        result = _MEASURES[name](scoring, maps)
        if name in CURVES:
            values[name], curves[name] = result.auc, result.curve
        else:
            values[name] = result.combined if name == "road" else result.value
    return values, curves


def interval(values: Tensor, resamples: int = 10000, seed: int = 0) -> tuple[float, float]:
    """The 95% confidence interval of the mean: the 2.5th and 97.5th percentiles of the means of ``resamples``
    bootstrap resamples (seeded); a single value gives itself."""
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(values), (resamples, len(values)), generator=generator)
    means = values.double()[picks].mean(dim=1)
    low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return low, high


def summary(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and 95% confidence interval over the images of each method and metric in manifest records."""
    gathered: dict[tuple[str, str], list[float]] = {}
    for record in records:
        for target in record.get("targets") or []:
            for name, value in (target.get("metrics") or {}).items():
                gathered.setdefault((record["method"], name), []).append(value)
    better = {entry.name: entry.better for entry in METRIC_CATALOG}
    rows = []
    for (method, name), found in gathered.items():
        values = torch.tensor(found, dtype=torch.float64)
        low, high = interval(values)
        rows.append(
            {
                "method": method,
                "metric": name,
                "mean": round(float(values.mean()), 6),
                "ci95": [round(low, 6), round(high, 6)],
                "images": len(found),
                "better": better[name],
            }
        )
    return rows


def mean_curves(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Each method's mean deletion and insertion curves over the images of manifest records."""
    found: dict[tuple[str, str], list[list[float]]] = {}
    for record in records:
        for target in record.get("targets") or []:
            for name, curve in (target.get("curves") or {}).items():
                found.setdefault((record["method"], name), []).append(curve)
    curves: dict[str, dict[str, list[float]]] = {}
    for (method, name), rows in found.items():
        curves.setdefault(name, {})[method] = torch.tensor(rows).mean(dim=0).tolist()
    return curves


def write_summary(out_dir: Path, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Write ``metrics.json``, ``metrics.csv`` and (with a curve) ``metrics.png`` for manifest records; returns
    the summary's rows."""
    rows = summary(records)
    curves = mean_curves(records)
    document = {"rows": rows, "curves": curves}
    write_atomically(out_dir / "metrics.json", lambda temp: temp.write_text(json.dumps(document, indent=1)))
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["method", "metric", "mean", "ci95_low", "ci95_high", "images", "better"])
    for row in rows:
        writer.writerow([row["method"], row["metric"], row["mean"], *row["ci95"], row["images"], row["better"]])
    write_atomically(out_dir / "metrics.csv", lambda temp: temp.write_text(text.getvalue()))
    if curves:
        write_atomically(out_dir / "metrics.png", lambda temp: _plot(curves, temp))
    return rows


def _plot(curves: dict[str, dict[str, list[float]]], path: Path) -> None:
    """Deletion and insertion curves side by side, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False, layout="constrained")
    for axis, (name, by_method) in zip(axes[0], curves.items()):
        for method, curve in by_method.items():
            fractions = torch.linspace(0, 1, len(curve)).tolist()
            axis.plot(fractions, curve, label=method)
        axis.set(title=name, xlabel=f"fraction of pixels {'deleted' if name == 'deletion' else 'inserted'}")
        axis.set(ylabel="score of the explained class", ylim=(0, None))
        axis.legend()
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)


def write_sanity(out_dir: Path, results: dict[str, SanityResult], threshold: float = 0.5) -> list[dict[str, Any]]:
    """Write ``sanity.json``, ``sanity.csv`` (a row per method and depth) and ``sanity.png`` (each method's mean
    Spearman correlation per depth) for the randomization test's results by method; returns the csv's rows."""
    rows = []
    for method, result in results.items():
        for row, depth in enumerate(result.depths):
            low, high = interval(result.spearman[row])
            rows.append(
                {
                    "method": method,
                    "depth": depth,
                    "block": result.blocks[depth - 1],
                    "spearman": round(float(result.spearman[row].mean()), 6),
                    "spearman_ci95": [round(low, 6), round(high, 6)],
                    "ssim": round(float(result.ssim[row].mean()), 6),
                    "images": result.spearman.shape[1],
                    "fails": result.insensitive(threshold),
                }
            )
    write_atomically(out_dir / "sanity.json", lambda temp: temp.write_text(json.dumps(rows, indent=1)))
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["method", "depth", "block", "spearman", "ci95_low", "ci95_high", "ssim", "images", "fails"])
    for row in rows:
        method, depth, block, spearman, (low, high) = (
            row[k] for k in ("method", "depth", "block", "spearman", "spearman_ci95")
        )
        writer.writerow([method, depth, block, spearman, low, high, row["ssim"], row["images"], row["fails"]])
    write_atomically(out_dir / "sanity.csv", lambda temp: temp.write_text(text.getvalue()))
    write_atomically(out_dir / "sanity.png", lambda temp: _plot_sanity(results, temp))
    return rows


def _plot_sanity(results: dict[str, SanityResult], path: Path) -> None:
    """Each method's mean Spearman correlation with the trained maps, per block randomized."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = next(iter(results.values())).blocks
    figure, axis = plt.subplots(figsize=(max(6, 0.5 * len(blocks) + 3), 4), layout="constrained")
    for method, result in results.items():
        axis.plot(result.depths, result.spearman.mean(dim=1).tolist(), marker="o", label=method)
    axis.set_xticks(range(1, len(blocks) + 1), blocks, rotation=60, ha="right")
    axis.set(xlabel="randomized down to block", ylabel="Spearman ρ with the trained maps", ylim=(-0.2, 1.05))
    axis.axhline(0.5, color="grey", linestyle=":")
    axis.legend()
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)
