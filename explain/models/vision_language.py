"""Vision-language models as explain explains them: a model reading fixed text, whose forward takes the image.

- :class:`VisionLanguage`: a HuggingFace image-text-to-text model, its logits over the text (its answer's tokens
  are the targets, see :class:`explain.targets.TokenTarget`).
- :class:`TextPrompts`: a contrastive image-text model (CLIP, SigLIP), the image's logits against each prompt,
  as a classifier's scores (the prompts are its classes).

Supported: LLaVA (1.5) and the models built as it is, a vision tower whose tokens a ``multi_modal_projector``
brings into the language model's sequence at the positions of the model's image token. The positions come from
the text's own tokens (the config's image token id), checked at every forward against the count of tokens the
projector produced: a mismatch is an error, never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ..core.hooks import Hooks
from ..errors import ExplainError

PROJECTOR = "multi_modal_projector"  # LLaVA's: the vision tokens as the language model reads them


def image_token_id(model: nn.Module) -> int:
    """The id of the token that stands for one vision token in the model's text (its config's).

    Raises:
        ExplainError: The config names none: not a model of the supported kind.
    """
    config = getattr(model, "config", None)
    for key in ("image_token_id", "image_token_index"):
        found = getattr(config, key, None)
        if isinstance(found, int):
            return found
    raise ExplainError(
        f"{type(model).__name__} names no image token in its config (image_token_id / image_token_index): explain "
        "explains vision-language models that put the image's tokens into the text (LLaVA 1.5 and its kind)"
    )


def projector(model: nn.Module) -> nn.Module:
    """The module that brings the vision tokens into the language model's sequence.

    Raises:
        ExplainError: The model has none under the name explain knows.
    """
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == PROJECTOR:
            return module
    raise ExplainError(
        f"{type(model).__name__} has no {PROJECTOR}: explain reads the vision tokens' count there (LLaVA 1.5 and "
        "models built as it is)"
    )


class VisionLanguage(nn.Module):
    """A vision-language model reading fixed text: ``forward(pixel_values)`` returns the logits over the text.

    Args:
        model: A HuggingFace image-text-to-text model (``LlavaForConditionalGeneration``,
            ``PaliGemmaForConditionalGeneration``), left as it was.
        text: The text's inputs as the model's processor builds them, each (1, T): ``input_ids``, with one image
            token per vision token (prompt and answer), and where the model takes them ``attention_mask`` and
            ``token_type_ids`` (PaliGemma's prefix of the prompt); passed to every forward.

    Raises:
        ExplainError: The model is of no supported kind, or the text holds no image token.
    """

    def __init__(self, model: nn.Module, text: Mapping[str, Tensor]) -> None:
        super().__init__()
        self.model = model
        self.image_token = image_token_id(model)
        self.projector = projector(model)
        self.text = {name: value.reshape(1, -1) for name, value in text.items()}
        self.image_tokens = int((self.text["input_ids"] == self.image_token).sum())
        if not self.image_tokens:
            raise ExplainError(
                f"the text holds no image token (id {self.image_token}): build it with the model's processor, "
                "which puts one per vision token where the prompt says <image>"
            )

    def forward(self, pixel_values: Tensor) -> Tensor:
        """The logits (N, T, vocabulary) of the text, given each image of ``pixel_values``.

        Raises:
            ExplainError: The vision tower made another number of tokens than the text has image tokens.
        """
        n, device = len(pixel_values), pixel_values.device
        text = {name: value.to(device).expand(n, -1) for name, value in self.text.items()}
        with Hooks() as hooks:
            hooks.forward(self.projector, lambda module, inputs, output: self._check(output, n))
            return self.model(**text, pixel_values=pixel_values, use_cache=False).logits

    def _check(self, projected: Tensor, images: int) -> None:
        """The vision tokens the projector made must be the text's image tokens, one for one."""
        made = projected.shape[:-1].numel() // images
        if made != self.image_tokens:
            raise ExplainError(
                f"the vision tower made {made} tokens per image, but the text holds {self.image_tokens} image "
                f"tokens (id {self.image_token}): build the text with the model's own processor, for an image of the "
                "size it expects"
            )


EXTENDED = {"attention_mask": 1, "token_type_ids": 1}  # a per-token input, and its value at the answer's tokens


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


def generate_answer(
    model: nn.Module, pixel_values: Tensor, text: Mapping[str, Tensor], max_new_tokens: int = 16
) -> tuple[Tensor, Tensor]:
    """The model's greedy answer to a prompt about one image: the new tokens' ids (A,), an end of sequence left
    out, and each one's log-probability as generation scored it (A,). The model is left as it was."""
    from ..core.model_state import untouched

    with untouched(model), torch.inference_mode():
        out = model.generate(
            **text, pixel_values=pixel_values, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    answer = out.sequences[0, text["input_ids"].shape[-1] :]
    scored = torch.stack([step[0].float().log_softmax(-1)[token] for step, token in zip(out.scores, answer)])
    end = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ends = {end} if isinstance(end, int) else set(end or ())
    while len(answer) and int(answer[-1]) in ends:
        answer = answer[:-1]
    return answer.clone(), scored[: len(answer)].clone()
