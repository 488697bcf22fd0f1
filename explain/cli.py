"""Command line: ``python cli.py IMAGES... [options]``, ``python -m explain`` or the ``explain`` console script.

Only the standard library and explain's torch-free modules are imported up front, so
``--help``, ``--version`` and ``--method list`` answer without loading torch, and a run
names its missing inputs before it loads a model. Every user error is one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from . import __version__
from .catalog import FUSIONS, METRIC_NAMES, method_table
from .errors import ExplainError
from .export.inputs import Input, collect_inputs, listed_inputs
from .export.preflight import Prepared, prepare
from .export.settings import ExportOptions, Prompt, RenderOptions
from .io.kinds import IMAGE, VIDEO, InputKind
from .models.names import BUNDLED_MODEL, DEFAULT_MODEL, VIDEO_MODELS, is_user_model
from .tasks.asked import Reading, texts_of

if TYPE_CHECKING:
    import torch

    from .models import ModelSpec
    from .models.text_image import TextImageSpec
    from .tasks.base import Task

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(ExplainError):
    """A problem with the command's arguments: exit status 2, nothing written."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """argparse's own errors, as one line like every other usage error."""
        raise UsageError(f"{message} (explain --help lists the options)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``explain`` command."""
    parser = _Parser(
        prog="explain",
        description="Grad-CAM heatmaps of a model's decision, overlaid on each image: a classifier's class,\n"
        "a segmenter's classes, a detector's boxes (the task follows from --model).\n\n" + commands_help(),
        epilog="Exit status: 0 all inputs written, 1 some inputs failed (each named on stderr), 2 usage error.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _what_to_read(parser.add_argument)
    _how_to_explain(parser.add_argument)
    _where_to_look(parser.add_argument)
    _what_to_say(parser.add_argument)
    _what_to_write(parser.add_argument)
    return parser


def _where_to_look(add: Callable[..., Any]) -> None:
    """What a dense or structured output's map explains: a depth estimator's region, a promptable segmenter's
    prompt, a pose model's keypoint."""
    add(
        "--region",
        metavar="X1,Y1,X2,Y2",
        help="a depth estimator's region (--model FOLDER: DPT, GLPN, Depth Anything) in each photo's pixels: its "
        "mean depth is explained (default: the whole photo)",
    )
    add(
        "--region-mask",
        type=Path,
        metavar="FILE",
        help="the region as a mask image (nonzero inside), resized to each photo",
    )
    add(
        "--direction",
        default="larger",
        choices=("larger", "smaller", "nearer", "farther"),
        help="what the region's depth is explained for: larger or smaller values, or nearer or farther (read from "
        "the model's config); default larger",
    )
    add(
        "--point",
        action="append",
        metavar="X,Y",
        help="a point on the object for a promptable segmenter (--model FOLDER: SAM), in the photo's pixels; repeat "
        "for several: the mask it draws is explained",
    )
    add("--box", metavar="X1,Y1,X2,Y2", help="a box around the object for a promptable segmenter (SAM)")
    add(
        "--keypoint",
        metavar="NAME|INDEX",
        help="a pose model's keypoint (Keypoint R-CNN, YOLO pose): its name (left_wrist, ...), index, or 'all'; one "
        "overlay per detection and keypoint, scored by the model's own keypoint confidence",
    )


def _what_to_say(add: Callable[..., Any]) -> None:
    """A vision-language model's text: a prompt to answer, an answer to explain, text prompts to score."""
    add(
        "--prompt",
        help="a question about each image to a vision-language model that answers (--model FOLDER, LLaVA 1.5 and "
        "its kind): one overlay per word of its answer, and a strip of them all",
    )
    add("--answer", help="with --prompt: explain this answer instead of the model's own")
    add(
        "--text",
        help="text prompts, comma-separated, to a contrastive image-text model (--model FOLDER: CLIP, SigLIP): one "
        "overlay per prompt; or text queries to an open-vocabulary detector (OWL-ViT, OWLv2): one overlay per box "
        "scoring at least --score-threshold",
    )
    add(
        "--max-new-tokens",
        type=_at_least_one,
        help="the longest answer generated for --prompt, at least 1 (default 16; refused with --answer, which "
        "generates none, and for a model that answers no prompt)",
    )


def _at_least_one(text: str) -> int:
    """A whole number of 1 or more, as the parser reads it."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of 1 or more, got {text!r}")
    return value


def _what_to_read(add: Callable[..., Any]) -> None:
    """The inputs, the model and its layers."""
    add(
        "inputs",
        nargs="*",
        help="image files (video files for a video model), folders (searched recursively) and glob patterns",
    )
    add(
        "--from-list",
        type=Path,
        metavar="FILE",
        help="also the image files a text file lists, one path per line (relative ones from the list's folder)",
    )
    add("--version", action="version", version=f"explain {__version__}")
    add(
        "--method",
        default="gradcam",
        help="CAM method (default gradcam), or several joined by commas (each writes its own overlays); "
        "'list' names them, 'all' compares the fast ones in one grid",
    )
    add(
        "--model",
        default=DEFAULT_MODEL,
        help=f"torchvision classifier, segmenter (lraspp_mobilenet_v3_large, ...), detector "
        f"(fasterrcnn_mobilenet_v3_large_fpn, ...) or video classifier (r3d_18, ...), a timm classifier as "
        f"timm/NAME, a YOLO checkpoint or yaml, {BUNDLED_MODEL} (bundled, offline), or your own model as "
        f"FILE.py:NAME (an explain.ModelSpec, or a function returning one: a 3-D or 1-D network, say); "
        f"default {DEFAULT_MODEL}",
    )
    add("--weights", type=Path, help="state_dict file (.pt, .pth, .safetensors) for the model's architecture")
    add("--labels", type=Path, help="text file of class names, one per line (for a checkpoint's own classes)")
    add(
        "--layer",
        help="target layer, a dotted name such as layer4 or features.28, or several joined by commas "
        "(their maps are fused); default: last spatial layer",
    )
    add(
        "--clip-stride",
        type=int,
        metavar="N",
        help="a video model's sliding windows over every frame, one starting every N frames (1 to the model's frame "
        "count); default: one clip of the model's frame count, taken uniformly",
    )
    add(
        "--layers",
        nargs="?",
        const="",
        metavar="SIZE",
        help="print the model's layers with spatial outputs and their shapes at input SIZE (H or HxW; "
        "default the model's input size), mark the automatic choice, and exit",
    )


def _how_to_explain(add: Callable[..., Any]) -> None:
    """The method's options and what is explained."""
    add("--fuse", choices=FUSIONS, help="how several layers' maps are fused (default mean; product: RefineCAM's)")
    add("--aug-smooth", action="store_true", help="average over flips and scales 0.9/1.0/1.1 (6 passes)")
    add("--eigen-smooth", action="store_true", help="first principal component of the weighted activations")
    add("--smooth-samples", type=int, help="SmoothGrad-style: average the maps of N noisy copies")
    add("--smooth-sigma", type=float, help="noise of --smooth-samples, a fraction of the value range (default 0.15)")
    add("--seed", type=int, help="seed of the random numbers (noise, SS-CAM, the random baseline)")
    add("--epsilon", type=float, help="the ε of the ε rule of lrp, attnlrp and cplrp (default 1e-6)")
    add(
        "--gate",
        choices=("signal", "uniform"),
        help="lrp, attnlrp and cplrp through a product of two relevant tensors: signal (default: a gate spread over "
        "the signal's positions or channels, as a squeeze-excitation's, held constant) or uniform (half each)",
    )
    add(
        "--target",
        help="class index or class name to explain; default: each image's top-1 class "
        "(a segmenter: every class present but the background; a detector: every detection)",
    )
    add(
        "--score-threshold",
        type=float,
        help="a detector's least score of an explained detection, one overlay each (default 0.5; an "
        "open-vocabulary detector's 0.1); a model that is no detector refuses it",
    )
    add("--topk", type=int, help="write one overlay for each of the K top classes")
    add(
        "--sanity-check",
        action="store_true",
        help="instead of overlays, run the model-parameter randomization test (Adebayo et al. 2018) of each --method "
        "on the images: sanity.csv, sanity.json and sanity.png (Spearman correlation with the trained maps per "
        "block randomized, from the output down)",
    )
    add(
        "--metrics",
        help=f"faithfulness metrics of each map, comma-separated: {', '.join(METRIC_NAMES)}; each image's values "
        "go into its manifest record, their means with 95%% intervals into metrics.json, metrics.csv and "
        "metrics.png (deletion and insertion curves); a classifier's class only",
    )


def _what_to_write(add: Callable[..., Any]) -> None:
    """The device, the outputs and how the run goes."""
    add("--device", help="torch device (cpu, cuda, cuda:1, mps, ...); default: cuda if available, else cpu")
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
    add(
        "--format",
        dest="fmt",
        choices=("jpg", "png"),
        help="overlay and figure format: jpg (default; about 1.5 ms to encode a 640x480 overlay) or png (exact "
        "pixels; about 25 ms; a vision-language model's words' default); --save-raw keeps the exact maps",
    )
    add("--save-raw", action="store_true", help="also save the raw feature-resolution CAM as .npy")
    add("--figure", action="store_true", help="also save a figure: image, heatmap with colour bar, overlay")
    add("--keep-aspect", action="store_true", help="resize the short side to the input size, not the whole to a square")
    add(
        "--workers",
        type=int,
        help="processes that read and resize the next batch while the model runs (0: threads of this process; "
        "default: threads for one batch, else a quarter of the cores for a model on the CPU, half for one on a GPU)",
    )
    add(
        "--resume",
        action="store_true",
        help="continue the run whose manifest the output folder holds: skip the inputs it finished, redo the "
        "failed and missing ones (the settings must be the same)",
    )
    add(
        "--overwrite",
        action="store_true",
        help="start afresh in an output folder that holds an earlier run: its manifest, outputs and gallery are "
        "removed (other files stay)",
    )
    add(
        "--gallery",
        action="store_true",
        help="also write OUT/index.html, a self-contained page of every explained target (from the manifest; "
        "with no inputs, rebuild it for a finished output folder)",
    )
    add("--quiet", action="store_true", help="print nothing but errors")


def _numbers(text: str | None, count: int, option: str) -> Any:
    """``count`` numbers joined by commas (a point, a box), or None where the option is not given.

    Raises:
        UsageError: Not ``count`` numbers.
    """
    if text is None:
        return None
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        values = ()
    if len(values) != count:
        form = "x,y" if count == 2 else "x1,y1,x2,y2"
        raise UsageError(f"{option} {text!r}: give {form}, numbers in the photo's pixels")
    return values


def _check_options(args: argparse.Namespace) -> None:
    """The command's own rules, beyond those of the export's settings."""
    if args.sanity_check and (args.topk is not None or args.metrics or args.figure or args.save_raw):
        raise UsageError("--sanity-check writes only its own files; drop --topk, --metrics, --figure and --save-raw")
    if args.smooth_samples is not None and args.smooth_samples < 1:
        raise UsageError("--smooth-samples must be at least 1")
    if args.layers is None and not args.inputs and args.from_list is None and not args.gallery:
        raise UsageError("no inputs given: name image files, folders or glob patterns (explain --help)")


def export_options(args: argparse.Namespace) -> ExportOptions:
    """The export's settings from the arguments, parsed and checked once (see
    :class:`explain.export.settings.ExportOptions`)."""
    flags = {
        "fuse": args.fuse,
        "aug_smooth": args.aug_smooth or None,
        "eigen_smooth": args.eigen_smooth or None,
        "smooth_samples": args.smooth_samples,
        "smooth_sigma": args.smooth_sigma,
        "seed": args.seed,
        "epsilon": args.epsilon,
        "gate": args.gate,
    }
    target = args.target
    if target is not None and target.lstrip("-").isdigit():
        target = int(target)
    return ExportOptions(
        method=args.method,
        method_options={name: value for name, value in flags.items() if value is not None},
        layer=args.layer.split(",") if args.layer and "," in args.layer else args.layer,
        target=target,
        topk=args.topk,
        score_threshold=args.score_threshold,
        keypoint=args.keypoint,
        prompt=Prompt(
            _numbers(args.region, 4, "--region"),
            args.region_mask,
            args.direction,
            tuple(_numbers(point, 2, "--point") for point in args.point or ()),
            _numbers(args.box, 4, "--box"),
        ),
        batch_size=args.batch_size,
        render=RenderOptions(args.fmt or "jpg", args.alpha, args.colormap, args.figure, args.save_raw),
        keep_aspect=args.keep_aspect or None,
        metrics=args.metrics or (),
        workers=args.workers,
        resume=args.resume,
        overwrite=args.overwrite,
        reading=_reading(args),
    )


def _reading(args: argparse.Namespace) -> Reading:
    """What a vision-language model reads besides each image: ``--prompt`` (and ``--answer``), or ``--text``'s
    comma-separated prompts or queries.

    Raises:
        UsageError: A ``--text`` that holds none.
    """
    texts = texts_of(args.text or "")
    if args.text is not None and not texts:
        raise UsageError("--text holds no prompt: give them comma-separated, as --text 'a cat, a remote'")
    return Reading(args.prompt, args.answer, texts, args.max_new_tokens)


def _check_inputs(args: argparse.Namespace, kind: InputKind) -> list[Input]:
    """Every input of the ``kind`` the model reads, found before any model work but a model of the user's code;
    none at all is a usage error."""
    listed = listed_inputs(args.from_list, kind) if args.from_list is not None else []
    inputs = collect_inputs([*args.inputs, *listed], exclude=args.out, kind=kind)
    if all(item.path is None for item in inputs):
        raise UsageError(f"no input {kind} found: " + "; ".join(item.error or item.name for item in inputs))
    return inputs


def available_devices() -> list[str]:
    """The devices this build of torch can use on this machine."""
    import torch

    devices = ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    if torch.backends.mps.is_available():
        devices.append("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        devices += [f"xpu:{i}" for i in range(xpu.device_count())]
    return devices


def _device(text: str | None) -> torch.device:
    """The device to run on: the one asked for, if this machine has it; else a usage error naming what it has."""
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    available = available_devices()
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(f"--device {text}: not a device name; available: {', '.join(available)}") from None
    kinds = {name.split(":")[0] for name in available}
    exists = device.type in kinds if device.index is None else f"{device.type}:{device.index}" in available
    if not exists and device.type != "cpu":
        raise UsageError(f"--device {text}: not available here; available: {', '.join(available)}")
    return device


PROBE_SIZE = 512  # the probe's side for a model that takes any size (a detector)


def _probe(spec: ModelSpec, size: str) -> torch.Tensor:
    """A zero input of the model's (or the given) size, for one look at its layers: (1, 3, H, W), or for a video
    model a clip of its frame count and crop, (1, 3, T, H, W)."""
    import torch

    from .models import ClipPreprocessing

    if isinstance(spec.preprocessing, ClipPreprocessing):
        clip = spec.preprocessing
        return torch.zeros(1, 3, clip.frames, *clip.crop, device=spec.device)
    if spec.preprocessing.kind.own_size:  # a scan or a signal: its size and channels are the input's own
        raise UsageError(
            f"{spec.name} reads {spec.preprocessing.kind}s of any size, so --layers and --layer have no size to "
            "look at; list the layers in Python: explain.candidate_layers(model, x) with one of your inputs"
        )
    try:
        default = spec.preprocessing.input_size or PROBE_SIZE
        sides = [int(side) for side in size.lower().split("x")] if size else [default]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2) or min(sides) < 1:
        raise UsageError(f"--layers {size}: the size must be H or HxW in pixels")
    height, width = sides if len(sides) == 2 else sides * 2
    return torch.zeros(1, 3, height, width, device=spec.device)


def layer_table(spec: ModelSpec, x: torch.Tensor) -> str:
    """The model's layers with spatial outputs at x's size, the automatic choice marked."""
    from .core.layers import layer_choices

    candidates, automatic = layer_choices(spec.model, x, spec.labels)
    if not candidates:
        return f"{spec.name} at {x.shape[-2]}x{x.shape[-1]}: no layer outputs a spatial map"
    mark = "  <- automatic choice" + (" (fused)" if len(automatic) > 1 else "")
    width = max(len(info.name) for info in candidates)
    lines = [f"{spec.name} at {x.shape[-2]}x{x.shape[-1]}: layers whose output is a map (C x H x W), in order"]
    for info in candidates:
        chosen = mark if info.name in automatic else ""
        lines.append(f"  {info.name:{width}}  {info.kind:24} {info.describe()}{chosen}")
    return "\n".join(lines)


def _print_record(record: dict[str, Any], out: Path, quiet: bool) -> None:
    from tqdm import tqdm

    if record["error"]:
        tqdm.write(f"explain: error: {record['error']}", file=sys.stderr)
        return
    if quiet:
        return
    if record["note"]:
        tqdm.write(f"{record['input']}: {record['note']}", file=sys.stdout)
    if record["answer"] is not None:
        tqdm.write(f"{record['input']}: answer {record['answer']!r}", file=sys.stdout)
    for target in record["targets"]:
        line = f"{record['input']}: {target['class_name']} ({target['score']:.3f}) layer={record['layer']}"
        tqdm.write(f"{line} -> {out / target['output']}", file=sys.stdout)


def _run(args: argparse.Namespace) -> int:
    """Everything after the arguments are known to be well-formed: inputs, device, model, export."""
    if args.gallery and not args.inputs and args.from_list is None and args.layers is None:
        return _write_gallery(args.out, args.quiet)  # rebuilt from the manifest alone: no model
    spec = _loaded(args) if is_user_model(args.model) else None  # the user's code says what its model reads
    if getattr(spec, "note", ""):
        print(f"explain: note: {args.model}: {spec.note}", file=sys.stderr)
    kind = spec.preprocessing.kind if spec else VIDEO if args.model in VIDEO_MODELS else IMAGE
    inputs = None if args.layers is not None else _check_inputs(args, kind)
    prepared = None
    if inputs is not None and not args.sanity_check:  # the run's preflight, once, before the model loads
        prepared = prepare(inputs, args.out, args.resume, args.overwrite)
    options = export_options(args)  # the inputs are named first: this imports matplotlib
    device = _device(args.device)
    spec = spec or _loaded(args)
    if args.layers is not None:
        from .models.text_image import TextImageSpec

        if isinstance(spec, TextImageSpec):
            raise UsageError(
                f"{spec.name} reads text besides the image, so --layers has no input to look at; list its layers in "
                "Python: explain.candidate_layers(model.vision_tower, pixel_values)"
            )
        print(layer_table(spec, _probe(spec, args.layers)))
        return EXIT_OK
    task = _check_model(spec, options)
    kind = spec.preprocessing.kind
    if args.fmt is not None and not kind.picture:
        raise UsageError(f"--format sets the format of an image's overlays; {spec.name} writes each {kind}'s own files")
    if args.sanity_check:
        if not task.classifies:
            raise UsageError(f"--sanity-check explains a classifier's class; {spec.name} is a {task.name} model")
        return _sanity_check(args, spec, inputs, options, device)
    return _export(args, spec, prepared, options, device)


def _loaded(args: argparse.Namespace) -> ModelSpec | TextImageSpec:
    """The model the arguments name, on their device (a ``torchrun`` process's own GPU), its clips in sliding
    windows where asked: a vision-language model from its folder (its weights and classes are its own), any other
    as :func:`explain.load_model` loads it.

    Raises:
        UsageError: ``--weights``, ``--labels`` or ``--clip-stride`` for a vision-language model.
    """
    from .export.distributed import this_process
    from .models import load_model
    from .models.text_image import is_text_image_model, load_text_image_model

    device = this_process().device(_device(args.device))  # where the export runs this process's share

    if is_text_image_model(args.model) or (_reading(args).given and not is_user_model(args.model)):
        if args.weights is not None or args.labels is not None or args.clip_stride is not None:
            raise UsageError(
                f"--weights, --labels and --clip-stride are for a named architecture; {args.model} is a "
                "vision-language model's folder, which holds its weights and reads images"
            )
        return load_text_image_model(args.model, device)
    spec = load_model(args.model, args.weights, args.labels, device)
    return spec if args.clip_stride is None else _with_clip_stride(spec, args.clip_stride)


def _with_clip_stride(spec: ModelSpec, stride: int) -> ModelSpec:
    """The model with its clips read in sliding windows, one every ``stride`` frames.

    Raises:
        UsageError: The model reads no videos.
    """
    from dataclasses import replace

    from .models import ClipPreprocessing

    if not isinstance(spec.preprocessing, ClipPreprocessing):
        raise UsageError(f"--clip-stride is for a video model; {spec.name} reads {spec.preprocessing.kind}s")
    return replace(spec, preprocessing=replace(spec.preprocessing, stride=stride))


def _check_model(spec: ModelSpec, options: ExportOptions) -> Task:
    """The settings' rules that need the model: its task (returned) and its class names."""
    from .targets import class_index

    task = options.check_task(spec)  # the layer is resolved once, by the run's first call: a wrong one writes nothing
    if options.target is not None:
        class_index(options.target, spec.labels, len(spec.labels))
    return task


def _export(
    args: argparse.Namespace, spec: ModelSpec, prepared: Prepared, options: ExportOptions, device: torch.device
) -> int:
    """Export the inputs' heatmaps; then the metrics' summary and the gallery, on the first process."""
    from .export.distributed import this_process
    from .export.gallery import PAGE
    from .export.run import export_heatmaps

    report = partial(_print_record, out=args.out, quiet=args.quiet)
    summary = export_heatmaps(spec, prepared, args.out, options, device=device, progress=not args.quiet, report=report)
    process = this_process()
    if not args.quiet:
        print(("" if process.world == 1 else f"rank {process.rank}: ") + summary.line())
    if process.rank != 0:
        return EXIT_SOME_FAILED if summary.failed else EXIT_OK
    records = summary.records
    if options.metrics and any(record["targets"] for record in records):
        _report_metrics(args.out, records, args.quiet)
    if args.gallery or (args.out / PAGE).is_file():  # a gallery already there is kept current (a resumed run)
        _write_gallery(args.out, args.quiet)
    return EXIT_SOME_FAILED if any(record["error"] for record in records) else EXIT_OK


def _write_gallery(out: Path, quiet: bool) -> int:
    """Write the output folder's gallery from its manifest."""
    from .export.gallery import write_gallery

    page = write_gallery(out)
    if not quiet:
        print(f"gallery: {page}")
    return EXIT_OK


def _sanity_check(
    args: argparse.Namespace, spec: ModelSpec, inputs: list[Input], options: ExportOptions, device: torch.device
) -> int:
    """The randomization test of each asked method on the readable images, in batches; its files and verdicts."""
    from .export.inputs import mark_output_folder
    from .export.reports import write_sanity
    from .metrics.sanity import SanityResult, sanity_check

    groups, errors = _readable_batches(spec, inputs, options)
    for error in errors:
        print(f"explain: error: {error}", file=sys.stderr)
    if not groups:
        return EXIT_SOME_FAILED
    results, seed = {}, args.seed or 0
    for name in options.methods.names:
        own = options.methods.options_for(name, options.batch_size)
        parts = [
            sanity_check(spec.model, x.to(device), name, options.target, layer=options.layer, init_seed=seed, **own)
            for x in groups
        ]
        results[name] = SanityResult.merged(parts)
    mark_output_folder(args.out)
    write_sanity(args.out, results)
    if not args.quiet:
        for name, result in results.items():
            verdict = "FAILS" if result.insensitive() else "passes"
            print(
                f"{name}: {verdict} (Spearman with the trained maps: {result.spearman[0].mean():.2f} with "
                f"{result.blocks[0]} random, {result.spearman[-1].mean():.2f} with all {len(result.blocks)} blocks)"
            )
        print(f"sanity check: {args.out / 'sanity.csv'}, {args.out / 'sanity.json'}, {args.out / 'sanity.png'}")
    return EXIT_SOME_FAILED if errors else EXIT_OK


def _readable_batches(
    spec: ModelSpec, inputs: list[Input], options: ExportOptions
) -> tuple[list[torch.Tensor], list[str]]:
    """The inputs' images as the model's batches (one per input shape and batch), and the errors of those that
    could not be read."""
    from .export.loading import load_batches

    errors = [item.error for item in inputs if item.error is not None]
    paths = [item.path for item in inputs if item.path is not None]
    read = spec.preprocessing.with_aspect(options.keep_aspect).read
    groups = []
    for batch in load_batches(paths, read, options.batch_size, workers=0, pin=False):
        errors += [error for _, error in batch.failed]
        groups += [group.x for group in batch.groups]
    return groups, errors


def _report_metrics(out: Path, records: list[dict[str, Any]], quiet: bool) -> None:
    """Write the metrics' summary files, and print their means with 95% intervals."""
    from .export.reports import write_summary

    rows = write_summary(out, records)
    if not quiet:
        for row in rows:
            low, high = row["ci95"]
            print(
                f"{row['method']} {row['metric']}: {row['mean']:.4g} (95% CI {low:.4g} to {high:.4g}, "
                f"{row['images']} images, {row['better']} is better)"
            )
        print(f"metrics: {out / 'metrics.csv'}, {out / 'metrics.json'}, {out / 'metrics.png'}")


def _os_error(err: OSError, out: Path) -> str:
    """An OS error that no step turned into its own message, as one line: what failed (a write into the output
    folder, or a read elsewhere) and on which path."""
    if err.filename is None:
        return f"{err.strerror or err}"
    path = Path(err.filename)
    try:
        writing = path.resolve().is_relative_to(out.resolve())
    except (OSError, RuntimeError):
        writing = False
    return f"cannot {'write' if writing else 'read'} {path}: {err.strerror or err}"


APP = "app"  # ``explain app ...``: the interactive explorer (a file named app is ``./app``)


def build_app_parser() -> argparse.ArgumentParser:
    """The argument parser of ``explain app``."""
    parser = _Parser(
        prog="explain app",
        description="The interactive explorer: a local web page to drop images in and switch the class, the method "
        'and the layer of their heatmaps (needs Gradio: pip install "explain[app]").',
    )
    parser.add_argument("--model", default=BUNDLED_MODEL, help=f"the model (default {BUNDLED_MODEL}: offline)")
    parser.add_argument("--weights", help="a checkpoint of the model")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1: this "
        "machine only; 0.0.0.0 lets anyone on the network use it)",
    )
    parser.add_argument("--port", type=int, default=7860, help="the port (default 7860)")
    parser.add_argument("--device", help="where the model runs (default: cuda if available, else cpu)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print warnings only")
    return parser


