"""Find the target layer: by dotted name, by module, or automatically."""

from __future__ import annotations

import difflib
import itertools
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import LayerError
from .detectors import canvas_recorded
from .hooks import Hooks, layer_entry
from .layouts import Geometry, Layout, find_layout, grids_recorded, is_attention
from .model_state import eval_mode

LayerSpec = str | nn.Module | None


def resolve_layer(
    model: nn.Module, layer: str | nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None = None
) -> tuple[str, nn.Module]:
    """Return the dotted name and the module for ``layer``.

    Args:
        model: The model that holds the layer.
        layer: A dotted name such as ``"layer4"`` or ``"features.28"``, or the module itself;
            ``"backbone.fpn:0"`` names entry ``"0"`` of a module's dict, list or tuple output
            (a feature pyramid's level), checked when the model runs.
        x: An input batch of the model: for an unknown name, one forward of its first
            image finds the layers that could serve instead.
        model_kwargs: Further keyword arguments of the model's forward.

    Raises:
        LayerError: The name is unknown (the message names layers with spatial
            outputs, the closest names first) or the module is not part of ``model``.
    """
    names = {name: module for name, module in model.named_modules() if name}
    if isinstance(layer, nn.Module):
        for name, module in names.items():
            if module is layer:
                return name, module
        raise LayerError(f"the given {type(layer).__name__} module is not a submodule of the model")
    module_name = layer_entry(layer)[0]
    if module_name in names:
        return layer, names[module_name]
    candidates = [info.name for info in candidate_layers(model, x, model_kwargs)]
    close = difflib.get_close_matches(layer, candidates, n=6, cutoff=0.5)
    listed = f"the closest are {', '.join(close)}" if close else f"the last are {', '.join(candidates[-6:])}"
    raise LayerError(
        f"unknown layer {layer!r}; of the {len(candidates)} layers with spatial outputs, {listed} "
        "(all of them: explain --layers, or explain.candidate_layers(model, x))"
    )


