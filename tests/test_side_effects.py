"""The user's model is theirs: no hooks, flags, gradients or buffers changed by any call."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torchvision
from conftest import hook_count, seeded
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import explain
from explain.targets import ClassTarget, DetectionTarget, RegressionTarget, SegmentationTarget, SimilarityTarget


def snapshot(model: nn.Module) -> dict:
    return {
        "hooks": hook_count(model),
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grad": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "inplace": [m.inplace for m in model.modules() if isinstance(m, nn.ReLU)],
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["hooks"] == 0 == before["hooks"]
    assert after["training"] == before["training"]
    assert after["requires_grad"] == before["requires_grad"]
    assert after["inplace"] == before["inplace"]
    for old, new in zip(before["grad"], after["grad"]):
        assert (old is None and new is None) or torch.equal(old, new)
    for old, new in zip(before["buffers"], after["buffers"]):
        assert torch.equal(old, new)


def prepared(name: str, train: bool) -> nn.Module:
    """A model with mixed state: some frozen parameters, some existing .grad, mixed training flags."""
    model = seeded(name, num_classes=10)
    model.train(train)
    params = list(model.parameters())
    params[0].requires_grad_(False)
    params[1].grad = torch.randn_like(params[1])
    next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d)).train(not train)
    return model


CONTEXTS = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize(
    ("name", "layer"), [("resnet18", "layer3"), ("resnet18", "layer4.1.bn2"), ("mobilenet_v3_small", None)]
)
def test_success_leaves_model_unchanged(name: str, layer: str | None, train: bool, context: str) -> None:
    model = prepared(name, train)
    before = snapshot(model)
    with CONTEXTS[context]():
        x = torch.randn(2, 3, 64, 64)
        cams = explain.gradcam(model, x, layer, [1, 2])
    assert cams.shape == (2, 64, 64) and not cams.isnan().any()
    assert_unchanged(model, before)


class Exploding(nn.Module):
    """A resnet18 whose forward raises after the target layer has run."""

    def __init__(self) -> None:
        super().__init__()
        self.body = seeded("resnet18", num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.body(x)
        raise RuntimeError("exploded after the forward")


@pytest.mark.parametrize("train", [False, True])
def test_failed_calls_leave_model_unchanged(train: bool) -> None:
    model = Exploding()
    model.train(train)
    model.body.fc.weight.grad = torch.ones_like(model.body.fc.weight)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="exploded"):
        explain.gradcam(model, torch.randn(2, 3, 64, 64), "body.layer4")
    assert_unchanged(model, before)

    plain = prepared("resnet18", train)
    before = snapshot(plain)
    with pytest.raises(explain.TargetError):
        explain.gradcam(plain, torch.randn(2, 3, 64, 64), "layer4", 99)
    with pytest.raises(explain.LayerError):
        explain.gradcam(plain, torch.randn(2, 3, 64, 64), "fc")
    assert_unchanged(plain, before)


def test_train_mode_uses_batch_statistics_but_restores_running_stats() -> None:
    model = seeded("resnet18", num_classes=10).train()
    x = torch.randn(4, 3, 64, 64)
    train_cams = explain.gradcam(model, x, "layer3", 1, normalize=False, resize=False)
    eval_cams = explain.gradcam(model.eval(), x, "layer3", 1, normalize=False, resize=False)
    assert not torch.allclose(train_cams, eval_cams)
    assert model.bn1.num_batches_tracked.item() == 0


ROLLOUTS = ["attention_rollout", "gradient_rollout", "legrad", "chefer"]  # for transformers: tested below


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("method", [name for name in explain.METHODS if name not in ROLLOUTS])
def test_every_method_leaves_model_unchanged_on_success_and_failure(method: str, train: bool) -> None:
    model = prepared("resnet18", train)  # in-place ReLUs, which Guided Backpropagation switches for its call
    assert any(m.inplace for m in model.modules() if isinstance(m, nn.ReLU))
    layer = "layer4" if method in ("cam", "dff") else "layer2"  # CAM and DFF need the layer the classifier reads
    if method in ("lrp", "attnlrp", "cplrp") or not explain.METHODS[method].reads_layer:
        layer = None  # the relevance at the input, through every batch norm; the others read no layer
    before = snapshot(model)
    if method in ("fullgrad", "lrp", "attnlrp", "cplrp"):  # a batch norm in training mode (one is, either way): refused
        with pytest.raises(explain.LayerError, match=r"call model\.eval"):
            explain.cam(model, torch.randn(2, 3, 32, 32), method, layer, [1, 2])
        assert_unchanged(model, before)
        model.eval()
        before = snapshot(model)
    side = 64 if method == "dff" else 32  # DFF's five concepts need more positions than layer4's 1 x 1 of 32
    with torch.no_grad():
        cams = explain.cam(model, torch.randn(2, 3, side, side), method, layer, [1, 2])
    assert cams.shape[0] == 2 and cams.shape[-2:] == (side, side) and not cams.isnan().any()
    with pytest.raises(explain.TargetError):
        explain.cam(model, torch.randn(2, 3, side, side), method, layer, 99)
    assert_unchanged(model, before)


def with_state(model: nn.Module) -> nn.Module:
    """A model in eval mode with some frozen parameters and some existing .grad."""
    params = list(model.parameters())
    params[0].requires_grad_(False)
    params[-1].grad = torch.randn_like(params[-1])
    return model.eval()


def segmentation_case() -> tuple:
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=4
    )
    return model, SegmentationTarget(background=0), SegmentationTarget(0, mask=torch.zeros(64, 64))


def detection_case() -> tuple:
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=3,
        min_size=96,
        max_size=128,
        box_score_thresh=0.0,
        box_detections_per_img=3,
    )
    return model, DetectionTarget(score_threshold=0.0), DetectionTarget(torch.tensor([[0.0, 0.0, 1.0, 1.0]]), [1])


def similarity_case() -> tuple:
    model = seeded("resnet18")
    model.fc = nn.Identity()
    return model, SimilarityTarget(torch.randn(512)), SimilarityTarget(torch.randn(3, 512))


# Each builds (model, a target that succeeds, a target that fails after the forward).
TASK_CASES = {
    "segmentation": segmentation_case,
    "detection": detection_case,
    "regression": lambda: (seeded("resnet18", num_classes=1), RegressionTarget(sign=-1), RegressionTarget(index=3)),
    "multilabel": lambda: (seeded("resnet18", num_classes=20), ClassTarget([3, 7], score="sigmoid"), ClassTarget([3])),
    "similarity": similarity_case,
}


@pytest.mark.parametrize("case", list(TASK_CASES))
def test_every_target_leaves_model_unchanged_on_success_and_failure(case: str) -> None:
    torch.manual_seed(0)
    model, good, bad = TASK_CASES[case]()
    model = with_state(model)
    x = torch.randn(2, 3, 64, 64)
    before = snapshot(model)
    result = explain.GradCAM(model)(x, good)
    assert result.cams.shape[0] == 2 and torch.isfinite(result.cams).all()
    with pytest.raises(explain.TargetError):
        explain.GradCAM(model)(x, bad)
    assert_unchanged(model, before)


def transformers() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "timm": VisionTransformer(img_size=32, patch_size=8, embed_dim=24, depth=2, num_heads=2, num_classes=10),
        "torchvision": torchvision.models.VisionTransformer(
            image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=10
        ),
    }


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("kind", ["timm", "torchvision"])
@pytest.mark.parametrize("method", ROLLOUTS)
def test_rollouts_leave_transformers_unchanged_on_success_and_failure(method: str, kind: str, train: bool) -> None:
    """The per-head-weights pre-hook on nn.MultiheadAttention and the hooks on timm's attention last one call."""
    model = transformers()[kind].train(train)
    nn.init.normal_(list(model.parameters())[-2], std=0.5)  # torchvision's head starts at zero
    params = list(model.parameters())
    params[0].requires_grad_(False)
    params[1].grad = torch.randn_like(params[1])
    before = snapshot(model)
    cams = explain.cam(model, torch.randn(2, 3, 32, 32), method, None, [1, 2])
    assert cams.shape == (2, 32, 32) and not cams.isnan().any()
    with pytest.raises(explain.TargetError):
        explain.cam(model, torch.randn(2, 3, 32, 32), method, None, 99)
    assert_unchanged(model, before)
