"""The command lines ``explain concepts IMAGES... [--model NAME] [--target CLASS] [--layer L] [--concepts 10]
[--crop 64] [-o OUT] [--resume]`` and ``explain tcav IMAGES... --target CLASS --concept DIR --random DIR [-o FILE]``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import ExplainError
from ..io.atomic import write_atomically


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _common(parser: argparse.ArgumentParser, bundled: str) -> None:
    """The options both commands take."""
    parser.add_argument("inputs", nargs="+", help="images, folders or glob patterns")
    parser.add_argument("--model", default=bundled, help=f"the classifier (default {bundled}: offline)")
    parser.add_argument("--weights", help="a checkpoint of the model")
    parser.add_argument("--target", help="the class, by name or index (default: the top class of the most images)")
    parser.add_argument("--layer", help="the layer (default: the automatic one; explain --layers lists them)")
    parser.add_argument("--batch-size", type=_positive, default=32, help="most images per forward (default 32)")
    parser.add_argument("--device", help="where the model runs (default: cuda if available, else cpu)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def add_concepts_arguments(parser: argparse.ArgumentParser, bundled: str) -> None:
    """The options of ``explain concepts``."""
    _common(parser, bundled)
    parser.add_argument("--concepts", type=_positive, default=10, help="how many concepts (default 10)")
    parser.add_argument(
        "--crop", type=int, default=64, help="the crops' side in input pixels (default 64; 0: the images whole)"
    )
    parser.add_argument("--designs", type=_positive, default=32, help="Sobol designs per image (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="the Sobol sequence's seed")
    parser.add_argument("-o", "--out", type=Path, default=Path("concepts"), help="the output folder")
    parser.add_argument("--resume", action="store_true", help="go on with an earlier atlas of the folder")


def add_tcav_arguments(parser: argparse.ArgumentParser, bundled: str) -> None:
    """The options of ``explain tcav``."""
    _common(parser, bundled)
    parser.add_argument("--concept", nargs="+", required=True, help="images of the concept: a folder or files")
    parser.add_argument("--random", nargs="+", required=True, help="random counterexamples: a folder or files")
    parser.add_argument(
        "--fit", choices=("linear", "standardized", "mean"), default="linear", help="how the CAV is fitted"
    )
    parser.add_argument("--runs", type=int, default=10, help="random halves of the significance test (default 10)")
    parser.add_argument("-o", "--out", type=Path, default=Path("tcav.json"), help="the JSON file written")


def run_concepts(args: argparse.Namespace, spec: Any, paths: list[Path]) -> str:
    """Make and write the atlas; returns the line that says what was found. Under ``torchrun``, the ranks make it
    together and the first writes it and says so (the others return an empty line)."""
    from ..export.distributed import process_group, this_process
    from .page import write_atlas
    from .run import AtlasOptions, concept_atlas

    if args.crop < 0:
        raise ExplainError(f"--crop {args.crop}: give a side in pixels, or 0 for the images whole")
    options = AtlasOptions(
        args.target, args.layer, args.concepts, args.crop or None, args.designs, args.batch_size, args.resume,
        not args.quiet, args.seed,
    )  # fmt: skip
    process = this_process()
    with process_group(process, spec.device):
        atlas = concept_atlas(spec, paths, args.out, options)
    if process.rank != 0:  # every rank has the atlas; the first writes it
        return ""
    manifest = write_atlas(atlas, spec, args.out)
    first = manifest["concepts"][0]
    return (
        f"{len(manifest['concepts'])} concepts of {manifest['class_name']} at {manifest['layer']}: the most important, "
        f"concept {first['concept']}, {first['importance']:.3f} (95%: {first['low']:.3f} to {first['high']:.3f}); "
        f"{args.out / 'atlas.html'}"
    )


def run_tcav(args: argparse.Namespace, spec: Any, paths: list[Path], concept: list[Path], random: list[Path]) -> str:
    """Score the concept, write the JSON file; returns the line that says what was found."""
    from .run import tcav_score

    found, (index, name) = tcav_score(
        spec, paths, concept, random, args.target, args.layer, fit=args.fit, runs=args.runs, batch_size=args.batch_size
    )
    record = {
        "model": spec.name, "layer": found.layer, "class": index, "class_name": name, "score": found.score,
        "magnitude": found.magnitude, "p_value": found.p_value, "significant": found.significant,
        "scores": found.scores.tolist(), "null": found.null.tolist(), "fit": args.fit,
        "images": len(paths), "concept_images": len(concept), "random_images": len(random),
    }  # fmt: skip
    write_atomically(args.out, lambda temp: temp.write_text(json.dumps(record, indent=1), encoding="utf-8"))
    verdict = "significant" if found.significant else "not significant"
    return (
        f"TCAV {found.score:.3f} for {name} along the concept at {found.layer} (p = {found.p_value:.3g}, {verdict}); "
        f"{args.out}"
    )
