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
from explain.errors import LayerError
from explain.relevance.epsilon import EPSILON
from explain.relevance.operations import OperationRules

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


@pytest.mark.parametrize("method", ["attnlrp", "cplrp"])
def test_relevance_at_a_named_layer_is_what_its_patches_hand_to_their_pixels(method: str) -> None:
    """``layer="patch_embed"`` (the patch tokens, laid out on their 4 x 4 grid): a bias-free patch embedding hands
    each token's relevance to its own 8 x 8 pixels alone, so the layer's map is the input's summed per patch; with
    the attention constant, it also sums to 1."""
    model = _zero_bias_vit()
    x = torch.randn(2, 3, 32, 32, generator=GENERATOR)
    at_input = explain.METHODS[method](model)(x, [0, 1], normalize=False).raw.sum(dim=1)
    at_layer = explain.METHODS[method](model, "patch_embed")(x, [0, 1], normalize=False)
    assert at_layer.layer == "patch_embed" and at_layer.raw.shape == (2, 192, 4, 4)
    per_patch = at_input.reshape(2, 4, 8, 4, 8).sum(dim=(2, 4))
    torch.testing.assert_close(at_layer.raw.sum(dim=1), per_patch, rtol=1e-4, atol=1e-5)
    if method == "cplrp":
        torch.testing.assert_close(at_layer.completeness, torch.zeros(2), atol=1e-3, rtol=0)
    with pytest.raises(LayerError, match="zero at every position"):  # the head reads the class token alone
        explain.METHODS[method](model, "blocks.1")(x, [0, 1])


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
    x, r = torch.randn(3, 4, generator=GENERATOR), torch.randn(3, 4, generator=GENERATOR)
    with pytest.raises(LayerError, match=r"^attnlrp has no relevance rule for a division by a tensor relevance"):
        _relevance(lambda t: t / (t.abs() + 1), (x,), r)
    with pytest.raises(LayerError, match=r"^attnlrp has no relevance rule for an einsum of 3 operands"):
        _relevance(lambda t: torch.einsum("ij,ij,ij->ij", t, t, t), (x,), r)


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


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_cplrp_conserves_a_prompts_score_through_a_contrastive_model_without_biases(kind: str) -> None:
    """CLIP's and SigLIP's logit of an image against a prompt, every bias, position and class embedding zero: both
    towers' embeddings divided by their norms (held constant, as a layer norm's spread), SigLIP's attention-pooling
    head; CP-LRP's pixels get the whole logit's relevance, 1, and AttnLRP's softmax rule reports its share."""
    pytest.importorskip("transformers")
    from test_vision_language import tiny_contrastive

    model = tiny_contrastive(kind)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "position_embedding" in name or "class_embedding" in name:
                parameter.zero_()
    x, prompts = torch.randn(2, 3, 32, 32, generator=GENERATOR), torch.tensor([[1, 5, 6, 2], [1, 7, 8, 2]])
    found = explain.explain_prompts(model, x, prompts, method="cplrp")
    torch.testing.assert_close(found.raw.flatten(2).sum(dim=2), torch.ones(2, 2), atol=1e-3, rtol=0)
    torch.testing.assert_close(found.completeness, torch.zeros(2, 2), atol=1e-3, rtol=0)
    softmax = explain.explain_prompts(model, x, prompts, method="attnlrp").completeness
    assert bool(torch.isfinite(softmax).all()) and float(softmax.abs().min()) > 1e-2


def _passing(layers) -> list:
    """Hooks that make each of a tower's encoder layers pass its input on: tokens no longer mix."""
    return [layer.register_forward_hook(lambda m, args, out: (args[0], *out[1:]) if isinstance(out, tuple) else args[0])
            for layer in layers]  # fmt: skip


