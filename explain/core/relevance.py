"""Relevance propagation: the backward pass of layer-wise relevance propagation (LRP), as a rule context.

For the block, each module of the model that a rule map names gets a forward hook that joins its output to its
input by :class:`Relevance`, an autograd function whose backward hands the rule's relevance of the module's input
back instead of the gradient (the module's own backward is skipped). Modules the map leaves out (max pooling,
reshapes, functions) pass the gradient as autograd does. The relevance of the model's output is the target's
score gradient (1 at the explained output): the relevance at the input is then the call's "gradient" there.

A batch norm whose input is a convolution's or linear layer's output is merged into that layer for its rule
(the layer's weights scaled by γ/σ, its bias shifted, read for the call only: the model is not modified) and
passes relevance through unchanged, as zennit's canonizers merge them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..errors import LayerError
from .hooks import Hooks, out_of_place


@dataclass
class RuledLayer:
    """A module as a rule sees it: the function of its input, and its effective weight and bias.

    Attributes:
        module: The module.
        norm: A batch norm merged into it (its input was this module's output), or None.
    """

    module: nn.Module
    norm: nn.modules.batchnorm._BatchNorm | None = None

    @property
    def parameters(self) -> dict[str, Tensor]:
        """Its weight and bias (zeros where it has none), with a merged batch norm folded in, detached."""
        found = {name: p.detach() for name, p in self.module.named_parameters(recurse=False)}
        if "weight" in found and "bias" not in found:
            found["bias"] = found["weight"].new_zeros(found["weight"].shape[0])
        if self.norm is not None and "weight" in found:
            norm = self.norm
            scale = norm.running_var.rsqrt() if norm.eps == 0 else (norm.running_var + norm.eps).rsqrt()
            if norm.weight is not None:
                scale = scale * norm.weight.detach()
            shift = norm.bias.detach() if norm.bias is not None else 0.0
            found["bias"] = (found["bias"] - norm.running_mean) * scale + shift
            found["weight"] = found["weight"] * scale.view(-1, *(1,) * (found["weight"].dim() - 1))
        return found

    def __call__(self, x: Tensor, parameters: Mapping[str, Tensor] | None = None) -> Tensor:
        """The module's output for ``x``, with its parameters replaced by ``parameters`` (by name) if given."""
        if parameters is None:
            return self.module(x)
        return functional_call(self.module, dict(parameters), (x,))


Rule = Callable[[RuledLayer, Tensor, Tensor], Tensor]  # (layer, its input, the output's relevance) -> the input's


_RULING = threading.local()  # set while a rule computes: the modules it calls are not joined again


class Relevance(torch.autograd.Function):
    """Joins a ruled module's output to its input; the backward gives the input the rule's relevance."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor, rule: Rule, layer: RuledLayer) -> Tensor:
        ctx.rule, ctx.layer = rule, layer
        ctx.save_for_backward(x)
        return y.detach().clone()

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[Tensor, None, None, None]:
        (x,) = ctx.saved_tensors
        _RULING.active = True
        try:
            with torch.enable_grad():
                found = ctx.rule(ctx.layer, x.detach(), relevance)
        finally:
            _RULING.active = False
        return found, None, None, None


def passed(layer: RuledLayer, x: Tensor, relevance: Tensor) -> Tensor:
    """The Pass rule: the output's relevance, unchanged (element-wise modules, merged batch norms)."""
    return relevance


BatchNorm = nn.modules.batchnorm._BatchNorm


def _weighted(module: nn.Module) -> bool:
    """Whether a module has a weight of its own (a batch norm can be merged into it)."""
    return isinstance(getattr(module, "weight", None), Tensor)


@contextmanager
def relevance_rules(model: nn.Module, rule_for: Callable[[str, nn.Module], Rule | None]) -> Iterator[int]:
    """For the block, the model's backward propagates relevance by module: ``rule_for(name, module)`` gives a
    module's rule, or None to leave it to autograd. A batch norm right after a ruled layer with a weight is merged
    into it (see the module's notes). In-place modules run out of place for the block.

    Raises:
        LayerError: A batch norm to merge is in training mode (its statistics are the batch's).

    Yields:
        The number of modules ruled.
    """
    rules = {m: rule for name, m in model.named_modules() for rule in [rule_for(name, m)] if rule is not None}
    outputs: dict[int, tuple[Tensor, RuledLayer]] = {}  # a ruled layer's output (kept alive), for its batch norm

    def joined(layer: RuledLayer, module: nn.Module, inputs: tuple[Tensor, ...], output: Any) -> Any:
        x = inputs[0] if inputs else None
        if getattr(_RULING, "active", False) or not isinstance(output, Tensor) or not isinstance(x, Tensor):
            return None
        if not (x.requires_grad or output.requires_grad):
            return None
        before = outputs.get(id(x))
        if isinstance(module, BatchNorm) and before is not None and before[0] is x and _weighted(before[1].module):
            if module.training or module.running_mean is None:
                raise LayerError(
                    f"LRP merges the {type(module).__name__} after {type(before[1].module).__name__} into it with its "
                    "running statistics; in training mode it uses the batch's: call model.eval() first"
                )
            before[1].norm = module
            return Relevance.apply(x, output, passed, layer)
        if module not in rules:
            return None
        joined_output = Relevance.apply(x, output, rules[module], layer)
        outputs[id(joined_output)] = (joined_output, layer)
        return joined_output

    norms = [m for m in model.modules() if isinstance(m, BatchNorm)]
    try:
        with out_of_place(list(rules)), Hooks() as hooks:
            for module in dict.fromkeys([*rules, *norms]):
                layer = RuledLayer(module)
                hooks.forward(module, lambda m, i, o, layer=layer: joined(layer, m, i, o))
            yield len(rules)
    finally:
        outputs.clear()
