"""Detection: torchvision's Faster R-CNN, RetinaNet, FCOS and SSDlite with random weights, the canvas geometry,
and DetectionTarget against references written here with plain hooks, torchvision's box IoU and autograd."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from conftest import hook_count, random_detector
from test_methods import first_component
from torch import nn
from torchvision.models import detection
from torchvision.ops import box_iou

import explain
from explain.core.maps import Canvas, normalize_maps, upsample
from explain.targets import DetectionTarget, InstanceTarget

LAYER, MODULE, LEVEL = "backbone.fpn:0", "backbone.fpn", "0"


@pytest.fixture(scope="module")
def detector() -> nn.Module:
    """Faster R-CNN (MobileNetV3-FPN) for small inputs, with random weights that detect (see random_detector)."""
    return random_detector(
        (128, 160), num_classes=5, min_size=128, max_size=192, box_score_thresh=0.3, box_detections_per_img=8
    )


def images() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.rand(2, 3, 100, 130)  # resized to 128 x 166 and padded to 128 x 192 by the detector


def reference_maps(
    detector: nn.Module,
    x: torch.Tensor,
    boxes: list[torch.Tensor],
    labels: list[int],
    level: str = LEVEL,
    module: str = MODULE,
) -> torch.Tensor:
    """Grad-CAM of each image's reference box at an FPN level, on the image: (N, h, w) at the resized size.

    The matched detection (same label, highest IoU >= 0.5) is found with torchvision's box_iou; the
    map is upsampled to the detector's padded canvas and the padding cut off. A level the score does
    not reach gives zeros.
    """
    kept = {}

    def keep(module, inputs, output):
        kept["a"] = output[level].clone().requires_grad_(True)
        return OrderedDict((k, kept["a"] if k == level else v) for k, v in output.items())

    handle = detector.get_submodule(module).register_forward_hook(keep)
    detections = detector(x)
    handle.remove()
    scores = []
    for found, box, label in zip(detections, boxes, labels):
        overlap = box_iou(box[None], found["boxes"])[0]
        overlap[found["labels"] != label] = -1
        assert overlap.max() >= 0.5
        scores.append(found["scores"][overlap.argmax()])
    (g,) = torch.autograd.grad(torch.stack(scores).sum(), kept["a"], allow_unused=True)
    g = torch.zeros_like(kept["a"]) if g is None else g
    return on_image(detector, x, (g.mean(dim=(2, 3))[..., None, None] * kept["a"]).sum(dim=1).clamp(min=0).detach())


def level_zero(detector: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """FPN level 0 as a plain hook sees it, float64."""
    kept = {}
    handle = detector.get_submodule(MODULE).register_forward_hook(lambda m, i, o: kept.update(a=o[LEVEL].detach()))
    with torch.no_grad():
        detector(x)
    handle.remove()
    return kept["a"].double()


def on_image(detector: nn.Module, x: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
    """Maps over the detector's padded canvas, upsampled to it and the padding cut off: (N, h, w), resized size."""
    canvas = detector.transform(list(x))[0]
    (height, width) = canvas.image_sizes[0]
    padded = F.interpolate(maps[:, None], size=canvas.tensors.shape[-2:], mode="bilinear", align_corners=False)
    return padded[:, 0, :height, :width]


