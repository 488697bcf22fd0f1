"""Grad-CAM against an independent reference, and the engine's options."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from conftest import reference_gradcam, seeded
from torch import nn

import explain
from explain.core.maps import normalize_maps, postprocess
from explain.targets import ClassTarget

CASES = [
    # model, layer, input side: a plain last stage, a conv whose output an in-place ReLU
    # overwrites, a BatchNorm whose output an in-place add overwrites, a Hardswish
    # stage, and features followed by a functional in-place ReLU.
    ("resnet18", "layer4", 96),
    ("vgg11", "features.18", 64),
    ("resnet18", "layer4.1.bn2", 96),
    ("mobilenet_v3_small", "features", 96),
    ("densenet121", "features", 96),
]


@pytest.mark.parametrize(("name", "layer", "side"), CASES)
def test_raw_maps_match_reference(name: str, layer: str, side: int) -> None:
    model = seeded(name, num_classes=10)
    torch.manual_seed(1)
    x = torch.randn(3, 3, side, side)
    targets = [9, 4, 6]
    expected = reference_gradcam(model, x, layer, targets)
    assert (expected.flatten(1).amax(1) > 0).all(), "reference maps must not be trivially zero"

    got = explain.gradcam(model, x, layer, targets, resize=False, normalize=False)

    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert (got.double() - expected).abs().max().item() <= 1e-5


def test_normalized_output_shape_range_and_device() -> None:
    model = seeded("resnet18", num_classes=10)
    x = torch.randn(2, 3, 80, 96)
    cams = explain.gradcam(model, x, "layer4")
    assert cams.shape == (2, 80, 96) and cams.dtype == torch.float32 and cams.device == x.device
    assert cams.min().item() == 0.0 and cams.max().item() == 1.0
    raw = explain.gradcam(model, x, "layer4", resize=False, normalize=False)
    upsampled = torch.nn.functional.interpolate(raw[:, None], size=(80, 96), mode="bilinear", align_corners=False)[:, 0]
    lo, hi = upsampled.amin((1, 2), keepdim=True), upsampled.amax((1, 2), keepdim=True)
    torch.testing.assert_close(cams, (upsampled - lo) / (hi - lo))


def test_flat_map_becomes_zeros_not_nan() -> None:
    flat = torch.zeros(2, 7, 7)
    flat[1] = 3.0
    out = postprocess(flat, 2, (14, 14), normalize=True)
    assert torch.equal(out, torch.zeros(2, 14, 14))
    ramp = torch.arange(4.0).reshape(1, 2, 2)
    assert torch.equal(normalize_maps(ramp, 2), ramp / 3)


def test_targets_by_index_name_sequence_tensor_and_callable() -> None:
    model = seeded("resnet18", num_classes=4)
    labels = ["ant", "bee", "cat", "dog"]
    x = torch.randn(2, 3, 64, 64)
    cam = explain.GradCAM(model, "layer4", labels=labels)
    by_index = cam(x, 2)
    assert by_index.class_indices.tolist() == [2, 2]
    assert torch.equal(cam(x, "cat").raw, by_index.raw)
    assert torch.equal(cam(x, "CAT").raw, by_index.raw)
    assert torch.equal(cam(x, [2, 2]).raw, by_index.raw)
    assert torch.equal(cam(x, torch.tensor([2, 2])).raw, by_index.raw)
    by_callable = cam(x, lambda logits: logits[:, 2])
    assert by_callable.class_indices is None and by_callable.probabilities is None
    torch.testing.assert_close(by_callable.raw, by_index.raw)

    top = cam(x)
    logits = model(x).detach()
    assert top.class_indices.tolist() == logits.argmax(1).tolist()
    torch.testing.assert_close(top.probabilities, logits.softmax(1).amax(1))
    torch.testing.assert_close(top.scores, logits.amax(1))


class Wrapped(nn.Module):
    """resnet18 whose scores come wrapped as many hub models return them: a dict, a tuple, an object."""

    def __init__(self, wrap) -> None:
        super().__init__()
        self.net = seeded("resnet18", num_classes=5)
        self.wrap = wrap

    def forward(self, x: torch.Tensor):
        return self.wrap(self.net(x))


class ModelOutput:
    """Like HuggingFace's outputs: fields, the scores in ``.logits``."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.hidden = logits, logits * 2


