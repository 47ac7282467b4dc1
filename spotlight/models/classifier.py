"""Small CNN digit classifiers: the training reward, and an independently trained held-out judge."""

from __future__ import annotations

import torch
from torch import nn


class DigitClassifier(nn.Module):
    """[B,1,16,16] in [-1,1] -> class probabilities [B,10]. ``width`` varies the architecture."""

    def __init__(self, width: int = 32, num_classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1, stride=2), nn.GELU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.GELU(),
            nn.Flatten(), nn.Linear(2 * width * 16, num_classes),
        )

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.logits(images).softmax(dim=-1)
