r"""CRAFT: Fel et al., "CRAFT: Concept Recursive Activation FacTorization for Explainability", CVPR 2023
(arXiv:2211.10154).

Crops of the user's images are read at a layer (:mod:`explain.concepts.reading`: a CNN's channels, a ViT's patch
tokens laid out on their grid), each crop's map averaged over its positions, and the crops' activations A
(crops × channels) factorized into K concepts, :math:`A \approx U W` (:mod:`explain.concepts.factorization`:
NMF, or semi-NMF for signed activations). A concept is a row of the bank W. On an image, the layer's activation
at each position is written on the bank (its coefficients U, non-negative): a concept's map is its coefficient
at every position. A concept's importance for a target is its Sobol total index (:mod:`explain.concepts.sobol`):
the coefficients masked by quasi-Monte Carlo masks in [0, 1], :math:`\tilde A = (U \odot m) W`, put back in the
layer's place, and the target's score of the rest of the model, averaged over the images, with an interval.
The paper's recursive decomposition splits a concept into sub-concepts: the crops the concept most describes,
factorized at an earlier layer (:meth:`Craft.refine`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.layers import LayerSpec
from ..core.maps import upsample
from ..errors import ExplainError
from ..targets import TargetLike
from .factorization import Factors, coefficients, factorize
from .ranks import current_ranks
from .reading import LayerReader, Reading
from .sobol import TotalIndices, jansen_total, sobol_design

CROP_OVERLAP = 0.8  # the crops' stride as a share of their side, as the authors' code

Progress = Callable[[Sequence[int], str], Iterable[int]]
"""Wraps the indices of a long step's parts, named by a few words (a progress bar)."""


class Cache(Protocol):
    """Where a long step's parts are kept and found again by key: a run that resumes."""

    def get(self, key: str) -> Tensor | None:
        """The part kept under ``key``, or None."""

    def put(self, key: str, value: Tensor) -> None:
        """Keep a part under ``key``."""


def quietly(steps: Sequence[int], what: str) -> Iterable[int]:
    """The steps as they are: no progress shown."""
    return steps


def _cached(cache: Cache | None, key: str, compute: Callable[[], Tensor], device: torch.device) -> Tensor:
    """The part under ``key`` from the cache (on ``device``), else computed and kept there."""
    found = None if cache is None else cache.get(key)
    if found is None:
        found = compute()
        if cache is not None:
            cache.put(key, found)
    return found.to(device)


def crop_boxes(images: Tensor, side: int | None) -> Tensor:
    """Square crops of ``side`` pixels of each image's plane, overlapping as the paper's (a stride of 80% of the
    side), as (crops, 4) rows: image, top, left, side; None: the images whole.

    Raises:
        ExplainError: The side is larger than the images or smaller than 1.
    """
    height, width = images.shape[-2:]
    if side is None:
        return torch.tensor([[i, 0, 0, 0] for i in range(len(images))], dtype=torch.long)
    if not 1 <= side <= min(height, width):
        raise ExplainError(f"a crop of {side} pixels does not fit images of {height}x{width}")
    stride = max(1, int(side * CROP_OVERLAP))
    tops, lefts = range(0, height - side + 1, stride), range(0, width - side + 1, stride)
    return torch.tensor([[i, t, left, side] for i in range(len(images)) for t in tops for left in lefts])


def cut(images: Tensor, boxes: Tensor) -> Tensor:
    """The crops of ``boxes`` (see :func:`crop_boxes`), each resized to the images' size; a box of side 0 is its
    image whole."""
    size = images.shape[-2:]
    crops = [
        images[i] if side == 0 else images[i, :, top : top + side, left : left + side]
        for i, top, left, side in boxes.tolist()
    ]
    return torch.stack([c if c.shape[-2:] == size else _resized(c, size) for c in crops])


def _resized(crop: Tensor, size: torch.Size) -> Tensor:
    return F.interpolate(crop[None], size=tuple(size), mode="bilinear", align_corners=False)[0]


@dataclass(frozen=True)
class Importance:
    """Each concept's importance for a target: its Sobol total index, averaged over images.

    Attributes:
        indices: Each concept's total index, (K,).
        low: The 95% interval's lower ends, (K,).
        high: Its upper ends, (K,).
        per_image: Each image's indices, (N, K).
    """

    indices: Tensor
    low: Tensor
    high: Tensor
    per_image: Tensor

    @property
    def ranking(self) -> Tensor:
        """The concepts from the most to the least important, (K,)."""
        return self.indices.argsort(descending=True)


