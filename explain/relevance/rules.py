r"""LRP's rules for a layer: how the relevance R at the output :math:`z = f(x; W, b)` of a convolution, a linear
layer or a pool goes to its input x. Most are :math:`x \odot J^\top (R / z')` for a modified input, weights or bias,
:math:`z'` the stabilized output (:func:`explain.relevance.epsilon.ratio`). A composite
(:mod:`explain.relevance.composites`) says which layer gets which rule; the operation engine
(:mod:`explain.relevance.operations`) runs it as the backward of the layer's operation, a batch norm that reads the
layer's output merged into it for the call (the model is not modified), as zennit's canonizers merge them.

References: Bach et al., "On Pixel-Wise Explanations for Non-Linear Classifier Decisions by Layer-Wise Relevance
Propagation", PLOS ONE 2015; Montavon et al., "Layer-Wise Relevance Propagation: An Overview", 2019; Kohlbrenner
et al., "Towards Best Practice in Explaining Neural Network Decisions with LRP", IJCNN 2020.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ExplainError
from .epsilon import EPSILON, ratio

Parameters = dict[str, Tensor | None]
STABILIZER = 1e-6  # the denominators' ε in the rules other than ε


@dataclass(frozen=True)
class MergedNorm:
    r"""A batch norm in eval mode merged into the layer before it, :math:`\gamma (z - \mu) / \sqrt{v + e} + \beta`."""

    mean: Tensor
    var: Tensor
    weight: Tensor | None
    bias: Tensor | None
    eps: float

    def folded(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        """A layer's weight and bias (output channels first) with the norm folded in."""
        scale = (self.var + self.eps).rsqrt()
        scale = scale * self.weight if self.weight is not None else scale
        shift = self.bias if self.bias is not None else 0.0
        bias = (bias if bias is not None else 0.0) - self.mean
        return weight * scale.view(-1, *(1,) * (weight.dim() - 1)), bias * scale + shift


@dataclass(frozen=True)
class Layer:
    """One call of a layer's operation, as a rule sees it.

    Attributes:
        func: The operation (``F.conv2d``, ``F.linear``, ``F.avg_pool2d``, ...).
        weight: Its weight (detached), or None (a pool).
        bias: Its bias (detached), or None.
        rest: Its further arguments by position (stride, padding, ...).
        options: Its further arguments by name.
        norm: A batch norm merged into it, or None.
    """

    func: Callable[..., Tensor]
    weight: Tensor | None
    bias: Tensor | None
    rest: tuple = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    norm: MergedNorm | None = None

    @property
    def parameters(self) -> Parameters:
        """Its weight and bias, with a merged batch norm folded in; empty for a pool."""
        if self.weight is None:
            return {}
        if self.norm is None:
            return {"weight": self.weight, "bias": self.bias}
        weight, bias = self.norm.folded(self.weight, self.bias)
        return {"weight": weight, "bias": bias}

    def __call__(self, x: Tensor, parameters: Parameters | None = None) -> Tensor:
        """The operation on ``x``, with its weight and bias replaced by ``parameters`` if given."""
        if self.weight is None:
            return self.func(x, *self.rest, **self.options)
        p = self.parameters if parameters is None else parameters
        return self.func(x, p["weight"], p.get("bias"), *self.rest, **self.options)


Rule = Callable[[Layer, Tensor, Tensor], Tensor]  # (layer, its input, the output's relevance) -> the input's


def clamped(parameters: Parameters, low: float | None = None, high: float | None = None) -> Parameters:
    """The parameters clamped to [low, high]."""
    return {name: None if p is None else p.clamp(min=low, max=high) for name, p in parameters.items()}


def unbiased(parameters: Parameters) -> Parameters:
    """The parameters without their bias."""
    return {**parameters, "bias": None}


