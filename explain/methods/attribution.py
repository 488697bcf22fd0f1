"""Pixel attributions: maps of the input's gradient, at the input's resolution, one value per pixel (or voxel, or
sample).

Each method's formula gives a signed attribution per input channel, (N, C, *spatial): the result's ``raw``. Its map,
the result's ``cams``, combines the channels as the method's paper shows it, and is normalized like every map, so
that the renderers and the faithfulness metrics take it as they take a CAM. SmoothGrad (Smilkov et al. 2017,
arXiv:1706.03825) is any of them with ``smooth_samples``: the attributions of noisy copies of the input averaged,
as the paper averages the gradients, before the channels are combined.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from ..core.engine import CAM, CAMResult, Capture
from ..core.layers import LayerSpec
from ..core.maps import postprocess
from ..core.model_state import running, untouched
from ..errors import ExplainError


class InputAttribution(CAM):
    """Base of the pixel attributions: a signed attribution per input channel from the input's gradient
    (:meth:`attribution`), and how the channels become one map (:meth:`combined`).

    Args:
        model: Any model explain explains; left as it was.
        layer: Not used (the map is at the input); accepted so every method takes the same arguments.
        labels: Class names, to accept a class name as target.
        smooth_samples: SmoothGrad: average the attributions of this many noisy copies of the input (0: off).
        smooth_sigma: The noise's standard deviation, as a fraction of each input's value range.
        seed: Seed of the noise.
        batch_size: Most inputs per extra forward pass (Integrated Gradients' steps).
    """

    needs_gradients = False  # no layer's: the input's
    map_of_input = True
    input_gradient = True
    relu = False

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        labels: Sequence[str] | None = None,
        smooth_samples: int = 0,
        smooth_sigma: float = 0.15,
        seed: int | None = None,
        batch_size: int = 16,
    ) -> None:
        super().__init__(
            model,
            None,
            labels=labels,
            smooth_samples=smooth_samples,
            smooth_sigma=smooth_sigma,
            seed=seed,
            batch_size=batch_size,
        )

    def attribution(self, capture: Capture) -> Tensor:
        """The signed attribution of each input channel, (N, C, *spatial)."""
        raise NotImplementedError

    def combined(self, attribution: Tensor, rank: int) -> Tensor:
        """One map from the channels (axis ``-rank - 1``): by default the absolute value of their sum."""
        return attribution.sum(dim=-rank - 1).abs()

    def compute(self, capture: Capture) -> Tensor:
        return self.attribution(capture)

    def finish(self, raw: Tensor, rank: int, size: Sequence[int] | None, normalize: bool) -> Tensor:
        return postprocess(self.combined(raw, rank), rank, size, normalize)


class Saliency(InputAttribution):
    r"""Saliency: Simonyan, Vedaldi & Zisserman, "Deep Inside Convolutional Networks: Visualising Image
    Classification Models and Saliency Maps", ICLR 2014 workshop (arXiv:1312.6034).

    The target score's gradient with respect to the input, :math:`w = \partial S / \partial x`; the map is its
    largest magnitude over the channels, :math:`M_{ij} = \max_c |w_{c,ij}|`, as the paper's. ``raw`` keeps the signed
    gradient (Captum's ``Saliency`` returns its absolute value per channel).
    """

    name = "saliency"

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

    def attribution(self, capture: Capture) -> Tensor:
        return capture.x * capture.gradients


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


class IntegratedGradients(InputAttribution):
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
        layer: Not used.
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
    input_gradient = False  # the plain pass only binds the target: the path's points give the gradients

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
        super().__init__(model, labels=labels, **options)
        if rule not in RULES:
            raise ExplainError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
        if steps < 1:
            raise ExplainError(f"steps must be at least 1, got {steps}")
        self.alphas, self.step_weights = path_points(steps, rule)
        self.baseline = baseline

    def baseline_for(self, x: Tensor) -> Tensor:
        """The baseline, shaped and typed as ``x``."""
        return torch.as_tensor(self.baseline, dtype=x.dtype, device=x.device).expand_as(x)

    def attribution(self, capture: Capture) -> Tensor:
        x = capture.x
        baseline = self.baseline_for(x)
        n = len(x)
        images = torch.arange(n, device=x.device).repeat(len(self.alphas))  # row r: image r % n
        alphas = self.alphas.to(x.device, x.dtype).repeat_interleave(n)
        weights = self.step_weights.to(x.device, x.dtype).repeat_interleave(n)
        total = torch.zeros_like(x)
        with torch.enable_grad(), running(self.model):
            for start in range(0, len(images), self.batch_size):
                rows = slice(start, start + self.batch_size)
                shape = (-1, *(1,) * (x.dim() - 1))
                points = baseline[images[rows]] + alphas[rows].view(shape) * (x - baseline)[images[rows]]
                points.requires_grad_(True)
                score = capture.score_rows(self.model(points, **capture.model_kwargs), images[rows])
                (gradient,) = torch.autograd.grad(score.sum(), points)
                total.index_add_(0, images[rows], gradient * weights[rows].view(shape))
        return (x - baseline) * total

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
