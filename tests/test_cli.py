"""The command line end to end, on the bundled real-weights model."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from conftest import ASSETS, CAT, COFFEE, manifest
from PIL import Image

import explain
from explain.cli import main
from explain.export.run import _Explainer
from explain.models import load_model

ROOT = ASSETS.parent
LITE0 = ["--model", "efficientnet_lite0"]


def top(record: dict) -> dict:
    """A record's first explained target."""
    return record["targets"][0]


@pytest.fixture
def photos(tmp_path) -> Path:
    """photos/cats/chelsea.png, photos/coffee.png and photos/more/chelsea.png (a same-named copy)."""
    root = tmp_path / "photos"
    (root / "cats").mkdir(parents=True)
    (root / "more").mkdir()
    shutil.copy(CAT, root / "cats" / "chelsea.png")
    shutil.copy(CAT, root / "more" / "chelsea.png")
    shutil.copy(COFFEE, root / "coffee.png")
    return root


def test_folder_and_glob_export(photos, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code = main([str(photos / "cats"), str(photos / "c*.png"), str(photos / "more"), "-o", str(out), *LITE0])
    assert code == 0
    records = manifest(out)
    assert [Path(r["input"]).relative_to(photos).as_posix() for r in records] == [
        "cats/chelsea.png",
        "coffee.png",
        "more/chelsea.png",
    ]
    assert all(r["schema"] == 6 and len(r["targets"]) == 1 for r in records)
    assert [top(r)["class_name"] for r in records] == ["Egyptian cat", "espresso", "Egyptian cat"]
    assert [top(r)["class_index"] for r in records] == [285, 967, 285]
    assert 0.6 < top(records[0])["score"] < 0.9 and top(records[1])["score"] > 0.8
    assert all(r["raw"] is None and top(r)["figure"] is None for r in records)  # the same fields without the flags
    assert all(r["layer"] == "bn2" and r["method"] == "gradcam" and r["model"] == "efficientnet_lite0" for r in records)
    assert all(r["error"] is None for r in records)
    outputs = [out / top(r)["output"] for r in records]  # paths below the output folder
    assert len(set(outputs)) == 3, "same-named inputs in different folders must not share an output"
    for record, output in zip(records, outputs):
        assert Image.open(output).size == Image.open(record["input"]).size
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith(records[0]["input"]) and "Egyptian cat" in lines[0] and str(outputs[0]) in lines[0]
    assert lines[3].startswith("written 3, failed 0, skipped 0 in ")


def test_overlay_is_a_blend_of_the_photo(tmp_path) -> None:
    out = tmp_path / "out"
    assert main([str(CAT), "-o", str(out), "--alpha", "0.3", "--format", "png", "--quiet", *LITE0]) == 0
    written = np.asarray(Image.open(out / top(manifest(out)[0])["output"])).astype(float)
    photo = np.asarray(Image.open(CAT).convert("RGB")).astype(float)
    residual = (written - 0.7 * photo) / 0.3  # what was blended in: colormap colours, within [0, 255]
    assert residual.min() > -3 and residual.max() < 258
    assert np.abs(written - photo).mean() > 5


def test_bad_files_fail_alone(photos, tmp_path, capsys) -> None:
    (photos / "empty.png").write_bytes(b"")
    (photos / "notes.jpg").write_text("no pixels here")
    (photos / "cut.png").write_bytes(CAT.read_bytes()[:5000])
    out = tmp_path / "out"
    code = main(
        [str(photos), str(tmp_path / "missing.png"), str(tmp_path / "nothing*.png"), "-o", str(out), "--quiet", *LITE0]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 5 and all(line.startswith("explain: error: ") for line in lines)
    for name in ("empty.png", "notes.jpg", "cut.png", "missing.png", "nothing*.png"):
        assert sum(name in line for line in lines) == 1
    records = manifest(out)
    assert len(records) == 8
    empty = next(r for r in records if r["input"].endswith("empty.png"))
    assert empty["error"] and empty["targets"] is None and empty["layer"] is None and empty["schema"] == 6
    good = [r for r in records if r["error"] is None]
    assert len(good) == 3 and all((out / top(r)["output"]).is_file() for r in good)


def test_batch_failure_costs_only_the_failing_image(photos, tmp_path, monkeypatch, capsys) -> None:
    explain_group = _Explainer.explain
    coffee = Image.open(COFFEE).size  # the only image of its size

    def fragile(self, x, sizes):
        if coffee in sizes:
            raise RuntimeError("device fell over\nsecond line")
        return explain_group(self, x, sizes)

    monkeypatch.setattr(_Explainer, "explain", fragile)
    out = tmp_path / "out"
    assert main([str(photos), "-o", str(out), "--quiet", *LITE0]) == 1
    records = manifest(out)
    assert [r["error"] is None for r in records] == [True, False, True]
    assert capsys.readouterr().err.strip().endswith("coffee.png: device fell over")


def test_unwritable_output_fails_alone(photos, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "cats").write_text("a file where the cats/ output folder would go")
    assert main([str(photos), "-o", str(out), "--quiet", *LITE0]) == 1
    records = manifest(out)
    assert [r["error"] is None for r in records] == [False, True, True]
    assert "cats/chelsea.png: cannot write outputs" in records[0]["error"]
    assert capsys.readouterr().err.count("explain: error:") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "resnet05"], "did you mean: resnet50"),
        ([*LITE0, "--layer", "blocks.9"], "unknown layer 'blocks.9'"),
        ([*LITE0, "--layer", "classifier"], "layer 'classifier' outputs (1000,), not a map of the image (N, C, h, w)"),
        ([*LITE0, "--target", "Egyptain cat"], "did you mean: Egyptian cat"),
        ([*LITE0, "--target", "1000"], "out of range"),
        ([*LITE0, "--topk", "2", "--target", "3"], "exclude each other"),
        ([*LITE0, "--alpha", "3"], "--alpha"),
        ([*LITE0, "--colormap", "nope"], "unknown colormap"),
        ([*LITE0, "--format", "gif"], "invalid choice"),
        ([*LITE0, "--frobnicate"], "unrecognized arguments"),
        ([*LITE0, "--method", "gradcamm"], "unknown method 'gradcamm'"),
        ([*LITE0, "--method", "all", "--topk", "2"], "drop --topk"),
        ([*LITE0, "--method", "guided_backprop", "--aug-smooth"], "aug_smooth do not apply"),
        ([*LITE0, "--layer", "blocks.5,blocks.9"], "unknown layer 'blocks.9'"),
        ([*LITE0, "--method", "cam", "--layer", "blocks.6"], "reads 1280"),
    ],
)
def test_usage_errors_exit_2_without_traceback(args, message, tmp_path, capsys) -> None:
    try:
        code = main([str(CAT), "-o", str(tmp_path / "out"), *args])
    except SystemExit as stop:  # argparse's own errors
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_outputs_never_overwrite_inputs(tmp_path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(CAT, folder / "a.png")
    shutil.copy(COFFEE, folder / "a.gradcam.png")  # an input named like a.png's output
    shutil.copy(COFFEE, folder / "a.jpg")  # same stem as a.png
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert main([str(folder), "-o", str(folder), "--quiet", *LITE0]) == 0
    assert all((folder / name).read_bytes() == data for name, data in before.items())
    outputs = [Path(top(r)["output"]).name for r in manifest(folder)]
    assert len(set(outputs)) == 3 and not set(outputs) & set(before)


def test_output_folders_are_not_read_again(photos, tmp_path) -> None:
    """The issue's sequence: outputs inside the input folder, then a deeper output folder, then the same one."""
    originals = ["cats/chelsea.png", "coffee.png", "more/chelsea.png"]

    def explained(out: Path) -> list[str]:
        return [Path(r["input"]).relative_to(photos).as_posix() for r in manifest(out)]

    for out in (photos / "out2", photos / "out" / "deeper", photos / "out2", photos, photos):
        assert main([str(photos), "-o", str(out), "--quiet", "--overwrite", *LITE0]) == 0
        assert explained(out) == originals
    assert not list(photos.rglob("*.gradcam.gradcam*"))
    # A glob that names earlier outputs explicitly is the user's choice.
    assert main([str(photos / "out2" / "*.jpg"), "-o", str(tmp_path / "again"), "--quiet", *LITE0]) == 0
    assert [Path(r["input"]).name for r in manifest(tmp_path / "again")] == ["coffee.gradcam.jpg"]


def test_glob_inputs_keep_their_folders(photos, tmp_path) -> None:
    out = tmp_path / "out"
    assert main([str(photos / "**" / "*.png"), "-o", str(out), "--quiet", *LITE0]) == 0
    outputs = [top(r)["output"] for r in manifest(out)]
    assert outputs == ["cats/chelsea.gradcam.jpg", "coffee.gradcam.jpg", "more/chelsea.gradcam.jpg"]


def test_own_checkpoint_and_labels(tmp_path) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).eval()
    weights, labels = tmp_path / "mine.pth", tmp_path / "labels.txt"
    torch.save(model.state_dict(), weights)
    labels.write_text("ant\nbee\ncat\n")
    out = tmp_path / "out"
    args = [str(CAT), "-o", str(out), "--model", "resnet18", "--weights", str(weights), "--labels", str(labels)]
    assert main([*args, "--target", "bee", "--quiet"]) == 0
    (record,) = manifest(out)
    assert (top(record)["class_index"], top(record)["class_name"], record["model"]) == (1, "bee", "resnet18")
    assert record["layer"] == "layer4"


