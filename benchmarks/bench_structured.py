"""Structured outputs: one keypoint's map, one oriented box's, one depth region's and one SAM prompt's, against
the model's own inference forward and against their limit; and all 17 keypoints of a detection in one call
against 17 calls.

Models (random weights, as no weights are downloaded here; their sizes are the small checkpoints' own):

- **keypoint**: Ultralytics' yolo11n-pose from its yaml (the ``yolo`` extra; its finest level's class biases
  raised so that it detects), one 480x640 image, ``KeypointTarget("left_wrist")`` of the top detection, at the
  automatic layers (the three neck levels the head reads, fused);
- **oriented box**: yolo11n-obb from its yaml, likewise, one 640x640 image, ``OrientedDetectionTarget`` of the top
  rotated box (matched by rotated IoU in every pass), at the automatic layers;
- **region**: a DPT of ViT-S size (6 layers of 384, 16-pixel patches) on a 384x384 image, the mean depth over a
  box (``RegionTarget``), at its last fusion stage;
- **SAM prompt**: a SAM of ViT-Tiny size (1024 input, 16-pixel patches, 4 layers of 192) with a point prompt on
  a 480x640 image (``SamPrompted``), the mask's mean logit (``PromptMaskTarget``), at the image encoder's neck.

Contenders per model, rounds interleaved, medians: the plain inference forward; ``explain`` Grad-CAM; the limit,
the same forward with autograd and the backward of the same score down to the explained layer(s), written here
with hooks and ``torch.autograd.grad``. Target: explain at most 1.15x its limit. DPT's dense head makes the limit
itself well above the forward (its backward runs through the head's upsampling at the input's resolution).

    python benchmarks/bench_structured.py [--rounds 5] [--out benchmarks/results_structured_cpu.md]
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers
from bench_yolo import detecting
from timing import emit, interleaved_medians, rounds_and_out

import explain
from explain.models.sam import SamPrompted
from explain.targets import (
    KeypointTarget,
    OrientedDetectionTarget,
    PromptMaskTarget,
    RegionTarget,
    box_iou,
    rotated_iou,
)

os.environ.setdefault("YOLO_CONFIG_DIR", "/tmp/explain-bench-ultralytics")


def limit(model: torch.nn.Module, x: torch.Tensor, layers: Sequence[str], score: Callable[[Any], torch.Tensor]):
    """The forward with autograd and the score's backward down to ``layers``, with plain hooks."""
    kept: dict[str, torch.Tensor] = {}
    handles = [
        model.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: kept.update({name: o}))
        for name in layers
    ]
    try:
        output = model(x)
    finally:
        for handle in handles:
            handle.remove()
    return torch.autograd.grad(score(output), [kept[name] for name in layers], allow_unused=True)


def pose_case() -> tuple[str, torch.nn.Module, torch.Tensor, Any, Sequence[str], Callable[[Any], torch.Tensor]]:
    model, x, found = detecting("yolo11n-pose.yaml", (480, 640))
    box, label = found["boxes"][:1].clone(), [int(found["labels"][0])]
    target = KeypointTarget("left_wrist", boxes=box, labels=label)

    def score(output: Any) -> torch.Tensor:
        match = box_iou(box, output[0]["boxes"].detach())[0].argmax()
        return output[0]["keypoints_scores"][match, 9]

    return "keypoint (yolo11n-pose)", model, x, target, model.feature_levels, score


def oriented_case() -> tuple[str, torch.nn.Module, torch.Tensor, Any, Sequence[str], Callable[[Any], torch.Tensor]]:
    model, x, found = detecting("yolo11n-obb.yaml", (640, 640))
    rbox, label = found["rboxes"][:1].clone(), [int(found["labels"][0])]
    target = OrientedDetectionTarget(rbox, label)

    def score(output: Any) -> torch.Tensor:
        match = rotated_iou(rbox, output[0]["rboxes"].detach())[0].argmax()
        return output[0]["scores"][match]

    return "oriented box (yolo11n-obb)", model, x, target, model.feature_levels, score


