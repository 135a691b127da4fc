"""Elementwise ops: activations, arithmetic, comparisons, casts, Clip, Where. Each fused layout passes through
them unchanged (the rules in ``core/rules/elementwise.py`` align the operands), so a kernel is torch's own op."""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from onnxfuse.runtime.torch.kernels._base import (
    Kernel,
    NodeSpec,
    all_inputs,
    autocast_lowered,
    identity,
    kern,
    op,
    torch_dtype,
)

_UNARY: dict[str, Callable] = {
    "Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Exp": torch.exp, "Log": torch.log,
    "Abs": torch.abs, "Neg": torch.neg, "Sqrt": torch.sqrt, "Reciprocal": torch.reciprocal, "Erf": torch.erf,
    "Softplus": F.softplus, "Softsign": F.softsign, "HardSwish": F.hardswish, "Mish": F.mish,
    "Floor": torch.floor, "Ceil": torch.ceil, "Round": torch.round, "Sign": torch.sign, "Not": torch.logical_not,
    "IsNaN": torch.isnan, "Sin": torch.sin, "Cos": torch.cos, "Identity": identity,
    "Tan": torch.tan, "Asin": torch.asin, "Acos": torch.acos, "Atan": torch.atan, "Sinh": torch.sinh,
    "Cosh": torch.cosh, "Asinh": torch.asinh, "Acosh": torch.acosh, "Atanh": torch.atanh,
    "BitwiseNot": torch.bitwise_not,
}


@op(*_UNARY)
def unary(spec: NodeSpec) -> Kernel:
    """y = f(x) elementwise (Round: half to even in both)."""
    return kern(_UNARY[spec.op_type], 0)


@op("LeakyRelu")
def leaky_relu(spec: NodeSpec) -> Kernel:
    alpha = float(spec.attr("alpha", 0.01))
    return kern(lambda x: F.leaky_relu(x, alpha), 0)


@op("Elu", "Celu")
def elu(spec: NodeSpec) -> Kernel:
    alpha = float(spec.attr("alpha", 1.0))
    f = F.elu if spec.op_type == "Elu" else F.celu
    return kern(lambda x: f(x, alpha), 0)


@op("Selu")
def selu(spec: NodeSpec) -> Kernel:
    """gamma * (x if x > 0 else alpha * (exp(x) - 1)); torch's constants give F.selu itself."""
    alpha = float(spec.attr("alpha", 1.67326319217681884765625))
    gamma = float(spec.attr("gamma", 1.05070102214813232421875))
    if abs(alpha - 1.6732632423543772) < 1e-6 and abs(gamma - 1.0507009873554805) < 1e-6:
        return kern(F.selu, 0)
    return kern(lambda x: F.elu(x, alpha) * gamma, 0)


@op("HardSigmoid")
def hard_sigmoid(spec: NodeSpec) -> Kernel:
    """clamp(alpha * x + beta, 0, 1); alpha 1/6, beta 1/2 is torch's Hardsigmoid (same gradient too)."""
    alpha, beta = float(spec.attr("alpha", 0.2)), float(spec.attr("beta", 0.5))
    if abs(alpha - 1 / 6) < 1e-7 and beta == 0.5:
        return kern(F.hardsigmoid, 0)
    return kern(lambda x: torch.clamp(x * alpha + beta, 0.0, 1.0), 0)


@op("Gelu")
def gelu(spec: NodeSpec) -> Kernel:
    approximate = spec.attr("approximate", "none")
    return kern(lambda x: F.gelu(x, approximate=approximate), 0)


@op("ThresholdedRelu")
def thresholded_relu(spec: NodeSpec) -> Kernel:
    alpha = float(spec.attr("alpha", 1.0))
    return kern(lambda x: F.threshold(x, alpha, 0.0), 0)


@op("Shrink")
def shrink(spec: NodeSpec) -> Kernel:
    """x - bias where x > lambd, x + bias where x < -lambd, else 0."""
    bias, lambd = float(spec.attr("bias", 0.0)), float(spec.attr("lambd", 0.5))
    if bias == lambd:
        return kern(lambda x: F.softshrink(x, lambd), 0)
    if bias == 0.0:
        return kern(lambda x: F.hardshrink(x, lambd), 0)
    return kern(lambda x: torch.where(x > lambd, x - bias, torch.where(x < -lambd, x + bias, torch.zeros_like(x))), 0)


@op("IsInf")
def is_inf(spec: NodeSpec) -> Kernel:
    neg, pos = int(spec.attr("detect_negative", 1)), int(spec.attr("detect_positive", 1))
    f = torch.isinf if neg and pos else torch.isneginf if neg else torch.isposinf if pos else \
        (lambda x: torch.zeros_like(x, dtype=torch.bool))
    return kern(f, 0)


@op("Cast")
def cast(spec: NodeSpec) -> Kernel:
    dtype = torch_dtype(int(spec.attr("to")))
    return kern(lambda x: x.to(dtype), 0)  # float -> int truncates toward zero in both


@op("CastLike")
def cast_like(spec: NodeSpec) -> Kernel:
    return kern(lambda x, like: x.to(like.dtype), 0, 1)


