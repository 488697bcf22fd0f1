"""Pixel attributions: maps of the input's gradient, at the input's resolution, one value per pixel (or voxel, or
sample).

Each method's formula gives a signed attribution per input channel, (N, C, *spatial): the result's ``raw``. Its map,
the result's ``cams``, combines the channels as the method's paper shows it, and is normalized like every map, so
that the renderers and the faithfulness metrics take it as they take a CAM. SmoothGrad (Smilkov et al. 2017,
arXiv:1706.03825) is any of them with ``smooth_samples``: the attributions of noisy copies of the input averaged,
as the paper averages the gradients, before the channels are combined; ``smooth_type="vargrad"`` takes their
variance instead (VarGrad: Adebayo et al., "Local Explanation Methods for Deep Neural Networks Lack Sensitivity to
Parameter Values", ICLR 2018 workshop, arXiv:1810.03307), ``"smoothgrad_sq"`` the mean of their squares (Hooker
et al. 2019), as Captum's ``NoiseTunnel`` names them. Sobel-CAM, a baseline, is the input's edges alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.engine import CAMResult, Capture, Needs
from ..core.input_attribution import InputAttribution
from ..core.layers import LayerSpec
from ..core.model_state import running, untouched
from ..core.rules import rescale_rule
from ..errors import ExplainError


class Saliency(InputAttribution):
    r"""Saliency: Simonyan, Vedaldi & Zisserman, "Deep Inside Convolutional Networks: Visualising Image
    Classification Models and Saliency Maps", ICLR 2014 workshop (arXiv:1312.6034).

    The target score's gradient with respect to the input, :math:`w = \partial S / \partial x`; the map is its
    largest magnitude over the channels, :math:`M_{ij} = \max_c |w_{c,ij}|`, as the paper's. ``raw`` keeps the signed
    gradient (Captum's ``Saliency`` returns its absolute value per channel).
    """

    name = "saliency"
    title = "Saliency, the input's gradient (Simonyan et al. 2014)"

    def attribution(self, capture: Capture) -> Tensor:
        return capture.gradients

    def combined(self, attribution: Tensor, rank: int) -> Tensor:
        return attribution.abs().amax(dim=-rank - 1)


class InputXGradient(InputAttribution):
    r"""Input × Gradient: Shrikumar et al., "Not Just a Black Box: Learning Important Features Through Propagating
    Activation Differences", 2016 (arXiv:1605.01713).

    :math:`R = x \odot \partial S / \partial x`, per channel; the map is the absolute value of the channels' sum.
    """

    name = "input_x_gradient"
    title = "Input x Gradient (Shrikumar et al. 2016)"

    def attribution(self, capture: Capture) -> Tensor:
        return capture.x * capture.gradients




def along_rows(values: Tensor, like: Tensor) -> Tensor:
    """One value per row (R,) shaped (R, 1, ...) to broadcast over rows of ``like``'s inputs."""
    return values.view(-1, *(1,) * (like.dim() - 1))


Rule = Literal["riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid", "gausslegendre"]
RULES = ("riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid", "gausslegendre")


def path_points(steps: int, rule: Rule) -> tuple[Tensor, Tensor]:
    """The points α in [0, 1] along the straight path from the baseline to the input, and their weights, of a
    quadrature rule of ``steps`` points: left, right or middle Riemann sums, the trapezoid rule, or Gauss-Legendre
    (float64). The weights sum to 1. (Captum's ``riemann_trapezoid`` weighs its points, spaced 1/(steps - 1), by
    1/steps, halved at the ends, so that its weights sum to (steps - 1)/steps: its attributions are this rule's
    times that.)"""
    if rule == "gausslegendre":
        nodes, weights = np.polynomial.legendre.leggauss(steps)
        return torch.from_numpy((nodes + 1) / 2), torch.from_numpy(weights / 2)
    k = torch.arange(steps, dtype=torch.float64)
    if rule == "riemann_trapezoid":
        if steps < 2:
            raise ExplainError("the trapezoid rule needs at least 2 steps")
        weights = torch.full((steps,), 1.0 / (steps - 1), dtype=torch.float64)
        weights[[0, -1]] /= 2
        return k / (steps - 1), weights
    offset = {"riemann_left": 0.0, "riemann_right": 1.0, "riemann_middle": 0.5}[rule]
    return (k + offset) / steps, torch.full((steps,), 1.0 / steps, dtype=torch.float64)


class FromBaseline(InputAttribution):
    """Base of the attributions of the input's difference from a baseline (Integrated Gradients, DeepLift),
    which sum to the score's change from the baseline: the result's ``completeness`` says how far they are."""

    baseline: float | Tensor = 0.0

    def baseline_for(self, x: Tensor) -> Tensor:
        """The baseline, shaped and typed as ``x``."""
        return torch.as_tensor(self.baseline, dtype=x.dtype, device=x.device).expand_as(x)

    def completed(self, result: CAMResult, x: Tensor, model_kwargs: Mapping[str, Any]) -> CAMResult:
        """The result with its ``completeness``: :math:`\\sum R - (S(x) - S(x'))` per image (and target, with a K
        axis), from one forward of the baseline."""
        with untouched(self.model), running(self.model), torch.no_grad():
            baseline = self.baseline_for(x.detach())
            output = self.model(baseline, **model_kwargs)
            at_baseline = result.target.score(output, torch.arange(len(x), device=x.device))
        raw = result.raw if result.target.keeps_k else result.raw[:, None]
        total = raw.flatten(2).double().sum(dim=2)  # over channels and positions: (N, K)
        scores = result.scores if result.target.keeps_k else result.scores[:, None]
        gap = (total - (scores.double() - at_baseline.double())).float()
        return replace(result, completeness=gap if result.target.keeps_k else gap[:, 0])


class IntegratedGradients(FromBaseline):
    r"""Integrated Gradients: Sundararajan, Taly & Yan, "Axiomatic Attribution for Deep Networks", ICML 2017
    (arXiv:1703.01365).

    The gradient integrated along the straight path from a baseline :math:`x'` to the input:
    :math:`R = (x - x') \odot \int_0^1 \partial S(x' + \alpha (x - x')) / \partial x \, d\alpha`, the integral a
    quadrature of ``steps`` points (:func:`path_points`). The points are scored as batched forwards of
    ``batch_size`` inputs, with the call's bound target. Completeness: the attributions sum to
    :math:`S(x) - S(x')`; the result's ``completeness`` is the difference, per image and target, which shrinks as
    ``steps`` grows. The map is the absolute value of the channels' sum.

    Args:
        model: Any model explain explains; left as it was.
        layer: None (a layer given is refused).
        labels: Class names, to accept a class name as target.
        steps: Points of the quadrature.
        rule: ``"gausslegendre"`` (Captum's default), ``"riemann_left"``, ``"riemann_right"``, ``"riemann_middle"``
            or ``"riemann_trapezoid"``.
        baseline: The baseline: a number (0: a black image after normalization is not 0; give the normalized
            black value to mean black) or a tensor broadcast to the input.
        **options: ``smooth_samples``, ``smooth_sigma``, ``seed`` and ``batch_size``, as for
            :class:`InputAttribution`.
    """

    name = "integrated_gradients"
    title = "Integrated Gradients (Sundararajan et al. 2017)"
    fast = False
    cost = "a forward and backward per step"
    needs = Needs(gradients=False, map_of_input=True)  # the plain pass binds; the path's points give the gradients

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        labels: Sequence[str] | None = None,
        steps: int = 50,
        rule: Rule = "gausslegendre",
        baseline: float | Tensor = 0.0,
        **options: Any,
    ) -> None:
        super().__init__(model, layer, labels=labels, **options)
        if rule not in RULES:
            raise ExplainError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
        if steps < 1:
            raise ExplainError(f"steps must be at least 1, got {steps}")
        self.alphas, self.step_weights = path_points(steps, rule)
        self.baseline = baseline

    def attribution(self, capture: Capture) -> Tensor:
        x = capture.x
        baseline = self.baseline_for(x)
        n = len(x)
        images = torch.arange(n, device=x.device).repeat(len(self.alphas))  # row r: image r % n
        alphas = along_rows(self.alphas.to(x.device, x.dtype).repeat_interleave(n), x)
        weights = along_rows(self.step_weights.to(x.device, x.dtype).repeat_interleave(n), x)

        def point(rows: slice) -> tuple[Tensor, Tensor, Tensor]:
            start = baseline[images[rows]]
            return start + alphas[rows] * (x[images[rows]] - start), images[rows], weights[rows]

        return (x - baseline) * self.gradient_sum(capture, len(images), point)


