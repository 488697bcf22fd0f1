"""Qwen2-VL and Qwen2.5-VL word by word: tiny random configs whose tower merges 2 x 2 patches (Qwen2.5-VL's also
reordered into windows inside it); the picture put back together from the processor's patches, each word's map
against Grad-CAM written here at the tower's output (its grid taken from the config), a vision token planted alone
landing on its own pixels, and the command line end to end."""

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
from explain.models import VisionLanguage
from explain.models.vision_language import image_reading, text_inputs
from explain.targets import TokenTarget

transformers = pytest.importorskip("transformers")

PATCH, MERGE, FRAMES = 4, 2, 2
HEIGHT, WIDTH = 40, 56  # 10 x 14 patches, 5 x 7 merged tokens: windows of 2 x 2 merged tokens do not tile it
IMAGE_TOKEN, VISION_START, VISION_END = 110, 111, 112
KINDS = ["qwen2_vl", "qwen2_5_vl"]


def tiny_qwen(kind: str) -> torch.nn.Module:
    vision = dict(
        depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, intermediate_size=64, patch_size=PATCH,
        spatial_merge_size=MERGE, temporal_patch_size=FRAMES, out_hidden_size=32, window_size=2 * PATCH * MERGE,
        fullatt_block_indexes=[1],
    )  # fmt: skip
    text = dict(
        vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        bos_token_id=1, eos_token_id=119, pad_token_id=3,
    )  # fmt: skip
    config_class, model_class = {
        "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    }[kind]
    config = config_class(
        vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN, video_token_id=113,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, bos_token_id=1, eos_token_id=119,
        pad_token_id=3,
    )  # fmt: skip
    torch.manual_seed(1)
    return model_class(config).eval()


def image_processor(**options) -> object:
    return transformers.Qwen2VLImageProcessor(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=FRAMES, min_pixels=HEIGHT * WIDTH,
        max_pixels=HEIGHT * WIDTH, **options,
    )  # fmt: skip


def inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    """The processor's image (a random photo of the model's size) and a prompt around its 35 image tokens."""
    rng = np.random.default_rng(seed)
    photo = rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    found = dict(image_processor()(images=[photo], return_tensors="pt"))
    tokens = (HEIGHT // PATCH // MERGE) * (WIDTH // PATCH // MERGE)
    ids = torch.tensor([[1, 5, VISION_START] + [IMAGE_TOKEN] * tokens + [VISION_END, 6, 7]])
    return {**found, "input_ids": ids, "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}


def test_the_picture_is_put_back_together_from_the_processors_patches() -> None:
    """A photo of the model's size, neither rescaled nor normalized: the picture is the photo itself, and cut again
    it gives the processor's patches exactly."""
    photo = np.random.default_rng(0).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    found = image_processor(do_rescale=False, do_normalize=False)(images=[photo], return_tensors="pt")
    ids = torch.tensor([[1] + [IMAGE_TOKEN] * 35 + [6]])
    model = tiny_qwen("qwen2_vl")
    with pytest.raises(explain.ExplainError, match="the text lacks mm_token_type_ids"):
        image_reading(model, {**found, "input_ids": ids})
    reading = image_reading(model, {**found, "input_ids": ids, "mm_token_type_ids": (ids == IMAGE_TOKEN).int()})
    picture = reading.picture(found)
    assert torch.equal(picture[0], torch.from_numpy(photo).permute(2, 0, 1).to(picture.dtype))
    again = reading.model_inputs(picture)
    assert torch.equal(again["pixel_values"], found["pixel_values"])
    assert torch.equal(again["image_grid_thw"], found["image_grid_thw"])


def reference(model: torch.nn.Module, given: dict, sequence: torch.Tensor, position: int) -> torch.Tensor:
    """Grad-CAM of one token's log-probability at the vision tower's merged output, written out: its 35 tokens on
    the 5 x 7 grid of merged patches (from the config's patch and merge sizes), row by row."""
    kept = {}

    def keep(module, args, output):
        kept["a"] = output.pooler_output

    handle = model.model.visual.register_forward_hook(keep)
    types = (sequence == IMAGE_TOKEN).int()[None]
    try:
        logits = model(input_ids=sequence[None], mm_token_type_ids=types, pixel_values=given["pixel_values"],
                       image_grid_thw=given["image_grid_thw"], use_cache=False).logits  # fmt: skip
    finally:
        handle.remove()
    (gradient,) = torch.autograd.grad(logits[0, position - 1].log_softmax(-1)[sequence[position]], kept["a"])
    rows, columns = HEIGHT // PATCH // MERGE, WIDTH // PATCH // MERGE
    activation = kept["a"].detach().T.reshape(-1, rows, columns)
    cam = torch.relu((gradient.mean(0)[:, None, None] * activation).sum(0))
    cam = F.interpolate(cam[None, None], size=(HEIGHT, WIDTH), mode="bilinear", align_corners=False)[0, 0]
    return (cam - cam.min()) / (cam.max() - cam.min())


@pytest.mark.parametrize("kind", KINDS)
def test_each_words_map_is_grad_cam_at_the_merged_tokens(kind: str) -> None:
    model, given = tiny_qwen(kind), inputs()
    found = explain.explain_answer(model, given, max_new_tokens=3)
    assert found.result.layer == "reading.tokens" and found.maps.shape[-2:] == (HEIGHT, WIDTH)
    sequence = torch.cat([given["input_ids"][0], found.answer])
    for k, position in enumerate(range(given["input_ids"].shape[1], len(sequence))):
        expected = reference(model, given, sequence, position)
        assert torch.corrcoef(torch.stack([found.maps[k].flatten(), expected.flatten()]))[0, 1] > 0.999


@pytest.mark.parametrize("method", ["saliency", "attnlrp", "cplrp"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_vision_token_planted_alone_lands_on_its_own_pixels(kind: str, method: str) -> None:
    """Blocks that pass their input on and one merged token alone left at the tower's output: the gradient of a
    word (or its relevance, AttnLRP's and CP-LRP's) reaches the 8 x 8 pixels of that token's cell (row-major on
    the 5 x 7 grid of the config) and no other, through the patches' cutting, Qwen2.5-VL's windows and their
    undoing; the map at the tokens has that cell alone."""
    model, given = tiny_qwen(kind), inputs()
    token, columns, side = 12, WIDTH // PATCH // MERGE, PATCH * MERGE  # row 1, column 5
    keep = torch.zeros(35, 1)
    keep[token] = 1

    def planted(module, args, output):
        output.pooler_output = output.pooler_output * keep
        return output

    handles = [block.register_forward_hook(lambda m, args, out: args[0]) for block in model.model.visual.blocks]
    handles.append(model.model.visual.register_forward_hook(planted))
    try:
        found = explain.explain_answer(model, given, answer=[20], method=method)
        method = explain.GradCAM(
            VisionLanguage(model, text_inputs(given), image_reading(model, given)), "reading.tokens"
        )
        method.relu = False
        picture = method.model.reading.picture(given)
        target = TokenTarget(given["input_ids"][0], [given["input_ids"].shape[1] - 1])
        cams = method(picture, target, resize=False, normalize=False).cams[0, 0]
    finally:
        for handle in handles:
            handle.remove()
    row, column = divmod(token, columns)
    where = torch.zeros(HEIGHT, WIDTH, dtype=torch.bool)
    where[row * side : (row + 1) * side, column * side : (column + 1) * side] = True
    reached = found.result.raw[0, 0].abs().sum(dim=0)  # the pixels' gradient, or relevance, in any channel
    assert bool((reached[~where] == 0).all()) and bool((reached[where] > 0).any())
    assert cams.shape == (5, 7) and cams[row, column] != 0 and torch.count_nonzero(cams) == 1


def test_image_tokens_that_the_language_model_does_not_place_on_the_grid_are_refused() -> None:
    model, given = tiny_qwen("qwen2_vl"), inputs()
    short = torch.tensor([[1, VISION_START] + [IMAGE_TOKEN] * 34 + [VISION_END, 6]])
    with pytest.raises(explain.ExplainError, match="made 35 tokens per image, but the text holds 34 image tokens"):
        explain.explain_answer(model, {**given, "input_ids": short, "mm_token_type_ids": (short == IMAGE_TOKEN).int()},
                               answer=[5])  # fmt: skip
    video = given["pixel_values"].clone()
    video[:, -1] += 1  # the second frame differs from the first
    with pytest.raises(explain.ExplainError, match="the answer holds the image token"):
        explain.explain_answer(model, given, answer=[5, IMAGE_TOKEN])
    with pytest.raises(explain.ExplainError, match="frames that differ: a video"):
        explain.explain_answer(model, {**given, "pixel_values": video}, answer=[5])


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory) -> Path:
    from test_vision_language import WORDS, _tokenizer

    folder = tmp_path_factory.mktemp("qwen")
    specials = {IMAGE_TOKEN: "<|image_pad|>", VISION_START: "<|vision_start|>", VISION_END: "<|vision_end|>",
                113: "<|video_pad|>"}  # fmt: skip
    words = WORDS + [f"w{i}" for i in range(len(WORDS), 120)]
    for index, special in specials.items():
        words[index] = special
    tokenizer = _tokenizer(words, list(specials.values()))
    tokenizer.image_token, tokenizer.video_token = "<|image_pad|>", "<|video_pad|>"
    videos = transformers.Qwen2VLVideoProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=FRAMES)
    processor = transformers.Qwen2VLProcessor(image_processor=image_processor(), tokenizer=tokenizer,
                                              video_processor=videos)  # fmt: skip
    tiny_qwen("qwen2_5_vl").save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_the_command_line_explains_each_word_of_qwens_answer(qwen_folder, tmp_path) -> None:
    from explain.cli import main

    out = tmp_path / "out"
    assert main([str(CAT), "--model", str(qwen_folder), "--prompt", "what is on the table?", "--answer", "a cat",
                 "-o", str(out), "--quiet", "--format", "png"]) == 0  # fmt: skip
    (record,) = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()][1:]
    assert [token["class_name"] for token in record["targets"]] == ["a", "cat"] and record["layer"] == "reading.tokens"
    model = transformers.AutoModelForImageTextToText.from_pretrained(qwen_folder).eval()
    processor = transformers.AutoProcessor.from_pretrained(qwen_folder)
    photo = load_image(CAT)
    given = processor(images=photo, text="USER: <|image_pad|>\nwhat is on the table? ASSISTANT:", return_tensors="pt")
    found = explain.explain_answer(model, dict(given), answer=processor.tokenizer("a cat").input_ids)
    for token, cam in zip(record["targets"], found.maps):
        written = np.asarray(Image.open(out / token["output"]), dtype=np.int16)
        assert np.abs(written - np.asarray(overlay(photo, cam), dtype=np.int16)).max() <= 1


@pytest.mark.parametrize("fails", [False, True])
def test_qwens_model_is_left_as_it_was(fails: bool) -> None:
    model, given = tiny_qwen("qwen2_5_vl"), inputs()
    model.model.visual.blocks[0].train()
    flags = [p.requires_grad for p in model.parameters()]
    with torch.no_grad():  # transformers installs its own output-capturing hooks at a model's first forward
        model(**given)
    hooks = [(m._forward_hooks.copy(), m._forward_pre_hooks.copy(), m._backward_hooks.copy()) for m in model.modules()]
    cache = model.config.text_config.use_cache
    if fails:
        with pytest.raises(explain.ExplainError):
            explain.explain_answer(model, {**given, "input_ids": given["input_ids"][:, :-5]}, answer=[5])
    else:
        explain.explain_answer(model, given, max_new_tokens=2, method="gradcampp")
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert model.model.visual.blocks[0].training and not model.model.visual.blocks[1].training
    assert model.config.text_config.use_cache == cache
    assert [(m._forward_hooks, m._forward_pre_hooks, m._backward_hooks) for m in model.modules()] == hooks


def test_a_layer_inside_the_tower_is_refused_with_the_way_out() -> None:
    """Inside the tower the tokens of all images lie in one sequence, in merge groups and windows: no map of the
    image is guessed from them."""
    model, given = tiny_qwen("qwen2_5_vl"), inputs()
    with pytest.raises(explain.ExplainError, match=r"not a map of the image.*reshape="):
        explain.explain_answer(model, given, answer=[5], layer="model.model.visual.blocks.1")
