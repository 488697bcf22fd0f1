"""Videos: frames decoded with PyAV (an optional extra, ``pip install "explain[video]"``, imported only when a video is
read or written), and an explanation written back: an overlay video of the original frames at their own rate, an
animated GIF and a strip of frames for the gallery."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ..errors import InputLoadError, first_line
from .atomic import write_atomically
from .render import overlay

VIDEO_SUFFIXES = (".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v")


@dataclass(frozen=True)
class Video:
    """A video's frames, every one, and its rate.

    Attributes:
        frames: (T, H, W, 3) uint8 RGB.
        fps: Frames per second.
    """

    frames: np.ndarray
    fps: float


def _av(path: Path):
    try:
        import av
    except ImportError:
        raise InputLoadError(f'{path}: a video needs PyAV: pip install "explain[video]"') from None
    return av


def read_video(path: str | Path) -> Video:
    """Every frame of a video file's first video stream, as RGB, and its frame rate.

    Raises:
        InputLoadError: The file cannot be decoded or holds no video frame; the message names the file.
    """
    path = Path(path)
    av = _av(path)
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise InputLoadError(f"{path}: no video stream")
            stream = container.streams.video[0]
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    except InputLoadError:
        raise
    except Exception as err:  # a corrupt or truncated file: PyAV raises its own errors and OSError
        raise InputLoadError(f"{path}: cannot decode the video: {first_line(err)}") from None
    if not frames:
        raise InputLoadError(f"{path}: the video has no frames")
    return Video(np.stack(frames), float(rate) if rate else 25.0)


def overlay_frames(
    frames: np.ndarray, maps: Tensor | np.ndarray, alpha: float = 0.5, colormap: str = "jet"
) -> np.ndarray:
    """Each frame (T, H, W, 3) with its map (T, h, w) in [0, 1] blended onto it: (T, H, W, 3) uint8."""
    values = torch.as_tensor(maps).detach().cpu().float()
    if values.dim() != 3 or len(values) != len(frames):
        raise ValueError(f"{len(frames)} frames need one 2-D map each, got maps of shape {tuple(values.shape)}")
    return np.stack([np.asarray(overlay(frame, heat, alpha, colormap)) for frame, heat in zip(frames, values)])


def write_video(frames: np.ndarray, fps: float, path: Path, quality: int = 18) -> None:
    """Frames (T, H, W, 3) uint8 RGB as an H.264 video (yuv420p, the format every player reads) at ``fps``,
    atomically. An odd side is padded by one repeated row or column (yuv420p halves the colour planes).

    Args:
        frames: The frames.
        fps: Frames per second.
        path: The file (``.mp4``).
        quality: x264's constant rate factor: 0 lossless, 18 visually lossless, 23 its default.
    """
    av = _av(path)
    height, width = frames.shape[1:3]
    even = np.pad(frames, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")

    def write(temp: Path) -> None:
        with av.open(str(temp), mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
            stream.width, stream.height, stream.pix_fmt = even.shape[2], even.shape[1], "yuv420p"
            stream.options = {"crf": str(quality)}
            for pixels in even:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
            container.mux(stream.encode(None))

    write_atomically(path, write)


def frame_strip(frames: np.ndarray, count: int = 8, height: int = 96) -> Image.Image:
    """``count`` frames taken evenly over the clip, each scaled to ``height``, side by side: a clip's thumbnail."""
    chosen = np.linspace(0, len(frames) - 1, min(count, len(frames))).round().astype(int)
    width = max(1, round(frames.shape[2] * height / frames.shape[1]))
    pictures = [Image.fromarray(frames[i]).resize((width, height), Image.Resampling.BILINEAR) for i in chosen]
    strip = Image.new("RGB", (width * len(pictures), height))
    for position, picture in enumerate(pictures):
        strip.paste(picture, (position * width, 0))
    return strip


def write_gif(frames: np.ndarray, fps: float, path: Path, height: int = 160, most: int = 48) -> None:
    """An animated GIF of the frames (at most ``most``, taken evenly, each scaled to ``height``), looping, at the
    clip's pace, atomically."""
    chosen = np.linspace(0, len(frames) - 1, min(most, len(frames))).round().astype(int)
    width = max(1, round(frames.shape[2] * height / frames.shape[1]))
    pictures = [Image.fromarray(frames[i]).resize((width, height), Image.Resampling.BILINEAR) for i in chosen]
    duration = max(20, round(1000 * len(frames) / len(chosen) / fps))  # ms per shown frame: the clip's length kept
    write_atomically(
        path,
        lambda temp: pictures[0].save(
            temp, format="GIF", save_all=True, append_images=pictures[1:], duration=duration, loop=0
        ),
    )


def sampled_maps(maps: Tensor, indices: Sequence[int], total: int) -> Tensor:
    """Maps of the sampled frames (T, h, w), at ``indices`` of a clip of ``total`` frames, as one map per frame of
    the clip (total, h, w): each frame takes the map of the sampled frame nearest it in time."""
    taken = torch.as_tensor(list(indices), dtype=torch.float32)
    nearest = (torch.arange(total, dtype=torch.float32)[:, None] - taken[None]).abs().argmin(dim=1)
    return maps[nearest.to(maps.device)]
