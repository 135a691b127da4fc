"""ONNX ops as torch callables: one small builder per op type, registered in ``OPS`` (op type -> builder, a
:class:`~onnxfuse.core.registry.Registry`).

A builder runs once, when a graph is converted (``torch_graph.OnnxModule``). It reads the node's attributes and the
inputs that are constants (a Reshape target, Slice starts, Clip bounds...) from a :class:`NodeSpec` and returns a
:class:`Kernel`: a callable over torch tensors and the indices of the node inputs it takes at run time. The forward
pass therefore parses nothing: it calls ``kernel.fn(*tensors)``. A kernel returns one tensor, or a tuple with one
entry per node output.

Covered: every op the fusion rules emit or accept (``onnxfuse.core.rules.RULES``; a per-model fallback copies source
nodes verbatim) and every op the load passes emit, in opsets 13..20, including the forms that changed in that range
(axes as attribute or input, Split sizes as input or ``num_outputs``, Resize 13/18/19, BatchNormalization 9/14/15).
float32 data, and the int64/bool shape arithmetic around it. Shape-like inputs that are not constants are read with
``.tolist()``; ``torch_graph`` keeps shape arithmetic on the host, so that is no device synchronisation.

Adding an op = one ``@op("OpType")`` builder here and one test in tests/test_torch_ops.py.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

from onnxfuse.core._graph import node_label
from onnxfuse.core._opset import is_training_batchnorm
from onnxfuse.core._resize import nearest_index, source_coords
from onnxfuse.core.errors import OnnxFuseError
from onnxfuse.core.registry import Registry
from onnxfuse.core.windows import floor_mode_end_pad, output_length, same_pads

__all__ = ["OPS", "op", "Kernel", "NodeSpec", "node_outputs", "TorchOptions", "UnsupportedTorchOpError",
           "supported_ops", "torch_dtype", "HOST_OPS", "RANDOM_OPS"]


class UnsupportedTorchOpError(OnnxFuseError):
    """A node the torch runtime cannot run (an op type without a builder, or an attribute form it does not cover)."""


class Kernel(NamedTuple):
    fn: Callable[..., Any]
    inputs: tuple[int, ...]  # the node inputs fn takes, in this order (an absent optional input is passed as None)
    host_inputs: tuple[int, ...] = ()  # of those, the ones fn reads as values (.tolist()): best kept on the host


@dataclass(frozen=True)
class TorchOptions:
    """Choices that are not ONNX attributes.

    update_stats: a training-mode BatchNorm whose running statistics are buffers of the module updates them in
        place during the forward pass, as ``torch.nn.BatchNorm*`` does; otherwise it leaves them and only returns
        the new values (outputs 1 and 2), for a runtime that writes them itself.
    running_var: "unbiased" (torch's rule, what the ORT runtime's ``batchnorm_pass`` writes: the batch variance
        times n/(n-1)) or "biased" (the ONNX specification's).
    """

    update_stats: bool = True
    running_var: str = "unbiased"


@dataclass
class NodeSpec:
    """What a builder may read: the node, its opset, decoded attributes and the constant inputs."""

    node: onnx.NodeProto
    opset: int
    attrs: dict[str, Any]
    consts: list[torch.Tensor | None]  # per input: its value when it is a constant, else None
    training: bool = True  # built for module.train() (True) or module.eval()
    options: TorchOptions = field(default_factory=TorchOptions)
    writable: tuple[bool, ...] = ()  # per input: a module buffer that this node alone reads (may update in place)
    used_outputs: tuple[bool, ...] = ()  # per output: read by another node or returned
    device: Callable[[], torch.device] = lambda: torch.device("cpu")  # the module's device, for new tensors

    @classmethod
    def of(cls, node: onnx.NodeProto, opset: int, consts: Sequence[torch.Tensor | None] = (), **kw) -> "NodeSpec":
        attrs = {a.name: _attr_value(a) for a in node.attribute}
        consts = list(consts) + [None] * (len(node.input) - len(consts))
        kw.setdefault("used_outputs", tuple(bool(o) for o in node_outputs(node)))
        return cls(node, opset, attrs, consts, **kw)

    @property
    def n_outputs(self) -> int:
        """Outputs the kernel returns: one tensor when 1, else a tuple of this length (None where unread)."""
        return len(self.used_outputs)

    @property
    def op_type(self) -> str:
        return self.node.op_type

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def has(self, i: int) -> bool:
        return i < len(self.node.input) and bool(self.node.input[i])

    def const(self, i: int) -> torch.Tensor | None:
        return self.consts[i] if self.has(i) else None

    def ints(self, i: int) -> list[int] | None:
        """Constant input i as a list of ints (None when absent or computed at run time)."""
        c = self.const(i)
        return None if c is None else [int(v) for v in c.reshape(-1).tolist()]

    def scalar(self, i: int, default=None):
        """Constant input i as a Python number; ``default`` when absent."""
        if not self.has(i):
            return default
        c = self.const(i)
        return None if c is None else c.reshape(-1)[0].item()

    def fail(self, problem: str, fix: str) -> None:
        raise UnsupportedTorchOpError(
            f"node '{node_label(self.node)}' ({self.op_type}, opset {self.opset}): {problem}. "
            f"To fix this, {fix}")

    def need_const(self, i: int, what: str) -> None:
        if self.has(i) and self.const(i) is None:
            self.fail(f"its {what} (input {i}) is computed at run time, and the torch runtime needs it constant",
                      "make it a constant in the model, or train this array with --runtime ort")


def node_outputs(node: onnx.NodeProto) -> list[str]:
    """The outputs a kernel of ``node`` returns: the node's, without trailing absent ones (at least one)."""
    outs = list(node.output)
    while len(outs) > 1 and not outs[-1]:
        outs.pop()
    return outs


Builder = Callable[[NodeSpec], "Kernel | Callable"]
OPS: Registry[Builder] = Registry("torch kernel")

# Ops whose outputs are small shape-like values when their inputs are (torch_graph keeps those on the host).
HOST_OPS = frozenset({
    "Shape", "Size", "Gather", "Concat", "Slice", "Unsqueeze", "Squeeze", "Reshape", "Cast", "Add", "Sub", "Mul",
    "Div", "Mod", "Neg", "Abs", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or",
    "Where", "Max", "Min", "ReduceProd", "ReduceSum", "ReduceMax", "ReduceMin", "Identity", "Floor", "Ceil", "Sqrt",
    "Flatten", "Transpose", "Expand", "Tile", "Sign", "CastLike",
})
# Ops never evaluated at build time even on constant inputs.
RANDOM_OPS = frozenset({"Dropout", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                        "Bernoulli", "Multinomial"})


def op(*op_types: str):
    """Register the decorated builder for ``op_types`` (default domain)."""
    return OPS.register(*op_types)


def supported_ops() -> list[str]:
    return OPS.names()


def _attr_value(a: onnx.AttributeProto) -> Any:
    if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return a  # subgraphs: no builder here reads them
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, onnx.TensorProto):
        return torch.from_numpy(numpy_helper.to_array(v).copy())
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [s.decode() for s in v]
    return v


_DTYPES = {
    onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16, onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT64: torch.int64, onnx.TensorProto.INT32: torch.int32, onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT8: torch.int8, onnx.TensorProto.UINT8: torch.uint8, onnx.TensorProto.BOOL: torch.bool,
}


def torch_dtype(elem_type: int) -> torch.dtype:
    if elem_type not in _DTYPES:
        raise UnsupportedTorchOpError(f"ONNX element type {onnx.TensorProto.DataType.Name(elem_type)} has no torch "
                                      "dtype here; use float32 data and int64/bool shape tensors")
    return _DTYPES[elem_type]


def _k(fn, *inputs: int, host: Sequence[int] = ()) -> Kernel:
    return Kernel(fn, tuple(inputs), tuple(host))


def _all(spec: NodeSpec) -> tuple[int, ...]:
    return tuple(range(len(spec.node.input)))


