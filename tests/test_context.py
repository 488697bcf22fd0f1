"""The model's context: what explain learns about a model is dropped when the model changes (a module replaced, a
head swapped, a branch switched by an attribute), never used stale; ``explain.forget`` drops it; a model the user
lets go is freed. Each changed model's map is checked against the same model explained by a fresh copy (deep
copies share no context) or against a given layer's map."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torchvision
from torch import nn

import explain
from explain.core import layers
from explain.core.context import knows
from explain.errors import LayerError


class Branchy(nn.Module):
    """Two convolutions, the second run only while ``deep`` is set; two classes of the head read a side branch."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.deep = nn.Conv2d(8, 8, 3, padding=1)
        self.side = nn.Conv2d(8, 4, 3, padding=1)
        self.side_head = nn.Linear(4, 2)
        self.head = nn.Linear(8, 4)
        self.use_deep = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stem = torch.relu(self.stem(x))
        side = self.side_head(self.side(stem).mean((2, 3)))
        x = torch.relu(self.deep(stem)) if self.use_deep else stem
        return torch.cat([side, self.head(x.mean((2, 3)))[:, 2:]], dim=1)


def branchy() -> nn.Module:
    torch.manual_seed(0)
    return Branchy().eval()


def images() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 64, 64)


def fresh_maps(model: nn.Module, x: torch.Tensor, **options) -> explain.CAMResult:
    """The result of a copy of the model that explain has never seen."""
    return explain.GradCAM(copy.deepcopy(model), **options)(x, 3)


@pytest.fixture
def counted_traces(monkeypatch) -> list[int]:
    """Counts the layer traces run from here on."""
    calls: list[int] = []
    original = layers.trace_layers

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(layers, "trace_layers", counting)
    return calls


def test_a_replaced_stage_gets_a_fresh_trace_and_the_right_layer(counted_traces) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    x = images()
    method = explain.GradCAM(model)
    assert method(x, 3).layer == "layer4"
    assert len(counted_traces) == 1
    method(x, 3)
    assert len(counted_traces) == 1  # learned once
    model.layer4 = nn.Sequential(nn.Conv2d(256, 512, 1), nn.ReLU())  # a stage replaced
    result = method(x, 3)
    assert len(counted_traces) == 2 and result.layer in ("layer4", "layer4.1")
    torch.testing.assert_close(result.cams, fresh_maps(model, x).cams)


def test_a_swapped_head_is_explained_through_the_new_head() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    x = images()
    before = explain.GradCAM(model)(x, 3)
    model.fc = nn.Linear(512, 7)
    after = explain.GradCAM(model)(x, 6)
    expected = explain.GradCAM(copy.deepcopy(model))(x, 6)
    assert after.logits.shape == (2, 7) and before.logits.shape == (2, 5)
    torch.testing.assert_close(after.cams, expected.cams)
    torch.testing.assert_close(after.scores, expected.scores)


def test_a_branch_switched_by_an_attribute_gets_the_right_layer() -> None:
    model, x = branchy(), images()
    method = explain.GradCAM(model)
    assert method(x, 3).layer == "deep"
    model.use_deep = False
    result = method(x, 3)
    assert result.layer == "stem"
    torch.testing.assert_close(result.cams, fresh_maps(model, x).cams)
    torch.testing.assert_close(result.cams, explain.GradCAM(model, "stem")(x, 3).cams)


def test_a_given_layer_that_no_longer_runs_is_named_in_the_error() -> None:
    model, x = branchy(), images()
    method = explain.GradCAM(model, "deep")
    method(x, 3)
    model.use_deep = False
    with pytest.raises(LayerError, match="'deep' did not run"):
        method(x, 3)


def test_the_automatic_layer_is_kept_per_kind_of_target() -> None:
    """Classes 0 and 1 read the side branch alone: the score of a callable target on them reaches ``side``, not the
    layer the class target's search found; each kind gets its own."""
    model, x = branchy(), images()
    assert explain.GradCAM(model)(x, 3).layer == "deep"
    side = explain.GradCAM(model)(x, lambda output: output[:, 0])
    assert side.layer == "side"
    torch.testing.assert_close(side.cams, explain.GradCAM(model, "side")(x, lambda output: output[:, 0]).cams)


def test_a_cached_automatic_layer_the_target_does_not_reach_is_searched_again() -> None:
    """A class target of the same kind as an earlier call's that reaches other layers (here class 0, read by the
    side branch alone) gets its own layer, not a zero map or an error."""
    model, x = branchy(), images()
    assert explain.GradCAM(model)(x, 3).layer == "deep"
    result = explain.GradCAM(model)(x, 0)
    assert result.layer == "side"
    torch.testing.assert_close(result.cams, explain.GradCAM(model, "side")(x, 0).cams)


