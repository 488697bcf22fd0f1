"""How fast the ``explain`` command starts and finishes a one-image run, against Python's and torch's own start.

Each command runs as a fresh process (as a user runs it), rounds interleaved so that machine noise falls
on all of them alike; the table gives median wall seconds and the ratio to a bare ``python -c pass``.
Targets (issue "release quality"): ``--help``, ``--version`` and ``--method list`` within 0.5 s, a
one-image run on the bundled model within 3 s, on this project's 2-core CPU machine.

    python benchmarks/bench_startup.py [--rounds 7] [--out benchmarks/results_startup_cpu.md]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHOTO = ROOT / "assets" / "chelsea.png"


def commands(out: Path) -> dict[str, tuple[list[str], float | None]]:
    """Each measured command with its target in seconds (None: a reference)."""
    python, script = sys.executable, str(Path(sys.executable).with_name("explain"))
    return {
        "python -c pass (baseline)": ([python, "-c", "pass"], None),
        "python -c 'import torch' (reference)": ([python, "-c", "import torch"], None),
        "explain --help": ([script, "--help"], 0.5),
        "explain --version": ([script, "--version"], 0.5),
        "explain --method list": ([script, "--method", "list"], 0.5),
        "explain missing.png (exit 2)": ([script, str(out / "missing.png")], 0.5),
        "explain chelsea.png --model efficientnet_lite0": (
            [script, str(PHOTO), "--model", "efficientnet_lite0", "-o", str(out), "--quiet", "--overwrite"],
            3.0,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        runs = commands(Path(folder))
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, (command, _) in runs.items():
                start = time.perf_counter()
                subprocess.run(command, capture_output=True, check=False)
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(seconds) for name, seconds in times.items()}
    python, torch = medians["python -c pass (baseline)"], medians["python -c 'import torch' (reference)"]
    lines = [
        f"Median wall seconds of {args.rounds} interleaved rounds, each command a fresh process.",
        "",
        "| command | median (s) | × python start | × import torch | target (s) | met |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, (_, target) in runs.items():
        met = "" if target is None else ("yes" if medians[name] <= target else "no")
        shown = "" if target is None else f"{target:.1f}"
        ratios = f"{medians[name] / python:.1f} | {medians[name] / torch:.2f}"
        lines.append(f"| `{name}` | {medians[name]:.2f} | {ratios} | {shown} | {met} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
