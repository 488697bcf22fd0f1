"""Ultralytics YOLO detectors (YOLOv8, YOLO11 and their family) answering as torchvision's detectors do.

Ultralytics is AGPL-3.0 and an optional extra (``pip install "explain[yolo]"``): it is imported only when a YOLO
model is asked for, and nothing of its code is copied here. What this module does itself: the letterbox, in
torch, with Ultralytics' geometry (the image scaled to fit ``size`` with its aspect kept, padded to a multiple of
the model's stride, centred, with grey 114); non-maximum suppression with torchvision's ``batched_nms``; and the
mapping of boxes back to the input's pixels.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ModelLoadError, first_line

PAD_VALUE = 114 / 255  # Ultralytics' letterbox grey, on [0, 1] images


@dataclass(frozen=True)
class Letterboxed:
    """A batch on its letterbox canvas, read by :func:`explain.core.detectors.canvas_recorded`.

    Attributes:
        tensors: The canvas batch (N, 3, H, W).
        image_sizes: Each image's (h, w) on the canvas.
        offset: The (top, left) of the images on the canvas.
        scale: Canvas pixels per input pixel.
    """

    tensors: Tensor
    image_sizes: list[tuple[int, int]]
    offset: tuple[int, int]
    scale: float


class Letterbox(nn.Module):
    """Ultralytics' letterbox of [0, 1] images (N, 3, H, W), in torch.

    Args:
        size: The side the image is scaled to fit.
        stride: The model's largest stride: the canvas is padded to a multiple of it, no more.
    """

    def __init__(self, size: int = 640, stride: int = 32) -> None:
        super().__init__()
        self.size, self.stride = size, stride

    def forward(self, x: Tensor) -> Letterboxed:
        height, width = x.shape[-2:]
        scale = min(self.size / height, self.size / width)
        new_h, new_w = max(round(height * scale), 1), max(round(width * scale), 1)
        pad_h, pad_w = (self.size - new_h) % self.stride / 2, (self.size - new_w) % self.stride / 2
        top, bottom = round(pad_h - 0.1), round(pad_h + 0.1)
        left, right = round(pad_w - 0.1), round(pad_w + 0.1)
        resized = x if (new_h, new_w) == (height, width) else F.interpolate(x, size=(new_h, new_w), mode="bilinear")
        canvas = F.pad(resized, (left, right, top, bottom), value=PAD_VALUE)
        return Letterboxed(canvas, [(new_h, new_w)] * len(x), (top, left), scale)


class YoloDetector(nn.Module):
    """An Ultralytics detection, segmentation or pose model whose output is torchvision's: one dict per image of
    ``"boxes"`` (x1, y1, x2, y2 in input pixels), ``"labels"`` and ``"scores"``; for a segmentation model
    ``"masks"`` (detections, 1, H, W), as Mask R-CNN's, for :class:`explain.targets.InstanceTarget`; for a pose
    model ``"keypoints"`` and ``"keypoints_scores"``, as Keypoint R-CNN's, for
    :class:`explain.targets.KeypointTarget`; for an oriented (OBB) model ``"rboxes"`` (cx, cy, w, h, angle in input
    pixels), suppressed by their rotated IoU, with ``"boxes"`` the upright boxes around them, for
    :class:`explain.targets.OrientedDetectionTarget`.

    The input, [0, 1] RGB images of any size, is letterboxed as Ultralytics predicts (see :class:`Letterbox`).
    The model's raw predictions, one row per anchor with its box and its class scores, go through torchvision's
    class-wise NMS at ``iou``, keeping rows that score at least ``conf`` (at most ``max_det`` per image). Each kept
    detection's score is its own row's class score: its gradient is that row's. The neck's levels, the maps the
    model's ``Detect`` head reads (its ``f``), are the automatic layers (:attr:`feature_levels`), fused.

    The head's branches (each level's boxes, classes and mask coefficients) are its :attr:`local_heads`: during a
    call, each is differentiated only over the window of cells its gradient reaches
    (:func:`explain.core.speedups.windows.windowed_heads`). One detection's score reaches one cell of one level's class
    branch: its backward recomputes that branch on the cell's receptive field and skips the other branches, and
    the neck behind them.

    Args:
        model: An Ultralytics ``DetectionModel`` or ``SegmentationModel`` (``ultralytics.nn.tasks``), in eval mode.
        size: The letterbox's side.
        conf: The least class score of a row kept for NMS (:attr:`score_thresh`, lowered for a call whose
            detection target asks for less: see :func:`explain.core.detectors.thresholds_lowered`).
        iou: NMS's IoU threshold.
        max_det: The most detections per image.
    """

    def __init__(self, model: nn.Module, size: int = 640, conf: float = 0.25, iou: float = 0.7, max_det: int = 300):
        super().__init__()
        self.model = model
        self.transform = Letterbox(size, int(max(model.stride)))
        self.score_thresh, self.iou, self.max_det = float(conf), iou, max_det  # score_thresh: as torchvision's
        head = model.model[-1]
        self.classes = int(head.nc)
        self.feature_levels = [f"model.model.{index}" for index in head.f]
        self.local_heads = [branch for name in ("cv2", "cv3", "cv4") for branch in getattr(head, name, ())]
        names = getattr(model, "names", None) or {}
        self.labels = [str(names.get(i, i)) for i in range(self.classes)]
        shape = getattr(head, "kpt_shape", None)  # a pose head's (keypoints, 2 or 3 values each)
        self.keypoint_shape = (int(shape[0]), int(shape[1])) if shape is not None else None
        self.oriented = type(head).__name__ == "OBB"  # its rows end with each box's angle

    def forward(self, x: Tensor) -> list[dict[str, Tensor]]:
        from torchvision.ops import batched_nms

        boxed = self.transform(x)
        self._usable_cache()
        predictions = self.model(boxed.tensors)
        first = predictions[0] if isinstance(predictions, (tuple, list)) else predictions
        rows, prototypes = first if isinstance(first, (tuple, list)) else (first, None)  # (N, 4 + classes [+ nm], A)
        centres, sizes = rows[:, :2].transpose(1, 2), rows[:, 2:4].transpose(1, 2)
        on_canvas = torch.cat([centres - sizes / 2, centres + sizes / 2], dim=-1)
        top, left = boxed.offset
        corners = (on_canvas - on_canvas.new_tensor([left, top, left, top])) / boxed.scale  # input pixels
        scores, labels = rows[:, 4 : 4 + self.classes].detach().transpose(1, 2).max(dim=-1)
        logits = _class_logits(predictions, rows, self.classes)
        detections = []
        for i, (image_corners, image_scores, image_labels) in enumerate(zip(corners, scores, labels)):
            candidates = (image_scores >= self.score_thresh).nonzero()[:, 0]
            if self.oriented:
                rotated = self._rotated(rows[i, :, candidates].T, boxed)
                kept = _rotated_nms(rotated.detach(), image_scores[candidates], image_labels[candidates], self.iou)
            else:
                kept = batched_nms(image_corners[candidates].detach(), image_scores[candidates],
                                   image_labels[candidates], self.iou)  # fmt: skip
            chosen = candidates[kept[: self.max_det]]
            found = {
                "boxes": image_corners[chosen],
                "labels": image_labels[chosen],
                "scores": _kept_scores(rows[i], None if logits is None else logits[i], image_labels[chosen], chosen),
            }
            if prototypes is not None:
                coefficients = rows[i, 4 + self.classes :, chosen].T
                found["masks"] = self._masks(prototypes[i], coefficients, on_canvas[i, chosen].detach(), boxed, x)
            if self.keypoint_shape is not None:
                found.update(self._keypoints(rows[i, 4 + self.classes :, chosen].T, boxed))
            if self.oriented:
                found.update(self._oriented(self._rotated(rows[i, :, chosen].T, boxed)))
            detections.append(found)
        return detections

    @staticmethod
    def _masks(prototypes: Tensor, coefficients: Tensor, boxes: Tensor, boxed: Letterboxed, x: Tensor) -> Tensor:
        """A segmentation model's masks of the kept detections, (K, 1, H, W) probabilities over the input: each
        detection's coefficients times the prototypes, upsampled to the canvas, a sigmoid, zero outside the
        detection's box (as Ultralytics crops them), the letterbox cut off and resized to the input."""
        logits = (coefficients @ prototypes.flatten(1)).reshape(len(coefficients), *prototypes.shape[-2:])
        logits = F.interpolate(logits[None], size=boxed.tensors.shape[-2:], mode="bilinear")[0]
        rows = torch.arange(logits.shape[-2], device=logits.device, dtype=boxes.dtype)[None, :, None]
        columns = torch.arange(logits.shape[-1], device=logits.device, dtype=boxes.dtype)[None, None, :]
        x1, y1, x2, y2 = (boxes[:, k, None, None] for k in range(4))
        inside = (columns >= x1) & (columns < x2) & (rows >= y1) & (rows < y2)
        top, left = boxed.offset
        (height, width) = boxed.image_sizes[0]
        masks = (logits.sigmoid() * inside)[:, top : top + height, left : left + width]
        return F.interpolate(masks[:, None], size=x.shape[-2:], mode="bilinear")

    def _keypoints(self, values: Tensor, boxed: Letterboxed) -> dict[str, Tensor]:
        """A pose model's keypoints of the kept detections from their rows' keypoint values (K, keypoints x dims):
        ``"keypoints"`` (K, keypoints, 3), x and y in input pixels and the confidence, and ``"keypoints_scores"``
        (K, keypoints), the confidence (the sigmoid of the keypoint's visibility logit) with its gradient; a
        model of two values a keypoint has no confidence: 1."""
        count, dims = self.keypoint_shape or (0, 3)
        points = values.reshape(len(values), count, dims)
        top, left = boxed.offset
        where = (points[..., :2] - points.new_tensor([left, top])) / boxed.scale
        confidence = points[..., 2] if dims == 3 else torch.ones_like(points[..., 0])
        return {"keypoints": torch.cat([where, confidence[..., None]], dim=-1), "keypoints_scores": confidence}

    def _rotated(self, rows: Tensor, boxed: Letterboxed) -> Tensor:
        """An OBB model's oriented boxes from their rows (K, 4 + classes + 1): (cx, cy, w, h, angle) in input
        pixels, mapped back through the letterbox (its scale is the same along both axes, so the angle stays)."""
        top, left = boxed.offset
        centre = (rows[:, :2] - rows.new_tensor([left, top])) / boxed.scale
        return torch.cat([centre, rows[:, 2:4] / boxed.scale, rows[:, -1:]], dim=1)

    @staticmethod
    def _oriented(rotated: Tensor) -> dict[str, Tensor]:
        """An OBB model's detections' ``"rboxes"`` and, as ``"boxes"``, the upright boxes around them."""
        from ..targets.oriented import upright_boxes

        return {"rboxes": rotated, "boxes": upright_boxes(rotated)}

    def _usable_cache(self) -> None:
        """The Detect head caches its anchors and strides at the first forward of an input shape. Made under
        ``torch.inference_mode()`` (a user's plain prediction), they are inference tensors, which a pass with
        autograd cannot use: such a cache is replaced by normal copies of the same values."""
        head = self.model.model[-1]
        if torch.is_inference_mode_enabled():
            return
        for name in ("anchors", "strides"):
            cached = getattr(head, name, None)
            if isinstance(cached, Tensor) and cached.is_inference():
                setattr(head, name, cached.clone())


