"""Piecewise-linear activations without a gradient builder in ORT 1.19: HardSigmoid and HardSwish.

Both become Clip (whose gradient ORT has) with the same constants torch uses, so the forward matches and the
gradient is torch's away from the kinks (the exact kink points x = -3, 3 are measure zero)."""
from __future__ import annotations

import onnx

from ._engine import Context, Emitter, rewrite

__all__ = ["hardsigmoid", "hardswish"]


@rewrite("HardSigmoid")
def hardsigmoid(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """HardSigmoid(x; alpha, beta) = max(0, min(1, alpha*x + beta))  ==>  Clip(x * alpha + beta, 0, 1).

    Layout: elementwise, any shape.
    Math: d/dx = alpha where 0 < alpha*x + beta < 1, else 0; torch's nn.Hardsigmoid exports alpha = 1/6, beta = 1/2:
    relu6(x + 3) / 6 with gradient 1/6 on (-3, 3).
    """
    x, y = node.input[0], node.output[0]
    attrs = ctx.attrs(node)
    alpha, beta = float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5))
    em = Emitter(node, ctx)
    z = em.op("Add", [em.op("Mul", [x, em.like(alpha, x, "alpha")]), em.like(beta, x, "beta")])
    em.op("Clip", [z, em.like(0.0, x, "zero"), em.like(1.0, x, "one")], [y])
    return em.nodes


@rewrite("HardSwish")
def hardswish(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """HardSwish(x) = x * max(0, min(1, x/6 + 1/2))  ==>  x * Clip(x + 3, 0, 6) / 6 (torch's own arithmetic).

    Layout: elementwise, any shape.
    Math: d/dx = 0 for x < -3, x/3 + 1/2 on (-3, 3), 1 for x > 3 (the product rule over Mul and Clip gives
    (x+3)/6 + x/6 inside), which is torch's hardswish_backward.
    """
    x, y = node.input[0], node.output[0]
    em = Emitter(node, ctx)
    relu6 = em.op("Clip", [em.op("Add", [x, em.like(3.0, x, "three")]), em.like(0.0, x, "zero"),
                           em.like(6.0, x, "six")])
    em.op("Div", [em.op("Mul", [x, relu6]), em.like(6.0, x, "six")], [y])
    return em.nodes
