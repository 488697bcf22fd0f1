"""How much a map moves when the image barely does: max-sensitivity and avg-sensitivity (Yeh et al.), and the
local Lipschitz estimate (Alvarez-Melis and Jaakkola). The maps of
every perturbed copy of every image are made by the explainer a chunk of ``batch_size`` at a time, each copy
explaining the class the plain image's map explains.

The explainer is an explain method (``explain.GradCAM(model)``, any :class:`explain.CAM`) or any callable
``explainer(images, classes)`` returning one map per image, a tensor or a result with ``.cams``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from ..errors import ExplainError
from ..targets import TargetLike

Explainer = Callable[[Tensor, Any], Any]


def maps_and_classes(found: Any) -> tuple[Tensor, Tensor | None]:
    """An explainer's maps, (N, ...) float, and the classes they explain where it says (a result's)."""
    if isinstance(found, Tensor):
        return found.float(), None
    cams, classes = getattr(found, "cams", None), getattr(found, "class_indices", None)
    if not isinstance(cams, Tensor):
        raise ExplainError(f"the explainer returned {type(found).__name__}: a tensor of maps or a result with .cams")
    if cams.dim() == 4 and cams.shape[1] == 1:  # one target per image, kept on its own axis
        cams = cams[:, 0]
    return cams.float(), classes


def perturbations_of(
    x: Tensor, samples: int, scale: float, given: Tensor | None, seed: int | None, uniform: bool
) -> Tensor:
    """Noise per element, (N, samples, ...): uniform in [-scale, scale] (Yeh et al.'s ball, Captum's default) or
    Gaussian of standard deviation ``scale``; or the perturbations given.

    Raises:
        ExplainError: Given perturbations of another shape.
    """
    if given is None:
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        shape = (len(x), samples, *x.shape[1:])
        drawn = torch.rand(shape, generator=generator) * 2 - 1 if uniform else torch.randn(shape, generator=generator)
        given = drawn * scale
    if given.dim() != x.dim() + 1 or given.shape[0] != len(x) or given.shape[2:] != x.shape[1:]:
        raise ExplainError(f"perturbations must be (N, samples, *x.shape[1:]), got {tuple(given.shape)}")
    return given.to(x.device, x.dtype)


def sensitivity(
    explainer: Explainer,
    x: Tensor,
    target: TargetLike = None,
    *,
    reduce: Literal["max", "mean"] = "max",
    samples: int = 10,
    radius: float = 0.02,
    perturbations: Tensor | None = None,
    relative: bool = False,
    seed: int | None = 0,
    batch_size: int | None = None,
) -> Tensor:
    """Max-sensitivity or avg-sensitivity (Yeh et al., "On the (in)fidelity and sensitivity of explanations",
    NeurIPS 2019): the largest, or the mean, of ||Phi(x + delta) - Phi(x)|| (the Frobenius norm) over ``samples``
    perturbations delta drawn uniformly in the ball of ``radius`` (each element within it). Lower is better.

    Args:
        explainer: An explain method or a callable ``(images, classes) -> maps`` (see the module's docstring).
        x: The images, (N, C, H, W).
        target: What the maps explain: None for each image's top class, a class, or one per image.
        reduce: ``"max"`` (max-sensitivity) or ``"mean"`` (avg-sensitivity).
        samples: Perturbations per image.
        radius: The ball's radius, in the input's units.
        perturbations: The perturbations themselves, (N, samples, C, H, W), drawn from ``seed`` when None.
        relative: Divide by ||Phi(x)|| (Captum's ``sensitivity_max``); the paper's is absolute.
        seed: The perturbations' seed (None: PyTorch's global generator).
        batch_size: Most perturbed copies per explainer call (None: as many as the images, the size the caller
            explains at).

    Returns:
        Each image's sensitivity, (N,).
    """
    noise = perturbations_of(x, samples, radius, perturbations, seed, uniform=True)
    distances, plain = _moves(explainer, x, target, noise, batch_size)
    if relative:
        distances = distances / plain.reshape(len(x), -1).norm(dim=1, keepdim=True)
    return distances.amax(dim=1) if reduce == "max" else distances.mean(dim=1)


class Copies(NamedTuple):
    """The explainer's answers on the images and on their copies.

    Attributes:
        maps: The copies' maps, (N, S, ...).
        plain: The images' maps, (N, ...).
        logits: The model's scores of the images, (N, classes), where the explainer's results carry them (an
            explain method's do), else None.
        copy_logits: The same of the copies, (N, S, classes), or None.
    """

    maps: Tensor
    plain: Tensor
    logits: Tensor | None
    copy_logits: Tensor | None


def _logits(found: Any) -> Tensor | None:
    """The model's scores an explainer's result carries (``.logits``), or None."""
    logits = getattr(found, "logits", None)
    return logits.detach().float().flatten(1) if isinstance(logits, Tensor) else None


def explained_copies(
    explainer: Explainer,
    x: Tensor,
    target: TargetLike,
    copies: Tensor,
    batch_size: int | None,
    found: Any = None,
) -> Copies:
    """The maps of ``copies`` (N, S, C, ...) of the images, (N, S, ...), each copy explaining the class the image's
    map explains, a call of ``batch_size`` copies (None: as many as the images) at a time; the images' maps
    (``found``: the explainer's answer on the images where it is at hand); and the model's scores of both where
    the explainer's results carry them (its forwards' own: no forward more)."""
    found = explainer(x, target) if found is None else found
    plain, classes = maps_and_classes(found)
    count = copies.shape[1]
    repeated = classes if classes is not None else target
    if isinstance(repeated, Tensor) and repeated.dim() >= 1 and len(repeated) == len(x):
        repeated = repeated.reshape(len(x), -1)[:, 0].repeat_interleave(count)
    flat = copies.flatten(0, 1)
    moved, scores = [], []
    for rows in torch.arange(len(flat)).split(batch_size or len(x)):
        chunk_target = repeated[rows] if isinstance(repeated, Tensor) and repeated.dim() == 1 else repeated
        answer = explainer(flat[rows.to(x.device)], chunk_target)
        moved.append(maps_and_classes(answer)[0])
        scores.append(_logits(answer))
    logits = _logits(found)
    copy_logits = (
        None if logits is None or any(s is None for s in scores) else torch.cat(scores).view(len(x), count, -1)
    )
    maps = torch.cat(moved).view(len(x), count, *plain.shape[1:])
    return Copies(maps, plain, logits if copy_logits is not None else None, copy_logits)


def _moves(
    explainer: Explainer, x: Tensor, target: TargetLike, noise: Tensor, batch_size: int | None
) -> tuple[Tensor, Tensor]:
    """How far each perturbed copy's map lies from the image's, ||Phi(x + delta) - Phi(x)|| (N, samples), and the
    images' maps (see :func:`explained_copies`)."""
    moved, plain, _, _ = explained_copies(explainer, x, target, x[:, None] + noise, batch_size)
    return (moved.flatten(2) - plain.reshape(len(x), 1, -1)).norm(dim=2), plain


def local_lipschitz_estimate(
    explainer: Explainer,
    x: Tensor,
    target: TargetLike = None,
    *,
    samples: int = 200,
    noise: float = 0.1,
    perturbations: Tensor | None = None,
    seed: int | None = 0,
    batch_size: int | None = None,
) -> Tensor:
    """The local Lipschitz estimate (Alvarez-Melis and Jaakkola, "On the robustness of interpretability methods",
    2018): max over perturbed copies x' of ||Phi(x) - Phi(x')||_2 / ||x - x'||_2, the copies x' = x + Gaussian noise
    of standard deviation ``noise`` (Quantus' 0.1 and 200 samples). Lower is better.

    Args:
        explainer: An explain method or a callable ``(images, classes) -> maps`` (see the module's docstring).
        x: The images, (N, C, H, W).
        target: What the maps explain: None for each image's top class, a class, or one per image.
        samples: Perturbed copies per image.
        noise: The Gaussian noise's standard deviation, in the input's units.
        perturbations: The noise itself, (N, samples, C, H, W), drawn from ``seed`` when None.
        seed: The noise's seed (None: PyTorch's global generator).
        batch_size: Most copies per explainer call (None: as many as the images).

    Returns:
        Each image's estimate, (N,).
    """
    drawn = perturbations_of(x, samples, noise, perturbations, seed, uniform=False)
    distances, _ = _moves(explainer, x, target, drawn, batch_size)
    return (distances / (drawn.flatten(2).norm(dim=2) + 1e-10)).amax(dim=1)


def max_sensitivity(explainer: Explainer, x: Tensor, target: TargetLike = None, **options: Any) -> Tensor:
    """Max-sensitivity: the largest move of the map over the perturbations (see :func:`sensitivity`)."""
    return sensitivity(explainer, x, target, reduce="max", **options)


def avg_sensitivity(explainer: Explainer, x: Tensor, target: TargetLike = None, **options: Any) -> Tensor:
    """Avg-sensitivity: the mean move of the map over the perturbations (see :func:`sensitivity`)."""
    return sensitivity(explainer, x, target, reduce="mean", **options)
