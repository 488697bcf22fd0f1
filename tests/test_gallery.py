"""The HTML gallery, loaded in a real browser (headless Chromium, which .ci/run installs where it is absent)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import pytest
from conftest import ASSETS, CAT, COFFEE, manifest
from PIL import Image

import explain
from explain.cli import main

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
if BROWSER is None and os.environ.get("EXPLAIN_REQUIRE_BROWSER"):
    raise RuntimeError("the gallery tests need chromium (apt-get install chromium)")
pytestmark = pytest.mark.skipif(BROWSER is None, reason="chromium not installed (.ci/run installs it)")


class Page(HTMLParser):
    """The cards, image sources and the viewer of a rendered page."""

    def __init__(self) -> None:
        super().__init__()
        self.cards: list[str] = []
        self.sources: list[str] = []
        self.viewer_open = False
        self.text: list[str] = []
        self.scripts = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "figure" and attributes.get("class") == "card":
            self.cards.append(attributes["data-id"])
        if tag == "img" and attributes.get("src"):
            self.sources.append(attributes["src"])
        if tag == "dialog" and "open" in attributes:
            self.viewer_open = True
        if tag == "script":
            self.scripts += 1

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def render(page: Path, fragment: str = "") -> tuple[Page, list[str]]:
    """The page's DOM after its script ran, and what it wrote to the console."""
    run = subprocess.run(
        [
            BROWSER,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
            page.resolve().as_uri() + fragment,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    parsed = Page()
    parsed.feed(run.stdout)
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    return parsed, console


@pytest.fixture(scope="module")
def gallery(tmp_path_factory) -> Path:
    """A finished export of three photos, one unreadable file, two methods, with metrics and the gallery."""
    root = tmp_path_factory.mktemp("gallery")
    photos = root / "photos"
    photos.mkdir()
    for photo in (CAT, COFFEE, ASSETS / "rocket.jpg"):
        shutil.copy(photo, photos / photo.name)
    (photos / "broken.png").write_bytes(b"not an image")
    out = root / "out"
    arguments = ["--model", "efficientnet_lite0", "--method", "gradcam,layercam", "--metrics", "deletion"]
    assert main([str(photos), "-o", str(out), *arguments, "--gallery", "--quiet"]) == 1  # one input failed
    return out


def test_every_card_loads_without_console_errors_and_every_source_exists(gallery) -> None:
    page, console = render(gallery / "index.html")
    records = [r for r in manifest(gallery) if r["error"] is None]
    assert len(page.cards) == sum(len(r["targets"]) for r in records) == 6
    assert console == []
    assert page.sources and all((gallery / unquote(src)).is_file() for src in page.sources)
    for src in page.sources:  # thumbnails: small JPEGs
        with Image.open(gallery / unquote(src)) as thumb:
            assert thumb.format == "JPEG" and max(thumb.size) <= 320
    text = " ".join(page.text)
    assert "Egyptian cat" in text and "espresso" in text and "6 of 6 maps" in text
    assert "broken.png" in text and "not an image" in text  # the failed input is listed with its error
    assert re.search(r"deletion 0\.\d{3}", text)


def test_the_filter_narrows_the_cards_and_a_card_opens_beside_its_original(gallery) -> None:
    page, console = render(gallery / "index.html", "#q=espresso")
    assert console == [] and len(page.cards) == 2 and "2 of 6 maps" in " ".join(page.text)
    page, _ = render(gallery / "index.html", "#q=CHELSEA&sort=score-desc")
    assert len(page.cards) == 2
    page, console = render(gallery / "index.html", "#open=0")
    assert console == [] and page.viewer_open
    shown = [unquote(src) for src in page.sources]
    first = next(r for r in manifest(gallery) if r["error"] is None)
    assert first["targets"][0]["output"] in shown  # the full-size overlay
    assert any(Path(gallery, src).resolve() == Path(first["input"]).resolve() for src in shown)  # the original


def test_a_script_error_would_be_seen(gallery, tmp_path) -> None:
    """The console check above can fail: a page whose script throws is caught."""
    broken = tmp_path / "index.html"
    broken.write_text((gallery / "index.html").read_text().replace('"use strict";', '"use strict"; nothing();'))
    _, console = render(broken)
    assert any("nothing is not defined" in line for line in console)


def test_rebuilt_from_the_manifest_alone(gallery, capsys) -> None:
    before = (gallery / "index.html").read_text()
    (gallery / "index.html").unlink()
    assert main(["--gallery", "-o", str(gallery)]) == 0  # no inputs, no model
    assert (gallery / "index.html").read_text() == before
    assert capsys.readouterr().out.strip() == f"gallery: {gallery / 'index.html'}"
    assert explain.write_gallery(gallery) == gallery / "index.html" and (gallery / "index.html").read_text() == before
    assert main(["--gallery", "-o", str(gallery / "nothing-here")]) == 2
    assert "no manifest of an explain run here" in capsys.readouterr().err


HOSTILE = "<!--<script>alert(1)</script>-->&amp;"
HOSTILE_FILE = "<!--<script>alert(1)&amp;"  # a file name holds no slash


def test_hostile_names_and_labels_leave_the_page_whole(tmp_path) -> None:
    """A file and class name that open a comment and a script in the page's data: every card still shows, and the
    names are shown as text, no script of theirs run."""
    photos = tmp_path / "photos"
    photos.mkdir()
    shutil.copy(CAT, photos / f"{HOSTILE_FILE}.png")
    shutil.copy(COFFEE, photos / "coffee.png")
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(f"{HOSTILE} {i}" for i in range(1000)))
    out = tmp_path / "out"
    assert (
        main([str(photos), "-o", str(out), "--model", "efficientnet_lite0", "--labels", str(labels), "--gallery"]) == 0
    )
    data = (out / "index.html").read_text().split('<script id="data" type="application/json">', 1)[1]
    assert "<" not in data.split("</script>", 1)[0]  # the data holds no '<' that could change how the page parses
    page, console = render(out / "index.html")
    assert console == [] and len(page.cards) == 2 and page.scripts == 2  # the page's data and its script, no other
    text = " ".join(page.text)
    assert f"{HOSTILE} 285" in text and f"{HOSTILE_FILE}.png" in text
