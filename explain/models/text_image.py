"""Vision-language models by name: a folder written by ``save_pretrained``, or a Hugging Face Hub name found in the
local cache (never downloaded here: a name that is not cached is one line that names the way out).

Three kinds, told from the model's config: a model that answers (its config names an image token: LLaVA 1.5,
PaliGemma and their kind), an open-vocabulary detector (transformers' zero-shot object detection: OWL-ViT, OWLv2),
and a contrastive model (a text tower beside the vision tower: CLIP, SigLIP).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..errors import ModelLoadError, first_line
from .spec import UNIT_PREPROCESSING, Preprocessing


@dataclass(frozen=True)
class TextImageSpec:
    """A vision-language model with its processor.

    Attributes:
        model: The model, in eval mode, on its device.
        processor: Its processor (images and text in, the model's inputs out).
        name: Its folder or Hub name.
        kind: What it does: ``"answers"`` prompts, ``"detects"`` boxes of text queries, or ``"scores"`` text
            prompts against the image.
    """

    model: nn.Module
    processor: Any
    name: str
    kind: Literal["answers", "detects", "scores"]

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return next(self.model.parameters()).device

    @property
    def preprocessing(self) -> Preprocessing:
        """How an export reads each image: whole, at its own size (the processor resizes it for the model)."""
        return UNIT_PREPROCESSING


@contextmanager
def _quiet_transformers() -> Iterator[Any]:
    """For the block, ``transformers`` without its progress bars and its warnings (errors are raised anyway)."""
    try:
        import transformers
    except ImportError:
        raise ModelLoadError("vision-language models need transformers: pip install transformers") from None
    logging = transformers.utils.logging
    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield transformers
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def is_text_image_model(name: str) -> bool:
    """Whether ``name`` is a folder holding a vision-language model's config (``config.json``): one that names an
    image token, or a text tower (``text_config``) beside its vision side."""
    path = Path(name) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and any(
        key in config for key in ("image_token_id", "image_token_index", "text_config")
    )


def load_text_image_model(name: str, device: str | torch.device = "cpu") -> TextImageSpec:
    """Load a vision-language model and its processor from a folder, or from the Hub's local cache.

    Raises:
        ModelLoadError: Not a folder and not in the cache, a model of another kind, or files that cannot be read.
    """
    with _quiet_transformers() as transformers:
        try:
            config = transformers.AutoConfig.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError) as err:
            where = "is not a folder with a config.json" if not Path(name).is_dir() else "holds no readable config"
            raise ModelLoadError(
                f"{name} {where}, and is not in the Hugging Face cache ({first_line(err)}): save the model with "
                "save_pretrained into a folder and give --model FOLDER, or download it once where there is network"
            ) from None
        kind = _kind(transformers, config)
        load = {
            "answers": transformers.AutoModelForImageTextToText,
            "detects": transformers.AutoModelForZeroShotObjectDetection,
            "scores": transformers.AutoModel,
        }[kind]
        try:
            model = load.from_pretrained(name, local_files_only=True)
            processor = transformers.AutoProcessor.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError, KeyError) as err:
            raise ModelLoadError(f"{name}: cannot load its model and processor: {first_line(err)}") from None
    if kind == "scores" and not callable(getattr(model, "get_text_features", None)):
        raise ModelLoadError(
            f"{name} is a {type(model).__name__}: --prompt needs a model that answers (LLaVA 1.5 and its kind), "
            "--text a contrastive image-text model (CLIP, SigLIP) or an open-vocabulary detector (OWL-ViT, OWLv2)"
        )
    return TextImageSpec(model.eval().to(device), processor, name, kind)


def _kind(transformers: Any, config: Any) -> Literal["answers", "detects", "scores"]:
    """What a model of this config does: it answers where it names an image token; it detects where transformers
    builds a zero-shot object detector of it; else it scores text prompts."""
    if any(isinstance(getattr(config, key, None), int) for key in ("image_token_id", "image_token_index")):
        return "answers"
    return "detects" if type(config) in transformers.MODEL_FOR_ZERO_SHOT_OBJECT_DETECTION_MAPPING else "scores"
