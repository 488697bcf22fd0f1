"""The manifest of an export: a header of the run's settings, then a record per input and method, appended as
each input completes; what a resumed run can skip; the parts of several processes merged into one.

``OUT/manifest.jsonl`` is JSON lines. Its first line is the header, ``{"header": {...settings}, "schema": ...,
"version": ...}``; every other line is a record (:data:`SCHEMA`), written only after the input's files are whole
(each file is written atomically), flushed at once and synced to disk once per batch. A process killed at any
moment leaves at most one incomplete last line, which the next run drops. The processes of a ``torchrun`` launch
write ``manifest.rank{R}.jsonl`` each; at the end the parts are merged into ``manifest.jsonl`` in input order.

Paths in records are relative to the output folder, so a finished folder can be moved and still resumed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from .. import __version__
from ..errors import ExplainError
from ..io.atomic import write_atomically

MANIFEST = "manifest.jsonl"
PART_GLOB = "manifest.rank*.jsonl"
# Version of the records' fields. 2: one list of explained targets per input; 3: each target's metrics and
# curves (null unless asked); 4: a header line of the run's settings, paths relative to the output folder; 5: each
# target's picture (a video's animated GIF; null for an image, whose overlay is its picture); 6: the answer whose
# words a vision-language model's targets are (null for any other).
SCHEMA = 6


class ResumeError(ExplainError):
    """An output folder that cannot be resumed, or that a fresh run would overwrite: exit status 2."""


def part_name(rank: int) -> str:
    """The manifest part of one process of a distributed run."""
    return f"manifest.rank{rank}.jsonl"


def header(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The first line of a manifest: the run's settings (the package's version among them), the schema, and
    the folder the run started in (inputs are named as given, relative ones from there)."""
    return {"header": {**settings, "version": __version__}, "schema": SCHEMA, "cwd": os.getcwd()}


def record(
    name: str,
    model: str,
    method: str,
    *,
    error: str | None = None,
    targets: list[dict[str, Any]] | None = None,
    layer: str | None = None,
    raw: str | None = None,
    note: str | None = None,
    answer: str | None = None,
) -> dict[str, Any]:
    """A record of one input (as the user named it) and one method: the same fields whatever the options (see
    :data:`SCHEMA`)."""
    return {
        "schema": SCHEMA,
        "input": name,
        "model": model,
        "method": method,
        "layer": layer,
        "targets": targets,
        "answer": answer,
        "raw": raw,
        "note": note,
        "error": error,
    }


