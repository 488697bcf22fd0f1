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
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import NothingToExplain, TargetError

OutputPicker = str | int | Callable[[Any], Tensor] | None
ClassScore = Literal["logit", "probability", "sigmoid"]


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
        classifier_rows: Whether ``classes`` index the rows of a classifier's last linear
            layer (class targets), which CAM weighs channels with.
    """

    score: Callable[[Any, Tensor], Tensor]
    classes: Tensor | None = None
    probabilities: Tensor | None = None
    keeps_k: bool = False
    valid: Tensor | None = None
    boxes: Tensor | None = None
    regions: Tensor | None = None
    classifier_rows: bool = False


class Target:
    """Base of the target objects: :meth:`bind` fixes a target on a call's plain output.

    Args:
        output: Where the scores are in a model output that is not a tensor (see
            :func:`read_output`); default: found automatically when unambiguous.
    """

    geometric = False  # fixed on the plain pass's pixels: flips and rescaling would misplace it

    def __init__(self, output: OutputPicker = None) -> None:
        self.output = output

    def read(self, output: Any) -> Tensor:
        """The scores tensor of a model output."""
        return read_output(output, self.output)

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        """Fix the target on the plain pass's output (N images)."""
        raise NotImplementedError


def _class_scores(scores: Tensor, score: ClassScore) -> Tensor:
    if score == "probability":
        return scores.softmax(dim=1)
    return scores.sigmoid() if score == "sigmoid" else scores


