"""Perturbation methods: channel weights from the scores of perturbed inputs, in extra forward passes.

The extra forwards run in chunks of at most ``batch_size`` inputs under
``torch.no_grad()`` (not inference mode: a model that caches a tensor in its forward, as YOLO's anchors, would
keep an inference tensor that a later pass with autograd cannot use), batched over every (image, channel) row of
the call on the input's device. Work that cannot change the result is skipped exactly: a
channel whose map is constant gives Score-CAM an all-zero mask, whose score is
computed once per image, and a channel that is zero everywhere gives Ablation-CAM
the unablated score, so its weight is 0 without a forward.

On the CPU the inputs are passed in channels-last layout, and Score-CAM's
family, which perturbs only the input, scores with a copy of the model whose
batch norms are folded into its convolutions (:class:`explain.core.speedups.folding.ScoringForwards`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from ..core.engine import CAM, Capture, Needs
from ..core.hooks import output_replaced
from ..core.maps import has_nonzero, normalize_maps
from ..core.model_state import running
from ..core.speedups.folding import ScoringForwards
from ..errors import LayerError


class PerturbationCAM(CAM):
    """Base of the methods that score perturbed copies of the input, one per (image, channel) row."""

    needs = Needs(gradients=False)
    folds = False  # whether the perturbed inputs may be scored by a copy of the model (see ScoringForwards)

    def perturbed(self, capture: Capture, images: Tensor, channels: Tensor) -> Iterator[tuple[Tensor, Any]]:
        """Inputs for one chunk of rows (image ``images[r]``, channel ``channels[r]``), each with the
        context its forward runs in; the scores of the inputs yielded are averaged."""
        raise NotImplementedError

    def row_scores(self, capture: Capture, images: Tensor, channels: Tensor) -> Tensor:
        """The averaged target score of each row's perturbed inputs, (rows,), chunk by chunk."""
        chunks = []
        forwards = capture.once("scoring", lambda: ScoringForwards(self.model, capture.x.device, self.folds))
        with torch.no_grad(), running(self.model):
            for start in range(0, len(images), self.batch_size):
                rows = slice(start, start + self.batch_size)
                total, count = 0.0, 0
                for inputs, context in self.perturbed(capture, images[rows], channels[rows]):
                    with context:
                        output = forwards(inputs, **capture.model_kwargs)
                        total = total + capture.score_rows(output, images[rows]).float()
                    count += 1
                chunks.append(total / count)
        return torch.cat(chunks).clone() if chunks else capture.scores.new_zeros(0)


class ScoreCAM(PerturbationCAM):
    r"""Score-CAM: Wang et al., "Score-CAM: Score-Weighted Visual Explanations for
    Convolutional Neural Networks", CVPRW 2020 (arXiv:1910.01279).

    Each channel's map, upsampled to the input size and min-max normalized, masks
    the input; :math:`s_c = y(x \odot M_c)` is the target score of the masked input
    and :math:`w = \mathrm{softmax}_c(s)`, :math:`\mathrm{cam} = \mathrm{ReLU}(\sum_c w_c A_c)`.
    (Subtracting the plain input's score, as the paper's increase of confidence
    does, leaves the softmax unchanged.) A constant map gives an all-zero mask.
    """

    name = "scorecam"
    title = "Score-CAM (Wang et al. 2020)"
    fast = False
    cost = "one forward per channel"
    skips_flat_channels = True  # a constant map's mask is known (zero): one forward per image serves them all
    folds = True  # only the input is perturbed

    def masks(self, mask: Tensor, generator: torch.Generator | None) -> Iterator[Tensor]:
        """The masks whose scores are averaged for one chunk's (rows, 1, *spatial) normalized masks."""
        yield mask

    def weights(self, capture: Capture) -> Tensor:
        a = capture.activations
        values = a.flatten(2)
        flat = (values.amax(dim=-1) == values.amin(dim=-1)) & self.skips_flat_channels
        first_flat = flat & (flat.cumsum(dim=1) == 1)  # one flat channel per image stands for the others
        images, channels = (~flat | first_flat).nonzero(as_tuple=True)
        scores = a.new_zeros(a.shape[:2])
        scores[images, channels] = self.row_scores(capture, images, channels)
        shared = torch.where(first_flat, scores, 0.0).sum(dim=1, keepdim=True)
        return torch.where(flat, shared, scores).softmax(dim=1)

    def perturbed(self, capture: Capture, images: Tensor, channels: Tensor) -> Iterator[tuple[Tensor, Any]]:
        mask = normalize_maps(capture.to_input(capture.activations[images, channels]), len(capture.spatial))[:, None]
        picked = capture.x[images]
        for step in self.masks(mask.to(picked.dtype), capture.generator):
            yield picked * step, nullcontext()


