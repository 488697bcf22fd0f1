"""Grad-CAM and gradient rollout on a vision transformer against its inference forward, and against pytorch-grad-cam.

timm ``vit_base_patch16_224`` with random weights, at batches 1, 8 and 32 of random 224x224 images. Contenders,
rounds interleaved, medians reported: a plain inference forward; ``explain`` Grad-CAM at the automatic layer
(``blocks.11.norm1``, the input of the last attention); ``explain`` gradient rollout (report only);
pytorch-grad-cam's ``GradCAM`` at the same layer with the ``reshape_transform`` of its tutorial (where
``grad-cam`` is installed), with the Pearson correlation of its maps and explain's. Target: explain's Grad-CAM
costs at most 1.10x the inference forward.

    python benchmarks/bench_vit.py [--rounds 3] [--batches 1,8,32] [--out benchmarks/results_vit_cpu.md]
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable

import numpy as np
import timm
import torch
from timing import emit, interleaved_medians

import explain

LAYER = "blocks.11.norm1"


def tokens_to_map(tensor: torch.Tensor, height: int = 14, width: int = 14) -> torch.Tensor:
    """pytorch-grad-cam's ViT reshape_transform (its tutorial's): drop the class token, tokens to a 14x14 grid."""
    result = tensor[:, 1:, :].reshape(tensor.size(0), height, width, tensor.size(2))
    return result.transpose(2, 3).transpose(1, 2)


def measure(model: torch.nn.Module, batch: int, rounds: int) -> list[str]:
    """The table's rows for one batch size."""
    x = torch.randn(batch, 3, 224, 224)

    def inference() -> torch.Tensor:
        with torch.inference_mode():
            return model(x)

    gradcam, rollout = explain.GradCAM(model), explain.methods.GradientRollout(model)
    runs: dict[str, Callable[[], object]] = {
        "inference forward": inference,
        "explain GradCAM": lambda: gradcam(x).cams,
        "explain GradientRollout": lambda: rollout(x).cams,
    }
    if importlib.util.find_spec("pytorch_grad_cam"):
        from pytorch_grad_cam import GradCAM as PGCGradCAM

        pgc = PGCGradCAM(model=model, target_layers=[model.get_submodule(LAYER)], reshape_transform=tokens_to_map)
        runs["pytorch-grad-cam GradCAM"] = lambda: pgc(x, targets=None)
    ours = runs["explain GradCAM"]().flatten().numpy()
    theirs = np.asarray(runs["pytorch-grad-cam GradCAM"]()).flatten() if "pytorch-grad-cam GradCAM" in runs else None
    medians = interleaved_medians(runs, rounds)
    base = medians["inference forward"]
    rows = []
    for name, median in medians.items():
        r = f"{np.corrcoef(ours, theirs)[0, 1]:.5f}" if name == "pytorch-grad-cam GradCAM" else ""
        rows.append(f"| {batch} | {name} | {1000 * median:.1f} | {median / base:.2f} | {r} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224").eval()
    lines = [
        f"timm vit_base_patch16_224, random weights, layer `{LAYER}`, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds.",
        "",
        "| batch | contender | median (ms) | × inference | map r vs explain |",
        "|---:|---|---:|---:|---:|",
    ]
    for batch in (int(b) for b in args.batches.split(",")):
        rows = measure(model, batch, args.rounds)
        print("\n".join(rows), flush=True)
        lines += rows
    emit(lines, args.out)


if __name__ == "__main__":
    main()
