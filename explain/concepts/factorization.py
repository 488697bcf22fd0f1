"""Concept banks: activations (crops × channels) factorized into concepts, in torch on their device, streamed.

The activations come in batches (:data:`Batches`: a fresh pass over them at each call), so that a data set larger
than memory is factorized by passes over its shards: what is held is the bank (concepts × channels), each crop's
coefficients (crops × concepts) and one batch. Two factorizations:

- non-negative (:func:`factorize`, ``signed=False``), :math:`A \\approx U W` with :math:`U, W \\ge 0`: Lee &
  Seung's multiplicative updates for the Frobenius norm from the NNDSVDa start (Boutsidis & Gallopoulos 2008),
  U then W at each iteration, the same steps as scikit-learn's ``NMF(solver="mu", init="nndsvda")``;
- semi-non-negative (``signed=True``) for signed activations (a vision transformer's tokens), :math:`A \\approx
  U W` with :math:`U \\ge 0` and W of any sign: Ding, Li & Jordan, "Convex and Semi-Nonnegative Matrix
  Factorizations", IEEE TPAMI 2010, W by least squares and U by their multiplicative rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ExplainError
from .ranks import ALONE, Ranks

Batches = Callable[[], Iterable[Tensor]]
"""A fresh pass over the activations at each call: batches (rows, channels), always in the same order."""

TINY = torch.finfo(torch.float32).eps  # a denominator exactly 0 becomes this, as scikit-learn's
ZERO_CUT = 1e-6  # NNDSVD's factors below this are zeros, as scikit-learn's
CHECK_EVERY = 10  # updates between checks of the error's fall, as scikit-learn's
OVERSAMPLE, POWER_STEPS = 10, 7  # the randomized start's extra directions and power steps


@dataclass(frozen=True)
class Factors:
    """A factorization :math:`A \\approx U W` of activations A (crops × channels).

    Attributes:
        bank: The concepts W, (concepts, channels).
        coefficients: Each crop's coefficients U, (crops, concepts), non-negative.
        error: The reconstruction error :math:`\\lVert A - U W \\rVert_F`.
        signed: Whether the bank may be negative (semi-NMF).
    """

    bank: Tensor
    coefficients: Tensor
    error: float
    signed: bool


def _safe(denominator: Tensor) -> Tensor:
    return torch.where(denominator == 0, TINY, denominator)


def _positive(m: Tensor) -> Tensor:
    return (m.abs() + m) / 2


def _negative(m: Tensor) -> Tensor:
    return (m.abs() - m) / 2


@dataclass
class _Statistics:
    """What one pass over the activations adds up: the Gram matrix AᵀA, the values' count, sum, sum of squares
    and least one, and the rows."""

    gram: Tensor | None = None
    least: float = float("inf")
    total: float = 0.0
    squares: float = 0.0
    count: int = 0
    rows: int = 0

    def combined(self, ranks: Ranks) -> _Statistics:
        """The statistics of every rank's rows."""
        if ranks.world == 1 or self.gram is None:
            return self
        sums = ranks.sum(torch.tensor([self.total, self.squares, self.count, self.rows], dtype=torch.float64,
                                      device=self.gram.device))  # fmt: skip
        total, squares, count, rows = sums.tolist()
        return _Statistics(ranks.sum(self.gram), ranks.least(self.least), total, squares, int(count), int(rows))

    def add(self, a: Tensor) -> None:
        self.gram = a.T @ a if self.gram is None else self.gram + a.T @ a
        self.least = min(self.least, float(a.min()))
        self.total += float(a.sum())
        self.squares += float((a * a).sum())
        self.count += a.numel()
        self.rows += len(a)


def _batches(batches: Batches, dtype: torch.dtype) -> Iterable[Tensor]:
    """Each batch as a 2-D float tensor of ``dtype``, checked."""
    for batch in batches():
        if batch.dim() != 2:
            raise ExplainError(f"activations must come as (rows, channels) batches, got shape {tuple(batch.shape)}")
        yield batch.detach().to(dtype)


def _svd_start(
    batches: Batches, concepts: int, dtype: torch.dtype, ranks: Ranks
) -> tuple[Tensor, Tensor, Tensor, _Statistics]:
    """The top singular triplets of A from its Gram matrix, streamed: left vectors (this rank's crops, K), values
    (K,), right vectors (K, channels), and the pass's statistics (every rank's)."""
    stats = _Statistics()
    for a in _batches(batches, dtype):
        stats.add(a)
    if stats.gram is None:
        raise ExplainError("no activations to factorize: the crops gave none")
    stats = stats.combined(ranks)
    if concepts > min(stats.rows, stats.gram.shape[0]):
        raise ExplainError(
            f"{concepts} concepts asked of {stats.rows} crops with {stats.gram.shape[0]} channels: give at most "
            f"{min(stats.rows, stats.gram.shape[0])} concepts, or more crops"
        )
    values, vectors = _top_eigenpairs(stats.gram, concepts)
    order = values.clamp_min(0).sqrt()
    right = vectors.T  # (K, C)
    left = torch.cat([a @ right.T for a in _batches(batches, dtype)]) / order.clamp_min(TINY)
    return left, order, right, stats


