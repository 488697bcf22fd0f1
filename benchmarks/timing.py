"""What the benchmarks share: interleaved timing rounds, and the table written out."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def rounds_and_out(doc: str, family: Sequence[str] = ()) -> argparse.Namespace:
    """The command line of a benchmark that times rounds and writes its table: ``--rounds`` (5) and ``--out``; and
    ``--family``, one of ``family`` (the first by default), where the benchmark has several."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if family:
        parser.add_argument("--family", choices=list(family), default=family[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--only", help="run only the rows whose names hold one of these, comma-separated")
    return parser.parse_args()


def against_inference(
    model: Callable[[Any], object], x: Any, explained: Callable[[], object]
) -> dict[str, Callable[[], object]]:
    """The contenders every benchmark of a detector starts from: the model's plain inference forward on ``x``, and
    ``explained``, an explainer's call (named for Grad-CAM of one detection)."""

    def inference() -> object:
        with torch.inference_mode():
            return model(x)

    return {"inference forward": inference, "explain GradCAM + DetectionTarget": explained}


def interleaved_medians(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """The median seconds of each run over ``rounds`` rounds, the runs interleaved within a round (so that a
    slow moment of the machine costs every contender alike); each run is called once first, as a warm-up."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def _resident_bytes() -> int:
    """The process's resident memory now (Linux's /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_mib(run: Callable[[], object]) -> float:
    """The most memory one call of ``run`` adds to the process, MiB: its resident memory sampled every
    millisecond during the call, over its resident memory just before (freed heap handed back to the system
    first, so that an earlier call's leftovers are not counted as free). Counts numpy's and torch's memory alike."""
    libc = ctypes.util.find_library("c")
    if libc:
        ctypes.CDLL(libc).malloc_trim(0)
    before = peak = _resident_bytes()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _resident_bytes())
            time.sleep(0.001)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        run()
    finally:
        done.set()
        watcher.join()
    return max(peak, _resident_bytes()) / 2**20 - before / 2**20


def ratio_table(medians: dict[str, float], baseline: str = "inference forward") -> list[str]:
    """A markdown table of each contender's median and its ratio to the baseline's."""
    base = medians[baseline]
    return [
        "| contender | median (ms) | × inference |",
        "|---|---:|---:|",
        *(f"| {name} | {1000 * median:.1f} | {median / base:.2f} |" for name, median in medians.items()),
    ]


def emit(lines: list[str], out: str | None) -> None:
    """Print the table, and write it to ``out`` when given."""
    table = "\n".join(lines)
    print(table)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(table + "\n")


def _cpu_ticks() -> list[int] | None:
    """The machine's CPU time by state (user, nice, system, idle, iowait, irq, softirq, steal, ...), or None."""
    stat = Path("/proc/stat")
    return [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:]] if stat.exists() else None


def stolen_share() -> Callable[[], str]:
    """Start watching the CPU time a virtual machine's host takes from it (steal); the returned function tells
    the share of the time since, for the table's header ("unknown" without /proc/stat)."""
    start = _cpu_ticks()

    def share() -> str:
        end = _cpu_ticks()
        if start is None or end is None:
            return "unknown"
        spent = [b - a for a, b in zip(start, end)]
        return f"{100 * spent[7] / max(1, sum(spent[:8])):.0f}%"

    return share


def resnet18_batch(images: int = 4) -> tuple[torch.nn.Module, torch.Tensor, list[int]]:
    """resnet18 with seeded random weights in eval mode, ``images`` random 224x224 inputs, and its top class of
    each: the set-up the attribution and peer benchmarks share."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=1000).eval()
    x = torch.randn(images, 3, 224, 224)
    with torch.no_grad():
        target = model(x).argmax(dim=1).tolist()
    return model, x, target
