"""Oriented boxes: their corners, their exact intersection over union, and the target of an oriented detector.

An oriented box is (cx, cy, w, h, angle): its centre, its sides and its rotation in radians (clockwise in image
coordinates, y down), as Ultralytics' OBB models give them. Two boxes' IoU is computed exactly: the area of the
convex polygon where they overlap (each box's corners inside the other and their edges' crossings, ordered around
their centre) over the union's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import TargetError
from .detection import DetectionTarget


def rotated_corners(boxes: Tensor) -> Tensor:
    """The four corners of oriented boxes (M, 5), (M, 4, 2), in order around the box."""
    centre, size, angle = boxes[:, None, :2], boxes[:, 2:4], boxes[:, 4]
    unit = torch.tensor([[-0.5, -0.5], [0.5, -0.5], [0.5, 0.5], [-0.5, 0.5]], device=boxes.device, dtype=boxes.dtype)
    offsets = unit[None] * size[:, None]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    rotated = torch.stack(
        [offsets[..., 0] * cos - offsets[..., 1] * sin, offsets[..., 0] * sin + offsets[..., 1] * cos], -1
    )
    return centre + rotated


def _inside(points: Tensor, polygon: Tensor) -> Tensor:
    """Whether each point (P, K, 2) lies inside (or on) its convex polygon (P, 4, 2), (P, K)."""
    edges = polygon.roll(-1, dims=1) - polygon  # (P, 4, 2)
    relative = points[:, :, None] - polygon[:, None]  # (P, K, 4, 2)
    cross = edges[:, None, :, 0] * relative[..., 1] - edges[:, None, :, 1] * relative[..., 0]
    return (cross >= -1e-6).all(dim=2) | (cross <= 1e-6).all(dim=2)


def _crossings(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Where each edge of polygon a crosses each edge of polygon b, (P, 16, 2), and whether it does, (P, 16)."""
    start_a, end_a = a[:, :, None], a.roll(-1, dims=1)[:, :, None]
    start_b, end_b = b[:, None], b.roll(-1, dims=1)[:, None]
    along_a, along_b = end_a - start_a, end_b - start_b
    denominator = along_a[..., 0] * along_b[..., 1] - along_a[..., 1] * along_b[..., 0]
    gap = start_b - start_a
    safe = torch.where(denominator.abs() > 1e-12, denominator, torch.ones_like(denominator))
    t = (gap[..., 0] * along_b[..., 1] - gap[..., 1] * along_b[..., 0]) / safe
    u = (gap[..., 0] * along_a[..., 1] - gap[..., 1] * along_a[..., 0]) / safe
    hit = (denominator.abs() > 1e-12) & (t >= 0) & (t <= 1) & (u >= 0) & (u <= 1)
    return (start_a + t[..., None] * along_a).flatten(1, 2), hit.flatten(1)


def _overlap_areas(a: Tensor, b: Tensor) -> Tensor:
    """The area where each pair of convex quadrilaterals (P, 4, 2) overlaps, (P,)."""
    crossing, hit = _crossings(a, b)
    points = torch.cat([a, b, crossing], dim=1)  # (P, 24, 2)
    valid = torch.cat([_inside(a, b), _inside(b, a), hit], dim=1)
    count = valid.sum(dim=1, keepdim=True).clamp_min(1)
    centre = (points * valid[..., None]).sum(dim=1, keepdim=True) / count[..., None]
    angle = torch.atan2(points[..., 1] - centre[..., 1], points[..., 0] - centre[..., 0])
    order = torch.where(valid, angle, torch.inf).argsort(dim=1)
    ordered, kept = points.gather(1, order[..., None].expand(-1, -1, 2)), valid.gather(1, order)
    first = ordered[:, :1].expand_as(ordered)
    ordered = torch.where(kept[..., None], ordered, first)  # the unused places repeat the first point: no area
    following = ordered.roll(-1, dims=1)
    twice = (ordered[..., 0] * following[..., 1] - following[..., 0] * ordered[..., 1]).sum(dim=1)
    return torch.where(valid.sum(dim=1) >= 3, twice.abs() / 2, torch.zeros_like(twice))


def rotated_pair_iou(a: Tensor, b: Tensor) -> Tensor:
    """The exact intersection over union of oriented boxes pair by pair: a (P, 5) and b (P, 5) give (P,)."""
    if len(a) == 0:
        return a.new_zeros(0)
    overlap = _overlap_areas(rotated_corners(a.double()), rotated_corners(b.double()))
    union = ((a[:, 2] * a[:, 3]).double() + (b[:, 2] * b[:, 3]).double() - overlap).clamp_min(1e-12)
    return (overlap / union).to(a.dtype)


def rotated_iou(a: Tensor, b: Tensor) -> Tensor:
    """The exact intersection over union of oriented boxes: a (A, 5) and b (B, 5) give (A, B)."""
    pairs_a = a[:, None].expand(-1, len(b), -1).reshape(-1, 5)
    pairs_b = b[None].expand(len(a), -1, -1).reshape(-1, 5)
    return rotated_pair_iou(pairs_a, pairs_b).view(len(a), len(b))


def upright_boxes(boxes: Tensor) -> Tensor:
    """The upright boxes (x1, y1, x2, y2) around oriented boxes (..., 5), (..., 4)."""
    corners = rotated_corners(boxes.reshape(-1, 5))
    return torch.cat([corners.amin(dim=1), corners.amax(dim=1)], dim=1).view(*boxes.shape[:-1], 4)


class OrientedDetectionTarget(DetectionTarget):
    """Oriented boxes of a detector whose detections hold ``"rboxes"`` (detections, 5): (cx, cy, w, h, angle) in
    input pixels (explain's Ultralytics YOLO OBB wrapper). Each reference box is matched, in every pass, to the
    detection of its label with the highest rotated IoU, at least ``iou``; as :class:`DetectionTarget` in all else.

    Args:
        rboxes: Reference oriented boxes, (M, 5) for every image or one (M_i, 5) per image; None explains every
            detection scoring at least ``score_threshold``.
        labels: Their labels (see :class:`DetectionTarget`).
        iou: The least rotated IoU of a match.
        score_threshold: See :class:`DetectionTarget`.
    """

    box_values = 5  # cx, cy, w, h, angle

    def __init__(
        self,
        rboxes: Tensor | Sequence[Tensor] | None = None,
        labels: Any = None,
        iou: float = 0.5,
        score_threshold: float = 0.5,
    ) -> None:
        super().__init__(rboxes, labels, iou, score_threshold)

    def detections(self, output: Any) -> list[Mapping[str, Tensor]]:
        found = super().detections(output)
        if not all("rboxes" in d for d in found):
            raise TargetError(
                "OrientedDetectionTarget reads each detection's rboxes (an oriented detector: YOLO OBB); the model's "
                "detections have none: explain its boxes with DetectionTarget"
            )
        return [{**d, "boxes": d["rboxes"]} for d in found]  # the boxes matched are the oriented ones

    @staticmethod
    def overlaps(boxes: Tensor, detected: Tensor) -> Tensor:
        """The rotated IoU of each reference box with each detected box, (M, D)."""
        return rotated_iou(boxes, detected)