@pytest.mark.parametrize("method", ["attnlrp", "cplrp"])
@pytest.mark.parametrize("family", ["llava", "paligemma"])
def test_a_planted_vision_token_lands_on_its_own_pixels_and_at_the_projector_on_its_cell(family: str, method: str):
    """One vision token alone left at the projector, the tower's layers passing their input on: a word's relevance
    reaches that token's 8 x 8 pixels and no other, and read at the projector (``layer=``) its 4 x 4 cell."""
    pytest.importorskip("transformers")
    from test_vision_language import PROMPT, image, tiny_llava, tiny_paligemma

    from explain.models import VisionLanguage
    from explain.targets import TokenTarget

    model, x, token = (tiny_llava() if family == "llava" else tiny_paligemma()), image(), 6  # row 1, column 2
    text = {"input_ids": PROMPT} if family == "llava" else {"input_ids": PROMPT, "token_type_ids": 0 * PROMPT}
    keep = torch.zeros(1, 16, 1)
    keep[0, token] = 1
    handles = _passing(model.model.vision_tower.encoder.layers)
    handles.append(model.model.multi_modal_projector.register_forward_hook(lambda m, i, o: o * keep))
    try:
        found = explain.explain_answer(model, {"pixel_values": x, **text}, answer=[20], method=method)
        at_layer = explain.METHODS[method](VisionLanguage(model, text), "model.model.multi_modal_projector")(
            x, TokenTarget(PROMPT[0], [PROMPT.shape[1] - 1]), normalize=False
        )
    finally:
        for handle in handles:
            handle.remove()
    where = torch.zeros(32, 32, dtype=torch.bool)
    where[8:16, 16:24] = True
    reached = found.result.raw[0, 0].abs().sum(dim=0)
    assert bool((reached[~where] == 0).all()) and bool((reached[where] > 0).any())
    cells = at_layer.raw[0, 0].abs().sum(dim=0)
    assert cells.shape == (4, 4) and cells[1, 2] > 0 and torch.count_nonzero(cells) == 1


def test_a_norm_divides_as_a_constant_and_a_statistic_used_as_a_feature_is_refused() -> None:
    """x / ‖x‖, an RMS norm written out (pow, mean, rsqrt) and a layer norm written out hold their statistics
    constant: the identity, and ε through the centring; a power added to its input is a feature, refused by name."""
    x, r = torch.randn(4, 8, generator=GENERATOR), torch.randn(4, 8, generator=GENERATOR)
    for fn in (lambda t: t / t.norm(dim=-1, keepdim=True), lambda t: t / torch.linalg.vector_norm(t, dim=-1)[:, None],
               lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)):  # fmt: skip
        (found,) = _relevance(fn, (x,), r)
        torch.testing.assert_close(found, r)
    written = lambda t: (t - t.mean(-1, keepdim=True)) / torch.sqrt(t.var(-1, keepdim=True) + 1e-5)  # noqa: E731
    (found,) = _relevance(written, (x,), r)
    mean = x.mean(-1, keepdim=True)
    ratio = r / _stable(x - mean)  # ε through x - mean: x's share, and the mean's, handed to x by ε through the mean
    through_mean = (-mean * ratio).sum(-1, keepdim=True)
    torch.testing.assert_close(found, x * ratio + x * (through_mean / _stable(mean)) / 8)
    with pytest.raises(LayerError, match=r"holds torch\.Tensor\.pow's result constant, .* uses it otherwise"):
        _relevance(lambda t: t + 0.1 * t.pow(3), (x,), r)


@pytest.mark.parametrize("kind", ["owlvit", "owlv2"])
def test_each_box_of_a_text_query_gets_relevance_on_its_own_patch_alone(kind: str) -> None:
    """OWL-ViT's and OWLv2's boxes of a text query, the tower's layers passing their input on: each box's score
    is read from its own patch's token, so its relevance (AttnLRP's) lies on that patch's 8 x 8 pixels alone."""
    pytest.importorskip("transformers")
    from test_vision_language import image, tiny_owl

    model, x, queries = tiny_owl(kind), image(), torch.tensor([[1, 5, 6, 2], [1, 7, 8, 2]])
    handles = _passing(model.owlvit.vision_model.encoder.layers if kind == "owlvit" else
                       model.owlv2.vision_model.encoder.layers)  # fmt: skip
    try:
        found = explain.explain_queries(model, x, queries, score_threshold=0.4, method="attnlrp")
        with torch.no_grad():
            best = model(input_ids=queries, pixel_values=x).logits[0].sigmoid().amax(dim=-1)
    finally:
        for handle in handles:
            handle.remove()
    patches = (best >= 0.4).nonzero()[:, 0].tolist()
    assert len(patches) > 1 and found.raw.shape[:2] == (1, len(patches))
    for k, patch in enumerate(patches):
        where = torch.zeros(32, 32, dtype=torch.bool)
        row, column = divmod(patch, 4)
        where[row * 8 : row * 8 + 8, column * 8 : column * 8 + 8] = True
        reached = found.raw[0, k].abs().sum(dim=0)
        assert bool((reached[~where] == 0).all()) and bool((reached[where] > 0).any()), patch


