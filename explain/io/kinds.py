"""The kinds of input a model reads (an image, a clip, a scan, a signal), each one object that every front end
asks: which files it takes, what its maps are written as, and how a viewer shows it. Nothing outside this module
tells a kind by its name. Readable without importing torch (a folder scan, the command line's checks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputKind:
    """A kind of input, and what each front end asks of it.

    Attributes:
        name: Its name in records and messages (``str(kind)``).
        suffixes: The files a folder scan takes for it.
        unit: The axis a viewer steps through (``"frame"``, ``"slice"``); None: one picture.
        picture: A flat picture: its maps are overlays drawn on it (JPG or PNG), which grids, figures, resizing
            with its aspect, concepts and clicks on it apply to.
        own_size: Read at its own size and channels (a scan, a signal), so a layer's size is the input's own.
        windowed: Shown through an intensity window (a scan).
        plotted: Shown as a plot, its map under it (a signal).
        folders: A folder of DICOM slices is one input of it.
        written: The suffix its maps are written as; None: the overlays' format (``--format``).
        shown: The suffix of the picture written beside its maps (a clip's GIF, a scan's montage); None: none.
    """

    name: str
    suffixes: frozenset[str]
    unit: str | None = None
    picture: bool = False
    own_size: bool = False
    windowed: bool = False
    plotted: bool = False
    folders: bool = False
    written: str | None = None
    shown: str | None = None

    def __str__(self) -> str:
        return self.name

    def input_suffix(self, name: str) -> str | None:
        """The suffix of a file name that makes it an input of this kind (the longest: ``.nii.gz``), or None."""
        lower = name.lower()
        return max((s for s in self.suffixes if lower.endswith(s)), key=len, default=None)


IMAGE = InputKind("image", frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}), picture=True)
VIDEO = InputKind(
    "video", frozenset({".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v"}), unit="frame", written="mp4", shown="gif"
)
VOLUME = InputKind(
    "volume", frozenset({".nii", ".nii.gz", ".npy"}), unit="slice", own_size=True, windowed=True, folders=True,
    written="nii.gz", shown="png",
)  # fmt: skip
SIGNAL = InputKind("signal", frozenset({".npy", ".csv"}), own_size=True, plotted=True, written="png")
