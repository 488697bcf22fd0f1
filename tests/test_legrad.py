"""LeGrad (explain.methods.legrad) against torchcam's on torchvision's ViT, and beyond it, on timm's and
HuggingFace's ViTs, against its equations written here on their explicit attention: each block's read-out of the
class (the tokens' mean through the final norm and head), differentiated at that block's probabilities."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import hook_count
from test_rollout import huggingface_model, timm_vit, torchvision_vit

import explain

TARGETS = [3, 7]


def legrad_reference(attentions, read_outs) -> torch.Tensor:
    """mean over blocks of mean over heads and queries of the positive gradient of the block's own class score at
    its attention, the class token dropped: (N, patches)."""
    maps = []
    for a, logits in zip(attentions, read_outs):
        (grad,) = torch.autograd.grad(logits[range(2), TARGETS].sum(), a, retain_graph=True)
        maps.append(grad.clamp(min=0).mean(dim=(1, 2))[:, 1:])
    return torch.stack(maps).mean(dim=0).double()


def test_legrad_is_torchcam_s_on_torchvision_s_vit() -> None:
    from torchcam.methods import LeGrad as TorchcamLeGrad

    model = torchvision_vit()
    x = torch.randn(2, 3, 64, 64)
    got = explain.methods.LeGrad(model)(x, TARGETS, resize=False, normalize=False)
    with TorchcamLeGrad(model, list(model.encoder.layers)) as extractor:
        expected = extractor(TARGETS, model(x), normalized=False)[0]
    assert expected.abs().max() > 0
    torch.testing.assert_close(got.raw, expected, rtol=1e-4, atol=1e-7)
    assert hook_count(model) == 0


def test_legrad_of_timm_s_vit_is_its_equations_on_explicit_attention() -> None:
    model = timm_vit()
    x = torch.randn(2, 3, 64, 64)
    explicit = copy.deepcopy(model)
    attentions, read_outs = [], []
    for block in explicit.blocks:
        block.attn.fused_attn = False
        block.attn.attn_drop.register_forward_hook(lambda m, i, o: attentions.append(i[0]))
        block.register_forward_hook(
            lambda m, i, o: read_outs.append(explicit.head(explicit.fc_norm(explicit.norm(o.mean(dim=1)))))
        )
    explicit(x)
    expected = legrad_reference(attentions, read_outs).reshape(2, 4, 4)
    got = explain.methods.LeGrad(model)(x, TARGETS, resize=False, normalize=False)
    assert expected.abs().max() > 0
    assert (got.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    last = explain.methods.LeGrad(model, ["blocks.2.attn"])(x, TARGETS, resize=False, normalize=False)
    only_last = legrad_reference(attentions[2:], read_outs[2:]).reshape(2, 4, 4)
    assert (last.raw.double() - only_last).abs().max() <= 1e-5 * only_last.abs().max()


def test_legrad_of_huggingface_s_vit_is_its_equations_on_eager_attention() -> None:
    model, target, _, _ = huggingface_model("vit")
    x = torch.randn(2, 3, 32, 32)
    explicit = copy.deepcopy(model)
    explicit.config._attn_implementation = "eager"
    output = explicit(x, output_attentions=True, output_hidden_states=True)
    read_outs = [explicit.classifier(explicit.vit.layernorm(h.mean(dim=1))) for h in output.hidden_states[1:]]
    expected = legrad_reference(output.attentions, read_outs).reshape(2, 4, 4)
    got = explain.methods.LeGrad(model)(x, target, resize=False, normalize=False)
    assert expected.abs().max() > 0
    assert (got.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_legrad_asks_for_a_read_out_where_it_knows_none() -> None:
    model, target, _, _ = huggingface_model("clip")
    with pytest.raises(explain.LayerError, match="give read_out="):
        explain.methods.LeGrad(model)(torch.randn(1, 3, 32, 32), target)
    projected = explain.methods.LeGrad(
        model,
        read_out=lambda tokens: {
            "image_embeds": model.visual_projection(model.vision_model.post_layernorm(tokens.mean(1)))
        },
    )(torch.randn(2, 3, 32, 32), target)
    assert projected.cams.shape == (2, 32, 32) and hook_count(model) == 0
