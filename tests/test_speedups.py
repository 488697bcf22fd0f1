"""The speedups apart from the meaning: with ``EXPLAIN_SPEEDUPS=0`` the engine computes its maps by plain autograd
and plain forwards, and every family's maps and layers are the same as with the speedups on (within 1e-5 of the
largest value). Each family is one whose passes a speedup changes: a CNN (folded scoring forwards, channels-last,
shared prefixes of masked copies), timm's and HuggingFace's transformers (rows a score reaches), an R-CNN (its kept
detections' box heads), YOLO (its head's windows), DETR, a segmenter, and a vision-language model's answer."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from conftest import CAT, random_detector, random_segmenter, seeded

import explain
from explain.core.speedups import SPEEDUPS, VARIABLE, enabled

transformers = pytest.importorskip("transformers")


def both_ways(monkeypatch, call) -> tuple[explain.CAMResult, explain.CAMResult]:
    """The result of ``call()`` with every speedup on, then with all of them off, each on a fresh model context."""
    monkeypatch.delenv(VARIABLE, raising=False)
    fast = call()
    monkeypatch.setenv(VARIABLE, "0")
    plain = call()
    monkeypatch.delenv(VARIABLE)
    return fast, plain


def assert_same(fast: explain.CAMResult, plain: explain.CAMResult, tolerance: float = 1e-5) -> None:
    """The same layer, and maps within ``tolerance`` of the largest value."""
    assert fast.layer == plain.layer
    for name in ("cams", "raw"):
        a, b = getattr(fast, name), getattr(plain, name)
        scale = float(b.abs().max())
        assert scale > 0 and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=tolerance * scale)


def vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", num_classes=5, depth=2).eval()


def hf_swin() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.SwinConfig(
        image_size=64, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4, num_labels=5
    )
    return transformers.SwinForImageClassification(config).eval()


CLASSIFIERS = {
    "cnn": (lambda: seeded("resnet18", num_classes=5), (1, 3, 64, 64)),
    "vit": (vit, (1, 3, 224, 224)),
    "swin": (hf_swin, (1, 3, 64, 64)),
}
METHODS = ["gradcam", "gradcampp", "layercam", "saliency", "input_x_gradient", "fullgrad", "scorecam", "ablationcam",
           "occlusion", "rise"]  # fmt: skip
# Scoring forwards through batch norms folded into their convolutions round otherwise in float32: the perturbation
# methods' maps, differences of scores, agree to 1e-4 of their largest value (measured: 1.5e-5 for Occlusion).
SCORED = {"scorecam", "ablationcam", "occlusion", "rise"}


@pytest.mark.parametrize(
    ("family", "method"),  # the scoring forwards' speedups (folding, channels-last, shared prefixes) are a CNN's
    [(family, method) for family in CLASSIFIERS for method in METHODS if family == "cnn" or method not in SCORED],
)
def test_a_classifiers_maps_are_the_same_without_the_speedups(family, method, monkeypatch) -> None:
    build, shape = CLASSIFIERS[family]
    model, x = build(), torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    options = {"seed": 0} if "seed" in explain.methods.method_options(method) else {}
    if method in ("occlusion", "rise"):
        options |= {"batch_size": 64} | ({"masks": 64} if method == "rise" else {"window": 16, "stride": 16})

    def call() -> explain.CAMResult:
        explain.forget(model)
        return explain.create_method(method, model, **options)(x, 2)

    assert_same(*both_ways(monkeypatch, call), tolerance=1e-4 if method in SCORED else 1e-5)


def test_detectors_and_a_segmenter_are_the_same_without_the_speedups(monkeypatch) -> None:
    """An R-CNN (its box head at the kept detections), YOLO (its head's windows), DETR and LR-ASPP."""
    from test_architectures import tiny_detr
    from test_yolo import detecting

    photo = explain.load_image(CAT).resize((160, 128))
    x = torch.from_numpy(np.array(photo)).permute(2, 0, 1)[None].float() / 255
    yolo = detecting("yolo11n.yaml")
    yolo.max_det = 3
    # The R-CNN's kept detections run its box head as a smaller matrix product, which rounds otherwise in float32:
    # measured 2.6e-5 of the largest value on 43 detections (here its two most confident).
    cases = [
        (random_detector((128, 160), num_classes=91), x, explain.targets.DetectionTarget(score_threshold=0.99), 1e-4),
        (yolo, x, explain.targets.DetectionTarget(score_threshold=0.3), 1e-5),
        (explain.models.QueryDetector(tiny_detr()).eval(), x, explain.targets.DetectionTarget(score_threshold=0), 1e-5),
        (random_segmenter(4), (x - 0.5) / 0.25, explain.targets.SegmentationTarget(1), 1e-5),
    ]
    for model, given, target, tolerance in cases:
        for method in ("gradcam", "saliency"):

            def call(model=model, given=given, target=target, method=method) -> explain.CAMResult:
                explain.forget(model)
                return explain.create_method(method, model)(given, target)

            fast, plain = both_ways(monkeypatch, call)
            assert fast.cams.shape == plain.cams.shape and fast.cams.numel() > 0
            assert_same(fast, plain, tolerance)


def test_a_vision_language_answer_is_the_same_without_the_speedups(monkeypatch) -> None:
    from test_vision_language import PROMPT, image, tiny_llava

    model = tiny_llava()
    inputs = {"input_ids": PROMPT, "attention_mask": torch.ones_like(PROMPT), "pixel_values": image()}
    answer = torch.tensor([9, 11, 12])

    def call() -> explain.CAMResult:
        explain.forget(model)
        return explain.explain_answer(model, inputs, answer=answer).result

    assert_same(*both_ways(monkeypatch, call))


def test_each_speedup_has_its_own_switch(monkeypatch) -> None:
    monkeypatch.setenv(VARIABLE, "rows,folding")
    assert [name for name in SPEEDUPS if enabled(name)] == ["rows", "folding"]
    monkeypatch.setenv(VARIABLE, "0")
    assert not any(enabled(name) for name in SPEEDUPS)
    monkeypatch.delenv(VARIABLE)
    assert all(enabled(name) for name in SPEEDUPS)
    monkeypatch.setenv(VARIABLE, "rows,turbo")
    with pytest.raises(explain.ExplainError, match="no speedup 'turbo'; the speedups are rows, windows"):
        enabled("rows")


def small_cnn() -> torch.nn.Module:
    """A CNN with batch norms (what the scoring speedups fold), small enough for every perturbation method."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 5),
    ).eval()  # fmt: skip


def small_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", num_classes=5, depth=2, img_size=64).eval()


ZOO = {"cnn": small_cnn, "vit": small_vit, "swin": hf_swin}
# The fewest samples, masks, scales or segments each method takes, so that every one runs in well under a second.
FEWEST = {
    "sess": {"scales": (64,)}, "sscam": {"samples": 4}, "iscam": {"samples": 4}, "integrated_gradients": {"steps": 8},
    "gradient_shap": {"samples": 4}, "occlusion": {"window": 16, "stride": 16}, "rise": {"masks": 32},
    "lime": {"samples": 16, "segments": 8}, "kernel_shap": {"samples": 16, "segments": 8},
    "feature_ablation": {"segments": 8},
}  # fmt: skip


@pytest.mark.parametrize("method", list(explain.METHODS))
@pytest.mark.parametrize("family", list(ZOO))
def test_every_method_on_every_family_is_the_same_without_the_speedups_or_refused_in_one_line(
    family, method, monkeypatch
) -> None:
    """Never a crash: a finite map, the same with every speedup off, or the same one-line refusal both ways."""
    model, x = ZOO[family](), torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    options = FEWEST.get(method, {}) | ({"seed": 0} if "seed" in explain.methods.method_options(method) else {})

    def call() -> explain.CAMResult | str:
        explain.forget(model)
        try:
            return explain.create_method(method, model, **options)(x, 2)
        except explain.ExplainError as err:
            assert "\n" not in str(err), str(err)
            return str(err)

    fast, plain = both_ways(monkeypatch, call)
    if isinstance(fast, str) or isinstance(plain, str):
        assert fast == plain
        return
    assert fast.layer == plain.layer
    tolerance = 1e-4 if method in SCORED | {"sscam", "iscam"} else 1e-5
    for a, b in ((fast.cams, plain.cams), (fast.raw, plain.raw)):  # a map may be zero: a score no mask moves
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=0, atol=tolerance * max(float(b.abs().max()), 1e-12))


@pytest.mark.parametrize("family", list(ZOO))
@pytest.mark.parametrize("images", [1, 2])
def test_the_automatic_layer_is_the_searchs_whether_the_pass_settles_it_or_not(family, images, monkeypatch) -> None:
    """One image on an unseen model: the trace's own forward settles the layer; two: the call's own pass among the
    last candidates; with ``layer_in_pass`` off, the search of every candidate. The same layer and maps each way,
    on the first call and on the next, which reads the remembered layer: one route, two speedups of it."""
    from explain.core import layers

    model = ZOO[family]()
    x = torch.randn(images, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    searches: list[int] = []
    search = layers.find_auto_layers
    monkeypatch.setattr(layers, "find_auto_layers", lambda *args: searches.append(1) or search(*args))

    def calls() -> list[explain.CAMResult]:
        explain.forget(model)
        return [explain.GradCAM(model)(x, 2) for _ in range(2)]

    monkeypatch.delenv(VARIABLE, raising=False)
    settled = calls()
    # settled by a pass, then remembered; a Swin's last tokens lie on several grids: only the search tells
    assert len(searches) == (family == "swin")
    searches.clear()
    monkeypatch.setenv(VARIABLE, ",".join(name for name in SPEEDUPS if name != "layer_in_pass"))
    searched = calls()
    assert len(searches) == 1  # searched once, then remembered
    for fast, plain in zip(settled, searched):
        assert_same(fast, plain)
