"""The zoo: Grad-CAM at the automatic layer of many architectures, each against a reference written here.

timm families at their smallest size, torchvision classifiers and segmenters, HuggingFace models from small
configs and Ultralytics' YOLO11n from its yaml (with the yolo extra), all with random weights, batch 1. For each
model, ``explain.GradCAM`` runs at its automatic layer(s) and is compared with Grad-CAM computed here from plain
hooks and autograd at the same layer (both without the final ReLU, which would flatten many maps of random
weights), the output laid out as the architecture is known to lay it out (stated per family below: channels
first, channels last, or tokens after a prefix read from the model's own attributes), never by explain's layout
code. Maps are compared position by position in row-major order, so a transposed or shifted layout shows as a
low r. Of fused pyramid levels, those the detection's score reaches are compared; the others give zero maps.

The automatic layer is also checked against its rules, here again without explain: its output changes when the
image does (a second image through a plain hook), it is not the tensor of scores, and the score's gradient there
is not zero everywhere. Linear layers that start at zero (a few heads) are drawn at random, since a zero head
makes every score constant.

    python benchmarks/zoo.py [--only NAME,...] [--out benchmarks/results_zoo_cpu.md]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import timm
import torch
import torch.nn.functional as F
import torchvision
import transformers
from timing import emit
from torch import nn
from torchvision.models.detection.transform import GeneralizedRCNNTransform

import explain
from explain.models.yolo import Letterbox


@dataclass
class Entry:
    """One architecture of the zoo.

    Attributes:
        name: Its name in the table.
        source: timm, torchvision or HuggingFace.
        build: Makes the model, random weights.
        size: The input's side.
        layout: How the automatic layer's output is laid out, from what the architecture is: ``"first"``,
            ``"last"`` or ``"tokens"``.
        prefix: For tokens, how many come before the patch tokens, read from the model.
        score: The explained score, from the model's output; default: the top class's logit.
    """

    name: str
    source: str
    build: Callable[[], nn.Module]
    size: int
    layout: str
    prefix: Callable[[nn.Module], int] = lambda model: 0
    score: Callable[[Any], torch.Tensor] | None = None


def timm_model(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: timm.create_model(name, pretrained=False, num_classes=10, **kwargs)


def prefix_tokens(model: nn.Module) -> int:
    return int(model.num_prefix_tokens)


def one(model: nn.Module) -> int:
    return 1


TIMM = [
    Entry("resnet18", "timm", timm_model("resnet18"), 128, "first"),
    Entry("resnet26d", "timm", timm_model("resnet26d"), 128, "first"),
    Entry("efficientnet_b0", "timm", timm_model("efficientnet_b0"), 128, "first"),
    Entry("mobilenetv3_small_050", "timm", timm_model("mobilenetv3_small_050"), 128, "first"),
    Entry("mobilenetv4_conv_small", "timm", timm_model("mobilenetv4_conv_small"), 128, "first"),
    Entry("regnetx_002", "timm", timm_model("regnetx_002"), 128, "first"),
    Entry("densenet121", "timm", timm_model("densenet121"), 128, "first"),
    Entry("vgg11", "timm", timm_model("vgg11"), 128, "first"),
    Entry("ghostnet_050", "timm", timm_model("ghostnet_050"), 128, "first"),
    Entry("rexnet_100", "timm", timm_model("rexnet_100"), 128, "first"),
    Entry("hrnet_w18_small", "timm", timm_model("hrnet_w18_small"), 128, "first"),
    Entry("dla34", "timm", timm_model("dla34"), 128, "first"),
    Entry("lcnet_050", "timm", timm_model("lcnet_050"), 128, "first"),
    Entry("repvgg_a0", "timm", timm_model("repvgg_a0"), 128, "first"),
    Entry("res2net50_14w_8s", "timm", timm_model("res2net50_14w_8s"), 128, "first"),
    Entry("resnest14d", "timm", timm_model("resnest14d"), 128, "first"),
    Entry("cspresnet50", "timm", timm_model("cspresnet50"), 128, "first"),
    Entry("ese_vovnet19b_dw", "timm", timm_model("ese_vovnet19b_dw"), 128, "first"),
    Entry("hgnetv2_b0", "timm", timm_model("hgnetv2_b0"), 128, "first"),
    Entry("xception41", "timm", timm_model("xception41"), 128, "first"),
    Entry("inception_v3", "timm", timm_model("inception_v3"), 160, "first"),
    Entry("nfnet_l0", "timm", timm_model("nfnet_l0"), 128, "first"),
    Entry("botnet26t_256", "timm", timm_model("botnet26t_256", img_size=128), 128, "first"),
    Entry("halonet26t", "timm", timm_model("halonet26t"), 256, "first"),
    Entry("convnext_atto", "timm", timm_model("convnext_atto"), 128, "first"),
    Entry("convnextv2_atto", "timm", timm_model("convnextv2_atto"), 128, "first"),
    Entry("convnext_atto at 384 (C=40, 96x96)", "timm", timm_model("convnext_atto"), 384, "first"),
    Entry("edgenext_xx_small", "timm", timm_model("edgenext_xx_small"), 128, "first"),
    Entry("poolformer_s12", "timm", timm_model("poolformer_s12"), 128, "first"),
    Entry("inception_next_tiny", "timm", timm_model("inception_next_tiny"), 128, "first"),
    Entry("fastvit_t8", "timm", timm_model("fastvit_t8"), 128, "first"),
    Entry("mobilevit_xxs", "timm", timm_model("mobilevit_xxs"), 128, "first"),
    Entry("mobilevitv2_050", "timm", timm_model("mobilevitv2_050"), 128, "first"),
    Entry("efficientvit_b0", "timm", timm_model("efficientvit_b0"), 128, "first"),
    Entry("efficientformerv2_s0", "timm", timm_model("efficientformerv2_s0", img_size=128), 128, "first"),
    Entry("starnet_s1", "timm", timm_model("starnet_s1"), 128, "first"),
    Entry("mambaout_femto", "timm", timm_model("mambaout_femto"), 128, "last"),
    Entry("swin_tiny_patch4_window7_224", "timm", timm_model("swin_tiny_patch4_window7_224"), 224, "last"),
    Entry("focalnet_tiny_srf", "timm", timm_model("focalnet_tiny_srf"), 128, "first"),
    Entry("davit_tiny", "timm", timm_model("davit_tiny"), 128, "first"),
    Entry("gcvit_xxtiny", "timm", timm_model("gcvit_xxtiny", img_size=224), 224, "first"),
    Entry("tiny_vit_5m_224", "timm", timm_model("tiny_vit_5m_224"), 224, "first"),
    Entry("maxvit_nano_rw_256", "timm", timm_model("maxvit_nano_rw_256", img_size=128), 128, "first"),
    Entry("coatnet_nano_rw_224", "timm", timm_model("coatnet_nano_rw_224", img_size=128), 128, "first"),
    Entry(
        "vit_tiny_patch16_224", "timm", timm_model("vit_tiny_patch16_224", img_size=128), 128, "tokens", prefix_tokens
    ),
    Entry(
        "deit_tiny_distilled_patch16_224",
        "timm",
        timm_model("deit_tiny_distilled_patch16_224", img_size=128),
        128,
        "tokens",
        prefix_tokens,
    ),
    Entry(
        "deit3_small_patch16_224",
        "timm",
        timm_model("deit3_small_patch16_224", img_size=128),
        128,
        "tokens",
        prefix_tokens,
    ),
    Entry(
        "eva02_tiny_patch14_224",
        "timm",
        timm_model("eva02_tiny_patch14_224", img_size=112),
        112,
        "tokens",
        prefix_tokens,
    ),
    Entry("beit_base_patch16_224", "timm", timm_model("beit_base_patch16_224", img_size=128), 128, "tokens", one),
    Entry("cait_xxs24_224", "timm", timm_model("cait_xxs24_224", img_size=128), 128, "tokens", one),
    Entry("xcit_nano_12_p16_224", "timm", timm_model("xcit_nano_12_p16_224", img_size=128), 128, "tokens", one),
    Entry("crossvit_tiny_240", "timm", timm_model("crossvit_tiny_240"), 240, "tokens", one),
    Entry("levit_128s", "timm", timm_model("levit_128s", img_size=128), 128, "tokens"),
    Entry("efficientformer_l1", "timm", timm_model("efficientformer_l1"), 224, "tokens"),
    Entry("hiera_tiny_224", "timm", timm_model("hiera_tiny_224"), 224, "tokens"),
    Entry("twins_svt_small", "timm", timm_model("twins_svt_small"), 128, "tokens"),
    Entry("pvt_v2_b0", "timm", timm_model("pvt_v2_b0"), 128, "first"),
    Entry("coat_lite_tiny", "timm", timm_model("coat_lite_tiny"), 224, "tokens", one),
    Entry("mixer_s32_224", "timm", timm_model("mixer_s32_224", img_size=128), 128, "tokens"),
    Entry("resmlp_12_224", "timm", timm_model("resmlp_12_224", img_size=128), 128, "tokens"),
    Entry("pit_ti_224", "timm", timm_model("pit_ti_224"), 224, "tokens", one),
    Entry("convit_tiny", "timm", timm_model("convit_tiny"), 224, "tokens", one),
    Entry("visformer_tiny", "timm", timm_model("visformer_tiny"), 224, "first"),
]


def tv_model(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: getattr(torchvision.models, name)(weights=None, num_classes=10, **kwargs)


def tv_segmenter(name: str) -> Callable[[], nn.Module]:
    return lambda: getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None, num_classes=5)


def tv_detector(name: str, threshold: str) -> Entry:
    """A torchvision detector at 256 px that keeps every detection (``threshold``: its score threshold's argument;
    random weights score low), its first detection explained."""
    build = getattr(torchvision.models.detection, name)
    options = {threshold: 0.0, "min_size": 256, "max_size": 256}
    model = lambda: build(weights=None, weights_backbone=None, num_classes=5, **options)  # noqa: E731
    return Entry(name, "torchvision", model, 256, "first", score=first_detection)


def first_detection(out: Any) -> torch.Tensor:
    return out[0]["scores"][:1]


def segment(out: Any) -> torch.Tensor:
    """A segmenter's class 1, its logits averaged over the image."""
    logits = out.logits if hasattr(out, "logits") else out["out"]
    return logits[:, 1].mean(dim=(1, 2))


