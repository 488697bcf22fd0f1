"""Layer fusion, augmentation, eigen and noise smoothing, and the properties every method must have."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import capture, reference_gradcam, seeded
from test_methods import first_component
from torch import nn

import explain
from explain.core.layers import traced_layers
from explain.core.maps import normalize_maps
from explain.methods import perturbation


def upsampled_normalized(maps: torch.Tensor, size) -> torch.Tensor:
    up = F.interpolate(maps[:, None].float(), size=size, mode="bilinear", align_corners=False)[:, 0]
    low, high = up.amin((1, 2), keepdim=True), up.amax((1, 2), keepdim=True)
    return torch.where(high > low, (up - low) / (high - low), 0.0)  # a flat map becomes zeros


def test_fusing_one_layer_gives_that_layers_map_and_two_layers_their_mean_or_max() -> None:
    model = seeded("resnet18", num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    single = explain.cam(model, x, "layercam", "layer4", [1, 2])
    torch.testing.assert_close(explain.cam(model, x, "layercam", ["layer4"], [1, 2]), single)

    parts = [upsampled_normalized(reference_gradcam(model, x, name, [1, 2]), (64, 64)) for name in ("layer3", "layer4")]
    result = explain.GradCAM(model, ["layer3", "layer4"])(x, [1, 2], normalize=False)
    assert result.layer == "layer3+layer4" and result.raw.shape == (2, 64, 64)
    torch.testing.assert_close(result.raw, (parts[0] + parts[1]) / 2)
    fused_max = explain.cam(model, x, "gradcam", ["layer3", "layer4"], [1, 2], normalize=False, fuse="max")
    torch.testing.assert_close(fused_max, torch.maximum(parts[0], parts[1]))


class MirrorNet(nn.Module):
    """A network equivariant to horizontal flips: mirror-symmetric kernels, stride 1, global pooling."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        convs = [nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)]
        self.features = nn.Sequential(convs[0], nn.ReLU(), convs[1], nn.ReLU())
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            for conv in (self.features[0], self.features[2]):
                conv.weight.copy_((conv.weight + conv.weight.flip(-1)) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def test_aug_smooth_is_flip_symmetric_and_averages_the_six_views() -> None:
    model = MirrorNet().eval()
    x = torch.randn(2, 3, 40, 40)
    smoothed = explain.cam(model, x, "gradcam", "features.3", [1, 3], aug_smooth=True)
    flipped = explain.cam(model, x.flip(-1), "gradcam", "features.3", [1, 3], aug_smooth=True)
    torch.testing.assert_close(flipped, smoothed.flip(-1), atol=1e-5, rtol=0)

    model = seeded("resnet18", num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    views = []
    for scale in (0.9, 1.0, 1.1):
        side = round(64 * scale)
        scaled = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)
        for flip in (False, True):
            view = scaled.flip(-1) if flip else scaled
            raw = reference_gradcam(model, view, "layer4", [1, 2])
            back = upsampled_normalized(raw, (64, 64))
            views.append(back.flip(-1) if flip else back)
    expected = normalize_maps(torch.stack(views).mean(0), 2)
    got = explain.cam(model, x, "gradcam", "layer4", [1, 2], aug_smooth=True)
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=0)