NMS_BLOCK = 256  # boxes whose overlaps the rotated NMS computes together, once the earlier ones are settled


def _rotated_nms(boxes: Tensor, scores: Tensor, labels: Tensor, iou: float) -> Tensor:
    """Greedy non-maximum suppression of oriented boxes (K, 5) by their exact rotated IoU, class by class: the
    indices kept, best score first. The exact IoU is computed only for the pairs of a class whose upright hulls
    overlap enough for it to reach ``iou``, block by block of ``NMS_BLOCK`` boxes in score order, and only for the
    boxes of a block that no earlier box suppressed; the greedy pass then reads which box suppresses which.
    (Ultralytics suppresses by a probabilistic IoU of the boxes' Gaussians: the kept sets can differ where two
    boxes' overlaps lie near ``iou``.)"""
    from ..targets.oriented import rotated_pair_iou, upright_boxes

    order = scores.argsort(descending=True)
    boxes, labels = boxes[order], labels[order]
    hulls = upright_boxes(boxes)
    low, high = (
        torch.maximum(hulls[:, None, :2], hulls[None, :, :2]),
        torch.minimum(hulls[:, None, 2:], hulls[None, :, 2:]),
    )
    reach = (high - low).clamp_min(0).prod(dim=-1)  # the hulls' overlap: at least the boxes' own overlap
    areas = boxes[:, 2] * boxes[:, 3]
    # IoU >= iou needs an overlap of at least iou (A + B) / (1 + iou): pairs whose hulls overlap less are apart
    candidates = (reach >= iou * (areas[:, None] + areas[None]) / (1 + iou)) & (labels[:, None] == labels[None])
    candidates = torch.triu(candidates, diagonal=1).cpu().numpy()
    alive = np.ones(len(order), dtype=bool)
    for start in range(0, len(order), NMS_BLOCK):  # the rows of boxes already suppressed are never computed
        rows = np.arange(start, min(start + NMS_BLOCK, len(order)))
        first, second = np.nonzero(candidates[rows] & alive[rows, None])
        first += start
        hits = (rotated_pair_iou(boxes[first], boxes[second]) >= iou).cpu().numpy() if len(first) else first
        table = np.zeros((len(rows), len(order)), dtype=bool)
        table[first[hits] - start, second[hits]] = True
        for k in rows:  # greedy: a box still alive suppresses the later boxes it overlaps
            if alive[k]:
                alive[k + 1 :] &= ~table[k - start, k + 1 :]
    return order[torch.from_numpy(alive).to(order.device)]


