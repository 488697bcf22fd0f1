"""Models as users hold them: compiled, wrapped, scripted, quantized, of another dtype than their input, or left in
training mode. Each is explained as the eager model it is, or refused in one line that says why."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from ..errors import ExplainError


def held_model(model: nn.Module) -> nn.Module:
    """The eager model explain hooks for the one the user holds: a ``torch.compile``'d model's own module (the same
    parameters; compiling changes the speed, not the function), else the model itself.

    Raises:
        ExplainError: A TorchScript module, which runs no Python hooks; or a graph module that calls none of its
            layers (``torch.export``'s). A quantized model is refused where its missing gradient shows (see
            :func:`refuse_quantized`), as a method without gradients reads it.
    """
    if isinstance(model, torch.jit.ScriptModule):
        raise ExplainError(
            f"the model is a TorchScript module ({type(model).__name__}), which runs no Python hooks, so explain "
            "cannot read its layers: pass the eager model it was scripted or traced from"
        )
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    if isinstance(model, torch.fx.GraphModule) and not _calls_layers(model):
        raise ExplainError(
            f"the model is a graph of operations ({type(model).__name__}, as torch.export's module() gives) that "
            "calls none of its layers, so no hook on a layer runs: pass the eager model, or "
            "torch.export.unflatten(program), whose layers run"
        )
    return model


def refuse_quantized(model: nn.Module, modules: list[nn.Module]) -> None:
    """Where a call found no gradient at its layers, say why if the model is quantized (``modules``: its walk).

    Raises:
        ExplainError: One of its layers is one of torch's quantized layers, which carry no gradient.
    """
    quantized = next((m for m in modules if _is_quantized(m)), None)
    if quantized is not None:
        name = next(name for name, m in model.named_modules() if m is quantized)
        raise ExplainError(
            f"the model is quantized (its layer {name or 'itself'!r} is a quantized {type(quantized).__name__}): "
            "quantized layers carry no gradient, so explain cannot read them; pass the float model it was "
            "quantized from"
        )


def _calls_layers(graph: torch.fx.GraphModule) -> bool:
    """Whether a graph module calls any module that holds parameters (a layer), not only their operations."""
    called = {node.target for node in graph.graph.nodes if node.op == "call_module"}
    return any(next(graph.get_submodule(name).parameters(), None) is not None for name in called)


def _is_quantized(module: nn.Module) -> bool:
    """Whether the module is one of torch's quantized layers (dynamic or static)."""
    return type(module).__module__.startswith(("torch.ao.nn.quantized", "torch.nn.quantized"))


def in_model_dtype(model: nn.Module, x: Tensor) -> Tensor:
    """The input cast to the floating dtype of the model's parameters, where it is of another (a bfloat16 model
    given a float32 batch), as the model's own preprocessing would."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), x.dtype)
    return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x


def _varies(module: nn.Module) -> bool:
    """Whether the layer acts otherwise in training: a batch norm, or a dropout that drops."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) or (
        isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0
    )


def warn_training(modules: list[nn.Module]) -> None:
    """Warn, in one line, that a model left in training mode (``modules``: its walk) gives maps that vary from call
    to call."""
    varying = sorted({type(m).__name__ for m in modules if m.training and _varies(m)})
    if varying:
        warnings.warn(
            f"the model is in training mode: its {', '.join(varying)} layers use each batch's statistics or draw "
            "anew, so its maps vary from call to call; call model.eval() first for the eval model's map",
            UserWarning,
            stacklevel=4,
        )
