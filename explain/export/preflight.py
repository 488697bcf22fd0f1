"""A run's preflight, once, before any model work and without torch: its inputs found and its output folder
checked (:func:`prepare`). The command line prepares a run before it loads the model and hands the export the
:class:`Prepared` run; a library call of the export prepares its own."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..io.kinds import IMAGE, InputKind
from .inputs import Input, collect_inputs
from .manifest import check_fresh
from .ownership import check_free


@dataclass(frozen=True)
class Prepared:
    """A run whose inputs were found and whose output folder was checked.

    Attributes:
        inputs: Every input found, in order (one carrying an error per source that gave none).
        out_dir: The output folder.
    """

    inputs: list[Input]
    out_dir: Path


def prepare(
    sources: Sequence[str | Path | Input],
    out_dir: str | Path,
    resume: bool,
    overwrite: bool,
    kind: InputKind = IMAGE,
    fresh: Callable[[Path, bool, bool], None] = check_fresh,
) -> Prepared:
    """Find a run's inputs (see :func:`explain.export.inputs.collect_inputs`) and check its output folder: one
    another live run holds is refused, and so is one holding an earlier run's manifest unless the run resumes it
    or starts afresh (``fresh``: the check of the run's kind of manifest). From here on the run holds the folder
    from its first write (its lock).

    Raises:
        FolderInUse: Another live run holds the folder.
        ResumeError: An earlier run's manifest, without ``resume`` or ``overwrite``.
    """
    out_dir = Path(out_dir)
    check_free(out_dir)  # another run's folder is refused before anything is read
    inputs = collect_inputs(sources, exclude=out_dir, kind=kind)
    fresh(out_dir, resume, overwrite)
    return Prepared(inputs, out_dir)
