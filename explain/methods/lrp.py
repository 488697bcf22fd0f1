"""Layer-wise relevance propagation (LRP): the score's relevance propagated back to the input, layer by layer, by a
rule per module type (zennit's design: rules by type, and the standard composites by name).

Each rule says how a layer with input x, function z = f(x; W, b) and output relevance R hands relevance to its
input; most are :math:`x \\odot J^\\top (R / z')` for a modified input, weights or bias and a stabilized
denominator :math:`z' = z + \\epsilon\\,\\mathrm{sign}(z)` (+1 where z is 0). They run as a backward rule context
(:func:`explain.core.rules.relevance_rules`), batch norms merged into the layer before them for the call.
References: Bach et al., "On Pixel-Wise Explanations for Non-Linear Classifier Decisions by Layer-Wise Relevance
Propagation", PLOS ONE 2015; Montavon et al., "Layer-Wise Relevance Propagation: An Overview", 2019; Kohlbrenner
et al., "Towards Best Practice in Explaining Neural Network Decisions with LRP", IJCNN 2020 (the composites).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from ..core.engine import Capture, Needs
from ..core.layers import LayerSpec
from ..core.maps import postprocess
from ..core.result import CAMResult
from ..core.rules import ELEMENTWISE, BatchNorm, Rule, RuledLayer, passed, relevance_rules
from ..errors import ExplainError, LayerError
from ..targets import BoundTarget, Target, TargetLike
from .attribution import InputAttribution

Parameters = dict[str, Tensor]
STABILIZER = 1e-6


def stabilized(z: Tensor, epsilon: float) -> Tensor:
    """z moved away from 0 by epsilon, in its own sign's direction (+ at 0)."""
    return z + epsilon * torch.where(z >= 0, 1.0, -1.0)


def clamped(parameters: Parameters, low: float | None = None, high: float | None = None) -> Parameters:
    """The parameters clamped to [low, high]."""
    return {name: p.clamp(min=low, max=high) for name, p in parameters.items()}


def unbiased(parameters: Parameters) -> Parameters:
    """The parameters with a zero bias."""
    return {name: torch.zeros_like(p) if name == "bias" else p for name, p in parameters.items()}


def forward_terms(layer: RuledLayer, terms: Sequence[tuple[Tensor, Parameters | None]]) -> list[tuple[Tensor, Tensor]]:
    """Each term (input, parameters) as (the input as a leaf, the layer's output for it), with autograd."""
    found = []
    for x, parameters in terms:
        leaf = x.detach().requires_grad_(True)
        found.append((leaf, layer(leaf, parameters)))
    return found


def input_relevance(terms: Sequence[tuple[Tensor, Tensor]], ratios: Sequence[Tensor]) -> list[Tensor]:
    """Each term's input times the Jacobian-transposed ratio: :math:`x_i \\odot J_i^\\top r_i`."""
    return [
        leaf.detach() * torch.autograd.grad(out, leaf, grad_outputs=ratio)[0]
        for (leaf, out), ratio in zip(terms, ratios)
    ]


def signed_share(
    layer: RuledLayer, x: Tensor, relevance: Tensor, up: Parameters, down: Parameters, stabilizer: float
) -> Tensor:
    """Relevance shared by two parts: the positive inputs through parameters ``up`` (with their bias) and the
    negative ones through ``down`` (without), the denominator their outputs' sum."""
    terms = forward_terms(layer, [(x.clamp(min=0), up), (x.clamp(max=0), unbiased(down))])
    ratio = relevance / stabilized(sum(out.detach() for _, out in terms), stabilizer)
    return sum(input_relevance(terms, [ratio, ratio]))


class Epsilon:
    r"""LRP-ε (LRP-0 at ε = 0): :math:`R_x = x \odot J^\top (R / (z + \epsilon\,\mathrm{sign}\,z))`."""

    def __init__(self, epsilon: float = 1e-6) -> None:
        self.epsilon = epsilon

    def __call__(self, layer: RuledLayer, x: Tensor, relevance: Tensor) -> Tensor:
        terms = forward_terms(layer, [(x, layer.parameters)])
        return input_relevance(terms, [relevance / stabilized(terms[0][1].detach(), self.epsilon)])[0]


