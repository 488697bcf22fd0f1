"""Keypoints of a pose model (KeypointTarget): torchvision's Keypoint R-CNN (small, random weights that detect),
each keypoint's map against Grad-CAM of its keypoints_scores written out with hooks and autograd, all keypoints
of a detection in one call equal to one call each, the K axis, the names, and the errors that name the way out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from conftest import hook_count
from test_detection import LAYER, LEVEL, MODULE, on_image
from torch import nn
from torchvision.models.detection.keypoint_rcnn import KeypointRCNNHeads, KeypointRCNNPredictor
from torchvision.ops import MultiScaleRoIAlign

import explain
from explain.errors import TargetError
from explain.targets import KeypointTarget, box_iou
from explain.targets.keypoints import COCO_KEYPOINTS, COCO_SKELETON

KEYPOINTS = 17


@pytest.fixture(scope="module")
def pose_model() -> nn.Module:
    return built_pose_model()


def built_pose_model() -> nn.Module:
    """Keypoint R-CNN on MobileNetV3-FPN with a small keypoint head pooling FPN level 0 alone (the one layer its
    keypoint scores read), random weights, BatchNorm calibrated and the heads damped so that it detects several
    people with unsaturated scores."""
    torch.manual_seed(0)
    base = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(weights=None, weights_backbone=None)
    model = torchvision.models.detection.KeypointRCNN(
        base.backbone, num_classes=2, rpn_anchor_generator=base.rpn.anchor_generator, min_size=128, max_size=192,
        box_score_thresh=0.05, box_detections_per_img=4,
        keypoint_head=KeypointRCNNHeads(base.backbone.out_channels, (16, 16)),
        keypoint_predictor=KeypointRCNNPredictor(16, KEYPOINTS),
        keypoint_roi_pool=MultiScaleRoIAlign([LEVEL], output_size=14, sampling_ratio=2),
    )  # fmt: skip
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = None
    torch.manual_seed(3)
    with torch.no_grad():
        model.backbone.train()(torch.rand(8, 3, 128, 160))
        model.roi_heads.box_predictor.cls_score.weight *= 0.05
        model.roi_heads.box_predictor.bbox_pred.weight *= 0.05
    return model.eval()


def _images() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.rand(2, 3, 100, 130)


def _reference(model: nn.Module, x: torch.Tensor, boxes: list[torch.Tensor], keypoint: int) -> torch.Tensor:
    """Grad-CAM at FPN level 0 of the keypoint score of each image's detection matching its box, on the image."""
    from collections import OrderedDict

    kept = {}

    def keep(module, inputs, output):
        kept["a"] = output[LEVEL].clone().requires_grad_(True)
        return OrderedDict((k, kept["a"] if k == LEVEL else v) for k, v in output.items())

    handle = model.get_submodule(MODULE).register_forward_hook(keep)
    found = model(x)
    handle.remove()
    scores = []
    for detections, box in zip(found, boxes):
        match = box_iou(box[None], detections["boxes"])[0].argmax()
        scores.append(detections["keypoints_scores"][match, keypoint])
    (g,) = torch.autograd.grad(torch.stack(scores).sum(), kept["a"])
    return on_image(model, x, (g.mean(dim=(2, 3))[..., None, None] * kept["a"]).sum(dim=1).clamp(min=0).detach())


def test_each_keypoint_is_grad_cam_of_its_own_score_and_all_of_them_come_in_one_call(pose_model) -> None:
    x = _images()
    with torch.no_grad():
        plain = pose_model(x)
    boxes = [found["boxes"][0] for found in plain]
    labels = [[int(found["labels"][0])] for found in plain]
    every = explain.GradCAM(pose_model, LAYER)(x, KeypointTarget(boxes=[b[None] for b in boxes], labels=labels),
                                               normalize=False)  # fmt: skip
    assert every.raw.shape[:2] == (2, KEYPOINTS) and every.class_indices[0].tolist() == list(range(KEYPOINTS))
    torch.testing.assert_close(every.probabilities, torch.stack([f["keypoints_scores"][0] for f in plain]))
    torch.testing.assert_close(every.target.points, torch.stack([f["keypoints"][0, :, :2] for f in plain]))
    for keypoint in (0, 9, 16):
        expected = _reference(pose_model, x, boxes, keypoint)
        got = every.raw[:, keypoint]
        assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    one = explain.GradCAM(pose_model, LAYER)(
        x, KeypointTarget("left_wrist", boxes=[b[None] for b in boxes], labels=labels), normalize=False
    )
    torch.testing.assert_close(one.raw[:, 0], every.raw[:, 9])  # left_wrist is COCO's keypoint 9
    assert hook_count(pose_model) == 0 and not pose_model.training


def test_the_k_axis_runs_over_detections_then_keypoints(pose_model) -> None:
    x = _images()[1:]  # the image with four detections
    target = KeypointTarget(["nose", 5], score_threshold=0.05)
    result = explain.GradCAM(pose_model, LAYER)(x, target)
    with torch.no_grad():
        found = pose_model(x)[0]
    count = int((found["scores"] >= 0.05).sum())
    assert count >= 2 and result.cams.shape[1] == 2 * count
    expected = found["keypoints_scores"][found["scores"] >= 0.05][:, [0, 5]].flatten()
    torch.testing.assert_close(result.probabilities[0], expected)
    assert result.target.boxes.shape == (1, 2 * count, 4)


