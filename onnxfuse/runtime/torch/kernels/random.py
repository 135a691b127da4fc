"""Ops that draw random numbers: Dropout (each element its own mask, so each fused model its own), RandomNormal,
RandomUniform, their *Like forms, Bernoulli and Multinomial (from the node's own generator when it has a seed)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, identity, kern, op, torch_dtype


@op("Dropout")
def dropout(spec: NodeSpec) -> Kernel:
    """Dropout(x, ratio, training_mode). Off unless training_mode is true and the module is in train mode; the mask
    output (if read) is True where x was kept. Each element draws its own mask, so each fused model does too."""
    if spec.opset < 12:
        ratio, on = float(spec.attr("ratio", 0.5)), spec.training
    else:
        spec.need_const(1, "ratio")
        spec.need_const(2, "training_mode")
        ratio, on = float(spec.scalar(1, 0.5)), bool(spec.scalar(2, False))
    on = on and spec.training and ratio > 0.0
    two = spec.n_outputs > 1
    want_mask = two and spec.used_outputs[1]
    if not on:
        if want_mask:
            return kern(lambda x: (x, torch.ones_like(x, dtype=torch.bool)), 0)
        return kern((lambda x: (x, None)) if two else identity, 0)
    if want_mask:
        return kern(lambda x: torch.native_dropout(x, ratio, True), 0)
    return kern((lambda x: (F.dropout(x, ratio, True), None)) if two else (lambda x: F.dropout(x, ratio, True)), 0)


def _dtype(spec: NodeSpec, like: torch.Tensor | None = None) -> torch.dtype:
    to = spec.attr("dtype")
    return torch_dtype(int(to)) if to is not None else (like.dtype if like is not None else torch.float32)


@op("RandomNormal", "RandomUniform")
def random_fill(spec: NodeSpec) -> Kernel:
    """A tensor of ``shape`` drawn from N(mean, scale^2) (RandomNormal) or U[low, high) (RandomUniform), from the
    node's generator (:meth:`NodeSpec.generator`)."""
    shape = [int(v) for v in spec.attr("shape")]
    normal = spec.op_type == "RandomNormal"
    a, b = (float(spec.attr("mean", 0.0)), float(spec.attr("scale", 1.0))) if normal else \
        (float(spec.attr("low", 0.0)), float(spec.attr("high", 1.0)))
    dtype = _dtype(spec)

    def fn():
        g, device = spec.generator(), spec.device()
        if normal:
            return torch.randn(shape, generator=g, device=device, dtype=dtype) * b + a
        return torch.rand(shape, generator=g, device=device, dtype=dtype) * (b - a) + a
    return kern(fn)


@op("RandomNormalLike", "RandomUniformLike")
def random_like(spec: NodeSpec) -> Kernel:
    """RandomNormal / RandomUniform in the shape of the input (its values unread: no gradient), in ``dtype``
    (default the input's)."""
    normal = spec.op_type == "RandomNormalLike"
    a, b = (float(spec.attr("mean", 0.0)), float(spec.attr("scale", 1.0))) if normal else \
        (float(spec.attr("low", 0.0)), float(spec.attr("high", 1.0)))

    def fn(x):
        g, dtype = spec.generator(), _dtype(spec, x)
        if normal:
            return torch.randn(x.shape, generator=g, device=x.device, dtype=dtype) * b + a
        return torch.rand(x.shape, generator=g, device=x.device, dtype=dtype) * (b - a) + a
    return kern(fn, 0)


@op("Bernoulli")
def bernoulli(spec: NodeSpec) -> Kernel:
    """1 with probability p (the input), else 0, in ``dtype`` (default the input's): torch.bernoulli."""
    def fn(p):
        return torch.bernoulli(p.detach(), generator=spec.generator()).to(_dtype(spec, p))
    return kern(fn, 0)


@op("Multinomial")
def multinomial(spec: NodeSpec) -> Kernel:
    """Multinomial(input [batch, classes] unnormalized log-probabilities) -> [batch, sample_size] class indices
    drawn with replacement (``dtype`` int32 by default): torch.multinomial of softmax(input)."""
    n = int(spec.attr("sample_size", 1))
    dtype = torch_dtype(int(spec.attr("dtype", 6)))  # 6: INT32

    def fn(x):
        probs = torch.softmax(x.detach().to(torch.float64), -1)
        return torch.multinomial(probs, n, replacement=True, generator=spec.generator()).to(dtype)
    return kern(fn, 0)
