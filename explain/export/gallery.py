"""The HTML gallery of an export: ``OUT/index.html``, built from the manifest alone.

One self-contained page (inline CSS and script, nothing fetched from the network) with a card per explained
target: a thumbnail (a small JPEG under ``OUT/thumbs/``, lazy-loaded), the input's name, the class and its
score, the method and layer, and the metrics where they were measured. The page filters by class or file name,
sorts by score, pages through any number of cards, and shows the full-size overlay beside the original on a
click; the inputs without a map are listed with their error or note. Its state lives in the address's
fragment (``#q=cat&sort=score-desc&page=2``; ``open=ID`` opens a card), so a view can be shared.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote

from PIL import Image

from ..errors import ExplainError
from ..io.atomic import write_atomically
from ..io.kinds import IMAGE
from .manifest import chosen_records, previous_run

PAGE = "index.html"
THUMBS = "thumbs"
THUMB_SIDE = 320  # the longest side of a thumbnail, in pixels
PAGE_SIZE = 120  # cards per page


def _url(path: Path, out_dir: Path) -> str:
    """A file as the page links it: its path relative to the output folder, percent-encoded."""
    return quote(Path(os.path.relpath(path, out_dir)).as_posix())


def _picture(path: Path) -> bool:
    """Whether an input file is there and a page shows it as a picture (an image; a video is no ``<img>``)."""
    return path.suffix.lower() in IMAGE.suffixes and path.is_file()


def thumbnail(overlay: Path, thumb: Path) -> None:
    """Write a small JPEG of an overlay (longest side :data:`THUMB_SIDE`), unless a newer one is there."""
    if thumb.is_file() and thumb.stat().st_mtime >= overlay.stat().st_mtime:
        return
    with Image.open(overlay) as image:
        image.draft("RGB", (THUMB_SIDE, THUMB_SIDE))  # a JPEG decodes at a fraction of its size
        small = image.convert("RGB")
        small.thumbnail((THUMB_SIDE, THUMB_SIDE))
    write_atomically(thumb, lambda temp: small.save(temp, format="JPEG", quality=85))


def gallery_data(out_dir: Path) -> dict[str, Any]:
    """The page's data from the output folder's manifest: its cards (one per map: a class, a box, a word, ...),
    and the inputs without a map.

    Raises:
        ExplainError: The folder holds no manifest.
    """
    head, records = previous_run(out_dir)
    records = chosen_records(records)
    if head is None:
        raise ExplainError(f"{out_dir}: no manifest of an explain run here to build a gallery from")
    root = Path(head.get("cwd", "."))
    cards, problems, thumbs = [], [], []
    for record in records:
        if record["error"] or record["note"]:
            kind = "error" if record["error"] else "note"
            problems.append({"input": record["input"], "kind": kind, "text": record[kind]})
            continue
        original = root / record["input"]
        for target in record["targets"]:
            shown = target.get("picture") or target["output"]  # a video's animated GIF, an image's overlay
            overlay = out_dir / shown
            if not overlay.is_file():
                problems.append({"input": record["input"], "kind": "error", "text": f"{overlay}: missing"})
                continue
            thumb = out_dir / THUMBS / Path(shown).with_suffix(".jpg")
            thumbs.append((overlay, thumb))
            cards.append(
                {
                    "id": len(cards),
                    "input": record["input"],
                    "class_name": target["class_name"],
                    "score": target["score"],
                    "method": record["method"],
                    "layer": record["layer"],
                    "metrics": target.get("metrics") or {},
                    "thumb": _url(thumb, out_dir),
                    "full": _url(overlay, out_dir),
                    "original": _url(original.resolve(), out_dir.resolve()) if _picture(original) else None,
                }
            )
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda pair: thumbnail(*pair), thumbs))
    return {"cards": cards, "problems": problems, "page_size": PAGE_SIZE}


def embedded(data: Any) -> str:
    """``data`` as JSON that a page's ``<script>`` element holds as it is: every ``<``, ``>`` and ``&`` escaped, so
    that no name, label or note in it can close the element or open a comment or a script state there."""
    text = json.dumps(data)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_gallery(out_dir: str | Path) -> Path:
    """Write ``index.html`` and the thumbnails for an output folder from its manifest; returns the page.

    Raises:
        ExplainError: The folder holds no manifest.
    """
    out_dir = Path(out_dir)
    data = embedded(gallery_data(out_dir))
    template = resources.files("explain").joinpath("data", "gallery.html").read_text(encoding="utf-8")
    page = out_dir / PAGE
    write_atomically(page, lambda temp: temp.write_text(template.replace("/*DATA*/", data), encoding="utf-8"))
    return page


def remove_gallery(out_dir: Path) -> None:
    """Remove an output folder's gallery page and thumbnails (a run that starts afresh makes them stale)."""
    (out_dir / PAGE).unlink(missing_ok=True)
    shutil.rmtree(out_dir / THUMBS, ignore_errors=True)
