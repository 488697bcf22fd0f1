"""Batch export: explain every image of files, folders and globs, and write overlays and a manifest."""

from __future__ import annotations

import json
import os
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from tqdm import tqdm

from . import render
from .catalog import ALL_METHODS
from .engine import CAMResult
from .errors import ImageLoadError, LayerError, NothingToExplain, TargetError, first_line
from .image_io import load_image, save_array, save_image, write_atomically
from .inputs import MANIFEST, Input, collect_inputs, mark_output_folder
from .layers import LayerSpec
from .methods import FAST_METHODS, Method, create_method, method_options
from .models import ModelSpec
from .targets import ClassTarget, DetectionTarget, SegmentationTarget, Target, TopK

# Version of the manifest records' fields; 2: one list of explained targets per input, whatever the options.
MANIFEST_SCHEMA = 3
BACKGROUND = "__background__"  # the name of class 0 of torchvision's segmenters and detectors


@dataclass(frozen=True)
class _Loaded:
    """An image read and preprocessed, with where its outputs go."""

    item: Input
    image: Image.Image
    tensor: torch.Tensor
    base: Path


@dataclass(frozen=True)
class ExportOptions:
    """What to explain and what to write for each image.

    ``method`` is a name of ``explain.METHODS``, or ``"all"`` for one grid figure per
    explained target with every fast method; ``method_options`` go to the method (see
    :func:`explain.cam`); under ``"all"`` each method gets those it takes. What is
    explained follows from the model's task (see :func:`task_target`): ``target`` is a
    class index or name, ``topk`` a classifier's K top classes, ``score_threshold`` the
    least score of an explained detection. ``keep_aspect`` None resizes as the model does.
    ``metrics`` names faithfulness metrics (``explain.catalog.METRIC_NAMES``) measured for each image's map,
    one class per image.
    """

    method: str = "gradcam"
    method_options: Mapping[str, Any] = field(default_factory=dict)
    layer: LayerSpec | Sequence[str] = None
    target: int | str | None = None
    topk: int | None = None
    score_threshold: float = 0.5
    batch_size: int = 16
    alpha: float = 0.5
    colormap: str = "jet"
    fmt: str = "png"
    save_raw: bool = False
    figure: bool = False
    keep_aspect: bool | None = None
    metrics: Sequence[str] = ()


def task_target(spec: ModelSpec, options: ExportOptions) -> Target:
    """What the export explains, from the model's task.

    - classification: ``options.target`` for every image, else each image's top class
      (or its ``topk`` top classes);
    - segmentation: ``options.target`` over the pixels it wins, else every class that wins
      a pixel, background left out;
    - detection: every detection scoring at least ``options.score_threshold`` (only those
      of class ``options.target``, if given).
    """
    if spec.task == "segmentation":
        background = 0 if spec.labels[0] == BACKGROUND else None
        return SegmentationTarget(options.target, background=background)
    if spec.task == "detection":
        return DetectionTarget(labels=options.target, score_threshold=options.score_threshold)
    return TopK(options.topk) if options.topk else ClassTarget(options.target)


