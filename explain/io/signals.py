"""Signals: a time series read from a ``.npy`` array (C, L) or a ``.csv`` table (one row per sample), and its picture:
the signal's channels drawn over the map as a coloured band along time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ..errors import InputLoadError, first_line
from .render import rendered

SIGNAL_SUFFIXES = (".npy", ".csv")


def read_signal(path: str | Path) -> np.ndarray:
    """A signal (C, L) float32: a ``.npy`` holds it as the model takes it, channels first, (C, L), or one channel
    (L,); a ``.csv`` holds one sample per row and one channel per column (a header row of names is skipped).

    Raises:
        InputLoadError: The file cannot be read, holds no 1- or 2-D numeric table, or holds NaN or infinite values;
            the message names the file.
    """
    path = Path(path)
    try:
        if path.suffix.lower() == ".npy":
            data = np.load(path, allow_pickle=False)
        elif path.suffix.lower() == ".csv":
            data = _csv(path).T  # (samples, channels) to (C, L)
        else:
            raise InputLoadError(f"{path}: not a signal ({', '.join(SIGNAL_SUFFIXES)})")
    except InputLoadError:
        raise
    except Exception as err:  # unreadable, not numbers, ragged rows: numpy raises many kinds
        raise InputLoadError(f"{path}: cannot read the signal: {first_line(err)}") from None
    if data.ndim == 1:
        data = data[None]
    if data.ndim != 2 or 0 in data.shape or not np.issubdtype(data.dtype, np.number) or np.iscomplexobj(data):
        raise InputLoadError(f"{path}: no signal (C, L) of real numbers, got shape {data.shape} of {data.dtype}")
    signal = data.astype(np.float32)
    if not np.isfinite(signal).all():
        raise InputLoadError(f"{path}: the signal holds NaN or infinite values")
    return signal


def _csv(path: Path) -> np.ndarray:
    """A table of numbers, one row per line; a first line that is not numbers (the channels' names) is skipped."""
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    try:
        [float(cell) for cell in first.split(",")]
        header = 0
    except ValueError:
        header = 1
    return np.loadtxt(path, delimiter=",", skiprows=header, ndmin=2, dtype=np.float64)


def plot_signal(signal: np.ndarray | Tensor, heatmap: np.ndarray | Tensor, colormap: str = "jet") -> Image.Image:
    """The signal's channels (C, L), one panel each (at most 12, then the first 12), drawn over the map (L,)
    as a coloured band along time: the picture of a signal's explanation.

    Raises:
        ValueError: The map's length is not the signal's (upsample it to the signal first).
    """
    from matplotlib.figure import Figure

    values = torch.as_tensor(signal).detach().cpu().float().numpy()
    band = torch.as_tensor(heatmap).detach().cpu().float().numpy()
    if band.shape != values.shape[-1:]:
        raise ValueError(f"the map is {band.shape}, the signal {values.shape}: upsample it to the signal's length")
    shown = values[:12]
    figure = Figure(figsize=(10, 1.2 * len(shown) + 0.4), dpi=100)
    axes = figure.subplots(len(shown), 1, sharex=True, squeeze=False)[:, 0]
    for channel, ax in zip(shown, axes):
        low, high = float(channel.min()), float(channel.max())
        pad = max(high - low, 1e-6) * 0.05
        ax.imshow(band[None], aspect="auto", cmap=colormap, vmin=0, vmax=1, alpha=0.6,
                  extent=(0, len(band), low - pad, high + pad))  # fmt: skip
        ax.plot(np.arange(len(channel)) + 0.5, channel, color="black", linewidth=0.8)
        ax.set_xlim(0, len(band))
        ax.set_yticks([])
    axes[-1].set_xlabel("sample")
    figure.tight_layout()
    return rendered(figure)
