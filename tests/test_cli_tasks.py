"""Segmenters and detectors by name on the command line: checkpoints of torchvision architectures with random
weights, checked against the same architecture run here by torchvision alone on the same pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from conftest import CAT, manifest, random_detector, random_segmenter
from PIL import Image

from explain.cli import main

SEGMENTER, DETECTOR = "lraspp_mobilenet_v3_large", "fasterrcnn_mobilenet_v3_large_fpn"
WHITE = (255, 255, 255)


def photo() -> np.ndarray:
    return np.asarray(Image.open(CAT).convert("RGB"))  # 451 x 300


@pytest.fixture(scope="module")
def segmenter_file(tmp_path_factory) -> Path:
    """LR-ASPP with 4 classes and random weights (see random_segmenter)."""
    path = tmp_path_factory.mktemp("segmenter") / "lraspp.pt"
    torch.save(random_segmenter(4).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def detector_file(tmp_path_factory) -> Path:
    """Faster R-CNN with COCO's 91 classes and random weights that detect (see random_detector)."""
    path = tmp_path_factory.mktemp("detector") / "frcnn.pt"
    torch.save(random_detector((320, 400), num_classes=91).state_dict(), path)
    return path


def test_segmenter_one_overlay_per_class_with_its_outline(segmenter_file, tmp_path) -> None:
    labels = tmp_path / "labels.txt"
    labels.write_text("__background__\ncat\ndog\nsky\n")
    out = tmp_path / "out"
    arguments = ["--model", SEGMENTER, "--weights", str(segmenter_file), "--labels", str(labels), "--format", "png"]
    code = main([str(CAT), *arguments, "-o", str(out)])  # png: exact pixels
    assert code == 0

    # The expectation: torchvision's model on the documented preprocessing (short side to 520, bilinear, ImageNet
    # mean and std), each class that wins a pixel but the background.
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=4
    )
    model.load_state_dict(torch.load(segmenter_file))
    resized = np.asarray(Image.open(CAT).convert("RGB").resize((782, 520), Image.Resampling.BILINEAR)) / 255.0
    x = torch.tensor((resized - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225], dtype=torch.float32).permute(2, 0, 1)
    with torch.no_grad():
        dense = model.eval()(x[None])["out"][0]
    winners = dense.argmax(dim=0)
    present = [c for c in winners.unique().tolist() if c != 0]
    assert len(present) >= 2

    (record,) = manifest(out)
    names = ["cat", "dog", "sky"]
    assert [t["class_index"] for t in record["targets"]] == present
    assert [Path(t["output"]).name for t in record["targets"]] == [
        f"chelsea.gradcam.{names[c - 1]}.png" for c in present
    ]
    assert record["layer"] == "backbone:low+backbone:high" and record["note"] is None
    for target in record["targets"]:
        region = winners == target["class_index"]
        assert target["region"]["fraction"] == pytest.approx(region.float().mean().item(), abs=1e-6)
        assert target["score"] == pytest.approx(
            dense.softmax(dim=0)[target["class_index"]][region].mean().item(), abs=1e-4
        )
        assert target["box"] is None

    # The largest region's outline is drawn in white: every boundary pixel of its mask at the photo's size.
    largest = max(record["targets"], key=lambda t: t["region"]["fraction"])
    mask = np.asarray(Image.fromarray((winners == largest["class_index"]).numpy().astype(np.uint8)).resize((451, 300)))
    padded = np.pad(mask, 1, mode="edge")
    neighbours_out = np.zeros_like(mask, dtype=bool)
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            neighbours_out |= padded[1 + dy : 301 + dy, 1 + dx : 452 + dx] == 0
    boundary = (mask == 1) & neighbours_out
    overlay = np.asarray(Image.open(out / largest["output"]))
    assert overlay.shape == (300, 451, 3) and boundary.sum() > 50
    assert (overlay[boundary] == WHITE).all(axis=1).mean() > 0.98


