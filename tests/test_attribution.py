"""Pixel attributions (explain.methods.attribution) against Captum, the peer that has them: Saliency, Input x
Gradient and Integrated Gradients with each quadrature rule; Integrated Gradients' completeness on the bundled
real model; SmoothGrad against a loop written here; and the maps in every rank."""

from __future__ import annotations

import pytest
import torch
from conftest import ASSETS, hook_count, seeded
from torch import nn

import explain

captum = pytest.importorskip("captum.attr", reason="captum: a test dependency (pip install -e '.[test]')")

TARGETS = [1, 7]


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return seeded("resnet18", num_classes=10)


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(2, 3, 48, 48)


def test_saliency_is_captum_s_and_its_map_the_largest_channel_magnitude(model, x) -> None:
    result = explain.Saliency(model)(x, TARGETS, normalize=False)
    theirs = captum.Saliency(model).attribute(x, target=TARGETS, abs=False)
    assert result.raw.shape == x.shape and theirs.abs().max() > 0
    torch.testing.assert_close(result.raw, theirs, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(result.cams, theirs.abs().amax(dim=1), rtol=1e-4, atol=1e-7)
    assert hook_count(model) == 0


def test_input_x_gradient_is_captum_s(model, x) -> None:
    result = explain.InputXGradient(model)(x, TARGETS, normalize=False)
    theirs = captum.InputXGradient(model).attribute(x, target=TARGETS)
    torch.testing.assert_close(result.raw, theirs, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(result.cams, theirs.sum(dim=1).abs(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("rule", ["gausslegendre", "riemann_trapezoid", "riemann_left", "riemann_middle"])
def test_integrated_gradients_and_its_completeness_are_captum_s(model, x, rule) -> None:
    baseline = torch.full_like(x, -0.5)
    method = explain.IntegratedGradients(model, steps=12, rule=rule, baseline=-0.5, batch_size=5)
    result = method(x, TARGETS, normalize=False)
    theirs, delta = captum.IntegratedGradients(model).attribute(
        x, baselines=baseline, target=TARGETS, n_steps=12, method=rule, return_convergence_delta=True
    )
    assert theirs.abs().max() > 0
    if rule == "riemann_trapezoid":  # Captum weighs its points, spaced 1/11, by 1/12: the weights sum to 11/12
        theirs = theirs * 12 / 11
    else:
        torch.testing.assert_close(result.completeness, delta.float(), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(result.raw, theirs, rtol=1e-4, atol=1e-6)
    assert hook_count(model) == 0


def test_integrated_gradients_is_complete_on_the_bundled_model(lite0) -> None:
    """The bundled EfficientNet-Lite0 on chelsea.png, from a black baseline: the attributions sum to the logit's
    change within 5%, the paper's check of enough steps, and the reported completeness is that sum's error."""
    image = explain.load_image(ASSETS / "chelsea.png")
    x = lite0.preprocess(image)
    black = lite0.preprocess(image.point(lambda _: 0))[0, :, 0, 0].view(1, 3, 1, 1)  # normalized black
    method = explain.IntegratedGradients(lite0.model, steps=48, baseline=black, batch_size=16)
    result = method(x, 285)  # Egyptian cat
    with torch.no_grad():
        change = lite0.model(x)[0, 285] - lite0.model(black.expand_as(x))[0, 285]
    total = result.raw.double().sum()
    assert change.abs() > 1
    assert abs(float(total - change)) <= 0.05 * abs(float(change))
    assert float(result.completeness[0]) == pytest.approx(float(total - change), abs=1e-3)


def test_smoothgrad_averages_the_gradients_of_noisy_copies(model, x) -> None:
    """Saliency with smooth_samples: the gradients of the noisy copies (noise of 0.2 of each image's value range,
    drawn as the engine draws it) averaged, then the largest channel magnitude."""
    result = explain.Saliency(model, smooth_samples=4, smooth_sigma=0.2, seed=11)(x, TARGETS, normalize=False)
    generator = torch.Generator().manual_seed(11)
    spread = x.amax(dim=(1, 2, 3), keepdim=True) - x.amin(dim=(1, 2, 3), keepdim=True)
    total = torch.zeros_like(x)
    for _ in range(4):
        noisy = (x + 0.2 * spread * torch.randn(x.shape, generator=generator)).requires_grad_(True)
        score = model(noisy).gather(1, torch.tensor(TARGETS)[:, None]).sum()
        total += torch.autograd.grad(score, noisy)[0]
    torch.testing.assert_close(result.raw, total / 4, rtol=1e-4, atol=1e-7)


def test_attributions_of_a_volume_and_a_signal_are_maps_of_their_input() -> None:
    torch.manual_seed(0)
    cases = ((nn.Conv3d, nn.AdaptiveAvgPool3d, (2, 1, 6, 8, 8)), (nn.Conv1d, nn.AdaptiveAvgPool1d, (2, 3, 40)))
    for conv, pool, shape in cases:
        net = nn.Sequential(conv(shape[1], 4, 3, padding=1), nn.ReLU(), pool(1), nn.Flatten(), nn.Linear(4, 3)).eval()
        volume = torch.randn(shape)
        for method in ("saliency", "input_x_gradient", "integrated_gradients"):
            result = explain.create_method(method, net)(volume, 2)
            assert result.cams.shape == (shape[0], *shape[2:]) and result.raw.shape == shape
            assert float(result.cams.min()) >= 0 and float(result.cams.max()) <= 1


@pytest.mark.parametrize(("window", "stride"), [(16, 8), (12, 9)])
def test_occlusion_is_captum_s_with_a_window_over_every_channel(model, x, window, stride) -> None:
    """Occlusion against Captum's with the window over all three channels (12 with stride 9: the last placement
    cut at the edge). A stride larger than the window, which would leave positions no window covers, is refused."""
    result = explain.Occlusion(model, window=window, stride=stride, baseline=0.1, batch_size=7)(x, TARGETS)
    theirs = captum.Occlusion(model).attribute(
        x, sliding_window_shapes=(3, window, window), strides=(3, stride, stride), baselines=0.1, target=TARGETS
    )
    assert torch.allclose(theirs[:, 0], theirs[:, 2]) and theirs.abs().max() > 0
    torch.testing.assert_close(result.raw, theirs[:, 0], rtol=1e-4, atol=1e-5)
    assert result.cams.shape == (2, 48, 48) and float(result.cams.amax()) == 1.0
    assert hook_count(model) == 0
    with pytest.raises(explain.ExplainError, match="stride 13 is larger than the window 12"):
        explain.Occlusion(model, window=12, stride=13)(x, TARGETS)


def test_rise_is_the_papers_score_weighted_sum_of_its_masks(model, x) -> None:
    """RISE against the paper's formula written here: the masks drawn as documented (the grids, then one shift
    per axis, from the call's seed), upsampled bilinearly to (cells + 1) cells and cut at the shift; the copies
    scored one by one; R = sum_i S(x M_i) M_i / (N p)."""
    import math

    import torch.nn.functional as F

    result = explain.RISE(model, masks=24, cells=4, p=0.5, baseline=0.0, batch_size=7, seed=3)(x, TARGETS)
    generator = torch.Generator().manual_seed(3)
    grids = (torch.rand(24, 1, 4, 4, generator=generator) < 0.5).float()
    cell = math.ceil(48 / 4)
    shifts = torch.stack([torch.randint(0, cell, (24,), generator=generator) for _ in range(2)], dim=1)
    large = F.interpolate(grids, size=(5 * cell, 5 * cell), mode="bilinear", align_corners=False)[:, 0]
    masks = torch.stack([large[i, r : r + 48, c : c + 48] for i, (r, c) in enumerate(shifts.tolist())])
    expected = torch.zeros(2, 48, 48)
    with torch.no_grad():
        for image, target in enumerate(TARGETS):
            for mask in masks:
                expected[image] += model((x[image] * mask)[None])[0, target] * mask
    expected /= 24 * 0.5
    assert expected.abs().max() > 0
    torch.testing.assert_close(result.raw, expected, rtol=1e-4, atol=1e-5)
    again = explain.RISE(model, masks=24, cells=4, batch_size=5, seed=3)(x, TARGETS)
    torch.testing.assert_close(again.raw, result.raw, rtol=1e-5, atol=1e-6)  # seeded, whatever the batch
    assert hook_count(model) == 0


def test_deconvolution_is_captum_s(model, x) -> None:
    """Deconvolution against Captum's: every ReLU passes back the positive part of the gradient it receives; the
    model's in-place ReLUs are restored after."""
    result = explain.Deconvolution(model)(x, TARGETS, normalize=False)
    theirs = captum.Deconvolution(model).attribute(x.clone().requires_grad_(True), target=TARGETS)
    guided = explain.GuidedBackprop(model)(x, TARGETS, normalize=False)
    assert theirs.abs().max() > 0 and not torch.allclose(result.raw, guided.raw)
    torch.testing.assert_close(result.raw, theirs, rtol=1e-4, atol=1e-6)
    assert all(m.inplace for m in model.modules() if isinstance(m, nn.ReLU)) and hook_count(model) == 0
