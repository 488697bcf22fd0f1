"""Batch export end to end against the model alone: images/s on a folder of 640x480 JPEGs, and where the time goes.

The bundled EfficientNet-Lite0, Grad-CAM, batches of 16, in one process. The model-only rate is Grad-CAM on
the same images decoded and preprocessed beforehand, in batches of 16; the export rate is ``export_heatmaps``
on the folder with the command's defaults (JPEG overlays; threads or processes for reading), from its first batch
to its last record (model loading excluded). Target (issue "data-set export"): at least 0.75x the model-only
rate on this project's 2-core CPU machine. The breakdown times each step alone, single-threaded, per image.

    python benchmarks/bench_export.py [--images 96] [--rounds 3] [--out benchmarks/results_export_cpu.md]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image
from timing import emit, stolen_share

import explain
from explain.export.loading import default_workers
from explain.export.run import export_heatmaps
from explain.export.settings import ExportOptions, RenderOptions
from explain.io import render
from explain.io.images import load_image, save_image

ROOT = Path(__file__).resolve().parents[1]
PHOTOS = sorted(p for p in (ROOT / "assets").iterdir() if p.suffix in (".png", ".jpg"))


def make_dataset(folder: Path, count: int) -> list[Path]:
    """``count`` 640x480 JPEGs (quality 90): crops of the photos in assets/ at shifting offsets."""
    paths = []
    for i in range(count):
        image = Image.open(PHOTOS[i % len(PHOTOS)]).convert("RGB")
        width, height = image.size
        shift = (i // len(PHOTOS)) % 8
        box = (shift * width // 40, shift * height // 40, width - (7 - shift) * width // 40, height)
        path = folder / f"{i:04d}.jpg"
        image.crop(box).resize((640, 480), Image.Resampling.BICUBIC).save(path, quality=90)
        paths.append(path)
    return paths


def per_image_ms(step, items, rounds: int = 3) -> float:
    """Median over rounds of a step's mean milliseconds per item."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for item in items:
            step(item)
        times.append((time.perf_counter() - start) / len(items) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    device = torch.device(args.device)
    spec = explain.load_model("efficientnet_lite0", device=device)
    method = explain.create_method("gradcam", spec.model)
    with tempfile.TemporaryDirectory() as temp:
        folder = Path(temp, "data")
        folder.mkdir()
        paths = make_dataset(folder, args.images)
        decoded = [load_image(p) for p in paths]
        x = torch.stack([spec.transform(image) for image in decoded])
        batches = [batch.to(device) for batch in x.split(16)]

        def model_only() -> float:
            start = time.perf_counter()
            for batch in batches:
                method(batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return len(x) / (time.perf_counter() - start)

        def export(fmt: str, workers: int | None, name: str) -> float:
            options = ExportOptions(batch_size=16, render=RenderOptions(fmt=fmt), workers=workers, overwrite=True)
            return export_heatmaps(spec, [folder], Path(temp, name), options, device=device).rate

        model_only()  # warm-up
        workers = default_workers(args.images, 16, device)
        loading = f"{workers} worker processes" if workers else "loading threads"
        runs = {
            "model only (pre-decoded tensors)": lambda: model_only(),
            f"export, defaults (jpg, {loading})": lambda: export("jpg", None, "default"),
            "export, jpg, 1 worker process": lambda: export("jpg", 1, "w1"),
            "export, png overlays": lambda: export("png", None, "png"),
        }
        steal = stolen_share()
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                rates[name].append(run())
        medians = {name: statistics.median(values) for name, values in rates.items()}
        stolen = steal()

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        sample, tensors = paths[:16], batches[0]
        cams = method(tensors).cams
        pictures = [render.picture(image, cam) for image, cam in zip(decoded[:16], cams)]
        steps = {
            "decode (Pillow, EXIF, RGB)": per_image_ms(load_image, sample),
            "resize and normalize to 224²": per_image_ms(spec.transform, decoded[:16]),
            "Grad-CAM, batch 16 (1 thread)": per_image_ms(method, [tensors]) / 16,
            "render the overlay (640x480)": per_image_ms(lambda pair: render.picture(*pair), list(zip(decoded, cams))),
            "encode JPEG (quality 90)": per_image_ms(lambda p: save_image(p, Path(temp, "o.jpg")), pictures),
            "encode PNG (zlib level 1)": per_image_ms(lambda p: save_image(p, Path(temp, "o.png")), pictures),
        }
        torch.set_num_threads(threads)

    base = medians["model only (pre-decoded tensors)"]
    lines = [
        f"EfficientNet-Lite0, Grad-CAM on {device.type}, {args.images} JPEGs of 640x480, batches of 16, "
        f"torch {torch.__version__}, {threads} threads; median of {args.rounds} interleaved rounds; CPU time taken "
        f"by the virtual machine's host meanwhile: {stolen}.",
        "",
        "| run | images/s | × model only |",
        "|---|---:|---:|",
        *(f"| {name} | {rate:.1f} | {rate / base:.2f} |" for name, rate in medians.items()),
        "",
        "Per image, each step alone on one thread:",
        "",
        "| step | ms |",
        "|---|---:|",
        *(f"| {name} | {ms:.1f} |" for name, ms in steps.items()),
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
