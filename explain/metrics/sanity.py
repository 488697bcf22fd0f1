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
from .imputation import gaussian_line, separable_filter


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


def average_ranks(values: Tensor) -> Tensor:
    """The rank of each value in its row (0-based), ties given their mean rank, (N, M) float64."""
    n, m = values.shape
    ordered, order = values.sort(dim=1, stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    group = starts.flatten().cumsum(0) - 1  # ties share a group, numbered across rows
    places = torch.arange(m, device=values.device, dtype=torch.float64).repeat(n)
    sums = torch.zeros(int(group[-1]) + 1, device=values.device, dtype=torch.float64).index_add_(0, group, places)
    sizes = torch.zeros_like(sums).index_add_(0, group, torch.ones_like(places))
    return torch.empty_like(places).view(n, m).scatter_(1, order, (sums / sizes)[group].view(n, m))


def spearman(a: Tensor, b: Tensor) -> Tensor:
    """Spearman's rank correlation of each pair of maps (N, H, W), (N,); where a map is flat, 1 if the other is
    flat too (nothing changed) and 0 if not."""
    ra, rb = (average_ranks(t.flatten(1)) for t in (a, b))
    ra, rb = ra - ra.mean(dim=1, keepdim=True), rb - rb.mean(dim=1, keepdim=True)
    spread_a, spread_b = ra.norm(dim=1), rb.norm(dim=1)
    flat = torch.where((spread_a == 0) & (spread_b == 0), 1.0, 0.0).to(ra.dtype)
    spread = spread_a * spread_b
    return torch.where(spread > 0, (ra * rb).sum(dim=1) / spread.clamp_min(1e-300), flat).float()


def ssim(a: Tensor, b: Tensor, window: int = 11, sigma: float = 1.5) -> Tensor:
    """The mean structural similarity of each pair of maps in [0, 1] (N, *spatial), (N,): Wang et al. 2004, a
    Gaussian window (11, sigma 1.5) along each spatial axis, C1 = 0.01², C2 = 0.03², over the windows that fit
    inside the map. An axis shorter than the window (a volume's few slices) gets the window cut to its length."""
    a, b = a.double(), b.double()
    lines = [gaussian_line(min(window, side - 1 + side % 2), sigma, a) for side in a.shape[1:]]

    def local(t: Tensor) -> Tensor:
        return separable_filter(t, lines, padding=0)

    mean_a, mean_b = local(a), local(b)
    var_a, var_b = local(a * a) - mean_a**2, local(b * b) - mean_b**2
    cov = local(a * b) - mean_a * mean_b
    c1, c2 = 0.01**2, 0.03**2
    index = ((2 * mean_a * mean_b + c1) * (2 * cov + c2)) / ((mean_a**2 + mean_b**2 + c1) * (var_a + var_b + c2))
    return index.flatten(1).mean(dim=1).float()


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
