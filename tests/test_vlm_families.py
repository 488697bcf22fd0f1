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
    with torch.no_grad():  # a new model's projection is zeros (the image reads as nothing): drawn, as trained ones are
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
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


def mllama():
    settings = {"text_config.cross_attention_layers": [1], "vision_config.num_global_layers": 1,
                "vision_config.intermediate_layers_indices": [0], "vision_config.vision_output_dim": 64}  # fmt: skip
    model = tiny("mllama", **settings)
    with torch.no_grad():  # a new model's cross-attention gates are closed (tanh 0): opened, as trained ones are
        for name, parameter in model.named_parameters():
            if "cross_attn" in name and "gate" in name:
                parameter.fill_(1.0)
    processor = transformers.MllamaImageProcessor(size={"height": 32, "width": 32}, max_image_tiles=4)
    photo = np.random.default_rng(0).integers(0, 256, (30, 60, 3), dtype=np.uint8)  # 1 x 2 tiles of 32
    given = {k: v for k, v in processor(images=[[photo]], return_tensors="pt").items() if k != "num_tiles"}
    ids = torch.tensor([[1, image_token(model), 5, 6, 7]])
    sees = torch.zeros(1, ids.shape[1], 1, 4, dtype=torch.long)
    sees[:, 1:, :, :2] = 1  # the tokens from the image on attend to its two tiles, as the processor marks them
    inputs = {**given, "input_ids": ids, "attention_mask": torch.ones_like(ids), "cross_attention_mask": sees}
    return model, inputs, {}


def florence2():
    vision = {"depths": [1, 1, 1, 1], "embed_dim": [8, 16, 32, 32], "num_heads": [1, 1, 2, 2],
              "num_groups": [1, 1, 2, 2], "window_size": 2, "projection_dim": 32}  # fmt: skip
    text = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
            "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "vocab_size": 300}  # fmt: skip
    model = tiny("florence2", **{f"vision_config.{k}": v for k, v in vision.items()},
                 **{f"text_config.{k}": v for k, v in text.items()})  # fmt: skip
    model.generation_config.suppress_tokens = [model.config.text_config.eos_token_id]  # a random model's end at once
    model.generation_config.forced_eos_token_id = None
    ids = torch.tensor([[0] + [image_token(model)] * 17 + [5, 6, 2]])  # a 128 x 128 image: 16 tokens and a pooled one
    return model, {"pixel_values": picture(128, 128), "input_ids": ids, "attention_mask": torch.ones_like(ids)}, {}


FAMILIES = {
    "gemma3": gemma3, "mistral3": mistral3, "fuyu": fuyu, "llava_onevision": llava_onevision, "aya_vision": aya_vision,
    "blip-2": lambda: blip("blip-2"), "instructblip": lambda: blip("instructblip"), "mllama": mllama,
    "florence2": florence2,
}  # fmt: skip


def teacher_forced(model, inputs: dict, answer: list[int], convention: dict[str, int]) -> torch.Tensor:
    """Each answer token's probability in the model's own forward over prompt and answer: after the prompt, the
    per-token inputs continued as the family's convention says (``convention``: the answer's value of each; an
    input of more axes repeats its last token's, as Mllama's generation does); or, for an encoder-decoder, in its
    decoder after the start token, the prompt read by its encoder."""
    given, tail = dict(inputs), torch.tensor([answer])
    given.pop("image_patches_indices", None)
    if model.config.is_encoder_decoder:
        start = model.config.text_config.decoder_start_token_id
        sequence = torch.cat([torch.tensor([[start]]), tail], 1)
        given["decoder_input_ids"], offset = sequence, 1
    else:
        sequence = given["input_ids"] = torch.cat([inputs["input_ids"], tail], 1)
        given["attention_mask"], offset = torch.ones_like(sequence), inputs["input_ids"].shape[1]
        for name, value in inputs.items():
            if value.dim() > 2 and value.shape[1] == inputs["input_ids"].shape[1]:
                given[name] = torch.cat([value, value[:, -1:].expand(-1, len(answer), *value.shape[2:])], 1)
        for name, value in convention.items():
            given[name] = torch.cat([inputs[name], torch.full_like(tail, value)], 1)
    with torch.no_grad():
        logits = model(**given, use_cache=False).logits[0]
    return torch.stack([logits[p - 1].softmax(-1)[sequence[0, p]] for p in range(offset, offset + len(answer))])


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
    def passed_on(module, args, kwargs, out):
        given = args[0] if args else kwargs["hidden_states"]
        return given if isinstance(out, torch.Tensor) else (given, *out[1:])

    def kept(module, args, out):
        first = out if isinstance(out, torch.Tensor) else out[0]
        alone = first * keep.reshape(*first.shape[:-1], 1).to(first)
        return alone if isinstance(out, torch.Tensor) else (alone, *out[1:])

    handles += [block.register_forward_hook(passed_on, with_kwargs=True) for block in blocks]
    handles.append(at.register_forward_hook(kept))


