"""Black-box attributions from the scores of masked copies of the input: Occlusion's sliding windows and RISE's
random masks, at the input's resolution.

A mask keeps the input where it is 1 and puts the baseline where it is 0. The copies of every image under every
mask are scored ``batch_size`` per forward under ``torch.no_grad()`` (on the CPU by a copy of the model with its batch
norms folded, channels-last: :class:`explain.core.speedups.folding.ScoringForwards`), with the call's bound target
(:class:`MaskedCopies`, which the superpixel methods share). A copy that differs from its image, or from the
all-baseline input, only inside a small box (an occluded window, an ablated segment, a coalition of one segment)
shares that input's local prefix (:mod:`explain.core.speedups.prefix`); the boxes are read from the masks. Each method's
formula weighs each mask's region by the score and normalizes the sum.
``raw`` keeps the signed attribution; the map is its positive part, normalized.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.engine import CAM, Capture, Needs
from ..core.layers import LayerSpec
from ..core.maps import INTERPOLATION, bounding_boxes, postprocess
from ..core.model_state import running
from ..core.speedups import enabled
from ..core.speedups.fields import per_axis
from ..core.speedups.folding import ScoringForwards
from ..core.speedups.prefix import SharedPrefix
from ..errors import ExplainError


def _positive_per_axis(value: int | Sequence[int], rank: int, what: str) -> tuple[int, ...]:
    """One positive int per spatial axis (see :func:`explain.core.speedups.fields.per_axis`).

    Raises:
        ExplainError: Not one positive int, nor one per axis.
    """
    try:  # numpy's integers too, never a float
        given = [operator.index(v) for v in value] if isinstance(value, Sequence) else operator.index(value)
    except TypeError:
        given = None
    values = per_axis(given, rank)
    if values is None or min(values) < 1:
        raise ExplainError(f"{what} must be a positive int or one per spatial axis ({rank}), got {value!r}")
    return values


class MaskedCopies(CAM):
    """Base of the black-box methods that score masked copies of the input (the masking and the superpixel
    methods): where a mask is 1 a copy keeps the input, where it is 0 it takes ``baseline``. The copies are scored
    ``batch_size`` per forward with the call's bound target (:meth:`score_copies`); the map is the positive part
    of the signed attribution, normalized.

    Args:
        model: Any model explain explains; left as it was.
        layer: None: the map is at the input (a layer given is refused in one line).
        labels: Class names, to accept a class name as target.
        baseline: The value a masked position takes (in the normalized input's units).
        batch_size: Masked copies per forward.
        seed: Seed of random masks.
    """

    needs = Needs(gradients=False, map_of_input=True)
    reads_layer = False

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        labels: Sequence[str] | None = None,
        baseline: float = 0.0,
        batch_size: int = 16,
        seed: int | None = None,
    ) -> None:
        super().__init__(model, layer, labels=labels, batch_size=batch_size, seed=seed)
        self.baseline = baseline

    def score_copies(
        self,
        capture: Capture,
        images: Tensor,
        keep: Callable[[Tensor], Tensor],
        scored: Callable[[Tensor, Tensor, Tensor], None],
    ) -> None:
        """Score copy r of image ``images[r]`` under its mask, ``batch_size`` copies per forward.

        A copy that differs from its image, or from the all-baseline input, only inside a small box shares that
        input's local prefix (:class:`explain.core.speedups.prefix.SharedPrefix`; see :func:`shared_prefix_plan`). Those
        copies are scored first, and the first forward through the prefix is checked against whole copies: a
        different score drops the prefix.

        Args:
            capture: The call's capture (its input, bound target and model arguments).
            images: Each copy's image, (rows,).
            keep: The masks of some rows (indices), (rows, *spatial) floats in [0, 1].
            scored: Called with each batch's rows (indices), their masks and their scores (rows,).
        """
        x = capture.x
        forwards = capture.once("scoring", lambda: ScoringForwards(self.model, x.device))
        with torch.no_grad(), running(self.model):
            plan = None
            if enabled("prefix"):
                kwargs = capture.model_kwargs
                plan = shared_prefix_plan(forwards, x, self.baseline, images, keep, self.batch_size, kwargs)
            order = torch.arange(len(images), device=x.device) if plan is None else plan.order
            checked = False
            for start in range(0, len(order), self.batch_size):
                rows = order[start : start + self.batch_size]
                mask, chosen = keep(rows), images[rows]
                scores = None
                if plan is not None and bool(plan.fits[rows].all()):
                    crops = partial(self._crops, x, mask, chosen)
                    output = plan.prefix(crops, plan.bases[rows], plan.starts[rows])
                    scores = None if output is None else capture.score_rows(output, chosen).float()
                    if scores is not None and not checked:  # the first copy scored whole too
                        checked = True
                        first = self._copies(x, mask[:1], chosen[:1])
                        whole = capture.score_rows(forwards(first, **capture.model_kwargs), chosen[:1]).float()
                        if not torch.allclose(scores[:1], whole, rtol=1e-3, atol=1e-4):
                            plan, scores = None, None
                if scores is None:
                    output = forwards(self._copies(x, mask, chosen), **capture.model_kwargs)
                    scores = capture.score_rows(output, chosen).float()
                scored(rows, mask, scores)

    def _copies(self, x: Tensor, mask: Tensor, images: Tensor, region: tuple[slice, ...] = ()) -> Tensor:
        """The copies of ``images`` under ``mask`` (rows, *spatial), within ``region`` of the spatial axes."""
        kept = mask[(slice(None), *region)][:, None]
        return (kept * x[(slice(None), slice(None), *region)][images] + (1 - kept) * self.baseline).to(x.dtype)

    def _crops(self, x: Tensor, mask: Tensor, images: Tensor, regions: list[tuple[slice, ...]]) -> Tensor:
        """Each copy within its own region (all of one size)."""
        return torch.cat(
            [self._copies(x, mask[r : r + 1], images[r : r + 1], region) for r, region in enumerate(regions)]
        )

    def finish(self, raw: Tensor, rank: int, size: Sequence[int] | None, normalize: bool) -> Tensor:
        return postprocess(raw.clamp(min=0), rank, size, normalize)


@dataclass(frozen=True)
class PrefixPlan:
    """Which copies share a prefix, and how.

    Attributes:
        prefix: The shared prefix, fitted to one window's sides; its inputs are the images, then the all-baseline
            input.
        order: The rows in the order they are scored: those that fit the window first.
        fits: Whether each row's copy differs from its input only inside the window, (rows,).
        bases: The input each row differs from: its image's index, or N for the all-baseline input, (rows,).
        starts: Where each row's window starts, (rows, rank).
    """

    prefix: SharedPrefix
    order: Tensor
    fits: Tensor
    bases: Tensor
    starts: Tensor


WINDOW_SHARES = (1 / 8, 1 / 4, 1 / 2, 3 / 4, 1)  # the shares of the copies whose boxes set a candidate window
MIN_WORTH = 3.0  # the whole forwards a shared prefix must save: its trace costs about that


def shared_prefix_plan(
    forwards: ScoringForwards,
    x: Tensor,
    baseline: float,
    images: Tensor,
    keep: Callable[[Tensor], Tensor],
    batch_size: int,
    model_kwargs: dict[str, Any],
) -> PrefixPlan | None:
    """Where copies may share their input's local prefix, read from their masks.

    A copy equals its image where its mask is 1 and the all-baseline input where it is 0: it differs from the one
    inside the box around its mask's positions below 1, from the other inside the box around those above 0; the
    smaller box is its own. Candidate windows are the boxes of the smallest eighth, quarter, half, three quarters
    and all of the copies (their largest side per axis); the one whose fitting copies save the most of the
    forward's work is chosen (:meth:`explain.core.speedups.prefix.SharedPrefix.saving`). None where none saves
    :data:`MIN_WORTH` whole forwards.
    """
    spatial = torch.tensor(x.shape[2:], device=x.device)
    bases, starts, sides = [], [], []
    for rows in torch.arange(len(images), device=x.device).split(batch_size):
        mask = keep(rows)
        from_image, from_baseline = bounding_boxes(mask != 1), bounding_boxes(mask != 0)
        closer = from_baseline[1].prod(dim=1) < from_image[1].prod(dim=1)
        bases.append(torch.where(closer, len(x), images[rows]))
        starts.append(torch.where(closer[:, None], from_baseline[0], from_image[0]))
        sides.append(torch.where(closer[:, None], from_baseline[1], from_image[1]))
    base, start, side = torch.cat(bases), torch.cat(starts), torch.cat(sides)
    by_area = side.prod(dim=1).argsort()
    windows = {tuple(side[by_area[: math.ceil(share * len(side))]].amax(dim=0).clamp_min(1).tolist())
               for share in WINDOW_SHARES}  # fmt: skip
    fitting = {w: int((side <= side.new_tensor(w)).all(dim=1).sum()) for w in windows}
    fitting = {w: n for w, n in fitting.items() if math.prod(w) <= math.prod(x.shape[2:]) / 2 and n >= MIN_WORTH}
    if not fitting:  # larger windows share little; too few copies would not pay for the trace
        return None
    prefix = SharedPrefix(forwards, torch.cat([x, torch.full_like(x[:1], baseline)]), None, model_kwargs)
    worth = {w: prefix.saving(w) * n for w, n in fitting.items()}
    window = max(worth, key=worth.__getitem__)
    if worth[window] < MIN_WORTH:
        return None
    prefix.fit(window)
    if prefix.cut is None:
        return None
    fits = (side <= side.new_tensor(window)).all(dim=1)
    at = torch.minimum(start, spatial - side.new_tensor(window)).clamp_min(0)  # the window holds the box
    order = torch.cat([fits.nonzero()[:, 0], (~fits).nonzero()[:, 0]])
    return PrefixPlan(prefix, order, fits, base, at)


class Masks(Protocol):
    """One call's masks of the input: how many, each one (:meth:`keep`), and how the summed credits become the
    attribution (:meth:`normalized`). Made anew at each call, so that the method keeps no call's state."""

    count: int

    def keep(self, indices: Tensor, spatial: Sequence[int]) -> Tensor:
        """Masks ``indices``, (len(indices), *spatial) in [0, 1]: 1 keeps the input, 0 puts the baseline."""

    def normalized(self, total: Tensor, keeps: Tensor) -> Tensor:
        """The attribution from the summed credits (N, *spatial) and the masks' sum (*spatial)."""


class Masking(MaskedCopies):
    """Base of the masking methods: a call's masks of the input (:meth:`masks`), and the region each one's score is
    credited to (:meth:`credit`). Every image is scored under every mask; the arguments are :class:`MaskedCopies`'.
    """

    def masks(self, capture: Capture) -> Masks:
        """The call's masks (random ones drawn with the call's generator)."""
        raise NotImplementedError

    def credit(self, score: Tensor, plain: Tensor, keep: Tensor) -> Tensor:
        """What each masked copy adds to the attribution of each position, (rows, *spatial)."""
        raise NotImplementedError

    def compute(self, capture: Capture) -> Tensor:
        x = capture.x
        spatial, device = x.shape[2:], x.device
        drawn = self.masks(capture)
        total = x.new_zeros(len(x), *spatial, dtype=torch.float32)
        keeps = x.new_zeros(*spatial, dtype=torch.float32)
        images = torch.arange(len(x), device=device).repeat_interleave(drawn.count)  # row r: image r // count
        masks = torch.arange(drawn.count, device=device).repeat(len(x))  # and its mask r % count

        def credited(rows: Tensor, keep: Tensor, score: Tensor) -> None:
            chosen = images[rows]
            total.index_add_(0, chosen, self.credit(score, capture.scores[chosen].float(), keep))
            keeps.add_(keep[chosen == 0].sum(dim=0))  # each mask once: the first image has them all

        self.score_copies(capture, images, lambda rows: drawn.keep(masks[rows], spatial).float(), credited)
        return drawn.normalized(total, keeps)


def window_starts(size: int, window: int, stride: int) -> list[int]:
    """Where a window of ``window`` starts along an axis of ``size``: every ``stride``, until the axis is covered
    (the last window cut at the edge), as Captum's ``Occlusion`` slides it.

    Raises:
        ExplainError: The window is larger than the axis, or the stride larger than the window (positions between
            two placements would have no attribution).
    """
    if window > size:
        raise ExplainError(f"an occlusion window of {window} is larger than the input's side of {size}")
    if stride > window:
        raise ExplainError(
            f"an occlusion stride {stride} is larger than the window {window}: positions between two placements "
            "would be covered by none"
        )
    return [k * stride for k in range(math.ceil((size - window) / stride) + 1)]


class Occlusion(Masking):
    r"""Occlusion: Zeiler & Fergus, "Visualizing and Understanding Convolutional Networks", ECCV 2014
    (arXiv:1311.2901).

    A window of ``window`` positions (every channel) slides over the input every ``stride``; each placement
    replaces it by ``baseline`` and scores the copy. A position's attribution is the mean, over the placements
    that cover it, of the score's drop, :math:`R_p = \mathrm{mean}_{w \ni p}\,[S(x) - S(x_{w \leftarrow b})]`, as
    Captum's ``Occlusion`` gives it with a window over all channels.

    A copy differs from its image only inside the window: a convolutional network's local first layers run on a
    crop around the window alone, their result pasted into the image's, computed once
    (:func:`shared_prefix_plan`); the scores are the whole copies'.

    Args:
        model: Any model explain explains; left as it was.
        layer: None: the map is at the input (a layer given is refused in one line).
        labels: Class names, to accept a class name as target.
        window: The window's side, one for all spatial axes or one per axis.
        stride: How far the window moves, likewise; at most the window.
        baseline: The value an occluded position takes (in the normalized input's units).
        batch_size: Occluded copies per forward.
    """

    name = "occlusion"
    title = "Occlusion, sliding windows (Zeiler & Fergus 2014)"
    fast = False
    cost = "one forward per window placement"

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        labels: Sequence[str] | None = None,
        window: int | Sequence[int] = 16,
        stride: int | Sequence[int] = 8,
        baseline: float = 0.0,
        batch_size: int = 16,
    ) -> None:
        super().__init__(model, layer, labels=labels, baseline=baseline, batch_size=batch_size)
        self.window, self.stride = window, stride

    def masks(self, capture: Capture) -> Windows:
        spatial = capture.x.shape[2:]
        rank = len(spatial)
        window = _positive_per_axis(self.window, rank, "window")
        stride = _positive_per_axis(self.stride, rank, "stride")
        starts = [window_starts(size, w, st) for size, w, st in zip(spatial, window, stride)]
        return Windows(torch.tensor(list(itertools.product(*starts)), device=capture.x.device), window)

    def credit(self, score: Tensor, plain: Tensor, keep: Tensor) -> Tensor:
        return (plain - score).view(-1, *(1,) * (keep.dim() - 1)) * (1 - keep)


