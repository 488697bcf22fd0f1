r"""CRP: Achtibat et al., "From attribution maps to human-understandable explanations through Concept Relevance
Propagation", Nature Machine Intelligence 2023 (arXiv:2206.03208).

The relevance of a target passing through a concept: LRP's backward (:class:`explain.relevance.propagation.LRP`,
zennit's composites), the relevance arriving at one layer kept where the concept is and passed on to the input,
:math:`R(x \mid \theta)`. A concept is a set of channels (a weight per channel, 1 on the set), or a direction of a
concept bank (:class:`explain.concepts.craft.ConceptBank`): at each position, its share of the activation's
reconstruction, :math:`u_k w_{kc} / \sum_j u_j w_{jc}`, on each channel c. Relevance is linear in the relevance it
starts from, so concepts that split a layer's relevance (channel sets that partition the channels, or a bank's
shares) have maps that sum to the unconditioned one. K concepts run in one pass over N·K copies of the images,
copy r conditioned on concept r mod K.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..core.context import input_signature
from ..core.engine import check_images
from ..core.held import held_model, in_model_dtype
from ..core.hooks import Hooks
from ..core.layers import LayerSpec, resolve_layer, traced_layers, wrapped_names
from ..core.model_state import exclusive, model_context, running, untouched
from ..errors import ExplainError, LayerError, TargetError
from ..relevance.propagation import LRP
from ..targets import TargetLike, as_target, bound_on
from .craft import ConceptBank
from .factorization import coefficients
from .references import Ranking, References, as_batches, check_mode, concept_scores, map_layout, receptive_boxes

Concepts = Sequence[Sequence[int]] | Tensor | ConceptBank
"""Channel sets (one list of channel indices per concept), a weight per concept and channel (K, C), or a bank."""


@dataclass(frozen=True)
class ConceptMaps:
    """Each concept's relevance map on each image.

    Attributes:
        maps: The input's relevance through each concept, summed over the input's channels, (N, K, *size), signed.
        relevance: Each concept's share of the score's relevance at the layer: its map's sum, (N, K).
        layer: The layer conditioned.
    """

    maps: Tensor
    relevance: Tensor
    layer: str


class _LayerLRP(LRP):
    """LRP whose relevance arriving at one layer is handed over: ``at_layer(output, axis)`` is called with the
    layer's output (and its channel axis) in the pass, and may hook the relevance that arrives there."""

    name = "crp"

    def __init__(
        self, model: nn.Module, layer: LayerSpec, at_layer: Callable[[Tensor, int], None], **options: Any
    ) -> None:
        super().__init__(model, **options)
        self.condition, self.at_layer = layer, at_layer

    @contextmanager
    def backward_rule(self, x: Tensor, model_kwargs: Mapping[str, Any]) -> Iterator[None]:
        name, module = resolve_layer(self.model, self.condition, x, model_kwargs)
        axis = channel_axis(self.model, name, x, model_kwargs, traced=False)
        with super().backward_rule(x, model_kwargs), Hooks() as hooks:  # after the rules': the relevance arriving
            hooks.forward(module, lambda m, i, output: self.at_layer(_relevant(output), axis))
            yield


def _relevant(output: Any) -> Tensor:
    """The layer's output, which relevance must pass through.

    Raises:
        LayerError: It is no tensor, or none that relevance passes through.
    """
    if not isinstance(output, Tensor) or not output.requires_grad:
        raise LayerError("the conditioned layer's output is no tensor the relevance passes through")
    return output


def channel_axis(model: nn.Module, name: str, x: Tensor, model_kwargs: Mapping[str, Any], traced: bool = True) -> int:
    """The channel axis of a layer's output, as the engine's trace lays it out (``traced``: traced now if it is not
    known; else, inside a pass, as traced before it).

    Raises:
        LayerError: The output is no map of the input with channels.
    """
    kind = layout_kind(model, name, x, model_kwargs, traced)
    if kind not in ("channels_first", "channels_last", "tokens"):
        raise LayerError(f"layer {name!r} has no channels of a map of the input to condition relevance on")
    return 1 if kind == "channels_first" else -1


def layout_kind(
    model: nn.Module, name: str, x: Tensor, model_kwargs: Mapping[str, Any], traced: bool = True
) -> str | None:
    """How the engine's trace lays out a layer's output (``"channels_first"``, ``"tokens"``, ...), or None where
    it is no map; ``traced``: traced now if it is not known, else as traced before."""
    if traced:
        infos = traced_layers(model, x, model_kwargs)
    else:
        infos = model_context(model).traces.get(input_signature(x, model_kwargs), {})
    info = next((infos[held] for held in (name, *wrapped_names(model, name)) if held in infos), None)
    return None if info is None or info.layout is None else info.layout.kind


