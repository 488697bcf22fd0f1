"""The explorer as a local web app, with Gradio: ``explain app [--model NAME] [--host H] [--port P]``.

Every control calls one function, :meth:`App.draw`, with the whole view. The explorer keeps the maps, so a
change of colormap, frame or slice only draws the kept map again; the alpha slider asks the server nothing (the
page stacks the map's layers and changes the heat layer's opacity). The endpoint ``/explain`` scripts the app:
``gradio_client.Client(url).predict(image, model, method, target, api_name="/explain")``.
"""

from __future__ import annotations

import html
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image

from ..errors import ExplainError
from ..io.render import data_uri
from ..models import ModelSpec
from ..models.loaders import load_named
from ..models.text_image import TextImageSpec
from ..targets import class_index
from .concept_panel import build_concepts
from .controls import ALPHA_STEP, CONTROLS, VIEW, Control
from .session import Explorer, Shown, View, bundled_photos, prompt_of
from .ui import gradio, on_model_thread, user_errors
from .words import build_words, word_menu

LOCAL = "127.0.0.1"
MAX_FILE_SIZE = "100mb"  # an upload larger than this is refused before it is read
SHOWN_FORMAT = "JPEG"  # how the page gets an overlay's layers: a tenth of PNG's encoding time; downloads are PNG


def stacked(shown: Shown, alpha: float, colormap: str, index: int | None = None) -> str:
    """A shown map as the page draws it: its two layers (see :meth:`Shown.layers`) stacked, inline as JPEG, the
    heat layer (class ``heat``) at opacity ``alpha``. The browser blends them as :meth:`Shown.picture` does, so
    that moving the alpha slider changes one style in the page and asks the server nothing."""
    base, heat = shown.layers(colormap, index)
    text = html.escape(f"{shown.entry.class_name}: {shown.view.method}")
    layers = f'<img class="base" src="{data_uri(base, SHOWN_FORMAT)}" alt="{text}" style="display:block;width:100%">'
    if heat is not None:
        layers += (
            f'<img class="heat" src="{data_uri(heat, SHOWN_FORMAT)}" alt="" '
            f'style="position:absolute;top:0;left:0;width:100%;opacity:{alpha}">'
        )
    return f'<div style="position:relative;max-width:{base.shape[1]}px">{layers}</div>'


# Set the heat layers' opacity in the page: what the alpha slider does, without the server.
OPACITY = """(alpha) => {
  document.querySelectorAll("#overlay img.heat, #overlay_b img.heat").forEach((img) => { img.style.opacity = alpha; });
}"""


