"""The faithfulness metrics' cost, in one process: deletion and insertion against the forwards of their perturbed
copies, ROAD against pytorch-grad-cam's ROAD classes (with the values compared, the imputers' noise off).

Deletion and insertion: resnet50 (random weights, eval mode), 8 images of 224², 28 steps, ``batch_size`` 16. The
baselines run forwards of as many copies (232), built beforehand, in chunks of 16 under ``no_grad``: the plain
model, and the forwards explain itself runs
(:class:`explain.core.speedups.folding.ScoringForwards`: on the CPU the batch
norms folded and the inputs channels last). ROAD: the bundled EfficientNet-Lite0 on the six photos in ``assets/``
and two of them again (8 images), each photo's top class scored by its softmax probability, Grad-CAM's maps, the
same removal fractions (explain's percentiles are the share removed, pytorch-grad-cam's the share kept); and a small
call, 4 photos at one percentile, where the folded scoring copy is built once per model, not once per call.

    python benchmarks/bench_metrics.py [--rounds 3] [--out benchmarks/results_metrics_cpu.md]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
import torchvision
from timing import emit, interleaved_medians, stolen_share

import explain
from explain import metrics
from explain.core.speedups.folding import ScoringForwards
from explain.export.inputs import collect_inputs

ASSETS = Path(__file__).resolve().parents[1] / "assets"
STEPS, IMAGES, CHUNK = 28, 8, 16
PERCENTILES = (20, 50, 80)


def forwards_of(run: object, copies: torch.Tensor) -> None:
    """Run ``copies`` through ``run`` in chunks, without autograd."""
    with torch.no_grad():
        for chunk in copies.split(CHUNK):
            run(chunk)


def deletion_rows(rounds: int) -> list[str]:
    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval()
    x = torch.randn(IMAGES, 3, 224, 224)
    maps = torch.rand(IMAGES, 7, 7)
    copies = x.repeat_interleave(STEPS + 1, dim=0)  # what is in them does not change a forward's time
    fast = ScoringForwards(model, x.device)
    times = interleaved_medians(
        {
            "deletion": lambda: metrics.deletion(model, x, maps, steps=STEPS, batch_size=CHUNK),
            "insertion": lambda: metrics.insertion(model, x, maps, steps=STEPS, batch_size=CHUNK),
            "model": lambda: forwards_of(model, copies),
            "scoring": lambda: forwards_of(fast, copies),
        },
        rounds,
    )
    rows = []
    for name in ("deletion", "insertion"):
        rows.append(
            f"| {name}, resnet50, {IMAGES} images, {STEPS} steps | {times[name]:.2f} | {times['scoring']:.2f} | "
            f"{times[name] / times['scoring']:.2f} | {times['model']:.2f} | {times[name] / times['model']:.2f} |"
        )
    return rows


def road_rows(rounds: int, images: int, percentiles: tuple[int, ...]) -> list[str]:
    """ROAD on ``images`` photos at ``percentiles``: explain's call against pytorch-grad-cam's, a table row."""
    spec = explain.load_model("efficientnet_lite0")
    model = spec.model
    photos = [item.path for item in collect_inputs([ASSETS]) if item.path.parent == ASSETS]
    x = spec.preprocess((photos * 2)[:images])
    classes = model(x).argmax(dim=1)
    maps = explain.gradcam(model, x, None, classes)  # (N, 224, 224), the input's size

    def ours(noise: float) -> torch.Tensor:
        return metrics.road(model, x, maps, classes, percentiles=percentiles, noise=noise).combined

    runs = {"explain": lambda: ours(0.01)}
    lines = []
    if importlib.util.find_spec("pytorch_grad_cam"):
        from pytorch_grad_cam.metrics import road
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputSoftmaxTarget

        targets = [ClassifierOutputSoftmaxTarget(int(c)) for c in classes]
        kept = [100 - p for p in percentiles]

        def theirs() -> torch.Tensor:
            combined = road.ROADCombined(percentiles=kept)(x, maps.numpy(), targets, model)
            return torch.as_tensor(combined)

        runs["pytorch-grad-cam"] = theirs
        defaults = road.NoisyLinearImputer.__init__.__defaults__
        road.NoisyLinearImputer.__init__.__defaults__ = (0.0, *defaults[1:])  # the values compared without noise
        try:
            difference = (ours(0.0) - theirs()).abs().max()
        finally:
            road.NoisyLinearImputer.__init__.__defaults__ = defaults
        lines.append(
            f"Values without noise, {images} photos: the largest difference of (LeRF − MoRF) / 2 is {difference:.2e}."
        )
    times = interleaved_medians(runs, rounds)
    rows = [
        f"| ROAD, EfficientNet-Lite0, {images} photos, removal {', '.join(f'{p}%' for p in percentiles)} | "
        f"{times['explain']:.2f} | "
        + (f"{times['pytorch-grad-cam']:.2f} | " if len(times) > 1 else "– | ")
        + (f"{times['pytorch-grad-cam'] / times['explain']:.2f} |" if len(times) > 1 else "– |")
    ]
    return [*rows, "", *lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="also write the tables to this markdown file")
    args = parser.parse_args()
    stolen = stolen_share()
    deletion = deletion_rows(args.rounds)
    large = road_rows(args.rounds, IMAGES, PERCENTILES)
    small = road_rows(args.rounds, 4, (50,))  # a small call, where building the folded copy once matters
    lines = [
        f"Medians of {args.rounds} interleaved rounds, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"CPU time stolen by the host: {stolen()}.",
        "",
        "| metric | explain (s) | its forwards of the copies (s) | ratio | the plain model's forwards (s) | ratio |",
        "|---|---:|---:|---:|---:|---:|",
        *deletion,
        "",
        "| metric | explain (s) | pytorch-grad-cam (s) | pytorch-grad-cam ÷ explain |",
        "|---|---:|---:|---:|",
        large[0],
        small[0],
        "",
        *large[2:],
        *small[2:],
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