def _int_div(a, b):
    if a.is_floating_point() or b.is_floating_point():
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc")  # ONNX integer Div truncates (C semantics)


_BINARY: dict[str, Callable] = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": _int_div,
    "Equal": torch.eq, "Less": torch.lt, "LessOrEqual": torch.le, "Greater": torch.gt, "GreaterOrEqual": torch.ge,
    "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor,
    "BitwiseAnd": torch.bitwise_and, "BitwiseOr": torch.bitwise_or, "BitwiseXor": torch.bitwise_xor,
}


@op(*_BINARY)
def binary(spec: NodeSpec) -> Kernel:
    """numpy broadcasting in both. A float Div is a plain division (no per-call dtype test needed then)."""
    f = _BINARY[spec.op_type]
    if f is _int_div and any(c is not None and c.is_floating_point() for c in spec.consts):
        f = torch.div
    return kern(f, 0, 1)


@op("Pow")
def pow_(spec: NodeSpec) -> Kernel:
    """x ** y, the result in x's type; a constant scalar exponent is passed as a Python number."""
    e = spec.const(1)
    if e is not None and e.numel() == 1:
        v = e.reshape(-1)[0].item()
        if float(v) == 2.0:
            return kern(torch.square, 0)
        return kern(lambda x: torch.pow(x, v), 0)
    return kern(lambda x, y: torch.pow(x, y).to(x.dtype), 0, 1)


@op("BitShift")
def bit_shift(spec: NodeSpec) -> Kernel:
    """x << y or x >> y (``direction`` LEFT / RIGHT) on unsigned integers, the bits shifted out dropped. torch
    shifts uint8 itself; wider unsigned types are shifted as int64 bit patterns (a right shift then clears the
    sign-extended bits: a logical shift, as for an unsigned type) and cast back."""
    left = spec.attr("direction") == "LEFT"

    def fn(x, y):
        if x.dtype == torch.uint8:
            return (torch.bitwise_left_shift if left else torch.bitwise_right_shift)(x, y)
        a, s = x.to(torch.int64), y.to(torch.int64)
        if left:
            return torch.bitwise_left_shift(a, s).to(x.dtype)
        kept = torch.bitwise_left_shift(torch.ones_like(a), (64 - s).clamp(max=63)) - 1  # the low 64 - s bits
        return torch.where(s > 0, torch.bitwise_right_shift(a, s) & kept, a).to(x.dtype)
    return kern(fn, 0, 1)


@op("Mod")
def mod(spec: NodeSpec) -> Kernel:
    """fmod 0: the sign of the divisor (Python's %, torch.remainder); fmod 1: the sign of the dividend (C fmod)."""
    f = torch.fmod if int(spec.attr("fmod", 0)) else torch.remainder
    return kern(f, 0, 1)


def _variadic(f2):
    def fn(*xs):
        return functools.reduce(f2, xs)
    return fn


@op("Max", "Min", "Sum", "Mean")
def variadic(spec: NodeSpec) -> Kernel:
    n = len(spec.node.input)
    if n == 1:
        return kern(identity, 0)
    f = {"Max": torch.maximum, "Min": torch.minimum, "Sum": torch.add, "Mean": torch.add}[spec.op_type]
    fn = _variadic(f)
    if spec.op_type == "Mean":
        return kern(lambda *xs: fn(*xs) / n, *all_inputs(spec))
    return kern(fn, *all_inputs(spec))


@op("Where")
def where(spec: NodeSpec) -> Kernel:
    return kern(torch.where, 0, 1, 2)


@op("Clip")
def clip(spec: NodeSpec) -> Kernel:
    """clamp(x, min, max). Constant float bounds give F.hardtanh: the same values, and the gradient torch's ReLU6 and
    Hardtanh have (none at the bounds themselves)."""
    if spec.opset < 11:
        lo, hi = spec.attr("min"), spec.attr("max")
    else:
        if (spec.has(1) and spec.const(1) is None) or (spec.has(2) and spec.const(2) is None):
            has_lo, has_hi = spec.has(1), spec.has(2)

            def dynamic(x, *bounds):  # bounds computed at run time (tensors)
                return torch.clamp(x, bounds[0] if has_lo else None, bounds[-1] if has_hi else None)
            return kern(dynamic, 0, *[i for i in (1, 2) if spec.has(i)])
        lo, hi = spec.scalar(1), spec.scalar(2)
    if lo is None and hi is None:
        return kern(identity, 0)
    if lo is not None and hi is not None and isinstance(lo, float) and isinstance(hi, float) and lo <= hi:
        return kern(lambda x: F.hardtanh(x, lo, hi) if x.is_floating_point() else torch.clamp(x, lo, hi), 0)
    return kern(lambda x: torch.clamp(x, lo, hi), 0)


@op("PRelu")
def prelu(spec: NodeSpec) -> Kernel:
    """x where x > 0, else slope * x (slope broadcast to x); the gradient of F.prelu. Under autocast in its lower
    precision, as autocast runs ``prelu``."""
    def fn(x, slope):
        x, slope = autocast_lowered(x, slope)
        return torch.where(x > 0, x, x * slope)
    return kern(fn, 0, 1)
