"""The gallery at data-set scale: 10,000 maps, the page built from the manifest and loaded in headless Chromium.

An output folder is made with a manifest of N records, each naming its own small overlay (a real JPEG); the
gallery is written (thumbnails included) and the page is loaded with ``--dump-dom``. The page records when its
first view was ready, counted from the start of the navigation (HTML and data parsed, the first page of cards
in the DOM). Target (issue "data-set export"): usable at 10,000 images, ready in under a second.

    python benchmarks/bench_gallery.py [--images 10000] [--out benchmarks/results_gallery.md]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from PIL import Image
from timing import emit

from explain.export.gallery import write_gallery
from explain.export.manifest import header, record

CLASSES = ["Egyptian cat", "espresso", "tripod", "military uniform", "drilling platform", "bobsled"]


def make_folder(out: Path, count: int) -> None:
    """An output folder of ``count`` records, each with its own 64x48 overlay."""
    colours = [Image.new("RGB", (64, 48), (40 * i, 255 - 40 * i, 128)) for i in range(len(CLASSES))]
    lines = [json.dumps(header({"model": "synthetic", "method": "gradcam"}))]
    for i in range(count):
        name = f"{i // 1000:02d}/{i:05d}.gradcam.jpg"
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        colours[i % len(CLASSES)].save(out / name, quality=80)
        target = {
            "class_index": i % 1000,
            "class_name": CLASSES[i % len(CLASSES)],
            "score": (i % 997) / 997,
            "box": None,
            "region": None,
            "output": name,
            "figure": None,
            "metrics": None,
            "curves": None,
        }
        lines.append(json.dumps(record(f"data/{i:05d}.jpg", "synthetic", "gradcam", targets=[target], layer="bn2")))
    (out / "manifest.jsonl").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    with tempfile.TemporaryDirectory() as temp:
        out = Path(temp)
        make_folder(out, args.images)
        start = time.perf_counter()
        page = write_gallery(out)
        first_build = time.perf_counter() - start
        start = time.perf_counter()
        write_gallery(out)
        rebuild = time.perf_counter() - start
        size = page.stat().st_size
        ready = []
        for fragment in ("", "#q=espresso&sort=score-desc"):
            dom = subprocess.run(
                [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri() + fragment],
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout
            ready.append(int(re.search(r'data-ready-ms="(\d+)"', dom).group(1)))
            cards = dom.count('class="card"')
    lines = [
        f"{args.images} maps, one 64x48 overlay each; Chromium headless, this 2-core machine.",
        "",
        "| step | value |",
        "|---|---:|",
        f"| write index.html and {args.images} thumbnails | {first_build:.1f} s |",
        f"| rebuild from the manifest (thumbnails kept) | {rebuild:.2f} s |",
        f"| index.html | {size / 1e6:.1f} MB |",
        f"| page ready, first view (from navigation start) | {ready[0]} ms |",
        f"| page ready, filtered and sorted by score | {ready[1]} ms ({cards} cards on its first page) |",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
