"""Metrics of maps alone and of maps against objects: complexity (sparseness, entropy, effective complexity) and
localisation (relevance mass and rank accuracy, top-k intersection, attribution localisation, AUC), each against
Quantus 0.6.0 on the same maps and masks, and the properties that must hold whatever the map."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from explain import metrics

quantus = pytest.importorskip("quantus")  # a test dependency: installed by the README's test command

N, SIZE = 4, (16, 16)


@pytest.fixture(scope="module")
def batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Images, signed maps without ties, and one box of 6 x 9 pixels per image (another place each)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3, *SIZE)).astype(np.float32)
    a = rng.normal(size=(N, 1, *SIZE)).astype(np.float32)
    s = np.zeros((N, 1, *SIZE), dtype=np.float32)
    for i in range(N):
        s[i, :, 2 + i : 8 + i, 3 + i : 12 + i] = 1
    return x, a, s


def _quantus(metric, batch, **options) -> np.ndarray:
    x, a, s = batch
    found = metric(disable_warnings=True, **options)(
        model=None, x_batch=x, y_batch=np.zeros(N, dtype=int), a_batch=a.copy(), s_batch=s, channel_first=True
    )
    return np.asarray(found, dtype=np.float64)


def _ours(batch) -> tuple[torch.Tensor, torch.Tensor]:
    _, a, s = batch
    return torch.from_numpy(a[:, 0]), torch.from_numpy(s[:, 0]).bool()


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (metrics.sparseness, quantus.Sparseness),
        (metrics.complexity, quantus.Complexity),
        (metrics.effective_complexity, quantus.EffectiveComplexity),
    ],
)
def test_complexity_metrics_equal_quantus(batch, ours, theirs) -> None:
    maps, _ = _ours(batch)
    np.testing.assert_allclose(ours(maps).double().numpy(), _quantus(theirs, batch), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("ours", "options", "theirs", "their_options"),
    [
        (metrics.relevance_mass_accuracy, {"positive": False}, quantus.RelevanceMassAccuracy, {}),
        (metrics.relevance_rank_accuracy, {}, quantus.RelevanceRankAccuracy, {}),
        (metrics.top_k_intersection, {"k": 50}, quantus.TopKIntersection, {"k": 50}),
        (metrics.top_k_intersection, {"k": 50, "concept_influence": True}, quantus.TopKIntersection,
         {"k": 50, "concept_influence": True}),
        (metrics.attribution_localisation, {"absolute": True}, quantus.AttributionLocalisation, {}),
        (metrics.localisation_auc, {}, quantus.AUC, {}),
    ],
)  # fmt: skip
def test_localisation_metrics_equal_quantus(batch, ours, options, theirs, their_options) -> None:
    maps, masks = _ours(batch)
    found = ours(maps, masks, SIZE, **options).double().numpy()
    np.testing.assert_allclose(found, _quantus(theirs, batch, **their_options), rtol=1e-5, atol=1e-6)


def test_what_must_hold_whatever_the_map() -> None:
    masks = torch.zeros(2, *SIZE, dtype=torch.bool)
    masks[:, 4:8, 4:10] = True
    inside = torch.rand(2, *SIZE) * masks  # a map that lies on its object alone
    one_hot = torch.zeros(2, *SIZE)
    one_hot[:, 3, 5] = 1
    n = SIZE[0] * SIZE[1]
    assert torch.allclose(metrics.relevance_mass_accuracy(inside, masks, SIZE), torch.ones(2))
    assert torch.allclose(metrics.attribution_localisation(inside, masks, SIZE), torch.ones(2), atol=1e-6)
    assert torch.allclose(metrics.localisation_auc(masks.float(), masks, SIZE), torch.ones(2))
    assert torch.allclose(metrics.relevance_rank_accuracy(masks.float() + 0.5, masks, SIZE), torch.ones(2))
    assert torch.allclose(metrics.sparseness(one_hot), torch.full((2,), (n - 1) / n), atol=1e-4)  # the most
    assert torch.allclose(metrics.sparseness(torch.ones(2, *SIZE)), torch.zeros(2), atol=1e-6)
    assert torch.allclose(metrics.complexity(torch.ones(2, *SIZE)), torch.full((2,), math.log(n)))
    assert torch.allclose(metrics.complexity(one_hot), torch.zeros(2), atol=1e-6)
    assert metrics.effective_complexity(one_hot).tolist() == [1, 1]


def test_ties_count_pro_rata_and_an_empty_object_is_nan() -> None:
    """A flat map ranks every pixel alike: its rank accuracy is the object's share of the image, whatever order a
    sort would give the ties; its AUC is one half. An empty object scores NaN."""
    masks = torch.zeros(1, *SIZE, dtype=torch.bool)
    masks[0, :4] = True  # a quarter of the image
    flat = torch.ones(1, *SIZE)
    assert metrics.relevance_rank_accuracy(flat, masks, SIZE).item() == pytest.approx(0.25)
    assert metrics.top_k_intersection(flat, masks, SIZE, k=40).item() == pytest.approx(0.25)
    assert metrics.localisation_auc(flat, masks, SIZE).item() == pytest.approx(0.5)
    empty = torch.zeros(1, *SIZE, dtype=torch.bool)
    assert torch.isnan(metrics.relevance_mass_accuracy(flat, empty, SIZE)).all()


def test_maps_of_another_resolution_are_upsampled_and_boxes_drawn() -> None:
    """A 4 x 4 map is upsampled to the input first; a box is the mask of the pixels whose centres it holds."""
    small = torch.zeros(1, 4, 4)
    small[0, 1, 1] = 1
    box = torch.tensor([[4.0, 4.0, 8.0, 8.0]])
    up = torch.nn.functional.interpolate(small[None], size=SIZE, mode="bilinear", align_corners=False)[0]
    mask = torch.zeros(1, *SIZE, dtype=torch.bool)
    mask[0, 4:8, 4:8] = True
    expected = (up * mask).sum() / up.sum()
    assert metrics.relevance_mass_accuracy(small, box, SIZE).item() == pytest.approx(expected.item(), rel=1e-5)
