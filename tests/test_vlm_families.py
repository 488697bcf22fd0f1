"""Vision-language families beyond the first six, each a tiny random model given what its processor gives: each
word's probability against the model's own teacher-forced forward (the answer's per-token inputs continued by
the family's convention, written out here), vision tokens planted alone landing on their own pixels for the
readings that lay tokens out themselves (rows of Mistral 3, Fuyu's patches), refusals that say why, and a sweep
over every architecture of transformers' image-text-to-text mapping that a tiny config builds."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_vlms
import torch
from tiny_vlms import image_token, tiny

import explain
from explain.models import VisionLanguage
from explain.models.vision_language import image_reading
from explain.targets import TokenTarget

transformers = pytest.importorskip("transformers")
tiny_vlms.transformers = transformers

ANSWER = [20, 21, 22]


def picture(height: int, width: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(seed))


def rows_text(token: int, rows: int, columns: int, separator: int, end: int) -> torch.Tensor:
    """Pixtral's layout: each row of image tokens closed by a separator, the last by the end token."""
    ids = [1, 5]
    for row in range(rows):
        ids += [token] * columns + [separator if row < rows - 1 else end]
    return torch.tensor([[*ids, 6, 7]])


def gemma3():
    model = tiny("gemma3", mm_tokens_per_image=4)
    token = image_token(model)
    ids = torch.tensor([[1, 5] + [token] * 4 + [6, 7]])
    inputs = {"pixel_values": picture(32, 32), "input_ids": ids, "attention_mask": torch.ones_like(ids),
              "token_type_ids": (ids == token).long()}  # fmt: skip
    return model, inputs, {"token_type_ids": 0}  # Gemma 3's token types mark the image: the answer is text


def mistral3():
    model = tiny("mistral3")
    ids = rows_text(image_token(model), 3, 2, 11, 12)  # a 48 x 32 picture: patches of 8, merged 2 x 2
    inputs = {"pixel_values": picture(48, 32), "input_ids": ids, "attention_mask": torch.ones_like(ids),
              "image_sizes": torch.tensor([[48, 32]])}  # fmt: skip
    return model, inputs, {}


def fuyu():
    model = tiny("fuyu", patch_size=8)
    token, rows, columns = image_token(model), 2, 3
    model.generation_config.suppress_tokens = [token]  # a random model may otherwise answer with the image token
    ids = torch.tensor([[1] + ([token] * columns + [11]) * rows + [5, 6]])  # a newline token closes each row
    image = picture(16, 24)
    patches = image.reshape(1, 3, rows, 8, columns, 8).permute(0, 2, 4, 3, 5, 1).reshape(1, rows * columns, -1)
    inputs = {"pixel_values": patches, "input_ids": ids, "attention_mask": torch.ones_like(ids),
              "image_patches_indices": torch.where(ids == token, torch.cumsum(ids == token, 1) - 1, -1)}  # fmt: skip
    return model, inputs, {}


def llava_onevision():
    pinpoints = [[32, 32], [32, 64], [64, 32]]
    model = tiny("llava_onevision", image_grid_pinpoints=pinpoints)
    processor = transformers.LlavaOnevisionImageProcessor(size={"height": 32, "width": 32},
                                                          image_grid_pinpoints=pinpoints)  # fmt: skip
    photo = np.random.default_rng(0).integers(0, 256, (40, 70, 3), dtype=np.uint8)  # not square
    given = dict(processor(images=[photo], return_tensors="pt"))
    with torch.no_grad():  # the count the processor's text would hold, by the model's own packing
        features = model.model.get_image_features(pixel_values=given["pixel_values"], image_sizes=given["image_sizes"])
    count = sum(len(part) for part in features.pooler_output)
    ids = torch.tensor([[1, 5] + [image_token(model)] * count + [6, 7]])
    return model, {**given, "input_ids": ids, "attention_mask": torch.ones_like(ids)}, {}


