"""Gradient methods: the map weighs the layer's activations A by the target score's gradient g = dy/dA.

Sums run over the spatial positions (i, j) of the layer's map: its every spatial axis, one for a signal, two for an
image, three for a volume or a clip (``capture.spatial``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.engine import CAM, Capture
from ..core.maps import principal_projection


class GradCAM(CAM):
    r"""Grad-CAM: Selvaraju et al., "Grad-CAM: Visual Explanations from Deep Networks
    via Gradient-based Localization", ICCV 2017 (arXiv:1610.02391).

    .. math:: w_c = \frac{1}{hw} \sum_{ij} g_{c,ij}, \qquad
              \mathrm{cam} = \mathrm{ReLU}\Big(\sum_c w_c A_c\Big).
    """

    name = "gradcam"

    def weights(self, capture: Capture) -> Tensor:
        return capture.gradients.mean(dim=capture.spatial)


class GradCAMPlusPlus(CAM):
    r"""Grad-CAM++: Chattopadhyay et al., "Grad-CAM++: Generalized Gradient-Based Visual
    Explanations for Deep Convolutional Networks", WACV 2018 (arXiv:1710.11063).

    The closed form of the paper for an exponential score, without a stabilizing epsilon:

    .. math:: \alpha_{c,ij} = \frac{g_{c,ij}^2}{2 g_{c,ij}^2 + \sum_{ab} A_{c,ab}\, g_{c,ij}^3}
              \ (0 \text{ where the denominator is } 0), \qquad
              w_c = \sum_{ij} \alpha_{c,ij} \mathrm{ReLU}(g_{c,ij}).

    With ``smooth_samples`` set it is SmoothGrad-CAM++ (Omeiza et al. 2019, arXiv:1908.01224).
    """

    name = "gradcampp"

    def weights(self, capture: Capture) -> Tensor:
        g, a = capture.gradients, capture.activations
        squared = g.pow(2)
        denominator = 2 * squared + a.sum(dim=capture.spatial, keepdim=True) * g.pow(3)
        alpha = torch.where(denominator != 0, squared / torch.where(denominator != 0, denominator, 1.0), 0.0)
        return (alpha * torch.relu(g)).sum(dim=capture.spatial)


class XGradCAM(CAM):
    r"""XGrad-CAM: Fu et al., "Axiom-based Grad-CAM: Towards Accurate Visualization and
    Explanation of CNNs", BMVC 2020 (arXiv:2008.02312).

    .. math:: w_c = \sum_{ij} \frac{A_{c,ij}}{\sum_{ab} A_{c,ab} + \epsilon}\, g_{c,ij},
              \quad \epsilon = 10^{-7}.
    """

    name = "xgradcam"
    epsilon = 1e-7

    def weights(self, capture: Capture) -> Tensor:
        a = capture.activations
        share = a / (a.sum(dim=capture.spatial, keepdim=True) + self.epsilon)
        return (share * capture.gradients).sum(dim=capture.spatial)


class HiResCAM(CAM):
    r"""HiResCAM: Draelos & Carin, "Use HiResCAM instead of Grad-CAM for faithful
    explanations of convolutional neural networks", 2020 (arXiv:2011.08891).

    The gradient weighs each position, not each channel:
    :math:`\mathrm{cam} = \mathrm{ReLU}\big(\sum_c g_c \odot A_c\big)`.
    """

    name = "hirescam"

    def weighted_activations(self, capture: Capture) -> Tensor:
        return capture.gradients * capture.activations


class GradCAMElementWise(CAM):
    r"""Grad-CAM, element-wise variant (as in pytorch-grad-cam): the ReLU is taken per
    position and channel before the sum, :math:`\mathrm{cam} = \sum_c \mathrm{ReLU}(g_c \odot A_c)`.
    """

    name = "gradcam_elementwise"

    def weighted_activations(self, capture: Capture) -> Tensor:
        return torch.relu(capture.gradients * capture.activations)


class LayerCAM(CAM):
    r"""LayerCAM: Jiang et al., "LayerCAM: Exploring Hierarchical Class Activation Maps
    for Localization", IEEE TIP 2021.

    :math:`\mathrm{cam} = \mathrm{ReLU}\big(\sum_c \mathrm{ReLU}(g_c) \odot A_c\big)`; suited to
    earlier layers, and to fusing several (``layer=[...]``).
    """

    name = "layercam"

    def weighted_activations(self, capture: Capture) -> Tensor:
        return torch.relu(capture.gradients) * capture.activations


class EigenGradCAM(CAM):
    r"""Eigen-Grad-CAM (as in pytorch-grad-cam): the first principal component of
    :math:`g \odot A`, with the sign fixed as :func:`explain.core.maps.principal_projection` says.
    """

    name = "eigengradcam"

    def weighted_activations(self, capture: Capture) -> Tensor:
        return capture.gradients * capture.activations

    def combine(self, weighted: Tensor) -> Tensor:
        return principal_projection(weighted)


class SegEigenCAM(CAM):
    r"""Seg-Eigen-CAM: Chung & Ying, "Seg-Eigen-CAM: Eigen-Value-Based Visual Explanations for Semantic
    Segmentation Models", Applied Sciences 15(13), 2025 (doi:10.3390/app15137562).

    The first principal component of :math:`|g| \odot A` (the gradient's magnitude weighs each position), its sign
    fixed as the paper's eq. 13 fixes it: flipped where its most negative value is larger in magnitude than its
    most positive; then the ReLU. Made for a segmenter's region (``SegmentationTarget``), it takes any target.
    """

    name = "segeigencam"

    def weighted_activations(self, capture: Capture) -> Tensor:
        return capture.gradients.abs() * capture.activations

    def combine(self, weighted: Tensor) -> Tensor:
        projection = principal_projection(weighted)
        axes = tuple(range(1, projection.dim()))
        flipped = projection.amin(dim=axes, keepdim=True).abs() > projection.amax(dim=axes, keepdim=True).abs()
        return torch.where(flipped, -projection, projection)
