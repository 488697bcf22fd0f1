"""The recorder's two gradient paths: full-backward hook, and the tensor-hook fallback."""

from __future__ import annotations

import pytest
import torch
from conftest import hook_count, reference_gradcam, seeded

import explain
from explain.hooks import ActivationGradientRecorder, uses_tensor_hook

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
    assert uses_tensor_hook(model.get_submodule(layer)) is (not module_hook_works)
    expected = reference_gradcam(model, x, layer, [1, 8])
    assert (result.raw.double() - expected).abs().max().item() <= 1e-5
    assert hook_count(model) == 0


def test_both_paths_record_the_same_activation_and_gradient() -> None:
    model = seeded("resnet18", num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    recorded = []
    for tensor_hook in (False, True):
        with torch.enable_grad(), explain.model_state.frozen_parameters(model):
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
        explain.model_state.frozen_parameters(model),
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
    assert forwards == [1, 1, "call", 1, "call"]  # the clash costs one forward, once


def test_hooks_removed_when_the_forward_raises() -> None:
    model = seeded("resnet18", num_classes=10)
    with pytest.raises(RuntimeError), ActivationGradientRecorder({"layer4": model.layer4}) as recorder:
        recorder.forward(model, torch.randn(2, 5, 64, 64))  # wrong channel count
    assert hook_count(model) == 0
