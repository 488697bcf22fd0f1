"""Targets of a pose model: the keypoints of its detections, scored by the model's own keypoint confidence.

A pose model's output is a detector's (a list of one dict per image with ``"boxes"``, ``"labels"`` and
``"scores"``) with each detection's keypoints: ``"keypoints"`` (detections, keypoints, 3: x, y and visibility) and
``"keypoints_scores"`` (detections, keypoints). torchvision's Keypoint R-CNN returns it; explain's Ultralytics
YOLO pose wrapper returns it with YOLO's keypoint confidences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from ..errors import TargetError
from .base import BoundTarget, OutputPicker
from .detection import DetectionTarget

COCO_KEYPOINTS = (
    "nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder", "left_elbow",
    "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip", "left_knee", "right_knee", "left_ankle",
    "right_ankle",
)  # fmt: skip
"""The 17 keypoints of COCO's people, in the order of torchvision's and Ultralytics' pose models."""

COCO_SKELETON = (
    (0, 1), (0, 2), (1, 3), (2, 4), (1, 2), (3, 5), (4, 6), (5, 6), (5, 7), (7, 9), (6, 8), (8, 10), (5, 11),
    (6, 12), (11, 12), (11, 13), (13, 15), (12, 14), (14, 16),
)  # fmt: skip
"""The limbs joining COCO's keypoints, as pairs of their indices: the face, arms, torso and legs."""


def limbs_of(count: int) -> tuple[tuple[int, int], ...]:
    """The limbs a pose of ``count`` keypoints is drawn with: COCO's for COCO's 17, else none (the points alone)."""
    return COCO_SKELETON if count == len(COCO_KEYPOINTS) else ()


class KeypointTarget(DetectionTarget):
    """Keypoints of a pose model's detections, each scored by the model's own confidence in it: torchvision's
    ``keypoints_scores`` (the keypoint heatmap's logit at its peak), YOLO pose's keypoint confidence.

    The detections are chosen and matched in every pass as :class:`DetectionTarget` chooses and matches boxes;
    a keypoint of a detection without a match scores 0. The K axis holds, detection after detection, each chosen
    keypoint of it: one keypoint of one detection is K = 1, all 17 of a person K = 17 (one call, one backward
    each).

    Args:
        keypoints: Which keypoints: an index, a name, a sequence of them, or None for all of them.
        names: The keypoints' names, in the model's order; default: COCO's 17 (:data:`COCO_KEYPOINTS`) where the
            model has 17 keypoints.
        boxes: See :class:`DetectionTarget` (the detections whose keypoints are explained).
        labels: See :class:`DetectionTarget`.
        iou: See :class:`DetectionTarget`.
        score_threshold: See :class:`DetectionTarget`.
        output: See :class:`DetectionTarget`.
    """

    def __init__(
        self,
        keypoints: int | str | Sequence[int | str] | None = None,
        *,
        names: Sequence[str] | None = None,
        boxes: Tensor | Sequence[Tensor] | None = None,
        labels: Any = None,
        iou: float = 0.5,
        score_threshold: float = 0.5,
        output: OutputPicker = None,
    ) -> None:
        super().__init__(boxes, labels, iou, score_threshold, output=output)
        self.keypoints, self.names = keypoints, names

    def chosen(self, count: int) -> list[int]:
        """The explained keypoints' indices among the model's ``count``.

        Raises:
            TargetError: An index out of range, or a name the model does not have (the names it has are listed).
        """
        if self.keypoints is None:
            return list(range(count))
        wanted = [self.keypoints] if isinstance(self.keypoints, (int, str)) else list(self.keypoints)
        names = list(self.names) if self.names is not None else list(COCO_KEYPOINTS) if count == 17 else None
        if names is not None and len(names) != count:
            raise TargetError(f"{len(names)} keypoint names for a model of {count} keypoints")
        indices = []
        for keypoint in wanted:
            if isinstance(keypoint, str):
                if names is None or keypoint not in names:
                    known = f"its keypoints are {', '.join(names)}" if names else "give names= to name them"
                    raise TargetError(f"the model has no keypoint {keypoint!r}: {known}, or pick one by index")
                indices.append(names.index(keypoint))
            elif not 0 <= int(keypoint) < count:
                raise TargetError(f"keypoint {int(keypoint)} is out of range for a model of {count} keypoints")
            else:
                indices.append(int(keypoint))
        return indices

    def keypoint_scores(self, detections: Any) -> Tensor:
        """One image's keypoint scores, (detections, keypoints).

        Raises:
            TargetError: The detections have no keypoints (not a pose model).
        """
        if "keypoints_scores" not in detections:
            raise TargetError(
                "KeypointTarget reads each detection's keypoints_scores (torchvision's Keypoint R-CNN, YOLO pose); "
                "the model's detections have none: explain its boxes with DetectionTarget"
            )
        return detections["keypoints_scores"]

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        bound = super().bind(output, labels)
        found = self.detections(output)
        count = self.keypoint_scores(found[0]).shape[-1]
        chosen = torch.tensor(self.chosen(count), dtype=torch.long, device=bound.boxes.device)
        per = len(chosen)
        valid = bound.valid.repeat_interleave(per, dim=1)

        def score(out: Any, images: Tensor) -> Tensor:
            rows = self.detections(out)
            scores = []
            for r, i in enumerate(images.tolist()):
                index, matched = self.match(rows[r], bound.boxes[i], bound.classes[i])
                kept = self.keypoint_scores(rows[r])
                picked = kept[index][:, chosen] if len(kept) else kept.new_zeros(len(index), per)
                scores.append(torch.where(matched[:, None], picked, 0.0).flatten())
            return torch.stack(scores) * valid[images]

        plain = score(output, torch.arange(len(found), device=bound.boxes.device)).detach()
        poses = torch.stack([self.posed(d, bound.boxes[i], bound.classes[i], count) for i, d in enumerate(found)])
        poses = poses.repeat_interleave(per, dim=1)  # (N, K, keypoints, 3): each entry's detection's pose
        entries = torch.arange(poses.shape[1], device=poses.device)
        points = poses[:, entries, chosen.repeat(bound.boxes.shape[1])][..., :2]  # (N, K, 2): each entry's keypoint
        names = self.names if self.names is not None else COCO_KEYPOINTS if count == len(COCO_KEYPOINTS) else None
        return replace(
            bound,
            names=tuple(names) if names is not None else tuple(f"keypoint {i}" for i in range(count)),
            score=score,
            classes=chosen.repeat(bound.classes.shape[1]).expand(len(found), -1),
            probabilities=plain,
            valid=valid,
            boxes=bound.boxes.repeat_interleave(per, dim=1),
            points=points,
            poses=poses,
        )

    def posed(self, detections: Any, boxes: Tensor, labels: Tensor, count: int) -> Tensor:
        """One image's reference detections' whole poses on the plain pass, (D, count, 3): each keypoint's x, y in
        input pixels and its visibility (zeros for a detection without a match)."""
        if "keypoints" not in detections or not len(detections["keypoints"]):
            return boxes.new_zeros(len(boxes), count, 3)
        index, matched = self.match(detections, boxes, labels)
        found = detections["keypoints"][index].detach().to(boxes.dtype)
        return torch.where(matched[:, None, None], found, 0.0)