def classifier(model: nn.Module) -> tuple[str, nn.Linear]:
    """The model's last linear layer, taken as its classifier, with its dotted name.

    Raises:
        LayerError: The model has no linear layer.
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise LayerError("the model has no linear layer to take as its classifier")
    return linears[-1]


# The automatic layers of each model, by input shape (C, H, W), so repeated calls skip the search.
_AUTO_LAYERS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], list[str]]] = weakref.WeakKeyDictionary()


def auto_layers(
    model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None = None
) -> list[tuple[str, nn.Module]]:
    """The automatic target layers (see :func:`find_auto_layers`), searched once per model and input shape."""
    known = _AUTO_LAYERS.setdefault(model, {})
    shape = tuple(x.shape[1:])
    modules = dict(model.named_modules())
    names = known.get(shape)
    if names is None or any(layer_entry(name)[0] not in modules for name in names):  # the model changed since
        known[shape] = find_auto_layers(model, x, model_kwargs)
    return [(name, modules[layer_entry(name)[0]]) for name in known[shape]]


@dataclass(frozen=True)
class LayerInfo:
    """A module of the model and what it gave in one forward pass.

    Attributes:
        name: Its dotted name.
        kind: Its class's name.
        shape: Its output's shape without the batch axis, or None when the output is not a
            tensor with one row per image (a dict, or the proposals of a detector's head).
        calls: How often it ran in the pass (more than once: a shared module).
        map_shape: The output as a map of the image, (C, h, w), or None when it is none
            (see :mod:`explain.core.layouts`).
        layout: How the output becomes that map, or None.
        start: When the module started, and
        finish: when it finished, on one clock that ticks at every module's start and finish.
    """

    name: str
    kind: str
    shape: tuple[int, ...] | None
    calls: int
    map_shape: tuple[int, int, int] | None = None
    layout: Layout | None = None
    start: int = 0
    finish: int = 0

    @property
    def spatial(self) -> bool:
        """Whether the output is a map of the image (C, h, w) with h, w > 1."""
        return self.map_shape is not None and min(self.map_shape[1:]) > 1

    @property
    def candidate(self) -> bool:
        """Whether a CAM can explain the layer: its output is a map of the image, and it runs once per forward."""
        return self.spatial and self.calls == 1


def trace_layers(model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None = None) -> list[LayerInfo]:
    """Every named module that runs when the model sees x's first image, in the order they finish, each
    tensor entry of a dict, list or tuple output after it as ``"name:key"``, with how its output reads as
    a map of the image (see :func:`explain.core.layouts.find_layout`); modules inside an attention module
    give none.

    One forward pass, in eval and inference mode, with ``model_kwargs`` passed to the
    model's forward; the model is left as it was.
    """
    infos: dict[str, LayerInfo] = {}
    modules = {name: module for name, module in model.named_modules() if name}
    starts: dict[str, int] = {}
    clock = itertools.count()

    def per_image_shape(value: Any) -> tuple[int, ...] | None:  # an output with one row per image, or None
        return tuple(value.shape[1:]) if isinstance(value, Tensor) and value.dim() and len(value) == 1 else None

    def started(name: str, module: nn.Module, inputs: Any) -> None:  # a forward pre-hook
        starts.setdefault(name, next(clock))

    def record(name: str, module: nn.Module, inputs: Any, output: Any) -> None:  # a forward hook
        entries: Any = []
        if isinstance(output, Mapping):
            entries = output.items()
        elif isinstance(output, (list, tuple)):
            entries = enumerate(output)
        for key, value in [(None, output), *entries]:
            label = name if key is None else f"{name}:{key}"
            if label in infos:
                infos[label] = replace(infos[label], calls=infos[label].calls + 1)
            elif key is None or isinstance(value, Tensor):
                shape = per_image_shape(value)
                infos[label] = LayerInfo(label, type(module).__name__, shape, 1, start=starts[name], finish=next(clock))

    with (
        Hooks() as hooks,
        eval_mode(model),
        torch.inference_mode(),
        canvas_recorded(model) as canvases,
        grids_recorded(model) as grids,
    ):
        for name, module in modules.items():
            hooks.forward_pre(module, partial(started, name))
            hooks.forward(module, partial(record, name))
        model(x[:1], **(model_kwargs or {}))
    geometry = Geometry(canvases[-1].size if canvases else tuple(x.shape[-2:]), grids[-1] if grids else None)
    return [_as_map(model, info, geometry) for info in infos.values()]


def _as_map(model: nn.Module, info: LayerInfo, geometry: Geometry) -> LayerInfo:
    """The info with its map shape and layout, where its output is a map of the image."""
    if info.shape is None:
        return info
    try:
        layout = find_layout(model, info.name, info.shape, geometry)
    except LayerError:
        return info
    probe = layout(torch.empty(1, *info.shape, device="meta"))
    return replace(info, map_shape=tuple(probe.shape[1:]), layout=layout)


def candidate_layers(model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None = None) -> list[LayerInfo]:
    """The layers a CAM can explain at x's input size: modules that run once per forward and
    whose output is a map of the image (see :mod:`explain.core.layouts`) with h, w > 1, in the order
    they finish (one forward pass)."""
    return [info for info in trace_layers(model, x, model_kwargs) if info.candidate]


BACKBONE = "backbone"  # torchvision's detectors and segmenters: the module whose dict of maps feeds the heads
_NOT_AUTOMATIC = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Identity)  # a resampling or an alias of a map


def find_auto_layers(model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None = None) -> list[str]:
    """Name the automatic target layers (one forward pass):

    - a model with a ``backbone`` submodule whose output is a dict of maps (torchvision's
      detectors and segmenters: the feature pyramid's levels, or a segmenter's ``out``,
      ``aux``, ``low`` and ``high`` maps): every level, to be fused. A detection's score
      reaches only the level its box or anchor was assigned to, so the other levels'
      maps are zero and the fused map is that level's;
    - a transformer whose layers output tokens: the input of its last attention, the
      last normalization with token output to finish after the previous attention and
      before the last one starts (``blocks.11.norm1``). The last block's own output gets
      no gradient at the patch tokens when the head reads only the class token;
    - any other model: the last layer to finish whose output is a map of the image,
      adaptive pools (which resample the map to a fixed size) and identities left out.

    Raises:
        LayerError: No module of the model produces a spatial map.
    """
    return choose_auto_layers(model, trace_layers(model, x, model_kwargs))


def choose_auto_layers(model: nn.Module, infos: list[LayerInfo]) -> list[str]:
    """The automatic target layers (see :func:`find_auto_layers`) among a forward pass's traced layers.

    Raises:
        LayerError: No module of the model produces a spatial map.
    """
    candidates = [info for info in infos if info.candidate]
    if not candidates:
        raise LayerError("no layer of the model outputs a map of the image (N, C, H, W); pass layer=")
    entries = [(info.name, *layer_entry(info.name)) for info in candidates]
    levels = [name for name, module, key in entries if module == BACKBONE and key is not None]
    if levels:
        return levels
    modules = dict(model.named_modules())
    calls = [(info.start, info.finish) for info in infos if is_attention(modules[layer_entry(info.name)[0]])]
    if calls and any(info.layout.kind == "tokens" for info in candidates):
        last = max(start for start, _ in calls)
        previous = max((finish for _, finish in calls if finish < last), default=-1)  # the block before's attention
        inputs = [
            c for c in candidates if c.layout.kind == "tokens" and "Norm" in c.kind and previous < c.finish < last
        ]
        if inputs:
            return [inputs[-1].name]
    usable = [info for info in candidates if not isinstance(modules[layer_entry(info.name)[0]], _NOT_AUTOMATIC)]
    return [(usable or candidates)[-1].name]
