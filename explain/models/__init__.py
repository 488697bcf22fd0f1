"""Models: the spec that pairs a network with its preprocessing, class names and task (``spec.py``); loading by
name (``loaders.py``); users' checkpoints (``checkpoints.py``); the bundled EfficientNet-Lite0
(``efficientnet_lite0.py``); object-query detectors and segmenters answering as torchvision's
(``query_models.py``); Ultralytics YOLO answering as torchvision's detectors (``yolo.py``)."""

from .checkpoints import lite0_state_to_timm, read_state_dict
from .loaders import TIMM_PREFIX, available_models, imagenet_labels, load_model, load_user_model
from .query_models import QueryDetector, QuerySegmenter
from .spec import (
    IMAGENET_PREPROCESSING,
    ClipPreprocessing,
    ImageLike,
    InputPreprocessing,
    ModelSpec,
    Preprocessing,
    SignalPreprocessing,
    Task,
    VolumePreprocessing,
)
from .yolo import YoloDetector, load_yolo

__all__ = [
    "IMAGENET_PREPROCESSING",
    "TIMM_PREFIX",
    "ClipPreprocessing",
    "ImageLike",
    "InputPreprocessing",
    "ModelSpec",
    "Preprocessing",
    "QueryDetector",
    "QuerySegmenter",
    "SignalPreprocessing",
    "Task",
    "VolumePreprocessing",
    "YoloDetector",
    "available_models",
    "imagenet_labels",
    "lite0_state_to_timm",
    "load_model",
    "load_user_model",
    "load_yolo",
    "read_state_dict",
]
