"""The explorer of a vision-language model: its photos, and for each photo and question the maps of every word of
the answer (or of every text prompt, or every box of the text queries), kept. Clicking another word draws its map
again without running the model; the web page is :func:`build_words`, served by ``explain app --model FOLDER``
(:func:`serve_words`).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..errors import ExplainError
from ..export.words import drawn, words_of_image
from ..io.images import load_image
from ..models.text_image import TextImageSpec
from ..tasks.language import Word, WordsRequest
from ..tasks.registry import words_task_of
from .session import bundled_photos, unique_name

KEPT = 16  # the questions whose words are kept, the oldest dropped first


class WordsExplorer:
    """One vision-language model, the photos given to it, and their words' maps, kept.

    Args:
        spec: The model and its processor (see :func:`explain.models.text_image.load_text_image_model`).
    """

    def __init__(self, spec: TextImageSpec) -> None:
        self.spec = spec
        self.task = words_task_of(spec)
        self.photos: dict[str, Image.Image] = {}
        self._digests: dict[str, str] = {}
        self._kept: OrderedDict[tuple[Any, ...], tuple[list[Word], dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, source: str | Path | Image.Image, name: str | None = None) -> str:
        """Take a photo (a file, read as :func:`explain.load_image` reads it, or a PIL image) and return its name:
        the same photo given twice is one, another under a taken name gets a suffix.

        Raises:
            ImageLoadError: A file that is no readable image (its message names the file).
        """
        image = source.convert("RGB") if isinstance(source, Image.Image) else load_image(source)
        name = name or (Path(source).name if isinstance(source, (str, Path)) else "image")
        digest = hashlib.sha256(np.asarray(image).tobytes() + repr(image.size).encode()).hexdigest()
        with self._lock:
            if digest not in self._digests:
                self._digests[digest] = unique_name(name, self.photos)
                self.photos[self._digests[digest]] = image
            return self._digests[digest]

    def request(self, question: str, answer: str, texts: str, method: str, **options: Any) -> WordsRequest:
        """What the page's fields ask: a question (and an answer to explain instead of the model's own) of a model
        that answers; comma-separated text prompts or queries of another.

        Raises:
            ExplainError: The field the model reads is empty.
        """
        if self.task.question:
            if not question.strip():
                raise ExplainError(f"{self.spec.name} answers prompts: type a question")
            return WordsRequest(question.strip(), answer.strip() or None, (), method=method or "gradcam", **options)
        prompts = tuple(text.strip() for text in texts.split(",") if text.strip())
        if not prompts:
            raise ExplainError(f"{self.spec.name} reads text prompts: type them comma-separated, as 'a cat, a remote'")
        return WordsRequest(None, None, prompts, method=method or "gradcam", **options)

    def words(self, photo: str, request: WordsRequest) -> tuple[list[Word], dict[str, Any]]:
        """The photo's words with their maps and their record: computed once per photo and question (method,
        prompt, answer, texts), then kept; the style of a drawing (alpha, colormap) computes nothing.

        Raises:
            ExplainError: An unknown photo, or one the model cannot explain.
        """
        if photo not in self.photos:
            raise ExplainError(f"no photo {photo!r}: add it first")
        key = (photo, request.prompt, request.answer, tuple(request.texts), request.max_new_tokens, request.method,
               request.score_threshold)  # fmt: skip
        with self._lock:
            if key not in self._kept:
                self._kept[key] = words_of_image(self.spec, self.photos[photo], request)
                while len(self._kept) > KEPT:
                    self._kept.popitem(last=False)
            self._kept.move_to_end(key)
            return self._kept[key]

    def picture(self, photo: str, request: WordsRequest, index: int) -> Image.Image:
        """The map of the photo's word ``index`` drawn on it in the request's style (its box drawn too).

        Raises:
            ExplainError: No such word.
        """
        words, _ = self.words(photo, request)
        if not 0 <= index < len(words):
            raise ExplainError(f"no word {index}: the photo has {len(words)}")
        return drawn(self.photos[photo], words[index], request.alpha, request.colormap)


def word_menu(words: list[Word]) -> list[tuple[str, int]]:
    """The words as the page lists them to click: their place, text and score."""
    return [(f"{i} {word.text} ({word.score:.2f})", i) for i, word in enumerate(words)]


class WordsApp:
    """The page's handlers over one :class:`WordsExplorer`, the bundled photos added."""

    def __init__(self, spec: TextImageSpec) -> None:
        self.explorer = WordsExplorer(spec)
        for path in bundled_photos():
            self.explorer.add(path)

    def explain(
        self, photo: str, question: str, answer: str, texts: str, method: str, alpha: float, colormap: str
    ) -> tuple[Any, Image.Image, str]:
        """Explain the photo (once per question): its words to click, the first one's map, and the answer."""
        from .web import gradio

        request = self.explorer.request(question, answer, texts, method, alpha=alpha, colormap=colormap)
        words, record = self.explorer.words(photo, request)
        said = record.get("answer") or ", ".join(record.get("texts", ()))
        caption = f"**{said}** · {request.method} at `{record['layer']}`"
        return gradio().Radio(choices=word_menu(words), value=0), self.explorer.picture(photo, request, 0), caption

    def show(
        self, photo: str, question: str, answer: str, texts: str, method: str, alpha: float, colormap: str, word: int
    ) -> Image.Image:
        """A clicked word's map, from the kept words."""
        request = self.explorer.request(question, answer, texts, method, alpha=alpha, colormap=colormap)
        return self.explorer.picture(photo, request, int(word or 0))


