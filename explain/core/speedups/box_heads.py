"""A speedup (``box_heads``): an R-CNN's box head differentiated at its kept detections alone.

Faster, Mask and Keypoint R-CNN score about a thousand proposals per image in their box head and keep a few
detections. Differentiating a kept detection's score through the whole head costs a second head's worth of work for
rows whose gradient is zero; :func:`sparse_box_heads` runs the head as it is without recording autograd, then
recomputes, with autograd, only the kept detections' own rows. The values and their gradients are torchvision's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..detectors import is_box_head, is_proposal_network
from ..hooks import Hooks
from .rows import RowsRecomputed


@contextmanager
def sparse_box_heads(model: nn.Module) -> Iterator[None]:
    """For the block, differentiate a torchvision R-CNN's kept detections through their own proposals only.

    The model's ``roi_heads`` (torchvision's ``GeneralizedRCNN``: Faster, Mask and Keypoint R-CNN), in eval
    mode and with features that require grad, runs on detached features: no
    autograd graph over its thousand proposals. Each kept detection is then traced to the
    proposal it was decoded from (the same decode, softmax and clipping as torchvision's
    ``postprocess_detections``, compared exactly), and its boxes and scores are returned as
    they are, joined to the features by :class:`explain.core.speedups.rows.RowsRecomputed`, whose backward
    recomputes, with
    autograd, only the rows whose gradient is asked for: RoI pooling, box head, predictor,
    softmax and box decoding of that one proposal. The values are torchvision's, and so is
    their gradient, since a row of the head depends on its own proposal alone (torchvision
    detaches the proposals). An image whose detections cannot all be traced gets the whole
    head run again with autograd, as torchvision would have run it. For the same reason the
    model's ``rpn``, whose outputs torchvision detaches in eval mode, runs on detached features.
    A detector wrapped in another module is differentiated as it is, whole. Mask R-CNN's masks and Keypoint
    R-CNN's keypoints of the kept detections are computed again with autograd from the features, their rows
    alone.
    """
    proposer, head = getattr(model, "rpn", None), getattr(model, "roi_heads", None)  # torchvision's GeneralizedRCNN
    with Hooks() as hooks:
        if isinstance(proposer, nn.Module) and is_proposal_network(proposer):
            hooks.forward_pre(proposer, _proposals_detached)
        if isinstance(head, nn.Module) and is_box_head(head):
            seen: dict[str, Any] = {}
            hooks.forward_pre(head, partial(_detach_features, seen))
            hooks.forward(head.box_predictor, lambda m, i, o, seen=seen: seen.update(rows=o))
            hooks.forward(head, partial(_kept_rows_joined, seen))
        yield


def _proposals_detached(proposer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if proposer.training or not torch.is_grad_enabled():
        return None
    images, features, *rest = args
    return (images, {key: value.detach() for key, value in features.items()}, *rest)


def _detach_features(seen: dict[str, Any], head: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    seen.clear()
    features = args[0]
    if head.training or not torch.is_grad_enabled() or not any(f.requires_grad for f in features.values()):
        return None
    seen["features"] = features
    return ({key: value.detach() for key, value in features.items()}, *args[1:])


def _decoded(head: nn.Module, regression: Tensor, proposals: list[Tensor], shapes: list[Any]) -> list[Tensor]:
    """Every proposal's box for every class, clipped to its image: one (P_i, classes, 4) per image."""
    from torchvision.ops import boxes as box_ops

    decoded = head.box_coder.decode(regression, proposals).split([len(p) for p in proposals])
    return [box_ops.clip_boxes_to_image(boxes, shape) for boxes, shape in zip(decoded, shapes)]


