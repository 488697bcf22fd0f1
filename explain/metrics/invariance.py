"""Input invariance (Kindermans et al., "The (un)reliability of saliency methods", 2019): a model and a copy of it
that takes every input shifted by a constant m and gives the same outputs, its first layer's bias lowered by
W m, should be explained alike. Gradients pass; a method that multiplies by the input does not.

The copy is exact, zero padding included: where the first layer is a convolution padded with zeros, the copy
pads the shifted input with m (so its border sees the shift too) and convolves without padding. The user's model
is never changed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.held import held_model, in_model_dtype
from ..core.hooks import Hooks
from ..errors import ExplainError
from ..targets import TargetLike
from .sanity import _layer_names
from .scoring import plain_forwards

Layer = nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d


class _PaddedWith(nn.Module):
    """A constant pad of the input (``F.pad``'s widths, last axis first) before a layer."""

    def __init__(self, widths: list[int], value: float, layer: nn.Module) -> None:
        super().__init__()
        self.widths, self.value, self.layer = widths, value, layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(F.pad(x, self.widths, value=self.value))


def first_layer(model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None) -> str:
    """The name of the layer (a module without submodules) the model's forward hands the input itself to first.

    Raises:
        ExplainError: No module takes the input as it is, or the first is not a linear layer or a convolution.
    """
    taken: list[tuple[str, nn.Module]] = []
    with Hooks() as hooks, plain_forwards(model):
        for name, module in model.named_modules():
            if name and next(module.children(), None) is None:  # its layers, not the blocks holding them
                hooks.forward_pre(
                    module, lambda m, args, name=name: taken.append((name, m)) if args and args[0] is x else None
                )
        model(x, **dict(model_kwargs or {}))
    if not taken or not isinstance(taken[0][1], Layer):
        found = f"{taken[0][0]!r} ({type(taken[0][1]).__name__})" if taken else "no module"
        raise ExplainError(
            f"input invariance shifts the first layer's bias; the input goes first to {found}: it needs a model "
            "whose forward hands the input itself to a linear layer or a convolution"
        )
    return taken[0][0]


def _conv_pad(layer: nn.Module, x: Tensor) -> list[int]:
    """The zero padding a convolution adds, as ``F.pad`` widths (last axis first)."""
    dims = x.dim() - 2
    if layer.padding == "same":
        totals = [d * (k - 1) for d, k in zip(layer.dilation, layer.kernel_size)]
        pairs = [(t // 2, t - t // 2) for t in totals]
    else:
        pairs = [(p, p) for p in (layer.padding if layer.padding != "valid" else (0,) * dims)]
    return [w for pair in reversed(pairs) for w in pair]


def shifted_model(model: nn.Module, x: Tensor, shift: float, model_kwargs: Mapping[str, Any] | None) -> nn.Module:
    """A copy of the model whose output for x + shift equals the model's for x (Kindermans et al.'s)."""
    name = first_layer(model, x if model_kwargs else x[:1], model_kwargs)  # one image finds it
    copied = copy.deepcopy(model)
    layer: Any = copied.get_submodule(name)
    with torch.no_grad():
        weight_sums = layer.weight.sum(dim=tuple(range(1, layer.weight.dim())))
        if layer.bias is None:
            layer.bias = nn.Parameter(torch.zeros_like(weight_sums), requires_grad=layer.weight.requires_grad)
        layer.bias -= weight_sums * shift
    replacement: nn.Module = layer
    if not isinstance(layer, nn.Linear) and layer.padding_mode == "zeros" and any(_conv_pad(layer, x)):
        widths = _conv_pad(layer, x)
        layer.padding = (0,) * (x.dim() - 2)
        replacement = _PaddedWith(widths, shift, layer)
    parent, _, child = name.rpartition(".")
    setattr(copied.get_submodule(parent) if parent else copied, child, replacement)
    return copied


def input_invariance(
    model: nn.Module,
    x: Tensor,
    method: str = "saliency",
    target: TargetLike = None,
    *,
    layer: Any = None,
    shift: float = -1.0,
    atol: float = 1e-4,
    model_kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> Tensor:
    """Input invariance: whether the method's map of x on the model equals, within ``atol``, its map of x + shift
    on the shifted copy. Quantus 0.6.0's ``InputInvariance`` leaves each image's first element unshifted, and its
    copy (the bias lowered by the least response to the shift) is exact only for a first layer without padding;
    here every element moves and the copy is exact.

    Args:
        model: The model; left as it was (the shifted one is a copy).
        x: The images, (N, C, H, W) (or any input the first layer takes).
        method: A method's name (``explain.METHODS``).
        target: What to explain, bound on the model; the copy explains the same classes.
        layer: The method's layer(s), for a CAM (the same names in the copy).
        shift: The constant m added to every input element (Quantus' -1).
        atol: The largest difference of two maps called equal (Quantus' 1e-4).
        model_kwargs: Further keyword arguments of the model's forward.
        **options: The method's options.

    Returns:
        Whether each image's map is unchanged, (N,) bool.

    Raises:
        ExplainError: The model does not hand its input to a linear layer or a convolution first, or the copy's
            outputs differ from the model's (a forward that reads the input elsewhere too).
    """
    from ..methods import create_method

    model = held_model(model)  # a compiled model's own module: the one copied and shifted
    x = in_model_dtype(model, x)
    layer = _layer_names(model, layer)
    shifted = shifted_model(model, x, shift, model_kwargs)
    plain = create_method(method, model, layer, **options)(x, target, model_kwargs=model_kwargs)
    moved = create_method(method, shifted, layer, **options)(x + shift, plain.target, model_kwargs=model_kwargs)
    # the outputs' own rounding: 1e-4 in float32, a few steps of bfloat16's or float16's coarser one
    tolerance = None if plain.logits is None else max(1e-4, 8 * torch.finfo(plain.logits.dtype).eps)
    if (
        plain.logits is not None
        and moved.logits is not None
        and not torch.allclose(plain.logits, moved.logits, rtol=tolerance, atol=tolerance)
    ):
        raise ExplainError(
            "input invariance: the shifted copy's outputs differ from the model's; its forward reads the input "
            "beyond the first layer, so no bias makes the shift vanish"
        )
    return ((plain.cams - moved.cams).abs().flatten(1) <= atol).all(dim=1)
