r"""The relevance engine: for the block, every torch operation the model's forward runs on a tensor that relevance
passes through is swapped for one whose backward hands relevance to its inputs by its rule. LRP, AttnLRP and
CP-LRP (Achtibat et al., "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers", ICML 2024)
and CRP all run here; any model built of these operations gets the rules, whatever its family, and an operation
without a rule is refused in one line that names it, never passed as a gradient.

The rules (R: the relevance at an operation's output, z its output, :math:`z' = z + \epsilon\,\mathrm{sign}(z)`):

- **A composite's rule** (LRP, :mod:`explain.relevance.composites`) for the convolutions, linear layers and pools
  it names: z⁺, αβ, γ, z^B, flat (:mod:`explain.relevance.rules`), a batch norm in eval that reads such a layer's
  output merged into the layer for the call (as zennit's canonizers merge them).
- **ε** for an affine map of one input (linear layers and convolutions no composite names, batch norms in eval,
  average pools, means and sums, resizing, a sum with a constant): :math:`R_x = x \odot J^\top (R / z')`.
- **ε** for the sum of two inputs (a residual connection): :math:`R_a = a \odot R / z'`, :math:`R_b = b \odot R / z'`.
- **Layer and group norms**: ε through the norm with each standard deviation held constant (its centring is
  linear).
- **Identity** through element-wise activations (GELU, SiLU, ...), RMS norms, a product with a constant, a division
  by one, and a negation: :math:`R_x = R`.
- **Gate** for the product of two inputs: a factor spread over the other's positions or channels (a
  squeeze-excitation) is held constant, the signal getting all (Pahde et al., "Optimizing Explanations by Network
  Canonization and Hyperparameter Search", CVPR workshops 2023); factors of one shape each get half (uniform),
  :math:`R_a = R_b = R / 2`; ``gate="uniform"`` halves everywhere.
- **Uniform and ε** for a matrix product of two inputs: :math:`R_a = a \odot ((R / 2z') b^\top)`,
  :math:`R_b = b \odot (a^\top (R / 2z'))`; with one constant, the other gets it all, :math:`R / z'`.
- **Softmax** (Deep Taylor at its input): :math:`R_x = x \odot (R - s \odot \sum R)`; with the attention held
  constant (CP-LRP, and LRP), its output is a constant in its product with the values, which get all the relevance.
- Fused attention (``scaled_dot_product_attention``) runs as its parts, :math:`\mathrm{softmax}(q k^\top s) v`.
- Layout (views, permutations, concatenation, indexing, writing values in, cutting into patches with
  ``unfold``), dropout in eval, selections (``where``,
  ``max``) and max pooling pass relevance as the gradient does: they move values, or pick one.
- **Statistics** of a relevant tensor (``pow``, ``norm``, ``var``, ``std``, and what is computed from them alone) are
  held constant, as a layer norm's spread: a tensor they scale or divide keeps its relevance (an RMS norm or an L2
  normalization written out), and relevance arriving at one used otherwise (a feature) is refused.
- An in-place operation runs under its rule on a copy, which the tensor then becomes: what a rule saved of the
  tensor before keeps its values.

An operation without a rule runs as it is, its result barred: the refusal, which names it, comes in the backward,
where relevance reaches it, so that a branch the explained score does not read (a detector's box decoding) runs.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_flatten

from ..core.hooks import Hooks
from ..errors import LayerError
from .epsilon import EPSILON, ratio
from .rules import Layer, MergedNorm, Rule

T = torch.Tensor


def _own(z: Tensor) -> Tensor:
    """A rule's output as a tensor of its own, not a view (of a tensor inside the rule, or of its input), so that the
    model may change it in place."""
    return torch.ops.aten._unsafe_view(z, z.shape)  # an alias autograd does not take for a view


def _grad(value: Any) -> bool:
    return isinstance(value, Tensor) and value.requires_grad


class _Affine(torch.autograd.Function):
    """ε for ``fn``, affine in its one input x: :math:`x \\odot J^\\top (R / z')`, the Jacobian product through
    the graph ``fn`` recorded in the forward (not run again; kept for every backward of the outer graph)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fn: Callable[[Tensor], Tensor], epsilon: float) -> Tensor:
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            z = fn(leaf)
        ctx.leaf, ctx.z, ctx.epsilon = leaf, z, epsilon
        return _own(z.detach())

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[Tensor, None, None]:
        leaf, z = ctx.leaf, ctx.z
        found = torch.autograd.grad(z, leaf, ratio(relevance, z.detach(), ctx.epsilon), retain_graph=True)[0]
        return leaf.detach() * found, None, None


