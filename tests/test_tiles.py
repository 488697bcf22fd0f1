"""Images read as tiles, word by word: a tiny random LLaVA-NeXt whose processor pads a wide image into a canvas of
three tiles after a base tile, and a tiny Idefics3 (and SmolVLM) whose processor splits it into two tiles before
its base image;
each word's map against Grad-CAM written here (the tiles' map on the canvas, cut to the image, fused with the
base's), a vision token planted alone landing on its own pixels, the tiles' padding, grid and count checked, and
the command line end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CAT
from PIL import Image

import explain
from explain.io.images import load_image
from explain.io.render import overlay

transformers = pytest.importorskip("transformers")

SIDE, PATCH, IMAGE_TOKEN = 16, 4, 110
G = SIDE // PATCH  # 4 x 4 tokens per tile
PINPOINTS = [[16, 32], [32, 16], [32, 32], [16, 48]]
PHOTO = (21, 50)  # resized to 16 x 39 on a 16 x 48 canvas of 1 x 3 tiles, 4 columns of padding left, 5 right
BOX = (0, 4, 16, 39)  # top, left, height, width on the canvas
TOKENS = G * G + 4 * 10 + 4  # the base, then the tiles' 4 x 12 tokens cut to 4 x 10, and a token closing each row


def tiny_llava_next() -> torch.nn.Module:
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=SIDE,
        patch_size=PATCH, projection_dim=32,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=119,
    )  # fmt: skip
    config = transformers.LlavaNextConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, image_grid_pinpoints=PINPOINTS
    )
    torch.manual_seed(0)
    return transformers.LlavaNextForConditionalGeneration(config).eval()


def image_processor():
    return transformers.LlavaNextImageProcessor(
        size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE}, image_grid_pinpoints=PINPOINTS
    )


def inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    photo = np.random.default_rng(seed).integers(0, 256, (*PHOTO, 3), dtype=np.uint8)
    found = dict(image_processor()(images=[photo], return_tensors="pt"))
    return {**found, "input_ids": torch.tensor([[1, 5] + [IMAGE_TOKEN] * TOKENS + [6, 7]])}


def _normalized(cam: torch.Tensor) -> torch.Tensor:
    return (cam - cam.min()) / (cam.max() - cam.min())


def reference(model: torch.nn.Module, given: dict, sequence: torch.Tensor, position: int) -> torch.Tensor:
    """Grad-CAM of one token's log-probability at the projector, written out: the three tiles' 4 x 4 tokens side by
    side on the 16 x 48 canvas, cut to the image's 16 x 39 there; the base tile's 4 x 4 tokens stretched over the
    image; the two maps, each normalized, averaged."""
    kept = {}
    handle = model.model.multi_modal_projector.register_forward_hook(lambda m, i, o: kept.update(a=o))
    try:
        logits = model(input_ids=sequence[None], pixel_values=given["pixel_values"],
                       image_sizes=given["image_sizes"], use_cache=False).logits  # fmt: skip
    finally:
        handle.remove()
    (gradient,) = torch.autograd.grad(logits[0, position - 1].log_softmax(-1)[sequence[position]], kept["a"])
    activation = kept["a"].detach()  # (1 + 3 tiles, 16 tokens, C)

    top, left, height, width = BOX
    weights = gradient[1:].mean((0, 1))  # over the canvas's 4 x 12 cells: the three tiles' tokens
    tiles = torch.relu(torch.cat([(activation[t] @ weights).reshape(G, G) for t in (1, 2, 3)], dim=1))
    on_canvas = F.interpolate(tiles[None, None], size=(SIDE, 3 * SIDE), mode="bilinear", align_corners=False)[0, 0]
    tiles = on_canvas[top : top + height, left : left + width]
    base = torch.relu((activation[0] @ gradient[0].mean(0)).reshape(G, G))
    base = F.interpolate(base[None, None], size=(height, width), mode="bilinear", align_corners=False)[0, 0]
    return _normalized(_normalized(tiles) + _normalized(base))


def test_each_words_map_is_grad_cam_of_the_tiles_on_their_canvas_fused_with_the_base() -> None:
    model, given = tiny_llava_next(), inputs()
    found = explain.explain_answer(model, given, max_new_tokens=3)
    assert found.result.layer == "reading.tiles+reading.base" and found.maps.shape[-2:] == BOX[2:]
    sequence = torch.cat([given["input_ids"][0], found.answer])
    for k, position in enumerate(range(given["input_ids"].shape[1], len(sequence))):
        expected = reference(model, given, sequence, position)
        assert torch.corrcoef(torch.stack([found.maps[k].flatten(), expected.flatten()]))[0, 1] > 0.999


def test_the_picture_is_the_image_on_its_tiles_and_is_cut_into_them_again() -> None:
    from explain.models.vision_language import image_reading

    model, given = tiny_llava_next(), inputs()
    reading = image_reading(model, given)
    picture = reading.picture(given)
    _, left, height, width = BOX
    assert picture.shape == (1, 3, height, width)
    assert torch.equal(picture[0, :, :, :12], given["pixel_values"][0, 1, :, :, left:])  # the first tile, unpadded
    again = reading.model_inputs(picture)
    assert torch.equal(again["pixel_values"], given["pixel_values"])
    assert torch.equal(again["image_sizes"], given["image_sizes"])


@pytest.mark.parametrize("method", ["saliency", "attnlrp", "cplrp"])
def test_a_vision_token_planted_alone_lands_on_its_own_pixels(method: str) -> None:
    """Encoder layers that pass their input on, and one token of the second tile alone left at the projector: the
    gradient of a word (or its relevance, AttnLRP's and CP-LRP's) reaches that token's 4 x 4 pixels of the canvas,
    moved by the padding onto the picture, and no other."""
    model, given = tiny_llava_next(), inputs()
    tile, cell = 2, 5  # the middle tile; its row 1, column 1
    keep = torch.zeros(1 + 3, G * G, 1)
    keep[tile, cell] = 1
    handles = [layer.register_forward_hook(lambda m, args, out: args[0]) for layer in
               model.model.vision_tower.encoder.layers]  # fmt: skip
    handles.append(model.model.multi_modal_projector.register_forward_hook(lambda m, i, o: o * keep))
    try:
        found = explain.explain_answer(model, given, answer=[20], method=method)
    finally:
        for handle in handles:
            handle.remove()
    row, column = divmod(cell, G)
    top = row * PATCH - BOX[0]
    left = (tile - 1) * SIDE + column * PATCH - BOX[1]
    where = torch.zeros(BOX[2:], dtype=torch.bool)
    where[top : top + PATCH, left : left + PATCH] = True
    reached = found.result.raw[0, 0].abs().sum(dim=0)  # the pixels' gradient, or relevance, in any channel
    assert bool((reached[~where] == 0).all()) and bool((reached[where] > 0).any())


def test_tiles_that_are_not_the_processors_are_refused() -> None:
    model, given = tiny_llava_next(), inputs()
    with pytest.raises(explain.ExplainError, match="made 60 tokens per image, but the text holds 59 image tokens"):
        explain.explain_answer(model, {**given, "input_ids": given["input_ids"][:, :-3]}, answer=[5])
    moved = given["pixel_values"].clone()
    moved[0, 1, :, :, 0] += 1  # the padding at the canvas's left edge changed
    with pytest.raises(explain.ExplainError, match="not padded around the 21x50 image"):
        explain.explain_answer(model, {**given, "pixel_values": moved}, answer=[5])
    with pytest.raises(explain.ExplainError, match="not the 1x3 tiles and the base image"):
        explain.explain_answer(model, {**given, "pixel_values": given["pixel_values"][:, :3]}, answer=[5])


@pytest.fixture(scope="module")
def llava_next_folder(tmp_path_factory) -> Path:
    from test_vision_language import WORDS, _tokenizer

    folder = tmp_path_factory.mktemp("llava_next")
    words = WORDS + [f"w{i}" for i in range(len(WORDS), IMAGE_TOKEN)] + ["<image>"]
    processor = transformers.LlavaNextProcessor(
        image_processor=image_processor(), tokenizer=_tokenizer(words, "<image>"), patch_size=PATCH,
        vision_feature_select_strategy="default", image_token="<image>", num_additional_image_tokens=1,
    )  # fmt: skip
    tiny_llava_next().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_the_command_line_explains_each_word_of_llava_nexts_answer(llava_next_folder, tmp_path) -> None:
    from explain.cli import main

    out = tmp_path / "out"
    assert main([str(CAT), "--model", str(llava_next_folder), "--prompt", "what is on the table?",
                 "--answer", "a cat", "-o", str(out), "--quiet", "--format", "png"]) == 0  # fmt: skip
    (record,) = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()][1:]
    assert [token["class_name"] for token in record["targets"]] == ["a", "cat"]
    assert record["layer"] == "reading.tiles+reading.base"
    model = transformers.AutoModelForImageTextToText.from_pretrained(llava_next_folder).eval()
    processor = transformers.AutoProcessor.from_pretrained(llava_next_folder)
    photo = load_image(CAT)
    given = processor(images=photo, text="USER: <image>\nwhat is on the table? ASSISTANT:", return_tensors="pt",
                      do_center_crop=False, size={"height": SIDE, "width": SIDE})  # fmt: skip
    found = explain.explain_answer(model, dict(given), answer=processor.tokenizer("a cat").input_ids)
    for token, cam in zip(record["targets"], found.maps):
        written = np.asarray(Image.open(out / token["output"]), dtype=np.int16)
        assert np.abs(written - np.asarray(overlay(photo, cam), dtype=np.int16)).max() <= 1


@pytest.mark.parametrize("fails", [False, True])
def test_llava_next_is_left_as_it_was(fails: bool) -> None:
    model, given = tiny_llava_next(), inputs()
    model.model.vision_tower.encoder.layers[0].train()
    flags = [p.requires_grad for p in model.parameters()]
    with torch.no_grad():  # transformers installs its own output-capturing hooks at a model's first forward
        model(**given)
    hooks = [(m._forward_hooks.copy(), m._forward_pre_hooks.copy(), m._backward_hooks.copy()) for m in model.modules()]
    if fails:
        with pytest.raises(explain.ExplainError):
            explain.explain_answer(model, {**given, "input_ids": given["input_ids"][:, :-3]}, answer=[5])
    else:
        explain.explain_answer(model, given, max_new_tokens=2, method="layercam")
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert model.model.vision_tower.encoder.layers[0].training and not model.model.vision_tower.encoder.training
    assert [(m._forward_hooks, m._forward_pre_hooks, m._backward_hooks) for m in model.modules()] == hooks


# Idefics3: a 21 x 50 photo resized to 16 x 32, split into 1 x 2 tiles of 16 pixels, the base image last; its
# connector shuffles each 2 x 2 of a tile's 4 x 4 patches into one token: 2 x 2 tokens per tile.
SCALE, SEQ = 2, (SIDE // PATCH // 2) ** 2
SPLIT_TOKENS = 3 * SEQ
SPECIALS = {IMAGE_TOKEN: "<image>", 111: "<fake_token_around_image>", 112: "<end_of_utterance>", 113: "<global-img>",
            **{114 + 3 * i + j: f"<row_{i + 1}_col_{j + 1}>" for i in range(3) for j in range(3)}}  # fmt: skip


def tiny_idefics3(kind: str = "idefics3") -> torch.nn.Module:
    """A tiny Idefics3, or SmolVLM (Idefics3's architecture under its own classes)."""
    vision_config, config_class, model_class = {
        "idefics3": (transformers.Idefics3VisionConfig, transformers.Idefics3Config,
                     transformers.Idefics3ForConditionalGeneration),
        "smolvlm": (transformers.SmolVLMVisionConfig, transformers.SmolVLMConfig,
                    transformers.SmolVLMForConditionalGeneration),
    }[kind]  # fmt: skip
    vision = vision_config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=SIDE,
        patch_size=PATCH,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=127,
    )  # fmt: skip
    config = config_class(vision_config=vision, text_config=text, scale_factor=SCALE, image_token_id=IMAGE_TOKEN)
    torch.manual_seed(0)
    return model_class(config).eval()