class App:
    """The app's state: one model's explorer at a time, and the handlers the page calls.

    Args:
        spec: The model to start with: any that :func:`explain.models.loaders.load_named` loads.
        load: Builds another model by name (for the endpoint's ``model``); the old one is dropped first.
    """

    def __init__(self, spec: ModelSpec | TextImageSpec, load: Callable[[str], ModelSpec | TextImageSpec]) -> None:
        self.explorer = Explorer(spec)
        self.load = load
        self.downloads = Path(tempfile.mkdtemp(prefix="explain-app-"))
        self._switch = threading.Lock()
        if spec.preprocessing.kind.picture:
            for path in bundled_photos():
                self.explorer.add(path)

    def explorer_for(self, model: str) -> Explorer:
        """The explorer of the named model (empty: the current one), one model in memory. Photos are kept from
        one image model to the next; a model of another input starts without."""
        with self._switch:
            if model and model != self.explorer.spec.name:
                photos = list(self.explorer.photos.values())
                self.explorer = None  # type: ignore[assignment]  # the old model goes before the new one loads
                self.explorer = Explorer(self.load(model))
                if self.explorer.spec.preprocessing.kind.picture:
                    for photo in photos if photos and photos[0].kind.picture else []:
                        self.explorer.add(photo.image, photo.name)
            return self.explorer

    def target(self, text: str) -> int | None:
        """A typed target: a class name or number for a classifier, an entry's number for a detector or a
        segmenter; empty: the top one."""
        text = text.strip().lstrip("#")
        if not text:
            return None
        spec = self.explorer.spec
        if self.explorer.task.classifies:
            return class_index(int(text) if text.isdigit() else text, spec.labels, len(spec.labels))
        if not text.isdigit():
            raise ExplainError(
                f"target {text!r}: a {self.explorer.task.name} model's targets are its entries' numbers, #0, #1, ..."
            )
        return int(text)

    def add(self, files: list[str] | None) -> tuple[Any, str]:
        """Uploaded files as photos: the photo menu, the last one chosen, and the problems of those that are no
        images (each one line, naming its file; the others are kept)."""
        gr = gradio()
        added, problems = [], []
        for path in files or []:
            name = Path(path).name
            try:
                added.append(self.explorer.add(path, name).name)
            except ExplainError as err:
                problems.append(str(err).replace(str(path), name))
        if problems and not added:
            raise gr.Error("; ".join(problems), print_exception=False)
        for problem in problems:
            gr.Warning(problem)
        photos = list(self.explorer.photos)
        return gr.Dropdown(choices=photos, value=added[-1] if added else None), "\n".join(problems)

    def opened(self, photo: str) -> tuple[Any, ...]:
        """A photo's entries to click, its layers to pick from, the entries again for the compared overlay, the
        target (its first entry), the frame or slice drawn (None: the map's peak), the prompt and the pending
        corner (none), and the photo to click (hidden for a classifier, whose classes have no place)."""
        gr = gradio()
        layers = self.explorer.layer_menu(photo) if photo else []
        try:  # a promptable segmenter's entry is its prompt's mask: none until a click
            menu = self.explorer.entry_menu(photo) if photo and not self.explorer.task.prompts else []
        except ExplainError as err:  # no automatic layer, say: the layers are listed to pick one
            gr.Warning(str(err))
            menu = []
        first = menu[0][1] if menu else None
        return (
            gr.Radio(choices=menu, value=first),
            gr.Dropdown(choices=layers, value=[], multiselect=True),
            gr.Dropdown(choices=menu, value=first),
            first,
            None,
            [],
            None,
            self.clickable(photo, []),
        )

    def listed(self, photo: str, target: int | None, prompt: list[float] | None) -> Any:
        """The entries to click after a click on the photo: the same photo's (the clicked one chosen), or those of
        the new prompt."""
        if self.explorer.task.prompts and not prompt:  # a box's first corner: no mask yet
            return gradio().skip()
        view = View(prompt=tuple(prompt or ())) if prompt else None
        menu = [(entry.label, entry.index) for entry in self.explorer.entries(photo, view)]
        return gradio().Radio(choices=menu, value=target if target is not None else menu[0][1])

    def clickable(self, photo: str, prompt: list[float] | None) -> Any:
        """The photo to click (see :meth:`Explorer.clickable`), with the prompt drawn; hidden where nothing on it
        can be picked (a classifier, a clip, a scan, a signal)."""
        gr = gradio()
        if not photo or not self.explorer.task.click or not self.explorer.photos[photo].kind.picture:
            return gr.Image(value=None, visible=False)
        view = View(prompt=tuple(prompt or ()))
        return gr.Image(
            value=self.explorer.clickable(photo, view), visible=True, label=self.explorer.task.click_label
        )

    def clicked(
        self, photo: str, mode: str, corner: list[float] | None, target: int | None, prompt: list[float] | None,
        event: Any,
    ) -> tuple[Any, ...]:  # fmt: skip
        """A click at the photo's pixel ``event.index``: a promptable segmenter's point, or a corner of its box
        (``mode`` ``"box"``) or of a depth model's region (the first corner waits in ``corner`` for the second);
        else the entry there (a keypoint, a detection, a segment). Returns the target, the prompt, the pending
        corner and the photo to click, with what was clicked drawn on it."""
        x, y = (float(v) for v in event.index)
        task, prompt = self.explorer.task, list(prompt or [])
        if task.regions or (task.prompts and mode == "box"):
            if corner is None:  # the box's first corner, drawn as a point until the second
                return target, prompt, [x, y], self.clickable(photo, [x, y])
            prompt, corner = [min(corner[0], x), min(corner[1], y), max(corner[0], x), max(corner[1], y)], None
        elif task.prompts:
            prompt = [x, y]
        else:
            target = self.explorer.entry_at(photo, x, y)
        return target, prompt, None, self.clickable(photo, prompt)

    def view(
        self,
        method: str,
        layers: list[str] | None,
        target: int | None,
        fuse: str,
        aug: bool,
        eigen: bool,
        prompt: list[float] | None = None,
    ) -> View:
        """The view the controls describe (``prompt``: the point or box clicked on the photo, or none)."""
        options = (fuse or "mean", bool(aug), bool(eigen), tuple(float(v) for v in prompt or ()))
        return View(method or "gradcam", tuple(layers or ()), target, *options)

    def draw(
        self,
        photo: str,
        method: str,
        layers: list[str] | None,
        target: int | None,
        fuse: str,
        aug: bool,
        eigen: bool,
        prompt: list[float] | None,
        alpha: float,
        colormap: str,
        index: int | None,
    ) -> tuple[str, str, Any]:
        """The overlay of the view (its layers stacked, see :func:`stacked`), its caption, and the slider of a
        clip's frames or a scan's slices (hidden for a photo), set to the one drawn (``index``; None: the map's
        peak). The model runs only for a view not seen before."""
        gr = gradio()
        if not photo or (self.explorer.task.prompts and not prompt):  # nothing to explain until a click
            return "", self.explorer.task.click_label if photo else "", gr.Slider(visible=False)
        shown = self.explorer.show(photo, self.view(method, layers, target, fuse, aug, eigen, prompt))
        drawn = shown.peak if index is None else int(index)
        depth = shown.photo.depth
        slider = gr.Slider(
            minimum=0,
            maximum=max((depth or 1) - 1, 1),
            value=drawn or 0,
            step=1,
            visible=depth is not None,
            label=shown.photo.kind.unit or "frame",
        )
        return stacked(shown, alpha, colormap or "jet", drawn), self.caption(shown, drawn), slider

    def caption(self, shown: Shown, index: int | None = None) -> str:
        """What a shown map is: class, probability, method and layer, and a clip's frame or a scan's slice."""
        text = f"{shown.entry.label} · {shown.view.method} · layer {shown.layer}"
        if shown.photo.depth is None or index is None:
            return text
        peak = " (the peak)" if index == shown.peak else ""
        return f"{text} · {shown.photo.kind.unit} {index} of {shown.photo.depth}{peak}"

    def metrics(self, photo: str, *view: Any) -> tuple[Any, str]:
        """The faithfulness of the shown map: the deletion and insertion curves as a figure, and the values."""
        from matplotlib.figure import Figure

        shown = self.explorer.show(photo, self.view(*view))
        found = self.explorer.faithfulness(shown)
        fig = Figure(figsize=(6, 3), layout="constrained")
        axes = fig.add_subplot(1, 1, 1)
        for name, curve in (("deletion", found.deletion), ("insertion", found.insertion)):
            axes.plot([i / (len(curve) - 1) for i in range(len(curve))], curve, label=name)
        axes.set_xlabel("fraction of pixels removed (deletion) or inserted (insertion)")
        axes.set_ylabel(f"p({shown.entry.class_name})")
        axes.legend()
        text = (
            f"deletion AUC **{found.deletion_auc:.3f}** (lower is better) · insertion AUC "
            f"**{found.insertion_auc:.3f}** (higher is better) · Average Drop **{found.average_drop:.1f}%** · "
            f"sanity check: {shown.view.method} **{found.sanity}** (its map changes when the output block is random)"
        )
        return fig, text

    def save(self, photo: str, *controls: Any) -> list[str]:
        """The shown view's overlay, raw map and manifest record as files to download."""
        *view, alpha, colormap, index = controls
        shown = self.explorer.show(photo, self.view(*view))
        saved = self.explorer.save(shown, self.downloads, alpha, colormap or "jet", index)
        return [str(path) for path in saved]

    def explain_words(
        self, photo: str, question: str, answer: str, texts: str, method: str, alpha: float, colormap: str
    ) -> tuple[Any, Image.Image, str]:
        """A vision-language model's page: the photo explained (once per question), its words to click, the first
        one's map, and what was said."""
        request = self.explorer.reading(question, answer, texts, method, alpha=alpha, colormap=colormap)
        words, said = self.explorer.words(photo, request)
        told = said.get("answer") or ", ".join(said.get("texts", ()))
        caption = f"**{told}** · {request.method} at `{said['layer']}`"
        menu = gradio().Radio(choices=word_menu(words), value=0)
        return menu, self.explorer.word_picture(photo, request, 0), caption

    def show_word(
        self, photo: str, question: str, answer: str, texts: str, method: str, alpha: float, colormap: str, word: int
    ) -> Image.Image:
        """A clicked word's map, from the kept words."""
        request = self.explorer.reading(question, answer, texts, method, alpha=alpha, colormap=colormap)
        return self.explorer.word_picture(photo, request, int(word or 0))

    def explain(self, image: str, model: str, method: str, target: str) -> tuple[Image.Image, dict[str, float], str]:
        """The endpoint ``/explain``: one image's overlay, its top classes (or entries) with their probabilities,
        and the layer used. For a model of clips, scans or signals, ``image`` is such a file, drawn at the map's
        peak frame or slice. For a promptable segmenter or a depth model, ``target`` is the prompt or the region:
        ``x,y`` or ``x1,y1,x2,y2`` in the image's pixels."""
        explorer = self.explorer_for((model or "").strip())
        if not image:
            raise ExplainError("no image given")
        photo = explorer.add(image, Path(image).name)
        name = (method or "").strip() or "gradcam"
        if explorer.task.prompted:  # the target is where the model is prompted: x,y or x1,y1,x2,y2
            view = View(method=name, prompt=prompt_of(target or ""))
        else:
            view = View(method=name, target=self.target(target or ""))
        shown = explorer.show(photo.name, view)
        top = {
            entry.label if entry.box is not None or entry.region is not None else entry.class_name: entry.probability
            for entry in explorer.entries(photo.name, view if view.prompt else None)
        }
        return shown.picture(), top, shown.layer


