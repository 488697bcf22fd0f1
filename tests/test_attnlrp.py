"""AttnLRP and CP-LRP by operation: each rule against its definition written out on one operation, conservation on
a vision transformer whose every bias, position embedding and class token is zero, the rules on timm's and
torchvision's ViTs, and an operation without a rule refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_vision_language import llava_folder  # noqa: F401  (a fixture: the LLaVA folder the command line reads)
from torch import nn

import explain
from explain.core.operation_rules import EPSILON, OperationRules
from explain.errors import LayerError

GENERATOR = torch.Generator().manual_seed(0)


def _stable(z: torch.Tensor) -> torch.Tensor:
    return z + EPSILON * torch.where(z >= 0, 1.0, -1.0)


def _relevance(fn, inputs: tuple[torch.Tensor, ...], relevance: torch.Tensor, attention: str = "attnlrp"):
    """The inputs' relevance when ``relevance`` arrives at ``fn(*inputs)``, under the rules."""
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    with OperationRules("attnlrp", attention):
        out = fn(*leaves)
    return torch.autograd.grad(out, leaves, relevance)


def test_the_softmax_rule_is_deep_taylor_at_its_input() -> None:
    x, r = torch.randn(3, 7, generator=GENERATOR), torch.randn(3, 7, generator=GENERATOR)
    (found,) = _relevance(lambda t: F.softmax(t, dim=-1), (x,), r)
    s = torch.exp(x) / torch.exp(x).sum(dim=-1, keepdim=True)
    torch.testing.assert_close(found, x * (r - s * r.sum(dim=-1, keepdim=True)))
    masked = x.clone()
    masked[:, 0] = -torch.inf  # a masked score gets none
    (found,) = _relevance(lambda t: t.softmax(-1), (masked,), r)
    assert bool((found[:, 0] == 0).all()) and bool(torch.isfinite(found).all())


def test_the_attention_product_splits_uniformly_and_a_constant_factor_takes_none() -> None:
    a, b = torch.randn(2, 4, 5, generator=GENERATOR), torch.randn(2, 5, 3, generator=GENERATOR)
    r = torch.randn(2, 4, 3, generator=GENERATOR)
    found_a, found_b = _relevance(torch.matmul, (a, b), r)
    ratio = r / _stable(2 * (a @ b))
    torch.testing.assert_close(found_a, a * (ratio @ b.transpose(-1, -2)))
    torch.testing.assert_close(found_b, b * (a.transpose(-1, -2) @ ratio))
    torch.testing.assert_close(found_a.sum() + found_b.sum(), r.sum(), rtol=1e-4, atol=1e-4)
    leaf = b.clone().requires_grad_(True)
    with OperationRules("cplrp", "constant"):
        out = a @ leaf
    (alone,) = torch.autograd.grad(out, leaf, r)  # a constant: the other factor takes it all, by epsilon
    torch.testing.assert_close(alone, b * (a.transpose(-1, -2) @ (r / _stable(a @ b))))


def test_the_layer_norm_rule_is_epsilon_with_its_spread_held_constant() -> None:
    x, r = torch.randn(2, 6, generator=GENERATOR), torch.randn(2, 6, generator=GENERATOR)
    weight, bias = torch.randn(6, generator=GENERATOR), torch.randn(6, generator=GENERATOR)
    (found,) = _relevance(lambda t: F.layer_norm(t, (6,), weight, bias, 1e-5), (x,), r)
    for row in range(2):
        spread = (x[row].var(unbiased=False) + 1e-5).sqrt()
        jacobian = weight[:, None] * (torch.eye(6) - 1 / 6) / spread  # of the output by the input, spread constant
        z = F.layer_norm(x[row : row + 1], (6,), weight, bias, 1e-5)[0]
        torch.testing.assert_close(found[row], x[row] * (jacobian.T @ (r[row] / _stable(z))))


