"""Small models for tests, the demo and the benchmarks. Each is a plain ``torch.nn.Module``."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["LeNet", "CNNBN", "MLP", "DigitsCNN"]


class LeNet(nn.Module):
    """LeNet-5 style CNN for [N, in_ch, 28, 28] images (uses ``x.view(x.size(0), -1)``)."""

    def __init__(self, in_ch: int = 1, num_classes: int = 10, image: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        side = ((image - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = x.view(x.size(0), -1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class CNNBN(nn.Module):
    """Conv-BatchNorm-ReLU blocks, global average pooling and a linear head, for [N, in_ch, H, W]."""

    def __init__(self, in_ch: int = 3, num_classes: int = 10, width: int = 16):
        super().__init__()
        # No conv bias before BatchNorm: its true gradient is exactly zero, and Adam turns float noise there into
        # full-size steps (in torch as in ONNX Runtime), so such biases cannot be compared tensor by tensor.
        self.conv1 = nn.Conv2d(in_ch, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


class MLP(nn.Module):
    """Flatten then three Linear layers (ReLU, Tanh)."""

    def __init__(self, in_features: int = 64, hidden: int = 64, num_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = torch.flatten(x, 1)
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


class DigitsCNN(nn.Module):
    """A small CNN with BatchNorm for scikit-learn's 8x8 digits ([N, 1, 8, 8], 10 classes): the demo's model."""

    def __init__(self, width: int = 16, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(2 * width * 4 * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))
        x = x.view(x.size(0), -1)
        return self.fc2(torch.relu(self.fc1(x)))
