"""Small CPU-friendly models for demos, tests and tiny datasets.

Both are deterministic on CPU under `torch.use_deterministic_algorithms(True)` (only conv,
batch norm, ReLU, max pool, adaptive average pool and linear layers) and accept any input
size of at least 8×8, because global pooling sits in front of the classifier. The classifier
is always the last `nn.Linear`, named `fc`, which is how pretrained loading finds the head.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from visionloop.models.registry import ModelDefaults, register_model

# Small native models are trained from scratch, mostly on small images: no crop at eval time
# (crop_pct=1.0) because a 32-pixel digit has no border to spare, and mean/std of 0.5 map
# [0, 1] pixels to [-1, 1]. A trainer may override them with the dataset's channel stats.
_SMALL_DEFAULTS = ModelDefaults(
    input_size=(3, 32, 32), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_pct=1.0, interpolation="bilinear"
)


def _conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    # bias=False: batch norm's shift makes a conv bias redundant.
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    """conv-BN-ReLU blocks, max-pooling after all but the last, global pooling, linear head.

    With the default widths (24, 48, 96, 128) it has ~165k parameters and costs ~8 MMACs per
    32×32 image: two epochs over scikit-learn digits take seconds on two CPU cores.
    """

    def __init__(
        self,
        num_classes: int,
        *,
        in_chans: int = 3,
        widths: Sequence[int] = (24, 48, 96, 128),
        drop_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if not widths:
            raise ValueError("widths needs at least one entry, e.g. (32, 64, 128)")
        layers: list[nn.Module] = []
        cin = in_chans
        for i, cout in enumerate(widths):
            layers.append(_conv_bn_relu(cin, cout))
            if i < len(widths) - 1:
                layers.append(nn.MaxPool2d(2))
            cin = cout
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(drop_rate)
        self.fc = nn.Linear(cin, num_classes)
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x)).flatten(1)
        out: torch.Tensor = self.fc(self.drop(x))
        return out


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv_bn_relu(cin, cout, stride)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.relu(self.bn2(self.conv2(self.conv1(x))) + self.shortcut(x))
        return out


class TinyResNet(nn.Module):
    """A CIFAR-style ResNet: a 3×3 stem, one basic block per stage, global pooling, linear head.

    With the default widths (16, 32, 64, 128) it has ~310k parameters; (16, 32, 64) ~78k.
    """

    def __init__(
        self,
        num_classes: int,
        *,
        in_chans: int = 3,
        widths: Sequence[int] = (16, 32, 64, 128),
        blocks_per_stage: int = 1,
        drop_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if not widths or blocks_per_stage < 1:
            raise ValueError("widths needs at least one entry and blocks_per_stage must be >= 1")
        self.stem = _conv_bn_relu(in_chans, widths[0])
        stages: list[nn.Module] = []
        cin = widths[0]
        for i, cout in enumerate(widths):
            for j in range(blocks_per_stage):
                stages.append(_BasicBlock(cin, cout, stride=2 if i > 0 and j == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(drop_rate)
        self.fc = nn.Linear(cin, num_classes)
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stages(self.stem(x))).flatten(1)
        out: torch.Tensor = self.fc(self.drop(x))
        return out


@register_model("small_cnn", defaults=_SMALL_DEFAULTS)
def small_cnn(num_classes: int, **kwargs: Any) -> nn.Module:
    """The demo's model: ~165k parameters, ≥97% on scikit-learn digits in two CPU epochs."""
    return SmallCNN(num_classes, **kwargs)


@register_model("tiny_resnet", defaults=_SMALL_DEFAULTS)
def tiny_resnet(num_classes: int, **kwargs: Any) -> nn.Module:
    """A residual baseline for 32-128 px images; a step up from small_cnn, still CPU-friendly."""
    return TinyResNet(num_classes, **kwargs)
