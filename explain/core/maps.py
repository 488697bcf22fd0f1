"""Map arithmetic, batched in torch on the maps' device: normalize, upsample, principal components.

Maps have any number of spatial axes, the trailing ones: a signal's (L,), an image's (H, W), a volume's or a
clip's (D, H, W). The rank, how many they are, is the input's: its axes after the batch and the channels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INTERPOLATION = {1: "linear", 2: "bilinear", 3: "trilinear"}  # by rank


def map_axes(rank: int) -> tuple[int, ...]:
    """The spatial axes of maps (..., *spatial) of that rank: the last ``rank`` axes."""
    return tuple(range(-rank, 0))


def has_nonzero(values: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Whether ``values`` hold anything but zeros, over ``dim`` (all axes when None); a NaN counts as not zero.
    One pass of summed magnitudes: on the CPU several times faster than ``any()`` of a float tensor."""
    magnitudes = values.abs()
    return (magnitudes.sum() if dim is None else magnitudes.sum(dim=dim)) != 0


def bounding_boxes(region: Tensor) -> tuple[Tensor, Tensor]:
    """The box around each row's true positions of ``region`` (rows, *spatial): its start and its sides along
    each spatial axis, (rows, rank) each; an empty row's sides are 0 (and its start 0)."""
    rank = region.dim() - 1
    starts, sides = [], []
    for axis in range(rank):
        others = tuple(a + 1 for a in range(rank) if a != axis)
        hit = region.any(dim=others) if others else region  # (rows, size): whether each position is hit
        position = torch.arange(hit.shape[1], device=region.device)
        first = torch.where(hit, position, hit.shape[1]).amin(dim=1)
        side = (torch.where(hit, position, -1).amax(dim=1) - first + 1).clamp_min(0)
        starts.append(torch.where(side > 0, first, 0))
        sides.append(side)
    return torch.stack(starts, dim=1), torch.stack(sides, dim=1)


def normalize_maps(maps: Tensor, rank: int) -> Tensor:
    """Min-max normalize each map (..., *spatial) over its ``rank`` spatial axes to [0, 1]; a flat map becomes
    zeros."""
    axes = map_axes(rank)
    low = maps.amin(dim=axes, keepdim=True)
    span = maps.amax(dim=axes, keepdim=True) - low
    return torch.where(span > 0, (maps - low) / span.clamp_min(torch.finfo(maps.dtype).tiny), 0.0)


def upsample(maps: Tensor, size: Sequence[int]) -> Tensor:
    """Resize maps (..., *spatial) to ``size``, whose length is their rank: linear, bilinear or trilinear
    interpolation (align_corners=False); maps already that size pass as they are."""
    rank = len(size)
    if tuple(maps.shape[-rank:]) == tuple(size):
        return maps
    flat = maps.reshape(-1, 1, *maps.shape[-rank:])
    resized = F.interpolate(flat, size=tuple(size), mode=INTERPOLATION[rank], align_corners=False)
    return resized.reshape(*maps.shape[:-rank], *resized.shape[2:])


@dataclass(frozen=True)
class Canvas:
    """The padded canvas on which a detector's transform (torchvision's ``GeneralizedRCNNTransform``, a YOLO
    letterbox) puts the resized images: its layers' maps cover the canvas, not the image.

    Attributes:
        size: The canvas (H, W), padding included.
        image: The resized image's (h, w) on it.
        offset: The image's (top, left) on the canvas: (0, 0) for torchvision, the centring padding of a
            letterbox (Ultralytics).
    """

    size: tuple[int, int]
    image: tuple[int, int]
    offset: tuple[int, int] = (0, 0)

    def crop(self, maps: Tensor) -> Tensor:
        """Maps (..., h, w) over the canvas as maps over the image: upsampled to the canvas, the padding cut off.
        (Resizing the result to the input's size then undoes the transform's resize exactly.) Maps that are zero
        everywhere (a pyramid level no detection reaches) become zeros of that size without being resized."""
        if not bool(has_nonzero(maps)):
            return maps.new_zeros(*maps.shape[:-2], *self.image)
        top, left = self.offset
        return upsample(maps, self.size)[..., top : top + self.image[0], left : left + self.image[1]]


COVERS = "covers"  # a layer module's canvas of its own: the one its map covers (see covered)


def covered(module: nn.Module | None) -> Canvas | None:
    """The canvas a layer module says its map covers (its ``covers`` attribute), or None where it says none.

    A model that hands its layers pictures of its own makes such modules: LLaVA-NeXt's tiles lie on a padded canvas
    around the image, and its base image is the whole image squeezed into a square (see
    :mod:`explain.models.image_readings`). Their maps are laid out on, and brought back from, that canvas.
    """
    covers = getattr(module, COVERS, None)
    return covers if isinstance(covers, Canvas) else None


def postprocess(raw: Tensor, rank: int, size: Sequence[int] | None, normalize: bool) -> Tensor:
    """Upsample maps (..., *spatial) of ``rank`` to ``size`` (if given), then normalize (if asked)."""
    maps = raw if size is None else upsample(raw, size)
    return normalize_maps(maps, rank) if normalize else maps


