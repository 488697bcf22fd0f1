"""Which files are inputs, by their names and contents, readable without importing torch (a folder scan, the
command line's checks)."""

from __future__ import annotations

from pathlib import Path

# The files a folder scan takes, by the kind of input the model reads.
INPUT_SUFFIXES = {
    "image": frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}),
    "video": frozenset({".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v"}),
    "volume": frozenset({".nii", ".nii.gz", ".npy"}),
    "signal": frozenset({".npy", ".csv"}),
}


def input_suffix(name: str, kind: str) -> str | None:
    """The suffix of a file name that makes it an input of ``kind`` (the longest: ``.nii.gz``), or None."""
    lower = name.lower()
    return max((s for s in INPUT_SUFFIXES[kind] if lower.endswith(s)), key=len, default=None)


def is_dicom(path: Path) -> bool:
    """Whether a file is a DICOM file, by its content (``DICM`` after a 128-byte preamble), as DICOM slices often
    have no suffix."""
    try:
        with open(path, "rb") as f:
            return f.read(132)[128:] == b"DICM"
    except OSError:
        return False
