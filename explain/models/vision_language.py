"""Vision-language models as explain explains them: a model reading fixed text, whose forward takes the image.

- :class:`VisionLanguage`: a HuggingFace image-text-to-text model, its logits over the text (its answer's tokens
  are the targets, see :class:`explain.targets.TokenTarget`).
- :class:`TextPrompts`: a contrastive image-text model (CLIP, SigLIP), the image's logits against each prompt,
  as a classifier's scores (the prompts are its classes).

Supported: LLaVA (1.5), PaliGemma and the models built as they are, a vision tower whose tokens a
``multi_modal_projector`` brings into the language model's sequence at the positions of the model's image token;
LLaVA-NeXt and Idefics3 (SmolVLM), which read the image as tiles beside a base image (:mod:`explain.models.tiles`);
Qwen2-VL and Qwen2.5-VL, whose tower merges groups of patches into one token each (how each reads the image:
:mod:`explain.models.image_readings`). The positions come from the text's own tokens (the config's image token
id), checked at every forward against the count of tokens the vision tower produced: a mismatch is an error, never
a guess.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ..core.hooks import Hooks
from ..errors import ExplainError
from .image_readings import MergedPatches, WholeImage, image_token_id
from .tiles import ROWS_AND_COLUMNS, AnyResolution, SplitImage

Reading = WholeImage | MergedPatches | AnyResolution | SplitImage
IMAGE_INPUTS = {*WholeImage.inputs, *MergedPatches.inputs, *AnyResolution.inputs, *SplitImage.inputs}


def image_reading(model: nn.Module, inputs: Mapping[str, Tensor]) -> Reading:
    """How the model reads the image of a processor's output (see :mod:`explain.models.image_readings`): cut into
    merged patches where the output has an ``image_grid_thw``, into LLaVA-NeXt's tiles where it has
    ``image_sizes`` beside tiles (N, tiles, 3, s, s), into Idefics3's where it has a ``pixel_attention_mask``, else
    whole.

    Raises:
        ExplainError: The model is of no supported kind, or the text holds no image token.
    """
    token = image_token_id(model)
    tokens = int((inputs["input_ids"] == token).sum())
    if not tokens:
        raise ExplainError(
            f"the text holds no image token (id {token}): build it with the model's processor, which puts one per "
            "vision token where the prompt says <image>"
        )
    if "image_grid_thw" in inputs:
        return MergedPatches(model, text_inputs(inputs), inputs["image_grid_thw"])
    if "image_sizes" in inputs and inputs["pixel_values"].dim() == 5:
        return AnyResolution(model, inputs, tokens)
    if "pixel_attention_mask" in inputs:
        return SplitImage(model, inputs, tokens)
    return WholeImage(model, tokens)


def text_inputs(inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The text's inputs of a processor's output (1, T) each: all but the image's."""
    return {name: value for name, value in inputs.items() if name not in IMAGE_INPUTS}


class VisionLanguage(nn.Module):
    """A vision-language model reading fixed text: ``forward(picture)`` returns the logits over the text.

    Args:
        model: A HuggingFace image-text-to-text model (``LlavaForConditionalGeneration``,
            ``PaliGemmaForConditionalGeneration``, ``Qwen2VLForConditionalGeneration``,
            ``Qwen2_5_VLForConditionalGeneration``), left as it was.
        text: The text's inputs as the model's processor builds them, each (1, T): ``input_ids``, with one image
            token per vision token (prompt and answer), and where the model takes them ``attention_mask``,
            ``token_type_ids`` (PaliGemma's prefix of the prompt) and ``mm_token_type_ids`` (Qwen2-VL's); passed
            to every forward.
        reading: How the model reads the picture (see :func:`image_reading`); None: whole, as LLaVA 1.5 does.

    Raises:
        ExplainError: The model is of no supported kind, or the text holds no image token.
    """

    def __init__(self, model: nn.Module, text: Mapping[str, Tensor], reading: Reading | None = None) -> None:
        super().__init__()
        self.model = model
        self.text = {name: value.reshape(1, -1) for name, value in text.items()}
        self.reading = reading if reading is not None else image_reading(model, self.text)

    @property
    def feature_levels(self) -> list[str] | None:
        """The layers the reading declares (LLaVA-NeXt's tiles and base image, fused), or None: searched."""
        levels = getattr(self.reading, "levels", None)
        return list(levels) if levels else None

    def forward(self, picture: Tensor) -> Tensor:
        """The logits (N, T, vocabulary) of the text, given each picture (N, 3, H, W).

        Raises:
            ExplainError: The vision tower made another number of tokens than the text has image tokens.
        """
        n, device = len(picture), picture.device
        text = {name: value.to(device).expand(n, -1) for name, value in self.text.items()}
        with Hooks() as hooks:
            self.reading.watch(hooks, n)
            return self.model(**text, **self.reading.model_inputs(picture), use_cache=False).logits


