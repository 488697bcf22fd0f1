"""Transformers and channels-last backbones: their layer outputs laid out as maps, against references written
here with plain hooks and autograd and the layout each model is known to have."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch
import torchvision
from conftest import CAT, TINY_HF, capture_score, hook_count, manifest
from PIL import Image
from timm.models.convnext import ConvNeXt
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import explain
from explain.cli import main
from explain.core.layers import find_auto_layers


def randomized_head(model: nn.Module) -> nn.Module:
    """torchvision's ViT starts with a zero head (its output would depend on nothing): random weights instead."""
    torch.manual_seed(5)
    nn.init.normal_(model.heads.head.weight, std=0.5)
    return model


def build(name: str) -> nn.Module:
    """Small random-weight models, each with what its layout is known to be."""
    torch.manual_seed(0)
    models = {
        "vit_tiny": lambda: timm.create_model("vit_tiny_patch16_224", num_classes=10),
        "deit_distilled": lambda: timm.create_model("deit_tiny_distilled_patch16_224", num_classes=10),
        "registers": lambda: VisionTransformer(
            img_size=64, patch_size=16, embed_dim=48, depth=2, num_heads=3, reg_tokens=4, num_classes=10
        ),
        "dynamic": lambda: VisionTransformer(
            img_size=64, patch_size=16, embed_dim=48, depth=2, num_heads=3, dynamic_img_size=True, num_classes=10
        ),
        "torchvision_vit": lambda: randomized_head(
            torchvision.models.VisionTransformer(
                image_size=64, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
            )
        ),
        "swin": lambda: SwinTransformer(
            img_size=112,
            patch_size=4,
            window_size=7,
            embed_dim=24,
            depths=(2, 2, 2),
            num_heads=(1, 2, 4),
            num_classes=10,
        ),
        "torchvision_swin": lambda: torchvision.models.SwinTransformer(
            patch_size=[4, 4],
            embed_dim=24,
            depths=[2, 2, 2, 2],
            num_heads=[1, 2, 3, 4],
            window_size=[7, 7],
            num_classes=10,
        ),
        "convnext_atto": lambda: timm.create_model("convnext_atto", num_classes=10),
        "convnext_linear_mlp": lambda: ConvNeXt(
            depths=(1, 1, 1, 1), dims=(16, 32, 64, 128), conv_mlp=False, num_classes=10
        ),
    }
    return models[name]().eval()


# model, input (H, W), layer, and how its output is known to be laid out: prefix tokens on the 16-pixel patch
# grid, or channels last
CASES = [
    ("vit_tiny", (224, 224), "blocks.11.norm1", ("tokens", 1)),
    ("deit_distilled", (224, 224), "blocks.11.norm1", ("tokens", 2)),  # class and distillation tokens
    ("registers", (64, 64), "blocks.1.norm1", ("tokens", 5)),  # class token and 4 registers
    ("dynamic", (64, 96), "blocks.1.norm1", ("tokens", 1)),  # a non-square input: a 4 x 6 grid
    ("torchvision_vit", (64, 64), "encoder.layers.encoder_layer_1.ln_1", ("tokens", 1)),
    ("swin", (112, 112), "layers.2", ("channels_last", 0)),
    ("torchvision_swin", (224, 224), "features.7", ("channels_last", 0)),
    ("convnext_linear_mlp", (64, 64), "stages.3.blocks.0.norm", ("channels_last", 0)),  # LayerNorm before Linears
]


