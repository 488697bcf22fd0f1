"""The first call of ``explain.gradcam`` on a model it has not seen, and the steady call, against the least work any
Grad-CAM can do.

What most users meet is the first call: one photo in a notebook, one run of the command line. Each model (random
weights, one 224x224 image, the CPU) is timed in one process, rounds interleaved: its inference forward; the first
call of ``explain.gradcam`` on a fresh copy (a deep copy: explain has learned nothing about it), with the automatic
layer and with the layer given; the second call on the same copy; and pytorch-grad-cam's first call on a fresh copy
where it takes the model as it is (a CNN; its transformers need a reshape written by the user). The inference forward
and the second call, whose model is warm, are timed five times a round; each first call once, on its fresh copy.
Copies are made
before the clock starts. The **limit** is a hand-written Grad-CAM at the same layer, the least work any can do: the
forward under ``no_grad`` up to the layer, where a forward hook switches grad on, one backward from the top class's
score to the layer's output, the channel weights, the map, upsampled and normalized; at the layer the steady call
chooses (a classifier's: its top class). Targets (issues "The first map
as fast as the hundredth" and "no fixed cost per call"): the second (steady) call at most 1.10x the limit; the first
call with the automatic layer at most 2x the second call, with the layer given at most 1.3x. The speedups' effect:
the second and the first call again with ``EXPLAIN_SPEEDUPS=0`` (every speedup off), against the default.

    python benchmarks/bench_first_call.py [--rounds 3] [--out benchmarks/results_first_call_cpu.md]
"""

from __future__ import annotations

import copy
import os
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


def _lite0() -> nn.Module:
    return explain.load_model("efficientnet_lite0").model


def _mobilenet_v3_small() -> nn.Module:
    import torchvision

    return torchvision.models.mobilenet_v3_small()


def _hf_vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536)
    return ViTForImageClassification(config)


CASES = [
    Case("explain's bundled EfficientNet-Lite0", _lite0, "bn2"),
    Case("torchvision mobilenet_v3_small", _mobilenet_v3_small, "features.12"),
    Case("torchvision resnet50", _resnet50, "layer4"),
    Case("timm convnext_tiny", _timm("convnext_tiny"), "stages.3"),
    Case("timm vit_small_patch16_224", _timm("vit_small_patch16_224"), "blocks.11.norm1", peer=False),
    Case("timm swin_tiny_patch4_window7_224", _timm("swin_tiny_patch4_window7_224"), "layers.3", peer=False),
    Case("timm efficientnet_b0", _timm("efficientnet_b0"), "bn2"),
    Case("torchvision Faster R-CNN (MobileNetV3 320)", _detector, "backbone.fpn:0", False, _top_detection),
    Case("HuggingFace ViT (12 x 384)", _hf_vit, "vit.layers.11.layernorm_before", peer=False),
]