TORCHVISION = [
    Entry("resnet18", "torchvision", tv_model("resnet18"), 128, "first"),
    Entry("mobilenet_v3_small", "torchvision", tv_model("mobilenet_v3_small"), 128, "first"),
    Entry("efficientnet_b0", "torchvision", tv_model("efficientnet_b0"), 128, "first"),
    Entry("regnet_y_400mf", "torchvision", tv_model("regnet_y_400mf"), 128, "first"),
    Entry("shufflenet_v2_x0_5", "torchvision", tv_model("shufflenet_v2_x0_5"), 128, "first"),
    Entry("squeezenet1_1", "torchvision", tv_model("squeezenet1_1"), 128, "first"),
    Entry("densenet121", "torchvision", tv_model("densenet121"), 128, "first"),
    Entry("mnasnet0_5", "torchvision", tv_model("mnasnet0_5"), 128, "first"),
    Entry("googlenet", "torchvision", tv_model("googlenet", aux_logits=False, init_weights=True), 128, "first"),
    Entry("convnext_tiny", "torchvision", tv_model("convnext_tiny"), 128, "first"),
    Entry("convnext_tiny at 352 (features.1: C=96, 88x88)", "torchvision", tv_model("convnext_tiny"), 352, "first"),
    Entry("swin_t", "torchvision", tv_model("swin_t"), 224, "first"),
    Entry("maxvit_t", "torchvision", tv_model("maxvit_t"), 224, "first"),
    Entry("vit_b_16", "torchvision", tv_model("vit_b_16", image_size=128), 128, "tokens", one),
    *(
        tv_detector(name, threshold)
        for name, threshold in [
            ("fasterrcnn_mobilenet_v3_large_fpn", "box_score_thresh"),
            ("maskrcnn_resnet50_fpn", "box_score_thresh"),
            ("retinanet_resnet50_fpn", "score_thresh"),
            ("fcos_resnet50_fpn", "score_thresh"),
        ]
    ),
    Entry("fcn_resnet50", "torchvision", tv_segmenter("fcn_resnet50"), 128, "first", score=segment),
    Entry(
        "deeplabv3_mobilenet_v3_large",
        "torchvision",
        tv_segmenter("deeplabv3_mobilenet_v3_large"),
        128,
        "first",
        score=segment,
    ),
    Entry(
        "lraspp_mobilenet_v3_large",
        "torchvision",
        tv_segmenter("lraspp_mobilenet_v3_large"),
        128,
        "first",
        score=segment,
    ),
]


