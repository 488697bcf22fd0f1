"""The export of what a vision-language model says or sees, for each image: one overlay per word of its answer
(``--prompt``, or ``--answer`` given), per text prompt (``--text``), or per box an open-vocabulary detector finds
for the text queries (``--text``, its box drawn), a strip of them all, the maps as ``.npy`` where asked, and a
record in the run's manifest of words (:data:`MANIFEST`: the run's settings on its first line, then one JSON line
per image). Which words an image has is its task's (:mod:`explain.tasks.language`).

A run resumed (``resume``) with the same settings skips the images an earlier run finished, whose files are all
there, and rewrites nothing when none is left; a run stopped at any moment loses only the image it was on.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from ..errors import ExplainError, LayerError, NothingToExplain, first_line
from ..io.atomic import write_atomically
from ..io.images import load_image, save_array, save_image
from ..io.render import annotate, grid, overlay
from ..models.text_image import TextImageSpec
from ..tasks.asked import slug
from ..tasks.language import Word, WordsRequest
from ..tasks.registry import words_task_of
from .distributed import this_process
from .inputs import Input
from .manifest import WORDS_MANIFEST, ResumeError, check_settings, header
from .ownership import FolderLock
from .preflight import Prepared, prepare

MANIFEST = WORDS_MANIFEST
STRIP_COLUMNS = 6  # words per row of the strip figure


def words_settings(spec: TextImageSpec, request: WordsRequest, weights: str) -> dict[str, Any]:
    """What decides a run's words, for its manifest's first line: a resumed run must have the same."""
    asked = {key: getattr(request, key) for key in ("prompt", "answer", "max_new_tokens", "method", "score_threshold")}
    return {"model": spec.name, "weights_sha256": weights, **asked, "texts": list(request.texts),
            "layer": request.layer, "alpha": request.alpha, "colormap": request.colormap,
            "save_raw": request.save_raw, "fmt": request.fmt}  # fmt: skip


def explain_words(
    spec: TextImageSpec,
    inputs: Sequence[Input] | Prepared,
    out: Path,
    request: WordsRequest,
    report: Callable[[dict[str, Any]], None],
    settings: Mapping[str, Any],
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = False,
) -> tuple[list[dict[str, Any]], int]:
    """Explain each image not finished before, write its files and its record; an image that fails gets its error
    in its record, and the others go on. The output folder is held for the run.

    ``inputs``: the images, or the run the caller prepared (:func:`explain.export.preflight.prepare`, with
    :func:`check_words_fresh`). ``progress``: a progress bar on stderr (where it is a terminal). The run is one
    process's: a ``torchrun`` launch is refused.

    Returns:
        Each image's record, in order (those of an earlier run kept as they were), and how many were skipped.

    Raises:
        ResumeError: The folder holds an earlier run's words and neither ``resume`` nor ``overwrite`` is set, or
            the run to resume had other settings.
        LayerError: The request's layer is not one of the model's.
    """
    if this_process().world > 1:
        raise ExplainError("a vision-language run explains its images in one process: launch it without torchrun")
    if not isinstance(inputs, Prepared):
        inputs = prepare(inputs, out, resume, overwrite, fresh=check_words_fresh)
    inputs, manifest = inputs.inputs, out / MANIFEST
    head, lock = header(settings), FolderLock(out)
    try:
        if out.is_dir():  # else taken at the first write: a run refused at its first image leaves no folder
            lock.take()
        previous, kept = _previous(manifest) if resume else (None, [])
        check_settings(out, previous, head["header"])
        done = {r["input"]: r for r in kept if r["error"] is None and _whole(out, r)}
        todo = [item for item in inputs if item.name not in done]
        records = [r for r in kept if r["input"] in done]
        for item in tqdm(todo, unit="image", disable=None if progress else True, file=sys.stderr):
            found = _recorded(spec, item, out, request, lock)
            records.append(found)
            _write(manifest, [head, *records])
            report(found)
    finally:
        lock.release()
    by_input = {r["input"]: r for r in records}
    return [by_input[item.name] for item in inputs], len(inputs) - len(todo)


def check_words_fresh(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a folder that holds an earlier run's words, unless the run resumes it or starts afresh.

    Raises:
        ResumeError: Naming the way out.
    """
    if (out / MANIFEST).is_file() and not (resume or overwrite):
        raise ResumeError(
            f"{out}: holds the words of an earlier run ({MANIFEST}); add --resume to continue it, or --overwrite to "
            "start afresh"
        )


