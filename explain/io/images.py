"""Reading images safely, turning them into model input, and writing outputs atomically."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor

from ..errors import ImageLoadError
from ..warning_filters import warning_filter
from .atomic import write_atomically


def load_image(path: str | Path, max_pixels: int | None = None) -> Image.Image:
    """Read an image as RGB, with its EXIF orientation applied.

    Modes are converted to RGB: transparent images (RGBA, LA, P with
    transparency) are composited on white; 16-bit greyscale is scaled to 8 bits;
    CMYK, L, 1 and the rest through Pillow. Multi-frame files give their first frame.

    Args:
        path: The image file.
        max_pixels: Refuse larger images (decompression bombs); default Pillow's
            ``Image.MAX_IMAGE_PIXELS``.

    Raises:
        ImageLoadError: Missing, empty, truncated, non-image or oversized file; the
            message names the file.
    """
    path = Path(path)
    limit = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    try:
        if path.is_file() and path.stat().st_size == 0:
            raise ImageLoadError(f"{path}: empty file")
        with warning_filter("error", category=Image.DecompressionBombWarning):
            opened = Image.open(path)  # reads the header alone, and warns of a decompression bomb
        with opened as image:
            width, height = image.size
            if limit is not None and width * height > limit:
                raise ImageLoadError(
                    f"{path}: {width}x{height} image exceeds the {limit}-pixel limit (decompression bomb?)"
                )
            image.load()
            ImageOps.exif_transpose(image, in_place=True)  # a copy otherwise, even when nothing turns
            return _to_rgb(image)
    except ImageLoadError:
        raise
    except FileNotFoundError:
        raise ImageLoadError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ImageLoadError(f"{path}: is a directory") from None
    except PermissionError as err:  # the file is there, but not ours to read: not a corrupt image
        raise ImageLoadError(f"{path}: cannot read ({err.strerror})") from None
    except UnidentifiedImageError:
        raise ImageLoadError(f"{path}: not an image, or a format Pillow cannot read") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageLoadError(f"{path}: refused as a possible decompression bomb ({err})") from None
    except OSError as err:
        if err.errno is not None:  # the system's refusal to read (a decoder's OSError has no errno)
            raise ImageLoadError(f"{path}: cannot read ({err.strerror or err})") from None
        raise ImageLoadError(f"{path}: truncated or corrupt image ({' '.join(str(err).split())})") from None
    except (ValueError, SyntaxError, EOFError) as err:
        raise ImageLoadError(f"{path}: truncated or corrupt image ({' '.join(str(err).split())})") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode.startswith("I"):
        values = np.asarray(image, dtype=np.float64)
        top = values.max(initial=0.0)
        scale = 1.0 if top <= 255 else (257.0 if top <= 65535 else top / 255.0)
        return Image.fromarray(np.clip(values / scale, 0, 255).astype(np.uint8)).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def rgb_array(image: Image.Image | np.ndarray) -> np.ndarray:
    """A PIL image (any mode, converted) or an HxWx3 uint8 RGB array, as an HxWx3 uint8 array.

    Raises:
        ValueError: An array of another shape or dtype.
    """
    if isinstance(image, Image.Image) and image.mode != "RGB":
        image = image.convert("RGB")
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ValueError(f"image must be a PIL image or an HxWx3 uint8 array, got {array.dtype} {array.shape}")
    return array


def input_size(image: Image.Image, size: int, keep_aspect: bool) -> tuple[int, int]:
    """The (width, height) an image is resized to: ``size`` square, or short side ``size``."""
    if not keep_aspect:
        return size, size
    width, height = image.size
    scale = size / min(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def to_tensor(
    image: Image.Image,
    size: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    resample: Image.Resampling = Image.Resampling.BICUBIC,
) -> Tensor:
    """Resize the whole image to ``size`` (width, height) and normalize it: (3, H, W) float32."""
    array = np.asarray(image.resize(size, resample), dtype=np.float32) / 255.0
    pixels = torch.from_numpy(array).permute(2, 0, 1)
    return (pixels - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]


def save_image(image: Image.Image, path: Path) -> None:
    """Write a PIL image atomically: JPEG (quality 90) for .jpg/.jpeg, else PNG (fast zlib level 1)."""
    jpeg = path.suffix.lower() in (".jpg", ".jpeg")
    options = {"format": "JPEG", "quality": 90} if jpeg else {"format": "PNG", "compress_level": 1}
    write_atomically(path, lambda temp: image.save(temp, **options))


def save_array(array: np.ndarray, path: Path) -> None:
    """Write a numpy array atomically as ``.npy``."""

    def write(temp: Path) -> None:
        with open(temp, "wb") as f:
            np.save(f, array)

    write_atomically(path, write)