def _norm(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _identity(x):
    return x


# ------------------------------------------------------------------------------------------------- elementwise
_UNARY: dict[str, Callable] = {
    "Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Exp": torch.exp, "Log": torch.log,
    "Abs": torch.abs, "Neg": torch.neg, "Sqrt": torch.sqrt, "Reciprocal": torch.reciprocal, "Erf": torch.erf,
    "Softplus": F.softplus, "Softsign": F.softsign, "HardSwish": F.hardswish, "Mish": F.mish,
    "Floor": torch.floor, "Ceil": torch.ceil, "Round": torch.round, "Sign": torch.sign, "Not": torch.logical_not,
    "IsNaN": torch.isnan, "Sin": torch.sin, "Cos": torch.cos, "Identity": _identity,
}


@op(*_UNARY)
def unary(spec: NodeSpec) -> Kernel:
    """y = f(x) elementwise (Round: half to even in both)."""
    return _k(_UNARY[spec.op_type], 0)


@op("LeakyRelu")
def leaky_relu(spec: NodeSpec) -> Kernel:
    alpha = float(spec.attr("alpha", 0.01))
    return _k(lambda x: F.leaky_relu(x, alpha), 0)


@op("Elu", "Celu")
def elu(spec: NodeSpec) -> Kernel:
    alpha = float(spec.attr("alpha", 1.0))
    f = F.elu if spec.op_type == "Elu" else F.celu
    return _k(lambda x: f(x, alpha), 0)


@op("Selu")
def selu(spec: NodeSpec) -> Kernel:
    """gamma * (x if x > 0 else alpha * (exp(x) - 1)); torch's constants give F.selu itself."""
    alpha = float(spec.attr("alpha", 1.67326319217681884765625))
    gamma = float(spec.attr("gamma", 1.05070102214813232421875))
    if abs(alpha - 1.6732632423543772) < 1e-6 and abs(gamma - 1.0507009873554805) < 1e-6:
        return _k(F.selu, 0)
    return _k(lambda x: F.elu(x, alpha) * gamma, 0)


@op("HardSigmoid")
def hard_sigmoid(spec: NodeSpec) -> Kernel:
    """clamp(alpha * x + beta, 0, 1); alpha 1/6, beta 1/2 is torch's Hardsigmoid (same gradient too)."""
    alpha, beta = float(spec.attr("alpha", 0.2)), float(spec.attr("beta", 0.5))
    if abs(alpha - 1 / 6) < 1e-7 and beta == 0.5:
        return _k(F.hardsigmoid, 0)
    return _k(lambda x: torch.clamp(x * alpha + beta, 0.0, 1.0), 0)


@op("Gelu")
def gelu(spec: NodeSpec) -> Kernel:
    approximate = spec.attr("approximate", "none")
    return _k(lambda x: F.gelu(x, approximate=approximate), 0)


@op("ThresholdedRelu")
def thresholded_relu(spec: NodeSpec) -> Kernel:
    alpha = float(spec.attr("alpha", 1.0))
    return _k(lambda x: F.threshold(x, alpha, 0.0), 0)


@op("Shrink")
def shrink(spec: NodeSpec) -> Kernel:
    """x - bias where x > lambd, x + bias where x < -lambd, else 0."""
    bias, lambd = float(spec.attr("bias", 0.0)), float(spec.attr("lambd", 0.5))
    if bias == lambd:
        return _k(lambda x: F.softshrink(x, lambd), 0)
    if bias == 0.0:
        return _k(lambda x: F.hardshrink(x, lambd), 0)
    return _k(lambda x: torch.where(x > lambd, x - bias, torch.where(x < -lambd, x + bias, torch.zeros_like(x))), 0)


@op("IsInf")
def is_inf(spec: NodeSpec) -> Kernel:
    neg, pos = int(spec.attr("detect_negative", 1)), int(spec.attr("detect_positive", 1))
    f = torch.isinf if neg and pos else torch.isneginf if neg else torch.isposinf if pos else \
        (lambda x: torch.zeros_like(x, dtype=torch.bool))
    return _k(f, 0)


@op("Cast")
def cast(spec: NodeSpec) -> Kernel:
    dtype = torch_dtype(int(spec.attr("to")))
    return _k(lambda x: x.to(dtype), 0)  # float -> int truncates toward zero in both


@op("CastLike")
def cast_like(spec: NodeSpec) -> Kernel:
    return _k(lambda x, like: x.to(like.dtype), 0, 1)


def _int_div(a, b):
    if a.is_floating_point() or b.is_floating_point():
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc")  # ONNX integer Div truncates (C semantics)


_BINARY: dict[str, Callable] = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": _int_div,
    "Equal": torch.eq, "Less": torch.lt, "LessOrEqual": torch.le, "Greater": torch.gt, "GreaterOrEqual": torch.ge,
    "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor,
}


@op(*_BINARY)
def binary(spec: NodeSpec) -> Kernel:
    """numpy broadcasting in both. A float Div is a plain division (no per-call dtype test needed then)."""
    f = _BINARY[spec.op_type]
    if f is _int_div and any(c is not None and c.is_floating_point() for c in spec.consts):
        f = torch.div
    return _k(f, 0, 1)


@op("Pow")
def pow_(spec: NodeSpec) -> Kernel:
    """x ** y, the result in x's type; a constant scalar exponent is passed as a Python number."""
    e = spec.const(1)
    if e is not None and e.numel() == 1:
        v = e.reshape(-1)[0].item()
        if float(v) == 2.0:
            return _k(torch.square, 0)
        return _k(lambda x: torch.pow(x, v), 0)
    return _k(lambda x, y: torch.pow(x, y).to(x.dtype), 0, 1)


@op("Mod")
def mod(spec: NodeSpec) -> Kernel:
    """fmod 0: the sign of the divisor (Python's %, torch.remainder); fmod 1: the sign of the dividend (C fmod)."""
    f = torch.fmod if int(spec.attr("fmod", 0)) else torch.remainder
    return _k(f, 0, 1)


def _variadic(f2):
    def fn(*xs):
        return functools.reduce(f2, xs)
    return fn


@op("Max", "Min", "Sum", "Mean")
def variadic(spec: NodeSpec) -> Kernel:
    n = len(spec.node.input)
    if n == 1:
        return _k(_identity, 0)
    f = {"Max": torch.maximum, "Min": torch.minimum, "Sum": torch.add, "Mean": torch.add}[spec.op_type]
    fn = _variadic(f)
    if spec.op_type == "Mean":
        return _k(lambda *xs: fn(*xs) / n, *_all(spec))
    return _k(fn, *_all(spec))


@op("Where")
def where(spec: NodeSpec) -> Kernel:
    return _k(torch.where, 0, 1, 2)


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
            return _k(dynamic, 0, *[i for i in (1, 2) if spec.has(i)])
        lo, hi = spec.scalar(1), spec.scalar(2)
    if lo is None and hi is None:
        return _k(_identity, 0)
    if lo is not None and hi is not None and isinstance(lo, float) and isinstance(hi, float) and lo <= hi:
        return _k(lambda x: F.hardtanh(x, lo, hi) if x.is_floating_point() else torch.clamp(x, lo, hi), 0)
    return _k(lambda x: torch.clamp(x, lo, hi), 0)


