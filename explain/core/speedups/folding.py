"""Forwards that need no gradient, as fast as the CPU runs them: Score-CAM's family and the faithfulness metrics
score thousands of perturbed inputs with :class:`ScoringForwards`. On the CPU the inputs go in channels last,
which oneDNN's convolutions run faster, and the model's batch norms are folded into the convolutions before them,
in a copy of a model in eval mode: the same function in fewer passes over memory. Outputs agree to float32
rounding, and the user's model is never changed.

The copy is traced with ``torch.fx``, every convolution and batch norm (subclasses included) a leaf, so a
convolution that pads itself from its input's shape (TensorFlow's "SAME", as in the bundled EfficientNet-Lite0)
traces too. A batch norm is folded where it alone reads a convolution's output, with running statistics. A
batch norm with an activation after it in one module (the bundled model's and timm's ``BatchNormAct2d``,
recognised by their classes) leaves that activation in its place; any other subclass of ``BatchNorm2d`` is kept
whole, its forward unknown.

The folded copy of a model is built once and kept while the model lives (a weak reference) and its parameters
and buffers hold the values it was built from: a loop of metric or Score-CAM calls pays the copy and the trace
once, and a model changed in any way (trained, loaded, moved) is folded afresh.
"""

from __future__ import annotations

import copy
import sys
from collections import Counter
from typing import Any, TypeVar

import torch
from torch import Tensor, fx, nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from ..context import context_of
from ..model_state import model_context
from . import enabled

# Subclasses of BatchNorm2d whose forward is act(drop(batch_norm(x))): what remains of them once folded.
_NORM_ACT: set[type[nn.BatchNorm2d]] = set()
_TIMM_NORM_ACT = ("timm.layers.norm_act", "BatchNormAct2d")  # recognised once timm is imported

NormAct = TypeVar("NormAct", bound=type[nn.BatchNorm2d])


def norm_with_activation(cls: NormAct) -> NormAct:
    """Class decorator: a ``BatchNorm2d`` subclass whose forward is ``act(drop(batch_norm(x)))``, with ``act``
    (and optionally ``drop``) attributes, so folding keeps its activation in its place."""
    _NORM_ACT.add(cls)
    return cls


def _is_norm_act(norm: nn.BatchNorm2d) -> bool:
    module, name = _TIMM_NORM_ACT
    timm_class = getattr(sys.modules.get(module), name, None)
    return type(norm) in _NORM_ACT or (timm_class is not None and type(norm) is timm_class)


class _LeafTracer(fx.Tracer):
    """Traces through every module but convolutions, batch norms and torch's own."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, (nn.Conv2d, nn.BatchNorm2d)) or super().is_leaf_module(module, qualified_name)


def _after_norm(norm: nn.BatchNorm2d) -> nn.Module | None:
    """What a batch norm leaves behind once folded into the convolution before it, or None: not foldable."""
    if norm.training or norm.running_mean is None or norm.running_var is None:
        return None
    if type(norm) is nn.BatchNorm2d:
        return nn.Identity()
    if _is_norm_act(norm):
        return nn.Sequential(getattr(norm, "drop", nn.Identity()), norm.act)
    return None


def folded(model: nn.Module) -> fx.GraphModule:
    """A traced copy of ``model`` with every batch norm that alone reads a convolution's output folded into it
    (each called once).

    Raises:
        Whatever ``torch.fx`` raises for a model it cannot trace (control flow on tensor values, say).
    """
    copied = copy.deepcopy(model)
    traced = fx.GraphModule(copied, _LeafTracer().trace(copied))
    modules = dict(traced.named_modules())
    calls = Counter(node.target for node in traced.graph.nodes if node.op == "call_module")
    for node in traced.graph.nodes:
        source = node.args[0] if node.op == "call_module" and node.args else None
        if not isinstance(source, fx.Node) or source.op != "call_module" or len(source.users) != 1:
            continue
        conv, norm = modules[source.target], modules[node.target]
        if not isinstance(conv, nn.Conv2d) or not isinstance(norm, nn.BatchNorm2d) or conv.training:
            continue
        if calls[source.target] > 1 or calls[node.target] > 1:  # a module called twice is shared by both calls
            continue
        remaining = _after_norm(norm)
        if remaining is None or conv.out_channels != norm.num_features:
            continue
        _replace(traced, source.target, fuse_conv_bn_eval(conv, norm))
        _replace(traced, node.target, remaining)
    traced.recompile()
    return traced.train(copied.training)  # the modules fx and the folding made start in training mode


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` in the place of the submodule ``name``."""
    parent, _, attribute = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attribute, module)


class _Folded:
    """A model's folded copy (None: the model does not trace) and the values of its state it was built from."""

    def __init__(self, model: nn.Module) -> None:
        self.state = _state(model)
        self.values = [tensor.detach().clone() for _, tensor in self.state]
        try:
            self.copy: nn.Module | None = folded(model)
        except Exception:  # whatever torch.fx cannot trace runs as it is
            self.copy = None

    def current(self, model: nn.Module) -> bool:
        """Whether the model's parameters and buffers are still those, holding the same values."""
        state = _state(model)
        if [(name, id(t), t.device, t.dtype, t.shape) for name, t in state] != [
            (name, id(t), t.device, t.dtype, t.shape) for name, t in self.state
        ]:
            return False
        with torch.no_grad():
            return all(torch.equal(t, value) for (_, t), value in zip(state, self.values))


def _state(model: nn.Module) -> list[tuple[str, Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def folded_copy(model: nn.Module) -> nn.Module | None:
    """The model's folded copy (see :func:`folded`), built at the first call and again once the model's parameters
    or buffers change; None for a model that does not trace. The copy never refers to the model, so it is dropped
    with the model."""
    context = context_of(model)
    with context.lock:
        entry = model_context(model).folded
        if entry is None or not entry.current(model):
            entry = context.folded = _Folded(model)
        return entry.copy


def _blocks_folding(module: nn.Module) -> bool:
    """Whether a module keeps its model from being folded: it is in training mode, or carries forward hooks."""
    return module.training or bool(module._forward_hooks or module._forward_pre_hooks)


class ScoringForwards:
    """A model's forwards without gradient, as fast as the device allows. On the CPU: channels-last inputs (a
    model that cannot take them gets contiguous ones from the first refusal on) and, with ``fold``, the copy of
    :func:`folded` where the model is in eval mode, carries no forward hook (the user's hooks run on the user's
    model, as they would without explain) and traces; anything else runs as it is. Elsewhere the model itself, as
    it is (on a GPU the gain was not measured).

    Args:
        model: The model; never changed.
        device: Where the inputs are.
        fold: Whether the forwards may run a folded copy (not where hooks on the model itself must run).
    """

    def __init__(self, model: nn.Module, device: torch.device, fold: bool = True) -> None:
        self.model = model
        self.channels_last = device.type == "cpu" and enabled("channels_last")
        cpu, folds = device.type == "cpu", fold and enabled("folding")
        if cpu and folds and not any(_blocks_folding(m) for m in model.modules()):
            self.model = folded_copy(model) or model

    def __call__(self, inputs: Tensor, **model_kwargs: Any) -> Any:
        if self.channels_last:
            try:
                return self.model(inputs.contiguous(memory_format=torch.channels_last), **model_kwargs)
            except RuntimeError:  # e.g. a .view() of a feature map; contiguous inputs serve every model
                self.channels_last = False
        return self.model(inputs.contiguous(), **model_kwargs)
