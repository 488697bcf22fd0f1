"""Vision-language models word by word: a tiny random LLaVA, each answer token's map against Grad-CAM written here
from hooks and autograd (the grid from the config), the vision tokens' places checked by a planted token, the
count of image tokens checked, and the model left as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CAT, COFFEE
from PIL import Image

import explain
from explain.models import VisionLanguage, generate_answer
from explain.targets import TokenTarget

transformers = pytest.importorskip("transformers")

IMAGE, PATCH, IMAGE_TOKEN = 32, 8, 99
GRID = IMAGE // PATCH  # 4 x 4 vision tokens, the class token dropped by LLaVA's "default" selection


def tiny_llava() -> torch.nn.Module:
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE,
        patch_size=PATCH, projection_dim=32,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config).eval()


PROMPT = torch.tensor([[1, 5, 6] + [IMAGE_TOKEN] * GRID**2 + [7, 8]])


def image() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(1, 3, IMAGE, IMAGE)


def reference(
    model: torch.nn.Module, x: torch.Tensor, sequence: torch.Tensor, positions: int | list[int]
) -> torch.Tensor:
    """Grad-CAM of tokens' summed log-probability at the projector's output, written out: its 16 tokens on the
    4 x 4 patch grid, row by row as the patch embedding flattens them."""
    kept = {}
    handle = model.model.multi_modal_projector.register_forward_hook(lambda m, i, o: kept.update(a=o))
    try:
        logits = model(input_ids=sequence[None], pixel_values=x, use_cache=False).logits
    finally:
        handle.remove()
    score = sum(
        logits[0, p - 1].log_softmax(-1)[sequence[p]]
        for p in ([positions] if isinstance(positions, int) else positions)
    )
    (gradient,) = torch.autograd.grad(score, kept["a"])
    activation = kept["a"][0].detach().T.reshape(-1, GRID, GRID)
    weights = gradient[0].mean(dim=0)
    cam = torch.relu((weights[:, None, None] * activation).sum(0))
    cam = F.interpolate(cam[None, None], size=(IMAGE, IMAGE), mode="bilinear", align_corners=False)[0, 0]
    return (cam - cam.min()) / (cam.max() - cam.min())


def test_each_answer_tokens_map_is_grad_cam_of_its_log_probability() -> None:
    model, x = tiny_llava(), image()
    found = explain.explain_answer(model, {"pixel_values": x, "input_ids": PROMPT}, max_new_tokens=4)
    generated = generate_answer(model, {"pixel_values": x, "input_ids": PROMPT}, max_new_tokens=4)[0]
    assert torch.equal(found.answer, generated)
    assert found.result.layer == "model.model.multi_modal_projector"  # the last map of the image before the text
    sequence = torch.cat([PROMPT[0], found.answer])
    for k, position in enumerate(range(PROMPT.shape[1], len(sequence))):
        expected = reference(model, x, sequence, position)
        r = torch.corrcoef(torch.stack([found.maps[k].flatten(), expected.flatten()]))[0, 1]
        assert r > 0.999
    probabilities = found.result.probabilities.reshape(-1)
    logits = model(input_ids=sequence[None], pixel_values=x).logits[0]
    wanted = [logits[p - 1].softmax(-1)[sequence[p]] for p in range(PROMPT.shape[1], len(sequence))]
    torch.testing.assert_close(probabilities, torch.stack(wanted).detach())


def test_the_whole_answer_is_the_sum_of_its_tokens() -> None:
    model, x = tiny_llava(), image()
    answer = torch.tensor([10, 11, 12])
    inputs = {"pixel_values": x, "input_ids": PROMPT}
    found = explain.explain_answer(
        model, inputs, answer=answer, whole=True, decode=lambda ids: " ".join(f"w{t}" for t in ids)
    )
    assert found.words == ["w10", "w11", "w12"] and found.maps.shape == (3, IMAGE, IMAGE)
    page = found._repr_html_()  # how Jupyter shows it: each word under its map
    assert page.count("<img") == 3 and all(f"w{t}" in page for t in (10, 11, 12))
    sequence = torch.cat([PROMPT[0], answer])
    expected = reference(model, x, sequence, list(range(PROMPT.shape[1], len(sequence))))
    assert torch.corrcoef(torch.stack([found.whole.flatten(), expected.flatten()]))[0, 1] > 0.999


def test_a_word_of_several_tokens_is_one_map_of_their_summed_log_probability() -> None:
    """Tokens 10 and 11 spell one word ("ta" "ble"), token 12 the next (" is"): two maps, the first of the two
    tokens' summed log-probabilities, its probability their product."""
    model, x = tiny_llava(), image()
    pieces = {10: "ta", 11: "ble", 12: " is"}
    answer = torch.tensor([10, 11, 12])
    found = explain.explain_answer(
        model, {"pixel_values": x, "input_ids": PROMPT}, answer=answer,
        decode=lambda ids: "".join(pieces[t] for t in ids),
    )  # fmt: skip
    assert found.words == ["table", "is"] and found.tokens == [2, 1] and found.maps.shape == (2, IMAGE, IMAGE)
    sequence = torch.cat([PROMPT[0], answer])
    start = PROMPT.shape[1]
    for k, positions in enumerate([[start, start + 1], [start + 2]]):
        expected = reference(model, x, sequence, positions)
        assert torch.corrcoef(torch.stack([found.maps[k].flatten(), expected.flatten()]))[0, 1] > 0.999
    with torch.no_grad():
        logits = model(input_ids=sequence[None], pixel_values=x, use_cache=False).logits[0]
    pieces = [logits[p - 1].softmax(-1)[sequence[p]] for p in (start, start + 1)]
    torch.testing.assert_close(found.result.probabilities[0, 0], pieces[0] * pieces[1])


