"""The command line's maps of what a vision-language model says or sees, for each image: one overlay per word of
its answer (``--prompt``, or ``--answer`` given), per text prompt (``--text``), or per box an open-vocabulary
detector finds for the text queries (``--text``, its box drawn), a strip of them all, and a record in the run's
manifest of words (:data:`MANIFEST`, one JSON line per image).

The image reaches the model whole: its processor resizes it to the model's input size without a centre crop, so
that every map covers the whole picture it is drawn on. An OWLv2 processor pads the image to a square at its
bottom and right first: the maps are cut back to the image, and the boxes scaled by the square's side.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ..errors import ExplainError, NothingToExplain, first_line
from ..io.atomic import write_atomically
from ..io.images import load_image, save_image
from ..io.render import annotate, grid, overlay
from ..methods.answers import explain_answer, explain_prompts, explain_queries
from ..models.query_models import phrase_text, phrase_tokens
from ..models.text_image import TextImageSpec
from ..models.tiles import ROWS_AND_COLUMNS
from .inputs import Input
from .manifest import ResumeError
from .outputs import slug
from .ownership import FolderLock

MANIFEST = "manifest.words.jsonl"
STRIP_COLUMNS = 6  # words per row of the strip figure


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
    """

    prompt: str | None
    answer: str | None
    texts: Sequence[str]
    max_new_tokens: int = 16
    method: str = "gradcam"
    alpha: float = 0.5
    colormap: str = "jet"
    score_threshold: float = 0.1


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


def explain_words(
    spec: TextImageSpec,
    inputs: Sequence[Input],
    out: Path,
    request: WordsRequest,
    report: Callable[[dict[str, Any]], None],
    overwrite: bool = False,
) -> list[dict[str, Any]]:
    """Explain each image, write its files and its record; an image that fails gets its error in its record, and
    the others go on. The output folder is held for the run (no other run writes there meanwhile).

    Returns:
        Each image's record, in order.

    Raises:
        ResumeError: The folder holds an earlier run's words, and ``overwrite`` is not set.
    """
    manifest = out / MANIFEST
    if manifest.is_file() and not overwrite:
        raise ResumeError(f"{out}: holds the words of an earlier run ({MANIFEST}); add --overwrite to start afresh")
    with FolderLock(out):
        manifest.unlink(missing_ok=True)
        return [_recorded(spec, item, out, request, report) for item in inputs]