class Norm(Epsilon):
    r"""A layer without weights (average pooling): its input's share of each output,
    :math:`R_x = x \odot J^\top (R / z')`, ε only a stabilizer."""

    def __init__(self, stabilizer: float = STABILIZER) -> None:
        super().__init__(stabilizer)


class AlphaBeta:
    r"""LRP-αβ: positive contributions weighed by α, negative by β (α - β = 1). With :math:`z^+` the output of the
    positive parts (:math:`W^+ x^+ + W^- x^- + b^+`) and :math:`z^-` of the negative ones
    (:math:`W^- x^+ + W^+ x^- + b^-`): :math:`R_x = \alpha\,[x^+ J_{W^+}^\top + x^- J_{W^-}^\top](R / z^+) -
    \beta\,[x^+ J_{W^-}^\top + x^- J_{W^+}^\top](R / z^-)`. At α = 1, β = 0 it is the z⁺ rule."""

    def __init__(self, alpha: float = 2.0, beta: float = 1.0, stabilizer: float = STABILIZER) -> None:
        if alpha < 0 or beta < 0 or alpha - beta != 1:
            raise ExplainError(f"alpha and beta must be non-negative with alpha - beta = 1, got {alpha} and {beta}")
        self.alpha, self.beta, self.stabilizer = alpha, beta, stabilizer

    def __call__(self, layer: RuledLayer, x: Tensor, relevance: Tensor) -> Tensor:
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

    def __call__(self, layer: RuledLayer, x: Tensor, relevance: Tensor) -> Tensor:
        p = layer.parameters
        up_p = {name: v + self.gamma * v.clamp(min=0) for name, v in p.items()}
        down_p = {name: v + self.gamma * v.clamp(max=0) for name, v in p.items()}
        with torch.no_grad():
            z = layer(x, p)
        rising = signed_share(layer, x, (z > 0) * relevance, up_p, down_p, self.stabilizer)
        return rising + signed_share(layer, x, (z < 0) * relevance, down_p, up_p, self.stabilizer)


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

    def __call__(self, layer: RuledLayer, x: Tensor, relevance: Tensor) -> Tensor:
        p = layer.parameters
        low = torch.as_tensor(self.low, dtype=x.dtype, device=x.device).expand_as(x)
        high = torch.as_tensor(self.high, dtype=x.dtype, device=x.device).expand_as(x)
        terms = forward_terms(layer, [(x, p), (low, clamped(p, low=0.0)), (high, clamped(p, high=0.0))])
        (_, z), (_, zl), (_, zh) = terms
        ratio = relevance / stabilized((z - zl - zh).detach(), self.stabilizer)
        plain, lowest, highest = input_relevance(terms, [ratio] * 3)
        return plain - lowest - highest


class Flat:
    r"""LRP-flat: relevance spread evenly over each output's receptive field, :math:`R_x = J_1^\top (R / z_1)`
    with every weight 1, no bias, and an input of ones."""

    def __init__(self, stabilizer: float = STABILIZER) -> None:
        self.stabilizer = stabilizer

    weights = staticmethod(torch.ones_like)

    def __call__(self, layer: RuledLayer, x: Tensor, relevance: Tensor) -> Tensor:
        p = unbiased({name: self.weights(v) if name == "weight" else v for name, v in layer.parameters.items()})
        ((leaf, out),) = forward_terms(layer, [(torch.ones_like(x), p)])
        return torch.autograd.grad(out, leaf, grad_outputs=relevance / stabilized(out.detach(), self.stabilizer))[0]


class WSquare(Flat):
    r"""LRP-w²: relevance spread by the squared weights, :math:`R_x = J_{W^2}^\top (R / z_{W^2})` on an input of
    ones, without the bias (as the rule's paper; zennit squares the bias too)."""

    weights = staticmethod(torch.square)


