"""An export's settings, parsed and checked once at the boundary (the command line or a library call), without
torch: which methods run (:class:`MethodSelection`), how maps are drawn (:class:`RenderOptions`), and the rest
(:class:`ExportOptions`), with the rules that tie them to the model's task."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..catalog import ALL_METHODS, FAST_METHOD_NAMES, check_method, check_metrics
from ..errors import ExplainError
from ..tasks.asked import Asked, Prompt, Reading

if TYPE_CHECKING:
    from ..models import ModelSpec
    from ..models.text_image import TextImageSpec
    from ..tasks.base import Task

LayerChoice = str | Sequence[str] | None  # a dotted name, several (fused), or None: the automatic layer
FORMATS = ("jpg", "png")


@dataclass(frozen=True)
class MethodSelection:
    """The methods an export runs.

    Attributes:
        names: The methods, in the order given (every fast method for the grid).
        grid: Whether they make one comparison grid per image (``"all"``) rather than outputs of their own.
        options: The method options set (``fuse``, ``smooth_samples``, ...; see :class:`explain.CAM`).
    """

    names: tuple[str, ...]
    grid: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, options: Mapping[str, Any] | None = None) -> MethodSelection:
        """A selection from a method's name, several joined by commas, or ``"all"`` (the fast ones in one grid).

        Raises:
            ExplainError: A name that is not a method's (close ones are suggested).
        """
        options = dict(options or {})
        if text == ALL_METHODS:
            return cls(tuple(FAST_METHOD_NAMES), True, options)
        names = tuple(name.strip() for name in text.split(","))
        for name in names:
            check_method(name)
        return cls(names, False, options)

    @property
    def text(self) -> str:
        """The selection as ``--method`` spells it."""
        return ALL_METHODS if self.grid else ",".join(self.names)

    @property
    def written(self) -> list[str]:
        """The methods whose outputs are written apart: each one, or ``"all"`` for the grid."""
        return [ALL_METHODS] if self.grid else list(self.names)

    def layer_for(self, method: str, layer: Any) -> Any:
        """The layer ``method`` gets: a lone method the one given (a method that reads none then refuses it); of
        several, the methods that read a layer."""
        from ..methods import METHODS

        return layer if (not self.grid and len(self.names) == 1) or METHODS[method].reads_layer else None

    def options_for(self, method: str, batch_size: int | None = None) -> dict[str, Any]:
        """The options ``method`` gets: a lone method all of them (one it does not take is then an error); of
        several, each those it takes. ``batch_size`` goes to a method that takes one."""
        from ..methods import method_options

        takes = method_options(method)
        alone = not self.grid and len(self.names) == 1
        given = {k: v for k, v in self.options.items() if alone or k in takes}
        if batch_size is not None and "batch_size" in takes:
            given["batch_size"] = batch_size
        return given


@dataclass(frozen=True)
class RenderOptions:
    """How an export draws and writes each map.

    Attributes:
        fmt: The overlays' and figures' format: ``"jpg"`` or ``"png"``.
        alpha: The heatmap's opacity, in [0, 1].
        colormap: A matplotlib colormap's name.
        figure: Also write a figure (image, heatmap with colour bar, overlay) per target.
        save_raw: Also write the raw maps as ``.npy``.
    """

    fmt: str = "jpg"
    alpha: float = 0.5
    colormap: str = "jet"
    figure: bool = False
    save_raw: bool = False

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ExplainError(f"format must be one of {', '.join(FORMATS)}, got {self.fmt!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ExplainError(f"--alpha must be between 0 and 1, got {self.alpha}")
        import difflib

        import matplotlib

        if self.colormap not in matplotlib.colormaps:
            close = difflib.get_close_matches(self.colormap, list(matplotlib.colormaps), n=3)
            hint = f"; did you mean: {', '.join(close)}" if close else ""
            raise ExplainError(f"unknown colormap {self.colormap!r}{hint}")


@dataclass(frozen=True)
class ExportOptions:
    """What to explain and what to write for each image, checked when made.

    Attributes:
        method: A name of ``explain.METHODS``, several joined by commas (each writes its own outputs and manifest
            records), ``"all"`` for one grid figure per explained target with every fast method, or a
            :class:`MethodSelection`.
        method_options: Options of the methods (see :func:`explain.cam`); under several methods each gets those it
            takes.
        layer: The target layer's dotted name, several (fused), or None for the automatic one.
        target: A class index or name; what is explained follows from the model's task (see
            :meth:`explain.tasks.base.Task.target`).
        topk: A classifier's K top classes instead of one.
        score_threshold: The least score of an explained detection; None: the task's default (a detector takes
            it, any other model refuses it).
        keypoint: A pose model's keypoint (a name such as ``left_wrist``, an index, or ``"all"``) explained for
            each detection instead of its box.
        prompt: A depth estimator's region or a promptable segmenter's prompt.
        batch_size: Images per forward pass, and the perturbed copies per forward of the methods that make them.
        render: How maps are drawn and written.
        keep_aspect: Resize the short side to the input size (True), the whole image (False), or as the model
            does (None).
        metrics: Faithfulness metrics (``explain.catalog.METRIC_NAMES``, or their names joined by commas) measured
            for each image's map, one class per image; a tuple in catalog order once made.
        workers: Processes that load the images (0: threads; None: :func:`explain.export.loading.default_workers`).
        resume: Continue the run whose manifest the output folder holds (its settings must be these).
        overwrite: Start afresh in a folder that holds one (removing the files its manifest names and its
            gallery); with neither, such a folder is refused.
        reading: What a vision-language model reads besides each image: a question, or text prompts.
        methods: The parsed ``method`` and ``method_options`` (set when made).

    Raises:
        ExplainError: A setting out of range, or settings that exclude each other.
    """

    method: str | MethodSelection = "gradcam"
    method_options: Mapping[str, Any] = field(default_factory=dict)
    layer: LayerChoice = None
    target: int | str | None = None
    topk: int | None = None
    score_threshold: float | None = None
    keypoint: str | None = None
    prompt: Prompt = field(default_factory=Prompt)
    batch_size: int = 16
    render: RenderOptions = field(default_factory=RenderOptions)
    keep_aspect: bool | None = None
    metrics: str | Sequence[str] = ()
    workers: int | None = None
    resume: bool = False
    overwrite: bool = False
    reading: Reading = field(default_factory=Reading)
    methods: MethodSelection = field(init=False)

    def __post_init__(self) -> None:
        chosen = self.method
        if not isinstance(chosen, MethodSelection):
            chosen = MethodSelection.parse(chosen, self.method_options)
        object.__setattr__(self, "methods", chosen)
        object.__setattr__(self, "method_options", dict(chosen.options))
        metrics = self.metrics if isinstance(self.metrics, str) else ",".join(self.metrics)
        object.__setattr__(self, "metrics", tuple(check_metrics(metrics)) if metrics else ())
        self._check()

    def _check(self) -> None:
        """The rules that need neither torch nor the model."""
        if self.methods.grid and (self.topk or self.render.figure or self.render.save_raw):
            raise ExplainError(
                "--method all writes one comparison grid per image; drop --topk, --figure and --save-raw"
            )
        if self.metrics and (self.methods.grid or self.topk is not None):
            raise ExplainError("--metrics measures one map per image; drop --method all and --topk")
        if self.keypoint is not None and (self.topk is not None or self.metrics):
            raise ExplainError("--keypoint explains a pose model's keypoints; drop --topk and --metrics")
        if self.topk is not None and self.target is not None:
            raise ExplainError("--topk and --target exclude each other")
        if self.topk is not None and self.topk < 1:
            raise ExplainError("--topk must be at least 1")
        if self.batch_size < 1:
            raise ExplainError("--batch-size must be at least 1")
        if self.score_threshold is not None and not 0.0 <= self.score_threshold <= 1.0:
            raise ExplainError("--score-threshold must be between 0 and 1")
        if self.workers is not None and self.workers < 0:
            raise ExplainError("--workers must be 0 or more")
        if self.resume and self.overwrite:
            raise ExplainError("--resume and --overwrite exclude each other")
        self.reading.check()

    @property
    def asked(self) -> Asked:
        """What is explained, as asked: what a task builds its target from."""
        return Asked(
            self.target, self.topk, self.score_threshold, self.keypoint, self.prompt, self.metrics, self.reading
        )

    def check_task(self, spec: ModelSpec | TextImageSpec) -> Task:
        """The rules that tie the settings to the model's task (see :meth:`explain.tasks.base.Task.check`) and
        input; returns the task.

        Raises:
            ExplainError: An option the model's task does not take (``topk`` or ``metrics`` for a model that is
                not a classifier, a question for one that reads none, ...), ``topk`` above its number of
                classes, or an option its input has no use for.
        """
        from ..tasks.registry import task_of  # the model is loaded: torch is there

        name, reads = spec.name, spec.preprocessing
        task = task_of(spec, self.keypoint)
        task.check(spec, self.asked)
        if self.topk is not None and self.topk > len(spec.labels):
            raise ExplainError(f"--topk {self.topk} exceeds the model's {len(spec.labels)} classes")
        if task.one_method and (self.methods.grid or len(self.methods.names) > 1):
            raise ExplainError(f"{name} is a {task.called or task.name} model: give one --method at a time")
        if getattr(reads, "stride", None) is not None and (self.metrics or self.topk is not None):
            raise ExplainError("--clip-stride explains each video's class over its windows; drop --metrics and --topk")
        if not reads.kind.picture and (self.methods.grid or self.render.figure or self.keep_aspect):
            raise ExplainError(
                f"{name} explains {reads.kind}s: --method all's grid, --figure and --keep-aspect draw or resize "
                f"images; write each method's own {reads.kind} outputs instead"
            )
        if self.keep_aspect and getattr(reads, "input_size", 0) is None:
            raise ExplainError(f"--keep-aspect resizes to a model's input size; {name} reads each image at its own")
        return task
