"""Einsum has no gradient builder in ORT 1.19: rewrite it as ReduceSum / Transpose / Reshape / MatMul."""
from __future__ import annotations

import string

import onnx

from onnxfuse.core.rewrite import COPY, Context, Dims, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["einsum"]


@rewrite("Einsum")
def einsum(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """Einsum over 1 or 2 operands, explicit ('bij,bjk->bik') or implicit ('ij,jk'), with '...' when ranks are known.

    One operand:  Y = Transpose(ReduceSum(A, letters not in the output)).
    Two operands: letters not in the output and in one operand only are summed first (ReduceSum); then
        A -> Transpose [batch, m, k] -> Reshape [batch, M, K];  B -> Transpose [batch, k, n] -> Reshape [batch, K, N]
        C = MatMul(A, B) [batch, M, N] -> Reshape [batch, m, n] -> Transpose to the output order,
    where batch = letters in A, B and the output, k = in A and B only (contracted), m = in A and the output only,
    n = in B and the output only; M, K, N are products of their dims (1 for an empty group).
    Math: sum_k A[b, m, k] B[b, k, n] is a batched matrix product; MatMul broadcasts batch dims like Einsum's '...'.
    A letter repeated within one operand (a diagonal, 'ii->i') is not supported.
    """
    equation = ctx.attrs(node)["equation"]
    if len(node.input) > 2:
        raise ctx.error(node, f"it has {len(node.input)} operands (equation '{equation}')",
                        "write it as a chain of two-operand einsums")
    terms, out = _parse(node, ctx, equation)
    em = Emitter(node, ctx)
    operands = []
    for name, term in zip(node.input, terms):
        shape = ctx.shape(name) or [None] * len(term)
        dims = dict(zip(term, shape))
        others = [t for other in terms if other is not term for t in other]
        summed = [t for t in term if t not in out and t not in others]
        if summed:
            name = em.reduce("ReduceSum", name, [term.index(t) for t in summed], keepdims=0)
            term = [t for t in term if t not in summed]
        operands.append((name, term, dims))
    y = node.output[0]
    if len(operands) == 1:
        a, ta, _ = operands[0]
        em.finish(em.transpose(a, [ta.index(t) for t in out]), y)
        return em.nodes
    (a, ta, da), (b, tb, db) = operands
    batch = [t for t in out if t in ta and t in tb]
    m = [t for t in out if t in ta and t not in tb]
    n = [t for t in out if t in tb and t not in ta]
    k = [t for t in ta if t in tb and t not in out]
    nb = len(batch)
    a_order, b_order = batch + m + k, batch + k + n
    a = em.transpose(a, [ta.index(t) for t in a_order])
    b = em.transpose(b, [tb.index(t) for t in b_order])

    def group(tensor: str, order: list, dims: dict, letters: list) -> Dims:
        return Dims(tensor, tuple(order.index(t) for t in letters), tuple(dims[t] for t in letters))

    a_mat = a if len(m) == 1 and len(k) == 1 else em.reshape(
        a, [COPY] * nb + [group(a, a_order, da, m), group(a, a_order, da, k)])
    b_mat = b if len(k) == 1 and len(n) == 1 else em.reshape(
        b, [COPY] * nb + [group(b, b_order, db, k), group(b, b_order, db, n)])
    c = em.op("MatMul", [a_mat, b_mat])
    if len(m) != 1 or len(n) != 1:  # split M and N back into their letters (dims read from A and B)
        c = em.reshape(c, [COPY] * nb + [group(a, a_order, da, [t]) for t in m]
                       + [group(b, b_order, db, [t]) for t in n])
    em.finish(em.transpose(c, [(batch + m + n).index(t) for t in out]), y)
    return em.nodes


def _parse(node: onnx.NodeProto, ctx: Context, equation: str) -> tuple[list[list[str]], list[str]]:
    """Operand and output index lists; each '...' becomes right-aligned tokens '...0', '...1' (one per dim)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    raw = lhs.split(",")
    if len(raw) != len(node.input):
        raise ctx.error(node, f"its equation '{equation}' has {len(raw)} operands for {len(node.input)} inputs",
                        "fix the equation")
    letters = []
    for k, (t, name) in enumerate(zip(raw, node.input)):
        body = t.replace("...", "")
        if any(c not in string.ascii_letters for c in body):
            raise ctx.error(node, f"operand {k} of its equation '{equation}' is not letters and '...'",
                            "fix the equation")
        repeated = sorted({c for c in body if body.count(c) > 1})
        if repeated:
            raise ctx.error(node, f"operand {k} of '{equation}' repeats index '{repeated[0]}' (a diagonal)",
                            "take the diagonal with torch.diagonal before the einsum")
        letters.append(body)
    n_ell = []
    for t, name, body in zip(raw, node.input, letters):
        n_ell.append(ctx.rank(node, name) - len(body) if "..." in t else 0)
        shape = ctx.shape(name)
        if "..." not in t and shape is not None and len(shape) != len(body):
            raise ctx.error(node, f"operand '{name}' has rank {len(shape)} but '{t}' names {len(body)} dims",
                            "fix the equation")
    max_ell = max(n_ell)
    ell = [f"...{j}" for j in range(max_ell)]
    terms = []
    for t, body, ne in zip(raw, letters, n_ell):
        if "..." in t:
            before, _, after = t.partition("...")
            terms.append(list(before) + ell[max_ell - ne:] + list(after))
        else:
            terms.append(list(body))
    if arrow:
        before, dots, after = rhs.partition("...")
        out = list(before) + (ell if dots else []) + list(after)
        if len(set(out)) != len(out) or any(t not in {x for term in terms for x in term} for t in out):
            raise ctx.error(node, f"the output of '{equation}' repeats an index or names one no operand has",
                            "fix the equation")
    else:
        counts: dict[str, int] = {}
        for body in letters:
            for c in body:
                counts[c] = counts.get(c, 0) + 1
        out = ell + sorted(c for c, n in counts.items() if n == 1)
    return terms, out
