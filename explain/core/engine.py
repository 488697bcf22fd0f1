"""The CAM engine's method protocol: :class:`CAM`, a method's options, what it needs and its formula.

A method subclasses :class:`CAM` and supplies only its formula: its channel weights (:meth:`CAM.weights`), its
element-wise weighted activations (:meth:`CAM.weighted_activations`), or how they become a map
(:meth:`CAM.combine`); it says what its formula needs from each pass in ``needs`` (:class:`Needs`: gradients at
the layers or at the input, curvature, a whole backward, the input's map, what its passes record: see
:mod:`explain.core.recording`). The passes are the pass runner's
(:mod:`explain.core.runner`); a call (:meth:`CAM.__call__`) checks the input, binds the call's state (its target
and layers, on the runner), and turns the runner's maps into the result. All map arithmetic is batched torch on
the input's device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..catalog import FUSIONS
from ..errors import ExplainError, LayerError, TargetError
from ..targets import BoundTarget, Target, TargetLike, as_target
from .detectors import thresholds_lowered
from .held import held_model, in_model_dtype, refuse_quantized, warn_training
from .layers import LayerSpec
from .layouts import Reshape
from .maps import has_nonzero, normalize_maps, postprocess, principal_projection, upsample
from .model_state import exclusive, modules_of, untouched
from .result import CAMResult, make_result
from .runner import INPUT, Capture, Needs, PassRunner

__all__ = ["CAM", "INPUT", "Capture", "Needs", "check_images", "check_rank"]

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
    the ReLU when ``relu`` is False). It declares what the formula needs from a pass in ``needs``.
    A method that records something else than a layer's output (attention probabilities, block inputs) says
    so (``Needs.layer_outputs``) and overrides :meth:`recorder`, and where it must, :meth:`target_layers`,
    :meth:`layout` and :meth:`layer_gradients`.

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
    title = ""  # what it is, with its paper: its line of the catalog (see explain.catalog), read from here
    fast = True  # one forward and at most one backward per target: part of ``--method all``
    cost: str | None = None  # what makes a call slow, for a method of many passes (the explorer shows it)
    needs = Needs()  # what the formula needs from each pass: by default, the layers' outputs and gradients
    reads_layer = True  # whether the method reads a layer; one that attributes the input alone refuses one
    relu = True
    smooth_statistic = "mean"  # what the passes' maps become: their "mean", mean "square" or "variance" (VarGrad)

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
        if layer is not None and not self.reads_layer:
            raise LayerError(
                f"{self.name} attributes the input and reads no layer; drop layer= (--layer), or use a method that "
                "reads one (lrp, attnlrp and cplrp read the relevance arriving at a layer)"
            )
        self.model = held_model(model)
        self.labels = list(labels) if labels is not None else None
        self.fused = isinstance(layer, (list, tuple))
        if self.fused and not layer:
            raise LayerError("an empty list of layers was given")
        self.requested = None if layer is None else list(layer) if self.fused else [layer]  # None: automatic
        self._layers: list[tuple[str, nn.Module | None]] | None = None  # the last call's, for ``layer``
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
        """Dotted name of the last call's target layer, names joined by ``+`` when fused (None until a call)."""
        return "+".join(name for name, _ in self._layers) if self._layers else None

    @property
    def automatic(self) -> bool:
        """Whether the method's layers are the automatic ones (none asked for), searched by the runner."""
        return self.requested is None and self.needs.records.searched and not self.needs.map_of_input

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
        given, x = x, in_model_dtype(self.model, x)
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
            warn_training(modules_of(self.model))
            runner = PassRunner(self, x, goal, model_kwargs, generator)  # a model changed since is looked up again
            images = x.clone() if x.is_inference() else x.detach()
            try:
                plain = runner.plain_pass(images)
            except LayerError:  # no gradient at the layers: a quantized model's, said as such
                refuse_quantized(self.model, modules_of(self.model))
                raise
            self._layers = runner.layers
            maps = runner.averaged(images, plain)
        size = x.shape[2:]
        fused = self.fused or len(runner.layers) > 1  # the automatic layers of a detector are fused
        raw = self.fused_maps(maps, size) if fused or self.aug_smooth else maps[0]
        cams = self.finish(raw, len(size), size if resize else None, normalize)
        if given.dtype != x.dtype:  # computed in the model's dtype, returned in float32
            cams, raw = cams.float(), raw.float()
        result = make_result(cams, raw, plain.output, plain.scores, plain.bound, self.layer, self.name, x, self.labels)
        return self.completed(result, x, model_kwargs)

    def target_for(self, target: TargetLike, topk: int | None) -> Target | BoundTarget:
        """The call's target object from what the caller gave (see :func:`explain.targets.as_target`); a method
        whose formula is a target of its own (Finer-CAM's contrast) builds it here."""
        return as_target(target, topk)

    def completed(self, result: CAMResult, x: Tensor, model_kwargs: Mapping[str, Any]) -> CAMResult:
        """The call's result, with what a method adds to it from ``x`` (Integrated Gradients' completeness);
        default: as it is."""
        return result

    def fused_maps(self, maps: list[Tensor], size: Sequence[int]) -> Tensor:
        """One map from each layer's: each upsampled to ``size`` and normalized, then their mean, maximum or product.
        For the mean and the maximum, a layer whose maps are all zero (a pyramid level no detection reaches) adds
        zeros without being resized."""
        reached = maps if self.fuse == "product" else [m for m in maps if bool(has_nonzero(m))] or maps[:1]
        stacked = torch.stack([normalize_maps(upsample(m, size), len(size)) for m in reached])
        if self.fuse == "product":
            return stacked.prod(dim=0)
        return stacked.sum(dim=0) / len(maps) if self.fuse == "mean" else stacked.amax(dim=0)