def hand_written(model: nn.Module, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Grad-CAM of the top class at ``layer`` with the least work: grad switched on at the layer (the forward before
    it under ``no_grad``), one backward to the layer's output; a token layer's map on its square grid of tokens."""
    caught: list[torch.Tensor] = []

    def switch_on(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        torch.set_grad_enabled(True)  # for the rest of this forward: the no_grad block restores it after
        caught.append(output.detach().requires_grad_(True))
        return caught[-1]

    handle = layer.register_forward_hook(switch_on)
    try:
        with torch.no_grad():
            logits = model(x)
    finally:
        handle.remove()
    logits = getattr(logits, "logits", logits)
    (gradient,) = torch.autograd.grad(logits.gather(1, logits.argmax(1, keepdim=True)).sum(), caught[0])
    activation = caught[0].detach()
    if activation.dim() == 3:  # tokens (N, T, C): the last side x side of them, as a grid
        side = int((activation.shape[1]) ** 0.5)
        activation, gradient = (t[:, -side * side :].transpose(1, 2).unflatten(2, (side, side)) for t in
                                (activation, gradient))  # fmt: skip
    cam = torch.relu((gradient.mean((2, 3), keepdim=True) * activation).sum(1, keepdim=True))
    cam = torch.nn.functional.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False).flatten(1)
    low, high = cam.min(1, keepdim=True).values, cam.max(1, keepdim=True).values
    return ((cam - low) / (high - low).clamp_min(1e-8)).view(len(x), *x.shape[-2:])


class speedups_off:  # a context manager, read as a phrase
    """``EXPLAIN_SPEEDUPS=0`` for the block (read at each pass)."""

    def __enter__(self) -> None:
        self.before = os.environ.get("EXPLAIN_SPEEDUPS")
        os.environ["EXPLAIN_SPEEDUPS"] = "0"

    def __exit__(self, *exc: object) -> None:
        if self.before is None:
            del os.environ["EXPLAIN_SPEEDUPS"]
        else:
            os.environ["EXPLAIN_SPEEDUPS"] = self.before


def contenders(case: Case, model: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], Callable[[], object]]]:
    """Each contender as a set-up (run before the clock: fresh copies) returning the timed call."""
    target = case.target(model, x) if case.target else None

    def inference() -> Callable[[], object]:
        def run() -> object:
            with torch.inference_mode():
                return model(x)

        return run

    def limit() -> Callable[[], object]:
        layer = model.get_submodule(explain.GradCAM(copy.deepcopy(model))(x).layer)  # the steady call's layer
        return lambda: hand_written(model, layer, x)

    def first(layer: str | None) -> Callable[[], Callable[[], object]]:
        def setup() -> Callable[[], object]:
            fresh = copy.deepcopy(model)
            return lambda: explain.gradcam(fresh, x, layer, target)

        return setup

    def second() -> Callable[[], object]:
        seen = copy.deepcopy(model)
        explain.gradcam(seen, x, None, target)
        return lambda: explain.gradcam(seen, x, None, target)

    def plain(setup: Callable[[], Callable[[], object]]) -> Callable[[], Callable[[], object]]:
        """The same call with every speedup off (its set-up too: the second call's first call learns without)."""

        def off() -> Callable[[], object]:
            with speedups_off():
                run = setup()

            def timed() -> object:
                with speedups_off():
                    return run()

            return timed

        return off

    runs = {
        "inference": inference,
        "first, automatic layer": first(None),
        "first, layer given": first(case.layer),
        "second": second,
        "second, speedups off": plain(second),
        "first, automatic layer, speedups off": plain(first(None)),
    }
    if case.target is None:  # a classifier: the top class, as the hand-written call takes it
        runs["limit"] = limit
    if case.peer:
        from pytorch_grad_cam import GradCAM

        def peer() -> Callable[[], object]:
            fresh = copy.deepcopy(model)
            return lambda: GradCAM(fresh, [fresh.get_submodule(case.layer)])(x, targets=None)

        runs["pytorch-grad-cam, first"] = peer
    return runs


WARM = ("inference", "limit", "second", "second, speedups off")  # warm calls: timed several times a round
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


def row(case: Case, medians: dict[str, float]) -> tuple[str, str]:
    """A model's line of each table: the calls against the inference forward and the limit; the speedups' effect."""
    base, steady = medians["inference"], medians["second"]
    columns = ["first, automatic layer", "first, layer given", "second", "pytorch-grad-cam, first"]
    cells = [f"{medians[c] / base:.2f}x" if c in medians else "—" for c in columns]
    limit = f"{steady / medians['limit']:.2f}" if "limit" in medians else "—"
    auto, given = medians["first, automatic layer"], medians["first, layer given"]
    ratios = f"{limit} | {auto / steady:.2f} | {given / steady:.2f}"
    first = f"{1000 * base:.0f} | " + (f"{1000 * medians['limit']:.1f}" if "limit" in medians else "—")
    speed = (f"| {case.name} | {1000 * steady:.1f} | {medians['second, speedups off'] / steady:.2f} | "
             f"{medians['first, automatic layer, speedups off'] / auto:.2f} |")  # fmt: skip
    return f"| {case.name} | {first} | " + " | ".join(cells) + f" | {ratios} |", speed


def main() -> None:
    args = rounds_and_out(__doc__)
    stolen = stolen_share()
    columns = ["first, automatic layer", "first, layer given", "second", "pytorch-grad-cam, first"]
    lines = [
        "| model | inference (ms) | limit (ms) | " + " | ".join(columns)
        + " | second / limit | first auto / second | first given / second |",
        "|---|---:|---:|" + "---:|" * (len(columns) + 3),
    ]
    speed = [
        "| model | second (ms) | second, speedups off / on | first auto, speedups off / on |",
        "|---|---:|---:|---:|",
    ]
    for case in CASES:
        if args.only and not any(part in case.name for part in args.only.split(",")):
            continue
        line, effect = row(case, measure(case, args.rounds))
        lines.append(line)
        speed.append(effect)
        print(line, effect, flush=True)
    lines.append("")
    lines.append(
        f"Medians of {args.rounds} interleaved rounds, batch 1, 224x224, random weights, "
        f"{torch.get_num_threads()} threads; each ratio to the model's inference forward unless named; the limit is "
        f"the hand-written Grad-CAM (a classifier's top class); CPU time stolen by the host: {stolen()}."
    )
    table = "\n".join([*lines, "", "The speedups' effect (`EXPLAIN_SPEEDUPS=0` against the default):", "", *speed])
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
