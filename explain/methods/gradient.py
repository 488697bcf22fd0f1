"""Gradient methods: the map weighs the layer's activations A by the target score's gradient g = dy/dA.

Sums run over the spatial positions (i, j) of the layer's map: its every spatial axis, one for a signal, two for an
image, three for a volume or a clip (``capture.spatial``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..core.engine import CAM, INPUT, Capture, Needs
from ..core.layers import LayerSpec, traced_layers
from ..core.maps import normalize_maps, principal_projection, upsample
from ..core.recording import Asking, Layers, Recording
from ..errors import ExplainError, LayerError, TargetError
from ..targets import BoundTarget, ClassTarget, ContrastTarget, Target, TargetLike, as_target


class GradCAM(CAM):
    r"""Grad-CAM: Selvaraju et al., "Grad-CAM: Visual Explanations from Deep Networks
    via Gradient-based Localization", ICCV 2017 (arXiv:1610.02391).

    .. math:: w_c = \frac{1}{hw} \sum_{ij} g_{c,ij}, \qquad
              \mathrm{cam} = \mathrm{ReLU}\Big(\sum_c w_c A_c\Big).
    """

    name = "gradcam"
    title = "Grad-CAM (Selvaraju et al. 2017)"

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
    title = "Grad-CAM++ (Chattopadhyay et al. 2018)"

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
    title = "XGrad-CAM (Fu et al. 2020)"
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
    title = "HiResCAM (Draelos & Carin 2020)"

    def weighted_activations(self, capture: Capture) -> Tensor:
        return capture.gradients * capture.activations


class GradCAMElementWise(CAM):
    r"""Grad-CAM, element-wise variant (as in pytorch-grad-cam): the ReLU is taken per
    position and channel before the sum, :math:`\mathrm{cam} = \sum_c \mathrm{ReLU}(g_c \odot A_c)`.
    """

    name = "gradcam_elementwise"
    title = "Grad-CAM, element-wise ReLU"

    def weighted_activations(self, capture: Capture) -> Tensor:
        return torch.relu(capture.gradients * capture.activations)


class LayerCAM(CAM):
    r"""LayerCAM: Jiang et al., "LayerCAM: Exploring Hierarchical Class Activation Maps
    for Localization", IEEE TIP 2021.

    :math:`\mathrm{cam} = \mathrm{ReLU}\big(\sum_c \mathrm{ReLU}(g_c) \odot A_c\big)`; suited to
    earlier layers, and to fusing several (``layer=[...]``).
    """

    name = "layercam"
    title = "LayerCAM (Jiang et al. 2021)"

    def weighted_activations(self, capture: Capture) -> Tensor:
        return torch.relu(capture.gradients) * capture.activations


class EigenGradCAM(CAM):
    r"""Eigen-Grad-CAM (as in pytorch-grad-cam): the first principal component of
    :math:`g \odot A`, with the sign fixed as :func:`explain.core.maps.principal_projection` says.
    """

    name = "eigengradcam"
    title = "Eigen-Grad-CAM, principal component of g*A"

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
    title = "Seg-Eigen-CAM, principal component of |g|*A (Chung & Ying 2025)"

    def weighted_activations(self, capture: Capture) -> Tensor:
        return capture.gradients.abs() * capture.activations

    def combine(self, weighted: Tensor) -> Tensor:
        projection = principal_projection(weighted)
        axes = tuple(range(1, projection.dim()))
        flipped = projection.amin(dim=axes, keepdim=True).abs() > projection.amax(dim=axes, keepdim=True).abs()
        return torch.where(flipped, -projection, projection)


class ShapleyCAM(CAM):
    r"""ShapleyCAM: Cai et al., "CAMs as Shapley Value-based Explainers", The Visual Computer 2025
    (arXiv:2501.06261).

    A second-order estimate of each activation's Shapley value weighs the channels: the gradient corrected by half
    the Hessian-vector product along the activations,

    .. math:: w_c = \frac{1}{hw} \sum_{ij} \big(g - \tfrac{1}{2} H A\big)_{c,ij}, \qquad
              \mathrm{cam} = \mathrm{ReLU}\Big(\sum_c w_c A_c\Big),

    with :math:`H` the Hessian of the score with respect to the layer's output. Where the score is linear in
    the layer (a ReLU network's last stage before pooling and a linear head) :math:`HA = 0` and ShapleyCAM is
    Grad-CAM. The Hessian-vector product costs a second backward through the head, and needs the head's
    operations to be twice differentiable.
    """

    name = "shapleycam"
    title = "ShapleyCAM, gradient and Hessian (Cai et al. 2025)"
    fast = False
    cost = "a second backward, through the Hessian"
    needs = Needs(curvature=True)

    def backward_rule(self, x: Tensor, model_kwargs: Mapping[str, Any]) -> AbstractContextManager[Any]:
        """Attention by PyTorch's math kernel, whose gradient can be differentiated again (the fused kernels'
        cannot), so that the Hessian reaches through a transformer's attention."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])

    def weights(self, capture: Capture) -> Tensor:
        return (capture.gradients - 0.5 * capture.curvature).mean(dim=capture.spatial)