PLANTED = {  # the grid of the reading's map, the planted token's cell, the pixels on a cell's side
    "mistral3": ((3, 2), 3, 16), "fuyu": ((2, 3), 4, 8), "mllama": ((4, 8), 13, 8), "gemma3": ((2, 2), 1, 16),
    "blip-2": ((4, 4), 6, 8), "instructblip": ((4, 4), 9, 8), "aya_vision": ((2, 2), 2, 16),
}  # fmt: skip


PLANTED_METHODS = [  # Fuyu's squared ReLU is refused by the relevance methods (the test after this one)
    (family, method) for family in sorted(PLANTED) for method in ("saliency", "attnlrp", "cplrp")
    if family != "fuyu" or method == "saliency"
]  # fmt: skip


@pytest.mark.parametrize(("family", "method"), PLANTED_METHODS)
def test_a_vision_token_planted_alone_lands_on_its_own_cell_and_pixels(family: str, method: str) -> None:
    """One token of the image alone left non-zero: Grad-CAM's weighted sum at the reading's map is non-zero at its
    cell alone, and the gradient of a word reaches that cell's pixels alone (Mistral 3: 16 x 16, its 2 x 2 merged
    patches of 8; Fuyu: its own patch of 8; Mllama: the patch of 8 of its second tile, row 1, column 5 of the 4 x 8
    canvas; Gemma 3 and Aya Vision: the 2 x 2 patches their projector pools or shuffles into the token; BLIP-2 and
    InstructBLIP: the patch their Q-Former reads at the tower's last block). The pixels' relevance of AttnLRP and
    CP-LRP likewise."""
    model, inputs, _ = FAMILIES[family]()
    (rows, columns), cell, side = PLANTED[family]
    handles: list = []
    if family == "mistral3":
        keep = torch.zeros(rows * columns)
        keep[cell] = 1
        _plant(handles, model.model.vision_tower.transformer.layers, model.model.multi_modal_projector, keep)
    elif family == "fuyu":
        keep = torch.zeros(rows * columns)
        keep[cell] = 1
        _plant(handles, [], model.model.vision_embed_tokens, keep)
    elif family in ("gemma3", "aya_vision"):  # the projector pools, or shuffles, 2 x 2 patches of 8 into a token
        keep = torch.zeros(rows * columns)
        keep[cell] = 1
        _plant(handles, model.model.vision_tower.encoder.layers, model.model.multi_modal_projector, keep)
    elif family in ("blip-2", "instructblip"):  # the tower's last block's patch tokens, after its class token
        keep = torch.zeros(1 + rows * columns)
        keep[1 + cell] = 1
        blocks = model.vision_model.encoder.layers
        _plant(handles, blocks, blocks[-1], keep)
    else:  # tile 1, its patch (1, 1): 1 + 4 + 1 after its class token; the class tokens and unused tiles zero
        keep = torch.zeros(1, 1, 4, 17)
        keep[0, 0, 1, 1 + 4 + 1] = 1
        vision = model.model.vision_model
        _plant(handles, [*vision.transformer.layers, *vision.global_transformer.layers],
               model.model.multi_modal_projector, keep)  # fmt: skip
    reading = image_reading(model, inputs)
    text = {"input_ids": torch.cat([inputs["input_ids"][0], torch.tensor([20])])[None]}
    if "cross_attention_mask" in inputs:
        seen = inputs["cross_attention_mask"]
        text["cross_attention_mask"] = torch.cat([seen, seen[:, -1:]], 1)  # the word sees what the prompt's last does
    wrapped = VisionLanguage(model, text, reading)
    try:
        gradcam = explain.GradCAM(wrapped, getattr(reading, "levels", [None])[0])  # the whole image's: searched
        gradcam.relu = False
        target = TokenTarget(text["input_ids"][0], [text["input_ids"].shape[1] - 1])
        x = reading.picture(inputs)
        cam = gradcam(x, target, resize=False, normalize=False).cams[0, 0]
        saliency = explain.create_method(method, wrapped)(x, target).raw[0, 0].abs().sum(0)
    finally:
        for handle in handles:
            handle.remove()
    row, column = divmod(cell, columns)
    if cam.shape == (rows, columns):  # the map itself
        assert cam[row, column] != 0 and torch.count_nonzero(cam) == 1
    else:  # tiles' maps come back on their canvas, bilinearly: the planted cell's pixels hold its peak
        peak = divmod(int(cam.abs().argmax()), cam.shape[1])
        assert cam.shape == (rows * side, columns * side) and (peak[0] // side, peak[1] // side) == (row, column)
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
    [("mllama", "reads the image by cross-attention.*aspect_ratio_ids"), ("chameleon", "discrete codes of a codebook"),
     ("emu3", "discrete codes of a codebook")],
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
    assert len(outcomes["explained"]) + len(outcomes["refused"]) >= 60


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


@pytest.fixture(scope="module")
def mistral3_folder(tmp_path_factory):
    """A tiny Mistral 3 saved with its Pixtral processor, built offline: rows of [IMG] closed by [IMG_BREAK]."""
    from test_vision_language import _tokenizer

    folder = tmp_path_factory.mktemp("mistral3")
    model = tiny("mistral3")
    words = ["<unk>", "<s>", "</s>", "<pad>", "what", "is", "it"] + [f"w{i}" for i in range(7, 300)]
    specials = {image_token(model): "[IMG]", 11: "[IMG_BREAK]", 12: "[IMG_END]"}
    for index, word in specials.items():
        words[index] = word
    processor = transformers.PixtralProcessor(
        image_processor=transformers.PixtralImageProcessor(size={"longest_edge": 48}, patch_size=8),
        tokenizer=_tokenizer(words, list(specials.values())), patch_size=8, spatial_merge_size=2,
        image_token="[IMG]", image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]",
    )  # fmt: skip
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_the_command_line_explains_each_word_of_mistral3s_answer_on_its_rows(mistral3_folder, tmp_path) -> None:
    """The command line on a family read in rows: the photo (not square) through the processor, each word's overlay
    the map explain_answer gives for the same processor's output."""
    import json

    from conftest import CAT
    from PIL import Image

    from explain.cli import main
    from explain.io.images import load_image
    from explain.io.render import overlay

    out = tmp_path / "out"
    assert main([str(CAT), "--model", str(mistral3_folder), "--prompt", "[IMG]what is it", "--max-new-tokens", "3",
                 "-o", str(out), "--quiet", "--format", "png"]) == 0  # fmt: skip
    _, record = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert record["layer"] == "reading.tokens"
    model = transformers.AutoModelForImageTextToText.from_pretrained(mistral3_folder).eval()
    processor = transformers.AutoProcessor.from_pretrained(mistral3_folder)
    image = load_image(CAT)
    inputs = processor(images=image, text="[IMG]what is it", return_tensors="pt")
    assert inputs["pixel_values"].shape[-2] != inputs["pixel_values"].shape[-1]
    found = explain.explain_answer(model, inputs, max_new_tokens=3)
    assert record["answer"] == processor.tokenizer.decode(found.answer.tolist())
    for target, cam in zip(record["targets"], found.maps, strict=True):
        written = np.asarray(Image.open(out / target["output"]), dtype=np.int16)
        assert np.abs(written - np.asarray(overlay(image, cam), dtype=np.int16)).max() <= 1


