"""Layouts read during a call's own forward (explain/core/watch.py) against the full trace's: for every layer of
several families, the watch either agrees with the trace or tells nothing (and the trace is run). On a batch of
several images it never lays out tokens: Hiera's unrolled tokens, moved across the batch axis, would keep the
mark of a grid they no longer follow. The trace's map shape of each layer is its layout's of the layer's output."""

from __future__ import annotations

import re

import pytest
import torch
import torchvision

import explain
from explain.core import layers
from explain.core.layouts import Geometry, find_layout, grids_recorded
from explain.core.watch import PassWatch

timm = pytest.importorskip("timm")

FAMILIES = {
    "vit": lambda: timm.create_model("vit_tiny_patch16_224", img_size=64, depth=2, num_classes=5),
    "swin": lambda: timm.create_model(
        "swin_tiny_patch4_window7_224", img_size=112, window_size=7, depths=(1, 1, 1, 1), num_classes=5
    ),
    "hiera": lambda: timm.create_model("hiera_tiny_224", img_size=64, num_classes=5),
    "levit": lambda: timm.create_model("levit_128s", img_size=64, num_classes=5),
    "resnet18": lambda: torchvision.models.resnet18(num_classes=5),
}


def watched(model: torch.nn.Module, x: torch.Tensor, names: list[str]) -> tuple[PassWatch, dict, Geometry]:
    """A forward of x under the watch, with each named layer's output."""
    watch = PassWatch(model, x, names)
    outputs = {}
    handles = [
        module.register_forward_hook(lambda module, args, output, name=name: outputs.setdefault(name, output))
        for name, module in model.named_modules()
        if name in names
    ]
    try:
        with torch.no_grad(), grids_recorded(model) as grids, watch.watching():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return watch, outputs, Geometry(tuple(x.shape[2:]), grids[-1] if grids else None)


@pytest.mark.parametrize("images", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_watch_agrees_with_the_trace_or_tells_nothing(family: str, images: int) -> None:
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    side = 112 if family == "swin" else 64
    x = torch.randn(images, 3, side, side)
    infos = layers.trace_layers(model, x, content=False)
    names = [info.name for info in infos if info.shape is not None and ":" not in info.name]
    watch, outputs, geometry = watched(model, x, names)
    told = 0
    for info in infos:
        output = outputs.get(info.name)
        if not isinstance(output, torch.Tensor):
            continue
        if info.layout is not None:  # the trace's map shape, told from the output's shape: the layout's own
            assert tuple(info.layout(output).shape[1:]) == info.map_shape, info.name
        found = watch.layout(info.name, output, geometry)
        if found is not None:
            told += 1
            assert found == info.layout, info.name
            assert images == 1 or found.kind != "tokens", info.name
    assert told > 0


class SpatialAttention(torch.nn.Module):
    """A CNN's attention over positions: a softmax over each channel's positions weighs its convolution's map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mapped = self.conv(x)
        weights = mapped.flatten(2).softmax(dim=-1).view_as(mapped)
        return x + weights * mapped


def attentive_cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), SpatialAttention(), torch.nn.Conv2d(8, 8, 3, stride=2),
        torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU()), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(8, 5),
    ).eval()  # fmt: skip


@pytest.mark.parametrize("family", ["resnet18", "mobilenet_v3_small", "attentive"])
def test_a_narrow_watch_tells_each_layer_of_a_cnn_what_the_whole_watch_tells(family: str) -> None:
    """The ``narrow_watch`` speedup on a convolutional network (no patch embedding, layer norm or attention module):
    watching a layer hooks it, the modules around it and their children, and tells its layout, or refuses it (a
    layer inside a module that computes attention), as the watch of every module does."""
    from explain.core.speedups.narrow_watch import watched_modules

    model = attentive_cnn() if family == "attentive" else torchvision.models.get_model(family, num_classes=5).eval()
    x = torch.randn(1, 3, 64, 64)
    names = [name for name, _ in model.named_modules() if name]
    whole, outputs, geometry = watched(model, x, names)
    told, refused = 0, 0
    for name in names:
        hooked = watched_modules(model, [name])
        assert hooked is not None and name in hooked and len(hooked) < len(names)
        narrow = PassWatch(model, x, [name], hooked)
        with torch.no_grad(), narrow.watching():
            model(x)
        output = outputs.get(name)
        if not isinstance(output, torch.Tensor) or output.dim() != 4:
            continue
        try:
            expected = find_layout(model, name, output.shape[1:], geometry, whole.observed)
        except explain.LayerError as error:
            with pytest.raises(explain.LayerError, match=re.escape(str(error))):
                find_layout(model, name, output.shape[1:], geometry, narrow.observed)
            refused += 1
            continue
        assert narrow.layout(name, output, geometry) == expected == whole.layout(name, output, geometry), name
        told += 1
    assert told > 5 and (refused > 0) == (family == "attentive")  # the attention module's own conv is refused


def test_a_model_that_may_make_tokens_is_watched_whole() -> None:
    from explain.core.speedups.narrow_watch import watched_modules

    for name, model in FAMILIES.items():
        if name != "resnet18":
            assert watched_modules(model(), ["head"]) is None, name
