"""Renderers: real pixels of overlays, in RGB order, at the image's resolution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import explain


def grey(width: int, height: int, value: int = 100) -> Image.Image:
    return Image.new("RGB", (width, height), (value, value, value))


def test_alpha_zero_keeps_the_image() -> None:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 50, 3), dtype=np.uint8))
    out = explain.overlay(image, torch.rand(7, 7), alpha=0.0)
    assert np.array_equal(np.asarray(out), np.asarray(image))


def test_colours_are_rgb_and_blended() -> None:
    hot = np.asarray(explain.overlay(grey(40, 20), torch.ones(7, 7), alpha=1.0))
    cold = np.asarray(explain.overlay(grey(40, 20), torch.zeros(7, 7), alpha=1.0))
    assert tuple(hot[5, 5]) == (128, 0, 0)  # jet at 1.0 is dark red
    assert tuple(cold[5, 5]) == (0, 0, 128)  # jet at 0.0 is dark blue
    half = np.asarray(explain.overlay(grey(40, 20), np.ones((7, 7)), alpha=0.5))
    assert tuple(half[5, 5]) == (114, 50, 50)
    viridis = np.asarray(explain.overlay(grey(40, 20), torch.ones(3, 3), alpha=1.0, colormap="viridis"))
    assert tuple(viridis[0, 0]) == (253, 231, 37)


@pytest.mark.parametrize("colormap", ["jet", "viridis", "gray"])
def test_colours_are_matplotlibs_own(colormap) -> None:
    """The colour table looked up equals matplotlib's colormap called on every value, the ends and beyond."""
    import matplotlib

    values = np.concatenate([np.random.default_rng(1).random(5000), np.linspace(0, 1, 1001), [-0.5, 1.5]])
    values = values.astype(np.float32).reshape(-1, 1)
    expected = (matplotlib.colormaps[colormap](np.clip(values, 0, 1))[..., :3] * 255 + 0.5).astype(np.uint8)
    assert np.array_equal(explain.io.render.colorize(values, colormap), expected)


def test_blend_is_rounded_per_pixel() -> None:
    image = np.random.default_rng(2).integers(0, 256, (30, 50, 3), dtype=np.uint8)
    cam = np.random.default_rng(3).random((30, 50)).astype(np.float32)
    heat = explain.io.render.colorize(cam).astype(np.float64)
    exact = 0.3 * heat + 0.7 * image
    difference = np.asarray(explain.overlay(image, cam, alpha=0.3)) - np.floor(exact + 0.5)
    tie = np.abs(exact - np.floor(exact) - 0.5) < 1e-3  # x.5 exactly: float32 may round either way
    assert np.abs(difference).max() <= 1 and not difference[~tie].any()


def test_low_resolution_map_lands_where_it_belongs() -> None:
    cam = torch.zeros(4, 8)
    cam[:, :4] = 1.0  # left half hot
    out = np.asarray(explain.overlay(np.full((300, 640, 3), 100, np.uint8), cam, alpha=1.0))
    assert out.shape == (300, 640, 3)
    assert out[150, 10, 0] > 100 and out[150, 10, 2] == 0
    assert out[150, 630, 2] > 100 and out[150, 630, 0] == 0


def test_figure_has_three_panels_side_by_side() -> None:
    fig = np.asarray(explain.figure(grey(60, 40), torch.rand(7, 7), "Egyptian cat (77.3%)"))
    assert fig.shape[1] > 2 * fig.shape[0]
    assert (fig != 255).any()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="HxWx3 uint8"):
        explain.overlay(np.zeros((10, 10), np.uint8), torch.rand(3, 3))
    with pytest.raises(ValueError, match="alpha"):
        explain.overlay(grey(4, 4), torch.rand(3, 3), alpha=2.0)
    with pytest.raises(ValueError, match="2-D"):
        explain.overlay(grey(4, 4), torch.rand(1, 3, 3))


def overlaps(fig) -> list[str]:
    """Every pair among the titles and the drawn images whose boxes on the canvas intersect."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = {"suptitle": fig._suptitle.get_window_extent(renderer)}
    for index, axes in enumerate(fig.axes):
        if axes.get_title():
            boxes[f"title {index}"] = axes.title.get_window_extent(renderer)
        for image in axes.images:
            boxes[f"image {index}"] = image.get_window_extent(renderer)
    names = list(boxes)
    return [f"{a} / {b}" for i, a in enumerate(names) for b in names[i + 1 :] if boxes[a].overlaps(boxes[b])]


@pytest.mark.parametrize(("width", "height", "panels"), [(451, 300, 5), (300, 451, 5), (300, 451, 12), (640, 200, 3)])
def test_titles_never_overlap_images_or_each_other(width, height, panels) -> None:
    from explain.io.render import panel_figure

    pictures = {f"method {i} with a long name": np.zeros((height, width, 3), np.uint8) for i in range(panels)}
    fig = panel_figure(pictures, "Egyptian cat (77.3%), every fast method", columns=min(4, panels))
    assert overlaps(fig) == []


def test_figure_heatmap_has_a_colour_bar(monkeypatch) -> None:
    from explain.io import render

    original, made = render.panel_figure, []

    def spy(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(render, "panel_figure", spy)
    cam = torch.rand(7, 7)
    render.figure(grey(300, 451), cam, "Egyptian cat (77.3%), gradcam at bn2", colormap="viridis")
    (fig,) = made
    panels = {axes.get_title(): axes for axes in fig.axes if axes.get_title()}
    assert list(panels) == ["image", "heatmap", "overlay"]
    heat = panels["heatmap"].images[0]
    assert heat.colorbar is not None and heat.cmap.name == "viridis" and heat.get_clim() == (0.0, 1.0)
    assert heat.get_array().shape == (451, 300)  # the map itself, upsampled to the photo, not colours
    assert overlaps(fig) == []