def _class_logits(predictions: object, rows: Tensor, classes: int) -> Tensor | None:
    """The raw class logits (N, classes, anchors) a Detect head returns beside its decoded rows (Ultralytics 8.4:
    the ``"scores"`` of its raw prediction dict), or None where its output has no such tensor."""
    raw = predictions[1] if isinstance(predictions, (tuple, list)) and len(predictions) > 1 else None
    logits = raw.get("scores") if isinstance(raw, dict) else None
    expected = (rows.shape[0], classes, rows.shape[2])
    return logits if isinstance(logits, Tensor) and tuple(logits.shape) == expected else None


def _kept_scores(rows: Tensor, logits: Tensor | None, labels: Tensor, chosen: Tensor) -> Tensor:
    """The kept detections' scores, with their gradient. Where the head gives its raw class logits and their
    sigmoid is the decoded rows' score, that sigmoid: its gradient reaches the class branches without passing
    through the decoding of every anchor's box. Else the decoded rows' own scores."""
    decoded = rows[4 + labels, chosen]
    if logits is not None:
        found = logits[labels, chosen].sigmoid()
        if torch.allclose(found.detach(), decoded.detach(), rtol=1e-5, atol=1e-6):
            return found
    return decoded


@contextmanager
def _process_kept() -> Iterator[None]:
    """Importing Ultralytics changes the whole process: it replaces ``PIL.Image.open`` with an opener that, on a
    file Pillow cannot identify, installs a package with pip; it sets ``OMP_NUM_THREADS=1`` and other variables
    in the environment, which every worker process started later inherits; it changes torch's and numpy's print
    options and the warning filters. explain's promise is a one-line error for a hostile file and no change to
    the user's process: what the import changed is put back."""
    import warnings

    import numpy as np
    from PIL import Image
    from torch._tensor_str import PRINT_OPTS

    opener, environment, filters = Image.open, dict(os.environ), list(warnings.filters)
    numpy_options, torch_options = np.get_printoptions(), dict(vars(PRINT_OPTS))
    try:
        yield
    finally:
        Image.open = opener
        for name in set(os.environ) - set(environment):
            del os.environ[name]
        os.environ.update(environment)
        warnings.filters[:] = filters
        np.set_printoptions(**numpy_options)
        vars(PRINT_OPTS).update(torch_options)