class SSCAM(ScoreCAM):
    r"""SS-CAM: Wang et al., "SS-CAM: Smoothed Score-CAM for Sharper Visual Feature
    Localization", 2020 (arXiv:2006.14255).

    Score-CAM with each score averaged over ``samples`` noisy masks,
    :math:`s_c = \frac{1}{N}\sum_n y\big(x \odot (M_c + \delta_n)\big)`,
    :math:`\delta_n \sim \mathcal{N}(0, \sigma^2)` per pixel (torchcam's defaults:
    N = 35, σ = 2). Every channel is scored, constant ones too: their noisy masks differ.

    Args:
        samples: Noisy masks per channel.
        sigma: Standard deviation of the noise added to the [0, 1] mask.
    """

    name = "sscam"
    title = "SS-CAM (Wang et al. 2020)"
    fast = False
    cost = "a forward per channel and noise sample"
    skips_flat_channels = False

    def __init__(self, *args: Any, samples: int = 35, sigma: float = 2.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.samples, self.sigma = samples, sigma

    def masks(self, mask: Tensor, generator: torch.Generator | None) -> Iterator[Tensor]:
        for _ in range(self.samples):
            yield mask + self.sigma * torch.randn(mask.shape, device=mask.device, generator=generator)


class ISCAM(ScoreCAM):
    r"""IS-CAM: Naidu et al., "IS-CAM: Integrated Score-CAM for axiomatic-based
    explanations", 2020 (arXiv:2010.03023).

    Score-CAM with each score averaged over ``samples`` integration steps whose
    masks accumulate, as in the paper's algorithm and torchcam:
    :math:`s_c = \frac{1}{N}\sum_{i=1}^{N} y(x \odot \beta_i M_c)`,
    :math:`\beta_i = \sum_{j=1}^{i} j / N`.

    Args:
        samples: Integration steps N.
    """

    name = "iscam"
    title = "IS-CAM (Naidu et al. 2020)"
    fast = False
    cost = "a forward per channel and integration step"

    def __init__(self, *args: Any, samples: int = 10, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.samples = samples

    def masks(self, mask: Tensor, generator: torch.Generator | None) -> Iterator[Tensor]:
        coefficient = 0.0
        for step in range(1, self.samples + 1):
            coefficient += step / self.samples
            yield coefficient * mask


class AblationCAM(PerturbationCAM):
    r"""Ablation-CAM: Desai & Ramaswamy, "Ablation-CAM: Visual Explanations for Deep
    Convolutional Network via Gradient-free Localization", WACV 2020.

    :math:`w_c = (y - y_c) / y`, with :math:`y_c` the target score when channel c of
    the layer's output is set to zero; :math:`\mathrm{cam} = \mathrm{ReLU}(\sum_c w_c A_c)`.
    A channel that is zero everywhere has :math:`y_c = y`, so :math:`w_c = 0` without a forward.
    """

    name = "ablationcam"
    title = "Ablation-CAM (Desai & Ramaswamy 2020)"
    fast = False
    cost = "one forward per channel"

    def weights(self, capture: Capture) -> Tensor:
        if capture.layout.kind != "channels_first":
            raise LayerError(
                f"Ablation-CAM puts the ablated map in place of the layer's output, so it needs a layer whose output "
                f"is the map (N, C, h, w) itself, not {capture.layout.describe()}; use Score-CAM or a gradient method"
            )
        a = capture.activations
        images, channels = has_nonzero(a.flatten(2), dim=-1).nonzero(as_tuple=True)
        y = capture.scores.float()
        weights = a.new_zeros(a.shape[:2])
        weights[images, channels] = (y[images] - self.row_scores(capture, images, channels)) / y[images]
        return weights

    def perturbed(
        self, capture: Capture, images: Tensor, channels: Tensor
    ) -> Iterator[tuple[Tensor, AbstractContextManager[None]]]:
        ablated = capture.activations[images].to(capture.x.dtype)
        ablated[torch.arange(len(images), device=ablated.device), channels] = 0
        yield capture.x[images], output_replaced(capture.module, ablated, capture.name)
