"""Reading images: orientation, modes, and clear per-file errors."""

from __future__ import annotations

import os
import threading
import time
import warnings

import numpy as np
import pytest
from PIL import Image

import explain
from explain.io.images import input_size, load_image, save_image, to_tensor
from explain.warning_filters import warning_filter


def test_exif_orientation_is_applied(tmp_path) -> None:
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :20] = (255, 0, 0)  # left half red
    pixels[:, 20:] = (0, 0, 255)  # right half blue
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = tmp_path / "rotated.png"
    image.save(path, exif=exif)

    loaded = np.asarray(load_image(path))

    assert loaded.shape == (40, 20, 3)
    assert np.array_equal(loaded, np.rot90(pixels, k=-1))  # red on top after a clockwise turn


def palette_image(colour: tuple[int, int, int]) -> Image.Image:
    image = Image.new("P", (4, 4), 1)
    image.putpalette([0, 0, 0, *colour] + [0] * 762)
    return image


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: Image.new("L", (4, 4), 77), (77, 77, 77)),
        (lambda: Image.new("LA", (4, 4), (77, 0)), (255, 255, 255)),
        (lambda: Image.new("LA", (4, 4), (77, 255)), (77, 77, 77)),
        (lambda: Image.new("RGBA", (4, 4), (10, 20, 30, 255)), (10, 20, 30)),
        (lambda: Image.new("RGBA", (4, 4), (10, 20, 30, 0)), (255, 255, 255)),
        (lambda: palette_image((10, 200, 30)), (10, 200, 30)),
        (lambda: Image.new("CMYK", (4, 4), (0, 255, 255, 0)), (255, 0, 0)),
        (lambda: Image.fromarray(np.full((4, 4), 257 * 100, np.uint16)), (100, 100, 100)),
    ],
    ids=["L", "LA-clear", "LA-opaque", "RGBA-opaque", "RGBA-clear", "P", "CMYK", "I;16"],
)
def test_modes_become_rgb(tmp_path, make, expected) -> None:
    image = make()
    path = tmp_path / ("image.tif" if image.mode == "CMYK" else "image.png")
    image.save(path)
    loaded = load_image(path)
    assert loaded.mode == "RGB"
    assert loaded.getpixel((1, 1)) == expected


def test_transparent_palette_image(tmp_path) -> None:
    image = Image.new("P", (4, 4), 0)
    image.putpalette([9, 9, 9] * 256)
    image.info["transparency"] = 0
    path = tmp_path / "clear.png"
    image.save(path, transparency=0)
    assert load_image(path).getpixel((0, 0)) == (255, 255, 255)


def broken_files(tmp_path):
    good = tmp_path / "good.png"
    Image.new("RGB", (64, 64), (1, 2, 3)).save(good)
    data = good.read_bytes()
    files = {
        "empty.png": b"",
        "truncated.png": data[: len(data) // 2],
        "notes.jpg": b"these are words, not pixels\n",
    }
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    return files


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("empty.png", "empty file"),
        ("truncated.png", "truncated or corrupt"),
        ("notes.jpg", "not an image"),
        ("missing.png", "no such file"),
    ],
)
def test_unreadable_files_are_named_in_one_line(tmp_path, name: str, message: str) -> None:
    broken_files(tmp_path)
    with pytest.raises(explain.ImageLoadError) as caught:
        load_image(tmp_path / name)
    text = str(caught.value)
    assert text.startswith(str(tmp_path / name)) and message in text and "\n" not in text


def test_decompression_bomb_is_refused(tmp_path, monkeypatch) -> None:
    path = tmp_path / "big.png"
    Image.new("L", (30, 30)).save(path)
    with pytest.raises(explain.ImageLoadError, match="30x30 image exceeds the 899-pixel limit"):
        load_image(path, max_pixels=899)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(explain.ImageLoadError, match="decompression bomb"):
        load_image(path)


def test_warning_filters_of_threads_at_once_are_kept_apart(tmp_path) -> None:
    """Threads that read images (each turning Pillow's bomb warning into an error) while another sets its own
    filters: each sees its own filter throughout, and the process's filters end as they began. Unguarded
    ``warnings.catch_warnings`` blocks that overlap restore each other's lists and leave filters behind."""
    path = tmp_path / "big.png"
    Image.new("L", (30, 30)).save(path)
    before, seen = list(warnings.filters), []

    def read(i: int) -> None:
        for _ in range(20):
            with pytest.raises(explain.ImageLoadError, match="decompression bomb"):
                load_image(path)
            with warning_filter("ignore", message=f"thread {i}"):
                seen.append(any(f[1] is not None and f[1].pattern == f"thread {i}" for f in warnings.filters))
                time.sleep(0.001)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # 900 pixels: Pillow warns, the filter makes it an error
        threads = [threading.Thread(target=read, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(seen) == 80 and all(seen)
    assert warnings.filters == before


def test_to_tensor_normalizes_whole_image() -> None:
    image = Image.new("RGB", (30, 10), (255, 0, 128))
    x = to_tensor(image, input_size(image, 8, keep_aspect=False), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert x.shape == (3, 8, 8)
    assert x[0].eq(1).all() and x[1].eq(-1).all()
    assert input_size(image, 8, keep_aspect=True) == (24, 8)


def test_save_is_atomic_and_leaves_nothing_on_failure(tmp_path) -> None:
    target = tmp_path / "out" / "x.png"
    old_umask = os.umask(0o022)
    try:
        save_image(Image.new("RGB", (5, 4)), target)
    finally:
        os.umask(old_umask)
    assert Image.open(target).size == (5, 4)
    assert target.stat().st_mode & 0o777 == 0o644
    bad = Image.new("RGB", (5, 4))
    bad.save = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        save_image(bad, tmp_path / "out" / "y.png")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["x.png"]
