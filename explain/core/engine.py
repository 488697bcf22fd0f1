"""The CAM engine: one base class that owns hooks, model state, targets, smoothing and post-processing.

A method subclasses :class:`CAM` and supplies only its formula: its channel
weights (:meth:`CAM.weights`), its element-wise weighted activations
(:meth:`CAM.weighted_activations`), or how they become a map (:meth:`CAM.combine`).

One call costs one forward pass plus a backward pass through the part of the
network after the target layer: parameters' gradients are switched off for the
call, so autograd records nothing before the layer and computes no weight
gradient (see :mod:`explain.core.hooks`); there, a sequence model's position-wise layers are differentiated only
at the rows the score reaches (see :mod:`explain.core.rows`). All map arithmetic is batched torch on the input's
device.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..catalog import FUSIONS
from ..errors import ExplainError, LayerError, TargetError
from ..targets import BoundTarget, Target, TargetLike, as_target, bound_on
from ..targets.base import spatial_axes
from .detectors import canvas_recorded, sparse_box_heads, thresholds_lowered
from .hooks import ActivationGradientRecorder, layer_entry
from .layers import BACKBONE, LayerSpec, PendingSearch, auto_layers, pending_search, resolve_layer, settle
from .layouts import Geometry, Layout, Reshape, grids_recorded
from .maps import INTERPOLATION, Canvas, has_nonzero, normalize_maps, postprocess, principal_projection, upsample
from .model_state import exclusive, running, untouched
from .result import CAMResult, make_result
from .rows import reached_rows
from .watch import PassLayouts
from .windows import windowed_heads

INPUTS = "signals (N, C, L), images (N, C, H, W) or volumes and clips (N, C, D, H, W)"


def check_images(x: Any) -> None:
    """Refuse anything but a float batch of inputs with one to three spatial axes (see :data:`INPUTS`), with an
    error that names the problem."""
    if not isinstance(x, Tensor):
        raise ExplainError(f"x must be a tensor of {INPUTS}, got a {type(x).__name__}")
    if not 3 <= x.dim() <= 5:
        raise ExplainError(f"x must be a batch of {INPUTS}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ExplainError(
            f"x must be a floating-point tensor of normalized images, got dtype {x.dtype}; "
            "convert and normalize it as the model expects (ModelSpec.preprocess does it for explain's models)"
        )
    if x.shape[0] == 0:
        raise ExplainError(f"x is an empty batch, shape {tuple(x.shape)}: give at least one image")
    if bool(torch.isfinite(x.detach().sum(dim=tuple(range(1, x.dim())))).all()):  # one pass: no NaN or infinity
        return
    broken = ~torch.isfinite(x.detach()).flatten(1).all(dim=1)  # a sum can also overflow: look at each value
    if bool(broken.any()):
        images = ", ".join(str(i) for i in broken.nonzero()[:, 0].tolist()[:10])
        raise ExplainError(f"x holds NaN or infinite values in image(s) {images}: their maps would be meaningless")


def check_rank(model: nn.Module, x: Tensor) -> None:
    """Refuse a batch of signals (N, C, L) for a model whose first convolution reads images: an image given
    without its batch axis (C, H, W) would otherwise run as three signals.

    Raises:
        ExplainError: The model's first convolution is a 2-D or 3-D one and x has one spatial axis.
    """
    first = next(((name, m) for name, m in model.named_modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    if x.dim() == 3 and first is not None and len(first[1].kernel_size) > 1:
        raise ExplainError(
            f"x has shape {tuple(x.shape)}, a batch of signals (N, C, L), but the model's first convolution "
            f"{first[0]!r} is a {type(first[1]).__name__}, which reads images or volumes: an image needs its batch "
            "axis, x[None]"
        )


def summed_score(bound: BoundTarget, k: int, images: Tensor, output: Any) -> Tensor:
    """The k-th target's score in an output whose row r stands for image ``images[r]``, summed over the rows."""
    return bound.score(output, images)[:, k].sum()


def target_scores(bound: BoundTarget, output: Any, x: Tensor) -> Tensor:
    """The (N, K) scores of a bound target in the output of a pass over the call's N images ``x``."""
    scores = bound.score(output, torch.arange(x.shape[0], device=x.device))
    if scores.shape[0] != x.shape[0]:
        raise TargetError(f"{scores.shape[0]} target scores for a batch of {x.shape[0]} images")
    return scores


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
            like them, for a method that asks for it (``curvature = True``); else None.
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


