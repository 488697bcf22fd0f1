"""Find the target layer: by dotted name, by module, or automatically."""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import LayerError, TargetError
from ..targets import BoundTarget, Target, TargetLike, as_target, bound_on
from ..targets.base import read_output
from .context import input_signature, target_kind
from .families import Picture, picture_recorded
from .hooks import Hooks, layer_entry, output_entry, with_entry
from .layouts import Geometry, Layout, find_layout, grid_fits
from .model_state import eval_mode, frozen_parameters, model_context, module_names
from .op_trace import Observed, OpTrace

LayerSpec = str | nn.Module | None


def resolve_layer(
    model: nn.Module, layer: str | nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None = None
) -> tuple[str, nn.Module]:
    """Return the dotted name and the module for ``layer``.

    Args:
        model: The model that holds the layer.
        layer: A dotted name such as ``"layer4"`` or ``"features.28"``, or the module itself;
            ``"backbone.fpn:0"`` names entry ``"0"`` of a module's dict, list or tuple output
            (a feature pyramid's level), checked when the model runs.
        x: An input batch of the model: for an unknown name, one forward of its first
            image finds the layers that could serve instead.
        model_kwargs: Further keyword arguments of the model's forward.

    Raises:
        LayerError: The name is unknown (the message names layers with spatial
            outputs, the closest names first) or the module is not part of ``model``.

    A layer of a wrapped model (``torch.compile``, ``DataParallel``) is found by its name in the model the user
    wrapped, or in the wrapper; the name returned is the one given.
    """
    names = module_names(model)
    if isinstance(layer, nn.Module):
        for name, module in names.items():
            if module is layer:
                return name, module
        raise LayerError(f"the given {type(layer).__name__} module is not a submodule of the model")
    module_name = layer_entry(layer)[0]
    if module_name in names:
        return layer, names[module_name]
    for name in wrapped_names(model, module_name):  # the user's own name for a layer of the model they wrapped
        if name in names:
            return layer, names[name]
    candidates = [info.name for info in candidate_layers(model, x, model_kwargs)]
    close = difflib.get_close_matches(layer, candidates, n=6, cutoff=0.5)
    listed = f"the closest are {', '.join(close)}" if close else f"the last are {', '.join(candidates[-6:])}"
    raise LayerError(
        f"unknown layer {layer!r}; of the {len(candidates)} layers with spatial outputs, {listed} "
        "(all of them: explain --layers, or explain.candidate_layers(model, x))"
    )


COMPILED, PARALLEL = "_orig_mod.", "module."  # torch.compile's prefix, and (Distributed)DataParallel's


def wrapped_names(model: nn.Module, name: str) -> list[str]:
    """The names a layer the user names ``name`` may have in the model explain hooks: a compiled model's name
    (explain hooks the model it compiles, see :func:`explain.core.held.held_model`) without ``_orig_mod.``; a
    layer of the model a ``DataParallel`` or ``DistributedDataParallel`` wraps with the wrapper's ``module.``."""
    found = name.removeprefix(COMPILED) if name.startswith(COMPILED) else name
    prefix = ""
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        prefix, model = prefix + PARALLEL, model.module
    return [found, prefix + found]


