"""Models as users hold them: compiled, wrapped, scripted, traced, quantized, of another dtype than their input,
left in training mode. Each gives the plain eager model's map (r >= 0.999), the user's own layer names accepted,
or is refused in one line that says why; on a small CNN and a small ViT. The concepts and the metrics take the held
models as the methods do."""

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
    up = explain.GradCAM(model, layer)(x.to(dtype))  # a low-precision input to a float32 model: cast up
    cast = explain.GradCAM(model, layer)(x.to(dtype).float()).cams
    assert up.cams.dtype == torch.float32 and r(up.cams, cast) > 0.999
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


USER_FILE = '''
import timm, torch, torchvision, transformers

def vit():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=32, patch_size=8,
                             depth=2)

def resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=4)

def hf():
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=8, num_labels=3, id2label={0: "cat", 1: "dog", 2: "cup"},
                                    label2id={"cat": 0, "dog": 1, "cup": 2})
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(config)

def grey():
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))
'''


@pytest.mark.parametrize(
    ("name", "size", "mean", "labels", "said"),
    [("vit", 32, (0.5, 0.5, 0.5), ["class 0"], "timm pretrained_cfg"),
     ("resnet", 224, (0.485, 0.456, 0.406), ["class 0"], "ImageNet's 224 x 224"),
     ("hf", 32, (0.485, 0.456, 0.406), ["cat", "dog", "cup"], "HuggingFace config")],
)  # fmt: skip
def test_a_users_file_that_returns_a_plain_module_runs_as_the_model_says(name, size, mean, labels, said, tmp_path,
                                                                         capsys) -> None:  # fmt: skip
    """The command line reads a plain module's preprocessing and class names from what it says of itself (or says
    in one note that it took ImageNet's), and writes the map the API gives for that preprocessing."""
    import numpy as np
    from conftest import CAT
    from PIL import Image

    from explain.cli import main
    from explain.io.images import load_image
    from explain.io.render import overlay
    from explain.models import load_model

    pytest.importorskip("transformers")
    source = tmp_path / "mine.py"
    source.write_text(USER_FILE)
    out = tmp_path / "out"
    assert main([str(CAT), "--model", f"{source}:{name}", "-o", str(out), "--quiet", "--format", "png"]) == 0
    note = capsys.readouterr().err.strip()
    assert note.count("\n") == 0 and "note" in note and said in note
    spec = load_model(f"{source}:{name}")
    assert spec.preprocessing.input_size == size and spec.preprocessing.mean == mean
    assert spec.labels[: len(labels)] == labels
    image = load_image(CAT)
    cam = explain.GradCAM(spec.model)(spec.preprocess(image)).cams[0]
    written = np.asarray(Image.open(out / "chelsea.gradcam.png"), dtype=np.int16)
    assert np.abs(written - np.asarray(overlay(image, cam), dtype=np.int16)).max() <= 1


def test_a_users_module_that_reads_other_than_three_channels_is_refused_in_one_line(tmp_path, capsys) -> None:
    from conftest import CAT

    from explain.cli import main

    source = tmp_path / "mine.py"
    source.write_text(USER_FILE)
    assert main([str(CAT), "--model", f"{source}:grey", "-o", str(tmp_path / "out"), "--quiet"]) != 0
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "a Conv2d of 1 channels, not an image's 3 channels" in error


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_torch_export_s_module_is_refused_and_its_unflattened_module_gives_the_eager_map(family: str) -> None:
    """An exported program's module() runs the graph's operations, calling none of its layers: refused in one
    line naming the way out; torch.export.unflatten's module runs its layers, and gives the eager map (a CNN's), or
    is refused where its tokens' grid is flattened by operations explain does not read (a ViT's: pass reshape=)."""
    build, layer, _ = FAMILIES[family]
    model, x = build(), batch(family)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))  # any batch
    with pytest.raises(explain.ExplainError, match=r"calls none of its layers.*torch.export.unflatten") as refused:
        explain.GradCAM(program.module(), layer)(x)
    assert "\n" not in str(refused.value)
    if family == "vit":  # its tokens' grid is flattened by aten operations explain does not read: refused
        with pytest.raises(explain.LayerError, match=r"did not flatten from a grid.*reshape="):
            explain.GradCAM(torch.export.unflatten(program), layer)(x)
        return
    unflattened = explain.GradCAM(torch.export.unflatten(program), layer)(x)
    assert r(unflattened.cams, explain.GradCAM(model, layer)(x).cams) >= 0.999


