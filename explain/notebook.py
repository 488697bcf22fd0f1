"""The explorer in Jupyter, with ipywidgets: ``explain.notebook.explore(model, image)``.

The same controls as the web app (``explain app``) over the same :class:`explain.explorer.Explorer`: the photo,
its top classes to click or a class to type (a detector's detections, a pose model's keypoints, a segmenter's
regions), a promptable segmenter's or a depth model's prompt to type, the method, the layers, fusion, smoothing,
alpha and colormap, a second overlay to compare, the faithfulness metrics and the files of a view. A change of
alpha or colormap draws the kept map again; only a new view runs the model.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from .errors import ExplainError
from .explorer.controls import ALPHA_STEP, COLORMAPS, CONTROLS, Control
from .explorer.session import Explorer, Shown, View, method_choices, prompt_of
from .explorer.words import word_menu
from .models import IMAGENET_PREPROCESSING, ImageLike, ModelSpec, Preprocessing
from .models.text_image import TextImageSpec
from .tasks.language import WordsRequest


def widgets() -> Any:
    """The ``ipywidgets`` module, imported on first use."""
    try:
        import ipywidgets
    except ImportError:
        raise ExplainError('the notebook explorer needs ipywidgets: pip install "explain[notebook]"') from None
    return ipywidgets


def widget(control: Control, explorer: Explorer) -> Any:
    """A control as a widget (see :mod:`explain.explorer.controls`), hidden where the model has no use for it."""
    w = widgets()
    options, value = control.options_for(explorer), control.value_for(explorer)
    common = {"description": control.label_for(explorer), "style": {"description_width": "initial"}}
    if not control.shown_for(explorer):
        common["layout"] = w.Layout(display="none")
    if control.kind == "menu":
        return w.Dropdown(options=options, value=value if options else None, **common)
    if control.kind == "menus":
        return w.SelectMultiple(options=options, rows=6, **common)
    if control.kind == "buttons":
        return w.ToggleButtons(options=options, **common)
    if control.kind == "search":
        names = [name for name, _ in options]
        return w.Combobox(options=names, placeholder="type a class", ensure_option=True, **common)
    if control.kind == "check":
        return w.Checkbox(value=value, **common)
    if control.kind == "slider":
        return w.FloatSlider(value=value, min=0.0, max=1.0, step=ALPHA_STEP, **common)
    return w.IntSlider(min=0, value=value, **common)


def png(shown: Shown, alpha: float, colormap: str, index: int | None = None) -> bytes:
    """A shown map's overlay as PNG bytes, what an image widget shows (a clip's frame or a scan's slice
    ``index``, None: the peak's)."""
    buffer = io.BytesIO()
    shown.picture(alpha, colormap, index).save(buffer, format="PNG")
    return buffer.getvalue()