def test_wrapped_outputs_are_read_when_unambiguous() -> None:
    x = torch.randn(2, 3, 64, 64)
    reference = explain.GradCAM(Wrapped(lambda t: t).net, "layer4")(x, 3)
    for wrap in (lambda t: {"logits": t, "aux": t}, lambda t: {"out": t}, lambda t: (t, t * 2), ModelOutput):
        model = Wrapped(wrap)
        result = explain.GradCAM(model, "net.layer4")(x, 3)
        assert result.class_indices.tolist() == [3, 3] and result.logits is None
        torch.testing.assert_close(result.raw, reference.raw)
        torch.testing.assert_close(result.probabilities, reference.probabilities)
    ambiguous = Wrapped(lambda t: {"first": t, "second": t * 2})
    with pytest.raises(explain.TargetError, match="dict with keys 'first', 'second'; pick the scores with output="):
        explain.gradcam(ambiguous, x, "net.layer4")
    picked = explain.GradCAM(ambiguous, "net.layer4")(x, ClassTarget(3, output="first"))
    torch.testing.assert_close(picked.raw, reference.raw)
    by_callable = explain.GradCAM(ambiguous, "net.layer4")(x, lambda out: out["first"][:, 3])
    assert by_callable.class_indices is None and by_callable.probabilities is None
    torch.testing.assert_close(by_callable.raw, reference.raw)
    with pytest.raises(explain.TargetError, match="3 target scores for a batch of 2"):
        explain.gradcam(ambiguous, x, "net.layer4", lambda out: out["first"][0, :3])


def test_topk_gives_one_map_per_class_equal_to_single_targets() -> None:
    model = seeded("resnet18", num_classes=6)
    x = torch.randn(2, 3, 64, 64)
    cam = explain.GradCAM(model, "layer4")
    result = cam(x, topk=3)
    assert result.cams.shape == (2, 3, 64, 64) and result.class_indices.shape == (2, 3)
    for k in range(3):
        single = cam(x, result.class_indices[:, k].tolist())
        torch.testing.assert_close(result.raw[:, k], single.raw)


def test_target_errors() -> None:
    model = seeded("resnet18", num_classes=4)
    x = torch.randn(2, 3, 64, 64)
    cam = explain.GradCAM(model, "layer4", labels=["ant", "bee", "cat", "dog"])
    with pytest.raises(explain.TargetError, match="out of range"):
        cam(x, 4)
    with pytest.raises(explain.TargetError, match="did you mean: cat"):
        cam(x, "cta")
    with pytest.raises(explain.TargetError, match="2 images"):
        cam(x, [1, 2, 3])
    with pytest.raises(explain.TargetError, match="labels"):
        explain.gradcam(model, x, "layer4", "cat")


def test_automatic_layer() -> None:
    cases = {
        "resnet18": "layer4",
        "vgg11": "features",  # not the adaptive pool, which resamples the 2x2 map to 7x7
        "densenet121": "features",
        "mobilenet_v3_small": "features",
    }
    for name, expected in cases.items():
        cam = explain.GradCAM(seeded(name, num_classes=5))
        result = cam(torch.randn(2, 3, 64, 64))
        assert result.layer == expected == cam.layer


def test_automatic_layer_is_searched_once_per_input_shape() -> None:
    model = seeded("resnet18", num_classes=5)
    images = []
    counter = model.register_forward_pre_hook(lambda m, inputs: images.append(inputs[0].shape[0]))
    try:
        for side in (64, 64, 96):
            explain.gradcam(model, torch.randn(3, 3, side, side))
    finally:
        counter.remove()
    # For each new input shape, one one-image forward, the layouts' trace; the call's own pass records the last
    # candidates and settles the automatic layer from their gradients: no probe, no content check on noise.
    assert images == [1, 3, 3, 1, 3]


def test_unknown_layer_lists_real_candidates() -> None:
    """The hint names layers with spatial outputs at x's size, never a linear head or a pooled vector."""
    model = seeded("efficientnet_b0", num_classes=5)
    x = torch.randn(1, 3, 64, 64)
    with pytest.raises(explain.LayerError, match=r"unknown layer 'layer4'") as caught:
        explain.GradCAM(model, "layer4")(x)
    hint = str(caught.value).split("the last are ")[1].split(" (")[0].split(", ")
    outputs = {}

    def keep(name, module, inputs, output) -> None:
        outputs[name] = output.shape

    handles = [m.register_forward_hook(partial(keep, n)) for n, m in model.named_modules()]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    assert len(hint) == 6 and hint[-1] == "features"  # the layers nearest the output, in order
    assert all(len(outputs[name]) == 4 and min(outputs[name][-2:]) > 1 for name in hint)
    with pytest.raises(explain.LayerError, match=r"unknown layer 'layer5'.*closest are layer4"):
        explain.GradCAM(seeded("resnet18"), "layer5")(x)
    with pytest.raises(explain.LayerError, match="not a submodule"):
        explain.GradCAM(seeded("resnet18"), nn.Conv2d(1, 1, 1))(x)