def split_processor():
    return transformers.Idefics3ImageProcessor(
        size={"longest_edge": 2 * SIDE}, max_image_size={"longest_edge": SIDE}, do_image_splitting=True
    )


def split_inputs(seed: int = 1) -> dict:
    photo = np.random.default_rng(seed).integers(0, 256, (*PHOTO, 3), dtype=np.uint8)
    found = dict(split_processor()(images=[[photo]], return_tensors="pt", return_row_col_info=True))
    return {**found, "input_ids": torch.tensor([[1, 5] + [IMAGE_TOKEN] * SPLIT_TOKENS + [6, 7]])}


def split_reference(model: torch.nn.Module, given: dict, sequence: torch.Tensor, position: int) -> torch.Tensor:
    """Grad-CAM at the connector, written out: the two tiles' 2 x 2 tokens side by side over the 16 x 32 picture,
    the base's (the last) stretched over it, each normalized, averaged."""
    kept = {}
    handle = model.model.connector.register_forward_hook(lambda m, i, o: kept.update(a=o))
    try:
        logits = model(input_ids=sequence[None], pixel_values=given["pixel_values"],
                       pixel_attention_mask=given["pixel_attention_mask"], use_cache=False).logits  # fmt: skip
    finally:
        handle.remove()
    (gradient,) = torch.autograd.grad(logits[0, position - 1].log_softmax(-1)[sequence[position]], kept["a"])
    activation, g = kept["a"].detach(), SIDE // PATCH // SCALE
    weights = gradient[:2].mean((0, 1))
    tiles = torch.relu(torch.cat([(activation[t] @ weights).reshape(g, g) for t in (0, 1)], dim=1))
    tiles = F.interpolate(tiles[None, None], size=(SIDE, 2 * SIDE), mode="bilinear", align_corners=False)[0, 0]
    base = torch.relu((activation[2] @ gradient[2].mean(0)).reshape(g, g))
    base = F.interpolate(base[None, None], size=(SIDE, 2 * SIDE), mode="bilinear", align_corners=False)[0, 0]
    return _normalized(_normalized(tiles) + _normalized(base))


