"""Batch export: explain every image of files, folders and globs, and write overlays and a manifest."""

from __future__ import annotations

import json
import os
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from tqdm import tqdm

from . import render
from .catalog import ALL_METHODS
from .errors import ImageLoadError, LayerError, TargetError, first_line
from .image_io import load_image, save_array, save_image, write_atomically
from .inputs import MANIFEST, Input, collect_inputs, mark_output_folder
from .layers import LayerSpec
from .methods import FAST_METHODS, Method, create_method, method_options
from .models import ModelSpec

# Version of the manifest records' fields; 2: one list of explained targets per input, whatever the options.
MANIFEST_SCHEMA = 2


@dataclass(frozen=True)
class _Loaded:
    """An image read and preprocessed, with where its outputs go."""

    item: Input
    image: Image.Image
    tensor: torch.Tensor
    base: Path


@dataclass(frozen=True)
class ExportOptions:
    """What to explain and what to write for each image.

    ``method`` is a name of ``explain.METHODS``, or ``"all"`` for one grid figure per
    image with every fast method; ``method_options`` go to the method (see
    :func:`explain.cam`); under ``"all"`` each method gets those it takes.
    """

    method: str = "gradcam"
    method_options: Mapping[str, Any] = field(default_factory=dict)
    layer: LayerSpec | Sequence[str] = None
    target: int | str | None = None
    topk: int | None = None
    batch_size: int = 16
    alpha: float = 0.5
    colormap: str = "jet"
    fmt: str = "png"
    save_raw: bool = False
    figure: bool = False
    keep_aspect: bool = False


def output_bases(inputs: Sequence[Input], out_dir: Path, files_for: Callable[[Path], list[Path]]) -> list[Path]:
    """Choose where each input's outputs go: ``out_dir / input.relative``.

    A ``-2``, ``-3``... suffix keeps bases apart when two inputs would share one
    (``cats/chelsea.png`` and ``more/chelsea.png`` given as files, or ``a.jpg`` beside
    ``a.png``) and keeps any output from landing on an input file.

    Args:
        inputs: The inputs that have a file.
        out_dir: The output folder.
        files_for: The files written for a base path.
    """
    taken = {item.path.resolve() for item in inputs}
    bases = []
    for item in inputs:
        base, number = out_dir / item.relative, 1
        while any(f.resolve() in taken for f in files_for(base)):
            number += 1
            base = out_dir / item.relative.parent / f"{item.relative.name}-{number}"
        taken.update(f.resolve() for f in files_for(base))
        bases.append(base)
    return bases