def test_activations_and_rms_norms_pass_relevance_and_a_gate_halves_it() -> None:
    x, r = torch.randn(4, 8, generator=GENERATOR), torch.randn(4, 8, generator=GENERATOR)
    for fn in (F.gelu, F.silu, torch.nn.GELU(), lambda t: F.rms_norm(t, (8,), torch.rand(8, generator=GENERATOR))):
        (found,) = _relevance(fn, (x,), r)
        torch.testing.assert_close(found, r)
    gate, up = torch.randn(4, 8, generator=GENERATOR), torch.randn(4, 8, generator=GENERATOR)
    found_gate, found_up = _relevance(lambda g, u: F.silu(g) * u, (gate, up), r)  # a SwiGLU's gate
    torch.testing.assert_close(found_gate, r / 2)
    torch.testing.assert_close(found_up, r / 2)
    (scaled,) = _relevance(lambda t: t * 3.0 / 2.0, (x,), r)  # a constant factor: identity
    torch.testing.assert_close(scaled, r)


def test_linear_layers_and_sums_are_epsilon() -> None:
    layer = nn.Linear(5, 3)
    x, r = torch.randn(2, 5, generator=GENERATOR), torch.randn(2, 3, generator=GENERATOR)
    (found,) = _relevance(layer, (x,), r)
    z = layer(x).detach()
    torch.testing.assert_close(found, x * ((r / _stable(z)) @ layer.weight.detach()))
    a, b = torch.randn(2, 3, generator=GENERATOR), torch.randn(2, 3, generator=GENERATOR)
    found_a, found_b = _relevance(lambda p, q: p + q, (a, b), r)
    torch.testing.assert_close(found_a, a * r / _stable(a + b))
    torch.testing.assert_close(found_b, b * r / _stable(a + b))


def _zero_bias_vit(seed: int = 0) -> nn.Module:
    """A small timm ViT with every bias, its position embedding and class token zero: a network linear in its
    input once the attention is held constant and each layer norm's spread too."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(seed)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=32, patch_size=8, depth=2
    ).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or name in ("pos_embed", "cls_token"):
                parameter.zero_()
    return model


def test_cplrp_conserves_the_score_on_a_vit_without_biases_and_attnlrp_reports_its_sum() -> None:
    model = _zero_bias_vit()
    x = torch.randn(3, 3, 32, 32, generator=GENERATOR)
    found = explain.METHODS["cplrp"](model)(x, [0, 1, 2], normalize=False)
    totals = found.raw.flatten(1).sum(dim=1)
    torch.testing.assert_close(totals, torch.ones(3), atol=1e-3, rtol=0)
    torch.testing.assert_close(found.completeness, totals - 1)  # what the result reports
    assert found.cams.shape == (3, 32, 32)
    attn = explain.METHODS["attnlrp"](model)(x, [0, 1, 2], normalize=False).raw.flatten(1).sum(dim=1)
    assert bool(torch.isfinite(attn).all()) and not torch.allclose(attn, totals)  # the softmax rule is not conserving


def test_torchvision_s_multi_head_attention_runs_as_its_parts_under_the_rules() -> None:
    import torchvision

    torch.manual_seed(1)
    model = torchvision.models.VisionTransformer(32, 8, 2, 2, 16, 32, num_classes=5).eval()
    with torch.no_grad():
        nn.init.normal_(model.heads.head.weight)  # torchvision starts its head at zero
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or name in ("class_token", "encoder.pos_embedding"):
                parameter.zero_()
    x = torch.randn(2, 3, 32, 32, generator=GENERATOR)
    found = explain.METHODS["cplrp"](model)(x, [1, 3], normalize=False)
    torch.testing.assert_close(found.raw.flatten(1).sum(dim=1), torch.ones(2), atol=1e-3, rtol=0)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


class _Resized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.grid_sample(self.conv(x), torch.zeros(len(x), 4, 4, 2), align_corners=False)
        return self.head(x.mean(dim=(2, 3)))


def test_an_operation_without_a_rule_is_refused_by_name() -> None:
    with pytest.raises(LayerError, match=r"^attnlrp has no relevance rule for torch\.nn\.functional\.grid_sample, "):
        explain.METHODS["attnlrp"](_Resized().eval())(torch.randn(1, 3, 16, 16), 1)


def _planted(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise images of 4 x 4 patches of 8 pixels, one patch at a random place holding a planted pattern whose
    polarity is the class: the images, their classes and the planted patch's place."""
    images = 0.3 * torch.randn(count, 3, 32, 32, generator=generator)
    classes = torch.randint(0, 2, (count,), generator=generator)
    places = torch.randint(0, 16, (count,), generator=generator)
    pattern = torch.ones(8, 8)
    pattern[2:6, 2:6] = -1.0
    for i, (label, place) in enumerate(zip(classes.tolist(), places.tolist())):
        row, column = divmod(place, 4)
        images[i, :, row * 8 : row * 8 + 8, column * 8 : column * 8 + 8] += (1.0 if label else -1.0) * 1.5 * pattern
    return images, classes, places


