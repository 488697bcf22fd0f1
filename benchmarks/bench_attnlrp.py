"""AttnLRP's cost against the model's own forward and backward, ratios in one process (the CPU).

- **The cost of the rules**: ``explain.METHODS["attnlrp"]`` and ``["cplrp"]`` on a ViT-Small-shaped timm ViT
  (random weights, 224 pixels, patches of 16, 12 blocks of width 384, batch of 4), against the same model's forward
  and backward of the same scores through plain autograd (``torch.autograd.grad`` of the summed class scores with
  respect to the input), and against ``lrp`` and the engine's own plain gradient (``saliency``: what any call of
  the engine costs over bare autograd). Target: AttnLRP at most 1.3x the forward and backward.
- **Memory**: each call's peak resident memory over the process's, beside the forward and backward's.

LXT's own AttnLRP is not timed: LXT 2.1 does not import beside current ``transformers`` (its BERT patch imports a
helper that is gone), and its torchvision ViT patch needs that import too.

    python benchmarks/bench_attnlrp.py [--rounds 5] [--out benchmarks/results_attnlrp_cpu.md]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from timing import emit, interleaved_medians, peak_mib, rounds_and_out, stolen_share

import explain

CLASSES = [1, 2, 3, 4]


def vit_small() -> torch.nn.Module:
    """A ViT-Small-shaped timm ViT with seeded random weights, in eval mode."""
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=10).eval()


def runs(model: torch.nn.Module, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The plain forward and backward, AttnLRP, CP-LRP and LRP on the same model, images and classes."""
    methods = {name: explain.METHODS[name](model) for name in ("saliency", "attnlrp", "cplrp", "lrp")}

    def plain() -> object:
        leaf = x.clone().requires_grad_(True)
        scores = model(leaf)[torch.arange(len(x)), CLASSES].sum()
        return torch.autograd.grad(scores, leaf)[0]

    return {
        "forward + backward": plain,
        **{name: (lambda method=method: method(x, CLASSES, normalize=False)) for name, method in methods.items()},
    }


def main() -> None:
    args = rounds_and_out(__doc__)
    stolen = stolen_share()
    torch.set_num_threads(2)
    model, x = vit_small(), torch.randn(len(CLASSES), 3, 224, 224, generator=torch.Generator().manual_seed(1))
    contest = runs(model, x)
    for run in contest.values():
        run()  # one-time workspaces and traces, outside the measurement
    memory = {name: peak_mib(run) for name, run in contest.items()}
    medians = interleaved_medians(contest, args.rounds)
    base = medians["forward + backward"]
    lines = [
        f"ViT-Small shape (12 blocks, width 384), {len(x)} images of 224x224; medians of {args.rounds} interleaved "
        "rounds",
        "",
        "| call | seconds | / forward + backward | peak memory (MiB) |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {t:.3f} | {t / base:.2f}x | {memory[name]:.0f} |" for name, t in medians.items()]
    lines += ["", "Target: attnlrp at most 1.30x the forward and backward.", "", f"CPU time stolen: {stolen()}"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
