"""Recurrent nets (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``; uni- and bidirectional, batch_first, initial states): each
fused at B = 1, 2, 3 and trained on both runtimes, against torch.optim on each model alone, with the differential
fuzzer's checks and bounds (``fuzz/harness.py``: the forward, 3 SGD-momentum steps, 3 AdamW steps)."""
from __future__ import annotations

import pytest

from fuzz.grammar import Rendered
from fuzz.harness import check_source

HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n"

NETS = {  # name: (layer, how the classifier reads it)
    "lstm": ("nn.LSTM(8, 12, batch_first=True)", "y, (h, c) = self.rnn(x)\n        z = h[-1]"),
    "lstm-bi": ("nn.LSTM(8, 12, batch_first=True, bidirectional=True)",
                "y, _ = self.rnn(x)\n        z = y[:, -1]"),
    "gru": ("nn.GRU(8, 12, batch_first=True)", "y, h = self.rnn(x)\n        z = h[-1]"),
    "gru-bi": ("nn.GRU(8, 12, batch_first=True, bidirectional=True)", "y, h = self.rnn(x)\n        z = y.mean(1)"),
    "rnn": ("nn.RNN(8, 12, batch_first=True)", "y, h = self.rnn(x)\n        z = h[-1]"),
    "rnn-relu-bi": ("nn.RNN(8, 12, nonlinearity='relu', batch_first=True, bidirectional=True)",
                    "y, h = self.rnn(x)\n        z = y[:, 0]"),
    "lstm-seq2seq": ("nn.LSTM(8, 12)", "y, _ = self.rnn(x.transpose(0, 1))\n        z = y.transpose(0, 1)"),
}


def rendered(name: str) -> Rendered:
    layer, read = NETS[name]
    width = 24 if "bi" in name else 12
    seq = name.endswith("seq2seq")
    source = HEADER + f"""class FuzzNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = {layer}
        self.head = nn.Linear({width}, 5)

    def forward(self, x):
        {read}
        return self.head(z)
"""
    if seq:  # one class per time step: [N, T, 5], classes on the last axis
        return Rendered(source, (6, 8), "float", (6, 5), "cross-entropy", -1, 5)
    return Rendered(source, (6, 8), "float", (5,), "cross-entropy", 1, 5)


@pytest.mark.parametrize("name", list(NETS))
def test_a_recurrent_classifier_trains_as_torch_trains_it_alone(name, runtime):
    out = check_source(rendered(name), seed=5, runtime=runtime)
    assert out.status in ("pass", "sensitive"), (name, runtime, out.B, out.stage, out.message)
