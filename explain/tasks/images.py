"""The kinds of output of models that read images, clips, scans or signals: a classifier's classes, a segmenter's
classes, a detector's boxes (upright or oriented), a pose model's keypoints, a depth estimator's region, a
promptable segmenter's mask."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from ..errors import ExplainError
from ..io.images import load_image
from ..metrics.scoring import plain_forwards
from ..models import ModelSpec
from ..models.sam import SamPrompted
from ..targets import (
    ClassTarget,
    DetectionTarget,
    KeypointTarget,
    OrientedDetectionTarget,
    PromptMaskTarget,
    RegionTarget,
    SegmentationTarget,
    Target,
    TopK,
    nearer_sign,
)
from ..targets.base import bound_on, read_output
from .asked import DETECTION_THRESHOLD, Asked, Prompt, slug
from .base import Task, Viewed

BACKGROUND = "__background__"  # the name of class 0 of torchvision's segmenters and detectors


def threshold(asked: Asked) -> float:
    """The least score of an explained detection: the one asked, else :data:`DETECTION_THRESHOLD`."""
    return DETECTION_THRESHOLD if asked.score_threshold is None else asked.score_threshold


class Classification(Task):
    """A classifier's class: ``target`` for every image, else each image's top class (or its ``topk`` top)."""

    name, map_of, classifies, click = "classification", "class", True, ""
    evaluates = True
    takes = frozenset({"topk", "metrics"})

    def target(self, spec: ModelSpec, asked: Asked) -> Target:
        return TopK(asked.topk) if asked.topk else ClassTarget(asked.target)

    def tag(self, k: int, class_name: str, method: str, topk: int | None) -> str:
        return f".{method}" + (f".top{k + 1}" if topk else "")

    def evaluated(self, spec: ModelSpec, name: str, x: Tensor) -> Target | None:
        return None

    def view(self, spec: ModelSpec, prompt: tuple[float, ...], size: tuple[int, int], asked: Asked) -> Viewed:
        if prompt:
            raise ExplainError(f"a classifier's classes have no place on the photo; {spec.name} takes no prompt")
        return spec.model, ClassTarget(asked.target)


class Segmentation(Task):
    """A segmenter's class over the pixels it wins: ``target``, else every class that wins a pixel, the
    background left out."""

    name, map_of = "segmentation", "segment"
    evaluates = True
    click_label = "Click a segment to explain it"

    def target(self, spec: ModelSpec, asked: Asked) -> Target:
        return SegmentationTarget(asked.target, background=0 if spec.labels[0] == BACKGROUND else None)

    def tag(self, k: int, class_name: str, method: str, topk: int | None) -> str:
        return f".{method}.{slug(class_name)}"

    def evaluated(self, spec: ModelSpec, name: str, x: Tensor) -> Target | None:
        """The class that wins the most pixels, the background left out."""
        with plain_forwards(spec.model):
            winners = read_output(spec.model(x)).argmax(dim=1).flatten()
        counts = torch.bincount(winners, minlength=len(spec.labels))
        if spec.labels[0] == BACKGROUND:
            counts[0] = 0
        if not bool(counts.any()):
            raise ExplainError(f"{name}: the segmenter finds nothing but background in it to explain")
        return SegmentationTarget(int(counts.argmax()))


class Detection(Task):
    """A detector's boxes: every detection scoring at least ``score_threshold`` (of class ``target``, if given)."""

    name, map_of = "detection", "box"
    evaluates = True
    takes = frozenset({"keypoint", "score_threshold"})
    click_label = "Click a detection (or a pose's keypoint) to explain it"
    matched = DetectionTarget

    def target(self, spec: ModelSpec, asked: Asked) -> Target:
        return self.matched(labels=asked.target, score_threshold=threshold(asked))

    def tag(self, k: int, class_name: str, method: str, topk: int | None) -> str:
        return f".{method}.box{k + 1}"

    def evaluated(self, spec: ModelSpec, name: str, x: Tensor) -> Target | None:
        """The most confident detection, its box and label."""
        with plain_forwards(spec.model):
            output = spec.model(x)
        found = bound_on(self.matched(score_threshold=0.0), output, spec.labels)
        scores = torch.where(found.valid, found.probabilities, -torch.inf) if found.valid is not None else None
        empty = found.boxes is None or found.boxes.shape[1] == 0
        if empty or (scores is not None and not bool(scores.isfinite().any())):
            raise ExplainError(f"{name}: the detector finds nothing in it to explain")
        top = int((scores if scores is not None else found.probabilities)[0].argmax())
        return self.matched(boxes=found.boxes[0, top : top + 1], labels=found.classes[0, top : top + 1])


class OrientedBoxes(Detection):
    """An oriented-box detector's boxes, matched by their rotated IoU."""

    map_of = "oriented box"
    matched = OrientedDetectionTarget


