"""The README's API example runs as written and does what its comments say."""

from __future__ import annotations

import contextlib
import io
import shutil

import numpy as np
from conftest import ASSETS, CAT
from PIL import Image


def readme_block(marker: str) -> str:
    """The first python block after ``marker`` in README.md."""
    text = (ASSETS.parent / "README.md").read_text(encoding="utf-8")
    after = text.split(marker, 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_api_round_trip_from_the_readme(tmp_path, monkeypatch) -> None:
    code = readme_block("<!-- api:roundtrip -->")
    assert len(code.strip().splitlines()) < 10
    (tmp_path / "assets").mkdir()
    shutil.copy(CAT, tmp_path / "assets" / "chelsea.png")
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    assert printed.getvalue() == "Egyptian cat bn2\n"
    photo = np.asarray(Image.open(CAT).convert("RGB")).astype(float)
    written = np.asarray(Image.open(tmp_path / "chelsea.cam.png")).astype(float)
    assert written.shape == photo.shape
    residual = (written - 0.5 * photo) / 0.5  # the blended-in colours lie within [0, 255]
    assert residual.min() > -3 and residual.max() < 258 and np.abs(written - photo).mean() > 5


def test_readme_links_and_the_site_cover_every_guide() -> None:
    """Each page the README links exists, and the site's navigation lists every page of docs/."""
    import re

    root = ASSETS.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    linked = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert linked and all((root / path).is_file() for path in linked)
    nav = (root / "mkdocs.yml").read_text(encoding="utf-8")
    pages = {path.relative_to(root / "docs").as_posix() for path in (root / "docs").rglob("*.md")}
    assert pages and all(f": {page}" in nav for page in pages)
