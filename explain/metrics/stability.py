"""How much a map moves against how much the model's view of the image moves: the relative input, output and
representation stability (Agarwal et al., "Rethinking stability for attribution-based explanations", 2022) and
continuity (Montavon et al., "Methods for interpreting and understanding deep neural networks", 2018).

The explainer is an explain method or a callable ``explainer(images, classes)`` (see
:mod:`explain.metrics.robustness`); the model is the explainer's own (``explainer.model``) unless given. A copy
whose predicted class differs from the image's is left out of the maximum, as the papers define it over the
copies the model classifies alike (Quantus 0.6.0 returns NaN for the whole image then); NaN where none is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..core.held import in_model_dtype
from ..core.hooks import Hooks
from ..core.layers import resolve_layer
from ..errors import ExplainError
from ..targets import TargetLike
from ..targets.base import read_output
from .robustness import Copies, Explainer, explained_copies, perturbations_of
from .scoring import plain_forwards

View = Literal["input", "output", "representation"]


def _model_of(explainer: Explainer, model: nn.Module | None, metric: str) -> nn.Module:
    """The model whose predictions decide which copies count: the one given, or the explainer's."""
    model = model if model is not None else getattr(explainer, "model", None)
    if not isinstance(model, nn.Module):
        raise ExplainError(f"{metric}: pass model=, the model the explainer explains (a callable explainer has none)")
    return model


def _reads(model: nn.Module, images: Tensor, layer: nn.Module | None, batch_size: int) -> tuple[Tensor, Tensor]:
    """The model's scores of the images, (M, classes), and the layer's output flattened (M, features) (the scores
    again without a layer); forwards without autograd, ``batch_size`` images at a time."""
    scores, kept = [], []
    with Hooks() as hooks, plain_forwards(model):
        if layer is not None:
            hooks.forward(layer, lambda module, args, output: kept.append(read_output(output).flatten(1)))
        for chunk in images.split(batch_size):
            scores.append(read_output(model(in_model_dtype(model, chunk))).flatten(1).float())
    scores_all = torch.cat(scores)
    return scores_all, (torch.cat(kept).float() if layer is not None else scores_all)


def _relative(change: Tensor, before: Tensor, eps: float) -> Tensor:
    """||(before - after) / before||_2 per row, zeros of ``before`` replaced by ``eps`` (the paper's guard);
    ``change`` is ``before - after``, (N, S, features), ``before`` (N, 1, features)."""
    return (change / (before + (before == 0) * eps)).norm(dim=2)


def _kept_max(ratios: Tensor, same: Tensor) -> Tensor:
    """The largest ratio of each image over the copies the model classifies as the image, (N,); NaN for none."""
    return torch.where(same, ratios, torch.full_like(ratios, -torch.inf)).amax(dim=1).nan_to_num(neginf=float("nan"))


def relative_stability(
    explainer: Explainer,
    x: Tensor,
    target: TargetLike = None,
    *,
    relative_to: View = "input",
    model: nn.Module | None = None,
    layer: str | nn.Module | None = None,
    samples: int = 200,
    radius: float = 0.05,
    perturbations: Tensor | None = None,
    seed: int | None = 0,
    eps: float = 1e-6,
    batch_size: int | None = None,
) -> Tensor:
    """Relative stability (Agarwal et al. 2022): the largest, over perturbed copies x' = x + delta (uniform in
    [-radius, radius] per element) that the model classifies as x, of

        ||(e_x - e_x') / e_x||_2 / max(||v(x) - v(x')||, eps)

    where v is the input, relative (RIS: ||(x - x') / x||_2), the model's logits (ROS: ||h(x) - h(x')||_2), or a
    layer's output, relative (RRS: ||(L_x - L_x') / L_x||_2); zeros of a divisor are replaced by ``eps``. Lower is
    better. Quantus 0.6.0 adds ``eps`` to a zero denominator rather than taking the maximum, which differs only
    for denominators below ``eps``.

    Args:
        explainer: An explain method or a callable ``(images, classes) -> maps``.
        x: The images, (N, C, H, W).
        target: What the maps explain: None for each image's top class, a class, or one per image.
        relative_to: ``"input"`` (RIS), ``"output"`` (ROS) or ``"representation"`` (RRS).
        model: The explained model (default: ``explainer.model``).
        layer: RRS's layer, a name or a module of the model.
        samples: Perturbed copies per image.
        radius: The noise's bound, in the input's units.
        perturbations: The noise itself, (N, samples, C, H, W), drawn from ``seed`` when None.
        seed: The noise's seed (None: PyTorch's global generator).
        eps: The guard against division by zero.
        batch_size: Most copies per explainer call and forward (None: as many as the images).

    Returns:
        Each image's relative stability, (N,); NaN where every copy changed the prediction.
    """
    metric = f"relative {relative_to} stability"
    model = _model_of(explainer, model, metric)
    if relative_to not in ("input", "output", "representation") or (relative_to == "representation") != (
        layer is not None
    ):
        raise ExplainError(f"{metric}: relative_to must be 'input', 'output' or 'representation' (with layer=)")
    noise = perturbations_of(x, samples, radius, perturbations, seed, uniform=True)
    copies = x[:, None] + noise
    explained = explained_copies(explainer, x, target, copies, batch_size)
    maps = explained.plain.reshape(len(x), 1, -1)
    numerator = _relative(maps - explained.maps.flatten(2), maps, eps)
    module = resolve_layer(model, layer, x)[1] if layer is not None else None
    denominator, same = _view_moves(model, x, copies, explained, relative_to, module, batch_size or len(x), eps)
    return _kept_max(numerator / denominator.clamp_min(eps), same)


