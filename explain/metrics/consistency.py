"""Whether alike explanations go with alike predictions across a batch: sufficiency and consistency (Dasgupta,
Frost and Moshkovitz, "Framework for evaluating faithfulness of local explanations", ICML 2022).

Both compare each image with the batch's other images: the batch is the sample of inputs the explanation is
checked on, so a larger batch gives a surer value. An image with no alike explanation in the batch gets NaN
(Quantus 0.6.0 gives 0, which reads as "unfaithful").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..errors import ExplainError
from .scoring import scorer

Discretise = Literal["top_k", "rank", "sign", "rounded", "leading_signs"]


def _predictions(model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None) -> Tensor:
    """Each image's predicted class, (N,)."""
    return scorer(model, x, None, "logit", "consistency", len(x), model_kwargs).bound.classes[:, 0]


def _agreement(alike: Tensor, predicted: Tensor) -> Tensor:
    """For each image, the share of the other images with an alike explanation (``alike``, (N, N) bool) that are
    predicted its class; NaN where none is alike."""
    alike = alike & ~torch.eye(len(alike), dtype=torch.bool, device=alike.device)
    same = alike & (predicted[:, None] == predicted[None])
    count = alike.sum(dim=1).float()
    return torch.where(count > 0, same.sum(dim=1) / count.clamp_min(1), torch.full_like(count, float("nan")))


def _magnitudes(maps: Tensor) -> Tensor:
    """The maps' absolute values, each divided by its largest (Quantus' defaults), flattened, (N, positions)."""
    flat = maps.detach().float().flatten(1).abs()
    return flat / flat.amax(dim=1, keepdim=True).clamp_min(1e-30)


def sufficiency(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    *,
    threshold: float = 0.6,
    distance: Literal["seuclidean", "euclidean"] = "seuclidean",
    model_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """Sufficiency: for each image, the share of the batch's images whose explanation lies within ``threshold`` of
    its own that the model predicts the same class. Higher is better.

    Explanations are the absolute maps each divided by its largest value; their distances (``"seuclidean"``:
    each position scaled by its variance over the batch, Quantus' default; or ``"euclidean"``) are divided by the
    batch's largest, so ``threshold`` lies in [0, 1].

    Args:
        model: The model whose predictions are compared; run without autograd, left as it was.
        x: The images, (N, C, H, W).
        maps: One map per image, (N, ...), any resolution (compared as given).
        threshold: The largest distance of an alike explanation, as a share of the batch's largest.
        distance: How explanations are compared.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        Each image's sufficiency, (N,); NaN where no other explanation is alike.
    """
    flat = _magnitudes(maps).double()
    if distance == "seuclidean":
        spread = torch.cat([flat, flat]).var(dim=0)  # SciPy's variance of both sides, stacked
        flat = flat[:, spread > 0] / spread[spread > 0].sqrt()
    elif distance != "euclidean":
        raise ExplainError(f"sufficiency: distance must be 'seuclidean' or 'euclidean', got {distance!r}")
    distances = torch.cdist(flat, flat)
    distances = distances / distances.max().clamp_min(1e-30)
    return _agreement(distances <= threshold, _predictions(model, x, model_kwargs))


def _keys(maps: Tensor, discretise: Discretise, k: int) -> Tensor:
    """Each explanation discretised, (N, m): two explanations are alike where their rows are equal."""
    flat = _magnitudes(maps)
    if discretise == "top_k":
        return flat.topk(min(k, flat.shape[1]), dim=1).indices.sort(dim=1).values
    if discretise == "rank":
        return flat.argsort(dim=1, descending=True, stable=True)
    if discretise == "sign":
        return flat.sign()
    if discretise == "rounded":
        return torch.round(flat, decimals=k)
    if discretise == "leading_signs":
        return flat[:, :k].sign()
    raise ExplainError(
        f"consistency: discretise must be 'top_k', 'rank', 'sign', 'rounded' or 'leading_signs', got {discretise!r}"
    )


def consistency(
    model: nn.Module,
    x: Tensor,
    maps: Tensor,
    *,
    discretise: Discretise = "top_k",
    k: int = 5,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """Consistency: for each image, the share of the batch's images with the same discretised explanation that the
    model predicts the same class. Higher is better.

    The paper's explanations are discrete; a map becomes one by ``discretise``, on its absolute values divided by
    the largest (Quantus' defaults): ``"top_k"`` (the set of its ``k`` highest positions, the default),
    ``"rank"`` (its whole order), ``"sign"``, ``"rounded"`` (to ``k`` decimals), or ``"leading_signs"`` (the
    signs of its first ``k`` positions in raster order: Quantus' default, ``top_n_sign``, which reads no
    relevance, so that every positive map is alike).

    Args:
        model: The model whose predictions are compared; run without autograd, left as it was.
        x: The images, (N, C, H, W).
        maps: One map per image, (N, ...), any resolution (compared as given).
        discretise: How a map becomes a discrete explanation.
        k: The positions (``"top_k"``, ``"leading_signs"``) or decimals (``"rounded"``) it keeps.
        model_kwargs: Further keyword arguments of the model's forward.

    Returns:
        Each image's consistency, (N,); NaN where no other explanation is alike.
    """
    keys = _keys(maps, discretise, k)
    alike = (keys[:, None] == keys[None]).all(dim=2)
    return _agreement(alike, _predictions(model, x, model_kwargs))
