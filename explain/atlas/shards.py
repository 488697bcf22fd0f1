"""The activations and scores of a long concept run kept on disk, one shard per part, so that a run killed midway
resumes where it was (:class:`Shards`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import ExplainError
from ..io.atomic import write_atomically

KEY = "key.json"


class Shards:
    """Tensors kept in a folder, one file per key, each written whole (a temporary file moved into place), under a
    key that says what they were computed from: a folder of another key is refused, never overwritten.

    Args:
        folder: The folder (made where absent).
        key: What the shards are of (the model, the layer, the images, the options), JSON-serializable.

    Raises:
        ExplainError: The folder holds shards of another key.
    """

    def __init__(self, folder: Path, key: Mapping[str, Any]) -> None:
        self.folder, self.key = folder, json.loads(json.dumps(key))
        found = folder / KEY
        if found.is_file():
            kept = json.loads(found.read_text(encoding="utf-8"))
            if kept != self.key:
                changed = sorted(name for name in {*kept, *self.key} if kept.get(name) != self.key.get(name))
                raise ExplainError(
                    f"{folder}: holds a run of another {', '.join(changed)}; run with another -o, or the same options"
                )
        else:
            write_atomically(found, lambda temp: temp.write_text(json.dumps(self.key, indent=1), encoding="utf-8"))

    def get(self, key: str) -> Tensor | None:
        """The shard under ``key``, or None."""
        path = self.folder / f"{key}.pt"
        return torch.load(path, weights_only=True) if path.is_file() else None

    def put(self, key: str, value: Tensor) -> None:
        """Keep a shard under ``key`` (on the CPU)."""
        write_atomically(self.folder / f"{key}.pt", lambda temp: torch.save(value.detach().cpu(), temp))