def _previous(manifest: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """An earlier run's first line and records; none where it left no manifest."""
    if not manifest.is_file():
        return None, []
    lines = [json.loads(line) for line in manifest.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines or "header" not in lines[0]:
        raise ResumeError(f"{manifest}: written by an older explain, without its settings; add --overwrite")
    return lines[0], lines[1:]


def _whole(out: Path, record: Mapping[str, Any]) -> bool:
    """Whether every file a record of words names is there."""
    files = [token["output"] for token in record.get("tokens") or ()]
    files += [record[key] for key in ("figure", "raw") if record.get(key)]
    return all((out / name).is_file() for name in files)


def _recorded(spec: TextImageSpec, item: Input, out: Path, request: WordsRequest, lock: FolderLock) -> dict:
    """One input explained and its record; its error is its record's. A wrong layer stops the run. The folder is
    held before anything is written."""
    try:
        if item.path is None:
            raise ExplainError(item.error or f"{item.name}: not found")
        image = load_image(item.path)
        words, record = words_of_image(spec, image, request)
    except NothingToExplain as err:  # no box above the threshold: nothing to draw, and no failure
        record = {"input": item.name, "note": first_line(err), "error": None}
    except LayerError:
        raise
    except ExplainError as err:
        record = {"input": item.name, "error": first_line(err)}
    lock.take()
    if "error" in record:
        return record
    return _written(spec, item, image, words, record, out, request)


def _written(
    spec: TextImageSpec,
    item: Input,
    image: Image.Image,
    words: list[Word],
    record: dict[str, Any],
    out: Path,
    request: WordsRequest,
) -> dict[str, Any]:
    """One image's words drawn and written under ``out`` (its outputs' path without suffix as its input's), and
    its whole record, which names the files relative to ``out``."""
    relative = item.relative or Path(item.path.stem)
    tokens = []
    for i, word in enumerate(words):
        tag = f"{i:02d}.{slug(word.text) or 'token'}.{request.method}"
        name = relative.with_name(f"{relative.name}.{tag}.{request.fmt}")
        save_image(drawn(image, word, request.alpha, request.colormap), out / name)
        entry = {"index": i, "text": word.text, "score": round(word.score, 6), "output": str(name)}
        tokens.append(entry if word.box is None else {**entry, "box": [round(v, 2) for v in word.box]})
    strip = relative.with_name(f"{relative.name}.words.{request.method}.{request.fmt}")
    panels = {f"{i} {word.text}": word.cam for i, word in enumerate(words)}
    title = f"{item.path.name} · {request.method} · {record.get('answer') or ', '.join(request.texts)}"
    columns = min(STRIP_COLUMNS, len(panels) + 1)
    save_image(grid(image, panels, title, request.alpha, request.colormap, columns=columns), out / strip)
    raw = relative.with_name(f"{relative.name}.words.{request.method}.npy") if request.save_raw else None
    if raw is not None:  # every word's map over the image, (words, H, W)
        save_array(torch.stack([word.cam for word in words]).float().numpy().astype(np.float32), out / raw)
    return {"input": item.name, "model": spec.name, "method": request.method, **record, "tokens": tokens,
            "figure": str(strip), "raw": None if raw is None else str(raw), "error": None}  # fmt: skip


def words_of_image(spec: TextImageSpec, image: Image.Image, request: WordsRequest) -> tuple[list[Word], dict[str, Any]]:
    """An image's words (its answer's, its prompts, or its boxes' queries, as the model's task has them) with their
    maps, and what a record says of them.

    Raises:
        ExplainError: The request does not suit the model, or the image cannot be explained.
    """
    return words_task_of(spec).words(spec, image, request)


def drawn(image: Image.Image, word: Word, alpha: float = 0.5, colormap: str = "jet") -> Image.Image:
    """A word's map over the image, its box drawn with its query and score where it has one."""
    picture = overlay(image, word.cam, alpha, colormap)
    if word.box is not None:
        picture = annotate(picture, f"{word.text} {word.score:.2f}", tuple(word.box))
    return picture


def _write(manifest: Path, lines: Sequence[Mapping[str, Any]]) -> None:
    """The manifest of words, whole: its first line and the records so far, written atomically."""
    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    write_atomically(manifest, lambda temp: temp.write_text(text, encoding="utf-8"))
