"""Capture a layer's activation and the gradient of a score with respect to it.

The recorder puts a forward hook on each target module. The hook detaches the
module's output into a fresh autograd leaf and hands that leaf on to the rest of
the model, so that, with the parameters frozen (see :mod:`explain.core.model_state`),
autograd records only the part of the network *after* the target layer: the
gradient costs a backward pass through the head alone, never through the
backbone, and no weight gradient is ever computed.

The gradient is caught by a full-backward hook (``register_full_backward_hook``).
PyTorch refuses such a hook when the model later modifies the layer's output in
place ("Output 0 of BackwardHookFunctionBackward is a view and is being modified
inplace": a ``ReLU(inplace=True)`` after a VGG conv, ``out += identity`` after a
ResNet ``bn2``). The recorder then switches, once, to a tensor hook
(``Tensor.register_hook``) on a copy of the output that the model is free to
modify; the activation kept is the output as the layer returned it, and the
gradient is the gradient with respect to that value, on either path. A target layer
computed from another target layer's output takes the tensor-hook path too, once found:
a full-backward hook would hand a zero gradient back through all that lies between the
two layers whenever the score reaches the earlier layer alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..errors import LayerError
from ..warning_filters import warning_filter
from .context import ModelContext
from .model_state import model_context

_INPLACE_CLASH = "BackwardHookFunction"  # in PyTorch's error for an in-place change of the output



def layer_entry(name: str) -> tuple[str, str | None]:
    """A layer name's module and the entry it names in a dict, list or tuple output, if any:
    ``"backbone.fpn:0"`` is entry ``"0"`` of what ``backbone.fpn`` returns."""
    module, separator, key = name.partition(":")
    return module, key if separator else None


def _entry_key(output: Any, key: str) -> Any:
    """The key or index of ``output`` that ``key`` names, or None."""
    if isinstance(output, Mapping):
        for candidate in (key, int(key) if key.lstrip("-").isdigit() else None):
            if candidate in output:
                return candidate
    elif isinstance(output, (list, tuple)) and key.lstrip("-").isdigit() and -len(output) <= int(key) < len(output):
        return int(key)
    return None


def output_entry(output: Any, key: str, name: str) -> tuple[Any, Tensor]:
    """The entry of a dict, list or tuple output that ``key`` names: its key or index and the tensor.

    Raises:
        LayerError: No tensor entry of that name; the message lists the entries there are.
    """
    found = _entry_key(output, key)
    if found is None or not isinstance(output[found], Tensor):
        kind = type(output).__name__
        entries: list[Any] = []
        if isinstance(output, Mapping):
            entries = list(output)
        elif isinstance(output, (list, tuple)):
            entries = list(range(len(output)))
        listed = f"; its entries: {', '.join(map(repr, entries))}" if entries else ""
        raise LayerError(f"layer {name!r}: the {kind} output has no tensor entry {key!r}{listed}")
    return found, output[found]


def with_entry(output: Any, key: Any, value: Tensor) -> Any:
    """A copy of a dict, list or tuple output with one entry replaced."""
    if isinstance(output, Mapping):
        replaced = copy.copy(output)
        replaced[key] = value
        return replaced
    items = list(output)
    items[key] = value
    return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)  # a namedtuple, or not


class Hooks:
    """The hooks one block of explain's code puts on a model, every one removed when the block ends, however it
    ends: the one place where explain registers and removes hooks.

    Use it as ``with Hooks() as hooks: hooks.forward(module, record)``; :meth:`remove` also removes them early.
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def forward(self, module: nn.Module, hook: Callable[..., Any], **options: Any) -> None:
        """A forward hook (``register_forward_hook``'s options, as ``with_kwargs=True``)."""
        self._handles.append(module.register_forward_hook(hook, **options))

    def forward_pre(self, module: nn.Module, hook: Callable[..., Any], **options: Any) -> None:
        """A forward pre-hook (``register_forward_pre_hook``'s options)."""
        self._handles.append(module.register_forward_pre_hook(hook, **options))

    def full_backward(self, module: nn.Module, hook: Callable[..., Any]) -> None:
        """A full-backward hook (``register_full_backward_hook``)."""
        self._handles.append(module.register_full_backward_hook(hook))

    def remove(self) -> None:
        """Remove every hook added so far."""
        while self._handles:
            self._handles.pop().remove()


