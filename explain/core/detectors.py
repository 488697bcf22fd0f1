"""torchvision's detectors during a call: where their maps lie, their own thresholds, and what they are made of.

The contexts are ones the engine opens around each pass; a model that is not such a detector is left alone. The
cheaper gradient of an R-CNN's box scores is a speedup (:mod:`explain.core.speedups.box_heads`).

- :func:`canvas_recorded`: the detector's transform resizes and pads the batch onto a canvas, so a layer's
  map covers the canvas; the canvas is recorded to bring maps back onto the image.
- :func:`thresholds_lowered`: a detector's own least score (torchvision's ``box_score_thresh``, YOLO's ``conf``)
  filters before any target sees the detections; a caller's lower threshold is brought down to it for the call.
- :func:`is_rcnn`: whether a model is a torchvision R-CNN, by its parts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from ..errors import LayerError
from .hooks import Hooks
from .maps import Canvas
from .model_state import modules_of


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
            if isinstance(own, float) and own > least and not is_proposal_network(module):
                lowered.append((module, own))
    try:
        for module, _ in lowered:
            setattr(module, FILTER, float(least))
        yield
    finally:
        for module, own in lowered:
            setattr(module, FILTER, own)


def is_box_head(module: nn.Module) -> bool:
    """Whether a module is torchvision's ``RoIHeads`` (the second stage of Faster, Mask and Keypoint R-CNN)."""
    parts = ("box_roi_pool", "box_head", "box_predictor", "box_coder", "postprocess_detections")
    return all(hasattr(module, part) for part in parts)


def is_proposal_network(module: nn.Module) -> bool:
    """Whether a module is torchvision's ``RegionProposalNetwork`` (the first stage of the R-CNNs)."""
    return all(hasattr(module, part) for part in ("head", "anchor_generator", "box_coder", "filter_proposals"))


def is_rcnn(model: nn.Module) -> bool:
    """Whether the model is a torchvision R-CNN (``GeneralizedRCNN``: Faster, Mask, Keypoint R-CNN), by its parts."""
    proposer, head = getattr(model, "rpn", None), getattr(model, "roi_heads", None)
    return (isinstance(proposer, nn.Module) and is_proposal_network(proposer)) or (
        isinstance(head, nn.Module) and is_box_head(head)
    )