def classifier(model: nn.Module) -> tuple[str, nn.Linear]:
    """The model's last linear layer, taken as its classifier, with its dotted name.

    Raises:
        LayerError: The model has no linear layer.
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise LayerError("the model has no linear layer to take as its classifier")
    return linears[-1]


@dataclass(frozen=True)
class LayerInfo:
    """A module of the model and what it gave in one forward pass.

    Attributes:
        name: Its dotted name.
        kind: Its class's name.
        shape: Its output's shape without the batch axis, or None when the output is not a
            tensor with one row per image (a dict, or the proposals of a detector's head).
        calls: How often it ran in the pass (more than once: a shared module).
        map_shape: The output as a map of the input, (C, *spatial), or None when it is none
            (see :mod:`explain.core.layouts`).
        layout: How the output becomes that map, or None.
        start: When the module started, and
        finish: when it finished, on one clock that ticks at every module's start and finish.
        varies: Whether the output changes with the image's content, None where the trace did not check (a
            position embedding, a mask or a
            constant does not).
        head: Whether the output is the model's own output, or the module lies in the head that makes it.
        refusal: Why the output is no map of the image, for an output with a shape that is none.
        alias: For an entry of a dict, list or tuple output, the earlier layer whose output it is, if any.
    """

    name: str
    kind: str
    shape: tuple[int, ...] | None
    calls: int
    map_shape: tuple[int, ...] | None = None
    layout: Layout | None = None
    start: int = 0
    finish: int = 0
    varies: bool = True
    head: bool = False
    refusal: str | None = None
    alias: str | None = None

    @property
    def spatial(self) -> bool:
        """Whether the output is a map of the input (C, *spatial) with more than one position along each axis of
        the image plane (the last two; a signal's one): a clip's map may have one frame."""
        return self.map_shape is not None and min(self.map_shape[1:][-2:]) > 1

    def describe(self) -> str:
        """Its map's shape, C x H x W, with how the output was laid out as a map and why it is no automatic
        choice (a constant, the model's head), where either applies."""
        shape = "x".join(map(str, self.map_shape)) if self.map_shape else "no map"
        notes = [self.layout.describe()] if self.layout is not None and self.layout.kind != "channels_first" else []
        notes += ["constant: no map of the image"] * (self.varies is False) + ["the model's head"] * self.head
        return f"{shape} ({'; '.join(notes)})" if notes else shape

    @property
    def candidate(self) -> bool:
        """Whether a CAM can explain the layer: its output is a map of the image, and it runs once per forward."""
        return self.spatial and self.calls == 1


def _tensors(output: Any, depth: int = 3) -> Iterator[Tensor]:
    """The tensors of a model output: itself, or inside its dicts, lists and tuples (a few levels deep)."""
    if isinstance(output, Tensor):
        yield output
    elif depth and isinstance(output, Mapping):
        for value in output.values():
            yield from _tensors(value, depth - 1)
    elif depth and isinstance(output, (list, tuple)):
        for value in output:
            yield from _tensors(value, depth - 1)


def is_probabilities(value: Tensor) -> bool:
    """Whether a per-image output of two or more axes is non-negative and sums to one over its last axis (its
    first row is checked first: most outputs fail there, at the cost of one row)."""
    if value.dim() < 3 or not value.is_floating_point() or value.numel() == 0:
        return False
    if abs(float(value[(0,) * (value.dim() - 1)].sum()) - 1.0) > 1e-3 or bool(value.amin() < 0):
        return False
    return bool(torch.allclose(value.sum(-1), torch.ones((), dtype=value.dtype, device=value.device), atol=1e-3))


FINGERPRINT_SAMPLES = 256  # values of a layer's output compared exactly between the image and the noise


def _fingerprint(value: Tensor) -> tuple[float, ...]:
    """Numbers that change when the tensor's values do: its sum (accumulated in float64) and a strided sample of
    its values, compared exactly. Cheap next to the forward: no copy of the tensor is made."""
    values = value.detach().reshape(-1)
    sample = values[:: max(1, len(values) // FINGERPRINT_SAMPLES)]
    return float(values.sum(dtype=torch.float64)), *sample.tolist()


OTHER_IMAGE_SEED = 20240229  # the other image the content check runs on: noise, the same every time


class _Recorder:
    """What the trace's module hooks record: each module's start, its outputs' infos and, with ``content``, their
    fingerprints on the image (pass 0) and on noise (pass 1); the operations are watched by :attr:`ops`."""

    def __init__(
        self, x: Tensor, modules: Mapping[str, nn.Module], content: bool, kept: TracedForward | None = None
    ) -> None:
        self.image = x[:1] if kept is None else kept.image
        self.content, self.passes, self.kept = content, 0, kept
        self.ops = OpTrace(partial(grid_fits, size=tuple(x.shape[2:])), rank=x.dim() - 2)
        self.ops.free_modules = {name for name, module in modules.items() if next(module.parameters(), None) is None}
        self.infos: dict[str, LayerInfo] = {}
        self.starts: dict[str, int] = {}
        self.clock = itertools.count()
        self.prints: list[dict[str, tuple[float, ...]]] = [{}, {}]
        self.probabilities: set[str] = set()
        self.reads_image: set[str] = set()

    def started(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A forward pre-hook."""
        self.ops.stack.append(name)
        self.starts.setdefault(name, next(self.clock))
        if any(value is self.image for value in (*args, *kwargs.values())):
            self.reads_image.add(name)

    def finished(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """A forward hook: the output, and each tensor entry of a dict, list or tuple output after it."""
        self.ops.stack.pop()
        if not self.passes:
            self.ops.module_output(name, args, kwargs, output)
        entries: Any = []
        if isinstance(output, Mapping):
            entries = output.items()
        elif isinstance(output, (list, tuple)):
            entries = enumerate(output)
        with self.ops.quiet():
            for key, value in [(None, output), *entries]:
                label = name if key is None else f"{name}:{key}"
                if self.content and isinstance(value, Tensor) and value.is_floating_point():
                    self.prints[self.passes].setdefault(label, _fingerprint(value))
                if not self.passes:
                    self._note(name, type(module).__name__, label, key, value)

    def _note(self, name: str, kind: str, label: str, key: Any, value: Any) -> None:
        """Note one output of the image's pass: a new layer, or one more call of a known one."""
        if label in self.infos:
            self.infos[label] = replace(self.infos[label], calls=self.infos[label].calls + 1)
            return
        if key is not None and not isinstance(value, Tensor):
            return
        per_image = isinstance(value, Tensor) and value.dim() and len(value) == 1  # one row per image
        shape = tuple(value.shape[1:]) if per_image else None
        alias = self.ops.producer(value) if key is not None else None
        self.infos[label] = LayerInfo(
            label, kind, shape, 1, start=self.starts[name], finish=next(self.clock), alias=alias
        )
        if shape is not None:
            if self.kept is not None:
                self.kept.outputs[label] = (value, value._version)
            self.ops.watch(label, value)
            self.ops.produced(label, value)
            if is_probabilities(value.detach()):
                self.probabilities.add(label)

    def varies(self, label: str) -> bool | None:
        """Whether the output changed from the image to the noise; None without the noise pass."""
        return self.prints[0].get(label) != self.prints[1].get(label) if self.content else None


def trace_layers(
    model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None = None, content: bool = True
) -> list[LayerInfo]:
    """Every named module that runs when the model sees x's first image, in the order they finish, each
    tensor entry of a dict, list or tuple output after it as ``"name:key"``, with how its output reads as
    a map of the image (see :func:`explain.core.layouts.find_layout`), whether it varies with the image,
    and whether it lies in the model's head.

    Two forward passes, in eval mode without autograd, with ``model_kwargs`` passed to the model's forward:
    x's first image, whose operations are watched (see :mod:`explain.core.op_trace`), then, with ``content``,
    an image of noise, to tell which outputs depend on the image (else ``varies`` is None). The model is left as
    it was.
    """
    return traced_infos(model, x, model_kwargs, content, None)


@dataclass
class TracedForward:
    """The trace's forward of one image, run with autograd from the image: a call's own pass where its batch is
    that image.

    Attributes:
        image: The image the model saw, which requires grad.
        output: The model's output.
        outputs: Each per-image tensor output by layer name, with its version counter when the module returned it
            (an output the model changed in place afterwards has a later one).
        picture: The forward's canvas and patch grid.
    """

    image: Tensor
    output: Any
    outputs: dict[str, tuple[Tensor, int]]
    picture: Picture


def traced_infos(
    model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None, content: bool, kept: TracedForward | None
) -> list[LayerInfo]:
    """:func:`trace_layers`; with ``kept``, its image's forward runs with autograd and fills ``kept`` (the
    ``layer_in_pass`` speedup's, :func:`explain.core.speedups.settling.traced_forward`)."""
    modules = {name: module for name, module in model.named_modules() if name}
    recorder = _Recorder(x, modules, content, kept)
    image, kwargs = recorder.image, model_kwargs or {}
    with (
        Hooks() as hooks,
        eval_mode(model),
        torch.enable_grad() if kept else torch.no_grad(),  # not inference mode: a tensor the model caches in its
        picture_recorded(model) as picture,  # forward (anchors) stays usable
    ):
        for name, module in modules.items():
            hooks.forward_pre(module, partial(recorder.started, name), with_kwargs=True)
            hooks.forward(module, partial(recorder.finished, name), with_kwargs=True)
        with recorder.ops:
            output = model(image, **kwargs)
        outputs = recorder.ops.returned(list(_tensors(output)))
        if kept is not None:
            kept.output = output
        del output
        geometry = picture.geometry(image)
        recorder.passes = 1
        recorder.ops.stack.clear()
        if content:
            other = torch.randn(image.shape, generator=torch.Generator().manual_seed(OTHER_IMAGE_SEED)).to(image)
            with recorder.ops.quiet():
                model(other, **kwargs)
    if kept is not None:  # the image's forward alone, not the noise's
        kept.picture = Picture(picture.canvases[:1], picture.grids[:1])
    heads = _heads(outputs, recorder.reads_image)
    return [
        _as_map(
            model,
            replace(
                info,
                varies=recorder.varies(info.name),
                head=info.name in outputs or any(_within(layer_entry(info.name)[0], head) for head in heads),
            ),
            geometry,
            recorder.ops.observed,
            info.name in recorder.probabilities,
        )
        for info in recorder.infos.values()
    ]


def _within(name: str, outer: str) -> bool:
    """Whether module ``name`` is ``outer`` or lies inside it."""
    return name == outer or name.startswith(outer + ".")


def _heads(outputs: set[str], reads_image: set[str]) -> set[str]:
    """The modules that make the model's output from features: from each module whose output is a model
    output, up through the enclosing modules that return that same output, as far as one that reads the image
    itself (which holds the whole network, not a head)."""
    producers = {name for name in outputs if layer_entry(name)[1] is None}
    heads = set()
    for name in producers:
        if name in reads_image:
            continue
        head = name
        while "." in head and head.rsplit(".", 1)[0] in producers and head.rsplit(".", 1)[0] not in reads_image:
            head = head.rsplit(".", 1)[0]
        heads.add(head)
    return heads


def _as_map(
    model: nn.Module, info: LayerInfo, geometry: Geometry, observed: Observed, probabilities: bool
) -> LayerInfo:
    """The info with its map shape and layout, where its output is a map of the image, else why it is none."""
    if info.shape is None:
        return info
    try:
        layout = find_layout(model, info.name, info.shape, geometry, observed, probabilities)
    except LayerError as err:
        return replace(info, refusal=str(err))
    return replace(info, map_shape=layout.map_shape(info.shape), layout=layout)


def traced_layers(
    model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None = None, content: bool = False
) -> dict[str, LayerInfo]:
    """:func:`trace_layers` by name, traced once per input signature and kept in the model's context (see
    :mod:`explain.core.context`: a change of the model's structure traces it again); with ``content``, traced again
    where the kept trace did not check which outputs vary with the image."""
    known = model_context(model).traces
    key = input_signature(x, model_kwargs)
    if key not in known or (content and any(info.varies is None for info in known[key].values())):
        known[key] = {info.name: info for info in trace_layers(model, x, model_kwargs, content)}
    return known[key]


def candidate_layers(model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None = None) -> list[LayerInfo]:
    """The layers a CAM can explain at x's input size: modules that run once per forward and
    whose output is a map of the image (see :mod:`explain.core.layouts`) with h, w > 1, in the order
    they finish (two forward passes)."""
    return [info for info in trace_layers(model, x, model_kwargs) if info.candidate]


def layer_choices(
    model: nn.Module, x: Tensor, labels: Sequence[str] | None = None
) -> tuple[list[LayerInfo], list[str]]:
    """The layers a CAM can use at x's input size (see :func:`candidate_layers`) and the names of the automatic
    choice among them (see :func:`find_auto_layers`; none when no layer qualifies), from one trace."""
    infos = list(traced_layers(model, x, content=True).values())
    candidates = [info for info in infos if info.candidate]
    try:
        automatic = choose_auto_layers(model, infos, x, labels=labels)
    except LayerError:
        automatic = []
    return candidates, automatic


BACKBONE = "backbone"  # torchvision's detectors and segmenters: the module whose dict of maps feeds the heads
NOT_AUTOMATIC = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Identity)  # a resampling or an alias of a map


def automatic_key(x: Tensor, model_kwargs: Mapping[str, Any] | None, target: TargetLike) -> Hashable:
    """Where a call's automatic layers are kept in the model's context: its input signature and kind of target."""
    return input_signature(x, model_kwargs), target_kind(as_target(target))


def knows_layers(model: nn.Module, x: Tensor, model_kwargs: Mapping[str, Any] | None, target: TargetLike) -> bool:
    """Whether the model's context holds the automatic layers of a call, or the trace of its input signature."""
    context = model_context(model)
    return automatic_key(x, model_kwargs, target) in context.automatic or input_signature(x, model_kwargs) in (
        context.traces
    )


def auto_layers(
    model: nn.Module,
    x: Tensor,
    model_kwargs: Mapping[str, Any] | None = None,
    target: TargetLike = None,
    labels: Sequence[str] | None = None,
    fresh: bool = False,
) -> list[tuple[str, nn.Module]]:
    """The automatic target layers (see :func:`find_auto_layers`), searched once per input signature and kind of
    target, and kept in the model's context (see :mod:`explain.core.context`); ``fresh`` searches again."""
    known = model_context(model).automatic
    key = automatic_key(x, model_kwargs, target)
    if fresh or key not in known:
        known[key] = find_auto_layers(model, x, model_kwargs, target, labels)
    return [(name, model.get_submodule(layer_entry(name)[0])) for name in known[key]]  # no walk of the whole model


def find_auto_layers(
    model: nn.Module,
    x: Tensor,
    model_kwargs: Mapping[str, Any] | None = None,
    target: TargetLike = None,
    labels: Sequence[str] | None = None,
) -> list[str]:
    """Name the automatic target layers, right by construction:

    - a model that names its feature levels (``model.feature_levels``, a list of layer names: YOLO's neck
      levels in :class:`explain.models.yolo.YoloDetector`): those, to be fused;
    - a model with a ``backbone`` submodule whose output is a dict of maps (torchvision's
      detectors and segmenters: the feature pyramid's levels, or a segmenter's ``out``,
      ``aux``, ``low`` and ``high`` maps): every level, to be fused. A detection's score
      reaches only the level its box or anchor was assigned to, so the other levels'
      maps are zero and the fused map is that level's;
    - any other model: the last layer, in the order of the forward pass, whose output
      (1) is a map of the image (see :mod:`explain.core.layouts`: never attention),
      (2) depends on the image (position embeddings, masks and constants never do): in the probe below, where
      only the image requires grad, its output does (a trace that checked its content also says it varies),
      (3) is neither the model's output nor inside the head that makes it, and
      (4) gets a non-zero gradient of the target's score at some position of its map, as the engine
      hands it on (one probe backward pass on x's first image): in a class-token transformer, the input
      of the last attention, since the head never reads the last block's patch tokens; in a
      HuggingFace model, never an output entry that only copies a tensor for ``output_hidden_states``.
      Adaptive pools and identities are passed over while another layer qualifies. Token towers that run
      side by side to the end on grids of their own (CrossViT's branches) give one layer each, fused.

    Args:
        model: The model.
        x: Its input batch: the search runs on the first image.
        model_kwargs: Further keyword arguments of the model's forward.
        target: The call's target (or its shorthand); a target that cannot be scored on one image is
            replaced by the sum of the model's scores.
        labels: Class names, to resolve a class name as target.

    Raises:
        LayerError: No layer qualifies; the message says which rule ruled the last maps out.
    """
    infos = list(traced_layers(model, x, model_kwargs).values())
    return choose_auto_layers(model, infos, x, model_kwargs, target, labels)


def choose_auto_layers(
    model: nn.Module,
    infos: list[LayerInfo],
    x: Tensor,
    model_kwargs: Mapping[str, Any] | None = None,
    target: TargetLike = None,
    labels: Sequence[str] | None = None,
) -> list[str]:
    """The automatic target layers (see :func:`find_auto_layers`) among a forward pass's traced layers.

    Raises:
        LayerError: No layer qualifies.
    """
    declared = declared_layers(model, infos)
    if declared is not None:
        return declared
    candidates = search_candidates(infos)
    reached = reached_layers(model, x, candidates, model_kwargs, target, labels)
    usable = [info for info in candidates if info.name in reached]
    usable = [info for info in usable if info.alias not in {other.name for other in usable}]  # the module's name
    if not usable:
        raise LayerError(
            f"the target's score reaches none of the {len(candidates)} maps of the image before the model's head "
            f"(the last: {candidates[-1].name}); pass layer= (explain --layers lists the maps)"
        )
    modules = dict(model.named_modules())
    chosen = [info for info in usable if not isinstance(modules[layer_entry(info.name)[0]], NOT_AUTOMATIC)]
    return [info.name for info in _towers(chosen or usable)]


def declares_layers(model: nn.Module) -> bool:
    """Whether the model may declare its automatic layers (see :func:`declared_layers`): its ``feature_levels``, or
    a detector's or segmenter's ``backbone``, whose levels its trace tells."""
    return bool(getattr(model, "feature_levels", None)) or isinstance(getattr(model, BACKBONE, None), nn.Module)


def declared_layers(model: nn.Module, infos: list[LayerInfo]) -> list[str] | None:
    """The automatic layers a model declares (its ``feature_levels``) or a detector's backbone levels (see
    :func:`find_auto_layers`), None for a model whose layer is searched.

    Raises:
        LayerError: No layer outputs a map of the image, or a declared level does not.
    """
    maps = [info for info in infos if info.candidate]
    if not maps:
        raise LayerError("no layer of the model outputs a map of the image (N, C, H, W); pass layer=")
    declared = getattr(model, "feature_levels", None)
    if declared:
        missing = [name for name in declared if name not in {info.name for info in maps}]
        if missing:
            raise LayerError(f"the model's feature_levels {', '.join(missing)} output no map of the image")
        return list(declared)
    levels = [
        info.name for info in maps if layer_entry(info.name)[0] == BACKBONE and layer_entry(info.name)[1] is not None
    ]
    return levels or None


def search_candidates(infos: list[LayerInfo]) -> list[LayerInfo]:
    """The maps of the image the automatic layer is searched among, in forward order: not constant (where the
    trace checked), not the model's head.

    Raises:
        LayerError: None is left.
    """
    candidates = [info for info in infos if info.candidate and info.varies is not False and not info.head]
    if not candidates:
        raise LayerError(
            "every layer whose output is a map of the image is constant (a position embedding, a mask) or part of "
            "the model's head; pass layer= (explain --layers lists the maps)"
        )
    return candidates


def _towers(usable: list[LayerInfo]) -> list[LayerInfo]:
    """The last usable layer, and, where token towers on other grids run beside its own to the end (CrossViT's
    branches), the last usable layer of each of them, in forward order, to be fused. A tower runs beside the
    last grid's layers past the middle of them. A hierarchy's earlier stages end before the last one starts, or
    just after (MViT's skip projection, after its pooling attention), so they are not towers."""
    last = usable[-1]
    if last.layout.kind != "tokens":
        return [last]
    by_grid: dict[tuple[int, ...], list[LayerInfo]] = {}
    for info in usable:
        if info.layout.kind == "tokens":
            by_grid.setdefault(info.layout.grid, []).append(info)
    own = by_grid[last.layout.grid]
    middle = own[len(own) // 2].finish
    ends = [layers[-1] for layers in by_grid.values() if layers[-1].finish >= middle]
    return sorted(ends, key=lambda info: info.finish)


def _probe_score(goal: Target | BoundTarget, output: Any, labels: Sequence[str] | None) -> Tensor:
    """The target's score of the first image in an output, or, where the target cannot score one image
    (one class per image of a larger batch, an output it does not fit), the sum of the model's scores."""
    try:
        bound = bound_on(goal, output, labels)
        return bound.score(output, torch.zeros(1, dtype=torch.long, device=_device(output)))[0].sum()
    except (TargetError, IndexError):
        pass
    try:
        return read_output(output).sum()
    except TargetError:
        return sum((t.sum() for t in _tensors(output) if t.is_floating_point() and t.requires_grad), torch.zeros(()))


def _device(output: Any) -> torch.device:
    return next(_tensors(output), torch.zeros(())).device


def reached_layers(
    model: nn.Module,
    x: Tensor,
    layers: Sequence[LayerInfo],
    model_kwargs: Mapping[str, Any] | None = None,
    target: TargetLike = None,
    labels: Sequence[str] | None = None,
) -> set[str]:
    """The layers, of those given (maps with a layout), at some position of whose map the target's score
    has a non-zero gradient: one forward and one backward pass of x's first image, in eval mode.

    Each layer's output is handed on as a copy, as the engine hands it on, so an output entry the model
    does not read on (a copy kept for ``output_hidden_states``) gets no gradient.
    """
    by_module: dict[str, list[LayerInfo]] = {}
    for info in layers:
        by_module.setdefault(layer_entry(info.name)[0], []).append(info)
    modules = dict(model.named_modules())
    kept: dict[str, Tensor] = {}

    def keep(name: str, module: nn.Module, inputs: Any, output: Any) -> Any:
        for info in by_module[name]:
            key = layer_entry(info.name)[1]
            value = output if key is None else output_entry(output, key, info.name)[1]
            if not isinstance(value, Tensor) or not value.requires_grad:
                continue
            copy = kept[info.name] = value.clone()
            output = copy if key is None else with_entry(output, output_entry(output, key, info.name)[0], copy)
        return output

    goal = as_target(target)
    with (
        eval_mode(model),
        frozen_parameters(model),
        torch.inference_mode(False),
        torch.enable_grad(),
        Hooks() as hooks,
    ):
        image = x[:1].detach().clone().requires_grad_(True)  # a normal tensor, whatever the caller's mode
        for name in by_module:
            hooks.forward(modules[name], partial(keep, name))
        output = model(image, **(model_kwargs or {}))
        score = _probe_score(goal, output, labels)
        if not kept or not score.requires_grad:
            return set()
        gradients = torch.autograd.grad(score, list(kept.values()), allow_unused=True)
    layouts = {info.name: info.layout for info in layers}
    return {
        name
        for name, gradient in zip(kept, gradients)
        if gradient is not None and bool(layouts[name](gradient).ne(0).any())
    }
