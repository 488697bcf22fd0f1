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

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

from ..core.hooks import Hooks
from ..errors import ExplainError
from .image_readings import MergedPatches, PatchRows, Queried, Rows, WholeImage, image_runs, image_token_id
from .tiles import ROWS_AND_COLUMNS, AnyResolution, CrossTiles, SplitImage

Reading = WholeImage | MergedPatches | AnyResolution | SplitImage | Rows | PatchRows | Queried | CrossTiles
IMAGE_INPUTS = {
    *WholeImage.inputs, *MergedPatches.inputs, *AnyResolution.inputs, *SplitImage.inputs, *Rows.inputs,
    *CrossTiles.inputs,
}  # fmt: skip


def image_reading(model: nn.Module, inputs: Mapping[str, Tensor]) -> Reading:
    """How the model reads the image of a processor's output (see :mod:`explain.models.image_readings`).

    Read from the output and the text, in order: merged patches where the output has an ``image_grid_thw``;
    LLaVA-NeXt's tiles where it has ``image_sizes`` beside tiles (N, tiles, 3, s, s); Idefics3's where it has a
    ``pixel_attention_mask``; rows where the text's image tokens come in several runs (patches given as tokens
    where ``pixel_values`` are (1, patches, features)); a Q-Former's queries where the model has one; else the
    whole image.

    Raises:
        ExplainError: The model reads the image in a way explain does not, or the text holds no image token.
    """
    refuse_unread(model, inputs)
    token = image_token_id(model)
    runs = image_runs(inputs["input_ids"], token)
    if not runs:
        raise ExplainError(
            f"the text holds no image token (id {token}): build it with the model's processor, which puts one per "
            "vision token where the prompt says <image>"
        )
    tokens = sum(length for _, length in runs)
    if "aspect_ratio_ids" in inputs:
        return CrossTiles(model, inputs)
    if "image_grid_thw" in inputs:
        return MergedPatches(model, text_inputs(inputs), inputs["image_grid_thw"])
    if "image_sizes" in inputs and inputs["pixel_values"].dim() == 5:
        return AnyResolution(model, inputs, tokens)
    if "pixel_attention_mask" in inputs:
        return SplitImage(model, inputs, tokens)
    if len(runs) > 1:
        return PatchRows(model, inputs, runs) if inputs["pixel_values"].dim() == 3 else Rows(model, inputs, runs)
    if any(name == "qformer" for name, _ in model.named_modules()):
        return Queried(model, inputs, tokens)
    return WholeImage(model, inputs, tokens)


def refuse_unread(model: nn.Module, inputs: Mapping[str, Tensor]) -> None:
    """Refuse, saying why, a model whose image reaches the text in a way no map of the image can follow.

    Raises:
        ExplainError: The image reaches the text only as discrete codes, or through a cross-attention without the
            tiles' inputs explain reads it from.
    """
    config, name = getattr(model, "config", None), type(model).__name__
    if getattr(config, "vq_config", None) is not None and getattr(config, "vision_config", None) is None:
        raise ExplainError(
            f"{name} reads the image as discrete codes of a codebook (its vq_config): no gradient passes a codebook "
            "lookup, so no method of explain can map its answer on the image"
        )
    text = getattr(config, "text_config", config)
    if getattr(text, "cross_attention_layers", None) and "aspect_ratio_ids" not in inputs:
        raise ExplainError(
            f"{name} reads the image by cross-attention (its cross_attention_layers), and explain reads it from "
            "Mllama's tiles: pass the processor's whole output (its aspect_ratio_ids and aspect_ratio_mask too)"
        )


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
        self.text = {name: value.reshape(1, -1) if value.dim() < 3 else value for name, value in text.items()}
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
        text = {name: value.to(device).expand(n, *value.shape[1:]) for name, value in self.text.items()}
        with Hooks() as hooks:
            self.reading.watch(hooks, n)
            with model_refusals(self.model):
                return self.model(**text, **self.reading.model_inputs(picture), use_cache=False).logits


@contextmanager
def model_refusals(model: nn.Module) -> Iterator[None]:
    """In the block, the model's own refusal of the inputs explain gives it is one line: explain's error. Running out
    of memory is not a refusal, and an error raised by a line of explain's own code inside the model's forward (a
    reading's hook) is explain's: both pass as they are. (An error a torch function raises where explain's hook
    called it is taken for the model's.)

    Raises:
        ExplainError: The model raised; the message names its error.
    """
    try:
        yield
    except ExplainError:
        raise
    except Exception as error:
        if isinstance(error, (torch.OutOfMemoryError, MemoryError)) or _raised_by_explain(error):
            raise
        first = str(error).splitlines()[0] if str(error) else ""
        raise ExplainError(
            f"{type(model).__name__} refuses the inputs explain gives it from its processor's output "
            f"({type(error).__name__}: {first}): pass the processor's whole output for one image and one prompt"
        ) from error


_PACKAGE = Path(__file__).resolve().parents[1]  # explain's own folder