def assert_maps(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and (expected.flatten(1).amax(dim=1) > 0).all()
    assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()


def test_a_feature_cell_lands_on_its_rectangle_of_the_image(detector) -> None:
    x = images()[:1]
    listed = detector.transform(list(x))[0]
    canvas = Canvas(tuple(listed.tensors.shape[-2:]), tuple(listed.image_sizes[0]))
    assert canvas == Canvas((128, 192), (128, 166))
    cell = torch.zeros(1, 4, 6)  # stride 32 over the canvas
    cell[0, 1, 4] = 1.0
    mapped = upsample(canvas.crop(cell), (100, 130))[0]
    # By hand: the cell covers canvas rows 32-64 and columns 128-160; the image was scaled by 128/100 and 166/130.
    top, bottom, left, right = 32 * 100 / 128, 64 * 100 / 128, 128 * 130 / 166, 160 * 130 / 166
    peak = divmod(int(mapped.argmax()), 130)
    assert top <= peak[0] < bottom and left <= peak[1] < right
    rows, columns = torch.arange(100) + 0.5, torch.arange(130) + 0.5  # pixel centres
    centre = (mapped.sum(dim=1) @ rows / mapped.sum(), mapped.sum(dim=0) @ columns / mapped.sum())
    # within 1.5 px of the cell's centre (a cell is 25 px here; bilinear resampling shifts mass by about 1 px)
    assert abs(centre[0] - (top + bottom) / 2) < 1.5 and abs(centre[1] - (left + right) / 2) < 1.5
    naive = upsample(cell, (100, 130))[0]  # ignoring the padding would put it 20 px to the left
    assert not left <= divmod(int(naive.argmax()), 130)[1] < right


def test_given_boxes_match_the_reference(detector) -> None:
    x = images()
    with torch.no_grad():
        plain = detector(x)
    boxes = [found["boxes"][0] for found in plain]
    labels = [int(found["labels"][0]) for found in plain]
    target = DetectionTarget([b[None] for b in boxes], [[label] for label in labels])
    result = explain.GradCAM(detector, LAYER)(x, target, normalize=False)
    assert result.cams.shape == (2, 1, 100, 130) and result.target.valid.all()
    assert result.class_indices[:, 0].tolist() == labels
    torch.testing.assert_close(result.probabilities[:, 0], torch.stack([f["scores"][0] for f in plain]))
    assert_maps(result.raw[:, 0], reference_maps(detector, x, boxes, labels))
    assert hook_count(detector) == 0 and not detector.training


def test_every_detection_above_the_threshold_gets_a_map(detector) -> None:
    x = images()
    with torch.no_grad():
        plain = detector(x)
    counts = [int((found["scores"] >= 0.5).sum()) for found in plain]
    assert counts[0] != counts[1] and min(counts) >= 2  # a ragged K axis
    result = explain.GradCAM(detector, LAYER)(x, DetectionTarget(score_threshold=0.5), normalize=False)
    assert result.raw.shape[1] == max(counts)
    assert result.target.valid.sum(dim=1).tolist() == counts
    for i, count in enumerate(counts):
        assert (result.raw[i, count:] == 0).all() and (result.class_indices[i, count:] == -1).all()
    second = [found["boxes"][1] for found in plain]
    expected = reference_maps(detector, x, second, [int(found["labels"][1]) for found in plain])
    assert_maps(result.raw[:, 1], expected)


def test_a_threshold_below_the_models_own_is_honoured() -> None:
    """torchvision's ``box_score_thresh`` filters before any target: a caller's lower threshold reaches it for the
    call. The detections explained are those the same model keeps with its threshold set to the caller's by hand;
    the model's own is the same after the call, and a threshold above it changes nothing."""
    strict = random_detector(
        (128, 160), num_classes=5, min_size=128, max_size=192, box_score_thresh=0.9, box_detections_per_img=8
    )
    x = images()
    with torch.no_grad():
        strict.roi_heads.score_thresh = 0.5
        expected = strict(x)
        strict.roi_heads.score_thresh = 0.9
        assert [len(found["scores"]) for found in strict(x)] < [len(found["scores"]) for found in expected]
    result = explain.GradCAM(strict, LAYER)(x, DetectionTarget(score_threshold=0.5))
    assert strict.roi_heads.score_thresh == 0.9
    for i, found in enumerate(expected):
        count = len(found["scores"])
        assert bool(result.target.valid[i, :count].all()) and not bool(result.target.valid[i, count:].any())
        torch.testing.assert_close(result.target.boxes[i, :count], found["boxes"])
        torch.testing.assert_close(result.target.probabilities[i, :count], found["scores"])
    above = explain.GradCAM(strict, LAYER)(x, DetectionTarget(score_threshold=0.95))
    assert int(above.target.valid.sum()) == sum(int((found["scores"] >= 0.95).sum()) for found in expected)


def test_the_automatic_layers_fuse_every_pyramid_level(detector) -> None:
    """Without a layer, every level of the backbone's output is explained and fused: each level's map on the
    image, normalized (zero at a level the box's score does not reach), their mean, normalized."""
    x = images()
    with torch.no_grad():
        plain = detector(x)
    boxes, labels = [found["boxes"][0] for found in plain], [int(found["labels"][0]) for found in plain]
    result = explain.GradCAM(detector)(x, DetectionTarget([b[None] for b in boxes], [[label] for label in labels]))
    levels = list(detector.backbone(detector.transform(list(x))[0].tensors))
    assert result.layer == "+".join(f"backbone:{level}" for level in levels) and len(levels) == 3
    per_level = [
        normalize_maps(upsample(reference_maps(detector, x, boxes, labels, lv), (100, 130)), 2) for lv in levels
    ]
    assert sum(bool(m.any()) for m in per_level) == 1  # torchvision assigns each box to one level
    expected = normalize_maps(torch.stack(per_level).mean(dim=0), 2)
    assert (result.cams[:, 0].double() - expected).abs().max() < 1e-4
    assert hook_count(detector) == 0


def test_an_unmatched_box_is_reported(detector) -> None:
    x = images()
    nowhere = torch.tensor([[0.0, 0.0, 2.0, 2.0]])
    with pytest.raises(
        explain.TargetError, match=r"image 0: no detection of label 3 overlaps box \[0.0, 0.0, 2.0, 2.0\]"
    ):
        explain.gradcam(detector, x, LAYER, DetectionTarget(nowhere, [3]))
    with pytest.raises(explain.TargetError, match="give labels="):
        DetectionTarget(nowhere)
    with pytest.raises(explain.TargetError, match=r"no detection scores at least 0\.999"):
        explain.gradcam(detector, x, LAYER, DetectionTarget(score_threshold=0.999))
    with pytest.raises(explain.TargetError, match="misplace a DetectionTarget"):
        explain.cam(detector, x, "gradcam", LAYER, DetectionTarget(), aug_smooth=True)


def test_perturbation_and_gradient_free_methods_serve_detection(detector) -> None:
    x = images()[:1]
    target = DetectionTarget(score_threshold=0.5)
    score_cam = explain.methods.ScoreCAM(detector, LAYER, batch_size=64)(x, target)
    eigen = explain.methods.EigenCAM(detector, LAYER)(x, target, normalize=False)
    expected = on_image(detector, x, first_component(level_zero(detector, x)).clamp(min=0))
    for k in range(eigen.raw.shape[1]):  # Eigen-CAM is the same for every box: the first principal component
        assert_maps(eigen.raw[:, k].double(), expected)
    for result in (score_cam, eigen):
        k = int(result.target.valid[0].sum())
        assert result.cams.shape[:2] == (1, result.target.valid.shape[1]) and result.cams.shape[2:] == (100, 130)
        assert torch.isfinite(result.cams).all() and (result.cams[0, :k].flatten(1).amax(dim=1) > 0).all()
    assert hook_count(detector) == 0


def test_only_the_explained_rows_of_the_box_head_are_differentiated(detector, monkeypatch) -> None:
    """The box head scores every proposal without autograd, then recomputes with autograd the explained
    detections' rows alone; the maps equal the reference's through the whole head, and so do they where
    a detection cannot be traced to its proposal and the whole head is run again with autograd."""
    x = images()
    with torch.no_grad():
        plain = detector(x)
    boxes, labels = [found["boxes"][1] for found in plain], [int(found["labels"][1]) for found in plain]
    target = DetectionTarget([b[None] for b in boxes], [[label] for label in labels])
    calls = []
    handle = detector.roi_heads.box_head.register_forward_hook(lambda m, i, o: calls.append((len(o), o.requires_grad)))
    try:
        sparse = explain.GradCAM(detector, LAYER)(x, target, normalize=False)
        assert calls[0][0] > 20 and not calls[0][1]  # every proposal of both images, no graph
        assert calls[1:] == [(2, True)]  # one row per image: its explained detection
        calls.clear()
        monkeypatch.setattr("explain.core.speedups.box_heads._trace", lambda *args: None)
        dense = explain.GradCAM(detector, LAYER)(x, target, normalize=False)
        assert calls[1] == (calls[0][0], True)  # the fallback: the whole head again, with autograd
    finally:
        handle.remove()
    expected = reference_maps(detector, x, boxes, labels)
    assert_maps(sparse.raw[:, 0], expected)
    assert_maps(dense.raw[:, 0], expected)
    torch.testing.assert_close(sparse.probabilities, dense.probabilities)
    assert hook_count(detector) == 0


def dense_detector(kind: str) -> tuple[nn.Module, str]:
    """RetinaNet, FCOS or SSDlite with seeded random weights, keeping their best 8 detections whatever the score,
    and the module whose dict of maps feeds their heads (SSDlite's BatchNorm calibrated on random images, so that
    its scores are not uniform)."""
    torch.manual_seed(0)
    common = {"weights": None, "weights_backbone": None, "num_classes": 5, "detections_per_img": 8, "score_thresh": 0}
    if kind == "retinanet":
        return detection.retinanet_resnet50_fpn(**common, min_size=128, max_size=192).eval(), "backbone.fpn"
    if kind == "fcos":
        return detection.fcos_resnet50_fpn(**common, min_size=128, max_size=192).eval(), "backbone.fpn"
    model = detection.ssdlite320_mobilenet_v3_large(**common)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = None
    torch.manual_seed(3)
    with torch.no_grad():
        model.backbone.train()(torch.rand(8, 3, 320, 320))
    return model.eval(), "backbone"


@pytest.mark.parametrize("kind", ["retinanet", "fcos", "ssdlite"])
def test_dense_detectors_match_the_reference_at_their_level(kind) -> None:
    """A detection of RetinaNet, FCOS or SSDlite (whose heads score every anchor or point densely) reaches one
    level of the maps that feed the heads: its map there, and the automatic layers' fused map, match the
    reference."""
    detector, module = dense_detector(kind)
    x = images()[:1]
    with torch.no_grad():
        (found,) = detector(x)
        levels = list(detector.backbone(detector.transform(list(x))[0].tensors))
    sides = found["boxes"][:, 2:] - found["boxes"][:, :2]
    best = int(sides.prod(dim=1).argmax())  # the largest: random weights also give boxes of no area
    boxes, labels = [found["boxes"][best]], [int(found["labels"][best])]
    references = {level: reference_maps(detector, x, boxes, labels, level, module) for level in levels}
    (reached,) = [level for level, maps in references.items() if maps.abs().max() > 0]
    target = DetectionTarget(boxes[0][None], [labels[0]])
    at_level = explain.GradCAM(detector, f"{module}:{reached}")(x, target, normalize=False)
    assert_maps(at_level.raw[:, 0], references[reached])
    fused = explain.GradCAM(detector)(x, target)
    assert f"backbone:{reached}" in fused.layer.split("+")
    expected = normalize_maps(upsample(references[reached], (100, 130)), 2)
    assert (fused.cams[:, 0].double() - expected).abs().max() < 1e-4
    assert hook_count(detector) == 0 and not detector.training


def test_a_detection_from_a_level_too_coarse_to_map_is_refused_with_the_way_out() -> None:
    """SSDlite's last level is 1 x 1, left out of the automatic layers: a detection there (made so here by raising
    one class's bias at that level alone) reaches none of them. The error says so, and the layer inside the
    backbone that feeds every level explains it."""
    detector, module = dense_detector("ssdlite")
    last = [m for m in detector.head.classification_head.module_list[5].modules() if isinstance(m, nn.Conv2d)][-1]
    with torch.no_grad():
        last.bias.view(-1, 5)[:, 2] += 8.0  # class 2 at every anchor of the last level
    x = images()[:1]
    with torch.no_grad():
        (found,) = detector(x)
    box, label = found["boxes"][0], int(found["labels"][0])
    levels = list(detector.backbone(detector.transform(list(x))[0].tensors))
    reached = [level for level in levels if reference_maps(detector, x, [box], [label], level, module).any()]
    assert label == 2 and reached == ["5"]
    target = DetectionTarget(box[None], [label])
    with pytest.raises(explain.LayerError, match=r"one cell wide, too coarse to map.*inside the backbone"):
        explain.GradCAM(detector)(x, target)
    inside = explain.GradCAM(detector, "backbone.features.1")(x, target)  # level 1, before the levels after it
    assert inside.cams.shape == (1, 1, 100, 130) and inside.cams.amax() > 0
    assert hook_count(detector) == 0


@pytest.fixture(scope="module")
def segmenter() -> nn.Module:
    """Mask R-CNN (MobileNetV3-FPN) for small inputs, random weights that detect (see random_detector)."""
    return random_detector(
        (128, 160), masks=True, num_classes=5, min_size=128, max_size=192, box_score_thresh=0.3,
        box_detections_per_img=8,
    )  # fmt: skip


def test_an_instance_is_explained_by_its_mask_or_its_box(segmenter) -> None:
    """InstanceTarget: by its mask, the mean mask logit over the pixels where its mask is at least 0.5 on the plain
    pass; by its box, its box score. Both against references written here at one FPN level."""
    x = images()[:1]
    with torch.no_grad():
        (plain,) = segmenter(x)
    box, label = plain["boxes"][0], int(plain["labels"][0])
    region = plain["masks"][0, 0] >= 0.5
    assert 0 < region.sum() < region.numel()

    kept = {}

    def keep(module, inputs, output):
        kept["a"] = output[LEVEL].clone().requires_grad_(True)
        return OrderedDict((k, kept["a"] if k == LEVEL else v) for k, v in output.items())

    def reference(score) -> torch.Tensor:
        handle = segmenter.get_submodule(MODULE).register_forward_hook(keep)
        (found,) = segmenter(x)
        handle.remove()
        overlap = box_iou(box[None], found["boxes"])[0]
        overlap[found["labels"] != label] = -1
        (g,) = torch.autograd.grad(score(found, int(overlap.argmax())), kept["a"])
        cam = (g.mean(dim=(2, 3))[..., None, None] * kept["a"]).sum(dim=1).clamp(min=0).detach()
        return on_image(segmenter, x, cam)

    def mask_logit(found, i):
        p = found["masks"][i, 0].clamp(1e-6, 1 - 1e-6)
        return (torch.log(p) - torch.log1p(-p))[fixed["region"]].mean()

    fixed = {}
    for by, score in (("mask", mask_logit), ("box", lambda found, i: found["scores"][i])):
        target = InstanceTarget(box[None], [label], by=by)
        result = explain.GradCAM(segmenter, LAYER)(x, target, normalize=False)
        assert result.cams.shape == (1, 1, 100, 130) and hook_count(segmenter) == 0
        if by == "mask":  # the region the target fixed on its plain pass: this pass's, but for pixels at 0.5 exactly
            fixed["region"] = result.target.regions[0, 0].bool()
            assert (fixed["region"] == region).float().mean() >= 0.995
        assert_maps(result.raw[:, 0], reference(score))
    with pytest.raises(explain.TargetError, match="'mask' or 'box'"):
        InstanceTarget(by="pixels")