def test_a_vision_token_lands_on_its_own_cell() -> None:
    """Only one vision token left non-zero at the projector: the map at the grid's resolution is non-zero at that
    token's cell alone (row-major patches), whatever the text does with it."""
    model, x = tiny_llava(), image()
    token = 6  # row 1, column 2
    keep = torch.zeros(1, GRID**2, 1)
    keep[0, token] = 1
    handle = model.model.multi_modal_projector.linear_2.register_forward_hook(lambda m, i, o: o * keep)
    try:
        method = explain.GradCAM(VisionLanguage(model, {"input_ids": PROMPT}), "model.model.multi_modal_projector")
        method.relu = False  # the weighted sum itself: its sign at the token's cell is the text's business
        maps = method(x, TokenTarget(PROMPT[0], [PROMPT.shape[1] - 1]), resize=False, normalize=False).cams[0, 0]
    finally:
        handle.remove()
    assert maps.shape == (GRID, GRID)
    assert maps[token // GRID, token % GRID] != 0 and torch.count_nonzero(maps) == 1


def tiny_paligemma() -> torch.nn.Module:
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE,
        patch_size=PATCH,
    )  # fmt: skip
    text = transformers.GemmaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
    )  # fmt: skip
    config = transformers.PaliGemmaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, projection_dim=32
    )
    torch.manual_seed(3)
    model = transformers.PaliGemmaForConditionalGeneration(config).eval()
    with torch.no_grad():  # weights large enough that the prefix's full attention changes the answer's scores
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.5)
    return model


def test_paligemmas_answer_is_scored_with_its_prefix_and_refused_without() -> None:
    """PaliGemma's prompt attends to itself both ways (its token types mark the prefix): with the processor's
    token_type_ids the explained forward scores the answer as generation did, and its maps are Grad-CAM's; without
    them the scores differ, and the call is refused rather than explaining another sequence."""
    model, x = tiny_paligemma(), image()
    prompt = torch.tensor([[IMAGE_TOKEN] * GRID**2 + [1, 5, 6, 7]])
    inputs = {"pixel_values": x, "input_ids": prompt, "token_type_ids": torch.zeros_like(prompt)}
    found = explain.explain_answer(model, inputs, max_new_tokens=3)
    assert found.result.layer == "model.model.multi_modal_projector"
    sequence = torch.cat([prompt[0], found.answer])
    types = torch.cat([torch.zeros_like(prompt[0]), torch.ones_like(found.answer)])
    kept = {}
    handle = model.model.multi_modal_projector.register_forward_hook(lambda m, i, o: kept.update(a=o))
    try:
        logits = model(input_ids=sequence[None], pixel_values=x, token_type_ids=types[None], use_cache=False).logits
    finally:
        handle.remove()
    position = prompt.shape[1]
    (gradient,) = torch.autograd.grad(logits[0, position - 1].log_softmax(-1)[sequence[position]], kept["a"])
    cam = torch.relu((gradient[0].mean(0)[:, None, None] * kept["a"][0].detach().T.reshape(-1, GRID, GRID)).sum(0))
    cam = F.interpolate(cam[None, None], size=(IMAGE, IMAGE), mode="bilinear", align_corners=False)[0, 0]
    assert torch.corrcoef(torch.stack([found.maps[0].flatten(), cam.flatten()]))[0, 1] > 0.999
    with pytest.raises(explain.ExplainError, match="scores the generated answer otherwise than generation did"):
        explain.explain_answer(model, {"pixel_values": x, "input_ids": prompt}, max_new_tokens=3)


