"""Models with object queries from HuggingFace ``transformers``, answering as torchvision's models do: detectors
(DETR, Conditional and Deformable DETR, RT-DETR) as torchvision's detectors, so that
:class:`explain.targets.DetectionTarget` explains their queries; open-vocabulary detectors (OWL-ViT, OWLv2) with
fixed text queries, likewise; mask classifiers (MaskFormer, Mask2Former) as
torchvision's segmenters, so that :class:`explain.targets.SegmentationTarget` explains their classes' regions."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import TargetError


class QueryDetector(nn.Module):
    """A HuggingFace object-query detector whose output is torchvision's: one dict per image of ``"boxes"``
    (x1, y1, x2, y2 in input pixels), ``"labels"`` and ``"scores"``, one entry per object query.

    There is no non-maximum suppression: each query is one detection. The scores are the model's own class
    probabilities: a softmax over the classes and the "no object" class, which is dropped, where the logits have
    one more entry than ``config.num_labels`` (DETR); a sigmoid per class otherwise (Conditional and Deformable
    DETR, RT-DETR). A query's label is its most probable class. The model's boxes, (cx, cy, w, h) relative to
    the input, are scaled to its pixels. ``DetectionTarget()`` then explains every query scoring at least its
    ``score_threshold``, each by its score.

    Args:
        model: A ``transformers`` model whose output has ``logits`` (N, queries, classes) and ``pred_boxes``
            (N, queries, 4), as ``DetrForObjectDetection`` and its relatives.

    Raises:
        TargetError: At the first forward, the output has no ``logits`` and ``pred_boxes``.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.labels = _labels(model)

    def forward(self, pixel_values: Tensor) -> list[dict[str, Tensor]]:
        logits, boxes = _read(self.model, pixel_values, "logits", "pred_boxes")
        classes = getattr(getattr(self.model, "config", None), "num_labels", logits.shape[-1])
        probabilities = logits.softmax(dim=-1)[..., :-1] if logits.shape[-1] == classes + 1 else logits.sigmoid()
        return detections(probabilities, boxes, pixel_values)

    def extra_repr(self) -> str:
        return f"queries of a {type(self.model).__name__}"


def detections(probabilities: Tensor, boxes: Tensor, pixel_values: Tensor) -> list[dict[str, Tensor]]:
    """torchvision's detections from queries' class probabilities (N, queries, classes) and boxes (N, queries, 4:
    cx, cy, w, h relative to the input): each query labelled by its most probable class, its box in input pixels."""
    scores, labels = probabilities.max(dim=-1)
    height, width = pixel_values.shape[-2:]
    scale = boxes.new_tensor([width, height, width, height])
    corners = torch.cat([boxes[..., :2] - boxes[..., 2:] / 2, boxes[..., :2] + boxes[..., 2:] / 2], dim=-1)
    return [
        {"boxes": image_boxes * scale, "labels": image_labels, "scores": image_scores}
        for image_boxes, image_labels, image_scores in zip(corners, labels, scores)
    ]


FEATURE_MAP = "layer_norm"  # OWL-ViT's and OWLv2's: the patches' embeddings that the class and box heads read


class TextQueryDetector(nn.Module):
    """An open-vocabulary detector with fixed text queries (HuggingFace's OWL-ViT, OWLv2 and Grounding DINO), whose
    output is torchvision's detectors': one dict per image of ``"boxes"`` (x1, y1, x2, y2 in input pixels),
    ``"labels"`` (the query, an index into :attr:`labels`) and ``"scores"``, one entry per image patch or object
    query.

    Each patch of the image (OWL's) or object query (Grounding DINO's) predicts a box and a logit per query; its
    score for a query is the logit's sigmoid, as the model's own post-processing scores it, and its label its best
    query. Grounding DINO scores every token of one text of several phrases instead: a phrase's logit is the largest
    of its tokens' (``phrases`` gives each one's tokens), as its post-processing takes the largest token score of a
    box. There is no non-maximum suppression: ``DetectionTarget(score_threshold=...)`` explains every box above the
    threshold, each by its score. OWL's automatic layer (:attr:`feature_levels`) is the map of patch embeddings that
    both heads read, the model's ``layer_norm``; the heads themselves, which read each patch on its own, are no map
    of the image to explain.

    Args:
        model: ``OwlViTForObjectDetection``, ``Owlv2ForObjectDetection``, ``GroundingDinoForObjectDetection`` or a
            model answering as they do.
        input_ids: The queries as the model's processor builds them: (queries, L) for OWL, one text (1, L) for
            Grounding DINO.
        attention_mask: Their attention mask, or None.
        queries: The queries' texts (the labels); default ``query 0``, ``query 1``, ...
        phrases: For a model that scores the text's tokens, each query's token positions in the text.

    Raises:
        TargetError: Phrases that are empty or lie outside the text.
    """

    def __init__(
        self,
        model: nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        queries: list[str] | None = None,
        phrases: list[list[int]] | None = None,
    ) -> None:
        super().__init__()
        self.model, self.input_ids, self.attention_mask = model, input_ids, attention_mask
        count = len(phrases) if phrases is not None else len(input_ids)
        self.labels = list(queries) if queries is not None else [f"query {i}" for i in range(count)]
        self.phrases = None if phrases is None else _phrase_matrix(phrases, input_ids.shape[-1])
        norm = getattr(model, FEATURE_MAP, None)
        self.feature_levels = [f"model.{FEATURE_MAP}"] if isinstance(norm, nn.Module) else None

    def forward(self, pixel_values: Tensor) -> list[dict[str, Tensor]]:
        device, n = pixel_values.device, len(pixel_values)
        ids, mask = self.input_ids.to(device), None if self.attention_mask is None else self.attention_mask.to(device)
        if self.phrases is not None:  # one text per image
            ids, mask = ids.expand(n, -1), None if mask is None else mask.expand(n, -1)
        output = self.model(input_ids=ids, pixel_values=pixel_values, attention_mask=mask)
        logits, boxes = getattr(output, "logits", None), getattr(output, "pred_boxes", None)
        if not isinstance(logits, Tensor) or not isinstance(boxes, Tensor):
            raise TargetError(f"{type(self.model).__name__} returns no logits and pred_boxes of text queries")
        if self.phrases is not None:
            tokens = logits[..., : self.phrases.shape[1]].unsqueeze(-2)  # (N, boxes, 1, tokens)
            logits = tokens.masked_fill(~self.phrases.to(device), float("-inf")).amax(dim=-1)
        if logits.shape[-1] != len(self.labels):
            raise TargetError(
                f"{type(self.model).__name__}'s logits score {logits.shape[-1]} text entries, not the "
                f"{len(self.labels)} queries: for a model that scores each token of one text (Grounding DINO), "
                "give each query's tokens (phrases=)"
            )
        return detections(logits.sigmoid(), boxes, pixel_values)

    def extra_repr(self) -> str:
        return f"{len(self.labels)} text queries of a {type(self.model).__name__}"


