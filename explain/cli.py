"""Command line: ``python cli.py IMAGES... [options]`` or the ``explain`` console script."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import torch
from tqdm import tqdm

from .errors import ExplainError
from .export import ALL, ExportOptions, export_heatmaps
from .layers import resolve_layer
from .methods import FAST_METHODS, METHODS, method_options
from .models import BUNDLED, DEFAULT_MODEL, load_model
from .targets import class_index

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``explain`` command."""
    parser = argparse.ArgumentParser(
        prog="explain",
        description="Grad-CAM heatmaps of a classifier's decision, overlaid on each image.",
        epilog="Exit status: 0 all inputs written, 1 some inputs failed (each named on stderr), 2 usage error.",
    )
    add = parser.add_argument
    add("inputs", nargs="*", help="image files, folders (searched recursively) and glob patterns")
    add(
        "--method",
        default="gradcam",
        help="CAM method (default gradcam); 'list' names them, 'all' compares the fast ones",
    )
    add("--model", default=DEFAULT_MODEL, help=f"torchvision classifier, or {BUNDLED} (bundled, offline)")
    add("--weights", type=Path, help="state_dict file (.pt, .pth, .safetensors) for the model's architecture")
    add("--labels", type=Path, help="text file of class names, one per line (for a checkpoint's own classes)")
    add(
        "--layer",
        help="target layer, a dotted name such as layer4 or features.28, or several joined by commas "
        "(their maps are fused); default: last spatial layer",
    )
    add("--fuse", choices=("mean", "max"), help="how several layers' maps are fused (default mean)")
    add("--aug-smooth", action="store_true", help="average over flips and scales 0.9/1.0/1.1 (6 passes)")
    add("--eigen-smooth", action="store_true", help="first principal component of the weighted activations")
    add("--smooth-samples", type=int, help="SmoothGrad-style: average the maps of N noisy copies")
    add("--smooth-sigma", type=float, help="noise of --smooth-samples, a fraction of the value range (default 0.15)")
    add("--seed", type=int, help="seed of the random numbers (noise, SS-CAM, the random baseline)")
    add("--target", help="class index or class name to explain; default: each image's top-1 class")
    add("--topk", type=int, help="write one overlay for each of the K top classes")
    add("--device", help="torch device; default: cuda if available, else cpu")
    add(
        "--batch-size",
        type=int,
        default=16,
        help="images per forward pass, also the masked or ablated copies "
        "per forward of Score-CAM and Ablation-CAM: their memory bound (default 16)",
    )
    add("-o", "--out", type=Path, default=Path("cam_out"), help="output folder (default cam_out/)")
    add("--alpha", type=float, default=0.5, help="heatmap opacity in [0, 1] (default 0.5)")
    add("--colormap", default="jet", help="matplotlib colormap (default jet)")
    add("--format", dest="fmt", choices=("png", "jpg"), default="png", help="overlay file format (default png)")
    add("--save-raw", action="store_true", help="also save the raw feature-resolution CAM as .npy")
    add("--figure", action="store_true", help="also save a side-by-side figure: image, heatmap, overlay")
    add("--keep-aspect", action="store_true", help="resize the short side to the input size, not the whole to a square")
    add("--quiet", action="store_true", help="print nothing but errors")
    return parser


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    if not args.inputs:
        parser.error("the following arguments are required: inputs")
    if args.method == ALL and (args.topk or args.figure or args.save_raw):
        parser.error("--method all writes one comparison grid per image; drop --topk, --figure and --save-raw")
    if args.smooth_samples is not None and args.smooth_samples < 1:
        parser.error("--smooth-samples must be at least 1")
    if args.topk is not None and args.target is not None:
        parser.error("--topk and --target exclude each other")
    if args.topk is not None and args.topk < 1:
        parser.error("--topk must be at least 1")
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    if not 0.0 <= args.alpha <= 1.0:
        parser.error("--alpha must be between 0 and 1")
    if args.colormap not in matplotlib.colormaps:
        parser.error(f"unknown colormap {args.colormap!r}")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as err:
        parser.error(f"bad --device: {err}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda asked for, but CUDA is not available")
    return device


def _print_record(record: dict[str, Any], quiet: bool) -> None:
    if record["error"]:
        tqdm.write(f"explain: error: {record['error']}", file=sys.stderr)
        return
    if quiet:
        return
    if "outputs" in record:  # --topk: lists, one entry per class
        rows = zip(record["class_name"], record["score"], record["outputs"])
    else:
        rows = [(record["class_name"], record["score"], record["output"])]
    for name, score, output in rows:
        tqdm.write(f"{record['input']}: {name} ({score:.3f}) layer={record['layer']} -> {output}", file=sys.stdout)


def _method_options(args: argparse.Namespace) -> dict[str, Any]:
    """The method options the user set; the batch size goes to every method that takes one."""
    flags = {
        "fuse": args.fuse,
        "aug_smooth": args.aug_smooth or None,
        "eigen_smooth": args.eigen_smooth or None,
        "smooth_samples": args.smooth_samples,
        "smooth_sigma": args.smooth_sigma,
        "seed": args.seed,
    }
    options = {name: value for name, value in flags.items() if value is not None}
    if args.method == ALL or "batch_size" in method_options(args.method):
        options["batch_size"] = args.batch_size
    return options


def list_methods() -> str:
    """One line per method: its name, what it is, and whether ``--method all`` includes it."""
    lines = []
    for name, cls in METHODS.items():
        title = (cls.__doc__ or "").strip().split(":")[0]
        cost = "fast, in --method all" if name in FAST_METHODS else "not in --method all"
        lines.append(f"{name:20} {title:45} {cost}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 all written, 1 some inputs failed, 2 usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.method == "list":
        print(list_methods())
        return EXIT_OK
    if args.method != ALL and args.method not in METHODS:
        parser.error(f"unknown method {args.method!r}; 'list' prints the names")
    device = _check_arguments(parser, args)
    try:
        spec = load_model(args.model, args.weights, args.labels, device)
        layer = args.layer.split(",") if args.layer and "," in args.layer else args.layer
        for name in [layer] if isinstance(layer, str) else layer or []:
            resolve_layer(spec.model, name)
        target = None
        if args.target is not None:
            target = int(args.target) if args.target.lstrip("-").isdigit() else args.target
            class_index(target, spec.labels, len(spec.labels))
        if args.topk is not None and args.topk > len(spec.labels):
            raise ExplainError(f"--topk {args.topk} exceeds the model's {len(spec.labels)} classes")
        options = ExportOptions(
            method=args.method,
            method_options=_method_options(args),
            layer=layer,
            target=target,
            topk=args.topk,
            batch_size=args.batch_size,
            alpha=args.alpha,
            colormap=args.colormap,
            fmt=args.fmt,
            save_raw=args.save_raw,
            figure=args.figure,
            keep_aspect=args.keep_aspect,
        )
        records = export_heatmaps(
            spec,
            args.inputs,
            args.out,
            options,
            device=device,
            progress=not args.quiet,
            report=lambda record: _print_record(record, args.quiet),
        )
    except ExplainError as err:
        print(f"explain: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:
        print(f"explain: error: cannot write to {args.out}: {err.strerror or err}", file=sys.stderr)
        return EXIT_SOME_FAILED
    except KeyboardInterrupt:
        print("explain: interrupted; outputs written so far are complete, the manifest is not", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_SOME_FAILED if any(record["error"] for record in records) else EXIT_OK
