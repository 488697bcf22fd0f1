"""The ``layer_in_pass`` speedup's search: the automatic layer settled by the call's own pass among the last
candidates (see :func:`explain.core.layers.find_auto_layers` for what the full search chooses, and
:meth:`explain.core.runner.PassRunner._decide` for where the call decides its layers). Every candidate after the
settled one was tried, so the search over all of them would choose it too: the same layer, without a search of its
own (``tests/test_speedups.py`` holds both ways the same).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from ...targets import TargetLike
from ..hooks import layer_entry
from ..layers import NOT_AUTOMATIC, LayerInfo, automatic_key, declared_layers, search_candidates, traced_layers
from ..model_state import model_context

SEARCH_IN_PASS = 4  # the last candidates a call's own pass records to settle its automatic layer
SEARCH_IN_PASS_TOKENS = 24  # the same for tokens, where the chosen layer lies a block's modules before the end


@dataclass(frozen=True)
class PendingSearch:
    """An automatic layer search left to the call's own pass, which records the last candidates (``tried``): their
    gradients settle it where they can (see :func:`settle`).

    Attributes:
        key: Where the settled layer is kept in the model's context.
        tried: The last candidates, in forward order.
        one_grid: Whether every candidate laid out as tokens is on one grid: then no tower of tokens runs beside
            the last (see :func:`find_auto_layers`), and a token layer settles it too.
    """

    key: Hashable
    tried: list[LayerInfo]
    one_grid: bool


def pending_search(
    model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None, target: TargetLike
) -> PendingSearch | None:
    """A search of the automatic layer that the call's own pass can settle, or None where it is known already or
    declared by the model, or where the last candidate is tokens and tokens lie on several grids (towers may run
    beside it): the last :data:`SEARCH_IN_PASS` candidates, or :data:`SEARCH_IN_PASS_TOKENS` where the last is
    tokens.

    Raises:
        LayerError: No layer qualifies.
    """
    key = automatic_key(x, model_kwargs, target)
    if key in model_context(model).automatic:
        return None
    infos = list(traced_layers(model, x, model_kwargs).values())
    if declared_layers(model, infos) is not None:
        return None
    candidates = search_candidates(infos)
    tokens = candidates[-1].layout.kind == "tokens"
    one_grid = len({info.layout.grid for info in candidates if info.layout.kind == "tokens"}) <= 1
    if tokens and not one_grid:  # towers may run beside the last tokens: only the probe of every candidate tells
        return None
    return PendingSearch(key, candidates[-(SEARCH_IN_PASS_TOKENS if tokens else SEARCH_IN_PASS) :], one_grid)


def settle(model: nn.Module, search: PendingSearch, reached: Collection[str]) -> str | None:
    """The automatic layer (see :func:`find_auto_layers`) where the tried candidates decide it, kept in the model's
    context: the last one the score reaches that is no adaptive pool or identity, when it is not an output entry
    standing for another module, nor tokens beside towers on other grids. Every candidate after it was tried, so
    the search over all of them would choose it too. None where they do not decide it."""
    for info in reversed(search.tried):
        if info.name not in reached or isinstance(model.get_submodule(layer_entry(info.name)[0]), NOT_AUTOMATIC):
            continue
        if info.alias is not None or (info.layout.kind == "tokens" and not search.one_grid):
            return None
        model_context(model).automatic[search.key] = [info.name]
        return info.name
    return None
