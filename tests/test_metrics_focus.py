"""Focus on mosaics: the mosaics built from the images they name, Focus against Quantus 0.6.0 on the same maps
and quadrants, and its bounds (a map on the class's two images scores 1, an even one 0.5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_metrics_faithfulness import tiny_model

from explain import metrics
from explain.errors import ExplainError

quantus = pytest.importorskip("quantus")


def test_mosaics_show_two_images_of_the_class_in_the_named_quadrants() -> None:
    x, labels = torch.randn(6, 3, 4, 5), torch.tensor([0, 0, 1, 1, 2, 0])
    built = metrics.mosaics(x, labels, count=7, seed=3)
    assert built.images.shape == (7, 3, 8, 10)
    for m in range(7):
        tiles = [built.images[m, :, :4, :5], built.images[m, :, :4, 5:], built.images[m, :, 4:, :5],
                 built.images[m, :, 4:, 5:]]  # fmt: skip
        for q in range(4):
            torch.testing.assert_close(tiles[q], x[built.sources[m, q]])
            assert bool(labels[built.sources[m, q]] == built.classes[m]) == bool(built.quadrants[m, q])
        assert int(built.quadrants[m].sum()) == 2 and len(set(built.sources[m].tolist())) == 4
    again = metrics.mosaics(x, labels, count=7, seed=3)
    assert torch.equal(again.sources, built.sources)
    with pytest.raises(ExplainError, match="a class with two images"):
        metrics.mosaics(x[:3], torch.tensor([0, 1, 2]), count=1)


def test_focus_equals_quantus_and_its_bounds() -> None:
    torch.manual_seed(0)
    maps = torch.randn(5, 8, 8)
    quadrants = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 0, 1]]).bool()
    x = torch.randn(5, 3, 8, 8)
    expected = quantus.Focus(disable_warnings=True)(
        model=tiny_model(3), x_batch=x.numpy(), y_batch=np.zeros(5, dtype=int), a_batch=maps[:, None].numpy(),
        custom_batch=quadrants.int().numpy(), channel_first=True, device="cpu",
    )  # fmt: skip
    np.testing.assert_allclose(metrics.focus(maps, quadrants).numpy(), expected, rtol=1e-5)
    on_class = torch.zeros(1, 8, 8)
    on_class[0, :4] = 1.0  # the top two quadrants
    assert metrics.focus(on_class, quadrants[:1]).item() == 1.0
    assert metrics.focus(torch.ones(1, 7, 7), quadrants[2:3]).item() == pytest.approx(0.5)  # odd: split evenly
    assert torch.isnan(metrics.focus(-torch.ones(1, 4, 4), quadrants[:1])).all()
