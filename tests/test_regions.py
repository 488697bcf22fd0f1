"""Dense regressions over a region (RegionTarget): the region placed on the output's grid by proportion (a
gradient planted through an upsampling output lands on the box's own pixels), each reduction against its value
written out, the errors that name the way out, and HuggingFace depth models (DPT, GLPN, Depth Anything, tiny random
configs) explained at a layer of theirs against Grad-CAM written out with hooks and autograd."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import explain
from explain.errors import TargetError
from explain.models.sam import SamPrompted
from explain.targets import RegionTarget, nearer_sign

transformers = pytest.importorskip("transformers")


def _doubling() -> nn.Module:
    """Channel 0 of the input, upsampled twice: the output's cell (i, j) is the input's pixel (i // 2, j // 2)."""
    conv = nn.Conv2d(3, 1, 1, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1))
    return nn.Sequential(conv, nn.Upsample(scale_factor=2, mode="nearest")).eval()


def test_a_box_in_input_pixels_lands_on_its_own_pixels_through_an_upsampling_output() -> None:
    x = torch.randn(2, 3, 10, 12)
    target = RegionTarget(box=torch.tensor([[2, 3, 7, 8], [0, 0, 4, 2]]), size=(10, 12))
    raw = explain.create_method("saliency", _doubling())(x, target).raw  # the input's gradient, (N, C, H, W)
    for i, (x1, y1, x2, y2) in enumerate([(2, 3, 7, 8), (0, 0, 4, 2)]):
        expected = torch.zeros(10, 12)
        expected[y1:y2, x1:x2] = 4.0 / (4 * (x2 - x1) * (y2 - y1))  # the mean over 4 output cells a pixel
        torch.testing.assert_close(raw[i, 0], expected)
        assert raw[i, 1:].abs().sum() == 0


def test_each_reduction_and_a_partly_covered_cell() -> None:
    model = _doubling()
    x = torch.randn(1, 3, 6, 6)
    with torch.no_grad():
        dense = model(x)[0, 0]
    for reduction, expected in (("mean", dense[2:6, 4:8].mean()), ("sum", dense[2:6, 4:8].sum()),
                                ("max", dense[2:6, 4:8].max()), ("min", dense[2:6, 4:8].min())):  # fmt: skip
        bound = RegionTarget(box=(2, 1, 4, 3), size=(6, 6), reduction=reduction, sign=-1).bind(model(x), None)
        torch.testing.assert_close(bound.score(model(x), torch.tensor([0]))[0, 0], -expected)
        torch.testing.assert_close(bound.probabilities[0, 0], expected)  # the value itself, unsigned
    half = RegionTarget(box=(0.0, 0.0, 1.5, 1.0), size=(12, 12)).bind(model(x), None)  # a cell and a half
    torch.testing.assert_close(half.regions[0, 0, 0, :3], torch.tensor([1.0, 0.5, 0.0]))
    point = RegionTarget(point=(3.2, 2.9), radius=1.0, size=(6, 6)).bind(model(x), None)
    rows, columns = torch.meshgrid(torch.arange(12) + 0.5, torch.arange(12) + 0.5, indexing="ij")
    disc = (columns - 6.4) ** 2 + (rows - 5.8) ** 2 <= 2.0**2  # (3.2, 2.9) and 1 pixel, on the doubled grid
    disc[5, 6] = True  # the cell holding the point
    torch.testing.assert_close(point.regions[0, 0], disc.float())
    masked = RegionTarget(mask=torch.eye(3, dtype=torch.bool)).bind(model(x), None)
    assert masked.regions[0, 0].sum() == 3 * 16  # each diagonal cell of the 3 x 3 mask covers 4 x 4 output cells


def test_regions_that_cannot_be_explained_name_the_way_out() -> None:
    model, x = _doubling(), torch.randn(1, 3, 6, 6)
    with pytest.raises(TargetError, match="outside the 6x6 image"):
        RegionTarget(box=(2, 2, 9, 4), size=(6, 6)).bind(model(x), None)
    with pytest.raises(TargetError, match="one region"):
        RegionTarget(box=(0, 0, 1, 1), point=(0, 0))
    with pytest.raises(TargetError, match="give channel="):
        RegionTarget(box=(0, 0, 1, 1)).bind(torch.zeros(1, 3, 4, 4), None)
    with pytest.raises(TargetError, match="covers no cell"):
        RegionTarget(mask=torch.zeros(6, 6)).bind(model(x), None)


