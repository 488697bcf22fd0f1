"""What vision-language models see: the map of every token of an answer, from one forward over the prompt and the
answer (teacher forcing) and one backward per token; and the map of every text prompt of a CLIP-style model."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core.layers import LayerSpec
from ..core.result import CAMResult
from ..errors import ExplainError
from ..methods import create_method
from ..models.image_readings import image_token_id
from ..models.query_models import TextQueryDetector
from ..models.vision_language import (
    Reading,
    TextPrompts,
    VisionLanguage,
    answered,
    generate_answer,
    image_reading,
    text_inputs,
)
from ..targets.classification import ClassesTarget
from ..targets.detection import DetectionTarget
from ..targets.language import TokenTarget


@dataclass(frozen=True)
class AnswerMaps:
    """The maps of an answer, one per word (or per token, where no decode was given).

    Attributes:
        prompt: The prompt's token ids (P,), its image tokens included.
        answer: The answer's token ids (A,): generated (greedy), or given.
        words: Each word's text (each token's id as text, without a decode).
        tokens: How many tokens each word takes, in order.
        maps: Each word's map over the image (W, H, W), normalized: of its tokens' summed log-probabilities.
        result: The call's result: ``result.probabilities`` holds each word's probability given what precedes
            it, ``result.layer`` the layer.
        whole: The map of the whole answer (the sum of its tokens' log-probabilities), (H, W), where asked.
    """

    prompt: Tensor
    answer: Tensor
    words: list[str]
    tokens: list[int]
    maps: Tensor
    result: CAMResult
    whole: Tensor | None = None

    def captions(self) -> list[str]:
        """One line per word: its place, its text and its probability given what precedes it."""
        probabilities = self.result.probabilities.reshape(-1).tolist()
        return [f"{i}: {word!r} {p:.1%}" for i, (word, p) in enumerate(zip(self.words, probabilities))]

    def _repr_html_(self) -> str:
        """The answer as a strip of its words, each with its map on the image: how Jupyter shows it."""
        from ..io.render import html_grid

        return html_grid(self.result.pictures(), self.captions())


SCORE_TOLERANCE = 1e-4  # the largest difference of a word's probability, teacher-forced or generated


def explain_answer(
    model: nn.Module,
    inputs: Mapping[str, Tensor],
    *,
    answer: Tensor | Sequence[int] | None = None,
    max_new_tokens: int = 16,
    decode: Callable[[list[int]], str] | None = None,
    method: str = "gradcam",
    layer: LayerSpec = None,
    whole: bool = False,
    **options: Any,
) -> AnswerMaps:
    """Explain each word of a vision-language model's answer to a prompt about one image.

    The answer is the model's own (greedy, at most ``max_new_tokens``), or the one given. A word's score is its
    tokens' summed log-probability given the image, the prompt and the answer before it, all tokens scored in one
    forward over the whole sequence; the K axis of the call holds the words (see
    :class:`explain.targets.TokenTarget`). A token whose text begins with a space, in the answer decoded so far,
    begins a word; without a decode each token is one.
    A generated answer's scores in that forward must be those generation gave it: where they differ (the model
    reads an input the call does not pass), the call is refused.

    Args:
        model: A HuggingFace image-text-to-text model (LLaVA 1.5, PaliGemma, Qwen2-VL, Qwen2.5-VL and their kind,
            see :mod:`explain.models.vision_language`), left as it was.
        inputs: The model's processor's output for one image and one prompt: ``pixel_values`` (1, 3, H, W), or
            Qwen2-VL's patches with their ``image_grid_thw``; ``input_ids`` (1, P) with its image tokens; and
            ``attention_mask``, ``token_type_ids`` and ``mm_token_type_ids`` where it gives them. The maps are of
            the picture the model reads, (H, W) (Qwen2-VL's put back together from its patches).
        answer: The answer's token ids to explain instead of the model's own.
        max_new_tokens: The longest answer generated.
        decode: Turns token ids into their text (a tokenizer's ``decode``), for ``words``.
        method: Any method that takes a target (``explain.METHODS``).
        layer: The layer (None: the automatic one, the last map of the image before the language model).
        whole: Also map the whole answer.
        **options: The method's options.

    Raises:
        ExplainError: More than one image, an empty answer, a model of no supported kind, or scores that are not
            generation's.
    """
    prompt, text, reading = _one_image(model, inputs)
    picture = reading.picture(inputs)
    answer, generated = _answer_of(model, inputs, answer, max_new_tokens)
    read, sequence, positions = answered(model, text, answer)
    words, runs = words_of(answer, decode)
    explainer = create_method(method, VisionLanguage(model, read, reading), layer, **options)
    result = explainer(picture, TokenTarget(sequence, positions, runs))
    if generated is not None:
        _check_generated(result.probabilities.reshape(-1).log(), generated, runs)
    maps = result.cams.reshape(len(words), *result.cams.shape[-2:])
    total = explainer(picture, TokenTarget(sequence, positions, "sum")).cams[0] if whole else None
    return AnswerMaps(prompt.reshape(-1), answer, words, runs, maps, result, total)


def _answer_of(
    model: nn.Module, inputs: Mapping[str, Tensor], answer: Tensor | Sequence[int] | None, max_new_tokens: int
) -> tuple[Tensor, Tensor | None]:
    """The answer's ids (A,): the one given, or the model's own with generation's log-probabilities.

    Raises:
        ExplainError: The answer is empty, or holds the image token.
    """
    generated = None
    if answer is None:
        answer, generated = generate_answer(model, inputs, max_new_tokens)
    answer = torch.as_tensor(answer, device=inputs["input_ids"].device).reshape(-1)
    if not len(answer):
        raise ExplainError("the answer is empty: nothing to explain (the model ended at once; give answer=)")
    if bool((answer == image_token_id(model)).any()):
        raise ExplainError(
            f"the answer holds the image token (id {image_token_id(model)}), which the model reads as a place of "
            "the image: explain another answer (answer=)"
        )
    return answer, generated


def words_of(answer: Tensor, decode: Callable[[list[int]], str] | None) -> tuple[list[str], list[int]]:
    """The answer's words and how many tokens each takes: a token whose text, in the answer decoded so far, begins
    with a space begins a word. Without a decode, each token is a word, named by its id."""
    if decode is None:
        return [str(int(token)) for token in answer], [1] * len(answer)
    words: list[str] = []
    runs: list[int] = []
    before = ""
    for k in range(len(answer)):
        text = decode(answer[: k + 1].tolist())
        piece = text[len(before) :] if text.startswith(before) else decode([int(answer[k])])
        if not runs or piece[:1].isspace():
            words.append(piece.strip())
            runs.append(1)
        else:
            words[-1] += piece
            runs[-1] += 1
        before = text
    return words, runs


def _one_image(model: nn.Module, inputs: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor], Reading]:
    """The prompt's ids, the text's inputs and how the model reads the image, of a processor's output for one image
    and one prompt.

    Raises:
        ExplainError: More than one prompt, or an image the model reads in a way explain does not.
    """
    prompt = inputs["input_ids"]
    if prompt.reshape(-1, prompt.shape[-1]).shape[0] != 1:
        raise ExplainError("explain_answer explains one image and one prompt: input_ids (1, P)")
    return prompt, text_inputs(inputs), image_reading(model, inputs)


def _check_generated(scored: Tensor, generated: Tensor, runs: list[int]) -> None:
    """The answer's words' probabilities in the explained forward must be generation's (its tokens' log-
    probabilities summed over each word's run), within :data:`SCORE_TOLERANCE`.

    Raises:
        ExplainError: They differ: the forward does not read the text as generation did.
    """
    generated = torch.stack([part.sum() for part in generated.to(scored).split(runs)])
    worst = float((scored.exp() - generated.exp()).abs().max())
    if worst > SCORE_TOLERANCE:
        raise ExplainError(
            f"the explained forward scores the generated answer otherwise than generation did (probabilities "
            f"{worst:.3g} apart): the model reads an input of the prompt that was not given; pass the processor's "
            "whole output (its attention_mask and token_type_ids too)"
        )


def explain_prompts(
    model: nn.Module,
    pixel_values: Tensor,
    input_ids: Tensor,
    *,
    prompts: Sequence[str] | None = None,
    attention_mask: Tensor | None = None,
    method: str = "gradcam",
    layer: LayerSpec = None,
    **options: Any,
) -> CAMResult:
    """Map each text prompt on each image of a contrastive image-text model (CLIP, SigLIP).

    The score of a prompt is the model's logit of the image against it (its scaled similarity); every prompt's
    map comes from one forward, in the order given (the K axis).

    Args:
        model: HuggingFace's ``CLIPModel``, ``SiglipModel`` or their kind (see
            :class:`explain.models.vision_language.TextPrompts`), left as it was.
        pixel_values: The images as the model's processor prepares them, (N, 3, H, W).
        input_ids: The prompts as the model's tokenizer builds them, (prompts, L).
        prompts: The prompts' texts, the result's labels.
        attention_mask: The prompts' attention mask, or None.
        method: Any method that takes a target (``explain.METHODS``).
        layer: The layer (None: the automatic one).
        **options: The method's options.
    """
    labels = list(prompts) if prompts is not None else [f"prompt {i}" for i in range(len(input_ids))]
    explainer = create_method(method, TextPrompts(model, input_ids, attention_mask), layer, labels=labels, **options)
    return explainer(pixel_values, ClassesTarget(range(len(labels))))


def explain_queries(
    model: nn.Module,
    pixel_values: Tensor,
    input_ids: Tensor,
    *,
    queries: Sequence[str] | None = None,
    attention_mask: Tensor | None = None,
    phrases: Sequence[Sequence[int]] | None = None,
    score_threshold: float = 0.1,
    method: str = "gradcam",
    layer: LayerSpec = None,
    **options: Any,
) -> CAMResult:
    """Map each box an open-vocabulary detector (OWL-ViT, OWLv2, Grounding DINO) finds for text queries.

    Each image patch's box scoring at least ``score_threshold`` for its best query is one detection, explained by
    that score (see :class:`explain.models.TextQueryDetector`); the result's ``target.boxes`` hold the boxes in the
    input's pixels, ``class_indices`` the queries.

    Args:
        model: ``OwlViTForObjectDetection``, ``Owlv2ForObjectDetection`` or their kind, left as it was.
        pixel_values: The images as the model's processor prepares them, (N, 3, H, W).
        input_ids: The queries as the model's processor builds them: (queries, L) for OWL; one text of them all
            (1, L) for Grounding DINO ("a cat. a remote.").
        queries: The queries' texts, the result's labels.
        attention_mask: The queries' attention mask, or None.
        phrases: For a model that scores each token of the text (Grounding DINO), each query's token positions
            (see :func:`explain.models.query_models.phrase_tokens`).
        score_threshold: The least score of an explained box.
        method: Any method that takes a target (``explain.METHODS``).
        layer: The layer (None: the automatic one).
        **options: The method's options.
    """
    spans = None if phrases is None else [list(p) for p in phrases]
    detector = TextQueryDetector(model, input_ids, attention_mask, None if queries is None else list(queries), spans)
    explainer = create_method(method, detector, layer, labels=detector.labels, **options)
    return explainer(pixel_values, DetectionTarget(score_threshold=score_threshold))
