"""Pixel attributions (explain.methods.attribution) against Captum, the peer that has them: Saliency, Input x
Gradient and Integrated Gradients with each quadrature rule; Integrated Gradients' completeness on the bundled
real model; SmoothGrad against a loop written here; and the maps in every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ASSETS, hook_count, seeded, smoothed
from torch import nn

import explain

captum = pytest.importorskip("captum.attr", reason="captum: a test dependency (pip install -e '.[test]')")

TARGETS = [1, 7]


@pytest.fixture(scope="module")
def model() -> nn.Module:
    """A ResNet-18 without kinks (GELUs, average pools): the references below take the gradients batched otherwise
    than explain does, and a ReLU network's gradient near a kink depends on the convolution kernel a CPU picks."""
    return smoothed(seeded("resnet18", num_classes=10))


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(2, 3, 48, 48)


def test_saliency_is_captum_s_and_its_map_the_largest_channel_magnitude(model, x) -> None:
    result = explain.methods.Saliency(model)(x, TARGETS, normalize=False)
    theirs = captum.Saliency(model).attribute(x, target=TARGETS, abs=False)
    assert result.raw.shape == x.shape and theirs.abs().max() > 0
    torch.testing.assert_close(result.raw, theirs, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(result.cams, theirs.abs().amax(dim=1), rtol=1e-4, atol=1e-7)
    assert hook_count(model) == 0


def test_input_x_gradient_is_captum_s(model, x) -> None:
    result = explain.methods.InputXGradient(model)(x, TARGETS, normalize=False)
    theirs = captum.InputXGradient(model).attribute(x, target=TARGETS)
    torch.testing.assert_close(result.raw, theirs, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(result.cams, theirs.sum(dim=1).abs(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("rule", ["gausslegendre", "riemann_trapezoid", "riemann_left", "riemann_middle"])
def test_integrated_gradients_and_its_completeness_are_captum_s(model, x, rule) -> None:
    baseline = torch.full_like(x, -0.5)
    method = explain.methods.IntegratedGradients(model, steps=12, rule=rule, baseline=-0.5, batch_size=5)
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
    method = explain.methods.IntegratedGradients(lite0.model, steps=48, baseline=black, batch_size=16)
    result = method(x, 285)  # Egyptian cat
    with torch.no_grad():
        change = lite0.model(x)[0, 285] - lite0.model(black.expand_as(x))[0, 285]
    total = result.raw.double().sum()
    assert change.abs() > 1
    assert abs(float(total - change)) <= 0.05 * abs(float(change))
    assert float(result.completeness[0]) == pytest.approx(float(total - change), abs=1e-3)


@pytest.mark.parametrize("smooth_type", ["smoothgrad", "smoothgrad_sq", "vargrad"])
def test_smoothgrad_and_vargrad_are_the_statistics_of_noisy_copies_gradients(model, x, smooth_type) -> None:
    """Saliency with smooth_samples: the gradients of the noisy copies (noise of 0.2 of each image's value range,
    drawn as the engine draws it), their mean (SmoothGrad), mean square or variance (VarGrad), before the largest
    channel magnitude."""
    method = explain.methods.Saliency(model, smooth_samples=4, smooth_sigma=0.2, smooth_type=smooth_type, seed=11)
    result = method(x, TARGETS, normalize=False)
    generator = torch.Generator().manual_seed(11)
    spread = x.amax(dim=(1, 2, 3), keepdim=True) - x.amin(dim=(1, 2, 3), keepdim=True)
    gradients = []
    for _ in range(4):
        noisy = (x + 0.2 * spread * torch.randn(x.shape, generator=generator)).requires_grad_(True)
        score = model(noisy).gather(1, torch.tensor(TARGETS)[:, None]).sum()
        gradients.append(torch.autograd.grad(score, noisy)[0].double())
    stacked = torch.stack(gradients)
    expected = {
        "smoothgrad": stacked.mean(0),
        "smoothgrad_sq": stacked.pow(2).mean(0),
        "vargrad": stacked.var(0, unbiased=False),
    }[smooth_type]
    assert expected.abs().max() > 0
    torch.testing.assert_close(result.raw.double(), expected, rtol=1e-3, atol=1e-3 * float(expected.abs().max()))
    torch.testing.assert_close(
        result.cams.double(), expected.abs().amax(dim=1), rtol=1e-3, atol=1e-3 * float(expected.abs().max())
    )


def reference_gradient_shap(model, x, baselines, samples, stdev, seed) -> torch.Tensor:
    """GradientSHAP written from its formula, the draws made in the documented order (the baselines' indices,
    the alphas, the noise, each of all draws at once), each draw's gradient taken alone, float64 sum."""
    generator = torch.Generator().manual_seed(seed)
    count = samples * len(x)
    chosen = torch.randint(len(baselines), (count,), generator=generator)
    alphas = torch.rand(count, generator=generator)
    noise = stdev * torch.randn((count, *x.shape[1:]), generator=generator)
    total = torch.zeros_like(x, dtype=torch.float64)
    for r in range(count):
        i = r % len(x)
        end, start = x[i] + noise[r], baselines[chosen[r]]
        point = (start + alphas[r] * (end - start))[None].requires_grad_(True)
        (gradient,) = torch.autograd.grad(model(point)[0, TARGETS[i]], point)
        total[i] += (gradient[0] * (end - start)).double() / samples
    return total


def test_gradient_shap_is_its_formula_and_converges_to_captum_s(model, x) -> None:
    """GradientSHAP against its formula with the same draws, to rounding (the model is smooth: the reference takes
    each draw's gradient alone, explain in batches of 5); and with many draws, against Captum's GradientShap with
    many draws (both estimate one expectation: they agree as their noise allows)."""
    torch.manual_seed(5)
    baselines = torch.randn(3, *x.shape[1:]) * 0.5
    method = explain.methods.GradientSHAP(model, baselines=baselines, samples=6, stdev=0.1, seed=4, batch_size=5)
    result = method(x, TARGETS, normalize=False)
    expected = reference_gradient_shap(model, x, baselines, 6, 0.1, 4)
    assert expected.abs().max() > 0
    torch.testing.assert_close(result.raw.double(), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))

    tiny = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(16, 3)).eval()  # fmt: skip
    small = x[:, :, :12, :12]
    ours = explain.methods.GradientSHAP(
        tiny, baselines=baselines[:, :, :12, :12], samples=3000, batch_size=1000, seed=0
    )
    mine = ours(small, [0, 2], normalize=False).raw
    torch.manual_seed(0)
    theirs = captum.GradientShap(tiny).attribute(
        small, baselines=baselines[:, :, :12, :12], n_samples=3000, target=[0, 2]
    )
    for a, b in zip(mine.flatten(1), theirs.flatten(1)):
        assert torch.corrcoef(torch.stack([a, b]))[0, 1] >= 0.99


def test_sobel_cam_is_pytorch_grad_cam_s_on_a_picture() -> None:
    """Sobel-CAM on an 8-bit photo against pytorch-grad-cam's sobel_cam (OpenCV's grey and Sobel), where no edge
    saturates its 8 bits: given OpenCV's 8-bit grey, within the rounding of its 8-bit result; given the colours,
    its grey is OpenCV's within that rounding. A signal's map is its one derivative."""
    import cv2
    from PIL import Image
    from pytorch_grad_cam.sobel_cam import sobel_cam

    photo = np.asarray(Image.open(ASSETS / "chelsea.png").convert("RGB").resize((64, 48)))
    photo = (photo // 4 + 64).astype(np.uint8)  # a quarter of the contrast: no derivative past 255
    expected = torch.from_numpy(sobel_cam(photo)).double()
    assert 0 < expected.max() < 255
    grey = torch.from_numpy(cv2.cvtColor(photo, cv2.COLOR_RGB2GRAY))[None, None].float()
    reads_grey = nn.Sequential(nn.Conv2d(1, 2, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())  # the model is not used
    got = explain.methods.SobelCAM(reads_grey)(grey, 0, normalize=False).cams[0].double()
    assert torch.corrcoef(torch.stack([got.flatten(), expected.flatten()]))[0, 1] >= 0.999
    assert (got - expected).abs().max() <= 1.0  # OpenCV rounds each magnitude and their mean to 8 bits
    sobel = explain.methods.SobelCAM(seeded("resnet18", num_classes=10))
    colours = sobel(torch.from_numpy(photo).permute(2, 0, 1)[None].float(), normalize=False).cams[0].double()
    assert torch.corrcoef(torch.stack([colours.flatten(), expected.flatten()]))[0, 1] >= 0.99
    signal = explain.methods.SobelCAM(nn.Sequential(nn.Conv1d(1, 2, 3), nn.AdaptiveAvgPool1d(1), nn.Flatten()))
    ramp = torch.cat([torch.zeros(10), torch.ones(10)])[None, None]
    edges = signal(ramp, 0, normalize=False).cams[0]
    assert edges.argmax() in (9, 10) and edges[:8].abs().max() == 0


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
    result = explain.methods.Occlusion(model, window=window, stride=stride, baseline=0.1, batch_size=7)(x, TARGETS)
    theirs = captum.Occlusion(model).attribute(
        x, sliding_window_shapes=(3, window, window), strides=(3, stride, stride), baselines=0.1, target=TARGETS
    )
    assert torch.allclose(theirs[:, 0], theirs[:, 2]) and theirs.abs().max() > 0
    torch.testing.assert_close(result.raw, theirs[:, 0], rtol=1e-4, atol=1e-5)
    assert result.cams.shape == (2, 48, 48) and float(result.cams.amax()) == 1.0
    assert hook_count(model) == 0
    with pytest.raises(explain.ExplainError, match="stride 13 is larger than the window 12"):
        explain.methods.Occlusion(model, window=12, stride=13)(x, TARGETS)


def test_rise_is_the_papers_score_weighted_sum_of_its_masks(model, x) -> None:
    """RISE against the paper's formula written here: the masks drawn as documented (the grids, then one shift
    per axis, from the call's seed), upsampled bilinearly to (cells + 1) cells and cut at the shift; the copies
    scored one by one; R = sum_i S(x M_i) M_i / (N p)."""
    import math

    import torch.nn.functional as F

    result = explain.methods.RISE(model, masks=24, cells=4, p=0.5, baseline=0.0, batch_size=7, seed=3)(x, TARGETS)
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
    again = explain.methods.RISE(model, masks=24, cells=4, batch_size=5, seed=3)(x, TARGETS)
    torch.testing.assert_close(again.raw, result.raw, rtol=1e-5, atol=1e-6)  # seeded, whatever the batch
    assert hook_count(model) == 0


def test_deconvolution_is_captum_s(x) -> None:
    """Deconvolution against Captum's, on a ResNet-18 with its ReLUs (both take the gradient of the whole batch at
    once): every ReLU passes back the positive part of the gradient it receives; the model's in-place ReLUs are
    restored after."""
    model = seeded("resnet18", num_classes=10)
    result = explain.methods.Deconvolution(model)(x, TARGETS, normalize=False)
    theirs = captum.Deconvolution(model).attribute(x.clone().requires_grad_(True), target=TARGETS)
    guided = explain.methods.GuidedBackprop(model)(x, TARGETS, normalize=False)
    assert theirs.abs().max() > 0 and not torch.allclose(result.raw, guided.raw)
    torch.testing.assert_close(result.raw, theirs, rtol=1e-4, atol=1e-6)
    assert all(m.inplace for m in model.modules() if isinstance(m, nn.ReLU)) and hook_count(model) == 0


class Reused(nn.Module):
    """Convolutions, a batch norm and smooth and piecewise-linear nonlinearities, one ReLU module called twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.conv1, self.bn, self.conv2 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.Conv2d(6, 6, 3)
        self.relu, self.tanh, self.sigmoid = nn.ReLU(inplace=True), nn.Tanh(), nn.Sigmoid()
        self.head = nn.Linear(6 * 4, 10)
        self.bn.eval()
        nn.init.normal_(self.bn.running_mean, std=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn(self.conv1(x)))
        x = self.tanh(self.conv2(x)) + self.relu(self.conv2(x))
        return self.head(self.sigmoid(nn.functional.adaptive_avg_pool2d(x, 2)).flatten(1))


def test_deeplift_is_captum_s_and_sums_to_the_score_s_change() -> None:
    """DeepLift (rescale) against Captum's on a network of distinct nonlinearity modules, then on one whose ReLU
    module is called twice (Captum's hooks would mix the calls): there the attributions sum to the score's change
    from the baseline, DeepLift's summation-to-delta, as its completeness reports."""
    torch.manual_seed(2)
    net = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3), nn.Tanh(), nn.Conv2d(6, 4, 3), nn.Sigmoid(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 10), nn.ReLU(),
    ).eval()  # fmt: skip
    x = torch.randn(2, 3, 12, 12)
    baseline = 0.1 * torch.randn(2, 3, 12, 12)
    result = explain.methods.DeepLift(net, baseline=baseline)(x, TARGETS, normalize=False)
    theirs = captum.DeepLift(net).attribute(x, baselines=baseline, target=TARGETS)
    assert theirs.abs().max() > 0
    torch.testing.assert_close(result.raw, theirs, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(
        result.raw, explain.methods.InputXGradient(net)(x - baseline, TARGETS, normalize=False).raw
    )

    model = Reused().eval()
    result = explain.methods.DeepLift(model, baseline=-0.2)(x, TARGETS, normalize=False)
    with torch.no_grad():
        change = model(x)[[0, 1], TARGETS] - model(torch.full_like(x, -0.2))[[0, 1], TARGETS]
    torch.testing.assert_close(result.raw.sum(dim=(1, 2, 3)), change, rtol=1e-4, atol=1e-5)
    assert result.completeness.abs().max() <= 1e-4 * change.abs().max()
    assert model.relu.inplace and hook_count(model) == 0


INPUT_METHODS = ["saliency", "input_x_gradient", "integrated_gradients", "gradient_shap", "deeplift", "sobel",
                 "occlusion", "rise", "feature_ablation", "lime", "kernel_shap", "guided_backprop", "deconvolution",
                 "fullgrad"]  # fmt: skip


@pytest.mark.parametrize("method", INPUT_METHODS)
def test_a_method_that_reads_no_layer_refuses_one_in_one_line(method: str) -> None:
    """A pixel attribution given a layer refuses it, naming the methods that read one; without, it runs."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 3)).eval()  # fmt: skip
    with pytest.raises(explain.LayerError, match=r"reads no layer; drop layer= \(--layer\).*\(lrp, attnlrp and cplrp"):
        explain.create_method(method, model, "0")
    assert not explain.METHODS[method].reads_layer and explain.METHODS["lrp"].reads_layer


def test_the_command_line_gives_a_layer_to_the_methods_of_a_list_that_read_one(tmp_path) -> None:
    """``--layer`` with a lone method that reads none: refused, exit 2, nothing written; with a list, the methods
    that read a layer get it (Grad-CAM's map is that layer's) and the others explain the input."""
    import json

    from explain.cli import main

    photo, lite0 = str(ASSETS / "chelsea.png"), ["--model", "efficientnet_lite0", "--quiet"]
    assert main([photo, *lite0, "--method", "saliency", "--layer", "blocks.5", "-o", str(tmp_path / "a")]) == 2
    assert not (tmp_path / "a").exists()
    out = tmp_path / "b"
    assert main([photo, *lite0, "--method", "saliency,gradcam", "--layer", "blocks.5", "-o", str(out)]) == 0
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()[1:]]
    assert {r["method"]: r["error"] for r in records} == {"saliency": None, "gradcam": None}
    assert {r["method"]: r["layer"] for r in records}["gradcam"] == "blocks.5"
