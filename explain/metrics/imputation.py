"""What removed pixels are replaced with: a Gaussian blur (RISE's insertion) and ROAD's noisy linear imputation.

Both work on a batch on its own device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ExplainError

# ROAD's neighbour weights (Rong et al. 2022): edges 1/6, diagonals 1/12.


def gaussian_line(size: int, sigma: float, like: Tensor) -> Tensor:
    """A normalized 1-D Gaussian of ``size`` taps and ``sigma`` in taps, in ``like``'s dtype and device."""
    offsets = torch.arange(size, device=like.device, dtype=torch.float64) - (size - 1) / 2
    line = torch.exp(-(offsets**2) / (2 * sigma**2))
    return (line / line.sum()).to(like.dtype)


def separable_filter(t: Tensor, lines: Sequence[Tensor], padding: int) -> Tensor:
    """``t`` (..., *spatial) convolved along each of its last ``len(lines)`` axes with that axis's 1-D kernel, zero
    padded by ``padding`` on each side: a filter over every spatial axis of a signal, an image or a volume."""
    for axis, line in zip(range(-len(lines), 0), lines):
        moved = t.movedim(axis, -1)
        flat = F.conv1d(moved.reshape(-1, 1, moved.shape[-1]), line.view(1, 1, -1), padding=padding)
        t = flat.view(*moved.shape[:-1], flat.shape[-1]).movedim(-1, axis)
    return t


def gaussian_blur(x: Tensor, size: int = 11, sigma: float = 5.0) -> Tensor:
    """Each channel of x (N, C, *spatial) convolved with a normalized Gaussian of ``size`` taps and ``sigma`` pixels
    along each spatial axis, with zero padding: RISE's insertion start (kernel 11, sigma 5, padded with zeros as its
    code does), for images, and the same along every axis of a signal or a volume."""
    return separable_filter(x, [gaussian_line(size, sigma, x)] * (x.dim() - 2), size // 2)


def _neighbour_sum(t: Tensor) -> Tensor:
    """The weighted sum of each pixel's neighbours inside the image, per channel (zero outside). The weights are
    ([1, 2, 1] x [1, 2, 1] - 4 at the centre) / 12, so the sum is taken as two 1-D passes, cheaper than a 3x3
    convolution."""
    padded = F.pad(t, (1, 1, 1, 1))
    rows = (padded[..., :-2, :] + padded[..., 2:, :]).add_(padded[..., 1:-1, :], alpha=2)
    both = (rows[..., :-2] + rows[..., 2:]).add_(rows[..., 1:-1], alpha=2)
    return both.sub_(t, alpha=4).div_(12)


OFFSETS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]  # a 3x3 stencil's entries, row by row; 4 is the centre

Operator = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class _Level:
    """The imputation's matrix at one resolution: its product with u (N, C, h, w, zero at the known pixels), its
    diagonal's inverse at the removed pixels, zero elsewhere (N, 1, h, w: Jacobi's step), and the removed pixels
    (N, 1, h, w) float."""

    apply: Operator
    inverse_diagonal: Tensor
    mask: Tensor

    @staticmethod
    def of(apply: Operator, diagonal: Tensor, mask: Tensor) -> _Level:
        """The level of a matrix given by its product and its diagonal, over the removed pixels ``mask``."""
        return _Level(apply, mask / diagonal.clamp_min(torch.finfo(diagonal.dtype).tiny), mask)


def _stencil_product(stencil: Tensor, u: Tensor) -> Tensor:
    """A 3x3 stencil with coefficients per pixel, (N, 9, h, w), applied to u (N, C, h, w): the sum over offsets
    o of stencil[o] times u shifted by o, zero outside the image."""
    h, w = u.shape[-2:]
    padded = F.pad(u, (1, 1, 1, 1))
    out = torch.zeros_like(u)
    for k, (dy, dx) in enumerate(OFFSETS):
        out.addcmul_(stencil[:, k, None], padded[..., 1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w])
    return out


def _restrict(r: Tensor) -> Tensor:
    """Sum over 2x2 blocks (the transpose of :func:`_prolong`)."""
    return F.avg_pool2d(r, 2, ceil_mode=True, divisor_override=1)


def _prolong(e: Tensor, mask: Tensor) -> Tensor:
    """Each coarse value copied to its block's removed pixels."""
    return F.interpolate(e, scale_factor=2, mode="nearest")[..., : mask.shape[-2], : mask.shape[-1]] * mask


def _finest(mask: Tensor) -> _Level:
    """The matrix over the removed pixels: (S u - sum_j w_ij u_j) at each removed pixel i, a convolution."""
    degree = _neighbour_sum(torch.ones_like(mask[:1]))
    return _Level.of(lambda u: _neighbour_sum(u).neg_().addcmul_(degree, u).mul_(mask), degree, mask)


