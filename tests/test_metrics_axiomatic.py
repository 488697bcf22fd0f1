"""Completeness and non-sensitivity: Integrated Gradients complete to its reported error, a gap written out, and
non-sensitivity equal to Quantus 0.6.0 on the same model, images and max-normalized maps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_metrics_faithfulness import _quantus, batch, tiny_model

import explain
from explain import metrics

quantus = pytest.importorskip("quantus")  # a test dependency: installed by the README's test command


def test_integrated_gradients_is_complete_to_its_reported_error() -> None:
    model = tiny_model(3)
    torch.manual_seed(5)
    x, target = torch.randn(2, 3, 10, 10), torch.tensor([2, 4])
    result = explain.methods.IntegratedGradients(model, steps=64)(x, target, normalize=False, resize=False)
    gap = metrics.completeness(model, x, result.raw[:, 0] if result.raw.dim() == 5 else result.raw, target)
    torch.testing.assert_close(gap, result.completeness, rtol=1e-3, atol=1e-5)
    assert bool((metrics.completeness(model, x, result.raw, target, relative=True).abs() < 0.05).all())
    with torch.no_grad():
        change = model(x)[torch.arange(2), target] - model(torch.zeros_like(x))[torch.arange(2), target]
    zero = metrics.completeness(model, x, torch.zeros_like(x), target)  # nothing attributed: the whole change
    torch.testing.assert_close(zero, -change)


def test_non_sensitivity_equals_quantus() -> None:
    model, (x, a, y) = tiny_model(1), batch(1, (6, 8))
    a = a * (a > 0.4)  # zero attribution on part of the image
    a = a / a.reshape(len(a), -1).max(axis=1)[:, None, None, None]  # Quantus normalizes by the maximum
    found = metrics.non_sensitivity(model, torch.from_numpy(x), torch.from_numpy(a[:, 0]), torch.from_numpy(y),
                                    eps=1e-3)  # fmt: skip
    expected = _quantus(quantus.NonSensitivity, model, x, a, y, eps=1e-3)  # it fails for features_in_step > 1
    np.testing.assert_array_equal(found.numpy(), expected)
    grouped = metrics.non_sensitivity(model, torch.from_numpy(x), torch.from_numpy(a[:, 0]), torch.from_numpy(y),
                                      eps=1e-3, features_in_step=4)  # fmt: skip
    assert grouped.shape == (3,) and bool((grouped <= 48).all())
