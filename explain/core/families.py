"""Model families whose passes need handling of their own, registered once here as contexts the runner enters.

Two kinds:

- **What the picture was.** A detector's transform resizes and pads the batch onto a canvas (torchvision's
  detectors, YOLO's letterbox), and a transformer's patch embedding cuts it into a grid of patches: a pass records
  both (:func:`picture_recorded`), so that its maps are laid out on the grid and brought back onto the image.
- **Where the backward can be spared.** The partial backwards of :data:`FAMILIES`: an R-CNN's kept detections
  through their own proposals (:func:`explain.core.speedups.box_heads.sparse_box_heads`), a YOLO head's local branches
  over the windows a detection reads (:func:`explain.core.speedups.windows.windowed_heads`), a sequence model's
  position-wise layers and attention at the rows a score reaches
  (:func:`explain.core.speedups.rows.reached_rows`). Which
  families a model belongs to is asked once per model structure and kept in its context
  (:mod:`explain.core.context`); a pass enters only those.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from .detectors import canvas_recorded, is_rcnn
from .layouts import Geometry, grids_recorded
from .maps import Canvas
from .model_state import model_context, modules_of
from .speedups import enabled
from .speedups.box_heads import sparse_box_heads
from .speedups.rows import has_sequence_layers, reached_rows
from .speedups.windows import has_local_heads, windowed_heads


@dataclass(frozen=True)
class PassScope:
    """What a family's context needs to know of one pass.

    Attributes:
        hooked: The modules the pass's recorder hooks: a family leaves them as they run.
        sequences: The names of the modules whose output is a sequence (N, T, C), where known (else None: every
            sequence layer is looked at).
    """

    hooked: Collection[nn.Module] = ()
    sequences: Collection[str] | None = None


@dataclass(frozen=True)
class Family:
    """A kind of model whose passes spare part of the backward.

    Attributes:
        name: What the family is.
        speedup: The switch of its partial backward (see :mod:`explain.core.speedups`).
        member: Whether a model belongs to it, from what the model holds.
        context: The context around one pass of a member, from the model and the pass's scope.
    """

    name: str
    speedup: str
    member: Callable[[nn.Module, list[nn.Module]], bool]
    context: Callable[[nn.Module, PassScope], AbstractContextManager[Any]]


FAMILIES = (
    Family(
        "torchvision R-CNN",
        "box_heads",
        lambda model, modules: is_rcnn(model),
        lambda model, scope: sparse_box_heads(model),
    ),
    Family(
        "local heads (YOLO)",
        "windows",
        lambda model, modules: has_local_heads(model),
        lambda model, scope: windowed_heads(model, skip=scope.hooked),
    ),
    Family(
        "sequences (transformers)",
        "rows",
        lambda model, modules: has_sequence_layers(modules),
        lambda model, scope: reached_rows(model, skip=scope.hooked, sequences=scope.sequences),
    ),
)


def families_of(model: nn.Module) -> tuple[Family, ...]:
    """The families of :data:`FAMILIES` the model belongs to, asked once per model structure."""
    context = model_context(model)
    if context.families is None:
        modules = modules_of(model)
        context.families = tuple(family for family in FAMILIES if family.member(model, modules))
    return context.families


@contextmanager
def partial_backward(model: nn.Module, scope: PassScope) -> Iterator[None]:
    """For the block (one pass), each of the model's families whose speedup is on differentiates its part only
    where the score reaches."""
    with ExitStack() as stack:
        for family in families_of(model):
            if enabled(family.speedup):
                stack.enter_context(family.context(model, scope))
        yield


@dataclass
class Picture:
    """What a pass's forwards showed of the picture the model's layers saw: a detector's canvases and a patch
    embedding's grids, one per forward."""

    canvases: list[Canvas] = field(default_factory=list)
    grids: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def canvas(self) -> Canvas | None:
        """The last forward's canvas, or None for a model without one."""
        return self.canvases[-1] if self.canvases else None

    def geometry(self, x: Tensor) -> Geometry:
        """The picture of the last forward over ``x``: its canvas's size (else x's), and its patch grid."""
        canvas = self.canvas
        return Geometry(canvas.size if canvas else tuple(x.shape[2:]), self.grids[-1] if self.grids else None)


@contextmanager
def picture_recorded(model: nn.Module) -> Iterator[Picture]:
    """For the block, record the canvas and the patch grid of each of the model's forwards (see :class:`Picture`)."""
    with canvas_recorded(model) as canvases, grids_recorded(model) as grids:
        yield Picture(canvases, grids)