def component(control: Control, explorer: Explorer) -> Any:
    """A control as the page's component (see :mod:`explain.explorer.controls`), its element id its name."""
    gr = gradio()
    options, value = control.options_for(explorer), control.value_for(explorer)
    common = {"label": control.label_for(explorer), "elem_id": control.name, "visible": control.shown_for(explorer)}
    if control.kind in ("menu", "menus", "search"):  # every menu filters its options as the user types
        return gr.Dropdown(choices=options, value=value, multiselect=control.kind == "menus", **common)
    if control.kind == "buttons":
        return gr.Radio(choices=options, value=value, **common)
    if control.kind == "check":
        return gr.Checkbox(value=value, **common)
    if control.kind == "slider":
        return gr.Slider(0.0, 1.0, value=value, step=ALPHA_STEP, **common)
    return gr.Slider(0, 1, value=value, step=1, **common)


def components(explorer: Explorer, groups: tuple[str, ...]) -> dict[str, Any]:
    """The components of the controls of these groups, by name, in their order."""
    return {control.name: component(control, explorer) for control in CONTROLS if control.group in groups}


def build(app: App) -> Any:
    """The page, as the model's task has it: photos and their entries on the left, the overlay and a second one to
    compare in the middle and on the right, the faithfulness metrics and the downloads below; for a task whose
    click picks a word, the words' page (:func:`explain.explorer.words.build_words`)."""
    gr = gradio()
    explorer = app.explorer
    if explorer.task.words:
        return build_words(app)
    with gr.Blocks(title=f"explain: {explorer.spec.name}") as page:
        gr.Markdown(f"### explain · {explorer.spec.name} ({explorer.task.name})")
        with gr.Row():
            with gr.Column(scale=1):
                files = gr.File(file_count="multiple", label="Images: drop, paste or click to upload", height=120)
                c = components(explorer, ("view", "style"))
                c["click"] = gr.Radio(
                    ["point", "box"], value="point", label="A click gives", elem_id="click",
                    visible=explorer.task.prompts,
                )  # fmt: skip
                c["picker"] = gr.Image(elem_id="picker", type="pil", interactive=False, visible=False)
            with gr.Column(scale=2):
                shown = [gr.HTML(elem_id="overlay"), gr.Markdown(elem_id="caption"), c["index"]]
            with gr.Column(scale=2):
                with gr.Row():
                    c.update(components(explorer, ("compare",)))
                shown_b = [gr.HTML(elem_id="overlay_b"), gr.Markdown()]
        with gr.Row():
            measure = gr.Button("Faithfulness of the overlay")
            download = gr.Button("Download overlay, map and record")
        curves, scores = gr.Plot(label="Deletion and insertion"), gr.Markdown()
        saved = gr.File(label="Files", file_count="multiple", interactive=False)
        if explorer.spec.preprocessing.kind.picture:
            build_concepts(app, c)
        problems = gr.Markdown(elem_id="problems")
        c["target"], c["drawn"] = gr.State(), gr.State()  # the entry explained; the frame or slice drawn
        c["prompt"], c["corner"] = gr.State([]), gr.State()  # the point or box clicked; a box's first corner
        view = [c[name] for name in VIEW]
        files.upload(user_errors(app.add), files, [c["photo"], problems])
        measure.click(user_errors(app.metrics), [c["photo"], *view], [curves, scores])
        download.click(user_errors(app.save), [c["photo"], *view, c["alpha"], c["colormap"], c["drawn"]], saved)
        wire(app, page, c, shown, shown_b)
        endpoint(app)
    return page


