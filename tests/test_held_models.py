"""Models as users hold them: compiled, wrapped, scripted, traced, quantized, of another dtype than their input,
left in training mode. Each gives the plain eager model's map (r >= 0.999), the user's own layer names accepted,
or is refused in one line that says why; on a small CNN and a small ViT."""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision

import explain

timm = pytest.importorskip("timm")


def cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).eval()


def vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8,
                             depth=2).eval()  # fmt: skip


FAMILIES = {"cnn": (cnn, "layer4", 96), "vit": (vit, "blocks.0", 32)}


def batch(family: str) -> torch.Tensor:
    side = FAMILIES[family][2]
    return torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1))


def r(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten().float(), b.flatten().float()]))[0, 1])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("held", ["compiled", "data_parallel"])
def test_a_wrapped_model_takes_the_users_layer_names_and_gives_the_eager_map(family: str, held: str) -> None:
    build, layer, _ = FAMILIES[family]
    model, x = build(), batch(family)
    eager = explain.GradCAM(model, layer)(x).cams
    wrapped = torch.compile(model, backend="eager") if held == "compiled" else torch.nn.DataParallel(model)
    prefix = "_orig_mod." if held == "compiled" else "module."
    for name in (layer, prefix + layer):
        found = explain.GradCAM(wrapped, name)(x)
        assert found.layer == name and r(found.cams, eager) >= 0.999
    assert not model._forward_hooks and not model._backward_hooks


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("way", ["script", "trace"])
def test_a_torchscript_module_is_refused_naming_the_eager_model(family: str, way: str) -> None:
    model, x = FAMILIES[family][0](), batch(family)
    try:
        held = torch.jit.script(model) if way == "script" else torch.jit.trace(model, x)
    except Exception:  # timm's ViT does not script: nothing a user could hold
        pytest.skip(f"{family} does not {way}")
    with pytest.raises(explain.ExplainError, match=r"TorchScript module.*runs no Python hooks.*eager model") as refused:
        explain.GradCAM(held)(x)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_input_of_another_dtype_is_cast_to_the_models(family: str, dtype: torch.dtype) -> None:
    build, layer, _ = FAMILIES[family]
    model, x = build(), batch(family)
    low = build().to(dtype)
    same = explain.GradCAM(low, layer)(x.to(dtype)).cams.float()  # the input already of the model's dtype
    found = explain.GradCAM(low, layer)(x)
    assert found.cams.dtype == torch.float32 and r(found.cams, same) >= 0.999
    assert r(found.cams, explain.GradCAM(model, layer)(x).cams) >= 0.99  # and near the float32 model's


def test_a_quantized_model_is_refused_with_the_true_reason() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(cnn(), {torch.nn.Linear}, dtype=torch.qint8)
    with pytest.raises(explain.ExplainError, match=r"quantized.*'fc'.*carry no gradient.*float model"):
        explain.GradCAM(quantized, "layer4")(batch("cnn"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_model_in_training_mode_is_explained_as_it_is_with_one_warning(family: str) -> None:
    build, layer, _ = FAMILIES[family]
    model, x = build(), batch(family)
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explain.GradCAM(model, layer)(x)
    varying = [w for w in caught if "training mode" in str(w.message)]
    if family == "vit" and not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        assert not varying  # nothing in it acts otherwise in training: no warning
    else:
        assert len(varying) == 1 and "model.eval()" in str(varying[0].message)
        assert "\n" not in str(varying[0].message)
    assert model.training