class RefineCAM(GradCAMPlusPlus):
    r"""RefineCAM (as pytorch-grad-cam's, arXiv:2605.14641): Grad-CAM++ at several layers, each map upsampled to
    the input and normalized to [0, 1], multiplied together: a position stands out only where it stands out at
    every layer, which takes the noise out of early layers' maps. It is Grad-CAM++ with ``fuse="product"``; give
    ``layer`` a list of layers (the automatic layer alone gives its plain Grad-CAM++ map).
    """

    name = "refinecam"
    title = "RefineCAM, Grad-CAM++ maps of layers multiplied"
    fast = False

    def __init__(self, model: nn.Module, layer: LayerSpec | Sequence[str | nn.Module] = None, **options: Any) -> None:
        super().__init__(model, layer, **{"fuse": "product", **options})


BIASED = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm)  # FullGrad's layers: spatial maps with a bias
Scaling = Literal["map", "channel"]


class BiasedLayers(Recording):
    """The input, and the output of every module with a bias that maps the input (FullGrad's terms)."""

    searched = False

    def layers(self, method: Asking, x: Tensor, model_kwargs: Mapping[str, Any], goal: Any) -> Layers:
        """The input, then every module with a bias whose output is a channels-first map of the input.

        Raises:
            LayerError: Such a module runs more than once in a forward (its gradient would mix the calls).
        """
        traced = traced_layers(method.model, x, model_kwargs)
        layers: list[tuple[str, nn.Module | None]] = [(INPUT, None)]
        for name, module in method.model.named_modules():
            info = traced.get(name)
            if not isinstance(module, BIASED) or module.bias is None or info is None or info.layout is None:
                continue
            if info.calls > 1:
                raise LayerError(f"FullGrad needs every bias once per forward; layer {name!r} runs {info.calls} times")
            if info.layout.kind == "channels_first":
                layers.append((name, module))
        return layers



