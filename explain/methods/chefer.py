"""Chefer et al. 2021a: relevance propagated through a vision transformer by the authors' rules, weighted by the
attention's gradient and rolled out.

The relevance pass follows the authors' equations ("Transformer Interpretability Beyond Attention Visualization",
CVPR 2021, arXiv:2012.09838, section 3): linear layers by LRP-αβ with α = 1, β = 0 and no bias; layer norms,
activations, dropout and the softmax pass relevance through; a residual sum u + v and the attention's two products
(q kᵀ and A v) split it between their operands in proportion to their contributions, the sum renormalized so that
each operand's share is its contribution's magnitude, and each product's halves divided by 2. Divisions by zero
give zero (the authors' ``safe_divide``: b + 1e-9 in the denominator). It runs on timm's ViT and DeiT blocks
(``Block`` with ``Attention``) with class-token pooling: the blocks' inputs are kept by the forward, and the pass
recomputes each block from its input.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.attention_capture import AttentionRecorder
from ..core.engine import Capture
from ..errors import LayerError
from .rollout import GradientRollout


def safe_divide(a: Tensor, b: Tensor) -> Tensor:
    """a / (b + 1e-9), and 0 where b is 0 (the authors' ``safe_divide``)."""
    return torch.where(b != 0, a / torch.where(b + 1e-9 != 0, b + 1e-9, 1.0), 0.0)


def z_plus(x: Tensor, weight: Tensor, relevance: Tensor) -> Tensor:
    r"""A linear layer's relevance by LRP-αβ at α = 1, β = 0, without the bias:
    :math:`R_x = x^+ \odot W^{+\top} s + x^- \odot W^{-\top} s`, :math:`s = R / (W^+ x^+ + W^- x^-)`."""
    up, down = weight.clamp(min=0), weight.clamp(max=0)
    xp, xn = x.clamp(min=0), x.clamp(max=0)
    s = safe_divide(relevance, xp @ up.T + xn @ down.T)
    return xp * (s @ up) + xn * (s @ down)


def split_sum(u: Tensor, v: Tensor, relevance: Tensor) -> tuple[Tensor, Tensor]:
    """A sum u + v's relevance split between its operands by their contributions, each operand's total then set
    to its share of the relevance, in proportion to the magnitudes of their totals (per image)."""
    s = safe_divide(relevance, u + v)
    a, b = u * s, v * s
    axes = tuple(range(1, a.dim()))
    a_sum, b_sum = a.sum(axes, keepdim=True), b.sum(axes, keepdim=True)
    total, magnitude = relevance.sum(axes, keepdim=True), a_sum.abs() + b_sum.abs()
    a_share, b_share = safe_divide(a_sum.abs(), magnitude) * total, safe_divide(b_sum.abs(), magnitude) * total
    return a * safe_divide(a_share, a_sum), b * safe_divide(b_share, b_sum)


def split_product(a: Tensor, b: Tensor, relevance: Tensor) -> tuple[Tensor, Tensor]:
    """A matrix product a @ b's relevance split between its operands by their contributions, each halved."""
    s = safe_divide(relevance, a @ b)
    return a * (s @ b.transpose(-2, -1)) / 2, b * (a.transpose(-2, -1) @ s) / 2


def attention_relevance(attention: nn.Module, tokens: Tensor, relevance: Tensor) -> tuple[Tensor, Tensor]:
    """timm's ``Attention`` on ``tokens`` (N, T, C): the relevance of its input and of its probabilities
    (N, heads, T, T), from its output's."""
    n, t, c = tokens.shape
    heads = attention.num_heads
    q, k, v = attention.qkv(tokens).reshape(n, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = attention.q_norm(q), attention.k_norm(k)
    probabilities = (q * attention.scale @ k.transpose(-2, -1)).softmax(dim=-1)
    merged = attention.norm((probabilities @ v).transpose(1, 2).reshape(n, t, c))
    per_head = z_plus(merged, attention.proj.weight, relevance).reshape(n, t, heads, -1).transpose(1, 2)
    of_probabilities, of_v = split_product(probabilities, v, per_head)
    of_q, of_k_transposed = split_product(q, k.transpose(-2, -1), of_probabilities)  # the softmax passes it
    of_qkv = torch.stack([of_q, of_k_transposed.transpose(-2, -1), of_v]).permute(1, 3, 0, 2, 4).reshape(n, t, 3 * c)
    return z_plus(tokens, attention.qkv.weight, of_qkv), of_probabilities


def block_relevance(block: nn.Module, x: Tensor, relevance: Tensor) -> tuple[Tensor, Tensor]:
    """timm's ``Block`` on its input ``x``: the relevance of its input and of its attention's probabilities."""
    normed = block.norm1(x)
    attended = block.ls1(block.attn(normed))
    middle = x + attended
    mlp = block.mlp
    hidden = block.norm2(middle)
    activated = mlp.norm(mlp.drop1(mlp.act(mlp.fc1(hidden))))
    of_middle, of_mlp = split_sum(middle, block.ls2(mlp(hidden)), relevance)
    of_middle = of_middle + z_plus(hidden, mlp.fc1.weight, z_plus(activated, mlp.fc2.weight, of_mlp))
    of_x, of_attended = split_sum(x, attended, of_middle)
    of_normed, of_probabilities = attention_relevance(block.attn, normed, of_attended)
    return of_x + of_normed, of_probabilities


def _is_timm(module: nn.Module, name: str) -> bool:
    return type(module).__module__.startswith("timm.") and type(module).__name__ == name


class BlockInputRecorder(AttentionRecorder):
    """An attention recorder that also keeps each block's input and the head's output (in the graph)."""

    def __init__(self, modules: Mapping[str, nn.Module], name: str, blocks: Sequence[nn.Module], head: nn.Module):
        super().__init__(modules, name)
        self.blocks, self.head = list(blocks), head
        self.inputs: dict[nn.Module, Tensor] = {}
        self.last: Tensor | None = None  # the last block's output
        self.head_output: Tensor | None = None

    def __enter__(self) -> BlockInputRecorder:
        super().__enter__()
        for block in self.blocks:
            self._hooks.forward(block, lambda m, i, o: self.inputs.__setitem__(m, i[0].detach()))
        self._hooks.forward(self.blocks[-1], lambda m, i, o: setattr(self, "last", o.detach()))
        self._hooks.forward(self.head, lambda m, i, o: setattr(self, "head_output", o))
        return self


class CheferRelevance(GradientRollout):
    r"""Chefer, Gur & Wolf, "Transformer Interpretability Beyond Attention Visualization", CVPR 2021
    (arXiv:2012.09838): each block's attention weighted by its gradient and its relevance, rolled out.

    :math:`\bar A_b = I + E_h[(\nabla A_b \odot R_{A_b})^+]`, :math:`C = \bar A_B \cdots \bar A_1`, the map the
    class token's row of C over the patch tokens. :math:`\nabla A_b` is the target score's gradient at block b's
    probabilities; :math:`R_{A_b}` their relevance, propagated from the score's gradient at the logits by the
    authors' rules (see this module's notes). Class-specific through any target. timm's ViT and DeiT with
    class-token pooling; another transformer is a clear error (``gradient_rollout`` needs no relevance).

    Args:
        model: timm's ``VisionTransformer``; left as it was.
        layer: The attention modules to roll out (relevance passes through every block above them); None: all.
        labels: Class names, to accept a class name as target.
    """

    name = "chefer"

    def recorder(self, modules: Mapping[str, nn.Module]) -> BlockInputRecorder:
        model = self.model
        if not _is_timm(model, "VisionTransformer") or model.global_pool != "token" or model.attn_pool is not None:
            raise LayerError(
                f"Chefer 2021a's relevance rules are written for timm's ViT and DeiT with class-token pooling, not a "
                f"{type(model).__name__}; gradient_rollout weighs the attention by its gradient alone"
            )
        blocks = list(model.blocks)
        if not all(_is_timm(b, "Block") and _is_timm(b.attn, "Attention") for b in blocks):
            raise LayerError("Chefer 2021a reads timm's Block and Attention; this ViT has other blocks")
        return BlockInputRecorder(self._attention, self.layer, blocks, model.head)

    def weighted(self, capture: Capture) -> Tensor:
        return capture.gradients.double().clamp(min=0).mean(dim=2)  # the "gradients" are ∇A ⊙ R_A already

    def layer_gradients(self, recorder: Any, score: Tensor, rescore: Callable[[Any], Tensor]) -> dict[str, Tensor]:
        """The gradient at each chosen attention times its relevance, stacked: (N, layers, heads, T, T)."""
        gradients = recorder.backward(score)[self.layer]
        (relevance,) = torch.autograd.grad(score, recorder.head_output, retain_graph=True)
        names = {m: name for name, m in self._attention.items()}
        found: dict[str, Tensor] = {}
        with torch.no_grad():
            features = self.model.fc_norm(self.model.norm(recorder.last)[:, 0])  # the head's input: norms pass
            tokens = torch.zeros_like(recorder.last)
            tokens[:, 0] = z_plus(features, self.model.head.weight, relevance.to(features.dtype))
            for block in reversed(recorder.blocks):
                tokens, of_probabilities = block_relevance(block, recorder.inputs[block], tokens)
                if block.attn in names:
                    found[names[block.attn]] = of_probabilities
        stacked = torch.stack([found[name] for name in self._attention], dim=1)
        return {self.layer: gradients * stacked.to(gradients.dtype)}
