"""Capture a transformer's attention probabilities, and the gradient of a score with respect to them.

Two kinds of attention module are read, each through the hook APIs, for one call only:

- ``torch.nn.MultiheadAttention`` (torchvision's ViT): a forward pre-hook asks the call for
  per-head weights (``need_weights=True, average_attn_weights=False``), which makes PyTorch
  form the probabilities A = softmax(q kᵀ / √d) explicitly and return them; their gradient is
  taken at the tensor the attention multiplies with v.
- timm's ``Attention`` (ViT, DeiT, register ViTs) and HuggingFace's plain attention (ViT, DeiT, DINOv2, CLIP's
  vision tower, as ``transformers`` 5 writes them, with ``q_proj``, ``k_proj`` and ``v_proj``): their fused
  kernels never form the probabilities, so they are computed from q and k as the module's projections (and
  timm's q/k norms) give them, with the module's own scale: A = softmax(scale · q kᵀ), as their unfused paths
  do. The gradient follows from the attention's output O = A v: ∂s/∂A = (∂s/∂O) vᵀ, with ∂s/∂O taken where
  the heads' merged outputs enter the module's next layer (timm's ``norm``, HuggingFace's output projection).

Other attention modules (EVA's rotary embedding, BEiT's relative position bias, ``transformers`` 4's split
self-attention) are not read: named, they are an error that names their type; by default the rollout takes the
readable ones and refuses a model with none. An attention called with a mask is refused too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import LayerError
from .hooks import Hooks

# timm's plain attention (ViT, DeiT, register ViTs), where timm 1.x and 0.9 define it. Not its relatives with the
# same parts (EVA's rotary embedding, BEiT's relative position bias): their probabilities are not softmax(q k^T).
TIMM_ATTENTION = {("timm.layers.attention", "Attention"), ("timm.models.vision_transformer", "Attention")}
# HuggingFace's plain attention, by model; read where it has transformers 5's q_proj, k_proj and v_proj.
HF_ATTENTION = {
    ("transformers.models.vit.modeling_vit", "ViTAttention"),
    ("transformers.models.deit.modeling_deit", "DeiTAttention"),
    ("transformers.models.dinov2.modeling_dinov2", "Dinov2Attention"),
    ("transformers.models.dinov2_with_registers.modeling_dinov2_with_registers", "Dinov2WithRegistersAttention"),
    ("transformers.models.clip.modeling_clip", "CLIPAttention"),
}


def attention_kind(module: nn.Module) -> str | None:
    """``"torch"`` for ``nn.MultiheadAttention``, ``"timm"`` for timm's plain ``Attention``, ``"hf"`` for
    HuggingFace's plain attention, else None."""
    if isinstance(module, nn.MultiheadAttention):
        return "torch"
    kind = (type(module).__module__, type(module).__name__)
    if kind in TIMM_ATTENTION:
        return "timm"
    return "hf" if kind in HF_ATTENTION and all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj")) else None


def _parts(module: nn.Module) -> tuple[dict[str, nn.Module], nn.Module, float, int]:
    """For a timm or HuggingFace attention: the modules whose outputs are its q, k and v (timm's fused ``qkv``
    stands for v), the module its heads' merged outputs enter, its scale, and its number of heads."""
    if attention_kind(module) == "timm":
        return {"q": module.q_norm, "k": module.k_norm, "qkv": module.qkv}, module.norm, module.scale, module.num_heads
    merged = module.o_proj if hasattr(module, "o_proj") else module.out_proj
    scale = module.scaling if hasattr(module, "scaling") else module.scale
    heads = module.num_attention_heads if hasattr(module, "num_attention_heads") else module.num_heads
    return {"q": module.q_proj, "k": module.k_proj, "v": module.v_proj}, merged, scale, heads


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's attention modules that can be read, by dotted name, in registration order."""
    return {name: m for name, m in model.named_modules() if name and attention_kind(m) is not None}


