"""Inputs beyond images: clips and volumes (N, C, D, H, W) and signals (N, C, L). Each map is checked against Grad-CAM,
Score-CAM or Ablation-CAM written here with plain hooks, autograd and loops, upsampled linearly or trilinearly by
torch itself, and Grad-CAM on a video network against pytorch-grad-cam's 3-D path."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import capture_score, hook_count
from PIL import Image
from torch import nn

import explain
from explain.core.layers import find_auto_layers, traced_layers
from explain.errors import ExplainError
from explain.models.names import VIDEO_MODELS

MODES = {3: "linear", 4: "bilinear", 5: "trilinear"}  # by the input's number of axes


def reference(model: nn.Module, x: torch.Tensor, layer: str, score, last: bool = False) -> torch.Tensor:
    """Grad-CAM from its paper at one layer, every spatial axis averaged: (N, *spatial), float64. ``last``: the
    layer's output is channels last, as the architecture is known to be."""
    a, g = (t.movedim(-1, 1) if last else t for t in capture_score(model, x, layer, score))
    axes = tuple(range(2, a.dim()))
    return (g.mean(dim=axes, keepdim=True) * a).sum(dim=1).clamp(min=0)


def on_input(raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Raw maps (N, *spatial) upsampled to x's size by torch's own interpolation of x's rank, min-max normalized."""
    maps = F.interpolate(raw[:, None].float(), size=x.shape[2:], mode=MODES[x.dim()], align_corners=False)[:, 0]
    flat = maps.flatten(1)
    low, high = flat.min(dim=1).values, flat.max(dim=1).values
    return ((flat - low[:, None]) / (high - low)[:, None]).view_as(maps)


def logit(c: int):
    return lambda logits: logits[:, c]


def r3d() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.video.r3d_18(num_classes=5).eval()


def clip(n: int = 2) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(n, 3, 8, 64, 64)


def signal_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(2, 8, 5, padding=2), nn.ReLU(), nn.Conv1d(8, 16, 5, stride=2, padding=2), nn.ReLU(),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(16, 3),
    ).eval()  # fmt: skip


def volume_net(classes: int = 4, dense: bool = False) -> nn.Module:
    """A small 3-D network: a classifier, or with ``dense`` a segmenter whose output is (N, classes, D, H, W)."""
    torch.manual_seed(0)
    features = [nn.Conv3d(1, 6, 3, padding=1), nn.ReLU(), nn.Conv3d(6, 8, 3, stride=2, padding=1), nn.ReLU()]
    if dense:
        head = [nn.Conv3d(8, classes, 1), nn.Upsample(scale_factor=2, mode="trilinear")]
    else:
        head = [nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(8, classes)]
    return nn.Sequential(*features, *head).eval()


def test_a_video_classifier_is_explained_at_its_last_stage_in_time_and_space() -> None:
    """r3d_18 on two clips of 8 frames: the automatic layer is the last stage, the raw maps (N, d, h, w) are the
    reference's, and the maps are upsampled trilinearly to the clip's (D, H, W), each normalized."""
    model, x = r3d(), clip()
    assert find_auto_layers(model, x) == ["layer4"]
    hooks = hook_count(model)
    result = explain.GradCAM(model)(x, 2)
    assert hook_count(model) == hooks and result.layer == "layer4"
    expected = reference(model, x, "layer4", logit(2))
    assert result.raw.shape == expected.shape == (2, 1, 4, 4) and expected.amax() > 0
    torch.testing.assert_close(result.raw.double(), expected, rtol=1e-5, atol=1e-6 * float(expected.amax()))
    assert result.cams.shape == (2, 8, 64, 64)
    torch.testing.assert_close(result.cams, on_input(result.raw, x), rtol=0, atol=1e-5)


def test_a_video_classifier_matches_pytorch_grad_cam_3d() -> None:
    """pytorch-grad-cam's Grad-CAM on a 5-D input at r3d_18's layer3: the same raw maps. (Its upsampling to the
    clip is scipy's spline zoom; explain's is trilinear, as the issue of N-D inputs asks.)"""
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    model, x = r3d(), clip()
    ours = explain.GradCAM(model, "layer3")(x, 2)
    peer = GradCAM(model=model, target_layers=[model.layer3])
    try:
        peer(input_tensor=x, targets=[ClassifierOutputTarget(2)] * 2)
        a, g = (t[0].numpy() for t in (peer.activations_and_grads.activations, peer.activations_and_grads.gradients))
        theirs = np.maximum(peer.get_cam_image(x, model.layer3, None, a, g, False), 0)
    finally:
        peer.activations_and_grads.release()
    assert theirs.shape == tuple(ours.raw.shape) == (2, 2, 8, 8)
    for mine, peers in zip(ours.raw.numpy(), theirs):
        assert np.corrcoef(mine.ravel(), peers.ravel())[0, 1] >= 0.999


def test_a_channels_last_video_transformer_is_laid_out_from_its_operations() -> None:
    """torchvision's Video Swin keeps (N, T, H, W, C) maps: its last norm is laid out channels last, as its layer
    norm reads it, and matches the reference."""
    torch.manual_seed(0)
    model = torchvision.models.video.swin3d_t(num_classes=5).eval()
    x = torch.randn(1, 3, 4, 64, 64)
    result = explain.GradCAM(model)(x, logit(1), normalize=False, resize=False)
    assert result.layer == "norm"
    expected = reference(model, x, "norm", logit(1), last=True)
    assert result.raw.shape == expected.shape == (1, 2, 2, 2)
    assert (result.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def small_mvit() -> nn.Module:
    """torchvision's MViT v2 with three blocks on 4x32x32 clips: a class token, a (2, 8, 8) token grid, and a
    pooling attention that halves it to (2, 4, 4) in the last block."""
    from torchvision.models.video.mvit import MSBlockConfig, MViT

    torch.manual_seed(0)
    blocks = [
        MSBlockConfig(1, 16, 16, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 2, 2]),
        MSBlockConfig(1, 16, 32, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 2, 2]),
        MSBlockConfig(2, 32, 32, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 1, 1]),
    ]
    model = MViT(
        spatial_size=(32, 32), temporal_size=4, block_setting=blocks, residual_pool=True,
        residual_with_cls_embed=False, rel_pos_embed=True, proj_after_attn=True, num_classes=5,
    )  # fmt: skip
    return model.eval()


