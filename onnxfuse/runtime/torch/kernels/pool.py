"""Pooling over spatial windows: MaxPool (with ONNX's flat indices), AveragePool, LpPool, the global pools, and
MaxUnpool (the inverse of MaxPool's indices)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, kern, op
from onnxfuse.runtime.torch.kernels._window import Window, symmetric, torch_pad

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _pool_window(spec: NodeSpec):
    k = list(spec.attr("kernel_shape"))
    return Window(spec, len(k), k), len(k)


@op("MaxPool")
def max_pool(spec: NodeSpec) -> Kernel:
    """F.max_pool{1,2,3}d; pads torch cannot take (asymmetric, > k/2, SAME_*, ceil_mode) are an explicit -inf pad.
    Indices (output 1): flat over [N, C, *S] in row-major order (storage_order 0), as ONNX defines them."""
    win, S = _pool_window(spec)
    k, st, dil = win.kernel, win.strides, win.dilations
    f = _MAX_POOL[S]
    indices = spec.n_outputs > 1 and spec.used_outputs[1]
    pair = spec.n_outputs > 1
    if indices and int(spec.attr("storage_order", 0)):
        spec.fail("MaxPool indices in column-major storage_order are not supported", "use storage_order 0")

    def torch_ok(pads):
        return symmetric(pads, S) and all(pads[a] * 2 <= k[a] for a in range(S))

    def run(x, pads):
        if torch_ok(pads):
            return f(x, k, st, pads[:S], dil, False, indices)
        if indices:
            spec.fail("MaxPool indices with asymmetric pads are not supported", "use symmetric pads")
        return f(F.pad(x, torch_pad(pads, S), value=-math.inf), k, st, 0, dil, False)

    def with_indices(x, pads):
        y, idx = run(x, pads)
        plane = math.prod(x.shape[2:])
        base = torch.arange(x.shape[0] * x.shape[1], device=x.device).reshape(x.shape[0], x.shape[1], *[1] * S)
        return y, idx + base * plane

    g = with_indices if indices else (lambda x, pads: (run(x, pads), None)) if pair else run
    if win.static:
        pads = win.pads
        return kern(lambda x: g(x, pads), 0)
    return kern(lambda x: g(x, win.resolve(x.shape[2:])), 0)


def _unfold_windows(x, k, st, dil, S):
    """[N, C, *out, *k] view of every window (after padding)."""
    for a in range(S):
        x = x.unfold(2 + a, (k[a] - 1) * dil[a] + 1, st[a])
        if dil[a] > 1:
            x = x[..., ::dil[a]]
    return x


@op("AveragePool")
def average_pool(spec: NodeSpec) -> Kernel:
    """Mean over each window. count_include_pad 0: the divisor counts input elements only; 1: the window's elements
    inside the padded axis (onnxfuse.core.windows.average_divisors). Pads torch cannot take are explicit zero pads, then
    the divisor is computed by pooling a ones tensor the same way."""
    win, S = _pool_window(spec)
    k, st, dil = win.kernel, win.strides, win.dilations
    include = bool(spec.attr("count_include_pad", 0))
    f = _AVG_POOL[S]
    kprod = math.prod(k)

    def run(x, pads):
        if any(d != 1 for d in dil):
            xp = F.pad(x, torch_pad(pads, S))
            sums = _unfold_windows(xp, k, st, dil, S).sum(dim=tuple(range(-S, 0)))
            if include:
                return sums / kprod
            ones = F.pad(torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device), torch_pad(pads, S))
            return sums / _unfold_windows(ones, k, st, dil, S).sum(dim=tuple(range(-S, 0)))
        if symmetric(pads, S) and all(pads[a] * 2 <= k[a] for a in range(S)):
            return f(x, k, st, pads[:S], False, include)
        xp = F.pad(x, torch_pad(pads, S))
        y = f(xp, k, st, 0, False, True)
        if include:
            return y
        ones = F.pad(torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device), torch_pad(pads, S))
        return y / f(ones, k, st, 0, False, True)

    if win.ceil and include:
        # ceil mode + counted pads: torch's divisor counts the declared pads but not the extra end pad
        def ceil_include(x):
            pads, p0 = win.resolve(x.shape[2:]), win.resolve(x.shape[2:], ceil=False)
            xp = F.pad(x, torch_pad(pads, S))
            sums = _unfold_windows(xp, k, st, dil, S).sum(dim=tuple(range(-S, 0)))
            ones = torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
            ones = F.pad(F.pad(ones, torch_pad(p0, S), value=1.0),
                         torch_pad([0] * S + [pads[S + a] - p0[S + a] for a in range(S)], S))
            return sums / _unfold_windows(ones, k, st, dil, S).sum(dim=tuple(range(-S, 0)))
        return kern(ceil_include, 0)
    if win.static:
        pads = win.pads
        return kern(lambda x: run(x, pads), 0)
    return kern(lambda x: run(x, win.resolve(x.shape[2:])), 0)


@op("LpPool")
def lp_pool(spec: NodeSpec) -> Kernel:
    """(sum over the window of |x|^p)^(1/p), pads counted as zeros."""
    win, S = _pool_window(spec)
    k, st, dil, p = win.kernel, win.strides, win.dilations, float(spec.attr("p", 2))

    def fn(x):
        pads = win.resolve(x.shape[2:])
        w = _unfold_windows(F.pad(x.abs().pow(p), torch_pad(pads, S)), k, st, dil, S)
        return w.sum(dim=tuple(range(-S, 0))).pow(1.0 / p)
    return kern(fn, 0)


@op("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def global_pool(spec: NodeSpec) -> Kernel:
    """Reduce every spatial axis, keeping it (size 1)."""
    if spec.op_type == "GlobalAveragePool":
        return kern(lambda x: x.mean(dim=tuple(range(2, x.dim())), keepdim=True), 0)
    if spec.op_type == "GlobalMaxPool":
        return kern(lambda x: x.amax(dim=tuple(range(2, x.dim())), keepdim=True), 0)
    p = float(spec.attr("p", 2))
    return kern(lambda x: x.abs().pow(p).sum(dim=tuple(range(2, x.dim())), keepdim=True).pow(1.0 / p), 0)


@op("MaxUnpool")
def max_unpool(spec: NodeSpec) -> Kernel:
    """MaxUnpool(X, I, output_shape?): zeros of the unpooled shape with X's values at I (a MaxPool's indices, flat
    over [N, C, *S]). Default spatial size: (L - 1) * stride + kernel - pad_begin - pad_end per axis; a given
    output_shape (a host value) wins."""
    k = [int(v) for v in spec.attr("kernel_shape")]
    S = len(k)
    strides = [int(v) for v in spec.attr("strides", [1] * S)]
    pads = [int(v) for v in spec.attr("pads", [0] * (2 * S))]

    def fn(x, i, shape=None):
        if shape is not None:
            out = [int(v) for v in shape.reshape(-1).tolist()]
        else:
            out = list(x.shape[:2]) + [(x.shape[2 + a] - 1) * strides[a] + k[a] - pads[a] - pads[S + a]
                                       for a in range(S)]
        y = x.new_zeros(math.prod(out)).scatter(0, i.reshape(-1).to(torch.int64), x.reshape(-1))
        return y.reshape(out)
    return kern(fn, *[j for j in (0, 1, 2) if spec.has(j)], host=(2,) if spec.has(2) else ())
