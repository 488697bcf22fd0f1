r"""TCAV: Kim et al., "Interpretability Beyond Feature Attribution: Quantitative Testing with Concept Activation
Vectors (TCAV)", ICML 2018 (arXiv:1711.11279).

A concept is a folder of images of it ("striped"); its concept activation vector (CAV) at a layer is the normal of
a linear boundary between their activations and those of random counterexamples, pointing to the concept: a
logistic regression fitted in torch (``"linear"``), or FastCAV's difference of the two means (Schmalwasser et al.,
"FastCAV: Efficient Computation of Concept Activation Vectors for Explaining Deep Neural Networks", ICML 2025;
``"mean"``). The activations are the layer's output laid out as maps by the engine (a ViT's patch tokens on their
grid), flattened. A class's TCAV score is the share of its images whose score rises along the CAV: the directional
derivative :math:`\nabla h_k(f_l(x)) \cdot v_C > 0`. Its significance: the score is measured again with each of
``runs`` random halves of the random images as the counterexamples, and a null of random against random (two
disjoint random halves); a two-sided t-test between the two sets of scores, as the paper's, decides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ..core.layers import LayerSpec
from ..errors import ExplainError, TargetError
from ..targets import TargetLike
from .reading import UNSCORED, LayerReader

Fit = Literal["linear", "standardized", "mean"]
SIGNIFICANCE = 0.05


@dataclass(frozen=True)
class TCAVResult:
    """A concept's TCAV score for a target at a layer.

    Attributes:
        score: The share of the images whose target score rises along the concept's CAV (all random images as the
            counterexamples), in [0, 1].
        magnitude: The positive directional derivatives' share of all their magnitudes, in [0, 1].
        scores: The score with each run's random half as the counterexamples, (runs,).
        null: The score of each run's random-against-random CAV, (runs,).
        p_value: The two-sided t-test's p-value between ``scores`` and ``null``.
        layer: The layer.
    """

    score: float
    magnitude: float
    scores: Tensor
    null: Tensor
    p_value: float
    layer: str

    @property
    def significant(self) -> bool:
        """Whether the concept's scores differ from the null's at the 5% level."""
        return self.p_value < SIGNIFICANCE


def cav(concept: Tensor, counter: Tensor, fit: Fit = "linear", iterations: int = 50, l2: float = 0.01) -> Tensor:
    """A unit concept activation vector from flattened activations (rows, features) of a concept and of its
    counterexamples, pointing to the concept.

    Args:
        concept: The concept's activations.
        counter: The counterexamples'.
        fit: ``"linear"``: a logistic regression's weights on the activations as they are (Newton's method, an L2
            penalty ``l2`` on the weights), the CAV of Kim et al. 2018 and of Captum's default classifier;
            ``"standardized"``: the same fit on each feature divided by its spread, the weights brought back to the
            activations' scale (a direction that weighs faint features more); ``"mean"``: FastCAV's difference of
            the means.
        iterations: Most Newton steps.
        l2: The penalty's weight.
    """
    concept, counter = concept.double(), counter.double()
    if fit == "mean":
        direction = concept.mean(dim=0) - counter.mean(dim=0)
        return direction / direction.norm().clamp_min(torch.finfo(direction.dtype).tiny)
    if fit not in ("linear", "standardized"):
        raise ExplainError(f"a CAV is fitted 'linear', 'standardized' or 'mean', not {fit!r}")
    data = torch.cat([concept, counter])
    labels = torch.cat([torch.ones(len(concept)), torch.zeros(len(counter))]).to(data)
    center = data.mean(dim=0)
    scale = data.std(dim=0).clamp_min(1e-8) if fit == "standardized" else torch.ones_like(center)
    direction = _logistic_weights((data - center) / scale, labels, l2, iterations) / scale
    return direction / direction.norm().clamp_min(torch.finfo(direction.dtype).tiny)


def _logistic_weights(x: Tensor, y: Tensor, l2: float, iterations: int) -> Tensor:
    r"""The weights w of an L2-penalized logistic regression, :math:`\min_w \frac1n \sum_i \ell(x_i w + b, y_i) +
    \lambda \lVert w \rVert^2`, by Newton's method on its representer :math:`w = X^\top \alpha` (rows ≪ features:
    an (n + 1)-square system), each step halved until the loss falls."""
    n = len(x)
    kernel = x @ x.T
    ones = torch.ones(n, 1, dtype=x.dtype, device=x.device)
    alpha, bias = torch.zeros(n, dtype=x.dtype, device=x.device), torch.zeros((), dtype=x.dtype, device=x.device)

    def loss(a: Tensor, b: Tensor) -> Tensor:
        logits = kernel @ a + b
        return nn.functional.binary_cross_entropy_with_logits(logits, y) + l2 * a @ kernel @ a

    current = loss(alpha, bias)
    for _ in range(iterations):
        p = torch.sigmoid(kernel @ alpha + bias)
        s = p * (1 - p) / n
        gradient = torch.cat([kernel @ ((p - y) / n + 2 * l2 * alpha), ((p - y) / n).sum()[None]])
        top = torch.cat([kernel @ (s[:, None] * kernel) + 2 * l2 * kernel, kernel @ (s[:, None] * ones)], dim=1)
        bottom = torch.cat([(s[:, None] * ones).T @ kernel, s.sum()[None, None]], dim=1)
        hessian = torch.cat([top, bottom]) + 1e-10 * torch.eye(n + 1, dtype=x.dtype, device=x.device)
        step = torch.linalg.lstsq(hessian, gradient[:, None]).solution[:, 0]
        size = 1.0
        while size > 1e-6:
            trial_alpha, trial_bias = alpha - size * step[:-1], bias - size * step[-1]
            trial = loss(trial_alpha, trial_bias)
            if trial <= current:
                break
            size /= 2
        if size <= 1e-6 or current - trial < 1e-12 * max(1.0, float(current)):
            alpha, bias = (trial_alpha, trial_bias) if size > 1e-6 else (alpha, bias)
            break
        alpha, bias, current = trial_alpha, trial_bias, trial
    return x.T @ alpha


def t_test(first: Tensor, second: Tensor) -> float:
    """The two-sided p-value of Student's t-test of two independent samples with equal variances (the paper's,
    scipy's ``ttest_ind``); 1 where both samples are constant and equal, 0 where constant and unequal."""
    a, b = first.double(), second.double()
    df = len(a) + len(b) - 2
    pooled = ((len(a) - 1) * a.var() + (len(b) - 1) * b.var()) / df
    spread = float((pooled * (1 / len(a) + 1 / len(b))).sqrt())
    gap = float(a.mean() - b.mean())
    if spread == 0:
        return 1.0 if gap == 0 else 0.0
    t = gap / spread
    return _incomplete_beta(df / 2, 0.5, df / (df + t * t))


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function :math:`I_x(a, b)`, by its continued fraction (Lentz's method)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _incomplete_beta(b, a, 1 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            step = 1.0
        elif i % 2 == 0:
            step = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            step = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1 + step * d
        d = 1 / (d if abs(d) > tiny else tiny)
        c = 1 + step / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1 - c * d) < 1e-15:
            break
    return front * (f - 1)


