"""Renderers: a heatmap in colour, blended onto the original image; guided maps as images; figures and grids."""

from __future__ import annotations

import base64
import functools
import html
import io
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

from .images import rgb_array

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def resize_map(cam: Tensor | np.ndarray, height: int, width: int) -> np.ndarray:
    """Upsample a 2-D map bilinearly (align_corners=False, as the engine does) to (height, width)."""
    values = cam.detach().cpu().float() if isinstance(cam, Tensor) else torch.as_tensor(cam, dtype=torch.float32)
    if values.dim() != 2:
        raise ValueError(f"cam must be a 2-D map, got shape {tuple(values.shape)}")
    resized = F.interpolate(values[None, None], size=(height, width), mode="bilinear", align_corners=False)
    return resized[0, 0].numpy()


@functools.lru_cache(maxsize=16)
def _colours(colormap: str) -> np.ndarray:
    """A matplotlib colormap's table as (N, 3) uint8 RGB."""
    cmap = matplotlib.colormaps[colormap]
    return (cmap(np.arange(cmap.N))[:, :3] * 255 + 0.5).astype(np.uint8)


def colorize(cam: Tensor | np.ndarray, colormap: str = "jet") -> np.ndarray:
    """Map values in [0, 1] (clipped) through a matplotlib colormap: HxWx3 uint8 RGB.

    The same colours as ``colormap(values)``, which picks entry ``int(value * N)`` of its N-entry table (1
    picks the last), looked up in the table at once rather than computed as floats per pixel.
    """
    colours = _colours(colormap)
    index = np.asarray(cam, dtype=np.float32) * np.float32(len(colours))
    np.clip(index, 0, len(colours) - 1, out=index)
    if len(colours) > 256:
        return np.take(colours, index.astype(np.intp), axis=0)
    paletted = Image.fromarray(index.astype(np.uint8), mode="P")  # Pillow looks the table up in C
    paletted.putpalette(colours.tobytes())
    return np.asarray(paletted.convert("RGB"))


def heat_layer(cam: Tensor | np.ndarray, height: int, width: int, colormap: str = "jet") -> np.ndarray:
    """A map upsampled bilinearly to (height, width) and coloured: the layer an overlay blends onto its image,
    HxWx3 uint8 RGB."""
    return colorize(resize_map(cam, height, width), colormap)


def blend(pixels: np.ndarray, heat: np.ndarray, alpha: float = 0.5) -> Image.Image:
    """``(1 - alpha) * pixels + alpha * heat``, rounded: two HxWx3 uint8 layers as one RGB image (what a browser
    draws for the heat layer at opacity ``alpha`` over the pixels)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    blended = heat.astype(np.float32)
    blended -= pixels  # in place: (1 - alpha) * pixels + alpha * heat, rounded, in four passes over memory
    blended *= alpha
    blended += pixels
    blended += 0.5  # at most 255.5, which the cast truncates to 255
    return Image.fromarray(blended.astype(np.uint8), mode="RGB")


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
    pixels = rgb_array(image)
    return blend(pixels, heat_layer(cam, *pixels.shape[:2], colormap), alpha)


def gradient_image(cam: Tensor | np.ndarray, height: int, width: int) -> Image.Image:
    """A guided map (3, h, w) with values in [0, 1] (as the guided methods return them) as an RGB image."""
    values = torch.as_tensor(cam).detach().cpu().float()
    if values.dim() != 3 or values.shape[0] != 3:
        raise ValueError(f"a guided map must be (3, H, W), got shape {tuple(values.shape)}")
    resized = F.interpolate(values[None], size=(height, width), mode="bilinear", align_corners=False)[0]
    pixels = (resized.clamp(0, 1) * 255 + 0.5).to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(pixels, mode="RGB")


def picture(
    image: Image.Image | np.ndarray, cam: Tensor | np.ndarray, alpha: float = 0.5, colormap: str = "jet"
) -> Image.Image:
    """What a method's map looks like on an image: a heatmap overlay, or the guided image (3-D maps)."""
    pixels = rgb_array(image)
    if np.ndim(cam) == 3:
        return gradient_image(cam, *pixels.shape[:2])
    return overlay(pixels, cam, alpha, colormap)


