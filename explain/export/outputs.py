"""An export's outputs: what each image's files are called, and rendering and writing them with their record."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..catalog import ALL_METHODS
from ..errors import InputLoadError, first_line
from ..io.images import save_array, save_image
from ..io.kinds import IMAGE, InputKind
from ..io.render import Skeleton, annotate, figure, grid, picture, strip
from ..io.signals import plot_signal
from ..io.video import count_frames, nearest_sampled, overlay_frames, write_gif, write_overlay_video
from ..io.volumes import montage, read_volume, write_heatmap
from ..models.spec import InputPreprocessing
from ..targets.keypoints import limbs_of
from ..tasks.base import Task
from .inputs import Input
from .manifest import record
from .settings import RenderOptions


@dataclass(frozen=True)
class Explained:
    """One explained target of one image, ready to render: its map(s) by method and what it explains."""

    k: int
    cams: dict[str, torch.Tensor]
    class_index: int
    class_name: str
    score: float
    box: list[float] | None  # x1, y1, x2, y2 in the original image's pixels
    region: torch.Tensor | None  # the region's weights at the model output's resolution
    point: list[float] | None = None  # a keypoint's x, y in the original image's pixels
    pose: list[list[float]] | None = None  # its detection's keypoints: x, y (the image's pixels), visibility
    polygon: list[list[float]] | None = None  # an oriented box's four corners in the original image's pixels
    metrics: dict[str, dict[str, float]] | None = None  # by method, each asked metric's value
    curves: dict[str, dict[str, list[float]]] | None = None  # by method, the deletion and insertion curves


@dataclass(frozen=True)
class Explanation:
    """What the model step gives an image that it explained: its targets, its raw maps and layers by method, and
    the answer whose words the targets are (a vision-language model's)."""

    targets: list[Explained]
    raws: dict[str, np.ndarray]
    layers: dict[str, str]
    answer: str | None = None


@dataclass(frozen=True)
class Failure:
    """An image the model refused (its own error, in one line)."""

    message: str


@dataclass(frozen=True)
class NothingFound:
    """An image that holds nothing to explain: no detection, no pixel of the class."""

    note: str


Outcome = Explanation | Failure | NothingFound


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


@dataclass(frozen=True)
class OutputWriter:
    """Names, renders and writes an input's outputs, one method (or the grid of ``"all"``) at a time.

    Attributes:
        out_dir: The output folder; records name files relative to it.
        model: The model's name, for the records.
        task: The model's kind of output, which tells each map's files apart and how figures are drawn.
        methods: The methods whose outputs are written apart: each asked one, or ``"all"`` (one grid).
        topk: The K top classes explained of each image, or None.
        render: How the maps are drawn and which files are written.
        preprocessing: How the model reads its inputs, which decides what is written of each: an image's overlay;
            a video's overlay video of all its frames (``.mp4``) and an animated GIF of the sampled ones (the
            picture the gallery shows); a volume's heatmap as NIfTI with the scan's affine (``.nii.gz``) and a
            montage of the slices through its peak (``.png``, the picture); a signal's plot over its map (``.png``).
    """

    out_dir: Path
    model: str
    task: Task
    methods: list[str]
    topk: int | None
    render: RenderOptions
    preprocessing: InputPreprocessing | None = None

    def tag(self, k: int, class_name: str, method: str) -> str:
        """What tells an image's outputs apart: the method, and which target (see :meth:`Task.tag`)."""
        return self.task.tag(k, class_name, method, self.topk)

    def paths(
        self, base: Path, tags: Sequence[str], method: str
    ) -> tuple[list[Path], list[Path], list[Path], Path | None]:
        """The overlays, figures, clips' pictures and raw maps of one method written for an output base path and its
        targets' tags."""
        fmt = self.kind.written or self.render.fmt
        overlays = [base.with_name(base.name + tag + f".{fmt}") for tag in tags]
        figures = [base.with_name(base.name + tag + f".figure.{fmt}") for tag in tags] if self.render.figure else []
        shown = self.kind.shown
        pictures = [base.with_name(base.name + tag + f".{shown}") for tag in tags] if shown else []
        raw = base.with_name(f"{base.name}.{method}.npy") if self.render.save_raw else None
        return overlays, figures, pictures, raw

    def files_for(self, base: Path) -> list[Path]:
        """The files written for an output base path (for detections and segments, those of the first target)."""
        files = []
        for method in self.methods:
            tags = [self.tag(k, "class", method) for k in range(self.topk or 1)]
            overlays, figures, pictures, raw = self.paths(base, tags, method)
            if figures and self.task.strips:
                figures = [self.strip_path(base, method, 1)]
            files += [*overlays, *figures, *pictures, *([raw] if raw else [])]
        return files

    def strip_path(self, base: Path, method: str, number: int) -> Path:
        """Where an image's strip ``number`` (counted from 1) is written (see :attr:`Task.strip`)."""
        part = self.task.strip.format(n=number)
        return base.with_name(f"{base.name}.{method}.{part}.figure.{self.render.fmt}")

    def write(self, item: Input, image: np.ndarray, base: Path, explanation: Explanation) -> list[dict[str, Any]]:
        """Render and write one image's outputs, a map per target for each method (or their grid); returns its
        records, one per method written apart."""
        return [self._write_method(item, image, base, explanation, m) for m in self.methods]

    def _write_method(
        self, item: Input, image: np.ndarray, base: Path, explanation: Explanation, method: str
    ) -> dict[str, Any]:
        explained, raw, layer = explanation.targets, explanation.raws.get(method), explanation.layers.get(method)
        tags = [self.tag(e.k, e.class_name, method) for e in explained]
        outputs, figures, pictures, raw_path = self.paths(base, tags, method)
        targets, style = [], self.render
        try:
            if figures and self.task.strips and method != ALL_METHODS:  # a strip of maps per detection
                figures = self.write_strips(image, base, explained, method, layer)
            for j, (e, output) in enumerate(zip(explained, outputs)):
                mark = partial(self.annotated, e)
                if self.kind.windowed:  # a scan
                    self.write_volume(item.path, e.cams[method], output, pictures[j])
                elif self.kind.unit:  # a clip's frames
                    self.write_clip(item.path, image, e.cams[method], output, pictures[j])
                elif self.kind.plotted:  # a signal
                    save_image(plot_signal(image, e.cams[method], style.colormap), output)
                elif method == ALL_METHODS:
                    title = f"{e.class_name} ({e.score:.1%}), every fast method"
                    save_image(grid(image, e.cams, title, style.alpha, style.colormap, mark=mark), output)
                else:
                    save_image(mark(picture(image, e.cams[method], style.alpha, style.colormap)), output)
                if figures and not self.task.strips:
                    title = f"{e.class_name} ({e.score:.1%}), {method} at {layer}"
                    save_image(figure(image, e.cams[method], title, style.alpha, style.colormap, mark), figures[j])
                targets.append(
                    {
                        "class_index": e.class_index,
                        "class_name": e.class_name,
                        "score": round(e.score, 6),
                        "box": None if e.box is None else [round(v, 1) for v in e.box],
                        "point": None if e.point is None else [round(v, 1) for v in e.point],
                        "polygon": None if e.polygon is None else [[round(v, 1) for v in c] for c in e.polygon],
                        "region": None if e.region is None else self.region_record(e.region, image.shape[:2]),
                        "output": self.relative(output),
                        "figure": self.relative(figures[j]) if figures else None,
                        "picture": self.relative(pictures[j]) if pictures else None,
                        "metrics": e.metrics[method] if e.metrics else None,
                        "curves": (e.curves[method] or None) if e.curves else None,
                    }
                )
            if raw_path:
                save_array(np.asarray(raw), raw_path)
        except InputLoadError as err:  # a video that turned unreadable after the model's pass
            return record(item.name, self.model, method, error=str(err))
        except OSError as err:
            return record(item.name, self.model, method, error=f"{item.name}: cannot write outputs: {first_line(err)}")
        except Exception as err:  # a picture that cannot be drawn costs its input, never the run
            return record(item.name, self.model, method, error=f"{item.name}: cannot render outputs: {first_line(err)}")
        raw_name = self.relative(raw_path) if raw_path else None
        return record(
            item.name, self.model, method, targets=targets, layer=layer, raw=raw_name, answer=explanation.answer
        )

    def write_strips(
        self, image: np.ndarray, base: Path, explained: list[Explained], method: str, layer: str
    ) -> list[Path]:
        """The figures of a task that draws strips (see :attr:`Task.strip`): a pose model's, one strip per detection
        of its keypoints' maps, each over the skeleton with its keypoint ringed; a vision-language model's, one of
        all its words. Returns each target's figure, its strip."""
        figures, style = [], self.render
        for number, run in enumerate(self.task.strip_runs(explained), start=1):
            path = self.strip_path(base, method, number)
            names = [e.class_name for e in run]
            if len(set(names)) < len(names):  # an answer's words may repeat: numbered, each its own panel
                names = [f"{i} {name}" for i, name in enumerate(names)]
            cams = {name: e.cams[method] for name, e in zip(names, run)}
            marks = {name: partial(self.annotated, e) for name, e in zip(names, run)}
            many = f"{self.task.map_of}{'s' * (len(run) > 1)}"
            title = f"{self.task.strip_title.format(n=number)}: {len(run)} {many}, {method} at {layer}"
            save_image(strip(image, cams, marks, title, style.alpha, style.colormap), path)
            figures += [path] * len(run)
        return figures

    @property
    def kind(self) -> InputKind:
        """What the inputs are (see :mod:`explain.io.kinds`)."""
        return IMAGE if self.preprocessing is None else self.preprocessing.kind

    def write_volume(self, source: Path, cam: torch.Tensor, output: Path, picture: Path) -> None:
        """A scan's heatmap, at the scan's size, as a NIfTI with the scan's affine (read again from its file), and
        the montage of the slices through the map's peak."""
        volume = read_volume(source)
        write_heatmap(cam, volume, output)
        save_image(montage(volume, cam, self.render.alpha, self.render.colormap), picture)

    def write_clip(self, source: Path, sampled: np.ndarray, cam: torch.Tensor, output: Path, picture: Path) -> None:
        """A video's overlay: every frame of ``source`` with the map of the sampled frame nearest it, placed on the
        region of the frame the model's crop saw (zero outside), as an H.264 video at the clip's rate; and the
        sampled frames (T, H, W, 3) with their maps as an animated GIF at the clip's pace."""
        height, width = sampled.shape[1:3]
        placed = self.preprocessing.on_frames(torch.as_tensor(cam), height, width)
        total, rate = count_frames(source)
        nearest = nearest_sampled(self.preprocessing.indices(total), total)
        style = self.render
        write_overlay_video(source, output, lambda i: placed[nearest[i]], style.alpha, style.colormap)
        blended = overlay_frames(sampled, placed, style.alpha, style.colormap)
        write_gif(blended, len(sampled) * rate / total, picture)

    def failed(self, item: Input, error: str) -> list[dict[str, Any]]:
        """The record of an input that failed as a whole (its file unreadable, the model's refusal)."""
        return [record(item.name, self.model, ",".join(self.methods), error=error)]

    def noted(self, item: Input, note: str) -> list[dict[str, Any]]:
        """The records of an input with nothing to explain (no detection, no pixel of the class): no files."""
        return [record(item.name, self.model, method, targets=[], note=note) for method in self.methods]

    def relative(self, path: Path) -> str:
        """A written file as the records name it: its path below the output folder."""
        return path.relative_to(self.out_dir).as_posix()

    @staticmethod
    def annotated(e: Explained, picture: Image.Image) -> Image.Image:
        """A picture with what a detection's or a segment's map explains drawn on it: its box or outline, and label."""
        if e.box is None and e.region is None and e.point is None:
            return picture
        box = None if e.polygon is not None else e.box  # an oriented box is drawn as itself
        skeleton = None if e.pose is None else Skeleton(e.pose, limbs_of(len(e.pose)))
        return annotate(picture, f"{e.class_name} {e.score:.3g}", box, e.region, e.point, e.polygon, skeleton)

    @staticmethod
    def region_record(region: torch.Tensor, shape: tuple[int, int]) -> dict[str, Any]:
        """A segment in the manifest: its share of the image and its bounding box in the pixels of the image,
        whose (height, width) is ``shape``."""
        rows, cols = region.nonzero(as_tuple=True)
        height, width = region.shape
        sx, sy = shape[1] / width, shape[0] / height
        box = [float(cols.min()) * sx, float(rows.min()) * sy, float(cols.max() + 1) * sx, float(rows.max() + 1) * sy]
        return {"fraction": round(float((region > 0).float().mean()), 6), "box": [round(v, 1) for v in box]}