def _top_eigenpairs(gram: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` largest eigenvalues of a symmetric positive semi-definite matrix and their eigenvectors (as
    columns), largest first: by randomized subspace iteration (Halko, Martinsson & Tropp 2011, as scikit-learn's
    ``randomized_svd``: ``OVERSAMPLE`` extra directions, ``POWER_STEPS`` power steps, a fixed seed), or exactly where
    the matrix is small."""
    size = len(gram)
    width = min(size, count + OVERSAMPLE)
    if width >= size // 2:
        values, vectors = torch.linalg.eigh(gram)
        return values.flip(0)[:count], vectors.flip(1)[:, :count]
    start = torch.randn(size, width, generator=torch.Generator().manual_seed(0), dtype=gram.dtype).to(gram.device)
    basis = torch.linalg.qr(gram @ start).Q
    for _ in range(POWER_STEPS):
        basis = torch.linalg.qr(gram @ basis).Q
    values, vectors = torch.linalg.eigh(basis.T @ gram @ basis)
    return values.flip(0)[:count], (basis @ vectors.flip(1))[:, :count]


def _nndsvda(left: Tensor, values: Tensor, right: Tensor, mean: float, ranks: Ranks) -> tuple[Tensor, Tensor]:
    """NNDSVD's non-negative start from the singular triplets, its zeros filled with the data's mean (NNDSVDa):
    each component's larger of its positive and negative parts (by the product of their norms over every rank's
    rows), scaled."""
    norms = [ranks.sum(part.square().sum(dim=0)).sqrt() for part in (left.clamp_min(0), (-left).clamp_min(0))]
    right_norms = [torch.linalg.norm(part, dim=1) for part in (right.clamp_min(0), (-right).clamp_min(0))]
    positive = norms[0] * right_norms[0] >= norms[1] * right_norms[1]
    sign = torch.where(positive, 1.0, -1.0).to(left.dtype)
    size = torch.where(positive, norms[0] * right_norms[0], norms[1] * right_norms[1])
    scale = (values * size).sqrt()
    xs, ys = (left * sign).clamp_min(0), (right * sign[:, None]).clamp_min(0)
    u = scale * xs / _safe(torch.where(positive, norms[0], norms[1]))
    w = (scale / _safe(torch.where(positive, right_norms[0], right_norms[1])))[:, None] * ys
    u[:, 0], w[0] = values[0].sqrt() * left[:, 0].abs(), values[0].sqrt() * right[0].abs()
    u[u < ZERO_CUT], w[w < ZERO_CUT] = 0, 0
    u[u == 0], w[w == 0] = mean, mean
    return u, w


def _semi_start(left: Tensor, values: Tensor, ranks: Ranks) -> Tensor:
    """Semi-NMF's non-negative start of U: the singular vectors' magnitudes, scaled, plus a little (a fifth of
    their mean over every rank's rows)."""
    u = left.abs() * values.sqrt()
    total = ranks.sum(torch.stack([u.sum(), u.new_tensor(float(u.numel()))]))
    return u + 0.2 * total[0] / total[1]


def factorize(
    batches: Batches,
    concepts: int,
    iterations: int = 200,
    *,
    signed: bool = False,
    tol: float = 1e-4,
    dtype: torch.dtype = torch.float64,
    ranks: Ranks = ALONE,
) -> Factors:
    """Factorize activations streamed in batches into ``concepts`` concepts.

    Args:
        batches: A fresh pass over the activations at each call (see :data:`Batches`); for the non-negative
            factorization they must be non-negative.
        concepts: K, how many concepts.
        iterations: Most multiplicative updates (each one pass over the activations).
        signed: Semi-NMF, for activations of any sign; else NMF.
        tol: Stop when the error fell by less than this share of its first checked value over the last
            ``CHECK_EVERY`` updates (scikit-learn's rule); 0: run every update.
        dtype: The arithmetic's float type (double by default: the updates divide small numbers).
        ranks: The processes the activations are split over (each passes its own batches; every one gets the same
            bank); default: this one alone.

    Returns:
        The bank, this rank's coefficients and the reconstruction error (of every rank's activations).

    Raises:
        ExplainError: No activations, more concepts than crops or channels, or negative activations for NMF.
    """
    if concepts < 1 or iterations < 1:
        raise ExplainError(f"concepts and iterations must be at least 1, got {concepts} and {iterations}")
    left, values, right, stats = _svd_start(batches, concepts, dtype, ranks)
    if not signed and stats.least < 0:
        raise ExplainError(
            "the activations have negative values, which a non-negative factorization cannot fit: "
            "factorize them signed (semi-NMF)"
        )
    if signed:
        u = _semi_start(left, values, ranks)
        w, uta, utu = _least_squares(batches, u, dtype, ranks)
    else:
        u, w = _nndsvda(left, values, right, stats.total / stats.count, ranks)
    update = _semi_update if signed else _mu_update
    first = previous = None
    for iteration in range(1, iterations + 1):
        uta, utu = _pass(batches, u, w, update, dtype, ranks)
        w = torch.linalg.lstsq(utu, uta).solution if signed else w * uta / _safe(utu @ w)
        if tol > 0 and iteration % CHECK_EVERY == 0:  # scikit-learn's rule: the error's fall since the last check
            error = _error(stats, uta, utu, w)
            first = error if first is None else first
            if previous is not None and (previous - error) / first < tol:
                break
            previous = error
    return Factors(w, u, _error(stats, uta, utu, w), signed)


def _error(stats: _Statistics, uta: Tensor, utu: Tensor, w: Tensor) -> float:
    r"""The reconstruction error :math:`\lVert A - U W \rVert_F` from the pass's UᵀA and UᵀU."""
    squared = stats.squares - 2 * float((uta * w).sum()) + float((utu * (w @ w.T)).sum())
    return max(squared, 0.0) ** 0.5


def _mu_update(a: Tensor, u: Tensor, w: Tensor, wwt: Tensor) -> Tensor:
    """NMF's multiplicative update of a batch's coefficients."""
    return u * (a @ w.T) / _safe(u @ wwt)


def _semi_update(a: Tensor, u: Tensor, w: Tensor, wwt: Tensor) -> Tensor:
    """Semi-NMF's multiplicative update of a batch's coefficients (Ding, Li & Jordan's rule)."""
    awt = a @ w.T
    return u * ((_positive(awt) + u @ _negative(wwt)) / _safe(_negative(awt) + u @ _positive(wwt))).sqrt()


def _pass(
    batches: Batches,
    u: Tensor,
    w: Tensor,
    update: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    dtype: torch.dtype,
    ranks: Ranks,
) -> tuple[Tensor, Tensor]:
    """One pass: each batch's coefficients updated in place, and UᵀA, UᵀU of the updated ones, over every rank."""
    wwt = w @ w.T
    uta = torch.zeros_like(w)
    utu = torch.zeros(len(w), len(w), dtype=w.dtype, device=w.device)
    start = 0
    for a in _batches(batches, dtype):
        rows = slice(start, start + len(a))
        u[rows] = update(a, u[rows], w, wwt)
        uta += u[rows].T @ a
        utu += u[rows].T @ u[rows]
        start += len(a)
    return ranks.sum(uta), ranks.sum(utu)


def _least_squares(batches: Batches, u: Tensor, dtype: torch.dtype, ranks: Ranks) -> tuple[Tensor, Tensor, Tensor]:
    """The bank of least squares for fixed coefficients, with the pass's UᵀA and UᵀU over every rank."""
    uta = utu = None
    start = 0
    for a in _batches(batches, dtype):
        part = u[start : start + len(a)]
        uta = part.T @ a if uta is None else uta + part.T @ a
        utu = part.T @ part if utu is None else utu + part.T @ part
        start += len(a)
    uta, utu = ranks.sum(uta), ranks.sum(utu)
    return torch.linalg.lstsq(utu, uta).solution, uta, utu


def coefficients(activations: Tensor, bank: Tensor, iterations: int = 200, *, signed: bool = False) -> Tensor:
    """Non-negative coefficients of activations (rows, channels) on a fixed bank (concepts, channels), rows × K:
    the factorization's own multiplicative rule for U with the bank held fixed, from scikit-learn's start for a
    fixed bank (every coefficient :math:`\\sqrt{\\bar A / K}`), or for a signed bank from the least-squares
    coefficients' positive part."""
    a = activations.detach().to(bank.dtype)
    wwt = bank @ bank.T
    if signed:
        u = _positive(torch.linalg.lstsq(wwt, bank @ a.T).solution.T) + TINY
    else:
        u = torch.full((len(a), len(bank)), max(float(a.mean()), 0.0) ** 0.5 / len(bank) ** 0.5, dtype=a.dtype)
        u = u.to(a.device)
    update = _semi_update if signed else _mu_update
    for _ in range(iterations):
        u = update(a, u, bank, wwt)
    return u
