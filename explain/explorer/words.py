"""The app's page for a vision-language model's task (its words, prompts or query boxes): a photo and a question
(or text prompts) on the left; the words to click and the clicked word's map on the right. The words of a photo
and question are computed once and kept by the :class:`explain.explorer.session.Explorer`: clicking another word
draws its map again without running the model.
"""

from __future__ import annotations

from typing import Any

from ..tasks.language import Word
from .ui import Page, gradio, user_errors


def word_menu(words: list[Word]) -> list[tuple[str, int]]:
    """The words as the page lists them to click: their place, text and score."""
    return [(f"{i} {word.text} ({word.score:.2f})", i) for i, word in enumerate(words)]


def build_words(app: Page) -> Any:
    """The page of a vision-language model: its photos, its question or text prompts, its method and style; the
    answer, its words to click and the clicked word's map."""
    from .controls import COLORMAPS
    from .session import method_choices

    gr, explorer = gradio(), app.explorer
    answers = getattr(explorer.task, "question", False)
    with gr.Blocks(title=f"explain: {explorer.spec.name}") as page:
        gr.Markdown(f"### explain · {explorer.spec.name} ({explorer.task.name} · {explorer.task.click_label})")
        with gr.Row():
            with gr.Column(scale=1):
                photos = list(explorer.photos)
                photo = gr.Dropdown(choices=photos, value=photos[0] if photos else None, label="Photo", elem_id="photo")
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
        go.click(user_errors(app.explain_words), fields, [words, shown, caption], api_name="explain_words")
        for control in (words, alpha, colormap):
            control.input(user_errors(app.show_word), [*fields, words], shown, api_name=False)
    return page
