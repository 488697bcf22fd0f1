"""``explain evaluate``: score a grid of methods and layers with the field's metrics on the user's own images, and
rank them (see :mod:`explain.evaluation.ranking`).

Each image is explained once per configuration (a method at a layer); then the metrics run, cheapest first, every
configuration and image of one metric before the next metric, while the time budget lasts. Every value is a line
of ``scores.jsonl`` in the output folder, appended as it is computed: a run killed midway is resumed with
``resume=True`` (``--resume``), which computes only what the file lacks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..errors import ExplainError, first_line
from ..export.ownership import FolderLock
from ..io.images import load_image
from ..methods import create_method
from ..metrics import CurveResult
from ..models import ModelSpec
from ..tasks.registry import task_of
from .catalog import EvalMetric, Scene, chosen_metrics
from .ranking import Ranking, Summary, rank, summarize

SCORES = "scores.jsonl"  # one line per (image, configuration, metric): the run's log, resumed from


@dataclass(frozen=True)
class Configuration:
    """A method at a layer (None: its automatic layer)."""

    method: str
    layer: str | None = None

    @property
    def label(self) -> str:
        """How tables and files name it: ``gradcam`` or ``gradcam@layer4``."""
        return self.method if self.layer is None else f"{self.method}@{self.layer}"


@dataclass
class Evaluation:
    """What an evaluation found.

    Attributes:
        configurations: The configurations' labels, in the grid's order.
        images: The images' names.
        metrics: The metrics run (or begun), cheapest first.
        values: Per metric, the values (configurations, images), NaN where not scored.
        summaries: Per metric and configuration, the mean with its interval.
        ranking: The configurations by mean rank over the metrics, and the recommendation.
        seconds: Per stage (``explain`` and each metric), the wall time it took in this run.
        unfinished: The metrics the budget left unfinished.
        curves: Per curve metric (deletion, insertion) and configuration, each image's curve: the score after each
            step, from the plain image on.
    """

    configurations: list[str]
    images: list[str]
    metrics: list[EvalMetric]
    values: dict[str, np.ndarray]
    summaries: dict[str, dict[str, Summary]] = field(default_factory=dict)
    ranking: Ranking | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    unfinished: list[str] = field(default_factory=list)
    curves: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)


def evaluate(
    spec: ModelSpec,
    images: Sequence[Path],
    out: Path,
    *,
    configurations: Sequence[Configuration] = (Configuration("gradcam"), Configuration("gradcampp")),
    metric_names: list[str] | None = None,
    masks: Path | None = None,
    boxes: Path | None = None,
    budget: float | None = None,
    resume: bool = False,
    progress: bool = False,
    seed: int = 0,
) -> Evaluation:
    """Score every configuration on every image with every metric, and rank the configurations.

    Args:
        spec: The model, as :func:`explain.load_model` returns it: a classifier (each image's top class is
            explained), a detector (its most confident detection) or a segmenter (the class that wins the most
            pixels); the model-based metrics then score the target's own score.
        images: The images.
        out: The output folder: ``scores.jsonl``, then the report (see :mod:`explain.evaluation.report`).
        configurations: The methods and layers to compare.
        metric_names: The metrics (see :data:`explain.evaluation.catalog.CATALOG`); None: the defaults.
        masks: A folder of the objects' masks, one PNG per image named as its image (``cat.png`` for
            ``cat.jpg``), at the image's size; nonzero pixels are the object.
        boxes: Instead of masks, a JSON file of the objects' boxes (see :func:`read_boxes`).
        budget: Seconds the run may take; the metrics it does not reach are listed, not run.
        resume: Keep the values an earlier run of the folder computed, and compute the rest.
        progress: Show a progress bar.
        seed: The seed of the metrics' random draws and of the bootstrap.

    Raises:
        ExplainError: An unknown metric, masks missing or of the wrong size, boxes missing or outside their image,
            an image that cannot be read, or a folder that holds an earlier evaluation without ``resume``.
    """
    task = task_of(spec)
    task.check_evaluated(spec)  # before any image is read
    metrics = chosen_metrics(metric_names, masks is not None or boxes is not None, task)
    given = read_boxes(boxes) if boxes is not None else None
    scenes = [_loaded(spec, Path(path), masks, given) for path in images]
    names = [name for name, _ in scenes]
    labels = [configuration.label for configuration in configurations]
    log = out / SCORES
    if log.is_file() and not resume:
        raise ExplainError(f"{out}: holds an earlier evaluation ({SCORES}); add --resume to go on with it")
    with FolderLock(out):
        done = _read_log(log)
        found = Evaluation(
            labels, names, metrics, {m.name: np.full((len(labels), len(names)), np.nan) for m in metrics}
        )
        _fill(found, done)
        _run(spec, scenes, configurations, found, log, done, budget, progress, seed)
    found.summaries = {m: {c: summarize(found.values[m][i], seed) for i, c in enumerate(labels)} for m in found.values}
    higher = {metric.name: metric.better == "higher" for metric in metrics}
    found.ranking = rank(found.values, labels, higher, seed)
    return found


def _loaded(
    spec: ModelSpec, path: Path, masks: Path | None, boxes: dict[str, Any] | None
) -> tuple[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """An image's name, its input (1, C, H, W) on the model's device and its object's mask (1, H, W) or None.

    Raises:
        ExplainError: The image cannot be read, or its mask is missing or not of the image's size, or its boxes
            are missing or outside it.
    """
    image = load_image(path)
    x = spec.preprocess(image).to(spec.device)
    if masks is None and boxes is None:
        return path.name, (x, None)
    mask = _mask_of(path, image, masks) if masks is not None else _boxes_mask(path, image, boxes or {})
    resized = mask.convert("L").resize((x.shape[-1], x.shape[-2]), Image.Resampling.NEAREST)
    return path.name, (x, torch.from_numpy(np.asarray(resized) > 0)[None].to(spec.device))


def _mask_of(path: Path, image: Image.Image, masks: Path) -> Image.Image:
    """The image's mask from the masks' folder, checked to be of its size."""
    mask_path = masks / f"{path.stem}.png"
    if not mask_path.is_file():
        raise ExplainError(f"{path}: no mask {mask_path} (a PNG named as the image, in --masks)")
    try:
        mask = Image.open(mask_path)
        mask.load()
    except OSError as err:
        raise ExplainError(f"{mask_path}: not a readable mask ({first_line(err)})") from None
    if mask.size != image.size:
        raise ExplainError(f"{mask_path}: a {mask.width}x{mask.height} mask for a {image.width}x{image.height} image")
    return mask


def read_boxes(file: Path) -> dict[str, Any]:
    """The objects' boxes of a JSON file: each image's file name to its box ``[x1, y1, x2, y2]`` or a list of
    boxes, in the image's pixels.

    Raises:
        ExplainError: The file cannot be read, or is not such an object.
    """
    try:
        found = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ExplainError(f"{file}: not a readable JSON file of boxes ({first_line(err)})") from None
    if not isinstance(found, dict):
        raise ExplainError(f"{file}: boxes must be an object of image names to [x1, y1, x2, y2] boxes")
    return found


def _boxes_mask(path: Path, image: Image.Image, boxes: dict[str, Any]) -> Image.Image:
    """A mask at the image's size, its boxes filled."""
    given = boxes.get(path.name)
    if given is None:
        raise ExplainError(f"{path}: no box for {path.name!r} in --boxes")
    rows = [given] if given and not isinstance(given[0], list) else given
    mask = np.zeros((image.height, image.width), dtype=np.uint8)
    for box in rows:
        valid = isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box)
        if not valid or not (0 <= box[0] < box[2] <= image.width and 0 <= box[1] < box[3] <= image.height):
            raise ExplainError(
                f"{path}: box {box!r} is not [x1, y1, x2, y2] inside the {image.width}x{image.height} image"
            )
        x1, y1, x2, y2 = (round(v) for v in box)
        mask[y1:y2, x1:x2] = 255
    return Image.fromarray(mask)


