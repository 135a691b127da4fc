"""Elementwise ops: unary ones keep any layout; n-ary ones broadcast their operands per model."""
from __future__ import annotations

from typing import TYPE_CHECKING

from onnxfuse.core.layout import stacked
from onnxfuse.core.rules._common import broadcast_inputs
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup

UNARY = (
    "Relu", "Sigmoid", "Tanh", "Exp", "Log", "Abs", "Neg", "Sqrt", "Reciprocal", "Erf", "Softplus", "Softsign",
    "LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish", "Gelu", "Mish", "ThresholdedRelu", "Floor",
    "Ceil", "Round", "Sign", "Not", "IsNaN", "IsInf", "Cast", "Sin", "Cos", "Identity", "Shrink", "Tan", "Asin",
    "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "BitwiseNot",
)
NARY = (
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Mod", "Equal", "Less", "LessOrEqual",
    "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Where", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitShift",
)


def _own_layout(g: "NodeGroup"):
    L = g.layout(0)
    return stacked(0) if L is None or L.is_shared else L


@rule(*UNARY)
def fuse_unary(g: "NodeGroup") -> None:
    """f(x) elementwise: any layout in, the same layout out (y_b = f(x_b) wherever x_b lives)."""
    L = _own_layout(g)
    g.emit_same([g.get(0, L)], L)


@rule("Clip")
def fuse_clip(g: "NodeGroup") -> None:
    """Clip(x, min, max): x keeps its layout; min and max must be shared scalars (the same for every model)."""
    L = _own_layout(g)
    g.emit_same([g.get(0, L)] + [g.shared(i) if g.has_input(i) else "" for i in range(1, g.num_inputs)], L)


@rule("CastLike")
def fuse_cast_like(g: "NodeGroup") -> None:
    """CastLike(x, target) = Cast(x, to=target's element type): x keeps its layout (shared stays shared). Only the
    target's type is read, so it is neither converted nor required to be shared (torch's dynamo exporter writes
    CastLike(constant, activation) for every Python scalar in the forward). Emitted as Cast, which every runtime
    differentiates."""
    to = g.input_dtype(1)
    if to is None:
        g.fail("the element type of input 1 (the target) is unknown")
    L = g.layout(0)
    L = stacked(0) if L is None else L  # a per-model weight, packed [B, ...]
    x = g.shared(0) if L.is_shared else g.get(0, L)
    g.set_output(0, g.emit("Cast", [x], [g.out_name(0)], to=to)[0], L)


@rule(*NARY)
def fuse_nary(g: "NodeGroup") -> None:
    """f(x, y, ...) with numpy broadcasting.

    Layout: the first full-rank per-model operand's layout when the others can follow by broadcasting, else
    stacked on that axis, else stacked(0). Per-model weights are packed to cover the output axes from the model
    axis on (e.g. a [C,1,1] bias next to [N, B*C, H, W] becomes [B*C,1,1]); shared operands gain a size-1 model
    axis where needed. Math: broadcasting then pairs model b's operands only with each other.
    """
    inputs, L = broadcast_inputs(g, range(g.num_inputs))
    g.emit_same(inputs, L)


@rule("PRelu")
def fuse_prelu(g: "NodeGroup") -> None:
    """PRelu(x, slope): as the n-ary ops, except that ONNX broadcasts slope to x's shape only (unidirectionally:
    the output has x's shape), so x must carry the model axis itself. A shared x next to a per-model slope is given
    one copy per model first (Expand); a shared output size [N, ...] would otherwise be declared for a per-model
    value, and ONNX Runtime then reuses a buffer of the wrong size."""
    inputs, L = broadcast_inputs(g, [0, 1])
    if g.is_shared(0):
        inputs[0] = g.get(0, L)
    g.emit_same(inputs, L)


@rule("Dropout", shared_passthrough=False)
def fuse_dropout(g: "NodeGroup") -> None:
    """Dropout: any layout in and out; ratio and training_mode are shared. A shared input is first given one
    copy per model, so each model draws its own mask as it would when trained alone."""
    L = _own_layout(g)
    g.emit_same([g.get(0, L)] + [g.shared(i) if g.has_input(i) else "" for i in range(1, g.num_inputs)], L)