def _view_moves(
    model: nn.Module,
    x: Tensor,
    copies: Tensor,
    explained: Copies,
    relative_to: View,
    layer: nn.Module | None,
    step: int,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """How far each copy (N, S, ...) moves the view of the image (the input or the layer's output relatively,
    the logits absolutely), (N, S), and whether the model classifies the copy as the image, (N, S). The logits are
    the explanations' own where they carry them; the model runs again only for what they lack."""
    scores, copy_scores = explained.logits, explained.copy_logits
    view = copy_view = None
    if scores is None or copy_scores is None or relative_to == "representation":
        scores, view = _reads(model, x, layer, step)
        copy_scores, copy_view = _reads(model, copies.flatten(0, 1), layer, step)
        copy_scores, copy_view = copy_scores.view(*copies.shape[:2], -1), copy_view.view(*copies.shape[:2], -1)
    if relative_to == "output":
        moves = (scores[:, None] - copy_scores).norm(dim=2)
    else:
        before, after = (x.flatten(1), copies.flatten(2)) if relative_to == "input" else (view, copy_view)
        moves = _relative(before[:, None] - after, before[:, None], eps)
    return moves, copy_scores.argmax(dim=2) == scores.argmax(dim=1, keepdim=True)


def relative_input_stability(explainer: Explainer, x: Tensor, target: TargetLike = None, **options: Any) -> Tensor:
    """Relative input stability, RIS (see :func:`relative_stability`)."""
    return relative_stability(explainer, x, target, relative_to="input", **options)


def relative_output_stability(explainer: Explainer, x: Tensor, target: TargetLike = None, **options: Any) -> Tensor:
    """Relative output stability, ROS: against the logits' move (see :func:`relative_stability`)."""
    return relative_stability(explainer, x, target, relative_to="output", **options)


def relative_representation_stability(
    explainer: Explainer, x: Tensor, target: TargetLike = None, *, layer: str | nn.Module, **options: Any
) -> Tensor:
    """Relative representation stability, RRS: against ``layer``'s output's move (see :func:`relative_stability`)."""
    return relative_stability(explainer, x, target, relative_to="representation", layer=layer, **options)


def translations(x: Tensor, shifts: Sequence[int]) -> Tensor:
    """Each image moved sideways by each shift in pixels (right for positive), the space it leaves filled with
    the image's least value, (N, len(shifts), C, H, W)."""
    width = x.shape[-1]
    fill = x.amin(dim=tuple(range(1, x.dim())), keepdim=True).expand_as(x)
    moved = []
    for shift in shifts:
        padded = torch.cat([fill, x, fill], dim=-1)  # the image between two fills of its own width
        start = min(max(width - shift, 0), 2 * width)
        moved.append(padded[..., start : start + width])
    return torch.stack(moved, dim=1)


def _scaled(flat: Tensor) -> Tensor:
    """Absolute maps, flattened on the last axis, each divided by its largest value."""
    flat = flat.abs()
    return flat / flat.amax(dim=-1, keepdim=True).clamp_min(1e-30)


def continuity(
    explainer: Explainer,
    x: Tensor,
    target: TargetLike = None,
    *,
    steps: int = 28,
    model: nn.Module | None = None,
    batch_size: int | None = None,
) -> Tensor:
    """Continuity (Montavon et al. 2018): the largest, over the image translated sideways in ``steps`` equal
    shifts from one side to the other (filled with its least value), of ||R(x) - R(x')||_1 / ||x - x'||_2, the
    maps R absolute and each divided by its largest (Quantus divides the batch by its largest); copies the model
    classifies otherwise than the image are left out. Lower is better.

    The shifts are Quantus': with W the width and dx = (2W + 1) // steps, -W + dx, -W + 2 dx, ..., -W + steps dx
    (Quantus 0.6.0 fails where a shift passes W; here such a copy is all fill).

    Args:
        explainer: An explain method or a callable ``(images, classes) -> maps``.
        x: The images, (N, C, H, W).
        target: What the maps explain: None for each image's top class, a class, or one per image.
        steps: Translations per image.
        model: The explained model (default: ``explainer.model``).
        batch_size: Most copies per explainer call and forward (None: as many as the images).

    Returns:
        Each image's continuity, (N,); NaN where every copy changed the prediction.
    """
    model = _model_of(explainer, model, "continuity")
    width = x.shape[-1]
    dx = (2 * width + 1) // steps
    copies = translations(x, [-width + dx * (k + 1) for k in range(steps)])
    explained = explained_copies(explainer, x, target, copies, batch_size)
    flat = explained.plain.flatten(1)
    change = (_scaled(flat)[:, None] - _scaled(explained.maps.flatten(2))).abs().sum(dim=2)
    distance = (x.flatten(1)[:, None] - copies.flatten(2)).norm(dim=2) + 1e-9
    _, same = _view_moves(model, x, copies, explained, "output", None, batch_size or len(x), 0.0)
    return _kept_max(change / distance, same)