def test_several_methods_take_an_answers_tokens() -> None:
    """The pixel attributions differentiate through the vision tower to the image: Saliency is the largest
    absolute gradient of the token's log-probability over the channels, as written here."""
    model, x = tiny_llava(), image()
    inputs = {"pixel_values": x, "input_ids": PROMPT}
    for method in ("gradcampp", "layercam", "integrated_gradients", "lrp"):
        found = explain.explain_answer(model, inputs, answer=[10, 11], method=method)
        assert found.maps.shape == (2, IMAGE, IMAGE) and bool(torch.isfinite(found.maps).all())
    saliency = explain.explain_answer(model, inputs, answer=[10, 11], method="saliency")
    sequence = torch.cat([PROMPT[0], torch.tensor([10, 11])])
    pixels = x.clone().requires_grad_(True)
    logits = model(input_ids=sequence[None], pixel_values=pixels, use_cache=False).logits[0]
    position = PROMPT.shape[1] + 1
    (gradient,) = torch.autograd.grad(logits[position - 1].log_softmax(-1)[11], pixels)
    expected = gradient[0].abs().amax(dim=0)
    expected = (expected - expected.min()) / (expected.max() - expected.min())
    torch.testing.assert_close(saliency.maps[1], expected, rtol=1e-4, atol=1e-4)


def test_a_text_whose_image_tokens_do_not_match_the_vision_tower_is_refused() -> None:
    model, x = tiny_llava(), image()
    short = torch.tensor([[1] + [IMAGE_TOKEN] * (GRID**2 - 1) + [7, 8]])
    with pytest.raises(explain.ExplainError, match="made 16 tokens per image, but the text holds 15 image tokens"):
        explain.explain_answer(model, {"pixel_values": x, "input_ids": short}, answer=[5])
    with pytest.raises(explain.ExplainError, match="the text holds no image token"):
        VisionLanguage(model, {"input_ids": torch.tensor([[1, 2, 3]])})
    tiles = {"pixel_values": x[:, None].expand(1, 5, 3, IMAGE, IMAGE), "input_ids": PROMPT}  # LLaVA-NeXt's
    with pytest.raises(explain.ExplainError, match=r"not one image \(1, 3, H, W\): images cut into tiles"):
        explain.explain_answer(model, tiles, answer=[5])
    with pytest.raises(explain.TargetError, match="the sequence's first token has no score"):
        TokenTarget(PROMPT[0], [0])