def test_fuyu_s_squared_relu_is_refused_by_the_relevance_methods_in_one_line() -> None:
    """Persimmon's MLP squares its ReLU: a square the relevance engine holds only as a norm's spread, so AttnLRP
    refuses, naming the way out, rather than propagating a wrong rule."""
    model, inputs, _ = fuyu()
    with pytest.raises(explain.LayerError, match=r"as a feature.*use lrp or a gradient method") as refused:
        explain.explain_answer(model, inputs, answer=ANSWER, method="attnlrp")
    assert "\n" not in str(refused.value)


def test_the_command_line_explains_a_given_answer_on_mistral3s_rows(mistral3_folder, tmp_path) -> None:
    """``--answer``: the given words' probabilities in the record are the model's own teacher-forced ones."""
    import json

    from conftest import CAT

    from explain.cli import main
    from explain.io.images import load_image

    out = tmp_path / "out"
    assert main([str(CAT), "--model", str(mistral3_folder), "--prompt", "[IMG]what is it", "--answer", "what is",
                 "-o", str(out), "--quiet"]) == 0  # fmt: skip
    _, record = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert record["answer"] == "what is" and [t["class_name"] for t in record["targets"]] == ["what", "is"]
    model = transformers.AutoModelForImageTextToText.from_pretrained(mistral3_folder).eval()
    processor = transformers.AutoProcessor.from_pretrained(mistral3_folder)
    inputs = dict(processor(images=load_image(CAT), text="[IMG]what is it", return_tensors="pt"))
    answer = processor.tokenizer("what is", add_special_tokens=False).input_ids
    expected = teacher_forced(model, inputs, answer, {})
    scores = [target["score"] for target in record["targets"]]
    assert np.allclose(scores, expected.numpy(), rtol=0, atol=1e-4)


