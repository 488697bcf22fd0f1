"""Black-box attributions over superpixels: the input cut into segments, copies of it with some segments kept and
the others set to a baseline, their scores, and one value per segment from each method's formula.

The segments are the caller's (``segments=`` a label map, Captum's ``feature_mask``) or SLIC's (Achanta et al.
2012, from scikit-image, an optional extra: ``pip install "explain[superpixels]"``) on each image rescaled to [0, 1]
per channel; a signal is cut into equal runs. A coalition z says which segments a copy keeps; the copies of every
image are scored ``batch_size`` per forward with the call's bound target, as the masking methods score theirs
(:class:`explain.methods.masking.MaskedCopies`). A coalition drawn more than once is scored once. ``raw`` is each
position's segment's value, signed; the map is its positive part, normalized.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.engine import Capture
from ..core.layers import LayerSpec
from ..errors import ExplainError
from .masking import MaskedCopies


def slic_segments(x: Tensor, segments: int, compactness: float) -> Tensor:
    """SLIC superpixels of each input (N, C, *spatial), as labels 0..M-1 per image, (N, *spatial) int64; a signal
    (one spatial axis) is cut into ``segments`` equal runs instead.

    Raises:
        ExplainError: scikit-image is not installed (images and volumes).
    """
    spatial = x.shape[2:]
    if len(spatial) == 1:
        runs = torch.arange(spatial[0], device=x.device) * segments // spatial[0]
        return runs.expand(len(x), -1).clone()
    try:
        from skimage.segmentation import slic
    except ImportError:
        raise ExplainError('superpixels need scikit-image: pip install "explain[superpixels]"') from None
    labels = []
    for image in x.detach().float().cpu():
        low = image.flatten(1).amin(dim=1).view(-1, *(1,) * len(spatial))
        span = (image.flatten(1).amax(dim=1).view_as(low) - low).clamp_min(torch.finfo(torch.float32).tiny)
        scaled = ((image - low) / span).movedim(0, -1).numpy()
        found = slic(scaled, n_segments=segments, compactness=compactness, start_label=0, channel_axis=-1)
        labels.append(torch.from_numpy(np.unique(found, return_inverse=True)[1].reshape(found.shape)))
    return torch.stack(labels).to(x.device)


class Superpixels(MaskedCopies):
    """Base of the superpixel methods: the coalitions of an image's M segments to score (:meth:`coalitions`) and
    how their scores become one value per segment (:meth:`fitted`).

    Args:
        model: Any model explain explains; left as it was.
        layer: Not used (the map is at the input); accepted so every method takes the same arguments.
        labels: Class names, to accept a class name as target.
        segments: How many SLIC superpixels to ask for per image, or the caller's label map: (N, *spatial) or
            (*spatial) for every image, integers, one segment per value.
        compactness: SLIC's balance of colour and space (scikit-image's; higher: squarer segments).
        baseline: The value a left-out segment takes (in the normalized input's units).
        batch_size: Copies per forward.
        seed: Seed of random coalitions.
    """

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        labels: Sequence[str] | None = None,
        segments: int | Tensor = 50,
        compactness: float = 10.0,
        baseline: float = 0.0,
        batch_size: int = 16,
        seed: int | None = None,
    ) -> None:
        super().__init__(model, layer, labels=labels, baseline=baseline, batch_size=batch_size, seed=seed)
        if isinstance(segments, int) and segments < 1:
            raise ExplainError(f"segments must be at least 1, got {segments}")
        self.segments, self.compactness = segments, compactness

    def segmented(self, x: Tensor) -> Tensor:
        """Each image's segment labels, (N, *spatial), 0..M-1.

        Raises:
            ExplainError: A given label map is not shaped as the input's spatial axes.
        """
        if isinstance(self.segments, int):
            return slic_segments(x, self.segments, self.compactness)
        given = torch.as_tensor(self.segments, device=x.device)
        if given.shape == x.shape[2:]:
            given = given.expand(len(x), *given.shape)
        if given.shape != (len(x), *x.shape[2:]) or given.is_floating_point():
            raise ExplainError(
                f"segments must be integer labels shaped {tuple(x.shape[2:])} or {(len(x), *x.shape[2:])}, "
                f"got {given.dtype} {tuple(given.shape)}"
            )
        return torch.stack([torch.unique(g, return_inverse=True)[1] for g in given])

    def coalitions(self, m: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
        """The coalitions of one image's ``m`` segments to score, (S, m), 1 where a segment is kept."""
        raise NotImplementedError

    def fitted(self, z: Tensor, scores: Tensor, plain: Tensor) -> Tensor:
        """Each segment's value (m,) from the coalitions (S, m), their scores (S,) and the input's score."""
        raise NotImplementedError

    def compute(self, capture: Capture) -> Tensor:
        x = capture.x
        labels = self.segmented(x)
        per_image = [self.coalitions(int(labels[n].max()) + 1, capture.generator, x.device) for n in range(len(x))]
        distinct = [torch.unique(coalitions, dim=0, return_inverse=True) for coalitions in per_image]
        widest = max(once.shape[1] for once, _ in distinct)
        kept_segments = torch.cat([F.pad(once, (0, widest - once.shape[1])) for once, _ in distinct])  # (rows, M)
        images = torch.cat([torch.full((len(once),), n, device=x.device) for n, (once, _) in enumerate(distinct)])
        scores = torch.empty(len(images), device=x.device)  # a coalition drawn twice: scored once

        def kept(chunk: Tensor) -> Tensor:
            segment = labels[images[chunk]]  # (rows, *spatial): each position's segment
            return kept_segments[chunk].gather(1, segment.flatten(1)).view_as(segment).float()

        def stored(chunk: Tensor, keep: Tensor, score: Tensor) -> None:
            scores[chunk] = score

        self.score_copies(capture, images, kept, stored)
        values, first = [], 0
        for n, (coalitions, (once, drawn)) in enumerate(zip(per_image, distinct)):
            own = scores[first : first + len(once)][drawn]  # each drawn coalition's score
            values.append(self.fitted(coalitions.float(), own, capture.scores[n].float())[labels[n]])
            first += len(once)
        return torch.stack(values)


class FeatureAblation(Superpixels):
    r"""Feature Ablation over superpixels, as Captum's ``FeatureAblation`` with a ``feature_mask``: each segment
    alone set to the baseline; its value is the score's drop, :math:`R_m = S(x) - S(x_{m \leftarrow b})`. One copy
    per segment and image."""

    name = "feature_ablation"
    title = "Feature Ablation over superpixels"
    fast = False
    cost = "one forward per superpixel"

    def coalitions(self, m: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
        return 1 - torch.eye(m, device=device, dtype=torch.long)

    def fitted(self, z: Tensor, scores: Tensor, plain: Tensor) -> Tensor:
        return plain - scores


def weighted_ridge(z: Tensor, y: Tensor, weights: Tensor, alpha: float) -> Tensor:
    """The coefficients of a ridge regression of y (S,) on z (S, m) with an intercept, each row weighed, in
    float64: scikit-learn's ``Ridge(alpha).fit(z, y, sample_weight=weights)``'s ``coef_``."""
    z, y, weights = z.double(), y.double(), weights.double()
    share = weights / weights.sum()
    zc, yc = z - share @ z, y - share @ y
    gram = zc.T @ (weights[:, None] * zc) + alpha * torch.eye(z.shape[1], dtype=z.dtype, device=z.device)
    return torch.linalg.solve(gram, zc.T @ (weights * yc)).float()


class LIME(Superpixels):
    r"""LIME over superpixels: Ribeiro, Singh & Guestrin, ""Why Should I Trust You?": Explaining the Predictions of
    Any Classifier", KDD 2016 (arXiv:1602.04938), as the authors' ``lime_image``.

    ``samples`` coalitions, each segment kept with probability 1/2 (seeded; the input itself is the first), are
    scored; a ridge regression (``alpha``, with an intercept) of the scores on the coalitions, each weighed by
    :math:`\sqrt{\exp(-d^2 / w^2)}` with d the cosine distance of its coalition to the input's (all kept) and
    :math:`w` = ``kernel_width``, gives each segment's value: its coefficient. Captum's ``Lime`` measures the
    distance between the images instead, and fits a lasso.

    Args:
        model: Any model explain explains; left as it was.
        layer: Not used.
        labels: Class names, to accept a class name as target.
        samples: Coalitions scored per image.
        kernel_width: w above (lime_image's 0.25).
        alpha: The ridge's penalty (lime's 1.0).
        **options: ``segments``, ``compactness``, ``baseline``, ``batch_size`` and ``seed``, as for
            :class:`Superpixels`.
    """

    name = "lime"
    title = "LIME over superpixels (Ribeiro et al. 2016)"
    fast = False
    cost = "one forward per sample"

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        labels: Sequence[str] | None = None,
        samples: int = 1000,
        kernel_width: float = 0.25,
        alpha: float = 1.0,
        **options: object,
    ) -> None:
        super().__init__(model, layer, labels=labels, **options)
        if samples < 2 or kernel_width <= 0 or alpha < 0:
            raise ExplainError("LIME needs samples >= 2, kernel_width > 0 and alpha >= 0")
        self.samples, self.kernel_width, self.alpha = samples, kernel_width, alpha

    def coalitions(self, m: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
        drawn = (torch.rand(self.samples - 1, m, generator=generator, device=device) < 0.5).long()
        return torch.cat([torch.ones(1, m, dtype=torch.long, device=device), drawn])

    def fitted(self, z: Tensor, scores: Tensor, plain: Tensor) -> Tensor:
        kept = z.sum(dim=1)
        cosine = torch.where(kept > 0, kept / (kept.sqrt() * math.sqrt(z.shape[1])).clamp_min(1e-12), 0.0)
        weights = torch.exp(-((1 - cosine) ** 2) / self.kernel_width**2).sqrt()
        return weighted_ridge(z, scores, weights, self.alpha)


class KernelSHAP(Superpixels):
    r"""Kernel SHAP over superpixels: Lundberg & Lee, "A Unified Approach to Interpreting Model Predictions",
    NeurIPS 2017 (arXiv:1705.07874).

    The Shapley values of the segments, as the weighted least-squares fit of the coalitions' scores with the
    Shapley kernel :math:`\pi(z) = (M - 1) / \big(\binom{M}{|z|} |z| (M - |z|)\big)`, constrained so that the
    values sum to :math:`S(x) - S(x_{\text{all} \leftarrow b})`. With ``samples`` at least :math:`2^M - 2`
    every coalition is scored and the values are the exact Shapley values; else ``samples`` coalitions are drawn
    (seeded) with their sizes in proportion to the kernel's weight of a size, and weighed alike. Captum's
    ``KernelShap`` samples coalitions uniformly and weighs them by the kernel.

    Args:
        model: Any model explain explains; left as it was.
        layer: Not used.
        labels: Class names, to accept a class name as target.
        samples: Coalitions scored per image, besides the empty one.
        **options: ``segments``, ``compactness``, ``baseline``, ``batch_size`` and ``seed``, as for
            :class:`Superpixels`.
    """

    name = "kernel_shap"
    title = "Kernel SHAP over superpixels (Lundberg & Lee 2017)"
    fast = False
    cost = "one forward per sample"

    def __init__(
        self, model: nn.Module, layer: LayerSpec = None, *, labels: Sequence[str] | None = None, samples: int = 500,
        **options: object,
    ) -> None:  # fmt: skip
        super().__init__(model, layer, labels=labels, **options)
        if samples < 1:
            raise ExplainError(f"samples must be at least 1, got {samples}")
        self.samples = samples

    def coalitions(self, m: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
        empty = torch.zeros(1, m, dtype=torch.long, device=device)
        if m < 2:
            return empty
        if 2**m - 2 <= self.samples:  # every coalition but the empty and the full one
            codes = torch.arange(1, 2**m - 1, device=device)
            return torch.cat([empty, (codes[:, None] >> torch.arange(m, device=device)) & 1])
        sizes = torch.arange(1, m, device=device, dtype=torch.float64)
        drawn = torch.multinomial((m - 1) / (sizes * (m - sizes)), self.samples, True, generator=generator) + 1
        order = torch.rand(self.samples, m, generator=generator, device=device).argsort(dim=1)
        return torch.cat([empty, (order < drawn[:, None]).long()])  # each row keeps `size` random segments

    def fitted(self, z: Tensor, scores: Tensor, plain: Tensor) -> Tensor:
        m = z.shape[1]
        none, total = scores[0], plain - scores[0]
        if m < 2:
            return total.reshape(1)
        z, y = z[1:].double(), (scores[1:] - none).double()
        size = z.sum(dim=1)
        if 2**m - 2 <= self.samples:
            weights = (m - 1) / (torch.exp(torch.lgamma(torch.tensor(m + 1.0, dtype=z.dtype)) - torch.lgamma(size + 1)
                                 - torch.lgamma(m - size + 1)) * size * (m - size))  # fmt: skip
        else:
            weights = torch.ones_like(size)
        # Σφ = total: the last value is total minus the others; regress what is left on the others' differences.
        others = z[:, :-1] - z[:, -1:]
        target = y - z[:, -1] * total
        gram = others.T @ (weights[:, None] * others)
        found = torch.linalg.lstsq(gram, others.T @ (weights * target)).solution
        return torch.cat([found, (total - found.sum()).reshape(1)]).float()
