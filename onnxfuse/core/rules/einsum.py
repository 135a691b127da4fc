"""Einsum: a new subscript letter for the model axis of every per-model operand and of the output."""
from __future__ import annotations

import string
from typing import TYPE_CHECKING

from onnxfuse.core.layout import stacked
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup


def _explicit(equation: str) -> tuple[list[str], str]:
    """Operand terms and the output term (the implicit output: letters used once, sorted, after '...')."""
    eq = equation.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if "->" not in eq:
        letters = [c for c in lhs if c.isalpha()]
        rhs = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return terms, rhs


@rule("Einsum")
def fuse_einsum(g: "NodeGroup") -> None:
    """B Einsums -> one Einsum whose equation gains a model letter m.

    Layout: every per-model operand stacked(0) (its term becomes 'm' + term); shared operands unchanged (they
    broadcast over m); output 'm' + output term = stacked(0). E.g. 'ij,jk->ik' with a per-model weight and a
    shared input becomes 'ij,mjk->mik'.
    """
    terms, out = _explicit(g.attr("equation"))
    m = next(c for c in string.ascii_letters if c not in g.attr("equation"))
    ins, new_terms = [], []
    for i, term in enumerate(terms):
        if g.is_shared(i):
            ins.append(g.shared(i))
            new_terms.append(term)
        else:
            ins.append(g.get(i, stacked(0)))
            new_terms.append(m + term)
    g.emit_same(ins, stacked(0), equation=",".join(new_terms) + "->" + m + out)
