"""The architectures whose automatic layer or layout used to be wrong: class-attention (CaiT, XCiT), token towers
(CrossViT), a ConvNeXt stage whose channel count equals its map's side, HuggingFace DETR, SegFormer, Swin and
ConvNeXt. Each map is checked against Grad-CAM written here with plain hooks and autograd, laid out by what the
architecture is known to be (its patch grid, its prefix tokens), never by explain's layout code."""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
import transformers
from conftest import capture_score, hook_count
from timm.models.cait import Cait
from timm.models.convnext import ConvNeXt
from timm.models.crossvit import CrossVit
from timm.models.hiera import Hiera
from timm.models.xcit import Xcit
from torch import nn

import explain
from explain.core.layers import find_auto_layers, traced_layers
from explain.errors import LayerError


def lay_out(t: torch.Tensor, layout: tuple) -> torch.Tensor:
    """A layer's output as (N, C, h, w), by a layout stated by hand: ("first",), ("last",) or ("tokens", prefix,
    (h, w))."""
    if layout[0] == "last":
        return t.permute(0, 3, 1, 2)
    if layout[0] == "tokens":
        _, prefix, grid = layout
        return t[:, prefix:].transpose(1, 2).reshape(len(t), t.shape[-1], *grid)
    return t


def reference(model: nn.Module, x: torch.Tensor, layer: str, score, layout: tuple) -> torch.Tensor:
    """Grad-CAM from its paper at one layer: (N, h, w), float64."""
    a, g = (lay_out(t, layout) for t in capture_score(model, x, layer, score))
    return (g.mean(dim=(2, 3), keepdim=True) * a).sum(dim=1).clamp(min=0)


