"""One run at a time in an output folder: an advisory lock file, ``OUT/.explain-lock``.

The file holds its owner: the process id, the host and the run (the processes of one ``torchrun`` launch share
theirs, ``TORCHELASTIC_RUN_ID`` or the launch's master address, and with it the lock). It is made whole beside
the folder's files and linked into place atomically, before the run writes anything, and removed when the run
ends, however it ends. A lock whose owner is gone (its process no longer runs on this host, after a kill or a
crash) is stale: the next run takes it over. A lock held by a running process, or by a process of another host,
refuses the run at once, naming its owner.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import ExplainError

LOCK = ".explain-lock"


class FolderInUse(ExplainError):
    """Another run owns the output folder: exit status 2, nothing written."""


@dataclass(frozen=True)
class Owner:
    """Who holds an output folder's lock."""

    pid: int
    host: str
    run: str

    @classmethod
    def this_run(cls) -> Owner:
        """This process, and the run it belongs to (its ``torchrun`` launch, or itself)."""
        host, pid, env = socket.gethostname(), os.getpid(), os.environ
        launch = f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}" if int(env.get("WORLD_SIZE", 1)) > 1 else None
        return cls(pid, host, env.get("TORCHELASTIC_RUN_ID") or launch or f"{host}:{pid}")

    def alive(self) -> bool:
        """Whether the owner may still run: its process exists on this host, or it is another host's."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        return True


def _owner(path: Path) -> Owner | None:
    """The owner a lock file names; None where it names none (half written by a killed run: stale)."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
        return Owner(int(found["pid"]), str(found["host"]), str(found["run"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_free(out_dir: Path) -> None:
    """Refuse a folder that another live run owns (before anything is loaded).

    Raises:
        FolderInUse: The folder's lock names a live owner of another run.
    """
    owner = _owner(out_dir / LOCK) if (out_dir / LOCK).exists() else None
    me = Owner.this_run()
    if owner is not None and owner.run != me.run and owner.alive():
        raise FolderInUse(
            f"{out_dir}: in use by another explain run (process {owner.pid} on {owner.host}); wait for it to end, "
            f"or use another -o folder (if that run is gone, remove {out_dir / LOCK})"
        )


class FolderLock:
    """This run's hold on its output folder, taken before its first write (:meth:`take`) and given up at the end
    (:meth:`release`).

    Args:
        out_dir: The output folder.
        last: Whether this process ends the run (``torchrun``'s rank 0, which merges the manifest): it gives up
            the lock of its launch, whichever process took it.
    """

    def __init__(self, out_dir: Path, last: bool = True) -> None:
        self.path = out_dir / LOCK
        self.me = Owner.this_run()
        self.last = last
        self.held = False

    def take(self) -> None:
        """Hold the folder (created if needed) for this run; again is a no-op.

        Raises:
            FolderInUse: Another live run holds it.
        """
        if self.held:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        draft = self.path.with_name(f"{LOCK}.{uuid.uuid4().hex[:12]}.part")  # a killed run's is cleared as others
        draft.write_text(json.dumps({"pid": self.me.pid, "host": self.me.host, "run": self.me.run}), encoding="utf-8")
        try:
            for _ in range(3):  # a stale lock is removed, then the lock is taken again
                try:
                    os.link(draft, self.path)  # atomic, and the lock is whole the moment it exists
                except FileExistsError:
                    owner = _owner(self.path)
                    if owner is not None and owner.run == self.me.run:  # another process of this launch holds it
                        self.held = True
                        return
                    if owner is not None and owner.alive():
                        break
                    if _owner(self.path) == owner:  # still the stale one
                        self.path.unlink(missing_ok=True)
                    continue
                self.held = True
                return
        finally:
            draft.unlink(missing_ok=True)
        check_free(self.path.parent)
        raise FolderInUse(f"{self.path.parent}: its lock {self.path} could not be taken")

    def __enter__(self) -> FolderLock:
        """Hold the folder for the block (see :meth:`take`)."""
        self.take()
        return self

    def __exit__(self, *exc: object) -> None:
        """Give the folder up however the block ends (see :meth:`release`)."""
        self.release()

    def release(self) -> None:
        """Give the folder up: the process that ends the run removes its launch's lock."""
        owner = _owner(self.path) if self.path.exists() else None
        if self.last and owner is not None and owner.run == self.me.run:
            self.path.unlink(missing_ok=True)
        self.held = False