def test_eigen_smooth_takes_the_first_component_of_the_weighted_activations() -> None:
    model = seeded("vgg11", num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    a, g = capture(model, x, "features.18", [3, 4])
    weighted = g.mean(dim=(2, 3), keepdim=True) * a
    got = explain.cam(model, x, "gradcam", "features.18", [3, 4], resize=False, normalize=False, eigen_smooth=True)
    expected = first_component(weighted).clamp(min=0)
    assert expected.abs().max() > 0
    assert (got.double() - expected).abs().max().item() <= 1e-5


def test_eigen_cam_where_positions_outnumber_channels() -> None:
    model = seeded("resnet18", num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    a, _ = capture(model, x, "layer1", [0, 1])
    assert a.shape[1] < a.shape[2] * a.shape[3]  # 64 channels, 256 positions: the other Gram matrix
    got = explain.cam(model, x, "eigencam", "layer1", resize=False, normalize=False)
    expected = first_component(a).clamp(min=0)
    assert expected.abs().max() > 0
    assert (got.double() - expected).abs().max().item() <= 1e-5


def test_noise_smoothing_averages_maps_of_noisy_copies_for_the_plain_inputs_targets() -> None:
    model = seeded("resnet18", num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    top = model(x).argmax(1).tolist()
    generator = torch.Generator().manual_seed(4)
    spread = (x.amax(dim=(1, 2, 3)) - x.amin(dim=(1, 2, 3)))[:, None, None, None]
    noisy = [x + 0.2 * spread * torch.randn(x.shape, generator=generator) for _ in range(3)]
    expected = torch.stack([reference_gradcam(model, n, "layer4", top) for n in noisy]).mean(0)
    result = explain.GradCAM(model, "layer4", smooth_samples=3, smooth_sigma=0.2, seed=4)(x, normalize=False)
    assert result.class_indices.tolist() == top
    assert (result.raw.double() - expected).abs().max().item() <= 1e-5
    again = explain.cam(model, x, "gradcampp", "layer4", smooth_samples=2, seed=9)
    torch.testing.assert_close(again, explain.cam(model, x, "gradcampp", "layer4", smooth_samples=2, seed=9))


def test_score_cam_weights_are_a_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    weights = perturbation.ScoreCAM.weights
    monkeypatch.setattr(perturbation.ScoreCAM, "weights", lambda self, c: seen.append(weights(self, c)) or seen[-1])
    explain.cam(seeded("resnet18", num_classes=10), torch.randn(2, 3, 32, 32), "scorecam", "layer3", [1, 2])
    (w,) = seen
    assert w.shape == (2, 256) and (w > 0).all()
    torch.testing.assert_close(w.sum(1), torch.ones(2))


class PositiveNet(nn.Module):
    """Positive weights on positive inputs: every ReLU passes everything, so guiding changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(inplace=True), nn.Conv2d(6, 6, 3), nn.ReLU())
        self.head = nn.Linear(6, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.abs_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def test_guided_backprop_is_the_input_gradient_when_every_relu_passes_everything() -> None:
    model = PositiveNet()
    x = torch.rand(2, 3, 12, 12)
    plain = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(model(plain)[:, 1].sum(), plain)
    got = explain.cam(model, x, "guided_backprop", target=1, normalize=False)
    torch.testing.assert_close(got, expected)
    assert model.body[1].inplace is True and model.body[3].inplace is False


class DeadChannels(nn.Module):
    """A conv stage whose last channels are dead (zero after ReLU) and one constant, before a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.conv.weight[5:] = 0
            self.conv.bias[5:7] = -1.0  # zero after the ReLU
            self.conv.bias[7] = 0.5  # constant, not zero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.relu(self.conv(x)).mean((2, 3)))


def test_constant_channels_cost_no_forward_and_change_nothing() -> None:
    model = DeadChannels().eval()
    x = torch.randn(2, 3, 10, 10)
    traced_layers(model, x)  # the layouts' trace, once per model and input shape, is not the methods' cost
    rows = []
    counter = model.conv.register_forward_pre_hook(lambda m, inputs: rows.append(inputs[0].shape[0]))
    try:
        scores = explain.methods.ScoreCAM(model, "relu", batch_size=4)(x, [1, 2], normalize=False)
        score_rows = sum(rows) - 2
        rows.clear()
        ablation = explain.methods.AblationCAM(model, "relu", batch_size=4)(x, [1, 2], normalize=False)
        ablation_rows = sum(rows) - 2
    finally:
        counter.remove()
    assert score_rows == 2 * (5 + 1)  # 5 varying channels per image, and one zero mask for the 3 constant ones
    assert ablation_rows == 2 * (5 + 1)  # the 2 dead channels need no ablation; the constant one does
    assert max(rows) <= 4

    a, _ = capture(model, x, "relu", [1, 2])
    with torch.no_grad():
        masked = [[model(x[n : n + 1] * normalized_mask(a[n, c], x.shape[-2:])) for c in range(8)] for n in range(2)]
    score = torch.tensor([[masked[n][c][0, t].item() for c in range(8)] for n, t in enumerate([1, 2])])
    expected = (score.double().softmax(1)[..., None, None] * a).sum(1).clamp(min=0)
    assert (scores.raw.double() - expected).abs().max().item() <= 1e-5

    with torch.no_grad():
        y = model(x)[range(2), [1, 2]].double()
        ablated = torch.zeros(2, 8, dtype=torch.float64)
        for n, t in enumerate([1, 2]):
            for c in range(8):
                values = a[n : n + 1].float().clone()
                values[0, c] = 0
                handle = model.relu.register_forward_hook(lambda m, i, o, v=values: v)
                ablated[n, c] = model(x[n : n + 1])[0, t].double()
                handle.remove()
    weights = (y[:, None] - ablated) / y[:, None]
    assert (weights[:, 5:7] == 0).all()  # the dead channels' ablation changes nothing
    expected = (weights[..., None, None] * a).sum(1).clamp(min=0)
    assert expected.abs().max() > 0
    assert (ablation.raw.double() - expected).abs().max().item() <= 1e-5


def normalized_mask(channel: torch.Tensor, size) -> torch.Tensor:
    up = F.interpolate(channel[None, None].float(), size=size, mode="bilinear", align_corners=False)
    span = up.max() - up.min()
    return (up - up.min()) / span if span > 0 else torch.zeros_like(up)