def blip(kind: str):
    model = tiny(kind, image_token_id=250, num_query_tokens=4, **{"qformer_config.encoder_hidden_size": 32})
    ids = torch.tensor([[250] * 4 + [1, 5, 6, 7]])
    inputs = {"pixel_values": picture(32, 32), "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if kind == "instructblip":  # the Q-Former reads the prompt too: held as given
        inputs |= {"qformer_input_ids": torch.tensor([[1, 5, 6]]), "qformer_attention_mask": torch.ones(1, 3).long()}
    return model, inputs, {}


def aya_vision():
    model = tiny("aya_vision")
    ids = torch.tensor([[1, 5] + [image_token(model)] * 4 + [6, 7]])
    return model, {"pixel_values": picture(32, 32), "input_ids": ids, "attention_mask": torch.ones_like(ids)}, {}


FAMILIES = {
    "gemma3": gemma3, "mistral3": mistral3, "fuyu": fuyu, "llava_onevision": llava_onevision, "aya_vision": aya_vision,
    "blip-2": lambda: blip("blip-2"), "instructblip": lambda: blip("instructblip"),
}  # fmt: skip


def teacher_forced(model, inputs: dict, answer: list[int], convention: dict[str, int]) -> torch.Tensor:
    """Each answer token's probability in the model's own forward over prompt and answer, the per-token inputs
    continued as the family's convention says (``convention``: the answer's value of each)."""
    prompt, given = inputs["input_ids"], dict(inputs)
    tail = torch.tensor([answer])
    given["input_ids"] = torch.cat([prompt, tail], 1)
    given["attention_mask"] = torch.ones_like(given["input_ids"])
    for name, value in convention.items():
        given[name] = torch.cat([inputs[name], torch.full_like(tail, value)], 1)
    given.pop("image_patches_indices", None)
    with torch.no_grad():
        logits = model(**given, use_cache=False).logits[0]
    start = prompt.shape[1]
    return torch.stack([logits[p - 1].softmax(-1)[given["input_ids"][0, p]] for p in range(start, start + len(answer))])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_words_probability_is_the_models_own_teacher_forced_one(family: str) -> None:
    model, inputs, convention = FAMILIES[family]()
    found = explain.explain_answer(model, inputs, answer=ANSWER)
    expected = teacher_forced(model, inputs, ANSWER, convention)
    assert found.maps.shape[0] == len(ANSWER) and bool(torch.isfinite(found.maps).all())
    torch.testing.assert_close(found.result.probabilities.reshape(-1), expected, rtol=0, atol=1e-4)
    generated = explain.explain_answer(model, inputs, max_new_tokens=3)  # checked against generation's own scores
    assert len(generated.answer) >= 1


def test_gemma3s_answer_continued_as_an_image_would_be_is_not_its_own() -> None:
    """The convention matters: continued with PaliGemma's 1 (Gemma 3's mark of the image), the answer's words
    attend to each other both ways and their log-probabilities move away from the model's causal ones."""
    model, inputs, _ = gemma3()
    right = teacher_forced(model, inputs, ANSWER, {"token_type_ids": 0}).log()
    wrong = teacher_forced(model, inputs, ANSWER, {"token_type_ids": 1}).log()
    found = explain.explain_answer(model, inputs, answer=ANSWER).result.probabilities.reshape(-1).log()
    assert float((right - wrong).abs().max()) > 1e-3
    torch.testing.assert_close(found, right, rtol=0, atol=1e-5)


def test_paligemma_takes_its_processors_whole_output_labels_and_all() -> None:
    from test_vision_language import IMAGE, _tokenizer, tiny_paligemma

    words = ["<unk>", "<s>", "</s>", "<pad>", "what", "is", "it", "a", "cat"] + [f"w{i}" for i in range(9, 99)]
    images = transformers.SiglipImageProcessor(size={"height": IMAGE, "width": IMAGE})
    processor = transformers.PaliGemmaProcessor(image_processor=images, tokenizer=_tokenizer([*words, "<image>"],
                                                                                             "<image>"))  # fmt: skip
    processor.image_seq_length = 16
    model = tiny_paligemma()
    photo = np.random.default_rng(2).integers(0, 256, (IMAGE, IMAGE, 3), dtype=np.uint8)
    given = dict(processor(text="<image>what is it", images=photo, return_tensors="pt"))
    assert "labels" in given and "token_type_ids" in given
    whole = dict(processor(text="<image>what is it", images=photo, suffix="a cat", return_tensors="pt"))
    answer = whole["input_ids"][0, given["input_ids"].shape[1] : -1].tolist()  # the suffix, its end left out
    found = explain.explain_answer(model, given, answer=answer)
    whole.pop("labels")
    with torch.no_grad():
        logits = model(**whole, use_cache=False).logits[0]
    start = given["input_ids"].shape[1]
    expected = torch.stack([logits[p - 1].softmax(-1)[whole["input_ids"][0, p]] for p in range(start, start + 2)])
    torch.testing.assert_close(found.result.probabilities.reshape(-1), expected, rtol=0, atol=1e-4)


def _plant(handles: list, blocks, at: torch.nn.Module, keep: torch.Tensor) -> None:
    """Blocks that pass their input on, and one token alone left where ``at`` makes them."""
    handles += [block.register_forward_hook(lambda m, args, out: args[0] if isinstance(out, torch.Tensor) else
                                            (args[0], *out[1:])) for block in blocks]  # fmt: skip
    handles.append(at.register_forward_hook(lambda m, i, out: out * keep.reshape((*out.shape[:-1], 1))))


@pytest.mark.parametrize("family", ["mistral3", "fuyu"])
def test_a_vision_token_planted_alone_lands_on_its_own_cell_and_pixels(family: str) -> None:
    """One token of the image alone left non-zero: Grad-CAM's weighted sum at the reading's map is non-zero at its
    cell alone, and the gradient of a word reaches that cell's pixels alone (Mistral 3: 16 x 16, its 2 x 2 merged
    patches of 8; Fuyu: its own patch of 8)."""
    model, inputs, _ = FAMILIES[family]()
    (rows, columns), cell, side = ((3, 2), 3, 16) if family == "mistral3" else ((2, 3), 4, 8)
    keep = torch.zeros(rows * columns)
    keep[cell] = 1
    handles: list = []
    if family == "mistral3":
        _plant(handles, model.model.vision_tower.transformer.layers, model.model.multi_modal_projector, keep)
    else:
        _plant(handles, [], model.model.vision_embed_tokens, keep)
    reading = image_reading(model, inputs)
    text = {"input_ids": torch.cat([inputs["input_ids"][0], torch.tensor([20])])[None]}
    wrapped = VisionLanguage(model, text, reading)
    try:
        method = explain.GradCAM(wrapped, "reading.tokens")
        method.relu = False
        target = TokenTarget(text["input_ids"][0], [text["input_ids"].shape[1] - 1])
        x = reading.picture(inputs)
        cam = method(x, target, resize=False, normalize=False).cams[0, 0]
        saliency = explain.create_method("saliency", wrapped)(x, target).raw[0, 0].abs().sum(0)
    finally:
        for handle in handles:
            handle.remove()
    row, column = divmod(cell, columns)
    assert cam.shape == (rows, columns) and cam[row, column] != 0 and torch.count_nonzero(cam) == 1
    where = torch.zeros(saliency.shape, dtype=torch.bool)
    where[row * side : (row + 1) * side, column * side : (column + 1) * side] = True
    assert bool((saliency[~where] == 0).all()) and bool((saliency[where] > 0).any())


def test_rows_of_different_lengths_are_refused() -> None:
    model, inputs, _ = mistral3()
    ids = inputs["input_ids"].clone()
    ids[0, 2] = 5  # the first row one token short
    with pytest.raises(explain.ExplainError, match=r"rows of \[1, 2\] tokens, which is not a grid"):
        explain.explain_answer(model, {**inputs, "input_ids": ids}, answer=ANSWER)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [("mllama", "reads the image by cross-attention"), ("florence2", "is an encoder-decoder"),
     ("chameleon", "discrete codes of a codebook")],
)  # fmt: skip
def test_a_model_whose_image_no_map_can_follow_is_refused_saying_why(kind: str, reason: str) -> None:
    codebook = {"embed_dim": 8, "num_embeddings": 16, "base_channels": 8, "channel_multiplier": [1, 2],
                "num_res_blocks": 1, "latent_channels": 8, "resolution": 32}  # fmt: skip
    config = transformers.AutoConfig.for_model(kind, **({"vq_config": codebook} if kind == "chameleon" else {}))
    model = type("Held", (torch.nn.Module,), {})()  # the reason is read from the config alone
    model.config = config
    with pytest.raises(explain.ExplainError, match=reason) as refused:
        explain.explain_answer(model, {"pixel_values": picture(32, 32), "input_ids": torch.tensor([[1, 2]])})
    assert "\n" not in str(refused.value)


