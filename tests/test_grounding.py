"""Grounding DINO with text queries: a tiny random config (a Swin backbone, a BERT text tower) whose logits score
each token of one text; a query's score is the largest of its phrase's tokens', each box's map against Grad-CAM
written here, the phrases' tokens from the tokenizer's offsets, and the command line end to end."""

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
from explain.models.query_models import phrase_text, phrase_tokens

transformers = pytest.importorskip("transformers")

HEIGHT, WIDTH = 64, 96
CLS, SEP, DOT = 101, 102, 1012  # BERT's ids, which Grounding DINO reads as its phrases' bounds
WORDS = {5: "a", 6: "cat", 7: "remote", 8: "dog"}


def tiny_grounding_dino() -> torch.nn.Module:
    swin = transformers.SwinConfig(
        embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=2, image_size=HEIGHT,
        out_features=["stage2", "stage3", "stage4"],
    )  # fmt: skip
    bert = transformers.BertConfig(
        vocab_size=1100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    config = transformers.GroundingDinoConfig(
        backbone_config=swin, text_config=bert, d_model=32, encoder_layers=1, decoder_layers=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2, num_queries=12,
        num_feature_levels=3, encoder_n_points=2, decoder_n_points=2, max_text_len=32, use_timm_backbone=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GroundingDinoForObjectDetection(config).eval()


def picture() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(1, 3, HEIGHT, WIDTH)


def test_each_box_is_grad_cam_of_its_best_phrases_largest_token_score() -> None:
    model, x = tiny_grounding_dino(), picture()
    text = torch.tensor([[CLS, 5, 6, DOT, 5, 7, DOT, SEP]])  # "a cat. a remote."
    phrases = [[1, 2], [4, 5]]
    found = explain.explain_queries(model, x, text, queries=["a cat", "a remote"], phrases=phrases,
                                    score_threshold=0.3)  # fmt: skip
    layer = model.get_submodule(found.layer.removeprefix("model."))
    kept = {}
    handle = layer.register_forward_hook(lambda m, i, o: kept.update(a=o))
    try:
        logits = model(input_ids=text, pixel_values=x, attention_mask=torch.ones_like(text)).logits[0]
    finally:
        handle.remove()
    per_phrase = torch.stack([logits[:, p].amax(dim=-1) for p in phrases], dim=-1).sigmoid()  # (queries, phrases)
    best, label = per_phrase.max(dim=-1)
    boxes = (best >= 0.3).nonzero()[:, 0]
    assert len(boxes) > 1 and found.cams.shape[1] == len(boxes)
    torch.testing.assert_close(found.class_indices[0], label[boxes])
    torch.testing.assert_close(found.scores[0], best[boxes].detach())
    for k, box in enumerate(boxes.tolist()):
        (gradient,) = torch.autograd.grad(best[box], kept["a"], retain_graph=True)
        cam = torch.relu((gradient[0].mean(dim=(1, 2))[:, None, None] * kept["a"][0].detach()).sum(0))
        cam = F.interpolate(cam[None, None], size=(HEIGHT, WIDTH), mode="bilinear", align_corners=False)[0, 0]
        assert torch.corrcoef(torch.stack([found.cams[0, k].flatten(), cam.flatten()]))[0, 1] > 0.999


def _tokenizer():
    vocabulary = {f"[unused{i}]": i for i in range(1100)}
    for index, word in {0: "[PAD]", 100: "[UNK]", CLS: "[CLS]", SEP: "[SEP]", 103: "[MASK]", DOT: ".", **WORDS}.items():
        del vocabulary[f"[unused{index}]"]
        vocabulary[word] = index
    return transformers.BertTokenizerFast(vocab=vocabulary)


def test_a_querys_tokens_are_those_within_its_phrase() -> None:
    text, spans = phrase_text(["A cat", " a remote"])
    assert text == "a cat. a remote." and [text[a:b] for a, b in spans] == ["a cat", "a remote"]
    encoded = _tokenizer()(text, return_offsets_mapping=True)
    assert encoded["input_ids"] == [CLS, 5, 6, DOT, 5, 7, DOT, SEP]
    assert phrase_tokens(encoded["offset_mapping"], spans) == [[1, 2], [4, 5]]
    with pytest.raises(explain.TargetError, match="queries \\[1\\] have no tokens"):
        phrase_tokens(encoded["offset_mapping"], [(0, 5), (40, 50)])


@pytest.fixture(scope="module")
def grounding_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("grounding")
    images = transformers.GroundingDinoImageProcessor(size={"shortest_edge": HEIGHT, "longest_edge": WIDTH})
    transformers.GroundingDinoProcessor(image_processor=images, tokenizer=_tokenizer()).save_pretrained(folder)
    tiny_grounding_dino().save_pretrained(folder)
    return folder


def test_the_command_line_draws_each_box_of_grounding_dinos_phrases(grounding_folder, tmp_path) -> None:
    from explain.cli import main
    from explain.io.images import load_image
    from explain.io.render import annotate, overlay

    out = tmp_path / "out"
    assert main([str(CAT), "--model", str(grounding_folder), "--text", "a cat, a remote", "--score-threshold",
                 "0.3", "-o", str(out), "--quiet", "--format", "png"]) == 0  # fmt: skip
    (record,) = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()][1:]
    image = load_image(CAT)
    model = transformers.GroundingDinoForObjectDetection.from_pretrained(grounding_folder).eval()
    processor = transformers.AutoProcessor.from_pretrained(grounding_folder)
    inputs = processor(text="a cat. a remote.", images=image, return_tensors="pt")
    found = explain.explain_queries(
        model, inputs["pixel_values"], inputs["input_ids"], queries=["a cat", "a remote"], phrases=[[1, 2], [4, 5]],
        attention_mask=inputs["attention_mask"], score_threshold=0.3,
    )  # fmt: skip
    assert len(record["targets"]) == found.cams.shape[1] > 0
    height, width = inputs["pixel_values"].shape[-2:]
    scale = torch.tensor([image.width / width, image.height / height] * 2)  # the processor kept the aspect, rounded
    for k, token in enumerate(record["targets"]):
        assert token["class_name"] == ["a cat", "a remote"][int(found.class_indices[0, k])]
        torch.testing.assert_close(torch.tensor(token["box"]), found.target.boxes[0, k] * scale, atol=0.06, rtol=0)
    first = record["targets"][0]
    drawn = overlay(image, found.cams[0, 0])
    drawn = annotate(drawn, f"{first['class_name']} {first['score']:.3g}", tuple(found.target.boxes[0, 0] * scale))
    written = np.asarray(Image.open(out / first["output"]), dtype=np.int16)
    assert np.abs(written - np.asarray(drawn, dtype=np.int16)).max() <= 1