CONVOLUTIONS = (nn.modules.conv._ConvNd,)
POOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)


def composite_rules(
    name: str, low: float | Tensor | None = None, high: float | Tensor | None = None
) -> dict[Any, Rule]:
    """A standard composite's rule per module type (the first convolution's under ``"first"``).

    ``"epsilon"``: LRP-ε everywhere; ``"epsilon_plus"``: z⁺ in convolutions, ε in linear layers;
    ``"epsilon_alpha2_beta1"``: α2β1 in convolutions; ``"epsilon_gamma_box"``: γ = 0.25 in convolutions and
    z^B(low, high) in the first one. All: ε = 1e-6 in linear layers, average pooling shared by input, element-wise
    activations and unmerged batch norms passing relevance through (zennit's composites of those names).

    Raises:
        ExplainError: An unknown name.
    """
    convolution = {
        "epsilon": Epsilon(),
        "epsilon_plus": ZPlus(),
        "epsilon_alpha2_beta1": AlphaBeta(2.0, 1.0),
        "epsilon_gamma_box": Gamma(0.25),
    }
    if name not in convolution:
        raise ExplainError(f"unknown LRP composite {name!r}; known: {', '.join(COMPOSITES)}")
    rules: dict[Any, Rule] = {
        ELEMENTWISE: passed,
        BatchNorm: passed,
        POOLS: Norm(),
        CONVOLUTIONS: convolution[name],
        nn.Linear: Epsilon(),
    }
    if name == "epsilon_gamma_box":
        rules["first"] = ZBox(low, high)
    return rules


COMPOSITES = ("epsilon_plus", "epsilon_alpha2_beta1", "epsilon_gamma_box", "epsilon")


class Propagation(InputAttribution):
    r"""Base of the relevance propagations: the input's gradient, under the method's backward rules, is its
    relevance; ``raw`` is it per channel, signed, and the map its positive part summed over the channels. The
    relevance starts as 1 at the explained score; the result's ``completeness`` is how far the input's falls from
    it, :math:`\sum R - 1` per image (and target), 0 where every rule conserves.

    With a ``layer``, the relevance is read where it arrives at that layer's output instead (the gradient there,
    under the rules), laid out as the engine lays the layer out (a transformer's patch tokens on their grid, a
    class token left out): ``raw`` is it per channel at the layer's resolution, the map its positive part summed
    over the channels and upsampled, ``completeness`` its sum minus 1.

    Args:
        model: Any model explain explains; left as it was.
        layer: One layer (a dotted name or a module) whose relevance to read; None: the input's.
        **options: As for :class:`InputAttribution`.

    Raises:
        LayerError: Several layers are given (relevance is read at one).
    """

    needs = Needs(gradients=False, input_gradient=True, whole_backward=True, map_of_input=True)
    at_layer = Needs(gradients=True, whole_backward=True)

    def __init__(self, model: nn.Module, layer: LayerSpec | Sequence[str | nn.Module] = None, **options: Any) -> None:
        super().__init__(model, **options)
        if isinstance(layer, (list, tuple)) and len(layer) != 1:
            raise LayerError(f"{self.name} reads relevance at one layer; {len(layer)} were given: name one")
        layer = layer[0] if isinstance(layer, (list, tuple)) else layer
        if layer is not None:
            self.requested, self.needs = [layer], self.at_layer

    def target_for(self, target: TargetLike, topk: int | None) -> Target | BoundTarget:
        """The call's target, scored by the model's own output (a token's logit, not its log-probability): the
        relevance starts there, as 1."""
        goal = super().target_for(target, topk)
        return goal.from_logits() if isinstance(goal, Target) else goal

    def completed(self, result: CAMResult, x: Tensor, model_kwargs: Mapping[str, Any]) -> CAMResult:
        raw = result.raw if result.target.keeps_k else result.raw[:, None]
        gap = (raw.flatten(2).double().sum(dim=2) - 1).float()
        return replace(result, completeness=gap if result.target.keeps_k else gap[:, 0])

    def attribution(self, capture: Capture) -> Tensor:
        return capture.gradients

    def combined(self, attribution: Tensor, rank: int) -> Tensor:
        return attribution.sum(dim=-rank - 1)

    def finish(self, raw: Tensor, rank: int, size: Sequence[int] | None, normalize: bool) -> Tensor:
        return postprocess(self.combined(raw, rank).clamp(min=0), rank, size, normalize)


