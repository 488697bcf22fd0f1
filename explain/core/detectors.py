"""torchvision's detectors during a call: where their maps lie, and a cheaper gradient for their box scores.

Both are contexts the engine opens around each pass; a model that is not such a detector is left alone.

- :func:`canvas_recorded`: the detector's transform resizes and pads the batch onto a canvas, so a layer's
  map covers the canvas; the canvas is recorded to bring maps back onto the image.
- :func:`thresholds_lowered`: a detector's own least score (torchvision's ``box_score_thresh``, YOLO's ``conf``)
  filters before any target sees the detections; a caller's lower threshold is brought down to it for the call.
- :func:`sparse_box_heads`: Faster, Mask and Keypoint R-CNN score about a thousand proposals per image in
  their box head and keep a few detections. Differentiating a kept detection's score through the whole head
  costs a second head's worth of work for rows whose gradient is zero; the context runs the head as it is
  without recording autograd, then recomputes, with autograd, only the kept detections' own rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import LayerError
from .hooks import Hooks
from .maps import Canvas
from .model_state import modules_of
from .speedups.rows import RowsRecomputed


@contextmanager
def canvas_recorded(model: nn.Module) -> Iterator[list[Canvas]]:
    """For the block, record the canvas of each forward of a torchvision detector.

    A model whose ``transform`` resizes and pads its input into an ``ImageList`` (``.tensors``,
    ``.image_sizes``, and ``.offset`` where the images are not at the top left), as torchvision's detectors and
    :class:`explain.models.yolo.YoloDetector` do, gets a forward hook on it; any other model records nothing.

    Yields:
        The list that receives one :class:`explain.core.maps.Canvas` per forward.

    Raises:
        LayerError: The images of one batch were resized to different sizes.
    """
    canvases: list[Canvas] = []
    transform = getattr(model, "transform", None)

    def record(module: nn.Module, inputs: Any, output: Any) -> None:
        images = output[0] if isinstance(output, tuple) else output
        if not hasattr(images, "image_sizes"):
            return
        sizes = {tuple(size) for size in images.image_sizes}
        if len(sizes) != 1:
            raise LayerError(f"the detector resized the batch's images to different sizes {sorted(sizes)}")
        canvases.append(Canvas(tuple(images.tensors.shape[-2:]), sizes.pop(), tuple(getattr(images, "offset", (0, 0)))))

    with Hooks() as hooks:
        if isinstance(transform, nn.Module):
            hooks.forward(transform, record)
        yield canvases


FILTER = "score_thresh"  # a detector's own least score: torchvision's RoIHeads, RetinaNet, FCOS, SSD; YoloDetector


@contextmanager
def thresholds_lowered(model: nn.Module, least: float | None) -> Iterator[None]:
    """For the block, every final filter of the model whose least score (its ``score_thresh``) is above ``least``
    keeps detections from ``least`` on; each is restored on exit.

    A final filter drops rows before non-maximum suppression and the per-image caps, which keep higher scores
    first: lowering it adds detections below those kept before and changes none of them. A proposal network's
    threshold is left as it is, since more proposals would change the detections themselves.

    Args:
        model: The model; any module of it with a float ``score_thresh`` counts, the model itself included.
        least: The caller's least score, or None to change nothing.
    """
    lowered = []
    if least is not None:
        for module in modules_of(model):
            own = getattr(module, FILTER, None)
            if isinstance(own, float) and own > least and not _is_proposal_network(module):
                lowered.append((module, own))
    try:
        for module, _ in lowered:
            setattr(module, FILTER, float(least))
        yield
    finally:
        for module, own in lowered:
            setattr(module, FILTER, own)


def _is_box_head(module: nn.Module) -> bool:
    """Whether a module is torchvision's ``RoIHeads`` (the second stage of Faster, Mask and Keypoint R-CNN)."""
    parts = ("box_roi_pool", "box_head", "box_predictor", "box_coder", "postprocess_detections")
    return all(hasattr(module, part) for part in parts)


def _is_proposal_network(module: nn.Module) -> bool:
    """Whether a module is torchvision's ``RegionProposalNetwork`` (the first stage of the R-CNNs)."""
    return all(hasattr(module, part) for part in ("head", "anchor_generator", "box_coder", "filter_proposals"))


def is_rcnn(model: nn.Module) -> bool:
    """Whether the model is a torchvision R-CNN (``GeneralizedRCNN``: Faster, Mask, Keypoint R-CNN), by its parts."""
    proposer, head = getattr(model, "rpn", None), getattr(model, "roi_heads", None)
    return (isinstance(proposer, nn.Module) and _is_proposal_network(proposer)) or (
        isinstance(head, nn.Module) and _is_box_head(head)
    )


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
        if isinstance(proposer, nn.Module) and _is_proposal_network(proposer):
            hooks.forward_pre(proposer, _proposals_detached)
        if isinstance(head, nn.Module) and _is_box_head(head):
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
