"""Attention Rollout and gradient-weighted rollout against references that run the model with explicit
attention: timm's unfused path, torchvision's attention written out here from its projection weights, and
HuggingFace's eager attention, which returns its probabilities."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import TINY_HF, hook_count, seeded
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


def rollout_reference(attentions: list[torch.Tensor], prefix: int = 1) -> torch.Tensor:
    """Abnar & Zuidema: head mean plus identity, rows normalized, multiplied through the layers; class row."""
    rolled = None
    for a in attentions:
        mean = a.double().mean(dim=1)
        augmented = mean + torch.eye(mean.shape[-1], dtype=torch.float64)
        augmented = augmented / augmented.sum(dim=-1, keepdim=True)
        rolled = augmented if rolled is None else augmented @ rolled
    return rolled[:, 0, prefix:]


def gradient_rollout_reference(
    attentions: list[torch.Tensor], grads: list[torch.Tensor], prefix: int = 1
) -> torch.Tensor:
    """Chefer et al.: R = I, R += mean_heads((grad * A)+) @ R through the layers; class row."""
    rolled = torch.eye(attentions[0].shape[-1], dtype=torch.float64).expand(len(attentions[0]), -1, -1)
    for a, g in zip(attentions, grads):
        rolled = rolled + (g.double() * a.double()).clamp(min=0).mean(dim=1) @ rolled
    return rolled[:, 0, prefix:]


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

    plain = explain.methods.AttentionRollout(model)(x, classes, resize=False, normalize=False)
    weighted = explain.methods.GradientRollout(model)(x, classes, resize=False, normalize=False)

    expected = rollout_reference(attentions).reshape(2, 4, 4)
    assert plain.raw.shape == (2, 4, 4)
    assert (plain.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    expected = gradient_rollout_reference(attentions, grads).reshape(2, 4, 4)
    assert expected.abs().max() > 0 and weighted.class_indices.tolist() == classes
    assert (weighted.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert explain.methods.GradientRollout(model)(x, classes).cams.shape == (2, 64, 64)  # upsampled, as every method's
    assert hook_count(model) == 0 and not any(p.grad is not None for p in model.parameters())
    assert [getattr(m, "fused_attn", None) for m in model.modules()] == fused


def huggingface_model(kind: str) -> tuple[nn.Module, object, object, int]:
    """A HuggingFace vision transformer with random weights: the model, a target, the score it stands for (from
    the model's output), and the number of prefix tokens."""
    import transformers as hf

    torch.manual_seed(0)
    if kind == "vit":  # q_proj ... o_proj, `scaling`, `num_attention_heads`
        model = hf.ViTForImageClassification(hf.ViTConfig(**TINY_HF, num_labels=10))
        return model.eval(), [3, 7], lambda out: out.logits[range(2), [3, 7]].sum(), 1
    if kind == "deit_distilled":  # a class token and a distillation token
        model = hf.DeiTForImageClassificationWithTeacher(hf.DeiTConfig(**TINY_HF, num_labels=10))
        return model.eval(), [3, 7], lambda out: out.logits[range(2), [3, 7]].sum(), 2
    if kind == "dinov2_registers":  # a class token and four registers
        config = hf.Dinov2WithRegistersConfig(**TINY_HF, num_register_tokens=4, num_labels=10)
        model = hf.Dinov2WithRegistersForImageClassification(config)
        return model.eval(), [3, 7], lambda out: out.logits[range(2), [3, 7]].sum(), 5
    # CLIP's vision tower: out_proj, `scale`, `num_heads`; the similarity of its embedding to a text's
    from explain.targets import SimilarityTarget

    model = hf.CLIPVisionModelWithProjection(hf.CLIPVisionConfig(**TINY_HF, projection_dim=16))
    text = torch.randn(16)
    score = lambda out: torch.cosine_similarity(out.image_embeds, text[None], dim=1).sum()  # noqa: E731
    return model.eval(), SimilarityTarget(text, output="image_embeds"), score, 1


@pytest.mark.parametrize("kind", ["vit", "deit_distilled", "dinov2_registers", "clip"])
def test_rollouts_of_huggingface_attention_match_its_eager_probabilities(kind) -> None:
    """The rollouts read HuggingFace's attention from its projections under its default (SDPA) kernel; the
    reference is its eager attention, which returns the probabilities in the graph."""
    model, target, score, prefix = huggingface_model(kind)
    x = torch.randn(2, 3, 32, 32)
    explicit = copy.deepcopy(model)
    explicit.config._attn_implementation = "eager"
    output = explicit(x, output_attentions=True)
    attentions = output.attentions
    grads = torch.autograd.grad(score(output), attentions)
    assert model.config._attn_implementation != "eager"

    plain = explain.methods.AttentionRollout(model)(x, target, resize=False, normalize=False)
    weighted = explain.methods.GradientRollout(model)(x, target, resize=False, normalize=False)

    expected = rollout_reference(attentions, prefix).reshape(2, 4, 4)
    assert (plain.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    expected = gradient_rollout_reference(attentions, grads, prefix).reshape(2, 4, 4)
    assert expected.abs().max() > 0
    assert (weighted.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert hook_count(model) == 0 and not any(p.grad is not None for p in model.parameters())


def test_rollouts_refuse_what_they_cannot_read() -> None:
    x = torch.randn(1, 3, 64, 64)
    with pytest.raises(explain.LayerError, match="this model has none"):
        explain.methods.GradientRollout(seeded("resnet18", num_classes=10))(x)
    torch.manual_seed(0)
    pooled = VisionTransformer(
        img_size=64, patch_size=16, embed_dim=48, depth=2, num_heads=3, class_token=False, global_pool="avg"
    ).eval()
    with pytest.raises(explain.LayerError, match="reads the class token's row"):
        explain.methods.AttentionRollout(pooled)(x)
    with pytest.raises(explain.LayerError, match=r"'blocks\.0\.norm1' is not an attention module"):
        explain.methods.AttentionRollout(timm_vit(), ["blocks.0.norm1"])(x)
    last_two = explain.methods.AttentionRollout(timm_vit(), ["blocks.1.attn", "blocks.2.attn"])(x)
    assert last_two.layer == "blocks.1.attn..blocks.2.attn (2 attention layers)"
