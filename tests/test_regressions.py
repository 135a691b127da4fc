"""Models that once trained wrongly when fused (or crashed), each checked against torch at B = 1, 2, 3: the forward
pass, 3 SGD-momentum steps (every split tensor < 1e-4, BatchNorm statistics < 1e-5) and 3 AdamW steps (outputs of
the split model < 1e-3), with per-model learning rates (fuzz/harness.py). The first two are the reproductions of the
correctness issue; the rest are minimal models the fuzzer found (``make fuzz``), each with its cause."""
from __future__ import annotations

import pytest

import torch

from fuzz.grammar import Rendered
from fuzz.harness import check_source, module_class

HEADER = "import math\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n"

# (source, input shape per sample, loss); every class is called FuzzNet
CASES = {
    # onnxruntime-training's ConvGrad zeroed memory past the input gradient of a grouped 1-D convolution: fc.weight's
    # gradient, placed there, came out 0 and fc.weight never moved (B >= 2; legalize/conv.py)
    "conv1d_mean_linear": ("""
class FuzzNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Conv1d(3, 16, 1)
        self.c1 = nn.Conv1d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(F.relu(self.c1(self.inp(x))).mean(2))
""", (3, 64), "cross-entropy"),
    # the same kernel bug in a TCN: updates 25-30 % off below the last convolution for models 0 and 1 of 3
    "tcn": ("""
class FuzzNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(1, 24, 3, padding=1)
        self.block1 = nn.Conv1d(24, 24, 3, padding=2, dilation=2)
        self.block2 = nn.Conv1d(24, 24, 3, padding=4, dilation=4)
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        x = self.stem(x.flatten(2))  # an 8x8 image as a sequence of 64
        x = x + F.relu(self.block1(x))
        x = x + F.relu(self.block2(x))
        return self.head(x.amax(2))
""", (1, 8, 8), "cross-entropy"),
    # ConvGrad reads only `pads`: padding='same' (auto_pad SAME_UPPER) trained as if unpadded; and ORT's CPU Conv
    # refuses SAME_* with dilation at all (onnxfuse/windows.py makes the pads explicit)
    "conv_same_dilated": ("""
class FuzzNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(4, 8, 3, padding='same', dilation=2)
        self.d = nn.Conv1d(8, 8, 4, padding='same', groups=2)

    def forward(self, x):
        return self.d(self.c(x).flatten(2))
""", (4, 6, 6), "mse"),
    # AveragePoolGrad sized its output from declared shapes (a symbolic batch read as 0): a floating point exception
    # in the train step; with ceil_mode, ORT's pools also counted one window more than torch (legalize/pool.py)
    "avg_and_max_pool_ceil": ("""
class FuzzNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv1d(6, 8, 1)
        self.avg = nn.AvgPool1d(2, stride=2, padding=1, ceil_mode=True, count_include_pad=True)
        self.max = nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True)
        self.head = nn.Linear(25, 7)

    def forward(self, x):
        x = self.avg(self.c(x))
        return self.head(self.max(x.unsqueeze(1)).flatten(2))
""", (6, 16), "mse"),
    # MaxPoolGrad sized its output from the graph's declared shapes, where a GroupNorm's computed Reshape left the
    # channel count unknown (read as 0): the train step failed (training/artifacts.py static_shapes_pass)
    "groupnorm_maxpool": ("""
class FuzzNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.n = nn.GroupNorm(2, 8)
        self.p = nn.MaxPool2d(3, stride=1, padding=1)

    def forward(self, x):
        return self.p(self.n(x))
""", (8, 6, 6), "mse"),
    # PRelu broadcasts its slope to x only: a shared x next to a per-model slope was declared [N, ...] for a
    # per-model value and ORT reused a buffer of the wrong size (rules/elementwise.py)
    "shared_prelu": ("""
class FuzzNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.PReLU(2, init=0.2)
        self.l = nn.Linear(32, 16)

    def forward(self, x):
        return self.l(F.mish(self.p(x + F.elu(x))))
""", (2, 32), "mse"),
    # Pad in reflect/replicate mode has no gradient builder in ORT (legalize/pad.py)
    "reflect_replicate_pad": ("""
class FuzzNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1, padding_mode='reflect')
        self.d = nn.Conv1d(4, 4, 3, padding=2, padding_mode='replicate')

    def forward(self, x):
        return self.d(F.pad(self.c(x), [1, 2, 0, 1], mode='replicate').flatten(2))
""", (3, 5, 5), "mse"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_regression_trains_like_torch(name):
    source, in_shape, loss = CASES[name]
    source = HEADER + source.lstrip("\n")
    with torch.no_grad():
        out_shape = tuple(module_class(source)()(torch.randn(2, *in_shape)).shape[1:])
    r = Rendered(source, in_shape, "float", out_shape, loss, 1, out_shape[0] if loss == "cross-entropy" else 0)
    out = check_source(r, seed=3)
    assert out.status == "pass", (out.status, out.B, out.stage, out.message)