def hf(cls: str, config: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: getattr(transformers, cls)(getattr(transformers, config)(**kwargs))


SMALL_VIT = dict(
    image_size=64,
    patch_size=8,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    num_labels=10,
)


def detr() -> nn.Module:
    backbone = transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], out_features=["stage4"]
    )
    config = transformers.DetrConfig(
        use_timm_backbone=False,
        backbone_config=backbone,
        use_pretrained_backbone=False,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_queries=100,
        num_labels=5,
    )
    return transformers.DetrForObjectDetection(config)


def segformer() -> nn.Module:
    config = transformers.SegformerConfig(
        num_labels=5, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_attention_heads=[1, 1, 1, 1]
    )
    config.decoder_hidden_size = 32
    return transformers.SegformerForSemanticSegmentation(config)


def upernet() -> nn.Module:
    backbone = transformers.ConvNextConfig(
        hidden_sizes=[16, 24, 32, 48], depths=[1, 1, 1, 1], out_features=["stage1", "stage2", "stage3", "stage4"]
    )
    config = transformers.UperNetConfig(
        backbone_config=backbone, hidden_size=16, auxiliary_channels=8, num_labels=5, use_auxiliary_head=False
    )
    return transformers.UperNetForSemanticSegmentation(config)


def mask2former() -> nn.Module:
    backbone = transformers.SwinConfig(
        embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=4, image_size=64,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )  # fmt: skip
    config = transformers.Mask2FormerConfig(
        backbone_config=backbone, num_labels=5, hidden_dim=32, mask_feature_size=32, feature_size=32,
        encoder_layers=1, decoder_layers=2, num_queries=10, encoder_feedforward_dim=64, dim_feedforward=64,
        num_attention_heads=2,
    )  # fmt: skip
    return explain.models.QuerySegmenter(transformers.Mask2FormerForUniversalSegmentation(config))


