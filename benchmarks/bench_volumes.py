"""Grad-CAM on clips, volumes and signals against the inference forward, and against pytorch-grad-cam's N-D path.

Random weights, one process, rounds interleaved, medians reported; peak memory as ``bench_gradcam.py`` measures it
(the profiler's allocation records on the CPU, CUDA's statistics on a GPU). Networks:

- torchvision's ``r3d_18`` on 16x112x112 clips (Kinetics-400's input), batch 1 and 4, at ``layer4``;
- a 3-D network on 1x64x96x96 volumes: MONAI's ``DenseNet121`` (spatial_dims=3) where the ``monai`` package is
  installed (a test dependency), else a 3-D stand-in written here, at its last feature map;
- a 1-D network on 12-lead signals of 5000 samples (10 s of ECG at 500 Hz), batch 16, at its last block.

Targets: explain costs at most 1.10x the inference forward and 1.05x its memory. pytorch-grad-cam takes images and
volumes (its 3-D path), not signals: it has no row for the 1-D network.

    python benchmarks/bench_volumes.py [--rounds 5] [--out benchmarks/results_volumes_cpu.md]
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torchvision
from bench_gradcam import peak_memory
from timing import emit, interleaved_medians, rounds_and_out
from torch import nn

import explain


def block(conv: type[nn.Module], norm: type[nn.Module], inputs: int, channels: int) -> nn.Module:
    """A stage of the stand-ins: two convolutions, each with its norm and ReLU, the first one striding by 2."""
    return nn.Sequential(
        conv(inputs, channels, 3, 2, 1, bias=False), norm(channels), nn.ReLU(),
        conv(channels, channels, 3, 1, 1, bias=False), norm(channels), nn.ReLU(),
    )  # fmt: skip


def stand_in(rank: int, inputs: int, classes: int) -> tuple[nn.Module, str]:
    """A VGG-style network of ``rank`` spatial axes (a stem, four stages of two convolutions), and its last stage's
    layer name."""
    conv, norm, pool = {
        1: (nn.Conv1d, nn.BatchNorm1d, nn.AdaptiveAvgPool1d), 3: (nn.Conv3d, nn.BatchNorm3d, nn.AdaptiveAvgPool3d)
    }[rank]  # fmt: skip
    widths = (64, 128, 256, 512)
    layers = [nn.Sequential(conv(inputs, 64, 7, 2, 3, bias=False), norm(64), nn.ReLU())]
    layers += [block(conv, norm, a, b) for a, b in zip((64, *widths), widths)]
    model = nn.Sequential(*layers, pool(1), nn.Flatten(), nn.Linear(512, classes))
    return model.eval(), str(len(layers) - 1)


def volume_network() -> tuple[nn.Module, str, str]:
    """MONAI's 3-D DenseNet121 where installed, else the stand-in; its layer and its name in the table."""
    if importlib.util.find_spec("monai"):
        from monai.networks.nets import DenseNet121

        return DenseNet121(spatial_dims=3, in_channels=1, out_channels=2).eval(), "features", "MONAI DenseNet121 (3-D)"
    model, layer = stand_in(3, 1, 2)
    return model, layer, "3-D VGG-style stand-in (monai not installed)"


def rows(name: str, model: nn.Module, layer: str, x: torch.Tensor, rounds: int) -> list[str]:
    """The table's rows of one network and batch: each contender's time and memory against the inference's."""
    module = model.get_submodule(layer)

    def inference() -> object:
        with torch.inference_mode():
            return model(x)

    explainer = explain.GradCAM(model, layer)
    runs: dict[str, Callable[[], object]] = {"inference forward": inference, "explain GradCAM": lambda: explainer(x)}
    if importlib.util.find_spec("pytorch_grad_cam") and x.dim() > 3:  # it takes images and volumes, not signals
        from pytorch_grad_cam import GradCAM

        peer = GradCAM(model=model, target_layers=[module])
        runs["pytorch-grad-cam GradCAM"] = lambda: peer(input_tensor=x, targets=None)
    medians = interleaved_medians(runs, rounds)
    memory = {contender: peak_memory(lambda _, run=run: run(), x) for contender, run in runs.items()}
    shape = "x".join(map(str, x.shape))
    return [
        f"| {name} | {shape} | {contender} | {1000 * seconds:.0f} | {seconds / medians['inference forward']:.2f} "
        f"| {memory[contender] / 2**20:.0f} | {memory[contender] / memory['inference forward']:.2f} |"
        for contender, seconds in medians.items()
    ]


def main() -> None:
    args = rounds_and_out(__doc__)
    torch.manual_seed(0)
    video = torchvision.models.video.r3d_18(num_classes=400).eval()
    volume, volume_layer, volume_name = volume_network()
    signal, signal_layer = stand_in(1, 12, 5)
    lines = [
        f"Grad-CAM, random weights, torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, median of "
        f"{args.rounds} interleaved rounds; memory: peak tensor memory of one call.",
        "",
        "| network | input | contender | median (ms) | × inference | peak memory (MiB) | × inference |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for batch in (1, 4):
        lines += rows("r3d_18 / layer4", video, "layer4", torch.randn(batch, 3, 16, 112, 112), args.rounds)
    lines += rows(f"{volume_name} / {volume_layer}", volume, volume_layer, torch.randn(1, 1, 64, 96, 96), args.rounds)
    lines += rows(f"1-D VGG-style / {signal_layer}", signal, signal_layer, torch.randn(16, 12, 5000), args.rounds)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
