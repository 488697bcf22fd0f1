"""An attribution's sum against the model's change under random perturbations: infidelity (Yeh et al.) and
sensitivity-n (Ancona et al.). Every perturbed copy of every image is built on the input's device and scored a
chunk of ``batch_size`` at a time.

Attributions are a map per image (N, h, w) at any resolution, upsampled (bilinearly) to the input and shared by its
channels, or per channel at the input's size, (N, C, H, W) (a pixel attribution such as Integrated Gradients).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ExplainError
from ..targets import TargetLike
from .faithfulness import replaced_copies
from .perturbation import Baseline, substrate
from .scoring import MetricScore, input_maps, scorer
from .similarity import pearson


def per_element(attributions: Tensor, x: Tensor, metric: str) -> Tensor:
    """Attributions as one value per element of the input, (N, C, H, W): given so, or a map per image upsampled to
    the input and shared by its channels."""
    if attributions.shape == x.shape:
        return attributions.to(x.device).float()
    return input_maps(attributions.to(x.device), len(x), x.shape[2:], metric)[:, None].expand_as(x)


def infidelity(
    model: nn.Module,
    x: Tensor,
    attributions: Tensor,
    target: TargetLike = None,
    *,
    samples: int = 10,
    noise: float = 0.003,
    perturbations: Tensor | None = None,
    normalize: bool = False,
    score: MetricScore = "logit",
    seed: int | None = 0,
    batch_size: int = 64,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """Infidelity (Yeh et al., "On the (in)fidelity and sensitivity of explanations", NeurIPS 2019):
    INFD = E_I[(I . phi - (f(x) - f(x - I)))^2], the expected squared gap between the attribution's dot product with
    a perturbation and the score's change when the perturbation is taken off the input. Lower is better.

    The perturbations are Gaussian noise of standard deviation ``noise`` (as in Captum's example), or given. With
    ``normalize``, the attribution is first scaled by the beta that minimizes the gap,
    beta = E[I . phi (f(x) - f(x - I))] / E[(I . phi)^2], as Captum's ``normalize=True``. Quantus 0.6.0 defines
    the perturbations otherwise: square patches set to the image's least value one more at a time, in raster
    order (its ``n_perturb_samples`` repeat the same deterministic run); pass
    ``perturbations=patch_removals(x, 4)`` for its value.

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The images, (N, C, H, W).
        attributions: One map per image (N, h, w), or per element (N, C, H, W).
        target: What the attributions explain (see :func:`explain.metrics.deletion`).
        samples: Perturbations per image.
        noise: The Gaussian perturbations' standard deviation, in the input's units.
        perturbations: The perturbations themselves, (N, samples, C, H, W), drawn from ``seed`` when None.
        normalize: Scale the attribution by its best beta first.
        score: The explained class's ``"logit"`` (Captum's output), ``"probability"``, or the target's own.
        seed: The perturbations' seed (None: PyTorch's global generator).
        batch_size: Most perturbed copies per forward.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        Each image's infidelity, (N,).
    """
    scoring = scorer(model, x, target, score, "infidelity", batch_size, model_kwargs)
    phi = per_element(attributions, x, "infidelity")
    if perturbations is None:
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        perturbations = torch.randn(len(x), samples, *x.shape[1:], generator=generator) * noise
    perturbations = perturbations.to(x.device, torch.float32)
    if perturbations.dim() != x.dim() + 1 or perturbations.shape[0] != len(x) or perturbations.shape[2:] != x.shape[1:]:
        raise ExplainError(f"perturbations must be (N, samples, *x.shape[1:]), got {tuple(perturbations.shape)}")
    count = perturbations.shape[1]
    images = torch.arange(len(x), device=x.device).repeat_interleave(count)
    taken = scoring.copies(images, lambda rows: x[images[rows]] - perturbations.flatten(0, 1)[rows])
    change = scoring.original[:, None] - taken.view(len(x), count)
    dot = (perturbations * phi[:, None]).flatten(2).sum(dim=2)
    if normalize:
        beta = (dot * change).mean(dim=1, keepdim=True) / dot.square().mean(dim=1, keepdim=True)
        dot = dot * beta
    return (dot - change).square().mean(dim=1)


def patch_removals(x: Tensor, patch_size: int = 4, baseline: Baseline = "black") -> Tensor:
    """Quantus' infidelity perturbations, I_k = x - x_k for k = 1..P, x_k the image with its first k square
    patches of ``patch_size`` (raster order, cut at the edges) replaced by the baseline, (N, P, C, H, W). They hold
    P copies of the images: meant for small images."""
    after = substrate(x, baseline, "infidelity")
    height, width = x.shape[-2:]
    columns = -(-width // patch_size)
    rows = torch.arange(height, device=x.device) // patch_size
    patch = rows[:, None] * columns + torch.arange(width, device=x.device)[None] // patch_size  # (H, W)
    count = int(patch.max()) + 1
    removed = patch[None] < torch.arange(1, count + 1, device=x.device)[:, None, None]  # (P, H, W)
    copies = torch.where(removed[None, :, None], after[:, None], x[:, None])
    return x[:, None] - copies


def sensitivity_n(
    model: nn.Module,
    x: Tensor,
    attributions: Tensor,
    target: TargetLike = None,
    *,
    sizes: Sequence[int] = (1, 10, 100, 1000),
    runs: int = 100,
    baseline: Baseline = 0.0,
    score: MetricScore = "logit",
    seed: int | None = 0,
    batch_size: int = 64,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """Sensitivity-n (Ancona et al., "Towards better understanding of gradient-based attribution methods for deep
    neural networks", ICLR 2018): for each subset size n, ``runs`` random subsets of n pixels set to the baseline;
    Pearson's correlation, over the subsets, between the attribution's sum over a subset and the score's change. An
    attribution is sensitive-n where they are equal (correlation 1).

    Quantus computes it otherwise: subsets in the map's order, not random, and correlations across the batch's
    images, not per image; this follows the paper.

    Args:
        model: The model, run as it is, without autograd; left as it was.
        x: The images, (N, C, H, W).
        attributions: One map per image (N, h, w), or per element (N, C, H, W).
        target: What the attributions explain (see :func:`explain.metrics.deletion`).
        sizes: The subset sizes n, in pixels (each at most the image's).
        runs: Subsets per image and size.
        baseline: What a subset's pixels become (the paper's 0).
        score: The explained class's ``"logit"``, ``"probability"``, or the target's own.
        seed: The subsets' seed (None: PyTorch's global generator).
        batch_size: Most perturbed copies per forward.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        Each image's correlation per size, (N, len(sizes)).
    """
    scoring = scorer(model, x, target, score, "sensitivity_n", batch_size, model_kwargs)
    phi = per_element(attributions, x, "sensitivity_n").sum(dim=1).flatten(1)  # a pixel's share, its channels'
    pixels = phi.shape[1]
    if not sizes or not all(0 < n <= pixels for n in sizes):
        raise ExplainError(f"sensitivity_n: sizes must lie in 1..{pixels} (the image's pixels), got {list(sizes)}")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    after = substrate(x, baseline, "sensitivity_n")
    found = []
    for n in sizes:
        ranks = torch.rand(len(x), runs, pixels, generator=generator).argsort(dim=2).argsort(dim=2).to(x.device)
        chosen = ranks < n  # (N, runs, pixels): n random pixels per run, the same draws as faithfulness_correlation's
        scores = replaced_copies(scoring, runs, lambda i, k, chosen=chosen: chosen[i, k], after)
        sums = (phi[:, None] * chosen).sum(dim=2)
        found.append(pearson(sums, scoring.original[:, None] - scores))
    return torch.stack(found, dim=1)
