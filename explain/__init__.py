"""explain: Grad-CAM style heatmaps for PyTorch classifiers, fast and without side effects.

>>> import explain
>>> cams = explain.gradcam(model, x)          # (N, H, W) in [0, 1], on x's device
>>> cams = explain.cam(model, x, method="gradcampp", layer=["layer3", "layer4"])
>>> explain.overlay(image, cams[0]).save("cam.png")

Importing the package is cheap: each name below is imported from its module on first use,
so ``explain --help`` and ``explain --version`` start without loading torch. The methods are reached by name
(``explain.METHODS``, ``explain.cam(model, x, method=...)``) or as classes in :mod:`explain.methods`;
Grad-CAM's class stays here too.
"""

from __future__ import annotations

from .catalog import METHOD_CATALOG
from .lazy_names import lazy_names

__version__ = "0.2.0"

# Each public name and the module that defines it.
_EXPORTS = {
    "CAM": "core.engine",
    "CAMResult": "core.engine",
    "ExplainError": "errors",
    "ImageLoadError": "errors",
    "LayerError": "errors",
    "ModelLoadError": "errors",
    "TargetError": "errors",
    "NothingToExplain": "errors",
    "ImageRefused": "errors",
    "ExportOptions": "export.settings",
    "MethodSelection": "export.settings",
    "RenderOptions": "export.settings",
    "ExportSummary": "export.run",
    "export_heatmaps": "export.run",
    "write_gallery": "export.gallery",
    "load_image": "io.images",
    "forget": "core.context",
    "LayerInfo": "core.layers",
    "candidate_layers": "core.layers",
    "find_auto_layers": "core.layers",
    "ModelSpec": "models.spec",
    "AnswerMaps": "tasks.answers",
    "explain_answer": "tasks.answers",
    "explain_prompts": "tasks.answers",
    "explain_queries": "tasks.answers",
    "load_model": "models.loaders",
    "figure": "io.render",
    "overlay": "io.render",
    **dict.fromkeys(["FAST_METHODS", "METHODS", "GradCAM", "cam", "create_method", "gradcam"], "methods"),
}

__all__ = ["__version__", *sorted(_EXPORTS)]


# Reached as explain.metrics (and so on) after a plain ``import explain``.
_SUBPACKAGES = {"concepts", "metrics", "methods", "targets", "models"}

# The other method classes left the top for explain.methods (and METHODS, cam(method=...)): kept one release.
_DEPRECATED = {
    entry.cls: ("methods", entry.cls, f"explain.methods.{entry.cls}, or explain.cam(model, x, method={entry.name!r})")
    for entry in METHOD_CATALOG
    if entry.cls not in _EXPORTS
}

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, _SUBPACKAGES, _DEPRECATED)
