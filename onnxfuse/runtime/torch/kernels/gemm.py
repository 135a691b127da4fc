"""Matrix products: MatMul, Gemm, Einsum and the runtime's own ``MatMulAdd``. A fused Linear is
``x [B, N.., C] @ W [B, 1.., C, D]`` (``core/rules/gemm.py``): its product is folded to one per model
(:func:`folded_matmul`), as HFTA's batched Linear computes it."""
from __future__ import annotations

import numpy as np
import torch

from onnxfuse.runtime.torch.kernels._base import OPS, Kernel, NodeSpec, all_inputs, kern, op


def _own_dims(b: torch.Tensor) -> int:
    """How many leading dims of a fused weight ``b`` [B, 1.., K, N] are its own (the models' axis and any before
    the size-1 dims it broadcasts over); at least 1: axis 0 is the models' (size 1 at B = 1)."""
    k = b.dim() - 2
    while k > 1 and b.shape[k - 1] == 1:
        k -= 1
    return k


def _per_model_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A shared input ``a`` (fewer dims than ``b``: no model axis yet) broadcast to each model of ``b``, so that a
    product folds to one per model (a copy per model). Under autocast torch.matmul would otherwise broadcast ``b``
    over ``a``'s batch entries and sum the weight's gradient from per-entry bf16 / fp16 products, where the model
    alone (``linear``, ``matmul`` of a 2-D weight) runs one product over every row."""
    if not 1 <= a.dim() < b.dim() or b.dim() < 3:
        return a
    a = a.reshape((1,) * (b.dim() - a.dim()) + tuple(a.shape))
    k = _own_dims(b)
    if all(d == 1 for d in a.shape[:k]):
        a = a.expand(*b.shape[:k], *a.shape[k:])
    return a


def folded_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)``, with the batch dims over which ``b`` broadcasts folded into ``a``'s rows.

    A fused Linear is ``x [B, N.., T, C] @ W [B, 1.., C, D]``: torch.matmul expands W to every (N.., T) batch entry
    and runs that many small products (and their gradient sums the expanded copies); folded, it is one product per
    model, ``[B, N..*T, C] @ [B, C, D]``, as HFTA's batched Linear computes it (3-4x faster forward and backward
    at the zoo's Transformer sizes on this CPU). Same values up to summation order. Under autocast a shared input
    is broadcast to the models first (:func:`_per_model_rows`)."""
    if torch.is_autocast_enabled(a.device.type):
        a = _per_model_rows(a, b)
    lead = b.dim() - 2
    if lead < 1 or a.dim() < b.dim():
        return torch.matmul(a, b)
    k = lead  # b's batch dims: its own leading ones, then size-1 dims up to the matrix
    while k > 0 and b.shape[k - 1] == 1:
        k -= 1
    own, extra = b.shape[:k], a.dim() - b.dim()
    if k == lead or extra or tuple(a.shape[:k]) != tuple(own):
        return torch.matmul(a, b)
    rows = a.shape[k:-1]
    y = torch.matmul(a.reshape(*own, -1, a.shape[-1]), b.reshape(*own, *b.shape[-2:]))
    return y.reshape(*own, *rows, b.shape[-1])


def _linear_unfused(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch's ``linear`` on one model's input runs ``matmul`` and a separate bias add: an input of more
    than 2 dims that is not contiguous. A fused input with the models' axis is contiguous for this when it is a
    contiguous tensor with that axis moved (the fusion's packing: models interleaved at the samples or channels,
    each model's rows as dense as alone); a shared input is itself."""
    if a.dim() < b.dim():
        return a.dim() > 2 and not a.is_contiguous()
    if a.dim() <= 3:
        return False
    return not any(a.movedim(0, p).is_contiguous() for p in range(a.dim()))


def folded_baddbmm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a @ b + c`` as nn.Linear computes it under autocast, folded as :func:`folded_matmul` folds; a bias
    ``[B, 1.., D]`` broadcasts over the rows. torch's ``linear`` adds the bias inside the product (one rounding to
    bf16 / fp16) for a 2-D or a contiguous input: here one ``torch.baddbmm`` per array, a shared input broadcast to
    every model. For a non-contiguous input of more dims (a transpose's or a slice's view) ``linear`` runs
    ``matmul`` and then adds the bias in the product's dtype (two roundings), and so does this (the model's slice
    of ``a`` decides). Without autocast it is ``matmul`` and an add: the bits of the ``MatMul -> Add`` it
    replaces, so a graph with the node computes float32 exactly as one without."""
    if not torch.is_autocast_enabled(a.device.type) or _linear_unfused(a, b):
        y = folded_matmul(a, b)
        return y + c.to(y.dtype)
    a = _per_model_rows(a, b)
    k = _own_dims(b)
    own = tuple(b.shape[:k])
    if (b.dim() >= 3 and a.dim() == b.dim() and tuple(a.shape[:k]) == own and c.dim() == a.dim()
            and tuple(c.shape[:k]) == own and all(d == 1 for d in c.shape[k:-1]) and c.shape[-1] == b.shape[-1]):
        rows = a.shape[k:-1]
        n = int(np.prod(own))
        y = torch.baddbmm(c.reshape(n, 1, c.shape[-1]), a.reshape(n, -1, a.shape[-1]), b.reshape(n, *b.shape[-2:]))
        return y.reshape(*own, *rows, b.shape[-1])
    y = folded_matmul(a, b)
    return y + c.to(y.dtype)


@OPS.register("MatMulAdd", domain="onnxfuse.torch")
def matmul_add(spec: NodeSpec) -> Kernel:
    """The torch runtime's own node for a fused Linear under autocast (``runtime/torch/precision.py``'s
    ``biased_products``): ``A [B, .., M, K] @ W [B, 1.., K, N] + C [B, 1.., N]`` as one baddbmm."""
    return kern(folded_baddbmm, 0, 1, 2)


@op("MatMul")
def matmul(spec: NodeSpec) -> Kernel:
    """torch.matmul, a fused Linear's product folded (:func:`folded_matmul`)."""
    return kern(folded_matmul, 0, 1)


@op("Gemm")
def gemm(spec: NodeSpec) -> Kernel:
    """Y = alpha * A' @ B' + beta * C (A', B' transposed if asked): torch.addmm, as nn.Linear computes it."""
    ta, tb = int(spec.attr("transA", 0)), int(spec.attr("transB", 0))
    alpha, beta = float(spec.attr("alpha", 1.0)), float(spec.attr("beta", 1.0))

    def operands(a, b):
        return (a.t() if ta else a), (b.t() if tb else b)

    if spec.has(2):
        def fn(a, b, c):
            a, b = operands(a, b)
            return torch.addmm(c, a, b, beta=beta, alpha=alpha)
        return kern(fn, 0, 1, 2)

    def fn2(a, b):
        a, b = operands(a, b)
        y = torch.mm(a, b)
        return y * alpha if alpha != 1.0 else y
    return kern(fn2, 0, 1)


@op("Einsum")
def einsum(spec: NodeSpec) -> Kernel:
    eq = spec.attr("equation").replace(" ", "")
    return kern(lambda *xs: torch.einsum(eq, *xs), *all_inputs(spec))


@op("Det")
def det(spec: NodeSpec) -> Kernel:
    """The determinant of each square matrix in the last two axes: torch.linalg.det (its gradient too)."""
    return kern(torch.linalg.det, 0)
