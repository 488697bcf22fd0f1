"""``explain evaluate IMAGES... [--model NAME] [--methods ...] [--layers ...] [--metrics ...] [--masks DIR]
[--boxes FILE] [--budget 10m] [-o OUT] [--resume]``: the command line of :func:`explain.evaluation.evaluate`."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

from ..errors import ExplainError
from .catalog import CATALOG, DEFAULT_METRICS

BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}


def budget_seconds(text: str | None) -> float | None:
    """A budget as ``90``, ``90s``, ``10m`` or ``1.5h``, in seconds.

    Raises:
        ExplainError: Not a budget.
    """
    if text is None:
        return None
    found = BUDGET.match(text)
    if found is None:
        raise ExplainError(f"--budget {text!r}: give a time as 90s, 10m or 1h")
    return float(found.group(1)) * UNITS[found.group(2)]


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser, bundled: str) -> None:
    """The options of ``explain evaluate``."""
    parser.add_argument("inputs", nargs="+", help="images, folders or glob patterns")
    parser.add_argument("--model", default=bundled, help=f"the classifier (default {bundled}: offline)")
    parser.add_argument("--weights", help="a checkpoint of the model")
    parser.add_argument("--methods", default="gradcam,gradcampp,layercam", help="methods to compare, comma-separated")
    parser.add_argument("--layers", help="layers to compare, comma-separated (default: each method's automatic one)")
    parser.add_argument(
        "--metrics", help=f"metrics, comma-separated, of {', '.join(m.name for m in CATALOG)} "
        f"(default: {', '.join(DEFAULT_METRICS)}; those of the object only with --masks)",
    )  # fmt: skip
    parser.add_argument("--masks", type=Path, help="a folder of the objects' masks, a PNG per image named as it")
    parser.add_argument(
        "--boxes", type=Path, help='instead of masks, a JSON file of the objects\' boxes: {"cat.jpg": [x1, y1, x2, y2]}'
    )
    parser.add_argument("--budget", help="the time the run may take (90s, 10m, 1h); cheap metrics run first")
    parser.add_argument("-o", "--out", type=Path, default=Path("evaluation"), help="the output folder")
    parser.add_argument("--resume", action="store_true", help="go on with an earlier evaluation of the folder")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the metrics' draws and of the bootstrap")
    parser.add_argument("--device", help="where the model runs (default: cuda if available, else cpu)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print the recommendation only")


def check(args: argparse.Namespace) -> None:
    """Refuse, before any model work, a bad budget, an unknown metric, or a metric of the object without masks.

    Raises:
        ExplainError: Naming the option and the way out.
    """
    from .catalog import chosen_metrics

    budget_seconds(args.budget)
    if args.masks is not None and args.boxes is not None:
        raise ExplainError("give the objects as --masks or as --boxes, not both")
    chosen_metrics(_names(args.metrics), args.masks is not None or args.boxes is not None)
    if args.masks is not None and not args.masks.is_dir():
        raise ExplainError(f"--masks {args.masks}: not a folder")
    if args.boxes is not None and not args.boxes.is_file():
        raise ExplainError(f"--boxes {args.boxes}: not a file")


def run(args: argparse.Namespace, spec: object, images: Sequence[Path]) -> str:
    """Evaluate as the arguments say, write the report, and return the line that says what was found."""
    from ..methods import METHODS
    from .report import MARKDOWN, write_report
    from .run import Configuration, evaluate

    methods = _names(args.methods) or ["gradcam"]
    layers: list[str | None] = _names(args.layers) or [None]
    grid = [
        Configuration(method, layer)
        for method in methods
        for layer in (layers if method not in METHODS or METHODS[method].reads_layer else [None])
    ]  # a method that reads no layer once, at the input
    found = evaluate(
        spec, images, args.out, configurations=grid, metric_names=_names(args.metrics), masks=args.masks,
        boxes=args.boxes, budget=budget_seconds(args.budget), resume=args.resume, progress=not args.quiet,
        seed=args.seed,
    )  # fmt: skip
    write_report(found, args.out)
    ranking = found.ranking
    verdict = f"recommended: {ranking.recommended}"
    if ranking.recommended is None:
        verdict = f"no clear winner ({ranking.order[0]} first, its interval overlapping the runner-up's)"
    return f"{verdict} -> {args.out / MARKDOWN}"
