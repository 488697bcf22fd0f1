"""Batch export at data-set scale: the manifest and resuming, a run killed at any moment, worker processes,
lists of inputs, several processes under torchrun."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import ASSETS, manifest
from PIL import Image
from ranks import ONE_THREAD, rank_process, torchrun

import explain
from explain.cli import main
from explain.export import run as export
from explain.export.distributed import Process
from explain.export.loading import InputFiles, load_batches
from explain.export.manifest import chosen_records

ROOT = ASSETS.parent
LITE0 = ["--model", "efficientnet_lite0"]
PHOTOS = sorted(p for p in ASSETS.iterdir() if p.suffix in (".png", ".jpg"))


def same_records(found: bytes, expected: bytes) -> bool:
    """Whether two manifests hold the same records in the same order, each record's scores equal to 1e-5: images
    redone in a smaller batch may round the last printed digit otherwise (the batch's convolutions sum in another
    order)."""

    def scoreless(line: bytes) -> tuple[dict, list[float]]:
        record = json.loads(line)
        scores = [target.pop("score") for target in record.get("targets") or []]
        return record, scores

    pairs = list(zip(found.splitlines(), expected.splitlines()))
    if len(pairs) != len(expected.splitlines()) or len(found.splitlines()) != len(pairs):
        return False
    for a, b in pairs:
        (ra, sa), (rb, sb) = scoreless(a), scoreless(b)
        if ra != rb or len(sa) != len(sb) or any(abs(x - y) > 1e-5 for x, y in zip(sa, sb)):
            return False
    return True


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """24 JPEGs of 160x120 in two folders: four crops of each of the six photos in assets/."""
    root = tmp_path_factory.mktemp("dataset")
    for photo in PHOTOS:
        image = Image.open(photo).convert("RGB")
        width, height = image.size
        for k in range(4):
            box = (k * width // 10, k * height // 10, width - (3 - k) * width // 10, height - (3 - k) * height // 10)
            folder = root / ("a" if k < 2 else "b")
            folder.mkdir(exist_ok=True)
            image.crop(box).resize((160, 120)).save(folder / f"{photo.stem}-{k}.jpg", quality=90)
    return root


def outputs(out: Path) -> dict[str, int]:
    """Each output file the manifest names, with its modification time (ns)."""
    return {t["output"]: (out / t["output"]).stat().st_mtime_ns for r in manifest(out) for t in r["targets"]}


def summary_line(text: str) -> str:
    (line,) = [line for line in text.splitlines() if line.startswith("written ")]
    return line


def run_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "cli.py"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_a_second_run_is_refused_and_resume_redoes_only_what_is_missing(dataset, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert main([str(dataset), "-o", str(out), *LITE0, "--format", "jpg"]) == 0
    head = json.loads((out / "manifest.jsonl").read_text().splitlines()[0])["header"]
    assert (head["model"], head["method"], head["fmt"], head["version"]) == (
        "efficientnet_lite0",
        "gradcam",
        "jpg",
        explain.__version__,
    )
    assert len(head["weights_sha256"]) == 64 and head["preprocessing"]["input_size"] == 224
    records = manifest(out)
    assert [Path(r["input"]).relative_to(dataset).as_posix() for r in records] == sorted(
        p.relative_to(dataset).as_posix() for p in dataset.rglob("*.jpg")
    )
    assert summary_line(capsys.readouterr().out).startswith("written 24, failed 0, skipped 0 in ")
    first, before = (out / "manifest.jsonl").read_bytes(), outputs(out)

    # Without --resume the folder is refused, before anything is loaded or written.
    assert main([str(dataset), "-o", str(out), *LITE0, "--format", "jpg"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds the manifest of an earlier run; add --resume" in err and "--overwrite" in err
    # Other settings cannot be resumed; the error names what differs.
    assert main([str(dataset), "-o", str(out), *LITE0, "--format", "jpg", "--alpha", "0.3", "--resume"]) == 2
    assert "cannot resume a run with other settings (alpha: 0.5 then, 0.3 now)" in capsys.readouterr().err
    assert (out / "manifest.jsonl").read_bytes() == first and outputs(out) == before

    # Resumed after a finished run: nothing redone, the manifest unchanged.
    assert main([str(dataset), "-o", str(out), *LITE0, "--format", "jpg", "--resume"]) == 0
    assert summary_line(capsys.readouterr().out).startswith("written 0, failed 0, skipped 24 in ")
    assert (out / "manifest.jsonl").read_bytes() == first and outputs(out) == before

    # Two outputs lost, a killed writer's incomplete last line and its temporary file: those two are redone.
    lost = sorted(before)[3:5]
    for name in lost:
        (out / name).unlink()
    with (out / "manifest.jsonl").open("a") as f:
        f.write('{"schema": 4, "input": "half a rec')
    (out / "a" / ".chelsea-0.gradcam.jpg.0123456789ab.part").write_bytes(b"half an image")
    assert main([str(dataset), "-o", str(out), *LITE0, "--format", "jpg", "--resume", "--quiet"]) == 0
    after = outputs(out)
    assert sorted(after) == sorted(before) and all(after[n] == before[n] for n in before if n not in lost)
    assert same_records((out / "manifest.jsonl").read_bytes(), first)  # in input order, as if never interrupted
    assert not list(out.rglob("*.part"))

    # --overwrite starts afresh: the earlier run's outputs, manifest and gallery go, and nothing else. Here the
    # new run explains one folder of the data set alone, with another method.
    assert main(["--gallery", "-o", str(out), "--quiet"]) == 0 and (out / "thumbs").is_dir()
    (out / "notes.txt").write_text("the user's own file")
    kept = sorted(dataset.glob("a/*.jpg"))
    assert main([str(dataset / "a"), "-o", str(out), *LITE0, "--method", "layercam", "--overwrite"]) == 0
    assert summary_line(capsys.readouterr().out).startswith(f"written {len(kept)}, failed 0, skipped 0 in ")
    assert [r["input"] for r in manifest(out)] == [str(path) for path in kept]
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == sorted([".explain-output", "manifest.jsonl", "notes.txt", *outputs(out)])
    assert all(name.endswith(".layercam.jpg") for name in outputs(out))


def test_resume_matches_inputs_by_file_not_by_spelling(dataset, tmp_path, monkeypatch, capsys) -> None:
    """A resumed run that names the same files otherwise skips them; one whose relative names, from another
    starting folder, are other files explains those."""
    out = tmp_path / "out"
    monkeypatch.chdir(dataset)
    assert main(["a", "-o", str(out), *LITE0, "--quiet"]) == 0
    before = outputs(out)
    assert [r["input"] for r in manifest(out)][:1] == ["a/astronaut-0.jpg"]
    monkeypatch.chdir(tmp_path)
    assert main([str(dataset / "a"), "-o", str(out), *LITE0, "--resume"]) == 0
    assert summary_line(capsys.readouterr().out).startswith(f"written 0, failed 0, skipped {len(before)} in ")
    assert outputs(out) == before
    assert [r["input"] for r in manifest(out)] == [str(p) for p in sorted(dataset.glob("a/*.jpg"))]

    # "a/" from another folder: two other images under the names of the first run's first two.
    other = tmp_path / "other"
    monkeypatch.chdir(dataset)
    assert main(["a", "-o", str(other), *LITE0, "--quiet"]) == 0
    (tmp_path / "a").mkdir()
    for k, name in enumerate(["astronaut-0.jpg", "astronaut-1.jpg"]):
        (tmp_path / "a" / name).write_bytes((dataset / "b" / f"coffee-{k + 2}.jpg").read_bytes())
    monkeypatch.chdir(tmp_path)
    assert main(["a", "-o", str(other), *LITE0, "--resume"]) == 0
    earlier = sorted(dataset.glob("a/*.jpg"))  # not given again: their records and files are kept, named absolutely
    line = summary_line(capsys.readouterr().out)
    assert line.startswith(f"written 2, failed 0, skipped 0, kept {len(earlier)} of the earlier run's inputs untouched")
    records = manifest(other)
    assert [r["input"] for r in records] == ["a/astronaut-0.jpg", "a/astronaut-1.jpg", *map(str, earlier)]
    assert [r["targets"][0]["class_name"] for r in records[:2]] == ["espresso", "espresso"]


def test_a_resumed_run_keeps_its_gallery_current(dataset, tmp_path) -> None:
    out, photos = tmp_path / "out", [str(p) for p in sorted(dataset.glob("a/*.jpg"))[:3]]
    assert main([*photos[:2], "-o", str(out), *LITE0, "--gallery", "--quiet"]) == 0
    assert photos[1] in (out / "index.html").read_text() and photos[2] not in (out / "index.html").read_text()
    assert main([*photos, "-o", str(out), *LITE0, "--resume", "--quiet"]) == 0  # without --gallery
    assert all(photo in (out / "index.html").read_text() for photo in photos)
    assert main([*photos, "-o", str(tmp_path / "plain"), *LITE0, "--quiet"]) == 0
    assert not (tmp_path / "plain" / "index.html").exists()  # none where none was asked for


def test_killed_at_any_moment_then_resumed_loses_nothing(dataset, tmp_path) -> None:
    """SIGKILL after 2 records, after 9, and once the first file is there; resumed each time."""
    out = tmp_path / "out"
    args = [str(dataset), "-o", str(out), *LITE0, "--batch-size", "4", "--workers", "0", "--quiet"]
    finished: dict[str, int] = {}
    for kill_after in (2, 9, 0):
        process = run_cli(*args, *(["--resume"] if out.exists() else []))
        manifest_file = out / "manifest.jsonl"
        while process.poll() is None:
            lines = manifest_file.read_text().count("\n") if manifest_file.exists() else 0
            if lines > kill_after + 1 or (kill_after == 0 and any(out.rglob("*.gradcam.*"))):
                break
            time.sleep(0.002)
        process.send_signal(signal.SIGKILL)
        process.wait()
        # What the manifest holds as finished was finished: whole files, never written again.
        lines = manifest_file.read_text().splitlines(keepends=True) if manifest_file.exists() else []
        for line in lines[1:]:
            if line.endswith("\n"):
                record = json.loads(line)
                for target in record["targets"]:
                    path = out / target["output"]
                    Image.open(path).load()
                    finished.setdefault(target["output"], path.stat().st_mtime_ns)
    process = run_cli(*args, "--resume")
    assert process.wait() == 0, process.stderr.read()
    records = manifest(out)
    names = [Path(r["input"]).relative_to(dataset).as_posix() for r in records]
    assert names == sorted(p.relative_to(dataset).as_posix() for p in dataset.rglob("*.jpg"))  # each exactly once
    assert all(r["error"] is None and len(r["targets"]) == 1 for r in records)
    for record in records:
        assert Image.open(out / record["targets"][0]["output"]).size == (160, 120)
    now = outputs(out)
    assert finished and all(now[name] == mtime for name, mtime in finished.items())  # nothing finished redone
    assert not list(out.rglob("*.part"))


def test_worker_processes_write_the_same_files(dataset, tmp_path) -> None:
    runs = {}
    for workers in ("0", "2"):
        out = tmp_path / f"w{workers}"
        assert (
            main([str(dataset / "a"), "-o", str(out), *LITE0, "--workers", workers, "--quiet", "--batch-size", "5"])
            == 0
        )
        runs[workers] = {t["output"]: (out / t["output"]).read_bytes() for r in manifest(out) for t in r["targets"]}
    assert len(runs["0"]) == 12 and runs["0"] == runs["2"]


def test_inputs_from_a_list(dataset, tmp_path, capsys) -> None:
    listing = dataset / "list.txt"
    absolute = dataset / "b" / "coffee-3.jpg"
    listing.write_text(f"# two photos and a missing one\na/chelsea-0.jpg\n\n{absolute}\na/nowhere.jpg\n")
    out = tmp_path / "out"
    assert main(["--from-list", str(listing), "-o", str(out), *LITE0, "--quiet"]) == 1
    records = manifest(out)
    assert [r["input"] for r in records] == [str(dataset / "a" / "chelsea-0.jpg"), str(absolute), "a/nowhere.jpg"]
    assert [t["output"] for r in records[:2] for t in r["targets"]] == [
        "a/chelsea-0.gradcam.jpg",
        "b/coffee-3.gradcam.jpg",
    ]
    assert records[2]["error"] == f"{listing}:5: a/nowhere.jpg: no such file"
    assert capsys.readouterr().err.strip() == f"explain: error: {listing}:5: a/nowhere.jpg: no such file"
    assert main(["--from-list", str(tmp_path / "none.txt"), "-o", str(tmp_path / "x")]) == 2
    assert "none.txt: cannot read the list of inputs" in capsys.readouterr().err


def test_records_chosen_over_runs() -> None:
    def rec(name: str, method: str, error: str | None = None) -> dict:
        return {"input": name, "method": method, "error": error}

    written = [
        rec("b", "gradcam", "boom"),
        rec("a", "gradcam"),
        rec("b", "gradcam"),  # b redone after an error
        rec("c", "gradcam,layercam", "unreadable"),  # an input that failed as a whole, then partly redone
        rec("c", "gradcam"),
        rec("a", "gradcam", "late failure"),  # a success is kept over a later error
    ]
    chosen = chosen_records(written, order=["a", "b", "c"], methods=["gradcam"])
    assert [(r["input"], r["error"]) for r in chosen] == [("a", None), ("b", None), ("c", None)]
    assert chosen_records([rec("d", "gradcam,layercam", "unreadable")], ["d"], ["gradcam", "layercam"])[0]["error"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds a rank's process through /proc")
def test_torchrun_shards_merges_and_resumes_after_a_rank_is_killed(dataset, tmp_path) -> None:
    """Two processes (gloo) write what one does; a rank killed mid-run, resumed by three, loses nothing."""
    common = [str(dataset), *LITE0, "--batch-size", "1", "--quiet"]  # batches of one: the same arithmetic in any rank
    alone = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *common, "-o", str(tmp_path / "alone")],
        env=ONE_THREAD,
        capture_output=True,
        text=True,
    )
    assert alone.returncode == 0, alone.stderr

    def files(out: Path) -> dict[str, bytes]:
        return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    two = torchrun(2, *common, "-o", str(tmp_path / "two"))
    assert two.wait(timeout=300) == 0, two.stderr.read()
    assert files(tmp_path / "two") == files(tmp_path / "alone")  # outputs and merged manifest, byte for byte

    out = tmp_path / "killed"
    killed = torchrun(2, *common, "-o", str(out))
    part = out / "manifest.rank1.jsonl"
    while killed.poll() is None and not (part.exists() and part.read_text().count("\n") >= 4):
        time.sleep(0.005)
    pid = rank_process(killed, 1)
    assert pid is not None, "rank 1 finished before it could be killed"
    os.kill(pid, signal.SIGKILL)
    assert killed.wait(timeout=120) != 0
    assert not (out / "manifest.jsonl").exists() and part.exists()  # no merge after a failure: the parts remain
    three = torchrun(3, *common, "-o", str(out), "--resume")
    assert three.wait(timeout=300) == 0, three.stderr.read()
    assert files(out) == files(tmp_path / "alone")


@dataclass(frozen=True)
class ThreadRank(Process):
    """A rank of a run whose processes are threads, meeting at a threading barrier."""

    meeting: threading.Barrier | None = None

    def barrier(self) -> None:
        self.meeting.wait(timeout=30)


def test_a_resumed_run_s_ranks_write_nothing_while_the_first_clears_the_folder(tmp_path, monkeypatch) -> None:
    """Three ranks prepare a folder a killed run left (a writer's part file, a rank's lock draft): the first clears
    it slowly on purpose, and no other rank takes the lock (writing its draft) before the clearing has ended."""
    out = tmp_path / "killed"
    out.mkdir()
    leftovers = [out / ".photo.gradcam.jpg.0123456789ab.part", out / ".explain-lock.ba9876543210.part"]
    for path in leftovers:
        path.write_text("killed mid-write")
    events: list[tuple[str, int, float]] = []
    clearing = export.remove_temporary_files
    taking = export.FolderLock.take

    def slow_clearing(folder: Path) -> None:
        events.append(("clearing", 0, time.monotonic()))
        time.sleep(0.3)  # long enough that a rank not held back would write inside it
        clearing(folder)
        events.append(("cleared", 0, time.monotonic()))

    def take(lock) -> None:
        events.append(("take", int(threading.current_thread().name), time.monotonic()))
        taking(lock)

    monkeypatch.setattr(export, "remove_temporary_files", slow_clearing)
    monkeypatch.setattr(export.FolderLock, "take", take)
    meeting, errors = threading.Barrier(3), []
    head = {"header": {"model": "m"}, "cwd": str(tmp_path)}

    def prepare(rank: int) -> None:
        try:
            process = ThreadRank(rank, 3, rank, meeting)
            lock = export.FolderLock(out, last=rank == 0)
            export._folder_prepared(process, out, export.ExportOptions(resume=True), head, [], lock)
            assert lock.held
        except BaseException as error:  # reported below
            errors.append(error)

    ranks = [threading.Thread(target=prepare, args=(rank,), name=str(rank)) for rank in range(3)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=60)
    assert not errors, errors
    cleared = next(t for kind, _, t in events if kind == "cleared")
    others = [t for kind, rank, t in events if kind == "take" and rank != 0]
    assert len(others) == 2 and min(others) > cleared
    assert not any(path.exists() for path in leftovers) and (out / ".explain-lock").exists()


def test_each_process_takes_its_share_and_its_own_device() -> None:
    ranks = [Process(rank, 3, rank) for rank in range(3)]
    items = list(range(10))
    assert [p.shard(items) for p in ranks] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert ranks[2].device(torch.device("cuda")) == torch.device("cuda", 2)  # a GPU per process
    assert ranks[2].device(torch.device("cuda", 0)) == torch.device("cuda", 0)  # a device the user named
    assert ranks[2].device(torch.device("cpu")) == torch.device("cpu")
    assert Process().device(torch.device("cuda")) == torch.device("cuda")


def test_spawned_worker_processes_get_the_preprocessing_not_the_model(dataset, tmp_path, monkeypatch) -> None:
    """macOS and Windows spawn ``DataLoader`` workers, which get a pickled copy of the dataset: the model's
    preprocessing, never the model. An export with spawned workers (forced here) writes what one with threads
    writes."""
    given = []

    def loading(paths, read, *args, **kwargs):
        given.append(InputFiles(paths, read))
        return load_batches(paths, read, *args, **kwargs)

    monkeypatch.setattr(export, "load_batches", loading)
    spawned, threads = tmp_path / "spawned", tmp_path / "threads"
    args = [str(dataset / "a"), *LITE0, "--batch-size", "4", "--quiet"]
    spawning = "import multiprocessing, sys; multiprocessing.set_start_method('spawn'); from explain.cli import main; "
    command = [sys.executable, "-c", spawning + "sys.exit(main(sys.argv[1:]))", *args, "-o", str(spawned)]
    run = subprocess.run([*command, "--workers", "2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert main([*args, "-o", str(threads), "--workers", "0"]) == 0
    assert len(given) == 1 and len(pickle.dumps(given[0])) < 4096  # what a spawned worker would get
    assert manifest(spawned) == manifest(threads)
    assert all((spawned / f).read_bytes() == (threads / f).read_bytes() for f in outputs(threads))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
@pytest.mark.parametrize("workers", [0, 1])
def test_batches_for_a_cuda_device_come_in_pinned_memory(dataset, workers) -> None:
    spec = explain.load_model("efficientnet_lite0")
    paths = sorted(dataset.rglob("*.jpg"))[:6]
    for batch in load_batches(paths, spec.preprocessing.read, batch_size=4, workers=workers, pin=True):
        assert all(group.x.is_pinned() for group in batch.groups)


def own_priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def priority_as_input(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """A reader whose 'model input' is the niceness of the thread that loaded the file."""
    return torch.zeros(1, 1, 3, dtype=torch.uint8), torch.tensor([float(own_priority())])


@pytest.mark.skipif(sys.platform != "linux", reason="priorities are set per thread on Linux alone")
@pytest.mark.parametrize("workers", [0, 1])
def test_loading_for_a_cpu_model_yields_to_it_and_the_model_keeps_its_priority(dataset, workers, tmp_path) -> None:
    paths, before = sorted(dataset.rglob("*.jpg"))[:6], own_priority()
    for background, expected in ((True, 19), (False, before)):
        batches = load_batches(paths, priority_as_input, 4, workers, pin=False, background=background)
        assert [float(v) for batch in batches for group in batch.groups for v in group.x] == [expected] * 6
    assert main([str(dataset / "a"), "-o", str(tmp_path / "out"), *LITE0, "--workers", str(workers), "--quiet"]) == 0
    assert own_priority() == before  # the thread that runs the model


def test_a_torchrun_process_loads_its_model_on_its_own_gpu(monkeypatch) -> None:
    """Under ``torchrun`` on CUDA, each process loads the model on the GPU of its local rank, where the export
    puts its inputs, whatever kind of model (the device is faked: the loader is asked, nothing runs)."""
    import explain.models
    from explain import cli
    from explain.models import text_image

    asked: list[torch.device] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(cli, "_device", lambda text: torch.device("cuda"))
    monkeypatch.setattr(explain.models, "load_model", lambda *args: asked.append(args[-1]))
    monkeypatch.setattr(text_image, "load_text_image_model", lambda name, device: asked.append(device))
    monkeypatch.setattr(text_image, "is_text_image_model", lambda name: name == "vlm")
    for model in ("resnet18", "vlm"):
        args = cli.build_parser().parse_args(["photo.jpg", "--model", model])
        cli._loaded(args)
    assert asked == [torch.device("cuda", 1)] * 2
