"""Look at a model's reasons without writing code: the explorer's state (``session.py``: one model, its photos,
their maps kept so that drawing them again runs no model) and its web app (``web.py``, with Gradio: ``explain
app``). The notebook explorer, :func:`explain.notebook.explore`, is the same state with ipywidgets."""

from .session import Entry, Explorer, Faithfulness, Photo, Shown, View, bundled_photos, method_choices

__all__ = ["Entry", "Explorer", "Faithfulness", "Photo", "Shown", "View", "bundled_photos", "method_choices"]
