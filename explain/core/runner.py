"""The pass runner: the passes of one call, run as a method says it needs them (its :class:`Needs`).

A call's runner finds the layers (the automatic one settled in the call's own pass where it can, see
:mod:`explain.core.speedups.settling`), runs the plain pass (the input as given: it binds the target), then
the views and noisy copies a method's smoothing asks for, and hands the method one :class:`Capture` per layer and
target. Around each pass it enters the model's families (:mod:`explain.core.families`: a detector's canvas, a
transformer's patch grid, the backwards spared where the score does not reach), the method's backward rule and
the recorder of the layers. The method holds only its formula (:class:`explain.core.engine.CAM`).

One pass costs one forward plus a backward through the part of the network after the target layer: parameters'
gradients are switched off for the call, so autograd records nothing before the layer and computes no weight
gradient (see :mod:`explain.core.hooks`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import LayerError
from ..targets import BoundTarget, Target, bound_on
from ..targets.base import spatial_axes
from .families import PassScope, partial_backward, picture_recorded
from .hooks import ActivationGradientRecorder
from .layers import auto_layers
from .layouts import Geometry, Layout, Reshape
from .maps import INTERPOLATION, Canvas, covered, normalize_maps, upsample
from .model_state import running
from .passes import PassRecord, check_reached, summed_score, target_scores
from .recording import INPUT, LAYER_OUTPUTS, Recording
from .speedups.in_pass import Pending, Traced, in_pass
from .watch import PassLayouts

AUG_SCALES = (0.9, 1.0, 1.1)
PLAIN_VIEW = (False, 1.0)  # (flip, scale): the input as given


@dataclass(frozen=True)
class Needs:
    """What a method's formula needs from each pass; the runner runs that and no more.

    Attributes:
        gradients: The target's gradient at each layer; without it, a forward records the layers' outputs.
        input_gradient: The target's gradient at the input (guided methods, Saliency).
        curvature: The Hessian-vector product H·A at each layer (ShapleyCAM).
        whole_backward: Every module differentiated as it ran: a backward rule replaces gradients (LRP), or the
            scores read every token (LeGrad); no family spares a part of the backward, which would only recompute
            it.
        map_of_input: The map is the input's, not a layer's (guided methods, pixel attributions).
        records: What its passes record, and where (:mod:`explain.core.recording`): by default the outputs and
            gradients of the layers it names or of the automatic ones.
    """

    gradients: bool = True
    input_gradient: bool = False
    curvature: bool = False
    whole_backward: bool = False
    map_of_input: bool = False
    records: Recording = LAYER_OUTPUTS

    @property
    def spared(self) -> bool:
        """Whether the families may spare part of the backward: not where it is differentiated again
        (``curvature``) or ruled (``whole_backward``)."""
        return not (self.curvature or self.whole_backward)


@dataclass(frozen=True)
class Capture:
    """What one pass recorded at one target layer for one target: a method's input.

    Attributes:
        x: The images the pass ran on (N, 3, H, W).
        activations: The layer's output (N, C, h, w), float32.
        gradients: The target score's gradient with respect to it, or None for a
            method that needs none.
        name: The layer's name: a dotted module name, with ``:entry`` for an entry of a dict or list output.
        module: The layer's module (None for the input).
        scores: The explained score of each image (N,).
        target: The call's bound target.
        k: Which of its K targets per image this capture explains.
        to_input: Brings maps (..., h, w) at the layer's resolution onto the input's
            (H, W): upsampled, and for a detector, its canvas's padding cut off first.
        curvature: The Hessian of the score with respect to the activations times the activations, H·A, shaped
            like them, for a method that asks for it (``Needs.curvature``); else None.
        generator: The call's random number generator (from ``seed``), or None for
            PyTorch's global one.
        model_kwargs: The call's further keyword arguments of the model's forward.
        shared: What a method computes once per pass for all its targets and layers (see :meth:`once`).
        layout: How the layer's output became ``activations`` (None for the input).
        geometry: The picture the pass's layers saw, and the patch grid.
    """

    x: Tensor
    activations: Tensor
    gradients: Tensor | None
    name: str
    module: nn.Module | None
    scores: Tensor
    target: BoundTarget
    k: int
    to_input: Callable[[Tensor], Tensor]
    curvature: Tensor | None
    generator: torch.Generator | None
    model_kwargs: Mapping[str, Any]
    shared: dict[str, Any]
    layout: Layout | None
    geometry: Geometry

    @property
    def spatial(self) -> tuple[int, ...]:
        """The spatial axes of the activations and gradients (N, C, *spatial), which every formula reduces over."""
        return spatial_axes(self.activations)

    def once(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, run at the pass's first capture that asks for ``key`` and shared by the others."""
        if key not in self.shared:
            self.shared[key] = compute()
        return self.shared[key]

    @property
    def classes(self) -> Tensor | None:
        """The explained class of each image (N,), a row of the classifier; None for a target that is not a
        classifier's class."""
        return self.target.classes[:, self.k] if self.target.classifier_rows else None

    def score_rows(self, output: Any, images: Tensor) -> Tensor:
        """The explained score in another forward's output, (rows,); ``images`` is the index (into x) of the
        image each output row stands for."""
        return self.target.score(output, images)[:, self.k]