class _Linear(torch.autograd.Function):
    r"""ε for a linear layer, from its saved output: :math:`R_x = x \odot ((R / z') W)`, no forward again."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, epsilon: float) -> Tensor:
        z = _own(F.linear(x, weight, bias))
        ctx.save_for_backward(x, weight)
        ctx.z, ctx.epsilon = z.detach(), epsilon  # z kept apart from the output, which may be changed in place
        return z

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[Tensor, None, None, None]:
        x, weight = ctx.saved_tensors
        return x * (ratio(relevance, ctx.z, ctx.epsilon) @ weight), None, None, None


class _Normalized(torch.autograd.Function):
    r"""ε through a layer or group norm with each spread σ held constant, from its saved output (its centring is
    linear): :math:`R_x = x \odot (w \odot r - \overline{w \odot r}) / \sigma` with :math:`r = R / z'`, the mean
    over each normalized block (a layer norm's last axes, a group norm's group of channels and positions).
    ``normalized(x)`` gives the norm's output and each block's 1 / σ, from the fused kernel; ``weight`` is the
    norm's weight as it broadcasts to x."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        normalized: Callable[[Tensor], tuple[Tensor, Tensor]],
        weight: Tensor | None,
        epsilon: float,
    ) -> Tensor:
        z, rstd = normalized(x)
        ctx.weighted, ctx.z, ctx.epsilon = weight is not None, z, epsilon
        ctx.save_for_backward(x, rstd, *([weight] if weight is not None else []))
        return _own(z)

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[Tensor | None, ...]:
        x, rstd, *weight = ctx.saved_tensors
        r = ratio(relevance, ctx.z, ctx.epsilon)
        r = r * weight[0] if ctx.weighted else r
        blocks = r.reshape(rstd.numel(), -1)  # each normalized block a row, in x's logical order
        centred = (blocks - blocks.mean(dim=1, keepdim=True)) * rstd.reshape(-1, 1)
        return x * centred.view_as(x), None, None, None


class _Identity(torch.autograd.Function):
    """The identity rule for ``fn`` of one input: its output, the relevance passed on unchanged."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        return _own(fn(x))

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[Tensor, None]:
        return relevance, None


class _Barred(torch.autograd.Function):
    """A value relevance may not pass through (a held statistic, an operation without a rule): ``value`` (computed
    without a graph) tied to ``source``, so that relevance arriving at it is seen and refused with ``refusal``;
    none arriving, it hands none on."""

    @staticmethod
    def forward(ctx: Any, source: Tensor, value: Tensor, refusal: str) -> Tensor:
        ctx.refusal = refusal
        return _own(value)

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[None, None, None]:
        _refuse_arriving(relevance, ctx.refusal)
        return None, None, None


class _BarredInPlace(torch.autograd.Function):
    """An in-place change of ``x`` that relevance may not pass through: x's history from here on is refused."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, refusal: str) -> Tensor:
        ctx.mark_dirty(x)
        ctx.refusal = refusal
        return x

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[None, None]:
        _refuse_arriving(relevance, ctx.refusal)
        return None, None


def _refuse_arriving(relevance: Tensor | None, refusal: str) -> None:
    if relevance is not None and bool(relevance.ne(0).any()):
        raise LayerError(refusal)


def barred(func: Callable[..., Any], args: tuple, kwargs: dict, source: Tensor, refusal: str) -> Any:
    """``func``, each tensor it gives that relevance would pass through barred to it (see :class:`_Barred`); in
    place, its first argument's history barred from here on."""
    result = func(*args, **kwargs)
    if args and result is args[0] and _grad(result):  # in place: it gave back its first argument, changed
        return _BarredInPlace.apply(result, refusal)

    def bar(value: Any) -> Any:
        return _Barred.apply(source, value.detach(), refusal) if _grad(value) else value

    if isinstance(result, (tuple, list)):
        return type(result)([bar(v) for v in result])
    return bar(result)


class _Sum(torch.autograd.Function):
    """ε for ``a + b`` (both inputs relevant), broadcast as the sum is."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, epsilon: float) -> Tensor:
        z = a + b
        ctx.save_for_backward(a, b)
        ctx.z, ctx.epsilon = z.detach(), epsilon
        return z

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[Tensor, Tensor, None]:
        a, b = ctx.saved_tensors
        shared = ratio(relevance, ctx.z, ctx.epsilon)
        return _unbroadcast(a * shared, a.shape), _unbroadcast(b * shared, b.shape), None


class _Product(torch.autograd.Function):
    """The uniform rule for ``a * b`` (both inputs relevant): half each."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
        ctx.shapes = a.shape, b.shape
        return a * b

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[Tensor, Tensor]:
        return tuple(_unbroadcast(relevance / 2, shape) for shape in ctx.shapes)  # type: ignore[return-value]


