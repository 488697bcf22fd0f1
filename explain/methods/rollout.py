"""Methods of vision transformers' attention: the class token's row of the attention rolled out through
the layers, on the patch grid. The probabilities are recorded as :class:`explain.core.recording.AttentionProbabilities`
says."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.engine import CAM, Capture, Needs
from ..core.layers import LayerSpec
from ..core.recording import ATTENTION
from ..errors import LayerError


@dataclass(frozen=True)
class ClassHead:
    """How a vision transformer reads its class out of tokens: ``linear(pre_head(norm(pooled)))``.

    Attributes:
        norm: The final norm, applied to each token (or to a pooled vector).
        pre_head: What lies between the norm and the linear head (timm's ``fc_norm`` and dropout, torchvision's
            pre-logits); empty where nothing does.
        linear: The linear head.
    """

    norm: nn.Module
    pre_head: nn.Sequential
    linear: nn.Linear

    def __call__(self, pooled: Tensor) -> Tensor:
        """The class scores of pooled tokens (N, C)."""
        return self.linear(self.pre_head(self.norm(pooled)))


def class_head(model: nn.Module) -> ClassHead | None:
    """The final norm and head of torchvision's ViT, timm's VisionTransformer or HuggingFace's
    ``*ForImageClassification`` (a ``layernorm`` and a linear ``classifier``); None for another model."""
    kind = (type(model).__module__.split(".")[0], type(model).__name__)
    if kind == ("torchvision", "VisionTransformer") and isinstance(model.heads[-1], nn.Linear):
        return ClassHead(model.encoder.ln, model.heads[:-1], model.heads[-1])
    if kind == ("timm", "VisionTransformer") and isinstance(model.head, nn.Linear):
        return ClassHead(model.norm, nn.Sequential(model.fc_norm, model.head_drop), model.head)
    base = getattr(model, "base_model", None)
    norm, classifier = getattr(base, "layernorm", None), getattr(model, "classifier", None)
    if isinstance(norm, nn.Module) and isinstance(classifier, nn.Linear):
        return ClassHead(norm, nn.Sequential(), classifier)
    return None


class Rollout(CAM):
    """Base of the rollout methods: records every attention layer's probabilities (N, layers, heads, T, T) and
    maps the class token's row of the rolled-out attention, over the patch tokens, onto the patch grid.

    Args:
        model: A vision transformer with a class token whose attention modules can be read
            (:func:`explain.core.attention_capture.attention_kind`: torchvision's, timm's, HuggingFace's); left as
            it was.
        layer: The attention modules to roll out, by name or module, in the order the model
            runs them; None: all of them.
        labels: Class names, to accept a class name as target.
    """

    needs = Needs(records=ATTENTION)  # the attention probabilities and their gradients; no layer given: all of them
    relu = False  # the rolled-out attention is not negative

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec | Sequence[str | nn.Module] = None,
        *,
        labels: Sequence[str] | None = None,
    ) -> None:
        super().__init__(model, layer, labels=labels)
        self.fused = False  # the layers are rolled out together, not fused map by map

    def rolled_out(self, capture: Capture) -> Tensor:
        """The attention rolled out through the layers, (N, T, T)."""
        raise NotImplementedError

    def patch_grid(self, capture: Capture) -> tuple[tuple[int, ...], int]:
        """The patch grid and the number of tokens before the patch tokens (class, distillation, registers).

        Raises:
            LayerError: The model has no patch embedding, or no token before its patches.
        """
        tokens, grid = capture.activations.shape[-1], capture.geometry.grid
        prefix = tokens - math.prod(grid) if grid else -1
        if grid is None or prefix < 1:
            found = "no patch embedding" if grid is None else f"{tokens} tokens on a {'x'.join(map(str, grid))} grid"
            raise LayerError(f"{type(self).__name__} reads the class token's row; the model has {found}")
        return grid, prefix

    def compute(self, capture: Capture) -> Tensor:
        """The class token's row of the rolled-out attention over the patch tokens, on the patch grid: (N, h, w)
        for an image, (N, t, h, w) for a clip's tubelets, (N, l) for a signal's patches."""
        grid, prefix = self.patch_grid(capture)
        return self.rolled_out(capture)[:, 0, prefix:].reshape(-1, *grid)


def _identity_like(attention: Tensor) -> Tensor:
    """The identity (N, T, T) for per-layer matrices (N, layers, T, T)."""
    n, _, tokens, _ = attention.shape
    return torch.eye(tokens, dtype=attention.dtype, device=attention.device).expand(n, tokens, tokens)


class AttentionRollout(Rollout):
    r"""Attention Rollout: Abnar & Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020
    (arXiv:2005.00928).

    Each layer's attention averaged over heads, plus the identity (the residual
    connection), rows normalized: :math:`\hat A_l = \mathrm{rows}(\bar A_l + I)`; rolled
    out by :math:`R = \hat A_L \cdots \hat A_1`. The map is the class token's row of R over
    the patch tokens. It does not depend on the target (the class is still bound and
    reported); no gradient is computed.
    """

    name = "attention_rollout"
    title = "Attention Rollout (Abnar & Zuidema 2020)"
    fast = False
    needs = Needs(gradients=False, records=ATTENTION)

    def rolled_out(self, capture: Capture) -> Tensor:
        layers = capture.activations.double().mean(dim=2)  # (N, layers, T, T)
        augmented = layers + _identity_like(layers)[:, None]
        augmented = augmented / augmented.sum(dim=-1, keepdim=True)
        rolled = augmented[:, 0]
        for layer in augmented.unbind(dim=1)[1:]:
            rolled = layer @ rolled
        return rolled.float()


class GradientRollout(Rollout):
    r"""Gradient-weighted attention rollout: Chefer, Gur & Wolf, "Generic Attention-model
    Explainability for Interpreting Bi-Modal and Encoder-Decoder Transformers", ICCV 2021
    (arXiv:2103.15679).

    Each layer's attention weighted by the target score's gradient, positive part,
    averaged over heads: :math:`\bar A_l = E_h[(\nabla A_l \odot A_l)^+]`; rolled out from
    :math:`R = I` by :math:`R \leftarrow R + \bar A_l R`. The map is the class token's row of
    R over the patch tokens: class-specific, through any target.
    """

    name = "gradient_rollout"
    title = "Gradient-weighted rollout (Chefer et al. 2021)"
    fast = False

    def weighted(self, capture: Capture) -> Tensor:
        """Each layer's weighted attention, averaged over heads: (N, layers, T, T)."""
        return (capture.gradients.double() * capture.activations.double()).clamp(min=0).mean(dim=2)

    def rolled_out(self, capture: Capture) -> Tensor:
        weighted = self.weighted(capture)
        rolled = _identity_like(weighted)
        for layer in weighted.unbind(dim=1):
            rolled = rolled + layer @ rolled
        return rolled.float()