def test_forget_drops_what_was_learned(counted_traces) -> None:
    model, x = branchy(), images()
    explain.gradcam(model, x)
    assert knows(model) and len(counted_traces) == 1
    explain.forget(model)
    assert not knows(model)
    explain.gradcam(model, x)
    assert len(counted_traces) == 2


def test_a_model_let_go_is_freed() -> None:
    model, x = branchy(), images()
    explain.gradcam(model, x)
    explain.cam(model, x, method="scorecam", batch_size=4)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def _three_calls(model: nn.Module, x: torch.Tensor, method: str, layer, target, **options) -> list[torch.Tensor]:
    """A method's maps on a copy of the model explain has never seen (the first call, its layouts read from its own
    forward), on the same copy again (what it learned), and on a copy whose layers were traced in full beforehand
    (the layouts as every call read them before the first call learned them from its own forward)."""
    if "seed" in explain.methods.method_options(method):
        options["seed"] = 0
    fresh, traced = copy.deepcopy(model), copy.deepcopy(model)
    layers.traced_layers(traced, x, content=True)
    maps = [explain.cam(fresh, x, method, layer, target, **options) for _ in range(2)]
    return [*maps, explain.cam(traced, x, method, layer, target, **options)]


ROLLOUTS = ["attention_rollout", "gradient_rollout", "legrad", "chefer"]


@pytest.mark.parametrize("method", [name for name in explain.METHODS if name not in ROLLOUTS])
def test_a_first_call_equals_the_second_and_the_traced_one(method: str) -> None:
    """Every method at a given layer; the automatic layer below (it costs the same passes for every method)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    x = torch.randn(2, 3, 64 if method in ("cam", "dff") else 32, 64 if method in ("cam", "dff") else 32)
    options = {"samples": 2} if method in ("sscam", "iscam") else {}  # their noisy copies: few suffice here
    layer = "layer4" if method in ("cam", "dff") else "layer2"
    layer = layer if explain.METHODS[method].reads_layer else None  # a method that reads none refuses one
    first, second, traced = _three_calls(model, x, method, layer, [1, 2], **options)
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(first, traced)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("method", ["gradcam", "gradcampp", "cam", "scorecam", "integrated_gradients"])
def test_a_first_call_at_the_automatic_layer_equals_the_second_and_the_traced_one(method: str, batch: int) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    first, second, traced = _three_calls(model, torch.randn(batch, 3, 64, 64), method, None, [1, 2][:batch])
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(first, traced)


@pytest.mark.parametrize("method", ["gradcam", "scorecam", *ROLLOUTS])
def test_a_transformers_first_call_equals_the_second_and_the_traced_one(method: str) -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=64, depth=3, num_classes=5).eval()
    x = torch.randn(2, 3, 64, 64)
    layer = None if method in ROLLOUTS else "blocks.1.norm1"
    for chosen in {layer, None}:
        first, second, traced = _three_calls(model, x, method, chosen, [1, 2])
        torch.testing.assert_close(first, second)
        torch.testing.assert_close(first, traced)


def _timm_model(name: str, **options) -> nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model(name, num_classes=5, **options)


FAMILIES = {
    "resnet18": lambda: torchvision.models.resnet18(num_classes=5),
    "mobilenet_v3_small": lambda: torchvision.models.mobilenet_v3_small(num_classes=5),
    "densenet121": lambda: torchvision.models.densenet121(num_classes=5),
    "convnext_atto": lambda: _timm_model("convnext_atto"),
    "swin": lambda: _timm_model("swin_tiny_patch4_window7_224", img_size=112, window_size=7, depths=(1, 1, 1, 1)),
    "vit": lambda: _timm_model("vit_tiny_patch16_224", img_size=64, depth=3),
    "cait": lambda: _timm_model("cait_xxs24_224", img_size=64, depth=2),
    "levit": lambda: _timm_model("levit_128s", img_size=64),  # tokens on several grids: the probe decides
    "hf_vit": lambda: _hf_vit(),
}


def _hf_vit() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, num_labels=5
    )
    return transformers.ViTForImageClassification(config)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_layer_a_first_call_settles_is_the_full_searchs(family: str, batch: int) -> None:
    """A first call settles the automatic layer from the gradients its own pass records at the last candidates
    (of one image: the trace's own forward, run with autograd); the search over every candidate with its own probe
    (find_auto_layers, on a copy) finds the same layer, and the call's maps are those of that layer given."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    x = torch.randn(batch, 3, 112, 112) if family == "swin" else torch.randn(batch, 3, 64, 64)
    searched = explain.find_auto_layers(copy.deepcopy(model), x, target=3)
    result = explain.GradCAM(model)(x, 3)
    assert result.layer == "+".join(searched)
    given = searched if len(searched) > 1 else searched[0]
    torch.testing.assert_close(result.cams, explain.GradCAM(copy.deepcopy(model), given)(x, 3).cams)


def _forwards(model: nn.Module, call) -> list[int]:
    """The batch sizes of the model's forwards during ``call()``."""
    seen: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].shape[0]))
    try:
        call()
    finally:
        handle.remove()
    return seen