@dataclass(frozen=True)
class PassRecord:
    """What one pass recorded at every target layer, before any method's formula.

    Attributes:
        x: The images the pass ran on, detached.
        output: The model's output.
        bound: The call's bound target.
        scores: Its (N, K) scores in this pass's output.
        activations: Each layer's output as a map (N, C, h, w), float32 (and the input's, for a method whose map
            is the input's).
        gradients: For each of the K targets, each layer's gradient as a map like its activation (empty maps for
            a method without gradients).
        curvatures: For each of the K targets, each layer's Hessian-vector product H·A as a map (empty maps for a
            method that asks for none).
        layouts: How each layer's output became its map.
        canvas: A detector's canvas (its maps are brought onto the image), or None.
        geometry: The picture the pass's layers saw, and the patch grid.
    """

    x: Tensor
    output: Any
    bound: BoundTarget
    scores: Tensor
    activations: dict[str, Tensor]
    gradients: list[dict[str, Tensor]]
    curvatures: list[dict[str, Tensor]]
    layouts: dict[str, Layout]
    canvas: Canvas | None
    geometry: Geometry


def _laid_out(values: Mapping[str, Tensor], layouts: Mapping[str, Layout]) -> dict[str, Tensor]:
    """Each layer's tensor shaped like its output, as a map (the input's own, which has no layout, as it is)."""
    return {name: layouts[name](value) if name in layouts else value for name, value in values.items()}


AUG_SCALES = (0.9, 1.0, 1.1)
PLAIN_VIEW = (False, 1.0)  # (flip, scale): the input as given
INPUT = "input"  # the layer name of the input, for methods whose map is the input's


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