def test_detector_one_overlay_per_detection_with_its_box(detector_file, tmp_path, capsys) -> None:
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=91
    )
    model.load_state_dict(torch.load(detector_file))
    x = torch.tensor(photo() / 255.0, dtype=torch.float32).permute(2, 0, 1)
    with torch.no_grad():
        found = model.eval()([x])[0]
    scores = found["scores"]
    threshold = float(scores[2] + scores[3]) / 2  # three detections pass
    assert scores[2] - scores[3] > 1e-4

    out = tmp_path / "out"
    args = ["--model", DETECTOR, "--weights", str(detector_file), "--score-threshold", str(threshold), "--figure"]
    args += ["--format", "png"]  # exact pixels
    code = main([str(CAT), *args, "-o", str(out)])
    assert code == 0
    (record,) = manifest(out)
    coco = torchvision.models.get_model_weights(DETECTOR).DEFAULT.meta["categories"]
    assert len(record["targets"]) == 3
    for k, target in enumerate(record["targets"]):
        assert Path(target["output"]).name == f"chelsea.gradcam.box{k + 1}.png"
        assert target["class_index"] == int(found["labels"][k]) and target["class_name"] == coco[target["class_index"]]
        assert target["score"] == pytest.approx(float(scores[k]), abs=1e-5)
        assert target["box"] == pytest.approx(found["boxes"][k].tolist(), abs=0.051)
        assert target["region"] is None
        assert Path(target["figure"]).name == f"chelsea.gradcam.box{k + 1}.figure.png"
        figure = Image.open(out / target["figure"])
        assert figure.width > 2 * figure.height  # image, heatmap and overlay side by side
        # the box's top edge is drawn in white across its width
        x1, y1, x2, _ = target["box"]
        overlay = np.asarray(Image.open(out / target["output"]))
        rows = overlay[max(0, int(y1) - 1) : int(y1) + 2, int(x1) + 3 : int(x2) - 3]
        assert any((row == WHITE).all() for row in rows)
    assert record["layer"] == "backbone:0+backbone:1+backbone:pool"
    assert f"{coco[int(found['labels'][0])]} ({float(scores[0]):.3f})" in capsys.readouterr().out


def test_detector_without_detections_and_its_usage_errors(detector_file, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    args = [str(CAT), "--model", DETECTOR, "--weights", str(detector_file), "-o", str(out)]
    assert main([*args, "--score-threshold", "1.0"]) == 0
    (record,) = manifest(out)
    assert record["targets"] == [] and record["error"] is None
    assert record["note"] == "nothing to explain: no detection scores at least 1.0"
    assert sorted(p.name for p in out.iterdir()) == [".explain-output", "manifest.jsonl"]
    assert "chelsea.png: nothing to explain" in capsys.readouterr().out

    assert main([*args, "--topk", "2", "--overwrite"]) == 2
    assert "--topk explains a classifier's top classes; fasterrcnn_mobilenet_v3_large_fpn is a detection model" in (
        capsys.readouterr().err
    )
    assert main(["--layers", "--model", DETECTOR, "--weights", str(detector_file)]) == 0
    marked = [line.split()[0] for line in capsys.readouterr().out.splitlines() if "<- automatic choice (fused)" in line]
    assert marked == ["backbone:0", "backbone:1", "backbone:pool"]


def test_a_torchvision_detector_from_the_users_file_is_taken_as_it_is(detector_file, tmp_path, capsys) -> None:
    """A Faster R-CNN built in the user's file (FILE.py:NAME, no ModelSpec) carries its own transform: its records
    are those of the same weights loaded by name; a bare classifier still gets the line naming ModelSpec."""
    code = tmp_path / "det.py"
    code.write_text(
        "import torch, torchvision\n\n"
        "def build():\n"
        "    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(\n"
        "        weights=None, weights_backbone=None, num_classes=91)\n"
        f"    model.load_state_dict(torch.load({str(detector_file)!r}))\n"
        "    return model\n\n"
        "bare = torch.nn.Conv2d(3, 2, 3)\n"
    )
    mine, named = tmp_path / "mine", tmp_path / "named"
    assert main([str(CAT), "--model", f"{code}:build", "-o", str(mine), "--quiet"]) == 0
    assert main([str(CAT), "--model", DETECTOR, "--weights", str(detector_file), "-o", str(named), "--quiet"]) == 0
    ours, theirs = manifest(mine), manifest(named)
    assert len(ours[0]["targets"]) > 0
    keys = ("class_name", "score", "box")
    assert [[t[k] for k in keys] for t in ours[0]["targets"]] == [[t[k] for k in keys] for t in theirs[0]["targets"]]
    capsys.readouterr()
    assert main([str(CAT), "--model", f"{code}:bare", "-o", str(tmp_path / "no")]) == 2
    assert "det.py:bare: a plain Conv2d that says nothing of its classes" in capsys.readouterr().err