class Keypoints(Detection):
    """A pose model's keypoint (``keypoint``: a name, an index, or ``"all"``) of each detection, scored by the
    model's own keypoint confidence; ``--figure`` draws each detection's keypoints in one strip."""

    name, map_of, strip, strip_title = "pose", "keypoint", "det{n}.keypoints", "detection {n}"

    def target(self, spec: ModelSpec, asked: Asked) -> Target:
        keypoint = asked.keypoint or "all"
        chosen = None if keypoint == "all" else int(keypoint) if keypoint.isdigit() else keypoint
        return KeypointTarget(chosen, labels=asked.target, score_threshold=threshold(asked))

    def tag(self, k: int, class_name: str, method: str, topk: int | None) -> str:
        return f".{method}.kp{k + 1}.{slug(class_name)}"


class DepthRegion(Task):
    """A depth estimator's mean depth over the prompt's region (the whole photo by default), in its direction."""

    name, map_of, click = "depth", "region", "region"
    takes = frozenset({"region"})
    click_label = "Click two corners of the region whose depth to explain"

    def target(self, spec: ModelSpec, asked: Asked) -> Target:
        prompt = asked.prompt
        if prompt.direction in ("nearer", "farther"):
            nearer = nearer_sign(spec.model)
            sign = nearer if prompt.direction == "nearer" else -nearer
        else:
            sign = 1 if prompt.direction == "larger" else -1
        if prompt.region_mask is not None:
            image = load_image(prompt.region_mask).convert("L")
            return RegionTarget(mask=torch.from_numpy(np.asarray(image) > 0), sign=sign)
        if prompt.region is not None:
            return RegionTarget(box=prompt.region, sign=sign)
        return RegionTarget(mask=torch.ones(1, 1), sign=sign)

    def tag(self, k: int, class_name: str, method: str, topk: int | None) -> str:
        return f".{method}.{class_name}"

    def view(self, spec: ModelSpec, prompt: tuple[float, ...], size: tuple[int, int], asked: Asked) -> Viewed:
        if len(prompt) not in (0, 4):
            raise ExplainError(f"a depth model's region is a box (x1, y1, x2, y2), got {len(prompt)} values")
        region = self.target(spec, replace(asked, prompt=Prompt(region=prompt or None)))  # type: ignore[arg-type]
        width, height = size
        return spec.model, region.drawn_on([(height, width)]) if isinstance(region, RegionTarget) else region


class PromptedMask(Task):
    """The mask a promptable segmenter (SAM) draws for its prompt, a point or a box in the photo's pixels."""

    name, map_of, click = "prompted", "mask", "prompt"
    takes = frozenset({"prompt"})
    click_label = "Click the photo to prompt the model: a point, or two corners of a box"

    def check(self, spec: ModelSpec, asked: Asked) -> None:
        super().check(spec, asked)
        if not asked.prompt.prompting:
            raise ExplainError(f"{spec.name} draws the mask of a prompt: give --point x,y or --box x1,y1,x2,y2")

    def target(self, spec: ModelSpec, asked: Asked) -> Target:
        return PromptMaskTarget()

    def explained(self, spec: ModelSpec, prompt: Prompt) -> ModelSpec:
        """The segmenter with its prompt fixed (:class:`explain.models.sam.SamPrompted`).

        Raises:
            ExplainError: The spec's preprocessing resizes the photo, so a prompt in its pixels would miss.
        """
        if getattr(spec.preprocessing, "input_size", None) is not None:  # the prompt is in the photo's pixels
            raise ExplainError(
                f"{spec.name} takes a prompt in the photo's pixels, so its preprocessing must keep the photo's size: "
                "give Preprocessing(None, ...) (SamPrompted resizes and pads the photo itself)"
            )
        points = [tuple(point) for point in prompt.points] or None
        return replace(spec, model=SamPrompted(spec.model, points=points, box=prompt.box))

    def tag(self, k: int, class_name: str, method: str, topk: int | None) -> str:
        return f".{method}.{class_name}"

    def probe_prompt(self, size: tuple[int, int]) -> tuple[float, ...]:
        """The photo's centre: the layers are those of any prompt."""
        return (size[0] / 2, size[1] / 2)

    def view(self, spec: ModelSpec, prompt: tuple[float, ...], size: tuple[int, int], asked: Asked) -> Viewed:
        if len(prompt) not in (2, 4):
            raise ExplainError(
                f"{spec.name} draws the mask of a prompt: give the view a point (x, y) or a box (x1, y1, x2, y2) "
                "of the photo, View(prompt=...)"
            )
        given = Prompt(points=(prompt,)) if len(prompt) == 2 else Prompt(box=prompt)  # type: ignore[arg-type]
        return self.explained(spec, given).model, self.target(spec, asked)
