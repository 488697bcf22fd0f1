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

ImageLike = Image.Image | np.ndarray | str | Path
Task = Literal["classification", "segmentation", "detection"]


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

    def with_aspect(self, keep_aspect: bool | None) -> Preprocessing:
        """The same preprocessing, resizing the short side (True) or the whole image (False); None: as it is."""
        if keep_aspect is None or keep_aspect == self.keep_aspect:
            return self
        return replace(self, keep_aspect=keep_aspect)

    def settings(self) -> dict[str, Any]:
        """Its fields as JSON values (the manifest's header)."""
        return asdict(self) | {"mean": list(self.mean), "std": list(self.std), "resample": int(self.resample)}


@dataclass
class ModelSpec:
    """A model together with what is needed to feed it and to name its classes.

    Attributes:
        model: The network, in eval mode.
        name: The architecture's name.
        labels: One name per output class.
        preprocessing: How an image becomes the model's input.
        task: What the model does, which decides the default target: ``"classification"``
            ((N, classes) scores), ``"segmentation"`` (a dict whose ``"out"`` is (N, classes,
            H, W)) or ``"detection"`` (a list of dicts of boxes, labels and scores).
    """

    model: nn.Module
    name: str
    labels: list[str]
    preprocessing: Preprocessing
    task: Task = "classification"

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