@dataclass(frozen=True)
class Windows:
    """Occlusion's masks of one call: each placement's window hidden.

    Attributes:
        starts: Each placement's first position along each axis, (placements, rank).
        sides: The window's side along each axis.
    """

    starts: Tensor
    sides: tuple[int, ...]

    @property
    def count(self) -> int:
        """How many placements."""
        return len(self.starts)

    def keep(self, indices: Tensor, spatial: Sequence[int]) -> Tensor:
        hidden = torch.ones(len(indices), *spatial, dtype=torch.bool, device=indices.device)
        for axis, (size, side) in enumerate(zip(spatial, self.sides)):
            start = self.starts[indices, axis].view(-1, *(1,) * len(spatial))
            position = torch.arange(size, device=indices.device).view(-1, *(1,) * (len(spatial) - axis - 1))
            hidden &= (position >= start) & (position < start + side)  # inside the window along this axis
        return (~hidden).float()

    def normalized(self, total: Tensor, keeps: Tensor) -> Tensor:
        return total / (self.count - keeps)  # each position: the placements that hide it


class RISE(Masking):
    r"""RISE: Petsiuk, Das & Saenko, "RISE: Randomized Input Sampling for Explanation of Black-box Models", BMVC
    2018 (arXiv:1806.07421).

    ``masks`` random masks: each a grid of ``cells`` cells per axis, each cell kept with probability ``p``,
    upsampled (bilinearly, trilinearly for volumes) to ``cells + 1`` times the input's cell size and cut at a random
    shift within one cell. The attribution is the score-weighted sum of the masks, normalized by the mask's
    expectation: :math:`R = \frac{1}{N p} \sum_i S(x \odot M_i)\, M_i`, with the masked positions at ``baseline``.
    The masks are drawn with the call's generator (``seed``), and scored ``batch_size`` per forward.

    Args:
        model: Any model explain explains; left as it was.
        layer: Not used (the map is at the input).
        labels: Class names, to accept a class name as target.
        masks: How many random masks.
        cells: The grid's cells per spatial axis.
        p: The probability that a cell is kept.
        baseline: The value a masked position takes (in the normalized input's units).
        batch_size: Masked copies per forward.
        seed: Seed of the masks; None uses PyTorch's global generator.
    """

    name = "rise"
    title = "RISE, random masks (Petsiuk et al. 2018)"
    fast = False
    cost = "one forward per random mask"

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        labels: Sequence[str] | None = None,
        masks: int = 2000,
        cells: int = 7,
        p: float = 0.5,
        baseline: float = 0.0,
        batch_size: int = 16,
        seed: int | None = None,
    ) -> None:
        super().__init__(model, layer, labels=labels, baseline=baseline, batch_size=batch_size, seed=seed)
        if masks < 1 or cells < 1 or not 0 < p <= 1:
            raise ExplainError(f"RISE needs masks >= 1, cells >= 1 and 0 < p <= 1; got {masks}, {cells}, {p}")
        self.count, self.cells, self.p = masks, cells, p

    def masks(self, capture: Capture) -> Grids:
        x, generator = capture.x, capture.generator
        rank = x.dim() - 2
        shape = (self.count, 1, *(self.cells,) * rank)
        grids = (torch.rand(shape, device=x.device, generator=generator) < self.p).float()
        cell = [math.ceil(side / self.cells) for side in x.shape[2:]]
        shifts = torch.stack(
            [torch.randint(0, c, (self.count,), device=x.device, generator=generator) for c in cell], dim=1
        )
        return Grids(grids, shifts, self.cells, self.p)

    def credit(self, score: Tensor, plain: Tensor, keep: Tensor) -> Tensor:
        return score.view(-1, *(1,) * (keep.dim() - 1)) * keep


