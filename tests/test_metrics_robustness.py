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