class Raising(torch.nn.Module):
    """A model whose forward raises ``error``."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise self.error


def test_only_the_models_own_refusal_becomes_one_line() -> None:
    from explain.core.maps import upsample
    from explain.models.vision_language import model_refusals

    refusing = Raising(ValueError("3 is not 4\nmore"))
    with pytest.raises(explain.ExplainError, match=r"Raising refuses .* \(ValueError: 3 is not 4\)"), model_refusals(
        refusing
    ):
        refusing(torch.zeros(1))
    out_of_memory = Raising(torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"), model_refusals(out_of_memory):
        out_of_memory(torch.zeros(1))
    hooked = torch.nn.Linear(2, 2)  # a hook of explain's own code that fails inside the model's forward
    hooked.register_forward_hook(lambda module, args, output: upsample(None, (2, 2)))
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'shape'"), model_refusals(hooked):
        hooked(torch.zeros(1, 2))


@pytest.mark.parametrize("fails", [False, True])
def test_the_model_is_left_as_it_was(fails: bool) -> None:
    model, x = tiny_llava(), image()
    model.model.language_model.layers[0].train()
    flags = [p.requires_grad for p in model.parameters()]
    with torch.no_grad():  # transformers installs its own output-capturing hooks at a model's first forward
        model(input_ids=PROMPT, pixel_values=x)
    hooks = [(m._forward_hooks.copy(), m._forward_pre_hooks.copy(), m._backward_hooks.copy()) for m in model.modules()]
    cache = model.config.text_config.use_cache
    prompt = torch.tensor([[1] + [IMAGE_TOKEN] * 3]) if fails else PROMPT
    if fails:
        with pytest.raises(explain.ExplainError):
            explain.explain_answer(model, {"pixel_values": x, "input_ids": prompt}, answer=[5, 6])
    else:
        explain.explain_answer(model, {"pixel_values": x, "input_ids": prompt}, max_new_tokens=2)
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert model.model.language_model.layers[0].training and not model.model.vision_tower.training
    assert model.config.text_config.use_cache == cache
    assert [(m._forward_hooks, m._forward_pre_hooks, m._backward_hooks) for m in model.modules()] == hooks


def tiny_contrastive(kind: str) -> torch.nn.Module:
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision |= {"image_size": IMAGE, "patch_size": PATCH}
    text = {"vocab_size": 50, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    text |= {"num_attention_heads": 2, "max_position_embeddings": 16, "eos_token_id": 2}
    torch.manual_seed(0)
    if kind == "clip":
        config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
        return transformers.CLIPModel(config).eval()
    return transformers.SiglipModel(transformers.SiglipConfig(text_config=text, vision_config=vision)).eval()


@pytest.mark.parametrize(("kind", "layer", "prefix"), [
    ("clip", "vision_model.encoder.layers.1.layer_norm1", 1),  # the class token read by the last block
    ("siglip", "vision_model.post_layernorm", 0),  # every token read by the attention-pooling head
])  # fmt: skip
def test_each_prompts_map_is_grad_cam_of_the_images_logit_against_it(kind: str, layer: str, prefix: int) -> None:
    model = tiny_contrastive(kind)
    torch.manual_seed(2)
    x, prompts = torch.randn(2, 3, IMAGE, IMAGE), torch.tensor([[1, 5, 6, 2], [1, 7, 8, 2], [1, 9, 2, 0]])
    found = explain.explain_prompts(model, x, prompts, prompts=["a cat", "a dog", "a mat"])
    assert found.layer == f"model.{layer}" and found.cams.shape == (2, 3, IMAGE, IMAGE)
    kept: dict[str, torch.Tensor] = {}
    for k in range(3):
        handle = model.get_submodule(layer).register_forward_hook(lambda m, i, o: kept.update(a=o))
        try:
            logits = model(input_ids=prompts, pixel_values=x).logits_per_image
        finally:
            handle.remove()
        torch.testing.assert_close(found.scores[:, k], logits[:, k].detach())
        (gradient,) = torch.autograd.grad(logits[:, k].sum(), kept["a"])
        a, g = (t[:, prefix:].transpose(1, 2).reshape(2, -1, GRID, GRID) for t in (kept["a"].detach(), gradient))
        cam = torch.relu((g.mean(dim=(2, 3))[..., None, None] * a).sum(1))
        cam = F.interpolate(cam[:, None], size=(IMAGE, IMAGE), mode="bilinear", align_corners=False)[:, 0]
        for n in range(2):
            r = torch.corrcoef(torch.stack([found.cams[n, k].flatten(), cam[n].flatten()]))[0, 1]
            assert r > 0.999


def test_a_model_without_a_text_tower_takes_no_prompts() -> None:
    with pytest.raises(explain.ExplainError, match="has no text tower"):
        explain.explain_prompts(torch.nn.Conv2d(3, 4, 3), image(), torch.tensor([[1, 2]]))


# The command line, on folders written by save_pretrained with processors whose tokenizers are built offline.

WORDS = ["<unk>", "<s>", "</s>", "<pad>", "USER:", "ASSISTANT:", "what", "is", "on", "the", "table?", "a", "cat"]


def _tokenizer(words: list[str], image_token: str | list[str] | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    specials = [image_token] if isinstance(image_token, str) else image_token
    extra = {"additional_special_tokens": specials} if specials else {}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **special, **extra)


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llava")
    words = WORDS + [f"w{i}" for i in range(len(WORDS), IMAGE_TOKEN)] + ["<image>"]
    images = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    processor = transformers.LlavaProcessor(
        image_processor=images, tokenizer=_tokenizer(words, "<image>"), patch_size=PATCH,
        vision_feature_select_strategy="default", image_token="<image>", num_additional_image_tokens=1,
    )  # fmt: skip
    tiny_llava().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("clip")
    images = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    words = ["<unk>", "<s>", "</s>", "<pad>", "a", "cat", "remote", "dog"] + [f"w{i}" for i in range(8, 50)]
    transformers.CLIPProcessor(image_processor=images, tokenizer=_tokenizer(words)).save_pretrained(folder)
    tiny_contrastive("clip").save_pretrained(folder)
    return folder


def _records(out: Path) -> list[dict]:
    head, *records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert head["header"]["model"] and "weights_sha256" in head["header"]  # the run's settings, then a line an image
    return records


def _head(out: Path) -> dict:
    return json.loads((out / "manifest.jsonl").read_text().splitlines()[0])["header"]


def test_the_command_line_writes_one_overlay_per_word_of_the_answer(llava_folder, tmp_path) -> None:
    from explain.cli import main
    from explain.io.images import load_image
    from explain.io.render import overlay

    out = tmp_path / "out"
    assert main([str(CAT), "--model", str(llava_folder), "--prompt", "what is on the table?",
                 "--max-new-tokens", "3", "-o", str(out), "--quiet", "--figure", "--format", "png"]) == 0  # fmt: skip
    (record,) = _records(out)
    assert _head(out)["reading"]["question"] == "what is on the table?"
    assert record["layer"] == "model.model.multi_modal_projector"
    model = transformers.LlavaForConditionalGeneration.from_pretrained(llava_folder).eval()
    processor = transformers.AutoProcessor.from_pretrained(llava_folder)
    image = load_image(CAT)
    inputs = processor(images=image, text="USER: <image>\nwhat is on the table? ASSISTANT:", return_tensors="pt",
                       do_center_crop=False, size={"height": IMAGE, "width": IMAGE})  # fmt: skip
    found = explain.explain_answer(model, inputs, max_new_tokens=3)
    assert [t["class_name"] for t in record["targets"]] == [processor.tokenizer.decode([t]) for t in found.answer]
    assert record["answer"] == processor.tokenizer.decode(found.answer.tolist())
    for target, cam in zip(record["targets"], found.maps):
        written = np.asarray(Image.open(out / target["output"]), dtype=np.int16)
        assert np.abs(written - np.asarray(overlay(image, cam), dtype=np.int16)).max() <= 1
    (strip,) = {target["figure"] for target in record["targets"]}  # one strip of every word
    assert strip == "chelsea.gradcam.words.figure.png" and (out / strip).is_file()


def test_a_whole_prompt_is_used_as_written_and_one_that_cannot_be_is_refused(llava_folder, tmp_path, capsys) -> None:
    """A prompt copied from a model card (its turn and image token) gives what the question alone gives; the turn's
    markers without the image token, two image tokens, or no new token at all are refused in one line each."""
    from explain.cli import main

    question, whole = tmp_path / "question", tmp_path / "whole"
    common = ["--max-new-tokens", "3", "--quiet", "--format", "png"]
    assert main([str(CAT), "--model", str(llava_folder), "--prompt", "what is on the table?", "-o", str(question),
                 *common]) == 0  # fmt: skip
    assert main([str(CAT), "--model", str(llava_folder), "--prompt", "USER: <image>\nwhat is on the table? ASSISTANT:",
                 "-o", str(whole), *common]) == 0  # fmt: skip
    (asked,), (written,) = _records(question), _records(whole)
    assert written["answer"] == asked["answer"] and len(written["targets"]) == len(asked["targets"]) > 0
    for a, w in zip(asked["targets"], written["targets"]):  # the same overlay, to a level of 8-bit rounding
        shown = [np.asarray(Image.open(out / t["output"]), dtype=np.int16) for out, t in ((question, a), (whole, w))]
        assert np.abs(shown[0] - shown[1]).max() <= 1
    capsys.readouterr()
    for prompt in ("USER: what is on the table? ASSISTANT:", "<image> <image> what is on the table?"):
        assert main([str(CAT), "--model", str(llava_folder), "--prompt", prompt, "-o", str(tmp_path / "no")]) == 2
    for count in ("0", "-1"):
        assert main([str(CAT), "--model", str(llava_folder), "--prompt", "what?", "--max-new-tokens", count,
                     "-o", str(tmp_path / "no")]) == 2  # fmt: skip
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("explain: error: ") for line in lines)
    assert "marker 'USER:' but not the image token <image>: give the question alone" in lines[0]
    assert "holds the image token <image> 2 times" in lines[1]
    assert "--max-new-tokens: must be a whole number of 1 or more, got '0'" in lines[2]
    assert not (tmp_path / "no").exists()


def test_every_export_option_on_the_words_is_honoured_or_refused_in_one_line(llava_folder, clip_folder, tmp_path,
                                                                            capsys) -> None:  # fmt: skip
    """--save-raw writes each word's map as the API gives it; --layer is honoured, a wrong one refused; --resume
    after a finished run redoes and rewrites nothing, after a killed one completes the rest; the options with no
    meaning for words are refused in one line, with nothing written."""
    from explain.cli import main

    out = tmp_path / "out"
    asked = [str(CAT), str(COFFEE), "--model", str(llava_folder), "--prompt", "what is on the table?",
             "--max-new-tokens", "2", "-o", str(out), "--quiet"]  # fmt: skip
    layer = "model.model.multi_modal_projector"
    assert main([*asked, "--save-raw", "--layer", layer, "--method", "layercam", "--device", "cpu", "--batch-size",
                 "4"]) == 0  # fmt: skip
    records = _records(out)
    assert [r["layer"] for r in records] == [layer] * 2 and all(r["method"] == "layercam" for r in records)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(llava_folder).eval()
    processor = transformers.AutoProcessor.from_pretrained(llava_folder)
    inputs = processor(images=explain.load_image(CAT), text="USER: <image>\nwhat is on the table? ASSISTANT:",
                       return_tensors="pt", do_center_crop=False, size={"height": IMAGE, "width": IMAGE})  # fmt: skip
    found = explain.explain_answer(model, inputs, max_new_tokens=2, method="layercam", layer=layer)
    raw = np.load(out / records[0]["raw"])
    assert raw.shape == tuple(found.maps.shape) and np.allclose(raw, found.maps.numpy(), atol=1e-5)

    written = {path: path.stat().st_mtime_ns for path in out.rglob("*") if path.is_file()}
    again = [*asked[:-1], "--save-raw", "--layer", layer, "--method", "layercam", "--batch-size", "4", "--resume"]
    capsys.readouterr()
    assert main(again) == 0
    assert "written 0, failed 0, skipped 2" in capsys.readouterr().out
    assert {path: path.stat().st_mtime_ns for path in out.rglob("*") if path.is_file()} == written
    lines = (out / "manifest.jsonl").read_text().splitlines(keepends=True)
    (out / "manifest.jsonl").write_text("".join(lines[:2]))  # killed after the first image
    (out / records[1]["targets"][0]["output"]).unlink()
    assert main(again) == 0
    assert "written 1, failed 0, skipped 1" in capsys.readouterr().out
    assert _records(out) == records
    assert main([*asked, "--method", "gradcam", "--resume"]) == 2  # other settings
    assert "cannot resume a run with other settings" in capsys.readouterr().err
    pngs = tmp_path / "pngs"  # --format: the overlays and the strip
    assert main([*asked[:-3], "-o", str(pngs), "--quiet", "--format", "png", "--figure"]) == 0
    (first, _) = _records(pngs)
    names = {name for t in first["targets"] for name in (t["output"], t["figure"])}
    assert len(names) == len(first["targets"]) + 1 and all(Image.open(pngs / n).format == "PNG" for n in names)

    refused = {
        "--topk 2": "--topk explains a classifier's top classes; ",
        "--metrics deletion": "--metrics explains a classifier's class; ",
        "--point 3,4": "--point and --box prompt a promptable segmenter (SAM); ",
        "--region 1,2,3,4": "--region explains a depth estimator's region; ",
        "--keypoint all": "--keypoint explains a pose model's keypoints; ",
        "--target 3": "--target names a class",
        "--method gradcam,layercam": "one --method at a time",
        "--layer no.such.layer": "unknown layer 'no.such.layer'",
    }
    for option, line in refused.items():
        capsys.readouterr()
        for model in (llava_folder, clip_folder):
            what = ["--prompt", "what?"] if model == llava_folder else ["--text", "a cat"]
            code = main([str(CAT), "--model", str(model), *what, *option.split(), "-o", str(tmp_path / "no")])
            errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("explain")]
            assert code == 2 and len(errors) == 1 and line in errors[0], (option, errors)
            assert not (tmp_path / "no").exists()


def test_the_command_line_explains_a_given_answer_and_text_prompts(llava_folder, clip_folder, tmp_path) -> None:
    from explain.cli import main

    assert main([str(CAT), "--model", str(llava_folder), "--prompt", "what is on the table?", "--answer", "a cat",
                 "-o", str(tmp_path / "answer"), "--quiet"]) == 0  # fmt: skip
    (record,) = _records(tmp_path / "answer")
    assert [t["class_name"] for t in record["targets"]] == ["a", "cat"] and record["answer"] == "a cat"
    assert main([str(CAT), str(COFFEE), "--model", str(clip_folder), "--text", "a cat, a remote",
                 "-o", str(tmp_path / "texts"), "--quiet"]) == 0  # fmt: skip
    records = _records(tmp_path / "texts")
    assert [[t["class_name"] for t in r["targets"]] for r in records] == [["a cat", "a remote"]] * 2
    assert all(r["answer"] is None for r in records)
    assert all((tmp_path / "texts" / t["output"]).is_file() for r in records for t in r["targets"])


def test_the_command_lines_text_errors_are_one_line(llava_folder, clip_folder, tmp_path, capsys) -> None:
    from explain.cli import main

    bad = tmp_path / "notes.jpg"
    bad.write_text("not an image")
    out = tmp_path / "out"
    assert main([str(CAT), str(bad), "--model", str(clip_folder), "--text", "a cat", "-o", str(out), "--quiet"]) == 1
    assert [r["error"] is None for r in _records(out)] == [True, False]  # the good image is written all the same
    assert (
        main([str(CAT), "--model", str(clip_folder), "--text", "a cat", "-o", str(out), "--quiet"]) == 2
    )  # not afresh
    assert main([str(CAT), "--model", str(llava_folder), "--text", "a cat", "-o", str(tmp_path / "b")]) == 2
    assert main([str(CAT), "--model", str(clip_folder), "--prompt", "what?", "-o", str(tmp_path / "c")]) == 2
    assert main([str(CAT), "--model", str(llava_folder), "--answer", "a cat", "-o", str(tmp_path / "d")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == f"explain: error: {bad}: not an image, or a format Pillow cannot read"
    assert "holds the manifest of an earlier run" in lines[1] and "--overwrite" in lines[1]
    assert lines[2:] == [
        f"explain: error: {llava_folder} answers prompts: give --prompt QUESTION",
        f"explain: error: {clip_folder} scores text prompts: give --text 'a cat, a remote'",
        "explain: error: --answer explains an answer to a --prompt: give the prompt too",
    ]
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    bounded = "--max-new-tokens bounds the answer a model generates for a --prompt; give the prompt, without --answer"
    for asked in (["--model", str(clip_folder), "--text", "a cat"],  # no answer generated: refused, not ignored
                  ["--model", str(llava_folder), "--prompt", "what?", "--answer", "a cat"],
                  ["--model", "efficientnet_lite0"]):  # fmt: skip
        assert main([str(CAT), *asked, "--max-new-tokens", "3", "-o", str(tmp_path / "e")]) == 2
        assert capsys.readouterr().err.strip() == f"explain: error: {bounded}"
    assert not (tmp_path / "e").exists()


def test_a_hub_name_that_is_not_cached_is_one_line_without_the_hub_clients_output(tmp_path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(
        [sys.executable, "-m", "explain", str(CAT), "--model", "llava-hf/llava-1.5-7b-hf", "--prompt", "hi",
         "-o", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("explain: error: llava-hf/llava-1.5-7b-hf is not a folder with a config.json, and is not")
    assert "save_pretrained" in line and not (tmp_path / "out").exists()


def tiny_owl(kind: str) -> torch.nn.Module:
    text = {"vocab_size": 50, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    text |= {"num_attention_heads": 2, "max_position_embeddings": 16, "eos_token_id": 2}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision |= {"image_size": IMAGE, "patch_size": PATCH}
    config, detector = {
        "owlvit": (transformers.OwlViTConfig, transformers.OwlViTForObjectDetection),
        "owlv2": (transformers.Owlv2Config, transformers.Owlv2ForObjectDetection),
    }[kind]
    torch.manual_seed(0)
    model = detector(config(text_config=text, vision_config=vision, projection_dim=32)).eval()
    with torch.no_grad():  # heads as a trained model's: boxes about their patches, scores away from 0 and 1
        model.box_head.dense2.weight.zero_()
        model.box_head.dense2.bias.zero_()
        for parameter in model.class_head.parameters():
            parameter.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("kind", ["owlvit", "owlv2"])
def test_each_box_of_a_text_query_is_grad_cam_of_its_score(kind: str) -> None:
    """Every patch's box above the threshold, explained by the sigmoid of its best query's logit, at the patch
    embeddings both heads read (the model's layer_norm, 16 tokens on the 4 x 4 grid)."""
    model, x = tiny_owl(kind), image()
    queries = torch.tensor([[1, 5, 6, 2], [1, 7, 8, 2]])
    found = explain.explain_queries(model, x, queries, queries=["a cat", "a dog"], score_threshold=0.4)
    assert found.layer == "model.layer_norm"
    kept = {}
    handle = model.layer_norm.register_forward_hook(lambda m, i, o: kept.update(a=o))
    try:
        output = model(input_ids=queries, pixel_values=x)
    finally:
        handle.remove()
    best, query = output.logits[0].sigmoid().max(dim=-1)
    patches = (best >= 0.4).nonzero()[:, 0]
    assert found.cams.shape == (1, len(patches), IMAGE, IMAGE) and len(patches) > 1
    torch.testing.assert_close(found.class_indices[0], query[patches])
    for k, patch in enumerate(patches.tolist()):
        (gradient,) = torch.autograd.grad(best[patch], kept["a"], retain_graph=True)
        a, g = kept["a"][0].detach().T.reshape(-1, GRID, GRID), gradient[0].T.reshape(-1, GRID, GRID)
        cam = torch.relu((g.mean(dim=(1, 2))[:, None, None] * a).sum(0))
        cam = F.interpolate(cam[None, None], size=(IMAGE, IMAGE), mode="bilinear", align_corners=False)[0, 0]
        assert torch.corrcoef(torch.stack([found.cams[0, k].flatten(), cam.flatten()]))[0, 1] > 0.999


@pytest.fixture(scope="module")
def owlv2_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("owlv2")
    words = ["<unk>", "<s>", "</s>", "<pad>", "a", "cat", "remote", "dog"] + [f"w{i}" for i in range(8, 50)]
    images = transformers.Owlv2ImageProcessor(size={"height": IMAGE, "width": IMAGE})
    transformers.Owlv2Processor(image_processor=images, tokenizer=_tokenizer(words)).save_pretrained(folder)
    tiny_owl("owlv2").save_pretrained(folder)
    return folder


def test_the_command_line_draws_each_box_of_a_text_query_on_the_whole_image(owlv2_folder, tmp_path) -> None:
    """OWLv2's processor pads the photo (451 x 300) to a square at its bottom and right: each box is the model's
    scaled by the square's side, and each map is cut back to the photo before it is drawn."""
    from explain.cli import main
    from explain.io.images import load_image
    from explain.io.render import annotate, overlay

    out = tmp_path / "out"
    assert main([str(CAT), "--model", str(owlv2_folder), "--text", "a cat, a dog", "--score-threshold", "0.4",
                 "-o", str(out), "--quiet", "--format", "png"]) == 0  # fmt: skip
    (record,) = _records(out)
    image = load_image(CAT)
    model = transformers.Owlv2ForObjectDetection.from_pretrained(owlv2_folder).eval()
    processor = transformers.AutoProcessor.from_pretrained(owlv2_folder)
    inputs = processor(text=[["a cat", "a dog"]], images=image, return_tensors="pt", padding=True)
    kept_rows = round(IMAGE * image.height / image.width)  # the photo's rows in the padded square
    assert image.width > image.height and kept_rows < IMAGE
    # below the photo the square is padding (two rows blend across the edge in the resize)
    assert bool((inputs["pixel_values"][0, :, kept_rows + 2 :] == inputs["pixel_values"][0, :, -1:]).all())
    found = explain.explain_queries(
        model, inputs["pixel_values"], inputs["input_ids"], queries=["a cat", "a dog"],
        attention_mask=inputs["attention_mask"], score_threshold=0.4,
    )  # fmt: skip
    scale = image.width / IMAGE
    assert len(record["targets"]) == found.cams.shape[1] > 1
    for k, token in enumerate(record["targets"]):
        assert token["class_name"] == ["a cat", "a dog"][int(found.class_indices[0, k])]
        torch.testing.assert_close(torch.tensor(token["box"]), found.target.boxes[0, k] * scale, atol=0.06, rtol=0)
    first = record["targets"][0]
    drawn = overlay(image, found.cams[0, 0][:kept_rows])
    drawn = annotate(drawn, f"{first['class_name']} {first['score']:.3g}", tuple(found.target.boxes[0, 0] * scale))
    written = np.asarray(Image.open(out / first["output"]), dtype=np.int16)
    assert np.abs(written - np.asarray(drawn, dtype=np.int16)).max() <= 1


def test_a_detector_scoring_text_tokens_instead_of_queries_is_refused() -> None:
    """Grounding DINO's logits score each text token (256 entries), not each query: never read as queries."""

    class PerToken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 8, stride=8)

        def forward(self, input_ids, pixel_values, attention_mask=None):
            features = self.conv(pixel_values).flatten(2).transpose(1, 2)  # (N, 16, 4)
            logits = features.mean(-1, keepdim=True).expand(-1, -1, 256)
            return transformers.utils.ModelOutput(logits=logits, pred_boxes=torch.full((*logits.shape[:2], 4), 0.5))

    with pytest.raises(explain.TargetError, match=r"logits score 256 text entries, not the 2 queries.*phrases="):
        explain.explain_queries(PerToken(), image(), torch.tensor([[1, 5], [1, 6]]), score_threshold=0.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun's gloo group, as the export's test")
def test_a_words_run_under_torchrun_shares_its_images_and_writes_what_one_process_does(clip_folder, tmp_path) -> None:
    """Each of two processes explains its share of the photos; the merged folder holds the one process's files and
    records: the same names, the same records but for float rounding (scores within 1e-5), the same overlays
    within one level of 8-bit rounding (another process may sum in another order)."""
    from test_export import ROOT, torchrun

    common = [str(CAT), str(COFFEE), "--model", str(clip_folder), "--text", "a cat, a remote", "--quiet",
              "--format", "png"]  # fmt: skip
    alone = subprocess.run([sys.executable, str(ROOT / "cli.py"), *common, "-o", str(tmp_path / "alone")],
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    two = torchrun(2, *common, "-o", str(tmp_path / "two"))
    assert two.wait(timeout=300) == 0, two.stderr.read()
    outs = tmp_path / "alone", tmp_path / "two"
    names = [sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) for out in outs]
    assert len(names[0]) == 6 and names[0] == names[1]  # two overlays an image, the marker and the manifest
    (one, two_) = ([_head(out), *_records(out)] for out in outs)
    scores = [[t.pop("score") for r in run[1:] for t in r["targets"]] for run in (one, two_)]
    assert one == two_ and np.allclose(scores[0], scores[1], rtol=0, atol=1e-5)
    for name in (n for n in names[0] if n.endswith(".png")):
        shown = [np.asarray(Image.open(out / name), dtype=np.int16) for out in outs]
        assert np.abs(shown[0] - shown[1]).max() <= 1, name


def test_evaluate_refuses_a_vision_language_model_in_one_line(clip_folder, tmp_path, capsys) -> None:
    """``explain evaluate`` scores one target per image; a model of words has none: one line before any image is
    read, nothing written."""
    from explain.cli import main

    assert main(["evaluate", str(CAT), "--model", str(clip_folder), "-o", str(tmp_path / "no")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("explain", "Traceback"))]
    assert errors == [
        "explain: error: explain evaluate scores maps of a classifier's class, a detector's box or a segmenter's "
        f"class; {clip_folder} is a vision-language model"
    ]
    assert not (tmp_path / "no").exists()
