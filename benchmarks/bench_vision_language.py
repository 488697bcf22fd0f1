"""Every word of a vision-language model's answer: explain's maps against the model's own forward and backward.

A small random LLaVA-style model on the CPU (a CLIP vision tower of 4 layers at 224x224, patches of 14: 256 vision
tokens; a Llama language model of 4 layers), a prompt and a 16-token answer, rounds interleaved, the model warm:

- **forward + backward**: the model's forward over the prompt and the answer, then the backward of one token's
  log-probability to the image (parameters frozen): what any gradient method of one word costs at least;
- **one word**: ``explain.GradCAM`` of one token of the answer (``TokenTarget``), at the automatic layer;
- **16 words, one call**: every token of the answer in one call (one forward, sixteen backward passes);
- **16 one-word calls**: the same maps, one call per token.

Targets (issue "Explain what vision-language models say"): one word at most 1.15x the forward and backward; the
sixteen words of one call at most 0.75x sixteen one-word calls. Peak memory: the tensor memory alive at the busiest
moment of one call (the profiler's allocation records), against the forward and backward's.

    python benchmarks/bench_vision_language.py [--rounds 5] [--out benchmarks/results_vision_language_cpu.md]
"""

from __future__ import annotations

import torch
import transformers
from bench_gradcam import peak_memory
from timing import emit, interleaved_medians, rounds_and_out

import explain
from explain.models import VisionLanguage
from explain.targets import TokenTarget

IMAGE_TOKEN, ANSWER = 31999, 16


def small_llava() -> torch.nn.Module:
    vision = transformers.CLIPVisionConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, image_size=224,
        patch_size=14,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512,
    )  # fmt: skip
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config).eval()


def main() -> None:
    args = rounds_and_out(__doc__)
    model = small_llava()
    torch.manual_seed(1)
    x = torch.randn(1, 3, 224, 224)
    prompt = [1, 306, 4966, 29901, *[IMAGE_TOKEN] * 256, 1724, 338, 373, 278, 1591, 29973]
    sequence = torch.tensor(prompt + torch.randint(100, 31000, (ANSWER,)).tolist())
    positions = list(range(len(prompt), len(sequence)))
    reader = VisionLanguage(model, {"input_ids": sequence[None]})
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
        f"Medians of {args.rounds} interleaved rounds, the model warm, batch 1, {len(sequence)} tokens "
        f"({ANSWER} of the answer), {torch.get_num_threads()} threads.",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