HELD_FILE = '''
import torch, torchvision

def eager():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=4).eval()

def compiled():
    return torch.compile(eager(), backend="eager")

def data_parallel():
    return torch.nn.DataParallel(eager())

def bfloat16():
    return eager().to(torch.bfloat16)

def scripted():
    return torch.jit.script(eager())
'''


@pytest.mark.parametrize("held", ["compiled", "data_parallel", "bfloat16", "scripted"])
def test_the_command_line_explains_a_held_model_from_a_users_file_as_the_eager_one(held: str, tmp_path,
                                                                                   capsys) -> None:  # fmt: skip
    """The command line on a user's file returning the model held otherwise: the eager model's overlay, layer
    names as the user names them, or (TorchScript) one line that says why."""
    import numpy as np
    from conftest import CAT
    from PIL import Image

    from explain.cli import main

    source = tmp_path / "held.py"
    source.write_text(HELD_FILE)
    eager, out = tmp_path / "eager", tmp_path / "out"
    assert main([str(CAT), "--model", f"{source}:eager", "--layer", "layer4", "-o", str(eager), "--quiet",
                 "--format", "png"]) == 0  # fmt: skip
    code = main([str(CAT), "--model", f"{source}:{held}", "--layer", "layer4", "-o", str(out), "--quiet",
                 "--format", "png"])  # fmt: skip
    if held == "scripted":
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert code != 0 and "TorchScript module" in error and "eager model" in error
        return
    assert code == 0
    ours, theirs = (np.asarray(Image.open(folder / "chelsea.gradcam.png"), dtype=np.int16) for folder in (out, eager))
    difference = np.abs(ours - theirs)  # bfloat16's map, computed in bfloat16, moves a few colour levels
    assert difference.max() <= (8 if held == "bfloat16" else 1) and difference.mean() <= 1


def held(model: torch.nn.Module, way: str) -> tuple[torch.nn.Module, str]:
    """The model as a user may hold it, and the prefix its own layer names then carry."""
    if way == "compiled":
        return torch.compile(model, backend="eager"), "_orig_mod."
    if way == "data_parallel":
        return torch.nn.DataParallel(model), "module."
    return model.to(torch.bfloat16), ""


def tcav_scores(model: torch.nn.Module, layer: str, x: torch.Tensor) -> list[tuple[float, float]]:
    """TCAV's score and magnitude of a darkened-image concept for classes 0 to 3 (the random network's derivatives
    point up for some, down for others)."""
    from explain.concepts import TCAV

    concept, examples, random = x[:4] * 0.5, x[:4], torch.cat([x, x])[:6]
    found = [TCAV(model, layer, runs=2)(examples, concept, random, c) for c in range(4)]
    return [(t.score, t.magnitude) for t in found]


@pytest.mark.parametrize("way", ["compiled", "data_parallel", "bfloat16"])
def test_concepts_and_metrics_take_a_held_model_as_the_eager_one(way: str) -> None:
    """CRAFT's maps of one concept bank, CRP's concept maps, TCAV's directional derivatives and a metric's scores:
    on the held model as on the eager one (its own layer names accepted), a bfloat16 one given float32 images."""
    from explain.concepts import ConceptRelevance, Craft

    x = torch.rand(6, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    eager = cnn()
    bank = Craft(eager, "layer4", concepts=3, crop=None, iterations=20).fit(x)
    concepts, maps = torch.eye(512)[:3], explain.gradcam(eager, x[:2])
    expected = {
        "craft": Craft(eager, "layer4", concepts=3, crop=None).maps(bank, x[:2]),
        "crp": ConceptRelevance(eager, "layer4", concepts=concepts)(x[:2], 0).maps,
        "tcav": tcav_scores(eager, "layer4", x),
        "deletion": explain.metrics.deletion(eager, x[:2], maps, 0, steps=8, score="logit").curve,
    }
    model, prefix = held(cnn(), way)
    for layer in {"layer4", prefix + "layer4"}:
        found = {
            "craft": Craft(model, layer, concepts=3, crop=None).maps(bank, x[:2]),
            "crp": ConceptRelevance(model, layer, concepts=concepts)(x[:2], 0).maps,
            "tcav": tcav_scores(model, layer, x),
            "deletion": explain.metrics.deletion(model, x[:2], maps, 0, steps=8, score="logit").curve,
        }
        assert found.pop("tcav") == expected["tcav"], layer
        for name, values in found.items():
            close = 0.999 if way == "bfloat16" else 0.99999
            assert values.shape == expected[name].shape and r(values, expected[name]) >= close, (name, layer)
