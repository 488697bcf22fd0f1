"""A plain ``nn.Module`` given where explain needs a :class:`ModelSpec`: its preprocessing and class names read from
what the model says of itself, else ImageNet's defaults, said in a note.

What a model may say, in order: timm's ``pretrained_cfg`` (input size, mean, std, interpolation, label names; a
ViT's size the one its patch embedding was built for); a
HuggingFace model's config (``image_size``, ``id2label``) and the image processor saved beside it (its mean and
std); its first layer's input channels, which must be an image's three. A torchvision model says nothing of its
weights' transforms, which are ImageNet's at 224: the defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image
from torch import nn

from ..core.held import held_model, refuse_quantized
from ..errors import ExplainError, ModelLoadError
from .spec import IMAGENET_PREPROCESSING, ModelSpec, Preprocessing

ASK_OTHERS = "return an explain.ModelSpec from your file to give others"


def plain_spec(model: nn.Module, name: str, source: str) -> ModelSpec:
    """The spec of a plain classifier named ``name``, from what it says of itself (see the module's docstring);
    ``source`` names where it came from in errors (the user's ``FILE.py:NAME``).

    Raises:
        ModelLoadError: A model explain cannot hook (see :func:`explain.core.held.held_model`), one whose first
            layer reads other than an image's 3 channels, or one that says nothing of its classes.
    """
    try:
        held_model(model)  # a TorchScript or exported model: refused saying why
        refuse_quantized(model, list(model.modules()))
    except ExplainError as err:
        raise ModelLoadError(f"{source}: {err}") from None
    first = next((m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    if not isinstance(first, nn.Conv2d) or first.in_channels != 3:
        reads = "no convolution" if first is None else f"a {type(first).__name__} of {first.in_channels} channels"
        raise ModelLoadError(
            f"{source}: a plain {type(model).__name__} whose first layer is {reads}, not an image's 3 channels: "
            f"{ASK_OTHERS}, with the preprocessing it reads (VolumePreprocessing, SignalPreprocessing, ...)"
        )
    count = _classes(model)
    if count is None:
        raise ModelLoadError(
            f"{source}: a plain {type(model).__name__} that says nothing of its classes (no last linear layer, no "
            f"config): {ASK_OTHERS}, with its class names and task"
        )
    found = _timm(model) or _huggingface(model)
    if found is not None:
        preprocessing, labels, said = found
        note = f"preprocessing from its {said}"
    else:
        preprocessing, labels = IMAGENET_PREPROCESSING, None
        note = f"it says nothing of its preprocessing: ImageNet's 224 x 224, mean {preprocessing.mean}, std {preprocessing.std} ({ASK_OTHERS})"  # noqa: E501
    if labels is None or len(labels) != count:
        labels = [f"class {i}" for i in range(count)]
    return ModelSpec(model.eval(), name, labels, preprocessing, note=note)


def _timm(model: nn.Module) -> tuple[Preprocessing, list[str] | None, str] | None:
    """timm's ``pretrained_cfg``: its preprocessing and label names, or None without one."""
    config = getattr(model, "pretrained_cfg", None)
    if not isinstance(config, dict) or "mean" not in config or "input_size" not in config:
        return None
    bicubic = config.get("interpolation") == "bicubic"
    built = getattr(getattr(model, "patch_embed", None), "img_size", None)  # the size a ViT was built for, if fixed
    side = int(built[-1]) if isinstance(built, (tuple, list)) else int(config["input_size"][-1])
    preprocessing = Preprocessing(
        side, tuple(config["mean"]), tuple(config["std"]),
        Image.Resampling.BICUBIC if bicubic else Image.Resampling.BILINEAR,
    )  # fmt: skip
    names = config.get("label_names")
    return preprocessing, list(names) if names else None, "timm pretrained_cfg"


def _huggingface(model: nn.Module) -> tuple[Preprocessing, list[str] | None, str] | None:
    """A HuggingFace model's config and the image processor saved beside it, or None for another model."""
    config = getattr(model, "config", None)
    size = getattr(config, "image_size", None)
    if not isinstance(size, int):
        return None
    mean, std, said = IMAGENET_PREPROCESSING.mean, IMAGENET_PREPROCESSING.std, "HuggingFace config (ImageNet's mean)"
    processor = _image_processor(getattr(model, "name_or_path", "") or getattr(config, "_name_or_path", ""))
    if processor is not None:
        mean, std = tuple(processor.image_mean), tuple(processor.image_std)
        said = "HuggingFace config and image processor"
    names = getattr(config, "id2label", None) or {}
    labels = [names[i] for i in range(len(names))] if names and not str(names.get(0, "")).startswith("LABEL_") else None
    return Preprocessing(size, mean, std), labels, said


def _image_processor(folder: str) -> Any:
    """The image processor saved in the model's folder, or None."""
    if not folder or not (Path(folder) / "preprocessor_config.json").is_file():
        return None
    import transformers

    try:
        return transformers.AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError):
        return None


def _classes(model: nn.Module) -> int | None:
    """How many classes the model scores: its last linear layer's outputs, or a HuggingFace config's labels."""
    config = getattr(model, "config", None)
    if getattr(config, "num_labels", None):
        return int(config.num_labels)
    last = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return last[-1].out_features if last else None
