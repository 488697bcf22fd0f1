"""The ``layer_in_pass`` speedup: the automatic layer settled by the call's own pass among the last candidates
(:func:`settled_pass`), or on a model not seen before by the trace's own forward as that pass (:func:`traced_pass`).
See :func:`explain.core.layers.find_auto_layers` for what the full search chooses, and
:meth:`explain.core.runner.PassRunner.decide` for where the call decides its layers (and
:mod:`explain.core.speedups.in_pass` for how the runner asks). Every candidate after the
settled one was tried, so the search over all of them would choose it too: the same layer, without a search of its
own (``tests/test_speedups.py`` holds both ways the same).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from ...targets import BoundTarget, Target, TargetLike, bound_on
from ..context import input_signature
from ..families import Picture
from ..hooks import layer_entry
from ..layers import (
    NOT_AUTOMATIC,
    LayerInfo,
    TracedForward,
    automatic_key,
    declared_layers,
    search_candidates,
    traced_infos,
    traced_layers,
)  # fmt: skip
from ..maps import has_nonzero
from ..model_state import model_context, running
from ..passes import PassRecord, check_reached, target_scores

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


def traced_forward(model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None = None) -> TracedForward:
    """Trace x's first image (see :func:`explain.core.layers.trace_layers`, without the noise pass) with autograd from
    the image, so that the gradient of a score of its output reaches every layer's output; the trace is kept in the
    model's context, as :func:`explain.core.layers.traced_layers` keeps it. The parameters' flags are the caller's
    to freeze."""
    forward = TracedForward(x[:1].detach().requires_grad_(True), None, {}, Picture())
    infos = traced_infos(model, x, model_kwargs, False, forward)
    model_context(model).traces[input_signature(x, model_kwargs)] = {info.name: info for info in infos}
    return forward


def traced_pass(
    model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any], goal: Target | BoundTarget, labels: Any
) -> tuple[list[tuple[str, nn.Module]], PassRecord] | None:
    """The plain pass of one image on a model explain knows nothing of, as the trace's own forward run with autograd
    from the image (:func:`traced_forward`): the trace finds the last candidates, their gradients settle the
    automatic layer (:func:`settle`), and its activation and gradient are the pass's. Returns the layer and the
    pass; None where the candidates do not settle it, or where the model changed a candidate's output in place after
    returning it: the trace is kept, and the call's pass runs as for a known model."""
    traced = traced_forward(model, x, model_kwargs)
    search = pending_search(model, x, model_kwargs, goal)
    if search is None:
        return None
    changed = [i for i, info in enumerate(search.tried) if not _intact(traced.outputs.get(info.name))]
    intact = search.tried[changed[-1] + 1 :] if changed else search.tried  # after the last one changed in place
    if not intact:
        return None
    leaves = [traced.outputs[info.name][0] for info in intact]
    with running(model):
        bound = bound_on(goal, traced.output, labels)
        scores = target_scores(bound, traced.output, x)
        count = scores.shape[1]
        found = [
            torch.autograd.grad(scores[:, k].sum(), leaves, retain_graph=k < count - 1, allow_unused=True)
            for k in range(count)
        ]
    laid = [{info.name: info.layout(g) for info, g in zip(intact, by_k) if g is not None} for by_k in found]
    reached = {name for by_k in laid for name, g in by_k.items() if has_nonzero(g)}
    chosen = settle(model, replace(search, tried=intact), reached)
    if chosen is None:
        return None
    layout = next(info.layout for info in intact if info.name == chosen)
    activation = layout(traced.outputs[chosen][0].detach())
    gradients = [{chosen: by_k.get(chosen, torch.zeros_like(activation))} for by_k in laid]
    check_reached(gradients, bound, automatic=True)
    picture = traced.picture
    recorded = PassRecord(
        x.detach(), traced.output, bound, scores, {chosen: activation.float()}, gradients, [{} for _ in laid],
        {chosen: layout}, picture.canvas, picture.geometry(x),
    )  # fmt: skip
    return [(chosen, model.get_submodule(layer_entry(chosen)[0]))], recorded


def settled_pass(model: nn.Module, search: PendingSearch, recorded: PassRecord) -> PassRecord | None:
    """The plain pass that recorded the last candidates, kept at the automatic layer their gradients settle (the
    first image's, as the search's probe reads them); None where they do not settle it."""
    reached = {name for by_layer in recorded.gradients for name, g in by_layer.items() if has_nonzero(g[0])}
    chosen = settle(model, search, reached)
    if chosen is None:
        return None
    kept = recorded.kept(chosen)
    check_reached(kept.gradients, kept.bound, automatic=True)
    return kept


def _intact(found: tuple[Tensor, int] | None) -> bool:
    """Whether a traced output is in the image's graph as its module returned it (not changed in place since)."""
    return found is not None and found[0].requires_grad and found[0]._version == found[1]
