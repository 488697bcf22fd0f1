"""What a CAM call returns, and how it shows itself: a grid of overlays in Jupyter, a matplotlib figure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ..targets import BoundTarget

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from PIL import Image


@dataclass(frozen=True)
class CAMResult:
    """What one CAM call found.

    With ``topk=K`` every per-target field gains a K axis after the batch axis.

    Attributes:
        cams: Heatmaps, (N, H, W) float32 for images, (N, *spatial) for signals,
            volumes and clips, post-processed as asked (resized to the input and/or
            min-max normalized to [0, 1]). Guided Backpropagation gives maps shaped
            as the input instead, (N, C, H, W).
        raw: The maps before resizing and normalization: at feature resolution,
            (N, h, w); at input resolution when several layers are fused or
            ``aug_smooth`` is on (each part is then normalized before combining).
        class_indices: The explained class per image, (N,), or None for a callable target.
        scores: The explained score (model output) per image, (N,).
        probabilities: Softmax probability of the explained class, (N,), or None for a
            callable target.
        logits: The model output, (N, classes), or None when it is not a tensor (a
            callable target read it).
        layer: Dotted name of the target layer (names joined by ``+`` when fused).
        method: Name of the CAM method.
        target: The target as bound on the call's plain pass (it scores any output of the call's images).
        completeness: For Integrated Gradients and DeepLift, how far the attributions' sum is from the score's
            change from the baseline, per image (and target): sum(R) - (S(x) - S(baseline)); for the relevance
            propagations (LRP, AttnLRP, CP-LRP), how far the input's relevance is from the 1 it starts from at the
            score: sum(R) - 1; None for other methods.
        inputs: The call's inputs, what the maps are drawn on when the result shows itself; None when unknown.
        labels: The class names the method was given, for the captions; None: class numbers.
    """

    cams: Tensor
    raw: Tensor
    class_indices: Tensor | None
    scores: Tensor
    probabilities: Tensor | None
    logits: Tensor | None
    layer: str
    method: str
    target: BoundTarget
    completeness: Tensor | None = None
    inputs: Tensor | None = None
    labels: Sequence[str] | None = None

    def shown(self) -> list[tuple[int, int]]:
        """Which maps there are to show: (image, target) pairs, in order; a detector's padding entries left out."""
        n = self.cams.shape[0]
        k = self.cams.shape[1] if self.target.keeps_k else 1
        valid = self.target.valid
        return [(i, j) for i in range(n) for j in range(k) if valid is None or bool(valid[i, j])]

    def captions(self) -> list[str]:
        """One line per shown map (see :meth:`shown`): its class and probability, the method and the layer."""
        lines = []
        for i, j in self.shown():
            pick = (i, j) if self.target.keeps_k else (i,)
            if self.class_indices is None:
                what = f"score {float(self.scores[pick]):.3g}"
            else:
                index = int(self.class_indices[pick])
                what = self.labels[index] if self.labels is not None else f"class {index}"
                if self.probabilities is not None:
                    what += f" {float(self.probabilities[pick]):.1%}"
            lines.append(f"{i}: {what} · {self.method} · {self.layer}")
        return lines

    def pictures(self, alpha: float = 0.5, colormap: str = "jet") -> list[Image.Image]:
        """Each shown map drawn on its input, in the order of :meth:`captions`.

        An image's map is overlaid on the image, its channels min-max scaled: the model's normalization is not
        known here. A volume's or clip's map is drawn on the slice or frame of its peak. A signal's map is a
        coloured band. Without the inputs, the maps alone are drawn.
        """
        from ..io.render import map_picture

        maps = self.cams.detach().cpu().float()
        inputs = None if self.inputs is None else self.inputs.detach().cpu().float()
        return [
            map_picture(
                maps[i, j] if self.target.keeps_k else maps[i], None if inputs is None else inputs[i], alpha, colormap
            )
            for i, j in self.shown()
        ]

    def _repr_html_(self) -> str:
        """The overlays in a grid, each under its caption: how Jupyter shows a result."""
        from ..io.render import html_grid

        return html_grid(self.pictures(), self.captions())

    def show(self, columns: int = 4, alpha: float = 0.5, colormap: str = "jet") -> Figure:
        """The overlays as one matplotlib figure, each under its caption (see :meth:`pictures`).

        Args:
            columns: Pictures per row.
            alpha: Weight of the heatmap over the input.
            colormap: A matplotlib colormap name.

        Returns:
            The figure; Jupyter draws it where it is the cell's last value.
        """
        from ..io.render import panel_figure

        panels = dict(zip(self.captions(), self.pictures(alpha, colormap)))
        return panel_figure(panels, f"{self.method} · {self.layer}", columns=min(columns, len(panels)))


def make_result(
    cams: Tensor,
    raw: Tensor,
    output: Any,
    scores: Tensor,
    bound: BoundTarget,
    layer: str | None,
    method: str,
    inputs: Tensor,
    labels: Sequence[str] | None,
) -> CAMResult:
    """A :class:`CAMResult` from per-target (N, K, ...) tensors; the K axis is dropped unless the target keeps it."""

    def per_target(t: Tensor | None) -> Tensor | None:
        return t if t is None or bound.keeps_k else t[:, 0]

    return CAMResult(
        cams=per_target(cams),
        raw=per_target(raw),
        class_indices=per_target(bound.classes),
        scores=per_target(scores.detach()),
        probabilities=per_target(bound.probabilities),
        logits=output.detach() if isinstance(output, Tensor) else None,
        layer=layer or "",
        method=method,
        target=bound,
        inputs=inputs.detach(),
        labels=labels,
    )
