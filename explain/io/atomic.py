"""Writing a file atomically: whole or not at all, whenever the process is stopped (no torch needed)."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write`` on a temporary file beside ``path``, then move it into place.

    A failure leaves no partial file behind; a killed process at most a ``.part`` file beside it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.part")
    try:
        write(temp)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{12}\.part$")


def remove_temporary_files(folder: Path) -> int:
    """Remove the temporary files that killed writers left below ``folder``; returns how many."""
    found = [path for path in folder.rglob(".*.part") if _TEMPORARY.match(path.name)] if folder.is_dir() else []
    for path in found:
        path.unlink(missing_ok=True)
    return len(found)