def _coarser(level: _Level) -> _Level:
    """The Galerkin operator R A P at half the resolution, over the blocks with a removed pixel. It is a 3x3
    stencil with coefficients per cell, probed: coarse cells three apart do not interact, so the operator applied
    to the cells of each of the 9 residues of (row mod 3, column mod 3) gives every coefficient."""
    mask = F.max_pool2d(level.mask, 2, ceil_mode=True)
    h, w = mask.shape[-2:]
    ys = torch.arange(h, device=mask.device)[:, None]
    xs = torch.arange(w, device=mask.device)[None, :]
    stencil = torch.zeros(mask.shape[0], 9, h, w, dtype=mask.dtype, device=mask.device)
    for cy in range(3):
        for cx in range(3):
            cells = ((ys % 3 == cy) & (xs % 3 == cx)).to(mask.dtype) * mask
            probed = _restrict(level.apply(_prolong(cells, level.mask))) * mask
            for k, (dy, dx) in enumerate(OFFSETS):
                stencil[:, k] += probed[:, 0] * (((ys + dy) % 3 == cy) & ((xs + dx) % 3 == cx)).to(mask.dtype)
    return _Level.of(partial(_stencil_product, stencil), stencil[:, 4, None], mask)


def _v_cycle(levels: list[_Level], r: Tensor, depth: int = 0, omega: float = 0.7, boost: float = 1.5) -> Tensor:
    """One multigrid V-cycle from zero for A u = r, symmetric (two damped Jacobi sweeps before and after, R = P^T,
    Galerkin coarse operators): the conjugate gradients' preconditioner. The piecewise-constant transfers make the
    coarse correction too small, so it is scaled by ``boost``, which halves the iterations."""
    level = levels[depth]
    inverse = level.inverse_diagonal

    def smooth(u: Tensor) -> Tensor:
        return u.addcmul(level.apply(u).neg_().add_(r), inverse, value=omega)

    u = omega * r * inverse
    if depth == len(levels) - 1:  # the coarsest level, a few cells: Jacobi until it has settled
        for _ in range(10):
            u = smooth(u)
        return u
    u = smooth(u)
    correction = _v_cycle(levels, _restrict(r - level.apply(u)), depth + 1, omega, boost)
    u = u.add_(_prolong(correction, level.mask), alpha=boost)
    return smooth(smooth(u))


def _solve(values: Tensor, removed: Tensor, tolerance: float) -> Tensor:
    """The linear imputation's systems (one per image and channel) solved together by conjugate gradients,
    preconditioned by a multigrid V-cycle: the removed pixels' values (zero at the known ones)."""
    levels = [_finest(removed.to(values.dtype))]
    while min(levels[-1].mask.shape[-2:]) > 3:
        levels.append(_coarser(levels[-1]))
    rhs = _neighbour_sum(values * ~removed) * levels[0].mask
    u, residual = torch.zeros_like(values), rhs
    goal = tolerance * rhs.flatten(2).norm(dim=2)
    z = _v_cycle(levels, residual)
    direction, rz = z, (residual * z).flatten(2).sum(dim=2)
    for _ in range(500):
        if bool((residual.flatten(2).norm(dim=2) <= goal).all()):
            return u
        product = levels[0].apply(direction)
        curvature = (direction * product).flatten(2).sum(dim=2)
        step = torch.where(curvature > 0, rz / curvature.clamp_min(1e-300), 0.0)[..., None, None]
        u = u + step * direction
        residual = residual - step * product
        z = _v_cycle(levels, residual)
        rz_next = (residual * z).flatten(2).sum(dim=2)
        direction = z + torch.where(rz > 0, rz_next / rz.clamp_min(1e-300), 0.0)[..., None, None] * direction
        rz = rz_next
    raise ExplainError("the linear imputation did not converge")


def noisy_linear_imputation(
    x: Tensor,
    removed: Tensor,
    noise: float = 0.01,
    generator: torch.Generator | None = None,
    tolerance: float = 1e-6,
) -> Tensor:
    """ROAD's noisy linear imputer (Rong et al., ICML 2022), for a batch, on its device.

    Each removed pixel takes the weighted mean of its neighbours inside the image (edges 1/6, diagonals 1/12),
    removed neighbours included: one sparse linear system per image and channel,
    S_i u_i - sum_j w_ij u_j = sum_(known j) w_ij x_j over the removed pixels i, where S_i sums the weights of
    i's neighbours inside the image. All systems are solved together, in float32 (the precision of the model's
    inputs), by conjugate gradients (the matrix is symmetric positive definite when an image keeps a pixel)
    preconditioned by a geometric multigrid V-cycle (Galerkin coarse operators, piecewise-constant transfers,
    damped Jacobi), a few dozen iterations; then Gaussian noise of standard deviation ``noise`` is added to the
    removed pixels, as ROAD does.

    Args:
        x: Images (N, C, H, W), e.g. normalized model inputs.
        removed: Which pixels to impute, (N, 1, H, W) or (N, H, W), bool.
        noise: The noise's standard deviation, in x's units (0: none).
        generator: The noise's random number generator, on x's device; None for PyTorch's global one.
        tolerance: Stop when each system's residual norm is below ``tolerance`` times its right-hand side's.

    Returns:
        x with its removed pixels imputed, x's dtype.

    Raises:
        ExplainError: An image has every pixel removed (nothing to impute from), or the solve did not converge.
    """
    removed = removed.reshape(x.shape[0], 1, *x.shape[-2:]).bool()
    known = ~removed
    if not bool(known.flatten(1).any(dim=1).all()):
        raise ExplainError("the imputation needs at least one kept pixel per image; every pixel was removed")
    u = _solve(x.float(), removed, tolerance)
    if noise:
        u = u + noise * torch.randn(u.shape, device=u.device, generator=generator, dtype=u.dtype)
    return torch.where(removed, u.to(x.dtype), x)
