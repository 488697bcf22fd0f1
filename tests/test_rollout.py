"""Attention Rollout and gradient-weighted rollout against references that run the model with explicit
attention: timm's unfused path, and torchvision's attention written out here from its projection weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import hook_count, seeded
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import explain


def timm_vit() -> nn.Module:
    torch.manual_seed(0)
    return VisionTransformer(img_size=64, patch_size=16, embed_dim=48, depth=3, num_heads=3, num_classes=10).eval()


def torchvision_vit() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=64, patch_size=16, num_layers=3, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    )
    nn.init.normal_(model.heads.head.weight, std=0.5)  # torchvision starts from a zero head
    return model.eval()


def timm_attention(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output of a copy of the model that runs timm's unfused attention, and each block's probabilities
    (the input of its attention dropout), in the graph."""
    explicit = copy.deepcopy(model)
    kept = []
    for block in explicit.blocks:
        block.attn.fused_attn = False
        block.attn.attn_drop.register_forward_hook(lambda m, i, o: kept.append(i[0]))
    return explicit(x), kept


def torchvision_attention(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output of a copy of the model whose every attention is computed here from its projection weights:
    A = softmax(q k^T / sqrt(d)) per head, O = A v, then the output projection; and each A, in the graph."""
    explicit = copy.deepcopy(model)
    kept = []

    def written_out(attention: nn.MultiheadAttention, args, kwargs, output):
        tokens = args[0]
        n, t, c = tokens.shape
        heads = attention.num_heads
        q, k, v = F.linear(tokens, attention.in_proj_weight, attention.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (z.reshape(n, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
        a = (q @ k.transpose(-2, -1) / (c // heads) ** 0.5).softmax(dim=-1)
        kept.append(a)
        merged = (a @ v).transpose(1, 2).reshape(n, t, c)
        return attention.out_proj(merged), None

    for layer in explicit.encoder.layers:
        layer.self_attention.register_forward_hook(written_out, with_kwargs=True)
    return explicit(x), kept


def rollout_reference(attentions: list[torch.Tensor]) -> torch.Tensor:
    """Abnar & Zuidema: head mean plus identity, rows normalized, multiplied through the layers; class row."""
    rolled = None
    for a in attentions:
        mean = a.double().mean(dim=1)
        augmented = mean + torch.eye(mean.shape[-1], dtype=torch.float64)
        augmented = augmented / augmented.sum(dim=-1, keepdim=True)
        rolled = augmented if rolled is None else augmented @ rolled
    return rolled[:, 0, 1:]


def gradient_rollout_reference(attentions: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """Chefer et al.: R = I, R += mean_heads((grad * A)+) @ R through the layers; class row."""
    rolled = torch.eye(attentions[0].shape[-1], dtype=torch.float64).expand(len(attentions[0]), -1, -1)
    for a, g in zip(attentions, grads):
        rolled = rolled + (g.double() * a.double()).clamp(min=0).mean(dim=1) @ rolled
    return rolled[:, 0, 1:]


@pytest.mark.parametrize("build", [timm_vit, torchvision_vit], ids=["timm", "torchvision"])
def test_rollouts_match_explicit_attention(build) -> None:
    model = build()
    fused = [getattr(m, "fused_attn", None) for m in model.modules()]
    torch.manual_seed(1)
    x = torch.randn(2, 3, 64, 64)
    classes = [3, 7]
    explicit = timm_attention if hasattr(model, "blocks") else torchvision_attention
    output, attentions = explicit(model, x)
    grads = torch.autograd.grad(output[range(2), classes].sum(), attentions)

    plain = explain.AttentionRollout(model)(x, classes, resize=False, normalize=False)
    weighted = explain.GradientRollout(model)(x, classes, resize=False, normalize=False)

    expected = rollout_reference(attentions).reshape(2, 4, 4)
    assert plain.raw.shape == (2, 4, 4)
    assert (plain.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    expected = gradient_rollout_reference(attentions, grads).reshape(2, 4, 4)
    assert expected.abs().max() > 0 and weighted.class_indices.tolist() == classes
    assert (weighted.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert explain.GradientRollout(model)(x, classes).cams.shape == (2, 64, 64)  # upsampled, as every method's
    assert hook_count(model) == 0 and not any(p.grad is not None for p in model.parameters())
    assert [getattr(m, "fused_attn", None) for m in model.modules()] == fused


def test_rollouts_refuse_what_they_cannot_read() -> None:
    x = torch.randn(1, 3, 64, 64)
    with pytest.raises(explain.LayerError, match="this model has none"):
        explain.GradientRollout(seeded("resnet18", num_classes=10))(x)
    torch.manual_seed(0)
    pooled = VisionTransformer(
        img_size=64, patch_size=16, embed_dim=48, depth=2, num_heads=3, class_token=False, global_pool="avg"
    ).eval()
    with pytest.raises(explain.LayerError, match="reads the class token's row"):
        explain.AttentionRollout(pooled)(x)
    with pytest.raises(explain.LayerError, match=r"'blocks\.0\.norm1' is not an attention module"):
        explain.AttentionRollout(timm_vit(), ["blocks.0.norm1"])(x)
    last_two = explain.AttentionRollout(timm_vit(), ["blocks.1.attn", "blocks.2.attn"])(x)
    assert last_two.layer == "blocks.1.attn..blocks.2.attn (2 attention layers)"
