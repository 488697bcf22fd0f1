"""How well a map lies on the object, given where the object is: relevance mass and rank accuracy, top-k
intersection, attribution localisation and the ROC AUC of the map as a detector of the object's pixels. The
pointing games are in :mod:`explain.metrics.pointing`. They need no model.

The object is given as masks at the input's size, or as boxes (x1, y1, x2, y2) in input pixels (see
:func:`explain.metrics.pointing.object_masks`); maps of any resolution are upsampled (bilinearly) to the input first.
An image whose object is empty scores NaN (no place to find), as in Quantus.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .pointing import Objects, object_masks
from .scoring import input_maps


def _maps_and_masks(maps: Tensor, objects: Objects, size: Sequence[int], name: str) -> tuple[Tensor, Tensor]:
    """The maps upsampled to the input and flattened (N, H * W), float; the objects' masks flattened likewise."""
    maps = input_maps(maps, len(maps), size, name)
    masks = object_masks(objects, len(maps), size, maps.device)
    return maps.flatten(1).float(), masks.flatten(1)


def _empty_is_nan(values: Tensor, masks: Tensor) -> Tensor:
    """NaN where the image's object is empty."""
    return torch.where(masks.any(dim=1), values, torch.full_like(values, float("nan")))


def relevance_mass_accuracy(maps: Tensor, objects: Objects, size: Sequence[int], *, positive: bool = True) -> Tensor:
    """The share of the map's relevance that lies on the object (Arras et al., "CLEVR-XAI", Information Fusion
    2022): R_within / R_total.

    Args:
        maps: One map per image, (N, h, w), any resolution.
        objects: The objects: masks or boxes.
        size: The input's (H, W).
        positive: Count the map's positive part only (a CAM is non-negative already); False takes the values as
            they are, signed (Quantus' convention).

    Returns:
        Each image's share, (N,); 1 where all the relevance is on the object.
    """
    values, masks = _maps_and_masks(maps, objects, size, "relevance_mass_accuracy")
    values = values.clamp_min(0) if positive else values
    return _empty_is_nan((values * masks).sum(dim=1) / values.sum(dim=1), masks)


def _top_hits(values: Tensor, masks: Tensor, k: Tensor) -> Tensor:
    """How many of each image's ``k`` largest values lie on its object: values tied at the k-th count pro rata
    (the mean over every order of the ties), so that the count does not depend on how a sort breaks them."""
    ordered = values.sort(dim=1, descending=True).values
    kth = ordered.gather(1, (k - 1).clamp_min(0)[:, None])  # (N, 1)
    above, tied = values > kth, values == kth
    slots = k[:, None] - above.sum(dim=1, keepdim=True)  # the places left for the tied values
    share = slots / tied.sum(dim=1, keepdim=True).clamp_min(1)
    return ((above & masks).sum(dim=1, keepdim=True) + (tied & masks).sum(dim=1, keepdim=True) * share)[:, 0]


def relevance_rank_accuracy(maps: Tensor, objects: Objects, size: Sequence[int]) -> Tensor:
    """The share of the object's K pixels among the map's K highest values, K the object's size (Arras et al.,
    "CLEVR-XAI", Information Fusion 2022). Values tied at the K-th count pro rata (see :func:`_top_hits`).

    Args:
        maps: One map per image, (N, h, w), any resolution.
        objects: The objects: masks or boxes.
        size: The input's (H, W).

    Returns:
        Each image's share, (N,); 1 where the object's pixels hold the map's highest values.
    """
    values, masks = _maps_and_masks(maps, objects, size, "relevance_rank_accuracy")
    k = masks.sum(dim=1)
    return _empty_is_nan(_top_hits(values, masks, k) / k.clamp_min(1), masks)


def top_k_intersection(
    maps: Tensor, objects: Objects, size: Sequence[int], *, k: int = 1000, concept_influence: bool = False
) -> Tensor:
    """The share of the map's ``k`` highest values that lie on the object (Theiner et al., "Interpretable semantic
    photo geolocation", WACV 2022). Values tied at the k-th count pro rata (see :func:`_top_hits`).

    Args:
        maps: One map per image, (N, h, w), any resolution.
        objects: The objects: masks or boxes.
        size: The input's (H, W).
        k: How many of the highest values (Quantus' 1000); at most the input's pixels.
        concept_influence: Divide by the object's share of the image (how much more the top values hit the object
            than a uniform draw would).

    Returns:
        Each image's share, (N,).
    """
    values, masks = _maps_and_masks(maps, objects, size, "top_k_intersection")
    count = torch.full((len(values),), min(k, values.shape[1]), device=values.device)
    found = _top_hits(values, masks, count) / count
    if concept_influence:
        found = found * values.shape[1] / masks.sum(dim=1).clamp_min(1)
    return _empty_is_nan(found, masks)


def attribution_localisation(
    maps: Tensor, objects: Objects, size: Sequence[int], *, weighted: bool = False, absolute: bool = False
) -> Tensor:
    """The share of the map's positive relevance inside the object (Kohlbrenner et al., "Towards best practice in
    explaining neural network decisions with LRP", IJCNN 2020): mu = R_in / R_total.

    Args:
        maps: One map per image, (N, h, w), any resolution.
        objects: The objects: masks or boxes.
        size: The input's (H, W).
        weighted: Multiply by the object's share of the image, S_object / S_image, as Quantus does (its image
            size is computed from the batch's array, which differs for batches of more than two images).
        absolute: Take the map's absolute values instead of its positive part (Quantus' default).

    Returns:
        Each image's share, (N,).
    """
    values, masks = _maps_and_masks(maps, objects, size, "attribution_localisation")
    values = values.abs() if absolute else values.clamp_min(0)
    found = (values * masks).sum(dim=1) / (values.sum(dim=1) + 1e-9)
    if weighted:
        found = found * masks.sum(dim=1) / masks.shape[1]
    return _empty_is_nan(found, masks)


def localisation_auc(maps: Tensor, objects: Objects, size: Sequence[int]) -> Tensor:
    """The area under the ROC curve of the map's values as a score of the object's pixels (Fawcett, "An
    introduction to ROC analysis", 2006): the chance that a pixel of the object outscores one outside it, ties
    counted half (the Mann-Whitney statistic, as the trapezoid over every threshold gives it).

    Args:
        maps: One map per image, (N, h, w), any resolution.
        objects: The objects: masks or boxes.
        size: The input's (H, W).

    Returns:
        Each image's AUC, (N,); 0.5 for a map that ignores the object, 1 for one that separates it. NaN where the
        object is empty or the whole image.
    """
    values, masks = _maps_and_masks(maps, objects, size, "localisation_auc")
    found = torch.stack([_mann_whitney(v, m) for v, m in zip(values, masks)])
    return torch.where((masks.sum(dim=1) % masks.shape[1]) > 0, found, torch.full_like(found, float("nan")))


def _mann_whitney(values: Tensor, positive: Tensor) -> Tensor:
    """P(a positive's value > a negative's) + P(equal) / 2, from the values' mean ranks (ties averaged)."""
    _, inverse, counts = values.unique(return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_ranks = ends - (counts.double() - 1) / 2  # the mean of each tied group's 1-based ranks
    ranks = mean_ranks[inverse]
    n_pos = positive.sum().double()
    n_neg = positive.numel() - n_pos
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2
    return (u / (n_pos * n_neg).clamp_min(1)).float()
