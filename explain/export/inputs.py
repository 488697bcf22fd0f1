"""Finding the inputs: image files, folders and glob patterns, never the outputs of earlier runs.

Importable without torch, so the command line checks its inputs before it loads a model.
Every output folder holds a marker file (:data:`OUTPUT_MARKER`); a folder scan passes over
marked folders below it, so the outputs of one run never become the inputs of the next.
"""

from __future__ import annotations

import errno
import glob
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ExplainError
from ..io.files import is_dicom
from ..io.kinds import IMAGE, InputKind
from .manifest import named_outputs

OUTPUT_MARKER = ".explain-output"


@dataclass(frozen=True, eq=False)
class Input:
    """One input as the user named it: a file to explain, or the reason there is none.

    Attributes:
        name: The path as found (or the source as given, for an error).
        path: The file, or None.
        relative: Where its outputs go under the output folder, without suffix: the
            file's path below the folder it was found in (for a glob, below the
            pattern's folder part), or its name.
        error: Why the source gave no file.
    """

    name: str
    path: Path | None = None
    relative: Path | None = None
    error: str | None = None


def mark_output_folder(folder: Path) -> None:
    """Create ``folder`` if needed and mark it as an output folder, so that scans pass over it."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / OUTPUT_MARKER
    if not marker.exists():
        marker.write_text("explain writes its outputs here; a scan of input folders passes over this one.\n")


def _resolved(path: Path) -> Path | None:
    """The file a path leads to, or None where it leads to none (a loop of links, an unreadable folder)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # RuntimeError: Python before 3.13, for a loop of symbolic links
        return None


def _unreadable(err: OSError) -> str:
    """What an OS error says of a path that was to be read."""
    if err.errno == errno.ELOOP:
        return "a loop of symbolic links"
    if err.errno == errno.ENOENT:  # a name the scan found, that leads nowhere
        return "a symbolic link to nothing"
    return f"cannot read ({err.strerror or err})"


def _stem(relative: Path, kind: InputKind) -> Path:
    """Where a file's outputs go: its path without its input suffix (both parts of ``.nii.gz``)."""
    suffix = kind.input_suffix(relative.name) or relative.suffix
    return relative.with_name(relative.name[: len(relative.name) - len(suffix)] if suffix else relative.name)


def _is_pattern(source: str) -> bool:
    return any(char in source for char in "*?[")


class _Scanner:
    """Collects inputs in order, once each, skipping output folders."""

    def __init__(self, exclude: Path | None, kind: InputKind) -> None:
        self.exclude = exclude.resolve() if exclude is not None else None
        self.kind = kind
        self.found: list[Input] = []
        self.seen: set[Path] = set()

    def is_output_folder(self, folder: Path) -> bool:
        try:
            return (folder / OUTPUT_MARKER).is_file() or folder.resolve() == self.exclude
        except (OSError, RuntimeError):  # unreadable, or a link loop: the walk reports it
            return False

    def failed(self, path: Path | str, problem: str) -> None:
        """An input that cannot be read: its error, the other inputs unharmed."""
        self.found.append(Input(str(path), error=f"{path}: {problem}"))

    def add(self, path: Path, relative: Path) -> None:
        """Add a file whose outputs go to ``relative`` below the output folder; a place that would leave it (a
        glob's ``..``) is the file's own name there instead."""
        relative = Path(os.path.normpath(relative))
        if relative.is_absolute() or relative.parts[:1] == ("..",):
            relative = Path(path.name)
        try:
            resolved = path.resolve(strict=True)
        except RuntimeError:  # Python before 3.13 for a loop of symbolic links
            return self.failed(path, "a loop of symbolic links")
        except OSError as err:
            return self.failed(path, _unreadable(err))
        if resolved not in self.seen:
            self.seen.add(resolved)
            self.found.append(Input(str(path), path, _stem(relative, self.kind)))

    def files_below(self, folder: Path) -> Iterator[Path]:
        """The input files below ``folder``, sorted, passing over the output folders inside it.

        ``folder`` itself is scanned even when it is an output folder (the user named
        it), but then the files its manifest lists as outputs are passed over.
        """
        written = named_outputs(folder) if self.is_output_folder(folder) else set()
        files = []

        def unreadable(err: OSError) -> None:
            self.failed(err.filename, f"cannot read this folder ({err.strerror or err})")

        for root, dirs, names in os.walk(folder, onerror=unreadable):
            dirs[:] = [d for d in dirs if not self.is_output_folder(Path(root, d))]
            if self.kind.folders and any(is_dicom(Path(root, name)) for name in names):
                files.append(Path(root))  # a folder of DICOM slices is one scan, its series
                continue
            files += [Path(root, name) for name in names if self.kind.input_suffix(name)]
        return (path for path in sorted(files) if not written or _resolved(path) not in written)

    def inside(self, path: Path, base: Path) -> bool:
        """Whether ``path`` lies in an output folder below ``base`` (``base`` itself not counted)."""
        below = [parent for parent in path.parents if parent != base and parent.is_relative_to(base)]
        return any(self.is_output_folder(parent) for parent in below)

    def scan(self, folder: Path, base: Path) -> int:
        """Add the inputs below ``folder``, their outputs placed by their path below ``base`` (a DICOM series named
        itself: by its folder's name); returns how many."""
        files = list(self.files_below(folder))
        for path in files:
            self.add(path, path.relative_to(base) if path != base else Path(path.name))
        return len(files)

    def glob(self, pattern: str) -> int:
        """Add what a pattern matches, placed by its path below the pattern's folder part; returns how many."""
        parts = Path(pattern).parts
        literal = next(i for i, part in enumerate(parts) if _is_pattern(part))
        base = Path(*parts[:literal])
        matches = [m for m in map(Path, sorted(glob.glob(pattern, recursive=True))) if not self.inside(m, base)]
        for match in matches:
            if match.is_dir():
                self.scan(match, base)
            else:
                self.add(match, match.relative_to(base))
        return len(matches)