def _app(argv: Sequence[str]) -> int:
    """``explain app``: serve the explorer until interrupted."""
    args = build_app_parser().parse_args(argv)
    from .explorer.web import gradio, serve

    gradio()  # a missing extra is named before the model loads
    serve(args.model, args.weights, args.host, args.port, _device(args.device), args.quiet)
    return EXIT_OK


def _image_paths(sources: Sequence[str], exclude: Path | None, what: str) -> list[Path]:
    """The image files of files, folders and patterns.

    Raises:
        UsageError: One is missing, or none is an image.
    """
    inputs = collect_inputs(sources, exclude=exclude, kind=IMAGE)
    missing = [item for item in inputs if item.path is None]
    if missing:
        raise UsageError(missing[0].error or f"{missing[0].name}: not found")
    if not inputs:
        raise UsageError(f"{what} {' '.join(map(str, sources))}: no images there")
    return [item.path for item in inputs]


EVALUATE = "evaluate"  # ``explain evaluate ...``: which method to trust, measured on the user's images


def _evaluate(argv: Sequence[str]) -> int:
    """``explain evaluate``: score methods and layers with the metrics, rank them, write the report."""
    from .evaluation import command
    from .models.loaders import load_named

    parser = _Parser(
        prog="explain evaluate",
        description="Which method should I trust here? Score a grid of methods and layers with the field's metrics "
        "on your images, with bootstrap intervals, and rank them.",
    )
    command.add_arguments(parser, BUNDLED_MODEL)
    args = parser.parse_args(argv)
    command.check(args)  # named before the model loads
    paths = _image_paths(args.inputs, args.out, "the images")
    spec = load_named(args.model, args.weights, _device(args.device))
    print(command.run(args, spec, paths))
    return EXIT_OK


