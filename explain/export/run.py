"""Batch export, the run loop: inputs, batches, model, maps, render, write, record.

Inputs are found (:mod:`explain.export.inputs`), those a resumed run finished are skipped
(:mod:`explain.export.manifest`), a process of a ``torchrun`` launch takes its share
(:mod:`explain.export.distributed`), worker processes or threads load the images in batches
(:mod:`explain.export.loading`), the model explains each batch here, and threads render and write each image's
files (:mod:`explain.export.outputs`) while the model works on the next batch; each input's records are appended
to the manifest as soon as its files are whole.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ..core.engine import CAM, CAMResult
from ..core.maps import normalize_maps
from ..errors import ImageRefused, LayerError, NothingToExplain, TargetError, first_line
from ..io.atomic import remove_temporary_files
from ..io.video import windowed_maps
from ..methods import create_method
from ..models import ModelSpec
from ..models.text_image import TextImageSpec
from ..targets import ClassTarget, RegionTarget, Target, class_index
from ..targets.base import read_output
from ..targets.oriented import rotated_corners, upright_boxes
from ..tasks.base import Task
from .distributed import Process, process_group, this_process
from .gallery import remove_gallery
from .inputs import Input, mark_output_folder
from .loading import Group, default_workers, helper_threads, load_batches
from .manifest import (
    MANIFEST,
    ManifestWriter,
    check_settings,
    finished,
    header,
    merge,
    part_name,
    previous_run,
    remove_run,
    rename_inputs,
)
from .outputs import Explained, Explanation, Failure, NothingFound, Outcome, OutputWriter, output_bases
from .ownership import FolderLock
from .preflight import Prepared, prepare
from .settings import ExportOptions
from .words import WordsExplainer


def _upright(boxes: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Boxes as (x1, y1, x2, y2), (N, K, 4), and, for oriented boxes (cx, cy, w, h, angle), their corners
    (N, K, 4, 2) with the upright boxes around them; upright boxes as they are, without corners."""
    if boxes is None or boxes.shape[-1] != 5:
        return boxes, None
    return upright_boxes(boxes), rotated_corners(boxes.flatten(0, 1)).view(*boxes.shape[:2], 4, 2)


def _writer(out_dir: Path, spec: ModelSpec | TextImageSpec, options: ExportOptions, task: Task) -> OutputWriter:
    """The run's writer, naming each map's files as the task tells them apart."""
    return OutputWriter(
        out_dir, spec.name, task, options.methods.written, options.topk, options.render, spec.preprocessing
    )