def _slug(name: str) -> str:
    """A class name as part of a file name: lower case, runs of other characters than letters and digits as '-'."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "class"


@dataclass(frozen=True)
class _Explained:
    """One explained target of one image, ready to render: its map(s) by method and what it explains."""

    k: int
    cams: dict[str, torch.Tensor]
    class_index: int
    class_name: str
    score: float
    box: list[float] | None  # x1, y1, x2, y2 in the original image's pixels
    region: torch.Tensor | None  # the region's weights at the model output's resolution
    metrics: dict[str, float] | None = None  # each asked metric's value (see explain.metrics.report)
    curves: dict[str, list[float]] | None = None  # the deletion and insertion curves among them


def output_bases(inputs: Sequence[Input], out_dir: Path, files_for: Callable[[Path], list[Path]]) -> list[Path]:
    """Choose where each input's outputs go: ``out_dir / input.relative``.

    A ``-2``, ``-3``... suffix keeps bases apart when two inputs would share one
    (``cats/chelsea.png`` and ``more/chelsea.png`` given as files, or ``a.jpg`` beside
    ``a.png``) and keeps any output from landing on an input file.

    Args:
        inputs: The inputs that have a file.
        out_dir: The output folder.
        files_for: The files written for a base path.
    """
    taken = {item.path.resolve() for item in inputs}
    bases = []
    for item in inputs:
        base, number = out_dir / item.relative, 1
        while any(f.resolve() in taken for f in files_for(base)):
            number += 1
            base = out_dir / item.relative.parent / f"{item.relative.name}-{number}"
        taken.update(f.resolve() for f in files_for(base))
        bases.append(base)
    return bases


def _batches(items: Sequence[Input], size: int) -> Iterator[Sequence[Input]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class _Exporter:
    """Runs one export: loads, explains and writes, one batch at a time."""

    def __init__(self, spec: ModelSpec, out_dir: Path, options: ExportOptions, device: torch.device) -> None:
        self.spec = spec
        self.out_dir = out_dir
        self.options = options
        self.device = device
        names = FAST_METHODS if options.method == ALL_METHODS else [options.method]
        self.methods: dict[str, Method] = {
            name: create_method(name, spec.model, options.layer, labels=spec.labels, **self._options_for(name))
            for name in names
        }
        self.target = task_target(spec, options)

    def tag(self, k: int, class_name: str) -> str:
        """What tells an image's outputs apart: the method, and which target (top class, detection, segment)."""
        o = self.options
        if self.spec.task == "detection":
            return f".{o.method}.box{k + 1}"
        if self.spec.task == "segmentation":
            return f".{o.method}.{_slug(class_name)}"
        return f".{o.method}" + (f".top{k + 1}" if o.topk else "")

    def _options_for(self, name: str) -> dict[str, Any]:
        given = dict(self.options.method_options)
        if self.options.method != ALL_METHODS:
            return given
        return {k: v for k, v in given.items() if k in method_options(name)}

    def paths(self, base: Path, tags: Sequence[str]) -> tuple[list[Path], list[Path], Path | None]:
        """The overlays, figures and raw maps written for an output base path and its targets' tags."""
        o = self.options
        overlays = [base.with_name(base.name + tag + f".{o.fmt}") for tag in tags]
        figures = [base.with_name(base.name + tag + f".figure.{o.fmt}") for tag in tags] if o.figure else []
        raw = base.with_name(f"{base.name}.{o.method}.npy") if o.save_raw else None
        return overlays, figures, raw

    def files_for(self, base: Path) -> list[Path]:
        """The files written for an output base path (for detections and segments, those of the first target)."""
        overlays, figures, raw = self.paths(base, [self.tag(k, "class") for k in range(self.options.topk or 1)])
        return [*overlays, *figures, *([raw] if raw else [])]

    def record(
        self,
        item: Input,
        error: str | None = None,
        targets: list[dict[str, Any]] | None = None,
        layer: str | None = None,
        raw: str | None = None,
        note: str | None = None,
    ) -> dict[str, Any]:
        """An input's manifest record: the same fields whatever the options (see ``MANIFEST_SCHEMA``)."""
        return {
            "schema": MANIFEST_SCHEMA,
            "input": item.name,
            "model": self.spec.name,
            "method": self.options.method,
            "layer": layer,
            "targets": targets,
            "raw": raw,
            "note": note,
            "error": error,
        }

    def load(self, item: Input, base: Path) -> _Loaded | dict[str, Any]:
        """Read and preprocess one image; a file that cannot be read gives its error record."""
        try:
            image = load_image(item.path)
        except ImageLoadError as err:
            return self.record(item, str(err))
        return _Loaded(item, image, self.spec.transform(image, self.options.keep_aspect), base)

    def explain(self, group: Sequence[_Loaded]) -> list[Callable[[], dict[str, Any]]]:
        """Explain images of one input size together; returns a job per image that writes its outputs."""
        x = torch.stack([member.tensor for member in group]).to(self.device)
        results = {}
        for name, method in list(self.methods.items()):
            try:
                results[name] = method(x, self.target)
            except NothingToExplain:
                raise
            except (LayerError, TargetError):
                if len(self.methods) == 1:
                    raise
                del self.methods[name]  # a comparison leaves out a method that does not fit the model or task (CAM)
        first = next(iter(results.values()))
        bound = first.target

        def per_target(t: torch.Tensor | None) -> torch.Tensor | None:  # (N, K, ...) whatever the target
            return None if t is None else (t if bound.keeps_k else t[:, None]).cpu()

        cams = {name: per_target(result.cams) for name, result in results.items()}
        raws, classes, scores = per_target(first.raw), per_target(first.class_indices), per_target(first.probabilities)
        valid = torch.ones(classes.shape, dtype=torch.bool) if bound.valid is None else bound.valid.cpu()
        boxes = None if bound.boxes is None else bound.boxes.cpu()
        regions = None if bound.regions is None else bound.regions.cpu()
        values, curves = self.measured(x, first)
        jobs = []
        for i, member in enumerate(group):
            width, height = member.image.size
            scale = torch.tensor([width / x.shape[-1], height / x.shape[-2]] * 2)
            explained = [
                _Explained(
                    k=k,
                    cams={name: c[i, k] for name, c in cams.items()},
                    class_index=int(classes[i, k]),
                    class_name=self.spec.labels[int(classes[i, k])],
                    score=float(scores[i, k]),
                    box=None if boxes is None else (boxes[i, k] * scale).tolist(),
                    region=None if regions is None else regions[i, k],
                    metrics={name: round(float(v[i]), 6) for name, v in values.items()} if values else None,
                    curves={name: [round(p, 6) for p in c[i].tolist()] for name, c in curves.items()} or None,
                )
                for k in valid[i].nonzero()[:, 0].tolist()
            ]
            raw = raws[i][valid[i]] if bound.keeps_k else raws[i, 0]
            jobs.append(partial(self.write, member, explained, raw, first.layer))
        return jobs

    def measured(self, x: torch.Tensor, result: CAMResult) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The asked metrics of a batch's maps, per image, and the deletion and insertion curves among them."""
        if not self.options.metrics:
            return {}, {}
        from .metrics.report import image_metrics

        values, curves = image_metrics(
            self.options.metrics, self.spec.model, x, result.cams, result.target, self.options.batch_size
        )
        return {k: v.cpu() for k, v in values.items()}, {k: c.cpu() for k, c in curves.items()}

    def write(self, member: _Loaded, explained: list[_Explained], raw: torch.Tensor, layer: str) -> dict[str, Any]:
        """Render and write one image's outputs (a map per target and method); returns its manifest record."""
        o = self.options
        tags = [self.tag(e.k, e.class_name) for e in explained]
        outputs, figures, raw_path = self.paths(member.base, tags)
        targets = []
        try:
            for j, (e, output) in enumerate(zip(explained, outputs)):
                mark = partial(self.annotated, e)
                if o.method == ALL_METHODS:
                    title = f"{e.class_name} ({e.score:.1%}), every fast method"
                    save_image(render.grid(member.image, e.cams, title, o.alpha, o.colormap, mark=mark), output)
                else:
                    (cam,) = e.cams.values()
                    save_image(mark(render.picture(member.image, cam, o.alpha, o.colormap)), output)
                if figures:
                    title = f"{e.class_name} ({e.score:.1%}), {o.method} at {layer}"
                    save_image(render.figure(member.image, cam, title, o.alpha, o.colormap, mark), figures[j])
                targets.append(
                    {
                        "class_index": e.class_index,
                        "class_name": e.class_name,
                        "score": round(e.score, 6),
                        "box": None if e.box is None else [round(v, 1) for v in e.box],
                        "region": None if e.region is None else self.region_record(e.region, member.image.size),
                        "output": str(output),
                        "figure": str(figures[j]) if figures else None,
                        "metrics": e.metrics,
                        "curves": e.curves,
                    }
                )
            if raw_path:
                save_array(raw.numpy(), raw_path)
        except OSError as err:
            return self.record(member.item, f"{member.item.name}: cannot write outputs: {first_line(err)}")
        return self.record(member.item, targets=targets, layer=layer, raw=str(raw_path) if raw_path else None)

    @staticmethod
    def annotated(e: _Explained, picture: Image.Image) -> Image.Image:
        """A picture with what a detection's or a segment's map explains drawn on it: its box or outline, and label."""
        if e.box is None and e.region is None:
            return picture
        return render.annotate(picture, f"{e.class_name} {e.score:.3g}", e.box, e.region)

    @staticmethod
    def region_record(region: torch.Tensor, size: tuple[int, int]) -> dict[str, Any]:
        """A segment in the manifest: its share of the image and its bounding box in the image's pixels."""
        rows, cols = region.nonzero(as_tuple=True)
        height, width = region.shape
        sx, sy = size[0] / width, size[1] / height
        box = [float(cols.min()) * sx, float(rows.min()) * sy, float(cols.max() + 1) * sx, float(rows.max() + 1) * sy]
        return {"fraction": round(float((region > 0).float().mean()), 6), "box": [round(v, 1) for v in box]}

    def explain_robustly(self, group: Sequence[_Loaded]) -> list[Callable[[], dict[str, Any]]]:
        """Explain a group; if it fails, explain its images one by one so one bad image costs only itself.
        An image with nothing to explain (no detection, no pixel of the class) gets a note and no outputs."""
        try:
            return self.explain(group)
        except NothingToExplain as err:
            if len(group) == 1:
                return [partial(self.record, group[0].item, targets=[], note=f"nothing to explain: {err.reason}")]
        except (LayerError, TargetError):
            raise
        except (RuntimeError, AssertionError) as err:  # the model's own refusal of an input (timm asserts sizes)
            if len(group) == 1:
                return [partial(self.record, group[0].item, f"{group[0].item.name}: {first_line(err)}")]
        return [job for member in group for job in self.explain_robustly([member])]


