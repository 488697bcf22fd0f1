"""Grad-CAM of one detection box against the detector's plain inference forward, and against pytorch-grad-cam.

Faster R-CNN (MobileNetV3-Large FPN, torchvision's default 800-pixel resize) with random weights on one
480x640 image; the explained box is the top detection of a plain forward. Contenders, rounds interleaved,
medians reported: a plain inference forward; ``explain`` Grad-CAM with a ``DetectionTarget`` at the last
backbone block; pytorch-grad-cam's ``GradCAM`` with its ``FasterRCNNBoxScoreTarget`` at the same layer
(where ``grad-cam`` is installed). Target: explain costs at most 1.15x the inference forward.

    python benchmarks/bench_detection.py [--rounds 5] [--out benchmarks/results_detection_cpu.md]
"""

from __future__ import annotations

import importlib.util

import torch
import torchvision
from timing import against_inference, emit, interleaved_medians, ratio_table, rounds_and_out

import explain
from explain.targets import DetectionTarget

LAYER = "backbone.body.16"  # the backbone's last block: a plain (N, 960, h, w) map, which both libraries can hook


def main() -> None:
    args = rounds_and_out(__doc__)
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, box_score_thresh=0.0
    ).eval()
    x = torch.rand(1, 3, 480, 640)
    with torch.inference_mode():
        top = model(x)[0]
    box, label = top["boxes"][:1].clone(), [int(top["labels"][0])]

    explainer = explain.GradCAM(model, LAYER)
    runs = against_inference(model, x, lambda: explainer(x, DetectionTarget(box, label)))
    if importlib.util.find_spec("pytorch_grad_cam"):
        from pytorch_grad_cam import GradCAM as PGCGradCAM
        from pytorch_grad_cam.utils.model_targets import FasterRCNNBoxScoreTarget

        pgc = PGCGradCAM(model=model, target_layers=[model.get_submodule(LAYER)])
        target = FasterRCNNBoxScoreTarget(label, box)
        runs["pytorch-grad-cam GradCAM + FasterRCNNBoxScoreTarget"] = lambda: pgc(x, targets=[target])
    medians = interleaved_medians(runs, args.rounds)
    lines = [
        f"fasterrcnn_mobilenet_v3_large_fpn, random weights, one 480x640 image, layer `{LAYER}`, "
        f"torch {torch.__version__}, median of {args.rounds} interleaved rounds.",
        "",
        *ratio_table(medians),
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
