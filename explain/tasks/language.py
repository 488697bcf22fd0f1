"""The kinds of output of vision-language models: the words of an answer, the text prompts of a contrastive
model, the boxes of an open-vocabulary detector's text queries. Each task turns an image and what was asked of
it into its words, each with its map over the whole image.

The image reaches the model whole: its processor resizes it to the model's input size without a centre crop, so
that every map covers the whole picture it is drawn on. An OWLv2 processor pads the image to a square at its
bottom and right first: the maps are cut back to the image, and the boxes scaled by the square's side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from PIL import Image

from ..errors import ExplainError
from ..models.query_models import phrase_text, phrase_tokens
from ..models.text_image import TextImageSpec
from ..models.tiles import ROWS_AND_COLUMNS
from ..targets import Target
from .answers import explain_answer, explain_prompts, explain_queries
from .asked import NEW_TOKENS, Asked, slug
from .base import Task

LayerChoice = str | Sequence[str] | None


@dataclass(frozen=True)
class WordsRequest:
    """What to explain and how to draw it.

    Attributes:
        prompt: The question to a model that answers, or None.
        answer: The answer to explain instead of the model's own, or None.
        texts: The text prompts of a contrastive model, or the text queries of a detector (empty for a model that
            answers).
        max_new_tokens: The longest answer generated.
        method: The method's name.
        alpha: The heatmap's opacity.
        colormap: The heatmap's colours.
        score_threshold: A detector's least score of an explained box.
        layer: The layer (None: the automatic one).
        method_options: The method's options (``fuse``, ``smooth_samples``, ...; see :class:`explain.CAM`).
    """

    prompt: str | None
    answer: str | None
    texts: Sequence[str]
    max_new_tokens: int = NEW_TOKENS
    method: str = "gradcam"
    alpha: float = 0.5
    colormap: str = "jet"
    score_threshold: float = 0.1
    layer: str | Sequence[str] | None = None
    method_options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Word:
    """One explained word, prompt or box of an image.

    Attributes:
        text: The word, the prompt, or the box's query.
        cam: Its map over the whole image, in [0, 1].
        score: Its probability (a word), the image's logit against it (a prompt), or the box's score.
        box: The box (x1, y1, x2, y2) in the image's pixels, or None.
    """

    text: str
    cam: torch.Tensor
    score: float
    box: list[float] | None = None


class WordsTask(Task):
    """A vision-language model's kind of output: what it reads besides the image, and its words' maps.

    Attributes:
        does: What the model does, as a refusal says it.
        asks: The option that gives what it reads.
        question: Whether it reads a question (else text prompts or queries).
    """

    does: ClassVar[str]
    asks: ClassVar[str]
    question: ClassVar[bool] = False
    called = "vision-language"
    click = "word"
    click_label = "Click a word to see where the model looked"
    takes = frozenset({"reading"})
    strip = "words"
    one_method = True

    def check(self, spec: TextImageSpec, asked: Asked) -> None:
        """As every task's, and what the model reads: a question to a model that answers, text prompts or queries
        to another.

        Raises:
            ExplainError: A question to a model of text prompts, or the reverse, or nothing to read.
        """
        super().check(spec, asked)
        if asked.target is not None:
            raise ExplainError(f"--target names a class; {spec.name} is a vision-language model: its words are its own")
        reading = asked.reading
        if (reading.question is not None) != self.question or (not self.question and not reading.texts):
            raise ExplainError(f"{spec.name} {self.does}: give {self.asks}")

    def request(self, asked: Asked, method: str, layer: LayerChoice, options: Mapping[str, Any]) -> WordsRequest:
        """What an export asks of each image: the reading asked, with a method, its options and a layer."""
        reading = asked.reading
        threshold = WordsRequest.score_threshold if asked.score_threshold is None else asked.score_threshold
        return WordsRequest(reading.question, reading.answer, reading.texts, reading.new_tokens, method,
                            score_threshold=threshold, layer=layer, method_options=options)  # fmt: skip

    def target(self, spec: TextImageSpec, asked: Asked) -> Target:  # type: ignore[override]
        """None: a vision-language model's maps are of its words, found by :meth:`words`.

        Raises:
            ExplainError: Always, naming the way to its words' maps.
        """
        raise ExplainError(
            f"{spec.name} is a vision-language model: its maps are of its words; ask for them with a question or "
            "text prompts (Explorer.reading and Explorer.words, or explain.explain_answer)"
        )

    def tag(self, k: int, class_name: str, method: str, topk: int | None) -> str:
        return f".{method}.{k:02d}.{slug(class_name)}"

    def strip_runs(self, explained: list[Any]) -> list[list[Any]]:
        """All the image's words in one strip."""
        return [list(explained)] if explained else []

    def words(
        self, spec: TextImageSpec, image: Image.Image, request: WordsRequest
    ) -> tuple[list[Word], dict[str, Any]]:
        """An image's words with their maps, and what a record says of them.

        Raises:
            ExplainError: The image cannot be explained.
        """
        raise NotImplementedError


