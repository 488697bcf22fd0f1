"""Target objects against references computed here: a hand-written score, differentiated with plain autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import capture_score, hook_count, random_segmenter, seeded
from torch import nn

import explain
from explain.targets import ClassTarget, RegressionTarget, SegmentationTarget, SimilarityTarget, TopK


def reference_gradcam(model: nn.Module, x: torch.Tensor, layer: str, score, **kwargs) -> torch.Tensor:
    """Grad-CAM from the paper for any per-image score: raw (N, h, w) maps, float64."""
    a, g = capture_score(model, x, layer, score, **kwargs)
    return (g.mean(dim=(-2, -1))[..., None, None] * a).sum(dim=1).clamp(min=0)


def assert_maps(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within 1e-5 of the maps' scale (random-weight maps can be small), each image's map non-zero."""
    assert got.shape == expected.shape
    assert (expected.flatten(1).abs().amax(dim=1) > 0).all(), "reference maps must not be trivially zero"
    assert (got.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def inputs(n: int = 2, side: int = 64) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(n, 3, side, side)


@pytest.fixture(scope="module")
def segmenter() -> nn.Module:
    """LR-ASPP with 4 classes and random weights (see random_segmenter)."""
    return random_segmenter(4)


def test_segmentation_class_over_its_argmax_region(segmenter) -> None:
    x = inputs()
    classes = [1, 3]
    with torch.no_grad():
        dense = segmenter(x)["out"]
    winners = dense.argmax(dim=1)
    assert all(0 < (winners[i] == c).float().mean() < 0.9 for i, c in enumerate(classes))  # partial regions

    def score(output):
        logits = output["out"]
        return torch.stack([(logits[i, c] * (winners[i] == c)).sum() for i, c in enumerate(classes)])

    expected = reference_gradcam(segmenter, x, "backbone.16", score)
    result = explain.GradCAM(segmenter, "backbone.16")(x, SegmentationTarget(classes))
    assert result.class_indices.tolist() == classes
    mean_probability = [dense.softmax(dim=1)[i, c][winners[i] == c].mean() for i, c in enumerate(classes)]
    torch.testing.assert_close(result.probabilities, torch.stack(mean_probability))
    assert_maps(result.raw, expected)


def test_segmentation_every_present_class(segmenter) -> None:
    """classes=None: one map per class that wins a pixel, background left out; each equals its own reference."""
    x = inputs()
    with torch.no_grad():
        winners = segmenter(x)["out"].argmax(dim=1)
    present = [sorted(set(w.unique().tolist()) - {0}) for w in winners]
    assert len(present[0]) != len(present[1]) or present[0] != present[1]  # the images differ
    result = explain.GradCAM(segmenter, "backbone.16")(x, SegmentationTarget(background=0))
    k = max(map(len, present))
    assert result.cams.shape == (2, k, 64, 64)
    for i, classes in enumerate(present):
        assert result.target.valid[i].tolist() == [j < len(classes) for j in range(k)]
        assert result.class_indices[i, : len(classes)].tolist() == classes
        for j, c in enumerate(classes):
            region = winners[i : i + 1] == c
            assert torch.equal(result.target.regions[i, j].bool(), region[0])

            def score(out, c=c, region=region):
                return (out["out"][:, c] * region).sum()

            expected = reference_gradcam(segmenter, x[i : i + 1], "backbone.16", score)
            assert_maps(result.raw[i, j][None], expected)


def test_segmentation_empty_region_is_refused(segmenter) -> None:
    x = inputs()
    with torch.no_grad():
        winners = segmenter(x)["out"].argmax(dim=1)
    image, absent = next((i, c) for i in range(2) for c in range(4) if not (winners[i] == c).any())
    with pytest.raises(explain.NothingToExplain, match=f"image {image}: class {absent} wins no pixel"):
        explain.GradCAM(segmenter, "backbone.16")(x, SegmentationTarget(absent))
    mask = torch.zeros(2, 64, 64)
    mask[0, :8, :8] = 1
    with pytest.raises(explain.NothingToExplain, match="image 1: the mask is empty"):
        explain.GradCAM(segmenter, "backbone.16")(x, SegmentationTarget(1, mask=mask))


def test_segmentation_with_a_given_mask(segmenter) -> None:
    x = inputs()
    mask = torch.zeros(64, 64)
    mask[8:40, 16:48] = 1.0
    expected = reference_gradcam(segmenter, x, "backbone.16", lambda out: (out["out"][:, 2] * mask).sum(dim=(1, 2)))
    got = explain.cam(
        segmenter, x, "gradcam", "backbone.16", SegmentationTarget(2, mask=mask), resize=False, normalize=False
    )
    assert_maps(got, expected)
    with pytest.raises(explain.TargetError, match="misplace a SegmentationTarget"):
        explain.cam(segmenter, x, "gradcam", "backbone.16", SegmentationTarget(2), aug_smooth=True)
    with pytest.raises(explain.TargetError, match="one per image"):
        explain.cam(segmenter, x, "gradcam", "backbone.16", SegmentationTarget(2, mask=torch.ones(3, 64, 64)))


@pytest.mark.parametrize("sign", [1, -1])
def test_regression_both_signs(sign) -> None:
    model = seeded("resnet18", num_classes=1)
    x = inputs()
    expected = reference_gradcam(model, x, "layer4", lambda y: sign * y[:, 0])
    result = explain.GradCAM(model, "layer4")(x, RegressionTarget(sign=sign))
    assert result.class_indices is None and result.cams.shape == (2, 64, 64)
    assert_maps(result.raw, expected)
    torch.testing.assert_close(result.scores, sign * model(x)[:, 0].detach())


@pytest.mark.parametrize("score", ["sigmoid", "probability"])
def test_multi_label_and_probability_scores(score) -> None:
    model = seeded("resnet18", num_classes=20)
    x = inputs()
    classes = [3, 17]
    squash = torch.sigmoid if score == "sigmoid" else (lambda logits: logits.softmax(dim=1))
    expected = reference_gradcam(model, x, "layer4", lambda logits: squash(logits)[range(2), classes])
    result = explain.GradCAM(model, "layer4")(x, ClassTarget(classes, score=score))
    assert_maps(result.raw, expected)
    with torch.no_grad():
        torch.testing.assert_close(result.probabilities, squash(model(x))[range(2), classes])


def test_top_k_object_keeps_its_k_axis() -> None:
    model = seeded("resnet18", num_classes=20)
    x = inputs()
    result = explain.GradCAM(model, "layer4")(x, TopK(1))
    assert result.cams.shape == (2, 1, 64, 64) and result.class_indices.shape == (2, 1)
    top = model(x).argmax(dim=1).tolist()
    assert_maps(result.raw[:, 0], reference_gradcam(model, x, "layer4", lambda logits: logits[range(2), top]))


def embedder() -> nn.Module:
    model = seeded("resnet18")
    model.fc = nn.Identity()
    return model


@pytest.mark.parametrize("per_image", [False, True])
def test_similarity_to_a_reference_embedding(per_image) -> None:
    model = embedder()
    x = inputs()
    torch.manual_seed(5)
    reference = torch.randn(2, 512) if per_image else torch.randn(512)
    expected = reference_gradcam(
        model, x, "layer4", lambda emb: F.cosine_similarity(emb, reference.expand(2, -1), dim=1)
    )
    result = explain.GradCAM(model, "layer4")(x, SimilarityTarget(reference))
    assert_maps(result.raw, expected)
    dot = explain.GradCAM(model, "layer4")(x, SimilarityTarget(reference, metric="dot"))
    assert_maps(dot.raw, reference_gradcam(model, x, "layer4", lambda emb: (emb * reference).sum(dim=1)))


def test_score_cam_scores_each_row_against_its_own_image_target() -> None:
    """Perturbed batches mix images; each row must be scored with its image's reference."""
    model = embedder()
    x = inputs(side=32)
    torch.manual_seed(6)
    reference = torch.randn(2, 512)
    a, _ = capture_score(model, x, "layer2", lambda emb: emb.sum(dim=1))
    expected = []
    with torch.no_grad():
        for n in range(2):
            masks = F.interpolate(a[n][:, None].float(), size=(32, 32), mode="bilinear", align_corners=False)
            low, high = masks.amin(dim=(2, 3), keepdim=True), masks.amax(dim=(2, 3), keepdim=True)
            masks = torch.where(high > low, (masks - low) / (high - low), 0.0)
            emb = model(x[n : n + 1] * masks)
            weights = F.cosine_similarity(emb, reference[n : n + 1], dim=1).double().softmax(dim=0)
            expected.append((weights[:, None, None] * a[n]).sum(dim=0).clamp(min=0))
    got = explain.cam(model, x, "scorecam", "layer2", SimilarityTarget(reference), resize=False, normalize=False)
    assert (got.double() - torch.stack(expected)).abs().max().item() <= 1e-4


def test_batch_rules_name_both_counts(segmenter) -> None:
    model = seeded("resnet18", num_classes=5)
    x = inputs(3, 32)
    with pytest.raises(explain.TargetError, match="1 targets given for a batch of 3 images"):
        explain.gradcam(model, x, "layer4", [2])
    with pytest.raises(explain.TargetError, match="1 targets given for a batch of 3 images"):
        explain.gradcam(model, x, "layer4", ClassTarget(["a"]), labels=list("abcde"))
    with pytest.raises(explain.TargetError, match="2 reference embeddings given for a batch of 3 images"):
        explain.gradcam(embedder(), x, "layer4", SimilarityTarget(torch.randn(2, 512)))
    with pytest.raises(explain.TargetError, match=r"RegressionTarget\(index=600\) needs"):
        explain.gradcam(embedder(), x, "layer3", RegressionTarget(index=600))
    with pytest.raises(
        explain.TargetError, match=r"output is \(3, 4, 32, 32\), not a classifier's .* SegmentationTarget"
    ):
        explain.gradcam(segmenter, x, "backbone.16", 1)


@pytest.mark.parametrize(
    "target",
    [
        RegressionTarget(sign=-1),
        ClassTarget([1, 4], score="sigmoid"),
        SimilarityTarget(torch.ones(5)),
    ],
)
def test_new_targets_leave_the_model_untouched(target) -> None:
    model = seeded("resnet18", num_classes=5).train()
    flags = [p.requires_grad for p in model.parameters()]
    x = inputs(2, 32)
    explain.cam(model, x, "gradcam", "layer3", target)
    explain.cam(model, x, "scorecam", "layer3", target, batch_size=64)
    assert hook_count(model) == 0 and model.training
    assert [p.requires_grad for p in model.parameters()] == flags and all(p.grad is None for p in model.parameters())


class ImageText(nn.Module):
    """A CLIP-like model: image and text embeddings in, their scaled cosine similarities (N, T) out."""

    def __init__(self) -> None:
        super().__init__()
        self.visual = seeded("resnet18", num_classes=16)

    def forward(self, images: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return 10 * F.normalize(self.visual(images), dim=1) @ F.normalize(text, dim=1).T


class TextBound(nn.Module):
    def __init__(self, model: nn.Module, text: torch.Tensor) -> None:
        super().__init__()
        self.model, self.text = model, text

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images, text=self.text)


def test_model_kwargs_reach_every_forward() -> None:
    model = ImageText().eval()
    x = inputs(2, 64)
    torch.manual_seed(7)
    text = torch.randn(3, 16)
    expected = reference_gradcam(model, x, "visual.layer4", lambda logits: logits[:, 2], text=text)
    got = explain.cam(model, x, "gradcam", None, 2, resize=False, normalize=False, model_kwargs={"text": text})
    assert_maps(got, expected)  # the automatic layer search ran with the text too
    score_cam = explain.methods.ScoreCAM(model, "visual.layer3")(x, 2, model_kwargs={"text": text}, normalize=False)
    baked = TextBound(model, text)  # the same network with the text inside: Score-CAM's reference tests cover it
    torch.testing.assert_close(
        score_cam.cams, explain.methods.ScoreCAM(baked, "model.visual.layer3")(x, 2, normalize=False).cams
    )
    guided = explain.cam(model, x, "guided_gradcam", "visual.layer4", 2, model_kwargs={"text": text})
    assert guided.shape == (2, 3, 64, 64)
    with pytest.raises(TypeError, match="text"):
        explain.gradcam(model, x, "visual.layer4", 2)


def test_the_default_target_of_a_detector_or_a_segmenter_names_their_targets() -> None:
    import torchvision
    from conftest import random_segmenter

    torch.manual_seed(0)
    detector = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=3
    ).eval()
    x = torch.rand(1, 3, 96, 96)
    with pytest.raises(explain.TargetError, match=r"detections .* target=explain\.targets\.DetectionTarget\(\)"):
        explain.gradcam(detector, x)
    with pytest.raises(explain.TargetError, match=r"\(1, 4, 96, 96\), not a .* dense map .*\.SegmentationTarget\(\)"):
        explain.gradcam(random_segmenter(), x)
