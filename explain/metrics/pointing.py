"""Metrics of where a map points, given where the object is: the pointing game (Zhang et al., ECCV 2016) and the
energy-based pointing game (Wang et al., CVPR Workshops 2020, Score-CAM). They need no model.

The object is given as boxes (x1, y1, x2, y2) in input pixels, or as masks at the input's size; maps of any
resolution are upsampled (bilinearly) to the input first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ExplainError
from ..targets import ragged
from .scoring import input_maps

Objects = Tensor | Sequence[Tensor]


def object_masks(objects: Objects, n: int, size: Sequence[int], device: torch.device) -> Tensor:
    """Each image's object as a mask (N, H, W): given masks as they are, boxes drawn (their pixels' centres
    inside the box), several boxes of an image joined.

    Args:
        objects: Masks (N, H, W); boxes (N, 4) or (N, K, 4); or a sequence of N tensors of boxes (K_i, 4).
        n: The number of images.
        size: The input's (H, W).
        device: Where the masks go.

    Raises:
        ExplainError: Neither masks of the input's size nor boxes, or not one entry per image.
    """
    h, w = size
    if isinstance(objects, Tensor) and objects.dim() == 3 and objects.shape[-1] != 4:
        if tuple(objects.shape) != (n, h, w):
            raise ExplainError(f"masks must be (N, H, W) = {(n, h, w)}, got {tuple(objects.shape)}")
        return objects.to(device).bool()
    per_image = list(objects if not isinstance(objects, Tensor) or objects.dim() != 2 else objects[:, None])
    if len(per_image) != n:
        raise ExplainError(f"{len(per_image)} sets of boxes given for {n} images")
    boxes, valid = ragged([torch.as_tensor(b, dtype=torch.float32, device=device).reshape(-1, 4) for b in per_image])
    ys = torch.arange(h, device=device, dtype=torch.float32)[:, None] + 0.5
    xs = torch.arange(w, device=device, dtype=torch.float32)[None, :] + 0.5
    x1, y1, x2, y2 = (boxes[..., i, None, None] for i in range(4))  # (N, K, 1, 1) each
    inside = (xs >= x1) & (xs <= x2) & (ys >= y1) & (ys <= y2) & valid[..., None, None]
    return inside.any(dim=1)


def pointing_game(maps: Tensor, objects: Objects, size: Sequence[int], *, tolerance: float = 15) -> Tensor:
    """Zhang et al.'s pointing game: a hit where the map's maximum lies within ``tolerance`` pixels of the object.

    The maximum is taken on the map upsampled to ``size``; where several pixels share it, all must lie within
    the tolerance (a flat map points nowhere and misses).

    Args:
        maps: One map per image, (N, h, w), any resolution.
        objects: The objects: masks or boxes (see :func:`object_masks`).
        size: The input's (H, W).
        tolerance: Pixels of slack around the object (Zhang et al.'s 15).

    Returns:
        Whether each image's map hits, (N,) bool; its mean is the game's accuracy.
    """
    maps = input_maps(maps, len(maps), size, "pointing_game")
    masks = object_masks(objects, len(maps), size, maps.device)
    radius = int(tolerance)
    offsets = torch.arange(-radius, radius + 1, device=maps.device, dtype=torch.float32)
    disc = (offsets[:, None] ** 2 + offsets[None, :] ** 2 <= tolerance**2).float()[None, None]
    near = F.conv2d(masks[:, None].float(), disc, padding=radius)[:, 0] > 0  # within the tolerance of the object
    peaks = maps == maps.amax(dim=(1, 2), keepdim=True)
    flat = maps.amax(dim=(1, 2)) == maps.amin(dim=(1, 2))
    return (peaks & ~near).flatten(1).any(dim=1).logical_not() & ~flat


def energy_pointing_game(maps: Tensor, objects: Objects, size: Sequence[int]) -> Tensor:
    """The energy-based pointing game (Score-CAM): the share of the map's mass that lies on the object.

    Args:
        maps: One non-negative map per image, (N, h, w), any resolution (as the methods return them).
        objects: The objects: masks or boxes (see :func:`object_masks`).
        size: The input's (H, W).

    Returns:
        Each image's share in [0, 1], (N,); 0 for a map of zero mass.

    Raises:
        ExplainError: A map has negative values (its mass is not defined).
    """
    maps = input_maps(maps, len(maps), size, "energy_pointing_game")
    if bool((maps < 0).any()):
        raise ExplainError("the energy pointing game needs non-negative maps; normalize them or take their ReLU")
    masks = object_masks(objects, len(maps), size, maps.device)
    total = maps.flatten(1).sum(dim=1)
    inside = (maps * masks).flatten(1).sum(dim=1)
    return torch.where(total > 0, inside / total.clamp_min(torch.finfo(total.dtype).tiny), 0.0)