def _condition(concepts: Tensor | ConceptBank, output: Tensor, axis: int) -> None:
    """Mask the relevance arriving at ``output``: copy r's by concept r mod K, along the channel ``axis``."""
    weights = _weights(output.detach().movedim(axis, -1), concepts).movedim(-1, axis)
    output.register_hook(lambda relevance: relevance * weights.to(relevance.dtype))


def _weights(features: Tensor, concepts: Tensor | ConceptBank) -> Tensor:
    """Each copy's weight on each channel at each position, shaped like ``features`` (copies, ..., C).

    Raises:
        LayerError: The concepts name more channels than the layer has.
    """
    copies, channels = len(features), features.shape[-1]
    bank = concepts.bank if isinstance(concepts, ConceptBank) else concepts
    if bank.shape[1] > channels or (isinstance(concepts, ConceptBank) and bank.shape[1] != channels):
        raise LayerError(f"the concepts are of {bank.shape[1]} channels and the layer has {channels}")
    own = torch.arange(copies, device=features.device) % len(bank)
    spread = (copies, *(1,) * (features.dim() - 2), channels)
    if not isinstance(concepts, ConceptBank):
        rows = torch.nn.functional.pad(bank, (0, channels - bank.shape[1])).to(features.device)[own]
        return rows.view(spread).expand_as(features)
    bank = bank.to(features.device)
    u = coefficients(features.reshape(-1, channels), bank).reshape(*features.shape[:-1], len(bank))
    parts = u.movedim(-1, 1)[torch.arange(copies), own][..., None] * bank[own].view(spread)
    whole = u @ bank
    return torch.where(whole > 0, parts / whole.clamp_min(torch.finfo(whole.dtype).tiny), 1.0 / len(bank))


def channel_weights(concepts: Concepts) -> Tensor | ConceptBank:
    """Concepts as a (K, C) weight tensor (channel sets as 0/1 rows), or the bank as it is.

    Raises:
        ExplainError: No concepts, a channel out of range, a signed bank, or weights of the wrong shape.
    """
    if isinstance(concepts, ConceptBank):
        if concepts.signed:
            raise ExplainError("CRP conditions on a bank's shares of each activation, which a signed bank lacks")
        return concepts
    if isinstance(concepts, Tensor):
        if concepts.dim() != 2 or len(concepts) == 0:
            raise ExplainError(f"concept weights must be (concepts, channels), got {tuple(concepts.shape)}")
        return concepts.detach().float()
    sets = [list(s) for s in concepts]
    if not sets or not all(sets):
        raise ExplainError("give at least one concept, each at least one channel")
    if min(min(s) for s in sets) < 0:
        raise ExplainError("a concept's channel is negative")
    width = 1 + max(max(s) for s in sets)
    weights = torch.zeros(len(sets), width)
    for row, channel_set in enumerate(sets):
        weights[row, channel_set] = 1.0
    return weights