def test_the_explorer_draws_each_word_of_mistral3s_answer_on_its_rows(mistral3_folder) -> None:
    """The explorer on a family read in rows: each clicked word's picture is the overlay of the map explain_answer
    gives for the processor's output of the same prompt and answer (Saliency: a random model's Grad-CAM may be
    all zero)."""
    pytest.importorskip("gradio")
    from conftest import CAT

    from explain.explorer import Explorer
    from explain.io.images import load_image
    from explain.io.render import overlay
    from explain.models.text_image import load_text_image_model

    spec = load_text_image_model(str(mistral3_folder))
    explorer = Explorer(spec)
    name = explorer.add(CAT).name
    request = explorer.reading("[IMG]what is it", "w20 w21", "", "saliency")
    words, record = explorer.words(name, request)
    assert [word.text for word in words] == ["w20", "w21"] and record["answer"] == "w20 w21"
    photo = load_image(CAT)
    inputs = spec.processor(images=photo, text="[IMG]what is it", return_tensors="pt")
    answer = spec.processor.tokenizer("w20 w21", add_special_tokens=False).input_ids
    found = explain.explain_answer(spec.model, dict(inputs), answer=answer, method="saliency")
    expected = [np.asarray(overlay(photo, cam), dtype=np.int16) for cam in found.maps]
    assert np.abs(expected[0] - expected[1]).max() > 1  # two maps a swapped click would tell apart
    for k in (1, 0):
        drawn = np.asarray(explorer.word_picture(name, request, k), dtype=np.int16)
        assert np.abs(drawn - expected[k]).max() <= 1
