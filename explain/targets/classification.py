"""Targets of one score per image: a classifier's class or its top K, a regression value, an embedding's
similarity to a reference."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import TargetError
from .base import BoundTarget, ClassScore, OutputPicker, Target, class_index, class_score, per_image


def _checked_2d(scores: Tensor, kind: str, output: Any) -> Tensor:
    if isinstance(getattr(output, "pred_boxes", None), Tensor):
        raise TargetError(
            f"the model returns object queries (logits {tuple(scores.shape)} and pred_boxes: a DETR-style detector), "
            f"not a classifier's (N, classes) scores that {kind} needs; wrap it in explain.models.QueryDetector and "
            "explain its detections with target=explain.targets.DetectionTarget()"
        )
    if scores.dim() == 4:
        raise TargetError(
            f"the model output is {tuple(scores.shape)}, not a classifier's (N, classes) scores that {kind} needs "
            "but a dense map of class scores (a segmenter's); explain its classes with "
            "target=explain.targets.SegmentationTarget() (every class that wins a pixel) or "
            "SegmentationTarget(classes=..., mask=...)"
        )
    if scores.dim() != 2:
        raise TargetError(
            f"the model output is {tuple(scores.shape)}, not a classifier's (N, classes) scores; "
            f"{kind} needs those (other outputs: RegressionTarget, SegmentationTarget, SimilarityTarget or a callable)"
        )
    return scores


class ClassTarget(Target):
    """A class of a classifier's (N, classes) output.

    Args:
        classes: A class index or name for all images, one per image, or None for each
            image's top-1 class.
        score: What is differentiated: the ``"logit"``, the softmax ``"probability"``,
            or the ``"sigmoid"`` of the logit (multi-label heads).
        output: See :class:`Target`.
    """

    keeps_k = False  # one class per image: results drop the K axis

    def __init__(self, classes: Any = None, score: ClassScore = "logit", *, output: OutputPicker = None) -> None:
        super().__init__(output)
        if score not in ("logit", "probability", "sigmoid"):
            raise TargetError(f"score must be 'logit', 'probability' or 'sigmoid', got {score!r}")
        self.classes = classes
        self.score = score

    def indices(self, scores: Tensor, labels: Sequence[str] | None) -> Tensor:
        """The (N, K) explained classes for the plain pass's (N, classes) scores."""
        n, num_classes = scores.shape
        if self.classes is None:
            return scores.argmax(dim=1, keepdim=True)
        chosen = [class_index(c, labels, num_classes) for c in per_image(self.classes, n, "targets")]
        return torch.tensor(chosen, device=scores.device)[:, None]

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        logits = _checked_2d(self.read(output), type(self).__name__, output).detach()
        indices = self.indices(logits, labels)
        probabilities = logits.float().sigmoid() if self.score == "sigmoid" else logits.float().softmax(dim=1)
        return BoundTarget(
            score=class_score(self.read, indices, self.score),
            classes=indices,
            probabilities=probabilities.gather(1, indices),
            keeps_k=self.keeps_k,
            read=self.read,
        )


class TopK(ClassTarget):
    """Each image's K highest-scoring classes, K maps per image.

    Args:
        k: How many classes.
        score: As for :class:`ClassTarget`.
        output: See :class:`Target`.
    """

    keeps_k = True

    def __init__(self, k: int, score: ClassScore = "logit", *, output: OutputPicker = None) -> None:
        super().__init__(None, score, output=output)
        self.k = k

    def indices(self, scores: Tensor, labels: Sequence[str] | None) -> Tensor:
        if not 1 <= self.k <= scores.shape[1]:
            raise TargetError(f"topk must be between 1 and {scores.shape[1]}")
        return scores.topk(self.k, dim=1).indices


class ClassesTarget(ClassTarget):
    """The same classes for every image, one map each, in the order given (prompts of a CLIP-style model, say).

    Args:
        classes: Class indices or names.
        score: As for :class:`ClassTarget`.
        output: See :class:`Target`.

    Raises:
        TargetError: No class given.
    """

    keeps_k = True

    def __init__(self, classes: Sequence[int | str], score: ClassScore = "logit", *, output: OutputPicker = None):
        super().__init__(None, score, output=output)
        self.each = list(classes)
        if not self.each:
            raise TargetError("ClassesTarget needs at least one class")

    def indices(self, scores: Tensor, labels: Sequence[str] | None) -> Tensor:
        chosen = [class_index(c, labels, scores.shape[1]) for c in self.each]
        return torch.tensor(chosen, device=scores.device).expand(len(scores), -1)


class RegressionTarget(Target):
    """A scalar output: (N,), (N, 1) or column ``index`` of (N, D). A one-logit binary classifier is one too.

    Args:
        index: The column of an (N, D) output.
        sign: +1 explains what raises the value, -1 what lowers it.
        output: See :class:`Target`.
    """

    def __init__(self, index: int = 0, sign: Literal[1, -1] = 1, *, output: OutputPicker = None) -> None:
        super().__init__(output)
        if sign not in (1, -1):
            raise TargetError(f"sign must be +1 or -1, got {sign!r}")
        self.index = index
        self.sign = sign

    def value(self, output: Any) -> Tensor:
        """The explained value of each row, signed: (rows,)."""
        values = self.read(output)
        if values.dim() == 1:
            return self.sign * values
        if values.dim() != 2 or not 0 <= self.index < values.shape[1]:
            shape = tuple(values.shape)
            raise TargetError(f"RegressionTarget(index={self.index}) needs an (N,) or (N, D) output, got {shape}")
        return self.sign * values[:, self.index]

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        self.value(output)  # checks the shape on the plain pass
        return BoundTarget(score=lambda out, images: self.value(out)[:, None])