def uses_tensor_hook(model: nn.Module, module: nn.Module) -> bool:
    """Whether an earlier call found that the model modifies this module's output in place."""
    return module in model_context(model).modified_in_place


class ActivationGradientRecorder:
    """Context manager that hooks the target modules for the duration of one CAM call.

    Args:
        modules: The target modules by their dotted names.
        tensor_hook: Use the tensor-hook path from the start; by default it is used
            for modules that earlier calls found modified in place.
        gradients: Whether gradients will be asked for; without them the recorder
            only keeps the activations and leaves the forward pass as it is.
        learned: The model's context, where what the recorder finds is kept for later calls: the modules whose
            output the model modifies in place (their recorders start on the tensor-hook path and skip the
            failing first forward), and those computed from another target module's output (a detector's finer
            pyramid level feeds the coarser ones: their gradient is caught by a tensor hook from then on, as a
            full-backward hook would hand a zero gradient back through all that lies between the two layers
            whenever the score reaches the first layer alone). None: kept for this recorder only.

    Attributes:
        activations: Each layer's output of the last forward pass, by name.
        gradients: Each layer's gradient from the last :meth:`backward`, by name.
        tensor_hook: Whether the tensor-hook path is in use.
    """

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        tensor_hook: bool | None = None,
        gradients: bool = True,
        learned: ModelContext | None = None,
    ) -> None:
        self.modules = dict(modules)
        self.record_gradients = gradients
        self.learned = ModelContext() if learned is None else learned
        if tensor_hook is None:
            tensor_hook = any(module in self.learned.modified_in_place for module in self.modules.values())
        self.tensor_hook = tensor_hook
        self.activations: dict[str, Tensor] = {}
        self.gradients: dict[str, Tensor] = {}
        self._leaves: dict[str, Tensor] = {}
        self._hooks = Hooks()

    def __enter__(self) -> ActivationGradientRecorder:
        self._register()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._hooks.remove()
        self._leaves.clear()

    def _tensor_hooked(self, name: str) -> bool:
        """Whether a layer's gradient is caught by a tensor hook: always for an entry of a dict or list output, and
        for a layer that an earlier pass found computed from another target layer."""
        return self.tensor_hook or layer_entry(name)[1] is not None or self.modules[name] in self.learned.downstream

    def _register(self) -> None:
        try:
            for name, module in self.modules.items():
                self._hooks.forward(module, partial(self._on_forward, name))
                if self.record_gradients and not self._tensor_hooked(name):
                    self._hooks.full_backward(module, partial(self._on_module_backward, name))
        except BaseException:
            self._hooks.remove()
            raise

    def _on_forward(self, name: str, module: nn.Module, inputs: Any, output: Any) -> Any:
        key = layer_entry(name)[1]
        if key is not None:  # one entry of a dict or list output: recorded, and replaced in a copy of the output
            index, value = output_entry(output, key, name)
            passed_on = self._record(name, value)
            return None if passed_on is None else with_entry(output, index, passed_on)
        if not isinstance(output, Tensor):
            raise LayerError(
                f"layer {name!r} returns {type(output).__name__}, not a tensor; choose a layer whose output is "
                "a feature map, or name an entry of a dict or list output as 'layer:key'"
            )
        return self._record(name, output)

    def _record(self, name: str, output: Tensor) -> Tensor | None:
        """Keep a layer's output; returns what the model gets instead (None: the output itself)."""
        if name in self.activations:
            raise LayerError(
                f"layer {name!r} runs more than once in one forward pass (a shared module), "
                "so its gradient would mix the calls; choose a layer that runs once"
            )
        if not self.record_gradients:  # a copy: the model may still modify its output in place
            self.activations[name] = output.detach().clone()
            return None
        # An output that already requires grad lies downstream of another target layer of this
        # recorder: it stays in the graph, so that layer's gradient can flow through it.
        if output.requires_grad and not self.tensor_hook:  # on the tensor-hook path already, it changes nothing
            self.learned.downstream.add(self.modules[name])
        leaf = output if output.requires_grad else output.detach().requires_grad_(True)
        self.activations[name] = leaf.detach()
        self._leaves[name] = leaf
        if not self._tensor_hooked(name):
            return leaf
        passed_on = leaf.clone()
        passed_on.register_hook(partial(self._on_tensor_backward, name))
        return passed_on

    def _on_module_backward(
        self, name: str, module: nn.Module, grad_input: Any, grad_output: tuple[Tensor, ...]
    ) -> None:
        if grad_output[0] is not None:  # None: the score does not reach the layer (an undefined gradient)
            self.gradients[name] = grad_output[0]

    def _on_tensor_backward(self, name: str, grad: Tensor | None) -> None:
        if grad is not None:
            self.gradients[name] = grad

    def forward(self, model: Callable[[Tensor], Any], x: Tensor) -> Any:
        """Run the model on ``x``, recording the activations.

        Falls back to the tensor-hook path, and runs the forward again, when the
        model modifies a target layer's output in place.
        """
        try:
            return self._forward_once(model, x)
        except RuntimeError as err:
            if not self.record_gradients or self.tensor_hook or _INPLACE_CLASH not in str(err):
                raise
        self._hooks.remove()
        self.tensor_hook = True
        for module in self.modules.values():
            self.learned.modified_in_place.add(module)
        self._register()
        return self._forward_once(model, x)

    def _forward_once(self, model: Callable[[Tensor], Any], x: Tensor) -> Any:
        self.activations.clear()
        self._leaves.clear()
        output = model(x)
        for name in self.modules:
            if name not in self.activations:
                raise LayerError(f"layer {name!r} did not run during the forward pass")
        return output

    def backward(
        self, score: Tensor, create_graph: bool = False, rescore: Callable[[Any], Tensor] | None = None
    ) -> dict[str, Tensor]:
        """Record the gradient of the scalar ``score`` with respect to each layer's output (``rescore``, how the
        pass's target scores another output, is for recorders that read other outputs out: unused here).

        The graph is kept, so several scores of one forward can be explained; with ``create_graph`` the
        gradients are themselves differentiable (see :meth:`curvature`). Of several
        layers, one the score does not reach gets a zero gradient (a feature pyramid's
        level that a box was not assigned to); the score must reach at least one.

        Returns:
            The gradients by layer name, each shaped like its activation.

        Raises:
            LayerError: The score reaches none of the layers.
        """
        self.gradients.clear()
        if not score.requires_grad:
            raise LayerError(f"the target score does not depend on layer(s) {', '.join(self.modules)}")
        # Expected by design: the layer's inputs never require grad, so PyTorch fires the hook with the output
        # gradient alone, which is all a CAM needs.
        with warning_filter("ignore", message="Full backward hook is firing when gradients are computed"):
            torch.autograd.grad(
                score, list(self._leaves.values()), retain_graph=True, create_graph=create_graph, allow_unused=True
            )
        missing = [name for name in self.modules if name not in self.gradients]
        if len(missing) == len(self.modules):
            raise LayerError(f"the target score does not depend on layer(s) {', '.join(missing)}")
        for name in missing:
            self.gradients[name] = torch.zeros_like(self.activations[name])
        return dict(self.gradients)

    def curvature(self, gradients: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Each layer's Hessian-vector product H·A: the derivative of its gradient (from :meth:`backward` with
        ``create_graph``) along its own output A. A gradient that does not depend on the output (a score linear
        in it) gives zeros."""
        products = {}
        for name, gradient in gradients.items():
            leaf = self._leaves[name]
            product = None
            if gradient.requires_grad:
                try:
                    with warning_filter("ignore", message="Full backward hook is firing when gradients are computed"):
                        (product,) = torch.autograd.grad(
                            gradient, leaf, grad_outputs=leaf.detach(), retain_graph=True, allow_unused=True
                        )
                except RuntimeError as err:
                    if "derivative for" not in str(err):
                        raise
                    raise LayerError(
                        f"the Hessian at layer {name!r} cannot be computed: between it and the score, {err} in "
                        "PyTorch (no second derivative); choose a later layer, or a first-order method"
                    ) from None
            products[name] = torch.zeros_like(leaf) if product is None else product
        return products


@contextmanager
def output_replaced(module: nn.Module, value: Tensor, name: str) -> Iterator[None]:
    """For the block, make ``module`` (the layer ``name``) return ``value`` instead of its output, or, where
    ``name`` is an entry of a dict, list or tuple output (``backbone:0``), instead of that entry (for ablations)."""
    entry = layer_entry(name)[1]

    def replace(module: nn.Module, inputs: Any, output: Any) -> Any:
        return value if entry is None else with_entry(output, output_entry(output, entry, name)[0], value)

    with Hooks() as hooks:
        hooks.forward(module, replace)
        yield
