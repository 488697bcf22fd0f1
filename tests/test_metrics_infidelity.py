"""Infidelity against Captum 0.9's on the same model, attributions and perturbations; sensitivity-n against the
paper's formula written out; what must hold whatever the model (a linear model's exact attribution has zero
infidelity and is sensitive-n for every n)."""

from __future__ import annotations

import pytest
import torch
from test_metrics_faithfulness import tiny_model
from torch import nn

from explain import metrics

captum_metrics = pytest.importorskip("captum.metrics")

N, SAMPLES = 3, 6


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    return torch.randn(N, 3, 8, 10), torch.rand(N, 8, 10), torch.tensor([0, 2, 4])


@pytest.mark.parametrize("normalize", [False, True])
def test_infidelity_equals_captums_on_the_same_perturbations(normalize: bool) -> None:
    model, (x, maps, target) = tiny_model(3), _inputs()
    noise = torch.randn(N, SAMPLES, *x.shape[1:]) * 0.05
    found = metrics.infidelity(model, x, maps, target, perturbations=noise, normalize=normalize)

    def perturb(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = noise.flatten(0, 1)  # Captum repeats each input for its samples, one after another
        return flat, inputs - flat

    attributions = maps[:, None].expand_as(x)  # the map shared by the channels
    expected = captum_metrics.infidelity(model, perturb, x, attributions, target=target,
                                         n_perturb_samples=SAMPLES, normalize=normalize)  # fmt: skip
    torch.testing.assert_close(found, expected.float(), rtol=1e-4, atol=1e-7)


def test_an_exact_attribution_of_a_linear_model_has_no_infidelity_and_is_sensitive_n() -> None:
    """For f(x) = w . x, the attribution w * x (Gradient x Input) gives f(x) - f(x - I) = w . I exactly: its
    infidelity against w (the gradient, per element) is 0, and setting any subset to 0 changes f by the sum of
    w * x over it, so sensitivity-n is 1 for every n."""
    torch.manual_seed(3)
    linear = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 10, 4)).eval()
    x, target = torch.randn(N, 3, 8, 10), torch.tensor([1, 1, 3])
    weights = linear[1].weight[target].detach().view(N, 3, 8, 10)
    assert metrics.infidelity(linear, x, weights, target).abs().max() < 1e-6
    correlation = metrics.sensitivity_n(linear, x, weights * x, target, sizes=(1, 5, 40), runs=20)
    torch.testing.assert_close(correlation, torch.ones(N, 3))


def test_sensitivity_n_is_the_correlation_over_random_subsets_written_out() -> None:
    model, (x, maps, target) = tiny_model(3), _inputs()
    found = metrics.sensitivity_n(model, x, maps, target, sizes=(4, 30), runs=15, seed=5)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        plain = model(x)[torch.arange(N), target]
    for column, n in enumerate((4, 30)):
        chosen = torch.rand(N, 15, 80, generator=generator).argsort(dim=2).argsort(dim=2) < n
        for i in range(N):
            copies = torch.where(chosen[i].view(15, 1, 8, 10), 0.0, x[i])
            with torch.no_grad():
                change = plain[i] - model(copies)[:, target[i]]
            sums = (maps[i].flatten() * 3 * chosen[i]).sum(dim=1)  # the map shared by 3 channels
            r = torch.corrcoef(torch.stack([sums, change]))[0, 1]
            torch.testing.assert_close(found[i, column], r, rtol=1e-4, atol=1e-5)


def test_infidelity_on_quantus_patches_equals_quantus() -> None:
    """Quantus' definition: 4 x 4 patches set to each image's least value one more at a time."""
    import numpy as np

    quantus = pytest.importorskip("quantus")
    model = tiny_model(3)
    torch.manual_seed(3)
    x, a = torch.randn(3, 3, 8, 12), torch.rand(3, 8, 12)
    y = torch.tensor([1, 0, 4])
    removals = metrics.patch_removals(x, 4)
    assert removals.shape == (3, 6, 3, 8, 12)
    last = x - removals[:, -1]
    torch.testing.assert_close(last, x.amin(dim=(1, 2, 3), keepdim=True).expand_as(x))  # all patches gone
    found = metrics.infidelity(model, x, a, y, perturbations=removals)
    expected = quantus.Infidelity(disable_warnings=True, n_perturb_samples=2)(
        model=model, x_batch=x.numpy(), y_batch=y.numpy(), a_batch=a[:, None].numpy(), channel_first=True,
        device="cpu",
    )  # fmt: skip
    np.testing.assert_allclose(found.numpy(), np.asarray(expected), rtol=1e-4, atol=1e-6)
