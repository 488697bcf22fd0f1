"""Every kind of output the command line explains (classes, segments, boxes, keypoints, oriented boxes, a depth
region, a SAM mask, signals, volumes, clips, an answer's words, prompts, query boxes), each with every export
option: the option does what it says (its file exists, its record names it) or is refused in one line with exit
status 2 and nothing written. None is silently ignored, none ends in a traceback. Small random models, one input of
each kind's, two for the resumes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CAT, COFFEE

from explain.cli import main

transformers = pytest.importorskip("transformers")


@dataclass(frozen=True)
class Kind:
    """A kind of output as the command line is given it: the arguments that name the model and what is asked, and
    the inputs."""

    args: tuple[str, ...]
    inputs: tuple[Path, ...] = (CAT, COFFEE)


MANIFEST = "manifest.jsonl"  # every kind's, a vision-language model's words too


USER_FILE = """
import numpy as np
import torch
import explain
from conftest import random_detector, random_segmenter
from test_volumes import signal_net, volume_net
from test_yolo import detecting

UNIT = explain.models.Preprocessing(None, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))


def classifier():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5),
    ).eval()
    preprocessing = explain.models.Preprocessing(64, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return explain.ModelSpec(model, "tiny", ["a", "b", "c", "d", "e"], preprocessing)


def segmenter():
    labels = ["__background__", "one", "two", "three"]
    preprocessing = explain.models.Preprocessing(96, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return explain.ModelSpec(random_segmenter(4), "lraspp", labels, preprocessing, "segmentation")


def detector():
    return random_detector((320, 400), num_classes=91)


def pose():
    model = detecting("yolo11n-pose.yaml")
    model.max_det = 2
    return explain.ModelSpec(model, "pose", model.labels, UNIT, "detection")


def oriented():
    model = detecting("yolo11n-obb.yaml")
    model.max_det = 2
    return explain.ModelSpec(model, "obb", model.labels, UNIT, "detection")


def signal():
    return explain.ModelSpec(signal_net(), "signal-net", ["a", "b", "c"], explain.models.SignalPreprocessing())


def volume():
    return explain.ModelSpec(volume_net(), "volume-net", list("abcd"), explain.models.VolumePreprocessing())


def clip():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv3d(3, 6, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv3d(6, 8, 3, stride=2, padding=1),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool3d(1), torch.nn.Flatten(), torch.nn.Linear(8, 3),
    ).eval()
    frames = explain.models.ClipPreprocessing(4, (32, 32), (32, 32), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return explain.ModelSpec(model, "clip-net", ["a", "b", "c"], frames)
"""


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, Kind]:
    """Each kind's model, written where the command line reads it: a user's file, or a save_pretrained folder."""
    from test_regions import _glpn
    from test_sam import _sam
    from test_vision_language import (
        IMAGE,
        IMAGE_TOKEN,
        PATCH,
        WORDS,
        _tokenizer,
        tiny_contrastive,
        tiny_llava,
        tiny_owl,
    )
    from test_volumes import make_video

    root = tmp_path_factory.mktemp("matrix")
    code = root / "models.py"
    code.write_text(USER_FILE)
    signals, volumes, videos = [], [], []
    generator = np.random.default_rng(0)
    for i in range(2):
        path = root / f"beat{i}.npy"
        np.save(path, np.stack([np.sin(np.arange(120) / (4 + i)), np.cos(np.arange(120) / 5)]).astype(np.float32))
        signals.append(path)
        volumes.append(root / f"scan{i}.npy")
        np.save(volumes[-1], generator.normal(size=(10, 16, 16)).astype(np.float32))
        frames = np.zeros((8, 40, 48, 3), np.uint8)
        for t in range(8):
            frames[t, 8:24, 4 * t + i : 4 * t + i + 12] = (220, 180, 40)
        videos.append(root / f"clip{i}.mkv")
        make_video(videos[-1], frames, fps=8)
    torch.manual_seed(0)
    glpn, sam, llava, clip = root / "glpn", root / "sam", root / "llava", root / "clip"
    _glpn().save_pretrained(glpn)
    transformers.GLPNImageProcessor(size_divisor=32).save_pretrained(glpn)
    _sam().save_pretrained(sam)
    images = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    words = WORDS + [f"w{i}" for i in range(len(WORDS), IMAGE_TOKEN)] + ["<image>"]
    transformers.LlavaProcessor(
        image_processor=images, tokenizer=_tokenizer(words, "<image>"), patch_size=PATCH,
        vision_feature_select_strategy="default", image_token="<image>", num_additional_image_tokens=1,
    ).save_pretrained(llava)  # fmt: skip
    tiny_llava().save_pretrained(llava)
    vocabulary = ["<unk>", "<s>", "</s>", "<pad>", "a", "cat", "remote", "dog"] + [f"w{i}" for i in range(8, 50)]
    transformers.CLIPProcessor(image_processor=images, tokenizer=_tokenizer(vocabulary)).save_pretrained(clip)
    tiny_contrastive("clip").save_pretrained(clip)
    owl = root / "owlv2"
    owl_images = transformers.Owlv2ImageProcessor(size={"height": IMAGE, "width": IMAGE})
    transformers.Owlv2Processor(image_processor=owl_images, tokenizer=_tokenizer(vocabulary)).save_pretrained(owl)
    tiny_owl("owlv2").save_pretrained(owl)
    user = str(code)
    return {
        "class": Kind(("--model", f"{user}:classifier")),
        "segment": Kind(("--model", f"{user}:segmenter")),
        "box": Kind(("--model", f"{user}:detector")),
        "keypoint": Kind(("--model", f"{user}:pose", "--keypoint", "0", "--score-threshold", "0.3")),
        "oriented box": Kind(("--model", f"{user}:oriented", "--score-threshold", "0.3")),
        "depth region": Kind(("--model", str(glpn), "--region", "100,50,300,200")),
        "SAM mask": Kind(("--model", str(sam), "--point", "200,150")),
        "signal": Kind(("--model", f"{user}:signal"), tuple(signals)),
        "volume": Kind(("--model", f"{user}:volume"), tuple(volumes)),
        "clip": Kind(("--model", f"{user}:clip"), tuple(videos)),
        "query boxes": Kind(("--model", str(owl), "--text", "a cat, a dog", "--score-threshold", "0.4")),
        "answer words": Kind(("--model", str(llava), "--prompt", "what is on the table?", "--max-new-tokens", "2")),
        "prompts": Kind(("--model", str(clip), "--text", "a cat, a remote")),
    }


def records(out: Path) -> list[dict]:
    """The records of a finished run, its first line (the run's settings) left out."""
    lines = [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]
    assert "header" in lines[0]
    return lines[1:]


def named_files(record: dict) -> list[str]:
    """Every file a record names."""
    files = [part[key] for part in record["targets"] or () for key in ("output", "figure", "picture") if part.get(key)]
    return files + ([record["raw"]] if record["raw"] else [])


def run(kind: Kind, out: Path, *extra: str, inputs: tuple[Path, ...] | None = None) -> int:
    return main([*map(str, inputs or kind.inputs[:1]), *kind.args, *extra, "-o", str(out), "--quiet"])


def snapshot(out: Path) -> dict[Path, int]:
    return {path: path.stat().st_mtime_ns for path in out.rglob("*") if path.is_file()}


# What a kind refuses, and the line that says why; every other option is honoured.
REFUSED = {
    **{(kind, "--topk"): "--topk explains a classifier's top classes" for kind in (
        "segment", "box", "oriented box", "depth region", "SAM mask", "answer words", "prompts", "query boxes")},
    **{(kind, "--metrics"): "--metrics explains a classifier's class" for kind in (
        "segment", "box", "oriented box", "depth region", "SAM mask", "answer words", "prompts", "query boxes")},
    **{(kind, "--format"): "--format sets the format of an image's overlays" for kind in ("signal", "volume", "clip")},
    **{(kind, "--score-threshold"): "--score-threshold sets a detector's least explained score" for kind in (
        "class", "segment", "depth region", "SAM mask", "signal", "volume", "clip", "answer words", "prompts")},
    ("volume", "--figure"): "--figure",
    ("clip", "--figure"): "--figure",
    ("keypoint", "--topk"): "--keypoint explains a pose model's keypoints; drop --topk and --metrics",
    ("keypoint", "--metrics"): "--keypoint explains a pose model's keypoints; drop --topk and --metrics",
    ("signal", "--figure"): "--figure",
}  # fmt: skip
OPTIONS = {
    "--save-raw": ["--save-raw"],
    "--figure": ["--figure"],
    "--gallery": ["--gallery"],
    "--method": ["--method", "layercam"],
    "--method attnlrp": ["--method", "attnlrp"],
    "--topk": ["--topk", "2"],
    "--metrics": ["--metrics", "deletion"],
    "--device": ["--device", "cpu"],
    "--format": ["--format", "png"],
    "--score-threshold": ["--score-threshold", "0.3"],
    "--workers": ["--workers", "1"],
}
# Besides the option: the random detector's few most confident boxes alone, each a backward through the whole network.
EXTRA = {("box", "--method attnlrp"): ["--score-threshold", "0.995"]}
KINDS = ("class", "segment", "box", "keypoint", "oriented box", "depth region", "SAM mask", "signal", "volume", "clip",
         "answer words", "prompts", "query boxes")  # fmt: skip


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("name", KINDS)
def test_each_option_is_honoured_or_refused_in_one_line(kinds, name, option, tmp_path, capsys, monkeypatch) -> None:
    from explain.export import run as export_run

    kind, out = kinds[name], tmp_path / "out"
    workers: list[int] = []  # what the export's loader was asked to start
    load = export_run.load_batches
    monkeypatch.setattr(export_run, "load_batches", lambda *a: workers.append(a[3]) or load(*a))
    code = run(kind, out, *OPTIONS[option], *EXTRA.get((name, option), []))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("explain", "Traceback"))]
    if (name, option) in REFUSED:
        assert code == 2 and len(errors) == 1, errors
        assert errors[0].startswith("explain: error: ") and REFUSED[name, option] in errors[0], errors
        assert not out.exists()
        return
    assert code == 0 and not errors, errors
    (record,) = records(out)
    assert record["error"] is None and all((out / name).is_file() for name in named_files(record))
    parts = record["targets"]
    assert parts, record
    if option == "--save-raw":
        assert (out / record["raw"]).is_file() and np.load(out / record["raw"]).size > 0
    if option == "--figure":
        figures = [part["figure"] for part in parts]
        assert figures and all((out / figure).is_file() for figure in figures)
    if option == "--gallery":  # a card per target (a word, a prompt), its overlay's thumbnail beside it
        page = (out / "index.html").read_text()
        assert all(json.dumps(part["class_name"]) in page for part in parts)
        assert len(list((out / "thumbs").rglob("*.jpg"))) == len(parts)
    if option == "--format":
        assert all(name.endswith(".png") for name in named_files(record) if not name.endswith(".npy"))
    if option == "--score-threshold":
        assert all(part["score"] >= 0.3 for part in parts)
    if option == "--method":
        assert record["method"] == "layercam"
    if option == "--workers":  # the loader was asked for one worker process, not the default threads
        assert workers == [1]
    if option == "--topk":
        assert len(parts) == 2
    if option == "--metrics":
        assert all(set(part["metrics"]) == {"deletion"} for part in parts)


@pytest.mark.parametrize("name", KINDS)
def test_the_layer_given_is_the_layer_used_and_a_wrong_one_is_one_line(kinds, name, tmp_path, capsys) -> None:
    kind = kinds[name]
    assert run(kind, tmp_path / "auto") == 0
    (record,) = records(tmp_path / "auto")
    layer = record["layer"].split("+")[0].split(",")[0]
    assert run(kind, tmp_path / "given", "--layer", layer) == 0
    (given,) = records(tmp_path / "given")
    assert given["layer"] == layer
    capsys.readouterr()
    assert run(kind, tmp_path / "wrong", "--layer", "no.such.layer") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("explain", "Traceback"))]
    assert len(errors) == 1 and "no.such.layer" in errors[0] and errors[0].startswith("explain: error: "), errors
    assert not (tmp_path / "wrong").exists()


@pytest.mark.parametrize("name", KINDS)
def test_resume_redoes_nothing_after_a_finished_run_and_the_rest_after_a_killed_one(kinds, name, tmp_path) -> None:
    kind, out = kinds[name], tmp_path / "out"
    assert run(kind, out, inputs=kind.inputs) == 0
    finished = records(out)
    assert len({r["input"] for r in finished}) == 2
    before = snapshot(out)
    assert run(kind, out, "--resume", inputs=kind.inputs) == 0
    assert snapshot(out) == before  # nothing redone, nothing rewritten

    lines = (out / MANIFEST).read_text().splitlines(keepends=True)
    second = [r for r in finished if r["input"] == finished[-1]["input"]]
    (out / MANIFEST).write_text("".join(lines[: len(lines) - len(second)]))  # killed before its record
    for record in second:
        for name in named_files(record):
            (out / name).unlink()
    assert run(kind, out, "--resume", inputs=kind.inputs) == 0
    again = records(out)
    assert [r["input"] for r in again] == [r["input"] for r in finished]
    assert all(r["error"] is None and all((out / f).is_file() for f in named_files(r)) for r in again)