@dataclass(frozen=True)
class Grids:
    """RISE's masks of one call: random grids of kept cells, each upsampled and cut at its shift.

    Attributes:
        grids: The grids, (masks, 1, *(cells,) * rank), 1 where a cell is kept.
        shifts: Each mask's shift along each axis, (masks, rank).
        cells: The grid's cells per axis.
        p: The probability that a cell is kept.
    """

    grids: Tensor
    shifts: Tensor
    cells: int
    p: float

    @property
    def count(self) -> int:
        """How many masks."""
        return len(self.grids)

    def keep(self, indices: Tensor, spatial: Sequence[int]) -> Tensor:
        rank = len(spatial)
        large = [(self.cells + 1) * math.ceil(side / self.cells) for side in spatial]
        upsampled = F.interpolate(self.grids[indices], size=large, mode=INTERPOLATION[rank], align_corners=False)
        rows = torch.arange(len(indices), device=indices.device).view(-1, *(1,) * rank)
        cut = [
            torch.arange(size, device=indices.device).view(-1, *(1,) * (rank - axis - 1))
            + self.shifts[indices, axis].view(-1, *(1,) * rank)
            for axis, size in enumerate(spatial)
        ]  # each mask's positions, shifted, along each axis
        return upsampled[:, 0][(rows, *cut)]

    def normalized(self, total: Tensor, keeps: Tensor) -> Tensor:
        return total / (self.count * self.p)
