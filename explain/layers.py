"""Find the target layer: by dotted name, by module, or automatically."""

from __future__ import annotations

import difflib
import weakref
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from .errors import LayerError
from .model_state import eval_mode

LayerSpec = str | nn.Module | None


def resolve_layer(model: nn.Module, layer: str | nn.Module) -> tuple[str, nn.Module]:
    """Return the dotted name and the module for ``layer``.

    Args:
        model: The model that holds the layer.
        layer: A dotted name such as ``"layer4"`` or ``"features.28"``, or the module itself.

    Raises:
        LayerError: The name is unknown (the closest valid names are listed) or the
            module is not part of ``model``.
    """
    names = {name: module for name, module in model.named_modules() if name}
    if isinstance(layer, nn.Module):
        for name, module in names.items():
            if module is layer:
                return name, module
        raise LayerError(f"the given {type(layer).__name__} module is not a submodule of the model")
    if layer in names:
        return layer, names[layer]
    close = difflib.get_close_matches(layer, list(names), n=6, cutoff=0.5)
    hint = close or [name for name in names if "." not in name]
    raise LayerError(f"unknown layer {layer!r}; closest valid names: {', '.join(hint)}")


def classifier(model: nn.Module) -> tuple[str, nn.Linear]:
    """The model's last linear layer, taken as its classifier, with its dotted name.

    Raises:
        LayerError: The model has no linear layer.
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise LayerError("the model has no linear layer to take as its classifier")
    return linears[-1]


# The automatic layer of each model, by input shape (C, H, W), so repeated calls skip the search.
_AUTO_LAYERS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], str]] = weakref.WeakKeyDictionary()


def auto_layer(model: nn.Module, x: Tensor) -> tuple[str, nn.Module]:
    """The automatic target layer (see :func:`find_auto_layer`), searched once per model and input shape."""
    known = _AUTO_LAYERS.setdefault(model, {})
    shape = tuple(x.shape[1:])
    if shape in known:
        try:
            return resolve_layer(model, known[shape])
        except LayerError:  # the model's modules changed since: search again
            pass
    known[shape] = find_auto_layer(model, x)
    return resolve_layer(model, known[shape])


def find_auto_layer(model: nn.Module, x: Tensor) -> str:
    """Name the last module whose output is a spatial map (N, C, H, W) with H, W > 1.

    One forward pass on the first image, in eval and inference mode, records
    which modules produce such maps and in which order they finish; modules that
    run more than once per forward (shared modules) are passed over.

    Raises:
        LayerError: No module of the model produces a spatial map.
    """
    calls: dict[str, int] = {}
    spatial: list[str] = []

    def record(name: str, module: nn.Module, inputs: Any, output: Any) -> None:  # a forward hook
        calls[name] = calls.get(name, 0) + 1
        if isinstance(output, Tensor) and output.dim() == 4 and min(output.shape[-2:]) > 1:
            spatial.append(name)

    handles = [module.register_forward_hook(partial(record, name)) for name, module in model.named_modules() if name]
    try:
        with eval_mode(model), torch.inference_mode():
            model(x[:1])
    finally:
        for handle in handles:
            handle.remove()
    for name in reversed(spatial):
        if calls[name] == 1:
            return name
    raise LayerError("no layer of the model outputs a spatial (N, C, H, W) map; pass layer=")
