"""LRP's composites: which rule (:mod:`explain.relevance.rules`) each layer of a model gets, by the type of the
module that holds its weight (zennit's design: rules by type, the standard composites by name), and pools by kind.

A composite is a mapping from a module type (or a tuple of types) to a rule, with three keys of its own:
``"first"``, the model's first convolution; ``"pool"``, average pools; ``"max_pool"``, max pools. Every operation a
composite does not name keeps its operation rule (:mod:`explain.relevance.operations`): ε for the layers and sums,
the identity for activations, and so on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..errors import ExplainError
from .epsilon import EPSILON
from .rules import AlphaBeta, Epsilon, Flat, Gamma, Rule, Spread, ZBox, ZPlus

CONVOLUTIONS = (nn.modules.conv._ConvNd,)
COMPOSITES = ("epsilon_plus", "epsilon_alpha2_beta1", "epsilon_gamma_box", "epsilon")
KINDS = ("first", "pool", "max_pool")  # a composite's keys that are no module type

FLAT: dict[Any, Rule] = {CONVOLUTIONS: Flat(), nn.Linear: Flat(), "pool": Flat(), "max_pool": Spread()}
"""LRP-flat in every layer and pool: the support of the relevance from one position is its receptive field."""


def composite_rules(
    name: str, low: float | Tensor | None = None, high: float | Tensor | None = None, epsilon: float = EPSILON
) -> dict[Any, Rule]:
    """A standard composite's rule per module type (the first convolution's under ``"first"``).

    ``"epsilon"``: LRP-ε everywhere; ``"epsilon_plus"``: z⁺ in convolutions, ε in linear layers;
    ``"epsilon_alpha2_beta1"``: α2β1 in convolutions; ``"epsilon_gamma_box"``: γ = 0.25 in convolutions and
    z^B(low, high) in the first one. All: ``epsilon`` in linear layers (zennit's composites of those names).

    Raises:
        ExplainError: An unknown name.
    """
    convolution = {
        "epsilon": Epsilon(epsilon),
        "epsilon_plus": ZPlus(),
        "epsilon_alpha2_beta1": AlphaBeta(2.0, 1.0),
        "epsilon_gamma_box": Gamma(0.25),
    }
    if name not in convolution:
        raise ExplainError(f"unknown LRP composite {name!r}; known: {', '.join(COMPOSITES)}")
    rules: dict[Any, Rule] = {CONVOLUTIONS: convolution[name], nn.Linear: Epsilon(epsilon)}
    if name == "epsilon_gamma_box":
        rules["first"] = ZBox(low, high)
    return rules


class LayerRules:
    """A composite resolved for one model: the rule of each layer operation its forward runs, found by the weight
    the operation is given (the module's own), or by the kind of pool.

    Args:
        model: The model.
        rules: The composite: module types (the first match wins) and the keys of :data:`KINDS` to rules.

    Raises:
        ExplainError: A module type whose modules of the model hold no weight.
    """

    def __init__(self, model: nn.Module, rules: Mapping[Any, Rule]) -> None:
        types = [(key, rule) for key, rule in rules.items() if key not in KINDS]
        modules = list(model.modules())
        for key, _ in types:
            found = [m for m in modules if isinstance(m, key)]
            if any(not isinstance(getattr(m, "weight", None), Tensor) for m in found):
                raise ExplainError(
                    f"an LRP rule by module type applies to modules with a weight (convolutions, linear layers); "
                    f"{key} has none: rule pools by 'pool' or 'max_pool'"
                )
        self.weights = {}  # each ruled module's weight by identity, with its rule (the weights kept alive)
        for module in modules:
            rule = next((rule for key, rule in types if isinstance(module, key)), None)
            if rule is not None:
                self.weights[id(module.weight)] = (module.weight, rule)
        first = next((m for m in modules if isinstance(m, CONVOLUTIONS)), None)
        if first is not None and "first" in rules:
            self.weights[id(first.weight)] = (first.weight, rules["first"])
        self.pools = {"pool": rules.get("pool"), "max_pool": rules.get("max_pool")}

    def __call__(self, kind: str, weight: Tensor | None) -> Rule | None:
        """The rule of a layer operation of ``kind`` (``"weighted"``, ``"pool"`` or ``"max_pool"``) given
        ``weight``; None: its operation rule."""
        if kind != "weighted":
            return self.pools[kind]
        found = self.weights.get(id(weight))
        return found[1] if found is not None and found[0] is weight else None
