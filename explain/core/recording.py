"""What a method's passes record, and where: a :class:`Recording`, which a method declares in its ``Needs`` and the
pass runner (:mod:`explain.core.runner`) asks.

A recording says three things: the call's layers (:meth:`Recording.layers`), the recorder that hooks them for one
pass (:meth:`Recording.recorder`, whose ``backward`` gives the score's gradient at each), and how a recorded output
becomes a map (:meth:`Recording.layout`). The default records the outputs of the layers a method names, or of the
automatic ones, and their plain gradients; the attention methods record the attention's probabilities
(:class:`AttentionProbabilities`), FullGrad the input and every bias
(:class:`explain.methods.gradient.BiasedLayers`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from torch import Tensor, nn

from ..errors import LayerError
from .attention_capture import AttentionRecorder, attention_modules
from .hooks import ActivationGradientRecorder
from .layers import auto_layers, resolve_layer
from .layouts import Geometry, Layout, Reshape
from .model_state import model_context
from .watch import PassLayouts

INPUT = "input"  # the layer name of the input, for methods whose map is the input's

Layers = list[tuple[str, nn.Module | None]]


class Asking(Protocol):
    """What a recording reads of the method that declares it: its model and the options of its call."""

    model: nn.Module
    labels: Sequence[str] | None
    requested: list[Any] | None
    reshape: Reshape | None

    @property
    def needs(self) -> Any:
        """What the method's formula needs (:class:`explain.core.runner.Needs`)."""


class Recording:
    """The layers' outputs and their gradients, at the layers a method names or the automatic ones.

    Attributes:
        searched: Whether a method that names no layer gets the automatic ones, searched by the runner.
    """

    searched = True

    def layers(self, method: Asking, x: Tensor, model_kwargs: Mapping[str, Any], goal: Any) -> Layers:
        """The call's layers by name and module: the input, for a method whose map is the input's; else those the
        method names, or the automatic ones for x and the call's target."""
        if method.needs.map_of_input:
            return [(INPUT, None)]
        if method.requested is None:
            return auto_layers(method.model, x, model_kwargs, goal, method.labels)
        return [resolve_layer(method.model, spec, x, model_kwargs) for spec in method.requested]

    def recorder(self, method: Asking, modules: Mapping[str, nn.Module]) -> ActivationGradientRecorder:
        """What records the layers' outputs and gradients in one pass (see :mod:`explain.core.hooks`)."""
        learned = model_context(method.model)
        return ActivationGradientRecorder(modules, gradients=method.needs.gradients, learned=learned)

    def layout(self, method: Asking, name: str, activation: Tensor, geometry: Geometry, known: PassLayouts) -> Layout:
        """How a layer's output becomes a map: the method's ``reshape``, else as the model's context or the pass
        itself tells (see :mod:`explain.core.watch` and :mod:`explain.core.layouts`).

        Raises:
            LayerError: The output is no map of the image.
        """
        if method.reshape is not None:
            return Layout("reshape", reshape=method.reshape)
        return known.layout(name, activation, geometry)


LAYER_OUTPUTS = Recording()

def chosen_attention(model: nn.Module, requested: list[Any] | None, method: str) -> dict[str, nn.Module]:
    """The attention modules a ``method`` reads, by name, in the order the model runs them: those ``requested`` (by
    name or module), or all that can be read; found anew at each call, as the model has them then.

    Raises:
        LayerError: A module asked for is no readable attention, or the model has none.
    """
    readable = attention_modules(model)
    if requested is None:
        chosen = readable
    else:
        named = dict(model.named_modules())
        chosen = {}
        for spec in requested:
            name = next((n for n, m in named.items() if m is spec), None) if isinstance(spec, nn.Module) else spec
            if name not in readable:
                raise LayerError(
                    f"{name!r} is not an attention module that can be read; the model's are "
                    f"{', '.join(readable) or 'none'}"
                )
            chosen[name] = readable[name]
    if not chosen:
        raise LayerError(
            f"{method} reads the attention of nn.MultiheadAttention, timm's Attention or HuggingFace's ViT, DeiT, "
            "DINOv2 and CLIP attention; this model has none"
        )
    return chosen


def layer_label(names: list[str]) -> str:
    """The attention modules' layer name in a call's records: the one, or the first and last of several."""
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]} ({len(names)} attention layers)"


class AttentionProbabilities(Recording):
    """The probabilities of the attention modules a method names (all that can be read where it names none) and
    their gradients, stacked as one layer (N, layers, heads, T, T)."""

    searched = False

    def chosen(self, method: Asking) -> dict[str, nn.Module]:
        """The attention modules the method reads (see :func:`chosen_attention`)."""
        return chosen_attention(method.model, method.requested, type(method).__name__)

    def layers(self, method: Asking, x: Tensor, model_kwargs: Mapping[str, Any], goal: Any) -> Layers:
        return [(layer_label(list(self.chosen(method))), None)]

    def recorder(self, method: Asking, modules: Mapping[str, nn.Module]) -> AttentionRecorder:
        chosen = self.chosen(method)
        return AttentionRecorder(chosen, layer_label(list(chosen)), gradients=method.needs.gradients)

    def layout(self, method: Asking, name: str, activation: Tensor, geometry: Geometry, known: PassLayouts) -> Layout:
        return Layout("attention")


ATTENTION = AttentionProbabilities()
