"""Several processes of one export, as ``torchrun`` launches them: which process this is, its share of the
inputs, its device, and the points where the processes wait for each other.

``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in each process's environment; without them the
export is the one process of a world of one and nothing here talks to another process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class Process:
    """This process's place among those of the run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This process's share of the items: every ``world``-th from its rank on (the same in every process for
        the same items)."""
        return list(items[self.rank :: self.world])

    def device(self, device: torch.device) -> torch.device:
        """The device this process runs on: a CUDA device of its own (its local rank) when the run uses CUDA
        without naming a device index; else ``device``."""
        if device.type == "cuda" and device.index is None and self.world > 1:
            return torch.device("cuda", self.local_rank)
        return device

    def barrier(self) -> None:
        """Wait until every process of the run has come here."""
        if self.world > 1:
            dist.barrier()


def this_process() -> Process:
    """The process as ``torchrun``'s environment describes it (a world of one without it)."""
    env = os.environ
    return Process(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


@contextmanager
def process_group(process: Process, device: torch.device) -> Iterator[None]:
    """Join the run's processes for the block (NCCL between CUDA devices, gloo otherwise), unless the process
    is alone or a group already exists (the caller's own)."""
    if process.world == 1 or dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()
