"""A warning filter for a block of code, safe where several threads set one.

``warnings.catch_warnings`` saves the process's list of filters and restores it on exit: when two threads are
inside it at once, the one that leaves last puts back a list from before the other's filter, which is then lost
or kept for good. explain sets filters in the thread that runs the model (its backward pass) and in the threads
that read images while it runs; one lock keeps those blocks apart, and each block is kept short.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_LOCK = threading.Lock()


@contextmanager
def warning_filter(action: str, **match: Any) -> Iterator[None]:
    """For the block, apply ``warnings.filterwarnings(action, **match)``, with no other such block running."""
    with _LOCK, warnings.catch_warnings():
        warnings.filterwarnings(action, **match)
        yield
