"""Backward passes that compute only the rows a score reaches.

A model often computes many rows of which the explained score reads a few: the thousand proposals of an R-CNN's
box head, of which a detection is one; the tokens of a class-token transformer's last block, of which the head
reads the class token alone. Autograd differentiates every row, rows of zero gradient included. Here a module's
output, computed as usual, is joined to its inputs by :class:`RowsRecomputed`, whose backward finds the rows
whose incoming gradient is not zero and recomputes, with autograd, those rows alone. Where most rows are
reached, the graph that the forward recorded serves instead.

- :func:`positionwise_rows`: ``nn.Linear`` and last-axis ``nn.LayerNorm`` modules applied to sequences
  (every position of their input mapped on its own), for the block.
- :func:`explain.detectors.sparse_box_heads` joins an R-CNN's kept detections to its features.

The recomputed rows' gradients are the ones autograd would give: a row of these outputs depends on its own
input row alone, and a row whose output gradient is zero has a zero input gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn


class RowsRecomputed(torch.autograd.Function):
    """Values (M, C) computed without autograd, joined to the inputs they came from.

    ``recompute(inputs, rows)`` gives rows ``rows`` of the values, with autograd, from the inputs; ``recorded``,
    where the forward recorded a graph for all rows, gives the inputs' gradients from the values' gradient
    through that graph, and is used when at least half of the rows are reached. The backward returns the
    inputs' gradients.
    """

    @staticmethod
    def forward(
        ctx: Any,
        recompute: Callable[[list[Tensor], Tensor], Tensor],
        recorded: Callable[[Tensor], tuple[Tensor | None, ...]] | None,
        values: Tensor,
        *inputs: Tensor,
    ) -> Tensor:
        ctx.recompute, ctx.recorded = recompute, recorded
        ctx.save_for_backward(*inputs)
        return values

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows = grad.any(dim=1).nonzero()[:, 0]
        if ctx.recorded is not None and 2 * len(rows) >= len(grad):
            return (None, None, None, *ctx.recorded(grad))
        inputs = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        with torch.enable_grad():
            recomputed = ctx.recompute(inputs, rows)
        return (None, None, None, *torch.autograd.grad(recomputed, inputs, grad[rows], allow_unused=True))


# Element-wise activations: each position of their input mapped on its own, as by Linear and LayerNorm.
_ELEMENTWISE = (nn.GELU, nn.SiLU, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.Tanh, nn.Sigmoid, nn.Hardswish, nn.Mish)


def _positionwise(module: nn.Module) -> bool:
    """Whether a module maps each position of its input's last axis on its own: torch's ``nn.Linear``,
    ``nn.LayerNorm`` over the last axis (and timm's, the same with a fast path) and element-wise activations
    that do not work in place."""
    kind = type(module)
    if kind.forward is nn.Linear.forward:
        return True
    if isinstance(module, _ELEMENTWISE):
        return kind.forward in {c.forward for c in _ELEMENTWISE} and not getattr(module, "inplace", False)
    timm_norm = (kind.__module__, kind.__name__) == ("timm.layers.norm", "LayerNorm")
    norm = isinstance(module, nn.LayerNorm) and (kind.forward is nn.LayerNorm.forward or timm_norm)
    return norm and len(module.normalized_shape) == 1


# The joined outputs of one context's layers, by their autograd node: the input their chain of layers starts
# from, and the chain.
Chains = dict[Any, tuple[Tensor, list[nn.Module]]]


def _rows_joined(chains: Chains, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Tensor | None:
    """Forward hook: a sequence layer's output joined by :class:`RowsRecomputed` to the input of its chain (the
    layer, and the position-wise layers before it whose output it takes as it is)."""
    if len(inputs) != 1 or not isinstance(output, Tensor) or not torch.is_grad_enabled():
        return None
    (x,) = inputs
    if not isinstance(x, Tensor) or not x.requires_grad or x.dim() != 3:
        return None
    if any(p.requires_grad for p in module.parameters(recurse=False)):  # its weight gradient is wanted
        return None
    source, earlier = chains.get(x.grad_fn, (x, []))
    chain = [*earlier, module]

    def recompute(sources: list[Tensor], rows: Tensor) -> Tensor:
        y = sources[0].reshape(-1, source.shape[-1])[rows]
        for layer in chain:
            y = layer.forward(y)
        return y

    def recorded(grad: Tensor) -> tuple[Tensor | None, ...]:
        return torch.autograd.grad(output, source, grad.reshape(output.shape), retain_graph=True)

    values = output.detach().reshape(-1, output.shape[-1])
    joined = RowsRecomputed.apply(recompute, recorded, values, source).reshape(output.shape)
    chains[joined.grad_fn] = (source, chain)
    return joined


@contextmanager
def positionwise_rows(model: nn.Module, skip: Collection[nn.Module] = ()) -> Iterator[None]:
    """For the block, differentiate the model's position-wise sequence layers only at the rows a score reaches.

    Each position-wise layer of the model (see :func:`_positionwise`) but those in ``skip`` (the target layers,
    whose outputs a recorder hooks) gets a forward hook. When its output is a sequence (N, T, C) that requires
    grad, and its parameters do not, the output is joined by :class:`RowsRecomputed` to the input of its chain:
    a layer that takes a joined output as it is extends that output's chain, so that a chain (a transformer's
    MLP: norm, linear, activation, linear) is recomputed as one, its rows gathered and scattered once. A
    gradient that also reaches an earlier layer's output by another way still flows through that layer's own
    node. In a class-token transformer's last block, the MLP and the attention's output projection are then
    differentiated at the class token alone.
    """
    chains: Chains = {}
    hook = partial(_rows_joined, chains)
    handles = [m.register_forward_hook(hook) for m in model.modules() if _positionwise(m) and m not in skip]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        chains.clear()