@pytest.mark.parametrize("kind", ["idefics3", "smolvlm"])
def test_each_words_map_of_a_split_image_is_grad_cam_of_its_tiles_fused_with_the_base(kind: str) -> None:
    model, given = tiny_idefics3(kind), split_inputs()
    found = explain.explain_answer(model, given, max_new_tokens=3)
    assert found.result.layer == "reading.tiles+reading.base" and found.maps.shape[-2:] == (SIDE, 2 * SIDE)
    sequence = torch.cat([given["input_ids"][0], found.answer])
    for k, position in enumerate(range(given["input_ids"].shape[1], len(sequence))):
        expected = split_reference(model, given, sequence, position)
        assert torch.corrcoef(torch.stack([found.maps[k].flatten(), expected.flatten()]))[0, 1] > 0.999


@pytest.mark.parametrize("method", ["saliency", "attnlrp", "cplrp"])
def test_a_token_of_a_split_image_planted_alone_lands_on_its_own_pixels(method: str) -> None:
    """Encoder layers that pass their input on, and one token of the second tile alone left at the connector: a
    word's gradient (or relevance) reaches the 8 x 8 pixels (2 x 2 patches shuffled into it) of that token, and no
    other."""
    model, given = tiny_idefics3(), split_inputs()
    tile, cell = 1, 2  # the second tile; its token at row 1, column 0
    keep = torch.zeros(3, SEQ, 1)
    keep[tile, cell] = 1
    handles = [layer.register_forward_hook(lambda m, args, out: args[0]) for layer in
               model.model.vision_model.encoder.layers]  # fmt: skip
    handles.append(model.model.connector.register_forward_hook(lambda m, i, o: o * keep))
    try:
        found = explain.explain_answer(model, given, answer=[20], method=method)
    finally:
        for handle in handles:
            handle.remove()
    side = PATCH * SCALE
    row, column = divmod(cell, SIDE // side)
    where = torch.zeros(SIDE, 2 * SIDE, dtype=torch.bool)
    where[row * side : (row + 1) * side, tile * SIDE + column * side : tile * SIDE + (column + 1) * side] = True
    reached = found.result.raw[0, 0].abs().sum(dim=0)  # the pixels' gradient, or relevance, in any channel
    assert bool((reached[~where] == 0).all()) and bool((reached[where] > 0).any())


def test_a_split_image_without_its_rows_and_columns_is_refused() -> None:
    model, given = tiny_idefics3(), split_inputs()
    unsaid = {k: v for k, v in given.items() if k not in ("rows", "cols")}
    with pytest.raises(explain.ExplainError, match="return_row_col_info=True"):
        explain.explain_answer(model, unsaid, answer=[5])
    with pytest.raises(explain.ExplainError, match="rows 2 and cols 2 are not the image's 2 tiles"):
        explain.explain_answer(model, {**given, "rows": [[2]], "cols": [[2]]}, answer=[5])
    with pytest.raises(explain.ExplainError, match="made 12 tokens per image, but the text holds 11 image tokens"):
        explain.explain_answer(model, {**given, "input_ids": given["input_ids"][:, :-3]}, answer=[5])
    masked = given["pixel_attention_mask"].clone()
    masked[..., -1] = 0
    with pytest.raises(explain.ExplainError, match="masks pixels of the tiles"):
        explain.explain_answer(model, {**given, "pixel_attention_mask": masked}, answer=[5])


@pytest.fixture(scope="module")
def idefics3_folder(tmp_path_factory) -> Path:
    from test_vision_language import WORDS, _tokenizer

    folder = tmp_path_factory.mktemp("idefics3")
    words = WORDS + [f"w{i}" for i in range(len(WORDS), 128)]
    for index, special in SPECIALS.items():
        words[index] = special
    processor = transformers.Idefics3Processor(
        image_processor=split_processor(), tokenizer=_tokenizer(words, list(SPECIALS.values())), image_seq_len=SEQ
    )
    tiny_idefics3().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_the_command_line_explains_each_word_of_idefics3s_answer(idefics3_folder, tmp_path) -> None:
    from explain.cli import main

    out = tmp_path / "out"
    assert main([str(CAT), "--model", str(idefics3_folder), "--prompt", "what is on the table?",
                 "--answer", "a cat", "-o", str(out), "--quiet", "--format", "png"]) == 0  # fmt: skip
    (record,) = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()][1:]
    assert [token["class_name"] for token in record["targets"]] == ["a", "cat"]
    assert record["layer"] == "reading.tiles+reading.base"
    model = transformers.AutoModelForImageTextToText.from_pretrained(idefics3_folder).eval()
    processor = transformers.AutoProcessor.from_pretrained(idefics3_folder)
    photo = load_image(CAT)
    given = dict(processor(images=[[photo]], text=["USER: <image>\nwhat is on the table? ASSISTANT:"],
                           return_tensors="pt"))  # fmt: skip
    info = processor.image_processor(images=[[photo]], return_row_col_info=True)
    given.update(rows=info["rows"], cols=info["cols"])
    found = explain.explain_answer(model, given, answer=processor.tokenizer("a cat").input_ids)
    for token, cam in zip(record["targets"], found.maps):
        written = np.asarray(Image.open(out / token["output"]), dtype=np.int16)
        assert np.abs(written - np.asarray(overlay(photo, cam), dtype=np.int16)).max() <= 1


