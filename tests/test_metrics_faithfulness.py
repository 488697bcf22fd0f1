"""Faithfulness by perturbation in the map's order: pixel flipping, region perturbation and selectivity, each
against Quantus 0.6.0 on the same tiny model, images, maps and baseline (Quantus runs a forward per step; here
every copy of a batch is built at once and scored in chunks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from explain import metrics
from explain.errors import ExplainError

quantus = pytest.importorskip("quantus")  # a test dependency: installed by the README's test command

N, CLASSES = 3, 5


def tiny_model(channels: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(channels, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, CLASSES),
    ).eval()  # fmt: skip


def batch(channels: int, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, channels, *size)).astype(np.float32)
    a = rng.random(size=(N, 1, *size)).astype(np.float32)  # no ties
    return x, a, np.array([0, 3, 1])


def _quantus(metric, model, x, a, y, **options) -> np.ndarray:
    found = metric(disable_warnings=True, **options)(
        model=model, x_batch=x, y_batch=y, a_batch=a.copy(), channel_first=True, device="cpu"
    )
    return np.asarray(found, dtype=np.float64)


def test_pixel_flipping_equals_quantus() -> None:
    """One channel, so that Quantus' features (each channel of each pixel) are the pixels flipped here."""
    model, (x, a, y) = tiny_model(1), batch(1, (10, 12))
    found = metrics.pixel_flipping(model, torch.from_numpy(x), torch.from_numpy(a[:, 0]), torch.from_numpy(y),
                                   features_in_step=8)  # fmt: skip
    expected = _quantus(quantus.PixelFlipping, model, x, a, y, features_in_step=8)
    assert found.curve.shape == (N, 1 + expected.shape[1]) == (N, 16)  # 120 pixels, 8 a step
    np.testing.assert_allclose(found.curve[:, 1:].numpy(), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("order", ["morf", "lerf"])
def test_region_perturbation_equals_quantus(order: str) -> None:
    """Regions of 4 pixels on a 10 x 14 image: the grid centred, those at the edges cut."""
    model, (x, a, y) = tiny_model(3), batch(3, (10, 14))
    found = metrics.region_perturbation(model, torch.from_numpy(x), torch.from_numpy(a[:, 0]), torch.from_numpy(y),
                                        patch_size=4, order=order, regions=8)  # fmt: skip
    expected = _quantus(quantus.RegionPerturbation, model, x, a, y, patch_size=4, order=order, regions_evaluation=8)
    np.testing.assert_allclose(found.drops.numpy(), expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(found.aopc.numpy(), np.concatenate([np.zeros((N, 1)), expected], 1).mean(1),
                               rtol=1e-4, atol=1e-6)  # fmt: skip


def test_selectivity_equals_quantus() -> None:
    model, (x, a, y) = tiny_model(3), batch(3, (12, 12))
    found = metrics.selectivity(model, torch.from_numpy(x), torch.from_numpy(a[:, 0]), torch.from_numpy(y),
                                patch_size=4)  # fmt: skip
    expected = _quantus(quantus.Selectivity, model, x, a, y, patch_size=4)
    assert found.curve.shape == (N, 10)  # the plain image, then 9 regions
    np.testing.assert_allclose(found.curve[:, 1:].numpy(), expected, rtol=1e-4, atol=1e-6)


def test_a_random_order_is_seeded_and_every_region_is_replaced_once() -> None:
    """Random orders differ by seed and repeat with it; all regions replaced, the image is the baseline."""
    model, (x, a, y) = tiny_model(3), batch(3, (8, 8))
    x, maps, target = torch.from_numpy(x), torch.from_numpy(a[:, 0]), torch.from_numpy(y)
    runs = [metrics.region_perturbation(model, x, maps, target, patch_size=4, order="random", seed=s).drops
            for s in (0, 0, 1)]  # fmt: skip
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    black = x.amin(dim=(1, 2, 3), keepdim=True).expand_as(x)
    with torch.no_grad():
        gone = model(black).softmax(-1)[torch.arange(N), target] - model(x).softmax(-1)[torch.arange(N), target]
    torch.testing.assert_close(-runs[0][:, -1], gone)


def test_faithfulness_estimate_equals_quantus() -> None:
    model, (x, a, y) = tiny_model(1), batch(1, (10, 12))
    found = metrics.faithfulness_estimate(model, torch.from_numpy(x), torch.from_numpy(a[:, 0]), torch.from_numpy(y),
                                          features_in_step=8)  # fmt: skip
    expected = _quantus(quantus.FaithfulnessEstimate, model, x, a, y, features_in_step=8)
    np.testing.assert_allclose(found.numpy(), expected, rtol=1e-4, atol=1e-5)


def test_faithfulness_correlation_equals_quantus_on_the_same_subsets(monkeypatch) -> None:
    """The subsets Quantus draws (numpy's choice, run after run, image after image) are recorded and passed to
    explain."""
    model, (x, a, y) = tiny_model(1), batch(1, (10, 12))
    runs, size, drawn = 12, 20, []
    choice = np.random.choice

    def recorded(*args, **kwargs):
        drawn.append(choice(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(np.random, "choice", recorded)
    expected = _quantus(quantus.FaithfulnessCorrelation, model, x, a, y, nr_runs=runs, subset_size=size,
                        return_aggregate=False)  # fmt: skip
    subsets = torch.from_numpy(np.array(drawn)).view(runs, N, size).permute(1, 0, 2)  # (N, runs, size)
    found = metrics.faithfulness_correlation(model, torch.from_numpy(x), torch.from_numpy(a[:, 0]),
                                             torch.from_numpy(y), subsets=subsets)  # fmt: skip
    np.testing.assert_allclose(found.numpy(), expected, rtol=1e-4, atol=1e-5)
    drawn_here = metrics.faithfulness_correlation(model, torch.from_numpy(x), torch.from_numpy(a[:, 0]),
                                                  torch.from_numpy(y), runs=runs, subset_size=size)  # fmt: skip
    assert torch.isfinite(drawn_here).all()


def test_monotonicity_follows_the_paper_and_not_quantus_baseline_over_baseline() -> None:
    """From each image's least value, pixels come back least relevant first, 8 at a time: monotonic where the
    probability never falls (the loop written out here). Quantus 0.6.0 writes the baseline over the baseline, so
    its probabilities never move and it calls every map monotonic."""
    model, (x, a, y) = tiny_model(1), batch(1, (10, 12))
    xt, maps, target = torch.from_numpy(x), torch.from_numpy(a[:, 0]), torch.from_numpy(y)
    found = metrics.monotonicity(model, xt, maps, target, features_in_step=8)
    expected = []
    for i in range(N):
        order = maps[i].flatten().argsort(stable=True)  # least first
        copy = xt[i].clone().flatten()
        copy[:] = xt[i].min()
        scores = []
        for step in range(15):
            copy[order[step * 8 : (step + 1) * 8]] = xt[i].flatten()[order[step * 8 : (step + 1) * 8]]
            with torch.no_grad():
                scores.append(model(copy.view(1, 1, 10, 12)).softmax(-1)[0, target[i]])
        expected.append(bool((torch.stack(scores).diff() >= 0).all()))
    assert found.tolist() == expected and not all(expected)
    assert all(_quantus(quantus.Monotonicity, model, x, a, y, features_in_step=8))


def test_monotonicity_correlation_equals_quantus_on_its_own_draws(monkeypatch) -> None:
    """Quantus replaces a group by one uniform value per draw (numpy's global generator, group after group, draw
    after draw): recorded, spread over each group's pixels, and passed to explain."""
    model, (x, a, y) = tiny_model(1), batch(1, (8, 8))  # one channel: Quantus' features are the pixels
    samples, step, drawn = 6, 4, []
    uniform = np.random.uniform

    def recorded(*args, **kwargs):
        drawn.append(uniform(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(np.random, "uniform", recorded)
    expected = _quantus(quantus.MonotonicityCorrelation, model, x, a, y, nr_samples=samples,
                        features_in_step=step)  # fmt: skip
    values = torch.from_numpy(np.array(drawn)).float().view(16, samples, N)  # (groups, samples, N)
    maps = torch.from_numpy(a[:, 0])
    group = maps.flatten(1).argsort(dim=1, stable=True).argsort(dim=1) // step  # each pixel's group, least first
    noise = values.permute(2, 1, 0).gather(2, group[:, None].expand(-1, samples, -1))  # (N, samples, pixels)
    noise = noise.view(N, samples, 1, 8, 8)
    found = metrics.monotonicity_correlation(model, torch.from_numpy(x), maps, torch.from_numpy(y),
                                             features_in_step=step, perturbations=noise)  # fmt: skip
    np.testing.assert_allclose(found.numpy(), expected, rtol=1e-4, atol=1e-5)
    own = metrics.monotonicity_correlation(model, torch.from_numpy(x), maps, torch.from_numpy(y),
                                           features_in_step=step, samples=4)  # fmt: skip
    assert own.shape == (N,) and bool(((own >= -1) & (own <= 1)).all())


def test_irof_equals_quantus_on_slic_superpixels(monkeypatch) -> None:
    """SLIC's superpixels of each image (as Quantus draws them), removed most relevant first; Quantus' number is
    its own area convention, read from the same curve. A constant baseline: Quantus' 'mean' is the whole batch's
    mean of the copies as they are being removed. One channel: Quantus' mask fits no other. Quantus calls numpy's
    trapz, which numpy 2 renamed trapezoid."""
    monkeypatch.setattr(np, "trapz", np.trapezoid, raising=False)
    model, (x, a, y) = tiny_model(1), batch(1, (16, 16))
    x = (x - x.min()) / (x.max() - x.min())  # SLIC takes images in [0, 1]
    found = metrics.irof(model, torch.from_numpy(x), torch.from_numpy(a[:, 0]), torch.from_numpy(y), baseline=0.0)
    expected = _quantus(quantus.IROF, model, x, a, y, perturb_baseline=0.0, return_aggregate=False)
    counts = (found.fractions > 0).sum(1) - (found.fractions == 1).sum(1) + 1  # each image's superpixels
    assert bool((counts > 3).all())  # SLIC cut each image into several superpixels
    own = [counts[i] - np.trapezoid(found.curve[i, 1 : counts[i] + 1].numpy(), dx=1.0) for i in range(N)]
    np.testing.assert_allclose(own, expected, rtol=1e-4, atol=1e-5)
    assert torch.allclose(found.curve[:, 0], torch.ones(N)) and bool((found.fractions[:, -1] == 1).all())


def test_irof_on_given_segments_is_the_curve_written_out() -> None:
    """Four quadrants, the map ranking them: removed one more at a time, the score over the plain one's."""
    model, (x, _, y) = tiny_model(3), batch(3, (8, 8))
    xt, target = torch.from_numpy(x), torch.from_numpy(y)
    quadrant = torch.arange(64).view(8, 8)
    segments = ((quadrant // 8 >= 4).long() * 2 + (quadrant % 8 >= 4).long()).expand(N, 8, 8)
    maps = torch.tensor([4.0, 1.0, 3.0, 2.0])[segments]  # quadrant 0 first, then 2, 3, 1
    found = metrics.irof(model, xt, maps, target, segments=segments * 10 + 7, baseline=0.0)  # any labels
    with torch.no_grad():
        plain = model(xt).softmax(-1)[torch.arange(N), target]
        copy, curve = xt.clone(), [torch.ones(N)]
        for quarter in (0, 2, 3, 1):
            copy[:, :, segments[0] == quarter] = 0.0
            curve.append(model(copy).softmax(-1)[torch.arange(N), target] / plain)
    torch.testing.assert_close(found.curve, torch.stack(curve, 1))
    torch.testing.assert_close(found.aoc, 1 - torch.trapezoid(torch.stack(curve, 1), dx=0.25, dim=1))
    with pytest.raises(ExplainError, match="segments must be one label image per input"):
        metrics.irof(model, xt, maps, target, segments=segments[:, :4])


def test_irof_of_images_with_fewer_superpixels_repeats_their_last_value_without_a_forward() -> None:
    """Image 1 has two superpixels, the others four: its curve ends after two removals and holds its last value;
    each copy is scored once (counted), the repeats taking the step before's score."""
    model, (x, _, y) = tiny_model(3), batch(3, (8, 8))
    xt, target = torch.from_numpy(x), torch.from_numpy(y)
    quadrant = torch.arange(64).view(8, 8)
    quarters = (quadrant // 8 >= 4).long() * 2 + (quadrant % 8 >= 4).long()
    segments = torch.stack([quarters, (quadrant % 8 >= 4).long(), quarters])
    maps = torch.rand(3, 8, 8)
    forwards = []
    handle = model.register_forward_pre_hook(lambda m, args: forwards.append(len(args[0])))
    found = metrics.irof(model, xt, maps, target, segments=segments, baseline=0.0)
    handle.remove()
    assert sum(forwards) == 3 + 4 + 2 + 4  # the plain images, then each image's own removals
    with torch.no_grad():
        for i in range(3):
            labels = segments[i].unique()
            means = torch.stack([maps[i][segments[i] == s].mean() for s in labels])
            copy, curve = xt[i : i + 1].clone(), [1.0]
            plain = model(xt[i : i + 1]).softmax(-1)[0, target[i]]
            for s in labels[means.argsort(descending=True)]:
                copy[:, :, segments[i] == s] = 0.0
                curve.append(float(model(copy).softmax(-1)[0, target[i]] / plain))
            curve += [curve[-1]] * (5 - len(curve))
            torch.testing.assert_close(found.curve[i], torch.tensor(curve))
    assert found.fractions[1].tolist() == [0.0, 0.5, 1.0, 1.0, 1.0]
