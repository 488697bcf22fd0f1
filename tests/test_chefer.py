"""Chefer et al. 2021a (explain.methods.chefer) on timm's ViT against the authors' algorithm written here: their
relevance modules (RelProp's gradprop, the αβ linear rule, the normalized residual sum, the halved products) run
image by image (their batch of one) over the blocks recomputed explicitly, each attention's gradient from timm's
unfused path, and their rollout of I + E_h[(∇A ⊙ R_A)⁺]. torchvision's and HuggingFace's ViTs against their timm
twins (the same weights in timm's blocks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import hook_count
from test_rollout import timm_attention, timm_vit
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import explain

TARGETS = [3, 7]


def safe_divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    den = b.clamp(min=1e-9) + b.clamp(max=1e-9)
    den = den + den.eq(0).type(den.type()) * 1e-9
    return a / den * b.ne(0).type(b.type())


def relprop_simple(f, inputs: list[torch.Tensor], relevance: torch.Tensor) -> list[torch.Tensor]:
    """Their RelPropSimple: Z = f(X), S = R / Z, R_i = X_i * dZ/dX_i(S)."""
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    z = f(*leaves)
    grads = torch.autograd.grad(z, leaves, safe_divide(relevance, z))
    return [leaf.detach() * g for leaf, g in zip(leaves, grads)]


def relprop_linear(x: torch.Tensor, weight: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """Their Linear.relprop at alpha = 1: the activators only."""
    pw, nw = weight.clamp(min=0), weight.clamp(max=0)
    px, nx = x.clamp(min=0).detach().requires_grad_(True), x.clamp(max=0).detach().requires_grad_(True)
    z1, z2 = F.linear(px, pw), F.linear(nx, nw)
    s = safe_divide(relevance, z1 + z2)
    return px.detach() * torch.autograd.grad(z1, px, s)[0] + nx.detach() * torch.autograd.grad(z2, nx, s)[0]


def relprop_add(u: torch.Tensor, v: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Their Add.relprop: RelPropSimple's split, each operand's total rescaled to its share."""
    a, b = relprop_simple(torch.add, [u, v], relevance)
    a_sum, b_sum = a.sum(), b.sum()
    a_fact = safe_divide(a_sum.abs(), a_sum.abs() + b_sum.abs()) * relevance.sum()
    b_fact = safe_divide(b_sum.abs(), a_sum.abs() + b_sum.abs()) * relevance.sum()
    return a * safe_divide(a_fact, a.sum()), b * safe_divide(b_fact, b.sum())