def test_topk_raw_figure_jpg_and_keep_aspect(tmp_path) -> None:
    out = tmp_path / "out"
    args = [str(CAT), "-o", str(out), "--topk", "3", "--save-raw", "--figure", "--format", "jpg", "--keep-aspect"]
    assert main([*args, "--quiet", *LITE0]) == 0
    (record,) = manifest(out)
    names, scores = [t["class_name"] for t in record["targets"]], [t["score"] for t in record["targets"]]
    assert names[0] == "Egyptian cat" and set(names[1:]) == {"tiger cat", "tabby"}
    assert scores == sorted(scores, reverse=True)
    outputs, figures = [t["output"] for t in record["targets"]], [t["figure"] for t in record["targets"]]
    assert [Path(p).suffix for p in outputs] == [".jpg"] * 3
    assert all(Image.open(out / p).size == (451, 300) for p in outputs)
    raw = np.load(out / record["raw"])
    assert raw.shape == (3, 7, 11)  # short side 224 keeps the 451x300 aspect: 224x337 -> 7x11 features
    assert [Path(p).suffix for p in figures] == [".jpg"] * 3  # --figure honours --format
    assert all(Image.open(out / p).format == "JPEG" for p in figures)


def one_error_line(capsys) -> str:
    """The only line on stderr, checked to be an explain error without a traceback or terminal colour codes."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and "\x1b" not in err
    (line,) = err.splitlines()
    assert line.startswith("explain: error: ")
    return line


@pytest.mark.parametrize("device", ["mps", "xpu", "cuda:7", "tpu", "cuda"])
def test_unavailable_devices_are_usage_errors(device, tmp_path, capsys, monkeypatch) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")  # the other cases run everywhere
    monkeypatch.setattr("explain.models.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main([str(CAT), "-o", str(tmp_path / "out"), "--device", device, *LITE0]) == 2
    line = one_error_line(capsys)
    assert f"--device {device}:" in line and "cpu" in line.rsplit("available: ", 1)[1]
    assert not (tmp_path / "out").exists()


def test_a_pickled_whole_model_is_named_as_such(tmp_path, capsys) -> None:
    whole = tmp_path / "whole.pt"
    torch.save(torchvision.models.resnet18(num_classes=3), whole)
    assert main([str(CAT), "-o", str(tmp_path / "out"), "--model", "resnet18", "--weights", str(whole)]) == 2
    line = one_error_line(capsys)
    assert f"{whole}: holds a pickled torchvision.models.resnet.ResNet object" in line
    assert "state_dict" in line and "weights_only" not in line and "add_safe_globals" not in line


def test_unknown_layer_hint_names_spatial_layers(tmp_path, capsys, lite0) -> None:
    assert main([str(CAT), "-o", str(tmp_path / "out"), "--layer", "layer4", *LITE0]) == 2
    line = one_error_line(capsys)
    hinted = line.split("the last are ")[1].split(" (")[0].split(", ")
    spatial = {info.name for info in explain.candidate_layers(lite0.model, torch.zeros(1, 3, 224, 224))}
    assert hinted[-1] == "bn2" and set(hinted) <= spatial and "classifier" not in line


def test_layers_lists_candidates_with_shapes(capsys) -> None:
    assert main(["--layers", *LITE0]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("efficientnet_lite0 at 224x224")
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows["bn2"] == ["BatchNormAct2d", "1280x7x7", "<-", "automatic", "choice"]
    assert rows["conv_stem"] == ["SameConv2d", "32x112x112"]
    assert "classifier" not in rows and "global_pool" not in rows  # no vector or 1x1 outputs
    assert sum("automatic" in line for line in lines) == 1
    assert main(["--layers", "320x480", *LITE0]) == 0
    assert "1280x10x15  <- automatic choice" in capsys.readouterr().out
    assert main(["--layers", "wide", *LITE0]) == 2
    assert "must be H or HxW" in one_error_line(capsys)


def test_no_existing_input_is_a_usage_error_before_the_model(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("explain.models.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    args = [str(tmp_path / "missing.png"), str(tmp_path / "nothing*.png"), "-o", str(tmp_path / "out")]
    assert main(args) == 2
    line = one_error_line(capsys)
    assert "missing.png: no such file" in line and "nothing*.png: no files match" in line
    assert not (tmp_path / "out").exists()


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("explain")
    run = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--keep-aspect" in run.stdout


# Runs the command with the heavy modules made unimportable: any import of them fails.
WITHOUT_HEAVY_MODULES = (
    "import sys\n"
    "for name in ('torch', 'torchvision', 'timm', 'matplotlib', 'numpy', 'PIL'):\n"
    "    sys.modules[name] = None\n"
    "from explain.cli import main\n"
    "raise SystemExit(main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["--method", "list"], ["missing.png"]])
def test_fast_paths_never_import_torch(args, tmp_path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_HEAVY_MODULES, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert "ImportError" not in run.stderr and "Traceback" not in run.stderr
    if args == ["missing.png"]:  # inputs are checked before anything heavy is imported
        assert (
            run.returncode == 2
            and run.stderr == "explain: error: no input image found: missing.png: no such file or directory\n"
        )
    else:
        assert run.returncode == 0 and run.stdout
    if args == ["--version"]:
        assert run.stdout == f"explain {explain.__version__}\n"


def test_version_has_one_source() -> None:
    from importlib.metadata import version

    assert explain.__version__ == version("explain")  # the installed metadata reads explain.__version__


def test_python_m_explain_is_the_command(tmp_path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "explain", str(COFFEE), "-o", str(tmp_path / "out"), *LITE0],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"{COFFEE}: espresso (") and (tmp_path / "out" / "coffee.gradcam.jpg").is_file()


def test_script_runs_as_a_program(tmp_path) -> None:
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    run = subprocess.run(
        [sys.executable, "cli.py", str(COFFEE), str(empty), "-o", str(tmp_path / "out"), *LITE0],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1
    assert "espresso" in run.stdout and str(tmp_path / "out" / "coffee.gradcam.jpg") in run.stdout
    assert run.stderr.splitlines() == [f"explain: error: {empty}: empty file"]  # no progress bar off a terminal


def test_method_list_needs_no_input(capsys) -> None:
    assert main(["--method", "list"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == list(explain.METHODS)


def test_method_all_writes_one_comparison_grid_per_image(tmp_path) -> None:
    out = tmp_path / "out"
    assert main([str(CAT), str(COFFEE), "-o", str(out), "--method", "all", "--quiet", *LITE0]) == 0
    records = manifest(out)
    assert [Path(top(r)["output"]).name for r in records] == ["chelsea.all.jpg", "coffee.all.jpg"]
    assert [top(r)["class_name"] for r in records] == ["Egyptian cat", "espresso"] and records[0]["method"] == "all"
    grid = np.asarray(Image.open(out / top(records[0])["output"]).convert("RGB")).astype(int)
    rows = math.ceil((1 + len(explain.FAST_METHODS)) / 4)  # panels of the 451 x 300 photo: it and every fast method
    assert grid.shape[1] == 1600 and grid.shape[0] > rows * 4 * 100 * 300 / 451  # 4 columns of 4 inches at 100 dpi
    assert grid.std() > 30  # photos and heatmaps, not a blank canvas


def test_score_cam_forwards_respect_the_batch_size(tmp_path, monkeypatch) -> None:
    batches = []

    def counting(*args, **kwargs):
        spec = load_model(*args, **kwargs)
        spec.model.register_forward_pre_hook(lambda m, inputs: batches.append(inputs[0].shape[0]))
        return spec

    monkeypatch.setattr("explain.models.load_model", counting)
    out = tmp_path / "out"
    args = [str(COFFEE), "-o", str(out), "--method", "scorecam", "--layer", "blocks.3", "--batch-size", "24"]
    assert main([*args, "--quiet", *LITE0]) == 0
    (record,) = manifest(out)
    assert top(record)["class_name"] == "espresso" and record["method"] == "scorecam"
    assert Path(top(record)["output"]).name == "coffee.scorecam.jpg"
    assert max(batches) == 24 and sum(batches) > 80  # 80 channels scored in chunks of at most 24


def test_guided_and_fused_smoothed_maps_from_the_command_line(tmp_path) -> None:
    out = tmp_path / "out"
    assert main([str(CAT), "-o", str(out), "--method", "guided_backprop", "--figure", "--quiet", *LITE0]) == 0
    (record,) = manifest(out)
    guided = np.asarray(Image.open(out / top(record)["output"]).convert("RGB")).astype(int)
    assert guided.shape == (300, 451, 3) and abs(np.median(guided) - 128) <= 3  # grey where the gradient is 0
    assert (out / top(record)["figure"]).is_file()

    args = ["--method", "layercam", "--layer", "blocks.5,blocks.6", "--fuse", "max", "--aug-smooth", "--quiet"]
    assert main([str(CAT), "-o", str(tmp_path / "fused"), *args, *LITE0]) == 0
    (record,) = manifest(tmp_path / "fused")
    assert record["layer"] == "blocks.5+blocks.6" and Path(top(record)["output"]).name == "chelsea.layercam.jpg"


def test_a_run_resolves_its_layer_once_in_its_call(tmp_path, monkeypatch) -> None:
    """One preflight: the layer given is resolved by the run's own call, once, without a probe's trace before."""
    from explain.core import layers, recording

    calls: list[str] = []
    for module, name in ((recording, "resolve_layer"), (layers, "resolve_layer"), (layers, "trace_layers")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    assert main([str(CAT), str(COFFEE), "-o", str(tmp_path / "out"), "--layer", "blocks.5", "--quiet", *LITE0]) == 0
    assert calls == ["resolve_layer"]
    assert {top(r)["class_name"] for r in manifest(tmp_path / "out")} and all(
        r["layer"] == "blocks.5" for r in manifest(tmp_path / "out")
    )
