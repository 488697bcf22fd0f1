"""BatchNorm folded into the convolution before it: a copy of a model in eval mode for forwards that need no
gradient (Score-CAM's family scores thousands of masked inputs with it). The same function in fewer passes over
memory: outputs agree to float32 rounding, and the user's model is never changed.

The copy is traced with ``torch.fx``, every convolution and batch norm (subclasses included) a leaf, so a
convolution that pads itself from its input's shape (TensorFlow's "SAME", as in the bundled EfficientNet-Lite0)
traces too. A batch norm is folded where it alone reads a convolution's output, with running statistics. A
batch norm with an activation after it in one module (the bundled model's and timm's ``BatchNormAct2d``) leaves
that activation in its place; any other subclass of ``BatchNorm2d`` is kept whole, its forward unknown.
"""

from __future__ import annotations

import copy
from collections import Counter

from torch import fx, nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

# Batch norms followed by their own activation, as (module, class): what remains of them once folded.
_NORM_ACT = {("explain.efficientnet_lite0", "BatchNormAct2d"), ("timm.layers.norm_act", "BatchNormAct2d")}


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
    if (type(norm).__module__, type(norm).__name__) in _NORM_ACT:
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
    return traced


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` in the place of the submodule ``name``."""
    parent, _, attribute = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attribute, module)
