"""Backward passes over the window of a map a score reaches (explain.core.speedups.windows): the gradients plain
autograd
gives, the reach read from the module's own operations, and modules that are not local left to autograd."""

from __future__ import annotations

import pytest
import torch
from conftest import hook_count
from torch import nn

from explain.core.speedups.windows import reach, windowed_heads


class Branch(nn.Module):
    """A head branch: a dilated 3x3 conv, batch norm, SiLU, a residual add, a 5x5 depth-wise conv and a 1x1."""

    def __init__(self, channels: int = 4, spread: nn.Module | None = None) -> None:
        super().__init__()
        self.first = nn.Conv2d(channels, channels, 3, padding=2, dilation=2)
        self.norm = nn.BatchNorm2d(channels)
        self.depthwise = nn.Conv2d(channels, channels, 5, padding=2, groups=channels)
        self.last = nn.Conv2d(channels, 3, 1)
        self.spread = spread

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.silu(self.norm(self.first(x))) + x
        y = self.depthwise(y) * 0.5
        if self.spread is not None:
            y = self.spread(y)
        return self.last(y)


class Holder(nn.Module):
    """A model that declares its branch a local head, as a YOLO detector does."""

    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        self.branch = branch
        self.local_heads = [branch]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.branch(x)


def randomized(branch: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for module in branch.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2)
    return branch.eval().requires_grad_(False)


def input_gradient(model: nn.Module, x: torch.Tensor, upstream: torch.Tensor, windowed: bool) -> torch.Tensor | None:
    x = x.clone().requires_grad_(True)
    with windowed_heads(model) if windowed else torch.enable_grad():
        output = model(x)
    (found,) = torch.autograd.grad(output, x, upstream, allow_unused=True)
    return found


def test_the_reach_is_the_sum_of_the_half_kernels() -> None:
    assert reach(randomized(Branch()), torch.zeros(1, 4, 12, 12)) == (2 + 2, 2 + 2)  # dilated 3x3, then 5x5


@pytest.mark.parametrize(
    "cells",
    [
        [(0, 1, 6, 7)],  # one cell inside the map
        [(0, 0, 0, 0), (0, 2, 11, 11)],  # two far corners of one image: the window is the whole map
        [(1, 1, 0, 9), (2, 0, 5, 5)],  # one cell in each of two images, the first on the map's edge
    ],
    ids=["inside", "corners", "two-images"],
)
def test_gradients_equal_plain_autograd(cells) -> None:
    model = Holder(randomized(Branch()))
    x = torch.randn(3, 4, 12, 12)
    upstream = torch.zeros(3, 3, 12, 12)
    for image, channel, row, column in cells:
        upstream[image, channel, row, column] = torch.randn(())
    expected = input_gradient(model, x, upstream, windowed=False)
    windowed = input_gradient(model, x, upstream, windowed=True)
    assert expected.abs().max() > 0
    torch.testing.assert_close(windowed, expected, rtol=1e-5, atol=1e-6)
    assert hook_count(model) == 0


def test_a_window_the_gradient_does_not_reach_passes_none_on() -> None:
    model = Holder(randomized(Branch()))
    upstream = torch.zeros(2, 3, 12, 12)
    assert input_gradient(model, torch.randn(2, 4, 12, 12), upstream, windowed=True) is None


def test_a_one_dimensional_and_a_three_dimensional_branch() -> None:
    torch.manual_seed(0)
    for conv, shape in ((nn.Conv1d, (2, 3, 20)), (nn.Conv3d, (2, 3, 6, 8, 8))):
        branch = nn.Sequential(conv(3, 3, 3, padding=1), nn.ReLU(), conv(3, 2, 3, padding=1))
        model = Holder(branch.requires_grad_(False))
        assert reach(model.branch, torch.zeros(shape)) == (2,) * (len(shape) - 2)
        upstream = torch.zeros(2, 2, *shape[2:])
        upstream[(1, 0, *(s // 2 for s in shape[2:]))] = 1.0
        x = torch.randn(shape)
        expected = input_gradient(model, x, upstream, windowed=False)
        torch.testing.assert_close(input_gradient(model, x, upstream, windowed=True), expected)


class Positional(nn.Module):
    """Adds a parameter that differs at every position: cropping the input would misplace it."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, 4, 12, 12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table


class Scaled(nn.Module):
    """Multiplies by a per-channel constant, the same at every position: still local."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.linspace(0.5, 1.5, 4).view(1, -1, 1, 1)


class SizedPadding(nn.Module):
    """A convolution whose padding is computed from the input's size: the size it keeps here, a crop would not."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.conv2d(x, self.conv.weight, self.conv.bias, padding=1 if x.shape[-1] > 6 else 0)


@pytest.mark.parametrize(
    "spread",
    [
        nn.AdaptiveAvgPool2d(1),  # every position reads the whole map
        nn.Conv2d(4, 4, 3, stride=2, padding=1),  # a stride: the output is another grid
        nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"),  # the map's edges are not zeros
        nn.Conv2d(4, 4, 3),  # no padding: the output is smaller
        nn.GroupNorm(2, 4),  # statistics over the whole map
        Positional(),
        SizedPadding(),
    ],
    ids=["pool", "stride", "reflect", "unpadded", "group-norm", "positional", "sized-padding"],
)
def test_a_module_that_is_not_local_is_left_to_autograd(spread) -> None:
    branch = randomized(Branch(spread=spread))
    x = torch.randn(2, 4, 12, 12)
    assert reach(branch, x) is None
    model = Holder(branch)
    upstream = torch.zeros_like(model(x))
    upstream.view(-1)[4] = 1.0
    expected = input_gradient(model, x, upstream, windowed=False)
    torch.testing.assert_close(input_gradient(model, x, upstream, windowed=True), expected)


def test_a_constant_spread_over_space_and_a_training_batch_norm() -> None:
    assert reach(randomized(Branch(spread=Scaled())), torch.zeros(1, 4, 12, 12)) == (4, 4)
    branch = Branch().train()  # batch statistics: every position reads the whole batch
    assert reach(branch, torch.zeros(2, 4, 12, 12)) is None
    assert reach(branch.eval(), torch.zeros(2, 4, 12, 12)) == (4, 4)  # traced again for the other flags


def test_a_pooling_of_stride_one_that_keeps_the_size_is_local() -> None:
    """A max pooling of stride one, padded to keep the map's size (as YOLO's SPPF pools), adds its half kernel to
    the reach; the windowed gradients are still plain autograd's, at a cell by the map's edge too."""
    branch = randomized(Branch(spread=nn.MaxPool2d(5, stride=1, padding=2)))
    x = torch.randn(2, 4, 12, 12)
    assert reach(branch, x) == (2 + 2 + 2, 2 + 2 + 2)
    model = Holder(branch)
    for cell in ((0, 5, 6), (1, 11, 0)):
        upstream = torch.zeros_like(model(x))
        upstream[(cell[0], 1, *cell[1:])] = 1.0
        expected = input_gradient(model, x, upstream, windowed=False)
        torch.testing.assert_close(input_gradient(model, x, upstream, windowed=True), expected)