def forward_terms(layer: Layer, terms: Sequence[tuple[Tensor, Parameters | None]]) -> list[tuple[Tensor, Tensor]]:
    """Each term (input, parameters) as (the input as a leaf, the layer's output for it), with autograd."""
    found = []
    for x, parameters in terms:
        leaf = x.detach().requires_grad_(True)
        found.append((leaf, layer(leaf, parameters)))
    return found


def input_relevance(terms: Sequence[tuple[Tensor, Tensor]], ratios: Sequence[Tensor]) -> list[Tensor]:
    """Each term's input times the Jacobian-transposed ratio: :math:`x_i \\odot J_i^\\top r_i`."""
    return [leaf.detach() * torch.autograd.grad(out, leaf, grad_outputs=r)[0] for (leaf, out), r in zip(terms, ratios)]


def signed_share(layer: Layer, x: Tensor, relevance: Tensor, up: Parameters, down: Parameters, eps: float) -> Tensor:
    """Relevance shared by two parts: the positive inputs through parameters ``up`` (with their bias) and the
    negative ones through ``down`` (without), the denominator their outputs' sum."""
    terms = forward_terms(layer, [(x.clamp(min=0), up), (x.clamp(max=0), unbiased(down))])
    shared = ratio(relevance, sum(out.detach() for _, out in terms), eps)
    return sum(input_relevance(terms, [shared, shared]))


class Epsilon:
    r"""LRP-ε (LRP-0 at ε = 0): :math:`R_x = x \odot J^\top (R / (z + \epsilon\,\mathrm{sign}\,z))`."""

    def __init__(self, epsilon: float = EPSILON) -> None:
        self.epsilon = epsilon

    def __call__(self, layer: Layer, x: Tensor, relevance: Tensor) -> Tensor:
        terms = forward_terms(layer, [(x, layer.parameters)])
        return input_relevance(terms, [ratio(relevance, terms[0][1].detach(), self.epsilon)])[0]


class AlphaBeta:
    r"""LRP-αβ: positive contributions weighed by α, negative by β (α - β = 1). With :math:`z^+` the output of the
    positive parts (:math:`W^+ x^+ + W^- x^- + b^+`) and :math:`z^-` of the negative ones
    (:math:`W^- x^+ + W^+ x^- + b^-`): :math:`R_x = \alpha\,[x^+ J_{W^+}^\top + x^- J_{W^-}^\top](R / z^+) -
    \beta\,[x^+ J_{W^-}^\top + x^- J_{W^+}^\top](R / z^-)`. At α = 1, β = 0 it is the z⁺ rule."""

    def __init__(self, alpha: float = 2.0, beta: float = 1.0, stabilizer: float = STABILIZER) -> None:
        if alpha < 0 or beta < 0 or alpha - beta != 1:
            raise ExplainError(f"alpha and beta must be non-negative with alpha - beta = 1, got {alpha} and {beta}")
        self.alpha, self.beta, self.stabilizer = alpha, beta, stabilizer

    def __call__(self, layer: Layer, x: Tensor, relevance: Tensor) -> Tensor:
        p = layer.parameters
        positive, negative = clamped(p, low=0.0), clamped(p, high=0.0)
        total = self.alpha * signed_share(layer, x, relevance, positive, negative, self.stabilizer)
        if self.beta:
            total = total - self.beta * signed_share(layer, x, relevance, negative, positive, self.stabilizer)
        return total


class ZPlus(AlphaBeta):
    r"""LRP-z⁺: only positive contributions, :math:`R_x = [x^+ J_{W^+}^\top + x^- J_{W^-}^\top](R / z^+)`."""

    def __init__(self, stabilizer: float = STABILIZER) -> None:
        super().__init__(1.0, 0.0, stabilizer)