class CAM:
    """Base class of the class activation map methods.

    Holds the model and the target layer(s), resolved once; each call hooks the
    layers for its own duration only, so the model carries no hook between calls.
    After every call, successful or not, the model has the same ``training`` flags,
    ``requires_grad`` flags, ``.grad`` tensors and buffers as before. In train mode
    the forward runs as in training (BatchNorm uses batch statistics, Dropout
    drops), but running statistics are restored afterwards.

    A subclass supplies its formula by overriding one of :meth:`weights` (channel
    weights), :meth:`weighted_activations` (element-wise weights) or
    :meth:`combine`; the map is ``ReLU(combine(weighted_activations))`` (without
    the ReLU when ``relu`` is False).
    A method that records something else than a layer's output (attention probabilities) also
    overrides :meth:`recorder`, :meth:`target_layers` and :meth:`layout`.

    Args:
        model: A classifier returning (N, classes) scores.
        layer: The target layer: dotted name, module, a list of them (their maps
            are fused), or None for the automatic choice (see
            :func:`explain.core.layers.find_auto_layers`: the last layer that outputs a
            spatial map, or a detector's or segmenter's backbone levels, fused),
            searched once per input signature and kind of target and kept in the model's
            context (see :mod:`explain.core.context`). Names are resolved at each call, so a
            module replaced since is found; an unknown name is an error that lists the layers
            with spatial outputs.
        labels: Class names, to accept a class name as target.
        fuse: How the maps of several layers become one, each upsampled to the
            input and normalized first: ``"mean"``, ``"max"`` or ``"product"`` (RefineCAM's: a position must
            stand out at every layer).
        aug_smooth: Average the maps of the horizontally flipped and unflipped
            input at scales 0.9, 1.0 and 1.1, each mapped back to the input's
            geometry and normalized (six passes). The flips and scales are of the
            image plane, the last two axes: a volume's depth and a clip's time
            are left as they are; a signal has no image plane (an error).
        eigen_smooth: Replace the weighted sum of channels by the first principal
            component of the weighted activations (see :func:`principal_projection`).
        smooth_samples: SmoothGrad-style noise smoothing: average the maps of this
            many noisy copies of the input (0: off). The targets are the plain input's.
        smooth_sigma: The noise's standard deviation, as a fraction of each image's
            value range (max - min).
        batch_size: Most inputs per forward pass for methods that run extra forwards
            (Score-CAM, Ablation-CAM): the bound on their memory.
        seed: Seed of the random numbers (noise, random weights), drawn on the
            input's device; None uses PyTorch's global generator.
        reshape: How the target layers' outputs (and their gradients) become maps
            (N, C, h, w); default: found from the output's shape (channels first or
            last, or transformer tokens on the patch grid: see :mod:`explain.core.layouts`).
    """

    name = "cam"
    needs_gradients = True  # a method that needs no gradient skips the backward pass
    relu = True
    map_of_input = False  # the map comes from the input and its gradient, not from a layer (guided methods)
    input_gradient = False  # the pass takes the target's gradient at the input (guided methods, Saliency)
    curvature = False  # the pass also takes the Hessian-vector product H·A at each layer (ShapleyCAM)
    smooth_statistic = "mean"  # what the passes' maps become: their "mean", mean "square" or "variance" (VarGrad)
    whole_backward = False  # differentiate every module as it ran: a backward rule replaces gradients (LRP), or
    # scores read every token (LeGrad), where differentiating a sequence's reached rows alone only recomputes them

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec | Sequence[str | nn.Module] = None,
        *,
        labels: Sequence[str] | None = None,
        fuse: Literal["mean", "max", "product"] = "mean",
        aug_smooth: bool = False,
        eigen_smooth: bool = False,
        smooth_samples: int = 0,
        smooth_sigma: float = 0.15,
        batch_size: int = 16,
        seed: int | None = None,
        reshape: Reshape | None = None,
    ) -> None:
        if fuse not in FUSIONS:
            raise ExplainError(f"fuse must be one of {', '.join(map(repr, FUSIONS))}, got {fuse!r}")
        if smooth_samples < 0 or smooth_sigma < 0 or batch_size < 1:
            raise ExplainError("smooth_samples and smooth_sigma must be >= 0 and batch_size >= 1")
        self.model = model
        self.labels = list(labels) if labels is not None else None
        self.fused = isinstance(layer, (list, tuple))
        if self.fused and not layer:
            raise LayerError("an empty list of layers was given")
        self._requested = None if layer is None else list(layer) if self.fused else [layer]
        self._layers: list[tuple[str, nn.Module]] | None = None  # resolved at each call, which knows x
        self._automatic = False  # whether the call's layers are the automatic ones, kept in the model's context
        self._search: PendingSearch | None = None  # an automatic layer the call's plain pass settles
        self.fuse = fuse
        self.aug_smooth = aug_smooth
        self.eigen_smooth = eigen_smooth
        self.smooth_samples = smooth_samples
        self.smooth_sigma = smooth_sigma
        self.batch_size = batch_size
        self.seed = seed
        self.reshape = reshape

    @property
    def layer(self) -> str | None:
        """Dotted name of the target layer, names joined by ``+`` when fused (None until found)."""
        return "+".join(name for name, _ in self._layers) if self._layers else None

    def target_layers(
        self, x: Tensor, model_kwargs: Mapping[str, Any], target: TargetLike = None
    ) -> list[tuple[str, nn.Module | None]]:
        """The target layers by name and module: those asked for, or the automatic one for x and the call's
        target (the input, for a method whose map is the input's)."""
        if self.map_of_input:
            return [(INPUT, None)]
        if self._requested is None:
            self._automatic = True
            self._search = pending_search(self.model, x, model_kwargs, target) if self._settles_in_pass() else None
            if self._search is not None:  # the call's own pass records the last candidates and settles it
                modules = dict(self.model.named_modules())
                return [(info.name, modules[layer_entry(info.name)[0]]) for info in self._search.tried]
            return auto_layers(self.model, x, model_kwargs, target, self.labels)
        return [resolve_layer(self.model, spec, x, model_kwargs) for spec in self._requested]

    def recorder(self, modules: Mapping[str, nn.Module]) -> ActivationGradientRecorder:
        """What records the target layers' outputs and gradients in a pass (see :mod:`explain.core.hooks`). A pass
        that settles the automatic layer records its candidates, one computed from another, by tensor hooks."""
        tensor_hook = True if self._search is not None else None
        return ActivationGradientRecorder(modules, tensor_hook=tensor_hook, gradients=self.needs_gradients)

    def weights(self, capture: Capture) -> Tensor:
        """Channel weights (N, C)."""
        raise NotImplementedError(f"{type(self).__name__} defines neither weights() nor weighted_activations()")

    def weighted_activations(self, capture: Capture) -> Tensor:
        """The activations weighted by the method, (N, C, h, w); by default by channel: w_c A_c."""
        weights = self.weights(capture)
        return weights.view(*weights.shape, *(1,) * len(capture.spatial)) * capture.activations

    def combine(self, weighted: Tensor) -> Tensor:
        """The map (N, h, w) from weighted activations: their channel sum, or with
        ``eigen_smooth`` their first principal component."""
        return principal_projection(weighted) if self.eigen_smooth else weighted.sum(dim=1)

    def compute(self, capture: Capture) -> Tensor:
        """The raw map (N, h, w) of one layer and one target."""
        cam = self.combine(self.weighted_activations(capture))
        return torch.relu(cam) if self.relu else cam

    def backward_rule(self, x: Tensor, model_kwargs: Mapping[str, Any]) -> AbstractContextManager[Any]:
        """A context around each pass's forward and backward over ``x`` (with the call's ``model_kwargs``) that
        changes how gradients flow; default none."""
        return nullcontext()

    def finish(self, raw: Tensor, rank: int, size: Sequence[int] | None, normalize: bool) -> Tensor:
        """The result's maps from the raw ones, of ``rank`` spatial axes: upsampled to ``size`` (if given) and
        normalized (if asked)."""
        return postprocess(raw, rank, size, normalize)

    def __call__(
        self,
        x: Tensor,
        target: TargetLike = None,
        *,
        topk: int | None = None,
        resize: bool = True,
        normalize: bool = True,
        model_kwargs: Mapping[str, Any] | None = None,
    ) -> CAMResult:
        """Explain a batch.

        The plain pass (the input as given) binds the target and, for a method with gradients, refuses a layer the
        score does not reach; every other pass (flipped and rescaled views, noisy copies) scores the bound target.

        Args:
            x: Normalized images (N, C, H, W), signals (N, C, L), volumes or clips
                (N, C, D, H, W); a caller's ``no_grad`` or
                ``inference_mode`` does not matter.
            target: What to explain: a target object of :mod:`explain.targets`, its
                shorthand (see :func:`explain.targets.as_target`), or a result's bound ``target``.
            topk: Explain each image's K top classes (``TopK(k)``) instead of one target.
            resize: Upsample the maps to x's spatial size; else keep the feature resolution.
            normalize: Min-max normalize each map to [0, 1]; else keep raw values.
            model_kwargs: Further keyword arguments of the model's forward (a CLIP
                model's text, say), passed unchanged to every forward the call runs,
                the perturbed batches of Score-CAM and Ablation-CAM included; so
                they must not have a per-image batch axis.

        Returns:
            A :class:`CAMResult` whose tensors are on ``x``'s device.
        """
        with exclusive(self.model):  # the layer search and the passes of one call, other threads' calls waiting
            return self._explained(x, target, topk, resize, normalize, model_kwargs)

    def _explained(
        self,
        x: Tensor,
        target: TargetLike,
        topk: int | None,
        resize: bool,
        normalize: bool,
        model_kwargs: Mapping[str, Any] | None,
    ) -> CAMResult:
        """The call's work, under the model's lock: the layers found, the plain pass, the averaged maps."""
        check_images(x)
        check_rank(self.model, x)
        model_kwargs = dict(model_kwargs or {})
        goal = self.target_for(target, topk)
        if self.aug_smooth and isinstance(goal, Target) and goal.geometric:
            raise TargetError(f"aug_smooth flips and rescales the input, which would misplace a {type(goal).__name__}")
        if self.aug_smooth and x.dim() == 3:
            raise ExplainError(
                "aug_smooth flips and rescales the image plane; a signal (N, C, L) has only its time axis: "
                "use smooth_samples instead"
            )
        generator = None if self.seed is None else torch.Generator(device=x.device).manual_seed(self.seed)
        with (
            untouched(self.model),
            thresholds_lowered(self.model, getattr(goal, "least_score", None)),
            torch.inference_mode(False),
            torch.enable_grad(),
        ):
            self._automatic = False
            self._layers = self.target_layers(x, model_kwargs, goal)  # a model changed since is looked up again
            images = x.clone() if x.is_inference() else x.detach()
            plain = self._plain_pass(images, goal, model_kwargs)
            self.fused = self.fused or len(self._layers) > 1  # the automatic layers of a detector are fused
            maps = self._averaged(images, plain, generator, model_kwargs)
        size = x.shape[2:]
        raw = self.fused_maps(maps, size) if self.fused or self.aug_smooth else maps[0]
        cams = self.finish(raw, len(size), size if resize else None, normalize)
        result = make_result(cams, raw, plain.output, plain.scores, plain.bound, self.layer, self.name, x, self.labels)
        return self.completed(result, x, model_kwargs)

    def _plain_pass(self, x: Tensor, goal: Target | BoundTarget, model_kwargs: Mapping[str, Any]) -> PassRecord:
        """The plain pass (see :meth:`_record`). Automatic layers kept from an earlier call that the score no longer
        reaches (the model's forward changed in a way its structure does not show, or this target reaches other
        layers than that call's) are searched again for this call, once; the error stands if the search finds them
        again."""
        try:
            recorded = self._record(x, goal, model_kwargs, plain=True)
        except LayerError:
            if not self._automatic or self._search is not None:
                raise
            layers = auto_layers(self.model, x, model_kwargs, goal, self.labels, fresh=True)
            if [name for name, _ in layers] == [name for name, _ in self._layers]:
                raise
            self._layers = layers
            return self._record(x, goal, model_kwargs, plain=True)
        return recorded if self._search is None else self._settled(recorded, x, goal, model_kwargs)

    def _settles_in_pass(self) -> bool:
        """Whether the plain pass can settle the automatic layer: a method whose pass takes the plain gradient at
        its layers, on a model in eval mode (as the search's own probe runs it)."""
        plain = not (self.curvature or self.whole_backward or self.input_gradient or self.model.training)
        recorded = type(self).recorder is CAM.recorder and type(self).layer_gradients is CAM.layer_gradients
        return self.needs_gradients and plain and recorded

    def _settled(
        self, recorded: PassRecord, x: Tensor, goal: Target | BoundTarget, model_kwargs: Mapping[str, Any]
    ) -> PassRecord:
        """The plain pass at the automatic layer its last candidates' gradients settle (see
        :func:`explain.core.layers.settle`): the first image's, as the search's probe reads them. Where they do
        not settle it, the layer is searched in full and the pass run again."""
        search, self._search = self._search, None
        reached = {name for by_layer in recorded.gradients for name, g in by_layer.items() if has_nonzero(g[0])}
        chosen = settle(self.model, search, reached)
        if chosen is None:
            self._layers = auto_layers(self.model, x, model_kwargs, goal, self.labels, fresh=True)
            return self._record(x, goal, model_kwargs, plain=True)
        self._layers = [(name, module) for name, module in self._layers if name == chosen]

        def kept(values: dict[str, Any]) -> dict[str, Any]:
            return {name: value for name, value in values.items() if name == chosen}

        recorded = replace(
            recorded,
            activations=kept(recorded.activations),
            gradients=[kept(g) for g in recorded.gradients],
            curvatures=[kept(c) for c in recorded.curvatures],
            layouts=kept(recorded.layouts),
        )
        self._check_reached(recorded.gradients, recorded.bound, automatic=True)
        return recorded

    def target_for(self, target: TargetLike, topk: int | None) -> Target | BoundTarget:
        """The call's target object from what the caller gave (see :func:`explain.targets.as_target`); a method
        whose formula is a target of its own (Finer-CAM's contrast) builds it here."""
        return as_target(target, topk)

    def completed(self, result: CAMResult, x: Tensor, model_kwargs: Mapping[str, Any]) -> CAMResult:
        """The call's result, with what a method adds to it from ``x`` (Integrated Gradients' completeness);
        default: as it is."""
        return result

    def _views(self) -> list[tuple[bool, float]]:
        """The (flip, scale) of each view of the input the call averages over: the plain one first."""
        if not self.aug_smooth:
            return [PLAIN_VIEW]
        return [PLAIN_VIEW] + [(flip, s) for s in AUG_SCALES for flip in (False, True) if (flip, s) != PLAIN_VIEW]

    def _averaged(
        self, images: Tensor, plain: PassRecord, generator: torch.Generator | None, model_kwargs: Mapping[str, Any]
    ) -> list[Tensor]:
        """Each layer's (N, K, h, w) maps averaged over the call's passes: the plain pass, its flipped and rescaled
        views (``aug_smooth``), each as ``smooth_samples`` noisy copies (the plain pass then only binds). Averaged
        as ``smooth_statistic`` says: the maps' mean, the mean of their squares, or their variance."""
        total: list[Tensor] = []
        squares: list[Tensor] = []
        passes = 0
        for flip, scale in self._views():
            for _ in range(max(1, self.smooth_samples)):
                if (flip, scale) == PLAIN_VIEW and not self.smooth_samples:
                    recorded = plain
                else:
                    seen = _augment(images, flip, scale)
                    if self.smooth_samples:
                        seen = self._noisy(seen, generator)
                    recorded = self._record(seen, plain.bound, model_kwargs)
                maps = self._maps(recorded, generator, model_kwargs)
                if self.aug_smooth:
                    maps = [_deaugment(m, flip, images.shape[2:]) for m in maps]
                total = maps if not total else [t + m for t, m in zip(total, maps)]
                if self.smooth_statistic != "mean":
                    squares = [m * m for m in maps] if not squares else [q + m * m for q, m in zip(squares, maps)]
                passes += 1
        means = [t / passes for t in total]
        if self.smooth_statistic == "mean":
            return means
        mean_squares = [q / passes for q in squares]
        if self.smooth_statistic == "square":
            return mean_squares
        return [q - m * m for q, m in zip(mean_squares, means)]

    def _noisy(self, x: Tensor, generator: torch.Generator | None) -> Tensor:
        """x plus Gaussian noise of ``smooth_sigma`` times each image's value range."""
        axes = tuple(range(1, x.dim()))
        spread = x.amax(dim=axes, keepdim=True) - x.amin(dim=axes, keepdim=True)
        return x + self.smooth_sigma * spread * torch.randn(x.shape, device=x.device, generator=generator)

    def fused_maps(self, maps: list[Tensor], size: Sequence[int]) -> Tensor:
        """One map from each layer's: each upsampled to ``size`` and normalized, then their mean, maximum or product.
        For the mean and the maximum, a layer whose maps are all zero (a pyramid level no detection reaches) adds
        zeros without being resized."""
        reached = maps if self.fuse == "product" else [m for m in maps if bool(has_nonzero(m))] or maps[:1]
        stacked = torch.stack([normalize_maps(upsample(m, size), len(size)) for m in reached])
        if self.fuse == "product":
            return stacked.prod(dim=0)
        return stacked.sum(dim=0) / len(maps) if self.fuse == "mean" else stacked.amax(dim=0)

    def _record(
        self, x: Tensor, goal: Target | BoundTarget, model_kwargs: Mapping[str, Any], plain: bool = False
    ) -> PassRecord:
        """One forward (and backward) pass over ``x``: the layers' activations and, for each of the K targets, their
        gradients. ``goal`` is bound on the output unless it is bound already. The ``plain`` pass (the input as
        given) refuses, for a method with gradients, layers the score does not reach."""
        hooked = {name: module for name, module in self._layers if module is not None}
        known = PassLayouts(self.model, x, model_kwargs, hooked if self.reshape is None else ())
        recording = self.recorder(hooked)
        if self.input_gradient:  # the whole network is recorded, for the gradient at the input
            x = x.detach().requires_grad_(True)
        with (
            running(self.model),
            torch.enable_grad() if self.needs_gradients or self.input_gradient else torch.no_grad(),
            self.backward_rule(x, model_kwargs),
            canvas_recorded(self.model) as canvases,
            grids_recorded(self.model) as grids,
            self._partial_backward(recording.modules.values(), known.sequences),
            recording as recorder,
        ):
            with known.watched():
                output = recorder.forward(partial(self.model, **model_kwargs), x)
            canvas = canvases[-1] if canvases else None  # a detector's: its maps are brought onto the image
            geometry = Geometry(canvas.size if canvas else tuple(x.shape[2:]), grids[-1] if grids else None)
            bound = bound_on(goal, output, self.labels)
            scores = target_scores(bound, output, x)
            count, images = scores.shape[1], torch.arange(len(x), device=x.device)
            derivatives = [
                self._gradients(recorder, partial(summed_score, bound, k, images), scores[:, k].sum(), x, more)
                for k, more in zip(range(count), [True] * (count - 1) + [False])
            ]
            recorded = recorder.activations
        # Laid out after the pass: a layout its forward could not tell is traced now, without the pass's hooks.
        layouts = {name: self.layout(name, a, geometry, known) for name, a in recorded.items()}
        gradients, curvatures = ([_laid_out(found[i], layouts) for found in derivatives] for i in (0, 1))
        if plain and self.needs_gradients and self._search is None:  # a pending search checks its choice
            self._check_reached(gradients, bound, automatic=self._requested is None)
        activations = {name: layouts[name](a).float() for name, a in recorded.items()}
        if self.map_of_input:
            activations[INPUT] = x.detach().float()
        return PassRecord(
            x.detach(), output, bound, scores, activations, gradients, curvatures, layouts, canvas, geometry
        )

    def _partial_backward(self, hooked: Collection[nn.Module], sequences: set[str] | None) -> ExitStack:
        """The contexts that differentiate parts of the model only where the score reaches (a detector's kept
        boxes, a sequence's reached rows, a YOLO head's windows), around one pass. A method that differentiates
        the gradient again (``curvature``) or that replaces the modules' gradients by rules (``whole_backward``) gets
        none: their recomputed backward is neither differentiable nor ruled."""
        stack = ExitStack()
        if not (self.curvature or self.whole_backward):
            stack.enter_context(sparse_box_heads(self.model))
            stack.enter_context(reached_rows(self.model, skip=hooked, sequences=sequences))
            stack.enter_context(windowed_heads(self.model, skip=hooked))
        return stack

    def _maps(
        self, recorded: PassRecord, generator: torch.Generator | None, model_kwargs: Mapping[str, Any]
    ) -> list[Tensor]:
        """Each layer's (N, K, h, w) maps of one recorded pass: the method's formula per layer and target."""
        canvas, x = recorded.canvas, recorded.x

        def to_input(maps: Tensor) -> Tensor:
            return upsample(canvas.crop(maps) if canvas else maps, x.shape[2:])

        maps, shared = [], {}
        for name, module in self._layers:
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
                    generator=generator,
                    model_kwargs=model_kwargs,
                    shared=shared,
                    layout=recorded.layouts.get(name),
                    geometry=recorded.geometry,
                )
                per_target.append(self.compute(capture))
            stacked = torch.stack(per_target, dim=1)
            maps.append(canvas.crop(stacked) if canvas and module is not None else stacked)
        return maps

    @staticmethod
    def _check_reached(gradients: list[dict[str, Tensor]], bound: BoundTarget, automatic: bool) -> None:
        """Refuse maps of a gradient that is zero everywhere: they would be flat, a confident picture of nothing.
        The message's way out depends on whether the layers are the automatic ones.

        Raises:
            LayerError: For some image and target, the gradient is zero at every position of every layer.
        """
        for k, by_layer in enumerate(gradients):
            zero = torch.stack([g.flatten(1).abs().amax(dim=1) == 0 for g in by_layer.values()]).all(dim=0)
            if bound.valid is not None:
                zero &= bound.valid[:, k]
            if zero.any():
                if automatic and all(layer_entry(name)[0] == BACKBONE for name in by_layer):
                    why = (
                        "The automatic layers leave out a detector's pyramid levels one cell wide, too coarse to map, "
                        "and a detection there reaches none of the others: choose a layer inside the backbone, "
                        "whose maps feed every level (explain --layers)"
                    )
                else:
                    why = (
                        "At the last block of a class-token transformer, say, the head never reads the patch tokens: "
                        "choose an earlier layer (explain --layers)" + ("" if automatic else ", or the automatic one")
                    )
                raise LayerError(
                    f"the target score's gradient is zero at every position of layer(s) {', '.join(by_layer)} "
                    f"(image {int(zero.nonzero()[0])}): the score does not depend on the map there. {why}"
                )

    def layout(self, name: str, activation: Tensor, geometry: Geometry, known: PassLayouts) -> Layout:
        """How a layer's output becomes a map: the caller's ``reshape``, else as the model's context or the pass
        itself tells (see :mod:`explain.core.watch` and :mod:`explain.core.layouts`).

        Raises:
            LayerError: The output is no map of the image.
        """
        if self.reshape is not None:
            return Layout("reshape", reshape=self.reshape)
        return known.layout(name, activation, geometry)

    def layer_gradients(self, recorder: Any, score: Tensor, rescore: Callable[[Any], Tensor]) -> dict[str, Tensor]:
        """The recorded layers' gradients of one target's summed score, by name: by default of ``score`` at every
        layer. ``rescore`` scores another output of the pass's images the same way (LeGrad scores each layer's
        own read-out)."""
        return recorder.backward(score, create_graph=self.curvature)

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
        if self.needs_gradients:
            raw = self.layer_gradients(recorder, score, rescore)
            if self.curvature:
                curved = dict(recorder.curvature(raw))
            found = {name: g.detach() for name, g in raw.items()}
        if self.input_gradient:
            found[INPUT] = torch.autograd.grad(score, x, retain_graph=more or self.needs_gradients)[0]
        return found, curved
