"""torch modules whose exports lose what training needs (issue 48's cases), built by the tests of ``fuse --like``
(``tests.runtime.torch.like_models:NAME`` as MODULE:FACTORY) and by the references they are checked against."""
from __future__ import annotations

import math

import torch
import torch.nn as nn


class Rotary(nn.Module):
    """Attention with rotary tables (``cos``/``sin`` buffers) and a causal mask of -inf (a buffer)."""

    def __init__(self, V: int = 50, D: int = 16, T: int = 8):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.q, self.k, self.v, self.out = (nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, V))
        pos = torch.arange(T)[:, None] * torch.exp(-torch.arange(0, D, 2) / D * math.log(1e4))[None]
        self.register_buffer("cos", torch.cos(pos))
        self.register_buffer("sin", torch.sin(pos))
        self.register_buffer("mask", torch.full((T, T), float("-inf")).triu(1))

    def rot(self, x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.cat([x1 * self.cos - x2 * self.sin, x1 * self.sin + x2 * self.cos], -1)

    def forward(self, ids):
        h = self.emb(ids)
        q, k, v = self.rot(self.q(h)), self.rot(self.k(h)), self.v(h)
        return self.out(torch.softmax(q @ k.transpose(-1, -2) / 4 + self.mask, -1) @ v + h)


class Window(nn.Module):
    """A fixed window (a buffer) multiplied into the input, as a spectrogram front end does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("window", torch.hann_window(8))

    def forward(self, x):
        return self.lin(x * self.window)


class BNCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.fc = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn1(self.conv1(x))).flatten(1))


class IndexAdd(nn.Module):
    """A graph network layer: each node's message summed into its destination with index_add_ over repeated
    destinations (TorchScript writes a ScatterElements without a reduction, which keeps one: wrong)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("dst", torch.tensor([1, 2, 2, 0, 0]))

    def forward(self, x):  # x [N=5, F=4]: one graph
        return torch.zeros(5, 4).index_add_(0, self.dst, self.lin(x))


class EdgeNet(nn.Module):
    """A graph network with integer buffers (edge lists) it reads by Gather, summed with scatter_add (exact)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("src", torch.tensor([0, 1, 2, 3, 4, 0, 1]))
        self.register_buffer("dst", torch.tensor([[1, 2, 3, 4, 0, 2, 2]] * 4).T.contiguous())

    def forward(self, x):  # x [N=5, F=4]
        return torch.zeros(5, 4).scatter_add(0, self.dst, self.lin(x)[self.src]).relu() + x


class Bert(nn.Module):
    """transformers' BertForSequenceClassification from a tiny config (no weights), returning its logits."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        self.bert = BertForSequenceClassification(cfg)

    def forward(self, ids):
        return self.bert(input_ids=ids).logits
