"""Backward rules: contexts under which a model's backward hands back something else than its gradient.

- Guided Backpropagation and Deconvolution (:func:`relu_rule`): every ReLU passes back the positive part of the
  gradient, where its input was positive (guided) or everywhere (deconvolution).
- DeepLift's rescale rule (:func:`rescale_rule`): every element-wise nonlinearity passes back its gradient times
  its secant to a reference input's values.
- Layer-wise relevance propagation (:func:`relevance_rules`): each module that a rule map names gets a forward
  hook that joins its output to its input by :class:`Relevance`, an autograd function whose backward hands the
  rule's relevance of the module's input back instead of the gradient (the module's own backward is skipped).
  Modules the map leaves out (max pooling, reshapes, functions) pass the gradient as autograd does. The relevance
  of the model's output is the target's score gradient (1 at the explained output): the relevance at the input is
  then the call's "gradient" there.

For LRP, a batch norm whose input is a convolution's or linear layer's output is merged into that layer for its rule
(the layer's weights scaled by γ/σ, its bias shifted, read for the call only: the model is not modified) and
passes relevance through unchanged, as zennit's canonizers merge them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..errors import LayerError
from .hooks import Hooks


def _guided(module: nn.Module, grad_input: tuple[Tensor | None, ...], grad_output: tuple[Tensor, ...]) -> tuple:
    """Guided Backpropagation's rule: the gradient a ReLU passes on to its input, positive part only."""
    return tuple(None if g is None else g.clamp(min=0) for g in grad_input)


def _deconvolved(module: nn.Module, grad_input: tuple[Tensor | None, ...], grad_output: tuple[Tensor, ...]) -> tuple:
    """Deconvolution's rule: a ReLU passes back the positive part of the gradient it receives, wherever its
    input was (the forward's mask left out)."""
    return tuple(None if g is None else o.clamp(min=0) for g, o in zip(grad_input, grad_output))


RELU_RULES = {"guided": _guided, "deconvolution": _deconvolved}


@contextmanager
def relu_rule(model: nn.Module, rule: str = "guided") -> Iterator[int]:
    """For the block, every ``nn.ReLU`` and ``nn.ReLU6`` module of the model passes gradients back by ``rule``:
    ``"guided"`` (Guided Backpropagation: positive gradients where the input was positive) or
    ``"deconvolution"`` (positive gradients everywhere).

    Each ReLU gets a full-backward hook that applies the rule. In-place ReLUs are made out-of-place for the block
    (PyTorch refuses a full-backward hook on a module that modifies its input in place); their flags are restored
    on exit.

    Yields:
        The number of modules ruled; ReLUs applied as functions are not.
    """
    relus = [m for m in model.modules() if isinstance(m, (nn.ReLU, nn.ReLU6))]
    with out_of_place(relus), Hooks() as hooks:
        for relu in relus:
            hooks.full_backward(relu, RELU_RULES[rule])
        yield len(relus)


@contextmanager
def out_of_place(modules: list[nn.Module]) -> Iterator[None]:
    """For the block, the modules that modify their input in place (``inplace=True``) do not: PyTorch refuses a
    full-backward hook on such a module. Their flags are restored on exit."""
    flags = [getattr(m, "inplace", None) for m in modules]
    try:
        for module, flag in zip(modules, flags):
            if flag:
                module.inplace = False
        yield
    finally:
        for module, flag in zip(modules, flags):
            if flag is not None:
                module.inplace = flag


# Element-wise nonlinearities: DeepLift's rescale rule replaces their gradient (see rescale_rule).
ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh,
    nn.Softplus, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh,
)  # fmt: skip
RESCALE_EPSILON = 1e-10  # a smaller input difference keeps the plain gradient (Captum's eps)


class _Rescaled(torch.autograd.Function):
    """Gives back an element-wise nonlinearity's output y = f(x) whose gradient reaches x times the secant
    (y - y') / (x - x') to the reference's values x', y' of the same call, where x and x' differ by at least
    :data:`RESCALE_EPSILON`; elsewhere through y's own graph, with the plain slope."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor, x_ref: Tensor, y_ref: Tensor) -> Tensor:
        dx, dy = x - x_ref, y - y_ref
        far = dx.abs() >= RESCALE_EPSILON
        ctx.save_for_backward(torch.where(far, dy / torch.where(far, dx, 1.0), 0.0), far)
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        secant, far = ctx.saved_tensors
        return grad * secant, torch.where(far, 0.0, grad), None, None


@contextmanager
def rescale_rule(model: nn.Module, reference: Callable[[], Any]) -> Iterator[int]:
    r"""For the block, DeepLift's rescale rule against the reference input that ``reference()`` runs the model on
    (at the block's start, without autograd): every call of an element-wise nonlinearity module
    (:data:`ELEMENTWISE`) in the block's forwards passes back its gradient times its secant instead of its slope,
    :math:`\Delta y / \Delta x` between the input's values and the reference's at the same call (the plain slope
    where :math:`|\Delta x| <` :data:`RESCALE_EPSILON`). Calls are matched in order, so a module called twice
    in a forward (a ResNet block's ReLU) is ruled at each call with its own values.

    Raises:
        LayerError: The block's forward runs a nonlinearity more often than the reference's did.

    Yields:
        The number of modules ruled; nonlinearities applied as functions keep their gradient.
    """
    found = [m for m in model.modules() if isinstance(m, ELEMENTWISE)]
    seen: dict[nn.Module, deque[tuple[Tensor, Tensor]]] = {m: deque() for m in found}

    def record(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        seen[module].append((inputs[0].detach(), output.detach()))

    def rescaled(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor | None:
        if not seen[module]:
            raise LayerError(
                f"DeepLift: a {type(module).__name__} runs more often for the input than for the reference"
            )
        x_ref, y_ref = seen[module].popleft()
        if not (inputs[0].requires_grad or output.requires_grad):
            return None
        return _Rescaled.apply(inputs[0], output, x_ref, y_ref)

    with out_of_place(found):
        with Hooks() as hooks, torch.no_grad():
            for module in found:
                hooks.forward(module, record)
            reference()
        with Hooks() as hooks:
            for module in found:
                hooks.forward(module, rescaled)
            yield len(found)


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