def assert_matches(model: nn.Module, x: torch.Tensor, layer, score, layout: tuple) -> torch.Tensor:
    """explain's Grad-CAM at ``layer`` (a name, or None for the automatic one) equals the reference there, and
    leaves the model's hooks as they were (HuggingFace models add their own at their first forward)."""
    model(x[:1])
    hooks = hook_count(model)
    result = explain.GradCAM(model, layer)(x, score, resize=False, normalize=False)
    assert hook_count(model) == hooks
    expected = reference(model, x, result.layer, score, layout)
    assert result.raw.shape == expected.shape and expected.abs().max() > 0
    assert (result.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    return result.raw


def logit(c: int):
    return lambda logits: logits[:, c]


def test_class_attention_is_recognised_and_its_heads_are_never_maps() -> None:
    """CaiT: the talking-heads projections (T, T, heads) and the attention dropout are attention, whatever their
    class is called; the automatic layer is the input of the last class-attention block, since the final norm's
    patch tokens never reach the head."""
    torch.manual_seed(0)
    model = Cait(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, depth_token_only=2, num_classes=5)
    x = torch.randn(2, 3, 32, 32)
    infos = traced_layers(model.eval(), x)
    listed = [name for name, info in infos.items() if info.candidate]
    assert not [name for name in listed if ".attn." in name]  # proj_l, proj_w, attn_drop, q, k, v: none
    assert "attention" in infos["blocks.0.attn.proj_l"].refusal
    assert find_auto_layers(model, x) == ["blocks_token_only.1.norm1"]
    assert_matches(model, x, None, logit(3), ("tokens", 1, (4, 4)))


def test_cross_covariance_attention_is_never_a_map() -> None:
    """XCiT: its attention is (heads, d, d) over channels; its class-attention blocks read the patch tokens."""
    torch.manual_seed(0)
    model = Xcit(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, cls_attn_layers=1, num_classes=5)
    x = torch.randn(2, 3, 32, 32)
    infos = traced_layers(model.eval(), x)
    assert not infos["blocks.0.attn.attn_drop"].candidate  # (2, 16, 16) would fit a 32 x 32 image
    assert find_auto_layers(model, x) == ["cls_attn_blocks.0.norm1"]
    assert_matches(model, x, None, logit(1), ("tokens", 1, (4, 4)))


def test_token_towers_give_one_map_each_fused() -> None:
    """CrossViT: two branches on grids of their own, side by side to the end: one layer each, fused."""
    torch.manual_seed(0)
    model = CrossVit(
        img_size=48, patch_size=(12, 16), embed_dim=(16, 32), depth=((1, 1, 0),), num_heads=(2, 2), num_classes=5
    ).eval()
    x = torch.randn(2, 3, 48, 48)
    layers = find_auto_layers(model, x)
    assert len(layers) == 2
    grids = {traced_layers(model, x)[name].layout.grid for name in layers}
    assert grids == {(4, 4), (3, 3)}
    result = explain.GradCAM(model)(x, 2)
    assert result.layer == "+".join(layers) and result.cams.shape == (2, 48, 48)


def square_convnext() -> nn.Module:
    """A ConvNeXt whose first stage has 24 channels on a 24 x 24 map at 96 px: both readings fit by size."""
    torch.manual_seed(0)
    return ConvNeXt(depths=(1, 1, 1, 1), dims=(24, 32, 48, 64), num_classes=5, conv_mlp=False).eval()


@pytest.mark.parametrize(
    ("layer", "layout"),
    [("stages.0", ("first",)), ("stages.0.blocks.0.mlp", ("last",)), ("stages.0.blocks.0.norm", ("last",))],
)
def test_channels_first_or_last_is_read_from_the_model_not_from_sizes(layer: str, layout: tuple) -> None:
    """The stage ends on a Linear (the old rule read it channels last); its output is channels first, since the
    next stage's norm and convolution read axis 1. Its MLP's output, read by a permute, is channels last."""
    model = square_convnext()
    x = torch.randn(2, 3, 96, 96)
    assert_matches(model, x, layer, logit(2), layout)


class Ambiguous(nn.Module):
    """A convolution whose (N, 16, 16, 16) output is the model's: nothing reads it, so nothing tells its layout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_a_layout_nothing_tells_is_refused_with_the_way_out() -> None:
    torch.manual_seed(0)
    model, x = Ambiguous().eval(), torch.randn(1, 3, 16, 16)
    score = lambda out: out[:, 3].mean((1, 2))  # noqa: E731
    with pytest.raises(LayerError, match="reshape="):
        explain.GradCAM(model, "conv")(x, score)
    explained = explain.GradCAM(model, "conv", reshape=lambda t: t)(x, score, resize=False, normalize=False)
    expected = reference(model, x, "conv", score, ("first",))
    assert (explained.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


LEVELS = ["stage2", "stage3", "stage4"]  # the pyramid a multi-scale detector reads


def tiny_resnet(
    levels: list[str] | None = None, kind: type = transformers.ResNetConfig
) -> transformers.PretrainedConfig:
    """A four-stage ResNet config of 16 to 128 channels, the backbone of the small detectors here."""
    return kind(
        embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], out_features=levels or ["stage4"]
    )


def tiny_detr() -> nn.Module:
    torch.manual_seed(0)
    backbone = tiny_resnet()
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
    return transformers.DetrForObjectDetection(config).eval()


def test_detr_is_explained_at_its_encoder_not_at_the_position_embedding() -> None:
    """At 320 px the encoder's map is 10 x 10 = 100 tokens, as many as the object queries: the queries, which
    were never a grid, are refused; the sine position embedding, the same for every image, is no map."""
    model = tiny_detr()
    x = torch.randn(2, 3, 320, 320)
    score = lambda out: out.logits[:, 7, 2]  # noqa: E731
    infos = traced_layers(model, x)
    embedding = next(info for name, info in infos.items() if "position_embedding" in name and info.shape)
    assert not embedding.varies
    queries = [info for name, info in infos.items() if name.startswith("model.decoder.layers.") and info.shape]
    assert queries and all(info.shape[0] != 100 or not info.candidate for info in queries)
    (layer,) = find_auto_layers(model, x, target=score)
    assert layer.startswith("model.encoder")
    maps = assert_matches(model, x, None, score, ("tokens", 0, (10, 10)))
    assert torch.corrcoef(maps.flatten(1))[0, 1] < 0.99  # two images, two maps


def test_segformer_is_explained_before_its_decode_head() -> None:
    torch.manual_seed(0)
    config = transformers.SegformerConfig(
        num_labels=4, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1], num_attention_heads=[1, 1, 1, 1]
    )
    config.decoder_hidden_size = 16
    model = transformers.SegformerForSemanticSegmentation(config).eval()
    x = torch.randn(2, 3, 64, 64)
    score = lambda out: out.logits[:, 1].mean((1, 2))  # noqa: E731
    (layer,) = find_auto_layers(model, x, target=score)
    assert not layer.startswith("decode_head") and traced_layers(model, x)[layer].map_shape == (32, 2, 2)
    assert_matches(model, x, None, score, ("first",))


def test_huggingface_swin_and_convnext_are_explained_where_the_classifier_reads() -> None:
    """HF Swin: not the reshaped copy kept for ``output_hidden_states``; HF ConvNeXt: not an output entry the
    pooler never reads."""
    torch.manual_seed(0)
    swin = transformers.SwinForImageClassification(
        transformers.SwinConfig(
            image_size=64, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4, num_labels=5
        )
    ).eval()
    x = torch.randn(2, 3, 64, 64)
    assert_matches(swin, x, None, lambda out: out.logits[:, 1], ("tokens", 0, (8, 8)))
    convnext = transformers.ConvNextForImageClassification(
        transformers.ConvNextConfig(hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1], num_labels=5)
    ).eval()
    (layer,) = find_auto_layers(convnext, x)
    assert ":" not in layer  # a module, not an entry of an output
    assert_matches(convnext, x, None, lambda out: out.logits[:, 1], ("first",))


def test_timm_hierarchical_tokens_are_laid_out_stage_by_stage() -> None:
    """LeViT shrinks its token grid (8 x 8, 4 x 4, 2 x 2 at 128 px) by slicing a reshaped view of its tokens:
    the last stage's 2 x 2 tokens are the map, not the convolutional stem."""
    torch.manual_seed(0)
    model = timm.create_model("levit_128s", num_classes=5, img_size=128).eval()
    with torch.no_grad():
        nn.init.normal_(model.head.linear.weight)  # timm's small initial head leaves maps of ~1e-6
    x = torch.randn(2, 3, 128, 128)
    assert find_auto_layers(model, x) == ["stages"]
    assert traced_layers(model, x)["stages.1"].layout.grid == (4, 4)
    assert_matches(model, x, None, logit(1), ("tokens", 0, (2, 2)))


def test_hiera_unrolled_tokens_are_laid_out_on_their_grid() -> None:
    """Hiera keeps its tokens unrolled (windows contiguous, strides moved to the batch axis) until its last stage,
    and pools them by max over groups: each stage is laid out on its grid, as Hiera's own reroll says."""
    torch.manual_seed(0)
    model = Hiera(img_size=(128, 128), embed_dim=16, num_heads=1, stages=(1, 1, 2, 1), num_classes=5).eval()
    with torch.no_grad():
        nn.init.normal_(model.head.fc.weight)  # timm's small initial head
    x = torch.randn(2, 3, 128, 128)
    layers = traced_layers(model, x)
    assert [layers[f"blocks.{i}"].layout.grid for i in range(5)] == [(32, 32), (16, 16), (8, 8), (8, 8), (4, 4)]
    assert layers["blocks.2"].layout.order is not None and layers["blocks.4"].layout.order is None
    assert find_auto_layers(model, x) == ["blocks.4"]
    assert_matches(model, x, None, logit(1), ("tokens", 0, (4, 4)))

    result = explain.GradCAM(model, "blocks.2")(x, logit(1), resize=False, normalize=False)
    a, g = (model.reroll(t, 2).permute(0, 3, 1, 2) for t in capture_score(model, x, "blocks.2", logit(1)))
    expected = (g.mean(dim=(2, 3), keepdim=True) * a).sum(dim=1).clamp(min=0)
    assert expected.abs().max() > 0
    assert (result.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_detr_queries_are_explained_as_detections_in_image_pixels() -> None:
    """QueryDetector: each query a detection (no NMS), its box in input pixels, its score the model's class
    probability; DetectionTarget explains one query at the encoder's map, as the reference does."""
    model = tiny_detr()
    with torch.no_grad():
        model.class_labels_classifier.bias[2] += 4.0  # random weights: make class 2 the queries' answer
    detector = explain.models.QueryDetector(model).eval()
    x = torch.randn(1, 3, 320, 256)
    with torch.no_grad():
        plain = model(pixel_values=x)
        (found,) = detector(x)
    assert len(found["scores"]) == 100 and (found["labels"] == 2).all()
    torch.testing.assert_close(found["scores"], plain.logits.softmax(-1)[0, :, 2])
    cx, cy, w, h = plain.pred_boxes[0, 7].tolist()
    expected_box = torch.tensor([(cx - w / 2) * 256, (cy - h / 2) * 320, (cx + w / 2) * 256, (cy + h / 2) * 320])
    torch.testing.assert_close(found["boxes"][7], expected_box)

    target = explain.targets.DetectionTarget(boxes=found["boxes"][7:8], labels=[2])
    result = explain.GradCAM(detector)(x, target, resize=False, normalize=False)
    assert result.layer.startswith("model.model.encoder") and result.target.boxes[0, 0].tolist() == pytest.approx(
        expected_box.tolist(), abs=1e-3
    )
    expected = reference(detector, x, result.layer, lambda out: out[0]["scores"][7:8], ("tokens", 0, (10, 8)))
    assert (result.raw[:, 0].double() - expected).abs().max() <= 1e-4 * expected.abs().max()  # float32 softmax
    every = explain.GradCAM(detector)(x, explain.targets.DetectionTarget(score_threshold=0.5))
    assert every.cams.shape[:2] == (1, int((found["scores"] >= 0.5).sum()))


def test_a_head_whose_output_the_model_only_flattens_is_the_head() -> None:
    """SqueezeNet's classifier ends on a map of class scores, pooled and flattened into the output by the model's
    forward: that map is the head's, and the automatic layer is the last feature map before it."""
    torch.manual_seed(0)
    model = torchvision.models.squeezenet1_1(num_classes=5).eval()
    x = torch.randn(1, 3, 96, 96)
    infos = traced_layers(model, x)
    assert infos["classifier.1"].candidate and infos["classifier.1"].head and not infos["features"].head
    assert find_auto_layers(model, x) == ["features"]


class PassesItsOutputOn(nn.Module):
    """A map passed on through calls that return the tensor itself (``contiguous()``, ``float()``), then pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).contiguous().float().to(x.dtype).mean((2, 3)))


def test_calls_that_return_their_own_tensor_are_followed_once() -> None:
    torch.manual_seed(0)
    model, x = PassesItsOutputOn().eval(), torch.randn(2, 3, 16, 16)
    assert find_auto_layers(model, x) == ["conv"]
    assert_matches(model, x, None, logit(1), ("first",))


def sigmoid_query_detector(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, dict]:
    """The model wrapped in QueryDetector, and its detections of x's one image, whose scores must be the sigmoid
    of the model's logits, each query's largest."""
    detector = explain.models.QueryDetector(model).eval()
    with torch.no_grad():
        (found,) = detector(x)
        logits = model(pixel_values=x).logits
    torch.testing.assert_close(found["scores"], logits.sigmoid()[0].amax(dim=-1))
    return detector, found


def test_conditional_detr_scores_by_sigmoid_and_modifies_its_head_in_place() -> None:
    """Conditional DETR has no "no object" class (its scores are sigmoids) and adds to its box head's output in
    place, after the row-restricted layers explain puts there: its maps match the reference."""
    torch.manual_seed(0)
    backbone = tiny_resnet()
    config = transformers.ConditionalDetrConfig(
        use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False, d_model=32,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=20, num_labels=5,
    )  # fmt: skip
    model = transformers.ConditionalDetrForObjectDetection(config).eval()
    x = torch.randn(1, 3, 128, 160)
    detector, found = sigmoid_query_detector(model, x)
    target = explain.targets.DetectionTarget(found["boxes"][3:4], [int(found["labels"][3])])
    result = explain.GradCAM(detector)(x, target, resize=False, normalize=False)
    expected = reference(detector, x, result.layer, lambda out: out[0]["scores"][3:4], ("tokens", 0, (4, 5)))
    assert (result.raw[:, 0].double() - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_the_default_target_of_a_detr_names_the_way_to_explain_it() -> None:
    with pytest.raises(explain.TargetError, match=r"QueryDetector.*DetectionTarget\(\)"):
        explain.GradCAM(tiny_detr())(torch.randn(1, 3, 128, 128))


def test_upernet_is_explained_at_its_backbone_not_its_decode_head() -> None:
    """UperNet upsamples its decode head's logits to the input in its forward: that head is still the head."""
    torch.manual_seed(0)
    backbone = transformers.ConvNextConfig(
        hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1], out_features=["stage1", "stage2", "stage3", "stage4"]
    )
    config = transformers.UperNetConfig(
        backbone_config=backbone, hidden_size=16, auxiliary_channels=8, num_labels=4, use_auxiliary_head=False
    )
    model = transformers.UperNetForSemanticSegmentation(config).eval()
    x = torch.randn(2, 3, 64, 64)
    score = lambda out: out.logits[:, 2].mean((1, 2))  # noqa: E731
    (layer,) = find_auto_layers(model, x, target=score)
    assert layer.startswith("backbone") and traced_layers(model, x)["decode_head"].head
    assert_matches(model, x, None, score, ("first",))


def test_mask2former_answers_as_a_segmenter_and_is_explained_at_its_mask_features() -> None:
    """QuerySegmenter: Mask2Former's semantic scores as its post-processing defines them (the queries' class
    probabilities without "no object", times their mask probabilities), at the input's size; SegmentationTarget
    explains a class over its region at the pixel decoder's mask features, never at the mask logits."""
    torch.manual_seed(0)
    backbone = transformers.SwinConfig(
        embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=4, image_size=64,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )  # fmt: skip
    config = transformers.Mask2FormerConfig(
        backbone_config=backbone, num_labels=4, hidden_dim=32, mask_feature_size=32, feature_size=32,
        encoder_layers=1, decoder_layers=2, num_queries=10, encoder_feedforward_dim=64, dim_feedforward=64,
        num_attention_heads=2,
    )  # fmt: skip
    model = transformers.Mask2FormerForUniversalSegmentation(config).eval()
    segmenter = explain.models.QuerySegmenter(model).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        plain, scores = model(pixel_values=x), segmenter(x)["out"]
    masks = nn.functional.interpolate(plain.masks_queries_logits, size=(64, 64), mode="bilinear").sigmoid()
    classes = plain.class_queries_logits.softmax(-1)[..., :-1]
    expected = (classes[..., None, None] * masks[:, :, None]).sum(dim=1)  # (N, classes, H, W), query by query
    torch.testing.assert_close(scores.exp(), expected)
    processed = transformers.Mask2FormerImageProcessor().post_process_semantic_segmentation(plain, [(64, 64)] * 2)
    agree = (torch.stack(processed) == scores.argmax(dim=1)).float().mean()
    assert agree >= 0.95  # the processor upsamples to 384 px first: the same classes but at a few borders

    layers = traced_layers(segmenter, x)
    assert layers["model:masks_queries_logits"].head and layers["model:class_queries_logits"].head
    label = int(scores[0].argmax(dim=0).flatten().mode().values)
    result = explain.GradCAM(segmenter)(x[:1], explain.targets.SegmentationTarget(label), resize=False, normalize=False)
    assert result.layer == "model.model.pixel_level_module.decoder.mask_projection"
    region = (scores[:1].argmax(dim=1) == label).double()
    expected = reference(
        segmenter, x[:1], result.layer, lambda out: (out["out"][:, label] * region).sum((1, 2)), ("first",)
    )
    assert (result.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def deformable_detr() -> nn.Module:
    backbone = tiny_resnet(LEVELS)
    options = dict(
        use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False, d_model=32, encoder_layers=1,
        decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        num_queries=20, num_labels=5, num_feature_levels=3,
    )  # fmt: skip
    return transformers.DeformableDetrForObjectDetection(transformers.DeformableDetrConfig(**options))


def rt_detr() -> nn.Module:
    backbone = tiny_resnet(LEVELS, transformers.RTDetrResNetConfig)
    config = transformers.RTDetrConfig(
        backbone_config=backbone, use_pretrained_backbone=False, encoder_in_channels=[32, 64, 128], d_model=32,
        encoder_hidden_dim=32, encoder_ffn_dim=32, decoder_ffn_dim=32, decoder_layers=1, num_queries=20, num_labels=5,
        encoder_attention_heads=2, decoder_attention_heads=2, decoder_in_channels=[32, 32, 32],
    )  # fmt: skip
    return transformers.RTDetrForObjectDetection(config)


@pytest.mark.parametrize(
    ("build", "one_sequence"), [(deformable_detr, True), (rt_detr, False)], ids=["deformable_detr", "rt_detr"]
)
def test_multi_scale_query_detectors_are_explained_at_a_map_of_theirs(build, one_sequence: bool) -> None:
    """Deformable DETR and RT-DETR (sigmoid scores) read a pyramid. Deformable DETR's encoder flattens its levels
    one after another into one sequence, which is no grid: it is never a map, and the automatic layer is a level's
    map. RT-DETR's encoder attends within its coarsest level alone, whose tokens are a grid."""
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(1, 3, 128, 160)
    detector, found = sigmoid_query_detector(model, x)
    if one_sequence:
        infos = traced_layers(detector, x).items()
        encoder = [info for name, info in infos if ".encoder.layers." in name and info.shape and len(info.shape) == 2]
        assert encoder and not any(info.candidate for info in encoder)
    target = explain.targets.DetectionTarget(found["boxes"][:1], [int(found["labels"][0])])
    result = explain.GradCAM(detector)(x, target, resize=False, normalize=False)
    expected = reference(detector, x, result.layer, lambda out: out[0]["scores"][:1], ("first",))
    assert (result.raw[:, 0].double() - expected).abs().max() <= 1e-4 * expected.abs().max()
