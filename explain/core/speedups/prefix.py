"""Forwards of copies of an image that differ from it inside one window (an occluded window, an ablated segment),
their shared prefix computed once.

A convolutional network's first operations are local: each output position reads a box of input positions, its
receptive field. A copy of an image that differs from it inside a window differs, after such operations, only at
the positions whose field meets the window. :class:`SharedPrefix` finds, in one traced forward, the operation
after which the rest of the model reads nothing of the prefix but that operation's result (the cut); computes
the cut's result on each image once; and runs each copy's prefix on a crop around its window alone, the crop's
result pasted into its image's, the rest of the model on the whole.

The prefix holds only the local operations of :mod:`explain.core.fields`, which follows each position's field
through them. The cut is chosen where the prefix's work saved is largest (a crop's share of the map, by the
convolutions' multiply-adds); below a tenth of the whole forward's work, none is made. A crop starts at a multiple
of the cut's stride, so that its positions lie on the image's grid; the positions pasted are those whose field
meets the window, and each reads the crop alone, or the image's own border: their values are the whole copy's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor
from torch.overrides import TorchFunctionMode

from .fields import Field, FieldTrace, name_of
from .folding import ScoringForwards

MIN_SAVING = 0.1  # the least share of the forward's work a cut must save


@dataclass(frozen=True)
class _Cut:
    """Where the prefix is cut: the call's ordinal and name, its result's fields, the crops' sides and the result's
    spatial size on the whole input."""

    index: int
    name: str
    fields: tuple[Field, ...]
    crop: tuple[int, ...]
    size: tuple[int, ...]


class _Replaced(TorchFunctionMode):
    """Count the calls of a forward; the result of call ``index`` goes through ``replace``."""

    def __init__(self, cut: _Cut, replace: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.cut, self.replace, self.calls = cut, replace, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        index = self.calls
        self.calls += 1
        result = func(*args, **(kwargs or {}))
        if index != self.cut.index:
            return result
        if name_of(func) != self.cut.name or not isinstance(result, Tensor):
            raise _Unmatched
        return self.replace(result)


class _Unmatched(Exception):
    """The forward did not run the traced calls."""


class _Captured(Exception):
    """The cut's result is kept: the forward ends there."""