def relprop_block(block, x: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Their Block.relprop, the block recomputed from its input x (1, T, C)."""
    attn = block.attn
    with torch.no_grad():
        t1 = block.norm1(x)
        n, t, c = t1.shape
        h = attn.num_heads
        qkv = attn.qkv(t1).reshape(n, t, 3, h, c // h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        a = ((q @ k.transpose(-2, -1)) * attn.scale).softmax(dim=-1)
        merged = (a @ v).transpose(1, 2).reshape(n, t, c)
        attended = attn.proj(merged)
        middle = x + attended
        t2 = block.norm2(middle)
        hidden = block.mlp.act(block.mlp.fc1(t2))
        out_mlp = block.mlp.fc2(hidden)
    r_middle, r_mlp = relprop_add(middle, out_mlp, relevance)
    r_t2 = relprop_linear(t2, block.mlp.fc1.weight, relprop_linear(hidden, block.mlp.fc2.weight, r_mlp))
    r_middle = r_middle + r_t2  # norm2 passes, the clone sums
    r_x, r_attended = relprop_add(x, attended, r_middle)
    r_merged = relprop_linear(merged, attn.proj.weight, r_attended).reshape(n, t, h, c // h).transpose(1, 2)
    r_a, r_v = relprop_simple(torch.matmul, [a, v], r_merged)
    r_a, r_v = r_a / 2, r_v / 2
    r_q, r_k = relprop_simple(lambda q, k: q @ k.transpose(-2, -1), [q, k], r_a)  # the softmax passes
    r_qkv = torch.stack([r_q / 2, r_k / 2, r_v]).permute(1, 3, 0, 2, 4).reshape(n, t, 3 * c)
    return r_x + relprop_linear(t1, attn.qkv.weight, r_qkv), r_a


def chefer_reference(model, x: torch.Tensor) -> torch.Tensor:
    """The authors' transformer attribution, image by image: (N, patches)."""
    maps = []
    for i in range(len(x)):
        image = x[i : i + 1]
        output, attentions = timm_attention(model, image)
        grads = torch.autograd.grad(output[0, TARGETS[i]], attentions)
        inputs = []
        hooks = [b.register_forward_hook(lambda m, a, o, kept=inputs: kept.append(a[0].detach())) for b in model.blocks]
        with torch.no_grad():
            features = model.forward_features(image)  # the last block's tokens through the final norm
        for hook in hooks:
            hook.remove()
        relevance = torch.zeros_like(features)  # the norms pass relevance; the class token's is the head's input's
        one_hot = F.one_hot(torch.tensor([TARGETS[i]]), 10).float()
        relevance[:, 0] = relprop_linear(model.fc_norm(features[:, 0]), model.head.weight, one_hot)
        cams = [None] * len(model.blocks)
        for index in reversed(range(len(model.blocks))):
            relevance, cams[index] = relprop_block(model.blocks[index], inputs[index], relevance)
        rolled = torch.eye(attentions[0].shape[-1])[None]
        for grad, cam in zip(grads, cams):
            layer = (grad * cam).clamp(min=0).mean(dim=1)  # over heads
            rolled = (layer + torch.eye(layer.shape[-1])) @ rolled
        maps.append(rolled[0, 0, 1:])
    return torch.stack(maps).double()


def test_chefer_is_the_authors_algorithm_on_timm_s_vit() -> None:
    model = timm_vit()
    x = torch.randn(2, 3, 64, 64)
    expected = chefer_reference(model, x).reshape(2, 4, 4)
    got = explain.methods.CheferRelevance(model)(x, TARGETS, resize=False, normalize=False)
    assert expected.abs().max() > 0
    assert (got.raw.double() - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert not torch.allclose(
        got.raw, explain.methods.GradientRollout(model)(x, TARGETS, resize=False, normalize=False).raw
    )
    assert hook_count(model) == 0


def timm_twin(depth: int, heads: int, width: int, mlp: int, **kwargs) -> nn.Module:
    """A timm ViT of the test models' shape (64 px, 16 px patches, 10 classes), to copy another family into."""
    return VisionTransformer(
        img_size=64, patch_size=16, embed_dim=width, depth=depth, num_heads=heads, mlp_ratio=mlp / width,
        num_classes=10, **kwargs,
    ).eval()  # fmt: skip


def copy_block(block, norm1, qkv_weight, qkv_bias, proj, norm2, fc1, fc2) -> None:
    """One timm block's weights set from another family's parts."""
    with torch.no_grad():
        for mine, theirs in ((block.norm1, norm1), (block.attn.proj, proj), (block.norm2, norm2)):
            mine.load_state_dict(theirs.state_dict())
        block.mlp.fc1.load_state_dict(fc1.state_dict())
        block.mlp.fc2.load_state_dict(fc2.state_dict())
        block.attn.qkv.weight.copy_(qkv_weight)
        block.attn.qkv.bias.copy_(qkv_bias)


def timm_copy_of_torchvision(model) -> nn.Module:
    layers = model.encoder.layers
    twin = timm_twin(len(layers), layers[0].self_attention.num_heads, model.hidden_dim, layers[0].mlp[0].out_features)
    with torch.no_grad():
        twin.patch_embed.proj.load_state_dict(model.conv_proj.state_dict())
        twin.cls_token.copy_(model.class_token)
        twin.pos_embed.copy_(model.encoder.pos_embedding)
        for block, layer in zip(twin.blocks, layers):
            attn = layer.self_attention
            copy_block(block, layer.ln_1, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj, layer.ln_2,
                       layer.mlp[0], layer.mlp[3])  # fmt: skip
        twin.norm.load_state_dict(model.encoder.ln.state_dict())
        twin.head.load_state_dict(model.heads.head.state_dict())
    return twin


def timm_copy_of_huggingface(model) -> nn.Module:
    config, base = model.config, model.vit
    twin = timm_twin(config.num_hidden_layers, config.num_attention_heads, config.hidden_size,
                     config.intermediate_size)  # fmt: skip
    with torch.no_grad():
        twin.patch_embed.proj.load_state_dict(base.embeddings.patch_embeddings.projection.state_dict())
        twin.cls_token.copy_(base.embeddings.cls_token)
        twin.pos_embed.copy_(base.embeddings.position_embeddings)
        for block, layer in zip(twin.blocks, base.layers):
            attn = layer.attention
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            copy_block(block, layer.layernorm_before, torch.cat([p.weight for p in projections]),
                       torch.cat([p.bias for p in projections]), attn.o_proj, layer.layernorm_after, layer.mlp.fc1,
                       layer.mlp.fc2)  # fmt: skip
        twin.norm.load_state_dict(base.layernorm.state_dict())
        twin.head.load_state_dict(model.classifier.state_dict())
    return twin


def huggingface_vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(image_size=64, patch_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=2, num_labels=10, layer_norm_eps=1e-6)  # fmt: skip
    return ViTForImageClassification(config).eval()


@pytest.mark.parametrize("family", ["torchvision", "huggingface"])
def test_chefer_on_torchvision_s_and_huggingface_s_vit_is_the_timm_twin_s(family) -> None:
    """Each family's ViT, its weights copied into a timm ViT: the two compute the same logits, and Chefer's map of
    the family's model is the authors' algorithm (written above) run on its timm twin."""
    from test_rollout import torchvision_vit

    model = torchvision_vit() if family == "torchvision" else huggingface_vit()
    twin = timm_copy_of_torchvision(model) if family == "torchvision" else timm_copy_of_huggingface(model)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        logits = model(x)
        logits = logits if isinstance(logits, torch.Tensor) else logits.logits
        assert torch.allclose(logits, twin(x), atol=1e-5)
    expected = chefer_reference(twin, x).reshape(2, 4, 4)
    got = explain.methods.CheferRelevance(model)(x, TARGETS, resize=False, normalize=False).raw.double()
    assert expected.abs().max() > 0
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert hook_count(model) == 0


def test_chefer_refuses_a_block_its_rules_do_not_describe() -> None:
    """A post-norm block (x + norm(attention(x))) has the parts the rules read but computes something else: the
    recomputed block differs from what the model computed, and the call refuses instead of drawing a map."""
    from test_rollout import torchvision_vit
    from torchvision.models.vision_transformer import EncoderBlock

    class PostNorm(EncoderBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            middle = x + self.ln_1(self.self_attention(x, x, x, need_weights=False)[0])
            return middle + self.ln_2(self.mlp(middle))

    model = torchvision_vit()
    model.encoder.layers[1].__class__ = PostNorm
    with pytest.raises(explain.LayerError, match="PostNorm does not compute what its rules read"):
        explain.methods.CheferRelevance(model)(torch.randn(1, 3, 64, 64))
    assert hook_count(model) == 0


def test_chefer_refuses_the_transformers_its_rules_are_not_written_for() -> None:
    from transformers import Dinov2Config, Dinov2ForImageClassification

    with pytest.raises(explain.LayerError, match="gradient_rollout weighs the attention by its gradient alone"):
        explain.methods.CheferRelevance(timm_twin(2, 2, 32, 64, global_pool="avg"))(torch.randn(1, 3, 64, 64))
    config = Dinov2Config(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_labels=10)  # fmt: skip
    dinov2 = Dinov2ForImageClassification(config).eval()  # layer-scaled blocks, the head reads the patches too
    with pytest.raises(explain.LayerError, match="gradient_rollout weighs the attention by its gradient alone"):
        explain.methods.CheferRelevance(dinov2)(torch.randn(1, 3, 32, 32))
    assert hook_count(dinov2) == 0


def test_chefer_refuses_a_head_that_reads_more_than_the_class_token() -> None:
    """A ViT with HuggingFace's parts whose head reads the class token beside the patches' mean (as DINOv2's): the
    head cannot be recomputed from the class token alone, and the call refuses with the way out."""

    class MeanToo(type(huggingface_vit())):
        def forward(self, pixel_values):
            tokens = self.vit(pixel_values).last_hidden_state
            return self.classifier(torch.cat([tokens[:, 0], tokens[:, 1:].mean(dim=1)], dim=1))

    model = huggingface_vit()
    model.__class__ = MeanToo
    model.classifier = nn.Linear(64, 10)
    with pytest.raises(explain.LayerError, match=r"architecture .* gradient_rollout weighs the attention"):
        explain.methods.CheferRelevance(model)(torch.randn(1, 3, 64, 64))
    assert hook_count(model) == 0
