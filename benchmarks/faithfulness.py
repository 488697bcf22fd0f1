"""Which method should I trust? Every method on the bundled model over the photos in ``assets/``: deletion,
insertion, Average Drop, ROAD and the randomization sanity check, as a markdown table.

EfficientNet-Lite0 with its ImageNet weights, each photo's top class, the automatic layer (``bn2``). Deletion and
insertion: 50 steps; ROAD: MoRF and LeRF at 20, 50 and 80%, (LeRF - MoRF) / 2; sanity check: the blocks of
``explain.metrics.cascading_blocks`` randomized from the output down, Spearman's correlation of the absolute maps
with the trained model's after the first block (the classifier) and after all of them; a method whose maps keep a
mean correlation of at least 0.5 with the classifier random fails (``SanityResult.insensitive``); only those
two depths are explained, which spares the perturbation methods ten runs each, and the other metrics score the
trained model's maps that the sanity check computed. A guided method's images are
scored as saliency maps (each pixel's largest absolute channel).

    python benchmarks/faithfulness.py [--methods gradcam,layercam] [--samples 10]
        [--out benchmarks/results_faithfulness.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from timing import emit

import explain
from explain import metrics
from explain.catalog import METHOD_CATALOG
from explain.export.inputs import collect_inputs
from explain.methods import method_options

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SKIPPED = {"attention_rollout", "gradient_rollout", "legrad", "chefer"}  # transformers' methods; the model is a CNN
LAYERS = {"refinecam": ["blocks.4", "blocks.5", "bn2"]}  # a method of several layers: these, multiplied


def saliency(cams: torch.Tensor) -> torch.Tensor:
    """Maps (N, H, W); a guided method's images as their largest absolute channel."""
    return cams.abs().amax(dim=1) if cams.dim() == 4 else cams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--methods", help="comma-separated methods (default: every method but the rollouts)")
    parser.add_argument(
        "--samples", type=int, help="SS-CAM's noisy masks or IS-CAM's steps per channel (default: the method's own)"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = explain.load_model("efficientnet_lite0")
    model = spec.model
    photos = [item.path for item in collect_inputs([ASSETS]) if item.path.parent == ASSETS]
    x = spec.preprocess(photos)
    classes = model(x).argmax(dim=1)
    names = ", ".join(f"{p.name} ({spec.labels[c]})" for p, c in zip(photos, classes.tolist()))
    lines = [
        f"EfficientNet-Lite0 (ImageNet weights), {len(photos)} photos: {names}; layer `bn2`, "
        f"torch {torch.__version__}.",
        "Mean over the photos; ↓ lower is better, ↑ higher is better.",
        "",
        "| method | deletion AUC ↓ | insertion AUC ↑ | Average Drop % ↓ | ROAD ↑ | sanity: ρ, classifier random | "
        "ρ, all random | sanity check |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    depth = len(metrics.cascading_blocks(model))  # the sanity check compares the maps at depth 1 and the last
    chosen = args.methods.split(",") if args.methods else [e.name for e in METHOD_CATALOG if e.name not in SKIPPED]
    for entry in (e for e in METHOD_CATALOG if e.name in chosen):
        options = method_options(entry.name)
        seeded = {"seed": 0} if "seed" in options else {}
        label = entry.name
        if args.samples and "samples" in options:
            seeded["samples"], label = args.samples, f"{entry.name} (samples={args.samples})"
        if entry.name in LAYERS:
            seeded["layer"], label = LAYERS[entry.name], f"{entry.name} ({', '.join(LAYERS[entry.name])})"
        sanity = metrics.sanity_check(model, x, entry.name, classes, init_seed=0, depths=(1, depth), **seeded)
        maps = saliency(sanity.trained.cams)  # the trained model's maps, which the sanity check computed
        deletion = metrics.deletion(model, x, maps, classes).auc.mean()
        insertion = metrics.insertion(model, x, maps, classes).auc.mean()
        drop = metrics.average_drop(model, x, maps, classes).value.mean()
        road = metrics.road(model, x, maps, classes, percentiles=(20, 50, 80)).combined.mean()
        first, last = sanity.spearman[0].mean(), sanity.spearman[-1].mean()
        verdict = "**fails**" if sanity.insensitive() else "passes"
        lines.append(
            f"| {label} | {deletion:.3f} | {insertion:.3f} | {drop:.1f} | {road:.3f} | {first:.2f} | "
            f"{last:.2f} | {verdict} |"
        )
        print(lines[-1], flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