def test_a_video_transformer_s_tokens_are_laid_out_on_their_time_and_space_grid() -> None:
    """MViT flattens its (t, h, w) patch grid into tokens behind a class token, and pools the grid inside its
    blocks (its last block's output is on a (2, 4, 4) grid). As in a class-token ViT the head reads the class
    token alone, so the automatic layer is the last block's input, laid out on its (2, 8, 8) grid."""
    model = small_mvit()
    torch.manual_seed(6)
    x = torch.randn(1, 3, 4, 32, 32)
    layers = traced_layers(model, x)
    assert layers["blocks.2:0"].layout.grid == (2, 4, 4) and layers["blocks.2:0"].layout.prefix == 1
    assert find_auto_layers(model, x) == ["blocks.2.norm1"]
    result = explain.GradCAM(model)(x, logit(1), resize=False, normalize=False)
    a, g = (t[:, 1:].transpose(1, 2).reshape(1, -1, 2, 8, 8) for t in capture_score(model, x, result.layer, logit(1)))
    expected = (g.mean(dim=(2, 3, 4), keepdim=True) * a).sum(dim=1).clamp(min=0)
    assert result.raw.shape == expected.shape == (1, 2, 8, 8) and expected.amax() > 0
    assert (result.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_a_signal_network_is_explained_along_time() -> None:
    """A Conv1d network on (N, 2, 100) signals: the last convolution's ReLU, its raw map the reference's, upsampled
    linearly to the signal's length."""
    model = signal_net()
    torch.manual_seed(2)
    x = torch.randn(3, 2, 100)
    result = explain.GradCAM(model)(x, 1)
    assert result.layer == "3"
    expected = reference(model, x, "3", logit(1))
    assert result.raw.shape == expected.shape == (3, 50) and expected.amax() > 0
    torch.testing.assert_close(result.raw.double(), expected, rtol=1e-5, atol=1e-6 * float(expected.amax()))
    torch.testing.assert_close(result.cams, on_input(result.raw, x), rtol=0, atol=1e-5)
    with pytest.raises(ExplainError, match="only its time axis"):
        explain.GradCAM(model, aug_smooth=True)(x, 1)


def test_score_cam_and_ablation_cam_on_volumes_against_loops() -> None:
    """Score-CAM: each channel upsampled trilinearly and normalized masks the volume, the softmax of the masked
    scores weighs the channels. Ablation-CAM: each channel zeroed in turn, (y - y_c) / y weighs it."""
    model = volume_net()
    torch.manual_seed(3)
    x = torch.randn(2, 1, 8, 16, 16)
    layer = "3"
    kept = {}
    handle = model[3].register_forward_hook(lambda m, i, o: kept.update(a=o))
    with torch.no_grad():
        y = model(x)[:, 1]
    handle.remove()
    a = kept["a"]  # (2, 8, 4, 8, 8)
    masks = on_input(a.flatten(0, 1), x).view(*a.shape[:2], *x.shape[2:])
    with torch.no_grad():
        masked = torch.stack([model(x * masks[:, c, None])[:, 1] for c in range(a.shape[1])], dim=1)
        ablated = []
        for c in range(a.shape[1]):

            def zero(m, i, o, c=c):
                o = o.clone()
                o[:, c] = 0
                return o

            handle = model[3].register_forward_hook(zero)
            ablated.append(model(x)[:, 1])
            handle.remove()
    weights = {"scorecam": masked.softmax(dim=1), "ablationcam": (y[:, None] - torch.stack(ablated, 1)) / y[:, None]}
    for name, w in weights.items():
        expected = (w[..., None, None, None] * a).sum(dim=1).clamp(min=0)
        result = explain.METHODS[name](model, layer)(x, 1, resize=False, normalize=False)
        assert result.raw.shape == expected.shape == (2, 4, 8, 8), name
        assert (result.raw - expected).abs().max() <= 1e-4 * expected.abs().max(), name


def test_a_volume_segmenter_explains_a_class_over_its_region() -> None:
    """SegmentationTarget over a (N, classes, D, H, W) output: the class's logits summed over the voxels it wins."""
    model = volume_net(dense=True)
    torch.manual_seed(4)
    x = torch.randn(1, 1, 8, 16, 16)
    with torch.no_grad():
        logits = model(x)
    label = int(logits.argmax(dim=1).flatten().mode().values)
    region = (logits.argmax(dim=1) == label).double()
    result = explain.GradCAM(model, "3")(x, explain.targets.SegmentationTarget(label), resize=False, normalize=False)
    expected = reference(model, x, "3", lambda out: (out[:, label] * region).sum(dim=(1, 2, 3)))
    assert result.raw.shape == expected.shape == (1, 4, 8, 8) and expected.amax() > 0
    assert (result.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    mask = torch.zeros(8, 16, 16, dtype=torch.bool)
    mask[:4, :8, :8] = True
    given = explain.GradCAM(model, "3")(x, explain.targets.SegmentationTarget(label, mask=mask), resize=False)
    assert given.raw.shape == (1, 4, 8, 8)
    with pytest.raises(explain.errors.TargetError, match=r"\(DxHxW\) or one per image"):
        explain.GradCAM(model, "3")(x, explain.targets.SegmentationTarget(label, mask=mask[0]))


def test_smoothing_fusion_and_the_input_gradient_work_on_clips() -> None:
    """aug_smooth flips and rescales the image plane and leaves the frames as they are; fused layers are
    upsampled trilinearly; Guided Backpropagation's map is the clip's shape."""
    model, x = r3d(), clip(1)
    smoothed = explain.GradCAM(model, "layer3", aug_smooth=True)(x, 2)
    assert smoothed.cams.shape == (1, 8, 64, 64) and smoothed.cams.amax() == 1
    fused = explain.GradCAM(model, ["layer3", "layer4"])(x, 2)
    expected = torch.stack([on_input(reference(model, x, name, logit(2)), x) for name in ("layer3", "layer4")])
    torch.testing.assert_close(fused.cams, on_input(expected.mean(dim=0), x), rtol=0, atol=1e-4)
    guided = explain.METHODS["guided_backprop"](model)(x, 2, normalize=False)
    assert guided.cams.shape == x.shape


def test_inputs_of_other_ranks_are_refused_and_the_model_is_left_as_it_was() -> None:
    model, x = r3d(), clip(1)
    model.train()
    flags = [p.requires_grad for p in model.parameters()]
    explain.GradCAM(model)(x, 1)
    with pytest.raises(ExplainError, match=r"signals \(N, C, L\), images \(N, C, H, W\) or volumes"):
        explain.GradCAM(model)(x[0, 0, 0], 1)
    with pytest.raises(ExplainError, match="got shape"):
        explain.GradCAM(model)(x[None], 1)
    assert model.training and hook_count(model) == 0
    assert [p.requires_grad for p in model.parameters()] == flags and all(p.grad is None for p in model.parameters())


def test_the_faithfulness_metrics_rank_voxels_and_samples() -> None:
    """Deletion on volumes: voxels, highest in the map first, set to the baseline in equal steps; a loop here does
    the same and scores with the model. Average Drop on signals: the signal times its normalized map. The sanity
    check compares maps of any rank; ROAD's imputation is of the image plane and is refused."""
    from explain import metrics

    model = volume_net()
    torch.manual_seed(5)
    x = torch.randn(2, 1, 8, 16, 16)
    maps = torch.rand(2, 4, 8, 8)
    result = metrics.deletion(model, x, maps, 1, steps=4, score="logit")
    dense = on_input(maps, x).flatten(1)
    order = dense.argsort(dim=1, descending=True, stable=True)
    curve = []
    for step in range(5):
        kept = torch.ones_like(dense)
        kept.scatter_(1, order[:, : round(step * dense.shape[1] / 4)], 0.0)
        with torch.no_grad():
            curve.append(model(x * kept.view_as(x))[:, 1])
    torch.testing.assert_close(result.curve, torch.stack(curve, dim=1), rtol=1e-5, atol=1e-5)

    signals, net = torch.randn(3, 2, 100), signal_net()
    weights = torch.rand(3, 50)
    drop = metrics.average_drop(net, signals, weights, 0, score="logit")
    scaled = on_input(weights, signals)[:, None] * signals
    with torch.no_grad():
        y, o = net(signals)[:, 0], net(scaled)[:, 0]
    torch.testing.assert_close(drop.value, 100 * (y - o).clamp_min(0) / y.abs())

    sanity = metrics.sanity_check(model, x, "gradcam", target=1, layer="3", depths=[1])
    assert sanity.spearman.shape == sanity.ssim.shape == (1, 2)
    with pytest.raises(ExplainError, match="road imputes"):
        metrics.road(model, x, maps, 1)


def test_an_image_without_its_batch_axis_is_not_taken_for_signals() -> None:
    model = torchvision.models.resnet18(num_classes=3).eval()
    with pytest.raises(ExplainError, match=r"a batch of signals \(N, C, L\), but the model's first convolution"):
        explain.GradCAM(model)(torch.randn(3, 32, 32), 1)


def test_monai_networks_are_explained_as_the_user_s_modules() -> None:
    """MONAI (a test dependency; explain never imports it): a 3-D DenseNet121 classifier at its last map, and a
    3-D U-Net whose region of a class is explained at the last map before its output convolution."""
    from monai.networks.nets import DenseNet121, UNet

    torch.manual_seed(0)
    densenet = DenseNet121(spatial_dims=3, in_channels=1, out_channels=3).eval()
    x = torch.randn(1, 1, 64, 64, 64)
    result = explain.GradCAM(densenet)(x, 1, resize=False, normalize=False)
    expected = reference(densenet, x, result.layer, logit(1))
    assert result.layer == "features" and result.raw.shape == expected.shape == (1, 2, 2, 2)
    assert (result.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()

    unet = UNet(spatial_dims=3, in_channels=1, out_channels=3, channels=(8, 16, 32), strides=(2, 2)).eval()
    x = torch.randn(1, 1, 32, 32, 32)
    with torch.no_grad():
        logits = unet(x)
    label = int(logits.argmax(dim=1).flatten().mode().values)
    region = (logits.argmax(dim=1) == label).double()
    result = explain.GradCAM(unet)(x, explain.targets.SegmentationTarget(label), resize=False, normalize=False)
    assert result.layer == "model.1"  # the skip connection's output, which the output convolution reads
    expected = reference(unet, x, "model.1", lambda out: (out[:, label] * region).sum(dim=(1, 2, 3)))
    assert result.raw.shape == expected.shape == (1, 16, 16, 16) and expected.amax() > 0
    assert (result.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_torchvision_video_classifiers_load_by_name_with_kinetics_preprocessing(tmp_path) -> None:
    """load_model("r3d_18"): Kinetics-400's class names, 16 frames taken evenly over a clip, and frames prepared
    exactly as torchvision's own transform of the weights prepares them; a checkpoint of the user's is read offline."""
    import torchvision.models.video as video

    torch.manual_seed(0)
    checkpoint = tmp_path / "r3d.pt"
    torch.save(video.r3d_18(num_classes=400).state_dict(), checkpoint)
    spec = explain.load_model("r3d_18", weights=checkpoint)
    assert spec.labels == list(video.R3D_18_Weights.DEFAULT.meta["categories"]) and len(spec.labels) == 400
    assert spec.preprocessing.frames == 16 and spec.preprocessing.indices(31) == list(range(0, 31, 2))
    frames = torch.randint(0, 256, (16, 90, 120, 3), dtype=torch.uint8)
    clip = spec.preprocessing(frames)
    expected = video.R3D_18_Weights.DEFAULT.transforms()(frames.permute(0, 3, 1, 2))
    assert clip.shape == expected.shape == (3, 16, 112, 112)
    torch.testing.assert_close(clip, expected)
    result = explain.GradCAM(spec.model, labels=spec.labels)(clip[None], spec.labels[7])
    assert result.layer == "layer4" and result.cams.shape == (1, 16, 112, 112) and result.class_indices[0] == 7
    assert {"r3d_18", "mvit_v2_s", "swin3d_t", "s3d"} <= set(explain.models.available_models())
    assert set(VIDEO_MODELS) == set(torchvision.models.list_models(module=torchvision.models.video))
    with pytest.raises(ExplainError, match="takes videos, not images"):
        spec.preprocess(np.zeros((32, 32, 3), np.uint8))


def peak_model() -> nn.Module:
    """A 3-D network whose score is the largest value of its input smoothed by a peaked kernel: its Grad-CAM is
    one-hot at the brightest voxel."""
    conv = nn.Conv3d(1, 1, 3, padding=1, bias=False)
    with torch.no_grad():
        conv.weight.fill_(1.0)
        conv.weight[0, 0, 1, 1, 1] = 3.0
    return nn.Sequential(conv, nn.ReLU(), nn.AdaptiveMaxPool3d(1), nn.Flatten()).eval()


def test_a_nifti_volume_is_read_and_its_heatmap_written_with_its_affine(tmp_path) -> None:
    """A NIfTI made here with a bright blob: read with its affine, explained by a network whose score peaks at the
    blob, its heatmap written as a NIfTI of the scan's shape and affine whose peak is the blob; and the montage of
    the three slices through the peak."""
    import nibabel

    from explain.io.volumes import montage, read_volume, write_heatmap

    data = np.zeros((10, 12, 14), np.float32)
    data[6, 3, 9] = 5.0
    affine = np.diag([0.8, 0.8, 2.5, 1.0])
    affine[:3, 3] = [-40.0, 12.0, 7.5]
    nibabel.save(nibabel.Nifti1Image(data, affine), str(tmp_path / "scan.nii.gz"))
    volume = read_volume(tmp_path / "scan.nii.gz")
    np.testing.assert_array_equal(volume.data, data)
    np.testing.assert_allclose(volume.affine, affine)

    x = torch.from_numpy(volume.data)[None, None]
    result = explain.GradCAM(peak_model(), "1")(x, 0)
    write_heatmap(result.cams[0], volume, tmp_path / "scan.gradcam.nii.gz")
    written = nibabel.load(str(tmp_path / "scan.gradcam.nii.gz"))
    assert written.shape == data.shape and np.allclose(written.affine, affine)
    heat = np.asarray(written.dataobj)
    assert np.unravel_index(heat.argmax(), heat.shape) == (6, 3, 9)
    picture = montage(volume, result.cams[0])
    assert picture.size == (14 + 4 + 14 + 4 + 12, 12)  # slices across D (12x14), H (10x14), W (10x12)


def test_bad_volumes_and_signals_are_one_line_errors(tmp_path) -> None:
    import nibabel

    from explain.errors import InputLoadError
    from explain.io.signals import read_signal
    from explain.io.volumes import read_volume

    nibabel.save(nibabel.Nifti1Image(np.zeros((4, 4, 4, 3), np.float32), np.eye(4)), str(tmp_path / "series.nii"))
    (tmp_path / "broken.nii.gz").write_bytes(b"\x1f\x8b not really gzip")
    np.save(tmp_path / "flat.npy", np.zeros((5, 5), np.float32))
    np.save(tmp_path / "nan.npy", np.array([[1.0, np.nan, 2.0]], np.float32))
    for name, problem in [
        ("series.nii", "a series of volumes, shape (4, 4, 4, 3)"),
        ("broken.nii.gz", "cannot read the volume"),
        ("flat.npy", "no volume, shape (5, 5)"),
    ]:
        with pytest.raises(InputLoadError, match=f"{name}: {re.escape(problem)}") as caught:
            read_volume(tmp_path / name)
        assert "\n" not in str(caught.value)
    with pytest.raises(InputLoadError, match=r"nan\.npy: the signal holds NaN"):
        read_signal(tmp_path / "nan.npy")


def test_a_signal_file_is_read_channels_first_and_drawn_over_its_map(tmp_path) -> None:
    """A .csv has one sample per row: read as (C, L). The picture draws each channel over the map's band: red where
    the map is high, blue where it is low (jet)."""
    from explain.io.signals import plot_signal, read_signal

    samples = np.stack([np.sin(np.arange(200) / 10), np.cos(np.arange(200) / 10)], axis=1)
    np.savetxt(tmp_path / "ecg.csv", samples, delimiter=",", header="lead I,lead II", comments="")
    signal = read_signal(tmp_path / "ecg.csv")
    assert signal.shape == (2, 200)
    np.testing.assert_allclose(signal, samples.T, rtol=1e-6)
    band = np.zeros(200, np.float32)
    band[150:] = 1.0
    picture = np.asarray(plot_signal(signal, band))
    row = picture[picture.shape[0] // 4]  # a row through the first panel
    inside = np.nonzero((row != 255).any(axis=1))[0]  # the panel's columns

    def commonest(column: int) -> np.ndarray:  # the band's colour: the commonest in the column, the curve aside
        colours, counts = np.unique(picture[:, column], axis=0, return_counts=True)
        return colours[counts.argmax()].astype(float)

    white = np.full(3, 255.0)
    jet = {value: np.array(matplotlib.colormaps["jet"](value)[:3]) * 255 for value in (0.0, 1.0)}
    for share, value in ((0.9, 1.0), (0.2, 0.0)):  # late: the map's high end; early: its low end
        expected = 0.6 * jet[value] + 0.4 * white  # the band, drawn at alpha 0.6 on white
        assert np.abs(commonest(inside[int(len(inside) * share)]) - expected).max() <= 3


def make_video(path, frames: np.ndarray, fps: int) -> None:
    """A lossless video (FFV1) of the frames, made with PyAV."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("ffv1", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode(None))


def test_a_video_file_is_explained_frame_by_frame_and_written_back(tmp_path) -> None:
    """A clip made here (PyAV): its frames read as they were written; 16 of its 24 frames sampled for r3d_18 and
    prepared as torchvision does; the maps placed back on the crop's region of each whole frame and on the nearest
    sampled frame in time; the overlay video has the clip's frame count, size and rate, and its frames are the
    original frames blended with those maps (up to H.264's loss)."""
    import av
    import torchvision.models.video as video

    from explain.errors import InputLoadError
    from explain.io.video import frame_strip, overlay_frames, read_video, sampled_maps, write_gif, write_video

    torch.manual_seed(0)
    frames = np.zeros((24, 48, 64, 3), np.uint8)
    for t in range(24):
        frames[t, 10:30, 2 * t : 2 * t + 16] = (220, 180, 40)  # a square moving right
    make_video(tmp_path / "clip.mkv", frames, fps=12)
    clip = read_video(tmp_path / "clip.mkv")
    assert clip.fps == 12 and clip.frames.shape == frames.shape
    np.testing.assert_array_equal(clip.frames, frames)

    checkpoint = tmp_path / "r3d.pt"
    torch.save(video.r3d_18(num_classes=400).state_dict(), checkpoint)
    spec = explain.load_model("r3d_18", weights=checkpoint)
    chosen = spec.preprocessing.indices(len(clip.frames))
    result = explain.GradCAM(spec.model)(spec.preprocessing(clip.frames[chosen])[None])
    placed = spec.preprocessing.on_frames(result.cams[0], 48, 64)  # (16, 48, 64)
    top, left, bottom, right = spec.preprocessing.region(48, 64)  # 128x171 -> 112x112 crop, scaled to 48x64
    assert (top, left, bottom, right) == (3, 11, 45, 53) and not placed[:, :, :left].any()
    maps = sampled_maps(placed, chosen, len(clip.frames))
    assert torch.equal(maps[0], placed[0]) and torch.equal(maps[23], placed[15]) and torch.equal(maps[3], placed[2])
    blended = overlay_frames(clip.frames, maps)
    write_video(blended, clip.fps, tmp_path / "clip.gradcam.mp4")
    written = read_video(tmp_path / "clip.gradcam.mp4")
    assert written.frames.shape == frames.shape and written.fps == 12
    # H.264 in yuv420p halves the colour planes, which blurs colour edges; each frame's mean colour survives
    assert np.median(np.abs(written.frames.astype(float) - blended)) <= 2
    assert np.abs(written.frames.mean(axis=(1, 2)) - blended.mean(axis=(1, 2))).max() < 2
    with av.open(str(tmp_path / "clip.gradcam.mp4")) as container:
        assert container.streams.video[0].codec_context.name == "h264"

    write_gif(blended, clip.fps, tmp_path / "clip.gradcam.gif")
    gif = Image.open(tmp_path / "clip.gradcam.gif")
    assert gif.n_frames == 24 and gif.size == (213, 160)
    assert frame_strip(blended, count=8).size == (128 * 8, 96)
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 truncated")
    with pytest.raises(InputLoadError, match=r"broken\.mp4: cannot decode the video"):
        read_video(tmp_path / "broken.mp4")


class SignalTransformer(nn.Module):
    """A 1-D transformer: a strided convolution cuts the signal into patches, a class token goes in front, two
    encoder layers, and a head on the class token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv1d(2, 16, 10, stride=10)
        self.cls = nn.Parameter(torch.randn(1, 1, 16))
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(len(tokens), -1, -1), tokens], dim=1)
        return self.head(self.encoder(tokens)[:, 0])


def test_a_1d_transformer_s_tokens_are_laid_out_along_the_signal() -> None:
    """The convolution's positions are the signal's grid; the transpose makes them tokens behind a class token.
    The head reads the class token alone, so the automatic layer is the last encoder layer's input, its 10 patch
    tokens laid out along time."""
    torch.manual_seed(0)
    model = SignalTransformer().eval()
    x = torch.randn(2, 2, 100)
    layers = traced_layers(model, x)
    assert layers["encoder.layers.0"].layout.kind == "tokens" and layers["encoder.layers.0"].layout.prefix == 1
    assert layers["embed"].layout.kind == "channels_first"
    result = explain.GradCAM(model)(x, logit(1), resize=False, normalize=False)
    assert result.layer == "encoder.layers.0"
    a, g = (t[:, 1:].transpose(1, 2) for t in capture_score(model, x, result.layer, logit(1)))
    expected = (g.mean(dim=2, keepdim=True) * a).sum(dim=1).clamp(min=0)
    assert result.raw.shape == expected.shape == (2, 10) and expected.amax() > 0
    assert (result.raw.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def write_dicom_slice(path, pixels: np.ndarray, z: float, series: str, intercept: float = -1024.0) -> None:
    """One CT slice made with pydicom: axial (rows along y, columns along x), 0.5 x 0.7 mm pixels, at height z."""
    from pydicom import Dataset
    from pydicom.dataset import FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = CTImageStorage, generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID, ds.SeriesInstanceUID = CTImageStorage, meta.MediaStorageSOPInstanceUID, series
    ds.Modality = "CT"
    ds.ImagePositionPatient = [-20.0, 10.0, z]
    ds.ImageOrientationPatient = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    ds.PixelSpacing, ds.SliceThickness = [0.5, 0.7], 2.0
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
    ds.RescaleSlope, ds.RescaleIntercept = 1.0, intercept
    ds.PixelData = pixels.astype(np.int16).tobytes()
    ds.save_as(path, enforce_file_format=True)


def test_a_dicom_series_is_read_in_slice_order_with_its_affine(tmp_path) -> None:
    """Four axial CT slices made here, written in shuffled order: stacked by their position along the normal, in
    Hounsfield units, with the affine from (slice, row, column) to RAS millimetres."""
    from explain.errors import InputLoadError
    from explain.io.volumes import read_volume

    rng = np.random.default_rng(0)
    stored = rng.integers(0, 2000, size=(4, 8, 10))
    heights = [30.0, 32.5, 35.0, 37.5]
    for k in (2, 0, 3, 1):
        write_dicom_slice(tmp_path / f"s{k}.dcm", stored[k], heights[k], series="1.2.3")
    volume = read_volume(tmp_path)
    np.testing.assert_array_equal(volume.data, stored - 1024.0)
    voxel = np.array([2, 3, 4, 1.0])  # slice 2, row 3, column 4
    lps = np.array([-20.0 + 4 * 0.7, 10.0 + 3 * 0.5, 35.0])  # x along the columns, y along the rows
    np.testing.assert_allclose(volume.affine @ voxel, [-lps[0], -lps[1], lps[2], 1.0])

    write_dicom_slice(tmp_path / "other.dcm", stored[0], 40.0, series="9.9.9")
    with pytest.raises(InputLoadError, match="several DICOM series"):
        read_volume(tmp_path)
    (tmp_path / "other.dcm").write_bytes(b"not dicom")
    with pytest.raises(InputLoadError, match=r"other\.dcm: cannot read the DICOM slice"):
        read_volume(tmp_path)


def test_a_folder_of_dicom_series_is_exported_one_scan_per_series(tmp_path) -> None:
    """A folder scan for a volume model takes each folder of DICOM slices (by their content: suffix or none) as one
    scan: the heatmap NIfTI has the series' shape and affine and its peak at the brightest voxel; a series named
    itself is written under its folder's name; a NIfTI beside the series is a scan of its own."""
    import nibabel

    from explain import export_heatmaps
    from explain.export.settings import ExportOptions
    from explain.io.volumes import read_volume
    from explain.models import ModelSpec, VolumePreprocessing

    scans = tmp_path / "scans"
    series = scans / "patient" / "ct"
    series.mkdir(parents=True)
    stored = np.zeros((4, 8, 10), np.int64)
    stored[2, 3, 7] = 3000  # the brightest voxel, in slice 2 (written in shuffled order)
    for k in (2, 0, 3, 1):
        write_dicom_slice(series / f"IM{k:04d}", stored[k], 30.0 + 2.5 * k, series="1.2.3", intercept=0.0)
    nibabel.save(nibabel.Nifti1Image(np.ones((4, 4, 4), np.float32), np.eye(4)), str(scans / "other.nii.gz"))
    spec = ModelSpec(peak_model(), "peak", ["peak"], VolumePreprocessing(mean=0.0, std=1.0))
    summary = export_heatmaps(spec, [scans], tmp_path / "out", ExportOptions(layer="1"))
    assert (summary.written, summary.failed) == (2, 0)
    heat = nibabel.load(str(tmp_path / "out" / "patient" / "ct.gradcam.nii.gz"))
    assert heat.shape == (4, 8, 10) and np.allclose(heat.affine, read_volume(series).affine)
    assert np.unravel_index(np.asarray(heat.dataobj).argmax(), heat.shape) == (2, 3, 7)
    assert (tmp_path / "out" / "other.gradcam.nii.gz").is_file()
    named = export_heatmaps(spec, [series], tmp_path / "named", ExportOptions(layer="1"))
    assert named.written == 1 and (tmp_path / "named" / "ct.gradcam.nii.gz").is_file()


def test_the_command_line_explains_video_files(tmp_path, capsys) -> None:
    """`explain clip.mp4 --model r3d_18`: videos are the inputs of a video model. The overlay video has the clip's
    frame count, size and rate; outside the crop the model saw, its frames are the original blended with the map's
    zero (jet's dark blue); the record names it and its GIF, which the gallery shows. A corrupt video fails alone,
    in one line, and a resumed run skips the finished clip."""
    import json

    import av
    import torchvision.models.video as video

    from explain.cli import main

    frames = np.zeros((20, 48, 64, 3), np.uint8)
    for t in range(20):
        frames[t, 10:30, 2 * t : 2 * t + 16] = (220, 180, 40)
    with av.open(str(tmp_path / "clip.mp4"), mode="w") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode(None))
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 cut short")
    torch.manual_seed(0)
    torch.save(video.r3d_18(num_classes=400).state_dict(), tmp_path / "r3d.pt")
    out = tmp_path / "out"
    args = [str(tmp_path / "clip.mp4"), str(tmp_path / "broken.mp4"), "--model", "r3d_18"]
    args += ["--weights", str(tmp_path / "r3d.pt"), "-o", str(out), "--gallery"]
    assert main(args) == 1  # one input failed
    assert "broken.mp4: cannot decode the video: Invalid data" in capsys.readouterr().err

    from explain.io.video import read_video

    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()[1:]]
    clip = next(r for r in records if r["input"].endswith("clip.mp4"))
    (target,) = clip["targets"]
    assert (target["output"], target["picture"], clip["layer"]) == ("clip.gradcam.mp4", "clip.gradcam.gif", "layer4")
    assert target["class_name"] in video.R3D_18_Weights.DEFAULT.meta["categories"]
    written = read_video(out / "clip.gradcam.mp4")
    assert written.frames.shape == frames.shape and written.fps == 10
    outside = written.frames[:, 34:46, 0:8].reshape(-1, 3).mean(axis=0)  # left of the crop (11-52), below the square
    assert np.abs(outside - [0, 0, 64]).max() <= 3  # black blended half with jet(0) = (0, 0, 127.5)
    assert Image.open(out / "clip.gradcam.gif").n_frames == 16
    assert (out / "thumbs" / "clip.gradcam.jpg").is_file() and "clip.gradcam.gif" in (out / "index.html").read_text()
    broken = next(r for r in records if r["input"].endswith("broken.mp4"))
    assert broken["error"].endswith("cannot decode the video: Invalid data found when processing input")

    before = (out / "clip.gradcam.mp4").stat().st_mtime_ns
    assert main([*args, "--resume"]) == 1
    assert "skipped 1" in capsys.readouterr().out and (out / "clip.gradcam.mp4").stat().st_mtime_ns == before
    assert main([*args, "--overwrite", "--figure"]) == 2  # refused before the earlier run is touched
    assert "r3d_18 explains videos: --method all's grid, --figure" in capsys.readouterr().err
    assert (out / "clip.gradcam.mp4").stat().st_mtime_ns == before


def test_sliding_windows_explain_every_frame_of_a_long_video(tmp_path, capsys) -> None:
    """`--clip-stride 12` on a 36-frame video and a 16-frame model: windows start at frames 0, 12 and 20 (the last
    one ends at the last frame). The video's class is its top class by the windows' mean probability, each window
    is explained for it, and each frame's raw map is the mean of its windows' maps: all against a reference
    written here (torchvision's own transform, hooks and autograd, trilinear upsampling). The overlay video has
    every frame."""
    import json

    import torchvision.models.video as video
    from conftest import reference_gradcam

    from explain.cli import main
    from explain.io.video import read_video

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, size=(36, 48, 64, 3), dtype=np.uint8)
    frames[:, 10:30, 20:40] = 230
    make_video(tmp_path / "long.mkv", frames, 10)
    torch.manual_seed(0)
    network = video.r3d_18(num_classes=400).eval()
    torch.save(network.state_dict(), tmp_path / "r3d.pt")
    out = tmp_path / "out"
    args = [str(tmp_path / "long.mkv"), "--model", "r3d_18", "--weights", str(tmp_path / "r3d.pt")]
    assert main([*args, "--clip-stride", "12", "--save-raw", "--batch-size", "2", "-o", str(out)]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("written 1, failed 0") and summary.endswith(" videos/s)")

    decoded = torch.from_numpy(frames)  # lossless: what the model saw
    transform = video.R3D_18_Weights.DEFAULT.transforms()
    windows = torch.stack([transform(decoded[s : s + 16].permute(0, 3, 1, 2)) for s in (0, 12, 20)])
    with torch.no_grad():
        probabilities = network(windows).softmax(dim=1)
    chosen = int(probabilities.mean(dim=0).argmax())
    maps = reference_gradcam(network, windows, "layer4", [chosen] * 3)[:, None].float()
    maps = F.interpolate(maps, size=(16, 112, 112), mode="trilinear", align_corners=False)[:, 0]
    expected, count = torch.zeros(36, 112, 112), torch.zeros(36, 1, 1)
    for w, start in enumerate((0, 12, 20)):
        expected[start : start + 16] += maps[w]
        count[start : start + 16] += 1
    expected /= count
    raw = torch.from_numpy(np.load(out / "long.gradcam.npy"))
    assert raw.shape == (36, 112, 112) and expected.abs().max() > 0
    torch.testing.assert_close(raw, expected, rtol=1e-3, atol=1e-4 * float(expected.abs().max()))
    record = json.loads((out / "manifest.jsonl").read_text().splitlines()[1])
    (target,) = record["targets"]
    assert target["class_index"] == chosen
    assert target["score"] == pytest.approx(float(probabilities[:, chosen].mean()), abs=1e-6)  # rounded to 6 places
    assert read_video(out / "long.gradcam.mp4").frames.shape == (36, 48, 64, 3)
    header = json.loads((out / "manifest.jsonl").read_text().splitlines()[0])["header"]
    assert header["preprocessing"]["stride"] == 12

    assert main([*args, "--clip-stride", "17", "-o", str(tmp_path / "refused")]) == 2
    assert "clip stride must be between 1 and the model's 16 frames" in capsys.readouterr().err
    assert main([*args, "--clip-stride", "4", "--topk", "2", "-o", str(tmp_path / "refused")]) == 2
    assert "--clip-stride explains each video's class over its windows" in capsys.readouterr().err


def test_volumes_and_signals_are_exported_with_their_manifest_and_resume(tmp_path) -> None:
    """export_heatmaps with a model of the user's: volumes (NIfTI, .npy) give a heatmap NIfTI with the scan's affine
    and a montage, signals (.csv) a plot of the signal over its map; a corrupt file fails alone; the manifest names
    the files; a resumed run skips what is finished."""
    import json

    import nibabel

    from explain import export_heatmaps
    from explain.export.settings import ExportOptions
    from explain.models import ModelSpec, SignalPreprocessing, VolumePreprocessing

    scans = tmp_path / "scans"
    scans.mkdir()
    data = np.zeros((8, 16, 16), np.float32)
    data[5, 4, 11] = 5.0
    affine = np.diag([0.9, 0.9, 3.0, 1.0])
    nibabel.save(nibabel.Nifti1Image(data, affine), str(scans / "a.nii.gz"))
    np.save(scans / "b.npy", np.roll(data, 3, axis=2))
    (scans / "c.nii.gz").write_bytes(b"\x1f\x8b broken")
    spec = ModelSpec(peak_model(), "peak", ["peak"], VolumePreprocessing(mean=0.0, std=1.0))
    out = tmp_path / "out"
    summary = export_heatmaps(spec, [scans], out, ExportOptions(layer="1"))
    assert (summary.written, summary.failed) == (2, 1)
    records = {Path(r["input"]).name: r for r in summary.records}
    assert records["c.nii.gz"]["error"].startswith(str(scans / "c.nii.gz"))
    target = records["a.nii.gz"]["targets"][0]
    assert (target["output"], target["picture"]) == ("a.gradcam.nii.gz", "a.gradcam.png")
    heat = nibabel.load(str(out / "a.gradcam.nii.gz"))
    assert np.allclose(heat.affine, affine) and heat.shape == data.shape
    assert np.unravel_index(np.asarray(heat.dataobj).argmax(), data.shape) == (5, 4, 11)
    shifted = np.asarray(nibabel.load(str(out / "b.gradcam.nii.gz")).dataobj)
    assert np.unravel_index(shifted.argmax(), data.shape) == (5, 4, 14)  # the .npy's peak, rolled by 3
    assert Image.open(out / "a.gradcam.png").size == (16 + 4 + 16 + 4 + 16, 16)
    again = export_heatmaps(spec, [scans], out, ExportOptions(layer="1", resume=True))
    assert (again.written, again.skipped) == (0, 2)

    series = tmp_path / "series"
    series.mkdir()
    samples = np.stack([np.sin(np.arange(100) / 5), np.cos(np.arange(100) / 5)], axis=1)
    np.savetxt(series / "ecg.csv", samples, delimiter=",")
    signal_spec = ModelSpec(signal_net(), "signal-net", ["a", "b", "c"], SignalPreprocessing())
    summary = export_heatmaps(signal_spec, [series], tmp_path / "signals", ExportOptions())
    (record,) = summary.records
    assert record["layer"] == "3" and record["targets"][0]["output"] == "ecg.gradcam.png"
    assert Image.open(tmp_path / "signals" / "ecg.gradcam.png").size[0] == 1000
    header = json.loads((tmp_path / "signals" / "manifest.jsonl").read_text().splitlines()[0])
    assert header["header"]["preprocessing"] == {"mean": None, "std": None}


def test_a_volume_export_scores_its_maps_voxel_by_voxel(tmp_path) -> None:
    """--metrics on volumes: the record's deletion AUC is that of the map computed directly, (N, D, H, W) read as
    one map per scan (not as a guided method's channels)."""
    from explain import export_heatmaps
    from explain.export.settings import ExportOptions
    from explain.models import ModelSpec, VolumePreprocessing

    torch.manual_seed(0)
    data = torch.rand(8, 12, 12).numpy()
    (tmp_path / "scans").mkdir()
    np.save(tmp_path / "scans" / "a.npy", data)
    spec = ModelSpec(volume_net(), "net", list("abcd"), VolumePreprocessing())
    summary = export_heatmaps(spec, [tmp_path / "scans"], tmp_path / "out", ExportOptions(metrics=("deletion",)))
    (record,) = summary.records
    x = spec.preprocessing.standardized(torch.from_numpy(data))[None, None]
    result = explain.GradCAM(spec.model)(x)
    expected = explain.metrics.deletion(spec.model, x, result.cams, result.target)
    assert record["targets"][0]["metrics"]["deletion"] == pytest.approx(float(expected.auc[0]), abs=1e-5)


def test_the_command_line_takes_a_model_of_the_users_own_code(tmp_path, capsys) -> None:
    """`--model net.py:build`: the user's file gives an explain.ModelSpec of a 3-D network with its preprocessing;
    its kind (volumes) decides the inputs, `--weights` loads strictly into it, and the heatmap's peak is the scan's
    brightest voxel. A file that raises, a name it lacks and a bare nn.Module are one-line errors."""
    import nibabel

    from explain.cli import main

    (tmp_path / "net.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "from explain.models import ModelSpec, VolumePreprocessing\n\n"
        "def network():\n"
        "    conv = nn.Conv3d(1, 1, 3, padding=1, bias=False)\n"
        "    return nn.Sequential(conv, nn.ReLU(), nn.AdaptiveMaxPool3d(1), nn.Flatten())\n\n"
        "def build():\n"
        "    return ModelSpec(network(), 'peak', ['peak'], VolumePreprocessing(mean=0.0, std=1.0))\n\n"
        "bare = network()\n\n"
        "def broken():\n"
        "    raise ValueError('no GPU here')\n"
    )
    weights = peak_model().state_dict()
    torch.save(weights, tmp_path / "peak.pt")
    data = np.zeros((6, 10, 12), np.float32)
    data[4, 2, 9] = 5.0
    nibabel.save(nibabel.Nifti1Image(data, np.eye(4)), str(tmp_path / "scan.nii.gz"))
    (tmp_path / "photo.png").write_bytes(b"")  # not a volume: the folder scan passes over it
    out = tmp_path / "out"
    args = [str(tmp_path), "--model", f"{tmp_path / 'net.py'}:build", "--weights", str(tmp_path / "peak.pt")]
    assert main([*args, "--layer", "1", "-o", str(out)]) == 0
    heat = np.asarray(nibabel.load(str(out / "scan.gradcam.nii.gz")).dataobj)
    assert np.unravel_index(heat.argmax(), data.shape) == (4, 2, 9)
    (tmp_path / "list.txt").write_text("scan.nii.gz\n")  # a list's file loses both parts of its suffix too
    assert main([*args[1:], "--from-list", str(tmp_path / "list.txt"), "--layer", "1", "-o", str(tmp_path / "l")]) == 0
    assert (tmp_path / "l" / "scan.gradcam.nii.gz").is_file()
    for name, message in (
        ("broken", "net.py:broken: ValueError: no GPU here"),
        ("missing", "net.py gives nothing of that name, not an explain.ModelSpec"),
        ("bare", "net.py:bare: a plain Sequential whose first layer is a Conv3d of 1 channels, not an image's 3"),
    ):
        assert main([str(tmp_path), "--model", f"{tmp_path / 'net.py'}:{name}", "-o", str(tmp_path / name)]) == 2
        assert message in capsys.readouterr().err


def test_a_volume_too_small_for_the_model_fails_alone_in_one_line(tmp_path) -> None:
    """A scan smaller than the network's 5x5x5 kernel: the model's own refusal, one line naming the file; the scan
    beside it is written."""
    import nibabel

    from explain import export_heatmaps
    from explain.export.settings import ExportOptions
    from explain.models import ModelSpec, VolumePreprocessing

    torch.manual_seed(0)
    network = nn.Sequential(nn.Conv3d(1, 2, 5), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten()).eval()
    scans = tmp_path / "scans"
    scans.mkdir()
    rng = np.random.default_rng(0)
    nibabel.save(nibabel.Nifti1Image(rng.random((9, 10, 11), np.float32), np.eye(4)), str(scans / "big.nii.gz"))
    nibabel.save(nibabel.Nifti1Image(rng.random((3, 10, 11), np.float32), np.eye(4)), str(scans / "thin.nii.gz"))
    spec = ModelSpec(network, "kernel-5", ["a", "b"], VolumePreprocessing())
    summary = export_heatmaps(spec, [scans], tmp_path / "out", ExportOptions(layer="1", batch_size=1))
    assert (summary.written, summary.failed) == (1, 1)
    error = next(r["error"] for r in summary.records if r["input"].endswith("thin.nii.gz"))
    assert error.startswith(str(scans / "thin.nii.gz")) and "\n" not in error and "Kernel size" in error
    assert (tmp_path / "out" / "big.gradcam.nii.gz").is_file()
    assert not list((tmp_path / "out").glob("thin*"))


class VideoViT(nn.Module):
    """A ViT over a clip's tubelets: a Conv3d patch embedding of 2x8x8, a class token, three timm blocks (their
    attention computed unfused, so that the test can read its probabilities), the class token's head."""

    def __init__(self) -> None:
        super().__init__()
        from timm.models.vision_transformer import Block

        self.patch = nn.Conv3d(3, 32, (2, 8, 8), stride=(2, 8, 8))
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, 32))
        self.blocks = nn.Sequential(*[Block(32, 4) for _ in range(3)])
        for block in self.blocks:
            block.attn.fused_attn = False
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = self.blocks(torch.cat([self.cls.expand(len(x), -1, -1), tokens], dim=1))
        return self.head(self.norm(tokens)[:, 0])


def test_the_rollouts_of_a_video_transformer_lie_on_its_tubelet_grid() -> None:
    """Attention Rollout and gradient rollout of a video ViT, on its (t, h, w) tubelet grid, against both rollouts
    written here from the probabilities the attention computes (and their gradients by autograd); a video
    transformer whose attention pools its tokens (MViT) is refused in one line."""
    torch.manual_seed(0)
    model = VideoViT().eval()
    x = torch.randn(2, 3, 4, 32, 32)
    probabilities: list[torch.Tensor] = []
    handles = [b.attn.attn_drop.register_forward_hook(lambda m, i, o: probabilities.append(o)) for b in model.blocks]
    try:
        gradients = torch.autograd.grad(model(x)[:, 1].sum(), probabilities)
    finally:
        for handle in handles:
            handle.remove()
    a, g = torch.stack(probabilities, dim=1).double(), torch.stack(gradients, dim=1).double()  # (N, L, H, T, T)
    eye = torch.eye(a.shape[-1], dtype=torch.float64)
    plain = a.mean(dim=2) + eye
    plain = plain / plain.sum(dim=-1, keepdim=True)
    rolled = plain[:, 2] @ plain[:, 1] @ plain[:, 0]
    weighted, by_gradient = (g * a).clamp(min=0).mean(dim=2), eye.expand(2, -1, -1)
    for layer in range(3):
        by_gradient = by_gradient + weighted[:, layer] @ by_gradient
    for method, expected in (
        (explain.methods.AttentionRollout, rolled),
        (explain.methods.GradientRollout, by_gradient),
    ):
        result = method(model)(x, 1, resize=False, normalize=False)
        reference = expected[:, 0, 1:].reshape(2, 2, 4, 4)
        assert result.raw.shape == (2, 2, 4, 4) and reference.abs().max() > 0
        torch.testing.assert_close(result.raw.double(), reference, rtol=1e-4, atol=1e-6)
        assert method(model)(x, 1).cams.shape == (2, 4, 32, 32)  # upsampled trilinearly to the clip
    assert hook_count(model) == 0
    with pytest.raises(explain.LayerError, match=r"reads the attention of nn\.MultiheadAttention"):
        explain.methods.AttentionRollout(small_mvit())(torch.randn(1, 3, 4, 32, 32))
