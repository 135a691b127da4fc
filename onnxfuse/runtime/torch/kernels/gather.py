"""Indexing: Gather, GatherElements, GatherND, the runtime's ``GatherKeepRows`` (an embedding's padding rows),
ScatterElements, ScatterND, Compress and NonZero. Negative indices count from the end, as ONNX defines."""
from __future__ import annotations

import math

import torch

from onnxfuse.runtime.torch.kernels._base import OPS, Kernel, NodeSpec, kern, norm_axis, op


@op("Gather")
def gather(spec: NodeSpec) -> Kernel:
    """x.take along ``axis``: out shape x.shape[:axis] + idx.shape + x.shape[axis+1:]; negative indices count from the
    end. A constant scalar index is a select (a view)."""
    axis = int(spec.attr("axis", 0))
    idx = spec.const(1)
    if idx is not None and idx.dim() == 0:
        i = int(idx)
        return kern(lambda x: x.select(axis, i), 0)
    if idx is not None and bool((idx >= 0).all()):
        flat = idx.reshape(-1)
        ishape = tuple(idx.shape)

        def const_idx(x):
            a = norm_axis(axis, x.dim())
            ix = flat if flat.device == x.device else flat.to(x.device)
            return x.index_select(a, ix).reshape(x.shape[:a] + ishape + x.shape[a + 1:])
        return kern(const_idx, 0)

    def fn(x, i):
        a = norm_axis(axis, x.dim())
        i = torch.where(i < 0, i + x.shape[a], i)
        return x.index_select(a, i.reshape(-1)).reshape(x.shape[:a] + i.shape + x.shape[a + 1:])
    return kern(fn, 0, 1)


@OPS.register("GatherKeepRows", domain="onnxfuse.torch")
def gather_keep_rows(spec: NodeSpec) -> Kernel:
    """An embedding lookup ``Gather(table, idx)`` (axis 0) whose lookups of ``rows`` (input 2, constant) pass no
    gradient to the table: ``nn.Embedding(padding_idx=)``'s backward, the fused table's padding rows
    (``onnxfuse/core/semantics.py``). The same values as Gather; those positions' outputs are detached."""
    spec.need_const(2, "rows")
    rows = spec.const(2).reshape(-1).to(torch.int64)

    def fn(x, i):
        i = torch.where(i < 0, i + x.shape[0], i)
        y = x.index_select(0, i.reshape(-1)).reshape(i.shape + x.shape[1:])
        kept = torch.isin(i, rows if rows.device == i.device else rows.to(i.device))
        return torch.where(kept.reshape(kept.shape + (1,) * (x.dim() - 1)), y.detach(), y)
    return kern(fn, 0, 1)


@op("GatherElements")
def gather_elements(spec: NodeSpec) -> Kernel:
    axis = int(spec.attr("axis", 0))

    def fn(x, i):
        a = norm_axis(axis, x.dim())
        return torch.gather(x, a, torch.where(i < 0, i + x.shape[a], i))
    return kern(fn, 0, 1)


def _wrapped(i: torch.Tensor, size: int) -> torch.Tensor:
    """Indices with negative ones counted from the end (ONNX's rule for every indexing op)."""
    return torch.where(i < 0, i + size, i)


