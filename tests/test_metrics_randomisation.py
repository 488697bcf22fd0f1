"""MPRT layer by layer, sMPRT, eMPRT and the random logit test: each against Quantus 0.6.0 on the same model,
images, seeds and draws (recorded and passed), and the entropy written out; a random
map's MPRT similarity is low; the user's model is left as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_metrics_faithfulness import tiny_model

import explain
from explain import metrics

quantus = pytest.importorskip("quantus")

N = 3


def _images() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model = tiny_model(3)
    torch.manual_seed(8)
    x = torch.randn(N, 3, 12, 12)
    return model, x, model(x).argmax(1).detach()


def _gradcam_of_any_model(model, inputs, targets, **kwargs) -> np.ndarray:
    """Quantus' explain_func: Grad-CAM at the second convolution of whichever model it is handed."""
    inputs = torch.as_tensor(inputs).float()
    return explain.GradCAM(model, "2")(inputs, torch.as_tensor(targets)).cams[:, None].numpy()


def _call(metric, model, x, y, **options):
    return metric(disable_warnings=True, **options)(
        model=model, x_batch=x.numpy(), y_batch=y.numpy(), a_batch=None, channel_first=True,
        explain_func=_gradcam_of_any_model, device="cpu",
    )  # fmt: skip


@pytest.mark.parametrize("order", ["top_down", "bottom_up"])
def test_mprt_equals_quantus_layer_by_layer(order: str) -> None:
    model, x, y = _images()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    found = metrics.mprt(model, x, "gradcam", y, layer="2", order=order)
    expected = _call(quantus.MPRT, model, x, y, layer_order=order)
    layers = [name for name in expected if name != "original"]
    assert found.blocks == layers == (["6", "2", "0"] if order == "top_down" else ["0", "2", "6"])
    quantus_values = np.array([expected[name] for name in layers])
    flat = np.isnan(quantus_values)  # a randomized map all zeros: Quantus' NaN, explain's 0 (no rank agreement)
    np.testing.assert_allclose(found.spearman.numpy()[~flat], quantus_values[~flat], atol=1e-5)
    assert (found.spearman.numpy()[flat] == 0).all()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_random_maps_mprt_similarity_is_low() -> None:
    """Random maps of 15 x 15 cells: two of them correlate by about 1 / 15."""
    model = tiny_model(3)
    x = torch.randn(N, 3, 32, 32)
    found = metrics.mprt(model, x, "random", layer="2", seed=3)
    assert float(found.spearman.abs().mean()) < 0.15


def test_smprt_equals_quantus_on_the_same_noise(monkeypatch) -> None:
    """Quantus draws each copy's noise anew for every model: its generator is made to repeat the same draws,
    which explain passes once for all. Quantus' SmoothMPRT explains the copies with its own quantus.explain, not
    the explain_func it is handed: it is handed the same Grad-CAM there."""
    model, x, y = _images()
    samples = 4
    noise = np.random.default_rng(0).standard_normal((samples - 1, N, 3, 12, 12))
    calls = []

    def repeated(*shape):
        calls.append(shape)
        return noise[(len(calls) - 1) % (samples - 1)]

    monkeypatch.setattr(np.random, "randn", repeated)
    monkeypatch.setattr(quantus, "explain", _gradcam_of_any_model)
    expected = _call(quantus.SmoothMPRT, model, x, y, nr_samples=samples, noise_magnitude=0.2)
    spread = (x.flatten(1).amax(1) - x.flatten(1).amin(1)).view(N, 1, 1, 1, 1)
    passed = torch.from_numpy(noise).float().permute(1, 0, 2, 3, 4) * 0.2 * spread
    found = metrics.smprt(model, x, "gradcam", y, layer="2", samples=samples, perturbations=passed)
    layers = [name for name in expected if name != "original"]
    assert found.blocks == layers
    np.testing.assert_allclose(found.spearman.numpy(), np.array([expected[name] for name in layers]), atol=1e-4)


def test_emprt_equals_quantus_and_is_the_rise_of_the_histogram_entropy() -> None:
    """Against Quantus' EfficientMPRT, and the entropy written out with numpy's histogram and scipy's entropy."""
    from scipy.stats import entropy

    model, x, y = _images()
    found = metrics.emprt(model, x, "gradcam", y, layer="2")
    np.testing.assert_allclose(found.numpy(), _call(quantus.EfficientMPRT, model, x, y), rtol=1e-4)
    maps = explain.GradCAM(model, "2")(x, y).cams
    written = [entropy(np.histogram(m.flatten().numpy(), bins=100)[0]) for m in maps]
    np.testing.assert_allclose(metrics.histogram_entropy(maps).numpy(), written, rtol=1e-5)


def test_random_logit_equals_quantus_on_its_own_draw(monkeypatch) -> None:
    model, x, y = _images()
    drawn, randint = [], np.random.randint

    def recorded(*args, **kwargs):
        drawn.append(randint(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(np.random, "randint", recorded)
    gradcam = explain.GradCAM(model, "2")
    expected = quantus.RandomLogit(num_classes=5, normalise=False, disable_warnings=True)(
        model=model, x_batch=x.numpy(), y_batch=y.numpy(), a_batch=gradcam(x, y).cams[:, None].numpy(),
        channel_first=True, explain_func=_gradcam_of_any_model, device="cpu",
    )  # fmt: skip
    others = torch.from_numpy(drawn[0]).long()
    others = others + (others >= y).long()  # Quantus' index among the classes without the explained one
    found = metrics.random_logit(gradcam, x, y, others=others, similarity="ssim_flat")
    np.testing.assert_allclose(found.numpy(), np.asarray(expected), rtol=1e-4, atol=1e-6)
    given = metrics.random_logit(gradcam, x, y, maps=gradcam(x, y).cams, others=others, similarity="ssim_flat")
    torch.testing.assert_close(given, found)  # the explained maps at hand: the explainer runs once
    from skimage.metrics import structural_similarity

    plain, other = gradcam(x, y).cams.numpy(), gradcam(x, others).cams.numpy()
    two_d = [structural_similarity(a, b, data_range=float(max(a.max(), b.max()) - min(a.min(), b.min())))
             for a, b in zip(plain, other)]  # fmt: skip
    np.testing.assert_allclose(metrics.random_logit(gradcam, x, y, others=others).numpy(), two_d, rtol=1e-4)
    own = metrics.random_logit(gradcam, x, y, seed=1)
    assert own.shape == (N,)