def _laid_out(values: Mapping[str, Tensor], layouts: Mapping[str, Layout]) -> dict[str, Tensor]:
    """Each layer's tensor shaped like its output, as a map (the input's own, which has no layout, as it is)."""
    return {name: layouts[name](value) if name in layouts else value for name, value in values.items()}


def _augment(x: Tensor, flip: bool, scale: float) -> Tensor:
    """x flipped along its last axis and rescaled along its last two, the image plane: a volume's or a clip's
    first spatial axis (depth or time) is left as it is."""
    if scale != 1.0:
        size = [*x.shape[2:-2], *(round(side * scale) for side in x.shape[-2:])]
        x = F.interpolate(x, size=size, mode=INTERPOLATION[len(size)], align_corners=False)
    return x.flip(-1) if flip else x


def _deaugment(maps: Tensor, flip: bool, size: Sequence[int]) -> Tensor:
    """Bring maps of an augmented pass back to the original geometry (``size``), normalized."""
    maps = upsample(maps, size)
    return normalize_maps(maps.flip(-1) if flip else maps, len(size))


class Method(Protocol):
    """What the runner asks of a method: its options, what it needs (its recording among them), its backward rule
    and its formula (the protocol :class:`explain.core.engine.CAM` implements)."""

    model: nn.Module
    labels: list[str] | None
    needs: Needs
    requested: list[Any] | None
    reshape: Reshape | None
    aug_smooth: bool
    smooth_samples: int
    smooth_sigma: float
    smooth_statistic: str

    @property
    def automatic(self) -> bool:
        """Whether the layers are the automatic ones."""

    def backward_rule(self, x: Tensor, model_kwargs: Mapping[str, Any]) -> AbstractContextManager[Any]:
        """A context around each pass that changes how gradients flow."""

    def compute(self, capture: Capture) -> Tensor:
        """The raw map (N, h, w) of one layer and one target."""


