"""Focus (Arias-Duart et al., "Focus! Rating XAI methods and finding biases", FUZZ-IEEE 2022): on a mosaic of four
images, two of the explained class and two of others, the share of the map's positive relevance that falls on
the explained class's two images. A map that looks at the class's evidence scores 1; one that cannot tell the
images apart scores about 0.5.

>>> built = explain.metrics.mosaics(x, labels, count=16)
>>> result = explain.GradCAM(model)(built.images, built.classes)
>>> explain.metrics.focus(result.cams, built.quadrants)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ExplainError


@dataclass(frozen=True)
class Mosaics:
    """Mosaics of four images in a 2 x 2 grid.

    Attributes:
        images: The mosaics, (M, C, 2H, 2W).
        classes: The class each mosaic is explained for, (M,).
        quadrants: Which quadrants hold an image of that class, (M, 4) bool, in the order top left, top right,
            bottom left, bottom right (Quantus' ``custom_batch``).
        sources: Which input image each quadrant shows, (M, 4).
    """

    images: Tensor
    classes: Tensor
    quadrants: Tensor
    sources: Tensor


def mosaics(x: Tensor, labels: Tensor, count: int, *, seed: int | None = 0) -> Mosaics:
    """``count`` mosaics of the images ``x`` (N, C, H, W) with their ``labels`` (N,): each of a class drawn among
    those with two images or more, two of its images and two of other classes, in random quadrants.

    Raises:
        ExplainError: No class has two images while two images of other classes remain.
    """
    labels = torch.as_tensor(labels).cpu().long()
    if labels.shape != (len(x),):
        raise ExplainError(f"mosaics: labels must be one class per image, ({len(x)},), got {tuple(labels.shape)}")
    classes, counts = labels.unique(return_counts=True)
    usable = classes[(counts >= 2) & (len(labels) - counts >= 2)]
    if len(usable) == 0:
        raise ExplainError("mosaics need a class with two images or more and two images of other classes")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    chosen, sources, quadrants = [], [], []
    for _ in range(count):
        label = usable[torch.randint(len(usable), (1,), generator=generator)]
        inside, outside = (labels == label).nonzero()[:, 0], (labels != label).nonzero()[:, 0]
        picked = torch.cat([
            inside[torch.randperm(len(inside), generator=generator)[:2]],
            outside[torch.randperm(len(outside), generator=generator)[:2]],
        ])  # fmt: skip
        places = torch.randperm(4, generator=generator)
        sources.append(torch.empty_like(picked).scatter_(0, places, picked))
        quadrants.append(torch.zeros(4, dtype=torch.bool).scatter_(0, places[:2], True))
        chosen.append(label)
    source = torch.stack(sources).to(x.device)
    tiles = x[source]  # (M, 4, C, H, W)
    images = torch.cat(
        [torch.cat([tiles[:, 0], tiles[:, 1]], dim=-1), torch.cat([tiles[:, 2], tiles[:, 3]], dim=-1)], -2
    )
    return Mosaics(images, torch.cat(chosen).to(x.device), torch.stack(quadrants).to(x.device), source)


def focus(maps: Tensor, quadrants: Tensor) -> Tensor:
    """Focus: the positive relevance on the quadrants of the explained class over all the positive relevance.

    Args:
        maps: One map per mosaic, (M, h, w), any resolution (a grid of odd size is doubled, each cell split
            evenly between the quadrants it straddles).
        quadrants: Which quadrants hold the explained class, (M, 4) bool (see :class:`Mosaics`).

    Returns:
        Each mosaic's focus in [0, 1], (M,); higher is better; NaN where a map has no positive relevance.
    """
    if maps.dim() != 3 or tuple(quadrants.shape) != (len(maps), 4):
        raise ExplainError(
            f"focus takes one map per mosaic (M, h, w) and its quadrants (M, 4); got {tuple(maps.shape)} and "
            f"{tuple(quadrants.shape)}"
        )
    positive = maps.detach().float().clamp_min(0)
    if positive.shape[1] % 2 or positive.shape[2] % 2:
        positive = F.interpolate(positive[:, None], scale_factor=2, mode="nearest")[:, 0] / 4
    half_h, half_w = positive.shape[1] // 2, positive.shape[2] // 2
    per_quadrant = positive.unflatten(1, (2, half_h)).unflatten(3, (2, half_w)).sum(dim=(2, 4)).flatten(1)
    total = per_quadrant.sum(dim=1)
    inside = (per_quadrant * quadrants.to(per_quadrant.device)).sum(dim=1)
    return torch.where(total > 0, inside / total.clamp_min(1e-30), torch.full_like(total, float("nan")))
