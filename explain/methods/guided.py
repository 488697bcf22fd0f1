"""Guided Backpropagation and Guided Grad-CAM: input-resolution maps, shaped as the input (N, C, *spatial),
that render as images.

Both fail the model-randomization sanity check of Adebayo et al., "Sanity Checks
for Saliency Maps", NeurIPS 2018 (arXiv:1810.03292): Guided Backpropagation
looks nearly the same for a trained network and for one whose weights were
randomized, because it mostly reconstructs the image's edges rather than
reflecting what the model learned. Use them for sharp pictures of edges, not as
evidence of what the model relies on; the CAM methods pass that check.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..core.engine import CAM, Capture, Needs
from ..core.layers import LayerSpec
from ..core.maps import map_axes
from ..core.rules import relu_rule
from ..errors import LayerError
from .gradient import GradCAM


def visible(gradients: Tensor, rank: int) -> Tensor:
    """Gradient images (..., C, *spatial) of ``rank`` spatial axes for display, in [0, 1]: standardized per
    image, at 0.1 per standard deviation around a grey 0.5, and clipped (the usual way to show guided maps)."""
    axes = (-rank - 1, *map_axes(rank))
    mean = gradients.mean(dim=axes, keepdim=True)
    spread = gradients.std(dim=axes, keepdim=True).clamp_min(torch.finfo(gradients.dtype).tiny)
    return (0.5 + 0.1 * (gradients - mean) / spread).clamp(0.0, 1.0)


class GuidedBackprop(CAM):
    r"""Guided Backpropagation: Springenberg et al., "Striving for Simplicity: The All
    Convolutional Net", ICLR 2015 workshop (arXiv:1412.6806).

    The gradient of the target score with respect to the input, where every ReLU
    passes back only positive gradients (at positions where its input was
    positive): :math:`R_{l} = \mathrm{ReLU}(R_{l+1}) \cdot [x_l > 0]`. The rule is
    full-backward hooks on the ``nn.ReLU`` and ``nn.ReLU6`` modules around the engine's
    forward and backward (see :func:`explain.core.rules.relu_rule`); ReLUs applied as
    functions are not guided. Fails the model-randomization sanity check (Adebayo et
    al. 2018): see this module's notes. Maps are shaped as the input, (N, C, *spatial); ``normalize``
    shows them as :func:`visible` does.

    Args:
        model: A classifier with ``nn.ReLU`` or ``nn.ReLU6`` modules; left as it was.
        layer: None: the map is at the input (a layer given is refused in one line).
        labels: Class names, to accept a class name as target.
    """

    name = "guided_backprop"
    title = "Guided Backprop (Springenberg et al. 2015)"
    needs = Needs(gradients=False, input_gradient=True, map_of_input=True)  # no layer's gradient: the input's
    reads_layer = False

    def __init__(self, model: nn.Module, layer: LayerSpec = None, *, labels: Sequence[str] | None = None) -> None:
        super().__init__(model, layer, labels=labels)

    rule = "guided"  # how the ReLUs pass gradients back (see relu_rule)

    @contextmanager
    def backward_rule(self, x: Tensor, model_kwargs: Mapping[str, Any]) -> Iterator[None]:
        with relu_rule(self.model, self.rule) as ruled:
            if not ruled:
                raise LayerError(f"{type(self).__name__} needs nn.ReLU or nn.ReLU6 modules; this model has none")
            yield

    def compute(self, capture: Capture) -> Tensor:
        return capture.gradients

    def finish(self, raw: Tensor, rank: int, size: Sequence[int] | None, normalize: bool) -> Tensor:
        return visible(raw, rank) if normalize else raw


class GuidedGradCAM(GuidedBackprop):
    r"""Guided Grad-CAM: Selvaraju et al. 2017 (arXiv:1610.02391), section 3.

    Guided Backpropagation multiplied by the Grad-CAM map upsampled to the input
    and normalized to [0, 1]: :math:`R \odot \mathrm{GradCAM}`; the target (top-1 by
    default) is bound once and explained by both (Grad-CAM in a pass of its own,
    with the ReLUs unguided). Inherits Guided Backpropagation's failure of the
    model-randomization sanity check in part.

    Args:
        model: A classifier with ``nn.ReLU`` or ``nn.ReLU6`` modules; left as it was.
        layer: Grad-CAM's target layer (None: automatic).
        labels: Class names, to accept a class name as target.
    """

    name = "guided_gradcam"
    title = "Guided Grad-CAM (Selvaraju et al. 2017)"
    reads_layer = True  # Grad-CAM's

    def __init__(self, model: nn.Module, layer: LayerSpec = None, *, labels: Sequence[str] | None = None) -> None:
        super().__init__(model, labels=labels)
        self.gradcam = GradCAM(model, layer, labels=labels)

    @property
    def layer(self) -> str:
        """Grad-CAM's target layer."""
        return self.gradcam.layer or ""

    def compute(self, capture: Capture) -> Tensor:
        cam = capture.once(
            "gradcam", lambda: self.gradcam(capture.x, capture.target, model_kwargs=capture.model_kwargs).cams
        )
        one = cam if cam.dim() == capture.x.dim() - 1 else cam[:, capture.k]  # (N, *spatial): the K axis dropped
        return capture.gradients * one[:, None]


class Deconvolution(GuidedBackprop):
    r"""Deconvolution: Zeiler & Fergus, "Visualizing and Understanding Convolutional Networks", ECCV 2014
    (arXiv:1311.2901).

    The target score's gradient with respect to the input, where every ReLU passes back the positive part of the
    gradient it receives, wherever its input was: :math:`R_l = \mathrm{ReLU}(R_{l+1})` (Guided Backpropagation
    also keeps the forward's mask). As Captum's ``Deconvolution``; maps shaped as the input, shown as
    :func:`visible` shows them. Like Guided Backpropagation it mostly reconstructs the image's edges.

    Args:
        model: A classifier with ``nn.ReLU`` or ``nn.ReLU6`` modules; left as it was.
        layer: None: the map is at the input (a layer given is refused in one line).
        labels: Class names, to accept a class name as target.
    """

    name = "deconvolution"
    title = "Deconvolution (Zeiler & Fergus 2014)"
    rule = "deconvolution"