def principal_projection(weighted: Tensor) -> Tensor:
    """Project each image's activations (N, C, *spatial) on their first principal component: (N, *spatial).

    The positions are the samples and the channels the variables: the activations
    are centred over positions, and the projection is their first left singular
    vector times its singular value. It is computed, in float64, from the
    eigendecomposition of the smaller of the two Gram matrices (positions x
    positions, or channels x channels), which gives the same component as an SVD
    at a fraction of its cost. A component is fixed only up to its sign; the sign
    is chosen so that the projection correlates positively with the channel sum
    of ``weighted`` (for weighted activations, the plain weighted map), and is +
    where that correlation is 0.
    """
    rows = weighted.flatten(2).transpose(1, 2).double()  # (N, positions, C)
    centred = rows - rows.mean(dim=1, keepdim=True)
    if centred.shape[1] <= centred.shape[2]:
        values, vectors = torch.linalg.eigh(centred @ centred.transpose(1, 2))
        projection = vectors[..., -1] * values[..., -1:].clamp_min(0).sqrt()
    else:
        _, vectors = torch.linalg.eigh(centred.transpose(1, 2) @ centred)
        projection = (centred @ vectors[..., -1:])[..., 0]
    return _signed(projection, rows).reshape(len(weighted), *weighted.shape[2:]).to(weighted.dtype)


def _signed(projection: Tensor, rows: Tensor) -> Tensor:
    """Projections (N, positions) with each image's sign chosen so that it correlates positively with the channel
    sum of ``rows`` (N, positions, C); + where that correlation is 0."""
    total = rows.sum(dim=2)
    agreement = (projection * (total - total.mean(dim=1, keepdim=True))).sum(dim=1, keepdim=True)
    return torch.where(agreement < 0, -projection, projection)


KERNELS = ("sigmoid", "rbf", "poly", "linear", "cosine")


def kernel_projection(activations: Tensor, kernel: str = "sigmoid", gamma: float | None = None) -> Tensor:
    """Project each image's activations (N, C, *spatial) on the first component of a kernel PCA: (N, *spatial).

    The positions are the samples and the channels the variables, centred over positions. The kernel between two
    positions' vectors x, y: ``"sigmoid"`` tanh(γ x·y + 1), ``"rbf"`` exp(-γ |x - y|²), ``"poly"`` (γ x·y + 1)³,
    ``"linear"`` x·y (plain PCA) or ``"cosine"``; γ defaults to 1/C. The kernel matrix is centred in feature space,
    and the projection is its first eigenvector times the square root of its eigenvalue (scikit-learn's
    ``KernelPCA.fit_transform``), in float64, its sign chosen as :func:`principal_projection` chooses it.
    """
    rows = activations.flatten(2).transpose(1, 2).double()  # (N, positions, C)
    x = rows - rows.mean(dim=1, keepdim=True)
    gamma = 1.0 / x.shape[2] if gamma is None else gamma
    dots = x @ x.transpose(1, 2)
    if kernel == "sigmoid":
        k = torch.tanh(gamma * dots + 1.0)
    elif kernel == "rbf":
        squared = dots.diagonal(dim1=1, dim2=2)
        k = torch.exp(-gamma * (squared[:, :, None] + squared[:, None, :] - 2 * dots).clamp_min(0))
    elif kernel == "poly":
        k = (gamma * dots + 1.0) ** 3
    elif kernel == "linear":
        k = dots
    elif kernel == "cosine":
        norms = x.norm(dim=2).clamp_min(torch.finfo(x.dtype).tiny)
        k = dots / (norms[:, :, None] * norms[:, None, :])
    else:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    centred = k - k.mean(dim=1, keepdim=True) - k.mean(dim=2, keepdim=True) + k.mean(dim=(1, 2), keepdim=True)
    projection = torch.stack([_top_eigenpair(matrix) for matrix in centred])
    return _signed(projection, rows).reshape(len(activations), *activations.shape[2:]).to(activations.dtype)


FULL_EIGH_LIMIT = 2048  # positions up to which kernel PCA decomposes its matrix whole; beyond, only its top pair


def _top_eigenpair(matrix: Tensor) -> Tensor:
    """A symmetric (n, n) float64 matrix's eigenvector of the largest eigenvalue, times that eigenvalue's square
    root (0 where it is negative). Up to ``FULL_EIGH_LIMIT`` rows, from the whole decomposition; beyond, LOBPCG
    finds the top pair alone (as scikit-learn's ARPACK does for one component), from the matrix's diagonal, and
    the whole decomposition is the fallback where its residual is not below 1e-6 of the eigenvalue."""
    if len(matrix) > FULL_EIGH_LIMIT:
        start = matrix.diagonal()[:, None] + 1e-3 * torch.linspace(-1, 1, len(matrix), dtype=matrix.dtype)[:, None]
        value, vector = torch.lobpcg(matrix, k=1, X=start, largest=True, tol=1e-8, niter=1000)
        residual = (matrix @ vector - value * vector).norm()
        if bool(residual <= 1e-6 * value.abs().clamp_min(1e-300)):
            return vector[:, 0] * value.clamp_min(0).sqrt()
    values, vectors = torch.linalg.eigh(matrix)
    return vectors[:, -1] * values[-1:].clamp_min(0).sqrt()


