"""The ``narrow_watch`` speedup: the watch of a call's own forward (:class:`explain.core.watch.PassWatch`), on a
convolutional network, hooks only the modules that tell the recorded layers' layouts, not every module.

What the watch reads of a recorded layer:

- its **feature axis**, from the operations that consume its output: the operation trace follows them whatever
  modules are hooked, once the layer's own hook has handed its output over;
- whether it lies **inside an attention module**: an attention operation marks the innermost hooked module running.
  With the layer, every module around it and each of their children hooked, an operation run directly by a module
  around the layer marks that module, as the full watch does; one run deeper marks a child that is not around the
  layer, which no layout of the layer reads;
- its **tokens**, and the modules whose output is a sequence: a convolutional network makes neither, so the watch
  is narrowed only on a model that reads as one: no patch embedding, no layer norm or attention module, and its
  linear layers and 1-D batch norms (the layers of tokens, as LeViT's) in its last part alone (a classifier's
  head). What a narrow watch does not tell (tokens made after all) is read from the full trace, after the pass, as
  any layout the forward does not tell: a model misjudged costs one forward more, never another layout. The
  sequences it finds are kept as the modules the rows speedup hooks, which only spares less.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from ..attention_capture import attention_kind
from ..hooks import layer_entry
from ..layers import wrapped_names
from ..layouts import patch_embedding
from ..model_state import module_names, modules_of
from . import enabled

SEQUENCE_LAYERS = (nn.LayerNorm, nn.MultiheadAttention)  # layers that work on sequences (T, C)
TOKEN_LAYERS = (nn.Linear, nn.BatchNorm1d)  # layers of tokens too: a CNN has them in its head alone


def watched_modules(model: nn.Module, names: Collection[str]) -> set[str] | None:
    """The names of the modules the watch of a pass recording ``names`` hooks, or None for every module (the
    speedup off, or a model that may make tokens)."""
    if not enabled("narrow_watch") or patch_embedding(model) is not None:
        return None
    if not _convolutional(model, modules_of(model)):
        return None
    hooked: set[str] = set()
    known = module_names(model)
    for name in names:
        given = layer_entry(name)[0]  # as the user names it: the model they wrapped may call it otherwise
        layer = next((own for own in (given, *wrapped_names(model, given)) if own in known), None)
        if layer is None:
            return None
        parts = layer.split(".")
        around = [".".join(parts[:depth]) for depth in range(1, len(parts))]
        hooked.update([layer, *around])
        for outer in around:
            children = known[outer]._modules  # the modules by name, found once per structure
            hooked.update(f"{outer}.{child}" for child in children)
    return hooked


def _convolutional(model: nn.Module, modules: list[nn.Module]) -> bool:
    """Whether the model (walked as ``modules``) reads as a convolutional network: no layer norm or attention module,
    and its linear layers and 1-D batch norms in its last child alone."""
    if any(isinstance(m, SEQUENCE_LAYERS) or attention_kind(m) is not None for m in modules):
        return False
    last = next(reversed(model._modules.values()), None)
    head = set(map(id, last.modules())) if last is not None else set()
    return not any(isinstance(m, TOKEN_LAYERS) and id(m) not in head for m in modules)