class LRP(Propagation):
    r"""Layer-wise relevance propagation with a composite of rules by module type (see this module's notes).

    The relevance of the explained output is its score's gradient, 1 (as zennit's with a one-hot output), so the
    input's relevance sums to 1 where the rules conserve it; each module of a type the composite
    names hands its output's relevance to its input by its rule; other modules (max pooling, reshapes, functions
    such as a residual ``+``) pass it as the gradient does, so relevance is conserved only through ruled modules.
    ``raw`` is the input's relevance per channel, signed; the map is its positive part summed over the channels.

    Args:
        model: Any model explain explains; left as it was (batch norms are merged for the call, not in the model).
        layer: One layer whose relevance to read (see :class:`Propagation`); None: the input's.
        labels: Class names, to accept a class name as target.
        composite: ``"epsilon_plus"`` (default), ``"epsilon_alpha2_beta1"``, ``"epsilon_gamma_box"`` or
            ``"epsilon"`` (see :func:`composite_rules`).
        rules: Rules by module type that replace or add to the composite's (a type or tuple of types to a rule
            such as ``Gamma(0.5)``); ``"first"`` names the first convolution.
        low: z^B's lowest input value per channel (``epsilon_gamma_box``); None: the batch's smallest per channel.
        high: Its highest, likewise.
        **options: ``smooth_samples``, ``smooth_sigma``, ``smooth_type`` and ``seed``, as for
            :class:`InputAttribution`.
    """

    name = "lrp"
    title = "Layer-wise relevance propagation, zennit's composites (Bach et al. 2015)"

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        labels: Sequence[str] | None = None,
        composite: str = "epsilon_plus",
        rules: Mapping[Any, Rule] | None = None,
        low: float | Tensor | None = None,
        high: float | Tensor | None = None,
        **options: Any,
    ) -> None:
        super().__init__(model, layer, labels=labels, **options)
        composite_rules(composite)  # an unknown name fails here
        self.composite, self.rules, self.low, self.high = composite, dict(rules or {}), low, high

    def rule_map(self, x: Tensor) -> Callable[[str, nn.Module], Rule | None]:
        """Each module's rule for a batch ``x``: the first convolution's, else the first type that matches."""
        low, high = self.low, self.high
        if self.composite == "epsilon_gamma_box" and (low is None or high is None):
            axes = [0, *range(2, x.dim())]
            shape = (1, -1, *(1,) * (x.dim() - 2))
            low = x.detach().amin(dim=axes).view(shape) if low is None else low
            high = x.detach().amax(dim=axes).view(shape) if high is None else high
        rules = {
            **self.rules,
            **{k: v for k, v in composite_rules(self.composite, low, high).items() if k not in self.rules},
        }  # the caller's first
        first = next((name for name, m in self.model.named_modules() if isinstance(m, CONVOLUTIONS)), None)

        def rule_for(name: str, module: nn.Module) -> Rule | None:
            if name == first and "first" in rules:
                return rules["first"]
            return next((rule for types, rule in rules.items() if types != "first" and isinstance(module, types)), None)

        return rule_for

    @contextmanager
    def backward_rule(self, x: Tensor, model_kwargs: Mapping[str, Any]) -> Iterator[None]:
        with relevance_rules(self.model, self.rule_map(x)) as ruled:
            if not ruled:
                raise LayerError("LRP found no module its composite has a rule for (convolutions, linear layers)")
            yield
