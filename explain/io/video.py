"""Videos: frames decoded with PyAV (an optional extra, ``pip install "explain[video]"``, imported only when a video is
read or written), and an explanation written back: an overlay video of the original frames at their own rate, an
animated GIF and a strip of frames for the gallery."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ..errors import InputLoadError, first_line
from .atomic import write_atomically
from .render import overlay


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
    with _decoding(path), _av(path).open(str(path)) as container:
        stream, rate = _video_stream(container, path)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    if not frames:
        raise InputLoadError(f"{path}: the video has no frames")
    return Video(np.stack(frames), rate)


def _reason(err: BaseException) -> str:
    """Why decoding failed, in a few words: an FFmpeg error's own text, without its number and the file's name."""
    return getattr(err, "strerror", None) or first_line(err)


@contextmanager
def _decoding(path: Path) -> Iterator[None]:
    """For the block, a failure to decode ``path`` (PyAV's errors, OSError) is an :class:`InputLoadError`."""
    try:
        yield
    except InputLoadError:
        raise
    except Exception as err:  # a corrupt or truncated file: PyAV raises its own errors and OSError
        raise InputLoadError(f"{path}: cannot decode the video: {_reason(err)}") from None


def _video_stream(container: Any, path: Path) -> tuple[Any, float]:
    """A container's first video stream and its frame rate (25 where the file tells none).

    Raises:
        InputLoadError: The file has no video stream.
    """
    if not container.streams.video:
        raise InputLoadError(f"{path}: no video stream")
    stream = container.streams.video[0]
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    return stream, float(rate) if rate else 25.0


def count_frames(path: Path) -> tuple[int, float]:
    """How many frames a video file's first video stream decodes to (not its header's claim), and its rate.

    Raises:
        InputLoadError: As :func:`read_video`.
    """
    with _decoding(path), _av(path).open(str(path)) as container:
        stream, rate = _video_stream(container, path)
        total = sum(1 for _ in container.decode(stream))
    if not total:
        raise InputLoadError(f"{path}: the video has no frames")
    return total, rate


def read_frames(path: str | Path, choose: Callable[[int], Sequence[int]]) -> tuple[np.ndarray, int, float]:
    """Some frames of a video, decoded without holding the others: a first pass counts the frames, ``choose(total)``
    names those wanted, a second pass keeps them as RGB. Returns them (T, H, W, 3) uint8, the total and the rate.

    Raises:
        InputLoadError: As :func:`read_video`.
    """
    path = Path(path)
    total, rate = count_frames(path)
    wanted = list(choose(total))
    chosen, kept = set(wanted), {}
    with _decoding(path), _av(path).open(str(path)) as container:
        for index, frame in enumerate(container.decode(video=0)):
            if index in chosen:
                kept[index] = frame.to_ndarray(format="rgb24")
    if len(kept) < len(chosen):
        raise InputLoadError(f"{path}: {total} frames counted, fewer decoded the second time")
    return np.stack([kept[i] for i in wanted]), total, rate


def write_overlay_video(
    source: Path,
    path: Path,
    maps: Callable[[int], Tensor],
    alpha: float = 0.5,
    colormap: str = "jet",
    quality: int = 18,
) -> None:
    """The video ``source`` with ``maps(i)``, a map of any resolution in [0, 1], blended onto each frame i, written
    as :func:`write_video` writes, frame by frame: no more than one frame is held at a time.

    Raises:
        InputLoadError: The source cannot be decoded.
    """
    av = _av(source)

    def write(temp: Path) -> None:
        with av.open(str(source)) as reading:
            decoded = reading.streams.video[0]
            rate = decoded.average_rate or decoded.guessed_rate or 25
            blended = (
                np.asarray(overlay(frame.to_ndarray(format="rgb24"), maps(index), alpha, colormap))
                for index, frame in enumerate(reading.decode(decoded))
            )
            _encode(av, blended, float(rate), temp, quality)

    try:
        write_atomically(path, write)
    except OSError:  # the output cannot be written: the writer's own error
        raise
    except Exception as err:  # the source turned unreadable between the model's pass and this one
        raise InputLoadError(f"{source}: cannot decode the video: {_reason(err)}") from None


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
    atomically (see :func:`_encode`).

    Args:
        frames: The frames.
        fps: Frames per second.
        path: The file (``.mp4``).
        quality: x264's constant rate factor: 0 lossless, 18 visually lossless, 23 its default.
    """
    av = _av(path)
    write_atomically(path, lambda temp: _encode(av, iter(frames), fps, temp, quality))


def _encode(av: Any, frames: Iterator[np.ndarray], fps: float, path: Path, quality: int) -> None:
    """RGB frames (H, W, 3) uint8, one at a time, encoded as H.264 in yuv420p at ``fps`` into the file ``path``;
    an odd side is padded by one repeated row or column (yuv420p halves the colour planes)."""
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = None
        for pixels in frames:
            height, width = pixels.shape[:2]
            even = np.pad(pixels, ((0, height % 2), (0, width % 2), (0, 0)), mode="edge")
            if stream is None:
                stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
                stream.width, stream.height, stream.pix_fmt = even.shape[1], even.shape[0], "yuv420p"
                stream.options = {"crf": str(quality)}
            container.mux(stream.encode(av.VideoFrame.from_ndarray(even, format="rgb24")))
        if stream is not None:
            container.mux(stream.encode(None))


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
    """An animated GIF of the frames (at most ``most``, taken evenly, each scaled to ``height``), looping, at
    ``fps`` frames of ``frames`` per second (shown frames last longer when some are left out), atomically."""
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


def nearest_sampled(indices: Sequence[int], total: int) -> list[int]:
    """For each frame of a clip of ``total`` frames, which of the sampled frames (at ``indices``) lies nearest it in
    time: the one whose map it takes."""
    taken = torch.as_tensor(list(indices), dtype=torch.float32)
    return (torch.arange(total, dtype=torch.float32)[:, None] - taken[None]).abs().argmin(dim=1).tolist()


def sampled_maps(maps: Tensor, indices: Sequence[int], total: int) -> Tensor:
    """Maps of the sampled frames (T, h, w), at ``indices`` of a clip of ``total`` frames, as one map per frame of
    the clip (total, h, w) (see :func:`nearest_sampled`)."""
    return maps[torch.as_tensor(nearest_sampled(indices, total), device=maps.device)]


def windowed_maps(maps: Tensor, starts: Sequence[int], length: int) -> Tensor:
    """Maps of sliding windows (N, W, T, ...), window w covering frames ``starts[w]`` to ``starts[w] + T`` of a
    sequence of ``length`` frames, as one map per frame (N, length, ...): the mean of the maps the windows that
    hold the frame give it."""
    frames = maps.shape[2]
    total = maps.new_zeros(maps.shape[0], length, *maps.shape[3:])
    count = maps.new_zeros(length)
    for w, start in enumerate(starts):
        total[:, start : start + frames] += maps[:, w]
        count[start : start + frames] += 1
    return total / count.clamp_min(1).view(1, length, *(1,) * (maps.dim() - 3))