class GradientSHAP(InputAttribution):
    r"""GradientSHAP: Lundberg & Lee, "A Unified Approach to Interpreting Model Predictions", NeurIPS 2017
    (arXiv:1705.07874), as expected gradients (Erion et al. 2021, arXiv:1906.10670) and Captum's
    ``GradientShap``.

    The expectation of Input × Gradient from a random baseline along a random point of the path:

    .. math:: R = \mathbb{E}_{x' \sim B,\ \epsilon \sim \mathcal{N}(0, \sigma^2),\ lpha \sim U(0, 1)}
              \Big[(	ilde x - x') \odot rac{\partial S}{\partial x}\Big|_{x' + lpha (	ilde x - x')}\Big],
              \quad 	ilde x = x + \epsilon,

    estimated with ``samples`` draws per image (seeded by ``seed``: per draw, in turn, the baseline's index, α and
    the noise, ``torch.randint``, ``torch.rand`` and ``torch.randn`` of all draws at once), scored as batched
    forwards of ``batch_size``. It approximates the SHAP values of a model linear between the baselines and the
    input. The map is the absolute value of the channels' sum.

    Args:
        model: Any model explain explains; left as it was.
        layer: None (a layer given is refused).
        labels: Class names, to accept a class name as target.
        baselines: The baseline distribution: a number, or a tensor of baselines (B, C, *spatial), or one input
            (C, *spatial).
        samples: Draws per image.
        stdev: The standard deviation of the noise added to the input, in the input's units (Captum's ``stdevs``).
        **options: ``seed`` and ``batch_size``, as for :class:`InputAttribution`.
    """

    name = "gradient_shap"
    title = "GradientSHAP, expected gradients (Lundberg & Lee 2017)"
    fast = False
    cost = "a forward and backward per sample"
    needs = Needs(gradients=False, map_of_input=True)  # the plain pass binds; the draws give the gradients

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        labels: Sequence[str] | None = None,
        baselines: float | Tensor = 0.0,
        samples: int = 20,
        stdev: float = 0.0,
        **options: Any,
    ) -> None:
        super().__init__(model, layer, labels=labels, **options)
        if samples < 1 or stdev < 0:
            raise ExplainError(f"samples must be at least 1 and stdev at least 0, got {samples} and {stdev}")
        self.baselines, self.samples, self.stdev = baselines, samples, stdev

    def baselines_for(self, x: Tensor) -> Tensor:
        """The baselines as (B, C, *spatial), typed as ``x``.

        Raises:
            ExplainError: A tensor of baselines that is not shaped as one input or a batch of them.
        """
        baselines = torch.as_tensor(self.baselines, dtype=x.dtype, device=x.device)
        if baselines.dim() == 0:
            return baselines.expand(1, *x.shape[1:])
        if baselines.shape[-x.dim() + 1 :] != x.shape[1:] or baselines.dim() not in (x.dim() - 1, x.dim()):
            raise ExplainError(
                f"baselines of shape {tuple(baselines.shape)} for inputs {tuple(x.shape[1:])}: give one input "
                "or a batch (B, *input shape)"
            )
        return baselines.reshape(-1, *x.shape[1:])

    def attribution(self, capture: Capture) -> Tensor:
        x, generator = capture.x, capture.generator
        baselines = self.baselines_for(x)
        count = self.samples * len(x)
        images = torch.arange(len(x), device=x.device).repeat(self.samples)  # row r: image r % n
        chosen = torch.randint(len(baselines), (count,), device=x.device, generator=generator)
        alphas = along_rows(torch.rand(count, device=x.device, dtype=x.dtype, generator=generator), x)
        noise = self.stdev * torch.randn((count, *x.shape[1:]), device=x.device, dtype=x.dtype, generator=generator)

        def point(rows: slice) -> tuple[Tensor, Tensor, Tensor]:
            start, end = baselines[chosen[rows]], x[images[rows]] + noise[rows]
            return start + alphas[rows] * (end - start), images[rows], (end - start) / self.samples

        return self.gradient_sum(capture, count, point)


LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601's weights of R, G and B, as OpenCV's RGB-to-grey


class SobelCAM(InputAttribution):
    r"""Sobel-CAM, as pytorch-grad-cam's ``sobel_cam``: a baseline that knows nothing of the model, the edges of
    the input. A method that localizes no better than this is drawing the picture's edges.

    The input in grey (BT.601's luma for three channels, their mean otherwise), its Sobel derivative along each
    spatial axis (the central difference along it, smoothed by [1, 2, 1] along the others, borders reflected), and
    the mean of their magnitudes, :math:`rac{1}{2}(|G_x| + |G_y|)` for an image. On the input as the model gets
    it: a per-channel normalization weighs the channels differently from the image's own grey (pytorch-grad-cam
    takes the 8-bit picture, and saturates at 255). Any rank: a signal's one derivative, a volume's three.
    """

    name = "sobel"
    title = "Sobel-CAM, the input's edges: a baseline"
    fast = False
    needs = Needs(gradients=False, map_of_input=True)

    def attribution(self, capture: Capture) -> Tensor:
        x = capture.x
        rank = x.dim() - 2
        if x.shape[1] == 3:
            grey = torch.einsum("nc...,c->n...", x, x.new_tensor(LUMA))[:, None]
        else:
            grey = x.mean(dim=1, keepdim=True)
        padded = F.pad(grey, (1, 1) * rank, mode="reflect")
        derivative, smoothing = x.new_tensor([-1.0, 0.0, 1.0]), x.new_tensor([1.0, 2.0, 1.0])
        magnitude = torch.zeros_like(grey)
        convolve = (F.conv1d, F.conv2d, F.conv3d)[rank - 1]
        for axis in range(rank):
            kernel = x.new_ones((3,) * rank)  # the outer product: the derivative along axis, smoothing elsewhere
            for other in range(rank):
                shape = [1] * rank
                shape[other] = 3
                kernel = kernel * (derivative if other == axis else smoothing).view(shape)
            magnitude += convolve(padded, kernel[None, None]).abs()
        return magnitude / rank


