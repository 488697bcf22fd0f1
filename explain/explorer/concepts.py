"""The explorer's concepts view: what the model sees, not only where. CRAFT's concepts (see
:mod:`explain.concepts`) are found in the explorer's own photos, or given (a bank from ``explain concepts`` or a
dictionary); pick one and see where it lies in a photo, and the crops it describes best.

A photo's concept maps are computed once per bank (one read of the photo at the bank's layer) and kept: drawing
another concept, alpha or colormap runs no model.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from ..atlas.page import shown
from ..concepts import ConceptBank, Craft
from ..concepts.craft import cut
from ..core.layers import LayerSpec
from ..errors import ExplainError
from ..io.images import rgb_array
from ..io.render import blend, heat_layer
from ..models.spec import ModelSpec


class Photos(Protocol):
    """What the view reads of its explorer (:class:`explain.explorer.session.Explorer`): the model, and the photos
    by name, each with its ``image`` and its input ``x``."""

    spec: ModelSpec
    photos: Mapping[str, Any]

BEST = 6  # a concept's best crops shown
THUMB = 96  # their side in pixels


@dataclass(frozen=True)
class ConceptEntry:
    """One concept as a photo's list shows it.

    Attributes:
        index: The concept's row in the bank.
        share: Its share of the photo: its coefficients' sum over the photo's positions, over all concepts'.
    """

    index: int
    share: float

    @property
    def label(self) -> str:
        """How a list shows it: ``concept 3 · 41% of the photo``."""
        return f"concept {self.index} · {self.share:.0%} of the photo"


class ExplorerConcepts:
    """The concepts of one explorer: a bank, found in its photos or given, and each photo's maps on it.

    Args:
        explorer: The explorer whose model and photos it reads.
        lock: The explorer's lock, held while the model runs.
    """

    def __init__(self, explorer: Photos, lock: AbstractContextManager[Any]) -> None:
        self.explorer, self._lock = explorer, lock
        self.bank: ConceptBank | None = None
        self._craft: Craft | None = None
        self._images: Tensor | None = None  # what a found bank's crops were cut from
        self._maps: dict[str, Tensor] = {}  # each photo's maps on the bank, (K, H, W) on the CPU

    def find(self, layer: LayerSpec = None, concepts: int = 6, crop: int | None = None) -> ConceptBank:
        """Find concepts in the explorer's photos by CRAFT, and keep them.

        Args:
            layer: The layer (None: the automatic one).
            concepts: How many.
            crop: The crops' side in the model's input pixels; None: half the input's shorter side.

        Raises:
            ExplainError: No photos, photos that are no images, or fewer crops than concepts.
        """
        explorer = self.explorer
        photos = list(explorer.photos.values())
        if not photos or not explorer.spec.preprocessing.kind.picture:
            raise ExplainError("concepts are found in photos: add photos first (clips, scans and signals have none)")
        size = photos[0].x.shape[-2:]
        images = torch.cat([_sized(photo.x, size) for photo in photos])
        side = crop if crop is not None else min(size) // 2
        craft = Craft(explorer.spec.model, layer, concepts=concepts, crop=side, labels=explorer.spec.labels)
        with self._lock:
            bank = craft.fit(images)
            self.bank, self._craft, self._images, self._maps = bank, craft, images, {}
        return bank

    def use(self, bank: ConceptBank) -> None:
        """Show a bank found elsewhere (``explain concepts``'s, or a dictionary's, see
        :func:`explain.concepts.dictionary_bank`); it has no crops of these photos to show."""
        craft = Craft(self.explorer.spec.model, bank.layer, concepts=bank.concepts, labels=self.explorer.spec.labels)
        with self._lock:
            self.bank, self._craft, self._images, self._maps = bank, craft, None, {}

    def maps(self, photo: str) -> Tensor:
        """The photo's concept maps, (K, H, W) at the model's input resolution on the CPU, each concept's
        coefficient at every position, scaled by the photo's largest: a concept barely there is drawn faint.

        Raises:
            ExplainError: No concepts yet, or no such photo.
        """
        bank, craft = self._found()
        if photo not in self.explorer.photos:
            raise ExplainError(f"no photo named {photo!r}; add it first")
        with self._lock:
            if photo not in self._maps:
                found = craft.maps(bank, self.explorer.photos[photo].x)[0].cpu()
                self._maps[photo] = found / found.max().clamp_min(torch.finfo(found.dtype).tiny)
            return self._maps[photo]

    def entries(self, photo: str) -> list[ConceptEntry]:
        """The bank's concepts, the most present in the photo first."""
        sums = self.maps(photo).flatten(1).sum(dim=1)
        shares = sums / sums.sum().clamp_min(torch.finfo(sums.dtype).tiny)
        order = shares.argsort(descending=True).tolist()
        return [ConceptEntry(k, float(shares[k])) for k in order]

    def picture(self, photo: str, concept: int, alpha: float = 0.5, colormap: str = "jet") -> Image.Image:
        """Where the concept lies in the photo: its map blended onto the photo at the photo's resolution.

        Raises:
            ExplainError: No such concept.
        """
        maps = self.maps(photo)
        if not 0 <= concept < len(maps):
            raise ExplainError(f"no concept {concept}: the bank has {len(maps)}")
        base = rgb_array(self.explorer.photos[photo].image)
        return blend(base, heat_layer(maps[concept], *base.shape[:2], colormap), alpha)

    def best_crops(self, concept: int, count: int = BEST) -> list[Image.Image]:
        """The crops of the explorer's photos the concept describes best, as pictures; none for a bank found
        elsewhere.

        Raises:
            ExplainError: No concepts yet, or no such concept.
        """
        bank, _ = self._found()
        if not 0 <= concept < bank.concepts:
            raise ExplainError(f"no concept {concept}: the bank has {bank.concepts}")
        if self._images is None:
            return []
        best = bank.best_crops(count)[concept]
        crops = cut(self._images, bank.boxes[best])
        return [Image.fromarray(shown(self.explorer.spec, c)).resize((THUMB, THUMB)) for c in crops]

    def _found(self) -> tuple[ConceptBank, Craft]:
        if self.bank is None or self._craft is None:
            raise ExplainError("no concepts yet: find them in the photos first")
        return self.bank, self._craft


def _sized(x: Tensor, size: torch.Size) -> Tensor:
    """A photo's input at the first photo's size, as the concepts are found on one batch."""
    return x if x.shape[-2:] == size else F.interpolate(x, size=tuple(size), mode="bilinear", align_corners=False)