def phrase_text(queries: Sequence[str]) -> tuple[str, list[tuple[int, int]]]:
    """One text of several queries as Grounding DINO reads it ("a cat. a remote."), and each query's span of
    characters in it."""
    text, spans = "", []
    for query in queries:
        phrase = query.strip().lower()
        spans.append((len(text), len(text) + len(phrase)))
        text += f"{phrase}. "
    return text.rstrip(), spans


def phrase_tokens(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Each span's tokens: the positions of the tokens (their character ``offsets`` in the text, a fast tokenizer's
    ``offset_mapping``; special tokens at (0, 0)) that lie within it.

    Raises:
        TargetError: A span that no token lies in.
    """
    found = [[i for i, (a, b) in enumerate(offsets) if b > a and start <= a and b <= end] for start, end in spans]
    empty = [k for k, positions in enumerate(found) if not positions]
    if empty:
        raise TargetError(f"queries {empty} have no tokens of their own in the text")
    return found


def _phrase_matrix(phrases: list[list[int]], length: int) -> Tensor:
    """Which of the text's ``length`` tokens each phrase holds, (phrases, length).

    Raises:
        TargetError: A phrase that is empty or names a token outside the text.
    """
    matrix = torch.zeros(len(phrases), length, dtype=torch.bool)
    for k, positions in enumerate(phrases):
        if not positions or not all(0 <= p < length for p in positions):
            raise TargetError(f"phrase {k} has tokens {list(positions)}, not tokens of the text's {length}")
        matrix[k, list(positions)] = True
    return matrix


class QuerySegmenter(nn.Module):
    """A HuggingFace mask classifier (MaskFormer, Mask2Former) whose output is a semantic segmenter's: a dict
    whose ``"out"`` holds per-class scores (N, classes, H, W) at the input's size.

    Each query predicts a class distribution and a mask. As the model's semantic post-processing defines it,
    a class's score at a pixel is the sum over the queries of the class's probability (a softmax whose last
    entry, "no object", is dropped) times the query's mask probability (a sigmoid of its mask logits,
    upsampled bilinearly to the input). The output is the logarithm of these scores. So its argmax is the
    model's segmentation, its softmax each class's share of a pixel, and ``SegmentationTarget`` sums the
    log-scores of a class over its region, as it sums a segmenter's logits.

    The automatic layer is the pixel decoder's mask features (:attr:`feature_levels`), the map of per-pixel
    embeddings that every query's mask is made from: the decode head's input, at a quarter of the input's size.

    Args:
        model: A ``transformers`` model whose output has ``class_queries_logits`` (N, queries, classes + 1) and
            ``masks_queries_logits`` (N, queries, h, w), as ``Mask2FormerForUniversalSegmentation``.

    Raises:
        TargetError: At the first forward, the output lacks them.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.labels = _labels(model)
        projections = [
            name for name, _ in model.named_modules() if name.endswith("pixel_level_module.decoder.mask_projection")
        ]
        self.feature_levels = [f"model.{projections[0]}"] if len(projections) == 1 else None

    def forward(self, pixel_values: Tensor) -> dict[str, Tensor]:
        classes, masks = _read(self.model, pixel_values, "class_queries_logits", "masks_queries_logits")
        masks = F.interpolate(masks, size=pixel_values.shape[-2:], mode="bilinear", align_corners=False)
        scores = torch.einsum("nqc,nqhw->nchw", classes.softmax(dim=-1)[..., :-1], masks.sigmoid())
        return {"out": scores.clamp_min(torch.finfo(scores.dtype).tiny).log()}

    def extra_repr(self) -> str:
        return f"masks of a {type(self.model).__name__}"


def _labels(model: nn.Module) -> list[str] | None:
    """The class names in the model's config, in index order, or None."""
    labels = getattr(getattr(model, "config", None), "id2label", None)
    return [labels[i] for i in sorted(labels)] if labels else None


def _read(model: nn.Module, pixel_values: Tensor, *names: str) -> tuple[Tensor, ...]:
    """The named tensors of the model's output for ``pixel_values``.

    Raises:
        TargetError: The output lacks one of them.
    """
    output = model(pixel_values=pixel_values)
    found = tuple(getattr(output, name, None) for name in names)
    if not all(isinstance(value, Tensor) for value in found):
        raise TargetError(
            f"{' and '.join(names)} are read from the model's output; {type(model).__name__} returns a "
            f"{type(output).__name__} without them"
        )
    return found