def _dpt() -> nn.Module:
    config = transformers.DPTConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=37, image_size=64, patch_size=8,
        neck_hidden_sizes=[8, 16, 32, 32], fusion_hidden_size=16, backbone_out_indices=[0, 1, 2, 3], head_in_index=-1,
    )  # fmt: skip
    return transformers.DPTForDepthEstimation(config)


def _glpn() -> nn.Module:
    config = transformers.GLPNConfig(
        num_encoder_blocks=4, depths=[1, 1, 1, 1], sr_ratios=[8, 4, 2, 1], hidden_sizes=[8, 16, 24, 32],
        num_attention_heads=[1, 1, 1, 1], decoder_hidden_size=16, patch_sizes=[7, 3, 3, 3], strides=[4, 2, 2, 2],
        mlp_ratios=[2, 2, 2, 2],
    )  # fmt: skip
    return transformers.GLPNForDepthEstimation(config)


def _depth_anything(kind: str = "relative") -> nn.Module:
    backbone = transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=37, image_size=56,
        patch_size=14, out_features=["stage1", "stage2", "stage3", "stage4"], reshape_hidden_states=False,
    )  # fmt: skip
    config = transformers.DepthAnythingConfig(
        backbone_config=backbone, neck_hidden_sizes=[8, 16, 32, 32], fusion_hidden_size=16, reassemble_hidden_size=32,
        patch_size=14, head_hidden_size=8, depth_estimation_type=kind,
    )  # fmt: skip
    return transformers.DepthAnythingForDepthEstimation(config)


def _gradcam_written_out(model: nn.Module, layer: str, x: torch.Tensor, score) -> torch.Tensor:
    kept = {}
    handle = model.get_submodule(layer).register_forward_hook(lambda m, a, out: kept.update(out=out))
    try:
        value = score(model(pixel_values=x).predicted_depth)
    finally:
        handle.remove()
    gradient = torch.autograd.grad(value.sum(), kept["out"])[0]
    return torch.relu((gradient.mean(dim=(2, 3), keepdim=True) * kept["out"]).sum(dim=1)).detach()