def _kept_rows_joined(seen: dict[str, Any], head: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    if "features" not in seen:
        return None
    features, proposals, shapes = seen["features"], args[1], args[2]
    result, losses = output
    result = _masks_recomputed(head, features, result, shapes)
    logits, regression = seen["rows"]
    scores = F.softmax(logits, -1).split([len(p) for p in proposals])
    traced = [_trace(d, b, s) for d, b, s in zip(result, _decoded(head, regression, proposals, shapes), scores)]
    if any(rows is None for rows in traced):  # the whole head with autograd, as torchvision computes it
        pooled = head.box_head(head.box_roi_pool(features, proposals, shapes))
        boxes, scores, labels = head.postprocess_detections(*head.box_predictor(pooled), proposals, shapes)
        rescored = [
            {**d, "boxes": b, "scores": s, "labels": lab} for d, b, s, lab in zip(result, boxes, scores, labels)
        ]
        return rescored, losses
    kept = torch.cat([p[rows] for p, rows in zip(proposals, traced)])
    image = torch.cat([torch.full_like(rows, i) for i, rows in enumerate(traced)])
    labels = torch.cat([d["labels"] for d in result])
    keys = list(features)

    def recompute(levels: list[Tensor], rows: Tensor) -> Tensor:
        """Rows of the kept detections (their boxes and scores) from the features, with autograd: (len(rows), 5)."""
        chosen = [kept[rows][image[rows] == i] for i in range(len(result))]
        pooled = head.box_head(head.box_roi_pool(dict(zip(keys, levels)), chosen, shapes))
        row_logits, row_regression = head.box_predictor(pooled)
        index, row_labels = torch.arange(len(rows), device=rows.device), labels[rows]
        boxes = torch.cat(_decoded(head, row_regression, chosen, shapes))[index, row_labels]
        return torch.cat([boxes, F.softmax(row_logits, -1)[index, row_labels, None]], dim=1)

    values = torch.cat([torch.cat([d["boxes"], d["scores"][:, None]], dim=1) for d in result])
    joined = RowsRecomputed.apply(recompute, None, (values,), *features.values()).split([len(rows) for rows in traced])
    return [{**d, "boxes": v[:, :4], "scores": v[:, 4]} for d, v in zip(result, joined)], losses


def _masks_recomputed(head: nn.Module, features: dict[str, Tensor], result: list[dict[str, Tensor]], shapes: Any):
    """Mask R-CNN's masks and Keypoint R-CNN's keypoints of the kept detections, computed again with autograd from
    the features: their branches ran on detached features with the rest of the head. Their rows are the kept
    detections alone, so this costs little. Other heads' results are returned as they are."""
    boxes = [d["boxes"].detach() for d in result]
    if hasattr(head, "has_mask") and head.has_mask() and all("masks" in d for d in result):
        from torchvision.models.detection.roi_heads import maskrcnn_inference

        logits = head.mask_predictor(head.mask_head(head.mask_roi_pool(features, boxes, shapes)))
        masks = maskrcnn_inference(logits, [d["labels"] for d in result])
        result = [{**d, "masks": m} for d, m in zip(result, masks)]
    if hasattr(head, "has_keypoint") and head.has_keypoint() and all("keypoints" in d for d in result):
        from torchvision.models.detection.roi_heads import keypointrcnn_inference

        pooled = head.keypoint_roi_pool(features, boxes, shapes)
        points, scores = keypointrcnn_inference(head.keypoint_predictor(head.keypoint_head(pooled)), boxes)
        result = [{**d, "keypoints": p, "keypoints_scores": k} for d, p, k in zip(result, points, scores)]
    return result


def _trace(detections: dict[str, Tensor], boxes: Tensor, scores: Tensor) -> Tensor | None:
    """The proposal each kept detection was decoded from, found by its label, box and score; None if one has
    no exact match."""
    labels = detections["labels"]
    if len(labels) == 0:
        return torch.zeros(0, dtype=torch.long, device=labels.device)
    candidates, candidate_scores = boxes[:, labels], scores[:, labels]  # (P, D, 4), (P, D)
    box_mismatch = (candidates - detections["boxes"][None]).abs().amax(dim=-1)
    mismatch = box_mismatch + (candidate_scores - detections["scores"]).abs()
    best, rows = mismatch.min(dim=0)
    return rows if bool((best == 0).all()) else None