def _nd_rows(x: torch.Tensor, idx: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For the ND ops: ``x [*batch, *D, *rest]`` as ``[prod(batch), prod(D), *rest]`` and ``idx [*batch, *Q, k]``
    (k = len(D)) as row numbers ``[prod(batch), prod(Q)]`` into it, with Q's size. Row = the index tuple in
    row-major order over D, negative entries counted from the end."""
    k = idx.shape[-1]
    D = x.shape[b:b + k]
    lead = math.prod(x.shape[:b])
    strides = torch.tensor([math.prod(D[j + 1:]) for j in range(k)], dtype=torch.int64, device=idx.device)
    sizes = torch.tensor(list(D), dtype=torch.int64, device=idx.device)
    rows = (_wrapped(idx.to(torch.int64), sizes) * strides).sum(-1)
    q = math.prod(idx.shape[b:-1])
    return x.reshape(lead, math.prod(D), *x.shape[b + k:]), rows.reshape(lead, q), q


@op("GatherND")
def gather_nd(spec: NodeSpec) -> Kernel:
    """GatherND(data, indices [*batch, *Q, k], batch_dims b): out[*batch, *Q] = data[*batch][tuple(idx)], shape
    batch + Q + data.shape[b + k:]. One advanced-indexing read (its gradient accumulates repeated rows)."""
    b = int(spec.attr("batch_dims", 0))

    def fn(x, idx):
        flat, rows, _ = _nd_rows(x, idx, b)
        picked = flat[torch.arange(flat.shape[0], device=x.device).unsqueeze(1), rows]
        return picked.reshape(*idx.shape[:-1], *x.shape[b + idx.shape[-1]:])
    return kern(fn, 0, 1)


# ONNX's scatter reductions as torch's scatter_reduce / index_reduce names (include_self: the data takes part)
_REDUCE = {"mul": "prod", "max": "amax", "min": "amin"}


@op("ScatterElements")
def scatter_elements(spec: NodeSpec) -> Kernel:
    """ScatterElements(data, indices, updates, axis, reduction): a copy of data with ``updates[i..]`` written at
    ``indices[i..]`` along ``axis`` (reduction none), or combined with what is there (add: torch.scatter_add, the
    message passing of graph networks; mul / max / min: scatter_reduce with the data included)."""
    axis, reduction = int(spec.attr("axis", 0)), spec.attr("reduction", "none")

    def fn(x, i, u):
        a = norm_axis(axis, x.dim())
        i = _wrapped(i.to(torch.int64), x.shape[a])
        if reduction == "none":
            return torch.scatter(x, a, i, u)
        if reduction == "add":
            return torch.scatter_add(x, a, i, u)
        return torch.scatter_reduce(x, a, i, u, _REDUCE[reduction], include_self=True)
    return kern(fn, 0, 1, 2)


@op("ScatterND")
def scatter_nd(spec: NodeSpec) -> Kernel:
    """ScatterND(data, indices [*Q, k], updates [*Q, *data.shape[k:]], reduction): a copy of data with each
    ``updates[q]`` written at (none) or combined with (add, mul, max, min) ``data[tuple(indices[q])]``; rows as
    :func:`_nd_rows` numbers them (index_copy / index_add / index_reduce along them)."""
    reduction = spec.attr("reduction", "none")

    def fn(x, idx, u):
        flat, rows, q = _nd_rows(x, idx, 0)  # no batch axes: one [1, rows, *rest] block
        flat, rows = flat[0], rows.reshape(q)
        u = u.reshape(q, *flat.shape[1:])
        if reduction == "none":
            y = flat.index_copy(0, rows, u)
        elif reduction == "add":
            y = flat.index_add(0, rows, u)
        else:
            y = flat.index_reduce(0, rows, u, _REDUCE[reduction], include_self=True)
        return y.reshape(x.shape)
    return kern(fn, 0, 1, 2)


@op("Compress")
def compress(spec: NodeSpec) -> Kernel:
    """The slices of x along ``axis`` (the flattened x without one) where ``condition`` is true; a condition shorter
    than the axis keeps none of the rest. The output's length depends on the data (read on the host)."""
    axis = spec.attr("axis")

    def fn(x, cond):
        if axis is None:
            x = x.reshape(-1)
        a = 0 if axis is None else norm_axis(int(axis), x.dim())
        keep = torch.nonzero(cond.reshape(-1)[: x.shape[a]].to(torch.bool)).reshape(-1)
        return x.index_select(a, keep)
    return kern(fn, 0, 1)


@op("NonZero")
def non_zero(spec: NodeSpec) -> Kernel:
    """[rank, count] indices of the non-zero elements in row-major order (numpy's nonzero, stacked)."""
    def fn(x):
        if x.dim() == 0:  # a scalar has no axes: [0, 1] when it is non-zero, else [0, 0]
            return torch.zeros(0, int(bool(x != 0)), dtype=torch.int64, device=x.device)
        return torch.nonzero(x).t()
    return kern(fn, 0)