def test_layer_given_as_module() -> None:
    model = seeded("resnet18", num_classes=5)
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(explain.gradcam(model, x, model.layer4), explain.gradcam(model, x, "layer4"))


class Shared(nn.Module):
    """Applies one conv twice, so its activation and gradient would be ambiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(self.conv(x)).mean((2, 3)))


def test_shared_module_is_refused() -> None:
    with pytest.raises(explain.LayerError, match="more than once"):
        explain.gradcam(Shared(), torch.randn(2, 3, 8, 8), "conv")


def test_layer_that_is_not_a_feature_map_or_not_used() -> None:
    model = seeded("resnet18", num_classes=5)
    with pytest.raises(explain.LayerError, match=r"outputs \(5,\), not a map of the image .* reshape="):
        explain.gradcam(model, torch.randn(2, 3, 64, 64), "fc")

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.side = nn.Conv2d(3, 3, 1)
            self.head = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.side(x)
            return self.head(x.mean((2, 3)))

    with pytest.raises(explain.LayerError, match="does not depend"):
        explain.gradcam(Unused(), torch.randn(2, 3, 8, 8), "side")


def test_bad_input_is_a_clear_error() -> None:
    model = seeded("resnet18")
    with pytest.raises(explain.ExplainError, match=r"x has shape \(3, 64, 64\), a batch of signals .* x\[None\]"):
        explain.gradcam(model, torch.randn(3, 64, 64))
    with pytest.raises(explain.ExplainError, match=r"\(N, C, H, W\) or volumes .* got shape \(64, 64\)"):
        explain.gradcam(model, torch.randn(64, 64))
    with pytest.raises(explain.ExplainError, match=r"floating-point .* got dtype torch\.uint8"):
        explain.gradcam(model, torch.zeros(2, 3, 224, 224, dtype=torch.uint8))
    with pytest.raises(explain.ExplainError, match="got a ndarray"):
        explain.gradcam(model, np.zeros((2, 3, 64, 64), np.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    model = seeded("resnet18", num_classes=10)
    x = torch.randn(4, 3, 96, 96)
    on_cpu = explain.gradcam(model, x, "layer4.1.bn2", [1, 2, 3, 4], normalize=False)
    on_gpu = explain.gradcam(model.cuda(), x.cuda(), "layer4.1.bn2", [1, 2, 3, 4], normalize=False)
    assert on_gpu.device.type == "cuda"
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, atol=1e-4, rtol=1e-3)


def test_a_method_of_its_own_recording_is_its_class_alone() -> None:
    """A new method that records elsewhere than its layers' outputs declares a Recording in its needs and holds
    only its formula: here the input of layer4's first block, recorded by a forward pre-hook, weighted Grad-CAM's
    way; its map is Grad-CAM's at the module whose output that input is (layer3), computed independently."""
    from explain.core.engine import CAM, Capture, Needs
    from explain.core.hooks import Hooks
    from explain.core.layouts import Layout
    from explain.core.recording import Recording

    class BlockInput:
        def __init__(self, module: nn.Module) -> None:
            self.modules, self.name, self._hooks = {"layer4.0": module}, "layer4.0 input", Hooks()
            self.activations: dict[str, torch.Tensor] = {}

        def __enter__(self) -> BlockInput:
            self._hooks.forward_pre(self.modules["layer4.0"], self._keep)
            return self

        def __exit__(self, *exc: object) -> None:
            self._hooks.remove()

        def _keep(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            self.leaf = args[0].detach().requires_grad_(True)
            self.activations = {self.name: self.leaf.detach()}
            return (self.leaf,)

        def forward(self, model, x):
            return model(x)

        def backward(self, score, create_graph=False, rescore=None):
            return {self.name: torch.autograd.grad(score, self.leaf, retain_graph=True)[0]}

    class Inputs(Recording):
        searched = False

        def layers(self, method, x, model_kwargs, goal):
            return [("layer4.0 input", None)]

        def recorder(self, method, modules):
            return BlockInput(method.model.layer4[0])

        def layout(self, method, name, activation, geometry, known):
            return Layout("channels_first")

    class BlockInputCAM(CAM):
        name = "block-input-cam"
        needs = Needs(records=Inputs(), whole_backward=True)

        def weights(self, capture: Capture) -> torch.Tensor:
            return capture.gradients.mean(dim=(2, 3))

    model = seeded("resnet18", num_classes=10)
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    got = BlockInputCAM(model)(x, [3, 8], resize=False, normalize=False)
    expected = reference_gradcam(model, x, "layer3", [3, 8])
    assert got.layer == "layer4.0 input" and (expected.flatten(1).amax(1) > 0).all()
    assert (got.raw.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