class AttentionRecorder:
    """Context manager that records, during one forward, the attention probabilities of the given modules.

    Args:
        modules: The attention modules by dotted name, in the order the model runs them.
        name: The name the stacked attention goes by in :attr:`activations`.
        gradients: Whether :meth:`backward` will be called: the forward then records autograd from the
            input on.

    Attributes:
        activations: ``{name: A}``, the probabilities of every module, (N, layers, heads, T, T).
    """

    def __init__(self, modules: Mapping[str, nn.Module], name: str, gradients: bool = True) -> None:
        self.modules = dict(modules)
        for module_name, module in self.modules.items():
            if attention_kind(module) is None:
                raise LayerError(
                    f"{module_name!r} is a {type(module).__name__}, not an attention module whose probabilities "
                    "can be read (nn.MultiheadAttention, timm's Attention, HuggingFace's ViT, DeiT, DINOv2 or CLIP "
                    "attention)"
                )
        self.name = name
        self.record_gradients = gradients
        self.activations: dict[str, Tensor] = {}
        self._probabilities: dict[str, Tensor] = {}
        self._gradient_of: dict[str, tuple[Tensor, Callable[[Tensor], Tensor]]] = {}
        self._parts: dict[str, dict[str, Tensor]] = {}
        self._hooks = Hooks()

    def __enter__(self) -> AttentionRecorder:
        try:
            for name, module in self.modules.items():
                if attention_kind(module) == "torch":
                    self._hooks.forward_pre(module, _per_head_weights, with_kwargs=True)
                    self._hooks.forward(module, partial(self._torch_weights, name))
                else:
                    self._hooks.forward_pre(module, partial(_unmasked, name), with_kwargs=True)
                    sources, merged, _, _ = _parts(module)
                    for part, source in sources.items():
                        keep = partial(self._keep, name, part)
                        self._hooks.forward(source, lambda m, i, o, keep=keep: keep(o))
                    self._hooks.forward_pre(merged, partial(self._from_parts, name))
        except BaseException:
            self._hooks.remove()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._hooks.remove()
        self._gradient_of.clear()
        self._parts.clear()

    def _keep(self, name: str, part: str, value: Tensor) -> None:
        self._parts.setdefault(name, {})[part] = value

    def _torch_weights(self, name: str, module: nn.Module, inputs: Any, output: Any) -> None:
        weights = output[1]
        if weights is None or weights.dim() != 4:
            raise LayerError(f"attention {name!r} returned no per-head weights")
        self._probabilities[name] = weights.detach()
        if self.record_gradients:
            if weights._base is None:
                raise LayerError(f"attention {name!r}: PyTorch returned weights outside the graph")
            self._gradient_of[name] = (weights._base, lambda grad, shape=weights.shape: grad.reshape(shape))

    def _from_parts(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Where the heads' merged outputs O (N, T, heads * head dim) enter the next layer: the probabilities
        from the kept q and k, and the way from the gradient at O to the gradient at A."""
        merged, parts = args[0], self._parts.pop(name)
        n, tokens, _ = merged.shape
        _, _, scale, heads = _parts(self.modules[name])

        def per_head(t: Tensor) -> Tensor:  # (N, T, heads * head dim) -> (N, heads, T, head dim)
            return t.detach().reshape(n, tokens, heads, -1).transpose(1, 2)

        if "qkv" in parts:  # timm: q and k already per head (after its norms), v a third of qkv
            q, k = parts["q"].detach(), parts["k"].detach()
            v = parts["qkv"].detach().reshape(n, tokens, 3, heads, -1)[:, :, 2].transpose(1, 2)
        else:
            q, k, v = (per_head(parts[p]) for p in ("q", "k", "v"))
        logits = (q * scale) @ k.transpose(-2, -1)
        self._probabilities[name] = logits.float().softmax(dim=-1).to(q.dtype)
        if self.record_gradients:

            def to_probabilities(grad: Tensor) -> Tensor:  # dS/dA = dS/dO v^T, head by head
                return grad.reshape(n, tokens, heads, -1).transpose(1, 2) @ v.transpose(-2, -1)

            self._gradient_of[name] = (merged, to_probabilities)

    def forward(self, model: Callable[[Tensor], Any], x: Tensor) -> Any:
        """Run the model on ``x``, recording every module's probabilities (and the graph, for gradients)."""
        self._probabilities.clear()
        output = model(x.detach().requires_grad_(True) if self.record_gradients else x)
        missing = [name for name in self.modules if name not in self._probabilities]
        if missing:
            raise LayerError(f"attention {missing[0]!r} did not run during the forward pass")
        first = next(iter(self.modules))
        expected = (len(x), *self._probabilities[first].shape[1:])
        for name in self.modules:
            found = self._probabilities[name].shape
            if tuple(found) != expected:
                raise LayerError(
                    f"attention {name!r} gives probabilities {tuple(found)}, {first!r} {expected}: the rollout "
                    "multiplies one (tokens x tokens) matrix per image and layer, which attention that pools its "
                    "tokens (MViT) or attends within windows (Swin) does not give; use a gradient method at a layer"
                )
        self.activations = {self.name: torch.stack([self._probabilities[n] for n in self.modules], dim=1)}
        return output

    def backward(
        self, score: Tensor, create_graph: bool = False, rescore: Callable[[Any], Tensor] | None = None
    ) -> dict[str, Tensor]:
        """The gradient of the scalar ``score`` with respect to every module's probabilities, stacked like
        them: ``{name: dS/dA}``, (N, layers, heads, T, T). ``rescore`` (how the pass's target scores another
        output) is for a recorder that reads other outputs out (LeGrad's): unused here.

        Raises:
            LayerError: ``create_graph``: the probabilities' gradient is not differentiated again.
        """
        if create_graph:
            raise LayerError("the attention probabilities' gradient cannot be differentiated again")
        tensors = [self._gradient_of[name][0] for name in self.modules]
        grads = torch.autograd.grad(score, tensors, retain_graph=True, allow_unused=True)  # one backward for all
        return self._stacked(grads)

    def backward_each(self, scores: list[Tensor]) -> dict[str, Tensor]:
        """Like :meth:`backward`, each module's gradient of its own score (one per module, in order), each
        backward only as deep as its module: a score a module's probabilities do not reach gives zeros."""
        grads = [
            torch.autograd.grad(score, self._gradient_of[name][0], retain_graph=True, allow_unused=True)[0]
            for score, name in zip(scores, self.modules)
        ]
        return self._stacked(grads)

    def _stacked(self, grads: list[Tensor | None]) -> dict[str, Tensor]:
        """Each module's gradient at its recorded tensor turned into the gradient at its probabilities, stacked."""
        per_layer = []
        for name, grad in zip(self.modules, grads):
            tensor, to_probabilities = self._gradient_of[name]
            per_layer.append(to_probabilities(torch.zeros_like(tensor) if grad is None else grad))
        return {self.name: torch.stack(per_layer, dim=1)}


def _unmasked(name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse an attention call with a mask: its probabilities would not be softmax(scale q k^T)."""
    masks = [kwargs.get(key) for key in ("attn_mask", "attention_mask", "causal_attention_mask", "head_mask")]
    if any(mask is not None for mask in [*masks, *args[1:]]) or kwargs.get("is_causal", False):
        raise LayerError(f"attention {name!r} is called with a mask, which the rollout does not read")


def _per_head_weights(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Make an ``nn.MultiheadAttention`` call return its per-head probabilities.

    A batch-first self-attention's input is handed over laid out sequence-first in memory (the same values): the
    module transposes it to (T, N, C), and with its weights frozen for the call, PyTorch's matmul projects a
    transposed input as one small product per token instead of one large one, twice as slow on the CPU.
    """
    if module.batch_first and len(args) >= 3 and args[0] is args[1] is args[2] and args[0].dim() == 3:
        tokens = args[0].transpose(0, 1).contiguous().transpose(0, 1)
        args = (tokens, tokens, tokens, *args[3:])
    return args, {**kwargs, "need_weights": True, "average_attn_weights": False}

