"""Where the ``layer_in_pass`` speedup meets the pass runner: the automatic layer settled in the call's own plain
pass instead of a search of its own (:mod:`explain.core.speedups.settling` says how). The runner decides, records
and maps; it asks :func:`in_pass` whether a call's pass can settle its layer, and hands that pass to the object it
gets. Off (``explain.core.speedups.disabled("layer_in_pass")``), the runner searches first, with the same maps.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor, nn

from ..hooks import ActivationGradientRecorder, layer_entry
from ..layers import declares_layers, knows_layers
from ..model_state import model_context
from ..passes import PassRecord
from . import enabled
from .settling import PendingSearch, pending_search, settled_pass, traced_pass


class Runner(Protocol):
    """What a settling pass asks of the call's runner (:class:`explain.core.runner.PassRunner`)."""

    method: Any
    model: nn.Module
    needs: Any
    model_kwargs: dict[str, Any]
    goal: Any
    layers: list[tuple[str, nn.Module | None]]
    in_pass: Traced | Pending | None

    def decide(self, x: Tensor, fresh: bool = False, trace: bool = True) -> None: ...

    def record(self, x: Tensor, goal: Any, plain: bool = False) -> PassRecord: ...

    def plain_pass(self, x: Tensor) -> PassRecord: ...


def in_pass(runner: Runner, x: Tensor, trace: bool = True) -> Traced | Pending | None:
    """How the call's own pass settles its automatic layer, or None where the speedup is off or cannot.

    It can for a method whose pass takes the plain gradient at its layers' outputs, on a model in eval mode (as the
    search's probe runs it). A call of one image on a model explain knows nothing of at x's signature, which
    declares no layers, runs the trace's own forward as its pass (:class:`Traced`, unless ``trace`` is off); else
    the pass records the last candidates (:class:`Pending`), where a search is pending at all.
    """
    needs, model = runner.needs, runner.model
    plain = needs.spared and not (needs.input_gradient or model.training)
    if not (needs.gradients and plain and enabled("layer_in_pass")):
        return None
    if trace and _unseen(runner, x):
        return Traced()
    search = pending_search(model, x, runner.model_kwargs, runner.goal)
    return None if search is None else Pending(search, model)


def _unseen(runner: Runner, x: Tensor) -> bool:
    """Whether the call is of one image on a model whose layers explain knows nothing of at x's signature, and which
    declares none."""
    if len(x) != 1 or runner.method.reshape is not None or declares_layers(runner.model):
        return False
    return not knows_layers(runner.model, x, runner.model_kwargs, runner.goal)


class Traced:
    """The trace's own forward as the call's plain pass (see :func:`explain.core.speedups.settling.traced_pass`)."""

    layers: tuple[tuple[str, nn.Module | None], ...] = ()  # decided by the pass

    def plain_pass(self, runner: Runner, x: Tensor) -> PassRecord:
        """The plain pass, settling the layer; where the traced pass does not, the call decides again without it."""
        found = traced_pass(runner.model, x, runner.model_kwargs, runner.goal, runner.method.labels)
        if found is None:
            runner.decide(x, trace=False)
            return runner.plain_pass(x)
        runner.layers, recorded = found
        runner.in_pass = None
        return recorded


class Pending:
    """The call's plain pass records the last candidates, and their gradients settle the layer (see
    :func:`explain.core.speedups.settling.settled_pass`).

    Args:
        search: The pending search.
        model: The model.
    """

    def __init__(self, search: PendingSearch, model: nn.Module) -> None:
        self.search = search
        self.layers = [(info.name, model.get_submodule(layer_entry(info.name)[0])) for info in search.tried]

    def recorder(self, runner: Runner, hooked: dict[str, nn.Module]) -> ActivationGradientRecorder:
        """The candidates' recorder: one computed from another, so by tensor hooks."""
        learned = model_context(runner.model)
        return ActivationGradientRecorder(hooked, tensor_hook=True, gradients=runner.needs.gradients, learned=learned)

    def plain_pass(self, runner: Runner, x: Tensor) -> PassRecord:
        """The plain pass at the layer the candidates settle; where they do not, searched in full and run again."""
        recorded = runner.record(x, runner.goal, plain=True)
        runner.in_pass = None
        kept = settled_pass(runner.model, self.search, recorded)
        if kept is None:
            runner.decide(x, fresh=True)
            return runner.record(x, runner.goal, plain=True)
        runner.layers = [(name, module) for name, module in runner.layers if name in kept.layouts]
        return kept
