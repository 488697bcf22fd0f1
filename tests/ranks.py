"""Launching an export under ``torchrun`` and finding one of its ranks, for the tests and the stress run of a killed
multi-process export (``benchmarks/stress_resume.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # every run's arithmetic the same, alone or in a rank


def torchrun(processes: int, *args: str) -> subprocess.Popen:
    """``torchrun --standalone --nproc_per_node=K cli.py ARGS``, one thread per process."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    return subprocess.Popen(
        [*command, str(ROOT / "cli.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ONE_THREAD,
    )


def rank_process(launcher: subprocess.Popen, rank: int) -> int | None:
    """The process id of one rank of a torchrun launch, once it runs."""
    for child in Path("/proc").glob("[0-9]*"):
        try:
            status = (child / "status").read_text()
            environment = (child / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:"))
        if parent == launcher.pid and f"RANK={rank}".encode() in environment:
            return int(child.name)
    return None
