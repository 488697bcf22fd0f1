"""The explorer's controls, declared once: the web app (:mod:`explain.explorer.web`) and the notebook
(:mod:`explain.notebook`) build each from its declaration here, in this order.

A control has a name (the notebook's key, the page's element id), a kind (how it is picked), its label, options
and value for a model's explorer, and which overlays its change draws again: the view's (``"a"``), the compared
one's (``"b"``), or both. A front end wires a few controls its own way (the photo opens a photo first; the web
page sets the alpha in the page itself, and keeps a clicked entry or a moved slider in one trip to the server);
every other control draws again the overlays it names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..catalog import FUSIONS
from .session import Explorer, method_choices

COLORMAPS = ("jet", "turbo", "viridis", "inferno", "magma", "gray")

Kind = Literal["menu", "menus", "buttons", "search", "check", "slider", "steps"]
"""How a control is picked: one of a menu, several of a menu, one of a row of buttons, a typed option, a check
box, a slider of values, a slider of steps (a clip's frames, a scan's slices)."""


def _classifier(explorer: Explorer) -> bool:
    return explorer.task.classifies


def _per_task(classifier: str, other: str) -> Callable[[Explorer], str]:
    """A label that names a classifier's classes, or another model's entries."""
    return lambda explorer: classifier if _classifier(explorer) else other


@dataclass(frozen=True)
class Control:
    """One control of the explorer.

    Attributes:
        name: Its name: the notebook's key for it, the page's element id.
        kind: How it is picked (see :data:`Kind`).
        label: Its label, or how a model's explorer words it.
        options: Its options for a model's explorer (None: filled when a photo opens).
        value: Its first value, or how a model's explorer gives it.
        redraws: The overlays its change draws again: ``"a"``, ``"b"`` or ``"ab"`` (``""``: none, the photo).
        shown: Whether a model's explorer shows it (None: always).
        group: Where it sits: with the ``"view"``, its ``"style"``, or the ``"compare"``d overlay.
    """

    name: str
    kind: Kind
    label: str | Callable[[Explorer], str]
    options: Callable[[Explorer], Sequence[Any]] | None = None
    value: Any | Callable[[Explorer], Any] = None
    redraws: str = "ab"
    shown: Callable[[Explorer], bool] | None = None
    group: Literal["view", "style", "compare"] = "view"

    def label_for(self, explorer: Explorer) -> str:
        """Its label for a model's explorer."""
        return self.label if isinstance(self.label, str) else self.label(explorer)

    def options_for(self, explorer: Explorer) -> list[Any]:
        """Its options for a model's explorer (empty until a photo opens, for those a photo fills)."""
        return list(self.options(explorer)) if self.options else []

    def value_for(self, explorer: Explorer) -> Any:
        """Its first value for a model's explorer."""
        return self.value(explorer) if callable(self.value) else self.value

    def shown_for(self, explorer: Explorer) -> bool:
        """Whether a model's explorer shows it."""
        return self.shown is None or self.shown(explorer)


def _photos(explorer: Explorer) -> list[str]:
    return list(explorer.photos)


def _first_photo(explorer: Explorer) -> str | None:
    return next(iter(explorer.photos), None)


def _classes(explorer: Explorer) -> list[tuple[str, int]]:
    return [(name, i) for i, name in enumerate(explorer.spec.labels)]


def _clips(explorer: Explorer) -> bool:
    return explorer.spec.preprocessing.kind.unit is not None


def step_label(explorer: Explorer) -> str:
    """What the steps slider moves through: a clip's frames or a scan's slices."""
    return explorer.spec.preprocessing.kind.unit or "frame"


CONTROLS = (
    Control("photo", "menu", "Photo", _photos, _first_photo, redraws=""),
    Control("entries", "buttons", _per_task("Top classes: click one to explain it", "Entries"), redraws="a"),
    Control("typed", "search", "Or type a class", _classes, redraws="a", shown=_classifier),
    Control("method", "menu", "Method", lambda explorer: method_choices(), "gradcam", redraws="a"),
    Control("layers", "menus", "Layers (none: the automatic one; several: fused)"),
    Control("fuse", "menu", "Fusion", lambda explorer: FUSIONS, "mean", group="style"),
    Control("colormap", "menu", "Colormap", lambda explorer: COLORMAPS, "jet", group="style"),
    Control("aug_smooth", "check", "aug smooth", value=False, group="style"),
    Control("eigen_smooth", "check", "eigen smooth", value=False, group="style"),
    Control("alpha", "slider", "Alpha", value=0.5, group="style"),
    Control("index", "steps", step_label, value=0, shown=_clips, group="style"),
    Control("method_b", "menu", "Compare: method", lambda explorer: method_choices(), "layercam", "b", group="compare"),
    Control("target_b", "menu", _per_task("Compare: class", "Compare: entry"), redraws="b", group="compare"),
)
"""Every control, in the order the front ends lay them out."""

VIEW = ("method", "layers", "target", "fuse", "aug_smooth", "eigen_smooth", "prompt")
"""The controls that make a view (see :class:`explain.explorer.session.View`), in its fields' order; ``target`` is
the entry clicked or typed, ``prompt`` the point or box clicked on the photo."""

ALPHA_STEP = 0.05  # the alpha slider's step, from 0 to 1
