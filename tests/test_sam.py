"""Promptable segmentation (SAM and SAM-HQ from tiny random configs): the prompt scaled onto SAM's resized image, the
image encoder's map against Grad-CAM of the mask's logits written out with hooks and autograd, brought back
through SAM's resize and padding (a one-hot cell lands on its own pixels), by IoU too, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import explain
from explain.core.maps import Canvas, upsample
from explain.errors import ExplainError, TargetError
from explain.models.sam import SamPrompted
from explain.targets import PromptMaskTarget

transformers = pytest.importorskip("transformers")
LAYER = "model.vision_encoder.neck"


def _sam(kind: str = "Sam") -> torch.nn.Module:
    """A tiny random SAM (``kind="Sam"``) or SAM-HQ (``"SamHQ"``, whose mask decoder also reads an early layer)."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")
    vision = getattr(transformers, f"{kind}VisionConfig")(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_dim=37, image_size=64, patch_size=8,
        output_channels=16, window_size=4, global_attn_indexes=[1], num_pos_feats=8,
    )  # fmt: skip
    prompt = getattr(transformers, f"{kind}PromptEncoderConfig")(
        hidden_size=16, image_size=64, patch_size=8, mask_input_channels=4
    )
    decoder = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, mlp_dim=32, iou_head_hidden_dim=16)
    decoder = getattr(transformers, f"{kind}MaskDecoderConfig")(
        **decoder, **({"vit_dim": 32} if kind == "SamHQ" else {})
    )
    config = config(vision_config=vision, prompt_encoder_config=prompt, mask_decoder_config=decoder)
    return getattr(transformers, f"{kind}Model")(config).eval()


def _image() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.rand(1, 3, 40, 60)  # resized to 43 x 64 and padded to 64 x 64


def test_the_prompt_is_scaled_onto_the_resized_image() -> None:
    sam = _sam()
    seen = {}
    handle = sam.prompt_encoder.register_forward_hook(
        lambda m, args, kwargs, out: seen.update(kwargs), with_kwargs=True
    )
    SamPrompted(sam, points=[(30.0, 20.0)], box=(6.0, 3.0, 45.0, 33.0))(_image())
    handle.remove()
    scale = torch.tensor([64 / 60, 43 / 40])
    torch.testing.assert_close(seen["input_points"][0, 0, 0], torch.tensor([30.0, 20.0]) * scale)
    torch.testing.assert_close(seen["input_boxes"][0, 0], torch.tensor([6.0, 3.0, 45.0, 33.0]) * scale.repeat(2))


@pytest.mark.parametrize(("kind", "by"), [("Sam", "mask"), ("Sam", "iou"), ("SamHQ", "mask")])
def test_the_image_encoders_map_is_grad_cam_of_the_masks_score(kind: str, by: str) -> None:
    prompted = SamPrompted(_sam(kind), points=[(30.0, 20.0)])
    x = _image()
    kept = {}
    handle = prompted.get_submodule(LAYER).register_forward_hook(lambda m, i, o: kept.update(a=o))
    out = prompted(x)
    handle.remove()
    masks, ious = out.pred_masks[:, 0], out.iou_scores[:, 0]
    best = int(ious[0].argmax())
    region = (masks[0, best] > 0).float()
    score = ious[0, best] if by == "iou" else (masks[0, best] * region).sum() / region.sum()
    (g,) = torch.autograd.grad(score, kept["a"])
    cam = (g.mean(dim=(2, 3), keepdim=True) * kept["a"]).sum(dim=1).clamp(min=0).detach()  # (1, 8, 8)
    expected = F.interpolate(cam[:, None], size=(64, 64), mode="bilinear", align_corners=False)[:, 0, :43, :64]

    flags = {name: p.requires_grad for name, p in prompted.named_parameters()}
    result = explain.GradCAM(prompted)(x, PromptMaskTarget(by=by), normalize=False)
    assert result.layer == LAYER and result.class_indices.tolist() == [best]
    assert result.target.names[best] == "mask"  # whichever mask: the export names its file for it
    assert result.raw.shape == (1, 43, 64) and expected.abs().max() > 0
    assert (result.raw - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert result.cams.shape == (1, 40, 60)
    assert {n: p.requires_grad for n, p in prompted.named_parameters()} == flags
    assert all(p.grad is None for p in prompted.parameters())


def test_a_cell_of_the_image_encoder_lands_on_its_own_pixels() -> None:
    """SAM's canvas: the image resized to 43 x 64 at the top left of 64 x 64; a cell of the 8 x 8 embedding
    covers canvas rows 8r..8r+8, input rows (8r) * 40 / 43."""
    boxed = SamPrompted(_sam(), box=(0, 0, 10, 10)).transform(_image())
    canvas = Canvas(tuple(boxed.tensors.shape[-2:]), boxed.image_sizes[0], boxed.offset)
    assert canvas == Canvas((64, 64), (43, 64))
    cell = torch.zeros(1, 8, 8)
    cell[0, 2, 5] = 1.0
    mapped = upsample(canvas.crop(cell), (40, 60))[0]
    rows, columns = (16 * 40 / 43, 24 * 40 / 43), (40 * 60 / 64, 48 * 60 / 64)
    peak = divmod(int(mapped.argmax()), 60)
    assert rows[0] - 1 <= peak[0] <= rows[1] and columns[0] - 1 <= peak[1] <= columns[1]


def test_prompts_and_masks_that_cannot_be_explained_name_the_way_out() -> None:
    with pytest.raises(ExplainError, match="needs a prompt"):
        SamPrompted(_sam())
    with pytest.raises(ExplainError, match="points must be"):
        SamPrompted(_sam(), points=[(1.0, 2.0, 3.0)])(_image())
    with pytest.raises(TargetError, match="mask 5 is out of range: the model drew 3 masks"):
        explain.GradCAM(SamPrompted(_sam(), points=[(30.0, 20.0)]))(_image(), PromptMaskTarget(mask=5))
    with pytest.raises(TargetError, match="pred_masks and iou_scores"):
        explain.GradCAM(torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3)), "0")(_image(), PromptMaskTarget())
