"""The evaluation metrics against Quantus 0.6.0's on the same batch, and against their own limit.

resnet18 (random weights, eval mode), 8 images of 224², each image's top class, Grad-CAM's maps (at ``layer4``,
upsampled to the input); rounds interleaved, the model warm. For each metric:

- **explain**: ``explain.metrics``' function, its copies built on the device and scored in chunks of 64;
- **quantus**: Quantus 0.6.0's metric class on the same arrays (its loop of forwards per step or run);
- **limit**: the perturbed forwards the metric needs (for max-sensitivity, the explanations: the plain images'
  and their perturbed copies', a call of 8 images each), run plainly in chunks of 64 under ``no_grad`` on copies
  built beforehand: what any implementation must spend.

Settings as in the issue: pixel flipping and faithfulness estimate in 28 steps, faithfulness correlation 20 runs of
224 pixels, region perturbation 28 regions of 8², selectivity regions of 32² (49), max-sensitivity 5 samples.

    python benchmarks/bench_metrics_quantus.py [--rounds 3] [--out benchmarks/results_metrics_quantus_cpu.md]
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import quantus
import torch
from timing import emit, interleaved_medians, resnet18_batch, rounds_and_out, stolen_share

import explain
from explain import metrics

IMAGES, STEPS, CHUNK = 8, 28, 64
PIXELS = 224 * 224


def plain_forwards(model: torch.nn.Module, copies: int) -> Callable[[], None]:
    """``copies`` forwards of random 224² images, built beforehand, in chunks, without autograd."""
    batch = torch.randn(copies, 3, 224, 224)

    def run() -> None:
        with torch.no_grad():
            for chunk in batch.split(CHUNK):
                model(chunk)

    return run


def cases(model, x, target, maps, gradcam) -> dict[str, tuple[Callable[[], object], Callable[[], object], int]]:
    """Per metric: explain's call, Quantus', and the forwards of its limit."""
    xs, ys, a = x.numpy(), np.asarray(target), maps[:, None].numpy()
    t = torch.tensor(target)

    def q(metric, call: dict | None = None, **options) -> Callable[[], object]:
        return lambda: metric(disable_warnings=True, **options)(
            model=model, x_batch=xs, y_batch=ys, a_batch=a.copy(), channel_first=True, device="cpu",
            batch_size=IMAGES, **(call or {}),
        )  # fmt: skip

    def explained(model, inputs, targets, **kwargs):  # Quantus' explain_func: Grad-CAM's maps, as numpy
        return gradcam(torch.as_tensor(inputs), torch.as_tensor(targets)).cams[:, None].numpy()

    step = PIXELS // STEPS
    return {
        "pixel flipping": (lambda: metrics.pixel_flipping(model, x, maps, t, features_in_step=step),
                           q(quantus.PixelFlipping, features_in_step=step), IMAGES * STEPS),
        "faithfulness estimate": (lambda: metrics.faithfulness_estimate(model, x, maps, t, features_in_step=step),
                                  q(quantus.FaithfulnessEstimate, features_in_step=step), IMAGES * STEPS),
        "faithfulness correlation": (
            lambda: metrics.faithfulness_correlation(model, x, maps, t, runs=20, subset_size=224),
            q(quantus.FaithfulnessCorrelation, nr_runs=20, subset_size=224, return_aggregate=False), IMAGES * 20),
        "region perturbation": (lambda: metrics.region_perturbation(model, x, maps, t, patch_size=8, regions=STEPS),
                                q(quantus.RegionPerturbation, patch_size=8, regions_evaluation=STEPS), IMAGES * STEPS),
        "selectivity": (lambda: metrics.selectivity(model, x, maps, t, patch_size=32),
                        q(quantus.Selectivity, patch_size=32), IMAGES * 49),
        "max-sensitivity": (lambda: metrics.max_sensitivity(gradcam, x, t, samples=5, radius=0.02),
                            q(quantus.MaxSensitivity, {"explain_func": explained}, nr_samples=5), -IMAGES * 5),
        "sparseness": (lambda: metrics.sparseness(maps), q(quantus.Sparseness), 0),
    }  # fmt: skip


def main() -> None:
    args = rounds_and_out(__doc__)
    torch.set_num_threads(torch.get_num_threads())
    model, x, target = resnet18_batch(IMAGES)
    gradcam = explain.GradCAM(model, "layer4")
    maps = gradcam(x, torch.tensor(target)).cams
    stolen = stolen_share()
    lines = [
        "| metric | explain (s) | Quantus (s) | limit (s) | Quantus / explain | explain / limit |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, (ours, theirs, copies) in cases(model, x, target, maps, gradcam).items():
        runs = {"explain": ours, "quantus": theirs}
        if copies > 0:
            runs["limit"] = plain_forwards(model, copies)
        elif copies < 0:  # the explanations it needs: the plain images' and the -copies perturbed images'
            noisy = x.repeat(1 + -copies // IMAGES, 1, 1, 1)
            runs["limit"] = lambda noisy=noisy: [gradcam(c, torch.tensor(target)) for c in noisy.split(IMAGES)]
        found = interleaved_medians(runs, args.rounds)
        limit, ours_s = found.get("limit"), found["explain"]
        limit_cells = ("—", "—") if limit is None else (f"{limit:.3f}", f"{ours_s / limit:.2f}")
        lines.append(
            f"| {name} | {ours_s:.3f} | {found['quantus']:.3f} | {limit_cells[0]} | "
            f"{found['quantus'] / ours_s:.1f} | {limit_cells[1]} |"
        )
    lines += ["", f"Medians of {args.rounds} interleaved rounds, resnet18 (random weights), 8 images of 224², "
              f"{torch.get_num_threads()} threads; {stolen()}."]  # fmt: skip
    emit(lines, args.out)


if __name__ == "__main__":
    main()