class FullGrad(CAM):
    r"""FullGrad: Srinivas & Fleuret, "Full-Gradient Representation for Neural Network Visualization", NeurIPS 2019
    (arXiv:1905.00780).

    The score's full-gradient decomposition: the input-gradient term plus, for every layer with a bias, the bias
    times its gradient. Each term is post-processed by :math:`\psi` (absolute value, rescaled to [0, 1],
    upsampled), and the channels and layers are summed:

    .. math:: \mathrm{FullGrad} = \psi(\nabla_x S \odot x) + \sum_l \sum_c \psi(b_{l,c}\, \nabla_{z_l} S_c).

    The layers are its own: every convolution and batch norm of the model's rank with a bias (an eval-mode batch
    norm's bias is :math:`\beta - \gamma\mu / \sqrt{\sigma^2 + \epsilon}`); a ``layer`` given is refused. A batch norm
    in training mode has no fixed bias (its statistics are the batch's): refused. ``scaling="map"`` rescales each
    term over all its channels at once, as the paper's code does; ``"channel"`` rescales each channel alone, as
    pytorch-grad-cam does. Upsampling is linear with half-pixel centres (the paper's code aligns corners).

    Args:
        model: Any model explain explains; left as it was.
        layer: None (a layer given is refused: the layers are its own).
        labels: Class names, to accept a class name as target.
        scaling: ``"map"`` or ``"channel"``, as above.
        **options: As for :class:`explain.core.engine.CAM` (``smooth_samples``, ``aug_smooth``, ...).
    """

    name = "fullgrad"
    title = "FullGrad, input and bias gradients (Srinivas & Fleuret 2019)"
    fast = False
    needs = Needs(input_gradient=True, map_of_input=True, records=BiasedLayers())
    reads_layer = False

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec | Sequence[str | nn.Module] = None,
        *,
        labels: Sequence[str] | None = None,
        scaling: Scaling = "map",
        **options: Any,
    ) -> None:
        super().__init__(model, layer, labels=labels, **options)
        if scaling not in ("map", "channel"):
            raise ExplainError(f"scaling must be 'map' or 'channel', got {scaling!r}")
        self.scaling = scaling

    @property
    def layer(self) -> str | None:
        """The input and how many bias layers."""
        return f"{INPUT}+{len(self._layers) - 1} bias layers" if self._layers else None

    @staticmethod
    def bias(module: nn.Module) -> Tensor:
        """A layer's bias per output channel; a batch norm's in eval mode folds its running statistics in.

        Raises:
            LayerError: A batch norm normalizes with the batch's statistics (training mode, or none kept).
        """
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            return module.bias.detach()
        if module.training or module.running_mean is None:
            raise LayerError(
                f"FullGrad: the {type(module).__name__} normalizes with the batch's statistics (training mode), so "
                "it has no fixed bias to decompose the score by; call model.eval() first"
            )
        scale = module.weight.detach() / torch.sqrt(module.running_var + module.eps)
        return module.bias.detach() - module.running_mean * scale

    def compute(self, capture: Capture) -> Tensor:
        if capture.module is None:  # the input-gradient term
            term = capture.x * capture.gradients
        else:
            bias = self.bias(capture.module).float()
            term = bias.view(1, -1, *(1,) * len(capture.spatial)) * capture.gradients
        term = term.abs()
        rank = len(capture.spatial)
        scaled = normalize_maps(term, rank) if self.scaling == "channel" else normalize_maps(term.flatten(1), 1)
        return scaled.view_as(term).sum(dim=1)

    def fused_maps(self, maps: list[Tensor], size: Sequence[int]) -> Tensor:
        """The terms' sum, each upsampled to ``size`` (they are rescaled already)."""
        return torch.stack([upsample(m, size) for m in maps]).sum(dim=0)


class FinerCAM(GradCAM):
    r"""Finer-CAM: Zhang et al., "Finer-CAM: Spotting the Difference Reveals Finer Details for Visual
    Explanation", CVPR 2025 (arXiv:2501.11309).

    Grad-CAM of the explained class against the classes it is most easily taken for: the score is
    :class:`explain.targets.ContrastTarget`'s, :math:`\sum_j p_j (y_c - \alpha y_j) / \sum_j p_j`. The call's
    target (None, a class, one per image, ``topk``) gives the explained classes; a ``ContrastTarget`` is taken as
    it is. Any other method explains a contrast too, given a ``ContrastTarget``.

    Args:
        model: A classifier; left as it was.
        layer: As for :class:`explain.core.engine.CAM`.
        against: The comparison classes (see :class:`explain.targets.ContrastTarget`); None: the look-alikes.
        nearest: How many look-alikes when ``against`` is None.
        alpha: How strongly the comparison classes are subtracted.
        **options: As for :class:`explain.core.engine.CAM`.
    """

    name = "finercam"
    title = "Finer-CAM, a class against its look-alikes (Zhang et al. 2025)"

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec | Sequence[str | nn.Module] = None,
        *,
        against: Any = None,
        nearest: int = 3,
        alpha: float = 1.0,
        **options: Any,
    ) -> None:
        super().__init__(model, layer, **options)
        self.contrast = {"against": against, "nearest": nearest, "alpha": alpha}

    def target_for(self, target: TargetLike, topk: int | None) -> Target | BoundTarget:
        goal = as_target(target, topk)
        if isinstance(goal, (ContrastTarget, BoundTarget)):
            return goal
        if not isinstance(goal, ClassTarget):
            raise TargetError(f"Finer-CAM contrasts a classifier's classes; {type(goal).__name__} gives none")
        return ContrastTarget(goal, **self.contrast)
