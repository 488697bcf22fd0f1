"""What to explain: target objects that turn a model's output into the scores whose gradients are explained.

A target is bound once per call, on the plain forward pass, into a :class:`BoundTarget`: what
depends on that pass (each image's top class, a segmentation mask) is fixed there, and the
bound target then scores any batch of outputs the call produces (augmented and noisy passes,
the perturbed copies of Score-CAM and Ablation-CAM) as (rows, K) scores, K explained targets
per image. Ints, class names, sequences and callables are shorthand for the objects
(:func:`as_target`).

Batch rule: a per-image value (class, mask, reference embedding) is given once for all images
or exactly once per image; any other count is an error naming both counts.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor

from ..errors import TargetError

OutputPicker = str | int | Callable[[Any], Tensor] | None
ClassScore = Literal["logit", "probability", "sigmoid"]


def spatial_axes(t: Tensor) -> tuple[int, ...]:
    """The spatial axes of a per-channel tensor (N, C, *spatial), every axis after the first two: a dense output's
    (N, classes, *spatial), a layer's map (N, C, *spatial). One for a signal, two for an image, three for a volume
    or a clip."""
    return tuple(range(2, t.dim()))


def read_output(output: Any, pick: OutputPicker = None) -> Tensor:
    """The tensor of scores in a model output.

    Args:
        output: The model output: a tensor; an object with ``.logits`` (HuggingFace);
            a dict (its ``"logits"`` or ``"out"`` entry, or its only tensor); a tuple or
            list (its first tensor).
        pick: Where the scores are when that is ambiguous: a key or attribute name,
            an index into a tuple, or a callable of the output.

    Raises:
        TargetError: The scores cannot be found; the message names the keys or fields found.
    """
    if callable(pick):
        return pick(output)
    if pick is not None:
        found = output[pick] if isinstance(output, Mapping | Sequence) else getattr(output, str(pick), None)
        if not isinstance(found, Tensor):
            raise TargetError(f"output={pick!r} gives a {type(found).__name__}, not a tensor of scores")
        return found
    if isinstance(output, Tensor):
        return output
    if isinstance(getattr(output, "logits", None), Tensor):
        return output.logits
    if isinstance(output, Mapping):
        tensors = [key for key, value in output.items() if isinstance(value, Tensor)]
        named = [key for key in ("logits", "out") if key in tensors]
        if named or len(tensors) == 1:
            return output[(named or tensors)[0]]
        keys = ", ".join(map(repr, output))
        raise TargetError(f"the model returns a dict with keys {keys}; pick the scores with output=KEY or a callable")
    if isinstance(output, Sequence) and any(isinstance(value, Tensor) for value in output):
        return next(value for value in output if isinstance(value, Tensor))
    if isinstance(output, Sequence) and output and all(isinstance(d, Mapping) and "boxes" in d for d in output):
        raise TargetError(
            "the model returns detections (a dict of boxes, labels and scores per image), not scores of classes; "
            "explain its boxes with target=explain.targets.DetectionTarget() (every detection above its "
            "score_threshold) or DetectionTarget(boxes=..., labels=...)"
        )
    fields = ", ".join(name for name in vars(output) if not name.startswith("_")) if hasattr(output, "__dict__") else ""
    detail = f" with fields {fields}" if fields else ""
    raise TargetError(
        f"the model returns a {type(output).__name__}{detail}, without scores to read; "
        "pick them with output=NAME or a callable, or pass a callable target"
    )


def class_index(target: int | str | Tensor, labels: Sequence[str] | None, num_classes: int) -> int:
    """Resolve a class index or class name to an index checked against ``num_classes``.

    Names match exactly first, then case-insensitively.

    Raises:
        TargetError: The name is unknown (close names are suggested), no labels are
            known to resolve it, or the index is out of range.
    """
    if isinstance(target, str):
        if labels is None:
            raise TargetError(f"target {target!r} is a class name, but the model's labels are unknown; pass labels=")
        if target in labels:
            return list(labels).index(target)
        folded = [name.casefold() for name in labels]
        if target.casefold() in folded:
            return folded.index(target.casefold())
        close = difflib.get_close_matches(target, list(labels), n=5, cutoff=0.6)
        hint = f"; did you mean: {', '.join(close)}" if close else ""
        raise TargetError(f"unknown class name {target!r}{hint}")
    index = int(target)
    if not 0 <= index < num_classes:
        raise TargetError(f"class index {index} is out of range for a model with {num_classes} classes")
    return index


def per_image(values: Any, n: int, what: str) -> list[Any]:
    """One value for all ``n`` images, or a sequence of exactly one per image, as a list of ``n``.

    Raises:
        TargetError: A sequence of another length; the message names both counts.
    """
    single = isinstance(values, (str, numbers.Integral)) or (isinstance(values, Tensor) and values.dim() == 0)
    if single:
        return [values] * n
    values = list(values)
    if len(values) != n:
        raise TargetError(f"{len(values)} {what} given for a batch of {n} images; give one for all or one per image")
    return values


@dataclass(frozen=True)
class BoundTarget:
    """A target fixed on a call's plain pass.

    Attributes:
        score: ``score(output, images)``: the (rows, K) scores of any batch of model
            outputs whose row r stands for image ``images[r]`` of the call.
        classes: The explained class of each image and target, (N, K), or None.
        probabilities: Their probabilities on the plain pass (softmax, or sigmoid for
            ``score="sigmoid"``), (N, K), or None.
        keeps_k: Whether results keep the K axis when K is 1 (TopK does; one class per image does not).
        valid: Which of the (N, K) entries stand for a target, when images have different
            numbers of them (detections) and K is the largest; None: all.
        boxes: The explained boxes (x1, y1, x2, y2) in input pixels, (N, K, 4), or None.
        regions: The explained regions' weights at the output's resolution, (N, K, H, W), or None.
        read: For a classifier's classes, what reads the (rows, classes) scores in an output; None for any
            other target. Its ``classes`` then index the rows of the classifier's last linear layer, which CAM
            weighs channels with, and the classes can be scored anew (:meth:`rescored`).
        names: What ``classes`` index where it is not the model's labels (a pose model's keypoints), or None.
        points: The explained points (x, y) in input pixels, (N, K, 2) (a pose model's keypoints on the plain
            pass), or None.
        poses: For each explained point, its detection's whole pose on the plain pass: (N, K, J, 3), each of its J
            keypoints' x, y (input pixels) and visibility (the model's confidence, or 1), or None.
    """

    score: Callable[[Any, Tensor], Tensor]
    classes: Tensor | None = None
    probabilities: Tensor | None = None
    keeps_k: bool = False
    valid: Tensor | None = None
    boxes: Tensor | None = None
    regions: Tensor | None = None
    read: Callable[[Any], Tensor] | None = None
    names: Sequence[str] | None = None
    points: Tensor | None = None
    poses: Tensor | None = None

    def repeated(self, copies: int) -> BoundTarget:
        """The target of a batch in which each image comes ``copies`` times in a row: row r is image r // copies."""
        score = self.score

        def rows(values: Tensor | None) -> Tensor | None:
            return None if values is None else values.repeat_interleave(copies, dim=0)

        return replace(
            self, score=lambda output, images: score(output, images // copies), classes=rows(self.classes),
            probabilities=rows(self.probabilities), valid=rows(self.valid), boxes=rows(self.boxes),
            regions=rows(self.regions), points=rows(self.points), poses=rows(self.poses),
        )  # fmt: skip

    @property
    def classifier_rows(self) -> bool:
        """Whether ``classes`` are a classifier's classes, rows of its last linear layer."""
        return self.read is not None

    def rescored(self, score: ClassScore) -> BoundTarget:
        """The same classes scored by their ``score`` in any output: a metric's softmax probability, say.

        Raises:
            TargetError: The target is not a classifier's classes.
        """
        if self.read is None or self.classes is None:
            raise TargetError(f"only a classifier's classes can be scored by their {score}; this target is not one")
        return replace(self, score=class_score(self.read, self.classes, score))


def class_score(read: Callable[[Any], Tensor], classes: Tensor, score: ClassScore) -> Callable[[Any, Tensor], Tensor]:
    """The score function of classes (N, K) of a classifier: in an output whose row r stands for image
    ``images[r]``, each row's classes scored by their ``"logit"``, softmax ``"probability"`` or ``"sigmoid"``."""

    def scored(output: Any, images: Tensor) -> Tensor:
        scores = read(output)
        if score == "probability":
            scores = scores.softmax(dim=1)
        elif score == "sigmoid":
            scores = scores.sigmoid()
        return scores.gather(1, classes[images])

    return scored


class Target:
    """Base of the target objects: :meth:`bind` fixes a target on a call's plain output.

    Args:
        output: Where the scores are in a model output that is not a tensor (see
            :func:`read_output`); default: found automatically when unambiguous.
    """

    geometric = False  # fixed on the plain pass's pixels: flips and rescaling would misplace it
    least_score: float | None = None  # the least detection score it explains: a detector's own filter must keep it

    def __init__(self, output: OutputPicker = None) -> None:
        self.output = output

    def read(self, output: Any) -> Tensor:
        """The scores tensor of a model output."""
        return read_output(output, self.output)

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        """Fix the target on the plain pass's output (N images)."""
        raise NotImplementedError

    def from_logits(self) -> Target:
        """The target scored by the model's own output, before any normalization of its own (where a relevance
        propagation starts: the score's relevance is the output's); by default it is already."""
        return self


def ragged(per_image_values: Sequence[Tensor], fill: float = 0) -> tuple[Tensor, Tensor]:
    """Stack per-image tensors (M_i, ...) into (N, K, ...), K the largest M_i, padded with ``fill``;
    returns it and the (N, K) mask of real entries."""
    k = max(len(values) for values in per_image_values)
    first = per_image_values[0]
    stacked = first.new_full((len(per_image_values), k, *first.shape[1:]), fill)
    valid = torch.zeros(len(per_image_values), k, dtype=torch.bool, device=first.device)
    for i, values in enumerate(per_image_values):
        stacked[i, : len(values)], valid[i, : len(values)] = values, True
    return stacked, valid


class CallableTarget(Target):
    """A function of the model output that returns one score per row, (rows,)."""

    def __init__(self, function: Callable[[Any], Tensor]) -> None:
        super().__init__(None)
        self.function = function

    def scores(self, output: Any) -> Tensor:
        values = self.function(output)
        if not isinstance(values, Tensor) or values.dim() != 1:
            raise TargetError("a callable target must return a tensor of one score per image, shape (N,)")
        return values[:, None]

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        self.scores(output)
        return BoundTarget(score=lambda out, images: self.scores(out))


TargetLike = Target | BoundTarget | int | str | Sequence[int | str] | Tensor | Callable[[Any], Tensor] | None


def bound_on(goal: Target | BoundTarget, output: Any, labels: Sequence[str] | None) -> BoundTarget:
    """``goal`` bound on a plain pass's output; a target bound already (by an earlier call) is kept as it is."""
    return goal if isinstance(goal, BoundTarget) else goal.bind(output, labels)
