r"""Sobol total indices: how much of a score's variance each input accounts for, with all its interactions.

The design is Saltelli's: two quasi-Monte Carlo matrices A and B (N designs × d inputs, in [0, 1]) from one
scrambled Sobol sequence of 2d dimensions, and for each input i the matrix :math:`A_B^{(i)}`, A with its column i
taken from B. The total index is Jansen's estimator (Jansen 1999; Saltelli et al., "Variance based sensitivity
analysis of model output", Computer Physics Communications 2010, table 2):

.. math:: S_{T_i} = \frac{\frac{1}{2N} \sum_j \left(f(A)_j - f(A_B^{(i)})_j\right)^2}{\mathrm{Var}(f)}

with the variance of f over A and B together. CRAFT (Fel et al., CVPR 2023) ranks concepts by it, the inputs then
being masks on the concepts' coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ExplainError


def sobol_design(inputs: int, designs: int, seed: int = 0) -> Tensor:
    """The points f is evaluated at, ``designs * (inputs + 2)`` rows of ``inputs`` values in [0, 1]: A, then B,
    then :math:`A_B^{(i)}` for each input i in turn.

    Raises:
        ExplainError: Fewer than one input or two designs.
    """
    if inputs < 1 or designs < 2:
        raise ExplainError(f"a Sobol design needs at least one input and two designs, got {inputs} and {designs}")
    points = torch.quasirandom.SobolEngine(2 * inputs, scramble=True, seed=seed).draw(designs, dtype=torch.float64)
    a, b = points[:, :inputs], points[:, inputs:]
    mixed = a.repeat(inputs, 1, 1)  # (inputs, designs, inputs)
    for i in range(inputs):
        mixed[i, :, i] = b[:, i]
    return torch.cat([a, b, mixed.flatten(0, 1)])


@dataclass(frozen=True)
class TotalIndices:
    r"""Sobol total indices of d inputs, over one or more functions (images).

    Attributes:
        terms: Jansen's estimator's terms, (functions, inputs, designs): each is
            :math:`(f(A)_j - f(A_B^{(i)})_j)^2 / (2\mathrm{Var}(f))`; their mean over designs is a function's index.
    """

    terms: Tensor

    @property
    def per_function(self) -> Tensor:
        """Each function's total indices, (functions, inputs)."""
        return self.terms.mean(dim=2)

    @property
    def indices(self) -> Tensor:
        """The total indices averaged over the functions, (inputs,)."""
        return self.per_function.mean(dim=0)

    def interval(self, level: float = 0.95) -> tuple[Tensor, Tensor]:
        """A normal confidence interval of :attr:`indices` at ``level``: from the spread of the functions' indices
        where there are several, else from the spread of the one function's terms over the designs."""
        spread = self.per_function if len(self.terms) > 1 else self.terms[0].T
        error = spread.std(dim=0) / len(spread) ** 0.5
        z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(0.5 + level / 2, dtype=torch.float64))
        return self.indices - z * error, self.indices + z * error


def jansen_total(outputs: Tensor, inputs: int) -> TotalIndices:
    """The total indices from f's values at :func:`sobol_design`'s points.

    Args:
        outputs: f's values, (designs * (inputs + 2),) for one function or (functions, designs * (inputs + 2)).
        inputs: d, the number of inputs.

    Raises:
        ExplainError: The outputs are not a whole design's.
    """
    values = outputs.detach().double().reshape(-1, outputs.shape[-1]) if outputs.dim() else outputs
    if values.shape[-1] % (inputs + 2):
        raise ExplainError(f"{values.shape[-1]} outputs are not a Sobol design of {inputs} inputs")
    designs = values.shape[-1] // (inputs + 2)
    f_a, f_b = values[:, :designs], values[:, designs : 2 * designs]
    f_mixed = values[:, 2 * designs :].reshape(len(values), inputs, designs)
    variance = torch.cat([f_a, f_b], dim=1).var(dim=1, unbiased=False).clamp_min(torch.finfo(torch.float64).tiny)
    terms = (f_a[:, None] - f_mixed) ** 2 / (2 * variance[:, None, None])
    return TotalIndices(terms)
