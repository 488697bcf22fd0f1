"""CAM methods: each supplies only its formula; :class:`explain.engine.CAM` does the rest."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from .engine import CAM
from .layers import LayerSpec
from .targets import Target


class GradCAM(CAM):
    r"""Grad-CAM: Selvaraju et al., "Grad-CAM: Visual Explanations from Deep Networks
    via Gradient-based Localization", ICCV 2017 (arXiv:1610.02391).

    Each channel is weighted by the spatial mean of the score's gradient,

    .. math:: w_c = \frac{1}{hw} \sum_{i,j} \frac{\partial y}{\partial A_{c,ij}}, \qquad
              \mathrm{cam} = \mathrm{ReLU}\Big(\sum_c w_c A_c\Big).
    """

    name = "gradcam"

    def weights(self, activations: Tensor, gradients: Tensor) -> Tensor:
        return gradients.mean(dim=(-2, -1))


def gradcam(
    model: nn.Module,
    x: Tensor,
    layer: LayerSpec = None,
    target: Target = None,
    *,
    resize: bool = True,
    normalize: bool = True,
    labels: Sequence[str] | None = None,
) -> Tensor:
    """Grad-CAM heatmaps for a batch, in one call.

    Args:
        model: A classifier returning (N, classes) scores; left exactly as it was.
        x: Normalized images (N, 3, H, W).
        layer: Dotted layer name (``"layer4"``, ``"features.28"``), module, or None
            for the last layer with a spatial output.
        target: None for each image's top-1 class; a class index or name; one index
            per image; or a callable mapping the model output to one score per image.
        resize: Upsample to x's (H, W); False keeps the feature-map resolution.
        normalize: Min-max normalize each map to [0, 1]; False keeps the raw ReLU'd map.
        labels: Class names, needed for a class-name target.

    Returns:
        float32 heatmaps (N, H, W) on x's device.
    """
    return GradCAM(model, layer, labels=labels)(x, target, resize=resize, normalize=normalize).cams