class _Bilinear(torch.autograd.Function):
    """The uniform and ε rules for ``fn(a, b)``, bilinear in its inputs (a matrix product, a two-operand einsum):
    each relevant input gets its input times the gradient of ``fn`` weighted by R / 2z' (R / z' where the other is
    a constant); a matrix product's from its saved output, as its own backward would."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, fn: Callable[[Tensor, Tensor], Tensor], epsilon: float) -> Tensor:
        z = _own(fn(a, b))
        ctx.fn, ctx.z, ctx.epsilon = fn, z.detach(), epsilon
        ctx.save_for_backward(a, b)
        return z

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        a, b = ctx.saved_tensors
        to_a, to_b = ctx.needs_input_grad[:2]
        shared = ratio(relevance, ctx.z, ctx.epsilon, 2.0 if to_a and to_b else 1.0)
        if ctx.fn is torch.matmul and a.dim() >= 2 and b.dim() >= 2:
            found_a = a * _unbroadcast(shared @ b.transpose(-1, -2), a.shape) if to_a else None
            found_b = b * _unbroadcast(a.transpose(-1, -2) @ shared, b.shape) if to_b else None
            return found_a, found_b, None, None
        with torch.enable_grad():
            leaves = a.detach().requires_grad_(to_a), b.detach().requires_grad_(to_b)
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            found = iter(torch.autograd.grad(ctx.fn(*leaves), wanted, shared))
        found_a, found_b = (leaf.detach() * next(found) if leaf.requires_grad else None for leaf in leaves)
        return found_a, found_b, None, None


class _Softmax(torch.autograd.Function):
    """AttnLRP's softmax rule, :math:`R_x = x \\odot (R - s \\odot \\sum R)` (masked inputs, -inf, as 0)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int) -> Tensor:
        s = torch.softmax(x, dim=dim)
        ctx.dim, ctx.s = dim, s.detach()
        ctx.save_for_backward(x)
        return s

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[Tensor, None]:
        (x,) = ctx.saved_tensors
        s = ctx.s
        x = x.nan_to_num(neginf=0.0)  # a masked score
        return x * (relevance - s * relevance.sum(dim=ctx.dim, keepdim=True)), None


def _unbroadcast(value: Tensor, shape: torch.Size) -> Tensor:
    """A broadcast operand's relevance summed back to its own shape."""
    while value.dim() > len(shape):
        value = value.sum(dim=0)
    axes = [i for i, (have, want) in enumerate(zip(value.shape, shape)) if want == 1 and have != 1]
    return value.sum(dim=axes, keepdim=True) if axes else value


def affine(x: Tensor, fn: Callable[[Tensor], Tensor], epsilon: float = EPSILON) -> Tensor:
    """``fn(x)`` under the ε rule."""
    return _Affine.apply(x, fn, epsilon)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, epsilon: float = EPSILON) -> Tensor:
    """``F.linear(x, weight, bias)`` under the ε rule, the weights constants."""
    return _Linear.apply(x, weight.detach(), None if bias is None else bias.detach(), epsilon)


