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
from timing import emit, interleaved_medians, peak_mib, resnet18_batch, rounds_and_out, stolen_share

import explain
from explain import metrics

IMAGES, STEPS, CHUNK = 8, 28, 64
PIXELS = 224 * 224
SEGMENTS = (torch.arange(224)[:, None] // 28 * 8 + torch.arange(224)[None] // 28).expand(IMAGES, 224, 224)  # 64


def plain_forwards(model: torch.nn.Module, copies: int) -> Callable[[], None]:
    """``copies`` forwards of random 224² images, built beforehand, in chunks, without autograd."""
    batch = torch.randn(copies, 3, 224, 224)

    def run() -> None:
        with torch.no_grad():
            for chunk in batch.split(CHUNK):
                model(chunk)

    return run


def cases(model, x, target, maps, gradcam) -> dict[str, tuple[Callable[[], object], Callable[[], object], int]]:
    """Per metric: explain's call, Quantus', and its limit: the forwards it needs (> 0) or the explanations it
    needs (< 0: minus their count of images, explained in calls of 8)."""
    xs, ys, a = x.numpy(), np.asarray(target), maps[:, None].numpy()
    t = torch.tensor(target)

    def q(metric, call: dict | None = None, **options) -> Callable[[], object]:
        return lambda: metric(disable_warnings=True, **options)(
            model=model, x_batch=xs, y_batch=ys, channel_first=True, device="cpu", batch_size=IMAGES,
            **{"a_batch": a.copy(), **(call or {})},
        )  # fmt: skip

    def explained(model, inputs, targets, **kwargs):  # Quantus' explain_func: Grad-CAM's maps of any model
        inputs = torch.as_tensor(inputs).float()
        return explain.GradCAM(model, "layer4")(inputs, torch.as_tensor(targets)).cams[:, None].numpy()

    step, layers = PIXELS // STEPS, len(metrics.resettable_modules(model))
    quadrants = torch.rand(IMAGES, 4).argsort(dim=1) < 2
    by_explanation = {"explain_func": explained, "a_batch": None}
    return {
        "pixel flipping": (lambda: metrics.pixel_flipping(model, x, maps, t, features_in_step=step),
                           q(quantus.PixelFlipping, features_in_step=step), IMAGES * STEPS),
        "faithfulness estimate": (lambda: metrics.faithfulness_estimate(model, x, maps, t, features_in_step=step),
                                  q(quantus.FaithfulnessEstimate, features_in_step=step), IMAGES * STEPS),
        "faithfulness correlation": (
            lambda: metrics.faithfulness_correlation(model, x, maps, t, runs=20, subset_size=224),
            q(quantus.FaithfulnessCorrelation, nr_runs=20, subset_size=224, return_aggregate=False), IMAGES * 20),
        "monotonicity correlation (12 groups, 2 draws)": (
            lambda: metrics.monotonicity_correlation(model, x, maps, t, features_in_step=PIXELS // 12 + 1, samples=2),
            q(quantus.MonotonicityCorrelation, features_in_step=3 * PIXELS // 12, nr_samples=2), IMAGES * 24),
        "region perturbation": (lambda: metrics.region_perturbation(model, x, maps, t, patch_size=8, regions=STEPS),
                                q(quantus.RegionPerturbation, patch_size=8, regions_evaluation=STEPS), IMAGES * STEPS),
        "selectivity": (lambda: metrics.selectivity(model, x, maps, t, patch_size=32),
                        q(quantus.Selectivity, patch_size=32), IMAGES * 49),
        "IROF (64 squares)": (lambda: metrics.irof(model, x, maps, t, segments=SEGMENTS), q(quantus.IROF),
                              IMAGES * 64),
        "sufficiency": (lambda: metrics.sufficiency(model, x, maps), q(quantus.Sufficiency), IMAGES),
        "consistency (rank)": (lambda: metrics.consistency(model, x, maps, discretise="rank"),
                               q(quantus.Consistency, discretise_func=quantus.discretise_func.rank), IMAGES),
        "max-sensitivity": (lambda: metrics.max_sensitivity(gradcam, x, t, samples=5, radius=0.02),
                            q(quantus.MaxSensitivity, by_explanation, nr_samples=5), -IMAGES * 6),
        "relative input stability": (lambda: metrics.relative_input_stability(gradcam, x, t, samples=5),
                                     q(quantus.RelativeInputStability, {"explain_func": explained}, nr_samples=5),
                                     -IMAGES * 6),
        "relative output stability": (lambda: metrics.relative_output_stability(gradcam, x, t, samples=5),
                                      q(quantus.RelativeOutputStability, {"explain_func": explained}, nr_samples=5),
                                      -IMAGES * 6),
        "continuity (28 steps)": (lambda: metrics.continuity(gradcam, x, t),
                                  q(quantus.Continuity, by_explanation), -IMAGES * 29),
        "random logit": (lambda: metrics.random_logit(gradcam, x, t, maps=maps, classes=1000, similarity="ssim_flat"),
                         q(quantus.RandomLogit, {"explain_func": explained}, num_classes=1000), -IMAGES),
        f"MPRT ({layers} layers)": (lambda: metrics.mprt(model, x, "gradcam", t, layer="layer4"),
                                    q(quantus.MPRT, by_explanation), -IMAGES * (layers + 1)),
        "eMPRT": (lambda: metrics.emprt(model, x, "gradcam", t, layer="layer4"),
                  q(quantus.EfficientMPRT, by_explanation), -IMAGES * 2),
        "input invariance": (lambda: metrics.input_invariance(model, x, "gradcam", t, layer="layer4"),
                             q(quantus.InputInvariance, {"explain_func": explained}), -IMAGES * 2),
        "focus": (lambda: metrics.focus(maps, quadrants),
                  q(quantus.Focus, {"custom_batch": quadrants.int().numpy()}), 0),
        "sparseness": (lambda: metrics.sparseness(maps), q(quantus.Sparseness), 0),
    }  # fmt: skip


def _quantus_runs(theirs: Callable[[], object]) -> str | None:
    """Why Quantus' call fails on this batch (its first line), or None where it runs."""
    try:
        theirs()
    except Exception as err:
        return f"fails ({type(err).__name__})"
    return None


def _limit(model, x, target, gradcam, copies: int) -> Callable[[], object] | None:
    """The limit's run: ``copies`` plain forwards (> 0), or -``copies`` images' explanations in calls of 8 (< 0)."""
    if copies > 0:
        return plain_forwards(model, copies)
    if copies < 0:  # the explanations it needs, the plain images' among them
        noisy = x.repeat(-copies // IMAGES, 1, 1, 1)
        return lambda: [gradcam(c, torch.tensor(target)) for c in noisy.split(IMAGES)]
    return None


def row(name: str, found: dict[str, float], failure: str | None, memory: dict[str, float]) -> str:
    """One line of the table: times, ratios and peak memory."""
    ours, limit = found["explain"], found.get("limit")
    limit_cells = ("—", "—") if limit is None else (f"{limit:.3f}", f"{ours / limit:.2f}")
    quantus_cells = (failure, "—") if failure else (f"{found['quantus']:.3f}", f"{found['quantus'] / ours:.1f}")
    theirs_memory = "—" if failure else f"{memory['quantus']:.0f}"
    return (
        f"| {name} | {ours:.3f} | {quantus_cells[0]} | {limit_cells[0]} | {quantus_cells[1]} | {limit_cells[1]} | "
        f"{memory['explain']:.0f} | {theirs_memory} |"
    )


def main() -> None:
    args = rounds_and_out(__doc__)
    torch.set_num_threads(torch.get_num_threads())
    model, x, target = resnet18_batch(IMAGES)
    gradcam = explain.GradCAM(model, "layer4")
    maps = gradcam(x, torch.tensor(target)).cams
    stolen = stolen_share()
    lines = [
        "| metric | explain (s) | Quantus (s) | limit (s) | Quantus / explain | explain / limit | explain peak "
        "(MiB) | Quantus peak (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (ours, theirs, copies) in cases(model, x, target, maps, gradcam).items():
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        failure = _quantus_runs(theirs)
        runs = {"explain": ours, **({} if failure else {"quantus": theirs})}
        limit = _limit(model, x, target, gradcam, copies)
        if limit is not None:
            runs["limit"] = limit
        found = interleaved_medians(runs, args.rounds)
        memory = {who: peak_mib(run) for who, run in runs.items() if who != "limit"}
        lines.append(row(name, found, failure, memory))
        print(lines[-1], flush=True)
    lines += ["", f"Medians of {args.rounds} interleaved rounds, resnet18 (random weights), 8 images of 224², "
              f"{torch.get_num_threads()} threads; peak memory: the resident memory one call adds, sampled every "
              f"millisecond; {stolen()}."]  # fmt: skip
    emit(lines, args.out)


if __name__ == "__main__":
    main()
