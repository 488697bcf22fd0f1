"""The explorer's state, without a user interface: one model, the inputs given to it, and their maps, kept.

An input is a photo, or for a model that reads them a video clip, a scan or a signal (called a photo all the
same). A map is computed once per photo and view (method, layers, target, smoothing): drawing it again with
another alpha, colormap, frame or slice runs no model. The web app (:mod:`explain.explorer.web`) and the notebook
explorer (:mod:`explain.notebook`) are two faces of one :class:`Explorer`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Container
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from ..catalog import METHOD_CATALOG, check_method
from ..core.engine import CAMResult
from ..core.layers import LayerInfo, layer_choices
from ..core.model_state import untouched
from ..errors import ExplainError
from ..export.manifest import record
from ..export.reports import image_metrics
from ..io.atomic import write_atomically
from ..io.images import load_image, rgb_array
from ..io.kinds import IMAGE, InputKind
from ..io.render import Skeleton, annotate, blend, gradient_image, heat_layer, overlay
from ..io.signals import plot_signal
from ..io.volumes import grey, intensity_window
from ..methods import create_method
from ..metrics import sanity_check
from ..models import ModelSpec
from ..models.text_image import TextImageSpec
from ..targets import ClassTarget, Target
from ..targets.keypoints import limbs_of
from ..tasks.asked import Asked, texts_of
from ..tasks.base import Task
from ..tasks.language import Word, WordsRequest, WordsTask
from ..tasks.registry import task_of
from .concepts import ExplorerConcepts

PHOTOS = Path(__file__).resolve().parent.parent / "data" / "photos"
TOP_CLASSES = 5  # a classifier's classes listed per photo


BUNDLED_PHOTOS = ("chelsea.jpg", "coffee.jpg", "astronaut.jpg")  # the cat first: its class is known


def bundled_photos() -> list[Path]:
    """The sample photos shipped with the package (``explain/data/photos``), the first shown first."""
    return [PHOTOS / name for name in BUNDLED_PHOTOS]


def method_choices() -> list[tuple[str, str]]:
    """Every method as (what a menu shows, its name): its title, the slow ones marked with their cost."""
    return [
        (f"{entry.name}: {entry.title}" + (f" [slow: {entry.cost}]" if entry.cost else ""), entry.name)
        for entry in METHOD_CATALOG
    ]


@dataclass(frozen=True)
class Photo:
    """One input the explorer was given.

    Attributes:
        name: Its name in the explorer: the file's name, made unique.
        image: What maps are drawn on: a photo (RGB, at its own resolution); a clip's sampled frames (T, H, W, 3)
            uint8; a scan's voxels (D, H, W); a signal (C, L).
        x: The model's input, (1, C, *spatial) on the model's device.
        kind: What it is (see :mod:`explain.io.kinds`): a picture, a clip, a scan or a signal.
        window: A scan's grey window (see :func:`explain.io.volumes.intensity_window`), found once; else None.
    """

    name: str
    image: Image.Image | Tensor
    x: Tensor
    kind: InputKind = IMAGE
    window: tuple[float, float] | None = None

    @property
    def depth(self) -> int | None:
        """A clip's frames or a scan's slices, what a slider browses; None for a photo or a signal."""
        return len(self.image) if self.kind.unit else None


@dataclass(frozen=True)
class View:
    """What a map shows, bar how it is drawn: with the photo, the key of the explorer's cache.

    Attributes:
        method: A name of ``explain.METHODS``.
        layers: The target layers; several are fused; none: the automatic choice.
        target: A classifier's class, or a detection's or region's place in :meth:`Explorer.entries`; None: the
            top class, or the first entry.
        fuse: How several layers' maps become one (``explain.catalog.FUSIONS``).
        aug_smooth: Average over flipped and scaled copies of the input.
        eigen_smooth: The first principal component of the weighted activations.
        prompt: Where a promptable segmenter (SAM) is prompted, a point ``(x, y)`` or a box ``(x1, y1, x2, y2)``,
            or a depth estimator's region ``(x1, y1, x2, y2)`` (none: the whole photo), in the photo's pixels.
    """

    method: str = "gradcam"
    layers: tuple[str, ...] = ()
    target: int | None = None
    fuse: str = "mean"
    aug_smooth: bool = False
    eigen_smooth: bool = False
    prompt: tuple[float, ...] = ()


@dataclass(frozen=True)
class Entry:
    """One thing of a photo a map can explain: a classifier's class, a detection or a segmenter's region.

    Attributes:
        index: What a :class:`View`'s target names it by: the class for a classifier, the place in the list for
            a detector or a segmenter.
        class_index: The class.
        class_name: Its name.
        probability: The model's probability of it (a detection's score).
        box: A detection's box in the photo's pixels, or None.
        region: A segmenter's region, a mask at the model's output resolution, or None.
        point: A pose model's keypoint in the photo's pixels, or None.
        pose: Its detection's keypoints (x, y in the photo's pixels, visibility), drawn as its skeleton, or None.
    """

    index: int
    class_index: int
    class_name: str
    probability: float
    box: tuple[float, float, float, float] | None = None
    region: Tensor | None = field(default=None, compare=False, repr=False)
    point: tuple[float, float] | None = None
    pose: tuple[tuple[float, float, float], ...] | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        """How a list shows it: ``tabby, tabby cat 62.3%``, a detection's place first."""
        place = "" if self.box is None and self.region is None else f"#{self.index} "
        return f"{place}{self.class_name} {self.probability:.1%}"

    def marked(self, picture: Image.Image, labelled: bool = True) -> Image.Image:
        """A picture with what the entry explains drawn on it: its box or outline, its keypoint over its skeleton,
        and its label (or none)."""
        skeleton = None if self.pose is None else Skeleton(self.pose, limbs_of(len(self.pose)))
        if not labelled:  # a photo to click: boxes and outlines, and a pose's skeleton alone
            box = None if skeleton is not None else self.box
            return annotate(picture, "", box, self.region, skeleton=skeleton)
        return annotate(picture, self.label, self.box, self.region, self.point, skeleton=skeleton)


