"""Attributions over superpixels (explain.methods.superpixels) against Captum's Feature Ablation, the exact Shapley
values enumerated here, and LIME's weighted ridge as scikit-learn fits it; SLIC's segments as scikit-image finds
them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import ASSETS, hook_count, seeded
from torch import nn

import explain

captum = pytest.importorskip("captum.attr", reason="captum: a test dependency (pip install -e '.[test]')")

TARGETS = [1, 7]


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10))  # fmt: skip
    return net.eval()


def blocks(side: int, per_axis: int) -> torch.Tensor:
    """A label map of per_axis x per_axis square segments."""
    cell = torch.arange(side) * per_axis // side
    return cell[:, None] * per_axis + cell[None, :]


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(2, 3, 16, 16)


def score(net: nn.Module, x: torch.Tensor, i: int, kept: torch.Tensor, segments: torch.Tensor) -> float:
    """The target logit of image i with only the kept segments (a 0/1 vector), the rest at 0."""
    with torch.no_grad():
        return float(net((x[i] * kept[segments].float())[None])[0, TARGETS[i]])


def test_feature_ablation_is_captum_s_with_the_same_feature_mask(x) -> None:
    net, segments = tiny_net(), blocks(16, 4)
    result = explain.methods.FeatureAblation(net, segments=segments, batch_size=7)(x, TARGETS, normalize=False)
    theirs = captum.FeatureAblation(net).attribute(x, target=TARGETS, feature_mask=segments[None, None], baselines=0.0)
    assert theirs.abs().max() > 0
    torch.testing.assert_close(result.raw, theirs[:, 0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(theirs[:, 0], theirs[:, 2])  # one value per segment, every channel alike
    assert result.cams.shape == (2, 16, 16) and hook_count(net) == 0


def shapley_values(net: nn.Module, x: torch.Tensor, i: int, segments: torch.Tensor) -> torch.Tensor:
    """Each segment's Shapley value from its definition, every coalition enumerated."""
    m = int(segments.max()) + 1
    values = {}
    for code in range(2**m):
        kept = torch.tensor([(code >> j) & 1 for j in range(m)])
        values[code] = score(net, x, i, kept, segments)
    phi = torch.zeros(m, dtype=torch.float64)
    for j in range(m):
        for code in range(2**m):
            if code >> j & 1:
                continue
            size = bin(code).count("1")
            weight = math.factorial(size) * math.factorial(m - size - 1) / math.factorial(m)
            phi[j] += weight * (values[code | 1 << j] - values[code])
    return phi


def test_kernel_shap_with_every_coalition_is_the_exact_shapley_values(x) -> None:
    net = tiny_net()
    segments = torch.div(blocks(16, 4), 3, rounding_mode="floor")  # 6 segments: 62 coalitions
    result = explain.methods.KernelSHAP(net, segments=segments, samples=100)(x, TARGETS, normalize=False)
    for i in range(2):
        exact = shapley_values(net, x, i, segments)
        assert exact.abs().max() > 0
        torch.testing.assert_close(result.raw[i].double(), exact[segments], rtol=1e-4, atol=1e-5)


def test_kernel_shap_with_sampled_coalitions_estimates_them(x) -> None:
    """With far fewer coalitions than there are (2^12), the estimate is close to the exact values, and it sums to
    the score's change from the all-baseline copy exactly."""
    net, segments = tiny_net(), blocks(16, 4)[:, :] % 12  # 12 segments
    result = explain.methods.KernelSHAP(net, segments=segments, samples=1500, seed=0, batch_size=64)(
        x, TARGETS, normalize=False
    )
    exact = shapley_values(net, x, 0, segments)
    got = torch.stack([result.raw[0][segments == j][0] for j in range(12)]).double()
    assert torch.corrcoef(torch.stack([got, exact]))[0, 1] >= 0.98
    empty = score(net, x, 0, torch.zeros(12, dtype=torch.long), segments)
    assert got.sum().item() == pytest.approx(float(result.scores[0]) - empty, rel=1e-4)


