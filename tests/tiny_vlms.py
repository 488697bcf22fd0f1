"""Tiny random vision-language models of any architecture in transformers' image-text-to-text mapping: the
architecture's default config, every size in it made small and every special token id moved inside a small
vocabulary. Used by the family tests and the sweep; nothing is downloaded."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

transformers: Any = None  # bound by the tests that import transformers first

VOCABULARY = 300
SMALL = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 16, "vocab_size": VOCABULARY, "d_model": 32, "encoder_layers": 1,
    "decoder_layers": 1, "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64, "num_layers": 2, "num_heads": 2, "projection_dim": 32, "moe_intermediate_size": 32,
    "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "image_size": 32, "patch_size": 8,
    "word_embed_proj_dim": 32, "max_position_embeddings": 512,
}  # fmt: skip
TOKEN_KEYS = ("_token_id", "_token_index", "_id", "_index")


def _shrunk(config: Any, depth: int = 0) -> Any:
    """The config with every size of :data:`SMALL` it has set small, its sub-configs too."""
    for key, value in SMALL.items():
        if isinstance(getattr(config, key, None), int):
            with contextlib.suppress(Exception):  # a size the config derives from others
                setattr(config, key, value)
    for value in list(vars(config).values()):
        if isinstance(value, transformers.PretrainedConfig) and depth < 3:
            _shrunk(value, depth + 1)
    return config


def _ids_inside(config: Any) -> Any:
    """The config with every special token id beyond the vocabulary moved inside it, each to its own id."""
    spare = iter(range(VOCABULARY - 1, 0, -1))

    def walk(part: Any, depth: int) -> None:
        for key, value in list(vars(part).items()):
            if isinstance(value, transformers.PretrainedConfig) and depth < 3:
                walk(value, depth + 1)
            elif key.endswith(TOKEN_KEYS) and type(value) is int and value >= VOCABULARY:
                setattr(part, key, next(spare))

    walk(config, 0)
    return config


def tiny(kind: str, **settings: Any) -> torch.nn.Module:
    """A tiny random model of the mapping's architecture ``kind``, in eval mode; ``settings`` set on its config
    (a dotted key reaches a sub-config: ``vision_config.image_size``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as MAPPING

    config = _ids_inside(_shrunk(transformers.AutoConfig.for_model(kind)))
    for key, value in settings.items():
        *path, last = key.split(".")
        part = config
        for step in path:
            part = getattr(part, step)
        setattr(part, last, value)
    torch.manual_seed(0)
    return getattr(transformers, MAPPING[kind])(config).eval()


def image_token(model: torch.nn.Module) -> int:
    """The model's image token id, as its config names it."""
    config = model.config
    found = getattr(config, "image_token_id", None)
    return found if isinstance(found, int) else config.image_token_index
