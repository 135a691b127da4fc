"""Matrix products: B Gemms / MatMuls are one batched MatMul with the model axis outermost."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from onnxfuse.core.errors import InputFileError
from onnxfuse.core.layout import stacked
from onnxfuse.core.weights import WeightSlot
from onnxfuse.core.rules._common import unsqueeze
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup


def _transpose_last2(g: "NodeGroup", x: str, rank: int) -> str:
    perm = list(range(rank))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return g.emit("Transpose", [x], perm=perm)[0]


def _matrix(g: "NodeGroup", i: int, transpose: bool) -> str:
    """Input i as a matrix operand: shared [M, K] as it is (it broadcasts), per-model [B, M, K]; transposed if asked."""
    shared = g.is_shared(i)
    x = g.shared(i) if shared else g.get(i, stacked(0))
    return _transpose_last2(g, x, 2 if shared else 3) if transpose else x


def _check_inner_dims(g: "NodeGroup", trans_a: int, trans_b: int, w_shape: list | None) -> None:
    """A's K is B's K where both are known: ONNX's Gemm shape inference does not check it (the fused MatMul's
    does), so a model whose input shape its weights cannot take (a dimension of 10**12 flattened into a Gemm whose
    weight expects 48) is refused here, naming the model and the node, not as an invalid fused graph."""
    a_shape = g.input_shape(0)
    k_a = a_shape[0 if trans_a else 1] if a_shape is not None and len(a_shape) == 2 else None
    k_w = w_shape[1 if trans_b else 0] if w_shape is not None and len(w_shape) == 2 else None
    if isinstance(k_a, int) and isinstance(k_w, int) and k_a != k_w:
        raise InputFileError(f"{g.model_label}: node '{g.name}' (Gemm) multiplies A of shape {a_shape} "
                             f"(transA={trans_a}) by B of shape {w_shape} (transB={trans_b}): their inner dimensions "
                             f"{k_a} and {k_w} differ, so the model's shapes do not agree; check its input shapes "
                             "against what its weights take, and re-export it")


@rule("Gemm")
def fuse_gemm(g: "NodeGroup") -> None:
    """B Gemms -> one batched MatMul (+ Add).

    Layout: A [B, M, K] stacked(0) (a shared A [M, K] broadcasts, no copy); W [B, K, N] with transB applied per
    model while packing (no Transpose at run time); C [B, 1|M, N]; Y [B, M, N] stacked(0).
    Math: Y_b = alpha * A_b @ W_b + beta * C_b, batched over the leading model axis.
    """
    trans_a, trans_b = int(g.attr("transA", 0)), int(g.attr("transB", 0))
    alpha, beta = float(g.attr("alpha", 1.0)), float(g.attr("beta", 1.0))
    w_shape = g.input_shape(1)
    _check_inner_dims(g, trans_a, trans_b, w_shape)
    a = _matrix(g, 0, trans_a)
    if g.is_weight(1):
        perm = (1, 0) if trans_b else None
        kn = (w_shape[1], w_shape[0]) if trans_b else tuple(w_shape)
        w = g.weight(1, WeightSlot(perm, (1, *kn)))
    else:
        w = _matrix(g, 1, trans_b)
    dtype = np.float32
    has_c = g.has_input(2)
    y = g.emit("MatMul", [a, w], 1 if has_c or alpha != 1.0 else [g.out_name(0)])[0]
    if alpha != 1.0:
        y = g.emit("Mul", [y, g.new_const(alpha, "alpha", dtype)], 1 if has_c else [g.out_name(0)])[0]
    if has_c:
        c_shape = g.input_shape(2)
        if g.is_weight(2):
            c = g.weight(2, WeightSlot(None, (1,) + (1,) * (2 - len(c_shape)) + tuple(c_shape)))
        elif g.is_shared(2):
            c = g.shared(2)
        else:
            c = g.get(2, stacked(0))
            c = unsqueeze(g, c, list(range(1, 3 - len(c_shape)))) if len(c_shape) < 2 else c
        if beta != 1.0:
            c = g.emit("Mul", [c, g.new_const(beta, "beta", dtype)])[0]
        y = g.emit("Add", [y, c], [g.out_name(0)])[0]
    g.set_output(0, y, stacked(0))


@rule("MatMul")
def fuse_matmul(g: "NodeGroup") -> None:
    """B MatMuls -> one MatMul whose outermost batch axis is the model axis.

    Layout: per-model operands stacked(0) and padded to the same rank: [B, ..., M, K] @ [B, ..., K, N]; a
    per-model weight [K, N] is packed to [B, 1.., K, N]; a shared operand broadcasts over the model axis (no copy).
    Output [B, ..., M, N] stacked(0). Math: numpy matmul broadcasting pairs model b's operands only.
    """
    ranks = [g.rank(0), g.rank(1)]
    if min(ranks) < 2 and not all(g.is_shared(i) or ranks[i] >= 2 for i in (0, 1)):
        g.fail("a 1-D per-model MatMul operand is not supported")
    r = max(ranks)
    operands = []
    for i in (0, 1):
        if g.is_shared(i):
            operands.append(g.shared(i))
        elif g.is_weight(i):
            operands.append(g.weight(i, WeightSlot(None, (1,) * (1 + r - ranks[i]) + tuple(g.input_shape(i)))))
        else:
            x = g.get(i, stacked(0))
            operands.append(unsqueeze(g, x, list(range(1, 1 + r - ranks[i]))) if ranks[i] < r else x)
    g.emit_same(operands, stacked(0))
