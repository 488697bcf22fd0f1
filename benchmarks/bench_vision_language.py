"""Every word of a vision-language model's answer: explain's maps against the model's own forward and backward.

A small random model on the CPU, a prompt and a 16-token answer, rounds interleaved, the model warm. Three families
(``--family``): ``llava``, a CLIP vision tower of 4 layers at 224x224, patches of 14 (256 vision tokens in one run)
and a Llama language model of 4 layers; ``mistral3``, Pixtral's tower of 4 layers on a 224x336 image, patches of 14
merged 2x2 (8 rows of 12 tokens, each row closed by a separator token) and a Mistral language model of 4 layers;
``mllama``, Mllama's tower of 4 layers and 1 global layer on 1 x 2 tiles of 224, patches of 14, read by 2 of the
4 layers of its language model through cross-attention:

- **forward + backward**: the model's forward over the prompt and the answer, then the backward of one token's
  log-probability to the image (parameters frozen): what any gradient method of one word costs at least;
- **one word**: ``explain.GradCAM`` of one token of the answer (``TokenTarget``), at the automatic layer;
- **16 words, one call**: every token of the answer in one call (one forward, sixteen backward passes);
- **16 one-word calls**: the same maps, one call per token.

Targets (issue "Explain what vision-language models say"): one word at most 1.15x the forward and backward; the
sixteen words of one call at most 0.75x sixteen one-word calls. Peak memory: the tensor memory alive at the busiest
moment of one call (the profiler's allocation records), against the forward and backward's.

    python benchmarks/bench_vision_language.py [--family mistral3] [--rounds 5] [--out ...]
"""

from __future__ import annotations

import torch
import transformers
from bench_gradcam import peak_memory
from timing import emit, interleaved_medians, rounds_and_out

import explain
from explain.models import VisionLanguage
from explain.models.vision_language import answered, image_reading, text_inputs
from explain.targets import TokenTarget

IMAGE_TOKEN, ANSWER = 31999, 16
TOWER = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4}  # every family's vision tower
TEXT = {**TOWER, "vocab_size": 32000, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 512}  # fmt: skip  # and its language model


def small_llava() -> torch.nn.Module:
    vision = transformers.CLIPVisionConfig(**TOWER, num_attention_heads=4, image_size=224, patch_size=14)
    text = transformers.LlamaConfig(**TEXT)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config).eval()


def small_mistral3() -> torch.nn.Module:
    vision = transformers.PixtralVisionConfig(**TOWER, num_attention_heads=4, image_size=336, patch_size=14,
                                              head_dim=64)  # fmt: skip
    text = transformers.MistralConfig(**TEXT, head_dim=64)
    config = transformers.Mistral3Config(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    torch.manual_seed(0)
    return transformers.Mistral3ForConditionalGeneration(config).eval()


def small_mllama() -> torch.nn.Module:
    vision = transformers.MllamaVisionConfig(
        **TOWER, num_global_layers=1, attention_heads=4, image_size=224, patch_size=14, max_num_tiles=4,
        intermediate_layers_indices=[1], vision_output_dim=512,
    )  # fmt: skip
    text = transformers.MllamaTextConfig(
        **TEXT, cross_attention_layers=[1, 3], pad_token_id=0, bos_token_id=1, eos_token_id=2
    )  # fmt: skip
    config = transformers.MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    torch.manual_seed(0)
    model = transformers.MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():  # a new model's cross-attention gates are closed (tanh 0); trained ones are open
        for name, parameter in model.named_parameters():
            if "cross_attn" in name and "gate" in name:
                parameter.fill_(1.0)
    return model


def family_inputs(family: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The family's model, and its processor's output for one image and one prompt (as the processor lays it)."""
    torch.manual_seed(1)
    if family == "llava":
        image = [*[IMAGE_TOKEN] * 256]
        pixels = {"pixel_values": torch.randn(1, 3, 224, 224)}
        model = small_llava()
    elif family == "mllama":  # one image token; the image as 1 x 2 tiles of 224, read by cross-attention
        model, image = small_mllama(), [IMAGE_TOKEN]
        prompt = [1, 306, 4966, 29901, *image, 1724, 338, 373, 278, 1591, 29973]
        sees = torch.zeros(1, len(prompt), 1, 4, dtype=torch.long)
        sees[:, 4:, :, :2] = 1  # the tokens from the image on attend to its two tiles
        pixels = {"pixel_values": torch.cat([torch.randn(1, 1, 2, 3, 224, 224), torch.zeros(1, 1, 2, 3, 224, 224)], 2),
                  "aspect_ratio_ids": torch.tensor([[2]]), "aspect_ratio_mask": torch.tensor([[[1, 1, 0, 0]]]),
                  "cross_attention_mask": sees}  # fmt: skip
        return model, {**pixels, "input_ids": torch.tensor([prompt])}
    else:  # 8 rows of 12 tokens, each closed by [IMG_BREAK] (12), the last by [IMG_END] (13)
        image = [token for row in range(8) for token in [*[IMAGE_TOKEN] * 12, 12 if row < 7 else 13]]
        pixels = {"pixel_values": torch.randn(1, 3, 224, 336), "image_sizes": torch.tensor([[224, 336]])}
        model = small_mistral3()
    prompt = [1, 306, 4966, 29901, *image, 1724, 338, 373, 278, 1591, 29973]
    return model, {**pixels, "input_ids": torch.tensor([prompt])}


def main() -> None:
    args = rounds_and_out(__doc__, family=("llava", "mistral3", "mllama"))
    model, inputs = family_inputs(args.family)
    read, sequence, positions = answered(model, text_inputs(inputs), torch.randint(100, 31000, (ANSWER,)))
    positions = list(positions)
    reading = image_reading(model, inputs)
    x = reading.picture(inputs)
    reader = VisionLanguage(model, read, reading)
    method = explain.GradCAM(reader)
    for parameter in model.parameters():
        parameter.requires_grad_(False)

    def forward_backward() -> object:
        image = x.clone().requires_grad_(True)
        logits = reader(image)
        score = logits[0, positions[0] - 1].log_softmax(-1)[sequence[positions[0]]]
        return torch.autograd.grad(score, image)

    runs = {
        "forward + backward": forward_backward,
        "one word": lambda: method(x, TokenTarget(sequence, positions[:1])),
        "16 words, one call": lambda: method(x, TokenTarget(sequence, positions)),
        "16 one-word calls": lambda: [method(x, TokenTarget(sequence, [p])) for p in positions],
    }
    medians = interleaved_medians(runs, args.rounds)
    memory = {name: peak_memory(lambda _, run=run: run(), x) for name, run in runs.items() if "16 one" not in name}
    base, single = medians["forward + backward"], medians["16 one-word calls"]
    lines = [
        "| contender | median (ms) | × forward + backward | × 16 one-word calls | peak memory (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, median in medians.items():
        peak = f"{memory[name] / 2**20:.0f}" if name in memory else "—"
        lines.append(f"| {name} | {1000 * median:.0f} | {median / base:.2f} | {median / single:.2f} | {peak} |")
    lines += [
        "",
        f"{args.family}: medians of {args.rounds} interleaved rounds, the model warm, batch 1, {len(sequence)} tokens "
        f"({ANSWER} of the answer), {torch.get_num_threads()} threads.",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
