"""What every model-based metric shares: the explained score of each image, bound once on the plain input, and
that score in perturbed copies of the images, run through the model in chunks on the input's device."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..core.engine import check_images
from ..core.held import held_model, in_model_dtype
from ..core.maps import upsample
from ..core.model_state import running, untouched
from ..core.speedups.folding import ScoringForwards
from ..errors import ExplainError, TargetError
from ..targets import BoundTarget, ClassTarget, Target, TargetLike, TopK, as_target, bound_on

MetricScore = Literal["probability", "logit", "target"]


@contextmanager
def plain_forwards(model: nn.Module) -> Any:
    """For the block, forwards without autograd that leave the model as they found it (flags and buffers)."""
    with untouched(model), torch.no_grad(), running(model):
        yield


def _bound_metric_target(goal: Target | BoundTarget, output: Any, metric: str, score: MetricScore) -> BoundTarget:
    """The target bound on the plain output, scoring each image's explained class by ``score`` (or, for
    ``"target"``, by the target's own score)."""
    if score == "target":
        return bound_on(goal, output, None)
    if isinstance(goal, BoundTarget):
        if not goal.classifier_rows:
            raise TargetError(
                f"{metric} scores a classifier's class by its {score}; this target is not a class: "
                "pass score='target' to use the target's own score"
            )
        bound = goal
    elif isinstance(goal, ClassTarget) and not isinstance(goal, TopK):
        bound = goal.bind(output, None)
    else:
        kind = "TopK" if isinstance(goal, TopK) else type(goal).__name__
        raise TargetError(
            f"{metric} scores one class per image by its {score}; a {kind} is not that: pass one class per image, "
            "or score='target' to use a target's own score"
        )
    if bound.classes.shape[1] != 1:
        raise TargetError(
            f"{metric} takes one map and one class per image; the target has {bound.classes.shape[1]}: "
            "pass maps[:, k] with target=result.target.classes[:, k]"
        )
    return bound.rescored(score)


@dataclass(frozen=True)
class Scorer:
    """The explained score of a call's N images, and of perturbed copies of them.

    Built once for a batch (:func:`scorer`), one scorer serves every metric of the batch's maps.

    Attributes:
        model: The model, run as it is (its mode kept) without autograd, each input cast to its dtype (see
            :func:`explain.core.held.in_model_dtype`); a compiled one's own module.
        x: The plain images, (N, C, H, W).
        score: What the scores are: ``"probability"``, ``"logit"`` or ``"target"`` (see :func:`scorer`).
        forwards: Its forwards of the perturbed copies (:class:`explain.core.speedups.folding.ScoringForwards`).
        bound: The target bound on the plain images.
        original: The score of each plain image, (N,).
        batch_size: Most copies per forward.
        model_kwargs: Further keyword arguments of every forward.
    """

    model: nn.Module
    x: Tensor
    score: MetricScore
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
                output = self.forwards(in_model_dtype(self.model, make(rows)), **self.model_kwargs)
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
    result's bound class target, rescored as it is). ``score="target"``: the target's own score, whatever the
    target. ``metric`` names the metric (or metrics) in error messages.

    Raises:
        ExplainError: ``x`` is not a float batch of images, or ``batch_size`` < 1.
        TargetError: The target does not fit the score (the message names the way out).
    """
    check_images(x)
    if score not in ("probability", "logit", "target"):
        raise ExplainError(f"score must be 'probability', 'logit' or 'target', got {score!r}")
    if batch_size < 1:
        raise ExplainError(f"batch_size must be >= 1, got {batch_size}")
    model, model_kwargs = held_model(model), dict(model_kwargs or {})
    forwards = ScoringForwards(model, x.device)
    with plain_forwards(model):
        output = forwards(in_model_dtype(model, x), **model_kwargs)
    bound = _bound_metric_target(as_target(target), output, metric, score)
    original = bound.score(output, torch.arange(len(x), device=x.device))
    if original.shape[1] != 1:
        raise TargetError(f"{metric} takes one target per image; the target has {original.shape[1]}")
    return Scorer(model, x, score, forwards, bound, original[:, 0].float(), batch_size, model_kwargs)


def input_maps(maps: Tensor, n: int, size: Sequence[int], metric: str) -> Tensor:
    """Maps (N, *spatial) at any resolution upsampled (linearly, bilinearly or trilinearly) to the input's
    spatial ``size``, float32.

    Raises:
        ExplainError: The maps are not one map per image, of the input's rank.
    """
    if not isinstance(maps, Tensor) or maps.dim() != len(size) + 1 or maps.shape[0] != n:
        shape = tuple(maps.shape) if isinstance(maps, Tensor) else type(maps).__name__
        axes = {1: "l", 2: "h, w", 3: "d, h, w"}[len(size)]
        raise ExplainError(
            f"{metric} takes one map per input, (N, {axes}) with N = {n}; got {shape} "
            "(a TopK result's maps[:, k]; a guided method's images reduced to one channel, e.g. .abs().amax(1))"
        )
    return upsample(maps.float(), size)