def test_a_first_call_runs_no_trace_for_a_grid_layer_and_one_after_its_pass_for_tokens() -> None:
    """A given grid layer's layout is read during the call's own forward: no other forward. A ViT's token layout is
    read there too for one image; for several it needs the trace of one image, run once after the pass (never the
    pass twice); the second call runs its pass alone."""
    torch.manual_seed(0)
    cnn, x = torchvision.models.resnet18(num_classes=5).eval(), torch.randn(3, 3, 64, 64)
    assert _forwards(cnn, lambda: explain.gradcam(cnn, x, "layer3")) == [3]
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_tiny_patch16_224", img_size=64, depth=3, num_classes=5).eval()
    assert _forwards(vit, lambda: explain.gradcam(vit, x, "blocks.1.norm1")) == [3, 1]
    assert _forwards(vit, lambda: explain.gradcam(vit, x, "blocks.1.norm1")) == [3]
    alone = copy.deepcopy(vit)  # one image: its own forward lays the tokens out (see test_watch.py)
    assert _forwards(alone, lambda: explain.gradcam(alone, x[:1], "blocks.1.norm1")) == [1]


@pytest.mark.parametrize("method", ["guided_gradcam", "gradcam"])
def test_a_model_is_traced_once_whatever_flags_its_calls_change(method: str, counted_traces) -> None:
    """Backward rules make in-place ReLUs out of place for their call, and the traces run in eval mode: neither is a
    change of the model, so three calls trace it once."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    assert any(getattr(m, "inplace", False) for m in model.modules())
    x = torch.randn(2, 3, 64, 64)
    for _ in range(3):
        explain.cam(model, x, method, None, 3)
    assert len(counted_traces) == 1


def test_the_structure_is_checked_once_per_call(monkeypatch) -> None:
    """The structure check reads every module's attributes: once per call, on entering it, not at each look-up; the
    structure itself is built once, when it is first learned, and again only after a change."""
    from explain.core import context

    checks: list[int] = []
    built: list[int] = []
    check, build = context.walked, context.structure
    monkeypatch.setattr(context, "walked", lambda model, known: (checks.append(1), check(model, known))[1])
    monkeypatch.setattr(context, "structure", lambda modules: (built.append(1), build(modules))[1])
    model, x = branchy(), images()
    explain.gradcam(model, x)  # first call: trace, settled layer
    explain.gradcam(model, x)
    explain.gradcam(model, x, "stem")
    assert len(checks) == 3 and len(built) == 1
    model.stem.stride = (2, 2)  # a convolution's stride: a new trace
    explain.gradcam(model, x)
    assert len(checks) == 4 and len(built) == 2


class Headed(nn.Module):
    """A convolution, then a head that declares itself local (as a YOLO detector's branches)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 1)
        self.local_heads = [self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.stem(x))).mean((2, 3))


def test_a_models_families_are_asked_once_and_again_after_a_change(monkeypatch) -> None:
    from explain.core import families

    asked: list[str] = []
    watched = [
        families.Family(
            f.name, f.speedup, lambda model, modules, f=f: asked.append(f.name) or f.member(model, modules), f.context
        )
        for f in families.FAMILIES
    ]
    monkeypatch.setattr(families, "FAMILIES", tuple(watched))
    torch.manual_seed(0)
    model, x = Headed().eval(), torch.randn(1, 3, 32, 32)
    first = explain.GradCAM(model, "stem")(x, 1).cams
    assert [f.name for f in families.families_of(model)] == ["local heads (YOLO)"]
    explain.GradCAM(model, "stem")(x, 1)
    assert asked == [f.name for f in families.FAMILIES]  # once, for the first call
    model.head = nn.Conv2d(8, 4, 1)  # replaced: the local head the model declares is now another module
    model.local_heads = []
    asked.clear()
    assert [f.name for f in families.families_of(model)] == []
    assert asked == [f.name for f in families.FAMILIES]
    again = explain.GradCAM(model, "stem")(x, 1).cams
    torch.testing.assert_close(again, explain.GradCAM(copy.deepcopy(model), "stem")(x, 1).cams)
    assert not torch.allclose(again, first)  # the new head's map, not a kept one


def test_each_family_is_found_from_what_the_model_holds() -> None:
    from explain.core.families import families_of

    torch.manual_seed(0)
    rcnn = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=3
    ).eval()
    names = {f.name for f in families_of(rcnn)}
    assert "torchvision R-CNN" in names and "local heads (YOLO)" not in names
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1)
    assert [f.name for f in families_of(encoder)] == ["sequences (transformers)"]
    convs = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
    assert families_of(convs) == ()


