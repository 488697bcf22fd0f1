"""Chefer et al. 2021a: relevance propagated through a vision transformer by the authors' rules, weighted by the
attention's gradient and rolled out.

The relevance pass follows the authors' equations ("Transformer Interpretability Beyond Attention Visualization",
CVPR 2021, arXiv:2012.09838, section 3): linear layers by LRP-αβ with α = 1, β = 0 and no bias; layer norms,
activations, dropout and the softmax pass relevance through; a residual sum u + v and the attention's two products
(q kᵀ and A v) split it between their operands in proportion to their contributions, the sum renormalized so that
each operand's share is its contribution's magnitude, and each product's halves divided by 2. Divisions by zero
give zero (the authors' ``safe_divide``: b + 1e-9 in the denominator).

The rules read a pre-norm block (``x + attention(norm(x))``, then ``+ mlp(norm(.))``) and a class token pooled
into a linear head; each family's parts are named in :func:`vit_parts` (timm's, torchvision's and HuggingFace's
ViT and DeiT). The forward keeps each block's input and output; the pass recomputes each block from its input
and refuses a model whose recomputed block or head does not give what the model computed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attention_capture import AttentionRecorder, attention_kind
from ..core.engine import Capture, Needs
from ..core.recording import Asking, AttentionProbabilities, layer_label
from ..errors import LayerError
from .rollout import ClassHead, GradientRollout, class_head


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


def _heads(z: Tensor, heads: int) -> Tensor:
    """Tokens (N, T, C) split into heads (N, heads, T, C / heads)."""
    n, t, _ = z.shape
    return z.reshape(n, t, heads, -1).transpose(1, 2)


@dataclass(frozen=True)
class BlockParts:
    """One pre-norm transformer block as the rules read it: ``m = x + ls1(proj(A v))`` with A, q, k and v from
    ``norm1(x)``, then ``m + ls2(fc2(activate(fc1(norm2(m)))))``.

    Attributes:
        block: The block, whose output the recomputation must give back.
        attention: Its attention module (whose probabilities the recorder keeps).
        norm1, norm2: The norms before the attention and before the MLP.
        qkv: The normed tokens' q, k and v, (N, heads, T, d) each, with any q/k norm applied.
        qkv_weight: The q, k and v projections' weights stacked, (3 C', C).
        scale: What q kᵀ is multiplied by before the softmax.
        merged_norm: Applied to the heads' merged outputs before the projection (timm's ``attn.norm``).
        proj: The attention's output projection.
        ls1, ls2: The layer scales of the two branches.
        fc1, fc2: The MLP's two linear layers.
        activate: What lies between them (activation, dropout, norm).
    """

    block: nn.Module
    attention: nn.Module
    norm1: nn.Module
    qkv: Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]
    qkv_weight: Tensor
    scale: float
    merged_norm: Callable[[Tensor], Tensor]
    proj: nn.Linear
    ls1: Callable[[Tensor], Tensor]
    norm2: nn.Module
    fc1: nn.Linear
    activate: Callable[[Tensor], Tensor]
    fc2: nn.Linear
    ls2: Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class ViTParts:
    """A class-token vision transformer as the rules read it: its blocks, and its head, which reads the class
    token of the last block's output."""

    blocks: list[BlockParts]
    head: ClassHead


def _identity(x: Tensor) -> Tensor:
    return x


