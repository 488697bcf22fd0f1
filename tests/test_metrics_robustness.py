"""Max- and avg-sensitivity: Grad-CAM's maps of perturbed copies against Captum 0.9's sensitivity_max on the same
perturbations (relative, as Captum's), the absolute ones against the norms written out, and a map that ignores the
image (a constant explainer) moves not at all."""

from __future__ import annotations

import pytest
import torch
from test_metrics_faithfulness import tiny_model

import explain
from explain import metrics

captum_metrics = pytest.importorskip("captum.metrics")

N, SAMPLES = 3, 5


def test_max_sensitivity_equals_captums_and_avg_is_the_mean_move() -> None:
    model = tiny_model(3)
    torch.manual_seed(4)
    x, target = torch.randn(N, 3, 12, 12), torch.tensor([1, 0, 3])
    noise = (torch.rand(N, SAMPLES, 3, 12, 12) * 2 - 1) * 0.05
    gradcam = explain.GradCAM(model, "2")
    found = metrics.max_sensitivity(gradcam, x, target, perturbations=noise, relative=True, batch_size=4)

    def explained(images: torch.Tensor | tuple, target: torch.Tensor) -> tuple[torch.Tensor]:
        """Captum passes the plain inputs as a tuple, and reads a tuple of explanations back."""
        return (gradcam(images[0] if isinstance(images, tuple) else images, target).cams,)

    expected = captum_metrics.sensitivity_max(
        explained, x, perturb_func=lambda inputs: inputs + noise.flatten(0, 1), n_perturb_samples=SAMPLES,
        target=target,
    )  # fmt: skip
    torch.testing.assert_close(found, expected.float(), rtol=1e-4, atol=1e-6)
    plain = gradcam(x, target).cams
    moved = torch.stack([gradcam(x + noise[:, s], target).cams for s in range(SAMPLES)], 1)
    distances = (moved - plain[:, None]).flatten(2).norm(dim=2)
    torch.testing.assert_close(metrics.avg_sensitivity(gradcam, x, target, perturbations=noise), distances.mean(1))
    torch.testing.assert_close(metrics.max_sensitivity(gradcam, x, target, perturbations=noise), distances.amax(1))


def test_a_map_that_ignores_the_image_does_not_move() -> None:
    x = torch.randn(2, 3, 8, 8)
    still = metrics.avg_sensitivity(lambda images, classes: torch.ones(len(images), 8, 8), x, samples=4)
    assert torch.equal(still, torch.zeros(2))


def test_the_local_lipschitz_estimate_equals_quantus_on_its_own_noise(monkeypatch) -> None:
    """Quantus draws each sample's Gaussian noise with numpy's global generator: recorded, and passed to explain."""
    import numpy as np
    import quantus

    model = tiny_model(3)
    torch.manual_seed(6)
    x, target = torch.randn(N, 3, 12, 12), torch.tensor([1, 0, 3])
    gradcam = explain.GradCAM(model, "2")
    plain = gradcam(x, target).cams
    drawn, normal = [], np.random.normal

    def recorded(*args, **kwargs):
        drawn.append(normal(*args, **kwargs))
        return drawn[-1]

    def explained(model, inputs, targets, **kwargs):
        return gradcam(torch.as_tensor(inputs), torch.as_tensor(targets)).cams[:, None].numpy()

    monkeypatch.setattr(np.random, "normal", recorded)
    expected = quantus.LocalLipschitzEstimate(nr_samples=SAMPLES, perturb_std=0.05, disable_warnings=True)(
        model=model, x_batch=x.numpy(), y_batch=target.numpy(), a_batch=plain[:, None].numpy(), channel_first=True,
        explain_func=explained, device="cpu",
    )  # fmt: skip
    noise = torch.from_numpy(np.stack(drawn, axis=1)).float().view(N, SAMPLES, 3, 12, 12)
    found = metrics.local_lipschitz_estimate(gradcam, x, target, perturbations=noise)
    np.testing.assert_allclose(found.numpy(), np.asarray(expected), rtol=1e-3, atol=1e-6)