@dataclass(frozen=True)
class Shown:
    """One map of one photo, ready to draw.

    Attributes:
        photo: The photo.
        view: What the map shows, its target resolved.
        entry: What it explains.
        cam: The map at the model's input resolution, (*spatial) in [0, 1], or a guided map (C, *spatial); on the
            CPU.
        layer: The layer it was computed at.
        canvas: The heatmap on what it is drawn on: ``cam`` itself, but for a clip the map placed on the region of
            its frames the model's crop saw, and for a guided map of a clip, scan or signal each point's largest
            absolute channel, scaled to [0, 1].
    """

    photo: Photo
    view: View
    entry: Entry
    cam: Tensor
    layer: str
    canvas: Tensor

    @property
    def peak(self) -> int | None:
        """The frame or slice where the map is highest, the one drawn by default; None for a photo or a signal."""
        if self.photo.depth is None:
            return None
        return int(self.canvas.flatten(1).amax(dim=1).argmax())

    def layers(self, colormap: str = "jet", index: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """The picture's two layers, HxWx3 uint8 at the photo's resolution: what the map is drawn on, and the
        coloured map; :meth:`picture` blends them, a page can stack them (the map at the opacity alpha). A
        detection's box or a region's outline is drawn on both. A guided map, or a signal drawn over its map as a
        coloured band, is one layer (the second None).

        A clip's frame or a scan's slice ``index`` is drawn (None: the :attr:`peak`'s).

        Raises:
            ExplainError: ``index`` is no frame or slice of the photo.
        """
        photo, canvas = self.photo, self.canvas
        if photo.kind.plotted:
            return np.asarray(plot_signal(photo.image, canvas, colormap)), None
        if photo.kind.unit:
            depth, index = len(photo.image), self.peak if index is None else index
            if not 0 <= index < depth:
                raise ExplainError(f"{photo.name} has {depth} {photo.kind.unit}s; no {index}")
            frame = photo.image[index].numpy()
            base = grey(frame, photo.window) if photo.kind.windowed else frame
            canvas = canvas[index]
        else:
            base = rgb_array(photo.image)
        height, width = base.shape[:2]
        if canvas.dim() == 3:  # a guided map of a photo: its own colours
            return np.asarray(gradient_image(canvas, height, width)), None
        heat = heat_layer(canvas, height, width, colormap)
        if self.entry.box is None and self.entry.region is None and self.entry.point is None:
            return base, heat
        return np.asarray(self.entry.marked(Image.fromarray(base))), np.asarray(
            self.entry.marked(Image.fromarray(heat))
        )

    def picture(self, alpha: float = 0.5, colormap: str = "jet", index: int | None = None) -> Image.Image:
        """The map on the photo at the photo's resolution (see :meth:`layers`): the heat layer blended onto the
        photo, a clip's frame or a scan's slice ``index``, with weight ``alpha``."""
        base, heat = self.layers(colormap, index)
        return Image.fromarray(base) if heat is None else blend(base, heat, alpha)

    def record(
        self, alpha: float, colormap: str, model: str, raw: str | None = None, index: int | None = None
    ) -> dict[str, Any]:
        """The view as a manifest record (see :func:`explain.export.manifest.record`), with how it was drawn (and
        a clip's frame or a scan's slice)."""
        target = {
            "class_index": self.entry.class_index,
            "class_name": self.entry.class_name,
            "score": round(self.entry.probability, 6),
            "box": None if self.entry.box is None else [round(v, 1) for v in self.entry.box],
            "point": None if self.entry.point is None else [round(v, 1) for v in self.entry.point],
        }
        view = {**asdict(self.view), "layers": list(self.view.layers), "alpha": alpha, "colormap": colormap}
        if self.photo.depth is not None:
            view["index"] = self.peak if index is None else index
        return {
            **record(self.photo.name, model, self.view.method, targets=[target], layer=self.layer, raw=raw),
            "view": view,
        }


@dataclass(frozen=True)
class Faithfulness:
    """How faithful a shown map is (see :mod:`explain.metrics`).

    Attributes:
        deletion: The model's probability as the most important pixels are removed first (lower area: better).
        insertion: The probability as they are inserted into a blurred photo first (higher area: better).
        deletion_auc: The area under ``deletion``.
        insertion_auc: The area under ``insertion``.
        average_drop: The probability's drop, in %, on the photo masked by the map (lower: better).
        sanity: The cascading randomization's verdict for the method on this photo: ``"passes"`` (the map
            changes when the output block is random) or ``"fails"``.
    """

    deletion: list[float]
    insertion: list[float]
    deletion_auc: float
    insertion_auc: float
    average_drop: float
    sanity: str


@dataclass(frozen=True)
class _Maps:
    """What one explanation call gave for one photo: the maps of its entries, in order."""

    cams: Tensor  # (K, ...) on the CPU
    entries: list[Entry]
    layer: str
    result: CAMResult


class Explorer:
    """One model and the photos it is shown, with their maps and top classes kept; for a vision-language model,
    each photo's words, prompts or boxes of each question, kept.

    Calls from several threads (a web server's) run the model one at a time. Its :attr:`concepts` are what the model
    sees in the photos (see :class:`explain.explorer.concepts.ExplorerConcepts`).

    Args:
        spec: The model, its preprocessing and class names (see :func:`explain.load_model`), or a vision-language
            model and its processor (see :func:`explain.models.text_image.load_text_image_model`).
        cache_size: How many explanation calls are kept, the least recently used dropped first.
        score_threshold: A detector's least score of a listed detection.
    """

    def __init__(self, spec: ModelSpec | TextImageSpec, cache_size: int = 64, score_threshold: float = 0.5) -> None:
        if getattr(spec.preprocessing, "stride", None) is not None:
            raise ExplainError(
                f"the explorer explains one clip per video; {spec.name} takes sliding windows (a clip stride): "
                "load it without one"
            )
        self.spec = spec
        self.photos: dict[str, Photo] = {}
        self.cache_size = cache_size
        self.score_threshold = score_threshold
        self._maps: OrderedDict[tuple[str, View], _Maps] = OrderedDict()
        self._words: OrderedDict[tuple[Any, ...], tuple[list[Word], dict[str, Any]]] = OrderedDict()
        self._top: dict[str, list[Entry]] = {}
        self._layers: dict[tuple[int, ...], tuple[list[LayerInfo], list[str]]] = {}
        self._digests: dict[str, str] = {}
        self._pose_model: bool | None = None
        self._lock = threading.RLock()
        self.task: Task = task_of(spec)
        self.concepts = ExplorerConcepts(self, self._lock)

    def add(self, source: str | Path | Image.Image | np.ndarray, name: str | None = None) -> Photo:
        """Take a photo: a file (read as :func:`explain.load_image` reads it), a PIL image or an RGB array; for a
        model of clips, scans or signals, a file of those (read as an export reads it).

        The same input given twice is one photo. Another input under a taken name gets a suffix.

        Raises:
            ImageLoadError: A file that is no readable image, or too large (its message names the file).
            InputLoadError: A file that is no readable clip, scan or signal.
            ExplainError: A picture given to a model of clips, scans or signals, which reads files.
        """
        kind = self.spec.preprocessing.kind
        if not kind.picture:
            if not isinstance(source, (str, Path)):
                raise ExplainError(f"{self.spec.name} reads {kind} files; give a file's path")
            image, x = self.spec.preprocessing.read(Path(source))
            image, x, name = image.contiguous(), x[None], name or Path(source).name
            content = image.numpy().tobytes() + repr(tuple(image.shape)).encode()
        elif isinstance(source, (str, Path)):
            image, x, name = load_image(source), None, name or Path(source).name
        else:
            image, x, name = Image.fromarray(rgb_array(source)), None, name or "image"
        if x is None:
            content = np.asarray(image).tobytes() + repr(image.size).encode()
            x = self.spec.preprocessing(image)[None]
        digest = hashlib.sha256(content).hexdigest()
        with self._lock:
            if digest in self._digests:
                return self.photos[self._digests[digest]]
            unique = unique_name(name, self.photos)
            window = intensity_window(image.numpy()) if kind.windowed else None
            photo = Photo(unique, image, x.to(self.spec.device), kind, window)
            self.photos[unique] = photo
            self._digests[digest] = unique
            return photo

    def reading(self, question: str, answer: str, texts: str, method: str, **options: Any) -> WordsRequest:
        """What a vision-language model's page asks: a question (and an answer to explain instead of the model's
        own) of a model that answers; comma-separated text prompts or queries of another. ``options``: how it is
        drawn (``alpha``, ``colormap``).

        Raises:
            ExplainError: The field the model reads is empty.
        """
        task = self.task
        if not isinstance(task, WordsTask):
            raise ExplainError(f"{self.spec.name} is a {task.name} model: it reads no question or text prompts")
        if task.question:
            if not question.strip():
                raise ExplainError(f"{self.spec.name} answers prompts: type a question")
            return WordsRequest(question.strip(), answer.strip() or None, (), method=method or "gradcam", **options)
        prompts = texts_of(texts)
        if not prompts:
            raise ExplainError(f"{self.spec.name} reads text prompts: type them comma-separated, as 'a cat, a remote'")
        return WordsRequest(None, None, prompts, method=method or "gradcam", **options)

    def words(self, photo: str, request: WordsRequest) -> tuple[list[Word], dict[str, Any]]:
        """A vision-language model's words of the photo with their maps, and what its record says: computed once
        per photo and question (method, prompt, answer, texts), then kept; the style of a drawing (alpha,
        colormap) computes nothing.

        Raises:
            ExplainError: An unknown photo, or one the model cannot explain.
        """
        if photo not in self.photos:
            raise ExplainError(f"no photo named {photo!r}; add it first")
        image = self.photos[photo].image
        asked = (request.prompt, request.answer, tuple(request.texts), request.max_new_tokens, request.method)
        key = (photo, *asked, request.score_threshold)
        with self._lock:
            if key not in self._words:
                self._words[key] = self.task.words(self.spec, image, request)  # type: ignore[attr-defined]
                while len(self._words) > self.cache_size:
                    self._words.popitem(last=False)
            self._words.move_to_end(key)
            return self._words[key]

    def word_picture(self, photo: str, request: WordsRequest, index: int) -> Image.Image:
        """The map of the photo's word ``index`` drawn on it in the request's style, its box drawn too.

        Raises:
            ExplainError: No such word.
        """
        words, _ = self.words(photo, request)
        if not 0 <= index < len(words):
            raise ExplainError(f"no word {index}: the photo has {len(words)}")
        word = words[index]
        drawn = overlay(self.photos[photo].image, word.cam, request.alpha, request.colormap)
        return drawn if word.box is None else annotate(drawn, f"{word.text} {word.score:.3g}", tuple(word.box))

    def layers(self, photo: str) -> tuple[list[LayerInfo], list[str]]:
        """The layers a CAM can use on the photo, and the automatic choice (see
        :func:`explain.core.layers.layer_choices`), found once per input shape."""
        with self._lock:
            x = self.photos[photo].x
            shape = tuple(x.shape)
            if shape not in self._layers:
                shown = self.photos[photo]
                size = shown.image.size if isinstance(shown.image, Image.Image) else (0, 0)
                model = self._subject(shown, View(prompt=self.task.probe_prompt(size)))[0]  # SAM's: any prompt's
                self._layers[shape] = layer_choices(model, x, self.spec.labels)
            return self._layers[shape]

    def layer_menu(self, photo: str) -> list[tuple[str, str]]:
        """The photo's candidate layers as (what a menu shows, the name): the map's shape, the automatic choice
        marked."""
        candidates, automatic = self.layers(photo)
        return [
            (f"{info.name}  {info.describe()}" + ("  [automatic]" if info.name in automatic else ""), info.name)
            for info in candidates
        ]

    def entry_menu(self, photo: str) -> list[tuple[str, int]]:
        """The photo's entries (see :meth:`entries`) as (what a list shows, the view's target)."""
        return [(entry.label, entry.index) for entry in self.entries(photo)]

    def entries(self, photo: str, view: View | None = None) -> list[Entry]:
        """What the photo's maps can explain: a classifier's top classes with their probabilities, or a detector's
        detections (a pose model's keypoints of each), or a segmenter's regions (those of the first view's call,
        ``view`` where none was made); with a prompt in ``view``, what that prompt's call explains."""
        with self._lock:
            if view is not None and view.prompt:  # the entries of that prompt (a SAM mask, a depth region)
                return self._explained(photo, view).entries
            if photo not in self._top:
                self.show(photo, replace_target(view or View(), None))
            return self._top[photo]

    def show(self, photo: str, view: View) -> Shown:
        """The photo's map for the view, computed once (one explanation call) and then kept.

        Raises:
            ExplainError: The view does not fit the model (a layer without a map, a method for another kind of
                model, a target out of range); the message names the way out.
        """
        check_method(view.method)
        with self._lock:
            maps = self._explained(photo, view)
            place = 0 if view.target is None or self.task.classifies else view.target
            if not 0 <= place < len(maps.entries):
                raise ExplainError(f"{photo} has {len(maps.entries)} entries to explain; there is no #{place}")
            resolved = self._resolved(photo, view) if self.task.classifies else replace_target(view, place)
            shown, cam = self.photos[photo], maps.cams[place]
            return Shown(shown, resolved, maps.entries[place], cam, maps.layer, self._canvas(shown, cam))

    def entry_at(self, photo: str, x: float, y: float) -> int:
        """The entry a click at ``(x, y)`` (the photo's pixels) picks: a pose model's keypoint nearest it, else the
        smallest detection box or the segment holding it.

        Raises:
            ExplainError: A classifier's photo (its classes have no place), or nothing there to pick.
        """
        if not self.task.click:
            raise ExplainError("a classifier's classes have no place on the photo: click one in the list")
        entries, image = self.entries(photo), self.photos[photo].image
        points = [(e.index, (e.point[0] - x) ** 2 + (e.point[1] - y) ** 2) for e in entries if e.point is not None]
        if points:
            return min(points, key=lambda found: found[1])[0]
        holding = [(e.index, _area(e, image.size)) for e in entries if _holds(e, x, y, image.size)]
        if not holding:
            raise ExplainError(
                f"{photo}: nothing to explain at ({x:.0f}, {y:.0f}); click inside a detection or segment"
            )
        return min(holding, key=lambda found: found[1])[0]

    def clickable(self, photo: str, view: View | None = None) -> Image.Image:
        """The photo as a user clicks it to pick what to explain: every entry's box, outline or skeleton drawn
        without labels, and the view's prompt (a point or a box)."""
        picture = self.photos[photo].image
        if not isinstance(picture, Image.Image):
            raise ExplainError(f"{photo} is a {self.photos[photo].kind}: pick its entries from the list")
        for entry in self.entries(photo) if self.task.picks else []:
            picture = entry.marked(picture, labelled=False)
        prompt = view.prompt if view is not None else ()
        if len(prompt) == 2:
            picture = annotate(picture, "", point=prompt)
        elif len(prompt) == 4:
            picture = annotate(picture, "", box=prompt)  # type: ignore[arg-type]
        return picture

    def faithfulness(self, shown: Shown, batch_size: int = 32) -> Faithfulness:
        """The faithfulness metrics of a shown map of a classifier's class, on demand: deletion and insertion
        (RISE's, 50 steps each), Average Drop, and the sanity check's verdict (the method's maps on a copy of the
        model whose output block is random).

        Raises:
            ExplainError: The model is no classifier: the metrics score a class's probability.
        """
        if not self.task.classifies:
            raise ExplainError(
                f"the faithfulness metrics score a classifier's class; {self.spec.name} is a {self.task.name} model"
            )
        with self._lock:
            result = self._explained(shown.photo.name, shown.view).result
            x, model = shown.photo.x, self.spec.model
            values, curves = image_metrics(
                ["deletion", "insertion", "drop"], model, x, result.cams, result.target, batch_size
            )
            checked = sanity_check(
                model,
                x,
                shown.view.method,
                shown.entry.class_index,
                layer=list(shown.view.layers) or None,
                depths=[1],
                **self._options(shown.view),
            )
        return Faithfulness(
            curves["deletion"][0].tolist(),
            curves["insertion"][0].tolist(),
            float(values["deletion"][0]),
            float(values["insertion"][0]),
            float(values["drop"][0]),
            "fails" if checked.insensitive() else "passes",
        )

    def save(
        self, shown: Shown, folder: Path, alpha: float = 0.5, colormap: str = "jet", index: int | None = None
    ) -> list[Path]:
        """Write the view's overlay (PNG; a clip's frame or a scan's slice ``index``, None: the peak's), its map
        (``.npy``, at the model's input resolution) and its manifest record (JSON) into ``folder``, each whole or
        not at all; returns their paths."""
        stem = f"{_stem(shown.photo.name)}.{shown.view.method}.{shown.entry.class_index}"
        overlay_path, raw_path, record_path = (folder / f"{stem}{suffix}" for suffix in (".png", ".npy", ".json"))
        write_atomically(overlay_path, lambda p: shown.picture(alpha, colormap, index).save(p, format="PNG"))
        write_atomically(raw_path, lambda p: np.save(p.open("wb"), shown.cam.numpy()))
        view_record = shown.record(alpha, colormap, self.spec.name, raw=raw_path.name, index=index)
        write_atomically(record_path, lambda p: p.write_text(json.dumps(view_record, indent=1) + "\n"))
        return [overlay_path, raw_path, record_path]

    def _canvas(self, photo: Photo, cam: Tensor) -> Tensor:
        """A map as it is drawn on the photo (see :attr:`Shown.canvas`)."""
        if photo.kind.picture:
            return cam
        if cam.dim() == photo.x.dim() - 1:  # a guided map (C, *spatial): each point's largest absolute channel
            cam = cam.abs().amax(dim=0)
            cam = cam / cam.max().clamp_min(1e-12)
        if photo.kind.unit and not photo.kind.windowed:  # a clip's frames, at the clip's own size
            height, width = photo.image.shape[1:3]
            return self.spec.preprocessing.on_frames(cam, height, width)
        return cam

    def _options(self, view: View) -> dict[str, Any]:
        options: dict[str, Any] = {"fuse": view.fuse} if len(view.layers) > 1 else {}
        if view.aug_smooth:
            options["aug_smooth"] = True
        if view.eigen_smooth:
            options["eigen_smooth"] = True
        return options

    def _resolved(self, photo: str, view: View) -> View:
        """A classifier's view with its target named: the top class for None."""
        if not self.task.classifies or view.target is not None or photo not in self._top:
            return view
        return replace_target(view, self._top[photo][0].class_index)

    def _explained(self, photo: str, view: View) -> _Maps:
        """The maps of one explanation call, from the cache or computed."""
        if photo not in self.photos:
            raise ExplainError(f"no photo named {photo!r}; add it first")
        view = self._resolved(photo, view)
        key_view = view if self.task.classifies else replace_target(view, None)
        key = (photo, key_view)
        if key in self._maps:
            self._maps.move_to_end(key)
            return self._maps[key]
        maps = self._computed(self.photos[photo], view)
        if self.task.classifies and view.target is None:  # now the top class is known: keep it by name
            key = (photo, replace_target(view, maps.entries[0].class_index))
        self._maps[key] = maps
        while len(self._maps) > self.cache_size:
            self._maps.popitem(last=False)
        return maps

    def _computed(self, photo: Photo, view: View) -> _Maps:
        """One explanation call for a view of a photo."""
        classifier = self.task.classifies
        model, target = (self.spec.model, None) if classifier else self._subject(photo, view)
        options = self._options(view)
        method = create_method(view.method, model, list(view.layers) or None, labels=self.spec.labels, **options)
        if classifier:
            result = method(photo.x, None if view.target is None else ClassTarget(view.target))
            if photo.name not in self._top:
                self._top[photo.name] = self._top_classes(result)
            entry = self._class_entry(result)
            return _Maps(result.cams.detach().cpu(), [entry], result.layer, result)
        result = method(photo.x, target)
        entries = self._listed(photo, result)
        if not view.prompt:  # a prompt's entries are its own: the photo's list is that of no prompt
            self._top.setdefault(photo.name, entries)
        keep = [k for _, k in result.shown()]
        return _Maps(_with_k(result, result.cams)[0, keep].detach().cpu(), entries, result.layer, result)

    def _subject(self, photo: Photo, view: View) -> tuple[nn.Module, Target]:
        """What a view of a photo explains, for a model other than a classifier: the model and the target, as the
        task has them for the view's prompt (see :meth:`explain.tasks.base.Task.view`); a detector's whose
        detections have keypoints explains every keypoint of each.

        Raises:
            ExplainError: A prompt the task does not take, or of the wrong length.
        """
        size = photo.image.size if isinstance(photo.image, Image.Image) else (0, 0)
        poses = "keypoint" in self.task.takes and self._poses(photo)
        task = task_of(self.spec, "all") if poses else self.task
        return task.view(self.spec, view.prompt, size, Asked(score_threshold=self.score_threshold))

    def _poses(self, photo: Photo) -> bool:
        """Whether the detector is a pose model (its detections have keypoint scores), found once per explorer."""
        if self._pose_model is None:
            with untouched(self.spec.model), torch.inference_mode():  # its buffers and flags as they were
                found = self.spec.model(photo.x)
            first = found[0] if isinstance(found, (list, tuple)) and found else None
            self._pose_model = isinstance(first, dict) and "keypoints_scores" in first
        return self._pose_model

    def _top_classes(self, result: CAMResult) -> list[Entry]:
        probabilities = result.logits.float().softmax(dim=1)[0]
        top = probabilities.topk(min(TOP_CLASSES, len(probabilities)))
        return [
            Entry(int(c), int(c), self.spec.labels[int(c)], float(p))
            for p, c in zip(top.values.tolist(), top.indices.tolist())
        ]

    def _class_entry(self, result: CAMResult) -> Entry:
        index = int(result.class_indices[0])
        return Entry(index, index, self.spec.labels[index], float(result.probabilities[0]))

    def _listed(self, photo: Photo, result: CAMResult) -> list[Entry]:
        """A detector's detections or a segmenter's regions of one call, in its order."""
        bound = result.target
        width, height = photo.image.size
        scale = torch.tensor([width / photo.x.shape[-1], height / photo.x.shape[-2]] * 2)
        names, entries = bound.names or self.spec.labels, []
        classes = _with_k(result, result.class_indices)[0].cpu()
        probabilities = _with_k(result, result.probabilities)[0].cpu()
        boxes, regions, points, poses = (
            None if values is None else values[0].detach().cpu()  # the photo's, on the CPU once
            for values in (bound.boxes, bound.regions, bound.points, bound.poses)
        )
        for place, (_, j) in enumerate(result.shown()):
            index = int(classes[j])
            box = None if boxes is None else tuple((boxes[j] * scale).tolist())
            region = None if regions is None else regions[j]
            point = None if points is None else tuple((points[j] * scale[:2]).tolist())
            pose = None if poses is None else (poses[j] * torch.cat([scale[:2], torch.ones(1)])).tolist()
            pose = None if pose is None else tuple(tuple(keypoint) for keypoint in pose)
            entries.append(Entry(place, index, names[index], float(probabilities[j]), box, region, point, pose))
        if not entries:
            raise ExplainError(f"{photo.name}: the model finds nothing to explain (no detection or region)")
        return entries


def _with_k(result: CAMResult, values: Tensor) -> Tensor:
    """A result's per-target values (maps, classes, probabilities) with their K axis, (N, K, ...), where a target
    of one map per image left it out."""
    return values if result.target.keeps_k else values[:, None]


def _holds(entry: Entry, x: float, y: float, size: tuple[int, int]) -> bool:
    """Whether a detection's box or a segment's region holds the point ``(x, y)`` of a photo of ``size`` (W, H)."""
    if entry.box is not None:
        x1, y1, x2, y2 = entry.box
        return x1 <= x <= x2 and y1 <= y <= y2
    if entry.region is None:
        return False
    rows, columns = entry.region.shape[-2:]
    row, column = min(int(y * rows / size[1]), rows - 1), min(int(x * columns / size[0]), columns - 1)
    return bool(entry.region[row, column] > 0)


def _area(entry: Entry, size: tuple[int, int]) -> float:
    """A detection's box area, or a segment's share of the photo times its area (pixels of a photo of ``size``)."""
    if entry.box is not None:
        return (entry.box[2] - entry.box[0]) * (entry.box[3] - entry.box[1])
    return float((entry.region > 0).float().mean()) * size[0] * size[1]  # type: ignore[union-attr]


def prompt_of(text: str) -> tuple[float, ...]:
    """A typed prompt: ``x,y`` (a point), ``x1,y1,x2,y2`` (a box), or nothing.

    Raises:
        ExplainError: Anything else, named.
    """
    try:
        values = tuple(float(part) for part in text.split(",")) if text.strip() else ()
    except ValueError:
        values = (0.0,)
    if len(values) not in (0, 2, 4):
        raise ExplainError(f"prompt {text!r}: give x,y (a point) or x1,y1,x2,y2 (a box), in the photo's pixels")
    return values


def unique_name(name: str, taken: Container[str]) -> str:
    """``name``, or where it is taken, ``name`` with the first free suffix: ``chelsea (2).png``."""
    unique, count = name, 1
    while unique in taken:
        count += 1
        unique = f"{_stem(name)} ({count}){name[len(_stem(name)) :]}"
    return unique


def _stem(name: str) -> str:
    """A file name without its suffixes: ``scan`` of ``scan.nii.gz``, ``chelsea`` of ``chelsea.png``."""
    return name.split(".", 1)[0] if not name.startswith(".") else name


def replace_target(view: View, target: int | None) -> View:
    """The view with another target."""
    return replace(view, target=target)
