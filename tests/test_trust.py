"""Trust under concurrency and hostile inputs: threads on one model, NaN and empty batches, extreme aspect ratios."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import manifest, seeded
from PIL import Image

import explain
from explain.io import render


def test_threads_on_one_model_give_the_sequential_maps_and_leave_it_as_it_was() -> None:
    model = seeded("resnet18", num_classes=6)
    model.fc.weight.requires_grad_(False)  # a mix of flags, each to be kept
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    torch.manual_seed(1)
    inputs = [torch.randn(2, 3, 48, 48) for _ in range(6)]
    expected = [explain.gradcam(model, x, "layer4") for x in inputs]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = explain.gradcam(model, inputs[i], "layer4")
        except BaseException as err:  # reported below, with the thread's own error
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert all(torch.allclose(results[i], expected[i], atol=1e-6) for i in range(len(inputs)))
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert not model.training and not any(m._forward_hooks or m._backward_hooks for m in model.modules())


def test_threads_mixing_methods_metrics_and_layer_search() -> None:
    model = seeded("resnet18", num_classes=6)
    torch.manual_seed(2)
    x = torch.randn(2, 3, 48, 48)
    maps = explain.gradcam(model, x, "layer4")
    jobs = {
        "auto": lambda: explain.gradcam(model, x),
        "layercam": lambda: explain.cam(model, x, "layercam", "layer3"),
        "deletion": lambda: explain.metrics.deletion(model, x, maps, steps=4).auc,
        "layers": lambda: [info.name for info in explain.candidate_layers(model, x)],
    }
    expected = {name: job() for name, job in jobs.items()}
    found: dict[str, object] = {}
    threads = [threading.Thread(target=lambda n=name, j=job: found.__setitem__(n, j())) for name, job in jobs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert found["layers"] == expected["layers"]
    for name in ("auto", "layercam", "deletion"):
        assert torch.allclose(found[name], expected[name], atol=1e-6), name
    assert all(p.requires_grad for p in model.parameters()) and not model.training


def test_non_finite_and_empty_batches_are_refused() -> None:
    model = seeded("resnet18", num_classes=6)
    x = torch.randn(3, 3, 32, 32)
    x[1, 0, 4, 4] = float("nan")
    x[2, 2, 0, 0] = float("inf")
    with pytest.raises(explain.ExplainError, match=r"NaN or infinite values in image\(s\) 1, 2"):
        explain.gradcam(model, x)
    with pytest.raises(explain.ExplainError, match="empty batch"):
        explain.gradcam(model, x[:0])
    with pytest.raises(explain.ExplainError, match="NaN or infinite"):
        explain.metrics.average_drop(model, x, torch.rand(3, 4, 4))


@pytest.mark.parametrize("shape", [(4000, 1), (1, 4000), (3000, 2)])
def test_a_figure_of_a_strip_has_a_bounded_canvas(shape) -> None:
    image = np.random.default_rng(0).integers(0, 255, (*shape, 3), dtype=np.uint8)
    panels = {"image": Image.fromarray(image), "heatmap": np.random.default_rng(1).random(shape)}
    width, height = render.panel_figure(panels, "a strip", columns=2).get_size_inches()
    assert width <= 8 and height <= 4 * render.MAX_ASPECT + 1
    drawn = render.figure(image, torch.rand(7, 1) if shape[0] > shape[1] else torch.rand(1, 7), "a strip")
    assert max(drawn.size) <= 100 * (4 * render.MAX_ASPECT + 12)


def test_a_call_from_inside_a_pass_on_the_same_model_is_refused() -> None:
    """A target or a hook that calls explain on the model whose pass is running gets a clear error; the model is
    left as it was, and a nested call that is no pass's (Guided Grad-CAM's Grad-CAM) still goes through."""
    model = seeded("resnet18", num_classes=6)
    x = torch.randn(1, 3, 32, 32)

    def nested_target(output: torch.Tensor) -> torch.Tensor:
        explain.gradcam(model, x, "layer4")
        return output[:, 0]

    with pytest.raises(explain.ExplainError, match="from inside a pass of another explain call"):
        explain.gradcam(model, x, "layer4", nested_target)
    handle = model.layer1.register_forward_hook(lambda *args: explain.gradcam(model, x, "layer4") and None)
    try:
        with pytest.raises(explain.ExplainError, match="from inside a pass"):
            explain.gradcam(model, x, "layer4")
    finally:
        handle.remove()
    assert all(p.requires_grad for p in model.parameters()) and not model.training
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())
    assert explain.cam(model, x, "guided_gradcam", "layer4").shape == (1, 3, 32, 32)


def test_a_picture_that_cannot_be_drawn_fails_its_input_alone(tmp_path, monkeypatch) -> None:
    from conftest import CAT, COFFEE

    from explain.cli import main
    from explain.export import outputs

    real = outputs.figure

    def failing(image, *args, **kwargs):
        if image.shape[0] == Image.open(CAT).height:
            raise MemoryError("the canvas is too large")
        return real(image, *args, **kwargs)

    monkeypatch.setattr(outputs, "figure", failing)
    out = tmp_path / "out"
    assert main([str(CAT), str(COFFEE), "-o", str(out), "--model", "efficientnet_lite0", "--figure", "--quiet"]) == 1
    records = manifest(out)
    errors = {Path(r["input"]).name: r["error"] for r in records}
    assert "cannot render outputs: the canvas is too large" in errors["chelsea.png"] and errors["coffee.png"] is None


LITE0 = ["--model", "efficientnet_lite0", "--quiet"]


@pytest.fixture
def finished_run(tmp_path):
    """An output folder of one explained photo, and a decoy file beside it that no run may touch."""
    from conftest import CAT

    from explain.cli import main

    out = tmp_path / "out"
    assert main([str(CAT), "-o", str(out), *LITE0]) == 0
    decoy = tmp_path / "decoy.jpg"
    decoy.write_bytes(b"the user's own file")
    return out, decoy


def rewrite(out: Path, change) -> None:
    lines = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    (out / "manifest.jsonl").write_text("".join(json.dumps(o) + "\n" for o in change(lines)))


@pytest.mark.parametrize("named", ["../decoy.jpg", "ABSOLUTE"])
def test_a_manifest_naming_files_outside_the_folder_is_refused(finished_run, named, capsys) -> None:
    from conftest import CAT

    from explain.cli import main

    out, decoy = finished_run
    name = str(decoy) if named == "ABSOLUTE" else named

    def hostile(lines):
        lines[1]["targets"][0]["output"] = name
        return lines

    rewrite(out, hostile)
    capsys.readouterr()
    for args in (["--gallery", "-o", str(out)], [str(CAT), "-o", str(out), "--resume", "--gallery", *LITE0]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"line 2 is a record that names {name!r}, outside the output folder" in err and err.count("\n") == 1
    assert decoy.read_bytes() == b"the user's own file"
    assert not (out / "thumbs").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda lines: [lines[0], {k: v for k, v in lines[1].items() if k != "method"}],
            "line 2 is a record without 'method'",
        ),
        (lambda lines: [lines[0], [1, 2, 3]], "line 2 is a list, not a record"),
        (lambda lines: [{**lines[0], "schema": 99}, lines[1]], "written by a newer version of explain (schema 99)"),
        (lambda lines: lines[1:], "line 1 is not the header of the run's settings"),
        (
            lambda lines: [lines[0], {**lines[1], "targets": "everything"}],
            "line 2 is a record whose 'targets' is a str",
        ),
    ],
)
def test_a_malformed_manifest_is_refused_in_one_line(finished_run, change, message, capsys) -> None:
    from conftest import CAT

    from explain.cli import main

    out, _ = finished_run
    rewrite(out, change)
    capsys.readouterr()
    for args in (["--gallery", "-o", str(out)], [str(CAT), "-o", str(out), "--resume", *LITE0]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_a_glob_with_dot_dot_keeps_its_outputs_in_the_folder(tmp_path) -> None:
    from conftest import CAT

    from explain.cli import main

    (tmp_path / "photos" / "a").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(CAT, tmp_path / "elsewhere" / "cat.png")
    out = tmp_path / "photos" / "out"
    pattern = str(tmp_path / "photos" / "*" / ".." / ".." / "elsewhere" / "*.png")
    assert main([pattern, "-o", str(out), *LITE0]) == 0
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.jpg"))
    assert written == ["photos/out/cat.gradcam.jpg"]


def test_resuming_with_fewer_inputs_keeps_the_others(tmp_path, capsys) -> None:
    from conftest import CAT, COFFEE

    from explain.cli import main

    out = tmp_path / "out"
    assert main([str(CAT), str(COFFEE), "-o", str(out), *LITE0, "--gallery"]) == 0
    before = {p.name: p.read_bytes() for p in out.glob("*.jpg")}
    capsys.readouterr()
    assert main([str(COFFEE), "-o", str(out), "--model", "efficientnet_lite0", "--resume", "--gallery"]) == 0
    assert "skipped 1, kept 1 of the earlier run's inputs untouched in" in capsys.readouterr().out
    records = manifest(out)
    assert [Path(r["input"]).name for r in records] == ["coffee.png", "chelsea.png"]
    assert {p.name: p.read_bytes() for p in out.glob("*.jpg")} == before
    assert "chelsea.png" in (out / "index.html").read_text()


def test_a_folder_held_by_a_live_run_is_refused_and_a_stale_lock_taken_over(finished_run, capsys) -> None:
    import socket
    import subprocess
    import sys

    from conftest import CAT

    from explain.cli import main
    from explain.export.ownership import LOCK

    out, _ = finished_run
    before = (out / "manifest.jsonl").read_bytes()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = {"pid": sleeper.pid, "host": socket.gethostname(), "run": "another"}
        (out / LOCK).write_text(json.dumps(owner))
        capsys.readouterr()
        assert main([str(CAT), "-o", str(out), "--resume", *LITE0]) == 2
        err = capsys.readouterr().err
        assert f"in use by another explain run (process {sleeper.pid} on {owner['host']})" in err
        assert err.count("\n") == 1 and (out / "manifest.jsonl").read_bytes() == before
    finally:
        sleeper.kill()
        sleeper.wait()
    assert main([str(CAT), "-o", str(out), "--resume", *LITE0]) == 0  # its owner is gone: the lock is stale
    assert not (out / LOCK).exists() and (out / "manifest.jsonl").read_bytes() == before


def test_two_runs_into_one_folder_the_second_refused(tmp_path) -> None:
    import signal
    import subprocess
    import sys
    import time

    from conftest import ASSETS

    from explain.export.ownership import LOCK

    photos = tmp_path / "photos"
    photos.mkdir()
    for k in range(24):
        shutil.copy(ASSETS / "chelsea.png", photos / f"cat-{k}.png")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "explain", str(photos), "-o", str(out), "--batch-size", "1", *LITE0]
    first = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / LOCK).exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (out / LOCK).exists(), "the first run never held its folder"
        first.send_signal(signal.SIGSTOP)  # paused, holding its folder, however fast it would have finished
        second = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "in use by another explain run" in second.stderr
    finally:
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 0, first.stderr.read()
    records = manifest(out)
    assert len(records) == 24 and all(r["error"] is None for r in records) and not (out / LOCK).exists()


def without_file_access() -> list[str]:
    """A command prefix that runs a program as this user without root's power over file permissions."""
    import os

    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root's file access cannot be dropped here: no setpriv (util-linux)")
    dropped = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={dropped}", f"--inh-caps={dropped}", "--"]


