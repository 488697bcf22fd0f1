"""Targets of one score per image: a classifier's class or its top K, a regression value, an embedding's
similarity to a reference."""

from __future__ import annotations

from collections.abc import Sequence
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