def reference_map(model: nn.Module, x: torch.Tensor, layer: str, layout: tuple[str, int], classes: list[int]):
    """Grad-CAM from the paper on the layer's output laid out by hand: (N, h, w), float64."""
    a, g = capture_score(model, x, layer, lambda logits: logits[range(len(classes)), classes])
    kind, prefix = layout
    if kind == "tokens":
        grid = (x.shape[-2] // 16, x.shape[-1] // 16)
        a, g = (t[:, prefix:].transpose(1, 2).reshape(len(t), -1, *grid) for t in (a, g))
    else:
        a, g = a.permute(0, 3, 1, 2), g.permute(0, 3, 1, 2)
    return (g.mean(dim=(2, 3))[..., None, None] * a).sum(dim=1).clamp(min=0)


@pytest.mark.parametrize(("name", "size", "layer", "layout"), CASES, ids=[case[0] for case in CASES])
def test_layouts_match_a_reference(name: str, size: tuple[int, int], layer: str, layout: tuple[str, int]) -> None:
    model = build(name)
    torch.manual_seed(1)
    x = torch.randn(2, 3, *size)
    classes = [3, 7]
    expected = reference_map(model, x, layer, layout, classes)
    result = explain.GradCAM(model, layer)(x, classes, normalize=False, resize=False)
    assert result.raw.shape == expected.shape and expected.abs().max() > 0
    assert (result.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert hook_count(model) == 0


AUTOMATIC = [
    ("vit_tiny", (224, 224), "blocks.11.norm1"),  # the input of the last attention, not the last block
    ("deit_distilled", (224, 224), "blocks.11.norm1"),
    ("registers", (64, 64), "blocks.1.norm1"),
    ("torchvision_vit", (64, 64), "encoder.layers.encoder_layer_1.ln_1"),
    ("swin", (112, 112), "norm"),  # the last stage, after its norm
    ("torchvision_swin", (224, 224), "permute"),  # the last stage's normalized map, channels first
    ("convnext_atto", (64, 64), "stages"),  # the last stage
]


@pytest.mark.parametrize(("name", "size", "expected"), AUTOMATIC, ids=[case[0] for case in AUTOMATIC])
def test_automatic_layer_of_transformers_and_modern_backbones(name: str, size: tuple[int, int], expected: str) -> None:
    model = build(name)
    x = torch.randn(2, 3, *size)
    assert find_auto_layers(model, x) == [expected]
    result = explain.GradCAM(model)(x, normalize=False)
    assert result.layer == expected and (result.raw.flatten(1).amax(dim=1) > 0).all()


def test_vgg_automatic_layer_is_the_feature_map_not_the_adaptive_pool() -> None:
    torch.manual_seed(0)
    model = torchvision.models.vgg11(num_classes=10).eval()
    result = explain.GradCAM(model)(torch.randn(1, 3, 448, 448), resize=False)
    assert result.layer == "features" and result.raw.shape == (1, 14, 14)  # the pool would give 7 x 7


def test_what_is_not_a_map_is_refused() -> None:
    model = build("vit_tiny")
    x = torch.randn(1, 3, 224, 224)
    with pytest.raises(explain.LayerError, match=r"inside the attention module 'blocks\.11\.attn'.*reshape="):
        explain.gradcam(model, x, "blocks.11.attn.k_norm")  # (N, heads, T, head dim)
    with pytest.raises(explain.LayerError, match="gradient is zero at every position"):
        explain.gradcam(model, x, "blocks.11")  # the class token alone reaches the head


class _Tokens3(nn.Module):
    """Tokens (N, 3, 10) without a patch embedding: nothing tells their grid."""

    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Linear(256, 10)
        self.head = nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lift(x.flatten(2)).mean(dim=1))


def test_tokens_without_a_grid_are_refused_and_reshape_lays_them_out() -> None:
    model = _Tokens3().eval()
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(explain.LayerError, match=r"outputs 3 tokens .* not flatten from a grid.*reshape="):
        explain.gradcam(model, x, "lift")

    def reshape(tokens: torch.Tensor) -> torch.Tensor:  # the caller knows: 3 channels of a 2 x 5 grid
        return tokens.reshape(len(tokens), 3, 2, 5)

    a, g = capture_score(model, x, "lift", lambda out: out[:, 1])
    a, g = reshape(a), reshape(g)
    expected = (g.mean(dim=(2, 3))[..., None, None] * a).sum(dim=1).clamp(min=0)
    got = explain.cam(model, x, "gradcam", "lift", 1, reshape=reshape, resize=False, normalize=False)
    assert (got.double() - expected).abs().max() <= 1e-6 * max(1.0, expected.abs().max().item())


def test_timm_model_by_name_with_a_checkpoint(tmp_path) -> None:
    """``--model timm/NAME --weights FILE``: built by timm, fed as its pretrained config says (224 bicubic, mean
    and std 0.5), explained at the input of its last attention."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", num_classes=10).eval()
    weights = tmp_path / "vit.pt"
    torch.save(model.state_dict(), weights)
    out = tmp_path / "out"
    assert main([str(CAT), "--model", "timm/vit_tiny_patch16_224", "--weights", str(weights), "-o", str(out)]) == 0
    (record,) = manifest(out)
    pixels = np.asarray(Image.open(CAT).convert("RGB").resize((224, 224), Image.Resampling.BICUBIC)) / 255.0
    x = torch.tensor((pixels - 0.5) / 0.5, dtype=torch.float32).permute(2, 0, 1)[None]
    with torch.no_grad():
        probabilities = model(x).softmax(dim=1)[0]
    (target,) = record["targets"]
    assert record["layer"] == "blocks.11.norm1"
    assert target["class_name"] == f"class {int(probabilities.argmax())}"
    assert target["score"] == pytest.approx(float(probabilities.max()), abs=1e-4)
    assert Image.open(out / target["output"]).size == Image.open(CAT).size

    # A ViT of fixed input size refuses the aspect-kept 224 x 337 input: a one-line error for that input, exit 1.
    kept = tmp_path / "kept"
    args = [str(CAT), "--model", "timm/vit_tiny_patch16_224", "--weights", str(weights), "--keep-aspect"]
    assert main([*args, "-o", str(kept)]) == 1
    (failed,) = manifest(kept)
    assert "chelsea.png: Input width (337) doesn't match model (224)" in failed["error"]


def test_timm_model_without_weights_offline_names_the_way_out(tmp_path) -> None:
    script = (
        "import explain\n"
        "for name in ('timm/vit_tiny_patch16_224', 'timm/vit_tiny_patch16_22'):\n"
        "    try:\n"
        "        explain.load_model(name)\n"
        "    except explain.ModelLoadError as err:\n"
        "        print(err)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "TORCH_HOME": str(tmp_path)}
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    offline, unknown = found.stdout.splitlines()
    assert offline.startswith("timm/vit_tiny_patch16_224: its pretrained weights") and "--weights FILE" in offline
    assert unknown.startswith("unknown timm model 'vit_tiny_patch16_22'; did you mean: timm/vit_tiny_patch16_224")


def token_reference(model: nn.Module, x: torch.Tensor, layer: str, score) -> torch.Tensor:
    """Grad-CAM of a 32 x 32 input's tokens at a layer: the class token dropped, a 4 x 4 grid of 8-pixel patches."""
    a, g = capture_score(model, x, layer, score)
    a, g = (t[:, 1:].transpose(1, 2).reshape(len(t), -1, 4, 4) for t in (a, g))
    expected = (g.mean(dim=(2, 3))[..., None, None] * a).sum(dim=1).clamp(min=0)
    assert expected.abs().max() > 0
    return expected


def test_huggingface_vit_from_a_random_config() -> None:
    """A HuggingFace image classifier: its ModelOutput's logits are read, its tokens laid out on its patch grid,
    and the automatic layer is the last layer's ``layernorm_before``; no download (a random config)."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(**TINY_HF, num_labels=10)).eval()
    x = torch.randn(2, 3, 32, 32)
    result = explain.GradCAM(model)(x, [1, 2], normalize=False, resize=False)
    norms = [name for name, _ in model.named_modules() if name.endswith("layernorm_before")]
    assert result.layer == norms[-1]
    expected = token_reference(model, x, result.layer, lambda output: output.logits[range(2), [1, 2]])
    assert (result.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_clip_vision_tower_explains_a_similarity() -> None:
    """CLIP's vision tower (HuggingFace, random config): the similarity of its image embedding to a reference
    (a text embedding, say), explained at the input of its last attention."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    from explain.targets import SimilarityTarget

    torch.manual_seed(0)
    model = CLIPVisionModelWithProjection(CLIPVisionConfig(**TINY_HF, projection_dim=16)).eval()
    x, text = torch.randn(2, 3, 32, 32), torch.randn(16)
    target = SimilarityTarget(text, output="image_embeds")
    result = explain.GradCAM(model)(x, target, normalize=False, resize=False)
    norms = [name for name, _ in model.named_modules() if name.endswith("layer_norm1")]
    assert result.layer == norms[-1]

    def similarity(output):
        return torch.cosine_similarity(output.image_embeds, text[None], dim=1)

    expected = token_reference(model, x, result.layer, similarity)
    assert (result.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_perturbation_methods_on_tokens() -> None:
    """Score-CAM masks the input with the laid-out maps, so it takes tokens; Ablation-CAM would put a map in
    place of the tokens, so it refuses them."""
    model = build("registers")
    x = torch.randn(2, 3, 64, 64)
    cams = explain.cam(model, x, "scorecam", "blocks.1.norm1", [3, 7], batch_size=64)
    assert cams.shape == (2, 64, 64) and torch.isfinite(cams).all() and (cams.flatten(1).amax(dim=1) > 0).all()
    with pytest.raises(explain.LayerError, match=r"Ablation-CAM .* not tokens: 5 prefix, 4x4 patches"):
        explain.cam(model, x, "ablationcam", "blocks.1.norm1", [3, 7])
    assert hook_count(model) == 0
