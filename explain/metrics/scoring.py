"""What every model-based metric shares: the explained score of each image, bound once on the plain input, and
that score in perturbed copies of the images, run through the model in chunks on the input's device."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..engine import check_images
from ..errors import ExplainError, TargetError
from ..folding import ScoringForwards
from ..maps import upsample
from ..model_state import untouched
from ..targets import BoundAlready, BoundTarget, ClassTarget, TargetLike, TopK, as_target

MetricScore = Literal["probability", "logit", "target"]


@contextmanager
def plain_forwards(model: nn.Module) -> Any:
    """For the block, forwards without autograd that leave the model as they found it (flags and buffers)."""
    with untouched(model), torch.no_grad():
        yield


def _class_target(goal: Any, output: Any, metric: str, score: str) -> ClassTarget:
    """The class target that scores each image's explained class by ``score``, from a target or a bound target."""
    if isinstance(goal, BoundAlready):
        bound = goal.bound
        if not bound.classifier_rows:
            raise TargetError(
                f"{metric} scores a classifier's class by its {score}; this target is not a class: "
                "pass score='target' to use the target's own score"
            )
        classes = bound.classes
    elif isinstance(goal, ClassTarget) and not isinstance(goal, TopK):
        classes = goal.bind(output, None).classes
    else:
        kind = "TopK" if isinstance(goal, TopK) else type(goal).__name__
        raise TargetError(
            f"{metric} scores one class per image by its {score}; a {kind} is not that: pass one class per image, "
            "or score='target' to use a target's own score"
        )
    if classes.shape[1] != 1:
        raise TargetError(
            f"{metric} takes one map and one class per image; the target has {classes.shape[1]}: "
            "pass maps[:, k] with target=result.target.classes[:, k]"
        )
    return ClassTarget(classes[:, 0], score=score, output=getattr(goal, "output", None))


@dataclass(frozen=True)
class Scorer:
    """The explained score of a call's N images, and of perturbed copies of them.

    Attributes:
        model: The model, run as it is (its mode kept) without autograd.
        forwards: Its forwards of the perturbed copies (:class:`explain.folding.ScoringForwards`).
        bound: The target bound on the plain images.
        original: The score of each plain image, (N,).
        batch_size: Most copies per forward.
        model_kwargs: Further keyword arguments of every forward.
    """

    model: nn.Module
    forwards: ScoringForwards
    bound: BoundTarget
    original: Tensor
    batch_size: int
    model_kwargs: Mapping[str, Any]

    def copies(self, images: Tensor, make: Callable[[Tensor], Tensor]) -> Tensor:
        """The score of M copies, (M,): copy r stands for image ``images[r]``, and ``make(rows)`` builds the
        copies of the given rows (an index into the M), (len(rows), C, H, W); at most ``batch_size`` at a time."""
        scores = []
        with plain_forwards(self.model):
            for rows in torch.arange(len(images), device=images.device).split(self.batch_size):
                output = self.forwards(make(rows), **self.model_kwargs)
                scores.append(self.bound.score(output, images[rows])[:, 0].float())
        return torch.cat(scores) if scores else torch.zeros(0, device=images.device)


def scorer(
    model: nn.Module,
    x: Tensor,
    target: TargetLike,
    score: MetricScore,
    metric: str,
    batch_size: int,
    model_kwargs: Mapping[str, Any] | None,
) -> Scorer:
    """Bind the metric's target on the plain images' output, and score them.

    ``score="probability"`` or ``"logit"``: the explained class's softmax probability or logit; the target must
    be one class per image (None for the top class, an index or name, one per image, a ``ClassTarget``, or a
    result's bound class target). ``score="target"``: the target's own score, whatever the target.

    Raises:
        ExplainError: ``x`` is not a float batch of images, or ``batch_size`` < 1.
        TargetError: The target does not fit the score (the message names the way out).
    """
    check_images(x)
    if score not in ("probability", "logit", "target"):
        raise ExplainError(f"score must be 'probability', 'logit' or 'target', got {score!r}")
    if batch_size < 1:
        raise ExplainError(f"batch_size must be >= 1, got {batch_size}")
    model_kwargs = dict(model_kwargs or {})
    forwards = ScoringForwards(model, x.device)
    with plain_forwards(model):
        output = forwards(x, **model_kwargs)
    goal = as_target(target)
    if score != "target":
        goal = _class_target(goal, output, metric, score)
    bound = goal.bind(output, None)
    original = bound.score(output, torch.arange(len(x), device=x.device))
    if original.shape[1] != 1:
        raise TargetError(f"{metric} takes one target per image; the target has {original.shape[1]}")
    return Scorer(model, forwards, bound, original[:, 0].float(), batch_size, model_kwargs)


def input_maps(maps: Tensor, n: int, size: Sequence[int], metric: str) -> Tensor:
    """Maps (N, h, w) at any resolution upsampled (bilinearly) to the input's (H, W), float32.

    Raises:
        ExplainError: The maps are not one (h, w) map per image.
    """
    if not isinstance(maps, Tensor) or maps.dim() != 3 or maps.shape[0] != n:
        shape = tuple(maps.shape) if isinstance(maps, Tensor) else type(maps).__name__
        raise ExplainError(
            f"{metric} takes one map per image, (N, h, w) with N = {n}; got {shape} "
            "(a TopK result's maps[:, k]; a guided method's images reduced to one channel, e.g. .abs().amax(1))"
        )
    return upsample(maps.float(), size)
