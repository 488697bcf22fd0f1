"""Score-CAM cost against pytorch-grad-cam and torchcam, in one process.

resnet18 / ``layer4`` (512 channels, so 512 masked forwards per image) /
224x224 / batch 1 with random weights, on the CPU by default. Rounds are
interleaved (each round runs every contender once, in turn) and medians
reported, with each contender's time as a multiple of explain's. Prints a
Markdown table.

    python benchmarks/bench_scorecam.py [--device cuda] [--rounds 3] [--batch-size 16]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable

import torch
import torchvision
from torch import nn

import explain


def contenders(model: nn.Module, batch_size: int) -> dict[str, Callable[[torch.Tensor], object]]:
    runs: dict[str, Callable[[torch.Tensor], object]] = {
        f"explain ScoreCAM (batch_size={batch_size})": explain.methods.ScoreCAM(model, "layer4", batch_size=batch_size),
    }
    if importlib.util.find_spec("pytorch_grad_cam"):
        from pytorch_grad_cam import ScoreCAM as PGCScoreCAM

        def pgc(x: torch.Tensor) -> object:
            with PGCScoreCAM(model, [model.layer4]) as cam:
                return cam(x, targets=None)

        runs["pytorch-grad-cam ScoreCAM"] = pgc
    if importlib.util.find_spec("torchcam"):
        from torchcam.methods import ScoreCAM as TorchcamScoreCAM

        def torchcam(x: torch.Tensor) -> object:
            with TorchcamScoreCAM(model, "layer4") as cam:
                scores = model(x)
                return cam(scores.argmax(1).tolist(), scores)

        runs["torchcam ScoreCAM"] = torchcam
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval().to(args.device)
    x = torch.randn(1, 3, 224, 224, device=args.device)
    runs = contenders(model, args.batch_size)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run(x)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ours = next(iter(medians.values()))
    print(f"\n{args.rounds} rounds on {args.device}, torch {torch.__version__}\n")
    print("| Score-CAM, resnet18 layer4, 1 image 224x224 | median time (s) | × explain |\n|---|---:|---:|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds:.2f} | {seconds / ours:.2f} |")


if __name__ == "__main__":
    main()
