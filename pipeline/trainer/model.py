"""The model family Tracks trains on the digits data: a small CNN for 8x8 images."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MODEL_FAMILY = "digits-cnn"
NUM_CLASSES = 10
IMAGE_SIDE = 8


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and a linear head; input is ``[N, 1, 8, 8]`` scaled to [0, 1]."""

    def __init__(self, channels: int = 16, hidden: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, channels * 2, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * 2 * (IMAGE_SIDE // 2) ** 2, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, NUM_CLASSES),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def build_model(model_config: dict[str, Any]) -> DigitsCNN:
    """Build the model from the ``model`` section of a training config."""
    return DigitsCNN(
        channels=int(model_config.get("channels", 16)),
        hidden=int(model_config.get("hidden", 64)),
        dropout=float(model_config.get("dropout", 0.0)),
    )