@pytest.mark.parametrize(
    ("build", "size", "layer"),
    [(_dpt, 64, "neck.fusion_stage.layers.2"), (_glpn, 64, "decoder.stages.2"),
     (_depth_anything, 56, "neck.fusion_stage.layers.2")],
)  # fmt: skip
def test_depth_models_are_explained_at_their_layers_as_grad_cam_written_out(build, size: int, layer: str) -> None:
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(2, 3, size, size)
    box = (size // 8, size // 4, size // 2, size - 4)
    sign = 1 if build is _dpt else nearer_sign(model)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    result = explain.GradCAM(model, layer)(x, RegionTarget(box=box, size=(size, size), sign=sign))

    def score(depth: torch.Tensor) -> torch.Tensor:
        scale = depth.shape[-1] / size
        x1, y1, x2, y2 = (round(v * scale) for v in box)
        return sign * depth[:, y1:y2, x1:x2].mean(dim=(1, 2))

    expected = _gradcam_written_out(model, layer, x, score)
    for found, wanted in zip(result.raw, expected):
        r = torch.corrcoef(torch.stack([found.flatten(), wanted.flatten()]))[0, 1]
        assert r > 0.999
    assert not model.training and {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())


def test_the_nearer_sign_is_read_from_the_config() -> None:
    assert nearer_sign(_glpn()) == -1
    assert nearer_sign(_depth_anything("relative")) == 1
    assert nearer_sign(_depth_anything("metric")) == -1
    with pytest.raises(TargetError, match="give sign=1 where larger values are nearer"):
        nearer_sign(_dpt())


def test_the_command_line_explains_a_depth_models_region_and_a_sams_prompt(tmp_path, capsys) -> None:
    """Folders written by save_pretrained: a GLPN and a Depth Anything with their image processors (--region in the
    photo's pixels: the manifest's score is the mean depth over it, the depth at the photo's size) and a SAM
    (--point: the mask it draws, scored by its predicted IoU in the manifest); prompts a model takes none of are
    one line each."""
    from conftest import CAT, manifest
    from test_sam import _sam

    from explain.cli import main
    from explain.models.sam import SamPrompted

    depth_folder, sam_folder, dpt_folder = tmp_path / "glpn", tmp_path / "sam", tmp_path / "dpt"
    torch.manual_seed(0)
    _glpn().save_pretrained(depth_folder)
    transformers.GLPNImageProcessor(size_divisor=32).save_pretrained(depth_folder)
    _dpt().save_pretrained(dpt_folder)
    transformers.DPTImageProcessor(size={"height": 64, "width": 64}).save_pretrained(dpt_folder)
    _sam().save_pretrained(sam_folder)

    out = tmp_path / "depth"
    assert main([str(CAT), "--model", str(depth_folder), "--region", "100,50,300,200", "--direction", "nearer",
                 "-o", str(out)]) == 0  # fmt: skip
    (record,) = manifest(out)
    (target,) = record["targets"]
    spec = explain.load_model(str(depth_folder))
    with torch.no_grad():
        depth = spec.model(spec.preprocess(explain.load_image(CAT)))
    assert depth.shape == (1, 300, 451) and target["class_name"] == "depth"
    assert target["score"] == pytest.approx(float(depth[0, 50:200, 100:300].mean()), rel=1e-4)
    assert (out / target["output"]).is_file() and target["output"].endswith("chelsea.gradcam.depth.jpg")

    anything = tmp_path / "depth-anything"  # relative inverse depth: nearer is larger, read from its config
    _depth_anything().save_pretrained(anything)
    processor = transformers.DPTImageProcessor(size={"height": 56, "width": 56}, keep_aspect_ratio=True,
                                               ensure_multiple_of=14)  # fmt: skip
    processor.save_pretrained(anything)
    out = tmp_path / "anything"
    assert main([str(CAT), "--model", str(anything), "--region", "40,30,200,120", "--direction", "nearer",
                 "-o", str(out)]) == 0  # fmt: skip
    (target,) = manifest(out)[0]["targets"]
    spec = explain.load_model(str(anything))
    with torch.no_grad():
        depth = spec.model(spec.preprocess(explain.load_image(CAT)))
    assert depth.shape == (1, 300, 451)
    assert target["score"] == pytest.approx(float(depth[0, 30:120, 40:200].mean()), rel=1e-4)

    out = tmp_path / "mask"
    assert main([str(CAT), "--model", str(sam_folder), "--point", "200,150", "-o", str(out)]) == 0
    (record,) = manifest(out)
    (target,) = record["targets"]
    prompted = SamPrompted(explain.load_model(str(sam_folder)).model, points=[(200.0, 150.0)])
    with torch.no_grad():
        ious = prompted(explain.load_model(str(sam_folder)).preprocess(explain.load_image(CAT))).iou_scores[0, 0]
    assert target["class_index"] == int(ious.argmax()) and target["score"] == pytest.approx(float(ious.max()), abs=1e-6)

    capsys.readouterr()
    refused = (
        ["--model", str(sam_folder)],
        ["--model", str(depth_folder), "--point", "3,4"],
        ["--model", "efficientnet_lite0", "--region", "1,2,3,4"],
        ["--model", str(dpt_folder), "--direction", "nearer"],
        ["--model", str(sam_folder), "--box", "1,2"],
    )
    for arguments in refused:
        assert main([str(CAT), *arguments, "-o", str(tmp_path / "no")]) in (1, 2)
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if "error" in line]
    assert any("give --point x,y or --box x1,y1,x2,y2" in line for line in errors)
    assert any(
        "--point and --box prompt a promptable segmenter (SAM); glpn is a depth model" in line for line in errors
    )
    assert any("--region explains a depth estimator's region; efficientnet_lite0 is a classification model" in line
               for line in errors)  # fmt: skip
    assert any("give sign=1 where larger values are nearer" in line for line in errors)
    assert any("--box '1,2': give x1,y1,x2,y2" in line for line in errors)


