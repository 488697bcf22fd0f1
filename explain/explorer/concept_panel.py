"""The app's concepts panel (see :mod:`explain.explorer.concepts`): find concepts in the photos at the view's
layer, pick one, and see where it lies in the open photo and the crops it describes best. A picked concept,
another photo, alpha or colormap draws the kept maps again without the model.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from .ui import Page, gradio, user_errors

MOST = 20  # the most concepts the panel finds


def found(
    app: Page, photo: str, layers: list[str] | None, count: float, alpha: float, colormap: str
) -> tuple[Any, ...]:
    """Concepts found in the app's photos at the view's first layer (none: the automatic one): the open photo's
    concepts to click, the first one's map (in the page's alpha and colormap) and best crops, and what was found."""
    layer = (layers or [None])[0]
    bank = app.explorer.concepts.find(layer, int(count))
    said = (
        f"**{bank.concepts} concepts** at `{bank.layer}`, from {len(bank.boxes)} crops of "
        f"{len(app.explorer.photos)} photos (reconstruction error {bank.error:.0%})"
    )
    return (*opened(app, photo, alpha, colormap), said)


def opened(app: Page, photo: str, alpha: float, colormap: str) -> tuple[Any, ...]:
    """The photo's concepts to click, the first one picked, its map and its best crops."""

    menu = listed(app, photo)
    first = menu[0][1] if menu else None
    return (gradio().Radio(choices=menu, value=first), *drawn(app, photo, first, alpha, colormap))


def listed(app: Page, photo: str) -> list[tuple[str, int]]:
    """The open photo's concepts as the panel lists them, the most present first; none before any are found."""
    concepts = app.explorer.concepts
    return [] if concepts.bank is None or not photo else [(e.label, e.index) for e in concepts.entries(photo)]


def drawn(app: Page, photo: str, concept: int | None, alpha: float, colormap: str) -> tuple[Any, list[Image.Image]]:
    """The concept's map on the photo and its best crops; nothing before concepts are found or one is picked."""
    concepts = app.explorer.concepts
    if concepts.bank is None or concept is None or not photo:
        return None, []
    picture = concepts.picture(photo, int(concept), float(alpha), colormap or "jet")
    return picture, concepts.best_crops(int(concept))


def build_concepts(app: Page, c: dict[str, Any]) -> None:
    """The panel, under the page's overlays, wired to the page's photo, layers, alpha and colormap."""

    gr = gradio()
    with gr.Accordion("Concepts: what the model sees (CRAFT)", open=False, elem_id="concepts_panel"):
        with gr.Row():
            count = gr.Slider(2, MOST, value=6, step=1, label="Concepts", elem_id="concept_count")
            find = gr.Button("Find concepts in the photos", elem_id="find_concepts")
        said = gr.Markdown(elem_id="concepts_found")
        with gr.Row():
            menu = gr.Radio(label="Concepts in this photo: click one", elem_id="concepts")
            picture = gr.Image(type="pil", format="png", label="Where it lies", elem_id="concept_map")
        crops = gr.Gallery(label="The crops it describes best", columns=6, height=140, elem_id="concept_crops")
    style = [c["alpha"], c["colormap"]]
    asked = [c["photo"], c["layers"], count, *style]
    find.click(user_errors(lambda *a: found(app, *a)), asked, [menu, picture, crops, said])
    draw = user_errors(lambda *a: drawn(app, *a))
    for control in (menu, *style):
        control.input(draw, [c["photo"], menu, *style], [picture, crops], show_progress="hidden")
    reopen = user_errors(lambda *a: opened(app, *a))
    c["photo"].change(reopen, [c["photo"], *style], [menu, picture, crops], show_progress="hidden")
