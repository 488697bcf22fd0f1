"""The CAM engine: one base class that owns hooks, model state, targets and post-processing.

A method subclasses :class:`CAM` and supplies only its formula: the channel
weights (:meth:`CAM.weights`), or its whole map (:meth:`CAM.compute`).

One call costs one forward pass plus a backward pass through the part of the
network after the target layer: parameters' gradients are switched off for the
call, so autograd records nothing before the layer and computes no weight
gradient (see :mod:`explain.hooks`). All map arithmetic is batched torch on the
input's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import ExplainError, LayerError, TargetError
from .hooks import ActivationGradientRecorder
from .layers import LayerSpec, auto_layer, resolve_layer
from .model_state import untouched
from .targets import Target, select_scores


@dataclass(frozen=True)
class CAMResult:
    """What one CAM call found.

    With ``topk=K`` every per-target field gains a K axis after the batch axis.

    Attributes:
        cams: Heatmaps, (N, H, W) float32, post-processed as asked (resized to the
            input and/or min-max normalized to [0, 1]).
        raw: The maps at feature resolution before resizing and normalization, (N, h, w).
        class_indices: The explained class per image, (N,), or None for a callable target.
        scores: The explained score (model output) per image, (N,).
        probabilities: Softmax probability of the explained class, (N,), or None for a
            callable target.
        logits: The model output, (N, classes), or None when it is not a tensor (a
            callable target read it).
        layer: Dotted name of the target layer.
        method: Name of the CAM method.
    """

    cams: Tensor
    raw: Tensor
    class_indices: Tensor | None
    scores: Tensor
    probabilities: Tensor | None
    logits: Tensor | None
    layer: str
    method: str


def normalize_maps(maps: Tensor) -> Tensor:
    """Min-max normalize each map over its last two axes to [0, 1]; a flat map becomes zeros."""
    low = maps.amin(dim=(-2, -1), keepdim=True)
    span = maps.amax(dim=(-2, -1), keepdim=True) - low
    return torch.where(span > 0, (maps - low) / span.clamp_min(torch.finfo(maps.dtype).tiny), 0.0)


def postprocess(raw: Tensor, size: Sequence[int] | None, normalize: bool) -> Tensor:
    """Upsample maps (..., h, w) bilinearly to ``size`` (if given), then normalize (if asked)."""
    maps = raw
    if size is not None:
        flat = raw.reshape(-1, 1, *raw.shape[-2:])
        resized = F.interpolate(flat, size=tuple(size), mode="bilinear", align_corners=False)
        maps = resized.reshape(*raw.shape[:-2], *resized.shape[-2:])
    return normalize_maps(maps) if normalize else maps


class CAM:
    """Base class of the class activation map methods.

    Holds the model and the target layer (resolved once); each call hooks the
    layer for its own duration only, so the model carries no hook between calls.
    After every call, successful or not, the model has the same ``training`` flags, ``requires_grad`` flags, ``.grad``
    tensors and buffers as before. In train mode the forward runs as in training
    (BatchNorm uses batch statistics, Dropout drops), but running statistics are
    restored afterwards.

    Args:
        model: A classifier returning (N, classes) scores.
        layer: The target layer: dotted name, module, or None to pick the last
            layer that outputs a spatial map (found with one extra forward of one
            image, the first time a model sees an input shape).
        labels: Class names, to accept a class name as target.
    """

    name = "cam"

    def __init__(self, model: nn.Module, layer: LayerSpec = None, *, labels: Sequence[str] | None = None) -> None:
        self.model = model
        self.labels = list(labels) if labels is not None else None
        self._layer = resolve_layer(model, layer) if layer is not None else None

    @property
    def layer(self) -> str | None:
        """Dotted name of the target layer (None until an automatic layer is found)."""
        return self._layer[0] if self._layer else None

    def weights(self, activations: Tensor, gradients: Tensor) -> Tensor:
        """Channel weights (N, C) from activations and gradients (N, C, h, w)."""
        raise NotImplementedError(f"{type(self).__name__} defines neither weights() nor compute()")

    def compute(self, activations: Tensor, gradients: Tensor) -> Tensor:
        """The raw map (N, h, w): ReLU of the weighted sum of activation channels."""
        weights = self.weights(activations, gradients)
        return torch.relu(torch.einsum("nc,nchw->nhw", weights, activations))

    def __call__(
        self,
        x: Tensor,
        target: Target = None,
        *,
        topk: int | None = None,
        resize: bool = True,
        normalize: bool = True,
    ) -> CAMResult:
        """Explain a batch.

        Args:
            x: Normalized images (N, 3, H, W); a caller's ``no_grad`` or
                ``inference_mode`` does not matter.
            target: What to explain, see :func:`explain.targets.select_scores`.
            topk: Explain each image's K top classes instead of one target.
            resize: Upsample the maps to (H, W); else keep the feature resolution.
            normalize: Min-max normalize each map to [0, 1]; else keep raw values.

        Returns:
            A :class:`CAMResult` whose tensors are on ``x``'s device.
        """
        if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ExplainError(f"x must be a float tensor of images (N, C, H, W), got {shape}")
        if self._layer is None:
            self._layer = auto_layer(self.model, x)
        name, module = self._layer
        with untouched(self.model), torch.inference_mode(False), torch.enable_grad():
            images = x.clone() if x.is_inference() else x.detach()
            with ActivationGradientRecorder({name: module}) as recorder:
                output = recorder.forward(self.model, images)
                activations = recorder.activations[name]
                if activations.dim() != 4:
                    raise LayerError(
                        f"layer {name!r} outputs shape {tuple(activations.shape)}; "
                        "a CAM needs a (N, C, H, W) feature map"
                    )
                scores, indices = select_scores(output, target, self.labels, topk)
                if scores.shape[0] != x.shape[0]:
                    raise TargetError(f"{scores.shape[0]} target scores for a batch of {x.shape[0]} images")
                activations = activations.float()
                raw = torch.stack(
                    [
                        self.compute(activations, recorder.backward(scores[:, k].sum())[name].float())
                        for k in range(scores.shape[1])
                    ],
                    dim=1,
                )
        logits = output.detach() if isinstance(output, Tensor) else None
        probabilities = None if indices is None else logits.float().softmax(dim=1).gather(1, indices)
        cams = postprocess(raw, x.shape[-2:] if resize else None, normalize)

        def per_target(t: Tensor | None) -> Tensor | None:
            return t if t is None or topk is not None else t[:, 0]

        return CAMResult(
            cams=per_target(cams),
            raw=per_target(raw),
            class_indices=per_target(indices),
            scores=per_target(scores.detach()),
            probabilities=per_target(probabilities),
            logits=logits,
            layer=name,
            method=self.name,
        )