class NotebookExplorer:
    """The widgets of :func:`explore` and the explorer behind them; Jupyter shows it as its widgets.

    Attributes:
        explorer: The model, its photos and their kept maps.
        controls: Each control by name: ``photo``, ``entries``, ``typed``, ``method``, ``layers``, ``fuse``,
            ``aug_smooth``, ``eigen_smooth``, ``alpha``, ``colormap``, ``index`` (a clip's frame or a scan's
            slice, shown for those), ``method_b``, ``target_b``.
        overlay: The overlay's image widget, and ``overlay_b`` the compared one's.
        caption: What the overlay shows, and ``caption_b`` what the compared one does.
        widget: The whole, a ``VBox``.
    """

    def __init__(self, explorer: Explorer, folder: Path) -> None:
        w = widgets()
        self.explorer, self.folder = explorer, folder
        self.controls: dict[str, Any] = {control.name: widget(control, explorer) for control in CONTROLS}
        self.overlay, self.overlay_b = w.Image(format="png"), w.Image(format="png")
        self.caption, self.caption_b = w.Label(), w.Label()
        self.problem = w.HTML()
        prompted = explorer.task.prompted
        self.prompt = w.Text(
            description="prompt", placeholder="x,y or x1,y1,x2,y2 (the photo's pixels)", continuous_update=False,
            layout=w.Layout(display=None if prompted else "none"),
        )  # fmt: skip
        self.prompt_value: tuple[float, ...] = ()  # the prompt typed: SAM's point or box, a depth model's region
        self.shown: Shown | None = None  # what the overlay shows
        self.index: int | None = None  # the frame or slice drawn; None: the map's peak
        self._opening = False
        self.metrics_output = w.Output()
        measure, save = w.Button(description="faithfulness"), w.Button(description="save view")
        measure.on_click(lambda _: self.measure())
        save.on_click(lambda _: self.save())

        def group(*names: str) -> Any:
            return w.VBox([self.controls[c.name] for c in CONTROLS if c.group in names])

        self.widget = w.VBox([
            w.HBox([w.VBox([group("view"), self.prompt]), group("style", "compare")]),
            w.HBox([w.VBox([self.overlay, self.caption]), w.VBox([self.overlay_b, self.caption_b])]),
            w.HBox([measure, save]),
            self.problem,
            self.metrics_output,
        ])  # fmt: skip
        self._wire()
        self.opened()

    def _wire(self) -> None:
        """Each control draws again the overlays it names (see :mod:`explain.explorer.controls`); a photo opens,
        a typed class draws its map, a moved slider draws that frame or slice."""
        c = self.controls
        c["photo"].observe(lambda _: self.opened(), names="value")
        c["typed"].observe(self._typed, names="value")
        c["index"].observe(self._moved, names="value")
        self.prompt.observe(self._prompted, names="value")
        for control in CONTROLS:
            if control.name in ("photo", "typed", "index"):
                continue
            if "a" in control.redraws:
                c[control.name].observe(lambda _: self.draw(), names="value")
            if "b" in control.redraws:
                c[control.name].observe(lambda _: self.draw_b(), names="value")

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def view(self, method: str, target: int | None) -> View:
        """The view the controls describe, with a method and target of its own."""
        c = self.controls
        options = (c["fuse"].value, c["aug_smooth"].value, c["eigen_smooth"].value, self.prompt_value)
        return View(method, tuple(c["layers"].value), target, *options)

    def _prompted(self, change: dict[str, Any]) -> None:
        """A prompt typed: SAM's point or box, or a depth model's region, explained; a malformed one named."""
        try:
            self.prompt_value = prompt_of(change["new"])
        except ExplainError as err:
            self.problem.value = f"<b>{err}</b>"
            return
        self.draw()
        self.draw_b()

    def opened(self) -> None:
        """A photo chosen: its entries and layers listed, the first entry explained."""
        c, photo = self.controls, self.controls["photo"].value
        self._opening, self.index = True, None  # the menus' own changes draw nothing; the peak is drawn
        try:
            c["layers"].options = self.explorer.layer_menu(photo)
            view = View(prompt=self.prompt_value) if self.prompt_value else None
            if self.explorer.task.prompts and view is None:
                raise ExplainError(f"{self.explorer.spec.name} draws the mask of a prompt: type it, x,y or x1,y1,x2,y2")
            menu = [(entry.label, entry.index) for entry in self.explorer.entries(photo, view)]
            for name in ("entries", "target_b"):
                c[name].options = menu
                c[name].value = menu[0][1]
        except ExplainError as err:  # no automatic layer, say: the layers are listed to pick one
            self.problem.value = f"<b>{err}</b>"
            return
        finally:
            self._opening = False
        self.draw()
        self.draw_b()

    def _moved(self, change: dict[str, Any]) -> None:
        if not self._opening:
            self.index = change["new"]
            self.draw()
            self.draw_b()

    def _typed(self, change: dict[str, Any]) -> None:
        name = change["new"]
        if name in self.explorer.spec.labels:
            self.show(self.explorer.spec.labels.index(name))

    def draw(self) -> None:
        """The overlay of the controls' view."""
        self.show(self.controls["entries"].value)

    def show(self, target: int | None) -> None:
        """The overlay of the controls' view for a target."""
        c = self.controls
        self.shown = self._shown(self.view(c["method"].value, target), self.overlay, self.caption) or self.shown

    def draw_b(self) -> None:
        """The compared overlay."""
        c = self.controls
        self._shown(self.view(c["method_b"].value, c["target_b"].value), self.overlay_b, self.caption_b)

    def _shown(self, view: View, image: Any, caption: Any) -> Shown | None:
        """Draw a view into an image widget and its caption; a view that does not fit the model shows its error."""
        c = self.controls
        if self._opening:
            return None
        try:
            shown = self.explorer.show(c["photo"].value, view)
        except ExplainError as err:
            self.problem.value = f"<b>{err}</b>"
            return None
        self.problem.value = ""
        index = shown.peak if self.index is None else self.index
        image.value = png(shown, c["alpha"].value, c["colormap"].value, index)
        caption.value = f"{shown.entry.label} · {shown.view.method} · layer {shown.layer}"
        if shown.photo.depth is not None and image is self.overlay:  # the slider follows what is drawn
            self._opening = True
            try:
                c["index"].max, c["index"].value = shown.photo.depth - 1, index
            finally:
                self._opening = False
        return shown

    def measure(self) -> None:
        """The faithfulness of the overlay, shown below it."""
        found = self.explorer.faithfulness(self.shown)
        self.metrics_output.clear_output()
        with self.metrics_output:
            print(
                f"deletion AUC {found.deletion_auc:.3f} (lower is better), insertion AUC {found.insertion_auc:.3f} "
                f"(higher is better), Average Drop {found.average_drop:.1f}%, sanity check: {found.sanity}"
            )

    def save(self) -> list[Path]:
        """Write the overlay, its map and its record into the explorer's folder."""
        c = self.controls
        return self.explorer.save(self.shown, self.folder, c["alpha"].value, c["colormap"].value, self.index)