class SharedPrefix:
    """Forwards of copies of images that differ from their image inside one window each, the prefix shared (see
    the module's docstring).

    The model is traced once; :meth:`saving` weighs windows of several sides against that trace, and :meth:`fit`
    chooses the cut for one of them and computes the images' results there. A model with a module in training
    mode gets no cut: its batch norms mix the copies of a batch.

    Args:
        forwards: The model's forwards without gradient.
        x: The images (N, C, *spatial).
        window: The window's side along each spatial axis; None: choose it later (:meth:`fit`).
        model_kwargs: The model's keyword arguments.
    """

    def __init__(
        self, forwards: ScoringForwards, x: Tensor, window: Sequence[int] | None, model_kwargs: dict[str, Any]
    ) -> None:
        self.forwards, self.model_kwargs, self.x = forwards, model_kwargs, x
        self.spatial = tuple(x.shape[2:])
        self.window: tuple[int, ...] = ()
        self.cut: _Cut | None = None
        self.features: Tensor | None = None
        training = any(m.training for m in forwards.model.modules())  # batch statistics: no copy is its own
        self._candidates = [] if training else self._traced(x[:1])
        if window is not None:
            self.fit(window)

    def _traced(self, probe: Tensor) -> list[tuple[float, _Cut]]:
        """The calls after which the prefix may be cut, each with the work done up to it (a share of the whole
        forward's); their crops' sides are set by :meth:`_chosen`."""
        layout = self.forwards.channels_last
        with FieldTrace(probe) as trace:
            self.forwards(probe, **self.model_kwargs)
        if self.forwards.channels_last != layout:  # the model refused channels-last inputs: the trace ran twice
            with FieldTrace(probe) as trace:
                self.forwards(probe, **self.model_kwargs)
        ends = trace.ends if trace.ends is not None else trace.calls
        total = sum(trace.costs) or 1.0
        cuts = {index: (name, result) for index, name, result in trace.local_results}
        found, done = [], 0.0
        for index, cost in enumerate(trace.costs[:ends]):
            done += cost
            if index not in cuts:
                continue
            name, result = cuts[index]
            if min(result.shape[2:]) < 2 or not self._alone(trace, index, result):
                continue
            found.append((done / total, _Cut(index, name, trace.fields[id(result)], (), tuple(result.shape[2:]))))
        return found

    def _chosen(self, window: Sequence[int]) -> tuple[float, _Cut | None]:
        """The cut that saves the most of the forward's work for windows of these sides, and that share (0 and
        None below :data:`MIN_SAVING`)."""
        best, saved = None, MIN_SAVING
        for done, cut in self._candidates:
            crop = tuple(_crop_side(f, size, w) for f, size, w in zip(cut.fields, self.spatial, window))
            share = math.prod(c / size for c, size in zip(crop, self.spatial))
            if done * (1 - share) > saved:
                best, saved = replace(cut, crop=crop), done * (1 - share)
        return (saved, best) if best is not None else (0.0, None)

    def saving(self, window: Sequence[int]) -> float:
        """The share of a whole forward's work that a copy differing inside a window of these sides saves (0
        where no cut serves)."""
        return self._chosen(window)[0]

    def fit(self, window: Sequence[int]) -> None:
        """Cut for windows of these sides, and compute the images' results at the cut (none: no cut)."""
        self.window = tuple(window)
        self.cut = self._chosen(self.window)[1]
        self.features = None
        if self.cut is None:
            return
        kept: list[Tensor] = []

        def keep(result: Tensor) -> Tensor:
            kept.append(result)
            raise _Captured  # the rest of the forward is not needed

        try:
            with _Replaced(self.cut, keep):
                self.forwards(self.x, **self.model_kwargs)
        except (_Captured, _Unmatched):
            pass
        if not kept or tuple(kept[0].shape[2:]) != self.cut.size:
            self.cut = None
        self.features = kept[0] if kept and self.cut is not None else None

    @staticmethod
    def _alone(trace: FieldTrace, index: int, result: Tensor) -> bool:
        """Whether, after call ``index``, the forward reads nothing made before it but its result."""
        return all(
            trace.last_use.get(key, born) <= index
            for key, born in trace.born.items()
            if born <= index and key != id(result)
        )

    def __call__(self, crops_of: Callable[[list[tuple[slice, ...]]], Tensor], images: Tensor, starts: Tensor) -> Any:
        """The model's output on copies of images ``images`` (rows,), copy r differing from its image inside the
        window that starts at ``starts[r]`` (rank,); None where the prefix cannot serve them (no cut, a window
        outside its crop, a forward that ran other calls than traced): the copies are then scored whole.

        Args:
            crops_of: The copies (rows, C, *crop) within one region each (a slice per spatial axis).
            images: Each copy's image.
            starts: Each copy's window start.
        """
        if self.cut is None or self.features is None:
            return None
        cut, features = self.cut, self.features
        boxes = [self._boxes(cut, [int(s) for s in start]) for start in starts.tolist()]
        if None in boxes:
            return None
        crops = crops_of([tuple(slice(c, c + side) for (c, _, _), side in zip(box, cut.crop)) for box in boxes])

        def pasted(cropped: Tensor) -> Tensor:
            full = features[images]  # a copy: indexing by a tensor
            for r, box in enumerate(boxes):
                into = tuple(slice(low, high) for _, low, high in box)
                out_of = tuple(slice(low - c // f.stride, high - c // f.stride) for (c, low, high), f in
                               zip(box, cut.fields))  # fmt: skip
                full[(r, slice(None), *into)] = cropped[(r, slice(None), *out_of)]
            return full

        try:
            with _Replaced(cut, pasted):
                return self.forwards(crops, **self.model_kwargs)
        except _Unmatched:
            return None

    def _boxes(self, cut: _Cut, start: Sequence[int]) -> list[tuple[int, int, int]] | None:
        """Per axis: where the crop starts in the input, and the cut's positions [low, high) the window reaches;
        None where they fall outside the crop."""
        box = []
        for f, size, side, w, s, outputs in zip(cut.fields, self.spatial, cut.crop, self.window, start, cut.size):
            low = max(math.ceil((s - f.start - f.reach) / f.stride), 0)
            high = min((s + w - 1 - f.start) // f.stride + 1, outputs)
            first = max(low * f.stride + f.start, 0)
            crop = min(first // f.stride * f.stride, size - side)
            if max(0, high - 1) * f.stride + f.start + f.reach >= crop + side and crop + side < size:
                return None
            box.append((crop, low, high))
        return box


def _crop_side(field: Field, size: int, window: int) -> int:
    """The crop's side along one axis: the input positions that a window's reached positions read, with a stride's
    slack for the crop's start on the grid; such that every crop start on the grid up to the input's end is a
    multiple of the stride. The whole axis where that is no shorter."""
    need = window + 2 * field.reach + 2 * field.stride
    if need >= size:
        return size
    return size - field.stride * ((size - need) // field.stride)
