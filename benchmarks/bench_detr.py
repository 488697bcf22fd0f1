"""Grad-CAM of one DETR detection (an object query) against the detector's plain inference forward.

HuggingFace ``DetrForObjectDetection`` at the size of facebook/detr-resnet-50 (a ResNet-50 backbone, d_model 256,
six encoder and six decoder layers, 100 queries), random weights, on one 480x640 image, wrapped in
``explain.models.QueryDetector``; the explained detection is the top query of a plain forward. Contenders, rounds
interleaved, medians reported: a plain inference forward of the wrapped model; ``explain`` Grad-CAM with a
``DetectionTarget`` of that box at the automatic layer (the encoder's map). No peer gives gradient maps for DETR.
Target: explain costs at most 1.15x the inference forward.

    python benchmarks/bench_detr.py [--rounds 5] [--out benchmarks/results_detr_cpu.md]
"""

from __future__ import annotations

import torch
import transformers
from timing import against_inference, emit, interleaved_medians, ratio_table, rounds_and_out

import explain
from explain.models import QueryDetector
from explain.targets import DetectionTarget


def detr_resnet50() -> torch.nn.Module:
    """DETR at facebook/detr-resnet-50's size, with random weights (no download)."""
    config = transformers.DetrConfig(
        use_timm_backbone=False,
        backbone_config=transformers.ResNetConfig(out_features=["stage4"]),
        use_pretrained_backbone=False,
        num_labels=91,
    )
    return transformers.DetrForObjectDetection(config).eval()


def main() -> None:
    args = rounds_and_out(__doc__)
    torch.manual_seed(0)
    model = QueryDetector(detr_resnet50()).eval()
    x = torch.rand(1, 3, 480, 640)
    with torch.inference_mode():
        (found,) = model(x)
    top = int(found["scores"].argmax())
    target = DetectionTarget(found["boxes"][top : top + 1].clone(), [int(found["labels"][top])])

    explainer = explain.GradCAM(model)  # its one-time trace and probe run in the warm-up round
    medians = interleaved_medians(against_inference(model, x, lambda: explainer(x, target)), args.rounds)
    lines = [
        f"DETR (ResNet-50, 6+6 layers, 100 queries), random weights, one 480x640 image, automatic layer "
        f"`{explainer.layer}`, torch {torch.__version__}, median of {args.rounds} interleaved rounds.",
        "",
        *ratio_table(medians),
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
