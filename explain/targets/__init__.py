"""What to explain: target objects that turn a model's output into the scores whose gradients are explained.

``base.py`` holds the protocol (:class:`Target` binds on a call's plain pass into a :class:`BoundTarget`, which
scores any later pass); ``classification.py`` a classifier's classes, regression values and embedding
similarities; ``regression.py`` a dense regression over a region (depth); ``segmentation.py`` a segmenter's
regions; ``detection.py`` a detector's boxes and an instance segmenter's instances; ``keypoints.py`` a pose
model's keypoints; ``oriented.py`` an oriented detector's rotated boxes; ``prompts.py`` the mask a promptable
segmenter (SAM) draws; ``language.py`` the tokens of a language model's answer; ``shorthand.py`` what an int, a
name, a sequence or a callable stands for.
"""

from .base import (
    BoundTarget,
    CallableTarget,
    OutputPicker,
    Target,
    TargetLike,
    bound_on,
    class_index,
    per_image,
    ragged,
    read_output,
)
from .classification import (
    ClassesTarget,
    ClassScore,
    ClassTarget,
    ContrastTarget,
    RegressionTarget,
    SimilarityTarget,
    TopK,
)
from .detection import DetectionTarget, InstanceTarget, box_iou
from .keypoints import COCO_KEYPOINTS, KeypointTarget
from .language import TokenTarget
from .oriented import OrientedDetectionTarget, rotated_iou
from .prompts import PromptMaskTarget
from .regression import RegionTarget, nearer_sign
from .segmentation import SegmentationTarget
from .shorthand import as_target

__all__ = [
    "COCO_KEYPOINTS",
    "BoundTarget",
    "CallableTarget",
    "ClassScore",
    "ClassTarget",
    "ClassesTarget",
    "ContrastTarget",
    "DetectionTarget",
    "InstanceTarget",
    "KeypointTarget",
    "OrientedDetectionTarget",
    "OutputPicker",
    "PromptMaskTarget",
    "RegionTarget",
    "RegressionTarget",
    "SegmentationTarget",
    "SimilarityTarget",
    "Target",
    "TargetLike",
    "TokenTarget",
    "TopK",
    "as_target",
    "bound_on",
    "box_iou",
    "class_index",
    "nearer_sign",
    "per_image",
    "ragged",
    "read_output",
    "rotated_iou",
]