def input_picture(x: Tensor) -> np.ndarray:
    """An input image (C, H, W) of any normalization as HxWx3 uint8 RGB: each channel min-max scaled; an input
    of another channel count than three drawn grey, as the mean of its channels."""
    values = x.detach().cpu().float()
    if values.shape[0] != 3:
        values = values.mean(dim=0, keepdim=True).expand(3, -1, -1)
    low = values.amin(dim=(1, 2), keepdim=True)
    spread = (values.amax(dim=(1, 2), keepdim=True) - low).clamp_min(1e-12)
    return ((values - low) / spread * 255 + 0.5).to(torch.uint8).permute(1, 2, 0).numpy()


BAND_HEIGHT = 32  # a signal's map drawn as a band of this many pixels


def map_picture(
    cam: Tensor | np.ndarray, x: Tensor | None = None, alpha: float = 0.5, colormap: str = "jet"
) -> Image.Image:
    """One map as a picture, on its input where given (see :meth:`explain.CAMResult.pictures`).

    Args:
        cam: A heatmap (*spatial) in [0, 1], or a guided map (C, *spatial) when ``x`` is given.
        x: The input it explains, (C, *spatial), or None.
        alpha: Weight of the heatmap over the input.
        colormap: A matplotlib colormap name.
    """
    values = torch.as_tensor(cam).detach().cpu().float()
    guided = x is not None and values.dim() == x.dim()
    if guided and values.shape[0] != 3:  # a guided map of other than three channels: its channels' mean
        values, guided = values.mean(dim=0), False
    if values.dim() - guided == 3:  # a volume or a clip: the slice or frame of the map's peak
        heat = values.abs().sum(dim=0) if guided else values
        depth = int(heat.flatten(1).amax(dim=1).argmax())
        values = values[:, depth] if guided else values[depth]
        x = None if x is None else x[:, depth]
    if values.dim() == 1:  # a signal
        return Image.fromarray(colorize(values[None].expand(BAND_HEIGHT, -1).numpy(), colormap))
    if x is None:
        return Image.fromarray(colorize(values.numpy(), colormap))
    return picture(input_picture(x), values, alpha, colormap)


def data_uri(image: Image.Image | np.ndarray, fmt: str = "PNG") -> str:
    """A picture encoded inline, as an HTML ``src``: ``data:image/png;base64,...``."""
    buffer = io.BytesIO()
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode('ascii')}"


def html_grid(pictures: list[Image.Image], captions: list[str], width: int = 224) -> str:
    """Pictures in a wrapping grid, each ``width`` pixels wide over its caption: an HTML fragment with the
    pictures inline as PNG."""
    figures = []
    for shown, caption in zip(pictures, captions):
        text = html.escape(caption)
        figures.append(
            f'<figure style="margin:4px;width:{width}px"><img src="{data_uri(shown)}" alt="{text}" '
            f'style="width:100%"><figcaption style="font-size:12px">{text}</figcaption></figure>'
        )
    return f'<div class="explain-result" style="display:flex;flex-wrap:wrap">{"".join(figures)}</div>'


BOX_COLOUR = (255, 255, 255)  # white: distinct from every colour of the jet map that it is drawn over
OUTLINE_COLOUR = (255, 255, 255)


