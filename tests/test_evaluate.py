"""``explain evaluate``: the bundled model and photos scored by a grid of methods with the metrics, each value the
metric's own on the method's own map, the ranking and its files, a run killed midway resumed, a budget that runs
out, and bad inputs refused with one line."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import explain
from explain import metrics
from explain.cli import main
from explain.evaluation.ranking import rank
from explain.explorer.session import bundled_photos


def _masks(folder: Path) -> Path:
    """A mask per bundled photo: its central quarter."""
    folder.mkdir()
    for photo in bundled_photos():
        width, height = Image.open(photo).size
        mask = np.zeros((height, width), dtype=np.uint8)
        mask[height // 4 : 3 * height // 4, width // 4 : 3 * width // 4] = 255
        Image.fromarray(mask).save(folder / f"{photo.stem}.png")
    return folder


def _scores(out: Path) -> dict[tuple[str, str, str], float]:
    lines = (out / "scores.jsonl").read_text().splitlines()
    return {(r["image"], r["configuration"], r["metric"]): r["value"] for r in map(json.loads, lines)}


def test_the_bundled_photos_are_scored_ranked_and_reported(lite0, tmp_path, capsys) -> None:
    out, photos = tmp_path / "out", bundled_photos()
    assert main(["evaluate", *map(str, photos), "--methods", "gradcam,layercam", "--metrics",
                 "sparseness,relevance_mass_accuracy,deletion", "--masks", str(_masks(tmp_path / "masks")),
                 "-o", str(out), "--quiet"]) == 0  # fmt: skip
    assert capsys.readouterr().out.strip().endswith(f"-> {out / 'evaluation.md'}")
    scores = _scores(out)
    assert len(scores) == 3 * 2 * 3
    for photo in photos:  # each value is the metric's own, on the method's own map
        image = explain.load_image(photo)
        x = lite0.preprocess(image)
        result = explain.GradCAM(lite0.model)(x)
        mask = np.asarray(Image.open(tmp_path / "masks" / f"{photo.stem}.png").resize(x.shape[-1:-3:-1], 0)) > 0
        expected = {
            "sparseness": metrics.sparseness(result.cams),
            "relevance_mass_accuracy": metrics.relevance_mass_accuracy(result.cams, torch.from_numpy(mask)[None],
                                                                       x.shape[-2:]),
            "deletion": metrics.deletion(lite0.model, x, result.cams, result.target).auc,
        }  # fmt: skip
        for name, value in expected.items():
            assert scores[(photo.name, "gradcam", name)] == pytest.approx(float(value), rel=1e-4, abs=1e-6)
    rows = list(csv.DictReader((out / "evaluation.csv").open()))
    assert len(rows) == 2 * 3 and {r["metric"] for r in rows} == {"sparseness", "relevance_mass_accuracy", "deletion"}
    gradcam = [v for (_, c, m), v in scores.items() if c == "gradcam" and m == "deletion"]
    row = next(r for r in rows if r["configuration"] == "gradcam" and r["metric"] == "deletion")
    assert float(row["mean"]) == pytest.approx(np.mean(gradcam)) and float(row["low"]) <= float(row["high"])
    report = (out / "evaluation.md").read_text()
    assert "## Ranking" in report and ("Recommended" in report or "No recommendation" in report)
    assert Image.open(out / "evaluation.png").size[0] > 0
    curves = [json.loads(line) for line in (out / "scores.jsonl").read_text().splitlines()]
    first = next(r for r in curves if r["metric"] == "deletion" and r["configuration"] == "gradcam")
    image = explain.load_image(next(p for p in photos if p.name == first["image"]))
    x = lite0.preprocess(image)
    result = explain.GradCAM(lite0.model)(x)
    expected = metrics.deletion(lite0.model, x, result.cams, result.target).curve[0]
    assert first["curve"] == pytest.approx(expected.tolist(), abs=1e-5)  # the curve behind the AUC, kept
    assert Image.open(out / "evaluation.curves.png").size[0] > 0


def test_a_configuration_better_everywhere_is_recommended_and_a_tie_is_not() -> None:
    rng = np.random.default_rng(0)
    good, bad = rng.normal(1.0, 0.1, 40), rng.normal(0.0, 0.1, 40)
    clear = rank({"a": np.stack([good, bad]), "b": np.stack([-good, -bad])}, ["x", "y"], {"a": True, "b": False})
    assert clear.order == ["x", "y"] and clear.recommended == "x" and clear.rank[0].mean == 1.0
    same = rng.normal(0.5, 0.3, (2, 40))
    assert rank({"a": same}, ["x", "y"], {"a": True}).recommended is None


def test_a_run_killed_midway_resumes_where_it_stopped(lite0, tmp_path) -> None:
    """A run killed after its first values, then resumed: only the missing values are computed, and all equal an
    uninterrupted run's."""
    photos = [str(p) for p in bundled_photos()]
    command = [sys.executable, "-m", "explain", "evaluate", *photos, "--methods", "gradcam,layercam", "--metrics",
               "sparseness,deletion", "--quiet"]  # fmt: skip
    killed = tmp_path / "killed"
    process = subprocess.Popen([*command, "-o", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = killed / "scores.jsonl"
    for _ in range(600):
        if log.is_file() and len(log.read_text().splitlines()) >= 7:  # the sparseness values and a deletion
            break
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    before = _scores(killed)
    assert 6 < len(before) < 12
    assert main(["evaluate", *photos, "--methods", "gradcam,layercam", "--metrics", "sparseness,deletion",
                 "-o", str(killed), "--resume", "--quiet"]) == 0  # fmt: skip
    lines = (killed / "scores.jsonl").read_text().splitlines()
    assert len(lines) == 12  # nothing computed twice
    fresh = tmp_path / "fresh"
    assert main(["evaluate", *photos, "--methods", "gradcam,layercam", "--metrics", "sparseness,deletion",
                 "-o", str(fresh), "--quiet"]) == 0  # fmt: skip
    assert _scores(killed) == pytest.approx(_scores(fresh))


def test_a_budget_that_runs_out_leaves_the_costly_metrics_unfinished(lite0, tmp_path) -> None:
    out = tmp_path / "out"
    assert main(["evaluate", str(bundled_photos()[0]), "--metrics", "sparseness,deletion", "--budget", "0s",
                 "-o", str(out), "--quiet"]) == 0  # fmt: skip
    assert "ran out before these metrics finished: sparseness, deletion" in (out / "evaluation.md").read_text()


def test_bad_inputs_are_one_line_each(lite0, tmp_path, capsys) -> None:
    photo = bundled_photos()[0]
    masks = tmp_path / "masks"
    masks.mkdir()
    Image.fromarray(np.zeros((10, 10), dtype=np.uint8)).save(masks / f"{photo.stem}.png")
    out = tmp_path / "out"
    assert main(["evaluate", str(photo), "--masks", str(masks), "-o", str(out)]) == 2
    assert main(["evaluate", str(photo), "--metrics", "sparseness,nope", "-o", str(out)]) == 2
    assert main(["evaluate", str(photo), "--metrics", "pointing_game", "-o", str(out)]) == 2
    assert main(["evaluate", str(photo), "--metrics", "sparseness", "-o", str(out), "--quiet"]) == 0
    assert main(["evaluate", str(photo), "--metrics", "sparseness", "-o", str(out), "--quiet"]) == 2  # not afresh
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith(f"explain: error: {masks / photo.stem}.png: a 10x10 mask for a ")
    assert lines[1].startswith("explain: error: unknown metric 'nope'")
    assert lines[2] == ("explain: error: pointing_game scores a map against the object: give the objects' masks "
                        "(--masks DIR) or boxes (--boxes FILE)")  # fmt: skip
    assert "holds an earlier evaluation" in lines[3] and "--resume" in lines[3] and len(lines) == 4


def test_the_newer_metrics_run_in_evaluate_as_they_run_alone(lite0, tmp_path) -> None:
    """One photo, Grad-CAM: each value equals the metric's own call, seeded as evaluate seeds it."""
    photo = bundled_photos()[0]
    names = ["random_logit", "relative_input_stability", "continuity", "irof", "monotonicity_correlation"]
    assert main(["evaluate", str(photo), "--methods", "gradcam", "--metrics", ",".join(names),
                 "-o", str(tmp_path / "out"), "--quiet"]) == 0  # fmt: skip
    scores = _scores(tmp_path / "out")
    x = lite0.preprocess(explain.load_image(photo))
    gradcam = explain.GradCAM(lite0.model)
    result = gradcam(x)
    step = -(-x.shape[-1] * x.shape[-2] // 16)
    calls = {
        "random_logit": lambda: metrics.random_logit(gradcam, x, result.target, seed=None),
        "relative_input_stability": lambda: metrics.relative_input_stability(gradcam, x, result.target, samples=20,
                                                                             seed=None),
        "continuity": lambda: metrics.continuity(gradcam, x, result.target),
        "irof": lambda: metrics.irof(lite0.model, x, result.cams, result.target).aoc,
        "monotonicity_correlation": lambda: metrics.monotonicity_correlation(
            lite0.model, x, result.cams, result.target, samples=10, seed=None, features_in_step=step),
    }  # fmt: skip
    for name in names:
        torch.manual_seed(0)
        assert scores[(photo.name, "gradcam", name)] == pytest.approx(float(calls[name]()), rel=1e-4, abs=1e-6), name


def test_boxes_are_the_objects_as_their_filled_masks_are(lite0, tmp_path, capsys) -> None:
    """A box per photo scores as the mask that fills it; a box outside its image, or a photo without one, is one
    line."""
    photos = bundled_photos()[:2]
    boxes, masks = {}, tmp_path / "masks"
    masks.mkdir()
    for photo in photos:
        width, height = Image.open(photo).size
        boxes[photo.name] = [width // 5, height // 6, width // 2, height - 1]
        mask = np.zeros((height, width), dtype=np.uint8)
        mask[height // 6 : height - 1, width // 5 : width // 2] = 255
        Image.fromarray(mask).save(masks / f"{photo.stem}.png")
    (tmp_path / "boxes.json").write_text(json.dumps(boxes))
    chosen = ["--methods", "gradcam", "--metrics", "relevance_mass_accuracy,pointing_game", "--quiet"]
    assert main(["evaluate", *map(str, photos), "--boxes", str(tmp_path / "boxes.json"), "-o", str(tmp_path / "b"),
                 *chosen]) == 0  # fmt: skip
    assert main(["evaluate", *map(str, photos), "--masks", str(masks), "-o", str(tmp_path / "m"), *chosen]) == 0
    assert _scores(tmp_path / "b") == _scores(tmp_path / "m")
    capsys.readouterr()
    (tmp_path / "bad.json").write_text(json.dumps({photos[0].name: [0, 0, 10_000, 10], photos[1].name: [0, 0, 5, 5]}))
    (tmp_path / "one.json").write_text(json.dumps({photos[0].name: [0, 0, 5, 5]}))
    for name in ("bad.json", "one.json"):
        assert main(["evaluate", *map(str, photos), "--boxes", str(tmp_path / name), "-o", str(tmp_path / name),
                     *chosen]) == 2  # fmt: skip
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "[0, 0, 10000, 10] is not [x1, y1, x2, y2] inside the" in lines[0]
    assert lines[1] == f"explain: error: {photos[1]}: no box for {photos[1].name!r} in --boxes"


def test_a_detector_and_a_segmenter_are_evaluated_on_their_own_targets(tmp_path, capsys) -> None:
    """A detector's map explains its most confident detection, a segmenter's the class winning the most pixels;
    the model-based metrics score that target's own score (each value equal to the metric's own call), and a
    metric of a classifier's classes is refused with one line."""
    from conftest import random_detector, random_segmenter

    from explain.tasks.registry import task_of

    photo = bundled_photos()[0]
    detector, segmenter = tmp_path / "frcnn.pt", tmp_path / "lraspp.pt"
    torch.save(random_detector((320, 400), num_classes=91).state_dict(), detector)
    torch.save(random_segmenter(4).state_dict(), segmenter)
    for model, weights in (("fasterrcnn_mobilenet_v3_large_fpn", detector), ("lraspp_mobilenet_v3_large", segmenter)):
        out = tmp_path / model
        assert main(["evaluate", str(photo), "--model", model, "--weights", str(weights), "--methods", "gradcam",
                     "--metrics", "sparseness,average_drop", "-o", str(out), "--quiet"]) == 0  # fmt: skip
        spec = explain.load_model(model, str(weights))
        x = spec.preprocess(explain.load_image(photo))
        target = task_of(spec).evaluated(spec, photo.name, x)
        assert type(target).__name__ == ("DetectionTarget" if "rcnn" in model else "SegmentationTarget")
        result = explain.GradCAM(spec.model)(x, target)
        expected = metrics.average_drop(spec.model, x, result.cams.reshape(1, *x.shape[-2:]), target, score="target")
        scores = _scores(out)
        assert scores[(photo.name, "gradcam", "average_drop")] == pytest.approx(float(expected.value), rel=1e-4)
        assert scores[(photo.name, "gradcam", "sparseness")] == pytest.approx(float(metrics.sparseness(result.cams)))
    capsys.readouterr()
    assert main(["evaluate", str(photo), "--model", "fasterrcnn_mobilenet_v3_large_fpn", "--weights", str(detector),
                 "--metrics", "random_logit", "-o", str(tmp_path / "no")]) == 2  # fmt: skip
    assert capsys.readouterr().err.strip() == ("explain: error: random_logit reads a classifier's classes; the model "
                                               "is a detection model: leave it out")  # fmt: skip


def test_a_vision_transformer_is_evaluated_as_a_cnn_is(tmp_path) -> None:
    """A timm ViT (random weights, offline from a state dict): its maps laid out from its tokens, each value the
    metric's own."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    weights = tmp_path / "vit.pt"
    torch.save(timm.create_model("vit_tiny_patch16_224", pretrained=False).state_dict(), weights)
    photo = bundled_photos()[0]
    assert main(["evaluate", str(photo), "--model", "timm/vit_tiny_patch16_224", "--weights", str(weights),
                 "--methods", "gradcam", "--metrics", "sparseness,average_drop", "-o", str(tmp_path / "out"),
                 "--quiet"]) == 0  # fmt: skip
    spec = explain.load_model("timm/vit_tiny_patch16_224", str(weights))
    x = spec.preprocess(explain.load_image(photo))
    result = explain.GradCAM(spec.model)(x)
    scores = _scores(tmp_path / "out")
    expected = metrics.average_drop(spec.model, x, result.cams, result.target).value
    assert scores[(photo.name, "gradcam", "average_drop")] == pytest.approx(float(expected), rel=1e-4)
    assert scores[(photo.name, "gradcam", "sparseness")] == pytest.approx(float(metrics.sparseness(result.cams)))