def identity(x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``fn(x)`` under the identity rule."""
    return _Identity.apply(x, fn)


@dataclass
class RuledCall:
    """One call of a layer operation under a composite's rule; a batch norm reading its output merges into it."""

    rule: Rule
    layer: Layer


class _Ruled(torch.autograd.Function):
    """A layer operation under a composite's rule: its output ``value`` (the model's own), the backward the rule's
    relevance of the layer's input (the layer as the forward left it: a batch norm after it merged)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, value: Tensor, call: RuledCall) -> Tensor:
        ctx.call = call
        ctx.save_for_backward(x)
        return _own(value)

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[Tensor, None, None]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            return ctx.call.rule(ctx.call.layer, x.detach(), relevance), None, None


Handler = Callable[["OperationRules", Callable[..., Any], tuple, dict], Any]


def _named(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by name, its positional ones named in order."""
    return {**dict(zip(names, args)), **kwargs}


def _affine_first(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """ε through an operation affine in its first argument (its others constants)."""
    if func is F.linear and _grad(args[0]):
        o = _named(("input", "weight", "bias"), args, kwargs)
        return linear(o["input"], o["weight"], o.get("bias"), mode.epsilon)
    return affine(args[0], lambda t: func(t, *args[1:], **kwargs), mode.epsilon)


def _layer(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A convolution, linear layer or pool under the rule the method's composite gives it, else under ε (a max pool
    as the gradient)."""
    kind = "weighted" if func in WEIGHTED else "max_pool" if func in MAX_POOLS else "pool"
    names = ("input", "weight", "bias") if kind == "weighted" else ("input",)
    o = _named(names, args, kwargs)
    x = o["input"]
    rule = mode.layers(kind, o.get("weight")) if mode.layers is not None and _grad(x) else None
    if rule is None:
        return func(*args, **kwargs) if kind == "max_pool" else _affine_first(mode, func, args, kwargs)
    constant = {n: None if o.get(n) is None else o[n].detach() for n in ("weight", "bias")}
    rest = {k: v for k, v in kwargs.items() if k not in names}
    layer = Layer(func, constant["weight"], constant["bias"], tuple(args[len(names) :]), rest)
    with torch.no_grad():
        value = func(*args, **kwargs)
    if not isinstance(value, Tensor):  # a max pool's indices too: as the gradient
        return func(*args, **kwargs)
    call = RuledCall(rule, layer)
    output = _Ruled.apply(x, value, call)
    if func in MERGING:
        mode.remember(output, call)
    return output


def _identity_first(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The identity rule through an element-wise operation of its first argument (run out of place)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
    return identity(args[0], lambda t: func(t, *args[1:], **kwargs))


def _plus(a: Any, b: Any, epsilon: float) -> Tensor:
    """``a + b`` under ε: both relevant, or one a constant that keeps its share (a bias)."""
    if _grad(a) and _grad(b):
        return _Sum.apply(a, b, epsilon)
    x, other = (a, b) if _grad(a) else (b, a)
    return affine(x, lambda t: t + other, epsilon)


def _add(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    a, b = args[0], args[1]
    if kwargs.get("alpha", 1) != 1:
        b = _times(b, kwargs["alpha"])
    return _plus(a, b, mode.epsilon)


def _sub(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    a, b = args[0], args[1]
    return _plus(a, _times(b, -kwargs.get("alpha", 1)), mode.epsilon)


def _rsub(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return _plus(args[1], _times(args[0], -1), mode.epsilon)


def _times(a: Any, b: Any, gate: str = "signal") -> Any:
    """``a * b``: the gate rule where both are relevant (see :class:`OperationRules`), the identity where one is a
    constant."""
    if gate == "signal" and _grad(a) and _grad(b) and a.shape != b.shape:
        a_gates = torch.broadcast_shapes(a.shape, b.shape) != a.shape  # a is spread over b's positions or channels
        a, b = (a.detach(), b) if a_gates else (a, b.detach())
    if _grad(a) and _grad(b):
        return _Product.apply(a, b)
    if not (_grad(a) or _grad(b)):
        return a * b
    x, other = (a, b) if _grad(a) else (b, a)
    return identity(x, lambda t: t * other)


def _mul(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return _times(mode.held(args[0]), mode.held(args[1]), mode.gate)


def _div(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A division by a constant (or a held statistic): the identity; by a relevant tensor: no rule, barred."""
    a, b = mode.held(args[0]), mode.held(args[1])
    if _grad(b):
        return barred(func, (a, b), kwargs, b, mode.refusal("a division by a tensor relevance passes through"))
    return identity(a, lambda t: func(t, b, **kwargs))


def _neg(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return identity(args[0], torch.neg)


def _matmul(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return _bilinear(mode.held(args[0]), mode.held(args[1]), torch.matmul, mode.epsilon)


def _einsum(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A two-operand einsum, bilinear: as a matrix product; one of another number of operands has no rule, barred."""
    equation, *operands = args
    operands = operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
    if len(operands) != 2:
        relevant = next(v for v in operands if _grad(v))
        return barred(func, args, kwargs, relevant, mode.refusal(f"an einsum of {len(operands)} operands"))
    a, b = mode.held(operands[0]), mode.held(operands[1])
    return _bilinear(a, b, lambda a, b: torch.einsum(equation, a, b), mode.epsilon)


def _bilinear(a: Tensor, b: Tensor, fn: Callable[[Tensor, Tensor], Tensor], epsilon: float) -> Tensor:
    """``fn(a, b)``: uniform and ε where both are relevant, ε to the one that is where the other is a constant."""
    return _Bilinear.apply(a, b, fn, epsilon)


def _softmax(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    names = ("input", "dim", "_stacklevel", "dtype") if func is F.softmax else ("input", "dim", "dtype")
    o = _named(names, args, kwargs)
    if o.get("dim") is None:
        raise LayerError(f"{mode.method}: a softmax without its dim (give it one)")
    x, dtype = o["input"], o.get("dtype")
    if dtype is not None:
        x = identity(x, lambda t: t.to(dtype))
    return mode.softmax(x, o["dim"])


def _attention(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Tensor:
    """Fused attention run as its parts, each under its rule: softmax(q kᵀ s + mask) v."""
    options = _named(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args, kwargs)
    q, k, v = options["query"], options["key"], options["value"]
    if options.get("dropout_p"):
        raise LayerError(f"{mode.method} rules attention without dropout: call model.eval() first")
    if options.get("enable_gqa"):
        repeats = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeats, dim=-3), v.repeat_interleave(repeats, dim=-3)
    scale = options.get("scale") or q.shape[-1] ** -0.5
    scores = identity(_bilinear(q, k.transpose(-1, -2), torch.matmul, mode.epsilon), lambda t: t * scale)
    mask = options.get("attn_mask")
    if options.get("is_causal"):
        size = scores.shape[-2:]
        mask = torch.ones(size, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        bias = _additive(mask, scores)
        scores = identity(scores, lambda t: t + bias)  # a mask: what it lets through keeps its relevance
    return _bilinear(mode.held(mode.softmax(scores, -1)), v, torch.matmul, mode.epsilon)


def _layer_norm(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    o = _named(("input", "normalized_shape", "weight", "bias", "eps"), args, kwargs)
    weight, bias = (None if o.get(n) is None else o[n].detach() for n in ("weight", "bias"))
    shape, eps = tuple(o["normalized_shape"]), o.get("eps", 1e-5)

    def normalized(x: Tensor) -> tuple[Tensor, Tensor]:
        z, _, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        return z, rstd

    return _Normalized.apply(o["input"], normalized, weight, mode.epsilon)


def _group_norm(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    o = _named(("input", "num_groups", "weight", "bias", "eps"), args, kwargs)
    weight, bias = (None if o.get(n) is None else o[n].detach() for n in ("weight", "bias"))
    x, groups, eps = o["input"], o["num_groups"], o.get("eps", 1e-5)

    def normalized(t: Tensor) -> tuple[Tensor, Tensor]:
        z, _, rstd = torch.native_group_norm(
            t.contiguous(), weight, bias, len(t), t.shape[1], t[0, 0].numel(), groups, eps
        )
        return z, rstd

    channels = None if weight is None else weight.view(-1, *(1,) * (x.dim() - 2))  # per channel, over positions
    return _Normalized.apply(x, normalized, channels, mode.epsilon)


BATCH_NORM_ARGUMENTS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def _batch_norm(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A batch norm in eval mode: merged into the ruled layer whose output it reads (the layer's rule then takes the
    folded weights, and the norm passes relevance on unchanged), else under ε.

    Raises:
        LayerError: It is in training mode (its statistics are the batch's).
    """
    o = _named(BATCH_NORM_ARGUMENTS, args, kwargs)
    if o.get("training") or o.get("running_mean") is None:
        raise LayerError(f"{mode.method} rules a batch norm with its running statistics: call model.eval() first")
    call = mode.ruled_call(o["input"])
    if call is None:
        return _affine_first(mode, func, args, kwargs)
    constant = [None if o.get(n) is None else o[n].detach() for n in ("running_mean", "running_var", "weight", "bias")]
    call.layer = replace(call.layer, norm=MergedNorm(*constant, o.get("eps", 1e-5)))
    return _identity_first(mode, func, args, kwargs)


MHA_ARGUMENTS = (
    "query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias", "bias_k", "bias_v",
    "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training", "key_padding_mask", "need_weights",
    "attn_mask", "use_separate_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "static_k",
    "static_v", "average_attn_weights", "is_causal",
)  # fmt: skip


def _multi_head(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """PyTorch's multi-head attention (``nn.MultiheadAttention``, torchvision's ViT) run as its parts: the
    projections under ε, the attention under its rules.

    Raises:
        LayerError: An option the parts do not cover (added key or value biases, a padding mask, static keys).
    """
    o = _named(MHA_ARGUMENTS, args, kwargs)
    if any(o.get(n) is not None for n in ("bias_k", "bias_v", "key_padding_mask", "static_k", "static_v")) or o.get(
        "add_zero_attn"
    ):
        raise LayerError(f"{mode.method} rules multi-head attention without added biases, padding masks or static keys")
    length, batch, width = o["query"].shape
    heads = o["num_heads"]
    if o.get("use_separate_proj_weight"):
        weights = (o["q_proj_weight"], o["k_proj_weight"], o["v_proj_weight"])
    else:
        weights = o["in_proj_weight"].chunk(3)
    biases = o["in_proj_bias"].chunk(3) if o.get("in_proj_bias") is not None else (None,) * 3

    def heads_of(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        projected = linear(x, weight, bias, mode.epsilon)
        return projected.reshape(len(x), batch, heads, -1).permute(1, 2, 0, 3)  # (N, H, L, d)

    q, k, v = (heads_of(o[n], w, b) for n, w, b in zip(("query", "key", "value"), weights, biases))
    mask = o.get("attn_mask")
    if mask is not None and mask.dim() == 3:
        mask = mask.reshape(batch, heads, *mask.shape[1:])
    attended = _attention(mode, func, (q, k, v), {"attn_mask": mask, "is_causal": bool(o.get("is_causal"))})
    attended = attended.permute(2, 0, 1, 3).reshape(length, batch, width)
    out = linear(attended, o["out_proj_weight"], o["out_proj_bias"], mode.epsilon)
    if not o.get("need_weights", True):
        return out, None
    scores = (q.detach() @ k.detach().transpose(-1, -2)) * q.shape[-1] ** -0.5  # what it returns, no graph
    weights_of = torch.softmax(scores if mask is None else scores + _additive(mask, scores), dim=-1)
    return out, weights_of.mean(dim=1) if o.get("average_attn_weights", True) else weights_of


def _additive(mask: Tensor, like: Tensor) -> Tensor:
    """An attention mask as what is added to the scores: a boolean one's False as -inf."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(~mask, -torch.inf)


class _Become(torch.autograd.Function):
    """``target`` made ``value`` in place: its values (new storage, so that what was saved of it before keeps its
    own) and its history, through which relevance passes to ``value``."""

    @staticmethod
    def forward(ctx: Any, target: Tensor, value: Tensor) -> Tensor:
        target.data = value
        ctx.mark_dirty(target)
        return target

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[None, Tensor]:
        return None, relevance


def _in_place(handler: Handler) -> Handler:
    """An in-place operation run out of place under ``handler``, on a copy of its first argument, which then becomes
    the result (for a call whose result is not assigned). On a view, which must write through to the tensor it views,
    or on one of the model's parameters or buffers, which must stay the model's own, it runs in place as it is:
    values moved there pass relevance as the gradient, any other rule is refused."""

    def run(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        target = args[0]
        if target._base is None and id(target) not in mode.own:
            return _Become.apply(target, handler(mode, func, (target.clone(), *args[1:]), kwargs))
        if handler is _moved:  # values written through to the viewed tensor, or into the model's own
            return _moved(mode, func, args, kwargs)
        refusal = mode.refusal(f"{_name(func)} in place on a view or a model's tensor")
        return barred(func, args, kwargs, next(v for v in tree_flatten((args, kwargs))[0] if _grad(v)), refusal)

    return run


def _moved(mode: OperationRules, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """An operation that writes values into its first argument (``copy_``, ``__setitem__``): as the gradient."""
    func(*args, **kwargs)
    return args[0]


MERGING = (F.linear, F.conv1d, F.conv2d, F.conv3d)  # layers a batch norm reading their output merges into
WEIGHTED = (*MERGING, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)
POOLS = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)
MAX_POOLS = (F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool1d, F.adaptive_max_pool2d,
             F.adaptive_max_pool3d)  # fmt: skip
AFFINE = (torch.mean, T.mean, torch.sum, T.sum, F.interpolate)
ELEMENTWISE = (
    F.relu, torch.relu, T.relu, F.relu6, F.gelu, F.silu, F.hardswish, F.leaky_relu, F.elu, F.mish, F.softplus,
    F.hardtanh, F.hardsigmoid, torch.sigmoid, T.sigmoid, F.sigmoid, torch.tanh, T.tanh, F.tanh, F.rms_norm,
    F.normalize, F.dropout1d, F.dropout2d, F.dropout3d,
)  # fmt: skip
PASSED = {
    T.__getitem__, T.view, T.reshape, torch.reshape, T.permute, torch.permute, T.transpose, torch.transpose,
    T.flatten, torch.flatten, T.unflatten, T.squeeze, torch.squeeze, T.unsqueeze, torch.unsqueeze, T.contiguous,
    T.expand, T.expand_as, T.clone, T.detach, T.to, T.type, T.type_as, T.float, T.double, T.half, T.bfloat16, T.unbind,
    torch.unbind, T.split, torch.split, T.chunk, torch.chunk, torch.cat, torch.concat, torch.stack, T.movedim,
    torch.movedim, T.narrow, T.select, T.flip, T.roll, T.repeat, T.repeat_interleave, T.view_as, T.reshape_as,
    F.pad, F.unfold, F.max_pool1d_with_indices, F.max_pool2d_with_indices, F.max_pool3d_with_indices, T.T.__get__,
    T.mT.__get__,
    F.dropout, F.alpha_dropout, T.masked_scatter, T.masked_fill, T.t, torch.t, T.swapaxes,
    torch.swapaxes, T.swapdims, torch.swapdims, torch.broadcast_to, T.broadcast_to, torch.where, T.where,
    torch.max, T.max, torch.amax, T.amax, torch.min, T.min, torch.amin, T.amin,
}  # fmt: skip
STATISTICS = {
    torch.pow, T.pow, T.__pow__, torch.square, T.square, torch.norm, T.norm, torch.linalg.norm,
    torch.linalg.vector_norm, torch.var, T.var, torch.std, T.std, torch.var_mean, torch.std_mean,
}  # fmt: skip
KEPT = {T.detach, T.requires_grad_, T.register_hook}  # what a statistic's caller does to it as to any tensor
TABLE: dict[Callable[..., Any], Handler] = {
    **dict.fromkeys((*WEIGHTED, *POOLS, *MAX_POOLS), _layer),
    **dict.fromkeys(AFFINE, _affine_first),
    **dict.fromkeys(ELEMENTWISE, _identity_first),
    **dict.fromkeys((T.add, torch.add, T.__add__, T.__radd__), _add),
    **dict.fromkeys((T.add_, T.__iadd__), _in_place(_add)),
    **dict.fromkeys((T.sub, torch.sub, T.__sub__), _sub),
    **dict.fromkeys((T.sub_, T.__isub__), _in_place(_sub)),
    T.__rsub__: _rsub,
    **dict.fromkeys((T.mul, torch.mul, T.__mul__, T.__rmul__), _mul),
    **dict.fromkeys((T.mul_, T.__imul__), _in_place(_mul)),
    **dict.fromkeys((T.div, torch.div, T.__truediv__), _div),
    **dict.fromkeys((T.div_, T.__itruediv__), _in_place(_div)),
    **dict.fromkeys((T.neg, torch.neg, T.__neg__), _neg),
    **dict.fromkeys((T.matmul, torch.matmul, T.__matmul__, torch.bmm, T.bmm), _matmul),
    **dict.fromkeys((F.softmax, torch.softmax, T.softmax), _softmax),
    F.scaled_dot_product_attention: _attention,
    F.layer_norm: _layer_norm,
    F.group_norm: _group_norm,
    F.batch_norm: _batch_norm,
    F.multi_head_attention_forward: _multi_head,
    torch.einsum: _einsum,
    **dict.fromkeys((F.relu_, torch.relu_, T.relu_), _in_place(_identity_first)),
    **dict.fromkeys((T.copy_, T.__setitem__), _in_place(_moved)),
}

BY_NAME: dict[str, Handler] = {"torchvision.roi_align": _affine_first}  # optional libraries' operations, by name
GATES = ("signal", "uniform")


def check_gate(gate: str) -> None:
    """Refuse an unknown gate rule, naming the known ones.

    Raises:
        LayerError: ``gate`` is none of :data:`GATES`.
    """
    if gate not in GATES:
        raise LayerError(f"gate must be one of {', '.join(GATES)}, got {gate!r}")


class OperationRules(TorchFunctionMode):
    """For the block, the torch operations relevance passes through run under their rules (see the module's
    notes); an operation on a relevant tensor without a rule is refused.

    Args:
        method: The method's name, for the refusals.
        attention: ``"attnlrp"``: the softmax rule; ``"constant"``: the attention held constant (CP-LRP): a softmax's
            output, in a product with a relevant tensor (the values), is a constant there; used otherwise (a
            detector's class probabilities as the score), it keeps the softmax rule.
        model: The model whose forward runs under the rules: its parameters and buffers are changed in place, if its
            forward does, as they are, never replaced.
        epsilon: The ε of the ε rule (:mod:`explain.relevance.epsilon`).
        gate: The rule of a product of two relevant factors. ``"signal"``: a factor spread over the other's positions
            or channels (a squeeze-excitation's or a spatial attention's gate) is held constant and the signal it
            scales gets all the relevance (Pahde et al. 2023's signal-only gate); factors of one shape (a gated MLP)
            share it uniformly. ``"uniform"``: every product shares it uniformly (AttnLRP's rule everywhere; through
            a sigmoid gate's pre-activations near 0 the ε rule then meets small denominators, and relevance grows
            far past the score).
        layers: A composite resolved for the model (:class:`explain.relevance.composites.LayerRules`): the rule
            of each convolution, linear layer or pool it names (a batch norm reading a ruled layer's output merged
            into it); None: ε in every layer.
    """

    def __init__(
        self,
        method: str,
        attention: str = "attnlrp",
        model: nn.Module | None = None,
        *,
        epsilon: float = EPSILON,
        gate: str = "signal",
        layers: Callable[[str, Tensor | None], Rule | None] | None = None,
    ) -> None:
        super().__init__()
        check_gate(gate)
        self.method, self.attention, self.epsilon, self.gate, self.layers = method, attention, epsilon, gate, layers
        tensors = [*model.parameters(), *model.buffers()] if model is not None else []
        self.own = {id(t) for t in tensors}  # the model's parameters and buffers
        self.statistics: dict[int, tuple[weakref.ref, str]] = {}  # held statistics by id: (the tensor, its origin)
        self.ruled: dict[int, tuple[weakref.ref, RuledCall]] = {}  # ruled layers' outputs by id
        self.weights: dict[int, weakref.ref] = {}  # softmax outputs, and what layout made of them alone, by id

    def remember(self, output: Tensor, call: RuledCall) -> None:
        """A ruled layer's output, which a batch norm reading it merges into the layer."""
        self.ruled[id(output)] = (weakref.ref(output), call)

    def ruled_call(self, value: Tensor) -> RuledCall | None:
        """The ruled layer call whose output ``value`` is, or None."""
        entry = self.ruled.get(id(value))
        return entry[1] if entry is not None and entry[0]() is value else None

    def softmax(self, x: Tensor, dim: int) -> Tensor:
        """A softmax under AttnLRP's rule; with the attention held constant, its output remembered as attention
        weights, which a product with a relevant tensor (the values) then holds constant."""
        weights = _Softmax.apply(x, dim)
        if self.attention == "constant":
            self.weights[id(weights)] = weakref.ref(weights)
        return weights

    def attention_weights(self, value: Any) -> bool:
        """Whether ``value`` is attention weights the method holds constant in a product."""
        entry = self.weights.get(id(value)) if isinstance(value, Tensor) else None
        return entry is not None and entry() is value

    def moved(self, func: Callable[..., Any], args: tuple, kwargs: dict, relevant: list[Tensor]) -> Any:
        """A layout operation (as the gradient); what it makes of attention weights alone stays attention weights."""
        result = func(*args, **kwargs)
        if self.weights and all(map(self.attention_weights, relevant)):
            for t in tree_flatten(result)[0]:
                if isinstance(t, Tensor):
                    self.weights[id(t)] = weakref.ref(t)
        return result

    def origin(self, value: Any) -> str | None:
        """The operation a held statistic comes from, or None where ``value`` is none."""
        entry = self.statistics.get(id(value)) if isinstance(value, Tensor) else None
        return entry[1] if entry is not None and entry[0]() is value else None

    def held(self, value: Any) -> Any:
        """``value`` as a constant where it is a held statistic (a tensor it scales keeps its relevance) or attention
        weights held constant (CP-LRP: the values keep the relevance)."""
        return value.detach() if self.origin(value) is not None or self.attention_weights(value) else value

    def statistic(self, func: Callable[..., Any], args: tuple, kwargs: dict, relevant: list[Tensor]) -> Any:
        """``func`` of a relevant tensor's statistic (or of statistics alone), run as a held statistic."""
        origin = next((o for o in map(self.origin, relevant) if o is not None), None) or _name(func)
        refusal = (
            f"{self.method} holds {origin}'s result constant, as a layer norm's spread, where it scales a tensor; "
            "this model uses it otherwise (as a feature); use lrp or a gradient method for this model"
        )
        value = barred(func, args, kwargs, relevant[0], refusal)
        for t in tree_flatten(value)[0]:
            if isinstance(t, Tensor):
                self.statistics[id(t)] = (weakref.ref(t), origin)
        return value

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        relevant = [v for v in tree_flatten((args, kwargs))[0] if _grad(v)]
        if not relevant or func in KEPT:
            return func(*args, **kwargs)
        if func in STATISTICS or all(self.origin(v) for v in relevant):
            return self.statistic(func, args, kwargs, relevant)
        if func in PASSED:
            return self.moved(func, args, kwargs, relevant)
        handler = TABLE.get(func) or BY_NAME.get(_name(func))
        if handler is not None:
            return handler(self, func, args, kwargs)
        refusal = self.refusal(f"{_name(func)}, which the model runs on a tensor relevance passes through")
        return barred(func, args, kwargs, relevant[0], refusal)  # refused where relevance reaches it

    def refusal(self, what: str) -> str:
        """The line that refuses an operation without a rule, once relevance reaches it."""
        return f"{self.method} has no relevance rule for {what}; use lrp or a gradient method for this model"


@contextmanager
def in_forward(model: nn.Module, mode: OperationRules) -> Iterator[None]:
    """For the block, ``mode`` holds inside the model's forwards alone: not in what the caller computes from the
    outputs (a target's scoring), nor in the backward."""
    with Hooks() as hooks:
        hooks.forward_pre(model, lambda module, args: mode.__enter__() and None)
        hooks.forward(model, lambda module, args, output: mode.__exit__(None, None, None), always_call=True)
        yield


@functools.cache
def _name(func: Callable[..., Any]) -> str:
    return resolve_name(func) or getattr(func, "__name__", repr(func))
