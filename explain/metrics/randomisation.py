"""Randomisation checks beyond Adebayo's cascading test (:mod:`explain.metrics.sanity`): the model parameter
randomisation test layer by layer as Quantus runs it (MPRT), its smooth and efficient variants (sMPRT, eMPRT;
Hedström et al., "Sanity checks revisited: an exploration to repair the model parameter randomisation test",
2023), and the random logit test (Sixt et al., "When explanations lie: why many modified BP attributions fail",
ICML 2020).

The randomized models are deep copies: the user's model is never changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..core.result import CAMResult
from ..errors import ExplainError
from ..targets import TargetLike
from .robustness import Explainer, explained_copies, maps_and_classes
from .sanity import Randomization, SanityResult, compared, randomized_maps
from .similarity import spearman, ssim

Order = Literal["top_down", "bottom_up", "independent"]


def resettable_modules(model: nn.Module, order: Order = "top_down") -> list[str]:
    """The names of the model's submodules with a ``reset_parameters`` (its layers, as Quantus randomizes them), in
    the order they are registered (``"bottom_up"``, ``"independent"``) or reversed (``"top_down"``)."""
    names = [name for name, module in model.named_modules() if name and hasattr(module, "reset_parameters")]
    return names[::-1] if order == "top_down" else names


def _randomization(model: nn.Module, order: Order, seed: int) -> Randomization:
    """Every resettable layer in ``order``, each re-initialized from ``seed + 1`` (Quantus' seeding)."""
    if order not in ("top_down", "bottom_up", "independent"):
        raise ExplainError(f"order must be 'top_down', 'bottom_up' or 'independent', got {order!r}")
    layers = resettable_modules(model, order)
    return Randomization(layers, [seed + 1] * len(layers), cascading=order != "independent")


def mprt(
    model: nn.Module,
    x: Tensor,
    method: str = "gradcam",
    target: TargetLike = None,
    *,
    layer: Any = None,
    order: Order = "top_down",
    seed: int = 42,
    depths: Sequence[int] | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> SanityResult:
    """The model parameter randomisation test (Adebayo et al. 2018) layer by layer: every layer with a
    ``reset_parameters`` re-initialized in turn, from the output down (``"top_down"``, cascading), from the input
    up (``"bottom_up"``), or each alone (``"independent"``); at each, the method's maps compared with the trained
    model's by Spearman's correlation and SSIM of the absolute maps. Lower similarity is better.

    Args:
        model: The trained model; left as it was.
        x: Normalized images (N, C, H, W).
        method: A method's name (``explain.METHODS``).
        target: What to explain, bound on the trained model; the randomized models explain the same classes.
        layer: The method's layer(s) as for :func:`explain.cam`.
        order: Which layers are random at each depth (see above).
        seed: Each layer is re-initialized from ``seed + 1`` (Quantus' seeding).
        depths: The depths compared (default every one).
        model_kwargs: Further keyword arguments of the model's forward.
        **options: The method's options.

    Returns:
        The comparisons per depth; ``blocks`` names the layers in order (with ``"independent"``, depth d has only
        ``blocks[d - 1]`` random).
    """
    randomization = _randomization(model, order, seed)
    trained, wanted, results = randomized_maps(
        model, x, method, target, layer=layer, randomization=randomization, depths=depths,
        model_kwargs=model_kwargs, options=options,
    )  # fmt: skip
    return compared(x, trained, randomization.blocks, wanted, results)


def smprt(
    model: nn.Module,
    x: Tensor,
    method: str = "gradcam",
    target: TargetLike = None,
    *,
    layer: Any = None,
    order: Order = "bottom_up",
    seed: int = 42,
    samples: int = 50,
    noise: float = 0.1,
    perturbations: Tensor | None = None,
    noise_seed: int | None = 0,
    batch_size: int | None = None,
    depths: Sequence[int] | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> SanityResult:
    """Smooth MPRT (Hedström et al. 2023): :func:`mprt` with each map the mean of the method's maps of the image
    and of ``samples - 1`` noisy copies (Gaussian of standard deviation ``noise`` times the image's range), which
    takes the noise out of the comparison. The same copies serve the trained and every randomized model.

    Args:
        model: The trained model; left as it was.
        x: Normalized images (N, C, H, W).
        method: A method's name (``explain.METHODS``).
        target: What to explain, bound on the trained model.
        layer: The method's layer(s).
        order: Which layers are random at each depth (see :func:`mprt`; the paper's ``"bottom_up"``).
        seed: Each layer is re-initialized from ``seed + 1``.
        samples: Maps averaged per image, the image's own among them.
        noise: The noise's standard deviation over each image's range (max - min).
        perturbations: The noise itself, (N, samples - 1, C, H, W), drawn from ``noise_seed`` when None.
        noise_seed: The noise's seed (None: PyTorch's global generator).
        batch_size: Most noisy copies per call (None: as many as the images).
        depths: The depths compared (default every one).
        model_kwargs: Further keyword arguments of the model's forward.
        **options: The method's options.

    Returns:
        The comparisons of the smoothed maps per depth.
    """
    copies = x[:, None] + _smoothing_noise(x, samples, noise, perturbations, noise_seed)

    def smoothed(run: Any, images: Tensor, goal: Any, kwargs: Mapping[str, Any] | None) -> CAMResult:
        found = run(images, goal, model_kwargs=kwargs)
        moved, plain, _, _ = explained_copies(
            lambda inputs, classes: run(inputs, classes, model_kwargs=kwargs), images, goal, copies, batch_size, found
        )
        mean = (moved.sum(dim=1) + plain) / (moved.shape[1] + 1)
        return dataclasses.replace(found, cams=mean.view(found.cams.shape))

    randomization = _randomization(model, order, seed)
    trained, wanted, results = randomized_maps(
        model, x, method, target, layer=layer, randomization=randomization, depths=depths,
        model_kwargs=model_kwargs, options=options, maps_of=smoothed,
    )  # fmt: skip
    return compared(x, trained, randomization.blocks, wanted, results)


def _smoothing_noise(x: Tensor, samples: int, noise: float, given: Tensor | None, seed: int | None) -> Tensor:
    """sMPRT's noise, (N, samples - 1, ...): Gaussian of standard deviation ``noise`` times each image's range
    (max - min), drawn from ``seed``, or the noise given."""
    if given is None:
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        drawn = torch.randn((len(x), samples - 1, *x.shape[1:]), generator=generator).to(x.device, x.dtype)
        spread = (x.flatten(1).amax(dim=1) - x.flatten(1).amin(dim=1)).view(-1, 1, *[1] * (x.dim() - 1))
        return drawn * noise * spread
    return given.to(x.device, x.dtype)


def histogram_entropy(maps: Tensor, bins: int = 100) -> Tensor:
    """The discrete entropy (nats) of each map's histogram of ``bins`` equal bins over its own range, (N,)."""
    flat = maps.detach().double().flatten(1)
    low, high = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
    width = torch.where(high > low, high - low, torch.ones_like(high))
    index = ((flat - low) / width * bins).floor().long().clamp_(0, bins - 1)
    counts = torch.zeros(len(flat), bins, dtype=torch.float64, device=flat.device).scatter_add_(
        1, index, torch.ones_like(flat)
    )
    p = counts / counts.sum(dim=1, keepdim=True)
    return -(p * p.clamp_min(1e-300).log()).sum(dim=1).float()


def emprt(
    model: nn.Module,
    x: Tensor,
    method: str = "gradcam",
    target: TargetLike = None,
    *,
    layer: Any = None,
    seed: int = 42,
    bins: int = 100,
    model_kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> Tensor:
    """Efficient MPRT (Hedström et al. 2023): the relative rise of the map's complexity, (H(e') - H(e)) / H(e),
    from the trained model to the fully randomized one (every resettable layer re-initialized from ``seed + 1``),
    H the discrete entropy of the map's histogram of ``bins`` bins (Quantus' ``discrete_entropy``). Higher is
    better: a map that explains the model turns to noise with it.

    Args:
        model: The trained model; left as it was.
        x: Normalized images (N, C, H, W).
        method: A method's name (``explain.METHODS``).
        target: What to explain, bound on the trained model.
        layer: The method's layer(s).
        seed: Each layer is re-initialized from ``seed + 1``.
        bins: The histogram's bins.
        model_kwargs: Further keyword arguments of the model's forward.
        **options: The method's options.

    Returns:
        Each image's relative rise in complexity, (N,).
    """
    randomization = _randomization(model, "bottom_up", seed)
    trained, _, (randomized,) = randomized_maps(
        model, x, method, target, layer=layer, randomization=randomization,
        depths=[len(randomization.blocks)], model_kwargs=model_kwargs, options=options,
    )  # fmt: skip
    before, after = histogram_entropy(trained.cams, bins), histogram_entropy(randomized.cams, bins)
    return (after - before) / before


Similarity = Literal["ssim", "ssim_flat", "spearman"]


def _similarity(a: Tensor, b: Tensor, similarity: Similarity) -> Tensor:
    """How alike two batches of maps are: SSIM with scikit-image's window (7, uniform) and the pair's data range,
    on the maps or on them flattened (Quantus'), or Spearman's correlation."""
    if similarity == "spearman":
        return spearman(a, b)
    if similarity not in ("ssim", "ssim_flat"):
        raise ExplainError(f"similarity must be 'ssim', 'ssim_flat' or 'spearman', got {similarity!r}")
    if similarity == "ssim_flat":
        a, b = a.flatten(1), b.flatten(1)
    both = torch.cat([a.flatten(1), b.flatten(1)], dim=1)
    return ssim(a, b, window=7, sigma=None, data_range=both.amax(dim=1) - both.amin(dim=1))


def random_logit(
    explainer: Explainer,
    x: Tensor,
    target: TargetLike = None,
    *,
    maps: Tensor | None = None,
    others: Tensor | None = None,
    classes: int | None = None,
    similarity: Similarity = "ssim",
    seed: int | None = 0,
) -> Tensor:
    """The random logit test (Sixt et al. 2020): the similarity of each image's map for its class with its map for
    a class drawn at random among the others. Lower is better: a map that does not change with the class does not
    explain the class.

    Args:
        explainer: An explain method or a callable ``(images, classes) -> maps`` (see
            :mod:`explain.metrics.robustness`).
        x: The images, (N, C, H, W).
        target: The explained classes: None for the top class, a class, or one per image.
        maps: The maps of the explained classes where they are at hand (``target`` then a tensor of the classes,
            ``classes`` or ``others`` given): the explainer runs once, for the other classes.
        others: The other classes themselves, (N,); drawn uniformly from ``seed`` when None.
        classes: How many classes the model has (default: the explainer's result's logits).
        similarity: ``"ssim"`` (on the maps, scikit-image's uniform 7-wide window and the pair's data range),
            ``"ssim_flat"`` (on the maps flattened, Quantus 0.6.0's), or ``"spearman"``.
        seed: The other classes' seed (None: PyTorch's global generator).

    Returns:
        Each image's similarity, (N,).
    """
    found = explainer(x, target) if maps is None else maps
    maps, explained = maps_and_classes(found)
    if explained is None:
        if not isinstance(target, Tensor):
            raise ExplainError("random_logit: pass the explained classes as target= (a tensor, one per image)")
        explained = target
    explained = explained.reshape(len(x), -1)[:, 0]
    if others is None:
        logits = getattr(found, "logits", None)
        count = classes if classes is not None else (logits.shape[1] if isinstance(logits, Tensor) else None)
        if count is None or count < 2:
            raise ExplainError("random_logit: pass classes=, the number of classes the model has (two or more)")
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        drawn = torch.randint(count - 1, (len(x),), generator=generator).to(explained.device)
        others = drawn + (drawn >= explained).long()  # every class but the explained one, equally likely
    other_maps, _ = maps_and_classes(explainer(x, torch.as_tensor(others, device=x.device)))
    return _similarity(maps, other_maps, similarity)
