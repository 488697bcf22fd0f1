"""Detectors with object queries (DETR, Conditional and Deformable DETR, RT-DETR from HuggingFace
``transformers``) answering as torchvision's detectors do, so that :class:`explain.targets.DetectionTarget`
explains their queries."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import TargetError


class QueryDetector(nn.Module):
    """A HuggingFace object-query detector whose output is torchvision's: one dict per image of ``"boxes"``
    (x1, y1, x2, y2 in input pixels), ``"labels"`` and ``"scores"``, one entry per object query.

    There is no non-maximum suppression: each query is one detection. The scores are the model's own class
    probabilities: a softmax over the classes and the "no object" class, which is dropped, where the logits have
    one more entry than ``config.num_labels`` (DETR); a sigmoid per class otherwise (Conditional and Deformable
    DETR, RT-DETR). A query's label is its most probable class. The model's boxes, (cx, cy, w, h) relative to
    the input, are scaled to its pixels. ``DetectionTarget()`` then explains every query scoring at least its
    ``score_threshold``, each by its score.

    Args:
        model: A ``transformers`` model whose output has ``logits`` (N, queries, classes) and ``pred_boxes``
            (N, queries, 4), as ``DetrForObjectDetection`` and its relatives.

    Raises:
        TargetError: At the first forward, the output has no ``logits`` and ``pred_boxes``.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        labels = getattr(getattr(model, "config", None), "id2label", None)
        self.labels = [labels[i] for i in sorted(labels)] if labels else None

    def forward(self, pixel_values: Tensor) -> list[dict[str, Tensor]]:
        output = self.model(pixel_values=pixel_values)
        logits, boxes = getattr(output, "logits", None), getattr(output, "pred_boxes", None)
        if not isinstance(logits, Tensor) or not isinstance(boxes, Tensor):
            raise TargetError(
                f"QueryDetector reads a detector's logits and pred_boxes; {type(self.model).__name__} returns "
                f"a {type(output).__name__} without them"
            )
        classes = getattr(getattr(self.model, "config", None), "num_labels", logits.shape[-1])
        probabilities = logits.softmax(dim=-1)[..., :-1] if logits.shape[-1] == classes + 1 else logits.sigmoid()
        scores, labels = probabilities.max(dim=-1)
        height, width = pixel_values.shape[-2:]
        scale = boxes.new_tensor([width, height, width, height])
        corners = torch.cat([boxes[..., :2] - boxes[..., 2:] / 2, boxes[..., :2] + boxes[..., 2:] / 2], dim=-1)
        return [
            {"boxes": image_boxes * scale, "labels": image_labels, "scores": image_scores}
            for image_boxes, image_labels, image_scores in zip(corners, labels, scores)
        ]

    def extra_repr(self) -> str:
        return f"queries of a {type(self.model).__name__}"