OWN_WIRING = ("photo", "entries", "typed", "index", "alpha")  # the controls :func:`wire` wires its own way


def wire(app: App, page: Any, c: dict[str, Any], shown: list[Any], shown_b: list[Any]) -> None:
    """The page's draws: each control draws again the overlays it names (see :mod:`explain.explorer.controls`);
    a clicked or typed entry, or a moved frame, is kept in one trip to the server; the alpha is set in the page;
    an opened photo lists its entries and layers and draws its first entry."""
    drawn = [c[name] for name in ("photo", *VIEW, "alpha", "colormap", "drawn")]
    drawn_b = [*drawn[:1], c["method_b"], c["layers"], c["target_b"], *drawn[4:]]
    draw, opened = user_errors(app.draw), user_errors(app.opened)
    live = {"trigger_mode": "always_last", "show_progress": "hidden", "queue": False}

    def draw_b(*controls: Any) -> tuple[Any, ...]:
        return draw(*controls)[:2]

    def picked(slot: int) -> Callable[..., tuple[Any, ...]]:
        """Draw with the value a user picked in the control at ``slot`` of ``drawn``, and keep it."""
        return lambda *controls: (*draw(*controls), controls[slot])

    def reopen(event: Any) -> None:
        """After a photo is opened, its first entry drawn, and compared."""
        event.then(draw, drawn, shown, show_progress="hidden")
        event.then(draw_b, drawn_b, shown_b, show_progress="hidden")

    chosen = [c["entries"], c["layers"], c["target_b"], c["target"], c["drawn"], c["prompt"], c["corner"], c["picker"]]
    reopen(c["photo"].change(opened, c["photo"], chosen))
    slots = {name: slot for slot, name in enumerate(("photo", *VIEW, "alpha", "colormap", "index"))}
    for name, kept in (("entries", "target"), ("typed", "target"), ("index", "drawn")):
        slot = slots["target" if kept == "target" else "index"]
        inputs = [*drawn[:slot], c[name], *drawn[slot + 1 :]]
        c[name].input(picked(slot), inputs, [*shown, c[kept]], **live)
    c["index"].input(draw_b, [*drawn_b[: slots["index"]], c["index"]], shown_b, **live)
    clicked = user_errors(app.clicked)
    clicked.__annotations__ = {"event": gradio().SelectData}  # Gradio hands the click's pixel to this argument
    where = [c["photo"], c["click"], c["corner"], c["target"], c["prompt"]]
    click = c["picker"].select(clicked, where, [c["target"], c["prompt"], c["corner"], c["picker"]])
    click.then(user_errors(app.listed), [c["photo"], c["target"], c["prompt"]], [c["entries"]])
    reopen(click)
    for control in CONTROLS:
        if control.name not in OWN_WIRING and "a" in control.redraws:
            c[control.name].change(draw, drawn, shown, **live)
        if control.name not in OWN_WIRING and "b" in control.redraws:
            c[control.name].change(draw_b, drawn_b, shown_b, **live)
    c["alpha"].change(None, c["alpha"], None, js=OPACITY)
    reopen(page.load(opened, c["photo"], chosen))


