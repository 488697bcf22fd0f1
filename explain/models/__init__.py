"""Models: the spec that pairs a network with its preprocessing, class names and task (``spec.py``); loading by
name (``loaders.py``); users' checkpoints (``checkpoints.py``); the bundled EfficientNet-Lite0
(``efficientnet_lite0.py``); object-query detectors and segmenters answering as torchvision's
(``query_models.py``); vision-language models reading fixed text (``vision_language.py``); Ultralytics YOLO
answering as torchvision's detectors (``yolo.py``); Hugging Face depth estimators and promptable segmenters by
folder (``dense.py``, ``sam.py``); the names the command line takes (``names.py``, read without
torch); pretrained weights from the local cache first (``cache.py``). Each public name below is imported from its
module on first use.
"""

from __future__ import annotations

from ..lazy_names import lazy_names

# Each public name and the module that defines it.
_EXPORTS = {
    "lite0_state_to_timm": "checkpoints",
    "read_state_dict": "checkpoints",
    "DepthEstimator": "dense",
    "ProcessorResize": "dense",
    "dense_kind": "dense",
    "load_dense_model": "dense",
    "TIMM_PREFIX": "loaders",
    "available_models": "loaders",
    "imagenet_labels": "loaders",
    "load_model": "loaders",
    "load_user_model": "loaders",
    "QueryDetector": "query_models",
    "QuerySegmenter": "query_models",
    "TextQueryDetector": "query_models",
    "SamPrompted": "sam",
    "SamResize": "sam",
    "IMAGENET_PREPROCESSING": "spec",
    "UNIT_PREPROCESSING": "spec",
    "ClipPreprocessing": "spec",
    "ImageLike": "spec",
    "InputPreprocessing": "spec",
    "ModelSpec": "spec",
    "Preprocessing": "spec",
    "SignalPreprocessing": "spec",
    "Task": "spec",
    "VolumePreprocessing": "spec",
    "TextPrompts": "vision_language",
    "VisionLanguage": "vision_language",
    "generate_answer": "vision_language",
    "YoloDetector": "yolo",
    "load_yolo": "yolo",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
