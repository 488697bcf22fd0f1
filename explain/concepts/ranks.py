"""The processes a concept search is split over: the ranks of the caller's ``torch.distributed`` group (as
``torchrun`` launches them), or one process alone.

Each rank reads its share of the crops or images (every ``world``-th from its rank on) and the ranks add up what
the factorization and the importance need (:meth:`Ranks.sum`), so that every rank ends with the same bank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Ranks:
    """This process's place among those of a concept search.

    Attributes:
        rank: Its rank.
        world: How many processes.
    """

    rank: int = 0
    world: int = 1

    def share(self, count: int) -> range:
        """This rank's share of ``count`` items: every ``world``-th from its rank on."""
        return range(self.rank, count, self.world)

    def sum(self, value: Tensor) -> Tensor:
        """The value added up over the ranks (a new tensor; the value itself where the process is alone)."""
        if self.world == 1:
            return value
        added = value.clone()
        dist.all_reduce(added, op=dist.ReduceOp.SUM)
        return added

    def wait(self) -> None:
        """Wait until every rank has come here."""
        if self.world > 1:
            dist.barrier()

    def least(self, value: float) -> float:
        """The least of a number over the ranks."""
        if self.world == 1:
            return value
        found = torch.tensor([value], dtype=torch.float64, device=self._device())
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
        return float(found)

    def gathered(self, rows: Tensor, count: int) -> Tensor:
        """Every rank's rows (its :meth:`share` of ``count``) in their places among the ``count``, on every rank."""
        if self.world == 1:
            return rows
        longest = len(range(0, count, self.world))
        padded = torch.zeros(longest, *rows.shape[1:], dtype=rows.dtype, device=rows.device)
        padded[: len(rows)] = rows
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        found = torch.empty(count, *rows.shape[1:], dtype=rows.dtype, device=rows.device)
        for rank, part in enumerate(parts):
            found[rank::self.world] = part[: len(range(rank, count, self.world))]
        return found

    def _device(self) -> torch.device:
        backend = dist.get_backend()
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


ALONE = Ranks()


def current_ranks() -> Ranks:
    """The ranks of the default ``torch.distributed`` group where one is initialized, else this process alone."""
    if not dist.is_available() or not dist.is_initialized():
        return ALONE
    return Ranks(dist.get_rank(), dist.get_world_size())