def export_heatmaps(
    spec: ModelSpec,
    sources: Sequence[str | Path | Input],
    out_dir: str | Path,
    options: ExportOptions = ExportOptions(),
    device: str | torch.device = "cpu",
    progress: bool = False,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Explain every image found in ``sources`` and write overlays plus ``out_dir/manifest.jsonl``.

    Inputs that cannot be read get a manifest entry with their ``error`` and are
    reported; every other input is still written. Each file is written atomically.
    The output folder is created and marked as such (see :mod:`explain.inputs`) when the
    first outputs are ready, so a run that fails on its first batch writes nothing.

    Args:
        spec: The model and its preprocessing (see :func:`explain.models.load_model`).
        sources: Files, folders (searched recursively) and glob patterns, or the
            inputs :func:`explain.inputs.collect_inputs` found in them.
        out_dir: Output folder.
        options: What to explain and write.
        device: Where to run the model.
        progress: Show a tqdm progress bar on stderr (when stderr is a terminal).
        report: Called with each input's manifest entry as soon as it is done.

    Returns:
        The manifest entries, in input order.
    """
    out_dir = Path(out_dir)
    exporter = _Exporter(spec, out_dir, options, torch.device(device))
    inputs = collect_inputs(sources, exclude=out_dir)
    readable = [item for item in inputs if item.path is not None]
    bases = dict(zip(readable, output_bases(readable, out_dir, exporter.files_for)))
    done: dict[Input, dict[str, Any]] = {}
    writing: deque[tuple[Input, Future[dict[str, Any]]]] = deque()

    def finish(item: Input, record: dict[str, Any]) -> None:
        done[item] = record
        if item.path is not None:  # the bar counts files, not sources that gave none
            bar.update()
        if report:
            report(record)

    def collect(keep: int) -> None:
        """Finish written inputs in order, waiting while more than ``keep`` are pending."""
        while writing and (len(writing) > keep or writing[0][1].done()):
            item, future = writing.popleft()
            finish(item, future.result())

    # Threads decode and encode images (Pillow and zlib release the GIL) while the model runs.
    with (
        tqdm(total=len(readable), unit="img", disable=None if progress else True, file=sys.stderr) as bar,
        ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool,
    ):
        for item in inputs:
            if item.error is not None:
                finish(item, exporter.record(item, item.error))
        for batch in _batches(readable, options.batch_size):
            groups: dict[tuple[int, ...], list[_Loaded]] = {}
            for item, loaded in zip(batch, pool.map(exporter.load, batch, [bases[i] for i in batch])):
                if isinstance(loaded, _Loaded):
                    groups.setdefault(tuple(loaded.tensor.shape), []).append(loaded)
                else:
                    finish(item, loaded)
            for group in groups.values():
                jobs = exporter.explain_robustly(group)
                mark_output_folder(out_dir)
                writing.extend((member.item, pool.submit(job)) for member, job in zip(group, jobs))
            collect(keep=2 * options.batch_size)
        collect(keep=0)
    records = [done[item] for item in inputs]
    text = "".join(json.dumps(record) + "\n" for record in records)
    mark_output_folder(out_dir)
    write_atomically(out_dir / MANIFEST, lambda temp: temp.write_text(text, encoding="utf-8"))
    return records