class Gamma:
    r"""LRP-γ (generalized to inputs of either sign): positive contributions favoured by γ. Where the output is
    positive, the relevance is shared by :math:`(W + \gamma W^+) x^+ + (W + \gamma W^-) x^-` (the bias
    :math:`b + \gamma b^+`); where it is negative, by :math:`(W + \gamma W^-) x^+ + (W + \gamma W^+) x^-`."""

    def __init__(self, gamma: float = 0.25, stabilizer: float = STABILIZER) -> None:
        self.gamma, self.stabilizer = gamma, stabilizer

    def __call__(self, layer: Layer, x: Tensor, relevance: Tensor) -> Tensor:
        p = layer.parameters
        up = {name: None if v is None else v + self.gamma * v.clamp(min=0) for name, v in p.items()}
        down = {name: None if v is None else v + self.gamma * v.clamp(max=0) for name, v in p.items()}
        with torch.no_grad():
            z = layer(x, p)
        rising = signed_share(layer, x, (z > 0) * relevance, up, down, self.stabilizer)
        return rising + signed_share(layer, x, (z < 0) * relevance, down, up, self.stabilizer)


class ZBox:
    r"""LRP-z^B for the input layer, whose input lies in a box [l, h]: :math:`z = Wx + b - (W^+ l + b^+) -
    (W^- h + b^-)`, :math:`R_x = x \odot J_W^\top r - l \odot J_{W^+}^\top r - h \odot J_{W^-}^\top r` with
    :math:`r = R / z'`.

    Args:
        low: The lowest value of each input channel (a number, or a tensor broadcast to the input).
        high: The highest, likewise.
        stabilizer: ε of the denominator.
    """

    def __init__(self, low: float | Tensor, high: float | Tensor, stabilizer: float = STABILIZER) -> None:
        self.low, self.high, self.stabilizer = low, high, stabilizer

    def __call__(self, layer: Layer, x: Tensor, relevance: Tensor) -> Tensor:
        p = layer.parameters
        low = torch.as_tensor(self.low, dtype=x.dtype, device=x.device).expand_as(x)
        high = torch.as_tensor(self.high, dtype=x.dtype, device=x.device).expand_as(x)
        terms = forward_terms(layer, [(x, p), (low, clamped(p, low=0.0)), (high, clamped(p, high=0.0))])
        (_, z), (_, zl), (_, zh) = terms
        shared = ratio(relevance, (z - zl - zh).detach(), self.stabilizer)
        plain, lowest, highest = input_relevance(terms, [shared] * 3)
        return plain - lowest - highest


class Flat:
    r"""LRP-flat: relevance spread evenly over each output's receptive field, :math:`R_x = J_1^\top (R / z_1)`
    with every weight 1, no bias, and an input of ones; a pool shares it as its own operation does on ones."""

    def __init__(self, stabilizer: float = STABILIZER) -> None:
        self.stabilizer = stabilizer

    def __call__(self, layer: Layer, x: Tensor, relevance: Tensor) -> Tensor:
        p = unbiased({name: torch.ones_like(v) for name, v in layer.parameters.items() if v is not None})
        ((leaf, out),) = forward_terms(layer, [(torch.ones_like(x), p or None)])
        return torch.autograd.grad(out, leaf, grad_outputs=ratio(relevance, out.detach(), self.stabilizer))[0]


class Spread(Flat):
    """A max pool's relevance spread evenly over each output's window, as an average pool of its window would (the
    receptive field of what a max pool reads, whichever element it picks)."""

    def __call__(self, layer: Layer, x: Tensor, relevance: Tensor) -> Tensor:
        rank = x.dim() - 2
        o = {**dict(zip(("kernel_size", "stride", "padding", "dilation", "ceil_mode"), layer.rest)), **layer.options}
        if "adaptive" in getattr(layer.func, "__name__", ""):
            size = o.get("output_size", layer.rest[0] if layer.rest else None)
            pool = Layer(getattr(F, f"adaptive_avg_pool{rank}d"), None, None, (size,))
        else:
            window = (o["kernel_size"], o.get("stride"), o.get("padding", 0), o.get("ceil_mode", False), False)
            pool = Layer(getattr(F, f"avg_pool{rank}d"), None, None, window)
        return super().__call__(pool, x, relevance)
