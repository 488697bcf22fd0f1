"""Loading an export's images, in ``DataLoader`` worker processes or in threads: read, EXIF-oriented, resized
and normalized while the model works on the batch before, grouped by input shape, in pinned memory for a CUDA
device; for a model on the CPU, at the lowest priority.

A file that cannot be read is not an exception in a worker (which would end the run) but an entry of the
batch's ``failed``, with the one-line error that names the file.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ..errors import InputLoadError

# How worker processes start: forked from a clean server process, never from this one, whose threads (torch's,
# a compiled model's, the loading threads) may hold a lock at the fork that the child would wait on for ever.
# Where there is no forkserver (Windows, and macOS's default), spawned.
WORKER_START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def lowest_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19), on Linux, where it is set per thread.

    A model on the CPU runs on every core, its kernels split among threads that wait for each other; a thread
    that takes a core from one of them stalls them all. At the lowest priority, reading and writing images runs
    in the gaps the model leaves, and at full speed when it waits for them.
    """
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def helper_threads(background: bool) -> ThreadPoolExecutor:
    """Threads that read or write images beside the model: up to 4, at the lowest priority when ``background``
    (a model on the CPU)."""
    return ThreadPoolExecutor(min(4, os.cpu_count() or 1), initializer=lowest_priority if background else None)


def _background_worker(worker: int) -> None:
    """A ``DataLoader`` worker's start: the lowest priority (see :func:`lowest_priority`)."""
    lowest_priority()


def default_workers(images: int, batch_size: int, device: torch.device) -> int:
    """Worker processes for ``images`` inputs (0: threads load them): none for at most one batch (starting one
    costs more than it saves); for a CUDA model half the cores (at most 8), which feed it while it runs on the
    GPU; for a CPU model a quarter (none on 2 cores), since the model needs the cores and reading an image costs
    about a seventh of its work on it (measured: 7 of 50 ms per 640x480 photo with the bundled model)."""
    if images <= batch_size:
        return 0
    cores = os.cpu_count() or 2
    return max(1, min(8, cores // 2)) if device.type == "cuda" else min(8, cores // 4)


@dataclass(frozen=True)
class Group:
    """Inputs of one batch that share an input shape.

    Attributes:
        positions: Each input's place in the list the dataset was made from.
        x: Their model input, (N, C, *spatial).
        images: What the maps are drawn on, at the inputs' own size: an image's pixels (H, W, 3), a clip's
            sampled frames (T, H, W, 3), uint8 RGB tensors, which pass from a worker process in shared memory,
            not pickled.
    """

    positions: list[int]
    x: Tensor
    images: list[Tensor]


@dataclass(frozen=True)
class Batch:
    """One batch as the loader gives it: its groups, and the files that could not be read with their errors."""

    groups: list[Group] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)

    def pin_memory(self) -> Batch:
        """The batch with its inputs in page-locked memory (the loader calls this for a CUDA run)."""
        groups = [Group(g.positions, g.x.pin_memory(), g.images) for g in self.groups]
        return Batch(groups, self.failed)


class InputFiles(Dataset):
    """Input files as (position, what the maps are drawn on, model input), or (position, error) for a file that
    cannot be read.

    Args:
        paths: The files.
        read: A file as what the maps are drawn on (an image's pixels, a clip's sampled frames) and the model's
            input (see ``Preprocessing.read``); it raises :class:`explain.errors.InputLoadError`.
    """

    def __init__(self, paths: Sequence[Path], read: Callable[[Path], tuple[Tensor, Tensor]]) -> None:
        self.paths = paths
        self.read = read

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, position: int) -> tuple[int, Tensor, Tensor] | tuple[int, str]:
        try:
            original, x = self.read(self.paths[position])
        except InputLoadError as err:
            return position, str(err)
        return position, original, x


def collate(items: list[tuple[int, Tensor, Tensor] | tuple[int, str]]) -> Batch:
    """A batch of loaded images, grouped by input shape in order of first appearance."""
    batch = Batch()
    shapes: dict[tuple[int, ...], list[tuple[int, Tensor, Tensor]]] = {}
    for item in items:
        if len(item) == 2:
            batch.failed.append(item)
        else:
            shapes.setdefault(tuple(item[2].shape), []).append(item)
    for members in shapes.values():
        positions, images, tensors = zip(*members)
        batch.groups.append(Group(list(positions), torch.stack(tensors), list(images)))
    return batch


def load_batches(
    paths: Sequence[Path],
    read: Callable[[Path], tuple[Tensor, Tensor]],
    batch_size: int,
    workers: int,
    pin: bool,
    background: bool = False,
) -> Iterable[Batch]:
    """The files in batches of ``batch_size``, in order, loaded while the batch before is being used: by
    ``workers`` processes, or with none by threads of this process (Pillow and torch release the GIL, and no
    image is sent between processes).

    Args:
        paths: The input files.
        read: A file as what the maps are drawn on and the model's input (see :class:`InputFiles`).
        batch_size: Files per batch.
        workers: Worker processes (0: threads).
        pin: Give the inputs in pinned memory (for a non-blocking copy to a CUDA device).
        background: Load at the lowest priority (for a model on the CPU: see :func:`lowest_priority`).
    """
    files = InputFiles(paths, read)
    if workers == 0:
        return _threaded_batches(files, batch_size, pin, background)
    return DataLoader(
        files,
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=pin,
        prefetch_factor=2,
        worker_init_fn=_background_worker if background else None,
        multiprocessing_context=WORKER_START,
    )


def _threaded_batches(files: InputFiles, batch_size: int, pin: bool, background: bool) -> Iterator[Batch]:
    """The batches of :func:`load_batches`, loaded by threads a batch ahead."""
    chunks = [range(start, min(start + batch_size, len(files))) for start in range(0, len(files), batch_size)]
    if not chunks:
        return
    with helper_threads(background) as pool:

        def load(positions: range) -> list[Future]:
            return [pool.submit(files.__getitem__, position) for position in positions]

        loading = load(chunks[0])
        for following in [*chunks[1:], range(0)]:
            current, loading = loading, load(following)
            batch = collate([item.result() for item in current])
            yield batch.pin_memory() if pin else batch
