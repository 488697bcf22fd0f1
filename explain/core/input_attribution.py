"""The base of the methods that attribute the input (pixel attributions, the relevance propagations): a signed
attribution per input channel from the input's gradient, how the channels become one map, SmoothGrad's noisy
copies, and the gradients of many points scored in batches (see :mod:`explain.methods.attribution`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from ..errors import ExplainError
from .engine import CAM, Capture, Needs
from .layers import LayerSpec
from .maps import postprocess
from .model_state import running

PointMaker = Callable[[slice], tuple[Tensor, Tensor, Tensor]]  # rows -> points, their images, their factors
SmoothType = Literal["smoothgrad", "smoothgrad_sq", "vargrad"]
SMOOTH_STATISTICS = {"smoothgrad": "mean", "smoothgrad_sq": "square", "vargrad": "variance"}


class InputAttribution(CAM):
    """Base of the pixel attributions: a signed attribution per input channel from the input's gradient
    (:meth:`attribution`), and how the channels become one map (:meth:`combined`).

    Args:
        model: Any model explain explains; left as it was.
        layer: None: the map is at the input (a layer given is refused in one line).
        labels: Class names, to accept a class name as target.
        smooth_samples: SmoothGrad: average the attributions of this many noisy copies of the input (0: off).
        smooth_sigma: The noise's standard deviation, as a fraction of each input's value range.
        smooth_type: What the noisy copies' attributions become: ``"smoothgrad"`` (their mean),
            ``"smoothgrad_sq"`` (the mean of their squares) or ``"vargrad"`` (their variance).
        seed: Seed of the noise (and of a method's own random draws): a generator on the input's device, from
            which each noisy copy takes one ``torch.randn`` of the input's shape, in turn.
        batch_size: Most inputs per extra forward pass (Integrated Gradients' steps).
    """

    needs = Needs(gradients=False, input_gradient=True, map_of_input=True)  # no layer's gradient: the input's
    reads_layer = False
    relu = False

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        labels: Sequence[str] | None = None,
        smooth_samples: int = 0,
        smooth_sigma: float = 0.15,
        smooth_type: SmoothType = "smoothgrad",
        seed: int | None = None,
        batch_size: int = 16,
    ) -> None:
        super().__init__(
            model,
            layer,
            labels=labels,
            smooth_samples=smooth_samples,
            smooth_sigma=smooth_sigma,
            seed=seed,
            batch_size=batch_size,
        )
        if smooth_type not in SMOOTH_STATISTICS:
            raise ExplainError(f"smooth_type must be one of {', '.join(SMOOTH_STATISTICS)}, got {smooth_type!r}")
        self.smooth_statistic = SMOOTH_STATISTICS[smooth_type]

    def attribution(self, capture: Capture) -> Tensor:
        """The signed attribution of each input channel, (N, C, *spatial)."""
        raise NotImplementedError

    def combined(self, attribution: Tensor, rank: int) -> Tensor:
        """One map from the channels (axis ``-rank - 1``): by default the absolute value of their sum."""
        return attribution.sum(dim=-rank - 1).abs()

    def gradient_sum(self, capture: Capture, count: int, point: PointMaker) -> Tensor:
        r""":math:`\sum_r f_r \odot \partial S(p_r) / \partial p_r` per image, over ``count`` points p_r scored in
        forwards of ``batch_size``, with the call's bound target: ``point(rows)`` gives the rows' points, the image
        each stands for, and the factors f_r."""
        total = torch.zeros_like(capture.x)
        with torch.enable_grad(), running(self.model):
            for start in range(0, count, self.batch_size):
                points, images, factors = point(slice(start, start + self.batch_size))
                points = points.detach().requires_grad_(True)
                score = capture.score_rows(self.model(points, **capture.model_kwargs), images)
                (gradient,) = torch.autograd.grad(score.sum(), points)
                total.index_add_(0, images, gradient * factors)
        return total

    def compute(self, capture: Capture) -> Tensor:
        return self.attribution(capture)

    def finish(self, raw: Tensor, rank: int, size: Sequence[int] | None, normalize: bool) -> Tensor:
        return postprocess(self.combined(raw, rank), rank, size, normalize)