def endpoint(app: App) -> None:
    """The endpoint ``/explain`` (see :meth:`App.explain`), on fields the page hides."""
    gr = gradio()
    with gr.Row(visible=False):
        image = gr.File(type="filepath")
        model, method, target = gr.Textbox(), gr.Textbox(), gr.Textbox()
        overlay = gr.Image(type="pil", format="png")
        classes, layer = gr.Label(), gr.Textbox()
        call = gr.Button()
    call.click(user_errors(app.explain), [image, model, method, target], [overlay, classes, layer], api_name="explain")


def serve(
    model: str,
    weights: str | None = None,
    host: str = LOCAL,
    port: int = 7860,
    device: str = "cpu",
    quiet: bool = False,
) -> None:
    """Start the app and serve until interrupted.

    Args:
        model: The model's name (see :func:`explain.models.loaders.load_named`).
        weights: A checkpoint of it, or None.
        host: The address to listen on; anything but 127.0.0.1 lets others on the network use it (a warning says so).
        port: The port.
        device: Where the model runs.
        quiet: Print nothing but warnings.
    """
    spec = on_model_thread(load_named)(model, weights, device)  # the first torch calls there too
    launch(build(on_model_thread(App)(spec, lambda name: load_named(name, None, device))), host, port, quiet)


def launch(page: Any, host: str, port: int, quiet: bool) -> None:
    """Serve a page until interrupted, without web fonts (offline); a warning where others on the network can use
    it."""
    gr = gradio()
    if host != LOCAL:
        print(
            f"explain app: warning: listening on {host}: anyone who can reach this machine can use the app and "
            "its model",
            file=sys.stderr,
        )
    theme = gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["monospace"])  # no web fonts: offline
    page.launch(
        server_name=host, server_port=port, quiet=quiet, theme=theme, max_file_size=MAX_FILE_SIZE, footer_links=["api"]
    )
