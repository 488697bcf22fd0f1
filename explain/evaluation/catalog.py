"""The metrics ``explain evaluate`` runs, cheapest first: what each costs, which way is better, whether it needs the
objects' masks, and how it scores one image's map."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from .. import metrics
from ..errors import ExplainError
from ..tasks.base import Task


@dataclass(frozen=True)
class Scene:
    """What a metric reads of one image: the model, the image (1, C, H, W), its map (1, H, W), what the map
    explains (a classifier's class (1,), or a detector's or segmenter's target object, scored by its own score),
    the object's mask (1, H, W) or None, and the method that made the map (to explain copies)."""

    model: Any
    x: Tensor
    maps: Tensor
    target: Any
    mask: Tensor | None
    method: Any

    @property
    def scored(self) -> dict[str, Any]:
        """The score option of the model-based metrics: their default for a class, the target's own otherwise."""
        return {} if isinstance(self.target, Tensor) else {"score": "target"}


@dataclass(frozen=True)
class EvalMetric:
    """One metric of the evaluation.

    Attributes:
        name: Its name (``--metrics``).
        cost: About how many forwards it runs per image: the order they run in, cheapest first.
        better: Whether ``"higher"`` or ``"lower"`` values are better.
        needs_masks: Whether it needs the objects' masks.
        classes_only: Whether it reads a classifier's classes (another class, the logits, the predicted class of
            copies): not for a detector or a segmenter.
        score: Its value for one image, or for a curve metric (deletion, insertion) the curve, whose AUC is the
            value.
    """

    name: str
    cost: int
    better: Literal["higher", "lower"]
    needs_masks: bool
    score: Callable[[Scene], Tensor | metrics.CurveResult]
    classes_only: bool = False


def _subset(scene: Scene) -> int:
    """Faithfulness correlation's subset: 224 of 224 x 224 pixels (Bhatt et al.'s), in proportion."""
    return max(1, round(224 / 224**2 * scene.x.shape[-1] * scene.x.shape[-2]))


def _sixteenth(scene: Scene) -> int:
    """Monotonicity correlation's group: a sixteenth of the image's pixels, so that it runs 16 groups."""
    return max(1, -(-scene.x.shape[-1] * scene.x.shape[-2] // 16))


CATALOG = (
    EvalMetric("sparseness", 0, "higher", False, lambda s: metrics.sparseness(s.maps)),
    EvalMetric("relevance_mass_accuracy", 0, "higher", True,
               lambda s: metrics.relevance_mass_accuracy(s.maps, s.mask, s.x.shape[-2:])),
    EvalMetric("pointing_game", 0, "higher", True,
               lambda s: metrics.pointing_game(s.maps, s.mask, s.x.shape[-2:]).float()),
    EvalMetric("average_drop", 1, "lower", False,
               lambda s: metrics.average_drop(s.model, s.x, s.maps, s.target, **s.scored).value),
    EvalMetric("random_logit", 1, "lower", False, lambda s: metrics.random_logit(s.method, s.x, s.target, seed=None),
               classes_only=True),
    EvalMetric("relative_input_stability", 20, "lower", False,
               lambda s: metrics.relative_input_stability(s.method, s.x, s.target, samples=20, seed=None),
               classes_only=True),
    EvalMetric("relative_output_stability", 20, "lower", False,
               lambda s: metrics.relative_output_stability(s.method, s.x, s.target, samples=20, seed=None),
               classes_only=True),
    EvalMetric("continuity", 28, "lower", False, lambda s: metrics.continuity(s.method, s.x, s.target),
               classes_only=True),
    EvalMetric("deletion", 50, "lower", False,
               lambda s: metrics.deletion(s.model, s.x, s.maps, s.target, **s.scored)),
    EvalMetric("insertion", 50, "higher", False,
               lambda s: metrics.insertion(s.model, s.x, s.maps, s.target, **s.scored)),
    EvalMetric("irof", 100, "higher", False,
               lambda s: metrics.irof(s.model, s.x, s.maps, s.target, **s.scored).aoc),
    EvalMetric("faithfulness_correlation", 100, "higher", False,
               lambda s: metrics.faithfulness_correlation(s.model, s.x, s.maps, s.target, subset_size=_subset(s),
                                                          **s.scored)),
    EvalMetric("monotonicity_correlation", 160, "higher", False,
               lambda s: metrics.monotonicity_correlation(s.model, s.x, s.maps, s.target, samples=10, seed=None,
                                                          features_in_step=_sixteenth(s), **s.scored)),
    EvalMetric("avg_sensitivity", 200, "lower", False,
               lambda s: metrics.avg_sensitivity(s.method, s.x, s.target)),
)  # fmt: skip
"""Every metric ``explain evaluate`` runs, cheapest first."""

DEFAULT_METRICS = ("sparseness", "relevance_mass_accuracy", "pointing_game", "deletion", "insertion",
                   "faithfulness_correlation")  # fmt: skip


def chosen_metrics(names: list[str] | None, masks: bool, task: Task | None = None) -> list[EvalMetric]:
    """The metrics named (None: the defaults, those needing masks only where masks are given), cheapest first.

    Raises:
        ExplainError: An unknown name, a metric needing masks without them, or one of a classifier's classes for
            a detector or a segmenter.
    """
    by_name = {metric.name: metric for metric in CATALOG}
    unknown = [name for name in names or () if name not in by_name]
    if unknown:
        raise ExplainError(f"unknown metric {unknown[0]!r}: explain evaluate runs {', '.join(by_name)}")
    if names is None:
        names = [name for name in DEFAULT_METRICS if masks or not by_name[name].needs_masks]
    missing = [name for name in names if by_name[name].needs_masks and not masks]
    if missing:
        raise ExplainError(
            f"{missing[0]} scores a map against the object: give the objects' masks (--masks DIR) or boxes "
            "(--boxes FILE)"
        )
    of_classes = [name for name in names if by_name[name].classes_only and task is not None and not task.classifies]
    if of_classes:
        raise ExplainError(
            f"{of_classes[0]} reads a classifier's classes; the model is a {task.name} model: leave it out"
        )
    return sorted((by_name[name] for name in names), key=lambda metric: metric.cost)