class PassRunner:
    """The passes of one call of a method.

    Args:
        method: The method: what it needs (``needs``), its recorder, rules and formula.
        x: The call's input, whose signature decides the layers.
        goal: The call's target, bound by the plain pass.
        model_kwargs: The model's further keyword arguments.
        generator: The call's random number generator, or None.

    Attributes:
        layers: The call's target layers, by name and module; after the plain pass, the ones its maps are of.
        automatic: Whether they are the automatic ones.
        search: The automatic layer the plain pass settles, or None.
    """

    def __init__(
        self,
        method: Method,
        x: Tensor,
        goal: Target | BoundTarget,
        model_kwargs: Mapping[str, Any],
        generator: torch.Generator | None,
    ) -> None:
        self.method, self.model, self.needs = method, method.model, method.needs
        self.model_kwargs, self.generator, self.goal = model_kwargs, generator, goal
        self.automatic = method.automatic
        self.in_pass: Traced | Pending | None = None
        self.layers: list[tuple[str, nn.Module | None]] = []
        self.decide(x)

    def decide(self, x: Tensor, fresh: bool = False, trace: bool = True) -> None:
        """The one place where a call's layers are decided: those the method names; else the automatic ones,
        remembered from an earlier call of the input's signature and kind of target, or searched (``fresh``:
        searched again, whatever was remembered). A speedup may leave the automatic layer to the call's own pass
        (:func:`explain.core.speedups.in_pass.in_pass`; ``trace`` off: not the trace's own forward)."""
        self.in_pass = in_pass(self, x, trace) if self.automatic and not fresh else None
        if self.in_pass is not None:
            self.layers = list(self.in_pass.layers)
        elif fresh:
            self.layers = auto_layers(self.model, x, self.model_kwargs, self.goal, self.method.labels, fresh=True)
        else:
            self.layers = self.needs.records.layers(self.method, x, self.model_kwargs, self.goal)

    def plain_pass(self, x: Tensor) -> PassRecord:
        """The pass over the input as given (see :meth:`record`); where a speedup settles the automatic layer, the
        pass it runs. Automatic layers kept from an earlier call that the score no longer reaches (the model's
        forward changed in a way its structure does not show, or this target reaches other layers than that
        call's) are searched again for this call, once; the error stands if the search finds them again."""
        if self.in_pass is not None:
            return self.in_pass.plain_pass(self, x)
        try:
            return self.record(x, self.goal, plain=True)
        except LayerError:
            if not self.automatic:
                raise
            remembered = [name for name, _ in self.layers]
            self.decide(x, fresh=True)
            if [name for name, _ in self.layers] == remembered:
                raise
            return self.record(x, self.goal, plain=True)

    def record(self, x: Tensor, goal: Target | BoundTarget, plain: bool = False) -> PassRecord:
        """One forward (and backward) pass over ``x``: the layers' activations and, for each of the K targets, their
        gradients. ``goal`` is bound on the output unless it is bound already. The ``plain`` pass (the input as
        given) refuses, for a method with gradients, layers the score does not reach."""
        method, needs, model_kwargs = self.method, self.needs, self.model_kwargs
        hooked = {name: module for name, module in self.layers if module is not None}
        known = PassLayouts(self.model, x, model_kwargs, hooked if method.reshape is None else ())
        pending = self.in_pass  # a pending search's candidates (see explain.core.speedups.in_pass)
        recording = pending.recorder(self, hooked) if pending is not None else needs.records.recorder(method, hooked)
        if needs.input_gradient:  # the whole network is recorded, for the gradient at the input
            x = x.detach().requires_grad_(True)
        scope = PassScope(recording.modules.values(), known.sequences)
        with (
            running(self.model),
            torch.enable_grad() if needs.gradients or needs.input_gradient else torch.no_grad(),
            method.backward_rule(x, model_kwargs),
            picture_recorded(self.model) as picture,
            partial_backward(self.model, scope) if needs.spared else nullcontext(),
            recording as recorder,
        ):
            with known.watched():
                output = recorder.forward(partial(self.model, **model_kwargs), x)
            bound = bound_on(goal, output, method.labels)
            scores = target_scores(bound, output, x)
            count, images = scores.shape[1], torch.arange(len(x), device=x.device)
            derivatives = [
                self._gradients(recorder, partial(summed_score, bound, k, images), scores[:, k].sum(), x, more)
                for k, more in zip(range(count), [True] * (count - 1) + [False])
            ]
            recorded = recorder.activations
        geometry = picture.geometry(x)
        # Laid out after the pass: a layout its forward could not tell is traced now, without the pass's hooks.
        layouts = {name: needs.records.layout(method, name, a, geometry, known) for name, a in recorded.items()}
        gradients, curvatures = ([_laid_out(found[i], layouts) for found in derivatives] for i in (0, 1))
        if plain and needs.gradients and pending is None:  # a pending search checks its choice
            check_reached(gradients, bound, automatic=method.requested is None)
        activations = {name: layouts[name](a).float() for name, a in recorded.items()}
        if needs.map_of_input:
            activations[INPUT] = x.detach().float()
        return PassRecord(
            x.detach(), output, bound, scores, activations, gradients, curvatures, layouts, picture.canvas, geometry
        )

    def _gradients(
        self,
        recorder: ActivationGradientRecorder,
        rescore: Callable[[Any], Tensor],
        score: Tensor,
        x: Tensor,
        more: bool,
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The gradient of one summed score at each layer, shaped like the layer's output (laid out as a map by the
        caller), and at the input for a method that takes it there; the whole network's graph, which that needs, is
        kept only when ``more`` scores follow. Second: each layer's Hessian-vector product, for a method that asks
        for it (else empty)."""
        found, curved = {}, {}
        if self.needs.gradients:
            raw = recorder.backward(score, create_graph=self.needs.curvature, rescore=rescore)
            if self.needs.curvature:
                curved = dict(recorder.curvature(raw))
            found = {name: g.detach() for name, g in raw.items()}
        if self.needs.input_gradient:
            found[INPUT] = torch.autograd.grad(score, x, retain_graph=more or self.needs.gradients)[0]
        return found, curved

    def views(self) -> list[tuple[bool, float]]:
        """The (flip, scale) of each view of the input the call averages over: the plain one first."""
        if not self.method.aug_smooth:
            return [PLAIN_VIEW]
        return [PLAIN_VIEW] + [(flip, s) for s in AUG_SCALES for flip in (False, True) if (flip, s) != PLAIN_VIEW]

    def averaged(self, images: Tensor, plain: PassRecord) -> list[Tensor]:
        """Each layer's (N, K, h, w) maps averaged over the call's passes: the plain pass, its flipped and rescaled
        views (``aug_smooth``), each as ``smooth_samples`` noisy copies (the plain pass then only binds). Averaged
        as the method's ``smooth_statistic`` says: the maps' mean, the mean of their squares, or their variance."""
        samples, statistic = self.method.smooth_samples, self.method.smooth_statistic
        total: list[Tensor] = []
        squares: list[Tensor] = []
        passes = 0
        for flip, scale in self.views():
            for _ in range(max(1, samples)):
                if (flip, scale) == PLAIN_VIEW and not samples:
                    recorded = plain
                else:
                    seen = _augment(images, flip, scale)
                    recorded = self.record(self._noisy(seen) if samples else seen, plain.bound)
                maps = self.maps(recorded)
                if self.method.aug_smooth:
                    maps = [_deaugment(m, flip, images.shape[2:]) for m in maps]
                total = maps if not total else [t + m for t, m in zip(total, maps)]
                if statistic != "mean":
                    squares = [m * m for m in maps] if not squares else [q + m * m for q, m in zip(squares, maps)]
                passes += 1
        means = [t / passes for t in total]
        if statistic == "mean":
            return means
        mean_squares = [q / passes for q in squares]
        return mean_squares if statistic == "square" else [q - m * m for q, m in zip(mean_squares, means)]

    def _noisy(self, x: Tensor) -> Tensor:
        """x plus Gaussian noise of the method's ``smooth_sigma`` times each image's value range."""
        axes = tuple(range(1, x.dim()))
        spread = x.amax(dim=axes, keepdim=True) - x.amin(dim=axes, keepdim=True)
        noise = torch.randn(x.shape, device=x.device, generator=self.generator)
        return x + self.method.smooth_sigma * spread * noise

    def maps(self, recorded: PassRecord) -> list[Tensor]:
        """Each layer's (N, K, h, w) maps of one recorded pass: the method's formula per layer and target. A layer
        whose module says which canvas its map covers (:func:`explain.core.maps.covered`) is brought onto the image
        through that one, else through the pass's."""
        x = recorded.x
        maps, shared = [], {}
        for name, module in self.layers:
            canvas = covered(module) or recorded.canvas

            def to_input(maps: Tensor, canvas: Canvas | None = canvas) -> Tensor:
                return upsample(canvas.crop(maps) if canvas else maps, x.shape[2:])

            per_target = []
            for k, (gradients, curvatures) in enumerate(zip(recorded.gradients, recorded.curvatures)):
                gradient, curvature = gradients.get(name), curvatures.get(name)
                capture = Capture(
                    x=x,
                    activations=recorded.activations[name],
                    gradients=None if gradient is None else gradient.float(),
                    name=name,
                    module=module,
                    scores=recorded.scores[:, k].detach(),
                    target=recorded.bound,
                    k=k,
                    to_input=to_input,
                    curvature=None if curvature is None else curvature.float(),
                    generator=self.generator,
                    model_kwargs=self.model_kwargs,
                    shared=shared,
                    layout=recorded.layouts.get(name),
                    geometry=recorded.geometry,
                )
                per_target.append(self.method.compute(capture))
            stacked = torch.stack(per_target, dim=1)
            maps.append(canvas.crop(stacked) if canvas and module is not None else stacked)
        return maps
