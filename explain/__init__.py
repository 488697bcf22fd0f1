"""explain: Grad-CAM style heatmaps for PyTorch classifiers, fast and without side effects.

>>> import explain
>>> cams = explain.gradcam(model, x)          # (N, H, W) in [0, 1], on x's device
>>> cams = explain.cam(model, x, method="gradcampp", layer=["layer3", "layer4"])
>>> explain.overlay(image, cams[0]).save("cam.png")
"""

from .engine import CAM, CAMResult
from .errors import ExplainError, ImageLoadError, LayerError, ModelLoadError, TargetError
from .export import ExportOptions, export_heatmaps
from .image_io import load_image
from .methods import (
    FAST_METHODS,
    ISCAM,
    METHODS,
    SSCAM,
    AblationCAM,
    EigenCAM,
    EigenGradCAM,
    GradCAM,
    GradCAMElementWise,
    GradCAMPlusPlus,
    GuidedBackprop,
    GuidedGradCAM,
    HiResCAM,
    LayerCAM,
    OriginalCAM,
    RandomCAM,
    ScoreCAM,
    XGradCAM,
    cam,
    create_method,
    gradcam,
)
from .models import ModelSpec, load_model
from .render import figure, overlay

__all__ = [
    "CAM",
    "FAST_METHODS",
    "ISCAM",
    "METHODS",
    "SSCAM",
    "AblationCAM",
    "CAMResult",
    "EigenCAM",
    "EigenGradCAM",
    "ExplainError",
    "ExportOptions",
    "GradCAM",
    "GradCAMElementWise",
    "GradCAMPlusPlus",
    "GuidedBackprop",
    "GuidedGradCAM",
    "HiResCAM",
    "ImageLoadError",
    "LayerCAM",
    "LayerError",
    "ModelLoadError",
    "ModelSpec",
    "OriginalCAM",
    "RandomCAM",
    "ScoreCAM",
    "TargetError",
    "XGradCAM",
    "cam",
    "create_method",
    "export_heatmaps",
    "figure",
    "gradcam",
    "load_image",
    "load_model",
    "overlay",
]
