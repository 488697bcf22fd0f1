"""Ultralytics YOLO (an optional extra, a test dependency): the letterbox against Ultralytics' own, a one-hot cell
mapped back through it by hand, detections matched to their raw prediction rows, and Grad-CAM at a neck level
against a reference written here with plain hooks and autograd. Random weights from Ultralytics' yolo11n.yaml."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import hook_count

import explain
from explain.core.maps import Canvas, upsample
from explain.errors import ModelLoadError
from explain.targets import DetectionTarget

os.environ.setdefault("YOLO_CONFIG_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "explain-tests-ultralytics"))
if importlib.util.find_spec("ultralytics") is None:  # found, not imported: explain imports it (see load_yolo)
    pytest.skip("the yolo extra: pip install 'explain[yolo]' (a test dependency)", allow_module_level=True)

from explain.models.yolo import Letterbox, load_yolo

OMP_BEFORE = os.environ.get("OMP_NUM_THREADS")  # before any test here imports Ultralytics
LEVEL = "model.model.16"  # the neck's finest level (stride 8), the first map the Detect head reads


def detecting(yaml: str):
    """An Ultralytics model from its yaml with random weights, its finest level's class biases raised so that the
    random network detects."""
    torch.manual_seed(0)
    model = load_yolo(yaml)
    with torch.no_grad():
        model.model.model[-1].cv3[0][-1].bias += 11.0
    return model


@pytest.fixture(scope="module")
def detector():
    return detecting("yolo11n.yaml")


def image() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.rand(1, 3, 200, 300)


def test_the_letterbox_is_ultralytics_own(detector) -> None:
    from ultralytics.data.augment import LetterBox  # imported after explain's own import of Ultralytics

    picture = (image()[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    theirs = LetterBox(new_shape=(640, 640), auto=True, stride=32)(image=picture)  # as Ultralytics predicts
    boxed = Letterbox(640, 32)(torch.from_numpy(picture).permute(2, 0, 1)[None].float() / 255)
    ours = (boxed.tensors[0].permute(1, 2, 0).numpy() * 255).round()
    assert ours.shape == theirs.shape == (448, 640, 3)
    params = LetterBox(new_shape=(640, 640), auto=True, stride=32).get_params({"img": picture})
    top, left = boxed.offset
    assert (top, left) == (params["top"], params["left"]) == (10, 0)
    assert boxed.image_sizes == [params["new_unpad"][::-1]] == [(427, 640)]
    assert (theirs[:top] == 114).all() and (ours[:top] == 114).all()  # the grey band, centred
    assert np.abs(ours[top : top + 427].astype(float) - theirs[top : top + 427]).mean() < 2.0  # bilinear resize


def test_a_cell_lands_on_its_rectangle_of_the_image(detector) -> None:
    """A one-hot cell of the stride-8 level, mapped back through the letterbox: by hand, canvas rows 8r..8r+8
    are input rows (8r - top) / scale, scale = 640 / 300."""
    boxed = detector.transform(image())
    canvas = Canvas(tuple(boxed.tensors.shape[-2:]), boxed.image_sizes[0], boxed.offset)
    cell = torch.zeros(1, 448 // 8, 640 // 8)
    cell[0, 20, 30] = 1.0
    mapped = upsample(canvas.crop(cell), (200, 300))[0]
    scale, (top, left) = 640 / 300, boxed.offset
    rows = ((8 * 20 - top) / scale, (8 * 21 - top) / scale)
    columns = ((8 * 30 - left) / scale, (8 * 31 - left) / scale)
    peak = divmod(int(mapped.argmax()), 300)
    assert rows[0] - 1 <= peak[0] <= rows[1] and columns[0] - 1 <= peak[1] <= columns[1]

    # A level no detection reaches: its zero map comes to the image's size as a resized one would.
    zero = torch.zeros(2, 448 // 16, 640 // 16)
    resized = upsample(zero, canvas.size)[..., top : top + canvas.image[0], left : left + canvas.image[1]]
    assert torch.equal(canvas.crop(zero), resized)


def test_a_detection_is_its_raw_row_and_its_map_the_reference(detector) -> None:
    x = image()
    kept = {}
    handle = detector.get_submodule(LEVEL).register_forward_hook(lambda m, i, o: kept.update(a=o) or o.clone())
    (found,) = detector(x)
    handle.remove()
    assert len(found["boxes"]) > 0
    # The kept score is the raw prediction row's class score: the row is found here by its box.
    boxed = detector.transform(x)
    raw = detector.model(boxed.tensors)[0][0]  # (4 + classes, anchors)
    centre = (found["boxes"][0, :2] + found["boxes"][0, 2:]) / 2 * boxed.scale + torch.tensor(boxed.offset[::-1])
    row = int((raw[:2].T - centre).abs().sum(dim=1).argmin())
    torch.testing.assert_close(found["scores"][0], raw[4 + int(found["labels"][0]), row])

    (g,) = torch.autograd.grad(found["scores"][0], kept["a"])
    cam = (g.mean(dim=(2, 3), keepdim=True) * kept["a"]).sum(dim=1).clamp(min=0).detach()
    top, left = boxed.offset
    (height, width) = boxed.image_sizes[0]
    expected = F.interpolate(cam[:, None], size=boxed.tensors.shape[-2:], mode="bilinear", align_corners=False)
    expected = expected[:, 0, top : top + height, left : left + width]

    target = DetectionTarget(found["boxes"][:1].detach(), [int(found["labels"][0])])
    result = explain.GradCAM(detector, LEVEL)(x, target, normalize=False)
    assert result.raw.shape == (1, 1, height, width) and expected.abs().max() > 0
    assert (result.raw[:, 0] - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert hook_count(detector) == 0


def test_a_score_is_differentiated_from_its_class_logit_not_through_the_box_decoding(detector) -> None:
    """Ultralytics' Detect returns its raw class logits beside the decoded rows: a kept score is their sigmoid, so
    its gradient passes through none of the boxes' decoding and reaches no box branch. Where a head gives no such
    logits, or their sigmoid is not the row's score, the decoded row's own score is kept."""
    from explain.models.yolo import _kept_scores

    (found,) = detector(image())
    assert len(found["scores"]) > 0
    boxes_branch = list(detector.model.model[-1].cv2.parameters())
    for output, reached in (("scores", False), ("boxes", True)):
        grads = torch.autograd.grad(found[output].sum(), boxes_branch, allow_unused=True, retain_graph=True)
        assert any(g is not None for g in grads) is reached

    torch.manual_seed(0)
    logits = torch.randn(3, 10, requires_grad=True)  # 3 classes, 10 anchors
    rows = torch.cat([torch.rand(4, 10), logits.detach().sigmoid()])
    labels, chosen = torch.tensor([0, 2]), torch.tensor([1, 5])
    kept = _kept_scores(rows, logits, labels, chosen)
    torch.testing.assert_close(kept, rows[4 + labels, chosen])
    assert kept.grad_fn is not None  # from the logits
    other = rows.clone()
    other[4:] = 0.5
    assert torch.equal(_kept_scores(other, logits, labels, chosen), other[4 + labels, chosen])
    assert torch.equal(_kept_scores(rows, None, labels, chosen), rows[4 + labels, chosen])


def test_head_branches_are_differentiated_over_the_reached_window_and_the_gradients_are_the_same(detector) -> None:
    """In a call, a detection's score reaches one cell of one level's class branch: that branch is recomputed on the
    cell's receptive field, the other branches pass no gradient on (None, not a tensor of zeros), so the neck
    levels behind them are not differentiated; the gradients are those of the plain Ultralytics model,
    differentiated whole."""
    from explain.core.model_state import frozen_parameters
    from explain.core.speedups.windows import windowed_heads

    x = image().requires_grad_(True)  # the whole network in the graph, the parameters frozen as in a call
    levels = [f"model.model.{index}" for index in detector.model.model[-1].f]
    kept: dict[str, torch.Tensor] = {}
    handles = [
        detector.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: kept.update({name: o}))
        for name in levels
    ]
    recomputed: list[tuple[int, ...]] = []
    first = detector.model.model[-1].cv3[0][0][0]  # the class branch's first convolution, at the finest level
    try:
        with frozen_parameters(detector), windowed_heads(detector):
            (found,) = detector(x)  # the branches' reach learned unwatched: a forward that reads sizes is not local
            k = int(found["scores"].argmin())  # the least score kept: a sigmoid far from saturation
            spy = first.register_forward_pre_hook(lambda m, args: recomputed.append(tuple(args[0].shape[-2:])))
            handles.append(spy)
            windowed = torch.autograd.grad(found["scores"][k], [kept[name] for name in levels], allow_unused=True)
            during_backward = list(recomputed)
        boxed = detector.transform(x)
        raw = detector.model(boxed.tensors)[0][0]  # plain Ultralytics: (4 + classes, anchors)
        centre = (found["boxes"][k, :2] + found["boxes"][k, 2:]) / 2 * boxed.scale + torch.tensor(boxed.offset[::-1])
        row = int((raw[:2].T - centre).abs().sum(dim=1).argmin())
        score = raw[4 + int(found["labels"][k]), row]
        plain = torch.autograd.grad(score, [kept[name] for name in levels], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(found["scores"][k], score)
    assert plain[0].abs().max() > 0
    torch.testing.assert_close(windowed[0], plain[0])  # the finest level, whose class branch the score reaches
    assert plain[2] is not None and not plain[2].any()  # the coarsest level: zeros, differentiated for nothing
    assert windowed[2] is None
    assert during_backward == [(5, 5)]  # one cell and the branch's reach, two cells each way (two 3x3 convolutions)
    assert hook_count(detector) == 0


def test_the_automatic_layers_are_the_levels_the_head_reads(detector) -> None:
    x = image()
    (found,) = detector(x)
    target = DetectionTarget(found["boxes"][:1].detach(), [int(found["labels"][0])])
    result = explain.GradCAM(detector)(x, target)
    levels = [f"model.model.{i}" for i in detector.model.model[-1].f]
    assert result.layer == "+".join(levels) and result.cams.shape == (1, 1, 200, 300)
    assert hook_count(detector) == 0


def test_a_yolo_model_by_file_and_its_errors(tmp_path, monkeypatch) -> None:
    spec = explain.load_model("yolo11n.yaml")
    assert spec.task == "detection" and len(spec.labels) == 80 and spec.preprocessing.input_size is None
    with pytest.raises(ModelLoadError, match="no such checkpoint file"):
        explain.load_model(str(tmp_path / "missing.pt"))  # never a download
    monkeypatch.setitem(sys.modules, "ultralytics.nn.tasks", None)  # as if the extra were not installed
    with pytest.raises(ModelLoadError, match=r'pip install "explain\[yolo\]"'):
        explain.load_model("yolo11n.yaml")


def test_the_command_line_takes_a_yolo_yaml(tmp_path) -> None:
    """The first forward of a fresh YOLO is explain's trace: the anchors its head caches there must serve the pass
    with autograd after it (a cache made in inference mode would not). Random weights detect nothing above 0.5."""
    from conftest import CAT, manifest

    from explain.cli import main

    assert main([str(CAT), "--model", "yolo11n.yaml", "-o", str(tmp_path / "out")]) == 0
    (record,) = manifest(tmp_path / "out")
    assert record["error"] is None and record["note"].startswith("nothing to explain")


def test_a_prediction_in_inference_mode_first_does_not_break_the_explanation(detector) -> None:
    """A user's plain prediction under ``torch.inference_mode()`` leaves the head's anchors cached as inference
    tensors; the explanation after it works, with the same maps as before."""
    x = torch.rand(1, 3, 160, 224)
    with torch.no_grad():
        (found,) = detector(x)
    target = DetectionTarget(found["boxes"][:1], [int(found["labels"][0])])
    before = explain.GradCAM(detector, LEVEL)(x, target).cams
    with torch.inference_mode():
        detector(torch.rand(1, 3, 100, 100))  # another shape: the anchors are made again, in inference mode
        detector(x)
    torch.testing.assert_close(explain.GradCAM(detector, LEVEL)(x, target).cams, before)


def test_importing_ultralytics_leaves_the_process_as_it_was(detector, tmp_path) -> None:
    """Ultralytics replaces PIL.Image.open and sets OMP_NUM_THREADS=1 when imported; explain puts them back, so a
    file that is no image stays a one-line error (Ultralytics' opener would try to pip install a HEIF plugin) and
    worker processes keep the user's threads."""
    from PIL import Image

    assert Image.open.__module__.startswith("PIL")
    assert os.environ.get("OMP_NUM_THREADS") == OMP_BEFORE
    bad = tmp_path / "notes.jpg"
    bad.write_text("not an image")
    with pytest.raises(explain.ImageLoadError, match=r"notes\.jpg"):
        explain.load_image(bad)


def test_ultralytics_is_imported_only_for_a_yolo_model() -> None:
    """AGPL-3.0 and an extra: explain, its models and a whole explanation of another model never import it."""
    import subprocess

    code = (
        "import sys, torch, explain, explain.models; spec = explain.load_model('efficientnet_lite0'); "
        "explain.gradcam(spec.model, torch.randn(1, 3, 64, 64)); assert 'ultralytics' not in sys.modules"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


@pytest.fixture(scope="module")
def segmenter():
    return detecting("yolo11n-seg.yaml")


def test_yolo_seg_masks_are_ultralytics_own_and_an_instance_is_explained_by_its_mask(segmenter) -> None:
    """At 256 x 640 the letterbox is the identity, so the masks are compared with Ultralytics' process_mask as they
    are; then InstanceTarget(by="mask") against a reference: the mean mask logit over the instance's region."""
    from ultralytics.utils.ops import process_mask

    torch.manual_seed(2)
    x = torch.rand(1, 3, 256, 640)
    kept = {}

    def keep(module, inputs, output):
        kept["proto"] = output
        return output

    handle = segmenter.model.model[-1].proto.register_forward_hook(keep)
    with torch.no_grad():
        (found,) = segmenter(x)
        rows = segmenter.model(x)[0][0][0]  # (4 + classes + 32, anchors): the letterbox changed nothing
    handle.remove()
    centre = (found["boxes"][:5, :2] + found["boxes"][:5, 2:]) / 2
    index = (rows[:2].T[None] - centre[:, None]).abs().sum(dim=-1).argmin(dim=1)  # each detection's raw row
    theirs = process_mask(kept["proto"][0], rows[4 + 80 :, index].T, found["boxes"][:5], (256, 640), upsample=True)
    assert (theirs.bool() == (found["masks"][:5, 0] >= 0.5)).float().mean() >= 0.999  # logits near 0 may round apart

    region = found["masks"][0, 0] >= 0.5
    assert 0 < region.sum() < region.numel()
    target = explain.targets.InstanceTarget(found["boxes"][:1], [int(found["labels"][0])], by="mask")
    result = explain.GradCAM(segmenter, LEVEL)(x, target, normalize=False)
    fixed = result.target.regions[0, 0].bool()  # the target's plain pass: this one's region, but for ties at 0.5
    assert (fixed == region).float().mean() >= 0.995
    level = {}
    handle = segmenter.get_submodule(LEVEL).register_forward_hook(lambda m, i, o: level.update(a=o) or o.clone())
    (again,) = segmenter(x)
    handle.remove()
    p = again["masks"][0, 0].clamp(1e-6, 1 - 1e-6)
    (g,) = torch.autograd.grad((torch.log(p) - torch.log1p(-p))[fixed].mean(), level["a"])
    cam = (g.mean(dim=(2, 3), keepdim=True) * level["a"]).sum(dim=1).clamp(min=0).detach()
    expected = F.interpolate(cam[:, None], size=(256, 640), mode="bilinear", align_corners=False)[:, 0]
    assert expected.abs().max() > 0
    assert (result.raw[:, 0] - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_a_threshold_below_the_models_own_conf_is_honoured() -> None:
    """YOLO's own ``conf`` (0.25) filters before any target: a caller's lower threshold reaches it for the call,
    so the detections are those the same model keeps with its filter set to that threshold by hand, and the
    model's ``conf`` is the same after the call."""
    model = detecting("yolo11n.yaml")
    with torch.no_grad():
        model.model.model[-1].cv3[0][-1].bias -= 0.8  # the finest level's scores now about 0.2, below 0.25
        assert [len(found["boxes"]) for found in model(image())] == [0]
        model.max_det, threshold = 5, 0.1  # a few detections
        model.score_thresh = threshold
        (expected,) = model(image())
        model.score_thresh = 0.25
    assert len(expected["scores"]) == 5 and float(expected["scores"].max()) < 0.25
    result = explain.GradCAM(model, LEVEL)(image(), DetectionTarget(score_threshold=threshold))
    assert model.score_thresh == 0.25
    torch.testing.assert_close(result.target.boxes[0], expected["boxes"])
    torch.testing.assert_close(result.target.probabilities[0], expected["scores"])


@pytest.mark.parametrize(("yaml", "level"), [("yolo11n-pose.yaml", LEVEL), ("yolov8n-pose.yaml", "model.model.15")])
def test_a_pose_models_keypoint_is_its_raw_rows_confidence_and_its_map_the_reference(yaml: str, level: str) -> None:
    """YOLO11 and YOLOv8 pose (random weights that detect): each kept detection's keypoints are its raw row's,
    mapped back through the letterbox; a keypoint's map is Grad-CAM of that row's keypoint confidence, written out
    here at the neck's finest level."""
    from explain.targets import KeypointTarget

    pose = detecting(yaml)
    x = image()
    kept = {}
    handle = pose.get_submodule(level).register_forward_hook(lambda m, i, o: kept.update(a=o) or o.clone())
    (found,) = pose(x)
    handle.remove()
    assert len(found["boxes"]) > 0 and found["keypoints"].shape == (len(found["boxes"]), 17, 3)
    boxed = pose.transform(x)
    raw = pose.model(boxed.tensors)[0][0]  # (4 + classes + 17 x 3, anchors)
    centre = (found["boxes"][0, :2] + found["boxes"][0, 2:]) / 2 * boxed.scale + torch.tensor(boxed.offset[::-1])
    row = int((raw[:2].T - centre).abs().sum(dim=1).argmin())
    points = raw[4 + pose.classes :, row].reshape(17, 3)
    top, left = boxed.offset
    torch.testing.assert_close(found["keypoints"][0, :, :2], (points[:, :2] - torch.tensor([left, top])) / boxed.scale)
    torch.testing.assert_close(found["keypoints_scores"][0], points[:, 2])

    (g,) = torch.autograd.grad(found["keypoints_scores"][0, 7], kept["a"])  # left_elbow
    cam = (g.mean(dim=(2, 3), keepdim=True) * kept["a"]).sum(dim=1).clamp(min=0).detach()
    (height, width) = boxed.image_sizes[0]
    expected = F.interpolate(cam[:, None], size=boxed.tensors.shape[-2:], mode="bilinear", align_corners=False)
    expected = expected[:, 0, top : top + height, left : left + width]
    target = KeypointTarget("left_elbow", boxes=found["boxes"][:1].detach(), labels=[int(found["labels"][0])])
    result = explain.GradCAM(pose, level)(x, target, normalize=False)
    assert result.raw.shape == (1, 1, height, width) and expected.abs().max() > 0
    assert (result.raw[:, 0] - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert hook_count(pose) == 0


@pytest.mark.parametrize(("yaml", "level"), [("yolo11n-obb.yaml", LEVEL), ("yolov8n-obb.yaml", "model.model.15")])
def test_an_oriented_box_is_its_raw_row_matched_by_rotated_iou_and_its_map_the_reference(yaml: str, level: str) -> None:
    """YOLO11 and YOLOv8 OBB (random weights that detect): each kept detection's oriented box is its raw row's,
    mapped back through the letterbox (its angle kept), suppressed by rotated IoU; its map is Grad-CAM of its
    score, written out here; the upright box is the rotated one's hull."""
    from explain.targets import OrientedDetectionTarget, rotated_iou
    from explain.targets.oriented import rotated_corners

    obb = detecting(yaml)
    x = image()
    kept = {}
    handle = obb.get_submodule(level).register_forward_hook(lambda m, i, o: kept.update(a=o) or o.clone())
    (found,) = obb(x)
    handle.remove()
    assert len(found["rboxes"]) > 1
    overlaps = rotated_iou(found["rboxes"].detach(), found["rboxes"].detach()).fill_diagonal_(0)
    same = found["labels"][:, None] == found["labels"][None]
    assert bool((overlaps[same] < obb.iou).all())  # no two kept boxes of a class overlap past the threshold
    boxed = obb.transform(x)
    raw = obb.model(boxed.tensors)[0][0]  # (4 + classes + 1, anchors)
    top, left = boxed.offset
    centre = found["rboxes"][0, :2] * boxed.scale + torch.tensor([left, top])
    row = int((raw[:2].T - centre).abs().sum(dim=1).argmin())
    torch.testing.assert_close(found["rboxes"][0, 2:4], raw[2:4, row] / boxed.scale)
    torch.testing.assert_close(found["rboxes"][0, 4], raw[-1, row])
    corners = rotated_corners(found["rboxes"][:1].detach())[0]
    torch.testing.assert_close(found["boxes"][0].detach(), torch.cat([corners.amin(0), corners.amax(0)]))

    (g,) = torch.autograd.grad(found["scores"][0], kept["a"])
    cam = (g.mean(dim=(2, 3), keepdim=True) * kept["a"]).sum(dim=1).clamp(min=0).detach()
    (height, width) = boxed.image_sizes[0]
    expected = F.interpolate(cam[:, None], size=boxed.tensors.shape[-2:], mode="bilinear", align_corners=False)
    expected = expected[:, 0, top : top + height, left : left + width]
    target = OrientedDetectionTarget(found["rboxes"][:1].detach(), [int(found["labels"][0])])
    result = explain.GradCAM(obb, level)(x, target, normalize=False)
    assert result.raw.shape == (1, 1, height, width) and expected.abs().max() > 0
    assert (result.raw[:, 0] - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert hook_count(obb) == 0


def test_rotated_iou_is_exact() -> None:
    """Upright boxes: the upright IoU; a square and itself turned 45 degrees: the regular octagon they share,
    8 (sqrt 2 - 1) of its area 4, over the union; boxes apart: 0."""
    import math

    from explain.targets import box_iou, rotated_iou

    a = torch.tensor([[10.0, 10, 8, 6, 0], [0, 0, 4, 4, 0]])
    b = torch.tensor([[12.0, 11, 8, 6, 0], [1, 1, 2, 2, 0], [40, 40, 2, 2, 0.3]])

    def upright(r: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [r[:, 0] - r[:, 2] / 2, r[:, 1] - r[:, 3] / 2, r[:, 0] + r[:, 2] / 2, r[:, 1] + r[:, 3] / 2], 1
        )

    torch.testing.assert_close(rotated_iou(a, b), box_iou(upright(a), upright(b)))
    square, turned = torch.tensor([[0.0, 0, 2, 2, 0]]), torch.tensor([[0.0, 0, 2, 2, math.pi / 4]])
    octagon = 8 * (math.sqrt(2) - 1)
    assert rotated_iou(square, turned).item() == pytest.approx(octagon / (8 - octagon), rel=1e-5)
    assert rotated_iou(turned, turned).item() == pytest.approx(1.0, rel=1e-6)


def test_the_command_line_draws_an_oriented_box_as_itself(tmp_path) -> None:
    """An OBB model of the user's code (at most 2 detections): each overlay's target is matched by rotated IoU,
    its manifest record holds the box's corners (and the upright box around them), and the overlay draws the
    rotated outline."""
    from conftest import CAT, manifest
    from PIL import Image

    from explain.cli import main
    from explain.io.render import BOX_COLOUR

    code = tmp_path / "obb.py"
    code.write_text(
        "import explain\nfrom test_yolo import detecting\n\n"
        "def spec():\n"
        "    model = detecting('yolo11n-obb.yaml')\n"
        "    model.max_det = 2\n"
        "    unit = explain.models.Preprocessing(None, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))\n"
        "    return explain.ModelSpec(model, 'obb', model.labels, unit, 'detection')\n"
    )
    out = tmp_path / "out"
    assert main([str(CAT), "--model", f"{code}:spec", "--score-threshold", "0.3", "--format", "png",
                 "-o", str(out)]) == 0  # fmt: skip
    (record,) = manifest(out)
    assert len(record["targets"]) == 2
    spec = explain.load_model(f"{code}:spec")
    with torch.no_grad():
        (found,) = spec.model(spec.preprocess(explain.load_image(CAT)))
    from explain.targets.oriented import rotated_corners

    for target, corners in zip(record["targets"], rotated_corners(found["rboxes"])):
        torch.testing.assert_close(torch.tensor(target["polygon"]), corners, atol=0.06, rtol=0)
        torch.testing.assert_close(torch.tensor(target["box"]), torch.cat([corners.amin(0), corners.amax(0)]),
                                   atol=0.06, rtol=0)  # fmt: skip
        picture = Image.open(out / target["output"]).convert("RGB")
        middles = [((a + b) / 2).round().long().tolist() for a, b in zip(corners, corners.roll(-1, 0))]
        inside = [(x, y) for x, y in middles if 1 <= x < 450 and 1 <= y < 299]  # the outline's edges' middles
        drawn = [any(picture.getpixel((x + dx, y + dy)) == BOX_COLOUR for dx in (-1, 0, 1) for dy in (-1, 0, 1))
                 for x, y in inside]  # fmt: skip
        assert inside and all(drawn)  # each edge drawn through its middle, within a pixel of rasterization


def test_the_rotated_nms_keeps_what_plain_greedy_suppression_keeps() -> None:
    """Over several blocks of boxes (600 > NMS_BLOCK), three classes, crowded: the kept indices are those of the
    textbook greedy pass over the whole table of exact rotated IoUs."""
    import numpy as np

    from explain.models.yolo import NMS_BLOCK, _rotated_nms
    from explain.targets import rotated_iou

    generator = torch.Generator().manual_seed(0)
    n = 600
    assert n > 2 * NMS_BLOCK
    centres, sides = torch.rand(n, 2, generator=generator) * 100, torch.rand(n, 2, generator=generator) * 20 + 5
    boxes = torch.cat([centres, sides, torch.rand(n, 1, generator=generator) * 3.1], dim=1)
    scores, labels = torch.rand(n, generator=generator), torch.randint(0, 3, (n,), generator=generator)
    order = scores.argsort(descending=True)
    overlaps = rotated_iou(boxes[order], boxes[order])
    assert ((overlaps - 0.45).abs() > 1e-4).all()  # no pair at the threshold, where rounding could decide
    table = (overlaps >= 0.45) & (labels[order, None] == labels[None, order])
    alive = np.ones(n, dtype=bool)
    for k in range(n):
        if alive[k]:
            alive[k + 1 :] &= ~table[k, k + 1 :].numpy()
    kept = _rotated_nms(boxes, scores, labels, 0.45)
    assert 50 < len(kept) < n - 50 and kept.tolist() == order[torch.from_numpy(alive)].tolist()