def _raised_by_explain(error: BaseException) -> bool:
    """Whether explain's own code raised the error: its innermost frame is explain's (a reading's hook), and not
    the operation trace's ``__torch_function__``, which only runs the model's own operation."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    if frame is None:
        return False
    code = frame.tb_frame.f_code
    return code.co_name != "__torch_function__" and Path(code.co_filename).resolve().is_relative_to(_PACKAGE)


# per-token inputs that do not feed the logits (a loss's labels, Fuyu's patch indices), or that the forward derives
NOT_CONTINUED = ("labels", "position_ids", "cache_position", "image_patches_indices")
TOKEN_TYPES = ("token_type_ids", "mm_token_type_ids")  # a model's marks of its tokens' kinds


def encoder_decoder(model: nn.Module) -> bool:
    """Whether the model reads its answer in a decoder apart from the prompt (Florence-2)."""
    config = getattr(model, "config", None)
    return any(getattr(part, "is_encoder_decoder", False) for part in (config, getattr(config, "text_config", None)))


def decoder_start(model: nn.Module) -> int:
    """The token an encoder-decoder's decoder starts from (its config's, or its generation config's).

    Raises:
        ExplainError: Neither names one.
    """
    for config in (getattr(model, "generation_config", None), model.config, getattr(model.config, "text_config", None)):
        found = getattr(config, "decoder_start_token_id", None)
        if isinstance(found, int):
            return found
    raise ExplainError(f"{type(model).__name__} names no decoder_start_token_id: explain cannot start its answer")


def answered(model: nn.Module, text: Mapping[str, Tensor], answer: Tensor) -> tuple[dict[str, Tensor], Tensor, range]:
    """The text's inputs with the answer, the sequence whose logits score it, and the answer's places in it.

    A decoder-only model reads the answer after the prompt (:func:`with_answer`). An encoder-decoder reads the
    prompt in its encoder and the answer in its decoder, after the decoder's start token (``decoder_input_ids``).
    """
    if encoder_decoder(model):
        sequence = torch.cat([answer.new_tensor([decoder_start(model)]), answer])
        return {**text, "decoder_input_ids": sequence[None]}, sequence, range(1, 1 + len(answer))
    read = with_answer(text, answer, image_token_id(model))
    prompt = text["input_ids"].shape[-1]
    return read, read["input_ids"], range(prompt, prompt + len(answer))


def with_answer(text: Mapping[str, Tensor], answer: Tensor, image_token: int) -> dict[str, Tensor]:
    """The prompt's text inputs followed by the answer, each per-token input continued by the model's convention.

    The attention mask is 1 over the answer. A per-token input of more axes (Mllama's ``cross_attention_mask``)
    repeats its last token's value, as the model's generation does. Token types are read from the prompt. Where
    they mark the image's tokens (Gemma 3's ``token_type_ids``, Qwen2-VL's ``mm_token_type_ids``), the answer is
    text: 0. Where they are 0 over the whole prompt, image included, they mark a prefix read both ways
    (PaliGemma's), and the answer is the causal suffix: 1. Labels, position ids and cache positions are left out:
    the forward makes its own.

    Raises:
        ExplainError: A per-token input explain cannot continue for the answer.
    """
    prompt = text["input_ids"].reshape(-1)
    image = prompt == image_token
    found = {"input_ids": torch.cat([prompt, answer.to(prompt)])}
    for name, value in text.items():
        if name == "input_ids" or name in NOT_CONTINUED:
            continue
        if value.dim() > 2:  # a value per token and more (Mllama's cross_attention_mask): the last one repeated
            found[name] = torch.cat([value, value[:, -1:].expand(-1, len(answer), *value.shape[2:])], dim=1)
            continue
        value = value.reshape(-1)
        found[name] = torch.cat([value, torch.full_like(answer, _continued(name, value, image)).to(value)])
    return found


def _continued(name: str, value: Tensor, image: Tensor) -> int:
    """The value of the per-token input ``name`` at the answer's tokens, read from its prompt's ``value``.

    Raises:
        ExplainError: An input explain does not know, or token types of neither convention.
    """
    if name == "attention_mask":
        return 1
    if name not in TOKEN_TYPES:
        raise ExplainError(
            f"the text input {name!r} has a value per token, which explain cannot continue for the answer (it "
            f"continues attention_mask and {', '.join(TOKEN_TYPES)}, and leaves out {', '.join(NOT_CONTINUED)})"
        )
    if bool(value[image].ne(0).all()) and bool(value[~image].eq(0).all()):
        return 0  # they mark the image's tokens: the answer is text
    if bool(value.eq(0).all()) and name == "token_type_ids":
        return 1  # a prefix read both ways: the answer is its causal suffix
    raise ExplainError(
        f"the prompt's {name} mark neither the image's tokens nor a prefix, so explain cannot tell their value for "
        "the answer: pass the processor's output for the prompt alone"
    )


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
    ids (A,), an end of sequence left out, and each one's log-probability under the model's own logits in
    generation (A,), before any of its generation config's processors. The model is left as it was."""
    from ..core.model_state import untouched

    given = {name: value for name, value in inputs.items() if name not in (*ROWS_AND_COLUMNS, *NOT_CONTINUED)}
    with untouched(model), torch.inference_mode(), model_refusals(model):
        out = model.generate(
            **given, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    answer = out.sequences[0, 1 if encoder_decoder(model) else inputs["input_ids"].shape[-1] :]
    scored = torch.stack([step[0].float().log_softmax(-1)[token] for step, token in zip(out.logits, answer)])
    end = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ends = {end} if isinstance(end, int) else set(end or ())
    while len(answer) and int(answer[-1]) in ends:
        answer = answer[:-1]
    return answer.clone(), scored[: len(answer)].clone()
