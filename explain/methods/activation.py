"""Methods that need no gradient: the map comes from the activations A alone (and the model's head)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.engine import CAM, Capture
from ..core.layers import classifier
from ..core.maps import principal_projection
from ..errors import LayerError, TargetError


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
    needs_gradients = False
    relu = False

    def weights(self, capture: Capture) -> Tensor:
        if capture.classes is None:
            raise TargetError(
                "CAM weighs channels by a class's row of the classifier; this target is not a classifier's class "
                "(use Grad-CAM or another method)"
            )
        channels = capture.activations.shape[1]
        name, head = classifier(self.model)
        if head.in_features != channels:
            raise LayerError(
                f"CAM needs a model ending in global pooling and one linear layer over the target layer's "
                f"{channels} channels; the last linear layer {name!r} reads {head.in_features} (use Grad-CAM)"
            )
        return head.weight.detach().float()[capture.classes]


class EigenCAM(CAM):
    r"""Eigen-CAM: Muhammad & Yeasin, "Eigen-CAM: Class Activation Map using Principal
    Components", IJCNN 2020 (arXiv:2008.00299).

    The projection of the centred activations on their first principal component
    (class-agnostic), its sign fixed as :func:`explain.core.maps.principal_projection` says.
    """

    name = "eigencam"
    needs_gradients = False

    def weighted_activations(self, capture: Capture) -> Tensor:
        return capture.activations

    def combine(self, weighted: Tensor) -> Tensor:
        return principal_projection(weighted)


class RandomCAM(CAM):
    r"""A baseline for evaluating methods: channel weights drawn uniformly from [-1, 1]
    (reproducible with ``seed``), :math:`\mathrm{cam} = \mathrm{ReLU}(\sum_c w_c A_c)`.
    A method that scores no better than this on a metric is not explaining the model."""

    name = "random"
    needs_gradients = False

    def weights(self, capture: Capture) -> Tensor:
        shape = capture.activations.shape[:2]
        device = capture.activations.device
        return 2 * torch.rand(shape, device=device, generator=capture.generator) - 1