def test_keypoints_the_model_lacks_and_a_model_without_keypoints_are_refused(pose_model) -> None:
    x = _images()[:1]
    with pytest.raises(TargetError, match="no keypoint 'tail': its keypoints are nose, left_eye"):
        explain.GradCAM(pose_model, LAYER)(x, KeypointTarget("tail", score_threshold=0.3))
    with pytest.raises(TargetError, match="keypoint 17 is out of range for a model of 17 keypoints"):
        explain.GradCAM(pose_model, LAYER)(x, KeypointTarget(17, score_threshold=0.3))
    from conftest import random_detector

    boxes_only = random_detector((128, 160), num_classes=3, min_size=128, max_size=192, box_score_thresh=0.3)
    with pytest.raises(TargetError, match="explain its boxes with DetectionTarget"):
        explain.GradCAM(boxes_only, LAYER)(x, KeypointTarget(score_threshold=0.3))


def test_the_command_line_writes_one_overlay_per_detection_and_keypoint(tmp_path, capsys) -> None:
    """A pose model of the user's code (FILE.py:NAME): --keypoint left_wrist writes one overlay per detection,
    named for the keypoint; its manifest records the keypoint, its score and the detection's box; --keypoint on
    a classifier is one line."""
    from conftest import CAT, manifest

    from explain.cli import main

    code = tmp_path / "pose.py"
    code.write_text(
        "import explain\nfrom test_keypoints import built_pose_model\n\n"
        "def spec():\n"
        "    preprocessing = explain.models.Preprocessing(None, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))\n"
        "    return explain.ModelSpec(built_pose_model(), 'pose', ['__background__', 'person'], preprocessing,"
        " 'detection')\n"
    )
    out = tmp_path / "out"
    assert main([str(CAT), "--model", f"{code}:spec", "--keypoint", "left_wrist", "--score-threshold", "0.05",
                 "--format", "png", "-o", str(out)]) == 0  # fmt: skip
    (record,) = manifest(out)
    targets = record["targets"]
    assert len(targets) >= 1 and {t["class_name"] for t in targets} == {"left_wrist"}
    assert all(t["class_index"] == 9 and len(t["box"]) == 4 for t in targets)
    assert [t["output"].rsplit("/", 1)[-1] for t in targets] == [
        f"chelsea.gradcam.kp{k + 1}.left-wrist.png" for k in range(len(targets))
    ]
    assert all((out / t["output"]).is_file() for t in targets)
    spec = explain.load_model(f"{code}:spec")
    with torch.no_grad():
        (found,) = spec.model(spec.preprocess(explain.load_image(CAT)))
    kept = found["scores"] >= 0.05
    assert [t["score"] for t in targets] == pytest.approx(found["keypoints_scores"][kept, 9].tolist(), abs=1e-4)
    where = found["keypoints"][kept, 9, :2]
    torch.testing.assert_close(torch.tensor([t["point"] for t in targets]), where, atol=0.06, rtol=0)  # to 0.1 px
    from PIL import Image

    from explain.io.render import BOX_COLOUR

    for target in targets:  # the keypoint's dot on its overlay
        x, y = (min(max(round(v), 0), side - 1) for v, side in zip(target["point"], (451, 300)))
        assert Image.open(out / target["output"]).convert("RGB").getpixel((x, y)) == BOX_COLOUR
    pixels = np.asarray(Image.open(out / targets[0]["output"]).convert("RGB"))
    white = (pixels == BOX_COLOUR).all(axis=2)
    pose = found["keypoints"][kept][0, :, :2]  # Keypoint R-CNN's keypoints are all visible: every limb is drawn
    for a, b in COCO_SKELETON:  # each limb of the first detection's skeleton passes through its midpoint
        x, y = ((pose[a] + pose[b]) / 2).round().long().tolist()
        if 1 <= x < 450 and 1 <= y < 299:
            assert white[y - 1 : y + 2, x - 1 : x + 2].any(), (a, b)
    out = tmp_path / "strip"  # every keypoint of the top detection: one strip of 17 maps, 6 to a row
    threshold = str(float(found["scores"].max()) - 1e-4)
    assert main([str(CAT), "--model", f"{code}:spec", "--keypoint", "all", "--score-threshold", threshold,
                 "--figure", "--format", "png", "-o", str(out)]) == 0  # fmt: skip
    (record,) = manifest(out)
    assert [t["class_name"] for t in record["targets"]] == list(COCO_KEYPOINTS)
    assert {t["figure"] for t in record["targets"]} == {"chelsea.gradcam.det1.keypoints.figure.png"}
    assert sorted(p.name for p in out.glob("*.figure.png")) == ["chelsea.gradcam.det1.keypoints.figure.png"]
    assert Image.open(out / "chelsea.gradcam.det1.keypoints.figure.png").width == 6 * 400  # 6 panels of 4 inches
    capsys.readouterr()
    assert main([str(CAT), "--model", "efficientnet_lite0", "--keypoint", "nose", "-o", str(tmp_path / "no")]) == 2
    assert "--keypoint explains a pose model's keypoints" in capsys.readouterr().err
