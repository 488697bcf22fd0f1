"""Shared fixtures: seeded random-weight models, an independent Grad-CAM reference, photos."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torch import nn

ASSETS = Path(__file__).resolve().parents[1] / "assets"
# A HuggingFace vision transformer small enough for the suite: 32 x 32 inputs, 8-pixel patches, two layers.
TINY_HF = {
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
}
CAT, COFFEE = ASSETS / "chelsea.png", ASSETS / "coffee.png"

# Under pytest-xdist each worker is a process of its own: the cores are shared out among the workers, rather than
# each running as many threads as there are cores; the processes a test starts run with its worker's threads, so
# that what they compute rounds as the worker's own computation does.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(THREADS)
    os.environ["OMP_NUM_THREADS"] = str(THREADS)


def seeded(name: str, **kwargs) -> nn.Module:
    """A torchvision model with seeded random weights, in eval mode."""
    torch.manual_seed(0)
    return torchvision.models.get_model(name, **kwargs).eval()


def smoothed(model: nn.Module) -> nn.Module:
    """The model with its kinks taken out, in place: every ReLU a GELU, every max pool an average pool of the same
    window. Its gradients are then smooth functions of the input, so two computations of them (batched otherwise,
    another CPU's convolution kernels) agree to rounding, where a ReLU network's may fall on either side of a kink."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, (nn.ReLU, nn.ReLU6)):
                setattr(parent, name, nn.GELU())
            elif isinstance(child, nn.MaxPool2d):
                setattr(parent, name, nn.AvgPool2d(child.kernel_size, child.stride, child.padding))
    return model


def random_segmenter(num_classes: int = 4) -> nn.Module:
    """LR-ASPP with seeded random weights, in eval mode; without the heads' biases no class wins everywhere."""
    torch.manual_seed(0)
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=num_classes
    )
    with torch.no_grad():
        model.classifier.low_classifier.bias.zero_()
        model.classifier.high_classifier.bias.zero_()
    return model.eval()


def vgg_with_norms() -> nn.Module:
    """VGG-11 with batch norms, random weights and batch-norm statistics, in eval mode: what LRP's composites
    merge and rule (tests/test_lrp.py, tests/test_concepts.py)."""
    torch.manual_seed(0)
    model = torchvision.models.vgg11_bn(num_classes=10).eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.normal_(m.running_mean, std=0.3)
            nn.init.uniform_(m.running_var, 0.5, 2.0)
            nn.init.normal_(m.bias, std=0.3)
            nn.init.uniform_(m.weight, 0.5, 1.5)
    return model


def random_detector(calibration: tuple[int, int], masks: bool = False, **options) -> nn.Module:
    """Faster R-CNN (MobileNetV3-FPN) with seeded random weights, in eval mode: BatchNorm calibrated on random
    images of the ``calibration`` size and the box head damped, so that the random network gives several
    distinct detections with unsaturated scores. ``options`` go to torchvision's builder. With ``masks``, a
    Mask R-CNN on the same backbone."""
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, **options
    )
    if masks:
        model = torchvision.models.detection.MaskRCNN(
            model.backbone, rpn_anchor_generator=model.rpn.anchor_generator, **options
        )
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = None
    torch.manual_seed(3)
    with torch.no_grad():
        model.backbone.train()(torch.rand(8, 3, *calibration))
        model.roi_heads.box_predictor.cls_score.weight *= 0.05
        model.roi_heads.box_predictor.bbox_pred.weight *= 0.05
    return model.eval()


def capture_score(model: nn.Module, x: torch.Tensor, layer: str, score, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's activations and the gradient of ``score(output)`` summed over images, float64, without the library
    (``kwargs`` go to the model's forward).

    A plain forward hook keeps the layer's output and hands a copy on, so later
    in-place operations of the model cannot alter what is kept; the gradient is
    plain ``torch.autograd.grad`` with respect to the kept output.
    """
    kept = {}

    def keep(module, inputs, output):
        kept["a"] = output
        return output.clone()

    handle = model.get_submodule(layer).register_forward_hook(keep)
    try:
        output = model(x, **kwargs)
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(score(output).sum(), kept["a"])
    return kept["a"].detach().double(), grad.double()


def capture(model: nn.Module, x: torch.Tensor, layer: str, targets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`capture_score` of the logit of one class per image."""
    return capture_score(model, x, layer, lambda logits: logits[range(len(targets)), targets])


def reference_gradcam(model: nn.Module, x: torch.Tensor, layer: str, targets: list[int]) -> torch.Tensor:
    """Grad-CAM written from the paper, without the library: raw (N, h, w) maps in float64."""
    activations, gradients = capture(model, x, layer, targets)
    maps = []
    for a, g in zip(activations, gradients):
        weights = [g[c].sum() / g[c].numel() for c in range(g.shape[0])]
        total = sum(w * a[c] for c, w in enumerate(weights))
        maps.append(total.clamp(min=0))
    return torch.stack(maps)


def hook_count(model: nn.Module) -> int:
    """Number of hooks of every kind on every module of the model."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return sum(len(getattr(m, kind)) for m in model.modules() for kind in kinds)


def square(path: Path, side: int) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB").resize((side, side), Image.Resampling.BICUBIC))


@pytest.fixture(scope="session")
def lite0():
    """The bundled EfficientNet-Lite0 with its real ImageNet weights."""
    from explain.models import load_model

    return load_model("efficientnet_lite0")


@pytest.fixture(scope="session")
def composite() -> np.ndarray:
    """The cat photo beside the coffee photo, each resized to a 224 x 224 square: 224 x 448 x 3."""
    return np.concatenate([square(CAT, 224), square(COFFEE, 224)], axis=1)


def manifest(out: Path) -> list[dict]:
    """The records of an output folder's manifest; its first line must be the run's header."""
    lines = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert "header" in lines[0] and all("header" not in line for line in lines[1:])
    return lines[1:]
