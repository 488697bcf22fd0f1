"""The recorder's two gradient paths: full-backward hook, and the tensor-hook fallback."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torchvision
from conftest import hook_count, reference_gradcam, seeded
from torch import nn

import explain
from explain.core.hooks import ActivationGradientRecorder, uses_tensor_hook
from explain.core.maps import normalize_maps, upsample

# (model, layer, whether PyTorch's full-backward hook can serve it)
PATHS = [
    ("resnet18", "layer4", True),
    ("vgg16", "features.28", False),  # followed by ReLU(inplace=True)
    ("resnet18", "layer4.1.bn2", False),  # followed by out += identity
]


@pytest.mark.parametrize(("name", "layer", "module_hook_works"), PATHS)
def test_path_chosen_and_result_matches_reference(name: str, layer: str, module_hook_works: bool) -> None:
    model = seeded(name, num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    cam = explain.GradCAM(model, layer)
    result = cam(x, [1, 8], resize=False, normalize=False)
    assert uses_tensor_hook(model, model.get_submodule(layer)) is (not module_hook_works)
    expected = reference_gradcam(model, x, layer, [1, 8])
    assert (result.raw.double() - expected).abs().max().item() <= 1e-5
    assert hook_count(model) == 0


def test_both_paths_record_the_same_activation_and_gradient() -> None:
    model = seeded("resnet18", num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    recorded = []
    for tensor_hook in (False, True):
        with torch.enable_grad(), explain.core.model_state.frozen_parameters(model):
            with ActivationGradientRecorder({"layer4": model.layer4}, tensor_hook) as recorder:
                logits = recorder.forward(model, x)
                grads = recorder.backward(logits[:, 3].sum())
            recorded.append((recorder.activations["layer4"], grads["layer4"]))
    (a0, g0), (a1, g1) = recorded
    assert torch.equal(a0, a1) and torch.equal(g0, g1)
    assert g0.abs().sum() > 0


def test_activation_is_the_output_before_a_later_inplace_change() -> None:
    model = seeded("resnet18", num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    kept = {}

    def keep(module, inputs, output) -> None:
        kept["out"] = output.detach().clone()

    handle = model.layer4[1].bn2.register_forward_hook(keep)
    with torch.no_grad():
        model(x)
    handle.remove()
    with (
        torch.enable_grad(),
        explain.core.model_state.frozen_parameters(model),
        ActivationGradientRecorder({"bn2": model.layer4[1].bn2}) as recorder,
    ):
        recorder.forward(model, x)
    assert recorder.tensor_hook
    assert torch.equal(recorder.activations["bn2"], kept["out"])


def test_inplace_clash_is_remembered_so_later_calls_run_one_forward() -> None:
    model = seeded("resnet18", num_classes=10)
    forwards = []
    x = torch.randn(2, 3, 64, 64)
    for _ in range(2):
        counter = model.register_forward_pre_hook(lambda m, i: forwards.append(1))
        explain.gradcam(model, x, "layer4.1.bn2")
        counter.remove()
        forwards.append("call")
    # The first call: no trace (the given layer's layout is read during the call's own forward); the clash costs one
    # forward, once.
    assert forwards == [1, 1, "call", 1, "call"]


def test_hooks_removed_when_the_forward_raises() -> None:
    model = seeded("resnet18", num_classes=10)
    with pytest.raises(RuntimeError), ActivationGradientRecorder({"layer4": model.layer4}) as recorder:
        recorder.forward(model, torch.randn(2, 5, 64, 64))  # wrong channel count
    assert hook_count(model) == 0


class Pyramid(nn.Module):
    """A backbone whose stage returns a dict of maps (like a feature pyramid) or a tuple, and a head over both."""

    def __init__(self, as_tuple: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.levels = Levels(as_tuple)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        levels = self.levels(torch.relu(self.stem(x)))
        fine, coarse = (levels[0], levels[1]) if isinstance(levels, tuple) else (levels["fine"], levels["coarse"])
        return self.head(torch.cat([fine.mean(dim=(2, 3)), coarse.amax(dim=(2, 3))], dim=1))


class Levels(nn.Module):
    def __init__(self, as_tuple: bool) -> None:
        super().__init__()
        self.fine = nn.Conv2d(8, 8, 3, padding=1)
        self.coarse = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.as_tuple = as_tuple

    def forward(self, x: torch.Tensor):
        fine, coarse = torch.relu(self.fine(x)), torch.relu(self.coarse(x))
        return (fine, coarse) if self.as_tuple else OrderedDict(fine=fine, coarse=coarse)


class DetectorBackbone(nn.Module):
    """torchvision's Faster R-CNN backbone (MobileNetV3 + FPN, random weights) under a small classifier head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        detector = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(weights=None, weights_backbone=None)
        self.backbone = detector.backbone
        self.head = nn.Linear(3 * 256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        levels = self.backbone(x)
        return self.head(torch.cat([level.mean(dim=(2, 3)) for level in levels.values()], dim=1))


ENTRY_CASES = [
    (lambda: Pyramid(), "levels", "fine"),
    (lambda: Pyramid(), "levels", "coarse"),
    (lambda: Pyramid(as_tuple=True), "levels", "0"),
    (lambda: Pyramid(as_tuple=True), "levels", "1"),
    (DetectorBackbone, "backbone.fpn", "0"),
]


@pytest.mark.parametrize(("make", "module", "key"), ENTRY_CASES)
def test_an_entry_of_a_dict_or_tuple_output_is_a_layer(make, module, key) -> None:
    model = make().eval()
    x = torch.randn(2, 3, 64, 64)
    kept = {}

    def keep(module, inputs, output):  # the reference: a plain hook that swaps in a tracked copy of the entry
        index = int(key) if isinstance(output, tuple) else key
        kept["a"] = output[index].clone().requires_grad_(True)
        if isinstance(output, tuple):
            return tuple(kept["a"] if i == index else t for i, t in enumerate(output))
        return OrderedDict((k, kept["a"] if k == index else t) for k, t in output.items())

    handle = model.get_submodule(module).register_forward_hook(keep)
    logits = model(x)
    handle.remove()
    (g,) = torch.autograd.grad(logits[range(2), [0, 2]].sum(), kept["a"])
    a = kept["a"].detach()
    expected = (g.mean(dim=(2, 3))[..., None, None] * a).sum(1).clamp(min=0)
    got = explain.GradCAM(model, f"{module}:{key}")(x, [0, 2], resize=False, normalize=False)
    assert expected.amax() > 0
    torch.testing.assert_close(got.raw, expected.float(), rtol=1e-5, atol=1e-6 * expected.amax().item())
    assert got.layer == f"{module}:{key}" and hook_count(model) == 0


def test_pyramid_levels_are_candidates_and_fuse() -> None:
    model = Pyramid().eval()
    x = torch.randn(2, 3, 16, 16)
    names = [info.name for info in explain.candidate_layers(model, x)]
    assert names[-2:] == ["levels:fine", "levels:coarse"]
    fused = explain.GradCAM(model, ["levels:fine", "levels:coarse"])(x, 1)
    assert fused.layer == "levels:fine+levels:coarse" and fused.cams.shape == (2, 16, 16)
    with pytest.raises(explain.LayerError, match=r"no tensor entry 'middle'; its entries: 'fine', 'coarse'"):
        explain.gradcam(model, x, "levels:middle")
    with pytest.raises(explain.LayerError, match="name an entry of a dict or list output"):
        explain.gradcam(model, x, "levels")


class TwoLevels(nn.Module):
    """A fine level, a coarse level computed from it through ``between``, and a score that reads each level
    through its own head; ``reads_coarse`` chooses whether the score reaches the coarse level."""

    def __init__(self) -> None:
        super().__init__()
        self.fine = nn.Conv2d(3, 4, 3, padding=1)
        self.between = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.coarse = nn.Conv2d(4, 4, 1)
        self.reads_coarse = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fine = self.fine(x)
        coarse = self.coarse(self.between(fine))
        score = fine.mean(dim=(2, 3))
        return score + coarse.mean(dim=(2, 3)) if self.reads_coarse else score


def test_a_layer_computed_from_another_target_layer_hands_no_zero_gradient_back() -> None:
    """A full-backward hook on the coarse level would hand a zero gradient back through ``between`` when the score
    reaches the fine level alone; once found downstream of the fine level, the coarse level's gradient is caught
    by a tensor hook, and ``between`` is not differentiated. The fused maps stay the references'."""
    torch.manual_seed(0)
    model, x = TwoLevels(), torch.randn(2, 3, 16, 16)
    reached: list[bool] = []

    def spy(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(lambda grad: reached.append(True))

    model.between.register_forward_hook(spy)
    for reads_coarse in (False, True):
        model.reads_coarse = reads_coarse
        cam = explain.GradCAM(model, ["fine", "coarse"])
        for _ in range(2):  # the first call finds the coarse level downstream
            reached.clear()
            result = cam(x, 1, normalize=False)
        assert reached == ([True] if reads_coarse else [])
        names = ("fine", "coarse") if reads_coarse else ("fine",)  # the coarse level's map is otherwise zero
        maps = [normalize_maps(upsample(reference_gradcam(model, x, name, [1, 1]), (16, 16)), 2) for name in names]
        torch.testing.assert_close(result.raw.double(), sum(maps) / 2, rtol=1e-5, atol=1e-6)
    assert len(model.between._forward_hooks) == 1  # the spy's alone