CONCEPTS, TCAV = "concepts", "tcav"  # ``explain concepts``: a folder's concept atlas; ``explain tcav``: a CAV's score


def _concepts(argv: Sequence[str]) -> int:
    """``explain concepts``: the concept atlas of a folder (CRAFT), written as a page, a sheet and a manifest."""
    from .atlas import command
    from .export.distributed import this_process
    from .models.loaders import load_named

    parser = _Parser(
        prog="explain concepts",
        description="What the model sees, not only where: the concepts a layer holds over your images' crops "
        "(CRAFT), each with its importance for the class, its best crops and its map on every image.",
    )
    command.add_concepts_arguments(parser, BUNDLED_MODEL)
    args = parser.parse_args(argv)
    paths = _image_paths(args.inputs, args.out, "the images")
    spec = load_named(args.model, args.weights, this_process().device(_device(args.device)))  # torchrun: a GPU each
    said = command.run_concepts(args, spec, paths)
    if said:
        print(said)
    return EXIT_OK


def _tcav(argv: Sequence[str]) -> int:
    """``explain tcav``: the TCAV score of a concept for a class, with its significance."""
    from .atlas import command
    from .models.loaders import load_named

    parser = _Parser(
        prog="explain tcav",
        description="Does the class's score rise along your concept? The share of the images whose score does "
        "(TCAV), against random counterexamples, with a t-test over random halves.",
    )
    command.add_tcav_arguments(parser, BUNDLED_MODEL)
    args = parser.parse_args(argv)
    paths = _image_paths(args.inputs, None, "the images")
    concept = _image_paths(args.concept, None, "--concept")
    random = _image_paths(args.random, None, "--random")
    spec = load_named(args.model, args.weights, _device(args.device))
    print(command.run_tcav(args, spec, paths, concept, random))
    return EXIT_OK


