"""Methods that need no gradient: the map comes from the activations A alone (and the model's head)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..core.engine import CAM, Capture, Needs
from ..core.layers import LayerSpec, classifier
from ..core.maps import KERNELS, kernel_projection, principal_projection
from ..errors import ExplainError, LayerError, TargetError


def classifier_over(model: nn.Module, channels: int, method: str) -> nn.Linear:
    """The model's classifier: its last linear layer, which must read the target layer's ``channels`` (a model
    ending in global pooling and one linear layer).

    Raises:
        LayerError: The last linear layer reads another number of features.
    """
    name, head = classifier(model)
    if head.in_features != channels:
        raise LayerError(
            f"{method} needs a model ending in global pooling and one linear layer over the target layer's "
            f"{channels} channels; the last linear layer {name!r} reads {head.in_features} (use Grad-CAM)"
        )
    return head


class OriginalCAM(CAM):
    r"""CAM: Zhou et al., "Learning Deep Features for Discriminative Localization",
    CVPR 2016 (arXiv:1512.04150).

    For a network that ends in global average pooling and one linear layer, the
    weights are that layer's row for the target class k, :math:`w_c = W_{k,c}`,
    and :math:`\mathrm{cam} = \sum_c w_c A_c`, without a ReLU (as in the paper).
    The linear layer is found automatically: the model's last ``nn.Linear``, which
    must read as many features as the target layer has channels.
    """

    name = "cam"
    title = "CAM (Zhou et al. 2016)"
    needs = Needs(gradients=False)
    relu = False

    def weights(self, capture: Capture) -> Tensor:
        if capture.classes is None:
            raise TargetError(
                "CAM weighs channels by a class's row of the classifier; this target is not a classifier's class "
                "(use Grad-CAM or another method)"
            )
        head = classifier_over(self.model, capture.activations.shape[1], "CAM")
        return head.weight.detach().float()[capture.classes]


class EigenCAM(CAM):
    r"""Eigen-CAM: Muhammad & Yeasin, "Eigen-CAM: Class Activation Map using Principal
    Components", IJCNN 2020 (arXiv:2008.00299).

    The projection of the centred activations on their first principal component
    (class-agnostic), its sign fixed as :func:`explain.core.maps.principal_projection` says.
    """

    name = "eigencam"
    title = "Eigen-CAM (Muhammad & Yeasin 2020)"
    needs = Needs(gradients=False)

    def compute(self, capture: Capture) -> Tensor:
        """The layer's map, the same for every target: computed once per pass."""
        return capture.once(f"{self.name}:{capture.name}", lambda: CAM.compute(self, capture))

    def weighted_activations(self, capture: Capture) -> Tensor:
        return capture.activations

    def combine(self, weighted: Tensor) -> Tensor:
        return principal_projection(weighted)


class RandomCAM(CAM):
    r"""A baseline for evaluating methods: channel weights drawn uniformly from [-1, 1]
    (reproducible with ``seed``), :math:`\mathrm{cam} = \mathrm{ReLU}(\sum_c w_c A_c)`.
    A method that scores no better than this on a metric is not explaining the model."""

    name = "random"
    title = "random channel weights, a baseline"
    fast = False
    needs = Needs(gradients=False)

    def weights(self, capture: Capture) -> Tensor:
        shape = capture.activations.shape[:2]
        device = capture.activations.device
        return 2 * torch.rand(shape, device=device, generator=capture.generator) - 1


class KPCACAM(EigenCAM):
    r"""KPCA-CAM: Karmani et al., "KPCA-CAM: Visual Explainability of Deep Computer Vision Models using Kernel
    PCA", MMSP 2024 (arXiv:2410.00267).

    Eigen-CAM with a kernel PCA: the projection of the centred activations on the first component of a kernel
    PCA over positions (:func:`explain.core.maps.kernel_projection`), class-agnostic.

    Args:
        model: Any model explain explains; left as it was.
        layer: The target layer(s) (None: automatic).
        labels: Class names, to accept a class name as target.
        kernel: ``"sigmoid"`` (the paper's and pytorch-grad-cam's default), ``"rbf"``, ``"poly"``, ``"linear"``
            (Eigen-CAM) or ``"cosine"``.
        gamma: The kernel's scale; None: 1 / channels.
        **options: The engine's options (see :class:`explain.core.engine.CAM`).
    """

    name = "kpcacam"
    title = "KPCA-CAM, kernel principal component (Karmani et al. 2024)"

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec | Sequence[str | nn.Module] = None,
        *,
        labels: Sequence[str] | None = None,
        kernel: str = "sigmoid",
        gamma: float | None = None,
        **options: object,
    ) -> None:
        super().__init__(model, layer, labels=labels, **options)
        if kernel not in KERNELS:
            raise ExplainError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.kernel, self.gamma = kernel, gamma

    def combine(self, weighted: Tensor) -> Tensor:
        return kernel_projection(weighted, self.kernel, self.gamma)


class FEM(CAM):
    r"""FEM, the Feature Explanation Method: Fuad et al., "Features Understanding in 3D CNNs for Actions
    Recognition in Video", IPTA 2020.

    Each channel's weight is the share of its positions that stand out, above its mean by ``k`` standard
    deviations (both over the positions): :math:`w_c = \mathrm{mean}\,[A_c > \mu_c + k\sigma_c]`,
    :math:`\mathrm{cam} = \mathrm{ReLU}(\sum_c w_c A_c)`; class-agnostic, as pytorch-grad-cam's.

    Args:
        model: Any model explain explains; left as it was.
        layer: The target layer(s) (None: automatic).
        labels: Class names, to accept a class name as target.
        k: How many standard deviations above the mean a position stands out.
        **options: The engine's options (see :class:`explain.core.engine.CAM`).
    """

    name = "fem"
    title = "FEM, channels' outstanding positions (Fuad et al. 2020)"
    needs = Needs(gradients=False)

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec | Sequence[str | nn.Module] = None,
        *,
        labels: Sequence[str] | None = None,
        k: float = 2.0,
        **options: object,
    ) -> None:
        super().__init__(model, layer, labels=labels, **options)
        self.k = k

    def weights(self, capture: Capture) -> Tensor:
        a = capture.activations
        std, mean = torch.std_mean(a, dim=capture.spatial, correction=0, keepdim=True)
        return (a > mean + self.k * std).float().mean(dim=capture.spatial)
