"""Renderers: a heatmap in colour, blended onto the original image, and a side-by-side figure."""

from __future__ import annotations

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor


def _as_image(image: Image.Image | np.ndarray) -> np.ndarray:
    array = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ValueError(f"image must be a PIL image or an HxWx3 uint8 array, got {array.dtype} {array.shape}")
    return array


def resize_map(cam: Tensor | np.ndarray, height: int, width: int) -> np.ndarray:
    """Upsample a 2-D map bilinearly (align_corners=False, as the engine does) to (height, width)."""
    values = cam.detach().cpu().float() if isinstance(cam, Tensor) else torch.as_tensor(cam, dtype=torch.float32)
    if values.dim() != 2:
        raise ValueError(f"cam must be a 2-D map, got shape {tuple(values.shape)}")
    resized = F.interpolate(values[None, None], size=(height, width), mode="bilinear", align_corners=False)
    return resized[0, 0].numpy()


def colorize(cam: Tensor | np.ndarray, colormap: str = "jet") -> np.ndarray:
    """Map values in [0, 1] (clipped) through a matplotlib colormap: HxWx3 uint8 RGB."""
    cmap = matplotlib.colormaps[colormap]
    values = np.clip(np.asarray(cam, dtype=np.float32), 0.0, 1.0)
    return (cmap(values)[..., :3] * 255 + 0.5).astype(np.uint8)


def overlay(
    image: Image.Image | np.ndarray,
    cam: Tensor | np.ndarray,
    alpha: float = 0.5,
    colormap: str = "jet",
) -> Image.Image:
    """Blend a coloured heatmap onto an image at the image's own resolution.

    Args:
        image: A PIL image or an HxWx3 uint8 RGB array.
        cam: A 2-D map of any resolution, values in [0, 1] (as :func:`explain.gradcam`
            returns them); it is upsampled bilinearly to the image.
        alpha: Weight of the heatmap, 0 (image only) to 1 (heatmap only).
        colormap: A matplotlib colormap name.

    Returns:
        The RGB overlay, same size as ``image``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    pixels = _as_image(image)
    heat = colorize(resize_map(cam, *pixels.shape[:2]), colormap)
    blended = (1.0 - alpha) * pixels.astype(np.float32) + alpha * heat.astype(np.float32)
    return Image.fromarray(np.clip(blended + 0.5, 0, 255).astype(np.uint8), mode="RGB")


def figure(
    image: Image.Image | np.ndarray,
    cam: Tensor | np.ndarray,
    title: str,
    alpha: float = 0.5,
    colormap: str = "jet",
) -> Image.Image:
    """A side-by-side figure: the image, the heatmap, and the overlay, under ``title``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pixels = _as_image(image)
    heat = resize_map(cam, *pixels.shape[:2])
    height, width = pixels.shape[:2]
    fig = Figure(figsize=(12, 4 * height / width + 0.6), dpi=100)
    canvas = FigureCanvasAgg(fig)
    panels = {"image": pixels, "heatmap": colorize(heat, colormap), "overlay": overlay(pixels, heat, alpha, colormap)}
    for position, (name, panel) in enumerate(panels.items(), start=1):
        axes = fig.add_subplot(1, 3, position)
        axes.imshow(panel)
        axes.set_title(name)
        axes.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    canvas.draw()
    return Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3].copy())
