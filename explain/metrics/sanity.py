"""The model-parameter randomization test (Adebayo et al., NeurIPS 2018, "Sanity Checks for Saliency Maps").

A copy of the model has its blocks re-initialized one more at a time, from the output down (cascading
randomization); at each depth the method explains the same images and targets again, and its maps are compared
with the trained model's: Spearman's rank correlation and SSIM of the absolute maps, each normalized to [0, 1].
A map that stays the same while the weights that make the decision are random does not explain the decision.
The user's model is never changed: the randomized model is a deep copy.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core.engine import CAMResult
from ..core.maps import normalize_maps
from ..errors import ExplainError
from ..targets import TargetLike
from .similarity import spearman, ssim


def cascading_blocks(model: nn.Module) -> list[str]:
    """The model's blocks from the output down: its top-level children that hold parameters, a container
    (``nn.Sequential``, ``nn.ModuleList``) among them split into its own children."""
    blocks = []
    for name, child in reversed(list(model.named_children())):
        parts = child.named_children() if isinstance(child, (nn.Sequential, nn.ModuleList)) else [("", child)]
        for part, module in reversed(list(parts)):
            if any(True for _ in module.parameters()):
                blocks.append(f"{name}.{part}" if part else name)
    return blocks


def randomize(block: nn.Module, seed: int) -> None:
    """Re-initialize a block's parameters, seeded: each submodule with a ``reset_parameters`` by it (BatchNorm's
    running statistics included); any other parameter from a normal distribution of its own mean and spread."""
    with torch.random.fork_rng(devices=[p.device for p in block.parameters() if p.is_cuda][:1]):
        torch.manual_seed(seed)
        covered: set[int] = set()
        for module in block.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
                covered |= {id(p) for p in module.parameters(recurse=False)}
        with torch.no_grad():
            for p in block.parameters():
                if id(p) not in covered:
                    p.copy_(torch.randn_like(p) * p.std(unbiased=False) + p.mean())


def _absolute_maps(cams: Tensor, x: Tensor) -> Tensor:
    """A method's maps of the inputs ``x`` as (N, *spatial) in [0, 1]: absolute values (a guided method's images,
    shaped as x: their largest absolute channel), normalized per map."""
    maps = cams.abs().amax(dim=1) if cams.dim() == x.dim() else cams.abs()
    return normalize_maps(maps.float(), x.dim() - 2)


@dataclass(frozen=True)
class SanityResult:
    """The randomization test's comparisons, per depth (blocks randomized) and image.

    Attributes:
        blocks: The blocks in the order they are randomized; depth d has ``blocks[:d]`` random.
        depths: The depth of each row of ``spearman`` and ``ssim``, increasing.
        spearman: Rank correlation of the absolute maps with the trained model's, (len(depths), N).
        ssim: Their structural similarity, (len(depths), N).
        trained: The method's result on the trained model, whose maps the others are compared with (its maps
            serve other metrics without computing them again); None where the comparisons of several calls are
            merged (:meth:`merged`).
    """

    blocks: list[str]
    depths: list[int]
    spearman: Tensor
    ssim: Tensor
    trained: CAMResult | None = None

    @staticmethod
    def merged(parts: Sequence[SanityResult]) -> SanityResult:
        """The comparisons of calls on different images (the same blocks and depths), their images in order."""
        return SanityResult(
            parts[0].blocks,
            parts[0].depths,
            torch.cat([part.spearman for part in parts], dim=1),
            torch.cat([part.ssim for part in parts], dim=1),
        )

    def insensitive(self, threshold: float = 0.5) -> bool:
        """Whether the method fails the test: with the output block random, the maps still correlate with the
        trained model's (mean Spearman at depth 1 at least ``threshold``)."""
        if 1 not in self.depths:
            raise ExplainError("the verdict needs the maps at depth 1 (the output block random); compare at depth 1")
        return bool(self.spearman[self.depths.index(1)].mean() >= threshold)


def _layer_names(model: nn.Module, layer: Any) -> Any:
    """Layer specs that name the same layers in a copy of the model: modules turned into their names."""
    names = {id(module): name for name, module in model.named_modules()}

    def named(spec: Any) -> Any:
        if isinstance(spec, nn.Module):
            if id(spec) not in names:
                raise ExplainError(f"the layer module {type(spec).__name__} is not part of the model")
            return names[id(spec)]
        return spec

    return [named(s) for s in layer] if isinstance(layer, (list, tuple)) else named(layer)


def sanity_check(
    model: nn.Module,
    x: Tensor,
    method: str = "gradcam",
    target: TargetLike = None,
    *,
    layer: Any = None,
    blocks: Sequence[str] | None = None,
    init_seed: int = 0,
    depths: Sequence[int] | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> SanityResult:
    """Cascading randomization: the method's maps on copies of the model with ever more blocks re-initialized,
    compared with its maps on the trained model.

    Args:
        model: The trained model; left as it was (the randomized ones are copies).
        x: Normalized images (N, C, H, W).
        method: A method's name (``explain.METHODS``).
        target: What to explain, bound on the trained model (its top class by default); the randomized models
            explain the same classes.
        layer: The method's layer(s) as for :func:`explain.cam` (the same names in every copy).
        blocks: The blocks to randomize, in order; default: :func:`cascading_blocks`, from the output down.
        init_seed: Seed of the re-initialization (the block at depth d uses ``init_seed + d - 1``); a method's own
            ``seed`` goes with its options.
        depths: The depths (numbers of blocks randomized, 1 for the output block) at which the maps are compared;
            default every depth. The blocks are randomized in order all the same, so a depth's maps do not depend
            on which others are compared: a slow method can be checked at depths 1 and the last alone.
        model_kwargs: Further keyword arguments of the model's forward.
        **options: The method's options (see :func:`explain.create_method`).

    Returns:
        The Spearman correlation and SSIM per depth and image.
    """
    from ..methods import create_method

    layer = _layer_names(model, layer)
    trained = create_method(method, model, layer, **options)(x, target, model_kwargs=model_kwargs)
    reference = _absolute_maps(trained.cams, x)
    order = list(blocks) if blocks is not None else cascading_blocks(model)
    if not order:
        raise ExplainError("the model has no block with parameters to randomize")
    wanted = sorted(set(depths)) if depths is not None else list(range(1, len(order) + 1))
    if not wanted or wanted[0] < 1 or wanted[-1] > len(order):
        raise ExplainError(f"depths must lie in 1..{len(order)} (the blocks from the output down: {order})")
    randomized = copy.deepcopy(model)
    correlations, similarities = [], []
    for depth, name in enumerate(order[: wanted[-1]], start=1):
        try:
            block = randomized.get_submodule(name)
        except AttributeError:
            raise ExplainError(f"the model has no block {name!r}; blocks from the output down: {order}") from None
        randomize(block, init_seed + depth - 1)
        if depth in wanted:
            result = create_method(method, randomized, layer, **options)(x, trained.target, model_kwargs=model_kwargs)
            maps = _absolute_maps(result.cams, x)
            correlations.append(spearman(reference, maps))
            similarities.append(ssim(reference, maps))
    return SanityResult(order, wanted, torch.stack(correlations), torch.stack(similarities), trained)
