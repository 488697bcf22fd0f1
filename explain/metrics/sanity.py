"""The model-parameter randomization test (Adebayo et al., NeurIPS 2018, "Sanity Checks for Saliency Maps").

A copy of the model has its blocks re-initialized one more at a time, from the output down (cascading
randomization); at each depth the method explains the same images and targets again, and its maps are compared
with the trained model's: Spearman's rank correlation and SSIM of the absolute maps, each normalized to [0, 1].
A map that stays the same while the weights that make the decision are random does not explain the decision.
The user's model is never changed: the randomized model is a deep copy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core.engine import CAMResult
from ..core.maps import normalize_maps
from ..errors import ExplainError
from ..targets import TargetLike
from .similarity import spearman_to, ssim_to


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


MapsOf = Callable[[Any, Tensor, Any, Mapping[str, Any] | None], CAMResult]


def _explained(method: Any, x: Tensor, target: Any, model_kwargs: Mapping[str, Any] | None) -> CAMResult:
    """A method's result on the images, as it is called plainly."""
    return method(x, target, model_kwargs=model_kwargs)


@dataclass(frozen=True)
class Randomization:
    """How the copies of the model are randomized: which blocks, in which order, with which seeds.

    Attributes:
        blocks: The blocks (module names) in the order they are randomized.
        seeds: Each block's seed.
        cascading: Whether each copy keeps the blocks before it random (Adebayo's cascading test); if not, each
            copy has its one block random (the independent test).
    """

    blocks: list[str]
    seeds: list[int]
    cascading: bool = True

    def copies(self, model: nn.Module, last: int) -> Iterator[tuple[int, nn.Module]]:
        """The randomized copies up to depth ``last``, with their depth (1 for the first block); the user's model
        is never changed."""
        randomized = copy.deepcopy(model)
        for depth, name in enumerate(self.blocks[:last], start=1):
            if not self.cascading and depth > 1:
                randomized = copy.deepcopy(model)
            try:
                block = randomized.get_submodule(name)
            except AttributeError:
                raise ExplainError(f"the model has no block {name!r}; blocks in order: {self.blocks}") from None
            randomize(block, self.seeds[depth - 1])
            yield depth, randomized


def randomized_maps(
    model: nn.Module,
    x: Tensor,
    method: str,
    target: TargetLike,
    *,
    layer: Any,
    randomization: Randomization,
    depths: Sequence[int] | None,
    model_kwargs: Mapping[str, Any] | None,
    options: Mapping[str, Any],
    maps_of: MapsOf = _explained,
) -> tuple[CAMResult, list[int], list[CAMResult]]:
    """The method's result on the trained model, the depths compared (increasing) and its result on the
    randomized copy at each, every copy explaining the trained model's target; ``maps_of(method, x, target,
    model_kwargs)`` runs a method (a smoothed one for sMPRT).

    Raises:
        ExplainError: No block to randomize, or depths outside 1..len(blocks).
    """
    from ..methods import create_method

    layer = _layer_names(model, layer)
    order = randomization.blocks
    if not order:
        raise ExplainError("the model has no block with parameters to randomize")
    wanted = sorted(set(depths)) if depths is not None else list(range(1, len(order) + 1))
    if not wanted or wanted[0] < 1 or wanted[-1] > len(order):
        raise ExplainError(f"depths must lie in 1..{len(order)} (the blocks in order: {order})")
    trained = maps_of(create_method(method, model, layer, **options), x, target, model_kwargs)
    results, explainer, explained_model = [], None, None
    for depth, randomized in randomization.copies(model, wanted[-1]):
        if depth not in wanted:
            continue
        if randomized is not explained_model:  # a cascading test randomizes one copy further: one method serves it
            explainer, explained_model = create_method(method, randomized, layer, **options), randomized
        results.append(maps_of(explainer, x, trained.target, model_kwargs))
    return trained, wanted, results


def compared(
    x: Tensor, trained: CAMResult, blocks: list[str], depths: list[int], results: list[CAMResult]
) -> SanityResult:
    """The Spearman correlation and SSIM of each randomized result's absolute maps with the trained one's."""
    reference = _absolute_maps(trained.cams, x)
    ranked, structured = spearman_to(reference), ssim_to(reference)  # the trained maps' part, computed once
    maps = [_absolute_maps(result.cams, x) for result in results]
    return SanityResult(
        blocks, depths, torch.stack([ranked(m) for m in maps]), torch.stack([structured(m) for m in maps]), trained
    )


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
    order = list(blocks) if blocks is not None else cascading_blocks(model)
    randomization = Randomization(order, [init_seed + d for d in range(len(order))])
    trained, wanted, results = randomized_maps(
        model, x, method, target, layer=layer, randomization=randomization, depths=depths,
        model_kwargs=model_kwargs, options=options,
    )  # fmt: skip
    return compared(x, trained, order, wanted, results)
