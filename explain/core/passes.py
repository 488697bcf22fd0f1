"""What one pass records (:class:`PassRecord`), its target's scores, and the check that they reach the layers: shared
by the pass runner (:mod:`explain.core.runner`) and the speedups that run a pass of their own
(:mod:`explain.core.speedups.settling`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..errors import LayerError, TargetError
from ..targets import BoundTarget
from .hooks import layer_entry
from .layers import BACKBONE
from .layouts import Geometry, Layout
from .maps import Canvas


@dataclass(frozen=True)
class PassRecord:
    """What one pass recorded at every target layer, before any method's formula.

    Attributes:
        x: The images the pass ran on, detached.
        output: The model's output.
        bound: The call's bound target.
        scores: Its (N, K) scores in this pass's output.
        activations: Each layer's output as a map (N, C, h, w), float32 (and the input's, for a method whose map
            is the input's).
        gradients: For each of the K targets, each layer's gradient as a map like its activation (empty maps for
            a method without gradients).
        curvatures: For each of the K targets, each layer's Hessian-vector product H·A as a map (empty maps for a
            method that asks for none).
        layouts: How each layer's output became its map.
        canvas: A detector's canvas (its maps are brought onto the image), or None.
        geometry: The picture the pass's layers saw, and the patch grid.
    """

    x: Tensor
    output: Any
    bound: BoundTarget
    scores: Tensor
    activations: dict[str, Tensor]
    gradients: list[dict[str, Tensor]]
    curvatures: list[dict[str, Tensor]]
    layouts: dict[str, Layout]
    canvas: Canvas | None
    geometry: Geometry

    def kept(self, name: str) -> PassRecord:
        """The record of one of its layers alone."""

        def of(values: dict[str, Any]) -> dict[str, Any]:
            return {key: value for key, value in values.items() if key == name}

        return replace(
            self,
            activations=of(self.activations),
            gradients=[of(g) for g in self.gradients],
            curvatures=[of(c) for c in self.curvatures],
            layouts=of(self.layouts),
        )


def summed_score(bound: BoundTarget, k: int, images: Tensor, output: Any) -> Tensor:
    """The k-th target's score in an output whose row r stands for image ``images[r]``, summed over the rows."""
    return bound.score(output, images)[:, k].sum()


def target_scores(bound: BoundTarget, output: Any, x: Tensor) -> Tensor:
    """The (N, K) scores of a bound target in the output of a pass over the call's N images ``x``."""
    scores = bound.score(output, torch.arange(x.shape[0], device=x.device))
    if scores.shape[0] != x.shape[0]:
        raise TargetError(f"{scores.shape[0]} target scores for a batch of {x.shape[0]} images")
    return scores


def check_reached(gradients: list[dict[str, Tensor]], bound: BoundTarget, automatic: bool) -> None:
    """Refuse maps of a gradient that is zero everywhere: they would be flat, a confident picture of nothing.
    The message's way out depends on whether the layers are the automatic ones.

    Raises:
        LayerError: For some image and target, the gradient is zero at every position of every layer.
    """
    for k, by_layer in enumerate(gradients):
        zero = torch.stack([g.flatten(1).abs().amax(dim=1) == 0 for g in by_layer.values()]).all(dim=0)
        if bound.valid is not None:
            zero &= bound.valid[:, k]
        if not zero.any():
            continue
        if automatic and all(layer_entry(name)[0] == BACKBONE for name in by_layer):
            why = (
                "The automatic layers leave out a detector's pyramid levels one cell wide, too coarse to map, "
                "and a detection there reaches none of the others: choose a layer inside the backbone, "
                "whose maps feed every level (explain --layers)"
            )
        else:
            why = (
                "At the last block of a class-token transformer, say, the head never reads the patch tokens: "
                "choose an earlier layer (explain --layers)" + ("" if automatic else ", or the automatic one")
            )
        raise LayerError(
            f"the target score's gradient is zero at every position of layer(s) {', '.join(by_layer)} "
            f"(image {int(zero.nonzero()[0])}): the score does not depend on the map there. {why}"
        )
