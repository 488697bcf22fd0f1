"""Targets of a dense output: a segmenter's classes over their regions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import NothingToExplain, TargetError
from .base import BoundTarget, OutputPicker, Target, class_index, per_image, spatial_axes


class SegmentationTarget(Target):
    """Classes of a dense output (N, classes, *spatial): each class's logit summed over its region. The spatial
    axes are an image's (H, W), a volume's (D, H, W) (a 3-D U-Net's) or a signal's (L,).

    Args:
        classes: A class index or name for all images, or one per image; None: every class
            that wins at least one pixel of an image's argmax, one map each (a K axis, as
            long as the image with the most classes; ``valid`` marks the real entries).
        mask: The region, (*spatial) for all images or (N, *spatial), boolean or weights; resized
            (nearest) to the output's size. Default: the pixels where the class wins
            the argmax on the plain pass. An empty region is an error (its map would be
            the gradient of a constant).
        background: A class never explained with ``classes=None`` (torchvision's
            segmenters: 0, ``__background__``).
        output: See :class:`Target` (torchvision's segmentation models return a dict
            whose ``"out"`` is read automatically).
    """

    geometric = True

    def __init__(
        self,
        classes: Any = None,
        mask: Tensor | None = None,
        *,
        background: int | None = None,
        output: OutputPicker = None,
    ) -> None:
        super().__init__(output)
        if classes is None and mask is not None:
            raise TargetError("a SegmentationTarget mask needs classes=: the class explained over it")
        self.classes, self.mask, self.background = classes, mask, background

    def given_mask(self, n: int, size: Sequence[int], like: Tensor) -> Tensor:
        """The given mask as (N, *spatial) weights at the output's spatial ``size``."""
        mask = torch.as_tensor(self.mask, device=like.device).to(like.dtype)
        mask = mask[None].expand(n, *mask.shape) if mask.dim() == len(size) else mask
        if mask.dim() != len(size) + 1 or mask.shape[0] != n:
            shape = "x".join("HW" if len(size) == 2 else "DHW" if len(size) == 3 else "L")
            raise TargetError(
                f"a mask must be ({shape}) or one per image (N, {shape}) for {n} images, got {tuple(mask.shape)}"
            )
        return F.interpolate(mask[:, None], size=tuple(size), mode="nearest-exact")[:, 0]

    def chosen(self, logits: Tensor, labels: Sequence[str] | None) -> tuple[Tensor, Tensor]:
        """Each image's explained classes (N, K) and their regions (N, K, *spatial) on the plain pass."""
        n, num_classes = logits.shape[:2]
        winners = logits.argmax(dim=1)
        if self.classes is None:
            won = torch.zeros(n, num_classes, dtype=torch.bool, device=logits.device)
            won.scatter_(1, winners.flatten(1), True)  # (N, classes): which classes win a pixel of each image
            if self.background is not None:
                won[:, self.background] = False
            if not won.any():
                raise NothingToExplain("no class but the background wins a pixel")
            index = torch.arange(num_classes, device=logits.device).expand(n, -1)
            ranked = torch.where(won, index, num_classes).sort(dim=1).values[:, : int(won.sum(dim=1).max())]
            classes = torch.where(ranked < num_classes, ranked, -1)  # each image's classes in order, then -1
        else:
            chosen = [class_index(c, labels, num_classes) for c in per_image(self.classes, n, "classes")]
            classes = torch.tensor(chosen, device=logits.device)[:, None]
        if self.mask is not None:
            regions = self.given_mask(n, logits.shape[2:], logits)[:, None]
        else:
            regions = (winners[:, None] == classes.view(*classes.shape, *(1,) * winners[0].dim())).to(logits.dtype)
        empty = (~regions[:, 0].flatten(1).ne(0).any(dim=1)).nonzero() if self.classes is not None else []
        if len(empty):
            i = int(empty[0])
            name = labels[classes[i, 0]] if labels else f"class {int(classes[i, 0])}"
            found = "the mask is empty" if self.mask is not None else f"{name} wins no pixel"
            raise NothingToExplain(found, i, f"give a mask= to explain {name} over a region")
        return classes, regions

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        logits = self.read(output)
        if not 3 <= logits.dim() <= 5:
            raise TargetError(
                f"SegmentationTarget needs a dense (N, classes, *spatial) output, got {tuple(logits.shape)}"
            )
        classes, regions = self.chosen(logits.detach(), labels)
        valid = classes >= 0
        spatial = spatial_axes(logits)
        index = classes.clamp(min=0).view(*classes.shape, *(1,) * len(spatial))

        def score(out: Any, images: Tensor) -> Tensor:
            dense = self.read(out)
            if dense.shape[2:] != regions.shape[2:]:
                raise TargetError("the segmentation region is fixed at the plain pass's resolution, not this pass's")
            picked = dense.gather(1, index[images].expand(-1, -1, *dense.shape[2:]))
            return (picked * regions[images]).sum(dim=spatial) * valid[images]

        probabilities = logits.detach().float().softmax(dim=1).gather(1, index.expand(-1, -1, *logits.shape[2:]))
        area = regions.sum(dim=spatial)
        return BoundTarget(
            score=score,
            classes=classes,
            probabilities=(probabilities * regions).sum(dim=spatial) / area.clamp_min(1e-12) * valid,
            keeps_k=self.classes is None,
            valid=None if self.classes is not None else valid,
            regions=regions.expand(-1, classes.shape[1], *regions.shape[2:]),
        )