@pytest.mark.parametrize("family", ["resnet18", "vit"])
def test_a_first_call_of_one_image_at_the_automatic_layer_runs_one_forward(family: str) -> None:
    """The trace's own forward, run with autograd, is the call's pass: one forward, then the same maps as a model
    whose layer is known (a second call runs one forward too)."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    x = torch.randn(1, 3, 64, 64)
    found: list[explain.CAMResult] = []
    assert _forwards(model, lambda: found.append(explain.GradCAM(model)(x, 3))) == [1]
    assert _forwards(model, lambda: found.append(explain.GradCAM(model)(x, 3))) == [1]
    torch.testing.assert_close(found[0].cams, found[1].cams)
    assert found[0].layer == found[1].layer == explain.find_auto_layers(copy.deepcopy(model), x, target=3)[0]


class ChangedInPlace(nn.Module):
    """Its last convolution's output is rectified in place by the forward around it, after the module returned it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.last = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.last(torch.relu(self.stem(x)))
        features.relu_()
        return self.head(features.mean((2, 3)))


def test_a_candidate_changed_in_place_is_not_read_from_the_traced_forward() -> None:
    """The last convolution's output, as the traced forward holds it, is already rectified: its map read from there
    would be the rectified activation's. The call leaves it to the search, and its map is the layer's, given."""
    torch.manual_seed(0)
    model = ChangedInPlace().eval()
    x = torch.randn(1, 3, 32, 32)
    first = explain.GradCAM(model)(x, 2, normalize=False)
    assert first.layer == "last"
    given = explain.GradCAM(copy.deepcopy(model), "last")(x, 2, normalize=False)
    torch.testing.assert_close(first.cams, given.cams)


def test_forget_leaves_no_entry_anywhere_and_a_dropped_model_is_freed() -> None:
    """What a recorder finds (a layer the model modifies in place, a layer computed from another target layer) and
    how far a YOLO head reads live in the model's context alone: forget clears them, and the model, let go, is
    freed with them."""
    from conftest import seeded
    from test_yolo import detecting

    from explain.core import hooks
    from explain.core.context import context_of
    from explain.core.speedups import windows

    assert not any(hasattr(module, name) for module in (hooks, windows)
                   for name in ("_MODIFIED_IN_PLACE", "_DOWNSTREAM", "_REACHES"))  # fmt: skip
    resnet, x = seeded("resnet18", num_classes=4), torch.randn(1, 3, 64, 64)
    explain.gradcam(resnet, x, ["layer3", "layer4.1.bn2"])  # bn2: out += identity after it, and it follows layer3
    learned = context_of(resnet)
    assert resnet.layer4[1].bn2 in learned.modified_in_place and resnet.layer4[1].bn2 in learned.downstream
    yolo = detecting("yolo11n.yaml")
    explain.gradcam(yolo, torch.rand(1, 3, 64, 64), target=explain.targets.DetectionTarget(score_threshold=0.3))
    assert len(context_of(yolo).reaches) > 0
    for model in (resnet, yolo):
        explain.forget(model)
        assert not knows(model) and not context_of(model).holds()
    gone = [weakref.ref(resnet), weakref.ref(yolo)]
    del resnet, yolo, learned, model
    gc.collect()
    assert all(ref() is None for ref in gone)


CHANGES = {
    "a module replaced": lambda m: setattr(m, "layer4", nn.Sequential(nn.Conv2d(256, 512, 1), nn.ReLU())),
    "a module added": lambda m: m.layer4.append(nn.Conv2d(512, 512, 1)),
    "a parameter's shape": lambda m: (setattr(m.fc, "weight", nn.Parameter(torch.randn(7, 512))),
                                      setattr(m.fc, "bias", nn.Parameter(torch.zeros(7)))),
    "a buffer": lambda m: setattr(m.layer4[1].bn2, "running_mean", torch.randn(512)),
    "a patched forward": lambda m: setattr(m.layer4[1], "forward", torch.relu),
    "a convolution's stride": lambda m: setattr(m.conv1, "stride", (4, 4)),
    "a module removed": lambda m: delattr(m.layer4[1], "relu") or setattr(m.layer4[1], "relu", nn.Identity()),
}  # fmt: skip


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_model_changed_after_a_call_is_explained_as_a_fresh_copy_of_it(change: str) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    x = images()
    explain.GradCAM(model)(x, 3)  # learned
    CHANGES[change](model)
    result, fresh = explain.GradCAM(model)(x, 3), fresh_maps(model, x)
    assert result.layer == fresh.layer
    torch.testing.assert_close(result.cams, fresh.cams)
    torch.testing.assert_close(result.scores, fresh.scores)
