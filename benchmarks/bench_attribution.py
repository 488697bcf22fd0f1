"""Pixel attributions against Captum's, the peer that has them: Saliency, Input x Gradient, Occlusion and
Integrated Gradients.

resnet18 with random weights at 224x224 on the CPU, batch 4, the top class; one process, rounds interleaved,
medians and peak memory reported (the profiler's allocation records, as ``bench_gradcam.py`` measures them).
Integrated Gradients: 50 Gauss-Legendre steps from a zero baseline, both batched 16 inputs per forward (Captum's
``internal_batch_size``). Occlusion: one image, 32x32 windows every 16 (169 placements), explain 16 copies per
forward, Captum with its default of one. Target: explain no slower than Captum, and a batched perturbation method
at least 2x faster than the peer's defaults.

    python benchmarks/bench_attribution.py [--rounds 5] [--out benchmarks/results_attribution_cpu.md]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from bench_gradcam import peak_memory
from captum import attr
from timing import emit, interleaved_medians, resnet18_batch, rounds_and_out

import explain


def main() -> None:
    args = rounds_and_out(__doc__)
    model, x, target = resnet18_batch()
    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "Saliency": (
            lambda: explain.methods.Saliency(model)(x, target),
            lambda: attr.Saliency(model).attribute(x.clone().requires_grad_(True), target=target),
        ),
        "Input x Gradient": (
            lambda: explain.methods.InputXGradient(model)(x, target),
            lambda: attr.InputXGradient(model).attribute(x.clone().requires_grad_(True), target=target),
        ),
        "Occlusion, 32x32 windows every 16": (
            lambda: explain.methods.Occlusion(model, window=32, stride=16, batch_size=16)(x[:1], target[:1]),
            lambda: attr.Occlusion(model).attribute(
                x[:1], sliding_window_shapes=(3, 32, 32), strides=(3, 16, 16), target=target[:1]
            ),
        ),
        "Integrated Gradients, 50 steps": (
            lambda: explain.methods.IntegratedGradients(model, steps=50, batch_size=16)(x, target),
            lambda: attr.IntegratedGradients(model).attribute(x, target=target, n_steps=50, internal_batch_size=16),
        ),
    }
    lines = [
        f"resnet18 (random weights), 4x3x224x224, torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, "
        f"median of {args.rounds} interleaved rounds; memory: peak tensor memory of one call.",
        "",
        "| method | contender | median (ms) | × Captum | peak memory (MiB) | × Captum |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, (ours, theirs) in pairs.items():
        medians = interleaved_medians({"explain": ours, "Captum": theirs}, args.rounds)
        memory = {who: peak_memory(lambda _, run=run: run(), x) for who, run in (("explain", ours), ("Captum", theirs))}
        for who in ("explain", "Captum"):
            lines.append(
                f"| {name} | {who} | {1000 * medians[who]:.0f} | {medians[who] / medians['Captum']:.2f} "
                f"| {memory[who] / 2**20:.0f} | {memory[who] / memory['Captum']:.2f} |"
            )
    emit(lines, args.out)


if __name__ == "__main__":
    main()
