"""Concept dictionaries learned elsewhere, used as CRAFT's bank: a basis of concepts × channels at a layer, from a
tensor, a file, or an ``overcomplete`` dictionary (its NMF, semi-NMF or sparse autoencoder: anything with
``get_dictionary()``). Each concept's map on an image is its coefficient at every position of the layer
(:meth:`explain.concepts.craft.ConceptBank.on`: non-negative least squares on the basis, by the factorization's own
rule; a sparse autoencoder's own encoder is not used)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import ExplainError
from .craft import ConceptBank

KEY = "dictionary"  # the entry read from a file that holds several tensors


def dictionary_bank(source: Any, layer: str, signed: bool | None = None) -> ConceptBank:
    """A concept bank from a dictionary.

    Args:
        source: A (concepts, channels) tensor or array; a file of one (``.pt``/``.pth`` saved by ``torch.save``,
            ``.npy``, ``.safetensors``: the one 2-D tensor it holds, or its entry ``dictionary``); or an object with
            ``get_dictionary()`` (``overcomplete``'s NMF, semi-NMF and sparse autoencoders).
        layer: The layer whose channels the dictionary's columns are.
        signed: Whether the basis may be negative (its coefficients then found by semi-NMF's rule); None: whether
            it has negative entries.

    Raises:
        ExplainError: A file that cannot be read or holds no single 2-D tensor, or a dictionary that is not
            (concepts, channels) of finite values.
    """
    found = _tensor(source)
    if found.dim() != 2 or min(found.shape) == 0 or not bool(torch.isfinite(found).all()):
        raise ExplainError(f"a dictionary must be (concepts, channels) of finite values, got {tuple(found.shape)}")
    bank = found.detach().double()
    negative = bool((bank < 0).any())
    signed = negative if signed is None else signed
    if negative and not signed:
        raise ExplainError("the dictionary has negative entries: its coefficients need signed=True (semi-NMF's rule)")
    empty = torch.zeros(0, 4, dtype=torch.long)
    return ConceptBank(bank, layer, signed, empty, torch.zeros(0, len(bank), dtype=bank.dtype), math.nan)


def _tensor(source: Any) -> Tensor:
    """The dictionary's tensor from any of the sources :func:`dictionary_bank` takes."""
    if hasattr(source, "get_dictionary"):
        return torch.as_tensor(source.get_dictionary())
    if isinstance(source, (Tensor, np.ndarray)):
        return torch.as_tensor(source)
    path = Path(source)
    if not path.is_file():
        raise ExplainError(f"{path}: no such dictionary file")
    try:
        if path.suffix == ".npy":
            return torch.from_numpy(np.load(path, allow_pickle=False))
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return _single(load_file(str(path)), path)
        return _single(torch.load(path, map_location="cpu", weights_only=True), path)
    except (OSError, ValueError, RuntimeError) as err:
        raise ExplainError(f"{path}: not a readable dictionary ({str(err).splitlines()[0]})") from err


def _single(loaded: Any, path: Path) -> Tensor:
    """The tensor a file holds: itself, its entry ``dictionary``, or its one 2-D tensor."""
    if isinstance(loaded, Tensor):
        return loaded
    if isinstance(loaded, dict):
        if isinstance(loaded.get(KEY), Tensor):
            return loaded[KEY]
        matrices = [value for value in loaded.values() if isinstance(value, Tensor) and value.dim() == 2]
        if len(matrices) == 1:
            return matrices[0]
    raise ExplainError(f"{path}: holds no single 2-D tensor; save the dictionary alone, or under {KEY!r}")