# a per-token input, and its value at the answer's tokens
EXTENDED = {"attention_mask": 1, "token_type_ids": 1, "mm_token_type_ids": 0}


def with_answer(text: Mapping[str, Tensor], answer: Tensor) -> dict[str, Tensor]:
    """The prompt's text inputs followed by the answer: its ids after the prompt's, the attention mask and the
    token types (PaliGemma's: 1 after the prefix) continued for it.

    Raises:
        ExplainError: A per-token input explain cannot continue for the answer.
    """
    prompt = text["input_ids"].reshape(-1)
    found = {"input_ids": torch.cat([prompt, answer.to(prompt)])}
    for name, value in text.items():
        if name == "input_ids":
            continue
        if name not in EXTENDED:
            raise ExplainError(
                f"the text input {name!r} has a value per token, which explain cannot continue for the answer "
                f"(it continues {', '.join(EXTENDED)})"
            )
        found[name] = torch.cat([value.reshape(-1), torch.full_like(answer, EXTENDED[name]).to(value)])
    return found


class TextPrompts(nn.Module):
    """A contrastive image-text model with fixed prompts: ``forward(pixel_values)`` returns each image's logits
    against each prompt (N, prompts), which explain explains as a classifier's scores.

    Args:
        model: HuggingFace's ``CLIPModel``, ``SiglipModel`` or a model answering as they do (``logits_per_image``),
            left as it was.
        input_ids: The prompts as the model's tokenizer builds them, (prompts, L).
        attention_mask: Their attention mask, or None.

    Raises:
        ExplainError: The model has no text tower (no ``get_text_features``).
    """

    def __init__(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None) -> None:
        super().__init__()
        if not callable(getattr(model, "get_text_features", None)):
            raise ExplainError(
                f"{type(model).__name__} has no text tower (get_text_features): text prompts need a contrastive "
                "image-text model such as CLIPModel or SiglipModel"
            )
        self.model, self.input_ids, self.attention_mask = model, input_ids, attention_mask

    def forward(self, pixel_values: Tensor) -> Tensor:
        """The logits (N, prompts) of each image against each prompt."""
        device = pixel_values.device
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        out = self.model(input_ids=self.input_ids.to(device), pixel_values=pixel_values, attention_mask=mask)
        return out.logits_per_image


def generate_answer(model: nn.Module, inputs: Mapping[str, Tensor], max_new_tokens: int = 16) -> tuple[Tensor, Tensor]:
    """The model's greedy answer to a prompt about one image (``inputs``: its processor's output): the new tokens'
    ids (A,), an end of sequence left out, and each one's log-probability as generation scored it (A,). The model
    is left as it was."""
    from ..core.model_state import untouched

    given = {name: value for name, value in inputs.items() if name not in ROWS_AND_COLUMNS}
    with untouched(model), torch.inference_mode():
        out = model.generate(
            **given, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    answer = out.sequences[0, inputs["input_ids"].shape[-1] :]
    scored = torch.stack([step[0].float().log_softmax(-1)[token] for step, token in zip(out.scores, answer)])
    end = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ends = {end} if isinstance(end, int) else set(end or ())
    while len(answer) and int(answer[-1]) in ends:
        answer = answer[:-1]
    return answer.clone(), scored[: len(answer)].clone()