class ConceptRelevance:
    """CRP: each concept's relevance map, K concepts in one pass.

    Args:
        model: A model LRP's composites rule (convolutions, linear layers).
        layer: The layer conditioned (a bank's own layer if not given).
        concepts: Channel sets, a (K, C) weight per concept and channel, or a non-negative concept bank.
        composite: LRP's composite (see :class:`explain.relevance.propagation.LRP`).
        labels: Class names, to accept a class name as target.
        **options: LRP's other options (``rules``, ``low``, ``high``).
    """

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        concepts: Concepts = (),
        *,
        composite: str = "epsilon_plus",
        labels: Sequence[str] | None = None,
        **options: Any,
    ) -> None:
        layer = concepts.layer if layer is None and isinstance(concepts, ConceptBank) else layer
        if layer is None:
            raise LayerError("CRP conditions relevance at a layer: name it (explain --layers lists them)")
        self.weights = channel_weights(concepts)
        self.model, self.labels, self.layer = held_model(model), labels, layer
        self.count = self.weights.concepts if isinstance(self.weights, ConceptBank) else len(self.weights)
        self.options = {"composite": composite, "labels": labels, **options}
        self.lrp = _LayerLRP(self.model, layer, partial(_condition, self.weights), **self.options)

    def __call__(self, x: Tensor, target: TargetLike = None) -> ConceptMaps:
        """Each concept's map of one target per image (the top class by default).

        Raises:
            TargetError: More than one target per image.
        """
        check_images(x)
        x = in_model_dtype(self.model, x)
        with exclusive(self.model), untouched(self.model), torch.no_grad():
            name = resolve_layer(self.model, self.layer, x, {})[0]
            channel_axis(self.model, name, x, {})  # traced here, outside the passes, which read it
            with running(self.model):
                bound = bound_on(as_target(target), self.model(x), self.labels)
        if bound.classes is not None and bound.classes.shape[1] != 1:
            raise TargetError(
                "CRP explains one target per image (of a detector, one box: DetectionTarget(boxes=..., labels=...)); "
                "run it once per target"
            )
        k = self.count
        result = self.lrp(x.repeat_interleave(k, dim=0), bound.repeated(k), normalize=False)
        raw = result.raw[:, 0] if bound.keeps_k else result.raw  # a target's K axis of one map
        relevance = raw.sum(dim=1)  # over the input's channels: (N K, *size)
        maps = relevance.view(len(x), k, *relevance.shape[1:])
        return ConceptMaps(maps, maps.flatten(2).sum(dim=2), name)

    def references(
        self,
        images: Tensor | Iterable[Tensor],
        count: int = 8,
        by: str = "relevance",
        target: TargetLike = None,
        batch_size: int = 32,
    ) -> References:
        """Each concept's reference samples over a data set, each cut to the receptive field of its peak (see
        :mod:`explain.concepts.references`): one LRP pass per batch (none for ``by="activation"``), one
        backward for all the crops.

        Args:
            images: The data set: a batch, or an iterable of batches (a folder read batch by batch), all of one
                size.
            count: The samples per concept.
            by: ``"relevance"``: the concept's relevance for the target; ``"activation"``: its peak activation.
            target: What relevance is of, as for any explain call (each image's top class by default).
            batch_size: Most images per pass, where ``images`` is one tensor.

        Raises:
            ExplainError: An unknown ranking, no images, or images of several sizes.
            LayerError: A layer that is no spatial map.
        """
        check_mode(by, count)
        ranking, probe, kept = Ranking(self.count, count), None, []
        reader = _LayerLRP(self.model, self.layer, partial(_kept, kept), **self.options) if by == "relevance" else None
        for x in as_batches(images, batch_size):
            check_images(x)
            x = in_model_dtype(self.model, x)
            if probe is not None and x.shape[1:] != probe[0].shape[1:]:
                shapes = f"{tuple(x.shape[1:])} after {tuple(probe[0].shape[1:])}"
                raise ExplainError(f"references need images of one size: {shapes}")
            kept.clear()
            name, last = self._read(x, target, reader, kept)
            features, relevance = kept[0], kept[1] if reader is not None else None
            scores = concept_scores(features, relevance, self.weights).flatten(2)
            ranking.add(scores.sum(dim=2) if by == "relevance" else scores.amax(dim=2), scores.argmax(dim=2))
            probe = probe or (x[:1], features.shape[1:-1], name, last)
        if probe is None:
            raise ExplainError("no images to rank: give a batch or batches of images")
        x, grid, name, last = probe
        places, where = ranking.peaks.unique(return_inverse=True)
        positions = torch.stack([places // grid[1], places % grid[1]], dim=1)
        boxes = receptive_boxes(self.model, name, x, positions, last)[where]
        return References(ranking.samples, ranking.values, boxes, name)

    def _read(self, x: Tensor, target: TargetLike, reader: _LayerLRP | None, kept: list[Tensor]) -> tuple[str, bool]:
        """Keep a batch's features at the layer, (N, *grid, C), and with a ``reader`` its relevance there, in
        ``kept``; returns the layer's name and whether it is laid out channels last."""
        with exclusive(self.model), untouched(self.model), torch.no_grad():
            name, module = resolve_layer(self.model, self.layer, x, {})
            last = map_layout(layout_kind(self.model, name, x, {}), name)
        if reader is not None:
            reader(x, target, normalize=False)
            return name, last
        with exclusive(self.model), untouched(self.model), running(self.model), torch.no_grad(), Hooks() as hooks:
            hooks.forward(module, lambda m, i, output: _kept(kept, output.detach(), -1 if last else 1))
            self.model(x)
        return name, last


def _kept(kept: list[Tensor], output: Tensor, axis: int) -> None:
    """Keep a layer's output with its channels last, and the relevance that arrives at it, if any will."""
    kept.append(output.detach().movedim(axis, -1))
    if output.requires_grad:
        output.register_hook(lambda relevance: kept.append(relevance.detach().movedim(axis, -1)) and None)