@pytest.mark.parametrize("method", ["attnlrp", "cplrp"])
def test_a_vit_trained_on_a_planted_patch_puts_the_most_relevance_there(method: str, planted_vit) -> None:
    model, generator = planted_vit, torch.Generator().manual_seed(7)
    images, classes, places = _planted(40, generator)
    relevance = explain.METHODS[method](model)(images, classes, normalize=False).raw.sum(dim=1)  # (N, 32, 32)
    per_patch = relevance.reshape(40, 4, 8, 4, 8).sum(dim=(2, 4)).flatten(1)  # (N, 16)
    hits = (per_patch.argmax(dim=1) == places).float().mean()
    assert float(hits) >= 0.9, float(hits)


@pytest.fixture(scope="module")
def planted_vit() -> nn.Module:
    """A small timm ViT trained for a few seconds to tell the planted pattern's polarity (accuracy checked)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=2, num_classes=2
    )
    generator = torch.Generator().manual_seed(3)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for _ in range(150):
        images, classes, _ = _planted(64, generator)
        loss = F.cross_entropy(model(images), classes)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    images, classes, _ = _planted(200, generator)
    with torch.no_grad():
        assert float((model(images).argmax(dim=1) == classes).float().mean()) > 0.95
    return model


@pytest.mark.parametrize("method", ["attnlrp", "cplrp"])
def test_each_word_of_a_llava_answer_gets_relevance_and_the_model_is_left_as_it_was(method: str) -> None:
    """A tiny LLaVA (CLIP tower, LLaMA with its RMS norms, rotary embeddings and SiLU gates): each word's relevance
    reaches the pixels through the language model and the vision tower, and the model keeps no hook or flag."""
    pytest.importorskip("transformers")
    from test_vision_language import PROMPT, image, tiny_llava

    model, x = tiny_llava(), image()
    flags = [p.requires_grad for p in model.parameters()]
    found = explain.explain_answer(model, {"pixel_values": x, "input_ids": PROMPT}, answer=[10, 11], method=method)
    relevance = found.result.raw.flatten(2).sum(dim=-1)  # each word's input relevance
    assert found.maps.shape == (2, 32, 32) and bool(torch.isfinite(found.result.raw).all())
    assert bool((relevance.abs() > 1e-6).all())
    assert [p.requires_grad for p in model.parameters()] == flags and all(p.grad is None for p in model.parameters())
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_the_command_line_explains_a_prompt_s_answer_with_attnlrp(llava_folder, tmp_path) -> None:  # noqa: F811
    """``--method attnlrp`` with ``--prompt`` on a LLaVA folder: one overlay per word of the answer."""
    import json

    from conftest import CAT

    from explain.cli import main

    out = tmp_path / "out"
    code = main([str(CAT), "--model", str(llava_folder), "--prompt", "what is on the table?", "--max-new-tokens", "2",
                 "--method", "attnlrp", "-o", str(out), "--quiet"])  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines() if '"input"' in line]
    (record,) = [r for r in records if r.get("method") == "attnlrp"]
    assert len(record["targets"]) >= 1 and all((out / t["output"]).is_file() for t in record["targets"])


def test_attention_with_dropout_is_refused_in_one_line() -> None:
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    with OperationRules("attnlrp"), pytest.raises(LayerError, match=r"^attnlrp rules attention without dropout"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


def test_a_softmax_s_dtype_is_honoured_given_by_name_or_place() -> None:
    x = torch.randn(2, 5, generator=GENERATOR)
    for fn in (lambda t: t.softmax(-1, torch.float64), lambda t: torch.softmax(t, -1, torch.float64),
               lambda t: F.softmax(t, dim=-1, dtype=torch.float64)):  # fmt: skip
        leaf = x.clone().requires_grad_(True)
        with OperationRules("attnlrp"):
            found = fn(leaf)
        assert found.dtype == torch.float64
        torch.testing.assert_close(found, torch.softmax(x.double(), -1))