def _read_log(log: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    """The records an earlier run wrote, by (image, configuration, metric); a line cut by a kill is passed over."""
    done: dict[tuple[str, str, str], dict[str, Any]] = {}
    if not log.is_file():
        return done
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            done[(record["image"], record["configuration"], record["metric"])] = {
                **record,
                "value": float(record["value"]),
            }
        except (ValueError, KeyError, TypeError):
            continue
    return done


def _fill(found: Evaluation, done: dict[tuple[str, str, str], dict[str, Any]]) -> None:
    """Put the values (and curves) already computed in their places."""
    for (image, configuration, metric), record in done.items():
        if metric in found.values and configuration in found.configurations and image in found.images:
            found.values[metric][found.configurations.index(configuration), found.images.index(image)] = record["value"]
            if "curve" in record:
                found.curves.setdefault(metric, {}).setdefault(configuration, []).append(record["curve"])


def _run(
    spec: ModelSpec,
    scenes: list[tuple[str, tuple[torch.Tensor, torch.Tensor | None]]],
    configurations: Sequence[Configuration],
    found: Evaluation,
    log: Path,
    done: dict[tuple[str, str, str], float],
    budget: float | None,
    progress: bool,
    seed: int,
) -> None:
    """Explain, then score metric by metric, cheapest first, while the budget lasts; each value logged."""
    from tqdm.auto import tqdm

    deadline = None if budget is None else time.monotonic() + budget
    todo = [(m, c, s) for m in found.metrics for c in configurations for s in scenes
            if (s[0], c.label, m.name) not in done]  # fmt: skip
    started = time.monotonic()
    methods = {c.label: create_method(c.method, spec.model, c.layer) for c in configurations}
    wanted = {(s[0], c.label) for _, c, s in todo}
    task = task_of(spec)
    targets = {name: task.evaluated(spec, name, x) for name, (x, _) in scenes if any(n == name for n, _ in wanted)}
    maps = _maps(methods, configurations, scenes, wanted, targets)
    found.seconds["explain"] = time.monotonic() - started
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", encoding="utf-8") as written, tqdm(total=len(todo), disable=not progress, unit="value") as bar:
        for metric, configuration, (name, (x, mask)) in todo:
            if deadline is not None and time.monotonic() > deadline:
                found.unfinished = [m.name for m in found.metrics if bool(np.isnan(found.values[m.name]).any())]
                return
            cams, target = maps[(name, configuration.label)]
            scene = Scene(spec.model, x, cams, target, mask, methods[configuration.label])
            began = time.monotonic()
            torch.manual_seed(seed)
            record = {"image": name, "configuration": configuration.label, "metric": metric.name,
                      **_value(metric.score(scene))}  # fmt: skip
            found.seconds[metric.name] = found.seconds.get(metric.name, 0.0) + time.monotonic() - began
            _fill(found, {(name, configuration.label, metric.name): record})
            written.write(json.dumps(record) + "\n")
            written.flush()
            bar.update()


def _value(scored: Any) -> dict[str, Any]:
    """A metric's value for one image, and its curve where it has one (a :class:`explain.metrics.CurveResult`)."""
    if isinstance(scored, CurveResult):
        return {"value": float(scored.auc.reshape(-1)[0]), "curve": [round(v, 6) for v in scored.curve[0].tolist()]}
    return {"value": float(scored.reshape(-1)[0])}


def _maps(
    methods: dict[str, Any],
    configurations: Sequence[Configuration],
    scenes: list[tuple[str, tuple[torch.Tensor, torch.Tensor | None]]],
    needed: set[tuple[str, str]],
    targets: dict[str, Any],
) -> dict[tuple[str, str], tuple[torch.Tensor, Any]]:
    """Each needed image's map per configuration, (1, H, W), and what it explains: the class (1,) for a classifier,
    else the image's target object (see :meth:`explain.tasks.base.Task.evaluated`)."""
    found = {}
    for configuration in configurations:
        for name, (x, _) in scenes:
            if (name, configuration.label) in needed:
                result = methods[configuration.label](x, targets[name])
                explained = result.class_indices.reshape(-1)[:1] if targets[name] is None else targets[name]
                found[(name, configuration.label)] = (result.cams.reshape(1, *x.shape[-2:]), explained)
    return found