def _recorded(
    spec: TextImageSpec, item: Input, out: Path, request: WordsRequest, report: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """One input explained, its record added to the manifest and reported; its error is its record's."""
    try:
        if item.path is None:
            raise ExplainError(item.error or f"{item.name}: not found")
        found = _explained_image(spec, item.path, out, item.relative or Path(item.path.stem), request)
    except NothingToExplain as err:  # no box above the threshold: nothing to draw, and no failure
        found = {"input": item.name, "note": first_line(err), "error": None}
    except ExplainError as err:
        found = {"input": item.name, "error": first_line(err)}
    _append(out / MANIFEST, found)
    report(found)
    return found


def _explained_image(
    spec: TextImageSpec, path: Path, out: Path, relative: Path, request: WordsRequest
) -> dict[str, Any]:
    """One image's maps, written under ``out`` at ``relative`` (its outputs' path without suffix), and its record,
    which names the files relative to ``out``."""
    image = load_image(path)
    words, record = words_of_image(spec, image, request)
    tokens = []
    for i, word in enumerate(words):
        name = relative.with_name(f"{relative.name}.{i:02d}.{slug(word.text) or 'token'}.{request.method}.png")
        save_image(drawn(image, word, request.alpha, request.colormap), out / name)
        entry = {"index": i, "text": word.text, "score": round(word.score, 6), "output": str(name)}
        tokens.append(entry if word.box is None else {**entry, "box": [round(v, 2) for v in word.box]})
    strip = relative.with_name(f"{relative.name}.words.{request.method}.png")
    panels = {f"{i} {word.text}": word.cam for i, word in enumerate(words)}
    title = f"{path.name} · {request.method} · {record.get('answer') or ', '.join(request.texts)}"
    columns = min(STRIP_COLUMNS, len(panels) + 1)
    save_image(grid(image, panels, title, request.alpha, request.colormap, columns=columns), out / strip)
    return {"input": str(path), "model": spec.name, "method": request.method, **record, "tokens": tokens,
            "figure": str(strip), "error": None}  # fmt: skip


def words_of_image(spec: TextImageSpec, image: Image.Image, request: WordsRequest) -> tuple[list[Word], dict[str, Any]]:
    """An image's words (its answer's, its prompts, or its boxes' queries, as the model's kind asks) with their
    maps, and what a record says of them.

    Raises:
        ExplainError: The request does not suit the model, or the image cannot be explained.
    """
    explained = {"answers": _answer, "detects": _queries, "scores": _prompts}[spec.kind]
    return explained(spec, image, request)


def drawn(image: Image.Image, word: Word, alpha: float = 0.5, colormap: str = "jet") -> Image.Image:
    """A word's map over the image, its box drawn with its query and score where it has one."""
    picture = overlay(image, word.cam, alpha, colormap)
    if word.box is not None:
        picture = annotate(picture, f"{word.text} {word.score:.2f}", tuple(word.box))
    return picture


def _answer(spec: TextImageSpec, image: Image.Image, request: WordsRequest) -> tuple[list[Word], dict[str, Any]]:
    """The answer's words (each one token or more) with their maps and probabilities, and what the record says of
    them."""
    processor, device = spec.processor, next(spec.model.parameters()).device
    inputs = processor(images=image, text=prompt_text(processor, request.prompt or ""), return_tensors="pt",
                       **_whole_image(processor)).to(device)  # fmt: skip
    inputs = {**inputs, **_rows_and_columns(processor, inputs, image)}
    answer = None
    if request.answer is not None:
        answer = processor.tokenizer(request.answer, add_special_tokens=False, return_tensors="pt").input_ids[0]
    found = explain_answer(
        spec.model, inputs, answer=answer, max_new_tokens=request.max_new_tokens,
        decode=processor.tokenizer.decode, method=request.method,
    )  # fmt: skip
    probabilities = found.result.probabilities.reshape(-1).tolist()
    text = processor.tokenizer.decode(found.answer.tolist())
    record = {"prompt": request.prompt, "answer": text, "layer": found.result.layer}
    return [Word(w, cam, p) for w, cam, p in zip(found.words, found.maps, probabilities)], record


def _prompts(spec: TextImageSpec, image: Image.Image, request: WordsRequest) -> tuple[list[Word], dict[str, Any]]:
    """The text prompts with their maps and the image's logit against each, and what the record says of them."""
    processor, device = spec.processor, next(spec.model.parameters()).device
    texts = list(request.texts)
    inputs = processor(text=texts, images=image, return_tensors="pt", padding=True, **_whole_image(processor))
    inputs = inputs.to(device)
    result = explain_prompts(
        spec.model, inputs["pixel_values"], inputs["input_ids"], prompts=texts,
        attention_mask=inputs.get("attention_mask"), method=request.method,
    )  # fmt: skip
    words = [Word(text, cam, score) for text, cam, score in zip(texts, result.cams[0], result.scores[0].tolist())]
    return words, {"texts": texts, "layer": result.layer}


def _queries(spec: TextImageSpec, image: Image.Image, request: WordsRequest) -> tuple[list[Word], dict[str, Any]]:
    """Each box the detector finds for the text queries, with its map and score, both in the image's geometry,
    and what the record says of them."""
    texts = list(request.texts)
    inputs, phrases = _query_inputs(spec, image, texts)
    result = explain_queries(
        spec.model, inputs["pixel_values"], inputs["input_ids"], queries=texts, phrases=phrases,
        attention_mask=inputs.get("attention_mask"), score_threshold=request.score_threshold, method=request.method,
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


def _append(manifest: Path, record: dict[str, Any]) -> None:
    """Add one record to the manifest, whole: the file is rewritten atomically with the new line."""
    before = manifest.read_text(encoding="utf-8") if manifest.is_file() else ""
    line = json.dumps(record, ensure_ascii=False) + "\n"
    write_atomically(manifest, lambda temp: temp.write_text(before + line, encoding="utf-8"))