def test_every_architecture_a_tiny_config_builds_is_explained_or_refused_in_one_line(capsys) -> None:
    """The sweep: each architecture of the mapping, built tiny, given an image and a text with as many image tokens
    as its own image features have, is explained or refused by explain's own one-line error, never another."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as MAPPING

    outcomes: dict[str, list[str]] = {"explained": [], "refused": [], "not built tiny": []}
    for kind in sorted(MAPPING):
        try:
            model = tiny(kind)
        except Exception:  # a default config that no small sizes build: not a model a user brings
            outcomes["not built tiny"].append(kind)
            continue
        if sum(p.numel() for p in model.parameters()) > 5_000_000:
            outcomes["not built tiny"].append(kind)
            continue
        inputs = _sweep_inputs(model)
        try:
            explain.explain_answer(model, inputs, answer=[7])
            outcomes["explained"].append(kind)
        except explain.ExplainError as refused:
            assert "\n" not in str(refused), kind
            outcomes["refused"].append(kind)
    with capsys.disabled():
        for outcome, kinds in outcomes.items():
            print(f"\n{outcome} ({len(kinds)}): {', '.join(kinds)}")
    assert {"llava", "paligemma", "aya_vision", "internvl"} <= set(outcomes["explained"])


def _sweep_inputs(model) -> dict[str, torch.Tensor]:
    """An image, and a text of as many image tokens as the model's image features for it (4 where it cannot
    say)."""
    x = picture(32, 32)
    count = 4
    try:
        with torch.no_grad():
            features = model.get_image_features(pixel_values=x)
        features = getattr(features, "pooler_output", features)
        features = features[0] if isinstance(features, (list, tuple)) else features
        count = features.shape[-2] if features.dim() == 3 else features.shape[0]
    except Exception:  # a model whose image features need more than the image
        pass
    token = getattr(model.config, "image_token_id", None) or getattr(model.config, "image_token_index", None) or 2
    ids = torch.tensor([[1] + [token] * count + [5, 6]])
    return {"pixel_values": x, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