def depth_case() -> tuple[str, torch.nn.Module, torch.Tensor, Any, Sequence[str], Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    config = transformers.DPTConfig(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536, image_size=384,
        patch_size=16, neck_hidden_sizes=[48, 96, 192, 384], fusion_hidden_size=64, backbone_out_indices=[1, 2, 4, 5],
    )  # fmt: skip
    model = transformers.DPTForDepthEstimation(config).eval()
    x = torch.randn(1, 3, 384, 384)
    target = RegionTarget(box=(96, 128, 256, 320), size=(384, 384))

    def score(output: Any) -> torch.Tensor:
        depth = output.predicted_depth
        scale = depth.shape[-1] / 384
        return depth[:, round(128 * scale) : round(320 * scale), round(96 * scale) : round(256 * scale)].mean()

    return "region (DPT, ViT-S size)", model, x, target, ["neck.fusion_stage.layers.3"], score


def sam_case() -> tuple[str, torch.nn.Module, torch.Tensor, Any, Sequence[str], Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    vision = transformers.SamVisionConfig(
        hidden_size=192, num_hidden_layers=4, num_attention_heads=3, mlp_dim=768, image_size=1024, patch_size=16,
        output_channels=64, window_size=14, global_attn_indexes=[1, 3], num_pos_feats=32,
    )  # fmt: skip
    prompt = transformers.SamPromptEncoderConfig(hidden_size=64, image_size=1024, patch_size=16)
    decoder = transformers.SamMaskDecoderConfig(hidden_size=64, num_attention_heads=2, mlp_dim=256,
                                                iou_head_hidden_dim=64)  # fmt: skip
    sam = transformers.SamModel(transformers.SamConfig(vision_config=vision, prompt_encoder_config=prompt,
                                                       mask_decoder_config=decoder)).eval()  # fmt: skip
    model = SamPrompted(sam, points=[(320.0, 240.0)])
    x = torch.rand(1, 3, 480, 640)
    with torch.no_grad():
        out = model(x)
    best = int(out.iou_scores[0, 0].argmax())
    region = (out.pred_masks[0, 0, best] > 0).float()
    if not region.any():
        region = torch.ones_like(region)  # a random SAM may draw nothing: its whole grid then
    target = PromptMaskTarget(by="mask" if bool((out.pred_masks[0, 0, best] > 0).any()) else "iou")

    def score(output: Any) -> torch.Tensor:
        if target.by == "iou":
            return output.iou_scores[0, 0, best]
        return (output.pred_masks[0, 0, best] * region).sum() / region.sum()

    return "SAM prompt (ViT-Tiny size)", model, x, target, model.feature_levels, score


def one_case(rounds: int, case: tuple) -> tuple[str, dict[str, float], str]:
    name, model, x, target, layers, score = case
    explainer = explain.GradCAM(model, list(layers))

    def inference() -> object:
        with torch.inference_mode():
            return model(x)

    found = interleaved_medians(
        {
            "forward": inference,
            "explain": lambda: explainer(x, target),
            "limit": lambda: limit(model, x, layers, score),
        },
        rounds,
    )
    return name, found, "+".join(layers)


def keypoints_together(rounds: int) -> dict[str, float]:
    """All 17 keypoints of the top detection: one call with K = 17, against 17 calls of one keypoint."""
    _, model, x, _, layers, _ = pose_case()
    with torch.inference_mode():
        (found,) = model(x)
    box, label = found["boxes"][:1].clone(), [int(found["labels"][0])]
    explainer = explain.GradCAM(model, list(layers))
    every = KeypointTarget(boxes=box, labels=label)
    singles = [KeypointTarget(k, boxes=box, labels=label) for k in range(17)]
    return interleaved_medians(
        {"one call, K = 17": lambda: explainer(x, every), "17 calls": lambda: [explainer(x, t) for t in singles]},
        rounds,
    )


def main() -> None:
    args = rounds_and_out(__doc__)
    lines = [
        "| output | inference forward (ms) | explain (ms) | limit (ms) | explain / forward | explain / limit | "
        "limit / forward |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    layers_used = []
    for case in (pose_case(), oriented_case(), depth_case(), sam_case()):
        name, found, layers = one_case(args.rounds, case)
        forward, ours, bound = found["forward"], found["explain"], found["limit"]
        lines.append(
            f"| {name} | {1000 * forward:.1f} | {1000 * ours:.1f} | {1000 * bound:.1f} | {ours / forward:.2f} | "
            f"{ours / bound:.2f} | {bound / forward:.2f} |"
        )
        layers_used.append(f"{name}: `{layers}`")
        print(lines[-1], flush=True)
    together = keypoints_together(args.rounds)
    one, many = together["one call, K = 17"], together["17 calls"]
    lines += [
        "",
        f"All 17 keypoints of a detection: one call {1000 * one:.0f} ms, 17 calls {1000 * many:.0f} ms "
        f"({one / many:.2f}x).",
        "",
        f"Layers: {'; '.join(layers_used)}. Medians of {args.rounds} interleaved rounds, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}.",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
