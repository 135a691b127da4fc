"""Indexing: Gather, GatherElements and the runtime's ``GatherKeepRows`` (an embedding's padding rows)."""
from __future__ import annotations

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
