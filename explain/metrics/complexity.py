"""How simple a map is: sparseness (the Gini index), complexity (the entropy of its mass) and effective complexity
(the count of values that matter). They need neither a model nor an object: maps of any resolution, (N, h, w) or
(N, *spatial), each reduced to its absolute values.
"""

from __future__ import annotations

from torch import Tensor

from ..errors import ExplainError

GINI_OFFSET = 1e-7  # added to every value before the Gini index (as Quantus does): a map of zeros is then uniform


def _magnitudes(maps: Tensor, name: str) -> Tensor:
    """Each map's absolute values, flattened: (N, features), in float.

    Raises:
        ExplainError: Not a batch of maps.
    """
    if maps.dim() < 2:
        raise ExplainError(f"{name} takes a batch of maps (N, h, w), got {tuple(maps.shape)}")
    return maps.detach().flatten(1).float().abs()


def sparseness(maps: Tensor) -> Tensor:
    """The Gini index of each map's absolute values (Chalasani et al., "Concise explanations of neural networks
    using adversarial training", ICML 2020): 1 where all the mass is on one value, 0 where it is spread evenly.

    With the n values sorted ascending, a_(1) <= ... <= a_(n): G = sum_i (2i - n - 1) a_(i) / (n sum_i a_(i)).
    Every value is raised by 1e-7 first, as Quantus does, so that a map of zeros scores 0.

    Args:
        maps: One map per image, (N, *spatial).

    Returns:
        Each map's Gini index, (N,), higher is sparser.
    """
    values = _magnitudes(maps, "sparseness") + GINI_OFFSET
    ordered = values.sort(dim=1).values
    n = ordered.shape[1]
    ranks = 2 * ordered.new_tensor(range(1, n + 1)) - n - 1
    return (ranks * ordered).sum(dim=1) / (n * ordered.sum(dim=1))


def complexity(maps: Tensor) -> Tensor:
    """The entropy of each map's mass (Bhatt et al., "Evaluating and aggregating feature-based model explanations",
    IJCAI 2020): with p_i = |a_i| / sum_j |a_j|, H = -sum_i p_i ln p_i. Lower is simpler: 0 where one value holds
    all the mass, ln n where all hold the same.

    Args:
        maps: One map per image, (N, *spatial).

    Returns:
        Each map's entropy in nats, (N,).
    """
    values = _magnitudes(maps, "complexity")
    shares = values / values.sum(dim=1, keepdim=True).clamp_min(1e-30)
    return -(shares * (shares + 1e-12).log()).sum(dim=1)


def effective_complexity(maps: Tensor, eps: float = 1e-5, normalize: bool = True) -> Tensor:
    """The count of each map's values whose magnitude exceeds ``eps`` (Nguyen and Martinez, "On quantitative aspects
    of model interpretability", 2020): how many features the explanation leans on. Lower is simpler.

    Args:
        maps: One map per image, (N, *spatial).
        eps: The least magnitude that counts.
        normalize: Divide each map by its largest magnitude first (Quantus' convention, and explain's maps' own,
            which lie in [0, 1]), so that ``eps`` is a share of the peak; False counts raw magnitudes.

    Returns:
        Each map's count, (N,), int64.
    """
    values = _magnitudes(maps, "effective_complexity")
    if normalize:
        values = values / values.amax(dim=1, keepdim=True).clamp_min(1e-30)
    return (values > eps).sum(dim=1)