def outline(mask: Tensor | np.ndarray, height: int, width: int, thickness: int = 1) -> np.ndarray:
    """The boundary pixels of a region, at (height, width): the region resized (nearest) minus its
    3x3 erosion, thickened to ``thickness`` pixels. Returns a boolean (height, width) array."""
    region = torch.as_tensor(mask).detach().cpu().float()[None, None] > 0
    region = F.interpolate(region.float(), size=(height, width), mode="nearest-exact")
    eroded = -F.max_pool2d(-region, 3, stride=1, padding=1)  # a 3x3 minimum; the image's border does not count
    edge = region - eroded
    if thickness > 1:
        edge = F.max_pool2d(edge, 2 * (thickness // 2) + 1, stride=1, padding=thickness // 2)
    return (edge[0, 0] > 0).numpy() & (region[0, 0] > 0).numpy()


@dataclass(frozen=True)
class Skeleton:
    """A detection's pose to draw: its keypoints (x, y in the picture's pixels, and visibility) and the limbs
    joining them, as pairs of keypoint indices. A keypoint whose visibility is under ``visible`` is left out, and
    so are its limbs."""

    keypoints: Sequence[Sequence[float]]
    limbs: Sequence[tuple[int, int]] = ()
    visible: float = 0.5

    def draw(self, draw: ImageDraw.ImageDraw, thickness: int) -> None:
        """The limbs as lines and the keypoints as small dots, in the box colour."""
        shown = [k[2] >= self.visible for k in self.keypoints]
        for a, b in self.limbs:
            if shown[a] and shown[b]:
                draw.line(
                    [tuple(self.keypoints[a][:2]), tuple(self.keypoints[b][:2])], fill=BOX_COLOUR, width=thickness
                )
        radius = thickness
        for (x, y, _), seen in zip(self.keypoints, shown):
            if seen:
                draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=BOX_COLOUR)


def annotate(
    picture: Image.Image,
    label: str,
    box: tuple[float, float, float, float] | None = None,
    region: Tensor | np.ndarray | None = None,
    point: Sequence[float] | None = None,
    polygon: Sequence[Sequence[float]] | None = None,
    skeleton: Skeleton | None = None,
) -> Image.Image:
    """Draw what a map explains on its picture: a detection's box (image pixels), or a segment's outline
    (a mask of any resolution, resized to the picture), a keypoint's position (a ringed dot) over its
    detection's skeleton, an oriented box's corners (its outline), and a label at its top left corner."""
    annotated, corner = picture.copy(), (0.0, 0.0)
    width, height = annotated.size
    thickness = max(2, round(min(width, height) / 200))
    if region is not None:
        pixels = np.asarray(annotated).copy()
        edge = outline(region, height, width, thickness)
        pixels[edge] = OUTLINE_COLOUR
        annotated = Image.fromarray(pixels)
        rows, cols = np.nonzero(edge)
        if len(rows):
            corner = (float(cols.min()), float(rows.min()))
    draw = ImageDraw.Draw(annotated)
    if box is not None:
        draw.rectangle(box, outline=BOX_COLOUR, width=thickness)
        corner = (box[0], box[1])
    if polygon is not None:
        corners = [tuple(corner) for corner in polygon]
        draw.line([*corners, corners[0]], fill=BOX_COLOUR, width=thickness)
        corner = (min(c[0] for c in corners), min(c[1] for c in corners))
    if skeleton is not None:
        skeleton.draw(draw, max(1, thickness // 2))
    if point is not None:
        radius = 2 * thickness
        x, y = point
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=BOX_COLOUR, outline=(0, 0, 0), width=1)
    if not label:
        return annotated
    font = ImageFont.load_default(size=max(10, round(min(width, height) / 30)))
    _, _, right, bottom = draw.textbbox((0, 0), label, font=font)
    x = min(max(0.0, corner[0]), max(0.0, width - right))
    y = max(0.0, corner[1] - bottom) if corner[1] >= bottom else corner[1]
    draw.rectangle((x, y, x + right, y + bottom), fill=BOX_COLOUR)
    draw.text((x, y), label, fill=(0, 0, 0), font=font)
    return annotated


MAX_ASPECT = 4.0  # the tallest (or widest) panel box a figure draws, as height over width


def panel_figure(
    panels: Mapping[str, np.ndarray | Image.Image], title: str, columns: int, colormap: str = "jet"
) -> Figure:
    """A matplotlib figure of images in a grid of ``columns``, each under its name, the whole under ``title``.

    A panel is an RGB image, or a 2-D map in [0, 1], drawn with ``colormap`` and a colour
    bar. Matplotlib's constrained layout places the titles, so none overlaps an image or
    another title, whatever the images' aspect. A panel's box follows the images' aspect up to
    ``MAX_ASPECT`` either way, so the canvas stays bounded for a strip one pixel wide; the image keeps
    its own aspect inside the box.
    """
    from matplotlib.figure import Figure

    first = np.asarray(next(iter(panels.values())))
    height, width = first.shape[:2]
    aspect = min(max(height / width, 1 / MAX_ASPECT), MAX_ASPECT)
    rows = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(4 * columns, rows * 4 * aspect + 0.8), dpi=100, layout="constrained")
    for position, (name, panel) in enumerate(panels.items(), start=1):
        axes = fig.add_subplot(rows, columns, position)
        shown = axes.imshow(panel, cmap=colormap, vmin=0.0, vmax=1.0)
        if np.ndim(panel) == 2:
            fig.colorbar(shown, ax=axes, shrink=0.8)
        axes.set_title(name)
        axes.axis("off")
    fig.suptitle(title)
    return fig


def rendered(fig: Figure) -> Image.Image:
    """A matplotlib figure drawn off-screen, as an RGB image."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3].copy())


Marker = Callable[[Image.Image], Image.Image]  # draws what a map explains (a box, an outline) on a picture


def _unmarked(picture: Image.Image) -> Image.Image:
    return picture


def figure(
    image: Image.Image | np.ndarray,
    cam: Tensor | np.ndarray,
    title: str,
    alpha: float = 0.5,
    colormap: str = "jet",
    mark: Marker = _unmarked,
) -> Image.Image:
    """A side-by-side figure under ``title``: the image, the heatmap with a colour bar, and the
    overlay (or, for a guided map, the image and the guided image); ``mark`` draws on the pictures."""
    pixels = rgb_array(image)
    plain = mark(Image.fromarray(pixels))
    if np.ndim(cam) == 3:
        return rendered(panel_figure({"image": plain, "guided": mark(picture(pixels, cam))}, title, columns=2))
    heat = np.clip(resize_map(cam, *pixels.shape[:2]), 0.0, 1.0)
    panels = {"image": plain, "heatmap": heat, "overlay": mark(overlay(pixels, heat, alpha, colormap))}
    return rendered(panel_figure(panels, title, columns=3, colormap=colormap))


def grid(
    image: Image.Image | np.ndarray,
    cams: Mapping[str, Tensor | np.ndarray],
    title: str,
    alpha: float = 0.5,
    colormap: str = "jet",
    columns: int = 4,
    mark: Marker = _unmarked,
) -> Image.Image:
    """One figure comparing methods: the image, then each method's map on it, under its name; ``mark``
    draws on every picture."""
    pixels = rgb_array(image)
    pictures = {name: picture(pixels, cam, alpha, colormap) for name, cam in cams.items()}
    panels = {"image": mark(Image.fromarray(pixels)), **{name: mark(p) for name, p in pictures.items()}}
    return rendered(panel_figure(panels, title, columns=min(columns, len(panels))))


def strip(
    image: Image.Image | np.ndarray,
    cams: Mapping[str, Tensor | np.ndarray],
    marks: Mapping[str, Marker],
    title: str,
    alpha: float = 0.5,
    colormap: str = "jet",
    columns: int = 6,
) -> Image.Image:
    """A strip of maps on one image, in rows of at most ``columns``: each map on the picture under its name, with
    what it explains drawn by its own ``marks`` entry (a pose's keypoints, each ringed in turn)."""
    pixels = rgb_array(image)
    panels = {name: marks[name](picture(pixels, cam, alpha, colormap)) for name, cam in cams.items()}
    return rendered(panel_figure(panels, title, columns=min(columns, len(panels))))


def concept_figure(
    image: Image.Image | np.ndarray, maps: Tensor | np.ndarray, names: list[str], title: str, alpha: float = 0.6
) -> Image.Image:
    """Concepts on one image (Deep Feature Factorization's): each pixel in the colour of the concept whose map is
    highest there, blended by that map's value, with a legend naming each concept (its top classes, say).

    Args:
        image: The picture.
        maps: The concepts' maps on it, (K, h, w), in [0, 1].
        names: One legend entry per concept.
        title: The figure's title.
        alpha: The blend at a map's value 1.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    pixels = rgb_array(image)
    height, width = pixels.shape[:2]
    values = np.stack([resize_map(m, height, width) for m in maps]).clip(0.0, 1.0)  # (K, H, W)
    colours = matplotlib.colormaps["tab10"](np.arange(len(values)) % 10)[:, :3]
    winner = values.argmax(axis=0)
    strength = alpha * values.max(axis=0)[..., None]
    blended = (1 - strength) * pixels / 255.0 + strength * colours[winner]
    fig = Figure(figsize=(6, 6 * height / width + 1.2), dpi=100, layout="constrained")
    axes = fig.add_subplot(1, 1, 1)
    axes.imshow(blended)
    axes.axis("off")
    axes.set_title(title)
    handles = [Patch(color=colours[k], label=name) for k, name in enumerate(names)]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(names), 3), fontsize="small")
    return rendered(fig)