def _complete_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a manifest file's complete lines, and the byte length of those lines (an incomplete
    last line, from a process killed while writing it, is not counted)."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    objects = []
    for number, line in enumerate(data[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            objects.append(json.loads(line))
        except ValueError:
            raise ResumeError(
                f"{path}: line {number} is not a manifest record; use --overwrite to start afresh"
            ) from None
    return objects, end


# Each field of a record and the types its value may have; each target's paths.
_FIELDS: dict[str, tuple[type, ...]] = {
    "schema": (int,),
    "input": (str,),
    "model": (str,),
    "method": (str,),
    "layer": (str, type(None)),
    "targets": (list, type(None)),
    "answer": (str, type(None)),
    "raw": (str, type(None)),
    "note": (str, type(None)),
    "error": (str, type(None)),
}


def _record_problem(record: Any, out_dir: Path) -> str | None:
    """What is wrong with one line of a manifest of this schema, or None: a field missing or of another type, or a
    file named outside the output folder."""
    if not isinstance(record, dict):
        return f"a {type(record).__name__}, not a record"
    for field, types in _FIELDS.items():
        if field not in record:
            return f"a record without {field!r}"
        if not isinstance(record[field], types) or isinstance(record[field], bool):
            return f"a record whose {field!r} is a {type(record[field]).__name__}"
    if record["schema"] != SCHEMA:
        return f"a record of schema {record['schema']}, not {SCHEMA}"
    targets = record["targets"] or []
    if not all(isinstance(t, dict) and isinstance(t.get("output"), str) for t in targets):
        return "a record whose targets are not objects naming their output"
    if any(t.get("figure") is not None and not isinstance(t["figure"], str) for t in targets):
        return "a record whose figure is not a path"
    root = out_dir.resolve()
    for name in written_files(record):
        try:
            inside = not Path(name).is_absolute() and (root / name).resolve().is_relative_to(root)
        except RuntimeError:  # Python before 3.13, for a loop of symbolic links
            inside = False
        if not inside:
            return f"a record that names {name!r}, outside the output folder"
    return None


def read_manifest(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """A manifest file's header (None for a manifest of schema 3 or before, which had none) and its records, each
    checked: the documented fields and types, and every file it names inside the output folder.

    Raises:
        ResumeError: A line that is no record of the documented shape, a header of another schema, or records
            of this schema without a header; the message names the line and the problem.
    """
    objects, _ = _complete_lines(path)
    if not objects:
        return None, []
    first = objects[0]
    if not (isinstance(first, dict) and "header" in first):  # an older version's: records only
        if any(isinstance(o, dict) and o.get("schema", 0) >= SCHEMA for o in objects):
            raise ResumeError(f"{path}: line 1 is not the header of the run's settings; use --overwrite")
        return None, objects
    if not isinstance(first["header"], dict) or first.get("schema") != SCHEMA:
        found = first.get("schema")
        newer = isinstance(found, int) and found > SCHEMA
        why = f"written by a newer version of explain (schema {found})" if newer else "its header is not one"
        raise ResumeError(f"{path}: line 1: {why}; use --overwrite, or another -o folder")
    for number, record in enumerate(objects[1:], start=2):
        problem = _record_problem(record, path.parent)
        if problem is not None:
            raise ResumeError(f"{path}: line {number} is {problem}; use --overwrite to start afresh")
    return first, objects[1:]


def manifest_files(out_dir: Path) -> list[Path]:
    """The manifest and the parts of distributed runs found in an output folder."""
    main = out_dir / MANIFEST
    return ([main] if main.is_file() else []) + sorted(out_dir.glob(PART_GLOB))


def previous_run(out_dir: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The header and every record that earlier runs left in an output folder, the manifest's first, then
    the parts'. All headers must agree."""
    head, records = None, []
    for path in manifest_files(out_dir):
        own, found = read_manifest(path)
        if own is None and found:
            raise ResumeError(f"{path}: written by an older version of explain, without settings; use --overwrite")
        if own is not None:
            if head is not None and own["header"] != head["header"]:
                raise ResumeError(f"{path}: its settings differ from those of {out_dir / MANIFEST}; use --overwrite")
            head = head or own
        records += found
    return head, records


def rename_inputs(out_dir: Path, cwd: str, names: Mapping[Path, str]) -> None:
    """Name the inputs of an earlier run's records as the run that resumes it does, so that records match by
    file, not by spelling: a file the new run names otherwise (absolute, or relative to another starting folder)
    takes the new run's name, and a relative name from another starting folder that names none of the new
    run's files becomes absolute, so that no name stands for two files. A manifest file is rewritten
    (atomically) only where a name or the starting folder changes.

    Args:
        out_dir: The output folder.
        cwd: The new run's starting folder.
        names: The new run's name of each of its files (resolved).
    """
    for path in manifest_files(out_dir):
        objects, _ = _complete_lines(path)
        if not objects or "header" not in objects[0]:
            continue
        root = Path(objects[0].get("cwd", "."))
        renamed = []
        for record in objects[1:]:
            file = (root / record["input"]).resolve()
            name = names.get(file) or (record["input"] if root == Path(cwd) else str(file))
            renamed.append({**record, "input": name})
        if renamed == objects[1:] and root == Path(cwd):
            continue
        text = "".join(json.dumps(o) + "\n" for o in [{**objects[0], "cwd": cwd}, *renamed])
        write_atomically(path, lambda temp, text=text: temp.write_text(text, encoding="utf-8"))


def check_settings(out_dir: Path, previous: Mapping[str, Any] | None, settings: Mapping[str, Any]) -> None:
    """Refuse to resume a run whose settings differ from this one's, naming what differs. This run's settings are
    compared as the manifest saved the earlier run's: as JSON values (a region given as a tuple is the list
    saved)."""
    if previous is None:
        return
    old = previous["header"]
    settings = json.loads(json.dumps(settings))
    changed = [key for key in sorted(set(old) | set(settings)) if old.get(key) != settings.get(key)]
    if changed:
        what = "; ".join(f"{key}: {old.get(key)!r} then, {settings.get(key)!r} now" for key in changed)
        raise ResumeError(
            f"{out_dir}: cannot resume a run with other settings ({what}); use another -o folder, "
            "or --overwrite to start afresh"
        )


def written_files(record: Mapping[str, Any]) -> list[str]:
    """The files a record names as written, relative to the output folder."""
    files = [record["raw"]] if record.get("raw") else []
    for target in record.get("targets") or ():
        files += [target[key] for key in ("output", "figure") if target.get(key)]
    return files


def finished(records: Iterable[Mapping[str, Any]], methods: Sequence[str], out_dir: Path) -> set[str]:
    """The inputs a resumed run can skip: a record without error for each method, every file it names there."""
    done: dict[str, set[str]] = {}
    for record in records:
        whole = record["error"] is None and all((out_dir / f).is_file() for f in written_files(record))
        methods_done = done.setdefault(record["input"], set())
        (methods_done.add if whole else methods_done.discard)(record["method"])
    return {name for name, ok in done.items() if ok.issuperset(methods)}


class ManifestWriter:
    """Appends records to one manifest file, opened by its header at the first record (so that a run that
    writes nothing leaves no file); flushes each call's records and syncs the file to disk on :meth:`sync`.
    An incomplete last line left by a killed process is cut off first."""

    def __init__(self, path: Path, head: Mapping[str, Any]) -> None:
        self.path = path
        self.head = head
        self.file: IO[str] | None = None

    @property
    def opened(self) -> bool:
        """Whether anything was appended."""
        return self.file is not None

    def add(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Append records, each one line, and flush them to the operating system."""
        if self.file is None:
            size = _complete_lines(self.path)[1] if self.path.is_file() else 0
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "r+" if self.path.is_file() else "w", encoding="utf-8")  # noqa: SIM115
            self.file.truncate(size)
            self.file.seek(size)
            if size == 0:
                records = [self.head, *records]
        self.file.write("".join(json.dumps(record) + "\n" for record in records))
        self.file.flush()

    def sync(self) -> None:
        """Make what was appended survive a crash of the machine."""
        if self.file is not None:
            os.fsync(self.file.fileno())

    def close(self) -> None:
        """Sync and close the file."""
        if self.file is not None:
            self.sync()
            self.file.close()


def check_fresh(out_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a folder that holds an earlier run's manifest unless the run resumes it or starts afresh."""
    if manifest_files(out_dir) and not resume and not overwrite:
        raise ResumeError(
            f"{out_dir}: holds the manifest of an earlier run; add --resume to continue it, "
            "or --overwrite to start afresh"
        )


def named_outputs(out_dir: Path) -> set[Path]:
    """The files (resolved) that the manifests of an output folder name as written: paths below the folder
    (schema 4 on) or as an older run named them (relative ones taken from the current folder); none where a
    manifest cannot be read."""
    named: set[Path] = set()
    try:
        for path in manifest_files(out_dir):
            for record in read_manifest(path)[1]:
                root = out_dir if record.get("schema", 0) >= 4 else Path()
                named |= {(root / name).resolve() for name in written_files(record)}
    except (OSError, ExplainError):
        return set()
    return named


def remove_run(out_dir: Path) -> None:
    """Start afresh in an output folder: remove the files that its manifests name (those inside the folder, and
    the folders they leave empty), then the manifests. Every other file stays."""
    root = out_dir.resolve()
    for path in sorted(named_outputs(out_dir)):
        if path.is_relative_to(root):
            path.unlink(missing_ok=True)
            for folder in path.parents:
                if folder == root or any(folder.iterdir()):
                    break
                folder.rmdir()
    for path in manifest_files(out_dir):
        path.unlink()


def chosen_records(
    records: Iterable[Mapping[str, Any]], order: Sequence[str] | None = None, methods: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """One record per input and method of records written over one or more runs: one without error wins over
    an error, else the last written; an input that failed as a whole (unreadable) keeps its last error record.

    Args:
        records: Records in the order they were written.
        order: The inputs in the order wanted (default: as they first appear).
        methods: The methods in the order wanted (default: as they first appear).
    """
    by_input: dict[str, dict[str, dict[str, Any]]] = {}
    seen_methods: dict[str, None] = {}
    for record in records:
        slot = by_input.setdefault(record["input"], {})
        kept = slot.get(record["method"])
        if kept is None or record["error"] is None or kept["error"] is not None:
            slot.pop(record["method"], None)
            slot[record["method"]] = dict(record)  # the last written last
        if record["error"] is None:
            seen_methods.setdefault(record["method"])
    methods = list(seen_methods) if methods is None else methods
    chosen = []
    for name in by_input if order is None else order:
        slot = by_input.get(name, {})
        chosen += [slot[m] for m in methods if m in slot] or list(slot.values())[-1:]
    return chosen


def merge(out_dir: Path, head: Mapping[str, Any], order: Sequence[str], methods: Sequence[str]) -> list[dict]:
    """Write ``manifest.jsonl`` anew from every manifest file in the folder (:func:`chosen_records`, in input
    and method order) and remove the parts; returns its records. A manifest that already reads so is left as it
    is (a resumed run that found everything done rewrites nothing)."""
    merged = chosen_records(previous_run(out_dir)[1], order, methods)
    text = "".join(json.dumps(record) + "\n" for record in [dict(head), *merged])
    path = out_dir / MANIFEST
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        write_atomically(path, lambda temp: temp.write_text(text, encoding="utf-8"))
    for part in out_dir.glob(PART_GLOB):
        part.unlink()
    return merged
