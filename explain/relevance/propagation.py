r"""The relevance propagations: LRP with zennit's composites (Bach et al. 2015), AttnLRP and CP-LRP (Achtibat et al.,
"AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers", ICML 2024), all on the one engine of
:mod:`explain.relevance.operations`: every torch operation of the model's forward under its rule, LRP's composite
choosing the rules of its convolutions, linear layers and pools.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from torch import Tensor, nn

from ..core.engine import Capture, Needs
from ..core.input_attribution import InputAttribution
from ..core.layers import LayerSpec
from ..core.maps import postprocess
from ..core.result import CAMResult
from ..errors import LayerError
from ..targets import BoundTarget, Target, TargetLike
from .composites import LayerRules, composite_rules
from .epsilon import EPSILON
from .operations import OperationRules, check_gate, in_forward
from .rules import Rule


class Propagation(InputAttribution):
    r"""Base of the relevance propagations: the input's gradient, under the method's rules, is its relevance; ``raw``
    is it per channel, signed, and the map its positive part summed over the channels. The relevance starts as 1 at
    the explained score; the result's ``completeness`` is how far the input's falls from it, :math:`\sum R - 1` per
    image (and target), 0 where every rule conserves.

    With a ``layer``, the relevance is read where it arrives at that layer's output instead (the gradient there,
    under the rules), laid out as the engine lays the layer out (a transformer's patch tokens on their grid, a
    class token left out): ``raw`` is it per channel at the layer's resolution, the map its positive part summed
    over the channels and upsampled, ``completeness`` its sum minus 1.

    Args:
        model: Any model explain explains; left as it was.
        layer: One layer (a dotted name or a module) whose relevance to read; None: the input's.
        epsilon: The ε of the ε rule (linear layers, sums, ...), as zennit's ``Epsilon(epsilon)``.
        gate: The rule of a product of two relevant tensors: ``"signal"`` (a gate spread over the signal's positions
            or channels held constant) or ``"uniform"`` (see :class:`explain.relevance.operations.OperationRules`).
        **options: As for :class:`InputAttribution`.

    Raises:
        LayerError: Several layers are given (relevance is read at one), or an unknown gate.
    """

    needs = Needs(gradients=False, input_gradient=True, whole_backward=True, map_of_input=True)
    at_layer = Needs(gradients=True, whole_backward=True)
    reads_layer = True  # the relevance arriving there
    attention = "attnlrp"

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec | Sequence[str | nn.Module] = None,
        *,
        epsilon: float = EPSILON,
        gate: str = "signal",
        **options: Any,
    ) -> None:
        super().__init__(model, **options)
        if isinstance(layer, (list, tuple)) and len(layer) != 1:
            raise LayerError(f"{self.name} reads relevance at one layer; {len(layer)} were given: name one")
        layer = layer[0] if isinstance(layer, (list, tuple)) else layer
        if layer is not None:
            self.requested, self.needs = [layer], self.at_layer
        check_gate(gate)
        self.epsilon, self.gate = epsilon, gate

    def layer_rules(self, x: Tensor) -> LayerRules | None:
        """The rules of the model's layers for a batch ``x``; None: ε in every layer."""
        return None

    @contextmanager
    def backward_rule(self, x: Tensor, model_kwargs: Mapping[str, Any]) -> Iterator[None]:
        mode = OperationRules(
            self.name, self.attention, self.model, epsilon=self.epsilon, gate=self.gate, layers=self.layer_rules(x)
        )
        with in_forward(self.model, mode):  # the rules hold in the model's forward alone, not in the target's scoring
            yield

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
    r"""Layer-wise relevance propagation with a composite of rules by module type (zennit's design): each convolution
    and linear layer the composite names gets its rule (:mod:`explain.relevance.rules`), a batch norm after it merged
    into it for the call; every other operation its operation rule (ε through residual sums, as zennit's ResNet
    canonizer; the identity through activations; the gate rule through a squeeze-excitation's product; layer norms
    as AttnLRP's; attention held constant, relevance through its values, as the conservative propagation of Ali et
    al., "XAI for Transformers: Better Explanations through Conservative Propagation", ICML 2022). The relevance of
    the explained output is 1 (as zennit's with a one-hot output), so the input's sums to 1 where the rules conserve
    it. ``raw`` is the input's relevance per channel, signed; the map
    is its positive part summed over the channels.

    Args:
        model: Any model explain explains; left as it was (batch norms are merged for the call, not in the model).
        layer: One layer whose relevance to read (see :class:`Propagation`); None: the input's.
        labels: Class names, to accept a class name as target.
        composite: ``"epsilon_plus"`` (default), ``"epsilon_alpha2_beta1"``, ``"epsilon_gamma_box"`` or
            ``"epsilon"`` (see :func:`explain.relevance.composites.composite_rules`).
        rules: Rules by module type that replace or add to the composite's (a type or tuple of types to a rule
            such as ``Gamma(0.5)``); ``"first"`` names the first convolution, ``"pool"`` and ``"max_pool"`` the
            pools.
        low: z^B's lowest input value per channel (``epsilon_gamma_box``); None: the batch's smallest per channel.
        high: Its highest, likewise.
        **options: ``epsilon``, ``gate`` (see :class:`Propagation`), ``smooth_samples``, ``smooth_sigma``,
            ``smooth_type`` and ``seed``, as for :class:`InputAttribution`.
    """

    name = "lrp"
    title = "Layer-wise relevance propagation, zennit's composites (Bach et al. 2015)"
    attention = "constant"

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
        LayerRules(model, self.rules)  # a rule for a type without weights fails here

    def layer_rules(self, x: Tensor) -> LayerRules:
        """Each layer's rule for a batch ``x``: the caller's rules first, then the composite's (z^B's box the
        batch's where it is not given)."""
        low, high = self.low, self.high
        if self.composite == "epsilon_gamma_box" and (low is None or high is None):
            axes = [0, *range(2, x.dim())]
            shape = (1, -1, *(1,) * (x.dim() - 2))
            low = x.detach().amin(dim=axes).view(shape) if low is None else low
            high = x.detach().amax(dim=axes).view(shape) if high is None else high
        composite = composite_rules(self.composite, low, high, self.epsilon)
        return LayerRules(self.model, {**self.rules, **{k: v for k, v in composite.items() if k not in self.rules}})


class AttnLRP(Propagation):
    r"""AttnLRP: the relevance of the explained score (1 at the score) propagated to the input by AttnLRP's rule for
    each operation; ε in every linear layer and convolution; the softmax's rule is
    :math:`R_x = x \odot (R - s \odot \sum_j R_j)` (Deep Taylor at its input). ``raw`` is the input's signed
    relevance per channel; where every rule conserves, it sums to 1.
    """

    name = "attnlrp"
    title = "AttnLRP: relevance through attention, softmax and norms by operation (Achtibat et al. 2024)"


class CPLRP(AttnLRP):
    r"""CP-LRP: AttnLRP's rules with the attention weights held constant, so that relevance flows through the
    values alone (the rule the AttnLRP authors advise inside a vision transformer's attention).
    """

    name = "cplrp"
    title = "CP-LRP: AttnLRP with the attention held constant, relevance through the values (Achtibat et al. 2024)"
    attention = "constant"