def _batches(items: Sequence[Input], size: int) -> Iterator[Sequence[Input]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class _Exporter:
    """Runs one export: loads, explains and writes, one batch at a time."""

    def __init__(self, spec: ModelSpec, out_dir: Path, options: ExportOptions, device: torch.device) -> None:
        self.spec = spec
        self.out_dir = out_dir
        self.options = options
        self.device = device
        names = FAST_METHODS if options.method == ALL_METHODS else [options.method]
        self.methods: dict[str, Method] = {
            name: create_method(name, spec.model, options.layer, labels=spec.labels, **self._options_for(name))
            for name in names
        }
        count = options.topk or 1
        self.tags = [f".{options.method}" + (f".top{k + 1}" if options.topk else "") for k in range(count)]

    def _options_for(self, name: str) -> dict[str, Any]:
        given = dict(self.options.method_options)
        if self.options.method != ALL_METHODS:
            return given
        return {k: v for k, v in given.items() if k in method_options(name)}

    def paths(self, base: Path) -> tuple[list[Path], list[Path], Path | None]:
        """The overlays, figures and raw map written for an output base path."""
        o = self.options
        overlays = [base.with_name(base.name + tag + f".{o.fmt}") for tag in self.tags]
        figures = [base.with_name(base.name + tag + f".figure.{o.fmt}") for tag in self.tags] if o.figure else []
        raw = base.with_name(f"{base.name}.{o.method}.npy") if o.save_raw else None
        return overlays, figures, raw

    def files_for(self, base: Path) -> list[Path]:
        """Every file written for an output base path."""
        overlays, figures, raw = self.paths(base)
        return [*overlays, *figures, *([raw] if raw else [])]

    def record(
        self,
        item: Input,
        error: str | None = None,
        targets: list[dict[str, Any]] | None = None,
        layer: str | None = None,
        raw: str | None = None,
    ) -> dict[str, Any]:
        """An input's manifest record: the same fields whatever the options (see ``MANIFEST_SCHEMA``)."""
        return {
            "schema": MANIFEST_SCHEMA,
            "input": item.name,
            "model": self.spec.name,
            "method": self.options.method,
            "layer": layer,
            "targets": targets,
            "raw": raw,
            "error": error,
        }

    def load(self, item: Input, base: Path) -> _Loaded | dict[str, Any]:
        """Read and preprocess one image; a file that cannot be read gives its error record."""
        try:
            image = load_image(item.path)
        except ImageLoadError as err:
            return self.record(item, str(err))
        return _Loaded(item, image, self.spec.transform(image, self.options.keep_aspect), base)

    def explain(self, group: Sequence[_Loaded]) -> list[Callable[[], dict[str, Any]]]:
        """Explain images of one input size together; returns a job per image that writes its outputs."""
        o = self.options
        x = torch.stack([member.tensor for member in group]).to(self.device)
        results = {}
        for name, method in list(self.methods.items()):
            try:
                results[name] = method(x, o.target, topk=o.topk)
            except LayerError:
                if len(self.methods) == 1:
                    raise
                del self.methods[name]  # a comparison leaves out a method that does not fit the model (CAM)

        first = next(iter(results.values()))

        def per_target(t: torch.Tensor) -> torch.Tensor:  # (N, K, ...) whatever the target
            return (t if first.target.keeps_k else t[:, None]).cpu()

        cams = {name: per_target(result.cams) for name, result in results.items()}
        raws = per_target(first.raw)
        indices, probs = per_target(first.class_indices).tolist(), per_target(first.probabilities).tolist()
        return [
            partial(self.write, member, {n: c[i] for n, c in cams.items()}, raws[i], indices[i], probs[i], first.layer)
            for i, member in enumerate(group)
        ]

    def write(
        self,
        member: _Loaded,
        cams: dict[str, torch.Tensor],
        raw: torch.Tensor,
        indices: list[int],
        probs: list[float],
        layer: str,
    ) -> dict[str, Any]:
        """Render and write one image's outputs (K maps per method); returns its manifest record."""
        o = self.options
        names = [self.spec.labels[c] for c in indices]
        outputs, figures, raw_path = self.paths(member.base)
        try:
            if o.method == ALL_METHODS:
                title = f"{names[0]} ({probs[0]:.1%}), every fast method"
                first_maps = {name: per_method[0] for name, per_method in cams.items()}
                save_image(render.grid(member.image, first_maps, title, o.alpha, o.colormap), outputs[0])
            else:
                (maps,) = cams.values()
                for k, path in enumerate(outputs):
                    save_image(render.picture(member.image, maps[k], o.alpha, o.colormap), path)
                for k, path in enumerate(figures):
                    title = f"{names[k]} ({probs[k]:.1%}), {o.method} at {layer}"
                    save_image(render.figure(member.image, maps[k], title, o.alpha, o.colormap), path)
            if raw_path:
                save_array((raw if o.topk else raw[0]).numpy(), raw_path)
        except OSError as err:
            return self.record(member.item, f"{member.item.name}: cannot write outputs: {first_line(err)}")

        targets = [
            {
                "class_index": index,
                "class_name": name,
                "score": round(prob, 6),
                "output": str(output),
                "figure": str(figures[k]) if figures else None,
            }
            for k, (index, name, prob, output) in enumerate(zip(indices, names, probs, outputs))
        ]
        return self.record(member.item, targets=targets, layer=layer, raw=str(raw_path) if raw_path else None)

    def explain_robustly(self, group: Sequence[_Loaded]) -> list[Callable[[], dict[str, Any]]]:
        """Explain a group; if it fails, explain its images one by one so one bad image costs only itself."""
        try:
            return self.explain(group)
        except (LayerError, TargetError):
            raise
        except RuntimeError as err:
            if len(group) == 1:
                return [partial(self.record, group[0].item, f"{group[0].item.name}: {first_line(err)}")]
        return [job for member in group for job in self.explain_robustly([member])]


def export_heatmaps(
    spec: ModelSpec,
    sources: Sequence[str | Path | Input],
    out_dir: str | Path,
    options: ExportOptions = ExportOptions(),
    device: str | torch.device = "cpu",
    progress: bool = False,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Explain every image found in ``sources`` and write overlays plus ``out_dir/manifest.jsonl``.

    Inputs that cannot be read get a manifest entry with their ``error`` and are
    reported; every other input is still written. Each file is written atomically.
    The output folder is created and marked as such (see :mod:`explain.inputs`) when the
    first outputs are ready, so a run that fails on its first batch writes nothing.

    Args:
        spec: The model and its preprocessing (see :func:`explain.models.load_model`).
        sources: Files, folders (searched recursively) and glob patterns, or the
            inputs :func:`explain.inputs.collect_inputs` found in them.
        out_dir: Output folder.
        options: What to explain and write.
        device: Where to run the model.
        progress: Show a tqdm progress bar on stderr (when stderr is a terminal).
        report: Called with each input's manifest entry as soon as it is done.

    Returns:
        The manifest entries, in input order.
    """
    out_dir = Path(out_dir)
    exporter = _Exporter(spec, out_dir, options, torch.device(device))
    inputs = collect_inputs(sources, exclude=out_dir)
    readable = [item for item in inputs if item.path is not None]
    bases = dict(zip(readable, output_bases(readable, out_dir, exporter.files_for)))
    done: dict[Input, dict[str, Any]] = {}
    writing: deque[tuple[Input, Future[dict[str, Any]]]] = deque()

    def finish(item: Input, record: dict[str, Any]) -> None:
        done[item] = record
        if item.path is not None:  # the bar counts files, not sources that gave none
            bar.update()
        if report:
            report(record)

    def collect(keep: int) -> None:
        """Finish written inputs in order, waiting while more than ``keep`` are pending."""
        while writing and (len(writing) > keep or writing[0][1].done()):
            item, future = writing.popleft()
            finish(item, future.result())

    # Threads decode and encode images (Pillow and zlib release the GIL) while the model runs.
    with (
        tqdm(total=len(readable), unit="img", disable=None if progress else True, file=sys.stderr) as bar,
        ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool,
    ):
        for item in inputs:
            if item.error is not None:
                finish(item, exporter.record(item, item.error))
        for batch in _batches(readable, options.batch_size):
            groups: dict[tuple[int, ...], list[_Loaded]] = {}
            for item, loaded in zip(batch, pool.map(exporter.load, batch, [bases[i] for i in batch])):
                if isinstance(loaded, _Loaded):
                    groups.setdefault(tuple(loaded.tensor.shape), []).append(loaded)
                else:
                    finish(item, loaded)
            for group in groups.values():
                jobs = exporter.explain_robustly(group)
                mark_output_folder(out_dir)
                writing.extend((member.item, pool.submit(job)) for member, job in zip(group, jobs))
            collect(keep=2 * options.batch_size)
        collect(keep=0)
    records = [done[item] for item in inputs]
    text = "".join(json.dumps(record) + "\n" for record in records)
    mark_output_folder(out_dir)
    write_atomically(out_dir / MANIFEST, lambda temp: temp.write_text(text, encoding="utf-8"))
    return records
