"""``explain concepts`` and ``explain tcav`` end to end on the bundled model and photos: the atlas's files, a run
killed midway and resumed, and bad inputs each refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import ASSETS
from PIL import Image

from explain.atlas.page import BEST, THUMB
from explain.cli import main
from explain.concepts.craft import Craft

EXIT_OK, EXIT_USAGE, EXIT_INTERRUPTED = 0, 2, 130
PHOTOS = ["chelsea.png", "coffee.png", "astronaut.png"]
FAST = ["--concepts", "3", "--crop", "112", "--designs", "8", "--quiet"]


@pytest.fixture
def photos(tmp_path: Path) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    for name in PHOTOS:
        shutil.copy(ASSETS / name, folder / name)
    return folder


def test_the_atlas_is_written_whole_and_says_what_it_found(photos: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "atlas"
    assert main(["concepts", str(photos), "--target", "Egyptian cat", "-o", str(out), *FAST]) == EXIT_OK
    said = capsys.readouterr().out
    found = json.loads((out / "manifest.json").read_text())
    assert found["class_name"] == "Egyptian cat" and found["class"] == 285 and found["layer"] == "bn2"
    assert found["images"] == 3 and found["crops"] == 3 * 4  # 112-pixel crops of 224 at a stride of 89: 2 x 2
    concepts = found["concepts"]
    assert len(concepts) == 3 and sorted(c["concept"] for c in concepts) == [0, 1, 2]
    assert [c["importance"] for c in concepts] == sorted((c["importance"] for c in concepts), reverse=True)
    assert all(c["low"] <= c["importance"] <= c["high"] and np.isfinite(c["importance"]) for c in concepts)
    assert all(b["image"] in PHOTOS and b["top"] + b["side"] <= 224 for c in concepts for b in c["best_crops"])
    assert f"concept {concepts[0]['concept']}" in said and "Egyptian cat at bn2" in said
    page = (out / "atlas.html").read_text()
    assert page.count('<section class="concept">') == 3 and page.count("data:image/png;base64,") == 3 * BEST + 3
    sheet = Image.open(out / "atlas.png")
    assert sheet.size == (THUMB * BEST, (THUMB + 18) * 3 + 18)
    strip = np.asarray(Image.open(out / "maps" / "chelsea.png"))
    photo = np.asarray(Image.open(ASSETS / "chelsea.png").convert("RGB").resize((THUMB, THUMB)))
    assert strip.shape == (THUMB, THUMB * 3, 3) and np.abs(strip[:, :THUMB].astype(int) - photo).mean() > 5


def test_a_run_killed_midway_resumes_from_its_shards(photos: Path, tmp_path: Path, monkeypatch) -> None:
    """The crops' activations and each image's scores are kept as they are computed: a run interrupted while
    scoring the second image resumes with --resume without reading a crop again, scoring only what was left; without
    --resume the folder is refused."""
    out = tmp_path / "atlas"
    scored: list[int] = []
    original = Craft._terms

    def interrupted(self, *args):
        if len(scored) == 1:
            raise KeyboardInterrupt
        scored.append(1)
        return original(self, *args)

    monkeypatch.setattr(Craft, "_terms", interrupted)
    assert main(["concepts", str(photos), "-o", str(out), *FAST]) == EXIT_INTERRUPTED
    assert not (out / "manifest.json").exists() and len(list((out / "cache" / "importance").glob("*.pt"))) == 1
    assert main(["concepts", str(photos), "-o", str(out), *FAST]) == EXIT_USAGE  # an earlier atlas, no --resume

    def never(self, crops):
        raise AssertionError("a crop read again")

    counted: list[int] = []
    monkeypatch.setattr(Craft, "_pooled", never)
    monkeypatch.setattr(Craft, "_terms", lambda *args: counted.append(1) or original(*args))
    assert main(["concepts", str(photos), "-o", str(out), "--resume", *FAST]) == EXIT_OK
    assert len(counted) == 2 and len(json.loads((out / "manifest.json").read_text())["concepts"]) == 3


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--concepts", "40", "--crop", "0"], "3 crops for 40 concepts"),
        (["--layer", "classifier"], "classifier"),
        (["--target", "unicorn"], "not a class of efficientnet_lite0"),
        (["--crop", "400"], "does not fit images of 224x224"),
    ],
)
def test_bad_requests_are_refused_in_one_line(photos, tmp_path, capsys, options, said) -> None:
    code = main(["concepts", str(photos), "-o", str(tmp_path / "atlas"), *FAST, *options])
    error = capsys.readouterr().err.strip()
    assert code == EXIT_USAGE and said in error and "\n" not in error and "Traceback" not in error


def test_an_empty_folder_is_refused_in_one_line(tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["concepts", str(tmp_path / "empty"), "-o", str(tmp_path / "atlas")]) == EXIT_USAGE
    error = capsys.readouterr().err.strip()
    assert "empty: no image files in this folder" in error and "\n" not in error
    assert not (tmp_path / "atlas").exists()


def test_tcav_prints_and_writes_the_score(tmp_path, capsys) -> None:
    images, concept, random = (tmp_path / name for name in ("images", "concept", "random"))
    for folder, names in [
        (images, ["chelsea.png", "coffee.png", "astronaut.png"]),
        (concept, ["chelsea.png", "camera.png"]),
        (random, ["coffee.png", "astronaut.png", "rocket.jpg", "grace_hopper.jpg"]),
    ]:
        folder.mkdir()
        for name in names:
            shutil.copy(ASSETS / name, folder / name)
    out = tmp_path / "tcav.json"
    code = main(
        ["tcav", str(images), "--target", "Egyptian cat", "--concept", str(concept), "--random", str(random),
         "--runs", "4", "-o", str(out), "--quiet"]
    )  # fmt: skip
    assert code == EXIT_OK
    said = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["class_name"] == "Egyptian cat" and record["layer"] == "bn2" and len(record["scores"]) == 4
    assert 0.0 <= record["score"] <= 1.0 and 0.0 <= record["p_value"] <= 1.0
    assert f"TCAV {record['score']:.3f} for Egyptian cat" in said
    assert main(["tcav", str(images), "--concept", str(concept), "--random", str(concept), "-o", str(out)]) == 2
    assert "4 random ones" in capsys.readouterr().err


def test_torchrun_ranks_split_the_crops_and_images_and_write_what_one_process_does(photos: Path, tmp_path) -> None:
    """Two processes (gloo) each read half the crops and score half the images (2 and 1: uneven), add up the
    factorization's statistics, and the first writes the atlas one process writes."""
    import os
    import subprocess
    import sys

    cli = Path(__file__).resolve().parents[1] / "cli.py"
    common = ["concepts", str(photos), *FAST, "--batch-size", "4"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(cli)]
    alone = subprocess.run([sys.executable, str(cli), *common, "-o", str(tmp_path / "alone")], env=environment,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    two = subprocess.run([*launch, *common, "-o", str(tmp_path / "two")], env=environment, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert alone.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("3 concepts of") == 1  # the first rank says what was found
    one, both = (json.loads((tmp_path / name / "manifest.json").read_text()) for name in ("alone", "two"))
    ours, theirs = ({c["concept"]: c for c in found["concepts"]} for found in (both, one))  # order: by importance
    assert sorted(ours) == sorted(theirs)
    for k, mine in ours.items():  # the sums' order differs between the ranks: equal within rounding
        values = ("importance", "low", "high")
        assert np.allclose([mine[v] for v in values], [theirs[k][v] for v in values], rtol=1e-5, atol=1e-7)
        assert mine["best_crops"][0] == theirs[k]["best_crops"][0]  # its best crop; the tail may tie
        shared = [crop for crop in mine["best_crops"] if crop in theirs[k]["best_crops"]]
        assert len(shared) >= len(mine["best_crops"]) - 1
    shards = sorted(path.name for path in (tmp_path / "two" / "cache" / "crops").iterdir())
    assert any(name.startswith("crops-0-of-2-") for name in shards) and any("crops-1-of-2-" in n for n in shards)
