"""EfficientNet-Lite0, the bundled model, in plain ``torch.nn``: building it imports neither torchvision nor timm.

EfficientNet (Tan & Le, "EfficientNet: Rethinking Model Scaling for Convolutional Neural
Networks", ICML 2019) in its Lite form for edge devices: no squeeze-and-excitation, ReLU6
activations, stem and head not scaled. Module names follow timm's ``tf_efficientnet_lite0``
(``conv_stem``, ``bn1``, ``blocks.S.I.conv_dw``, ``conv_head``, ``bn2``, ``classifier``), so a
state_dict loads into either and a layer name (``bn2``, ``blocks.6``) means the same in both;
the tests check that both give the same outputs. Convolutions with stride 2 pad the way
TensorFlow's ``"SAME"`` does, as the weights were trained: the output side is
ceil(input / stride), and an odd padding puts its extra pixel at the bottom and right.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from ..core.speedups.folding import norm_with_activation

# Per stage: expansion ratio, kernel size, stride of its first block, output channels, blocks.
STAGES = (
    (1, 3, 1, 16, 1),
    (6, 3, 2, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
)
STEM_CHANNELS, HEAD_CHANNELS = 32, 1280
BN_EPS = 1e-3
DROPOUT = 0.2


class SameConv2d(nn.Conv2d):
    """A convolution padded like TensorFlow's ``"SAME"``: output side ceil(input / stride)."""

    def forward(self, x: Tensor) -> Tensor:
        pads: list[int] = []
        for size, kernel, stride in zip(x.shape[:1:-1], self.kernel_size[::-1], self.stride[::-1]):  # width first
            total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
            pads += [total // 2, total - total // 2]
        return super().forward(F.pad(x, pads))


def conv(channels_in: int, channels_out: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    """A bias-free convolution: symmetric padding at stride 1, TensorFlow's ``"SAME"`` padding otherwise."""
    if stride == 1:
        return nn.Conv2d(channels_in, channels_out, kernel, padding=kernel // 2, groups=groups, bias=False)
    return SameConv2d(channels_in, channels_out, kernel, stride, groups=groups, bias=False)


@norm_with_activation
class BatchNormAct2d(nn.BatchNorm2d):
    """Batch normalization and then ReLU6 (or nothing) as one module, whose output is the activated map."""

    def __init__(self, channels: int, act: bool = True) -> None:
        super().__init__(channels, eps=BN_EPS)
        self.act = nn.ReLU6(inplace=True) if act else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(super().forward(x))


class DepthwiseSeparableConv(nn.Module):
    """The first stage's block: depthwise conv, ReLU6, pointwise projection (no activation)."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv_dw = conv(channels_in, channels_in, kernel, stride, groups=channels_in)
        self.bn1 = BatchNormAct2d(channels_in)
        self.conv_pw = conv(channels_in, channels_out, 1)
        self.bn2 = BatchNormAct2d(channels_out, act=False)
        self.residual = stride == 1 and channels_in == channels_out

    def forward(self, x: Tensor) -> Tensor:
        y = self.bn2(self.conv_pw(self.bn1(self.conv_dw(x))))
        return x + y if self.residual else y


class InvertedResidual(nn.Module):
    """MobileNetV2's block: pointwise expansion, depthwise conv (both ReLU6), linear projection."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = channels_in * expansion
        self.conv_pw = conv(channels_in, hidden, 1)
        self.bn1 = BatchNormAct2d(hidden)
        self.conv_dw = conv(hidden, hidden, kernel, stride, groups=hidden)
        self.bn2 = BatchNormAct2d(hidden)
        self.conv_pwl = conv(hidden, channels_out, 1)
        self.bn3 = BatchNormAct2d(channels_out, act=False)
        self.residual = stride == 1 and channels_in == channels_out

    def forward(self, x: Tensor) -> Tensor:
        y = self.bn3(self.conv_pwl(self.bn2(self.conv_dw(self.bn1(self.conv_pw(x))))))
        return x + y if self.residual else y


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0: 224x224 inputs normalized with mean 0.5 and std 0.5; any input size works."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv_stem = conv(3, STEM_CHANNELS, 3, stride=2)
        self.bn1 = BatchNormAct2d(STEM_CHANNELS)
        stages, channels = [], STEM_CHANNELS
        for expansion, kernel, stride, channels_out, count in STAGES:
            blocks: list[nn.Module] = []
            for index in range(count):
                step = stride if index == 0 else 1
                if expansion == 1:
                    blocks.append(DepthwiseSeparableConv(channels, channels_out, kernel, step))
                else:
                    blocks.append(InvertedResidual(channels, channels_out, kernel, step, expansion))
                channels = channels_out
            stages.append(nn.Sequential(*blocks))
        self.blocks = nn.Sequential(*stages)
        self.conv_head = conv(channels, HEAD_CHANNELS, 1)
        self.bn2 = BatchNormAct2d(HEAD_CHANNELS)
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(DROPOUT)
        self.classifier = nn.Linear(HEAD_CHANNELS, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        features = self.bn2(self.conv_head(self.blocks(self.bn1(self.conv_stem(x)))))
        return self.classifier(self.dropout(self.global_pool(features).flatten(1)))
