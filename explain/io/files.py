"""Which files are inputs, by their names and contents, readable without importing torch (a folder scan, the
command line's checks)."""

from __future__ import annotations

from pathlib import Path


def is_dicom(path: Path) -> bool:
    """Whether a file is a DICOM file, by its content (``DICM`` after a 128-byte preamble), as DICOM slices often
    have no suffix."""
    try:
        with open(path, "rb") as f:
            return f.read(132)[128:] == b"DICM"
    except OSError:
        return False