def _timm_parts(model: nn.Module) -> list[BlockParts] | None:
    if not (_is_timm(model, "VisionTransformer") and model.global_pool == "token" and model.attn_pool is None):
        return None

    def block_parts(block: nn.Module) -> BlockParts:
        attn, mlp = block.attn, block.mlp

        def qkv(t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            q, k, v = (_heads(z, attn.num_heads) for z in attn.qkv(t).chunk(3, dim=-1))
            return attn.q_norm(q), attn.k_norm(k), v

        activate = lambda h: mlp.norm(mlp.drop1(mlp.act(h)))  # noqa: E731
        return BlockParts(block, attn, block.norm1, qkv, attn.qkv.weight, attn.scale, attn.norm, attn.proj,
                          block.ls1, block.norm2, mlp.fc1, activate, mlp.fc2, block.ls2)  # fmt: skip

    return [block_parts(b) for b in model.blocks]


def _torchvision_parts(model: nn.Module) -> list[BlockParts] | None:
    if (type(model).__module__.split(".")[0], type(model).__name__) != ("torchvision", "VisionTransformer"):
        return None

    def block_parts(block: nn.Module) -> BlockParts:
        attn, mlp = block.self_attention, block.mlp

        def qkv(t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            projected = F.linear(t, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
            return tuple(_heads(z, attn.num_heads) for z in projected)  # type: ignore[return-value]

        scale = (attn.embed_dim // attn.num_heads) ** -0.5
        return BlockParts(block, attn, block.ln_1, qkv, attn.in_proj_weight, scale, _identity, attn.out_proj,
                          _identity, block.ln_2, mlp[0], lambda h: mlp[2](mlp[1](h)), mlp[3], _identity)  # fmt: skip

    return [block_parts(b) for b in model.encoder.layers]


def _huggingface_parts(model: nn.Module) -> list[BlockParts] | None:
    blocks = getattr(getattr(model, "base_model", None), "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        return None
    if not all(attention_kind(getattr(b, "attention", None)) == "hf" for b in blocks):
        return None

    def block_parts(block: nn.Module) -> BlockParts:
        attn, mlp = block.attention, block.mlp
        heads = attn.num_attention_heads

        def qkv(t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            return tuple(_heads(p(t), heads) for p in (attn.q_proj, attn.k_proj, attn.v_proj))  # type: ignore[return-value]

        weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        return BlockParts(block, attn, block.layernorm_before, qkv, weight, attn.scaling, _identity, attn.o_proj,
                          _identity, block.layernorm_after, mlp.fc1, mlp.activation_fn, mlp.fc2, _identity)  # fmt: skip

    return [block_parts(b) for b in blocks]


PASSING = (nn.LayerNorm, nn.Dropout, nn.Identity)  # what lies before a head that relevance passes unchanged


def vit_parts(model: nn.Module) -> ViTParts:
    """The model's blocks and head as Chefer's rules read them: timm's ViT and DeiT, torchvision's ViT, and
    HuggingFace's ViT and DeiT classifiers, each with class-token pooling and a linear head after norms.

    Raises:
        LayerError: Another model; it names gradient_rollout.
    """
    head = class_head(model)
    if head is not None and all(isinstance(m, PASSING) for m in head.pre_head.modules() if m is not head.pre_head):
        for family in (_timm_parts, _torchvision_parts, _huggingface_parts):
            try:
                blocks = family(model)
            except AttributeError:  # a relative with other parts: no rules for it
                blocks = None
            if blocks:
                return ViTParts(blocks, head)
    raise LayerError(
        f"Chefer 2021a's relevance rules are written for class-token vision transformers (timm's, torchvision's and "
        f"HuggingFace's ViT and DeiT), not a {type(model).__name__}; gradient_rollout weighs the attention by its "
        "gradient alone"
    )


@dataclass(frozen=True)
class Attended:
    """A block's attention recomputed from its normed tokens (N, T, C): q, k and v per head, the probabilities
    (N, heads, T, T), the heads' merged outputs (after any norm), and the attention's output."""

    q: Tensor
    k: Tensor
    v: Tensor
    probabilities: Tensor
    merged: Tensor
    output: Tensor


def attended(parts: BlockParts, tokens: Tensor) -> Attended:
    """The block's attention on its normed ``tokens``, each intermediate kept for the relevance pass."""
    q, k, v = parts.qkv(tokens)
    probabilities = (q * parts.scale @ k.transpose(-2, -1)).softmax(dim=-1)
    merged = parts.merged_norm((probabilities @ v).transpose(1, 2).flatten(2))
    return Attended(q, k, v, probabilities, merged, parts.ls1(parts.proj(merged)))


def attention_relevance(parts: BlockParts, tokens: Tensor, seen: Attended, relevance: Tensor) -> tuple[Tensor, Tensor]:
    """A block's attention on its normed ``tokens`` (``seen``: its recomputation): the relevance of its input and
    of its probabilities (N, heads, T, T), from its output's."""
    per_head = _heads(z_plus(seen.merged, parts.proj.weight, relevance), seen.q.shape[1])
    of_probabilities, of_v = split_product(seen.probabilities, seen.v, per_head)
    of_q, of_k_transposed = split_product(seen.q, seen.k.transpose(-2, -1), of_probabilities)  # the softmax passes
    of_qkv = torch.cat([z.transpose(1, 2).flatten(2) for z in (of_q, of_k_transposed.transpose(-2, -1), of_v)], -1)
    return z_plus(tokens, parts.qkv_weight, of_qkv), of_probabilities


def block_relevance(parts: BlockParts, x: Tensor, output: Tensor, relevance: Tensor) -> tuple[Tensor, Tensor]:
    """A block on its input ``x``: the relevance of its input and of its attention's probabilities.

    Raises:
        LayerError: The block recomputed from its parts does not give its recorded ``output``: the rules do not
            describe it.
    """
    normed = parts.norm1(x)
    seen = attended(parts, normed)
    middle = x + seen.output
    hidden = parts.norm2(middle)
    activated = parts.activate(parts.fc1(hidden))
    mlp = parts.ls2(parts.fc2(activated))
    _check_recomputed(middle + mlp, output, type(parts.block).__name__)
    of_middle, of_mlp = split_sum(middle, mlp, relevance)
    of_middle = of_middle + z_plus(hidden, parts.fc1.weight, z_plus(activated, parts.fc2.weight, of_mlp))
    of_x, of_attended = split_sum(x, seen.output, of_middle)
    of_normed, of_probabilities = attention_relevance(parts, normed, seen, of_attended)
    return of_x + of_normed, of_probabilities


def _refusal(what: str) -> LayerError:
    return LayerError(
        f"Chefer 2021a: this model's {what} does not compute what its rules read (a pre-norm block "
        "x + attention(norm(x)), then + mlp(norm(.)); class-token pooling into a linear head); "
        "gradient_rollout weighs the attention by its gradient alone"
    )


def _check_recomputed(recomputed: Tensor, recorded: Tensor, what: str) -> None:
    """The rules describe a part only if recomputing it from them gives what the model computed."""
    tolerance = 1e-3 * recorded.abs().max().clamp_min(1e-6)
    if recomputed.shape != recorded.shape or (recomputed - recorded).abs().max() > tolerance:
        raise _refusal(what)


@contextmanager
def _unreadable_as_refusal() -> Iterator[None]:
    """A part the rules cannot even recompute (its tensors do not fit together as they read them) is refused
    as one that recomputes to something else."""
    try:
        yield
    except RuntimeError as err:
        raise _refusal(f"architecture ({str(err).splitlines()[0]})") from err


def _is_timm(module: nn.Module, name: str) -> bool:
    return type(module).__module__.startswith("timm.") and type(module).__name__ == name


class BlockInputRecorder(AttentionRecorder):
    """An attention recorder that also keeps each block's input and output and the head's output (in the graph).

    Args:
        modules: The attention modules to record, by name.
        name: The name the stacked attention goes by.
        parts: The model's parts (see :func:`vit_parts`).
    """

    def __init__(self, modules: Mapping[str, nn.Module], name: str, parts: ViTParts):
        super().__init__(modules, name)
        self.parts = parts
        self.inputs: dict[nn.Module, Tensor] = {}
        self.outputs: dict[nn.Module, Tensor] = {}
        self.head_output: Tensor | None = None

    def __enter__(self) -> BlockInputRecorder:
        super().__enter__()
        try:
            for block in (b.block for b in self.parts.blocks):
                self._hooks.forward_pre(block, self._keep_input, with_kwargs=True)
                self._hooks.forward(block, lambda m, i, o: self.outputs.__setitem__(m, _tokens(o).detach()))
            self._hooks.forward(self.parts.head.linear, lambda m, i, o: setattr(self, "head_output", o))
        except BaseException:
            self._hooks.remove()
            raise
        return self

    def _keep_input(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.inputs[module] = (args[0] if args else kwargs["hidden_states"]).detach()

    def backward(
        self, score: Tensor, create_graph: bool = False, rescore: Callable[[Any], Tensor] | None = None
    ) -> dict[str, Tensor]:
        """The gradient at each chosen attention times its relevance, stacked: (N, layers, heads, T, T)."""
        gradients = super().backward(score, create_graph)[self.name]
        (relevance,) = torch.autograd.grad(score, self.head_output, retain_graph=True)
        names = {m: name for name, m in self.modules.items()}
        parts = self.parts
        found: dict[str, Tensor] = {}
        with torch.no_grad(), _unreadable_as_refusal():
            last = self.outputs[parts.blocks[-1].block]
            pooled = parts.head.pre_head(parts.head.norm(last[:, 0]))  # the linear head's input: norms pass
            _check_recomputed(parts.head.linear(pooled), self.head_output.detach(), "head")
            tokens = torch.zeros_like(last)
            tokens[:, 0] = z_plus(pooled, parts.head.linear.weight, relevance.to(pooled.dtype))
            for block in reversed(parts.blocks):
                tokens, of_probabilities = block_relevance(
                    block, self.inputs[block.block], self.outputs[block.block], tokens
                )
                if block.attention in names:
                    found[names[block.attention]] = of_probabilities
        stacked = torch.stack([found[name] for name in self.modules], dim=1)
        return {self.name: gradients * stacked.to(gradients.dtype)}


def _tokens(output: Any) -> Tensor:
    """A block's output tokens: the tensor itself, or the first of a tuple."""
    return output[0] if isinstance(output, (tuple, list)) else output


class BlockInputs(AttentionProbabilities):
    """The attention probabilities and their gradients, with each block's input and output and the head's output
    (:class:`BlockInputRecorder`): the gradient each gives is weighted by its relevance."""

    def recorder(self, method: Asking, modules: Mapping[str, nn.Module]) -> BlockInputRecorder:
        chosen = self.chosen(method)
        return BlockInputRecorder(chosen, layer_label(list(chosen)), vit_parts(method.model))


class CheferRelevance(GradientRollout):
    r"""Chefer, Gur & Wolf, "Transformer Interpretability Beyond Attention Visualization", CVPR 2021
    (arXiv:2012.09838): each block's attention weighted by its gradient and its relevance, rolled out.

    :math:`\bar A_b = I + E_h[(\nabla A_b \odot R_{A_b})^+]`, :math:`C = \bar A_B \cdots \bar A_1`, the map the
    class token's row of C over the patch tokens. :math:`\nabla A_b` is the target score's gradient at block b's
    probabilities; :math:`R_{A_b}` their relevance, propagated from the score's gradient at the logits by the
    authors' rules (see this module's notes). Class-specific through any target. timm's, torchvision's and
    HuggingFace's ViT and DeiT with class-token pooling; another transformer is a clear error
    (``gradient_rollout`` needs no relevance).

    Args:
        model: A class-token vision transformer (see :func:`vit_parts`); left as it was.
        layer: The attention modules to roll out (relevance passes through every block above them); None: all.
        labels: Class names, to accept a class name as target.
    """

    name = "chefer"
    title = "Chefer 2021a, relevance and gradient rolled out (Chefer et al. 2021)"
    fast = False
    needs = Needs(records=BlockInputs())  # the "gradients" at the attention are weighted by its relevance

    def weighted(self, capture: Capture) -> Tensor:
        return capture.gradients.double().clamp(min=0).mean(dim=2)  # the "gradients" are ∇A ⊙ R_A already
