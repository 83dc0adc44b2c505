"""Small models for 1x8x8 digit images (the `ncclavg train` demo and the tests).

Neither uses dropout or batch norm on purpose: every tower then computes a pure function of its weights
and its slice of the batch, so N towers reproduce single-tower full-batch training and a resumed run
reproduces the uninterrupted one bit for bit (no per-tower RNG streams or running statistics involved).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """conv3x3(c1) -> ReLU -> conv3x3(c2) -> ReLU -> maxpool2 -> fc(hidden) -> ReLU -> fc(classes).
    About 40k parameters with the defaults; reaches ~97-98% on the digits test split in a few epochs."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 8,
                 channels: Sequence[int] = (16, 32), hidden: int = 64):
        super().__init__()
        if image_size < 2 or image_size % 2:
            raise ValueError(f"image_size: must be an even number >= 2, got {image_size!r}")
        c1, c2 = (int(c) for c in channels)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        flat = c2 * (image_size // 2) ** 2
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(),
                                        nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class DigitsMLP(nn.Module):
    """Flatten -> [Linear -> ReLU] * len(hidden) -> Linear(classes)."""

    def __init__(self, num_classes: int = 10, in_features: int = 64, hidden: Sequence[int] = (128, 64)):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = int(in_features)
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            width = int(h)
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


MODELS = ("cnn", "mlp")


def build_model(name: str, input_shape: Sequence[int] = (1, 8, 8), num_classes: int = 10,
                seed: int | None = None) -> nn.Module:
    """'cnn' | 'mlp' for images of `input_shape` (C, H, W). With `seed`, the initial weights depend
    only on the seed (a private generator state, the global RNG is restored afterwards)."""
    if name not in MODELS:
        raise ValueError(f"model: unknown model {name!r}; choose one of {', '.join(MODELS)}")
    shape = tuple(int(s) for s in input_shape)

    def make() -> nn.Module:
        if name == "cnn":
            if len(shape) != 3 or shape[1] != shape[2]:
                raise ValueError(f"input_shape: the cnn needs square images (C, H, W), got {shape}")
            return DigitsCNN(num_classes=num_classes, in_channels=shape[0], image_size=shape[1])
        numel = 1
        for s in shape:
            numel *= s
        return DigitsMLP(num_classes=num_classes, in_features=numel)

    if seed is None:
        return make()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return make()
