"""Grad-CAM of one YOLO detection against the detector's plain inference forward.

Ultralytics' yolo11n from its yaml (random weights, its finest level's class biases raised so that it detects;
the ``yolo`` extra), wrapped in ``explain.models.YoloDetector`` (letterbox and NMS included), on one 480x640 image;
the explained box is the top detection of a plain forward. Contenders, rounds interleaved, medians reported: a
plain inference forward; ``explain`` Grad-CAM with a ``DetectionTarget`` at the automatic layers (the three neck
levels the Detect head reads, fused). pytorch-grad-cam's YOLO path is its Eigen-CAM tutorial on YOLOv5 from
torch.hub, which needs the network: not run here. Target: explain costs at most 1.15x the inference forward.

    python benchmarks/bench_yolo.py [--rounds 5] [--out benchmarks/results_yolo_cpu.md]
"""

from __future__ import annotations

import torch
from timing import against_inference, emit, interleaved_medians, ratio_table, rounds_and_out

import explain
from explain.models.yolo import load_yolo
from explain.targets import DetectionTarget


def detecting(yaml: str, size: tuple[int, int]) -> tuple[torch.nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    """An Ultralytics model from its yaml, random weights, its finest level's class biases raised so that it
    detects; a random image of ``size``; and its detections there."""
    torch.manual_seed(0)
    model = load_yolo(yaml)
    with torch.no_grad():
        model.model.model[-1].cv3[0][-1].bias += 11.0
    x = torch.rand(1, 3, *size)
    with torch.inference_mode():
        (found,) = model(x)
    return model, x, found


def main() -> None:
    args = rounds_and_out(__doc__)
    model, x, found = detecting("yolo11n.yaml", (480, 640))
    target = DetectionTarget(found["boxes"][:1].clone(), [int(found["labels"][0])])

    explainer = explain.GradCAM(model)  # its one-time trace runs in the warm-up round
    medians = interleaved_medians(against_inference(model, x, lambda: explainer(x, target)), args.rounds)
    lines = [
        f"yolo11n (yaml, random weights), one 480x640 image, {len(found['boxes'])} detections, automatic layers "
        f"`{explainer.layer}`, torch {torch.__version__}, median of {args.rounds} interleaved rounds.",
        "",
        *ratio_table(medians),
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