def _checked_2d(scores: Tensor, kind: str) -> Tensor:
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
        logits = _checked_2d(self.read(output), type(self).__name__).detach()
        indices = self.indices(logits, labels)
        probabilities = logits.float().sigmoid() if self.score == "sigmoid" else logits.float().softmax(dim=1)
        return BoundTarget(
            score=lambda out, images: _class_scores(self.read(out), self.score).gather(1, indices[images]),
            classes=indices,
            probabilities=probabilities.gather(1, indices),
            keeps_k=self.keeps_k,
            classifier_rows=True,
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


class SegmentationTarget(Target):
    """Classes of a dense output (N, classes, H, W): each class's logit summed over its region.

    Args:
        classes: A class index or name for all images, or one per image; None: every class
            that wins at least one pixel of an image's argmax, one map each (a K axis, as
            long as the image with the most classes; ``valid`` marks the real entries).
        mask: The region, (H, W) for all images or (N, H, W), boolean or weights; resized
            (nearest) to the output's size. Default: the pixels where the class wins
            the argmax on the plain pass. An empty region is an error (its map would be
            the gradient of a constant).
        background: A class never explained with ``classes=None`` (torchvision's
            segmenters: 0, ``__background__``).
        output: See :class:`Target` (torchvision's segmentation models return a dict
            whose ``"out"`` is read automatically).
    """

    geometric = True

    def __init__(
        self,
        classes: Any = None,
        mask: Tensor | None = None,
        *,
        background: int | None = None,
        output: OutputPicker = None,
    ) -> None:
        super().__init__(output)
        if classes is None and mask is not None:
            raise TargetError("a SegmentationTarget mask needs classes=: the class explained over it")
        self.classes, self.mask, self.background = classes, mask, background

    def given_mask(self, n: int, size: Sequence[int], like: Tensor) -> Tensor:
        """The given mask as (N, H, W) weights at the output's size."""
        mask = torch.as_tensor(self.mask, device=like.device).to(like.dtype)
        mask = mask[None].expand(n, -1, -1) if mask.dim() == 2 else mask
        if mask.dim() != 3 or mask.shape[0] != n:
            raise TargetError(f"a mask must be (H, W) or one per image (N, H, W) for {n} images, got {mask.shape}")
        return F.interpolate(mask[:, None], size=tuple(size), mode="nearest-exact")[:, 0]

    def chosen(self, logits: Tensor, labels: Sequence[str] | None) -> tuple[Tensor, Tensor]:
        """Each image's explained classes (N, K) and their regions (N, K, H, W) on the plain pass."""
        n, num_classes = logits.shape[:2]
        winners = logits.argmax(dim=1)
        if self.classes is None:
            won = torch.zeros(n, num_classes, dtype=torch.bool, device=logits.device)
            won.scatter_(1, winners.flatten(1), True)  # (N, classes): which classes win a pixel of each image
            if self.background is not None:
                won[:, self.background] = False
            if not won.any():
                raise NothingToExplain("no class but the background wins a pixel")
            index = torch.arange(num_classes, device=logits.device).expand(n, -1)
            ranked = torch.where(won, index, num_classes).sort(dim=1).values[:, : int(won.sum(dim=1).max())]
            classes = torch.where(ranked < num_classes, ranked, -1)  # each image's classes in order, then -1
        else:
            chosen = [class_index(c, labels, num_classes) for c in per_image(self.classes, n, "classes")]
            classes = torch.tensor(chosen, device=logits.device)[:, None]
        if self.mask is not None:
            regions = self.given_mask(n, logits.shape[-2:], logits)[:, None]
        else:
            regions = (winners[:, None] == classes[..., None, None]).to(logits.dtype)
        empty = (~regions[:, 0].flatten(1).ne(0).any(dim=1)).nonzero() if self.classes is not None else []
        if len(empty):
            i = int(empty[0])
            name = labels[classes[i, 0]] if labels else f"class {int(classes[i, 0])}"
            found = "the mask is empty" if self.mask is not None else f"{name} wins no pixel"
            raise NothingToExplain(found, i, f"give a mask= to explain {name} over a region")
        return classes, regions

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        logits = self.read(output)
        if logits.dim() != 4:
            raise TargetError(f"SegmentationTarget needs a dense (N, classes, H, W) output, got {tuple(logits.shape)}")
        classes, regions = self.chosen(logits.detach(), labels)
        valid = classes >= 0
        index = classes.clamp(min=0)[..., None, None]

        def score(out: Any, images: Tensor) -> Tensor:
            dense = self.read(out)
            if dense.shape[-2:] != regions.shape[-2:]:
                raise TargetError("the segmentation region is fixed at the plain pass's resolution, not this pass's")
            picked = dense.gather(1, index[images].expand(-1, -1, *dense.shape[-2:]))
            return (picked * regions[images]).sum(dim=(-2, -1)) * valid[images]

        probabilities = logits.detach().float().softmax(dim=1).gather(1, index.expand(-1, -1, *logits.shape[-2:]))
        area = regions.sum(dim=(-2, -1))
        return BoundTarget(
            score=score,
            classes=classes,
            probabilities=(probabilities * regions).sum(dim=(-2, -1)) / area.clamp_min(1e-12) * valid,
            keeps_k=self.classes is None,
            valid=None if self.classes is not None else valid,
            regions=regions.expand(-1, classes.shape[1], -1, -1),
        )


def box_iou(a: Tensor, b: Tensor) -> Tensor:
    """Intersection over union of boxes (x1, y1, x2, y2): a (A, 4) and b (B, 4) give (A, B)."""
    low = torch.maximum(a[:, None, :2], b[None, :, :2])
    high = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    intersection = (high - low).clamp(min=0).prod(dim=-1)
    area_a, area_b = (a[:, 2:] - a[:, :2]).prod(dim=-1), (b[:, 2:] - b[:, :2]).prod(dim=-1)
    return intersection / (area_a[:, None] + area_b[None] - intersection).clamp_min(torch.finfo(a.dtype).tiny)


class DetectionTarget(Target):
    """Boxes of an object detector: torchvision's Faster R-CNN, RetinaNet, FCOS and SSD, whose output
    is a list of one dict per image with ``"boxes"`` (x1, y1, x2, y2 in input pixels), ``"labels"``
    and ``"scores"``.

    Each reference box is matched, in every output the call scores, to the detection of its label
    with the highest IoU, at least ``iou``; the matched detection's score is explained, and a box
    without a match in a perturbed or augmented pass scores 0. On the plain pass a given box without
    a match is an error that names it, never a map of zeros. One map per box: a K axis, as long as
    the image with the most boxes; ``valid`` marks the entries that are boxes.

    Args:
        boxes: Reference boxes, (M, 4) for every image or one (M_i, 4) per image; None
            explains every detection that scores at least ``score_threshold`` on the plain pass.
        labels: The reference boxes' labels, (M,) or one (M_i,) per image (indices, or
            names with ``labels=`` class names); with ``boxes=None``, only detections of these labels.
        iou: The least IoU of a match.
        score_threshold: With ``boxes=None``, the least score of an explained detection.
        output: Where the list of detections is in the output (see :class:`Target`).
    """

    geometric = True

    def __init__(
        self,
        boxes: Tensor | Sequence[Tensor] | None = None,
        labels: Any = None,
        iou: float = 0.5,
        score_threshold: float = 0.5,
        *,
        output: OutputPicker = None,
    ) -> None:
        super().__init__(output)
        if boxes is not None and labels is None:
            raise TargetError("DetectionTarget matches boxes by label: give labels= with boxes=")
        self.boxes, self.labels, self.iou, self.score_threshold = boxes, labels, iou, score_threshold

    def detections(self, output: Any) -> list[Mapping[str, Tensor]]:
        """The per-image dicts of boxes, labels and scores in a model output."""
        found = output if self.output is None else read_output(output, self.output)
        fields = ("boxes", "labels", "scores")
        if not isinstance(found, Sequence) or not all(isinstance(d, Mapping) and set(fields) <= set(d) for d in found):
            raise TargetError(
                f"DetectionTarget reads a list of one dict per image with {', '.join(fields)} "
                f"(torchvision's detectors in eval mode); the model returns a {type(found).__name__}"
            )
        return found

    def references(self, found: list[Mapping[str, Tensor]], names: Sequence[str] | None) -> list[tuple[Tensor, Tensor]]:
        """Each image's reference boxes (M_i, 4) and labels (M_i,)."""
        n, device = len(found), found[0]["boxes"].device if found else "cpu"

        def label_ids(values: Any) -> Tensor:
            ids = [class_index(v, names, len(names or [])) if isinstance(v, str) else int(v) for v in values]
            return torch.tensor(ids, dtype=torch.long, device=device)

        if self.boxes is None:
            single = isinstance(self.labels, (str, numbers.Integral))
            wanted = None if self.labels is None else label_ids([self.labels] if single else self.labels)
            refs = []
            for d in found:
                keep = d["scores"] >= self.score_threshold
                if wanted is not None:
                    keep &= torch.isin(d["labels"], wanted)
                refs.append((d["boxes"][keep].detach(), d["labels"][keep]))
            return refs
        shared = isinstance(self.boxes, Tensor) and self.boxes.dim() == 2
        boxes = [self.boxes] * n if shared else per_image(self.boxes, n, "box sets")
        labels = [self.labels] * n if shared else per_image(self.labels, n, "label sets")
        return [
            (torch.as_tensor(b, dtype=torch.float32, device=device).reshape(-1, 4), label_ids(list(lab)))
            for b, lab in zip(boxes, labels)
        ]

    def matched(self, detections: Mapping[str, Tensor], boxes: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """The score of each reference box's match among one image's detections (0 without one), and which matched."""
        if len(detections["boxes"]) == 0 or len(boxes) == 0:
            return detections["scores"].new_zeros(len(boxes)), torch.zeros(
                len(boxes), dtype=torch.bool, device=boxes.device
            )
        overlap = box_iou(boxes.to(detections["boxes"]), detections["boxes"].detach())
        overlap = torch.where(labels[:, None] == detections["labels"][None], overlap, -1.0)
        best, index = overlap.max(dim=1)
        found = best >= self.iou
        return torch.where(found, detections["scores"][index], 0.0), found

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        found = self.detections(output)
        refs = self.references(found, labels)
        if not any(len(boxes) for boxes, _ in refs):
            raise NothingToExplain(f"no detection scores at least {self.score_threshold}", hint="lower score_threshold")
        boxes, valid = ragged([image_boxes for image_boxes, _ in refs])
        classes, _ = ragged([image_labels for _, image_labels in refs], fill=-1)
        plain = [self.matched(d, boxes[i], classes[i]) for i, d in enumerate(found)]
        missing = valid & ~torch.stack([matched for _, matched in plain])
        if missing.any():
            i, j = missing.nonzero()[0].tolist()
            box = [round(v, 1) for v in boxes[i, j].tolist()]
            raise NothingToExplain(
                f"no detection of label {int(classes[i, j])} overlaps box {box} with IoU >= {self.iou}", i
            )

        def score(out: Any, images: Tensor) -> Tensor:
            rows = self.detections(out)
            return (
                torch.stack([self.matched(rows[r], boxes[i], classes[i])[0] for r, i in enumerate(images.tolist())])
                * valid[images]
            )

        return BoundTarget(
            score=score,
            classes=classes,
            probabilities=torch.stack([scores.detach() for scores, _ in plain]),
            keeps_k=True,
            valid=valid,
            boxes=boxes,
        )


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


class BoundAlready(Target):
    """A target bound by an earlier call: binding it again returns it as it is (Guided Grad-CAM's Grad-CAM)."""

    def __init__(self, bound: BoundTarget) -> None:
        super().__init__(None)
        self.bound = bound

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        return self.bound


TargetLike = Target | BoundTarget | int | str | Sequence[int | str] | Tensor | Callable[[Any], Tensor] | None


def as_target(target: TargetLike, topk: int | None = None) -> Target:
    """The target object for a target or its shorthand.

    ``None`` is each image's top-1 class; an int or name one class for all images; a
    sequence or 1-D tensor one class per image; a callable one score per row; and
    ``topk=K`` is :class:`TopK`.

    Raises:
        TargetError: ``topk`` together with a target.
    """
    if topk is not None:
        if target is not None:
            kind = "a callable target" if callable(target) and not isinstance(target, Target) else "a target"
            raise TargetError(f"topk explains the top classes; it cannot be combined with {kind}")
        return TopK(topk)
    if isinstance(target, Target):
        return target
    if isinstance(target, BoundTarget):
        return BoundAlready(target)
    if callable(target):
        return CallableTarget(target)
    return ClassTarget(target)
