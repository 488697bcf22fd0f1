"""Deep Feature Factorization: a layer's activations over a batch factorized into concepts, each a map per image
and a vector of the layer's channels that the model's head scores like a feature."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..concepts.factorization import factorize
from ..core.engine import CAM, Capture, Needs, check_images
from ..core.layers import LayerSpec
from ..core.maps import normalize_maps, upsample
from ..core.model_state import exclusive, untouched
from ..core.runner import PassRunner
from ..errors import ExplainError, LayerError
from ..targets import as_target
from .activation import classifier_over


@dataclass(frozen=True)
class FactorizedConcepts:
    """A batch's activations factorized into K concepts.

    Attributes:
        maps: Each concept's map per image, (N, K, *spatial), each normalized to [0, 1] (at the input's size from
            :meth:`DeepFeatureFactorization.concepts`).
        vectors: Each concept as a vector of the layer's channels, (K, C): the factor W plus each channel's
            minimum, which was taken off to make the activations non-negative.
        scores: The model's head on each concept's vector, (K, classes): what class each concept stands for.
        layer: The factorized layer's name.
    """

    maps: Tensor
    vectors: Tensor
    scores: Tensor
    layer: str


class DeepFeatureFactorization(CAM):
    r"""Deep Feature Factorization: Collins, Achanta & Süsstrunk, "Deep Feature Factorization for Concept
    Discovery", ECCV 2018 (arXiv:1806.10206), as pytorch-grad-cam's ``DeepFeatureFactorization``.

    The activations of the whole batch, positions as columns, :math:`V \in \mathbb{R}^{C \times N h w}`, each
    channel shifted by its minimum to be non-negative, are factorized as :math:`V \approx W H` by non-negative
    matrix factorization into K concepts (:func:`explain.concepts.factorization.factorize`, the one NMF of the
    package, CRAFT's too: multiplicative updates from the NNDSVDa start, every iteration run; pytorch-grad-cam runs
    scikit-learn's coordinate descent). A row of H
    is a concept's map over the images; a column of W plus the minima is its vector, which the model's last
    linear layer scores. :meth:`concepts` returns them all, and :func:`explain.io.render.concept_figure` draws
    them. As a method of ``explain.METHODS``, each image's map is that of the concept whose score ranks the
    explained class highest.

    Args:
        model: A classifier ending in global pooling and one linear layer over the target layer's channels.
        layer: The layer to factorize (None: automatic).
        labels: Class names, to accept a class name as target.
        concepts: K, how many concepts.
        iterations: Multiplicative updates.
        **options: The engine's options (``seed``: the random start).
    """

    name = "dff"
    title = "Deep Feature Factorization, NMF concepts (Collins et al. 2018)"
    fast = False
    needs = Needs(gradients=False)
    relu = False

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec | Sequence[str | nn.Module] = None,
        *,
        labels: Sequence[str] | None = None,
        concepts: int = 5,
        iterations: int = 200,
        **options: Any,
    ) -> None:
        super().__init__(model, layer, labels=labels, **options)
        if concepts < 1 or iterations < 1:
            raise ExplainError(f"concepts and iterations must be at least 1, got {concepts} and {iterations}")
        self.k, self.iterations = concepts, iterations

    def factorized(self, activations: Tensor, name: str) -> FactorizedConcepts:
        """The concepts of one layer's activations (N, C, *spatial), maps at the layer's resolution."""
        n, channels, *spatial = activations.shape
        if self.k > activations[:, 0].numel():
            raise LayerError(
                f"Deep Feature Factorization asked for {self.k} concepts of the {activations[:, 0].numel()} positions "
                f"of layer {name}: ask for fewer concepts (concepts=), or give more or larger images"
            )
        v = activations.detach().double().nan_to_num(0.0).transpose(0, 1).reshape(channels, -1)
        offset = v.amin(dim=1, keepdim=True)
        found = factorize(lambda: [(v - offset).T], self.k, self.iterations, tol=0.0)  # positions x channels
        w, h = found.bank.T, found.coefficients.T
        vectors = (w + offset).T.float()  # (K, C)
        head = classifier_over(self.model, channels, "Deep Feature Factorization")
        with torch.no_grad():
            scores = head(vectors.to(head.weight.dtype)).float()
        maps = h.reshape(self.k, n, *spatial).transpose(0, 1).float()
        return FactorizedConcepts(normalize_maps(maps, len(spatial)), vectors, scores, name)

    def compute(self, capture: Capture) -> Tensor:
        if capture.classes is None:
            raise LayerError("Deep Feature Factorization picks the concept of a classifier's class; give one")
        found = capture.once(
            f"dff:{capture.name}", lambda: self.factorized(capture.activations, capture.name)
        )
        best = found.scores[:, capture.classes].argmax(dim=0)  # per image: the concept that ranks its class highest
        return found.maps[torch.arange(len(best)), best]

    def concepts(self, x: Tensor, model_kwargs: Mapping[str, Any] | None = None) -> FactorizedConcepts:
        """All K concepts of a batch, their maps upsampled to the input's size and normalized per map.

        Raises:
            LayerError: More than one target layer.
        """
        check_images(x)
        kwargs = dict(model_kwargs or {})
        generator = None if self.seed is None else torch.Generator(device=x.device).manual_seed(self.seed)
        with exclusive(self.model), untouched(self.model), torch.inference_mode(False), torch.no_grad():
            runner = PassRunner(self, x, as_target(None), kwargs, generator)
            self._layers = runner.layers
            if len(self._layers) != 1:
                raise LayerError(f"Deep Feature Factorization factorizes one layer, not {self.layer}")
            recorded = runner.record(x.detach(), as_target(None))
        name = self._layers[0][0]
        found = self.factorized(recorded.activations[name], name)
        size = x.shape[2:]
        return FactorizedConcepts(
            normalize_maps(upsample(found.maps, size), len(size)), found.vectors, found.scores, name
        )