class Answers(WordsTask):
    """Each word of a model's answer to a question about the image (LLaVA, PaliGemma, Qwen2-VL, ...)."""

    name, map_of, does, asks, question = "answers", "word", "answers prompts", "--prompt QUESTION", True
    strip_title = "the answer"

    def check(self, spec: TextImageSpec, asked: Asked) -> None:
        """As every words task's, and a prompt that can be read faithfully (see :func:`prompt_text`)."""
        super().check(spec, asked)
        prompt_text(spec.processor, asked.reading.question or "")

    def words(
        self, spec: TextImageSpec, image: Image.Image, request: WordsRequest
    ) -> tuple[list[Word], dict[str, Any]]:
        """The answer's words (each one token or more) with their maps and probabilities, and what the record says
        of them."""
        processor, device = spec.processor, next(spec.model.parameters()).device
        inputs = processor(images=image, text=prompt_text(processor, request.prompt or ""), return_tensors="pt",
                           **_whole_image(processor)).to(device)  # fmt: skip
        inputs = {**inputs, **_rows_and_columns(processor, inputs, image)}
        answer = None
        if request.answer is not None:
            answer = processor.tokenizer(request.answer, add_special_tokens=False, return_tensors="pt").input_ids[0]
        found = explain_answer(
            spec.model, inputs, answer=answer, max_new_tokens=request.max_new_tokens,
            decode=processor.tokenizer.decode, method=request.method, layer=request.layer,
            **request.method_options,
        )  # fmt: skip
        probabilities = found.result.probabilities.reshape(-1).tolist()
        text = processor.tokenizer.decode(found.answer.tolist())
        record = {"prompt": request.prompt, "answer": text, "layer": found.result.layer}
        return [Word(w, cam, p) for w, cam, p in zip(found.words, found.maps, probabilities)], record


class Prompts(WordsTask):
    """Each text prompt of a contrastive model (CLIP, SigLIP), by the image's logit against it."""

    name, map_of, does, asks = "prompts", "prompt", "scores text prompts", "--text 'a cat, a remote'"
    strip_title = "the prompts"

    def words(
        self, spec: TextImageSpec, image: Image.Image, request: WordsRequest
    ) -> tuple[list[Word], dict[str, Any]]:
        """The text prompts with their maps and the image's logit against each, and what the record says of them."""
        processor, device = spec.processor, next(spec.model.parameters()).device
        texts = list(request.texts)
        inputs = processor(text=texts, images=image, return_tensors="pt", padding=True, **_whole_image(processor))
        inputs = inputs.to(device)
        result = explain_prompts(
            spec.model, inputs["pixel_values"], inputs["input_ids"], prompts=texts,
            attention_mask=inputs.get("attention_mask"), method=request.method, layer=request.layer,
            **request.method_options,
        )  # fmt: skip
        words = [Word(text, cam, score) for text, cam, score in zip(texts, result.cams[0], result.scores[0].tolist())]
        return words, {"texts": texts, "layer": result.layer}