class DeepLift(FromBaseline):
    r"""DeepLift with the rescale rule: Shrikumar, Greenside & Kundaje, "Learning Important Features Through
    Propagating Activation Differences", ICML 2017 (arXiv:1704.02685), as Captum's ``DeepLift``.

    The reference :math:`x'` runs first, without autograd; then the input's gradient is taken with every
    element-wise nonlinearity's slope replaced by its secant between the two,
    :math:`m = \Delta y / \Delta x` (see :func:`explain.core.rules.rescale_rule`), and
    :math:`R = (x - x') \odot \partial^{\mathrm{rescale}} S / \partial x`. For a network of linear layers and
    element-wise nonlinearities the attributions sum to :math:`S(x) - S(x')` (the result's ``completeness`` is
    the difference). Max pooling passes its plain gradient (Captum has a rule of its own for it); nonlinearities
    applied as functions rather than modules keep their slope. The map is the absolute value of the channels'
    sum.

    Args:
        model: Any model explain explains; left as it was.
        layer: None (a layer given is refused).
        labels: Class names, to accept a class name as target.
        baseline: The reference: a number or a tensor broadcast to the input.
        **options: ``smooth_samples``, ``smooth_sigma``, ``seed``, as for :class:`InputAttribution`.
    """

    name = "deeplift"
    title = "DeepLift, the rescale rule (Shrikumar et al. 2017)"
    fast = False
    # the rule replaces the nonlinearities' slopes wherever the gradient goes
    needs = Needs(gradients=False, input_gradient=True, whole_backward=True, map_of_input=True)

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        labels: Sequence[str] | None = None,
        baseline: float | Tensor = 0.0,
        **options: Any,
    ) -> None:
        super().__init__(model, layer, labels=labels, **options)
        self.baseline = baseline

    def backward_rule(self, x: Tensor, model_kwargs: Mapping[str, Any]) -> AbstractContextManager[Any]:
        reference = self.baseline_for(x.detach())
        return rescale_rule(self.model, lambda: self.model(reference, **model_kwargs))

    def attribution(self, capture: Capture) -> Tensor:
        return (capture.x - self.baseline_for(capture.x)) * capture.gradients