@dataclass(frozen=True)
class ConceptBank:
    r"""Concepts found at a layer: the bank W (concepts × channels) and what it was found on.

    Attributes:
        bank: The concepts, (K, C), float64, on the images' device.
        layer: The layer's name.
        signed: Whether the bank was found signed (semi-NMF, for activations of any sign).
        boxes: The crops it was found on, (crops, 4) (see :func:`crop_boxes`).
        coefficients: Each crop's coefficients, (crops, K) (none for a dictionary learned elsewhere).
        error: The factorization's relative reconstruction error :math:`\lVert A - UW \rVert_F / \lVert A \rVert_F`.
    """

    bank: Tensor
    layer: str
    signed: bool
    boxes: Tensor
    coefficients: Tensor
    error: float

    @property
    def concepts(self) -> int:
        """K, how many concepts."""
        return len(self.bank)

    def on(self, reading: Reading, iterations: int = 200) -> Tensor:
        """The coefficients of a reading's activations on the bank at every position, (N, K, *grid).

        Raises:
            ExplainError: The bank's concepts are of another number of channels than the reading's layer has.
        """
        activations = reading.activations
        if activations.shape[1] != self.bank.shape[1]:
            raise ExplainError(
                f"the concepts are of {self.bank.shape[1]} channels and layer {reading.layer} has "
                f"{activations.shape[1]}: read the layer they were found at"
            )
        rows = activations.movedim(1, -1).reshape(-1, activations.shape[1])
        found = coefficients(rows, self.bank, iterations, signed=self.signed)
        return found.reshape(*activations.shape[:1], *activations.shape[2:], -1).movedim(-1, 1)

    def best_crops(self, count: int = 8) -> Tensor:
        """The indices of each concept's ``count`` crops of highest coefficient, (K, count)."""
        return self.coefficients.topk(min(count, len(self.coefficients)), dim=0).indices.T