def _two_layers(in_place: bool):
    """Two linear layers with a ReLU and a residual sum between, in place (results not assigned) or not, and a branch
    without a rule (``grid_sample``) that the output does not read."""
    weights = torch.randn(6, 6, generator=GENERATOR), torch.randn(3, 6, generator=GENERATOR)

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, weights[0])
        if in_place:
            h.relu_()
            h.add_(x)
        else:
            h = torch.relu(h) + x
        F.grid_sample(h[:, None, None, :2], torch.zeros(len(x), 1, 1, 2), align_corners=False)  # unread
        return F.linear(h, weights[1])

    return forward


def test_in_place_operations_keep_their_rules_and_an_unread_operation_without_one_is_not_refused() -> None:
    """``h.relu_()`` and ``h.add_(x)`` as statements hand relevance on as ``relu(h) + x`` does (what the rules saved
    of ``h`` before is not overwritten); the unread ``grid_sample`` is refused only where relevance reaches it."""
    x, r = torch.randn(4, 6, generator=GENERATOR), torch.randn(4, 3, generator=GENERATOR)
    state = GENERATOR.get_state()
    (found,) = _relevance(_two_layers(True), (x,), r)
    GENERATOR.set_state(state)
    (expected,) = _relevance(_two_layers(False), (x,), r)
    torch.testing.assert_close(found, expected)
    assert found.abs().sum() > 0


LXT_CP_LRP = """
import importlib.util, sys, types, torch
from torchvision.models import vision_transformer
root = importlib.util.find_spec("lxt").submodule_search_locations[0]
for name, folder in (("lxt", ""), ("lxt.efficient", "/efficient"), ("lxt.efficient.models", "/efficient/models")):
    package = types.ModuleType(name)  # LXT's packages without their __init__: its BERT patch does not import
    package.__path__ = [root + folder]
    sys.modules[name] = package
from lxt.efficient.models.vit_torch import cp_LRP
for module, patch in cp_LRP.items():
    patch(module)
model = vision_transformer.VisionTransformer(32, 8, 2, 2, 16, 32, num_classes=5).eval()
model.load_state_dict(torch.load(sys.argv[1]))
model.requires_grad_(False)
x = torch.load(sys.argv[2]).requires_grad_(True)
logits = model(x)[torch.arange(len(x)), torch.tensor([1, 3])]
logits.sum().backward()
torch.save({"relevance": (x * x.grad).detach(), "logits": logits.detach()}, sys.argv[3])
"""


