r"""CRP's reference samples: each concept's images of highest relevance (relevance maximization) or activation
(activation maximization) over a data set, each cut to the receptive field of the layer position where the concept
peaks in it (Achtibat et al. 2023, section 4.2).

The relevance of every concept at the layer comes from one plain LRP pass per batch, read where it arrives at
the layer: a concept's relevance in an image is :math:`\sum_{p, c} s_{kc}(p) R_c(p)`, its share s of each
channel's relevance (1 on a channel set, a bank's share of the activation). The crop needs no backward per sample:
a position's receptive field is the support of LRP-flat relevance sent back from that position alone (every
weight 1, an input of ones, max pools spreading evenly over their window), one batched backward for all the
positions the references peak at, the same for every image of a size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.hooks import Hooks
from ..core.layers import resolve_layer
from ..core.model_state import exclusive, running, untouched
from ..errors import ExplainError, LayerError
from ..relevance.composites import FLAT, LayerRules
from ..relevance.operations import OperationRules, in_forward
from .craft import ConceptBank
from .factorization import coefficients

MODES = ("relevance", "activation")


@dataclass(frozen=True)
class References:
    """Each concept's reference samples.

    Attributes:
        samples: Each concept's samples, by their place in the data set, the best first, (K, count).
        values: What they were ranked by: the concept's relevance in the sample, or its peak activation, (K, count).
        boxes: Each sample's crop, the receptive field of the position where the concept peaks in it: top, left,
            height and width in input pixels, (K, count, 4).
        layer: The layer the concepts are at.
    """

    samples: Tensor
    values: Tensor
    boxes: Tensor
    layer: str

    def crops(self, images: Tensor) -> list[list[Tensor]]:
        """The reference crops cut from the data set's images (indexed as :attr:`samples`), each concept's list."""
        return [
            [images[int(n), :, t : t + h, left : left + w] for n, (t, left, h, w) in zip(row, box.tolist())]
            for row, box in zip(self.samples, self.boxes)
        ]


def concept_scores(features: Tensor, relevance: Tensor | None, concepts: Tensor | ConceptBank) -> Tensor:
    """Each concept's relevance (``relevance`` given) or activation at every position, (N, K, *grid), from a
    layer's features and relevance laid out (N, *grid, C).

    A channel set's or weight row's activation is its channels' weighted sum; a bank's is its coefficient. Its
    relevance is its share of each channel's relevance, summed over the channels.
    """
    channels = features.shape[-1]
    if not isinstance(concepts, ConceptBank):
        weights = F.pad(concepts, (0, channels - concepts.shape[1])).to(features)
        return ((features if relevance is None else relevance) @ weights.T).movedim(-1, 1)
    bank = concepts.bank.to(features.device)
    rows = features.reshape(-1, channels).to(bank.dtype)
    u = coefficients(rows, bank)
    if relevance is None:
        return u.float().reshape(*features.shape[:-1], -1).movedim(-1, 1)
    r, whole = relevance.reshape(-1, channels).to(bank.dtype), u @ bank
    ratio = torch.where(whole > 0, r / whole.clamp_min(torch.finfo(whole.dtype).tiny), 0.0)
    unshared = torch.where(whole > 0, 0.0, r).sum(dim=1, keepdim=True) / len(bank)  # shared evenly, as in CRP
    found = u * (ratio @ bank.T) + unshared
    return found.float().reshape(*features.shape[:-1], -1).movedim(-1, 1)


class Ranking:
    """The best samples of each concept so far, kept as batches stream past."""

    def __init__(self, concepts: int, count: int) -> None:
        self.count, self.seen = count, 0
        self.values = torch.full((concepts, 0), -torch.inf)
        self.samples = torch.zeros((concepts, 0), dtype=torch.long)
        self.peaks = torch.zeros((concepts, 0), dtype=torch.long)

    def add(self, values: Tensor, peaks: Tensor) -> None:
        """The next batch's values and peak positions, (N, K) each."""
        samples = torch.arange(self.seen, self.seen + len(values))[:, None].expand_as(values)
        self.seen += len(values)
        values = torch.cat([self.values, values.T.cpu()], dim=1)
        samples = torch.cat([self.samples, samples.T], dim=1)
        peaks = torch.cat([self.peaks, peaks.T.cpu()], dim=1)
        top = values.topk(min(self.count, values.shape[1]), dim=1).indices
        self.values, self.samples, self.peaks = values.gather(1, top), samples.gather(1, top), peaks.gather(1, top)


def receptive_boxes(model: nn.Module, layer: str, x: Tensor, positions: Tensor, channels_last: bool) -> Tensor:
    """The receptive field of each of a layer's positions as a box (top, left, height, width) in ``x``'s pixels.

    Args:
        model: The model.
        layer: The layer's name.
        x: One input of the model, (1, C, H, W): any image of the size the positions are of.
        positions: Positions on the layer's grid, (P, 2) rows and columns.
        channels_last: Whether the layer's output is laid out (N, H, W, C).
    """
    module = resolve_layer(model, layer, x)[1]
    kept: list[Tensor] = []
    xs = x.detach().expand(len(positions), *x.shape[1:]).clone().requires_grad_(True)
    flat = OperationRules("CRP's receptive fields", model=model, layers=LayerRules(model, FLAT))
    with exclusive(model), untouched(model), running(model), in_forward(model, flat), Hooks() as hooks:
        hooks.forward(module, lambda m, i, output: kept.append(output))
        model(xs)
        seed = torch.zeros_like(kept[0])
        laid = seed if channels_last else seed.movedim(1, -1)  # a view: (P, h, w, C)
        laid[torch.arange(len(positions)), positions[:, 0], positions[:, 1]] = 1.0
        found = torch.autograd.grad(kept[0], xs, seed)[0]
    support = found.detach().abs().sum(dim=1) > 0  # (P, H, W)
    return torch.stack([_box(s) for s in support])


def _box(support: Tensor) -> Tensor:
    """The bounding box (top, left, height, width) of a plane's support; the whole plane where it has none."""
    rows, columns = support.any(dim=1).nonzero().flatten(), support.any(dim=0).nonzero().flatten()
    if not len(rows):
        return torch.tensor([0, 0, *support.shape])
    return torch.stack([rows[0], columns[0], rows[-1] - rows[0] + 1, columns[-1] - columns[0] + 1]).cpu()


def check_mode(by: str, count: int) -> None:
    """Refuse an unknown ranking or a count below 1, naming the choices.

    Raises:
        ExplainError: Either.
    """
    if by not in MODES:
        raise ExplainError(f"references by {by!r}: rank them by {' or '.join(MODES)}")
    if count < 1:
        raise ExplainError(f"count must be at least 1, got {count}")


def as_batches(images: Tensor | Iterable[Tensor], batch_size: int) -> Iterable[Tensor]:
    """A data set as batches: a tensor split, or an iterable of batches as it is."""
    return images.split(batch_size) if isinstance(images, Tensor) else images


def map_layout(kind: str, name: str) -> bool:
    """Whether a layer's output is laid out channels last; a layer of tokens or no map refused.

    Raises:
        LayerError: No spatial map: a ViT's tokens see the whole image, and have no receptive field to cut.
    """
    if kind not in ("channels_first", "channels_last"):
        raise LayerError(
            f"layer {name!r} is no spatial map: its positions have no receptive field to cut references to "
            "(a ViT's tokens see the whole image); name a convolutional layer"
        )
    return kind == "channels_last"