# The commands besides the heatmaps of images: each one's entry point, what it does and an example (explain --help).
COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str, str]] = {
    APP: (_app, "the interactive explorer, a local web page", "explain app --model resnet50"),
    EVALUATE: (_evaluate, "which method to trust here, measured on your images", "explain evaluate photos/"),
    CONCEPTS: (_concepts, "what the model sees: a folder's concept atlas (CRAFT)", "explain concepts photos/"),
    TCAV: (_tcav, "does a class's score rise along your concept (TCAV)",
           "explain tcav cats/ --target 'tabby cat' --concept stripes/ --random random/"),
}  # fmt: skip


def commands_help() -> str:
    """The commands, each with one line and an example, as ``explain --help`` lists them."""
    lines = ["commands (each has its own --help):", f"  {'explain IMAGES...':<20} heatmaps of each image (below)"]
    lines += [f"  {'explain ' + name:<20} {said}\n  {'':<20}   e.g. {example}" for name, (_, said, example) in
              COMMANDS.items()]  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 all written, 1 some inputs failed, 2 usage error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = None
    try:
        if argv[:1] and argv[0] in COMMANDS:
            return COMMANDS[argv[0]][0](argv[1:])
        args = build_parser().parse_args(argv)
        if args.method == "list":
            print(method_table())
            return EXIT_OK
        _check_options(args)
        return _run(args)
    except ExplainError as err:
        print(f"explain: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:
        print(f"explain: error: {_os_error(err, args.out if args else Path.cwd())}", file=sys.stderr)
        return EXIT_SOME_FAILED
    except KeyboardInterrupt:
        print("explain: interrupted; what was written is complete and recorded: --resume continues", file=sys.stderr)
        return EXIT_INTERRUPTED