def test_cplrp_is_lxt_s_on_torchvision_s_vit(tmp_path) -> None:
    """LXT 2.1's own CP-LRP for torchvision's ViT (its vision patch, run unchanged in a process of its own; LXT's
    package as a whole does not import beside current ``transformers``): Gradient x Input with the query and key
    held constant, GELU and layer norms by the identity, which starts from the logit. explain's, from 1 at the
    logit, times the logit: with its stabilizer ε made as small as LXT's (none), equal within 1e-4 of the largest
    value; at its own ε = 1e-6, which moves the relevance of outputs near zero, correlated above 0.999 (the input
    is one where ε matters most among 25 tried)."""
    import subprocess
    import sys

    pytest.importorskip("lxt", reason="lxt: a test dependency (pip install -e '.[test]')")
    import torchvision

    torch.manual_seed(1)
    model = torchvision.models.VisionTransformer(32, 8, 2, 2, 16, 32, num_classes=5).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "head" in name or name == "class_token":
                parameter.normal_(0, 0.5)  # torchvision starts them at zero
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(20))
    torch.save(model.state_dict(), tmp_path / "vit.pt")
    torch.save(x, tmp_path / "x.pt")
    argv = [str(tmp_path / name) for name in ("vit.pt", "x.pt", "lxt.pt")]
    subprocess.run([sys.executable, "-c", LXT_CP_LRP, *argv], check=True, capture_output=True, timeout=300)
    lxt = torch.load(tmp_path / "lxt.pt")
    peak = float(lxt["relevance"].abs().max())
    found = explain.METHODS["cplrp"](model)(x, [1, 3], normalize=False)
    torch.testing.assert_close(found.scores, lxt["logits"])
    scaled = found.raw * lxt["logits"][:, None, None, None]
    assert peak > 0 and torch.corrcoef(torch.stack([scaled.flatten(), lxt["relevance"].flatten()]))[0, 1] > 0.999
    scaled = explain.METHODS["cplrp"](model, epsilon=1e-12)(x, [1, 3], normalize=False).raw
    scaled = scaled * lxt["logits"][:, None, None, None]
    torch.testing.assert_close(scaled, lxt["relevance"], rtol=0, atol=1e-4 * peak)


def test_the_explorer_and_evaluate_take_attnlrp_on_the_bundled_model(lite0, tmp_path) -> None:
    """The explorer's view of a photo with ``attnlrp`` is the direct call's map (at the input, and at a named layer
    its relevance there); ``explain evaluate`` scores its map with the metric's own value on it."""
    import json

    from conftest import COFFEE

    from explain import metrics
    from explain.cli import main
    from explain.explorer import Explorer, View

    explorer = Explorer(lite0)
    photo = explorer.add(COFFEE)
    x = lite0.preprocess(COFFEE)
    for layer in (None, "blocks.5"):
        shown = explorer.show(photo.name, View("attnlrp", (layer,) if layer else (), 967))
        direct = explain.METHODS["attnlrp"](lite0.model, layer)(x, 967)
        torch.testing.assert_close(shown.cam, direct.cams[0].cpu(), atol=1e-5, rtol=0)
    out = tmp_path / "evaluation"
    assert main(["evaluate", str(COFFEE), "--methods", "attnlrp", "--metrics", "sparseness", "-o", str(out),
                 "--quiet"]) == 0  # fmt: skip
    (record,) = [json.loads(line) for line in (out / "scores.jsonl").read_text().splitlines()]
    expected = metrics.sparseness(explain.METHODS["attnlrp"](lite0.model)(x).cams)
    assert record["configuration"] == "attnlrp" and record["value"] == pytest.approx(float(expected), rel=1e-4)


ZEROED = ("bias", "pos_embed", "position_embedding", "cls_token", "dist_token", "class_embedding", "mask_token",
          "relative_position_bias_table")  # fmt: skip


def _sweep_model(name: str) -> tuple[nn.Module, int]:
    """A small random config of a family, and its input size."""
    timm = pytest.importorskip("timm")
    transformers = pytest.importorskip("transformers")
    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_labels": 5}
    if name == "deit":
        return timm.create_model(
            "deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, num_classes=5, depth=2
        ), 32
    if name == "eva02":  # rotary embeddings, SwiGLU
        return timm.create_model("eva02_tiny_patch14_224", img_size=28, num_classes=5, depth=2), 28
    if name == "swin":
        return timm.create_model("swin_tiny_patch4_window7_224", img_size=56, num_classes=5, depths=(1, 1),
                                 num_heads=(1, 2), embed_dim=16, window_size=7), 56  # fmt: skip
    if name == "hf_vit":
        config = transformers.ViTConfig(intermediate_size=64, image_size=32, patch_size=8, **small)
        return transformers.ViTForImageClassification(config), 32
    if name == "dinov2":  # layer scale
        return transformers.Dinov2ForImageClassification(
            transformers.Dinov2Config(image_size=32, patch_size=8, **small)
        ), 32
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                     window_size=4, num_labels=5)  # fmt: skip
    return transformers.SwinForImageClassification(config), 32


