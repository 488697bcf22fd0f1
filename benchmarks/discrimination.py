"""Class discrimination of every method, at two layers of the bundled EfficientNet-Lite0.

The input is the cat photo beside the coffee photo (assets/chelsea.png |
assets/coffee.png, each resized to 224 x 224, the pair squashed to 224 x 224).
For each method and layer it explains "Egyptian cat" and "espresso" and reports
the share of each map's mass on the half where that object is: 0.5 is no
discrimination, 1.0 perfect. The guided methods' maps are images; their mass is
the absolute value summed over colour channels. Eigen-CAM is class-agnostic,
so its two maps are the same and its two shares add up to 1. SS-CAM and IS-CAM
run with fewer samples than their defaults, to keep the run short (given in the table).
Prints a Markdown table (about 10 minutes on a 2-core CPU).

    python benchmarks/discrimination.py [--device cuda] [--layers bn2 blocks.6]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import explain
from explain.io.images import to_tensor

ASSETS = Path(__file__).resolve().parents[1] / "assets"
CLASSES = ("Egyptian cat", "espresso")
SAMPLES = {"sscam": 4, "iscam": 4}


def composite(side: int = 224) -> Image.Image:
    photos = [
        Image.open(ASSETS / name).convert("RGB").resize((side, side), Image.Resampling.BICUBIC)
        for name in ("chelsea.png", "coffee.png")
    ]
    return Image.fromarray(np.concatenate([np.asarray(p) for p in photos], axis=1))


def shares(maps: torch.Tensor) -> list[float]:
    """Share of each map's mass on its own half: the cat's on the left, the espresso's on the right."""
    mass = maps.abs().sum(dim=1) if maps.dim() == 4 else maps
    width = mass.shape[-1]
    halves = [mass[0, :, : width // 2].sum(), mass[1, :, width // 2 :].sum()]
    return [(half / mass[i].sum()).item() for i, half in enumerate(halves)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", nargs="+", default=["bn2", "blocks.6"])
    parser.add_argument("--methods", nargs="+", default=list(explain.METHODS))
    args = parser.parse_args()
    spec = explain.load_model("efficientnet_lite0", device=args.device)
    p = spec.preprocessing
    x = to_tensor(composite(), (224, 224), p.mean, p.std, p.resample)[None].repeat(2, 1, 1, 1).to(args.device)
    rows = []
    for method in args.methods:
        cells, seconds = [], 0.0
        for layer in args.layers:
            options = {"seed": 0} if method in ("random", "sscam") else {}
            if method in SAMPLES:
                options["samples"] = SAMPLES[method]
            start = time.perf_counter()
            try:
                guided = method.startswith("guided")  # their normalized maps are display images: take the gradients
                maps = explain.cam(
                    spec.model, x, method, layer, list(CLASSES), normalize=not guided, labels=spec.labels, **options
                )
            except explain.LayerError:  # CAM needs the layer that the classifier reads
                cells += ["n/a", "n/a"]
                continue
            seconds += time.perf_counter() - start
            cells += [f"{share:.2f}" for share in shares(maps)]
        note = f" ({SAMPLES[method]} samples)" if method in SAMPLES else ""
        rows.append(f"| {method}{note} | " + " | ".join(cells) + f" | {seconds:.1f} |")
        print(rows[-1], flush=True)
    head = " | ".join(f"{name} @ {layer}" for layer in args.layers for name in ("cat", "espresso"))
    print(f"\n| method | {head} | seconds |\n|---|" + "---:|" * (2 * len(args.layers) + 1))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