def autocast_lowered(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` as torch.autocast hands them to an op it runs in lower precision (``prelu``, ...): the floating
    ones cast to the autocast dtype while autocast is on for their device, else as they are. For a kernel that
    computes such an op with other torch ops, which autocast would leave in their inputs' precision."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


@op("PRelu")
def prelu(spec: NodeSpec) -> Kernel:
    """x where x > 0, else slope * x (slope broadcast to x); the gradient of F.prelu. Under autocast in its lower
    precision, as autocast runs ``prelu``."""
    def fn(x, slope):
        x, slope = autocast_lowered(x, slope)
        return torch.where(x > 0, x, x * slope)
    return _k(fn, 0, 1)


@op("Dropout")
def dropout(spec: NodeSpec) -> Kernel:
    """Dropout(x, ratio, training_mode). Off unless training_mode is true and the module is in train mode; the mask
    output (if read) is True where x was kept. Each element draws its own mask, so each fused model does too."""
    if spec.opset < 12:
        ratio, on = float(spec.attr("ratio", 0.5)), spec.training
    else:
        spec.need_const(1, "ratio")
        spec.need_const(2, "training_mode")
        ratio, on = float(spec.scalar(1, 0.5)), bool(spec.scalar(2, False))
    on = on and spec.training and ratio > 0.0
    two = spec.n_outputs > 1
    want_mask = two and spec.used_outputs[1]
    if not on:
        if want_mask:
            return _k(lambda x: (x, torch.ones_like(x, dtype=torch.bool)), 0)
        return _k((lambda x: (x, None)) if two else _identity, 0)
    if want_mask:
        return _k(lambda x: torch.native_dropout(x, ratio, True), 0)
    return _k((lambda x: (F.dropout(x, ratio, True), None)) if two else (lambda x: F.dropout(x, ratio, True)), 0)


# ------------------------------------------------------------------------------------------ matrix products
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
    """The torch runtime's own node for a fused Linear under autocast (``runtime/precision.py``'s
    ``biased_products``): ``A [B, .., M, K] @ W [B, 1.., K, N] + C [B, 1.., N]`` as one baddbmm."""
    return _k(folded_baddbmm, 0, 1, 2)


@op("MatMul")
def matmul(spec: NodeSpec) -> Kernel:
    """torch.matmul, a fused Linear's product folded (:func:`folded_matmul`)."""
    return _k(folded_matmul, 0, 1)


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
        return _k(fn, 0, 1, 2)

    def fn2(a, b):
        a, b = operands(a, b)
        y = torch.mm(a, b)
        return y * alpha if alpha != 1.0 else y
    return _k(fn2, 0, 1)


@op("Einsum")
def einsum(spec: NodeSpec) -> Kernel:
    eq = spec.attr("equation").replace(" ", "")
    return _k(lambda *xs: torch.einsum(eq, *xs), *_all(spec))


# ------------------------------------------------------------------------------------- convolution, pooling
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _torch_pad(pads: Sequence[int], S: int) -> list[int]:
    """ONNX pads [b1..bS, e1..eS] over the spatial axes -> F.pad's (bS, eS, ..., b1, e1)."""
    out: list[int] = []
    for a in reversed(range(S)):
        out += [pads[a], pads[S + a]]
    return out


class _Window:
    """Spatial window attributes, with the pads resolved per input length when they depend on it (auto_pad SAME_*,
    ceil_mode: onnxfuse.core.windows' rules, the ONNX specification's since opset 19 and torch's)."""

    def __init__(self, spec: NodeSpec, S: int, kernel: Sequence[int] | None):
        self.S = S
        self.kernel = list(kernel) if kernel is not None else None
        self.strides = list(spec.attr("strides", [1] * S))
        self.dilations = list(spec.attr("dilations", [1] * S))
        self.auto_pad = spec.attr("auto_pad", "NOTSET")
        self.ceil = bool(spec.attr("ceil_mode", 0))
        self.pads = list(spec.attr("pads", [0] * (2 * S)))
        if self.auto_pad == "VALID":
            self.pads = [0] * (2 * S)
        self.static = self.auto_pad in ("NOTSET", "VALID") and not self.ceil

    def resolve(self, spatial: Sequence[int], kernel: Sequence[int] | None = None, ceil: bool | None = None
                ) -> list[int]:
        """Explicit pads [b.., e..] for these input lengths, in floor mode (``ceil``: the ceil-mode extra end pad,
        default the node's ceil_mode)."""
        k, S = list(kernel or self.kernel), self.S
        pads = list(self.pads)
        if self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            sp = [same_pads(spatial[a], k[a], self.strides[a], self.dilations[a], self.auto_pad == "SAME_UPPER")
                  for a in range(S)]
            pads = [p[0] for p in sp] + [p[1] for p in sp]
        if self.ceil if ceil is None else ceil:
            ends = []
            for a in range(S):
                n = output_length(spatial[a], k[a], self.strides[a], pads[a], pads[S + a], self.dilations[a], True)
                ends.append(floor_mode_end_pad(spatial[a], k[a], self.strides[a], pads[a], pads[S + a],
                                               self.dilations[a], n))
            pads = pads[:S] + ends
        return pads


def _symmetric(pads: Sequence[int], S: int) -> bool:
    return all(pads[a] == pads[S + a] for a in range(S))


@op("Conv")
def conv(spec: NodeSpec) -> Kernel:
    """F.conv{1,2,3}d with group; asymmetric or size-dependent (SAME_*) pads are an explicit F.pad first."""
    w = spec.const(1)
    kshape = spec.attr("kernel_shape") or (list(w.shape[2:]) if w is not None else None)
    S = len(kshape) if kshape is not None else len(spec.attr("strides", spec.attr("dilations", [1, 1])))
    if S not in _CONV:
        spec.fail(f"{S}-D convolution has no torch kernel", "use 1-, 2- or 3-D convolutions")
    win = _Window(spec, S, kshape)
    f, group, stride, dil = _CONV[S], int(spec.attr("group", 1)), win.strides, win.dilations
    ins = (0, 1, 2) if spec.has(2) else (0, 1)
    if win.static and _symmetric(win.pads, S):
        padding = win.pads[:S]
        return _k(lambda x, w, b=None: f(x, w, b, stride, padding, dil, group), *ins)

    def fn(x, w, b=None):
        pads = win.resolve(x.shape[2:], w.shape[2:])
        if _symmetric(pads, S):
            return f(x, w, b, stride, pads[:S], dil, group)
        return f(F.pad(x, _torch_pad(pads, S)), w, b, stride, 0, dil, group)
    return _k(fn, *ins)


@op("ConvTranspose")
def conv_transpose(spec: NodeSpec) -> Kernel:
    """F.conv_transpose{1,2,3}d. Output length per axis: s*(L-1) + op + d*(k-1) + 1 - pb - pe. Pads that torch cannot
    express (asymmetric, output_shape, auto_pad, output_padding >= stride) run as pads 0 and a crop/zero-pad of the
    full result, with the bias added after."""
    w = spec.const(1)
    kshape = spec.attr("kernel_shape") or (list(w.shape[2:]) if w is not None else None)
    S = len(kshape) if kshape is not None else len(spec.attr("strides", [1, 1]))
    f, group = _CONV_T[S], int(spec.attr("group", 1))
    stride, dil = list(spec.attr("strides", [1] * S)), list(spec.attr("dilations", [1] * S))
    op_ = list(spec.attr("output_padding", [0] * S))
    pads0 = list(spec.attr("pads", [0] * (2 * S)))
    out_shape = spec.attr("output_shape")
    auto_pad = spec.attr("auto_pad", "NOTSET")
    ins = (0, 1, 2) if spec.has(2) else (0, 1)
    simple = out_shape is None and auto_pad in ("NOTSET", "VALID") and _symmetric(pads0, S) and \
        all(o < max(s, d) for o, s, d in zip(op_, stride, dil))
    if simple:
        padding = pads0[:S] if auto_pad == "NOTSET" else [0] * S
        return _k(lambda x, w, b=None: f(x, w, b, stride, padding, op_, group, dil), *ins)

    def pads_for(L, k):
        if auto_pad == "VALID":
            return [0] * (2 * S)
        if out_shape is None and auto_pad == "NOTSET":
            return pads0
        target = list(out_shape)[-S:] if out_shape is not None else [L[a] * stride[a] for a in range(S)]
        pb, pe = [], []
        for a in range(S):
            total = stride[a] * (L[a] - 1) + op_[a] + (k[a] - 1) * dil[a] + 1 - target[a]
            if auto_pad == "SAME_UPPER":
                pb.append(total // 2); pe.append(total - total // 2)  # noqa: E702
            else:
                pb.append(total - total // 2); pe.append(total // 2)  # noqa: E702
        return pb + pe

    def fn(x, w, b=None):
        L, k = x.shape[2:], w.shape[2:]
        pads = pads_for(L, k)
        y = f(x, w, None, stride, 0, 0, group, dil)
        for a in range(S):
            full = y.shape[2 + a]
            want = full + op_[a] - pads[a] - pads[S + a]
            stop = pads[a] + want
            if stop > full:
                y = F.pad(y, [0, 0] * (S - 1 - a) + [0, stop - full])
            y = y.narrow(2 + a, pads[a], want)
        return y if b is None else y + b.reshape([-1] + [1] * S)
    return _k(fn, *ins)


def _pool_window(spec: NodeSpec):
    k = list(spec.attr("kernel_shape"))
    return _Window(spec, len(k), k), len(k)


@op("MaxPool")
def max_pool(spec: NodeSpec) -> Kernel:
    """F.max_pool{1,2,3}d; pads torch cannot take (asymmetric, > k/2, SAME_*, ceil_mode) are an explicit -inf pad.
    Indices (output 1): flat over [N, C, *S] in row-major order (storage_order 0), as ONNX defines them."""
    win, S = _pool_window(spec)
    k, st, dil = win.kernel, win.strides, win.dilations
    f = _MAX_POOL[S]
    indices = spec.n_outputs > 1 and spec.used_outputs[1]
    pair = spec.n_outputs > 1
    if indices and int(spec.attr("storage_order", 0)):
        spec.fail("MaxPool indices in column-major storage_order are not supported", "use storage_order 0")

    def torch_ok(pads):
        return _symmetric(pads, S) and all(pads[a] * 2 <= k[a] for a in range(S))

    def run(x, pads):
        if torch_ok(pads):
            return f(x, k, st, pads[:S], dil, False, indices)
        if indices:
            spec.fail("MaxPool indices with asymmetric pads are not supported", "use symmetric pads")
        return f(F.pad(x, _torch_pad(pads, S), value=-math.inf), k, st, 0, dil, False)

    def with_indices(x, pads):
        y, idx = run(x, pads)
        plane = math.prod(x.shape[2:])
        base = torch.arange(x.shape[0] * x.shape[1], device=x.device).reshape(x.shape[0], x.shape[1], *[1] * S)
        return y, idx + base * plane

    g = with_indices if indices else (lambda x, pads: (run(x, pads), None)) if pair else run
    if win.static:
        pads = win.pads
        return _k(lambda x: g(x, pads), 0)
    return _k(lambda x: g(x, win.resolve(x.shape[2:])), 0)


def _unfold_windows(x, k, st, dil, S):
    """[N, C, *out, *k] view of every window (after padding)."""
    for a in range(S):
        x = x.unfold(2 + a, (k[a] - 1) * dil[a] + 1, st[a])
        if dil[a] > 1:
            x = x[..., ::dil[a]]
    return x


@op("AveragePool")
def average_pool(spec: NodeSpec) -> Kernel:
    """Mean over each window. count_include_pad 0: the divisor counts input elements only; 1: the window's elements
    inside the padded axis (onnxfuse.core.windows.average_divisors). Pads torch cannot take are explicit zero pads, then
    the divisor is computed by pooling a ones tensor the same way."""
    win, S = _pool_window(spec)
    k, st, dil = win.kernel, win.strides, win.dilations
    include = bool(spec.attr("count_include_pad", 0))
    f = _AVG_POOL[S]
    kprod = math.prod(k)

    def run(x, pads):
        if any(d != 1 for d in dil):
            xp = F.pad(x, _torch_pad(pads, S))
            sums = _unfold_windows(xp, k, st, dil, S).sum(dim=tuple(range(-S, 0)))
            if include:
                return sums / kprod
            ones = F.pad(torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device), _torch_pad(pads, S))
            return sums / _unfold_windows(ones, k, st, dil, S).sum(dim=tuple(range(-S, 0)))
        if _symmetric(pads, S) and all(pads[a] * 2 <= k[a] for a in range(S)):
            return f(x, k, st, pads[:S], False, include)
        xp = F.pad(x, _torch_pad(pads, S))
        y = f(xp, k, st, 0, False, True)
        if include:
            return y
        ones = F.pad(torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device), _torch_pad(pads, S))
        return y / f(ones, k, st, 0, False, True)

    if win.ceil and include:
        # ceil mode + counted pads: torch's divisor counts the declared pads but not the extra end pad
        def ceil_include(x):
            pads, p0 = win.resolve(x.shape[2:]), win.resolve(x.shape[2:], ceil=False)
            xp = F.pad(x, _torch_pad(pads, S))
            sums = _unfold_windows(xp, k, st, dil, S).sum(dim=tuple(range(-S, 0)))
            ones = torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
            ones = F.pad(F.pad(ones, _torch_pad(p0, S), value=1.0),
                         _torch_pad([0] * S + [pads[S + a] - p0[S + a] for a in range(S)], S))
            return sums / _unfold_windows(ones, k, st, dil, S).sum(dim=tuple(range(-S, 0)))
        return _k(ceil_include, 0)
    if win.static:
        pads = win.pads
        return _k(lambda x: run(x, pads), 0)
    return _k(lambda x: run(x, win.resolve(x.shape[2:])), 0)


@op("LpPool")
def lp_pool(spec: NodeSpec) -> Kernel:
    """(sum over the window of |x|^p)^(1/p), pads counted as zeros."""
    win, S = _pool_window(spec)
    k, st, dil, p = win.kernel, win.strides, win.dilations, float(spec.attr("p", 2))

    def fn(x):
        pads = win.resolve(x.shape[2:])
        w = _unfold_windows(F.pad(x.abs().pow(p), _torch_pad(pads, S)), k, st, dil, S)
        return w.sum(dim=tuple(range(-S, 0))).pow(1.0 / p)
    return _k(fn, 0)


@op("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def global_pool(spec: NodeSpec) -> Kernel:
    """Reduce every spatial axis, keeping it (size 1)."""
    if spec.op_type == "GlobalAveragePool":
        return _k(lambda x: x.mean(dim=tuple(range(2, x.dim())), keepdim=True), 0)
    if spec.op_type == "GlobalMaxPool":
        return _k(lambda x: x.amax(dim=tuple(range(2, x.dim())), keepdim=True), 0)
    p = float(spec.attr("p", 2))
    return _k(lambda x: x.abs().pow(p).sum(dim=tuple(range(2, x.dim())), keepdim=True).pow(1.0 / p), 0)


# --------------------------------------------------------------------------------------------- normalization
@op("BatchNormalization")
def batch_norm(spec: NodeSpec) -> Kernel:
    """BatchNormalization(x, scale, bias, mean, var) per channel (axis 1).

    Inference (training_mode 0, or the module in eval mode): y = scale * (x - mean) / sqrt(var + eps) + bias on the
    running statistics; outputs 1 and 2, if any, are the running statistics unchanged.

    Training (training_mode 1 from opset 14; opset < 14: more than one output), module in train mode:
    y normalizes with the batch mean and the biased batch variance (over N and the spatial axes). Outputs 1 and 2
    are the new running statistics, with ONNX's momentum (the weight of the old value; torch's is 1 - it):

        running_mean' = momentum * running_mean + (1 - momentum) * batch_mean
        running_var'  = momentum * running_var  + (1 - momentum) * batch_var * n / (n - 1)

    with n = elements per channel: torch's rule and what the ORT runtime's ``batchnorm_pass`` writes (the ONNX
    specification's biased batch_var with ``TorchOptions(running_var="biased")``). Computed by F.batch_norm, the
    kernel of torch.nn.BatchNorm*, so bit-identical to torch. The statistics carry no gradient. With
    ``update_stats`` and statistics that are module buffers read by this node alone, they are updated in place
    (outputs 1 and 2 are then those buffers); otherwise copies are. Opset 9 outputs 3 and 4 (saved mean, saved
    variance) are the batch mean and 1/sqrt(batch_var + eps), as ONNX Runtime writes them.
    """
    eps = float(spec.attr("epsilon", 1e-5))
    momentum = float(spec.attr("momentum", 0.9))
    train_mode = is_training_batchnorm(spec.node, spec.opset)
    n_out = spec.n_outputs
    if not (train_mode and spec.training):
        def infer(x, w, b, rm, rv):
            y = F.batch_norm(x, rm, rv, w, b, False, 0.0, eps)
            return (y, rm, rv, rm, rv)[:n_out] if n_out > 1 else y
        return _k(infer, 0, 1, 2, 3, 4)
    torch_momentum = 1.0 - momentum
    inplace = spec.options.update_stats and len(spec.writable) > 4 and spec.writable[3] and spec.writable[4]
    saved = n_out > 3 and any(spec.used_outputs[3:5])
    if spec.options.running_var == "biased" or saved:
        def stats_fn(x, w, b, rm, rv):
            y = F.batch_norm(x, None, None, w, b, True, 0.0, eps)
            with torch.no_grad():
                dims = [0] + list(range(2, x.dim()))
                var, mean = torch.var_mean(x, dims, correction=0)
                n = x.numel() // x.shape[1]
                v_run = var if spec.options.running_var == "biased" else var * (n / max(n - 1, 1))
                new_rm = rm * momentum + mean * torch_momentum
                new_rv = rv * momentum + v_run * torch_momentum
                if inplace:
                    rm.copy_(new_rm)
                    rv.copy_(new_rv)
                    new_rm, new_rv = rm, rv
            outs = (y, new_rm, new_rv, mean, torch.rsqrt(var + eps))
            return outs[:n_out] if n_out > 1 else y
        return _k(stats_fn, 0, 1, 2, 3, 4)

    def train(x, w, b, rm, rv):
        if not inplace:
            rm, rv = rm.detach().clone(), rv.detach().clone()
        y = F.batch_norm(x, rm, rv, w, b, True, torch_momentum, eps)
        return (y, rm, rv)[:n_out] if n_out > 1 else y
    return _k(train, 0, 1, 2, 3, 4)


def _is(c: torch.Tensor | None, value: float) -> bool:
    return c is not None and c.is_floating_point() and bool((c == value).all())


@op("LayerNormalization")
def layer_norm(spec: NodeSpec) -> Kernel:
    """Normalize over axes [axis, rank): F.layer_norm (a constant scale of ones or bias of zeros is dropped). Mean and
    InvStdDev (outputs 1, 2, when read) keep size-1 normalized axes, as ONNX defines them."""
    axis, eps = int(spec.attr("axis", -1)), float(spec.attr("epsilon", 1e-5))
    w_in = None if _is(spec.const(1), 1.0) else 1
    b_in = None if (not spec.has(2) or _is(spec.const(2), 0.0)) else 2
    ins = (0,) + tuple(i for i in (w_in, b_in) if i is not None)
    extra = spec.n_outputs > 1 and any(spec.used_outputs[1:])
    n_out = spec.n_outputs

    def fn(x, *wb):
        a = _norm(axis, x.dim())
        w = wb[0] if w_in is not None else None
        b = wb[-1] if b_in is not None else None
        y = F.layer_norm(x, x.shape[a:], w, b, eps)
        if not extra:
            return y if n_out == 1 else (y,) + (None,) * (n_out - 1)
        dims = tuple(range(a, x.dim()))
        var, mean = torch.var_mean(x, dims, correction=0, keepdim=True)
        return (y, mean, torch.rsqrt(var + eps))[:n_out]
    return _k(fn, *ins)


@OPS.register("LayerNormAffine", domain="onnxfuse.torch")
def layer_norm_affine(spec: NodeSpec) -> Kernel:
    """``LayerNormalization(x, 1, 0) -> Mul(W) -> Add(C)`` of a fused LayerNorm (``runtime/precision.py``'s
    ``norms_in_fp32``); x ``[B, .., *S]`` over the normalized axes S from ``axis``, W and C ``[B, 1.., *S]``.
    Without autocast, or for a float32 input, those three ops (their bits). Under autocast for a bf16 / fp16
    input, each model's ``F.layer_norm(x[b], S, W[b], C[b])``: the mixed-dtype kernel the model alone runs, its
    affine's gradient included; where W or C is not one per model, the three ops in float32, rounded once."""
    axis, eps = int(spec.attr("axis", -1)), float(spec.attr("epsilon", 1e-5))

    def fn(x, w, c):
        a = _norm(axis, x.dim())
        shape = x.shape[a:]
        if x.dtype == torch.float32 or not torch.is_autocast_enabled(x.device.type):
            return F.layer_norm(x, shape, None, None, eps) * w + c
        B = x.shape[0]
        if a >= 1 and all(t.dim() == x.dim() and t.shape[0] == B and all(d == 1 for d in t.shape[1:a])
                          for t in (w, c)):
            ws, cs = (t.reshape(B, *t.shape[a:]).expand(B, *shape) for t in (w, c))
            return torch.stack([F.layer_norm(x[b], shape, ws[b], cs[b], eps) for b in range(B)])
        return (F.layer_norm(x.float(), shape, None, None, eps) * w + c).to(x.dtype)
    return _k(fn, 0, 1, 2)


@op("InstanceNormalization")
def instance_norm(spec: NodeSpec) -> Kernel:
    eps = float(spec.attr("epsilon", 1e-5))
    return _k(lambda x, w, b: F.instance_norm(x, None, None, w, b, True, 0.0, eps), 0, 1, 2)


@op("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
def loss_op(spec: NodeSpec) -> Kernel:
    """SoftmaxCrossEntropyLoss(scores [N, C, d...], labels [N, d...], weights?) -> loss, log_prob? and
    NegativeLogLikelihoodLoss(log_prob, labels, weights?) -> loss, as F.cross_entropy / F.nll_loss with the same
    ``reduction`` and ``ignore_index`` (an ignored label contributes 0 and no gradient; "mean" divides by the
    summed weights of the kept labels, as both ONNX and torch do). Output 1 of SoftmaxCrossEntropyLoss is
    log_softmax(scores) along axis 1."""
    reduction = spec.attr("reduction", "mean")
    ignore = spec.attr("ignore_index", None)
    ignore = -100 if ignore is None else int(ignore)  # torch's default matches no valid class index either
    soft = spec.op_type == "SoftmaxCrossEntropyLoss"
    with_log_prob = soft and spec.n_outputs > 1

    def f(x, labels, weight=None):
        logp = torch.log_softmax(x, 1) if soft else x
        loss = F.nll_loss(logp, labels.long(), weight=weight, ignore_index=ignore, reduction=reduction)
        return (loss, logp) if with_log_prob else loss

    return _k(f, *_all(spec))


@op("Softmax", "LogSoftmax", "Hardmax")
def softmax(spec: NodeSpec) -> Kernel:
    """Along ``axis`` (opset >= 13); opset < 13 flattens to 2-D at ``axis`` first."""
    axis = int(spec.attr("axis", -1 if spec.opset >= 13 else 1))
    if spec.op_type == "Hardmax":
        def hard(x):
            a = _norm(axis, x.dim())
            return F.one_hot(x.argmax(a), x.shape[a]).movedim(-1, a).to(x.dtype)
        f = hard
    else:
        f = (lambda x: torch.softmax(x, axis)) if spec.op_type == "Softmax" else (lambda x: torch.log_softmax(x, axis))
    if spec.opset >= 13:
        return _k(f, 0)

    def coerced(x):
        a = _norm(axis, x.dim())
        return (torch.softmax if spec.op_type == "Softmax" else torch.log_softmax)(
            x.reshape(math.prod(x.shape[:a]), -1), 1).reshape(x.shape)
    return _k(coerced, 0)


# ------------------------------------------------------------------------------------------------ reductions
def _axes(spec: NodeSpec, since: int) -> tuple[list[int] | None, bool]:
    """(axes, given): from the attribute before opset ``since``, from input 1 from then on."""
    if spec.opset < since:
        a = spec.attr("axes")
        return (None if a is None else [int(v) for v in a]), a is not None
    if not spec.has(1):
        return None, False
    spec.need_const(1, "axes")
    return spec.ints(1), True


def _reduce_fn(op_type: str):
    if op_type == "ReduceMean":
        return lambda x, d, k: x.mean(d, keepdim=k)
    if op_type == "ReduceSum":
        return lambda x, d, k: x.sum(d, keepdim=k)
    if op_type == "ReduceMax":
        return lambda x, d, k: x.amax(d, keepdim=k)
    if op_type == "ReduceMin":
        return lambda x, d, k: x.amin(d, keepdim=k)
    if op_type == "ReduceL1":
        return lambda x, d, k: x.abs().sum(d, keepdim=k)
    if op_type == "ReduceL2":
        return lambda x, d, k: torch.linalg.vector_norm(x, 2, d, keepdim=k)
    if op_type == "ReduceSumSquare":
        return lambda x, d, k: (x * x).sum(d, keepdim=k)
    if op_type == "ReduceLogSum":
        return lambda x, d, k: torch.log(x.sum(d, keepdim=k))
    if op_type == "ReduceLogSumExp":
        return lambda x, d, k: torch.logsumexp(x, d, keepdim=k)

    def prod(x, d, k):
        for a in sorted(d, reverse=True):
            x = x.prod(a, keepdim=True)
        return x if k else x.squeeze(tuple(d)) if d else x
    return prod


@op("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceSumSquare")
def reduce(spec: NodeSpec) -> Kernel:
    """Reduce ``axes`` (attribute before opset 18 - ReduceSum: 13 -, input from then on); no axes: every axis, or
    none with noop_with_empty_axes."""
    axes, _ = _axes(spec, 13 if spec.op_type == "ReduceSum" else 18)
    keep = bool(spec.attr("keepdims", 1))
    f = _reduce_fn(spec.op_type)
    if not axes:
        if spec.attr("noop_with_empty_axes", 0):
            return _k(_identity, 0)
        return _k(lambda x: f(x, tuple(range(x.dim())), keep), 0)
    dims = tuple(axes)
    return _k(lambda x: f(x, dims, keep), 0)


@op("ArgMax", "ArgMin")
def arg_max(spec: NodeSpec) -> Kernel:
    """Index of the first max/min along ``axis`` (the last with select_last_index)."""
    axis, keep = int(spec.attr("axis", 0)), bool(spec.attr("keepdims", 1))
    f = torch.argmax if spec.op_type == "ArgMax" else torch.argmin
    if int(spec.attr("select_last_index", 0)):
        def last(x):
            a = _norm(axis, x.dim())
            return x.shape[a] - 1 - f(x.flip(a), a, keep)
        return _k(last, 0)
    return _k(lambda x: f(x, axis, keep), 0)


@op("CumSum")
def cumsum(spec: NodeSpec) -> Kernel:
    spec.need_const(1, "axis")
    axis = spec.ints(1)[0]
    exclusive, reverse = int(spec.attr("exclusive", 0)), int(spec.attr("reverse", 0))

    def fn(x):
        a = _norm(axis, x.dim())
        y = x.flip(a) if reverse else x
        if exclusive:  # shift right by one: [0, x0, x0+x1, ...]
            y = F.pad(y.narrow(a, 0, y.shape[a] - 1), [0, 0] * (x.dim() - 1 - a) + [1, 0])
        y = torch.cumsum(y, a)
        return y.flip(a) if reverse else y
    return _k(fn, 0)


# ---------------------------------------------------------------------------------------------- shape ops
@op("Shape")
def shape(spec: NodeSpec) -> Kernel:
    start, end = spec.attr("start", 0), spec.attr("end")
    sl = slice(start, end)
    return _k(lambda x: torch.tensor(x.shape[sl], dtype=torch.int64), 0)


@op("Size")
def size(spec: NodeSpec) -> Kernel:
    return _k(lambda x: torch.tensor(x.numel(), dtype=torch.int64), 0)


def _reshape_target(target: list[int], allowzero: bool):
    """A function of x's shape giving the target with 0 = "copy this dim" resolved (unless allowzero)."""
    zeros = [] if allowzero else [i for i, v in enumerate(target) if v == 0]
    if not zeros:
        return None
    def resolve(shape):
        t = list(target)
        for i in zeros:
            t[i] = shape[i]
        return t
    return resolve


@op("Reshape")
def reshape(spec: NodeSpec) -> Kernel:
    allowzero = bool(spec.attr("allowzero", 0))
    target = spec.ints(1)
    if target is not None:
        resolve = _reshape_target(target, allowzero)
        if resolve is None:
            return _k(lambda x: x.reshape(target), 0)
        return _k(lambda x: x.reshape(resolve(x.shape)), 0)

    def dynamic(x, t):
        t = t.tolist()
        r = _reshape_target(t, allowzero)
        return x.reshape(r(x.shape) if r else t)
    return _k(dynamic, 0, 1, host=(1,))


@op("Flatten")
def flatten(spec: NodeSpec) -> Kernel:
    axis = int(spec.attr("axis", 1))

    def fn(x):
        a = _norm(axis, x.dim())
        return x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:]))
    return _k(fn, 0)


@op("Transpose")
def transpose(spec: NodeSpec) -> Kernel:
    perm = spec.attr("perm")
    if perm is None:
        return _k(lambda x: x.permute(*reversed(range(x.dim()))), 0)
    perm = [int(p) for p in perm]
    return _k(lambda x: x.permute(perm), 0)


@op("Squeeze")
def squeeze(spec: NodeSpec) -> Kernel:
    axes, given = _axes(spec, 13)
    if not given:
        return _k(lambda x: x.squeeze(), 0)
    dims = tuple(axes)
    return _k(lambda x: x.squeeze(dims), 0)


@op("Unsqueeze")
def unsqueeze(spec: NodeSpec) -> Kernel:
    """Insert size-1 axes at output positions ``axes`` (attribute before opset 13, input from then on)."""
    axes, _ = _axes(spec, 13)
    if axes is None:
        spec.fail("Unsqueeze without axes", "give the axes")
    if all(a >= 0 for a in axes):
        order = sorted(axes)
        if len(order) == 1:
            a0 = order[0]
            return _k(lambda x: x.unsqueeze(a0), 0)

        def fn(x):
            for a in order:
                x = x.unsqueeze(a)
            return x
        return _k(fn, 0)

    def neg(x):
        r = x.dim() + len(axes)
        for a in sorted(_norm(a, r) for a in axes):
            x = x.unsqueeze(a)
        return x
    return _k(neg, 0)


@op("Expand")
def expand(spec: NodeSpec) -> Kernel:
    """Bidirectional broadcast of x and the target shape (a 1 in the target keeps x's dim), as a view."""
    target = spec.ints(1)
    if target is not None:
        return _k(lambda x: x.expand(torch.broadcast_shapes(x.shape, target)), 0)
    return _k(lambda x, t: x.expand(torch.broadcast_shapes(x.shape, tuple(t.tolist()))), 0, 1, host=(1,))


@op("Tile")
def tile(spec: NodeSpec) -> Kernel:
    reps = spec.ints(1)
    if reps is not None:
        return _k(lambda x: x.repeat(reps), 0)
    return _k(lambda x, r: x.repeat(r.tolist()), 0, 1, host=(1,))


@op("Concat")
def concat(spec: NodeSpec) -> Kernel:
    axis = int(spec.attr("axis"))
    return _k(lambda *xs: torch.cat(xs, axis), *_all(spec))


@op("Split")
def split(spec: NodeSpec) -> Kernel:
    """Pieces of the given sizes (``split`` input from opset 13, attribute before), else equal pieces: the number of
    outputs (``num_outputs`` from opset 18; the last piece smaller when uneven)."""
    axis, n = int(spec.attr("axis", 0)), len(spec.node.output)
    if spec.opset >= 13:
        spec.need_const(1, "split")
        sizes = spec.ints(1)
    else:
        sizes = spec.attr("split")
    if n == 1:
        return _k(_identity, 0)
    if sizes:
        sizes = [int(s) for s in sizes]
        return _k(lambda x: torch.split(x, sizes, axis), 0)
    return _k(lambda x: torch.split(x, -(-x.shape[axis] // n), axis), 0)


def _slice_index(x, starts, ends, axes, steps):
    """x[starts:ends:steps] on ``axes`` with ONNX's (numpy's) clamping; negative steps through a flip."""
    idx: list = [slice(None)] * x.dim()
    flips = []
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = _norm(a, x.dim())
        if st > 0:
            idx[a] = slice(s, e, st)
        else:
            r = range(x.shape[a])[slice(s, e, st)]
            if len(r) == 0:
                idx[a] = slice(0, 0)
            else:  # element r[j] of x is element (L-1-r[j]) of x.flip(a)
                L = x.shape[a]
                idx[a] = slice(L - 1 - r.start, L - 1 - r.start + (len(r) - 1) * (-st) + 1, -st)
                flips.append(a)
    if flips:
        x = x.flip(flips)
    return x[tuple(idx)]


@op("Slice")
def slice_(spec: NodeSpec) -> Kernel:
    """Slice(x, starts, ends, axes, steps) (opset >= 10 inputs): constant ones are one precomputed index."""
    if spec.opset < 10:
        starts, ends = list(spec.attr("starts")), list(spec.attr("ends"))
        axes = list(spec.attr("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = spec.ints(1), spec.ints(2)
        spec.need_const(3, "axes")
        spec.need_const(4, "steps")
        axes, steps = spec.ints(3), spec.ints(4)
    if starts is not None and ends is not None:
        axes = list(axes) if axes is not None else list(range(len(starts)))
        steps = list(steps) if steps is not None else [1] * len(starts)
        if all(st > 0 for st in steps) and all(a >= 0 for a in axes):
            idx: list = [slice(None)] * (max(axes) + 1 if axes else 0)
            for s, e, a, st in zip(starts, ends, axes, steps):
                idx[a] = slice(s, e, st)
            index = tuple(idx)
            return _k(lambda x: x[index], 0)
        return _k(lambda x: _slice_index(x, starts, ends, axes, steps), 0)

    def dynamic(x, s, e):
        s, e = s.tolist(), e.tolist()
        a = list(axes) if axes is not None else list(range(len(s)))
        st = list(steps) if steps is not None else [1] * len(s)
        return _slice_index(x, s, e, a, st)
    return _k(dynamic, 0, 1, 2, host=(1, 2))


@op("Pad")
def pad(spec: NodeSpec) -> Kernel:
    """Pad(x, pads, constant_value, axes) (opset >= 11); modes constant, reflect, edge (replicate), wrap (circular).
    Negative pads crop."""
    mode = spec.attr("mode", "constant")
    if spec.opset < 11:
        pads, value, axes = list(spec.attr("pads")), float(spec.attr("value", 0.0)), None
    else:
        spec.need_const(1, "pads")
        spec.need_const(2, "constant_value")
        spec.need_const(3, "axes")
        pads, value, axes = spec.ints(1), spec.scalar(2, 0), spec.ints(3)
    tmode = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}.get(mode)
    if tmode is None:
        spec.fail(f"pad mode '{mode}' is not supported", "use constant, reflect, edge or wrap")

    def fn(x):
        r = x.dim()
        ax = [_norm(a, r) for a in axes] if axes is not None else list(range(r))
        n = len(ax)
        full_b, full_e = [0] * r, [0] * r
        for j, a in enumerate(ax):
            full_b[a], full_e[a] = pads[j], pads[n + j]
        padded = [a for a in range(r) if full_b[a] or full_e[a]]
        if not padded:
            return x
        first = padded[0]
        tp: list[int] = []
        for a in reversed(range(first, r)):
            tp += [full_b[a], full_e[a]]
        if tmode == "constant":
            return F.pad(x, tp, "constant", value)
        k = r - first  # torch's other modes pad the last 1..3 axes of a [N, C, *S] tensor
        if k > 3:
            spec.fail(f"{mode} padding of {k} trailing axes", "pad at most the last 3 axes")
        lead = x.shape[:first]
        y = F.pad(x.reshape((1, math.prod(lead)) + tuple(x.shape[first:])), tp, tmode)
        return y.reshape(tuple(lead) + tuple(y.shape[2:]))
    return _k(fn, 0)


@op("DepthToSpace")
def depth_to_space(spec: NodeSpec) -> Kernel:
    """[N, C*b*b, H, W] -> [N, C, H*b, W*b]; CRD is F.pixel_shuffle, DCR reads the depth as (b, b, C)."""
    b = int(spec.attr("blocksize"))
    if spec.attr("mode", "DCR") == "CRD":
        return _k(lambda x: F.pixel_shuffle(x, b), 0)

    def dcr(x):
        N, C, H, W = x.shape
        return x.reshape(N, b, b, C // (b * b), H, W).permute(0, 3, 4, 1, 5, 2).reshape(N, C // (b * b), H * b, W * b)
    return _k(dcr, 0)


@op("SpaceToDepth")
def space_to_depth(spec: NodeSpec) -> Kernel:
    """[N, C, H*b, W*b] -> [N, b*b*C, H, W], the depth ordered (b, b, C) as ONNX defines it."""
    b = int(spec.attr("blocksize"))

    def fn(x):
        N, C, H, W = x.shape
        return x.reshape(N, C, H // b, b, W // b, b).permute(0, 3, 5, 1, 2, 4).reshape(N, C * b * b, H // b, W // b)
    return _k(fn, 0)


@op("Gather")
def gather(spec: NodeSpec) -> Kernel:
    """x.take along ``axis``: out shape x.shape[:axis] + idx.shape + x.shape[axis+1:]; negative indices count from the
    end. A constant scalar index is a select (a view)."""
    axis = int(spec.attr("axis", 0))
    idx = spec.const(1)
    if idx is not None and idx.dim() == 0:
        i = int(idx)
        return _k(lambda x: x.select(axis, i), 0)
    if idx is not None and bool((idx >= 0).all()):
        flat = idx.reshape(-1)
        ishape = tuple(idx.shape)

        def const_idx(x):
            a = _norm(axis, x.dim())
            ix = flat if flat.device == x.device else flat.to(x.device)
            return x.index_select(a, ix).reshape(x.shape[:a] + ishape + x.shape[a + 1:])
        return _k(const_idx, 0)

    def fn(x, i):
        a = _norm(axis, x.dim())
        i = torch.where(i < 0, i + x.shape[a], i)
        return x.index_select(a, i.reshape(-1)).reshape(x.shape[:a] + i.shape + x.shape[a + 1:])
    return _k(fn, 0, 1)


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
    return _k(fn, 0, 1)


@op("GatherElements")
def gather_elements(spec: NodeSpec) -> Kernel:
    axis = int(spec.attr("axis", 0))

    def fn(x, i):
        a = _norm(axis, x.dim())
        return torch.gather(x, a, torch.where(i < 0, i + x.shape[a], i))
    return _k(fn, 0, 1)


# ------------------------------------------------------------------------------------------------ generators
@op("Constant")
def constant(spec: NodeSpec) -> Kernel:
    """The value attribute in any of its forms (evaluated at build time, never at run time)."""
    a = spec.attrs
    if "value" in a:
        v = a["value"]
    elif "value_float" in a:
        v = torch.tensor(float(a["value_float"]), dtype=torch.float32)
    elif "value_floats" in a:
        v = torch.tensor(list(a["value_floats"]), dtype=torch.float32)
    elif "value_int" in a:
        v = torch.tensor(int(a["value_int"]), dtype=torch.int64)
    elif "value_ints" in a:
        v = torch.tensor(list(a["value_ints"]), dtype=torch.int64)
    else:
        spec.fail(f"Constant with attribute {sorted(a)} is not supported", "use a numeric value")
    return _k(lambda: v)


@op("ConstantOfShape")
def constant_of_shape(spec: NodeSpec) -> Kernel:
    value = spec.attr("value")
    v = value.reshape(-1)[0].item() if value is not None else 0.0
    dtype = value.dtype if value is not None else torch.float32
    device = spec.device
    return _k(lambda s: torch.full(s.tolist(), v, dtype=dtype, device=device()), 0, host=(0,))


@op("Range")
def range_(spec: NodeSpec) -> Kernel:
    device = spec.device

    def fn(start, limit, delta):
        return torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype, device=device())
    return _k(fn, 0, 1, 2, host=(0, 1, 2))


# ---------------------------------------------------------------------------------------------------- Resize
_TORCH_LINEAR = {1: "linear", 2: "bilinear", 3: "trilinear"}


@op("Resize")
def resize(spec: NodeSpec) -> Kernel:
    """Resize(X, roi, scales, sizes) with constant scales or sizes (opsets 13..19; axes from 18).

    Per resized axis: output length = sizes[a], or floor(L * scales[a]); x_original from
    coordinate_transformation_mode. torch's F.interpolate where it computes the same (nearest + asymmetric + floor;
    linear + half_pixel / align_corners; cubic with a = -0.75, exclude_outside 0); otherwise nearest and linear
    run separably per axis with index_select (exactly ONNX's definition), and other forms are refused.
    """
    mode = spec.attr("mode", "nearest")
    ctm = spec.attr("coordinate_transformation_mode", "half_pixel")
    nearest_mode = spec.attr("nearest_mode", "round_prefer_floor")
    cubic_a = float(spec.attr("cubic_coeff_a", -0.75))
    exclude = int(spec.attr("exclude_outside", 0))
    if ctm == "tf_crop_and_resize":
        spec.fail("tf_crop_and_resize is not supported", "use another coordinate_transformation_mode")
    if int(spec.attr("antialias", 0)) or spec.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        spec.fail("antialias / keep_aspect_ratio_policy are not supported", "resize without them")
    spec.need_const(2, "scales")
    spec.need_const(3, "sizes")
    scales = spec.const(2) if spec.has(2) and spec.const(2).numel() else None
    sizes = spec.ints(3) if spec.has(3) else None
    scales = [float(s) for s in scales.tolist()] if scales is not None else None
    axes_attr = spec.attr("axes")

    def plan(shape):
        r = len(shape)
        axes = [_norm(int(a), r) for a in axes_attr] if axes_attr is not None else list(range(r))
        out, sc = list(shape), [1.0] * r
        for j, a in enumerate(axes):
            if sizes is not None:
                out[a], sc[a] = sizes[j], sizes[j] / shape[a]
            else:
                out[a], sc[a] = int(math.floor(shape[a] * scales[j])), scales[j]
        return out, sc

    def torch_path(x, out, sc):
        resized = [a for a in range(x.dim()) if out[a] != x.shape[a] or sc[a] != 1.0]
        if not resized:
            return x
        first = min(resized)
        S = x.dim() - first
        if mode == "nearest" and not (ctm == "asymmetric" and nearest_mode == "floor"):
            return None
        if mode == "linear" and ctm not in ("half_pixel", "pytorch_half_pixel", "align_corners"):
            return None
        if mode == "cubic" and (ctm not in ("half_pixel", "pytorch_half_pixel", "align_corners") or
                                abs(cubic_a + 0.75) > 1e-6 or exclude or S > 2):
            return None
        if S > 3 or (ctm == "pytorch_half_pixel" and any(out[a] == 1 for a in resized)):
            return None
        lead = x.shape[:first]
        y = x.reshape((1, math.prod(lead)) + tuple(x.shape[first:]))
        size = out[first:]
        if mode == "cubic" and S == 1:
            y = y.unsqueeze(2)
            size = [1] + size
        kw = {}
        if sizes is None and ctm != "align_corners":  # ONNX maps coordinates with the given scales, not out/in
            kw = dict(scale_factor=sc[first:] if not (mode == "cubic" and S == 1) else [1.0] + sc[first:],
                      recompute_scale_factor=False)
        else:
            kw = dict(size=size)
        if mode == "nearest":
            y = F.interpolate(y, mode="nearest", **kw)
        elif mode == "linear":
            y = F.interpolate(y, mode=_TORCH_LINEAR[S], align_corners=ctm == "align_corners", **kw)
        else:
            y = F.interpolate(y, mode="bicubic", align_corners=ctm == "align_corners", **kw)
        if mode == "cubic" and S == 1:
            y = y.squeeze(2)
        return y.reshape(tuple(lead) + tuple(y.shape[2:]))

    cache: dict = {}

    def separable(x, out, sc):
        for a in range(x.dim()):
            if out[a] == x.shape[a] and sc[a] == 1.0:  # onnxruntime leaves such axes as they are
                continue
            key = (a, x.shape[a], out[a], sc[a], x.device)
            if key not in cache:
                # float32 coordinates, as onnxruntime computes them
                xs = source_coords(out[a], x.shape[a], sc[a], ctm, np.float32)
                if mode == "nearest":
                    cache[key] = (torch.from_numpy(nearest_index(xs, nearest_mode, x.shape[a])).to(x.device),)
                else:
                    xo = torch.from_numpy(xs).clamp(0, x.shape[a] - 1)
                    i0 = xo.floor().to(torch.int64)
                    i1 = (i0 + 1).clamp(max=x.shape[a] - 1)
                    w = (xo - i0).to(x.dtype).reshape([-1] + [1] * (x.dim() - 1 - a))
                    cache[key] = (i0.to(x.device), i1.to(x.device), w.to(x.device))
            c = cache[key]
            if mode == "nearest":
                x = x.index_select(a, c[0])
            else:
                x = torch.lerp(x.index_select(a, c[0]), x.index_select(a, c[1]), c[2])
        return x

    if mode == "cubic":
        def cubic(x):
            out, sc = plan(x.shape)
            y = torch_path(x, out, sc)
            if y is None:
                spec.fail(f"cubic resize with {ctm}, a = {cubic_a}, exclude_outside {exclude} is not supported",
                          "use half_pixel or align_corners with a = -0.75, or linear")
            return y
        return _k(cubic, 0)

    def fn(x):
        out, sc = plan(x.shape)
        y = torch_path(x, out, sc)
        return separable(x, out, sc) if y is None else y
    return _k(fn, 0)


# --------------------------------------------------------------------------------------------- subgraph ops
@op("If", "Loop", "Scan")
def control_flow(spec: NodeSpec) -> Kernel:
    spec.fail("control flow (subgraphs) is not supported by the torch runtime, and no fusion rule accepts it",
              "export the model without data-dependent control flow, or train this array with --runtime ort")
    raise AssertionError  # unreachable


# ------------------------------------------------------------------------------------------------ recurrent
# ONNX's gate order per op, and torch's (_VF.lstm / gru / rnn_*): the same gates, stacked differently
_GATES = {"LSTM": ("iofc", "ifco"), "GRU": ("zrh", "rzh"), "RNN": ("h", "h")}


def _torch_gates(w: torch.Tensor, op_type: str) -> torch.Tensor:
    """An ONNX recurrent weight or bias of one direction, gates stacked on axis 0 in ONNX's order, restacked in
    torch's (LSTM: i o f c -> i f c o; GRU: z r h -> r z h)."""
    onnx_order, torch_order = _GATES[op_type]
    if onnx_order == torch_order:
        return w
    blocks = w.chunk(len(onnx_order), 0)
    return torch.cat([blocks[onnx_order.index(g)] for g in torch_order], 0)


def _recurrent_attrs(spec: NodeSpec, t: str) -> tuple[int, str, int, int, bool]:
    """(H, direction, layout, D, relu) of an LSTM / GRU / RNN node (``t``) both recurrent kernels run; the forms they
    refuse fail here, one line each: sequence_lens that are not constant, LSTM peepholes, clip, input_forget,
    activations other than the defaults (RNN: Tanh or Relu), GRU with linear_before_reset=0 (torch's GRU applies
    the reset gate after its recurrent product)."""
    H = int(spec.attr("hidden_size", 0) or 0)
    direction = spec.attr("direction", "forward")
    layout = int(spec.attr("layout", 0))
    acts = [a.decode() if isinstance(a, bytes) else a for a in (spec.attr("activations") or [])]
    defaults = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}[t]
    D = 2 if direction == "bidirectional" else 1
    named = [a.lower() for a in acts]
    relu = t == "RNN" and named == ["relu"] * D
    if named and named != [a.lower() for a in defaults] * D and not relu:
        spec.fail(f"activations {acts} have no torch kernel", "use the default activations (nn.LSTM/GRU/RNN)")
    if spec.attr("clip") is not None:
        spec.fail("clip has no torch kernel", "train it with --runtime ort")
    if int(spec.attr("input_forget", 0)):
        spec.fail("input_forget has no torch kernel", "train it with --runtime ort")
    if t == "GRU" and not int(spec.attr("linear_before_reset", 0)):
        spec.fail("linear_before_reset=0 has no torch kernel (torch's GRU resets after its recurrent product)",
                  "export the GRU from torch (nn.GRU), or train it with --runtime ort")
    if t == "LSTM" and spec.has(7):
        p = spec.const(7)
        if p is None or bool((p != 0).any()):
            spec.fail("peepholes have no torch kernel", "train it with --runtime ort")
    spec.need_const(4, "sequence_lens")
    return H, direction, layout, D, relu


def _full_lengths(spec: NodeSpec, lens: torch.Tensor | None, T: int) -> None:
    if lens is not None and bool((lens != T).any()):
        spec.fail("sequence_lens shorter than the sequence have no torch kernel",
                  "pad every sequence to the same length, or train it with --runtime ort")


@op("LSTM", "GRU", "RNN")
def recurrent(spec: NodeSpec) -> Kernel:
    """ONNX LSTM / GRU / RNN as torch's own recurrent kernels (``torch._VF.lstm``, ``gru``, ``rnn_tanh``,
    ``rnn_relu``: what ``nn.LSTM``/``nn.GRU``/``nn.RNN`` run, so the same numerics), one layer, forward, reverse
    or bidirectional, layout 0 (X [T, N, I]) or 1 ([N, T, I]), with initial states. The weights W [D, G*H, I],
    R [D, G*H, H] and bias B [D, 2*G*H] are restacked from ONNX's gate order to torch's. Y: [T, D, N, H]
    (layout 1: [N, T, D, H]); Y_h, Y_c: [D, N, H] ([N, D, H]). Refused: see :func:`_recurrent_attrs`."""
    t = spec.op_type
    H, direction, layout, D, relu = _recurrent_attrs(spec, t)
    fn_vf = {"LSTM": torch._VF.lstm, "GRU": torch._VF.gru}.get(t) or (torch._VF.rnn_relu if relu else torch._VF.rnn_tanh)
    lens = spec.const(4)
    n_out = spec.n_outputs

    def fn(x, w, r, b=None, seq_lens=None, h0=None, c0=None, peepholes=None):
        T_axis, N_axis = (1, 0) if layout else (0, 1)
        _full_lengths(spec, lens, x.shape[T_axis])
        N = x.shape[N_axis]
        params = []
        for d in range(D):
            params += [_torch_gates(w[d], t), _torch_gates(r[d], t)]
            if b is not None:
                wb, rb = b[d].chunk(2, 0)
                params += [_torch_gates(wb, t), _torch_gates(rb, t)]
        # cast once, as autocast casts a module's weights once (its cache): the T steps' gradients of each weight
        # are then summed in the lower precision, as torch sums them for the module alone
        params = list(autocast_lowered(*params))

        def state(s):
            if s is None:
                return x.new_zeros(D, N, H)
            return s.transpose(0, 1) if layout else s
        hx = (state(h0), state(c0)) if t == "LSTM" else state(h0)
        seq = x.flip(T_axis) if direction == "reverse" else x
        y, *states = fn_vf(seq, hx, params, b is not None, 1, 0.0, spec.training, D == 2, bool(layout))
        if direction == "reverse":
            y = y.flip(T_axis)
        y = y.reshape(*y.shape[:2], D, H)  # [T, N, D, H] or [N, T, D, H]
        if not layout:
            y = y.permute(0, 2, 1, 3)  # [T, D, N, H]
        states = [s.transpose(0, 1) if layout else s for s in states]
        return ((y, *states) + (None,) * 3)[:n_out] if n_out > 1 else y
    return _k(fn, *range(len(spec.node.input)))


@OPS.register("BatchedLSTM", "BatchedGRU", "BatchedRNN", domain="onnxfuse.torch")
def batched_recurrent(spec: NodeSpec) -> Kernel:
    """B models' LSTM / GRU / RNN in one recurrence: the recurrent rule's "batched" form
    (``core/rules/recurrent.py``), the attributes of the ONNX op. Every per-model tensor has a leading model axis:
    X [B, T, N, I] (layout 1: [B, N, T, I]; a shared X [T, N, I] is read by every model), W [B, D, G*H, I],
    R [B, D, G*H, H], bias [B, D, 2*G*H], initial states [B, D, N, H] ([B, N, D, H]; shared: [D, N, H]);
    Y [B, T, D, N, H] ([B, N, T, D, H]), Y_h / Y_c [B, D, N, H] ([B, N, D, H]).
    Math: torch's CPU recurrence (aten/src/ATen/native/RNN.cpp, the cells of ``_VF.gru`` / ``rnn_*``): the input
    product of every step first (``linear(x, W, Wb)``), then per step the recurrent product ``linear(h, R, Rb)``
    plus it and the cell in torch's order of operations, each product batched over the B models and the D
    directions (``baddbmm``); a reverse direction runs on its input reversed in time. Refused: see
    :func:`_recurrent_attrs`."""
    t = spec.op_type[len("Batched"):]
    H, direction, layout, D, relu = _recurrent_attrs(spec, t)
    G = {"LSTM": 4, "GRU": 3, "RNN": 1}[t]
    reverse = [direction == "reverse" or d == 1 for d in range(D)]
    lens = spec.const(4)
    n_out = spec.n_outputs
    act = torch.relu if relu else torch.tanh

    def flip_reversed(z):  # z [B, D, T, ...]: each reverse direction's time axis reversed
        if not any(reverse):
            return z
        return torch.cat([z[:, d:d + 1].flip(2) if reverse[d] else z[:, d:d + 1] for d in range(D)], 1)

    def cell(xw, hw, h, c):  # torch's cells, in place on the fresh recurrent product hw as they are
        if t == "LSTM":  # ONNX's gates i o f c; torch: c' = f * c + i * g, h' = o * tanh(c')
            i, o, f, g = hw.add_(xw).unsafe_chunk(4, -1)
            i, o, f, g = i.sigmoid_(), o.sigmoid_(), f.sigmoid_(), g.tanh_()
            c = (f * c).add_(i * g)
            return o * c.tanh(), c
        if t == "GRU":  # ONNX's gates z r h; torch: n = tanh(xn + r * hn), h' = (h - n) * z + n
            xz, xr, xn = xw.unsafe_chunk(3, -1)
            hz, hr, hn = hw.unsafe_chunk(3, -1)
            r, z = hr.add_(xr).sigmoid_(), hz.add_(xz).sigmoid_()
            n = xn.add(hn.mul_(r)).tanh_()
            return (h - n).mul_(z).add_(n), c
        return act(hw.add_(xw)), c

    def fn(x, w, r, b=None, seq_lens=None, h0=None, c0=None, peepholes=None):
        Bm = w.shape[0]
        MD = Bm * D  # the models' directions, one batch of recurrences
        if layout:
            x = x.transpose(-3, -2)  # [.., T, N, I]
        T, N, I = x.shape[-3:]
        _full_lengths(spec, lens, T)
        xs = x.reshape(-1, 1, T * N, I).expand(Bm, D, T * N, I).reshape(MD, T * N, I)
        wt, rt = w.reshape(MD, G * H, I).transpose(1, 2), r.reshape(MD, G * H, H).transpose(1, 2)
        wb, rb = b.reshape(MD, 1, 2 * G * H).chunk(2, -1) if b is not None else (None, None)
        if wb is not None and (x[0] if x.dim() == 4 else x).is_contiguous():
            xw = torch.baddbmm(wb, xs, wt)  # torch's linear of a contiguous [T, N, I]: addmm, the bias inside
        else:  # of a strided one (batch_first's transpose): matmul, then add_(bias), each rounded under autocast
            xw = torch.bmm(xs, wt)
            if wb is not None:
                xw.add_(wb.to(xw.dtype))
        xw = flip_reversed(xw.reshape(Bm, D, T, N, G * H)).reshape(MD, T, N, G * H)
        # cast once, as autocast casts a module's weights once (its cache): the T steps' gradients of R and Rb are
        # then summed in the lower precision, as torch sums them alone
        rt, rb = autocast_lowered(rt, rb) if rb is not None else (autocast_lowered(rt)[0], None)

        def state(s):
            if s is None:
                return x.new_zeros(MD, N, H)
            if layout:  # [.., N, D, H]
                s = s.transpose(-3, -2)
            return s.expand(Bm, D, N, H).reshape(MD, N, H)
        h, c = state(h0), (state(c0) if t == "LSTM" else None)
        ys = []
        for xw_t in xw.unbind(1):  # (not xw[:, step]: each select's gradient would be a zero-filled copy of xw)
            hw = torch.bmm(h, rt) if rb is None else torch.baddbmm(rb, h, rt)
            h, c = cell(xw_t, hw, h, c)
            ys.append(h)
        y = flip_reversed(torch.stack(ys, 1).reshape(Bm, D, T, N, H))
        y = y.permute(0, 3, 2, 1, 4) if layout else y.permute(0, 2, 1, 3, 4)  # [B, N, T, D, H] / [B, T, D, N, H]
        states = [s.reshape(Bm, D, N, H) for s in ((h, c) if t == "LSTM" else (h,))]
        states = [s.transpose(1, 2) if layout else s for s in states]
        return ((y, *states) + (None,) * 3)[:n_out] if n_out > 1 else y
    return _k(fn, *range(len(spec.node.input)))
