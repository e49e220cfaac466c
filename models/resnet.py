"""Built-in ``resnet``: a small residual CNN whose layers do not cost the same.

Layers: ``stem`` (3x3 convolution), then stages of residual blocks ``stage1.block0``, ...,
``stage2.block0``, ... where the first block of every stage after the first halves the
image side and doubles the channels, then ``head`` (global average pool + linear classifier).
Early layers work on large feature maps, downsampling blocks carry an extra projection, the
head is nearly free: the uneven costs where a uniform split of layers is a poor plan.

Normalisation is GroupNorm, not BatchNorm. BatchNorm normalises with statistics of the batch
it sees, so a pipeline that splits a batch into micro-batches would compute a different
function than the unsplit model; GroupNorm normalises each sample on its own.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .data import Classification
from .layered import AsTuple, LayeredModel

DEFAULTS: dict[str, Any] = {"blocks": [2, 2, 2], "width": 16, "image_size": 32, "num_classes": 10}
CHANNELS_IN = 3


def _norm(channels: int) -> nn.GroupNorm:
    # Up to 8 groups; a divisor of the channel count, as GroupNorm requires.
    return nn.GroupNorm(math.gcd(channels, 8), channels)


def _conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)


class Stem(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = _conv3x3(CHANNELS_IN, width)
        self.norm = _norm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


class BasicBlock(nn.Module):
    """relu(x + norm(conv(relu(norm(conv(x)))))), with a 1x1 projection of x when shapes change."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv3x3(c_in, c_out, stride)
        self.norm1 = _norm(c_out)
        self.conv2 = _conv3x3(c_out, c_out)
        self.norm2 = _norm(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


class Head(nn.Module):
    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


class ResNet(nn.Module):
    """Images (batch, 3, size, size) -> logits (batch, num_classes)."""

    def __init__(self, blocks: list[int], width: int, num_classes: int) -> None:
        super().__init__()
        self.stem = Stem(width)
        channels = width
        self.stages = nn.ModuleList()
        for s, count in enumerate(blocks):
            out = width * 2**s
            stage = nn.Sequential()
            for b in range(count):
                stride = 2 if (s > 0 and b == 0) else 1
                stage.append(BasicBlock(channels, out, stride))
                channels = out
            self.stages.append(stage)
        self.head = Head(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


def check_options(options: dict[str, Any]) -> None:
    blocks = options["blocks"]
    if not isinstance(blocks, list) or not blocks or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in blocks):
        raise ValueError(f"blocks must be a non-empty list of positive integers (blocks per stage), got {blocks!r}")
    for key in ("width", "image_size", "num_classes"):
        value = options[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if options["num_classes"] < 2:
        raise ValueError("num_classes must be at least 2")


def build(spec: dict[str, Any]) -> LayeredModel:
    o = spec["options"]
    model = ResNet(o["blocks"], o["width"], o["num_classes"])
    layers: list[tuple[str, nn.Module]] = [("stem", AsTuple(model.stem, spread=True))]
    for s, stage in enumerate(model.stages, start=1):
        layers += [(f"stage{s}.block{b}", AsTuple(block, spread=True)) for b, block in enumerate(stage)]
    layers.append(("head", AsTuple(model.head, spread=True)))
    data = Classification(shape=(CHANNELS_IN, o["image_size"], o["image_size"]), dtype=torch.float32,
                          num_classes=o["num_classes"])
    return LayeredModel(spec, model, layers, data)