def conditional_detr() -> nn.Module:
    backbone = transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], out_features=["stage4"]
    )
    config = transformers.ConditionalDetrConfig(
        use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False, d_model=32,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=30, num_labels=5,
    )  # fmt: skip
    return transformers.ConditionalDetrForObjectDetection(config)


HUGGINGFACE = [
    Entry("ViT", "HuggingFace", hf("ViTForImageClassification", "ViTConfig", **SMALL_VIT), 64, "tokens", one),
    Entry("BEiT", "HuggingFace", hf("BeitForImageClassification", "BeitConfig", **SMALL_VIT), 64, "tokens", one),
    Entry(
        "DINOv2",
        "HuggingFace",
        hf("Dinov2ForImageClassification", "Dinov2Config", **{**SMALL_VIT, "image_size": 64}),
        64,
        "tokens",
        one,
    ),
    Entry(
        "Swin",
        "HuggingFace",
        hf(
            "SwinForImageClassification",
            "SwinConfig",
            image_size=64,
            patch_size=4,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[1, 2],
            window_size=4,
            num_labels=10,
        ),
        64,
        "tokens",
    ),
    Entry(
        "ConvNeXt",
        "HuggingFace",
        hf(
            "ConvNextForImageClassification",
            "ConvNextConfig",
            hidden_sizes=[16, 24, 32, 48],
            depths=[1, 1, 1, 1],
            num_labels=10,
        ),
        64,
        "first",
    ),
    Entry(
        "ConvNeXt at 176 (C=44, 44x44)",
        "HuggingFace",
        hf(
            "ConvNextForImageClassification",
            "ConvNextConfig",
            hidden_sizes=[44, 48, 56, 64],
            depths=[1, 1, 1, 1],
            num_labels=10,
        ),
        176,
        "first",
    ),
    Entry(
        "ResNet",
        "HuggingFace",
        hf(
            "ResNetForImageClassification",
            "ResNetConfig",
            embedding_size=16,
            hidden_sizes=[16, 32, 64, 128],
            depths=[1, 1, 1, 1],
            num_labels=10,
        ),
        64,
        "first",
    ),
    Entry(
        "MobileViT",
        "HuggingFace",
        hf("MobileViTForImageClassification", "MobileViTConfig", image_size=64, num_labels=10),
        64,
        "first",
    ),
    Entry("SegFormer", "HuggingFace", segformer, 64, "first", score=segment),
    Entry("UperNet (ConvNeXt backbone)", "HuggingFace", upernet, 64, "first", score=segment),
    Entry("Mask2Former (QuerySegmenter)", "HuggingFace", mask2former, 64, "first", score=segment),
    Entry("Conditional DETR", "HuggingFace", conditional_detr, 256, "tokens", score=lambda out: out.logits[:, 3, 1]),
    Entry(
        "DETR at 320 (100 encoder tokens = 100 queries)",
        "HuggingFace",
        detr,
        320,
        "tokens",
        score=lambda out: out.logits[:, 7, 2],
    ),
]