def test_a_coalition_drawn_twice_is_scored_once(x, monkeypatch) -> None:
    """Kernel SHAP draws 40 coalitions of 6 segments, sizes by the kernel: some are drawn twice. Each distinct one
    is scored once (the copies asked for are counted), and the values are those of scoring every draw: their sum
    is still the score's change from the all-baseline copy."""
    net, segments = tiny_net(), torch.div(blocks(16, 4), 3, rounding_mode="floor")
    method = explain.methods.KernelSHAP(net, segments=segments, samples=40, seed=5, batch_size=16)
    drawn = method.coalitions(6, torch.Generator().manual_seed(5), torch.device("cpu"))
    distinct = len(torch.unique(drawn, dim=0))
    assert distinct < len(drawn)  # the draw repeats itself: the case under test
    asked: list[int] = []
    score_copies = method.score_copies
    monkeypatch.setattr(method, "score_copies", lambda capture, images, *a: asked.append(len(images))
                        or score_copies(capture, images, *a))  # fmt: skip
    result = method(x[:1], TARGETS[:1], normalize=False)
    assert asked == [distinct]
    values = torch.stack([result.raw[0][segments == j][0] for j in range(6)])
    empty = score(net, x, 0, torch.zeros(6, dtype=torch.long), segments)
    assert values.sum().item() == pytest.approx(float(result.scores[0]) - empty, rel=1e-4)


def test_lime_is_the_weighted_ridge_of_its_coalitions(x) -> None:
    """LIME against scikit-learn's Ridge fitted here on the same coalitions (drawn in the documented order: per
    image, ``torch.rand`` of all samples but the first, the input itself), scores and kernel weights."""
    from sklearn.linear_model import Ridge

    net, segments = tiny_net(), blocks(16, 4)
    result = explain.methods.LIME(net, segments=segments, samples=60, seed=2)(x, TARGETS, normalize=False)
    generator = torch.Generator().manual_seed(2)
    for i in range(2):
        z = torch.cat([torch.ones(1, 16, dtype=torch.long), (torch.rand(59, 16, generator=generator) < 0.5).long()])
        y = np.array([score(net, x, i, row, segments) for row in z])
        distance = 1 - z.sum(1).double() / (z.sum(1).double().sqrt() * 4).clamp_min(1e-12)
        distance[z.sum(1) == 0] = 1.0
        weights = np.sqrt(np.exp(-(distance.numpy() ** 2) / 0.25**2))
        coef = Ridge(alpha=1.0).fit(z.numpy(), y, sample_weight=weights).coef_
        torch.testing.assert_close(result.raw[i].double(), torch.from_numpy(coef)[segments], rtol=1e-3, atol=1e-5)


def test_slic_segments_a_photo_as_scikit_image_does_and_needs_it() -> None:
    from PIL import Image
    from skimage.segmentation import slic

    photo = np.asarray(Image.open(ASSETS / "chelsea.png").convert("RGB").resize((64, 48))) / 255.0
    x = torch.from_numpy(photo).permute(2, 0, 1)[None].float()
    model = seeded("resnet18", num_classes=10)
    method = explain.methods.FeatureAblation(model, segments=20, batch_size=32)
    labels = method.segmented(x)
    scaled = (photo - photo.min(axis=(0, 1))) / (photo.max(axis=(0, 1)) - photo.min(axis=(0, 1)))
    expected = slic(scaled.astype(np.float32), n_segments=20, compactness=10.0, start_label=0, channel_axis=-1)
    assert labels.shape == (1, 48, 64) and 10 <= int(labels.max()) + 1 <= 30
    assert np.array_equal(np.unique(expected, return_inverse=True)[1].reshape(expected.shape), labels[0].numpy())
    result = method(x, 3)
    assert result.cams.shape == (1, 48, 64) and len(torch.unique(result.raw)) <= int(labels.max()) + 1


def test_superpixel_methods_need_scikit_image_named(monkeypatch, x) -> None:
    import builtins

    real = builtins.__import__

    def without_skimage(name, *args, **kwargs):
        if name.startswith("skimage"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_skimage)
    with pytest.raises(explain.ExplainError, match=r'pip install "explain\[superpixels\]"'):
        explain.methods.LIME(tiny_net(), segments=10)(x, TARGETS)
    signal = nn.Sequential(nn.Conv1d(2, 3, 3), nn.AdaptiveAvgPool1d(1), nn.Flatten()).eval()
    runs = explain.methods.FeatureAblation(signal, segments=4)(torch.randn(1, 2, 20), 1, normalize=False)  # no SLIC
    assert len(torch.unique(runs.raw)) <= 4
