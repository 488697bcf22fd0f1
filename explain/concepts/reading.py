"""A layer read and rewritten through the engine: its output laid out as maps (N, C, *grid) in the engine's own
pass (the layer named, or the automatic one; a ViT's patch tokens on their grid), and the model run again with
that output replaced, to score what a change of the layer's features does to a target."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..core.engine import CAM, Needs, check_images
from ..core.held import held_model, in_model_dtype
from ..core.hooks import Hooks, layer_entry
from ..core.layers import LayerSpec
from ..core.layouts import Layout
from ..core.model_state import exclusive, running, untouched
from ..core.runner import PassRunner
from ..core.speedups import enabled
from ..core.speedups.tails import CHECKED, shared_prefix, shared_rows
from ..errors import LayerError
from ..targets import BoundTarget, Target, TargetLike, as_target


class _LayerOutputs(CAM):
    """The engine's pass at one layer, recording its output alone (no formula: concepts read the activations)."""

    name = "layer-outputs"
    needs = Needs(gradients=False)


class _LayerGradients(CAM):
    """The engine's pass at one layer, recording its output and the target's gradient there."""

    name = "layer-gradients"


class Unscored(Target):
    """No target: a pass that reads a layer's outputs alone scores nothing (a detector's crops hold no detection to
    explain, a classifier's no class)."""

    def bind(self, output: Any, labels: Sequence[str] | None) -> BoundTarget:
        return BoundTarget(score=lambda out, images: torch.zeros(len(images), 1, device=images.device))


UNSCORED = Unscored()


def _readers(model: nn.Module, layer: LayerSpec, labels: Sequence[str] | None) -> dict[bool, CAM]:
    """The passes a reader runs, by whether they take the gradient."""
    return {False: _LayerOutputs(model, layer, labels=labels), True: _LayerGradients(model, layer, labels=labels)}


@dataclass(frozen=True)
class Reading:
    """One batch read at a layer.

    Attributes:
        activations: The layer's output as maps (N, C, *grid), float32.
        layer: The layer's name.
        module: The layer's module.
        layout: How its output became the maps (and how maps become its output again, :meth:`Layout.placed`).
        bound: The target bound on the batch's output.
        scores: The target's score of each image, (N,).
        gradients: The score's gradient at the layer, laid out as the activations, or None where not asked.
    """

    activations: Tensor
    layer: str
    module: nn.Module
    layout: Layout
    bound: BoundTarget
    scores: Tensor
    gradients: Tensor | None = None


class LayerReader:
    """Reads one layer of a model through the engine's pass, and reruns the model with that layer's output
    replaced.

    Args:
        model: Any model explain explains.
        layer: The layer: a name, a module, or None for the automatic one (found on the first batch read).
        labels: Class names, to accept a class name as target.
        model_kwargs: Further keyword arguments of the model's forward.
    """

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        labels: Sequence[str] | None = None,
        model_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(layer, (list, tuple)):
            raise LayerError("concepts are found at one layer; give one layer, not a list")
        self.model, self.labels, self.model_kwargs = held_model(model), labels, dict(model_kwargs or {})
        self._methods = _readers(self.model, layer, labels)
        self._shares: dict[str, bool] = {}  # by layer: whether copies of an image were checked to share its prefix

    def read(self, x: Tensor, target: TargetLike = UNSCORED, gradients: bool = False) -> Reading:
        """The layer's output for a batch x, and the target bound on the batch's output (none by default, except
        the top class while the automatic layer is searched; None: the top class); with ``gradients``, the target
        score's gradient at the layer too.

        Raises:
            LayerError: The layer's output is no map of the input, or the automatic layers are several (a detector's
                levels): name one.
        """
        check_images(x)
        x = in_model_dtype(self.model, x)
        method = self._methods[gradients]
        searched = target is UNSCORED and method.requested is None  # the automatic layer is searched for a score
        goal = as_target(None if searched else target)
        with exclusive(self.model), untouched(self.model), torch.inference_mode(False):
            runner = PassRunner(method, x, goal, self.model_kwargs, None)
            recorded = runner.plain_pass(x.detach())
            if len(runner.layers) != 1:
                raise LayerError(
                    f"concepts are found at one layer, and the automatic layers are {len(runner.layers)}: name one "
                    "(explain --layers lists them)"
                )
        name, module = runner.layers[0]
        if layer_entry(name)[1] is not None:
            raise LayerError(f"layer {name!r} is an entry of a module's output, which concepts cannot replace")
        if method.requested is None:  # the automatic layer, found once, is kept for the next batches
            self._methods = _readers(self.model, module, self.labels)
        found = recorded.gradients[0][name].float() if gradients else None
        return Reading(
            recorded.activations[name], name, module, recorded.layouts[name], recorded.bound, recorded.scores[:, 0],
            found,
        )  # fmt: skip

    def rescored(self, x: Tensor, reading: Reading, maps: Tensor, images: Tensor, batch_size: int) -> Tensor:
        """The bound target's score with the layer's output replaced by ``maps`` (B, C, *grid): row r runs image
        ``images[r]`` of ``x``, its layer output replaced by ``maps[r]``; in batches of ``batch_size``. (B,) Copies
        of one image share their forward up to the layer where they can (the ``tails`` speedup), checked once per
        layer."""
        score = partial(self._scored, in_model_dtype(self.model, x), reading)
        with exclusive(self.model), untouched(self.model), torch.inference_mode(False), torch.no_grad():
            found = None
            if enabled("tails") and self._shares.get(reading.layer, True):
                rows = shared_rows(batch_size, x, maps)
                found = shared_prefix(score, maps, images, rows, checked=self._shares.get(reading.layer, False))
                if found is None and len(images) > CHECKED and bool((images == images[0]).all()):
                    self._shares[reading.layer] = False  # checked, and not shared: every later copy runs whole
            if found is None:
                starts = range(0, len(maps), batch_size)
                return torch.cat([score(maps[s : s + batch_size], images[s : s + batch_size], False) for s in starts])
        self._shares[reading.layer] = found[1]
        return found[0]

    def _scored(self, x: Tensor, reading: Reading, maps: Tensor, images: Tensor, once: bool) -> Tensor:
        """The rows' scores with the layer's output replaced by ``maps``; ``once``: the first row's image run once
        (see :data:`explain.core.speedups.tails.Score`)."""
        with _replaced(reading.module, reading.layout, maps), running(self.model):
            output = self.model(x[images[:1]] if once else x[images], **self.model_kwargs)
            return reading.bound.score(output, images)[:, 0].float()


@contextmanager
def _replaced(module: nn.Module, layout: Layout, maps: Tensor) -> Iterator[None]:
    """For the block, the module's output replaced by ``maps`` laid out as its output."""

    def replace(module: nn.Module, inputs: Any, output: Any) -> Tensor:
        if not isinstance(output, Tensor):
            raise LayerError(f"the layer returns a {type(output).__name__}, which concepts cannot replace")
        return layout.placed(output, maps.to(output.dtype))

    with Hooks() as hooks:
        hooks.forward(module, replace)
        yield
