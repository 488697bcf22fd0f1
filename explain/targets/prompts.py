"""Targets of a promptable segmenter (SAM): the mask it draws for its prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from ..errors import NothingToExplain, TargetError
from .base import BoundTarget, Target


class PromptMaskTarget(Target):
    """The mask a promptable segmenter draws for its prompt (Hugging Face's ``SamModel`` and its kind, whose output
    holds ``pred_masks`` (N, 1, masks, h, w), mask logits, and ``iou_scores`` (N, 1, masks); see
    :class:`explain.models.sam.SamPrompted`).

    Args:
        by: ``"mask"``: the mean logit of the mask over its region, the cells where its logit is positive on the
            plain pass (fixed there); ``"iou"``: the model's predicted IoU of the mask.
        mask: Which of the model's masks (its multimask output); None: the one it predicts the best IoU for on
            the plain pass, as SAM's users pick.
    """

    geometric = True

    def __init__(self, by: Literal["mask", "iou"] = "mask", mask: int | None = None) -> None:
        super().__init__(None)
        if by not in ("mask", "iou"):
            raise TargetError(f"PromptMaskTarget explains a mask by 'mask' or 'iou', got {by!r}")
        self.by, self.mask = by, mask

    @staticmethod
    def fields(output: Any) -> tuple[Tensor, Tensor]:
        """The output's mask logits (N, masks, h, w) and predicted IoUs (N, masks), of the first prompt."""
        masks, ious = getattr(output, "pred_masks", None), getattr(output, "iou_scores", None)
        if not isinstance(masks, Tensor) or not isinstance(ious, Tensor) or masks.dim() != 5:
            raise TargetError(
                "PromptMaskTarget reads a promptable segmenter's pred_masks and iou_scores (SAM); the model returns "
                f"a {type(output).__name__}: explain it with the target of its kind"
            )
        return masks[:, 0], ious[:, 0]

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        masks, ious = (field.detach() for field in self.fields(output))
        if self.mask is not None and not 0 <= self.mask < masks.shape[1]:
            raise TargetError(f"mask {self.mask} is out of range: the model drew {masks.shape[1]} masks")
        chosen = ious.argmax(dim=1) if self.mask is None else torch.full_like(ious[:, 0], self.mask).long()
        regions = (masks[torch.arange(len(masks)), chosen] > 0).float()
        empty = (regions.flatten(1).sum(dim=1) == 0).nonzero()
        if self.by == "mask" and len(empty):
            raise NothingToExplain("the mask drawn for the prompt is empty", int(empty[0]), "explain it by='iou'")

        def score(out: Any, images: Tensor) -> Tensor:
            logits, predicted = self.fields(out)
            picked = chosen[images]
            if self.by == "iou":
                return predicted[torch.arange(len(images)), picked][:, None]
            mask = logits[torch.arange(len(images)), picked]
            region = regions[images]
            return ((mask * region).flatten(1).sum(dim=1) / region.flatten(1).sum(dim=1))[:, None]

        return BoundTarget(
            score=score,
            classes=chosen[:, None],
            probabilities=ious.gather(1, chosen[:, None]).float(),
            regions=regions[:, None],
            names=("mask",) * masks.shape[1],  # the model's masks are its classes: each one a mask
        )
