"""Ops that order values: TopK (torch.topk, what a model's own ``torch.topk`` routing runs) and Unique."""
from __future__ import annotations

import torch

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, kern, norm_axis, op


@op("TopK")
def top_k(spec: NodeSpec) -> Kernel:
    """TopK(X, K [1]) along ``axis``: the K largest (``largest`` 1) or smallest values and their int64 indices,
    sorted (``sorted`` 1; 0 leaves the order open, torch's sorted order is one). The values' gradient goes to the
    chosen positions, as torch.topk's does. K is a host value."""
    axis, largest = int(spec.attr("axis", -1)), bool(spec.attr("largest", 1))
    if spec.opset < 10:
        k0 = int(spec.attr("k"))
        return kern(lambda x: tuple(torch.topk(x, k0, axis, largest, True)), 0)

    def fn(x, k):
        values, indices = torch.topk(x, int(k.reshape(-1)[0]), norm_axis(axis, x.dim()), largest, True)
        return values, indices
    return kern(fn, 0, 1, host=(1,))


@op("Unique")
def unique(spec: NodeSpec) -> Kernel:
    """Unique(X): Y the distinct values (slices along ``axis``; the flattened X without one), sorted ascending
    (``sorted`` 1) or in order of first occurrence (0); indices: each one's first position in X; inverse_indices:
    each element's (slice's) position in Y; counts. Integer outputs: no gradient."""
    axis, ordered = spec.attr("axis"), bool(spec.attr("sorted", 1))

    def fn(x):
        a = None if axis is None else norm_axis(int(axis), x.dim())
        y, inverse, counts = torch.unique(x if a is not None else x.reshape(-1), sorted=True, return_inverse=True,
                                          return_counts=True, dim=a)
        n = inverse.numel()
        first = torch.full((counts.numel(),), n, dtype=torch.int64, device=x.device)
        first = first.scatter_reduce(0, inverse, torch.arange(n, device=x.device), "amin", include_self=True)
        if not ordered:  # the sorted values in order of their first occurrence
            order = torch.argsort(first)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(order.numel(), device=x.device)
            y, first, counts, inverse = y.index_select(0 if a is None else a, order), first[order], counts[order], \
                rank[inverse]
        return y, first, inverse, counts
    return kern(fn, 0)