def weights_digest(model: nn.Module) -> str:
    """A SHA-256 of the model's parameters and buffers, by name, shape, type and value: what the weights are,
    whatever file they came from."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        values = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(values.shape)}:{values.dtype};".encode())
        digest.update(values.view(-1).view(torch.uint8).numpy())  # the tensor's own bytes, not a copy of them
    return digest.hexdigest()


def run_settings(spec: ModelSpec | TextImageSpec, options: ExportOptions) -> dict[str, Any]:
    """What decides an export's outputs, for its manifest's header: a resumed run must have the same. How the run
    goes (batch size, workers, resume, overwrite) is left out."""
    layer = options.layer
    render = options.render
    chosen = {
        "method": options.methods.text,
        "method_options": dict(sorted(options.method_options.items())),
        "layer": layer if isinstance(layer, (str, type(None))) else [str(part) for part in layer],
        "target": options.target,
        "topk": options.topk,
        "score_threshold": options.score_threshold,
        "keypoint": options.keypoint,
        "prompt": {
            "region": options.prompt.region,
            "region_mask": str(options.prompt.region_mask or "") or None,
            "direction": options.prompt.direction,
            "points": [list(p) for p in options.prompt.points],
            "box": options.prompt.box,
        },
        "alpha": render.alpha,
        "colormap": render.colormap,
        "fmt": render.fmt,
        "save_raw": render.save_raw,
        "figure": render.figure,
        "keep_aspect": options.keep_aspect,
        "metrics": list(options.metrics),
        "reading": {
            **vars(options.reading),
            "texts": list(options.reading.texts),
            "max_new_tokens": options.reading.new_tokens,  # the same run, given 16 or not
        },
    }
    preprocessing = spec.preprocessing.settings()
    return {"model": spec.name, "weights_sha256": weights_digest(spec.model), "preprocessing": preprocessing, **chosen}


@dataclass
class ExportSummary:
    """What an export did.

    Attributes:
        records: The manifest's records (this process's, in a distributed run other than on rank 0), in input
            order: those written now and those a resumed run kept.
        written: Inputs explained and written now.
        failed: Inputs that failed now (each record holds its error).
        skipped: Inputs a resumed run found finished.
        kept: Inputs of the earlier run that a resumed run was not given: their records and files stay as they
            were (the manifest is the union of both runs).
        seconds: The run's time, from the first batch on.
        unit: What the inputs are, in the plural: ``"images"``, ``"videos"``, ``"volumes"`` or ``"signals"``.
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    written: int = 0
    failed: int = 0
    skipped: int = 0
    kept: int = 0
    seconds: float = 0.0
    unit: str = "images"

    @property
    def rate(self) -> float:
        """Inputs written or failed per second."""
        return (self.written + self.failed) / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The one-line summary the command prints at the end."""
        kept = f", kept {self.kept} of the earlier run's inputs untouched" if self.kept else ""
        return (
            f"written {self.written}, failed {self.failed}, skipped {self.skipped}{kept} in {self.seconds:.1f} s "
            f"({self.rate:.1f} {self.unit}/s)"
        )


class _Explainer:
    """The model step: explains a group of same-shape images with every asked method."""

    def __init__(self, spec: ModelSpec, options: ExportOptions, device: torch.device, task: Task) -> None:
        spec = task.explained(spec, options.prompt)
        self.spec = spec
        self.options = options
        self.device = device
        selection = options.methods
        self.methods: dict[str, CAM] = {
            name: create_method(
                name,
                spec.model,
                selection.layer_for(name, options.layer),
                labels=spec.labels,
                **selection.options_for(name, options.batch_size),
            )
            for name in selection.names
        }
        self.target = task.target(spec, options.asked)

    def target_for(self, sizes: Sequence[tuple[int, int]]) -> Target:
        """The run's target for a group of photos of ``sizes`` (width, height): a region drawn in the photos'
        pixels is placed on each photo's own frame, which the model's input and output cover whole."""
        if not isinstance(self.target, RegionTarget):
            return self.target
        return self.target.drawn_on([(height, width) for width, height in sizes])

    def results(self, x: torch.Tensor, target: Target) -> dict[str, CAMResult]:
        """Each method's result for a group; the grid leaves out a method that does not fit the model (CAM)."""
        results = {}
        for name, method in list(self.methods.items()):
            try:
                results[name] = method(x, target)
            except ImageRefused:  # the image's, not the method's
                raise
            except (LayerError, TargetError):
                if not self.options.methods.grid:
                    raise
                del self.methods[name]
        return results

    def explain(self, x: torch.Tensor, sizes: Sequence[tuple[int, int]]) -> list[Explanation]:
        """Explain images of one input size together (``sizes``: each image's own (width, height)); returns, per
        image, its explained targets, its raw maps by method, and the layer."""
        x = x.to(self.device, non_blocking=True)
        if getattr(self.spec.preprocessing, "stride", None) is not None:
            return self.explain_windows(x)
        results = self.results(x, self.target_for(sizes))
        first = next(iter(results.values()))
        bound = first.target

        def per_target(t: torch.Tensor | None) -> torch.Tensor | None:  # (N, K, ...) whatever the target
            return None if t is None else (t if bound.keeps_k else t[:, None]).cpu()

        cams = {name: per_target(result.cams) for name, result in results.items()}
        raws = {name: per_target(result.raw) for name, result in results.items()}
        classes, scores = per_target(first.class_indices), per_target(first.probabilities)
        valid = torch.ones(classes.shape, dtype=torch.bool) if bound.valid is None else bound.valid.cpu()
        boxes, polygons = _upright(None if bound.boxes is None else bound.boxes.cpu())
        points = None if bound.points is None else bound.points.cpu()
        poses = None if bound.poses is None else bound.poses.cpu()
        regions = None if bound.regions is None else bound.regions.cpu()
        measured = {name: self.measured(x, result) for name, result in results.items()}
        explained = []
        for i, (width, height) in enumerate(sizes):
            scale = torch.tensor([width / x.shape[-1], height / x.shape[-2]] * 2)
            targets = [
                Explained(
                    k=k,
                    cams={name: c[i, k] for name, c in cams.items()},
                    class_index=int(classes[i, k]),
                    class_name=(bound.names or self.spec.labels)[int(classes[i, k])],
                    score=float(scores[i, k]),
                    box=None if boxes is None else (boxes[i, k] * scale).tolist(),
                    point=None if points is None else (points[i, k] * scale[:2]).tolist(),
                    pose=None if poses is None else (poses[i, k] * torch.cat([scale[:2], torch.ones(1)])).tolist(),
                    polygon=None if polygons is None else (polygons[i, k] * scale[:2]).tolist(),
                    region=None if regions is None else regions[i, k],
                    **self.image_metrics(measured, i),
                )
                for k in valid[i].nonzero()[:, 0].tolist()
            ]
            raw = {name: (r[i][valid[i]] if bound.keeps_k else r[i, 0]).numpy() for name, r in raws.items()}
            explained.append(Explanation(targets, raw, {name: result.layer for name, result in results.items()}))
        return explained

    def explain_windows(self, x: torch.Tensor) -> list[Explanation]:
        """Explain clips (N, 3, L, h, w) in sliding windows (see :meth:`ClipPreprocessing.windows`), ``batch_size``
        windows per pass. A clip's class is the ``target``, else its top class by the mean probability of its
        windows, as a video classifier is evaluated over several clips; every window is explained for that
        class, and each frame's map is the mean of its windows' maps at the input's resolution, normalized over
        the clip. The score is the class's mean probability over the windows."""
        clip, model, chunk = self.spec.preprocessing, self.spec.model, self.options.batch_size
        starts = clip.windows(x.shape[2])
        windows = torch.stack([x[:, :, s : s + clip.frames] for s in starts], dim=1).flatten(0, 1)
        parts = [windows[i : i + chunk] for i in range(0, len(windows), chunk)]
        if self.options.target is None:
            with torch.inference_mode():
                probabilities = torch.cat([read_output(model(part)).float().softmax(dim=1) for part in parts])
            classes = probabilities.view(len(x), len(starts), -1).mean(dim=1).argmax(dim=1)
        else:
            chosen = class_index(self.options.target, self.spec.labels, len(self.spec.labels))
            classes = torch.full((len(x),), chosen, device=x.device)
        rows = classes.repeat_interleave(len(starts)).tolist()
        maps, scores, layers = {}, None, {}
        for name, method in self.methods.items():
            results = [
                method(part, ClassTarget(rows[i * chunk : i * chunk + len(part)]), normalize=False)
                for i, part in enumerate(parts)
            ]
            cams = torch.cat([r.cams for r in results]).view(len(x), len(starts), *results[0].cams.shape[1:])
            maps[name] = windowed_maps(cams, starts, x.shape[2]).cpu()
            scores = torch.cat([r.probabilities for r in results]).view(len(x), len(starts)).mean(dim=1)
            layers[name] = results[0].layer
        explained = []
        for i, class_ in enumerate(classes.tolist()):
            cams = {name: normalize_maps(m[i], m.dim() - 1) for name, m in maps.items()}
            target = Explained(0, cams, class_, self.spec.labels[class_], float(scores[i]), None, None)
            explained.append(Explanation([target], {name: m[i].numpy() for name, m in maps.items()}, layers))
        return explained

    def measured(self, x: torch.Tensor, result: CAMResult) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The asked metrics of a batch's maps, per image, and the deletion and insertion curves among them."""
        if not self.options.metrics:
            return {}, {}
        from .reports import image_metrics

        values, curves = image_metrics(
            self.options.metrics, self.spec.model, x, result.cams, result.target, self.options.batch_size
        )
        return {k: v.cpu() for k, v in values.items()}, {k: c.cpu() for k, c in curves.items()}

    def image_metrics(self, measured: Mapping[str, tuple[dict, dict]], i: int) -> dict[str, Any]:
        """Image ``i``'s metric values and curves by method, as :class:`Explained` takes them (none unasked)."""
        if not self.options.metrics:
            return {}
        return {
            "metrics": {
                m: {name: round(float(v[i]), 6) for name, v in values.items()} for m, (values, _) in measured.items()
            },
            "curves": {
                m: {name: [round(p, 6) for p in c[i].tolist()] for name, c in curves.items()}
                for m, (_, curves) in measured.items()
            },
        }

    def outcomes(self, x: torch.Tensor, images: Sequence[np.ndarray]) -> list[Outcome]:
        """Explain a group: its model input ``x`` and its pictures, whose sizes a detector's boxes are scaled to
        (an image's, a clip's frames'; none else)."""
        sizes = [(image.shape[-2], image.shape[-3]) if image.ndim >= 3 else (1, 1) for image in images]
        return self.explain_robustly(x, sizes)

    def explain_robustly(self, x: torch.Tensor, sizes: Sequence[tuple[int, int]]) -> list[Outcome]:
        """Explain a group; if it fails, its images one by one, so one bad image costs only itself: an image that
        fails (the model refuses it, the target cannot be placed on it) gets a :class:`Failure`, one with nothing
        to explain (no detection, no pixel of the class) a :class:`NothingFound`."""
        try:
            return self.explain(x, sizes)
        except NothingToExplain as err:
            if len(sizes) == 1:
                return [NothingFound(f"nothing to explain: {err.reason}")]
        except ImageRefused as err:
            if len(sizes) == 1:
                return [Failure(err.reason)]
        except (LayerError, TargetError):
            raise
        except (RuntimeError, AssertionError) as err:  # the model's own refusal of an input (timm asserts sizes)
            if len(sizes) == 1:
                return [Failure(first_line(err))]
        return [part for i in range(len(sizes)) for part in self.explain_robustly(x[i : i + 1], sizes[i : i + 1])]