class TCAV:
    """TCAV at one layer of a model.

    Args:
        model: Any model explain explains.
        layer: The layer: a name, a module, or None for the automatic one.
        fit: How the CAVs are fitted (see :func:`cav`).
        runs: The random halves of the significance test.
        batch_size: Most images per forward.
        labels: Class names, to accept a class name as target.
        seed: The random halves' seed.
    """

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec = None,
        *,
        fit: Fit = "linear",
        runs: int = 10,
        batch_size: int = 32,
        labels: Sequence[str] | None = None,
        seed: int = 0,
    ) -> None:
        if runs < 2 or batch_size < 1:
            raise ExplainError(f"runs must be at least 2 and batch_size at least 1, got {runs} and {batch_size}")
        self.reader = LayerReader(model, layer, labels=labels)
        self.fit, self.runs, self.batch_size, self.seed = fit, runs, batch_size, seed

    def activations(self, images: Tensor) -> Tensor:
        """The layer's activations of the images, laid out as maps and flattened, (N, features)."""
        return self._read(images, UNSCORED, gradients=False)[0]

    def gradients(self, images: Tensor, target: TargetLike) -> Tensor:
        """The target score's gradient at the layer for each image, flattened like the activations, (N, features).

        Raises:
            TargetError: No target: TCAV asks about one class.
        """
        if target is None:
            raise TargetError("TCAV scores a concept for a class: give the target class")
        return self._read(images, target, gradients=True)[0]

    def _read(self, images: Tensor, target: TargetLike, gradients: bool) -> tuple[Tensor, str]:
        """The activations, or the target's gradients, of the images in batches, flattened; and the layer."""
        readings = [self.reader.read(part, target, gradients) for part in images.split(self.batch_size)]
        found = [(r.gradients if gradients else r.activations).flatten(1) for r in readings]
        return torch.cat(found), readings[0].layer

    def __call__(self, images: Tensor, concept: Tensor, random: Tensor, target: TargetLike) -> TCAVResult:
        """The TCAV score of the concept for the target over the images, and its significance.

        Args:
            images: The images whose share is counted (the target class's, usually).
            concept: Images of the concept.
            random: Random counterexamples: at least 4, so that two disjoint halves make the null.
            target: The class, as for any explain call.

        Raises:
            ExplainError: Too few concept or random images.
        """
        if len(concept) < 2 or len(random) < 4:
            raise ExplainError(
                f"TCAV needs at least 2 concept images and 4 random ones, got {len(concept)} and {len(random)}"
            )
        if target is None:
            raise TargetError("TCAV scores a concept for a class: give the target class")
        gradients, layer = self._read(images, target, gradients=True)
        gradients = gradients.double()
        ours, theirs = self.activations(concept), self.activations(random)
        whole = gradients @ cav(ours, theirs, self.fit).to(gradients)
        generator = torch.Generator().manual_seed(self.seed)
        scores, null = [], []
        for _ in range(self.runs):
            order = torch.randperm(len(theirs), generator=generator)
            first, second = order[: len(order) // 2], order[len(order) // 2 :]
            scores.append(_share(gradients @ cav(ours, theirs[first], self.fit).to(gradients)))
            null.append(_share(gradients @ cav(theirs[first], theirs[second], self.fit).to(gradients)))
        positive = whole.clamp_min(0).sum() / whole.abs().sum().clamp_min(torch.finfo(whole.dtype).tiny)
        found, baseline = torch.tensor(scores), torch.tensor(null)
        return TCAVResult(_share(whole), float(positive), found, baseline, t_test(found, baseline), layer)


def _share(derivatives: Tensor) -> float:
    """The share of positive directional derivatives."""
    return float((derivatives > 0).double().mean())
