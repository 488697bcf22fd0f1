"""Occlusion: a black-box attribution from the scores of the input with windows of it replaced by a baseline,
scored in batched forwards at the input's resolution."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..core.engine import CAM, Capture
from ..core.layers import LayerSpec
from ..core.maps import postprocess
from ..core.model_state import running
from ..errors import ExplainError


def _per_axis(value: int | Sequence[int], rank: int, what: str) -> tuple[int, ...]:
    """One value per spatial axis: an int for all, or a sequence of ``rank``."""
    values = (value,) * rank if isinstance(value, int) else tuple(value)
    if len(values) != rank or min(values) < 1:
        raise ExplainError(f"{what} must be a positive int or one per spatial axis ({rank}), got {value!r}")
    return values


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


class Occlusion(CAM):
    r"""Occlusion: Zeiler & Fergus, "Visualizing and Understanding Convolutional Networks", ECCV 2014
    (arXiv:1311.2901).

    A window of ``window`` positions (every channel) slides over the input every ``stride``; each placement
    replaces it by ``baseline`` and scores the copy. A position's attribution is the mean, over the placements
    that cover it, of the score's drop, :math:`R_p = \mathrm{mean}_{w \ni p}\,[S(x) - S(x_{w \leftarrow b})]`, as
    Captum's ``Occlusion`` gives it with a window over all channels. ``raw`` keeps this signed map; the map is its
    positive part (where occluding lowers the score), normalized. The copies are scored ``batch_size`` per forward
    under ``torch.no_grad()``.

    Args:
        model: Any model explain explains; left as it was.
        layer: Not used (the map is at the input); accepted so every method takes the same arguments.
        labels: Class names, to accept a class name as target.
        window: The window's side, one for all spatial axes or one per axis.
        stride: How far the window moves, likewise.
        baseline: The value an occluded position takes (in the normalized input's units).
        batch_size: Occluded copies per forward.
    """

    name = "occlusion"
    needs_gradients = False
    map_of_input = True

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
        super().__init__(model, None, labels=labels, batch_size=batch_size)
        self.window, self.stride, self.baseline = window, stride, baseline

    def placements(self, spatial: Sequence[int]) -> list[tuple[slice, ...]]:
        """Every placement of the window over positions of size ``spatial``: one slice per axis each."""
        rank = len(spatial)
        window, stride = _per_axis(self.window, rank, "window"), _per_axis(self.stride, rank, "stride")
        per_axis = [
            [slice(s, s + w) for s in window_starts(size, w, st)] for size, w, st in zip(spatial, window, stride)
        ]
        return list(itertools.product(*per_axis))

    def compute(self, capture: Capture) -> Tensor:
        x = capture.x
        spatial = x.shape[2:]
        placements = self.placements(spatial)
        n, count = len(x), len(placements)
        total = x.new_zeros(n, *spatial, dtype=torch.float32)
        covers = x.new_zeros(*spatial, dtype=torch.float32)
        for slices in placements:
            covers[slices] += 1
        rows = [(i, p) for i in range(n) for p in range(count)]
        with torch.no_grad(), running(self.model):
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start : start + self.batch_size]
                images = torch.tensor([i for i, _ in chunk], device=x.device)
                hidden = torch.zeros(len(chunk), 1, *spatial, dtype=torch.bool, device=x.device)
                for r, (_, p) in enumerate(chunk):
                    hidden[(r, 0, *placements[p])] = True
                copies = torch.where(hidden, torch.as_tensor(self.baseline, dtype=x.dtype), x[images])
                drop = capture.scores[images] - capture.score_rows(self.model(copies, **capture.model_kwargs), images)
                total.index_add_(0, images, drop.float().view(-1, *(1,) * len(spatial)) * hidden[:, 0])
        return total / covers

    def finish(self, raw: Tensor, rank: int, size: Sequence[int] | None, normalize: bool) -> Tensor:
        return postprocess(raw.clamp(min=0), rank, size, normalize)
