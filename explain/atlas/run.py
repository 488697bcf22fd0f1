"""The concept atlas of a folder of images (``explain concepts``): CRAFT's concepts at a layer, their importance for
a class, their best crops and their maps on every image, written as a page, a sheet and a manifest; resumable."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..concepts import TCAV, ConceptBank, Craft, Importance, TCAVResult
from ..concepts.craft import quietly
from ..concepts.ranks import current_ranks
from ..errors import ExplainError
from ..export.ownership import FolderLock
from ..export.run import weights_digest
from ..io.images import load_image
from ..models.spec import ModelSpec
from .shards import Shards

CACHE = "cache"  # the output folder's subfolder of activation and score shards


@dataclass(frozen=True)
class Atlas:
    """A folder's concepts at a layer for a class.

    Attributes:
        names: The images' names.
        images: The images as the model sees them, (N, C, H, W).
        bank: The concepts.
        importance: Their importance for the class.
        maps: Each concept's map on each image, (N, K, H, W), each map scaled to [0, 1].
        target: The class explained: its index and name.
    """

    names: list[str]
    images: Tensor
    bank: ConceptBank
    importance: Importance
    maps: Tensor
    target: tuple[int, str]


@dataclass(frozen=True)
class AtlasOptions:
    """What ``explain concepts`` was asked.

    Attributes:
        target: The class, by name or index; None: the top class of the most images.
        layer: The layer; None: the automatic one.
        concepts: How many concepts.
        crop: The crops' side in input pixels; None: the images whole.
        designs: The Sobol designs per image.
        batch_size: Most images per forward.
        resume: Go on with an earlier run of the folder.
        progress: Show progress bars.
        seed: The Sobol sequence's seed.
    """

    target: str | None = None
    layer: str | None = None
    concepts: int = 10
    crop: int | None = 64
    designs: int = 32
    batch_size: int = 32
    resume: bool = False
    progress: bool = True
    seed: int = 0


def loaded_images(spec: ModelSpec, paths: Sequence[Path]) -> tuple[list[str], Tensor]:
    """The images' names and the batch the model sees, on its device.

    Raises:
        ExplainError: No images, or images of different sizes as the model's input.
    """
    if not paths:
        raise ExplainError("no images to read: give a folder or files of images")
    return [path.name for path in paths], spec.preprocess([load_image(path) for path in paths])


def class_of(spec: ModelSpec, images: Tensor, target: str | None, batch_size: int) -> tuple[int, str]:
    """The class explained: the one named (a name of the model's labels, or an index), else the top class of the
    most images.

    Raises:
        ExplainError: A name the model does not know, or an index out of its range.
    """
    labels = spec.labels
    if target is None:
        with torch.no_grad():
            top = torch.cat([spec.model(part).argmax(dim=1) for part in images.split(batch_size)])
        index = int(top.mode().values)
    elif target.isdigit():
        index = int(target)
    elif target in labels:
        index = labels.index(target)
    else:
        raise ExplainError(f"--target {target!r}: not a class of {spec.name} (give a class name or index)")
    if not 0 <= index < len(labels):
        raise ExplainError(f"--target {target}: {spec.name} has classes 0 to {len(labels) - 1}")
    return index, labels[index]


def concept_atlas(spec: ModelSpec, paths: Sequence[Path], out: Path, options: AtlasOptions) -> Atlas:
    """The atlas of the images, its activations and scores kept in ``out``'s cache as they are computed. Under
``torch.distributed`` (``torchrun``), the ranks split the crops and the images (see :class:`explain.concepts.Craft`)
    and each gets the whole atlas.

    Raises:
        ExplainError: Bad options or images, a folder that holds an earlier atlas without ``resume`` or one of other
            options, or what the concepts refuse (too few crops for the concepts, a layer without channels).
    """
    names, images = loaded_images(spec, paths)
    ranks = current_ranks()
    if (out / CACHE).exists() and not options.resume:
        raise ExplainError(f"{out}: holds an earlier concept atlas; add --resume to go on with it, or give another -o")
    ranks.wait()  # every rank has looked before any writes
    target = class_of(spec, images, options.target, options.batch_size)
    craft = Craft(
        spec.model, options.layer, concepts=options.concepts, crop=options.crop, batch_size=options.batch_size,
        labels=spec.labels,
    )  # fmt: skip
    key = {
        "model": spec.name, "weights": weights_digest(spec.model), "layer": options.layer, "crop": options.crop,
        "batch_size": options.batch_size, "images": names, "size": list(images.shape[1:]),
    }  # fmt: skip
    progress = _bars if options.progress else quietly
    with FolderLock(out, last=ranks.rank == 0):
        bank = craft.fit(images, Shards(out / CACHE / "crops", key), progress)
        scored = {**key, "concepts": options.concepts, "target": target[0], "designs": options.designs,
                  "seed": options.seed}  # fmt: skip
        cache = Shards(out / CACHE / "importance", scored)
        importance = craft.importance(bank, images, target[0], options.designs, options.seed, cache, progress)
    maps = craft.maps(bank, images)
    peak = maps.flatten(2).amax(dim=2).clamp_min(torch.finfo(maps.dtype).tiny)
    return Atlas(names, images, bank, importance, maps / peak[..., None, None], target)


def _bars(steps: Sequence[int], what: str) -> Iterable[int]:
    """A progress bar over the steps."""
    from tqdm.auto import tqdm

    return tqdm(steps, desc=what, unit="batch", leave=False)


def tcav_score(
    spec: ModelSpec,
    images: Sequence[Path],
    concept: Sequence[Path],
    random: Sequence[Path],
    target: str | None,
    layer: str | None,
    *,
    fit: str = "linear",
    runs: int = 10,
    batch_size: int = 32,
) -> tuple[TCAVResult, tuple[int, str]]:
    """A concept's TCAV score for a class over the images, and the class.

    Raises:
        ExplainError: Too few images in a folder, or images the model cannot take together.
    """
    _, x = loaded_images(spec, images)
    _, ours = loaded_images(spec, concept)
    _, theirs = loaded_images(spec, random)
    chosen = class_of(spec, x, target, batch_size)
    found = TCAV(spec.model, layer, fit=fit, runs=runs, batch_size=batch_size, labels=spec.labels)
    return found(x, ours, theirs, chosen[0]), chosen