def test_a_users_map_model_explains_a_region_drawn_on_each_photo_through_its_resize(tmp_path, capsys) -> None:
    """A map-valued model of the user's code (FILE.py:NAME, task "depth") whose preprocessing squeezes each photo
    to 64 x 64 and whose output is 32 x 32: --region in the photo's pixels is the mean of the output cells it
    covers once both are scaled, here cells [4, 20) x [8, 16) of the cat's 451 x 300; a region outside the photo
    fails it, naming it; a promptable model whose preprocessing resizes is refused; SAM-HQ by folder."""
    from conftest import CAT, manifest
    from test_sam import _sam

    from explain.cli import main

    code = tmp_path / "mine.py"
    code.write_text(
        "import torch\nimport explain\n\n"
        "def spec():\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.ReLU(),"
        " torch.nn.Conv2d(4, 1, 3, padding=1)).eval()\n"
        "    preprocessing = explain.models.Preprocessing(64, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))\n"
        "    return explain.ModelSpec(model, 'mine', ['depth'], preprocessing, 'depth')\n\n"
        "def squeezed_sam():\n"
        "    from test_sam import _sam\n"
        "    preprocessing = explain.models.Preprocessing(64, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))\n"
        "    return explain.ModelSpec(_sam(), 'squeezed', ['mask'], preprocessing, 'prompted')\n"
    )
    box = (451 * 8 / 32, 300 * 4 / 32, 451 * 16 / 32, 300 * 20 / 32)
    out = tmp_path / "out"
    assert main([str(CAT), "--model", f"{code}:spec", "--region", ",".join(map(str, box)), "--direction", "smaller",
                 "--layer", "0", "-o", str(out)]) == 0  # fmt: skip
    (record,) = manifest(out)
    (target,) = record["targets"]
    spec = explain.load_model(f"{code}:spec")
    with torch.no_grad():
        depth = spec.model(spec.preprocess(explain.load_image(CAT)))
    assert depth.shape == (1, 1, 32, 32)
    assert target["score"] == pytest.approx(float(depth[0, 0, 4:20, 8:16].mean()), rel=1e-5)
    assert (out / target["output"]).is_file()
    assert main([str(CAT), "--model", f"{code}:spec", "--region", "0,0,500,10", "-o", str(tmp_path / "no")]) == 1
    assert f"{CAT}: the region lies outside the 300x451 image it is drawn on" in capsys.readouterr().err
    assert main([str(CAT), "--model", f"{code}:squeezed_sam", "--point", "3,4", "-o", str(tmp_path / "no2")]) == 2
    assert "its preprocessing must keep the photo's size: give Preprocessing(None" in capsys.readouterr().err

    folder = tmp_path / "sam-hq"
    _sam("SamHQ").save_pretrained(folder)
    out = tmp_path / "hq"
    assert main([str(CAT), "--model", str(folder), "--box", "100,50,300,250", "-o", str(out)]) == 0
    (record,) = manifest(out)
    (target,) = record["targets"]
    loaded = explain.load_model(str(folder))
    assert type(loaded.model).__name__ == "SamHQModel"
    prompted = SamPrompted(loaded.model, box=(100.0, 50.0, 300.0, 250.0))
    with torch.no_grad():
        ious = prompted(loaded.preprocess(explain.load_image(CAT))).iou_scores[0, 0]
    assert target["class_index"] == int(ious.argmax()) and target["score"] == pytest.approx(float(ious.max()), abs=1e-6)


def test_a_region_and_a_box_resume_as_given_and_a_sams_wrong_layer_is_one_line(tmp_path, capsys) -> None:
    """--resume of a finished run with --region (a depth model) or --box (SAM) redoes and rewrites nothing: the
    settings are compared as the manifest saved them. A SAM's unknown --layer is one line naming its layers."""
    from conftest import CAT
    from test_sam import _sam

    from explain.cli import main

    torch.manual_seed(0)
    depth_folder, sam_folder = tmp_path / "glpn", tmp_path / "sam"
    _glpn().save_pretrained(depth_folder)
    transformers.GLPNImageProcessor(size_divisor=32).save_pretrained(depth_folder)
    _sam().save_pretrained(sam_folder)
    for model, prompt in ((depth_folder, ["--region", "100,50,300,200"]), (sam_folder, ["--box", "10,10,200,150"])):
        out = tmp_path / f"{model.name}-out"
        assert main([str(CAT), "--model", str(model), *prompt, "-o", str(out), "--quiet"]) == 0
        written = {path: path.stat().st_mtime_ns for path in out.rglob("*") if path.is_file()}
        assert main([str(CAT), "--model", str(model), *prompt, "-o", str(out), "--resume"]) == 0
        assert "written 0, failed 0, skipped 1" in capsys.readouterr().out
        assert {path: path.stat().st_mtime_ns for path in out.rglob("*") if path.is_file()} == written
    assert main([str(CAT), "--model", str(sam_folder), "--point", "200,150", "--layer", "no.such.layer",
                 "-o", str(tmp_path / "no")]) == 2  # fmt: skip
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("explain")]
    assert line.startswith("explain: error: unknown layer 'no.such.layer'") and "model.vision_encoder" in line
    assert not (tmp_path / "no").exists()
