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

# Version of the manifest records' fields; 2: one list of explained targets per input, whatever the options;
# 3: each target's metrics and curves (null unless asked).
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

    ``method`` is a name of ``explain.METHODS``, several joined by commas (each writes its own
    outputs and manifest records), or ``"all"`` for one grid figure per explained target with
    every fast method; ``method_options`` go to the method (see
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
    metrics: dict[str, dict[str, float]] | None = None  # by method, each asked metric's value
    curves: dict[str, dict[str, list[float]]] | None = None  # by method, the deletion and insertion curves


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
        names = FAST_METHODS if options.method == ALL_METHODS else options.method.split(",")
        self.methods: dict[str, Method] = {
            name: create_method(name, spec.model, options.layer, labels=spec.labels, **self._options_for(name))
            for name in names
        }
        self.target = task_target(spec, options)

    @property
    def outputs(self) -> list[str]:
        """The methods whose outputs are written apart: each asked one, or ``"all"`` (one grid of them all)."""
        return [ALL_METHODS] if self.options.method == ALL_METHODS else list(self.methods)

    def tag(self, k: int, class_name: str, method: str) -> str:
        """What tells an image's outputs apart: the method, and which target (top class, detection, segment)."""
        if self.spec.task == "detection":
            return f".{method}.box{k + 1}"
        if self.spec.task == "segmentation":
            return f".{method}.{_slug(class_name)}"
        return f".{method}" + (f".top{k + 1}" if self.options.topk else "")

    def _options_for(self, name: str) -> dict[str, Any]:
        """The options a method gets: all given for one method; of several, each gets those it takes."""
        given = dict(self.options.method_options)
        if self.options.method == name:
            return given
        return {k: v for k, v in given.items() if k in method_options(name)}

    def paths(self, base: Path, tags: Sequence[str], method: str) -> tuple[list[Path], list[Path], Path | None]:
        """The overlays, figures and raw maps of one method written for an output base path and its targets' tags."""
        o = self.options
        overlays = [base.with_name(base.name + tag + f".{o.fmt}") for tag in tags]
        figures = [base.with_name(base.name + tag + f".figure.{o.fmt}") for tag in tags] if o.figure else []
        raw = base.with_name(f"{base.name}.{method}.npy") if o.save_raw else None
        return overlays, figures, raw

    def files_for(self, base: Path) -> list[Path]:
        """The files written for an output base path (for detections and segments, those of the first target)."""
        files = []
        for method in self.outputs:
            tags = [self.tag(k, "class", method) for k in range(self.options.topk or 1)]
            overlays, figures, raw = self.paths(base, tags, method)
            files += [*overlays, *figures, *([raw] if raw else [])]
        return files

    def record(
        self,
        item: Input,
        error: str | None = None,
        targets: list[dict[str, Any]] | None = None,
        layer: str | None = None,
        raw: str | None = None,
        note: str | None = None,
        method: str | None = None,
    ) -> dict[str, Any]:
        """A manifest record of an input (and one method of several): the same fields whatever the options
        (see ``MANIFEST_SCHEMA``)."""
        return {
            "schema": MANIFEST_SCHEMA,
            "input": item.name,
            "model": self.spec.name,
            "method": method or self.options.method,
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

    def explain(self, group: Sequence[_Loaded]) -> list[Callable[[], list[dict[str, Any]]]]:
        """Explain images of one input size together; returns a job per image that writes its outputs."""
        x = torch.stack([member.tensor for member in group]).to(self.device)
        results = {}
        for name, method in list(self.methods.items()):
            try:
                results[name] = method(x, self.target)
            except NothingToExplain:
                raise
            except (LayerError, TargetError):
                if self.options.method != ALL_METHODS:
                    raise
                del self.methods[name]  # the comparison grid leaves out a method that does not fit the model (CAM)
        first = next(iter(results.values()))
        bound = first.target

        def per_target(t: torch.Tensor | None) -> torch.Tensor | None:  # (N, K, ...) whatever the target
            return None if t is None else (t if bound.keeps_k else t[:, None]).cpu()

        cams = {name: per_target(result.cams) for name, result in results.items()}
        raws = {name: per_target(result.raw) for name, result in results.items()}
        classes, scores = per_target(first.class_indices), per_target(first.probabilities)
        valid = torch.ones(classes.shape, dtype=torch.bool) if bound.valid is None else bound.valid.cpu()
        boxes = None if bound.boxes is None else bound.boxes.cpu()
        regions = None if bound.regions is None else bound.regions.cpu()
        measured = {name: self.measured(x, result) for name, result in results.items()}
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
                    metrics={
                        m: {name: round(float(v[i]), 6) for name, v in values.items()}
                        for m, (values, _) in measured.items()
                    }
                    if self.options.metrics
                    else None,
                    curves={
                        m: {name: [round(p, 6) for p in c[i].tolist()] for name, c in curves.items()}
                        for m, (_, curves) in measured.items()
                    }
                    if self.options.metrics
                    else None,
                )
                for k in valid[i].nonzero()[:, 0].tolist()
            ]
            raw = {name: r[i][valid[i]] if bound.keeps_k else r[i, 0] for name, r in raws.items()}
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

    def write(
        self, member: _Loaded, explained: list[_Explained], raws: dict[str, torch.Tensor], layer: str
    ) -> list[dict[str, Any]]:
        """Render and write one image's outputs, a map per target for each method (or their grid); returns its
        manifest records, one per method written apart."""
        return [self.write_method(member, explained, method, raws.get(method), layer) for method in self.outputs]

    def write_method(
        self, member: _Loaded, explained: list[_Explained], method: str, raw: torch.Tensor | None, layer: str
    ) -> dict[str, Any]:
        """Render and write one image's outputs of one method (or of ``"all"``: the grid); returns the record."""
        o = self.options
        tags = [self.tag(e.k, e.class_name, method) for e in explained]
        outputs, figures, raw_path = self.paths(member.base, tags, method)
        targets = []
        try:
            for j, (e, output) in enumerate(zip(explained, outputs)):
                mark = partial(self.annotated, e)
                if method == ALL_METHODS:
                    title = f"{e.class_name} ({e.score:.1%}), every fast method"
                    save_image(render.grid(member.image, e.cams, title, o.alpha, o.colormap, mark=mark), output)
                else:
                    save_image(mark(render.picture(member.image, e.cams[method], o.alpha, o.colormap)), output)
                if figures:
                    title = f"{e.class_name} ({e.score:.1%}), {method} at {layer}"
                    save_image(
                        render.figure(member.image, e.cams[method], title, o.alpha, o.colormap, mark), figures[j]
                    )
                targets.append(
                    {
                        "class_index": e.class_index,
                        "class_name": e.class_name,
                        "score": round(e.score, 6),
                        "box": None if e.box is None else [round(v, 1) for v in e.box],
                        "region": None if e.region is None else self.region_record(e.region, member.image.size),
                        "output": str(output),
                        "figure": str(figures[j]) if figures else None,
                        "metrics": e.metrics[method] if e.metrics else None,
                        "curves": (e.curves[method] or None) if e.curves else None,
                    }
                )
            if raw_path:
                save_array(raw.numpy(), raw_path)
        except OSError as err:
            error = f"{member.item.name}: cannot write outputs: {first_line(err)}"
            return self.record(member.item, error, method=method)
        raw_name = str(raw_path) if raw_path else None
        return self.record(member.item, targets=targets, layer=layer, raw=raw_name, method=method)

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

    def explain_robustly(self, group: Sequence[_Loaded]) -> list[Callable[[], list[dict[str, Any]]]]:
        """Explain a group; if it fails, explain its images one by one so one bad image costs only itself.
        An image with nothing to explain (no detection, no pixel of the class) gets a note and no outputs."""
        try:
            return self.explain(group)
        except NothingToExplain as err:
            if len(group) == 1:
                note = f"nothing to explain: {err.reason}"
                return [lambda: [self.record(group[0].item, targets=[], note=note, method=m) for m in self.outputs]]
        except (LayerError, TargetError):
            raise
        except (RuntimeError, AssertionError) as err:  # the model's own refusal of an input (timm asserts sizes)
            if len(group) == 1:
                error = f"{group[0].item.name}: {first_line(err)}"
                return [lambda: [self.record(group[0].item, error)]]
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
        The manifest entries, in input order (an input's entries in method order).
    """
    out_dir = Path(out_dir)
    exporter = _Exporter(spec, out_dir, options, torch.device(device))
    inputs = collect_inputs(sources, exclude=out_dir)
    readable = [item for item in inputs if item.path is not None]
    bases = dict(zip(readable, output_bases(readable, out_dir, exporter.files_for)))
    done: dict[Input, list[dict[str, Any]]] = {}
    writing: deque[tuple[Input, Future[list[dict[str, Any]]]]] = deque()

    def finish(item: Input, records: list[dict[str, Any]]) -> None:
        done[item] = records
        if item.path is not None:  # the bar counts files, not sources that gave none
            bar.update()
        for record in records if report else ():
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
                finish(item, [exporter.record(item, item.error)])
        for batch in _batches(readable, options.batch_size):
            groups: dict[tuple[int, ...], list[_Loaded]] = {}
            for item, loaded in zip(batch, pool.map(exporter.load, batch, [bases[i] for i in batch])):
                if isinstance(loaded, _Loaded):
                    groups.setdefault(tuple(loaded.tensor.shape), []).append(loaded)
                else:
                    finish(item, [loaded])
            for group in groups.values():
                jobs = exporter.explain_robustly(group)
                mark_output_folder(out_dir)
                writing.extend((member.item, pool.submit(job)) for member, job in zip(group, jobs))
            collect(keep=2 * options.batch_size)
        collect(keep=0)
    records = [record for item in inputs for record in done[item]]
    text = "".join(json.dumps(record) + "\n" for record in records)
    mark_output_folder(out_dir)
    write_atomically(out_dir / MANIFEST, lambda temp: temp.write_text(text, encoding="utf-8"))
    return records