def yolo11n() -> nn.Module:
    """Ultralytics' yolo11n from its yaml (random weights), its finest level's class biases raised to detect."""
    from explain.models.yolo import load_yolo

    model = load_yolo("yolo11n.yaml")
    with torch.no_grad():
        model.model.model[-1].cv3[0][-1].bias += 11.0
    return model


ULTRALYTICS = [Entry("YOLO11n (yaml)", "Ultralytics", yolo11n, 256, "first", score=first_detection)]

ZOO = TIMM + TORCHVISION + HUGGINGFACE + ULTRALYTICS


def logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def scores_of(output: Any) -> torch.Tensor:
    """The tensor of scores the explained score is read from."""
    return output["out"] if isinstance(output, dict) and "out" in output else logits(output)


class SignedGradCAM(explain.GradCAM):
    """Grad-CAM without its final ReLU: random weights often give maps below zero, which would compare as flat."""

    relu = False


def random_heads(model: nn.Module) -> nn.Module:
    """Linear layers that start at zero (timm's MLP-Mixer and ResMLP heads, torchvision's ViT head) drawn at random:
    a zero head makes every score constant."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and not module.weight.any():
                nn.init.normal_(module.weight, std=0.02)
    return model


def per_position(t: torch.Tensor, layout: str, prefix: int) -> torch.Tensor:
    """One image's layer output as (positions, channels), positions in row-major order."""
    if layout == "first":
        return t.flatten(1).T
    if layout == "last":
        return t.flatten(0, -2)
    return t[prefix:]


def reference(model: nn.Module, x: torch.Tensor, layer: str, score, entry: Entry) -> tuple[torch.Tensor, dict]:
    """Grad-CAM at one layer from plain hooks and autograd, per position, and the automatic layer's rules."""
    module_name, _, key = layer.partition(":")
    module = model.get_submodule(module_name)
    kept: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, inputs: Any, output: Any) -> Any:
        entry = int(key) if key.isdigit() and isinstance(output, (list, tuple)) else key or None
        value = output[entry] if key else output
        kept["a"] = value
        copy = value.clone()  # the model may modify its copy in place (DenseNet's ReLU); the kept value stays
        if not key:
            return copy
        if isinstance(output, tuple):
            return type(output)(copy if i == entry else v for i, v in enumerate(output))
        output[entry] = copy
        return output

    handle = module.register_forward_hook(keep)
    try:
        with torch.no_grad():
            model(torch.rand_like(x) * 4 - 2)
            other = kept["a"].clone()
        output = model(x)
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(score(output).sum(), kept["a"], allow_unused=True)
    a = kept["a"].detach()[0].double()
    g = torch.zeros_like(a) if grad is None else grad[0].double()
    prefix = entry.prefix(model)
    if a.dim() != (2 if entry.layout == "tokens" else 3):
        raise ValueError(f"{layer} outputs {tuple(a.shape)}, not the family's {entry.layout} layout")
    a, g = per_position(a, entry.layout, prefix), per_position(g, entry.layout, prefix)
    cam = (a * g.mean(dim=0)).sum(dim=1)  # signed: random weights often give maps below zero
    transform = getattr(model, "transform", None)
    if isinstance(transform, (Letterbox, GeneralizedRCNNTransform)):  # a detector: its map covers its canvas
        boxed = transform(x) if isinstance(transform, Letterbox) else transform(list(x))[0]
        (top, left), (height, width) = getattr(boxed, "offset", (0, 0)), boxed.image_sizes[0]
        grid = cam.reshape(1, 1, *kept["a"].shape[-2:])
        canvas = F.interpolate(grid, size=boxed.tensors.shape[-2:], mode="bilinear", align_corners=False)
        cam = canvas[0, 0, top : top + height, left : left + width].flatten()  # the image, cut out of the canvas
    rules = {
        "varies": not torch.equal(other, kept["a"].detach()),
        "not the scores": scores_of(output) is not kept["a"],
        "reached": bool(g.ne(0).any()),
    }
    return cam, rules


