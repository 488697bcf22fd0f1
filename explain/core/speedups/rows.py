"""Backward passes that compute only the rows a score reaches.

A model often computes many rows of which the explained score reads a few: the thousand proposals of an R-CNN's
box head, of which a detection is one; the tokens of a class-token transformer's last block, of which the head
reads the class token alone. Autograd differentiates every row, rows of zero gradient included. Here a module's
output, computed as usual, is joined to its inputs by :class:`RowsRecomputed`, whose backward finds the rows
whose incoming gradient is not zero and recomputes, with autograd, those rows alone. Where most rows are
reached, the graph that the forward recorded serves instead.

- :func:`reached_rows`: ``nn.Linear`` and last-axis ``nn.LayerNorm`` modules applied to sequences (every
  position of their input mapped on its own), and self-attention, timm's and ``nn.MultiheadAttention`` (a row of
  its output depends on its own query row and on every key and value of its image), for the block.
- :func:`explain.core.speedups.box_heads.sparse_box_heads` joins an R-CNN's kept detections to its features.

The recomputed rows' gradients are the ones autograd would give: a row whose output gradient is zero adds
nothing to the input's gradient, and the recomputation computes the other rows as the forward did.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..attention_capture import attention_kind
from ..hooks import Hooks
from ..maps import has_nonzero


class Recorded(NamedTuple):
    """The graph a forward recorded for all rows of a joined output, as an alternative to recomputing rows.

    Attributes:
        gradients: The inputs' gradients from the values' gradient, through that graph.
        serves: Whether, for the reached rows (indices into the values' rows), that graph costs less than their
            recomputation; its cost does not depend on the rows.
    """

    gradients: Callable[[Tensor], tuple[Tensor | None, ...]]
    serves: Callable[[Tensor], bool]


class RowsRecomputed(torch.autograd.Function):
    """Values (..., C) computed without autograd, joined to the inputs they came from.

    The values come in a one-element tuple, not as a tensor argument, and are no view: an input returned as it is,
    or a view, could not be modified in place by the model after (Conditional DETR adds to its box head's output).

    ``recompute(inputs, rows)`` gives rows ``rows`` of the values, with autograd, from the inputs; ``recorded``,
    where the forward recorded a graph for all rows, is used instead when it serves the reached rows better. The
    backward returns the inputs' gradients.
    """

    @staticmethod
    def forward(
        ctx: Any,
        recompute: Callable[[list[Tensor], Tensor], Tensor],
        recorded: Recorded | None,
        values: tuple[Tensor],
        *inputs: Tensor,
    ) -> Tensor:
        ctx.recompute, ctx.recorded = recompute, recorded
        ctx.save_for_backward(*inputs)
        return values[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grad = grad.reshape(-1, grad.shape[-1])
        rows = has_nonzero(grad, dim=1).nonzero()[:, 0]
        if ctx.recorded is not None and ctx.recorded.serves(rows):
            return (None, None, None, *ctx.recorded.gradients(grad))
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


def _joinable(module: nn.Module, x: Any, output: Any) -> bool:
    """Whether a module's output can be joined to its input ``x``: a sequence (N, T, C) that requires grad, a
    tensor output, and no weight gradient wanted of the module."""
    if not isinstance(output, Tensor) or not isinstance(x, Tensor) or not torch.is_grad_enabled():
        return False
    return x.requires_grad and x.dim() == 3 and not any(p.requires_grad for p in module.parameters())


def _rows_joined(chains: Chains, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Tensor | None:
    """Forward hook: a sequence layer's output joined by :class:`RowsRecomputed` to the input of its chain (the
    layer, and the position-wise layers before it whose output it takes as it is)."""
    if len(inputs) != 1 or not _joinable(module, inputs[0], output):
        return None
    x = inputs[0]
    source, earlier = chains.get(x.grad_fn, (x, []))
    chain = [*earlier, module]
    total = output.numel() // output.shape[-1]

    def recompute(sources: list[Tensor], rows: Tensor) -> Tensor:
        y = sources[0].reshape(-1, source.shape[-1])[rows]
        for layer in chain:
            y = layer.forward(y)
        return y

    def gradients(grad: Tensor) -> tuple[Tensor | None, ...]:
        return torch.autograd.grad(output, source, grad.reshape(output.shape), retain_graph=True)

    recorded = Recorded(gradients, serves=lambda rows: 2 * len(rows) >= total)
    joined = RowsRecomputed.apply(recompute, recorded, (output.detach(),), source)
    chains[joined.grad_fn] = (source, chain)
    return joined


class AttentionParts(NamedTuple):
    """What :func:`_attention_rows` reads of a self-attention: softmax(scale q kᵀ) v per head, then the rest.

    Attributes:
        weight: The query, key and value projections, (3, heads, head dim, width).
        bias: Their biases, (3, heads, head dim), or None.
        scale: The logits' scale.
        q_norm: Position-wise norm of each head's queries, or None.
        norm: Position-wise norm of the heads' merged outputs, or None.
        gate: Position-wise gate on the input, multiplying the merged outputs after a sigmoid, or None.
        proj: The output projection.
    """

    weight: Tensor
    bias: Tensor | None
    scale: float
    q_norm: nn.Module | None
    norm: nn.Module | None
    gate: nn.Module | None
    proj: nn.Module


def _present(module: nn.Module | None) -> nn.Module | None:
    """A module, or None for an absent one or ``nn.Identity``."""
    return None if module is None or isinstance(module, nn.Identity) else module


def attention_parts(module: nn.Module) -> AttentionParts | None:
    """A self-attention's parts where :func:`_attention_rows` recomputes it: timm's plain ``Attention`` without a
    key norm (the keys then enter the logits linearly), and ``nn.MultiheadAttention`` with one projection of the
    width for queries, keys and values, batch first, and no added key or value; else None."""
    kind = attention_kind(module)
    if kind == "timm":
        heads, dim, key_norm = module.num_heads, module.head_dim, _present(module.k_norm)
        weight, bias = module.qkv.weight, module.qkv.bias
        parts = (_present(module.q_norm), _present(getattr(module, "norm", None)), getattr(module, "gate", None))
        if key_norm is not None or not all(p is None or _positionwise(p) for p in parts):
            return None
        q_norm, norm, gate, proj, scale = *parts, module.proj, module.scale
    elif kind == "torch":
        if not module._qkv_same_embed_dim or not module.batch_first or module.bias_k is not None:
            return None
        if module.add_zero_attn:
            return None
        heads, dim = module.num_heads, module.head_dim
        weight, bias, proj, scale = module.in_proj_weight, module.in_proj_bias, module.out_proj, module.head_dim**-0.5
        q_norm = norm = gate = None
    else:
        return None
    if not _positionwise(proj):
        return None
    width = weight.shape[-1]
    return AttentionParts(
        weight.view(3, heads, dim, width),
        None if bias is None else bias.view(3, heads, dim),
        scale,
        q_norm,
        norm,
        gate,
        proj,
    )


def _attention_rows(parts: AttentionParts, x: Tensor, rows: Tensor) -> Tensor:
    """Rows ``rows`` (indices into N x T) of a self-attention's output on ``x`` (N, T, C), with autograd.

    A query row i of head h meets every token j of its image: its logits are scale q_hi . (W_kh x_j + b_kh) =
    x_j . u_hi + c_hi with u_hi = scale W_khᵀ q_hi, and the constant c_hi (from the key bias) drops out of the
    softmax; as each row of probabilities p_hi sums to 1, the head's output is W_vh (Σ_j p_hij x_j) + b_vh. So no
    key or value is formed, and the cost grows with the rows times the heads, not with the tokens times the width.
    Each image's rows are padded to the most any image has.
    """
    n, tokens, width = x.shape
    weight, (heads, dim) = parts.weight, parts.weight.shape[1:3]
    bias = parts.bias if parts.bias is not None else x.new_zeros(3, heads, dim)
    image = rows // tokens
    counts = torch.bincount(image, minlength=n)
    slot = torch.arange(len(rows), device=rows.device) - (counts.cumsum(0) - counts)[image]  # rows are sorted
    own = x.reshape(-1, width)[rows]
    q = torch.einsum("mc,hdc->mhd", own, weight[0]) + bias[0]
    q = (q if parts.q_norm is None else parts.q_norm.forward(q)) * parts.scale
    u = x.new_zeros(n, int(counts.max()), heads, width)
    u = u.index_put((image, slot), torch.einsum("mhd,hdc->mhc", q, weight[1]))
    probabilities = torch.einsum("ntc,nrhc->nrht", x, u).softmax(dim=-1)
    mixed = torch.einsum("nrht,ntc->nrhc", probabilities, x)[image, slot]
    y = (torch.einsum("mhc,hdc->mhd", mixed, weight[2]) + bias[2]).reshape(len(rows), heads * dim)
    if parts.norm is not None:
        y = parts.norm.forward(y)
    if parts.gate is not None:
        y = y * parts.gate.forward(own).sigmoid()
    return parts.proj.forward(y)


def _plain_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The input of a self-attention call that :func:`_attention_rows` reproduces (no mask, no dropout at work,
    the same tensor as query, key and value, no weights returned); else None."""
    if kwargs.get("attn_mask") is not None or kwargs.get("is_causal", False):
        return None
    if isinstance(module, nn.MultiheadAttention):
        plain = len(args) == 3 and args[0] is args[1] is args[2] and kwargs.get("key_padding_mask") is None
        dropping = module.training and module.dropout > 0
        return args[0] if plain and not dropping and kwargs.get("need_weights", True) is False else None
    dropping = module.training and (module.attn_drop.p > 0 or module.proj_drop.p > 0)
    return args[0] if len(args) == 1 and not dropping else None


def _attention_joined(
    chains: Chains,
    parts: AttentionParts,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
) -> Any:
    """Forward hook: a self-attention's output joined by :class:`RowsRecomputed` to its input.

    Where the input is itself a joined chain's output (a block's norm before the attention), the attention's own
    position-wise layers (its query, key and value projection) extended that chain, so the graph the forward
    recorded reaches the chain's source, not the input: the output is joined to both, the recomputed rows giving
    the input's gradient and the recorded graph the source's, the one gradient that graph holds.
    """
    x = _plain_call(module, args, kwargs)
    out = output[0] if isinstance(module, nn.MultiheadAttention) else output
    if not _joinable(module, x, out):
        return None
    n, tokens, width = x.shape
    source = chains.get(x.grad_fn, (x, []))[0]
    inputs = (x,) if source is x else (x, source)

    def gradients(grad: Tensor) -> tuple[Tensor | None, ...]:
        (found,) = torch.autograd.grad(out, source, grad.reshape(out.shape), retain_graph=True)
        return (found,) if source is x else (None, found)

    def serves(rows: Tensor) -> bool:  # recomputing costs ~ rows per image x heads x T x C, the graph ~ T x C^2
        return 2 * int(torch.bincount(rows // tokens, minlength=n).max()) * parts.weight.shape[1] > width

    recompute = lambda sources, rows: _attention_rows(parts, sources[0], rows)  # noqa: E731
    joined = RowsRecomputed.apply(recompute, Recorded(gradients, serves), (out.detach(),), *inputs)
    return (joined, *output[1:]) if isinstance(module, nn.MultiheadAttention) else joined


def has_sequence_layers(modules: Iterable[nn.Module]) -> bool:
    """Whether any of the modules is a position-wise layer or a self-attention that :func:`reached_rows` hooks."""
    return any(_positionwise(module) or attention_parts(module) is not None for module in modules)


@contextmanager
def reached_rows(
    model: nn.Module, skip: Collection[nn.Module] = (), sequences: Collection[str] | None = None
) -> Iterator[None]:
    """For the block, differentiate the model's sequence layers only at the rows a score reaches.

    Each position-wise layer of the model (see :func:`_positionwise`) and each self-attention that
    :func:`_attention_rows` recomputes (see :func:`attention_parts`) gets a forward hook, but not those in
    ``skip`` (the modules a recorder hooks) nor an attention that holds one. When the output of a hooked layer is a
    sequence (N, T, C) that requires grad, and its parameters do not, the output is joined by
    :class:`RowsRecomputed` to its input. A position-wise layer that takes a joined output as it is extends that
    output's chain, so that a chain (a transformer's MLP: norm, linear, activation, linear) is recomputed as one,
    its rows gathered and scattered once. A gradient that also reaches an earlier layer's output by another way
    still flows through that layer's own node. In a class-token transformer's last block, the MLP and the
    attention are then differentiated at the class token alone.

    ``sequences``, where given, names the modules whose output a traced pass found a sequence (T, C) per image:
    only those are hooked. A convolutional network's activations then cost no hook call.
    """
    chains: Chains = {}
    skipped = set(skip)
    if sequences is None:
        modules = [module for _, module in model.named_modules()]
    else:  # looked up by name: no walk of a model whose layers are all maps
        modules = list({id(m): m for m in map(model.get_submodule, sorted(sequences))}.values())
    try:
        with Hooks() as hooks:
            for module in modules:
                if module in skipped:
                    continue
                if _positionwise(module):
                    hooks.forward(module, partial(_rows_joined, chains))
                elif (parts := attention_parts(module)) is not None and skipped.isdisjoint(module.modules()):
                    hooks.forward(module, partial(_attention_joined, chains, parts), with_kwargs=True)
            yield
    finally:
        chains.clear()