def build_words(app: WordsApp) -> Any:
    """The page of a vision-language model: a photo and a question (or text prompts) on the left; the answer's
    words to click and the clicked word's map on the right."""
    from .controls import COLORMAPS
    from .session import method_choices
    from .web import gradio, user_errors

    gr, spec = gradio(), app.explorer.spec
    answers = app.explorer.task.question
    with gr.Blocks(title=f"explain: {spec.name}") as page:
        kind = app.explorer.task.name
        gr.Markdown(f"### explain · {spec.name} ({kind} · click a word to see where the model looked)")
        with gr.Row():
            with gr.Column(scale=1):
                photos = list(app.explorer.photos)
                photo = gr.Dropdown(choices=photos, value=photos[0], label="Photo", elem_id="photo")
                question = gr.Textbox(label="Question", visible=answers, elem_id="question")
                answer = gr.Textbox(label="Answer to explain (empty: the model's own)", visible=answers)
                texts = gr.Textbox(label="Text prompts, comma-separated", visible=not answers, elem_id="texts")
                method = gr.Dropdown(choices=method_choices(), value="gradcam", label="Method")
                alpha = gr.Slider(0.0, 1.0, value=0.5, step=0.05, label="Alpha")
                colormap = gr.Dropdown(choices=list(COLORMAPS), value="jet", label="Colormap")
                go = gr.Button("Explain", variant="primary", elem_id="explain")
            with gr.Column(scale=2):
                caption = gr.Markdown(elem_id="caption")
                words = gr.Radio(label="Words: click one", elem_id="words")
                shown = gr.Image(type="pil", format="png", label="Its map", elem_id="overlay")
        fields = [photo, question, answer, texts, method, alpha, colormap]
        go.click(user_errors(app.explain), fields, [words, shown, caption], api_name="explain_words")
        for control in (words, alpha, colormap):
            control.input(user_errors(app.show), [*fields, words], shown, api_name=False)
    return page


def serve_words(folder: str, host: str, port: int, device: str, quiet: bool) -> None:
    """Serve a vision-language model's words' page (``explain app --model FOLDER``) until interrupted."""
    from ..models.text_image import load_text_image_model
    from .web import launch, on_model_thread

    spec = on_model_thread(load_text_image_model)(folder, device)  # the first torch calls there too
    launch(build_words(on_model_thread(WordsApp)(spec)), host, port, quiet)
