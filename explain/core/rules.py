"""Gradient rules by module: contexts under which a model's backward hands back something else than its gradient
(relevance has its own engine, by operation: :mod:`explain.relevance`).

- Guided Backpropagation and Deconvolution (:func:`relu_rule`): every ReLU passes back the positive part of the
  gradient, where its input was positive (guided) or everywhere (deconvolution).
- DeepLift's rescale rule (:func:`rescale_rule`): every element-wise nonlinearity passes back its gradient times
  its secant to a reference input's values.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

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
