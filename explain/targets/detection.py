"""Targets of an object detector: its boxes, matched by label and IoU in every output the call scores."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from ..errors import NothingToExplain, TargetError
from .base import BoundTarget, OutputPicker, Target, class_index, per_image, ragged, read_output


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
    box_values = 4  # the values of a box: x1, y1, x2, y2

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

    @property
    def least_score(self) -> float | None:  # type: ignore[override]
        """``score_threshold`` where the detections are chosen by it (``boxes=None``): the engine lowers the
        model's own filters to it for the call (see :func:`explain.core.detectors.thresholds_lowered`)."""
        return self.score_threshold if self.boxes is None else None

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
            (torch.as_tensor(b, dtype=torch.float32, device=device).reshape(-1, self.box_values), label_ids(list(lab)))
            for b, lab in zip(boxes, labels)
        ]

    def match(self, detections: Mapping[str, Tensor], boxes: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Which of one image's detections each reference box matches (its index), and whether it matches one."""
        if len(detections["boxes"]) == 0 or len(boxes) == 0:
            nothing = torch.zeros(len(boxes), dtype=torch.long, device=boxes.device)
            return nothing, nothing.bool()
        overlap = self.overlaps(boxes.to(detections["boxes"]), detections["boxes"].detach())
        overlap = torch.where(labels[:, None] == detections["labels"][None], overlap, -1.0)
        best, index = overlap.max(dim=1)
        return index, best >= self.iou

    @staticmethod
    def overlaps(boxes: Tensor, detected: Tensor) -> Tensor:
        """The IoU of each reference box with each detected box, (M, D)."""
        return box_iou(boxes, detected)

    def matched(self, detections: Mapping[str, Tensor], boxes: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """The score of each reference box's match among one image's detections (0 without one), and which matched."""
        index, found = self.match(detections, boxes, labels)
        if not len(detections["scores"]):
            return detections["scores"].new_zeros(len(boxes)), found
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


class InstanceTarget(DetectionTarget):
    """Instances of an instance segmenter: torchvision's Mask R-CNN, whose detections also hold ``"masks"``,
    (detections, 1, H, W) probabilities in input pixels.

    Instances are chosen and matched as :class:`DetectionTarget` chooses and matches boxes. Each is explained by
    what ``by`` says:

    - ``"mask"``: the mean logit of its mask over its region, the pixels where the mask is at least 0.5 on the
      plain pass (fixed there, like a segmenter's region). A match in another pass without its mask scores 0.
    - ``"box"``: its box score, as :class:`DetectionTarget` explains it.

    Args:
        boxes: See :class:`DetectionTarget`.
        labels: See :class:`DetectionTarget`.
        by: ``"mask"`` or ``"box"``.
        iou: See :class:`DetectionTarget`.
        score_threshold: See :class:`DetectionTarget`.
        output: See :class:`DetectionTarget`.

    Raises:
        TargetError: ``by`` is neither, or, with ``"mask"``, the detections have no masks.
        NothingToExplain: An explained instance's mask is empty on the plain pass.
    """

    def __init__(
        self,
        boxes: Tensor | Sequence[Tensor] | None = None,
        labels: Any = None,
        by: str = "mask",
        iou: float = 0.5,
        score_threshold: float = 0.5,
        *,
        output: OutputPicker = None,
    ) -> None:
        if by not in ("mask", "box"):
            raise TargetError(f"InstanceTarget explains an instance by 'mask' or 'box', got {by!r}")
        super().__init__(boxes, labels, iou, score_threshold, output=output)
        self.by = by

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        bound = super().bind(output, labels)
        if self.by == "box":
            return bound
        found = self.detections(output)
        if not all("masks" in d for d in found):
            raise TargetError("InstanceTarget(by='mask') reads the detections' masks; the model returns none")
        regions = []
        for i, d in enumerate(found):
            index, _ = self.match(d, bound.boxes[i], bound.classes[i])
            masks = d["masks"][index, 0].detach() >= 0.5 if len(d["masks"]) else None
            image_regions = masks.float() if masks is not None else bound.boxes.new_zeros(len(index), 1, 1)
            empty = (image_regions.flatten(1).sum(dim=1) == 0) & bound.valid[i]
            if empty.any():
                raise NothingToExplain(f"instance {int(empty.nonzero()[0])}'s mask is empty", i)
            regions.append(image_regions)
        regions = torch.stack(regions)

        def score(out: Any, images: Tensor) -> Tensor:
            rows = self.detections(out)
            scores = []
            for r, i in enumerate(images.tolist()):
                index, matched = self.match(rows[r], bound.boxes[i], bound.classes[i])
                if not len(rows[r]["masks"]):
                    scores.append(regions.new_zeros(len(index)))
                    continue
                probabilities = rows[r]["masks"][index, 0].clamp(1e-6, 1 - 1e-6)
                logits = torch.log(probabilities) - torch.log1p(-probabilities)
                mean = (logits * regions[i]).flatten(1).sum(dim=1) / regions[i].flatten(1).sum(dim=1).clamp(min=1)
                scores.append(torch.where(matched, mean, 0.0))
            return torch.stack(scores) * bound.valid[images]

        return replace(bound, score=score, regions=regions)
