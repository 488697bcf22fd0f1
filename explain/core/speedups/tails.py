"""A speedup (``tails``): copies of one image that differ only in a layer's output (CRAFT's masked concepts) share
the model's forward up to that layer: the image runs once, its layer output expanded to the copies', and only the
part after the layer runs for each copy.

It holds where what follows the layer reads the part before it only through tensors that broadcast over the
batch; a model that reads it otherwise (a shape taken from the input, a concatenation with an earlier tensor) fails
or scores differently, which :func:`shared_prefix` checks on its first copies, scored both ways, before it keeps its
scores: else the caller runs every copy whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Score = Callable[[Tensor, Tensor, bool], Tensor]
"""``score(maps, images, once)``: the target's scores (rows,) of the rows' images with the layer's output replaced
by ``maps``; ``once``: the first row's image run once, its layer output expanded to the rows'."""

CHECKED = 2  # copies scored both ways
SHARED_ELEMENTS = 2**25  # the layer-output elements of the copies that share one run (128 MiB of float32)


def shared_prefix(
    score: Score, maps: Tensor, images: Tensor, rows: int, checked: bool = False
) -> tuple[Tensor, bool] | None:
    """The scores of copies of one image (``images`` all one index) with the layer's output replaced by ``maps``,
    ``rows`` copies at a time, each batch running the image once up to the layer; and whether the sharing was
    checked. Unless ``checked`` already (on an earlier image at the same layer), the first copies are scored whole
    too and must agree. None where the copies are of several images, or where the checked copies disagree (or the
    shared forward fails)."""
    if len(images) <= CHECKED or bool((images != images[0]).any()):
        return None
    starts = range(0, len(maps), rows)
    try:
        found = [score(maps[s : s + rows], images[s : s + rows], True) for s in starts[:1]]
    except RuntimeError:
        return None
    if not checked:
        whole = score(maps[:CHECKED], images[:CHECKED], False)
        tolerance = 1e-4 * float(whole.abs().max().clamp_min(1e-6))
        if found[0].shape != (min(rows, len(maps)),) or (found[0][:CHECKED] - whole).abs().max() > tolerance:
            return None
    found += [score(maps[s : s + rows], images[s : s + rows], True) for s in starts[1:]]
    return torch.cat(found), True


def shared_rows(batch_size: int, image: Tensor, maps: Tensor) -> int:
    """How many copies share one run of the image: as many as fit in ``SHARED_ELEMENTS`` layer-output elements, or
    ``batch_size`` copies' worth of the image's elements where that is more; all of them at most."""
    copy = max(1, maps[0].numel())
    scale = max(1, image[0].numel() // copy)
    return min(len(maps), max(batch_size * scale, SHARED_ELEMENTS // copy))
