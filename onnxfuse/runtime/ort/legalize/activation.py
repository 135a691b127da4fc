"""Activations without a gradient builder in ORT 1.19: HardSigmoid, HardSwish, Elu, Selu, Celu, Softplus, PRelu, Sign.

Each becomes ops whose gradients ORT has (Clip, Relu, Min, Exp, Abs, Log, Mul, Add) with torch's constants, so the
forward matches and the gradient is torch's away from kinks (x = 0, or -3 and 3: measure zero)."""
from __future__ import annotations

import onnx

from onnxfuse.core.rewrite import Context, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["hardsigmoid", "hardswish", "elu_family", "softplus", "prelu", "sign"]


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


@rewrite("Elu", "Selu", "Celu")
def elu_family(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """Elu(x; alpha)         = x if x > 0 else alpha (exp(x) - 1)
    Selu(x; alpha, gamma) = gamma Elu(x; alpha);   Celu(x; alpha) = x if x > 0 else alpha (exp(x / alpha) - 1)
    ==>  [gamma *] (Relu(x) + alpha * (Exp(Min(x, 0) [/ alpha]) - 1)).

    Layout: elementwise, any shape.
    Math: for x > 0 the second term is alpha (exp(0) - 1) = 0 exactly; Min(x, 0) keeps Exp from overflowing on the
    branch that is not taken. d/dx = 1 for x > 0, alpha exp(x) (Celu: exp(x / alpha)) below, torch's backward.
    """
    x, y = node.input[0], node.output[0]
    attrs = ctx.attrs(node)
    default_alpha = {"Elu": 1.0, "Celu": 1.0, "Selu": 1.67326319217681884765625}[node.op_type]
    alpha = float(attrs.get("alpha", default_alpha))
    gamma = float(attrs.get("gamma", 1.05070102214813232421875)) if node.op_type == "Selu" else None
    em = Emitter(node, ctx)
    negative = em.op("Min", [x, em.like(0.0, x, "zero")])
    if node.op_type == "Celu":
        negative = em.op("Div", [negative, em.like(alpha, x, "alpha")])
    expm1 = em.op("Sub", [em.op("Exp", [negative]), em.like(1.0, x, "one")])
    out = em.op("Add", [em.op("Relu", [x]), em.op("Mul", [expm1, em.like(alpha, x, "alpha")])])
    if gamma is not None:
        out = em.op("Mul", [out, em.like(gamma, x, "gamma")])
    em.finish(out, y)
    return em.nodes


@rewrite("Softplus")
def softplus(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """Softplus(x) = log(exp(x) + 1)  ==>  Relu(x) + Log(1 + Exp(-Abs(x))) (the form that cannot overflow).

    Layout: elementwise, any shape (torch's nn.Softplus and nn.Mish export Softplus).
    Math: log(1 + e^x) = max(x, 0) + log(1 + e^-|x|); d/dx = sigmoid(x), torch's backward (which returns 1 above its
    threshold 20, where sigmoid(x) rounds to 1 in float32).
    """
    x, y = node.input[0], node.output[0]
    em = Emitter(node, ctx)
    tail = em.op("Exp", [em.op("Neg", [em.op("Abs", [x])])])
    log_term = em.op("Log", [em.op("Add", [tail, em.like(1.0, x, "one")])])
    em.op("Add", [em.op("Relu", [x]), log_term], [y])
    return em.nodes


@rewrite("PRelu")
def prelu(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """PRelu(x, slope) = x if x > 0 else slope * x  ==>  Relu(x) + slope * Min(x, 0).

    Layout: x [N, C, ...]; slope broadcastable to x (torch: [C, 1, ..] after an Unsqueeze, or [1]).
    Math: d/dx = 1 for x > 0, slope below; d/dslope = min(x, 0) summed over the broadcast axes, torch's backward.
    """
    x, slope, y = node.input[0], node.input[1], node.output[0]
    em = Emitter(node, ctx)
    negative = em.op("Mul", [em.op("Min", [x, em.like(0.0, x, "zero")]), slope])
    em.op("Add", [em.op("Relu", [x]), negative], [y])
    return em.nodes


@rewrite("Sign")
def sign(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """Sign(x)  ==>  Where(x > 0, 1, Where(x < 0, -1, 0)).

    Layout: elementwise, any shape (x float; an integer Sign is never on a gradient path and is left alone).
    Math: the same values; its gradient is 0 wherever it exists, which is what Where gives (its condition is not
    differentiable and its branches are constants). torch's LPPool exports Sign(avg) * Relu(Abs(avg)); ORT 1.19 has
    no gradient builder for Sign.
    """
    x, y = node.input[0], node.output[0]
    if not ctx.is_float(x):
        return None
    em = Emitter(node, ctx)
    zero = em.like(0.0, x, "zero")
    negative = em.op("Where", [em.op("Less", [x, zero]), em.like(-1.0, x, "minus_one"), zero])
    em.op("Where", [em.op("Greater", [x, zero]), em.like(1.0, x, "one"), negative], [y])
    return em.nodes