def test_an_image_not_split_is_one_squeezed_tile() -> None:
    """An image processor that does not split: the photo's one tile, squeezed, is the picture, and the map is
    Grad-CAM of its 2 x 2 tokens."""
    model = tiny_idefics3()
    photo = np.random.default_rng(2).integers(0, 256, (10, 12, 3), dtype=np.uint8)
    whole = transformers.Idefics3ImageProcessor(
        size={"longest_edge": SIDE}, max_image_size={"longest_edge": SIDE}, do_image_splitting=False
    )
    given = dict(whole(images=[[photo]], return_tensors="pt"))
    assert given["pixel_values"].shape[1] == 1
    given["input_ids"] = torch.tensor([[1, 5] + [IMAGE_TOKEN] * SEQ + [6, 7]])
    found = explain.explain_answer(model, given, answer=[20])
    assert found.result.layer == "reading.tiles" and found.maps.shape[-2:] == (SIDE, SIDE)
    kept = {}
    handle = model.model.connector.register_forward_hook(lambda m, i, o: kept.update(a=o))
    try:
        sequence = torch.cat([given["input_ids"][0], torch.tensor([20])])
        logits = model(input_ids=sequence[None], pixel_values=given["pixel_values"], use_cache=False).logits
    finally:
        handle.remove()
    (gradient,) = torch.autograd.grad(logits[0, -2].log_softmax(-1)[20], kept["a"])
    g = SIDE // PATCH // SCALE
    cam = torch.relu((kept["a"][0].detach() @ gradient[0].mean(0)).reshape(g, g))
    cam = F.interpolate(cam[None, None], size=(SIDE, SIDE), mode="bilinear", align_corners=False)[0, 0]
    assert torch.corrcoef(torch.stack([found.maps[0].flatten(), _normalized(cam).flatten()]))[0, 1] > 0.999
