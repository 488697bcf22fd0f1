"""Grad-CAM cost against a plain inference forward, and against the peers, in one process.

Times, with repetitions interleaved (each round runs every contender once, in
turn) and medians reported: a plain inference forward, ``explain.gradcam`` and,
where installed, pytorch-grad-cam
(``grad-cam``), torchcam and Captum, on resnet50 / layer4 / 224x224 with random
weights. Peak memory is the largest amount of tensor memory alive during one
call: CUDA's allocator statistics on a GPU, the profiler's allocation records on
the CPU. Prints a Markdown table.

    python benchmarks/bench_gradcam.py [--device cuda] [--batches 1 8 32] [--rounds 7]
    python benchmarks/bench_gradcam.py --no-peers --methods gradcampp xgradcam hirescam layercam
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


def contenders(
    model: nn.Module, device: torch.device, methods: list[str], peers: bool
) -> dict[str, Callable[[torch.Tensor], object]]:
    def inference(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(x)

    runs: dict[str, Callable[[torch.Tensor], object]] = {
        "inference forward": inference,
        "explain.gradcam": lambda x: explain.gradcam(model, x, "layer4"),
    }
    for method in methods:
        runs[f"explain {method}"] = explain.create_method(method, model, "layer4")
    if not peers:
        return runs
    if importlib.util.find_spec("pytorch_grad_cam"):
        from pytorch_grad_cam import GradCAM as PGCGradCAM

        pgc = PGCGradCAM(model=model, target_layers=[model.layer4])
        runs["pytorch-grad-cam"] = lambda x: pgc(input_tensor=x, targets=None)
    if importlib.util.find_spec("torchcam"):
        from torchcam.methods import GradCAM as TorchCAMGradCAM

        def torchcam_run(x: torch.Tensor) -> object:
            with TorchCAMGradCAM(model, target_layer="layer4") as extractor:
                scores = model(x)
                return extractor(scores.argmax(1).tolist(), scores)

        runs["torchcam"] = torchcam_run
    if importlib.util.find_spec("captum"):
        from captum.attr import LayerAttribution, LayerGradCam

        captum_cam = LayerGradCam(model, model.layer4)

        def captum_run(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                targets = model(x).argmax(1)
            attribution = captum_cam.attribute(x, target=targets, relu_attributions=True)
            return LayerAttribution.interpolate(attribution, x.shape[-2:])

        runs["captum"] = captum_run
    return runs


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(run: Callable[[torch.Tensor], object], x: torch.Tensor) -> int:
    """Bytes of tensor memory alive at the busiest moment of one call, above what was alive before."""
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
        torch.cuda.reset_peak_memory_stats(x.device)
        before = torch.cuda.memory_allocated(x.device)
        run(x)
        torch.cuda.synchronize(x.device)
        return torch.cuda.max_memory_allocated(x.device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(x)
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    alive = peak = 0
    for event in events:
        alive += event.self_cpu_memory_usage
        peak = max(peak, alive)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--methods", nargs="*", default=[], help="more explain methods to time, e.g. gradcampp")
    parser.add_argument("--no-peers", action="store_true", help="time explain only")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval().to(device)
    runs = contenders(model, device, args.methods, peers=not args.no_peers)
    print(f"resnet50 / layer4 / 224x224, {device.type}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print()
    print("| batch | method | median time (ms) | × inference | images/s | peak memory (MiB) | × inference |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        x = torch.randn(batch, 3, 224, 224, device=device)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():  # warm-up
            run(x)
        for _ in range(args.rounds):
            for name, run in runs.items():
                synchronize(device)
                start = time.perf_counter()
                run(x)
                synchronize(device)
                times[name].append(time.perf_counter() - start)
        memory = {name: peak_memory(run, x) for name, run in runs.items()}
        base_time = statistics.median(times["inference forward"])
        for name in runs:
            median = statistics.median(times[name])
            print(
                f"| {batch} | {name} | {median * 1000:.1f} | {median / base_time:.2f} | {batch / median:.1f} "
                f"| {memory[name] / 2**20:.1f} | {memory[name] / memory['inference forward']:.2f} |"
            )


if __name__ == "__main__":
    main()
