"""Chefer et al. 2021a (explain.methods.chefer) on timm's ViT against the authors' algorithm written here: their
relevance modules (RelProp's gradprop, the αβ linear rule, the normalized residual sum, the halved products) run
image by image (their batch of one) over the blocks recomputed explicitly, each attention's gradient from timm's
unfused path, and their rollout of I + E_h[(∇A ⊙ R_A)⁺]."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import hook_count
from test_rollout import timm_attention, timm_vit

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
    got = explain.CheferRelevance(model)(x, TARGETS, resize=False, normalize=False)
    assert expected.abs().max() > 0
    assert (got.raw.double() - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert not torch.allclose(got.raw, explain.GradientRollout(model)(x, TARGETS, resize=False, normalize=False).raw)
    assert hook_count(model) == 0


def test_chefer_refuses_the_transformers_its_rules_are_not_written_for() -> None:
    from test_rollout import torchvision_vit

    with pytest.raises(explain.LayerError, match="gradient_rollout weighs the attention by its gradient alone"):
        explain.CheferRelevance(torchvision_vit())(torch.randn(1, 3, 64, 64))