def collect_inputs(
    sources: Sequence[str | Path | Input], exclude: Path | None = None, kind: InputKind = IMAGE
) -> list[Input]:
    """Expand files, folders (recursively, files of the ``kind`` of input only) and glob patterns, in order.

    Folders found below a scanned folder or a glob's folder part that hold an output
    marker (or are ``exclude``) are passed over: outputs are not read again as inputs.
    Files below a folder keep their path below it in ``relative``, and so do files a
    glob matches, below the pattern's folder part (``photos/**/*.png`` gives
    ``cats/a`` for ``photos/cats/a.png``). A file named explicitly, or matched by a
    glob whose folder part lies inside an output folder, is the user's choice and kept.

    Args:
        sources: Paths and patterns as the user gave them; an :class:`Input` passes as it is.
        exclude: A folder treated as an output folder (the current run's).
        kind: What a folder scan takes: files of the kind of input the model reads (see
            :mod:`explain.io.kinds`); for scans, a folder of DICOM slices is one input, its series (see
            :func:`explain.io.volumes.read_dicom_series`).

    Returns:
        One :class:`Input` per file found, without duplicates, and one carrying an
        error per source that yields nothing.
    """
    scanner = _Scanner(exclude, kind)
    for source in sources:
        if isinstance(source, Input):
            scanner.found.append(source)
            continue
        text, path = str(source), Path(source)
        if path.is_dir():
            if not scanner.scan(path, path):
                scanner.found.append(Input(text, error=f"{text}: no {kind} files in this folder"))
        elif path.exists():
            scanner.add(path, Path(path.name))
        elif _is_pattern(text):
            if not scanner.glob(text):
                scanner.found.append(Input(text, error=f"{text}: no files match"))
        else:
            scanner.found.append(Input(text, error=f"{text}: no such file or directory"))
    return scanner.found


def listed_inputs(list_file: Path, kind: InputKind = IMAGE) -> list[Input]:
    """The files a list names, one path per line (blank lines and lines starting with ``#`` passed over).

    A relative path is taken from the list's folder; a file's outputs keep its path below that folder (or its
    name, for a file elsewhere), without its input suffix of ``kind`` (both parts of ``.nii.gz``). A line naming
    no file gives an :class:`Input` carrying the error.

    Raises:
        ExplainError: The list itself cannot be read.
    """
    try:
        lines = list_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ExplainError(f"{list_file}: cannot read the list of inputs ({err.strerror or err})") from None
    root, found = list_file.parent, []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        path = root / text
        if not path.is_file():
            found.append(Input(text, error=f"{list_file}:{number}: {text}: no such file"))
            continue
        inside = path.resolve().is_relative_to(root.resolve())
        relative = path.resolve().relative_to(root.resolve()) if inside else Path(path.name)
        found.append(Input(str(path), path, _stem(relative, kind)))
    return found
