"""The CAM methods, by name: each supplies only its formula; :class:`explain.core.engine.CAM` does the rest.

Files: ``gradient.py`` (maps from activations and gradients), ``activation.py`` (activations alone),
``factorization.py`` (concepts factorized out of a layer), ``perturbation.py`` (scores of masked or ablated
inputs), ``guided.py`` (input-resolution guided gradients), ``attribution.py`` (pixel attributions of the input's
gradient), ``masking.py`` (the scores of the input with parts of it
masked), ``superpixels.py`` (the scores of the input with superpixels left out), ``rollout.py`` (vision
transformers' attention rolled out through the layers), ``legrad.py`` (each block's read-out at its attention),
``chefer.py`` (relevance through a transformer's blocks), ``scales.py`` (a method over rescaled, slid windows).
The relevance propagations (LRP, AttnLRP, CP-LRP) live with their engine, in :mod:`explain.relevance`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from importlib import import_module
from typing import Any

from torch import Tensor, nn

from ..catalog import FAST_METHOD_NAMES, METHOD_CATALOG, check_method
from ..core.engine import CAM
from ..core.layers import LayerSpec
from ..errors import ExplainError
from ..lazy_names import lazy_names
from ..targets import TargetLike
from .factorization import FactorizedConcepts

# Each method's name to its class: the catalog's, read from the classes themselves (see explain.catalog).
METHODS: dict[str, type[CAM]] = {
    entry.name: getattr(import_module(f"..{entry.module}", __name__), entry.cls) for entry in METHOD_CATALOG
}
globals().update({cls.__name__: cls for cls in METHODS.values()})  # explain.methods.GradCAM, ...

# One forward and at most one backward per target: what ``--method all`` compares.
FAST_METHODS = list(FAST_METHOD_NAMES)


@functools.cache
def method_options(method: str) -> frozenset[str]:
    """The options (keyword arguments besides ``labels``) that a method's class takes, read once per method."""
    names: set[str] = set()
    for cls in METHODS[method].__mro__:
        if "__init__" not in cls.__dict__:
            continue
        parameters = inspect.signature(cls.__dict__["__init__"]).parameters.values()
        names |= {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return frozenset(names - {"labels"})


def create_method(
    method: str,
    model: nn.Module,
    layer: LayerSpec | Sequence[str | nn.Module] = None,
    *,
    labels: Sequence[str] | None = None,
    **options: Any,
) -> CAM:
    """Build a method by name (see ``METHODS``), with its options.

    Raises:
        ExplainError: The name is unknown (close names are suggested) or an option
            does not apply to the method.
    """
    check_method(method)
    unknown = sorted(set(options) - method_options(method))
    if unknown:
        raise ExplainError(f"option(s) {', '.join(unknown)} do not apply to method {method!r}")
    return METHODS[method](model, layer, labels=labels, **options)


def cam(
    model: nn.Module,
    x: Tensor,
    method: str = "gradcam",
    layer: LayerSpec | Sequence[str | nn.Module] = None,
    target: TargetLike = None,
    *,
    resize: bool = True,
    normalize: bool = True,
    labels: Sequence[str] | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> Tensor:
    """Heatmaps of any method for a batch, in one call.

    Args:
        model: A classifier returning (N, classes) scores; left exactly as it was.
        x: Normalized inputs: images (N, C, H, W), signals (N, C, L), volumes or clips (N, C, D, H, W).
        method: A name from ``explain.METHODS``: ``"gradcam"``, ``"gradcampp"``,
            ``"scorecam"``, ``"guided_backprop"``...
        layer: Dotted layer name (``"layer4"``, ``"features.28"``), module, a list of
            them (fused), or None for the last layer with a spatial output.
        target: None for each image's top-1 class; a class index or name; one index
            per image; or a callable mapping the model output to one score per image.
        resize: Upsample to x's spatial size; False keeps the feature-map resolution.
        normalize: Min-max normalize each map to [0, 1]; False keeps the raw map.
        labels: Class names, needed for a class-name target.
        model_kwargs: Further keyword arguments of the model's forward, passed to every
            forward the method runs (see :meth:`explain.core.engine.CAM.__call__`).
        **options: The method's options: ``fuse``, ``aug_smooth``, ``eigen_smooth``,
            ``smooth_samples``, ``smooth_sigma``, ``batch_size``, ``seed`` (see
            :class:`explain.core.engine.CAM`), ``samples``/``sigma`` for SS-CAM and IS-CAM, and ``steps``, ``rule``
            and ``baseline`` for Integrated Gradients.

    Returns:
        float32 heatmaps (N, *spatial) on x's device, (N, H, W) for images; maps shaped as x for the guided
        methods.
    """
    explainer = create_method(method, model, layer, labels=labels, **options)
    return explainer(x, target, resize=resize, normalize=normalize, model_kwargs=model_kwargs).cams


def gradcam(
    model: nn.Module,
    x: Tensor,
    layer: LayerSpec | Sequence[str | nn.Module] = None,
    target: TargetLike = None,
    *,
    resize: bool = True,
    normalize: bool = True,
    labels: Sequence[str] | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """Grad-CAM heatmaps for a batch: :func:`cam` with ``method="gradcam"``.

    Returns:
        float32 heatmaps (N, *spatial) on x's device, (N, H, W) for images.
    """
    return cam(
        model, x, "gradcam", layer, target, resize=resize, normalize=normalize, labels=labels, model_kwargs=model_kwargs
    )


__all__ = [  # the method classes, from the catalog, then the rest
    *(entry.cls for entry in METHOD_CATALOG),
    "FAST_METHODS",
    "METHODS",
    "FactorizedConcepts",
    "cam",
    "create_method",
    "gradcam",
    "method_options",
]

# Names that left this module, kept one release: every method is a CAM, and DFF's result is FactorizedConcepts.
__getattr__, _ = lazy_names(
    __name__,
    {},
    deprecated={
        "Method": (".core.engine", "CAM", "explain.CAM"),
        "Concepts": ("factorization", "FactorizedConcepts", "explain.methods.FactorizedConcepts"),
    },
)
