"""A model together with what it needs: its preprocessing (how an image becomes its input), its class names and
its task."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from ..errors import ExplainError
from ..io.images import input_size, load_image, rgb_array, to_tensor
from ..io.kinds import IMAGE, SIGNAL, VIDEO, VOLUME
from ..io.video import read_frames

ImageLike = Image.Image | np.ndarray | str | Path
Task = Literal["classification", "segmentation", "detection", "depth", "prompted"]


@dataclass(frozen=True)
class Preprocessing:
    """How an image becomes a model's input, without the model: what ``DataLoader`` workers get a copy of (on
    platforms that spawn them, a pickled one). Called on an RGB image, it gives the (3, H, W) float32 input:
    resized with the filter ``resample``, scaled to [0, 1] and normalized with ``mean`` and ``std``.

    Attributes:
        input_size: Side of the square input (the short side with ``keep_aspect``); None: the image's size (a
            detector resizes images itself).
        mean: Per-channel normalization mean.
        std: Per-channel normalization standard deviation.
        resample: PIL resampling filter.
        keep_aspect: Resize the short side to ``input_size`` rather than the whole image to a square.
    """

    input_size: int | None
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: Image.Resampling = Image.Resampling.BILINEAR
    keep_aspect: bool = False

    def __call__(self, image: Image.Image) -> Tensor:
        size = image.size if self.input_size is None else input_size(image, self.input_size, self.keep_aspect)
        return to_tensor(image, size, self.mean, self.std, self.resample)

    kind = IMAGE  # what an export of the model reads (see explain.io.kinds)

    def with_aspect(self, keep_aspect: bool | None) -> Preprocessing:
        """The same preprocessing, resizing the short side (True) or the whole image (False); None: as it is."""
        if keep_aspect is None or keep_aspect == self.keep_aspect:
            return self
        return replace(self, keep_aspect=keep_aspect)

    def read(self, path: Path) -> tuple[Tensor, Tensor]:
        """An image file as its pixels (H, W, 3) uint8, what the maps are drawn on, and the model's input.

        Raises:
            ImageLoadError: The file is no readable image.
        """
        image = load_image(path)
        return torch.from_numpy(np.array(image)), self(image)

    def settings(self) -> dict[str, Any]:
        """Its fields as JSON values (the manifest's header)."""
        return asdict(self) | {"mean": list(self.mean), "std": list(self.std), "resample": int(self.resample)}


# ImageNet's usual preprocessing: 224 x 224, torchvision's mean and std (the default for a user's bare classifier)
IMAGENET_PREPROCESSING = Preprocessing(224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
# The photo itself at its own size in [0, 1]: for a model that resizes and normalizes its inputs itself (a detector)
UNIT_PREPROCESSING = Preprocessing(None, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))


@dataclass(frozen=True)
class ClipPreprocessing:
    """How a video's frames become a video classifier's input, (3, T, h, w): ``frames`` frames taken uniformly over
    the clip (:meth:`indices`), each resized to ``resize`` (one side: the short side; two: exactly), cropped in
    the centre to ``crop``, scaled to [0, 1] and normalized with ``mean`` and ``std``, as torchvision's video
    weights preprocess Kinetics-400 clips (bilinear, without antialiasing, on the uint8 frames).

    With a ``stride``, every frame of the video is taken instead, and the model sees it in sliding windows of
    ``frames`` consecutive frames, one starting every ``stride`` frames (:meth:`windows`).

    Attributes:
        frames: The model's frame count (its weights' ``clip_len``).
        resize: The size frames are resized to.
        crop: The (h, w) of the centre crop.
        mean: Per-channel normalization mean.
        std: Per-channel normalization standard deviation.
        stride: The frames between the starts of two sliding windows, from 1 to ``frames`` (so that every frame
            lies in a window), or None for one clip of frames taken uniformly.
    """

    frames: int
    resize: tuple[int, ...]
    crop: tuple[int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    stride: int | None = None

    kind = VIDEO  # what an export of the model reads (see explain.io.kinds)

    def __post_init__(self) -> None:
        if self.stride is not None and not 1 <= self.stride <= self.frames:
            raise ExplainError(
                f"the clip stride must be between 1 and the model's {self.frames} frames, so that every frame lies "
                f"in a window; got {self.stride}"
            )

    def windows(self, length: int) -> list[int]:
        """Where the sliding windows start in a sequence of ``length`` sampled frames: every ``stride`` frames, and
        the last window ends at the last frame (one window, of all frames, without a stride)."""
        if self.stride is None or length <= self.frames:
            return [0]
        starts = list(range(0, length - self.frames + 1, self.stride))
        return starts if starts[-1] + self.frames == length else [*starts, length - self.frames]

    def with_aspect(self, keep_aspect: bool | None) -> ClipPreprocessing:
        """The same preprocessing: a clip is resized and cropped as the weights were trained (``keep_aspect`` is
        for images)."""
        return self

    def read(self, path: Path) -> tuple[Tensor, Tensor]:
        """A video file's sampled frames (T, H, W, 3) uint8 and the model's input (3, T, h, w), all its windows'
        frames with a ``stride``; the other frames are not kept.

        Raises:
            InputLoadError: The file is no readable video.
        """
        frames, _, _ = read_frames(path, self.indices)
        return torch.from_numpy(frames), self(frames)

    def indices(self, total: int) -> list[int]:
        """The frames taken from a clip of ``total`` frames: ``frames`` of them, evenly spaced from the first to
        the last (repeated where the clip is shorter); with a ``stride``, every frame of a clip of at least
        ``frames``."""
        if total < 1:
            raise ExplainError("a clip without frames")
        if self.stride is not None and total >= self.frames:
            return list(range(total))
        return torch.linspace(0, total - 1, self.frames).round().long().tolist()

    def __call__(self, frames: Tensor | np.ndarray) -> Tensor:
        """The clip ``frames`` (T, H, W, 3) uint8 RGB, already sampled, as the model's input (3, T, h, w)."""
        from torchvision.transforms import functional

        clip = torch.as_tensor(np.asarray(frames)).permute(0, 3, 1, 2)  # (T, 3, H, W)
        clip = functional.resize(clip, list(self.resize), antialias=False)
        clip = functional.center_crop(clip, list(self.crop)).float() / 255
        clip = functional.normalize(clip, list(self.mean), list(self.std))
        return clip.permute(1, 0, 2, 3).contiguous()

    def region(self, height: int, width: int) -> tuple[int, int, int, int]:
        """The part of a (height, width) frame that the centre crop keeps, in the frame's pixels, rounded:
        (top, left, bottom, right). The frame is resized first, so the crop's box scales back with it."""
        if len(self.resize) == 1:  # the short side to resize[0], the long one in proportion (rounded down)
            short, long = sorted((height, width))
            side = (self.resize[0], int(self.resize[0] * long / short))
            resized = side if height <= width else side[::-1]
        else:
            resized = self.resize
        top, left = (round((r - c) / 2) for r, c in zip(resized, self.crop))  # as torchvision centres its crop
        scale_h, scale_w = height / resized[0], width / resized[1]
        box = (top * scale_h, left * scale_w, (top + self.crop[0]) * scale_h, (left + self.crop[1]) * scale_w)
        return tuple(round(v) for v in box)  # type: ignore[return-value]

    def on_frames(self, maps: Tensor, height: int, width: int) -> Tensor:
        """Maps (T, h, w) over the model's crop as maps over whole (height, width) frames: each resized
        bilinearly onto the crop's :meth:`region`, zero outside it, where the model saw nothing."""
        top, left, bottom, right = self.region(height, width)
        placed = maps.new_zeros(len(maps), height, width)
        inside = torch.nn.functional.interpolate(
            maps[:, None].float(), size=(bottom - top, right - left), mode="bilinear", align_corners=False
        )
        placed[:, top:bottom, left:right] = inside[:, 0]
        return placed

    def settings(self) -> dict[str, Any]:
        """Its fields as JSON values (the manifest's header)."""
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}


@dataclass(frozen=True)
class Standardizing:
    """What volume and signal preprocessing share: values minus ``mean``, divided by ``std``, at the input's own
    size (None: the input's own statistic).

    Attributes:
        mean: The value subtracted, or None for the input's own mean.
        std: The value divided by, or None for the input's own standard deviation (a spread of zero divides by 1).
    """

    mean: float | None = None
    std: float | None = None

    def with_aspect(self, keep_aspect: bool | None) -> Standardizing:
        """The same preprocessing (``keep_aspect`` is for images)."""
        return self

    def standardized(self, values: Tensor, axis: int | None = None) -> Tensor:
        """``values`` standardized; the statistics a None asks for are taken along ``axis``, or over all values."""
        axes = () if axis is None else (axis,)
        shift = values.mean(dim=axes or None, keepdim=bool(axes)) if self.mean is None else torch.tensor(self.mean)
        spread = values.std(dim=axes or None, keepdim=bool(axes)) if self.std is None else torch.tensor(self.std)
        return (values - shift) / torch.where(spread > 0, spread, 1.0)

    def settings(self) -> dict[str, Any]:
        """Its fields as JSON values (the manifest's header)."""
        return asdict(self)


@dataclass(frozen=True)
class VolumePreprocessing(Standardizing):
    """How a scan becomes a 3-D network's input, (1, D, H, W) at the scan's own size: standardized over all its
    voxels (see :class:`Standardizing`). Read from a NIfTI file or a 3-D ``.npy`` (see
    :func:`explain.io.volumes.read_volume`)."""

    kind = VOLUME  # what an export of the model reads (see explain.io.kinds)

    def read(self, path: Path) -> tuple[Tensor, Tensor]:
        """A scan's voxels (D, H, W) float32, what the maps are drawn on, and the model's input (1, D, H, W).

        Raises:
            InputLoadError: The file is no readable volume.
        """
        from ..io.volumes import read_volume

        voxels = torch.from_numpy(read_volume(path).data)
        return voxels, self.standardized(voxels)[None]


@dataclass(frozen=True)
class SignalPreprocessing(Standardizing):
    """How a signal becomes a 1-D network's input, (C, L) at its own length: each channel standardized on its own
    (see :class:`Standardizing`). Read from a ``.npy`` (C, L) or a ``.csv`` of one sample per row (see
    :func:`explain.io.signals.read_signal`)."""

    kind = SIGNAL  # what an export of the model reads (see explain.io.kinds)

    def read(self, path: Path) -> tuple[Tensor, Tensor]:
        """A signal (C, L) float32, what the maps are drawn on, and the model's input (C, L).

        Raises:
            InputLoadError: The file is no readable signal.
        """
        from ..io.signals import read_signal

        signal = torch.from_numpy(read_signal(path))
        return signal, self.standardized(signal, axis=-1)


InputPreprocessing = Preprocessing | ClipPreprocessing | VolumePreprocessing | SignalPreprocessing


@dataclass
class ModelSpec:
    """A model together with what is needed to feed it and to name its classes.

    Attributes:
        model: The network, in eval mode.
        name: The architecture's name.
        labels: One name per output class.
        preprocessing: How an image becomes the model's input, or for a video classifier how a clip's frames do.
        task: What the model does, which decides the default target: ``"classification"``
            ((N, classes) scores), ``"segmentation"`` (a dict whose ``"out"`` is (N, classes,
            H, W)), ``"detection"`` (a list of dicts of boxes, labels and scores), ``"depth"`` (a depth map (N, H,
            W) at the input's size) or ``"prompted"`` (a promptable segmenter: SAM, given its prompt).
        note: What explain assumed of the model where it did not say (a plain module's preprocessing), said once
            to the user; empty where nothing was assumed.
    """

    model: nn.Module
    name: str
    labels: list[str]
    preprocessing: InputPreprocessing
    task: Task = "classification"
    note: str = ""

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are."""
        return next(self.model.parameters()).device

    def transform(self, image: Image.Image, keep_aspect: bool | None = None) -> Tensor:
        """One RGB image as the model sees it: (3, H, W) float32 on the CPU (see :class:`Preprocessing`;
        ``keep_aspect`` None resizes as the model does)."""
        return self.preprocessing.with_aspect(keep_aspect)(image)

    def preprocess(self, images: ImageLike | Sequence[ImageLike], keep_aspect: bool | None = None) -> Tensor:
        """Images as a batch for the model, on its device: (N, 3, H, W).

        Args:
            images: One image or a sequence: PIL images, HxWx3 uint8 RGB arrays, or
                file paths (read with :func:`explain.load_image`: EXIF orientation
                applied, any mode converted to RGB).
            keep_aspect: Resize the short side to ``input_size`` instead of the whole
                image to a square (None: as the model does it); the images of one
                batch must then share a shape.

        Raises:
            ExplainError: With ``keep_aspect``, images whose resized shapes differ.
            ImageLoadError: A path that is not a readable image.
        """
        if not self.preprocessing.kind.picture:
            raise ExplainError(
                f"{self.name} takes {self.preprocessing.kind}s, not images: preprocessing.read(path) gives what its "
                "maps are drawn on and its input"
            )
        single = isinstance(images, (Image.Image, np.ndarray, str, Path))
        transform = self.preprocessing.with_aspect(keep_aspect)
        batch = [transform(_as_rgb(image)) for image in ([images] if single else images)]
        shapes = {tuple(t.shape) for t in batch}
        if len(shapes) > 1:
            raise ExplainError(
                f"these images have different shapes as the model's input {sorted(shapes)}; "
                "preprocess them one at a time"
            )
        return torch.stack(batch).to(self.device)


def _as_rgb(image: ImageLike) -> Image.Image:
    if isinstance(image, (Image.Image, np.ndarray)):
        try:
            return Image.fromarray(rgb_array(image))
        except ValueError as err:
            raise ExplainError(str(err)) from None
    return load_image(image)