@pytest.mark.parametrize("name", ["deit", "eva02", "swin", "hf_vit", "dinov2", "hf_swin"])
def test_cplrp_conserves_the_score_across_vision_transformer_families(name: str) -> None:
    """timm's DeiT (distilled), EVA-02 and Swin, HuggingFace's ViT, DINOv2 and Swin, random small configs with every
    bias, position embedding, class and distillation token and relative position bias zero: CP-LRP's input relevance
    sums to 1 within 2e-3."""
    torch.manual_seed(0)
    model, size = _sweep_model(name)
    model.eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if any(part in parameter_name for part in ZEROED):
                parameter.zero_()
            elif "head" in parameter_name or "classifier" in parameter_name:
                parameter.normal_(0, 0.5)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    found = explain.METHODS["cplrp"](model)(x, [1, 3], normalize=False)
    torch.testing.assert_close(found.raw.flatten(1).sum(dim=1), torch.ones(2), atol=2e-3, rtol=0)


def test_an_answer_s_relevance_starts_at_its_tokens_logits() -> None:
    """The relevance propagations score a word by its tokens' logits (the model's own output), not their
    log-probabilities; the probabilities reported are the tokens' either way; an unknown score is refused."""
    pytest.importorskip("transformers")
    from test_vision_language import PROMPT, image, tiny_llava

    from explain.errors import TargetError
    from explain.models import VisionLanguage
    from explain.targets import TokenTarget

    model, x = tiny_llava(), image()
    sequence = torch.cat([PROMPT[0], torch.tensor([10, 11])])
    positions = [PROMPT.shape[1], PROMPT.shape[1] + 1]
    reader = VisionLanguage(model, {"input_ids": sequence[None]})
    with torch.no_grad():
        logits = model(input_ids=sequence[None], pixel_values=x).logits[0]
    expected = torch.stack([logits[p - 1, sequence[p]] for p in positions])
    for method in ("attnlrp", "lrp", "saliency"):
        found = explain.METHODS[method](reader)(x, TokenTarget(sequence, positions), normalize=False)
        wanted = (
            expected
            if method != "saliency"
            else torch.stack([logits[p - 1].log_softmax(-1)[sequence[p]] for p in positions])
        )
        torch.testing.assert_close(found.scores[0], wanted, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(found.probabilities[0], torch.stack(
            [logits[p - 1].softmax(-1)[sequence[p]] for p in positions]), rtol=1e-4, atol=1e-6)  # fmt: skip
    with pytest.raises(TargetError, match="score must be"):
        TokenTarget(sequence, positions, score="probability")


def test_the_group_norm_rule_is_epsilon_with_each_group_s_spread_held_constant() -> None:
    """A group norm under the rules against the ε rule written out with autograd: each group's mean subtracted, its
    spread a constant, the channel's weight and bias applied; a bias-free convolution, group norm and pool chain
    conserves the score."""
    x, r = torch.randn(2, 6, 3, 4, generator=GENERATOR), torch.randn(2, 6, 3, 4, generator=GENERATOR)
    weight, bias = torch.randn(6, generator=GENERATOR), torch.randn(6, generator=GENERATOR)
    (found,) = _relevance(lambda t: F.group_norm(t, 3, weight, bias, 1e-5), (x,), r)
    leaf = x.clone().requires_grad_(True)
    grouped = leaf.view(2, 3, -1)
    spread = (grouped.detach().var(dim=2, unbiased=False, keepdim=True) + 1e-5).sqrt()
    z = ((grouped - grouped.mean(dim=2, keepdim=True)) / spread).view_as(x) * weight.view(-1, 1, 1) + bias.view(
        -1, 1, 1
    )
    expected = x * torch.autograd.grad(z, leaf, r / _stable(z.detach()))[0]
    torch.testing.assert_close(found, expected, rtol=1e-4, atol=1e-5)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.GroupNorm(2, 8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 3, bias=False)).double().eval()  # fmt: skip
    nn.init.zeros_(net[1].bias)
    images = torch.randn(2, 3, 12, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    result = explain.METHODS["attnlrp"](net)(images, [0, 2], normalize=False)
    torch.testing.assert_close(result.completeness, torch.zeros(2), atol=1e-4, rtol=0)