class SimilarityTarget(Target):
    """The similarity of an embedding output (N, D) to a reference embedding.

    Args:
        reference: One embedding (D,) for all images, or one per image (N, D): another
            image's embedding, a text embedding (CLIP), a class prototype.
        metric: ``"cosine"`` or ``"dot"`` product.
        output: See :class:`Target`.
    """

    def __init__(self, reference: Tensor, metric: Literal["cosine", "dot"] = "cosine", *, output: OutputPicker = None):
        super().__init__(output)
        if metric not in ("cosine", "dot"):
            raise TargetError(f"metric must be 'cosine' or 'dot', got {metric!r}")
        self.reference = torch.as_tensor(reference)
        self.metric = metric

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        embeddings = self.read(output)
        if embeddings.dim() != 2 or self.reference.shape[-1] != embeddings.shape[1] or self.reference.dim() > 2:
            raise TargetError(
                f"SimilarityTarget compares (N, D) embeddings with a (D,) or (N, D) reference; "
                f"got embeddings {tuple(embeddings.shape)} and reference {tuple(self.reference.shape)}"
            )
        reference = self.reference.to(embeddings.device, embeddings.dtype)
        if reference.dim() == 1:
            reference = reference.expand(embeddings.shape[0], -1)
        elif reference.shape[0] != embeddings.shape[0]:
            raise TargetError(
                f"{reference.shape[0]} reference embeddings given for a batch of {embeddings.shape[0]} images; "
                "give one for all or one per image"
            )

        def score(out: Any, images: Tensor) -> Tensor:
            emb, ref = self.read(out), reference[images]
            similarity = F.cosine_similarity(emb, ref, dim=1) if self.metric == "cosine" else (emb * ref).sum(dim=1)
            return similarity[:, None]

        return BoundTarget(score=score)


class ContrastTarget(Target):
    r"""A class against the classes it is most easily taken for: Finer-CAM's score (Zhang et al., "Finer-CAM:
    Spotting the Difference Reveals Finer Details for Visual Explanation", CVPR 2025, arXiv:2501.11309).

    .. math:: S = \frac{\sum_j p_j\,(y_c - \alpha\, y_j)}{\sum_j p_j + 10^{-9}}

    over the comparison classes j, each weighed by its softmax probability :math:`p_j` (differentiated with the
    rest, as in the authors' code in pytorch-grad-cam). The map then shows what tells class c apart from them.

    Args:
        classes: The explained classes: a :class:`ClassTarget` or :class:`TopK`, or a class shorthand (None for
            each image's top class, an index or name, one per image).
        against: The comparison classes: one class or a list of classes for every image, or one list per image;
            None for each explained class's ``nearest`` look-alikes, the classes whose logits are closest to its.
        nearest: How many look-alikes when ``against`` is None.
        alpha: How strongly the comparison classes are subtracted; 0 leaves the class's own logit.
        output: See :class:`Target`.
    """

    def __init__(
        self,
        classes: Any = None,
        against: Any = None,
        nearest: int = 3,
        alpha: float = 1.0,
        *,
        output: OutputPicker = None,
    ) -> None:
        given = isinstance(classes, ClassTarget)
        super().__init__(classes.output if given and output is None else output)
        self.main = classes if given else ClassTarget(classes, output=output)
        if nearest < 1:
            raise TargetError(f"nearest must be at least 1, got {nearest}")
        self.against = against
        self.nearest = nearest
        self.alpha = alpha

    def comparisons(self, logits: Tensor, classes: Tensor, labels: Sequence[str] | None) -> Tensor:
        """The (N, K, M) comparison classes of the (N, K) explained ones."""
        n, num_classes = logits.shape
        if self.against is None:
            if num_classes <= self.nearest:
                raise TargetError(f"nearest={self.nearest} look-alikes need more than {self.nearest} classes")
            distance = (logits[:, None, :] - logits.gather(1, classes)[..., None]).abs()  # (N, K, classes)
            distance.scatter_(2, classes[..., None], float("inf"))  # never the class itself
            return distance.topk(self.nearest, dim=2, largest=False).indices
        shared = isinstance(self.against, (int, str)) or (
            isinstance(self.against, Sequence) and all(isinstance(c, (int, str)) for c in self.against)
        )
        per_image_lists = [self.against] * n if shared else per_image(self.against, n, "comparison class lists")
        rows = [
            [class_index(c, labels, num_classes) for c in ([g] if isinstance(g, (int, str)) else g)]
            for g in per_image_lists
        ]
        if len({len(r) for r in rows}) != 1 or not rows[0]:
            raise TargetError("give every image the same, non-zero number of comparison classes")
        chosen = torch.tensor(rows, device=logits.device)[:, None, :].expand(n, classes.shape[1], -1)
        if bool((chosen == classes[..., None]).any()):
            raise TargetError("a comparison class is the explained class itself")
        return chosen

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        bound = self.main.bind(output, labels)
        logits = self.read(output).detach()
        against = self.comparisons(logits, bound.classes, labels)
        read, classes, alpha = self.read, bound.classes, self.alpha

        def score(out: Any, images: Tensor) -> Tensor:
            y = read(out)
            theirs = against[images].flatten(1)  # (rows, K * M)
            p = y.softmax(dim=1).gather(1, theirs).view(against[images].shape)
            differences = y.gather(1, classes[images])[..., None] - alpha * y.gather(1, theirs).view(p.shape)
            return (p * differences).sum(dim=2) / (p.sum(dim=2) + 1e-9)

        return replace(bound, score=score)
