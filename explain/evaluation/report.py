"""The evaluation's files: ``evaluation.md`` (the table of means with their intervals, the ranking, the
recommendation and how the time was spent), ``evaluation.csv`` (the same numbers, one row per configuration and
metric), ``evaluation.png`` (each configuration's score with its interval, a panel per metric) and, where deletion
or insertion ran, ``evaluation.curves.png`` (each configuration's mean curve over the images)."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from ..io.atomic import write_atomically
from .run import Evaluation

MARKDOWN, CSV, FIGURE, CURVES = "evaluation.md", "evaluation.csv", "evaluation.png", "evaluation.curves.png"


def write_report(found: Evaluation, out: Path) -> list[Path]:
    """Write the evaluation's files into ``out``; returns their paths."""
    paths = [out / MARKDOWN, out / CSV, out / FIGURE]
    write_atomically(paths[0], lambda temp: temp.write_text(markdown(found), encoding="utf-8"))
    write_atomically(paths[1], lambda temp: temp.write_text(table_csv(found), encoding="utf-8"))
    write_atomically(paths[2], lambda temp: _figure(found, temp))
    if found.curves:
        paths.append(out / CURVES)
        write_atomically(paths[3], lambda temp: _curves(found, temp))
    return paths


def _cell(found: Evaluation, metric: str, configuration: str) -> str:
    summary = found.summaries[metric][configuration]
    return "—" if not summary.images else f"{summary.mean:.4g} [{summary.low:.4g}, {summary.high:.4g}]"


def markdown(found: Evaluation) -> str:
    """The report as Markdown."""
    arrows = {m.name: "↑" if m.better == "higher" else "↓" for m in found.metrics}
    lines = [f"# Which method to trust: {len(found.configurations)} configurations on {len(found.images)} images", ""]
    lines += ["| configuration | " + " | ".join(f"{m.name} {arrows[m.name]}" for m in found.metrics) + " |"]
    lines += ["|---|" + "---:|" * len(found.metrics)]
    for configuration in found.configurations:
        cells = [_cell(found, m.name, configuration) for m in found.metrics]
        lines.append(f"| {configuration} | " + " | ".join(cells) + " |")
    lines += ["", "Means over the images, [95% bootstrap interval]; ↑ higher is better, ↓ lower.", ""]
    ranking = found.ranking
    lines += ["## Ranking", "", "| rank | configuration | mean rank over the metrics |", "|---:|---|---:|"]
    for place, (name, summary) in enumerate(zip(ranking.order, ranking.rank), start=1):
        lines.append(f"| {place} | {name} | {summary.mean:.2f} [{summary.low:.2f}, {summary.high:.2f}] |")
    if ranking.recommended:
        verdict = f"**Recommended: {ranking.recommended}**: its interval of mean rank lies below the runner-up's."
    else:
        verdict = (f"**No recommendation**: {ranking.order[0]} ranks first, but its interval of mean rank overlaps "
                   "the runner-up's; more images would tell them apart.")  # fmt: skip
    lines += ["", verdict, ""]
    if found.unfinished:
        lines += [f"The time budget ran out before these metrics finished: {', '.join(found.unfinished)}.", ""]
    spent = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in found.seconds.items())
    lines += [f"Time spent in this run: {spent}.", ""]
    return "\n".join(lines)


def table_csv(found: Evaluation) -> str:
    """The means and intervals, one row per configuration and metric."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["configuration", "metric", "better", "mean", "low", "high", "images"])
    for metric in found.metrics:
        for configuration in found.configurations:
            s = found.summaries[metric.name][configuration]
            writer.writerow([configuration, metric.name, metric.better, s.mean, s.low, s.high, s.images])
    return buffer.getvalue()


def _figure(found: Evaluation, path: Path) -> None:
    """Each configuration's mean with its interval, a panel per metric, written as PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(found.metrics), figsize=(3.2 * len(found.metrics), 2.8), squeeze=False)
    for axis, metric in zip(axes[0], found.metrics):
        summaries = [found.summaries[metric.name][c] for c in found.configurations]
        means = [s.mean for s in summaries]
        errors = [[s.mean - s.low for s in summaries], [s.high - s.mean for s in summaries]]
        axis.errorbar(range(len(means)), means, yerr=errors, fmt="o", capsize=3)
        axis.set_xticks(range(len(means)), found.configurations, rotation=30, ha="right", fontsize=7)
        axis.set_title(f"{metric.name} ({'higher' if metric.better == 'higher' else 'lower'} better)", fontsize=8)
    fig.tight_layout()
    with path.open("wb") as handle:
        fig.savefig(handle, format="png", dpi=110)
    plt.close(fig)


def _curves(found: Evaluation, path: Path) -> None:
    """Each curve metric's mean curve per configuration over the images, a panel per metric, as PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(found.curves), figsize=(4 * len(found.curves), 3), squeeze=False)
    for axis, (metric, by_configuration) in zip(axes[0], found.curves.items()):
        for configuration, curves in by_configuration.items():
            mean = np.mean(np.asarray(curves, dtype=float), axis=0)
            axis.plot(np.linspace(0, 1, len(mean)), mean, label=f"{configuration} ({len(curves)})")
        axis.set_xlabel("fraction of pixels changed", fontsize=8)
        axis.set_ylabel("score", fontsize=8)
        axis.set_title(f"{metric}: mean curve over the images", fontsize=8)
        axis.legend(fontsize=7)
    fig.tight_layout()
    with path.open("wb") as handle:
        fig.savefig(handle, format="png", dpi=110)
    plt.close(fig)
