"""The one ε of relevance: every rule that shares an output's relevance R by the output's value z divides by
:math:`z' = z + \\epsilon\\,\\mathrm{sign}(z)` (+ε at 0), so that a small z does not blow the shares up; the ε
absorbs :math:`R\\,\\epsilon / z'` of the relevance, 0 as ε goes to 0."""

from __future__ import annotations

import torch
from torch import Tensor

EPSILON = 1e-6  # the ε of the ε rule where a method is not given another (zennit's)


def ratio(relevance: Tensor, z: Tensor, epsilon: float = EPSILON, scale: float = 1.0) -> Tensor:
    """:math:`R / (s z)'`, the stabilized ratio (+ε at 0, -ε at -0), in one new tensor (its steps in place: the
    tensors are large)."""
    denominator = torch.copysign(z.new_full((), epsilon), z)  # +ε or -ε by z's sign
    denominator.add_(z, alpha=scale) if scale != 1.0 else denominator.add_(z)
    if relevance.shape == z.shape and relevance.dtype == z.dtype:
        return torch.div(relevance, denominator, out=denominator)
    return relevance / denominator
