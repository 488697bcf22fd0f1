"""explain: Grad-CAM style heatmaps for PyTorch classifiers, fast and without side effects.

>>> import explain
>>> cams = explain.gradcam(model, x)          # (N, H, W) in [0, 1], on x's device
>>> explain.overlay(image, cams[0]).save("cam.png")
"""

from .engine import CAM, CAMResult
from .errors import ExplainError, ImageLoadError, LayerError, ModelLoadError, TargetError
from .export import ExportOptions, export_heatmaps
from .image_io import load_image
from .methods import GradCAM, gradcam
from .models import ModelSpec, load_model
from .render import figure, overlay

__all__ = [
    "CAM",
    "CAMResult",
    "ExplainError",
    "ExportOptions",
    "GradCAM",
    "ImageLoadError",
    "LayerError",
    "ModelLoadError",
    "ModelSpec",
    "TargetError",
    "export_heatmaps",
    "figure",
    "gradcam",
    "load_image",
    "load_model",
    "overlay",
]
