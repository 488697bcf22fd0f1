"""Targets of a dense regression: a depth model's depth, or any map-valued output, reduced over a region.

A region is a box, a mask, or a point's neighbourhood, in the pixels of the image it is drawn on (``size``); it is
placed on the output's grid by proportion, which holds where the output covers the image's whole field of view
(depth models do: they resize, they do not crop). Its reduction (mean, sum, max or min) times ``sign`` is the
score: ``sign=1`` explains what raises the values, ``sign=-1`` what lowers them, so that "nearer" and "farther"
are both expressible (:func:`nearer_sign` reads which is which from a depth model's config).

A CAM keeps the positive part of its map: the map of ``sign=1`` shows where the score rises, the map of
``sign=-1`` where it falls. The two together are the signed map; a method with ``relu=False`` (or the pixel
attributions' ``raw``) gives it in one pass.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ImageRefused, NothingToExplain, TargetError
from .base import BoundTarget, OutputPicker, Target

Reduction = Literal["mean", "sum", "max", "min"]


class RegionTarget(Target):
    """A dense output's values over a region, reduced to one score per image.

    Args:
        box: ``(x1, y1, x2, y2)`` in the pixels of ``size``: for all images, or one row per image (N, 4). A cell
            the box covers in part weighs by the share it covers.
        mask: The region as (H, W) or one per image (N, H, W), boolean or weights, at any size covering the image
            (resized, nearest, to the output's grid).
        point: ``(x, y)`` in the pixels of ``size``: the output cell holding it, and with ``radius`` the cells whose
            centres lie within it; for all images, or one row per image (N, 2).
        radius: The point's neighbourhood, in pixels of ``size``.
        size: ``(H, W)``: the image whose pixels ``box`` and ``point`` are in: the model's input (``x.shape[-2:]``),
            or the photo it was resized from without a crop; the output is taken to cover it whole. One per image
            (N, 2) where the photos differ in size. None: the output's own grid.
        reduction: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` of the values over the region.
        sign: +1 explains what raises the reduced value, -1 what lowers it.
        channel: The channel of an (N, C, H, W) output (None: an (N, H, W) output, or one of one channel).
        output: See :class:`Target`; a depth model's ``predicted_depth`` is read without it.
    """

    geometric = True

    def __init__(
        self,
        box: Sequence[float] | Tensor | None = None,
        *,
        mask: Tensor | None = None,
        point: Sequence[float] | Tensor | None = None,
        radius: float = 0.0,
        size: Sequence[int] | None = None,
        reduction: Reduction = "mean",
        sign: Literal[1, -1] = 1,
        channel: int | None = None,
        output: OutputPicker = None,
    ) -> None:
        super().__init__(output)
        if sum(region is not None for region in (box, mask, point)) != 1:
            raise TargetError("a RegionTarget takes one region: box=(x1, y1, x2, y2), mask= or point=(x, y)")
        if reduction not in ("mean", "sum", "max", "min"):
            raise TargetError(f"reduction must be 'mean', 'sum', 'max' or 'min', got {reduction!r}")
        if sign not in (1, -1):
            raise TargetError(f"sign must be +1 or -1, got {sign!r}")
        self.box, self.mask, self.point, self.radius = box, mask, point, radius
        self.size, self.reduction, self.sign, self.channel = size, reduction, sign, channel

    def values(self, output: Any) -> Tensor:
        """The dense output as (rows, H, W)."""
        dense = self.read(output)
        if dense.dim() == 4 and (self.channel is not None or dense.shape[1] == 1):
            channel = self.channel or 0
            if not 0 <= channel < dense.shape[1]:
                raise TargetError(f"channel {channel} is out of range for an output of {dense.shape[1]} channels")
            dense = dense[:, channel]
        elif dense.dim() == 4:
            raise TargetError(
                f"the output has {dense.shape[1]} channels, (N, C, H, W) = {tuple(dense.shape)}: give channel="
            )
        if dense.dim() != 3:
            raise TargetError(f"a RegionTarget needs a dense (N, H, W) output, got {tuple(dense.shape)}")
        return dense

    def weights(self, n: int, grid: Sequence[int], like: Tensor) -> Tensor:
        """The region's weights on the output's grid, (N, H, W).

        Raises:
            TargetError: The region lies outside the image.
        """
        height, width = grid
        if self.mask is not None:
            mask = torch.as_tensor(self.mask, device=like.device).to(like.dtype)
            mask = mask.expand(n, *mask.shape[-2:]) if mask.dim() == 2 else mask
            if mask.dim() != 3 or mask.shape[0] != n:
                raise TargetError(f"a region mask must be (H, W) or (N, H, W) for {n} images, got {tuple(mask.shape)}")
            return F.interpolate(mask[:, None], size=(height, width), mode="nearest-exact")[:, 0]
        frames = self.frames(n, grid, like.device)  # (N, 2): each image's (H, W)
        scale = torch.stack([width / frames[:, 1], height / frames[:, 0]], dim=1)  # (N, 2): x and y
        rows = torch.arange(height, device=like.device, dtype=torch.float64)[None, :, None]  # cell i spans [i, i + 1]
        columns = torch.arange(width, device=like.device, dtype=torch.float64)[None, None]
        if self.box is not None:
            boxes = torch.as_tensor(self.box, dtype=torch.float64, device=like.device).reshape(-1, 4).expand(n, 4)
            inside = [_inside_box(box, frame) for box, frame in zip(boxes, frames.tolist())]
            low, high = (boxes[:, :2] * scale)[..., None, None], (boxes[:, 2:] * scale)[..., None, None]
            across = (torch.minimum(columns + 1, high[:, 0]) - torch.maximum(columns, low[:, 0])).clamp(0, 1)
            down = (torch.minimum(rows + 1, high[:, 1]) - torch.maximum(rows, low[:, 1])).clamp(0, 1)
            region = across * down  # each cell's share covered by the box
        else:
            points = torch.as_tensor(self.point, dtype=torch.float64, device=like.device).reshape(-1, 2).expand(n, 2)
            inside = [bool(0 <= p[0] < f[1] and 0 <= p[1] < f[0]) for p, f in zip(points, frames.tolist())]
            at = (points * scale)[..., None, None]
            cell = (columns == at[:, 0].floor()) & (rows == at[:, 1].floor())
            reach = (self.radius * scale.mean(dim=1))[:, None, None]
            disc = (columns + 0.5 - at[:, 0]) ** 2 + (rows + 0.5 - at[:, 1]) ** 2 <= reach**2
            region = (cell | disc).double()
        if not all(inside):
            i = inside.index(False)
            frame = "x".join(str(int(v)) for v in frames[i].tolist())
            raise ImageRefused(f"the region lies outside the {frame} image it is drawn on", i)
        return region.to(like.dtype)

    def drawn_on(self, sizes: Sequence[Sequence[int]]) -> RegionTarget:
        """The same region drawn on images of ``sizes``, one (H, W) per image: a copy whose ``size`` they are."""
        drawn = copy.copy(self)
        drawn.size = [tuple(size) for size in sizes]
        return drawn

    def frames(self, n: int, grid: Sequence[int], device: torch.device) -> Tensor:
        """Each image's frame, the (H, W) its box or point is drawn in, as (N, 2) float64.

        Raises:
            TargetError: ``size`` is neither one (H, W) nor one per image.
        """
        sizes = torch.as_tensor(self.size if self.size is not None else grid, dtype=torch.float64, device=device)
        if sizes.shape not in ((2,), (n, 2)):
            raise TargetError(f"size must be (H, W) or one (H, W) per image for {n} images, got {tuple(sizes.shape)}")
        return sizes.expand(n, 2)

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        """Fix the region on the plain pass's grid; the bound target's ``probabilities`` hold the region's value
        (the reduction, unsigned) and its one class is 0 (the output's)."""
        dense = self.values(output).detach()
        weights = self.weights(len(dense), dense.shape[1:], dense)
        empty = (weights.flatten(1).sum(dim=1) == 0).nonzero()
        if len(empty):
            raise NothingToExplain("the region covers no cell of the output", int(empty[0]), "give a larger region")

        def score(out: Any, images: Tensor) -> Tensor:
            values, region = self.values(out), weights[images]
            if values.shape[1:] != region.shape[1:]:
                raise TargetError("the region is fixed at the plain pass's resolution, not this pass's")
            if self.reduction == "max":
                reduced = torch.where(region > 0, values, -torch.inf).flatten(1).amax(dim=1)
            elif self.reduction == "min":
                reduced = torch.where(region > 0, values, torch.inf).flatten(1).amin(dim=1)
            else:
                reduced = (values * region).flatten(1).sum(dim=1)
                if self.reduction == "mean":
                    reduced = reduced / region.flatten(1).sum(dim=1)
            return (self.sign * reduced)[:, None]

        value = self.sign * score(output, torch.arange(len(dense), device=dense.device)).detach()
        zeros = torch.zeros(len(dense), 1, dtype=torch.long, device=dense.device)
        return BoundTarget(score=score, classes=zeros, probabilities=value.float(), regions=weights[:, None])


def _inside_box(box: Tensor, frame: Sequence[int]) -> bool:
    """Whether a box (x1, y1, x2, y2) is a box inside an image of ``frame`` (H, W)."""
    x1, y1, x2, y2 = box.tolist()
    return 0 <= x1 < x2 <= frame[1] and 0 <= y1 < y2 <= frame[0]


def nearer_sign(model: nn.Module) -> Literal[1, -1]:
    """The sign that makes a depth model's :class:`RegionTarget` explain what brings the region nearer, read from
    its config: -1 for a model of metric depth (GLPN, ZoeDepth, Depth Anything's metric checkpoints: nearer is
    smaller), +1 for one of relative inverse depth (Depth Anything's relative checkpoints: nearer is larger).

    Raises:
        TargetError: The config does not say (DPT checkpoints are trained for either): the message names the way
            out, ``sign=`` given by hand.
    """
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind in ("glpn", "zoedepth"):
        return -1
    if kind == "depth_anything":
        return -1 if getattr(config, "depth_estimation_type", "relative") == "metric" else 1
    raise TargetError(
        f"the {kind or type(model).__name__} model's config does not say whether it predicts depth or inverse depth: "
        "give sign=1 where larger values are nearer (inverse depth, MiDaS-style DPT) or sign=-1 where they are "
        "farther (metric depth)"
    )
