"""The first call of ``explain.gradcam`` on a model it has not seen, against the model's inference forward.

What most users meet is the first call: one photo in a notebook, one run of the command line. Each model (random
weights, one 224x224 image, the CPU) is timed in one process, rounds interleaved: its inference forward; the first
call of ``explain.gradcam`` on a fresh copy (a deep copy: explain has learned nothing about it), with the automatic
layer and with the layer given; the second call on the same copy; and pytorch-grad-cam's first call on a fresh copy
where it takes the model as it is (a CNN; its transformers need a reshape written by the user). The inference forward
and the second call, whose model is warm, are timed five times a round; each first call once, on its fresh copy.
Copies are made
before the clock starts. Targets (issue "The first map as fast as the hundredth"): the first call with the automatic
layer at most 2x the second call, with the layer given at most 1.3x; the second call at most 1.10x the inference
forward.

    python benchmarks/bench_first_call.py [--rounds 3] [--out benchmarks/results_first_call_cpu.md]
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from timing import rounds_and_out, stolen_share
from torch import nn

import explain


@dataclass
class Case:
    """One model of the table: how to build it, the layer given, its target, and whether the peer takes it."""

    name: str
    build: Callable[[], nn.Module]
    layer: str
    peer: bool = True
    target: Callable[[nn.Module, torch.Tensor], object] | None = None


def _timm(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False)

    return build


def _resnet50() -> nn.Module:
    import torchvision

    return torchvision.models.resnet50()


def _detector() -> nn.Module:
    import torchvision

    return torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, box_score_thresh=0.0
    )


def _top_detection(model: nn.Module, x: torch.Tensor) -> object:
    """The detector's top detection on x, found before the clock starts."""
    with torch.no_grad():
        (found,) = copy.deepcopy(model)(x)
    return explain.targets.DetectionTarget(found["boxes"][:1], [int(found["labels"][0])])


def _hf_vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536)
    return ViTForImageClassification(config)


CASES = [
    Case("torchvision resnet50", _resnet50, "layer4"),
    Case("timm convnext_tiny", _timm("convnext_tiny"), "stages.3"),
    Case("timm vit_small_patch16_224", _timm("vit_small_patch16_224"), "blocks.11.norm1", peer=False),
    Case("timm swin_tiny_patch4_window7_224", _timm("swin_tiny_patch4_window7_224"), "layers.3", peer=False),
    Case("timm efficientnet_b0", _timm("efficientnet_b0"), "bn2"),
    Case("torchvision Faster R-CNN (MobileNetV3 320)", _detector, "backbone.fpn:0", False, _top_detection),
    Case("HuggingFace ViT (12 x 384)", _hf_vit, "vit.layers.11.layernorm_before", peer=False),
]


def contenders(case: Case, model: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], Callable[[], object]]]:
    """Each contender as a set-up (run before the clock: fresh copies) returning the timed call."""
    target = case.target(model, x) if case.target else None

    def inference() -> Callable[[], object]:
        def run() -> object:
            with torch.inference_mode():
                return model(x)

        return run

    def first(layer: str | None) -> Callable[[], Callable[[], object]]:
        def setup() -> Callable[[], object]:
            fresh = copy.deepcopy(model)
            return lambda: explain.gradcam(fresh, x, layer, target)

        return setup

    def second() -> Callable[[], object]:
        seen = copy.deepcopy(model)
        explain.gradcam(seen, x, None, target)
        return lambda: explain.gradcam(seen, x, None, target)

    runs = {
        "inference": inference,
        "first, automatic layer": first(None),
        "first, layer given": first(case.layer),
        "second": second,
    }
    if case.peer:
        from pytorch_grad_cam import GradCAM

        def peer() -> Callable[[], object]:
            fresh = copy.deepcopy(model)
            return lambda: GradCAM(fresh, [fresh.get_submodule(case.layer)])(x, targets=None)

        runs["pytorch-grad-cam, first"] = peer
    return runs


WARM = ("inference", "second")  # calls whose model is warm: each round times them several times over
WARM_REPEATS = 5


def measure(case: Case, rounds: int) -> dict[str, float]:
    """The median seconds of each contender over interleaved rounds."""
    torch.manual_seed(0)
    model = case.build().eval()
    x = torch.randn(1, 3, 224, 224)
    setups = contenders(case, model, x)
    times: dict[str, list[float]] = {name: [] for name in setups}
    setups["inference"]()()  # warm-up
    for _ in range(rounds):
        for name, setup in setups.items():
            run = setup()
            for _ in range(WARM_REPEATS if name in WARM else 1):  # a first call has one go per fresh copy
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def main() -> None:
    args = rounds_and_out(__doc__)
    stolen = stolen_share()
    columns = ["first, automatic layer", "first, layer given", "second", "pytorch-grad-cam, first"]
    lines = [
        "| model | inference (ms) | " + " | ".join(columns) + " | first auto / second | first given / second |",
        "|---|---:|" + "---:|" * (len(columns) + 2),
    ]
    for case in CASES:
        medians = measure(case, args.rounds)
        base = medians["inference"]
        cells = [f"{medians[c] / base:.2f}x" if c in medians else "—" for c in columns]
        auto, given = medians["first, automatic layer"], medians["first, layer given"]
        ratios = f"{auto / medians['second']:.2f} | {given / medians['second']:.2f}"
        lines.append(f"| {case.name} | {1000 * base:.0f} | " + " | ".join(cells) + f" | {ratios} |")
        print(lines[-1], flush=True)
    lines.append("")
    lines.append(
        f"Medians of {args.rounds} interleaved rounds, batch 1, 224x224, random weights, "
        f"{torch.get_num_threads()} threads; each ratio to the model's inference forward unless named; "
        f"CPU time stolen by the host: {stolen()}."
    )
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
