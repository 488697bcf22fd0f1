"""Sufficiency and consistency over a batch: each against Quantus 0.6.0 on the same model, images and maps where an
image has alike explanations (Quantus gives 0 where it has none, explain NaN), and the share written out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from explain import metrics
from explain.errors import ExplainError

quantus = pytest.importorskip("quantus")

N = 9


def linear_model() -> nn.Module:
    """A linear classifier of 4 classes, whose predictions spread over the nine images."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4)).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Nine images; their maps three patterns, each at three scales, each divided by its largest (Quantus divides
    the batch by its largest)."""
    torch.manual_seed(2)
    x = torch.randn(N, 3, 8, 8)
    patterns = torch.rand(3, 8, 8) + 0.1
    maps = patterns[torch.arange(N) % 3] * torch.arange(1, N + 1).float().view(N, 1, 1)
    maps = maps / maps.flatten(1).amax(1).view(N, 1, 1)
    assert len(set(linear_model()(x).argmax(1).tolist())) > 1
    return x, maps, linear_model()(x).argmax(1).detach().numpy()


def _quantus(metric, x, maps, y, **options) -> np.ndarray:
    found = metric(disable_warnings=True, **options)(
        model=linear_model(), x_batch=x.numpy(), y_batch=y, a_batch=maps[:, None].numpy(), channel_first=True,
        device="cpu",
    )  # fmt: skip
    return np.asarray(found, dtype=np.float64)


def test_sufficiency_equals_quantus_and_the_share_written_out() -> None:
    x, maps, predicted = _batch()
    maps = maps + torch.rand(N, 8, 8) * 0.05  # near, not equal
    maps = maps / maps.flatten(1).amax(1).view(N, 1, 1)
    found = metrics.sufficiency(linear_model(), x, maps, threshold=0.5)
    np.testing.assert_allclose(found.numpy(), _quantus(quantus.Sufficiency, x, maps, predicted, threshold=0.5),
                               rtol=1e-5)  # fmt: skip
    flat = maps.flatten(1).double()
    distances = torch.cdist(flat, flat)
    alike = (distances / distances.max() <= 0.3) & ~torch.eye(N, dtype=torch.bool)
    same = torch.from_numpy(predicted[:, None] == predicted[None])
    expected = (alike & same).sum(1) / alike.sum(1)
    euclidean = metrics.sufficiency(linear_model(), x, maps, threshold=0.3, distance="euclidean")
    torch.testing.assert_close(euclidean, expected.float(), equal_nan=True)


@pytest.mark.parametrize("discretise", ["rank", "rounded", "leading_signs"])
def test_consistency_equals_quantus(discretise: str) -> None:
    x, maps, predicted = _batch()
    found = metrics.consistency(linear_model(), x, maps, discretise=discretise, k={"rounded": 2}.get(discretise, 5))
    quantus_func = {"rank": quantus.discretise_func.rank, "rounded": quantus.discretise_func.floating_points,
                    "leading_signs": quantus.discretise_func.top_n_sign}[discretise]  # fmt: skip
    expected = _quantus(quantus.Consistency, x, maps, predicted, discretise_func=quantus_func)
    np.testing.assert_allclose(found.numpy(), expected, rtol=1e-6, atol=1e-8)
    same_pattern = torch.arange(N)[:, None] % 3 == torch.arange(N)[None] % 3
    alike = same_pattern & ~torch.eye(N, dtype=torch.bool)
    if discretise != "leading_signs":  # Quantus' default calls every positive map alike
        same = torch.from_numpy(predicted[:, None] == predicted[None])
        torch.testing.assert_close(found, ((alike & same).sum(1) / alike.sum(1)).float())


def test_top_k_consistency_reads_the_highest_positions_and_no_alike_map_is_nan() -> None:
    x, maps, _ = _batch()
    lonely = maps.clone()
    lonely[0, 0, 0] = 100.0  # the first image's top cell moves: no other map shares its top 5
    found = metrics.consistency(linear_model(), x, lonely, k=5)
    assert torch.isnan(found[0]) and not torch.isnan(found[1:]).any()
    with pytest.raises(ExplainError, match="discretise must be"):
        metrics.consistency(linear_model(), x, maps, discretise="hash")
