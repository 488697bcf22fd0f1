r"""Relevance through attention, by operation: AttnLRP and CP-LRP (Achtibat et al., "AttnLRP: Attention-Aware
Layer-Wise Relevance Propagation for Transformers", ICML 2024).

Every torch operation of the model's forward runs under its rule (:mod:`explain.core.operation_rules`): ε through
linear layers, convolutions, sums and means, the identity through layer norms' normalization and element-wise
activations, the uniform rule through gates and the two matrix products of attention, and the softmax's own rule.
Any transformer the engine runs gets them, whatever its family; an operation without a rule is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor

from ..core.hooks import Hooks
from ..core.operation_rules import OperationRules
from .lrp import Propagation


class AttnLRP(Propagation):
    r"""AttnLRP: the relevance of the explained score (1 at the score) propagated to the input by AttnLRP's rule for
    each operation; the softmax's is :math:`R_x = x \odot (R - s \odot \sum_j R_j)` (Deep Taylor at its input).
    ``raw`` is the input's signed relevance per channel; where every rule conserves, it sums to 1.
    """

    name = "attnlrp"
    title = "AttnLRP: relevance through attention, softmax and norms by operation (Achtibat et al. 2024)"
    attention = "attnlrp"

    @contextmanager
    def backward_rule(self, x: Tensor, model_kwargs: Mapping[str, Any]) -> Iterator[None]:
        mode = OperationRules(self.name, self.attention, self.model)
        with Hooks() as hooks:  # the rules hold inside the model's forward alone, not in the target's scoring
            hooks.forward_pre(self.model, lambda module, args: mode.__enter__() and None)
            hooks.forward(self.model, lambda module, args, output: mode.__exit__(None, None, None), always_call=True)
            yield


class CPLRP(AttnLRP):
    r"""CP-LRP: AttnLRP's rules with the attention weights held constant, so that relevance flows through the
    values alone (the rule the AttnLRP authors advise inside a vision transformer's attention).
    """

    name = "cplrp"
    title = "CP-LRP: AttnLRP with the attention held constant, relevance through the values (Achtibat et al. 2024)"
    attention = "constant"