ModelStep = _Explainer | WordsExplainer  # what explains a group of images: a model's maps, or its words'


def export_heatmaps(
    spec: ModelSpec | TextImageSpec,
    sources: Sequence[str | Path | Input] | Prepared,
    out_dir: str | Path,
    options: ExportOptions | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> ExportSummary:
    """Explain every image found in ``sources``, write overlays, and record each in ``out_dir/manifest.jsonl``.

    Inputs that cannot be read get a record with their ``error`` and are reported; every other input is still
    written. Each file is written atomically and each input's records are appended to the manifest once its
    files are whole, so a run stopped at any moment and resumed (``options.resume``) loses nothing and redoes
    nothing finished. The output folder is created and marked as such (see :mod:`explain.export.inputs`) when the
    first outputs are ready, so a run that fails on its first batch writes nothing. Launched by ``torchrun``,
    each process explains its share of the inputs on its own device and the manifest is merged at the end.

    Args:
        spec: The model and its preprocessing (see :func:`explain.models.load_model`), or a vision-language model
            and its processor (:func:`explain.models.text_image.load_text_image_model`), whose words are explained
            (``options.reading`` says what it reads).
        sources: Files, folders (searched recursively) and glob patterns, or the
            inputs :func:`explain.export.inputs.collect_inputs` found in them, or a run the caller prepared
            (:func:`explain.export.preflight.prepare`: its inputs found and its folder checked, once).
        out_dir: Output folder.
        options: What to explain and write (default: ``ExportOptions()``).
        device: Where to run the model (a process of a distributed CUDA run takes its own device).
        progress: Show a progress bar with images/s and the time left on stderr (when it is a terminal).
        report: Called with each input's manifest record as soon as it is written.

    Raises:
        ResumeError: The folder holds an earlier run's manifest and neither ``resume`` nor ``overwrite`` is
            set, or the run to resume had other settings.
    """
    out_dir, process, options = Path(out_dir), this_process(), options or ExportOptions()
    task = options.check_task(spec)
    if not isinstance(sources, Prepared):  # before --overwrite forgets the folder's outputs
        sources = prepare(sources, out_dir, options.resume, options.overwrite, spec.preprocessing.kind)
    inputs = sources.inputs
    device = process.device(torch.device(device))
    explainer = (WordsExplainer if isinstance(spec, TextImageSpec) else _Explainer)(spec, options, device, task)
    writer = _writer(out_dir, spec, options, task)
    head = header(run_settings(spec, options))
    lock = FolderLock(out_dir, last=process.rank == 0)
    try:
        with process_group(process, device):
            previous, records = _folder_prepared(process, out_dir, options, head, inputs, lock)
            todo, bases, summary, order = _plan(process, out_dir, writer, inputs, records)
            log = ManifestWriter(out_dir / (MANIFEST if process.world == 1 else part_name(process.rank)), head)
            try:
                _run(explainer, writer, todo, bases, log, summary, progress, report, lock)
            finally:
                log.close()
            process.barrier()  # every part is complete
            if process.rank == 0 and (log.opened or previous is not None):
                summary.records = merge(out_dir, head, order, writer.methods)
    finally:
        lock.release()
    return summary


def _plan(
    process: Process, out_dir: Path, writer: OutputWriter, inputs: Sequence[Input], records: list[dict[str, Any]]
) -> tuple[list[Input], dict[Input, Path], ExportSummary, list[str]]:
    """What this process does: its share of the inputs an earlier run did not finish, where each input's outputs
    go, the summary it starts from, and the merged manifest's order of inputs (this run's, then the earlier run's
    that this one was not given: their records and files are kept)."""
    done = finished(records, writer.methods, out_dir)
    process.barrier()  # every process has read what earlier runs finished before any writes more
    readable = [item for item in inputs if item.path is not None]
    bases = dict(zip(readable, output_bases(readable, out_dir, writer.files_for)))
    # Each process takes its share of what is left to do, so that a resumed run keeps them all busy.
    todo = process.shard([item for item in inputs if item.name not in done])
    names = [item.name for item in inputs]
    given = set(names)
    earlier = [name for name in dict.fromkeys(r["input"] for r in records) if name not in given]
    skipped = len(process.shard([item for item in inputs if item.name in done]))
    summary = ExportSummary(skipped=skipped, kept=len(earlier), unit=f"{writer.kind}s")
    return todo, bases, summary, names + earlier


def _folder_prepared(
    process: Process,
    out_dir: Path,
    options: ExportOptions,
    head: dict[str, Any],
    inputs: Sequence[Input],
    lock: FolderLock,
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The output folder made ready for this run: an earlier run refused, cleared (``overwrite``) or checked and
    renamed to this run's input names (``resume``); killed writers' files removed; the folder, if it exists,
    held by this run (its preflight refused an earlier run's without resume or overwrite). The first process takes
    the lock and clears the folder alone; the others write nothing, their lock's draft included, until it has.
    Returns the earlier run's header (or None) and its records."""
    existed = out_dir.is_dir()
    if process.rank == 0:  # alone: no other process writes while it clears (a lock's draft is a killed writer's file)
        if existed:
            lock.take()
        if options.overwrite:
            remove_run(out_dir)
            remove_gallery(out_dir)
        remove_temporary_files(out_dir)
    process.barrier()  # the first process holds the folder and has cleared it (killed writers' files, --overwrite's)
    if existed:
        lock.take()  # the others join their launch's lock
    previous, records = previous_run(out_dir)
    check_settings(out_dir, previous, head["header"])
    if previous is not None:
        if process.rank == 0:
            files = {item.path.resolve(): item.name for item in inputs if item.path is not None}
            rename_inputs(out_dir, head["cwd"], files)
        process.barrier()  # the earlier records name their inputs as this run does
        records = previous_run(out_dir)[1]
    return previous, records


@dataclass
class _Recorder:
    """Takes each input's records in input order, once its files are written: appends them to the manifest,
    counts them in the summary, advances the progress bar and reports them."""

    log: ManifestWriter
    summary: ExportSummary
    bar: tqdm
    out_dir: Path
    report: Callable[[dict[str, Any]], None] | None
    lock: FolderLock
    pending: deque[Future[list[dict[str, Any]]]] = field(default_factory=deque)

    def expect(self, records: Future[list[dict[str, Any]]]) -> None:
        """An input's records to come, after those expected before."""
        self.pending.append(records)

    def record(self, records: list[dict[str, Any]], counted: bool = True) -> None:
        """Record one input's records now (``counted``: the input is a file the progress bar counts)."""
        self.lock.take()
        mark_output_folder(self.out_dir)
        self.log.add(records)
        self.summary.records += records
        failed = any(r["error"] for r in records)
        self.summary.failed += failed
        self.summary.written += not failed
        if counted:
            self.bar.update()
        for r in records if self.report else ():
            self.report(r)

    def drain(self, keep: int) -> None:
        """Record the inputs whose files are written, in order, waiting while more than ``keep`` are pending."""
        while self.pending and (len(self.pending) > keep or self.pending[0].done()):
            self.record(self.pending.popleft().result())


def _run(
    explainer: ModelStep,
    writer: OutputWriter,
    todo: Sequence[Input],
    bases: Mapping[Input, Path],
    log: ManifestWriter,
    summary: ExportSummary,
    progress: bool,
    report: Callable[[dict[str, Any]], None] | None,
    lock: FolderLock,
) -> None:
    """Explain and write this process's inputs, appending each input's records to ``log`` in input order."""
    options = explainer.options
    files = [item for item in todo if item.path is not None]
    workers = options.workers
    if workers is None:
        workers = default_workers(len(files), options.batch_size, explainer.device)
    read = explainer.spec.preprocessing.with_aspect(options.keep_aspect).read
    pin = explainer.device.type == "cuda"
    # Threads render and encode images (numpy, Pillow and zlib release the GIL) while the model runs. A model on
    # the CPU needs every core: there the threads and worker processes yield to it (see lowest_priority).
    background = explainer.device.type == "cpu"
    start = time.perf_counter()
    with (
        tqdm(total=len(files), unit=str(writer.kind), disable=None if progress else True, file=sys.stderr) as bar,
        helper_threads(background) as pool,
    ):
        recorder = _Recorder(log, summary, bar, writer.out_dir, report, lock)
        paths = [item.path for item in files]
        for batch in load_batches(paths, read, options.batch_size, workers, pin, background):
            for position, error in batch.failed:
                recorder.expect(pool.submit(writer.failed, files[position], error))
            for group in batch.groups:
                for job in _write_jobs(explainer, writer, group, files, bases):
                    recorder.expect(pool.submit(job))
            recorder.drain(keep=2 * options.batch_size)
            log.sync()
        recorder.drain(keep=0)
        for item in todo:  # sources that gave no file: recorded last, so that a failing first batch writes nothing
            if item.error is not None:
                recorder.record(writer.failed(item, item.error), counted=False)
    summary.seconds = time.perf_counter() - start


def _write_jobs(
    explainer: ModelStep, writer: OutputWriter, group: Group, files: Sequence[Input], bases: Mapping[Input, Path]
) -> list[Callable[[], list[dict[str, Any]]]]:
    """Explain a group; returns for each image the job that writes its outputs and returns its records."""
    images = [pixels.numpy() for pixels in group.images]
    parts = explainer.outcomes(group.x, images)
    jobs = []
    for position, image, outcome in zip(group.positions, images, parts):
        item = files[position]
        if isinstance(outcome, Failure):
            jobs.append(partial(writer.failed, item, f"{item.name}: {outcome.message}"))
        elif isinstance(outcome, NothingFound):
            jobs.append(partial(writer.noted, item, outcome.note))
        else:
            jobs.append(partial(writer.write, item, image, bases[item], outcome))
    return jobs