def load_yolo(path: str | Path) -> YoloDetector:
    """A YOLO detector from an Ultralytics checkpoint (``.pt``) or a model yaml (``.yaml``: random weights; a
    bare name such as ``yolo11n.yaml`` is one of Ultralytics' own).

    A checkpoint is read by Ultralytics' own loader, which unpickles it: load only files you trust.

    Raises:
        ModelLoadError: Ultralytics is not installed, the file cannot be read, or its model is no detector.
    """
    try:
        with _process_kept():
            from ultralytics.nn.tasks import (
                DetectionModel,
                OBBModel,
                PoseModel,
                SegmentationModel,
                guess_model_task,
                load_checkpoint,
            )
    except ImportError:
        raise ModelLoadError(
            f'{path}: a YOLO model needs Ultralytics (AGPL-3.0): pip install "explain[yolo]"'
        ) from None
    path = Path(path)
    if path.suffix not in (".yaml", ".yml") and not path.is_file():  # Ultralytics would try to download it
        raise ModelLoadError(f"{path}: no such checkpoint file")
    try:
        if path.suffix in (".yaml", ".yml"):
            tasks = {"segment": SegmentationModel, "pose": PoseModel, "obb": OBBModel}
            model = tasks.get(guess_model_task(str(path)), DetectionModel)(str(path), verbose=False)  # its head
        else:
            model = load_checkpoint(str(path), device="cpu")[0]
    except Exception as err:  # Ultralytics' loaders raise many kinds; the user gets one line
        raise ModelLoadError(f"{path}: cannot load a YOLO model: {first_line(err)}") from None
    if type(model).__name__ not in ("DetectionModel", "SegmentationModel", "PoseModel", "OBBModel"):
        raise ModelLoadError(f"{path}: a {type(model).__name__}, not a YOLO detection, segmentation, pose or OBB model")
    return YoloDetector(model.float()).eval()