def test_loops_and_unreadable_paths_are_errors_of_their_own(tmp_path) -> None:
    import os
    import subprocess
    import sys

    from conftest import CAT, COFFEE

    photos = tmp_path / "photos"
    (photos / "locked").mkdir(parents=True)
    shutil.copy(CAT, photos / "cat.png")
    shutil.copy(COFFEE, photos / "locked" / "coffee.png")
    shutil.copy(COFFEE, photos / "secret.png")
    (photos / "loop.png").symlink_to("loop.png")
    (photos / "again").symlink_to(photos, target_is_directory=True)  # a folder loop: not followed
    os.chmod(photos / "locked", 0)
    os.chmod(photos / "secret.png", 0)
    out = tmp_path / "out"
    try:
        run = subprocess.run(
            [*without_file_access(), sys.executable, "-m", "explain", str(photos), "-o", str(out), *LITE0],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        os.chmod(photos / "locked", 0o755)
        os.chmod(photos / "secret.png", 0o644)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    errors = sorted(line.removeprefix("explain: error: ") for line in run.stderr.splitlines())
    assert errors == [
        f"{photos / 'locked'}: cannot read this folder (Permission denied)",
        f"{photos / 'loop.png'}: a loop of symbolic links",
        f"{photos / 'secret.png'}: cannot read (Permission denied)",
    ]
    records = manifest(out)
    assert sorted(Path(r["input"]).name for r in records if r["error"] is None) == ["cat.png"]


def test_weights_refusals_name_the_file_without_torchs_advice(tmp_path) -> None:
    import pickle

    from explain.models import read_state_dict

    cases = {"garbage.pt": b"not a checkpoint at all", "empty.pt": b""}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    with (tmp_path / "pickled.pt").open("wb") as file:
        pickle.dump({"weights": {1, 2}}, file, protocol=4)
    messages = {}
    for name in ("garbage.pt", "empty.pt", "pickled.pt"):
        with pytest.raises(explain.ModelLoadError) as caught:
            read_state_dict(tmp_path / name)
        messages[name] = str(caught.value)
    assert all(message.startswith(f"{tmp_path / name}: cannot load weights: ") for name, message in messages.items())
    assert "empty or cut short" in messages["empty.pt"]
    assert not any("weights_only" in m or "trusted source" in m or "\n" in m for m in messages.values())


def test_killed_at_random_moments_then_resumed_loses_no_record(tmp_path, capsys) -> None:
    """Runs killed (SIGKILL) at random moments, each resumed by the next, within a time bound: every record the
    manifest held stays true (its files whole), none is lost, nothing finished is redone, the lock never blocks."""
    import random
    import signal
    import subprocess
    import sys
    import time

    from conftest import ASSETS

    photos = tmp_path / "photos"
    photos.mkdir()
    for k, photo in enumerate(sorted(ASSETS.glob("*.png")) * 3):
        Image.open(photo).convert("RGB").resize((96, 72)).save(photos / f"{k:02d}-{photo.stem}.jpg")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "explain", str(photos), "-o", str(out), "--batch-size", "2", "--workers", "0"]
    rng, trials, finished = random.Random(20), 0, {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and trials < 12:
        run = subprocess.Popen([*command, *LITE0, *(["--resume"] if out.exists() else [])], stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.5, 4.0))
        if run.poll() is not None:  # it finished before the kill: the run is complete
            assert run.returncode == 0, run.stderr.read()
            break
        run.send_signal(signal.SIGKILL)
        run.wait()
        trials += 1
        manifest_file = out / "manifest.jsonl"
        for line in manifest_file.read_text().splitlines(keepends=True)[1:] if manifest_file.exists() else []:
            if line.endswith("\n"):  # a complete record: its files are whole
                for target in json.loads(line)["targets"]:
                    Image.open(out / target["output"]).load()
                    finished.setdefault(target["output"], (out / target["output"]).stat().st_mtime_ns)
    final = subprocess.run([*command, *LITE0, "--resume"], capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    records = manifest(out)
    assert sorted(Path(r["input"]).name for r in records) == sorted(p.name for p in photos.iterdir())
    assert all(r["error"] is None for r in records) and not list(out.rglob("*.part"))
    now = {t["output"]: (out / t["output"]).stat().st_mtime_ns for r in records for t in r["targets"]}
    assert all(now[name] == mtime for name, mtime in finished.items())
    with capsys.disabled():
        print(f"\n{trials} runs killed at random moments, {len(finished)} finished records kept, none lost")


def test_a_strip_image_with_a_figure_is_written_at_a_bounded_size(tmp_path) -> None:
    """A 1 x 4000 image with --figure, in a process whose address space is capped at 6 GiB (the run with the
    model loaded peaks near 3.5): written, at a bounded size."""
    import resource
    import subprocess
    import sys

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))

    strip = tmp_path / "strip.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (4000, 1, 3), dtype=np.uint8)).save(strip)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "explain", str(strip), "-o", str(out), "--figure", *LITE0]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, preexec_fn=capped)
    assert run.returncode == 0, run.stderr
    with Image.open(out / "strip.gradcam.figure.jpg") as drawn:
        assert max(drawn.size) <= 100 * (4 * render.MAX_ASPECT + 12)


def test_an_os_error_says_what_failed_and_where(tmp_path, capsys) -> None:
    from conftest import CAT

    from explain.cli import main

    out = tmp_path / "out"
    out.write_text("a file where the output folder would go")
    assert main([str(CAT), "-o", str(out), *LITE0]) == 1
    assert capsys.readouterr().err == f"explain: error: cannot write {out}: File exists\n"