class Queries(WordsTask):
    """Each box an open-vocabulary detector (OWL-ViT, OWLv2, Grounding DINO) finds for text queries."""

    name, map_of, does, asks = "queries", "box of a text query", "detects text queries", "--text 'a cat, a remote'"
    takes = frozenset({"reading", "score_threshold"})
    strip_title = "the boxes"

    def words(
        self, spec: TextImageSpec, image: Image.Image, request: WordsRequest
    ) -> tuple[list[Word], dict[str, Any]]:
        """Each box the detector finds for the text queries, with its map and score, both in the image's geometry,
        and what the record says of them."""
        texts = list(request.texts)
        inputs, phrases = _query_inputs(spec, image, texts)
        result = explain_queries(
            spec.model, inputs["pixel_values"], inputs["input_ids"], queries=texts, phrases=phrases,
            attention_mask=inputs.get("attention_mask"), score_threshold=request.score_threshold,
            method=request.method, layer=request.layer, **request.method_options,
        )  # fmt: skip
        height, width = inputs["pixel_values"].shape[-2:]
        side = max(image.size)
        padded = getattr(getattr(spec.processor, "image_processor", None), "do_pad", False)
        if padded and height == width:  # OWLv2's: the image at the top left of a square of its longer side
            scale = (side / width, side / height)
            keep = (round(height * image.height / side), round(width * image.width / side))
        else:
            scale, keep = (image.width / width, image.height / height), (height, width)
        boxes = result.target.boxes[0].cpu() * torch.tensor([*scale, *scale])
        words = [
            Word(texts[int(label)], cam[: keep[0], : keep[1]], float(score), box.tolist())
            for cam, label, score, box in zip(result.cams[0], result.class_indices[0], result.scores[0], boxes)
        ]
        return words, {"texts": texts, "layer": result.layer, "score_threshold": request.score_threshold}


def _query_inputs(spec: TextImageSpec, image: Image.Image, texts: list[str]) -> tuple[Any, list[list[int]] | None]:
    """The detector's inputs for the queries, and where it scores the tokens of one text of them all (its config's
    ``max_text_len``: Grounding DINO's), each query's tokens in that text."""
    processor, device = spec.processor, next(spec.model.parameters()).device
    if getattr(spec.model.config, "max_text_len", None) is None:  # a text per query: OWL-ViT's, OWLv2's
        return processor(text=[texts], images=image, return_tensors="pt", padding=True).to(device), None
    text, spans = phrase_text(texts)
    offsets = processor.tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    return processor(text=text, images=image, return_tensors="pt").to(device), phrase_tokens(offsets, spans)


LLAVA_TURN = ("USER:", "ASSISTANT:")  # the turn's markers of LLaVA 1.5, whose processor has no chat template


def prompt_text(processor: Any, prompt: str) -> str:
    """The prompt as the model reads it. A question alone is wrapped: through the processor's chat template where
    it has one, else as LLaVA 1.5 was trained (``USER: <image>\\n... ASSISTANT:``). A prompt that already holds
    the image token, once, is a whole prompt (copied from a model card): used as written.

    Raises:
        ExplainError: The prompt holds the image token more than once, or the template's markers (a special token
            of the tokenizer, or LLaVA 1.5's turn) without the image token: it cannot be used as written, nor
            wrapped again.
    """
    image_token = getattr(processor, "image_token", None) or "<image>"
    count = prompt.count(image_token)
    if count == 1:
        return prompt
    if count > 1:
        raise ExplainError(f"--prompt holds the image token {image_token} {count} times; each image is read once")
    tokenizer = getattr(processor, "tokenizer", None)
    markers = [*getattr(tokenizer, "all_special_tokens", ()), *LLAVA_TURN]
    marked = [marker for marker in markers if marker and marker in prompt]
    if marked:
        raise ExplainError(
            f"--prompt holds the chat template's marker {marked[0]!r} but not the image token {image_token}: give "
            f"the question alone (explain wraps it in the model's template), or the whole prompt with {image_token}"
        )
    if getattr(processor, "chat_template", None):
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        return processor.apply_chat_template(turn, add_generation_prompt=True)
    return f"{LLAVA_TURN[0]} {image_token}\n{prompt} {LLAVA_TURN[1]}"


def _rows_and_columns(processor: Any, inputs: Mapping[str, Any], image: Image.Image) -> dict[str, Any]:
    """For an image split into tiles with a pixel mask (Idefics3's), how many rows and columns of them: the image
    processor tells where asked (``return_row_col_info``), the processor drops it. Nothing for another image."""
    if "pixel_attention_mask" not in inputs:
        return {}
    info = processor.image_processor(images=[[image]], return_row_col_info=True)
    return {key: info[key] for key in ROWS_AND_COLUMNS if key in info}


def _whole_image(processor: Any) -> dict[str, Any]:
    """The processor's options that resize the whole image to the model's input, without a centre crop."""
    images = getattr(processor, "image_processor", None)
    crop = getattr(images, "crop_size", None)
    if not getattr(images, "do_center_crop", False) or crop is None:
        return {}
    return {"do_center_crop": False, "size": {"height": crop["height"], "width": crop["width"]}}
