"""Batch norms folded into the convolutions before them, for Score-CAM's scoring copy: the same outputs as the
model, the batch norms gone where folding is exact and kept where it is not, the model itself untouched."""

from __future__ import annotations

import timm
import torch
from conftest import hook_count, seeded
from torch import nn

import explain
from explain import metrics
from explain.core.speedups import folding
from explain.core.speedups.folding import folded
from explain.methods import perturbation
from explain.metrics import scoring


def with_statistics(model: nn.Module) -> nn.Module:
    """The model in eval mode with random running statistics and affine parameters in every batch norm, so that
    folding them changes the convolutions' weights and biases."""
    torch.manual_seed(5)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            with torch.no_grad():
                module.running_mean.normal_(0, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.normal_(1, 0.2)
                module.bias.normal_(0, 0.2)
    return model.eval()


def batch_norms(model: nn.Module) -> int:
    return sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def assert_same_function(model: nn.Module, copy: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        expected, got = model(x), copy(x)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_every_batch_norm_after_a_convolution_is_folded_and_the_model_untouched() -> None:
    """torchvision's ResNet (plain BatchNorm2d), the bundled EfficientNet-Lite0 (TensorFlow "SAME" padding from
    the input's shape, batch norm and ReLU6 in one module) and timm's MobileNetV3 (timm's BatchNormAct2d)."""
    x = torch.randn(2, 3, 96, 128)
    lite0 = explain.load_model("efficientnet_lite0").model
    mobilenet = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=10)
    for model in (with_statistics(seeded("resnet18", num_classes=10)), lite0, with_statistics(mobilenet)):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        kinds = [type(m) for m in model.modules()]
        copy = folded(model)
        assert batch_norms(model) > 0 and batch_norms(copy) == 0
        assert_same_function(model, copy, x)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        assert [type(m) for m in model.modules()] == kinds and hook_count(model) == 0


class Reused(nn.Module):
    """A convolution whose output a residual reads too, a convolution called twice, and a batch norm subclass
    whose forward does more than normalize: none can be folded."""

    class Shifted(nn.BatchNorm2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + 1.0

    def __init__(self) -> None:
        super().__init__()
        self.read_twice, self.norm_a = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.shared, self.norm_b, self.norm_c = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.BatchNorm2d(8)
        self.before_shifted, self.shifted = nn.Conv2d(8, 8, 1), self.Shifted(8)
        self.folds, self.norm_d = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.read_twice(x)
        y = self.norm_a(y) + y
        y = self.norm_b(self.shared(y)) + self.norm_c(self.shared(y.flip(-1)))
        return self.norm_d(self.folds(self.shifted(self.before_shifted(y))))


def test_a_batch_norm_is_kept_where_folding_it_would_change_the_function() -> None:
    model = with_statistics(Reused())
    copy = folded(model)
    kept = {name for name, m in copy.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert kept == {"norm_a", "norm_b", "norm_c", "shifted"}
    assert_same_function(model, copy, torch.randn(2, 3, 16, 16))


def test_metrics_and_score_cam_score_with_the_folded_copy_as_with_the_model(monkeypatch) -> None:
    """Deletion's and Score-CAM's perturbed copies go through the folded copy on the CPU, with the scores the
    model itself gives them; one copy, folded once, serves both calls."""
    model = with_statistics(seeded("resnet18", num_classes=10))
    torch.manual_seed(2)
    x, maps = torch.randn(2, 3, 64, 64), torch.rand(2, 7, 7)
    made = []

    def counted(model: nn.Module) -> nn.Module:
        made.append(folded(model))
        return made[-1]

    monkeypatch.setattr(folding, "folded", counted)
    fast = metrics.deletion(model, x, maps, steps=8)
    cams = explain.methods.ScoreCAM(model, "layer4")(x).cams
    assert len(made) == 1 and batch_norms(made[0]) == 0

    def unfolded(model: nn.Module, device: torch.device, fold: bool = True) -> folding.ScoringForwards:
        return folding.ScoringForwards(model, device, fold=False)

    monkeypatch.setattr(scoring, "ScoringForwards", unfolded)
    monkeypatch.setattr(perturbation, "ScoringForwards", unfolded)
    plain = metrics.deletion(model, x, maps, steps=8)
    assert len(made) == 1
    assert (fast.curve - plain.curve).abs().max() < 1e-5
    assert (explain.methods.ScoreCAM(model, "layer4")(x).cams - cams).abs().max() < 1e-4


def test_a_model_with_forward_hooks_is_scored_as_it_is() -> None:
    """The user's hooks run on the user's model: a hook that changes the output keeps the model from being folded
    (a folded copy would drop it), and the scores are the hooked model's."""
    model = with_statistics(seeded("resnet18", num_classes=10))
    x = torch.randn(2, 3, 64, 64)
    handle = model.layer1.register_forward_hook(lambda m, i, o: o * 0.5)
    try:
        forwards = folding.ScoringForwards(model, x.device)
        assert forwards.model is model
        assert_same_function(model, lambda inputs: forwards(inputs), x)
    finally:
        handle.remove()
    assert isinstance(folding.ScoringForwards(model, x.device).model, torch.fx.GraphModule)
