"""Faithfulness metrics (explain.metrics) against expectations computed here independently: a linear model on
pixels whose exact attribution and curves are known in closed form, a direct sparse solve of ROAD's imputation,
hand-placed maps and boxes, and a randomization whose effect on the map is known."""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path

import numpy as np
import pytest
import scipy.ndimage
import scipy.sparse
import scipy.sparse.linalg
import scipy.stats
import torch
from conftest import ASSETS, CAT, COFFEE, hook_count, manifest, reference_gradcam, seeded
from PIL import Image
from torch import nn

import explain
from explain import metrics
from explain.errors import ExplainError, TargetError

SIZE = (6, 7)
ASTRONAUT = ASSETS / "astronaut.png"


class PixelLinear(nn.Module):
    """Two logits: a weighted sum of the pixels, and 0. Class 0's logit is linear in every pixel."""

    def __init__(self, weights: torch.Tensor) -> None:
        super().__init__()
        self.weights = nn.Parameter(weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logit = (x * self.weights).flatten(1).sum(dim=1)
        return torch.stack([logit, torch.zeros_like(logit)], dim=1)


def linear_case(seed: int = 0, scale: float = 1.0):
    """The model, positive images (2, 3, 6, 7), and the exact attribution of class 0: sum over channels of w x."""
    generator = torch.Generator().manual_seed(seed)
    weights = scale * (torch.rand(3, *SIZE, generator=generator) + 0.1)
    x = torch.rand(2, 3, *SIZE, generator=generator) + 0.5
    return PixelLinear(weights).eval(), x, (weights * x).sum(dim=1)


def trapezoid(curve: np.ndarray) -> np.ndarray:
    steps = curve.shape[1] - 1
    return (curve[:, 1:] + curve[:, :-1]).sum(axis=1) / (2 * steps)


def test_deletion_and_insertion_of_a_linear_model_follow_its_exact_attribution() -> None:
    model, x, attribution = linear_case()
    pixels = SIZE[0] * SIZE[1]
    contributions = attribution.flatten(1).double().numpy()
    best_first = -np.sort(-contributions, axis=1)
    total = contributions.sum(axis=1, keepdims=True)
    start = np.zeros((2, 1))
    expected_deletion = total - np.concatenate([start, best_first.cumsum(axis=1)], axis=1)
    expected_reversed = total - np.concatenate([start, best_first[:, ::-1].cumsum(axis=1)], axis=1)
    expected_insertion = np.concatenate([start, best_first.cumsum(axis=1)], axis=1)

    exact = metrics.deletion(model, x, attribution, 0, steps=pixels, score="logit")
    reversed_ = metrics.deletion(model, x, -attribution, 0, steps=pixels, score="logit")
    inserted = metrics.insertion(model, x, attribution, 0, steps=pixels, baseline=0.0, score="logit")
    np.testing.assert_allclose(exact.curve.numpy(), expected_deletion, rtol=1e-5)
    np.testing.assert_allclose(reversed_.curve.numpy(), expected_reversed, rtol=1e-5)
    np.testing.assert_allclose(inserted.curve.numpy(), expected_insertion, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(exact.auc.numpy(), trapezoid(expected_deletion), rtol=1e-5)
    assert (exact.auc < reversed_.auc).all()
    np.testing.assert_allclose(exact.fractions.numpy(), np.arange(pixels + 1) / pixels, rtol=1e-6)

    # The default score: the softmax probability of class 0 against the constant logit 0, a sigmoid.
    probability = metrics.deletion(model, x, attribution, 0, steps=pixels)
    np.testing.assert_allclose(probability.curve.numpy(), 1 / (1 + np.exp(-expected_deletion)), rtol=1e-5)
    assert ((probability.auc >= 0) & (probability.auc <= 1)).all()

    # Coarser steps: step s removes round(s * pixels / steps) pixels; maps at another resolution are upsampled.
    coarse = metrics.deletion(model, x, attribution, 0, steps=4, score="logit")
    counts = [round(s * pixels / 4) for s in range(5)]
    np.testing.assert_allclose(coarse.curve.numpy(), expected_deletion[:, counts], rtol=1e-5)


def test_insertion_starts_from_the_rise_blur() -> None:
    model, x, attribution = linear_case(1)
    offsets = np.arange(11) - 5
    line = np.exp(-(offsets**2) / 50)
    kernel = np.outer(line, line) / np.outer(line, line).sum()
    blurred = np.stack(
        [[scipy.ndimage.convolve(c, kernel, mode="constant") for c in image] for image in x.double().numpy()]
    )
    weights = model.weights.detach().double().numpy()
    result = metrics.insertion(model, x, attribution, 0, steps=2, score="logit")
    np.testing.assert_allclose(result.curve[:, 0].numpy(), (blurred * weights).sum(axis=(1, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(
        result.curve[:, -1].numpy(), (x.double().numpy() * weights).sum(axis=(1, 2, 3)), rtol=1e-5
    )


def test_confidence_metrics_on_the_linear_model() -> None:
    model, x, attribution = linear_case(2, scale=0.02)  # logits about 1.5: probabilities not saturated
    low, high = attribution.amin(dim=(1, 2), keepdim=True), attribution.amax(dim=(1, 2), keepdim=True)
    weights = ((attribution - low) / (high - low))[:, None]
    logit = lambda images: (images * model.weights.detach()).flatten(1).sum(dim=1).double()  # noqa: E731
    original, explained = torch.sigmoid(logit(x)), torch.sigmoid(logit(x * weights))
    drop = metrics.average_drop(model, x, attribution, 0)
    torch.testing.assert_close(drop.original.double(), original, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(drop.explained.double(), explained, rtol=1e-5, atol=1e-6)
    expected_drop = 100 * (original - explained).clamp_min(0) / original
    torch.testing.assert_close(drop.value.double(), expected_drop, rtol=1e-4, atol=1e-4)
    assert (drop.value > 0).all()  # dimming the positive pixels lowers the score

    increase = metrics.increase_in_confidence(model, x, attribution, 0)
    assert increase.value.tolist() == [0.0, 0.0]
    # Class 1's probability rises when class 0's falls: an increase, and a gain of (O - Y) / (1 - Y).
    rises = metrics.increase_in_confidence(model, x, attribution, 1)
    assert rises.value.tolist() == [100.0, 100.0]
    gain = metrics.average_gain(model, x, attribution, 1)
    expected_gain = 100 * ((1 - explained) - (1 - original)) / original
    torch.testing.assert_close(gain.value.double(), expected_gain, rtol=1e-4, atol=1e-4)


def direct_imputation(image: np.ndarray, removed: np.ndarray) -> np.ndarray:
    """ROAD's linear imputation by a direct sparse solve, one equation per removed pixel, built pixel by pixel."""
    channels, h, w = image.shape
    weights = {(dy, dx): (1 / 12 if dy and dx else 1 / 6) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if dy or dx}
    unknown = {p: i for i, p in enumerate(zip(*np.nonzero(removed)))}
    matrix = scipy.sparse.lil_matrix((len(unknown), len(unknown)))
    rhs = np.zeros((len(unknown), channels))
    for (y, x), i in unknown.items():
        for (dy, dx), weight in weights.items():
            if 0 <= y + dy < h and 0 <= x + dx < w:
                matrix[i, i] += weight
                if (y + dy, x + dx) in unknown:
                    matrix[i, unknown[y + dy, x + dx]] -= weight
                else:
                    rhs[i] += weight * image[:, y + dy, x + dx]
    solution = np.atleast_2d(scipy.sparse.linalg.spsolve(matrix.tocsc(), rhs))
    out = image.copy()
    for (y, x), i in unknown.items():
        out[:, y, x] = solution[i]
    return out


def test_noisy_linear_imputation_equals_a_direct_sparse_solve() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 3, 23, 31, generator=generator)
    removed = torch.rand(3, 23, 31, generator=generator) < torch.tensor([0.3, 0.6, 0.9])[:, None, None]
    removed[2, 2:20, 3:25] = True  # a large hole, far from the kept pixels
    imputed = metrics.noisy_linear_imputation(x, removed, noise=0)
    for i in range(3):
        expected = direct_imputation(x[i].double().numpy(), removed[i].numpy())
        np.testing.assert_allclose(imputed[i].double().numpy(), expected, atol=1e-4)
    noisy = metrics.noisy_linear_imputation(x, removed, noise=0.01, generator=torch.Generator().manual_seed(0))
    difference = (noisy - imputed)[removed[:, None].expand_as(x)]
    assert abs(float(difference.std()) - 0.01) < 0.001
    assert torch.equal(noisy[~removed[:, None].expand_as(x)], x[~removed[:, None].expand_as(x)])
    with pytest.raises(ExplainError, match="every pixel"):
        metrics.noisy_linear_imputation(x, torch.ones(3, 23, 31, dtype=torch.bool))


def test_road_scores_the_imputed_images() -> None:
    model, x, attribution = linear_case(4)
    result = metrics.road(model, x, attribution, 0, percentiles=(25, 50), noise=0, score="logit")
    weights = model.weights.detach().double().numpy()
    pixels = SIZE[0] * SIZE[1]
    order = np.argsort(-attribution.flatten(1).numpy(), axis=1, kind="stable")
    for i in range(2):
        for j, share in enumerate((25, 50)):
            count = round(share / 100 * pixels)
            for kind, chosen in (("morf", order[i, :count]), ("lerf", order[i, pixels - count :])):
                removed = np.zeros(pixels, dtype=bool)
                removed[chosen] = True
                imputed = direct_imputation(x[i].double().numpy(), removed.reshape(SIZE))
                expected = (imputed * weights).sum()
                assert abs(float(getattr(result, kind)[i, j]) - expected) < 1e-3, (kind, i, share)
    assert (result.morf < result.lerf).all()  # the most relevant pixels matter most to a linear model
    assert result.combined.shape == (2,) and (result.combined > 0).all()


def box_map(center: tuple[int, int], size: tuple[int, int] = (100, 120)) -> torch.Tensor:
    """A map at the input's size whose single maximum is at ``center`` (y, x)."""
    ys, xs = torch.meshgrid(torch.arange(size[0]), torch.arange(size[1]), indexing="ij")
    return -((ys - center[0]) ** 2 + (xs - center[1]) ** 2).float()


def test_pointing_games_on_hand_placed_maps_and_boxes() -> None:
    size = (100, 120)
    box = torch.tensor([40.0, 30.0, 60.0, 50.0])  # x1, y1, x2, y2: pixels 40..59 by 30..49
    maps = torch.stack(
        [
            box_map((40, 50)),  # inside
            box_map((40, 59 + 15)),  # 15 px right of the box's last column: within the tolerance
            box_map((40, 59 + 16)),  # 16 px: a miss
            box_map((49 + 11, 59 + 11)),  # diagonal, sqrt(2) * 11 = 15.6 px: a miss
            torch.zeros(size),  # flat: points nowhere
        ]
    )
    hits = metrics.pointing_game(maps, box.expand(5, 4), size)
    assert hits.tolist() == [True, True, False, False, False]
    masks = torch.zeros(5, *size, dtype=torch.bool)
    masks[:, 30:50, 40:60] = True
    assert metrics.pointing_game(maps, masks, size).tolist() == hits.tolist()
    # Several boxes for an image: a hit on any; maps at a lower resolution are upsampled.
    boxes = [torch.tensor([[0.0, 0.0, 10.0, 10.0], [40.0, 30.0, 60.0, 50.0]])] * 2
    low = torch.nn.functional.avg_pool2d(maps[:2, None], 4)[:, 0]
    assert metrics.pointing_game(low, boxes, size).tolist() == [True, True]

    energy_maps = torch.zeros(2, *size)
    energy_maps[0, 30:50, 40:60] = 1.0  # all inside
    energy_maps[1, 30:50, 50:70] = 1.0  # half inside
    energy_maps[1, 0:10, 0:20] = 2.0  # 400 outside
    shares = metrics.energy_pointing_game(energy_maps, box.expand(2, 4), size)
    torch.testing.assert_close(shares, torch.tensor([1.0, 200 / (400 + 400)]))
    with pytest.raises(ExplainError, match="non-negative"):
        metrics.energy_pointing_game(-energy_maps, box.expand(2, 4), size)


def test_sanity_check_against_a_randomization_done_here() -> None:
    model = seeded("resnet18", num_classes=10)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 128, 128)
    assert metrics.cascading_blocks(model)[:4] == ["fc", "layer4.1", "layer4.0", "layer3.1"]
    assert metrics.cascading_blocks(model)[-2:] == ["bn1", "conv1"]

    # Eigen-CAM at layer4 does not depend on the classifier: randomizing it leaves the maps exactly as they were.
    eigen = metrics.sanity_check(model, x, "eigencam", layer="layer4", blocks=["fc"])
    torch.testing.assert_close(eigen.spearman, torch.ones(1, 2))
    torch.testing.assert_close(eigen.ssim, torch.ones(1, 2))
    assert eigen.insensitive()
    # So do random channel weights; the method's own seed goes with its options.
    random = metrics.sanity_check(model, x, "random", layer="layer4", blocks=["fc"], seed=3)
    torch.testing.assert_close(random.spearman, torch.ones(1, 2))

    # Grad-CAM does: its randomized maps are those of the classifier re-drawn here with the same seed.
    result = metrics.sanity_check(model, x, "gradcam", layer="layer4", blocks=["fc", "layer4.1"], init_seed=7)
    classes = model(x).argmax(dim=1).tolist()
    randomized = copy.deepcopy(model)
    trained_maps = reference_gradcam(model, x, "layer4", classes)
    for depth, name in enumerate(["fc", "layer4.1"]):
        torch.manual_seed(7 + depth)
        for module in randomized.get_submodule(name).modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        maps = reference_gradcam(randomized, x, "layer4", classes)
        for i in range(2):
            up = [
                torch.nn.functional.interpolate(m[None, None].float(), (128, 128), mode="bilinear")[0, 0]
                for m in (trained_maps[i], maps[i])
            ]
            expected = scipy.stats.spearmanr(up[0].flatten().numpy(), up[1].flatten().numpy()).statistic
            assert abs(float(result.spearman[depth, i]) - expected) < 1e-3
    assert result.blocks == ["fc", "layer4.1"] and result.depths == [1, 2]
    # The trained model's result is Grad-CAM's own on the model: the same classes, the reference's maps.
    trained = result.trained
    assert trained.class_indices.tolist() == classes and trained.layer == "layer4"
    torch.testing.assert_close(trained.raw.double(), trained_maps, rtol=1e-4, atol=1e-6 * trained_maps.max())
    # Compared at depth 2 alone, the maps are the same: the blocks are randomized in order all the same.
    alone = metrics.sanity_check(
        model, x, "gradcam", layer="layer4", blocks=["fc", "layer4.1", "layer4.0"], init_seed=7, depths=[2]
    )
    assert alone.depths == [2] and alone.blocks == ["fc", "layer4.1", "layer4.0"]
    torch.testing.assert_close(alone.spearman, result.spearman[1:])
    with pytest.raises(ExplainError, match="depth 1"):
        alone.insensitive()
    with pytest.raises(ExplainError, match=r"depths must lie in 1\.\.2"):
        metrics.sanity_check(model, x, "gradcam", layer="layer4", blocks=["fc", "layer4.1"], depths=[3])
    assert hook_count(model) == 0 and not any(p.grad is not None for p in model.parameters())


def test_metrics_take_a_results_target_and_refuse_what_does_not_fit() -> None:
    model = seeded("resnet18", num_classes=10)
    torch.manual_seed(2)
    x = torch.randn(2, 3, 64, 64)
    result = explain.GradCAM(model, "layer4")(x, [3, 5])
    by_result = metrics.deletion(model, x, result.raw, result.target, steps=4)
    by_class = metrics.deletion(model, x, result.cams, [3, 5], steps=4)
    torch.testing.assert_close(by_result.curve, by_class.curve)  # raw maps at 2x2 rank like their upsampled cams
    expected_start = model(x).softmax(dim=1)[[0, 1], [3, 5]]
    torch.testing.assert_close(by_result.curve[:, 0], expected_start.detach())

    topk = explain.GradCAM(model, "layer4")(x, topk=2)
    with pytest.raises(TargetError, match=r"maps\[:, k\]"):
        metrics.deletion(model, x, topk.cams[:, 0], topk.target)
    with pytest.raises(ExplainError, match="one map per input"):
        metrics.insertion(model, x, topk.cams, [3, 5])
    similarity = explain.targets.SimilarityTarget(torch.randn(10))
    with pytest.raises(TargetError, match="score='target'"):
        metrics.average_drop(model, x, result.cams, similarity)
    own = metrics.average_drop(model, x, result.cams, similarity, score="target")
    assert own.value.shape == (2,)
    assert hook_count(model) == 0 and model.training is False


def test_random_maps_score_worse_than_gradcam_on_real_photos(lite0: explain.ModelSpec) -> None:
    """The random baseline, a map of uniform noise, against Grad-CAM: real weights, real photos."""
    model, x = lite0.model, lite0.preprocess([CAT, COFFEE, ASTRONAUT])
    result = explain.GradCAM(model)(x)
    noise = torch.rand(result.raw.shape, generator=torch.Generator().manual_seed(0))
    for metric, better in ((metrics.deletion, torch.lt), (metrics.insertion, torch.gt)):
        gradcam = metric(model, x, result.cams, result.target, steps=16).auc
        random = metric(model, x, noise, result.target, steps=16).auc
        assert better(gradcam, random).all(), (metric.__name__, gradcam, random)


def test_cli_metrics_in_the_manifest_and_the_summary_files(lite0: explain.ModelSpec, tmp_path, capsys) -> None:
    from explain.cli import main

    out = tmp_path / "out"
    code = main(
        [str(CAT), str(COFFEE), "--model", "efficientnet_lite0", "--metrics", "insertion,deletion,drop", "-o", str(out)]
    )
    assert code == 0
    records = manifest(out)
    # Each image's values are the API's on the same images and maps.
    x = lite0.preprocess([CAT, COFFEE])
    result = explain.GradCAM(lite0.model)(x)
    expected = {
        "deletion": metrics.deletion(lite0.model, x, result.cams, result.target).auc,
        "insertion": metrics.insertion(lite0.model, x, result.cams, result.target).auc,
        "drop": metrics.average_drop(lite0.model, x, result.cams, result.target).value,
    }
    for i, record in enumerate(records):
        (target,) = record["targets"]
        assert list(target["metrics"]) == ["deletion", "insertion", "drop"]  # catalog order
        for name, values in expected.items():
            assert abs(target["metrics"][name] - float(values[i])) < 1e-4, name
        assert len(target["curves"]["deletion"]) == 51 and set(target["curves"]) == {"deletion", "insertion"}
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [(r["method"], r["metric"]) for r in rows] == [
        ("gradcam", "deletion"),
        ("gradcam", "insertion"),
        ("gradcam", "drop"),
    ]
    for row in rows:
        mean = float(expected[row["metric"]].mean())
        assert abs(float(row["mean"]) - mean) < 1e-4
        assert float(row["ci95_low"]) <= float(row["mean"]) <= float(row["ci95_high"])
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["rows"][0]["better"] == "lower" and set(summary["curves"]) == {"deletion", "insertion"}
    plot = np.asarray(Image.open(out / "metrics.png").convert("L"))
    assert plot.shape[1] > plot.shape[0] and (plot < 128).mean() > 0.01  # two panels with lines and text
    printed = capsys.readouterr().out
    assert "gradcam deletion:" in printed and "95% CI" in printed


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--metrics", "deletion,speed"], "unknown metric(s) 'speed'"),
        (["--metrics", "deletion", "--method", "all"], "--metrics measures one map per image"),
        (["--metrics", "deletion", "--topk", "2"], "--metrics measures one map per image"),
    ],
)
def test_cli_metrics_usage_errors(arguments: list[str], message: str, tmp_path, capsys) -> None:
    from explain.cli import main

    out = tmp_path / "out"
    assert main([str(CAT), "--model", "efficientnet_lite0", "-o", str(out), *arguments]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_several_methods_each_write_their_outputs_and_records(tmp_path, capsys) -> None:
    from explain.cli import main

    out = tmp_path / "out"
    methods = "gradcam,layercam,eigencam"
    arguments = ["--model", "efficientnet_lite0", "--method", methods, "--format", "png", "-o", str(out)]
    code = main([str(CAT), str(COFFEE), *arguments])
    assert code == 0
    records = manifest(out)
    assert [(Path(r["input"]).name, r["method"]) for r in records] == [
        (photo, method) for photo in ("chelsea.png", "coffee.png") for method in methods.split(",")
    ]
    model = explain.load_model("efficientnet_lite0")
    x = model.preprocess([CAT, COFFEE])
    for record in records:
        (target,) = record["targets"]
        written = np.asarray(Image.open(out / target["output"]))
        i = 0 if record["input"].endswith("chelsea.png") else 1
        cam = explain.cam(model.model, x, record["method"])[i]
        expected = np.asarray(explain.overlay(Image.open(record["input"]).convert("RGB"), cam))
        assert np.abs(written.astype(int) - expected.astype(int)).max() <= 1, record["method"]


def test_cli_sanity_check_files_and_verdicts(lite0: explain.ModelSpec, tmp_path, capsys) -> None:
    from explain.cli import main

    out = tmp_path / "out"
    arguments = [str(CAT), str(tmp_path / "missing.png"), "--model", "efficientnet_lite0"]
    code = main([*arguments, "--method", "gradcam,eigencam", "--sanity-check", "-o", str(out)])
    assert code == 1  # the missing photo is an error; the other is tested
    rows = list(csv.DictReader((out / "sanity.csv").open()))
    blocks = metrics.cascading_blocks(lite0.model)
    assert [(r["method"], r["block"]) for r in rows] == [(m, b) for m in ("gradcam", "eigencam") for b in blocks]
    expected = metrics.sanity_check(lite0.model, lite0.preprocess(CAT), "gradcam")
    gradcam = [float(r["spearman"]) for r in rows if r["method"] == "gradcam"]
    np.testing.assert_allclose(gradcam, expected.spearman[:, 0].numpy(), atol=1e-5)
    eigen_first = next(r for r in rows if r["method"] == "eigencam")
    assert float(eigen_first["spearman"]) == pytest.approx(1.0) and eigen_first["fails"] == "True"
    assert Image.open(out / "sanity.png").size[0] > 400
    captured = capsys.readouterr()
    assert "eigencam: FAILS" in captured.out and "gradcam: " in captured.out
    assert "missing.png" in captured.err and len(captured.err.strip().splitlines()) == 1