def correlation(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's r; for a flat map (every position alike: LeViT's last 2 x 2 tokens), 1 if the maps agree
    within float32's precision, else 0."""
    if got.std() > 0 and expected.std() > 0:
        return float(torch.corrcoef(torch.stack([got, expected]))[0, 1])
    return float(torch.allclose(got, expected, rtol=1e-4, atol=1e-6 * float(expected.abs().max())))


def check(entry: Entry) -> str:
    """The entry's table row."""
    torch.manual_seed(0)
    try:
        model = random_heads(entry.build().eval())
        x = torch.randn(1, 3, entry.size, entry.size)
        if entry.score is None:
            with torch.no_grad():
                top = int(logits(model(x)).argmax(dim=1))
            score = lambda out: logits(out)[:, top]  # noqa: E731
        else:
            score = entry.score
        start = time.perf_counter()
        fused = explain.GradCAM(model)(x, score)
        seconds = time.perf_counter() - start
        layers = fused.layer.split("+")
        rs, broken = [], []
        for layer in layers:
            expected, rules = reference(model, x, layer, score, entry)
            if len(layers) > 1 and not rules["reached"]:  # a detection reaches one pyramid level; the others are 0
                continue
            raw = SignedGradCAM(model, layer)(x, score, resize=False, normalize=False).raw[0].flatten().double()
            broken += [f"{layer}: {rule}" for rule, held in rules.items() if not held]
            if expected.shape != raw.shape:
                raise ValueError(f"{layer}: {raw.numel()} positions, the reference {expected.numel()}")
            rs.append(correlation(raw, expected))
        layout = explain.core.layers.traced_layers(model, x)[layers[0]].layout.describe()
        r = min(rs)
        verdict = "ok" if r >= 0.999 and not broken else "**check**: " + "; ".join(broken or [f"r {r:.4f}"])
        shown = " + ".join(f"`{layer}`" for layer in layers)
        return f"| {entry.name} | {entry.source} | {shown} | {layout} | {r:.4f} | {seconds:.2f} | {verdict} |"
    except Exception as err:  # a row of the table says what failed; the sweep goes on
        reason = (str(err).splitlines() or ["(no message)"])[0][:160].replace("|", "/")
        return f"| {entry.name} | {entry.source} | | | | | **error**: {type(err).__name__}: {reason} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated entry names (default: all)")
    parser.add_argument("--out", help="write the table here as well")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    chosen = [e for e in ZOO if not args.only or e.name in args.only.split(",")]
    lines = [
        f"Grad-CAM at the automatic layer, random weights, batch 1, torch {torch.__version__}, timm "
        f"{timm.__version__}, transformers {transformers.__version__} ({len(chosen)} architectures). r: Pearson "
        "correlation with the reference, position by position; time: the first call (the layout trace and the "
        "automatic layer's probe included).",
        "",
        "| architecture | source | automatic layer | layout | r | time (s) | rules |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for entry in chosen:
        row = check(entry)
        print(row, flush=True)
        lines.append(row)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