class WordsNotebook:
    """The widgets of :func:`explore` for a vision-language model: a photo, a question (and an answer to explain
    instead of the model's own) or comma-separated text prompts, a method; the words to pick and the picked
    word's map. Picking another word draws its kept map again.

    Attributes:
        explorer: The model, its photos and their kept words.
        controls: ``photo``, ``question``, ``answer``, ``texts``, ``method``, ``alpha``, ``colormap`` and
            ``words`` (the words to pick, filled by :meth:`explain`).
        overlay: The picked word's image widget; ``caption`` what was said, the method and the layer.
        widget: The whole, a ``VBox``.
    """

    def __init__(self, explorer: Explorer) -> None:
        w = widgets()
        self.explorer, answers = explorer, getattr(explorer.task, "question", False)
        asked, texts = (w.Layout(display=None if shown else "none") for shown in (answers, not answers))
        methods = [name for _, name in method_choices()]
        self.controls: dict[str, Any] = {
            "photo": w.Dropdown(options=list(explorer.photos), description="photo"),
            "question": w.Text(description="question", layout=asked),
            "answer": w.Text(description="answer", placeholder="empty: the model's own", layout=asked),
            "texts": w.Text(description="texts", placeholder="a cat, a remote", layout=texts),
            "method": w.Dropdown(options=methods, value="gradcam", description="method"),
            "alpha": w.FloatSlider(value=0.5, min=0.0, max=1.0, step=ALPHA_STEP, description="alpha"),
            "colormap": w.Dropdown(options=list(COLORMAPS), value="jet", description="colormap"),
            "words": w.ToggleButtons(options=[], description="words"),
        }
        self.overlay, self.caption, self.problem = w.Image(format="png"), w.Label(), w.HTML()
        go = w.Button(description="explain")
        go.on_click(lambda _: self.explain())
        for name in ("words", "alpha", "colormap"):
            self.controls[name].observe(lambda _: self.draw(), names="value")
        self.widget = w.VBox([*self.controls.values(), go, self.overlay, self.caption, self.problem])

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def request(self) -> WordsRequest:
        """What the controls ask."""
        c = {name: control.value for name, control in self.controls.items()}
        fields = (c["question"], c["answer"], c["texts"], c["method"])
        return self.explorer.reading(*fields, alpha=c["alpha"], colormap=c["colormap"])

    def explain(self) -> None:
        """The photo explained for the controls' question (once), its words listed and the first one drawn."""
        try:
            words, said = self.explorer.words(self.controls["photo"].value, self.request())
        except ExplainError as err:
            self.problem.value = f"<b>{err}</b>"
            return
        self.problem.value = ""
        told = said.get("answer") or ", ".join(said.get("texts", ()))
        self.caption.value = f"{told} · {self.controls['method'].value} · layer {said['layer']}"
        self.controls["words"].options = word_menu(words)
        self.draw()

    def draw(self) -> None:
        """The picked word's map, from the kept words."""
        if not self.controls["words"].options:
            return
        try:
            picture = self.explorer.word_picture(
                self.controls["photo"].value, self.request(), self.controls["words"].value or 0
            )
        except ExplainError as err:
            self.problem.value = f"<b>{err}</b>"
            return
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        self.overlay.value = buffer.getvalue()


def explore(
    model: ModelSpec | TextImageSpec | nn.Module,
    image: ImageLike | Sequence[ImageLike],
    *,
    labels: Sequence[str] | None = None,
    preprocessing: Preprocessing = IMAGENET_PREPROCESSING,
    folder: str | Path = "explain_views",
) -> NotebookExplorer | WordsNotebook:
    """Explore a model's maps of one or several images with widgets; the notebook cell's last value shows them.

    Args:
        model: A :class:`explain.ModelSpec` (from :func:`explain.load_model`), a vision-language model (from
            :func:`explain.models.text_image.load_text_image_model`: its words' widgets, :class:`WordsNotebook`),
            or a classifier returning (N, classes) scores, left as it was.
        image: A path, PIL image or RGB array, or a sequence of them; for a ModelSpec of clips, scans or signals,
            files of those.
        labels: A bare classifier's class names; default ``class 0``, ``class 1``, ...
        preprocessing: How a bare classifier's images become its input; default ImageNet's.
        folder: Where "save view" writes a view's overlay, map and record.

    Raises:
        ExplainError: ipywidgets is not installed (its ``pip install`` named), or an image is unreadable.
    """
    widgets()
    if not isinstance(model, (ModelSpec, TextImageSpec)):
        count = None if labels is not None else _class_count(model, preprocessing)
        names = list(labels) if labels is not None else [f"class {i}" for i in range(count)]
        model = ModelSpec(model, type(model).__name__, names, preprocessing)
    explorer = Explorer(model)
    single = isinstance(image, (str, Path)) or not isinstance(image, Sequence)
    for item in [image] if single else image:
        explorer.add(item)
    if explorer.task.words:  # the page follows the task, as the web app's does
        return WordsNotebook(explorer)
    return NotebookExplorer(explorer, Path(folder))


def _class_count(model: nn.Module, preprocessing: Preprocessing) -> int:
    """A bare classifier's class count: its output's width on one blank input."""
    import torch

    from .core.model_state import untouched

    size = preprocessing.input_size or 224
    device = next(model.parameters()).device
    with untouched(model), torch.no_grad():
        return int(model(torch.zeros(1, 3, size, size, device=device)).shape[1])
