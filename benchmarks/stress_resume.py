"""Stress run of a killed multi-process export resumed by more processes (not a benchmark: a count of failures).

Each round launches ``torchrun`` with two ranks on a folder of JPEGs (four crops of each of two bundled photos by
default), kills rank 1 once it has written two records, then resumes the run with three or four ranks, while a
second process keeps the cores busy. A round fails when the resume exits non-zero or its outputs differ from a single
process's (each with one thread: the same arithmetic). The result goes to ``results_stress_resume.md``.

    python benchmarks/stress_resume.py --rounds 20
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from ranks import ONE_THREAD, rank_process, torchrun  # noqa: E402  (the tests' launcher)

COMMON = ["--model", "efficientnet_lite0", "--batch-size", "1", "--quiet"]
LOAD = "import itertools\nfor i in itertools.count(): sum(j * j for j in range(10000))"


def dataset(root: Path, photos: int) -> Path:
    """Four 160x120 crops of each of the first ``photos`` bundled photos."""
    folder = root / "photos"
    folder.mkdir()
    for photo in sorted((ROOT / "assets").glob("*.png"))[:photos]:
        image = Image.open(photo).convert("RGB")
        width, height = image.size
        for k in range(4):
            box = (k * width // 10, k * height // 10, width - (3 - k) * width // 10, height - (3 - k) * height // 10)
            image.crop(box).resize((160, 120)).save(folder / f"{photo.stem}-{k}.jpg", quality=90)
    return folder


def files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def one_round(photos: Path, out: Path, ranks: int, expected: dict[str, bytes]) -> tuple[bool, str | None]:
    """Kill rank 1 of two, resume with ``ranks``: whether rank 1 was killed before it ended, and None or what went
    wrong."""
    killed = torchrun(2, str(photos), *COMMON, "-o", str(out))
    part = out / "manifest.rank1.jsonl"
    while killed.poll() is None and not (part.exists() and part.read_text().count("\n") >= 3):
        time.sleep(0.005)
    pid = rank_process(killed, 1)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    was_killed = killed.wait(timeout=300) != 0
    resumed = torchrun(ranks, str(photos), *COMMON, "-o", str(out), "--resume")
    if resumed.wait(timeout=600) != 0:
        return was_killed, resumed.stderr.read().strip().splitlines()[-1]
    return was_killed, None if files(out) == expected else "outputs differ from a single process's"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds per number of resuming ranks")
    parser.add_argument("--photos", type=int, default=2, help="bundled photos whose four crops make the data set")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temp:
        root = Path(temp)
        photos = dataset(root, args.photos)
        alone = root / "alone"
        alone_run = [sys.executable, str(ROOT / "cli.py"), str(photos), *COMMON, "-o", str(alone)]
        subprocess.run(alone_run, check=True, env=ONE_THREAD)
        expected = files(alone)
        load = subprocess.Popen([sys.executable, "-c", LOAD])
        rows = []
        try:
            for ranks in (3, 4):
                failures, kills = [], 0
                for k in range(args.rounds):
                    was_killed, failure = one_round(photos, root / f"out-{ranks}-{k}", ranks, expected)
                    failures += [failure] if failure else []
                    kills += was_killed
                    print(f"{ranks} ranks, round {k + 1}: killed {was_killed}, {failure or 'ok'}", flush=True)
                rows.append((ranks, args.rounds, kills, failures))
        finally:
            load.kill()
    lines = ["| resuming ranks | rounds | rank 1 killed mid-run | failed | first failure |", "|---|---|---|---|---|"]
    lines += [f"| {r} | {n} | {k} | {len(f)} | {f[0] if f else ''} |" for r, n, k, f in rows]
    report = "\n".join(["# Kill and resume under load", "", *lines, ""])
    (Path(__file__).parent / "results_stress_resume.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
