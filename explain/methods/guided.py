"""Guided Backpropagation and Guided Grad-CAM: input-resolution maps, (N, 3, H, W), that render as images.

Both fail the model-randomization sanity check of Adebayo et al., "Sanity Checks
for Saliency Maps", NeurIPS 2018 (arXiv:1810.03292): Guided Backpropagation
looks nearly the same for a trained network and for one whose weights were
randomized, because it mostly reconstructs the image's edges rather than
reflecting what the model learned. Use them for sharp pictures of edges, not as
evidence of what the model relies on; the CAM methods pass that check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..engine import CAMResult, check_images, make_result, target_scores
from ..errors import LayerError
from ..hooks import guided_relus
from ..layers import LayerSpec
from ..model_state import untouched
from ..targets import BoundTarget, Target, TargetLike, as_target
from .gradient import GradCAM


def visible(gradients: Tensor) -> Tensor:
    """Gradient images (..., 3, H, W) for display, in [0, 1]: standardized per image, at 0.1 per
    standard deviation around a grey 0.5, and clipped (the usual way to show guided maps)."""
    mean = gradients.mean(dim=(-3, -2, -1), keepdim=True)
    spread = gradients.std(dim=(-3, -2, -1), keepdim=True).clamp_min(torch.finfo(gradients.dtype).tiny)
    return (0.5 + 0.1 * (gradients - mean) / spread).clamp(0.0, 1.0)


class GuidedBackprop:
    r"""Guided Backpropagation: Springenberg et al., "Striving for Simplicity: The All
    Convolutional Net", ICLR 2015 workshop (arXiv:1412.6806).

    The gradient of the target score with respect to the input, where every ReLU
    passes back only positive gradients (at positions where its input was
    positive): :math:`R_{l} = \mathrm{ReLU}(R_{l+1}) \cdot [x_l > 0]`. Implemented by
    full-backward hooks on the ``nn.ReLU`` and ``nn.ReLU6`` modules (see
    :func:`explain.hooks.guided_relus`); ReLUs applied as functions are not guided. Fails the model-randomization sanity
    check (Adebayo et al. 2018): see this module's notes.

    Args:
        model: A classifier with ``nn.ReLU`` or ``nn.ReLU6`` modules; left as it was.
        layer: Not used (the map is at the input); accepted so every method takes the same arguments.
        labels: Class names, to accept a class name as target.
    """

    name = "guided_backprop"

    def __init__(self, model: nn.Module, layer: LayerSpec = None, *, labels: Sequence[str] | None = None) -> None:
        self.model = model
        self.labels = list(labels) if labels is not None else None

    @property
    def layer(self) -> str:
        """Where the map lives: the input."""
        return "input"

    def __call__(
        self,
        x: Tensor,
        target: TargetLike = None,
        *,
        topk: int | None = None,
        resize: bool = True,
        normalize: bool = True,
        model_kwargs: Mapping[str, Any] | None = None,
    ) -> CAMResult:
        """Explain a batch; ``cams`` are (N, 3, H, W) images in [0, 1] (with ``normalize``), ``raw`` the gradients.

        Args are those of :meth:`explain.engine.CAM.__call__`; ``resize`` has no effect.
        """
        check_images(x)
        output, bound, scores, raw = self.input_gradients(x, as_target(target, topk), model_kwargs)
        return make_result(visible(raw) if normalize else raw, raw, output, scores, bound, self.layer, self.name)

    def input_gradients(
        self, x: Tensor, goal: Target | BoundTarget, model_kwargs: Mapping[str, Any] | None = None
    ) -> tuple[Any, BoundTarget, Tensor, Tensor]:
        """Guided gradients of each target: the output, the bound target, its (N, K) scores, (N, K, 3, H, W) maps.

        ``goal`` is bound on this pass's output, unless it is bound already.
        """
        with untouched(self.model), torch.inference_mode(False), torch.enable_grad():
            images = (x.clone() if x.is_inference() else x.detach()).requires_grad_(True)
            with guided_relus(self.model) as guided:
                if not guided:
                    raise LayerError("Guided Backpropagation needs nn.ReLU or nn.ReLU6 modules; this model has none")
                output = self.model(images, **(model_kwargs or {}))
                bound = goal if isinstance(goal, BoundTarget) else goal.bind(output, self.labels)
                scores = target_scores(bound, output, x)
                maps = [
                    torch.autograd.grad(scores[:, k].sum(), images, retain_graph=True)[0]
                    for k in range(scores.shape[1])
                ]
        return output, bound, scores.detach(), torch.stack(maps, dim=1).float()


class GuidedGradCAM(GuidedBackprop):
    r"""Guided Grad-CAM: Selvaraju et al. 2017 (arXiv:1610.02391), section 3.

    Guided Backpropagation multiplied by the Grad-CAM map upsampled to the input
    and normalized to [0, 1]: :math:`R \odot \mathrm{GradCAM}`; the Grad-CAM target
    (top-1 by default) is the one explained by both. Inherits Guided
    Backpropagation's failure of the model-randomization sanity check in part.

    Args:
        model: A classifier with ``nn.ReLU`` or ``nn.ReLU6`` modules; left as it was.
        layer: Grad-CAM's target layer (None: automatic).
        labels: Class names, to accept a class name as target.
    """

    name = "guided_gradcam"

    def __init__(self, model: nn.Module, layer: LayerSpec = None, *, labels: Sequence[str] | None = None) -> None:
        super().__init__(model, labels=labels)
        self.gradcam = GradCAM(model, layer, labels=labels)

    @property
    def layer(self) -> str:
        """Grad-CAM's target layer."""
        return self.gradcam.layer or ""

    def __call__(
        self,
        x: Tensor,
        target: TargetLike = None,
        *,
        topk: int | None = None,
        resize: bool = True,
        normalize: bool = True,
        model_kwargs: Mapping[str, Any] | None = None,
    ) -> CAMResult:
        check_images(x)
        cam = self.gradcam(x, target, topk=topk, model_kwargs=model_kwargs)
        maps = cam.cams if cam.target.keeps_k else cam.cams[:, None]
        output, bound, scores, guided = self.input_gradients(x, cam.target, model_kwargs)
        raw = guided * maps[:, :, None]
        return make_result(visible(raw) if normalize else raw, raw, output, scores, bound, self.layer, self.name)