class Craft:
    """CRAFT on a model at a layer: :meth:`fit` finds the concepts, :meth:`importance` ranks them for a target,
    :meth:`maps` shows where each lies in an image.

    Args:
        model: Any model explain explains (a classifier, a ViT, a detector with a detection target).
        layer: The layer: a name, a module, or None for the automatic one.
        concepts: K, how many concepts.
        crop: The crops' side in pixels (None: the images whole).
        iterations: The factorization's multiplicative updates.
        batch_size: Most images per forward.
        signed: Factorize signed activations (semi-NMF); None: when the activations have negative values.
        labels: Class names, to accept a class name as target.
    """

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        concepts: int = 10,
        crop: int | None = 64,
        iterations: int = 200,
        batch_size: int = 32,
        signed: bool | None = None,
        labels: Sequence[str] | None = None,
    ) -> None:
        if concepts < 1 or batch_size < 1:
            raise ExplainError(f"concepts and batch_size must be at least 1, got {concepts} and {batch_size}")
        self.reader = LayerReader(model, layer, labels=labels)
        self.concepts, self.crop, self.iterations = concepts, crop, iterations
        self.batch_size, self.signed = batch_size, signed

    def fit(self, images: Tensor, cache: Cache | None = None, progress: Progress = quietly) -> ConceptBank:
        """The concepts of the images' crops, read in batches.

        Under ``torch.distributed`` (as ``torchrun`` launches it), each rank reads its share of the crops and the
        ranks add up the factorization's statistics (see :mod:`explain.concepts.ranks`): every rank gets the same
        bank, with every crop's coefficients.

        Args:
            images: The images, normalized as the model expects.
            cache: Where each batch's activations are kept and found again (a run that resumes); None: nowhere.
            progress: Wraps the batches' indices as they are read (a progress bar).

        Raises:
            ExplainError: Fewer crops than concepts, or than ranks.
        """
        boxes, ranks = crop_boxes(images, self.crop), current_ranks()
        if len(boxes) < max(self.concepts, ranks.world):
            raise ExplainError(
                f"{len(boxes)} crops for {self.concepts} concepts"
                + (f" over {ranks.world} ranks" if ranks.world > 1 else "")
                + ": give more images, smaller crops or fewer concepts"
            )
        mine, device, size = boxes[list(ranks.share(len(boxes)))], images.device, self.batch_size
        part = "" if ranks.world == 1 else f"{ranks.rank}-of-{ranks.world}-"  # a rank's shards apart from another's
        pooled = [
            _cached(cache, f"crops-{part}{i}", lambda i=i: self._pooled(cut(images, mine[i : i + size])), device)
            for i in progress(range(0, len(mine), size), "reading crops")
        ]
        layer = self.reader.read(cut(images, boxes[:1])).layer
        least = ranks.least(min(float(a.min()) for a in pooled))
        signed = self.signed if self.signed is not None else least < 0
        found: Factors = factorize(lambda: iter(pooled), self.concepts, self.iterations, signed=signed, ranks=ranks)
        norm = float(ranks.sum(sum((a * a).sum() for a in pooled)).sqrt())
        u = ranks.gathered(found.coefficients, len(boxes))
        return ConceptBank(found.bank, layer, signed, boxes, u, found.error / norm)

    def _pooled(self, crops: Tensor) -> Tensor:
        """The crops' activations averaged over the layer's positions, (crops, C), float64."""
        return self.reader.read(crops).activations.flatten(2).mean(dim=2).double()

    def maps(self, bank: ConceptBank, images: Tensor, resize: bool = True) -> Tensor:
        """Each concept's map on each image: its coefficient at every position of the layer, (N, K, *size),
        upsampled to the images' size (``resize``) or at the layer's grid."""
        found = torch.cat([bank.on(self.reader.read(images[i : i + self.batch_size])) for i in self._starts(images)])
        return upsample(found.float(), images.shape[2:]) if resize else found.float()

    def importance(
        self,
        bank: ConceptBank,
        images: Tensor,
        target: TargetLike = None,
        designs: int = 32,
        seed: int = 0,
        cache: Cache | None = None,
        progress: Progress = quietly,
    ) -> Importance:
        """Each concept's Sobol total index for the target (each image's top class by default), over the images.

        Args:
            bank: The concepts (:meth:`fit`).
            images: The images the indices are averaged over.
            target: What is explained, as for any explain call: one target for every image.
            designs: N, the quasi-Monte Carlo designs per image: N (K + 2) forwards per image.
            seed: The scrambled Sobol sequence's seed.
            cache: Where each image's estimator terms are kept and found again; None: nowhere.
            progress: Wraps the image batches' starts as they are scored (a progress bar).

        Under ``torch.distributed``, each rank scores its share of the images, and every rank gets every image's
        indices.

        Raises:
            ExplainError: Fewer images than ranks.
        """
        device, ranks = images.device, current_ranks()
        if len(images) < ranks.world:
            raise ExplainError(f"{len(images)} images for {ranks.world} ranks: give at least one image per rank")
        masks = sobol_design(bank.concepts, designs, seed).to(device)
        mine, terms = list(ranks.share(len(images))), []
        for start in progress(range(0, len(mine), self.batch_size), "scoring concepts"):
            places = mine[start : start + self.batch_size]
            part, keys = images[places], [f"importance-{i}" for i in places]
            found = [None if cache is None else cache.get(key) for key in keys]
            if any(terms_of is None for terms_of in found):
                reading = self.reader.read(part, target)  # the batch's layer outputs, once
                coefficients_of = bank.on(reading)
                for j, key in enumerate(keys):
                    if found[j] is None:
                        found[j] = self._terms(bank, part, reading, coefficients_of, j, masks)
                        if cache is not None:
                            cache.put(key, found[j])
            terms += [t.to(device) for t in found]
        total = TotalIndices(ranks.gathered(torch.cat(terms), len(images)))
        low, high = total.interval()
        return Importance(total.indices, low, high, total.per_function)

    def _terms(self, bank: ConceptBank, x: Tensor, reading: Reading, u: Tensor, j: int, masks: Tensor) -> Tensor:
        """Jansen's terms of image ``j`` of the batch ``x`` read as ``reading`` (its coefficients ``u``: all the
        batch's, (N, K, *grid)), (1, K, designs): its coefficients masked, put back in the layer's place and
        scored."""
        own = u[j : j + 1].movedim(1, -1).float()  # (1, *grid, K)
        perturbed = own * masks.float().view(len(masks), *(1,) * (own.dim() - 2), -1)  # (designs (K + 2), *grid, K)
        maps = (perturbed @ bank.bank.float()).movedim(-1, 1)  # (designs (K + 2), C, *grid)
        rows = torch.full((len(maps),), j, dtype=torch.long, device=x.device)
        scores = self.reader.rescored(x, reading, maps, rows, self.batch_size)
        return jansen_total(scores, bank.concepts).terms

    def refine(
        self, bank: ConceptBank, images: Tensor, concept: int, layer: LayerSpec, concepts: int = 3
    ) -> ConceptBank:
        """The paper's recursive decomposition of one concept: the crops of ``images`` (those the bank was found on)
        it describes best (those whose largest coefficient is its own), factorized into ``concepts`` sub-concepts at
        another layer, usually an earlier one, where the concept's parts are still apart.

        Raises:
            ExplainError: The concept is no concept of the bank, or describes fewer crops than sub-concepts asked.
        """
        if not 0 <= concept < bank.concepts:
            raise ExplainError(f"concept {concept} is not one of the bank's {bank.concepts}")
        chosen = cut(images, bank.boxes[bank.coefficients.argmax(dim=1) == concept])
        sub = Craft(
            self.reader.model, layer, concepts=concepts, crop=None, iterations=self.iterations,
            batch_size=self.batch_size, signed=self.signed, labels=self.reader.labels,
        )  # fmt: skip
        return sub.fit(chosen)

    def _starts(self, images: Tensor) -> range:
        return range(0, len(images), self.batch_size)
