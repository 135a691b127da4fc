"""The ONNX -> torch converter (onnxfuse/runtime/torch/program.py and its kernels), judged by others:

- op by op against onnxruntime's InferenceSession on the same one-node graph (graph optimizations off: ORT's
  Conv+BatchNorm fusion ignores training_mode), over the attribute forms and opsets that differ;
- every zoo model and fuzz models fused at B = 2: the converted fused graph's forward against onnxruntime on the same
  graph; and the converted *original* (exported, unfused) model's gradients and BatchNorm statistics against the
  torch module's own (the exporter keeps initializer names = state_dict keys), so torch is the judge, not the
  converter itself.
"""
from __future__ import annotations

import copy
import json
import inspect
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from tests.conftest import fuzz_case, rel_err, run_onnx
from onnxfuse import fuse_models
from onnxfuse.core.standard import standard_onnx
from onnxfuse.exporters import export_module
from onnxfuse.exporters.zoo import ZOO
from onnxfuse.runtime.torch.program import OnnxModule, TorchOptions, UnsupportedTorchOpError

RNG = np.random.default_rng(0)


def _vi(name, arr=None):
    if arr is None:
        return h.make_empty_tensor_value_info(name)
    return h.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape)


def one_node(op, inputs: dict, consts: dict | None = None, attrs: dict | None = None, opset: int = 17,
             n_out: int = 1, order: list | None = None, nodes: list | None = None):
    """A graph of one ``op`` node: ``inputs`` are graph inputs, ``consts`` initializers; input order is ``order``
    (names, "" for absent) or inputs then consts."""
    consts = consts or {}
    order = order if order is not None else list(inputs) + list(consts)
    outs = [f"y{k}" for k in range(n_out)]
    body = (nodes or []) + [h.make_node(op, order, outs, name=f"{op}_node", **(attrs or {}))]
    g = h.make_graph(body, "g", [_vi(n, a) for n, a in inputs.items()], [_vi(o) for o in outs],
                     [nh.from_array(np.asarray(v), n) for n, v in consts.items()])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m)  # declares the outputs' types


def compare(model, inputs: dict, tol: float = 1e-5, **kw) -> float:
    """Max |torch - onnxruntime| / max(1, |onnxruntime|) over every output; asserts it is below ``tol``."""
    ref = run_onnx(model, inputs)
    mod = OnnxModule(model, trainable=kw.pop("trainable", []), buffers=kw.pop("buffers", []), **kw)
    got = mod(**{k: torch.from_numpy(np.array(v)) for k, v in inputs.items()})
    worst = 0.0
    for g, r in zip(got, ref):
        g = g.detach().cpu().numpy()
        assert g.shape == r.shape and g.dtype == r.dtype, (g.shape, r.shape, g.dtype, r.dtype)
        if r.dtype == bool or np.issubdtype(r.dtype, np.integer):
            assert np.array_equal(g, r)
            continue
        err = float(np.max(np.abs(g - r)) / max(1.0, float(np.max(np.abs(r))))) if r.size else 0.0
        worst = max(worst, err)
    assert worst <= tol, worst
    return worst


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


X4 = rand(2, 4, 7, 6)

# ------------------------------------------------------------------------------------------------ elementwise
UNARY = ["Relu", "Sigmoid", "Tanh", "Exp", "Abs", "Neg", "Erf", "Softplus", "Softsign", "HardSwish", "Floor",
         "Ceil", "Round", "Sign", "Sin", "Cos", "Identity", "Reciprocal"]


@pytest.mark.parametrize("op", UNARY)
def test_unary(op):
    compare(one_node(op, {"x": rand(3, 5) * 3}), {"x": rand(3, 5) * 3})


@pytest.mark.parametrize("op,attrs,opset", [
    ("LeakyRelu", {"alpha": 0.1}, 17), ("Elu", {"alpha": 0.7}, 17), ("Celu", {"alpha": 0.5}, 17),
    ("Selu", {}, 17), ("Selu", {"alpha": 1.5, "gamma": 1.1}, 17), ("HardSigmoid", {}, 17),
    ("HardSigmoid", {"alpha": 1 / 6}, 17), ("Gelu", {}, 20), ("Gelu", {"approximate": "tanh"}, 20),
    ("ThresholdedRelu", {"alpha": 0.5}, 17), ("Shrink", {"lambd": 0.6}, 17),
    ("Shrink", {"lambd": 0.5, "bias": 0.5}, 17),
    ("Shrink", {"lambd": 0.5, "bias": 0.2}, 17), ("Mish", {}, 18), ("Sqrt", {}, 17), ("Log", {}, 17),
])
def test_unary_attrs(op, attrs, opset):
    x = rand(4, 6) * 3
    if op in ("Sqrt", "Log"):
        x = np.abs(x) + 0.1
    compare(one_node(op, {"x": x}, attrs=attrs, opset=opset), {"x": x})


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "Equal", "Less", "Greater",
                                "LessOrEqual", "GreaterOrEqual"])
def test_binary_broadcast(op):
    a, b = rand(2, 3, 4), rand(3, 1)
    if op == "Pow":
        a = np.abs(a) + 0.5
    compare(one_node(op, {"a": a, "b": b}), {"a": a, "b": b})


@pytest.mark.parametrize("op,fmod", [("Div", 0), ("Mod", 0), ("Mod", 1), ("Add", 0), ("Mul", 0)])
def test_integer_arithmetic(op, fmod):
    a = np.array([7, -7, 9, -9, 3], np.int64)
    b = np.array([2, 2, -4, -4, 3], np.int64)
    compare(one_node(op, {"a": a, "b": b}, attrs={"fmod": fmod} if op == "Mod" else {}), {"a": a, "b": b})


@pytest.mark.parametrize("op", ["And", "Or", "Xor", "Not"])
def test_bool(op):
    a, b = RNG.random(6) > 0.5, RNG.random(6) > 0.5
    ins = {"a": a} if op == "Not" else {"a": a, "b": b}
    compare(one_node(op, ins), ins)


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
def test_variadic(op):
    ins = {"a": rand(2, 3), "b": rand(3), "c": rand(1, 3)}
    compare(one_node(op, ins), ins)


@pytest.mark.parametrize("exponent", [2.0, 3.0, 0.5])
def test_pow_constant(exponent):
    x = np.abs(rand(3, 4)) + 0.1
    compare(one_node("Pow", {"x": x}, {"e": np.array(exponent, np.float32)}), {"x": x})


def test_where_cast_castlike_isinf_isnan():
    c, a, b = RNG.random((3, 4)) > 0.5, rand(3, 4), rand(4)
    compare(one_node("Where", {"c": c, "a": a, "b": b}), {"c": c, "a": a, "b": b})
    x = rand(3, 4) * 5
    compare(one_node("Cast", {"x": x}, attrs={"to": TP.INT64}), {"x": x})
    compare(one_node("Cast", {"x": x}, attrs={"to": TP.BOOL}), {"x": x})
    compare(one_node("CastLike", {"x": x, "like": np.zeros(1, np.int64)}), {"x": x, "like": np.zeros(1, np.int64)})
    y = np.array([1.0, np.inf, -np.inf, np.nan], np.float32)
    for attrs in ({}, {"detect_negative": 0}, {"detect_positive": 0}):
        compare(one_node("IsInf", {"y": y}, attrs=attrs), {"y": y})
    compare(one_node("IsNaN", {"y": y}), {"y": y})


@pytest.mark.parametrize("bounds", [(-0.5, 0.7), (None, 0.7), (-0.5, None), (0.0, 6.0)])
@pytest.mark.parametrize("runtime", [False, True])
def test_clip(bounds, runtime):
    x = rand(3, 5) * 4
    ins, consts, order = {"x": x}, {}, ["x"]
    for n, v in zip(("lo", "hi"), bounds):
        if v is None:
            order.append("")
        else:
            (ins if runtime else consts)[n] = np.array(v, np.float32)
            order.append(n)
    compare(one_node("Clip", ins, consts, order=order), ins)


def test_prelu():
    x, slope = rand(2, 3, 4, 4), rand(3, 1, 1)
    compare(one_node("PRelu", {"x": x, "s": slope}), {"x": x, "s": slope})


# ------------------------------------------------------------------------------------------ matrix products
@pytest.mark.parametrize("ta,tb,alpha,beta,c", [(0, 0, 1.0, 1.0, True), (1, 0, 0.5, 1.0, True),
                                                 (0, 1, 1.0, 2.0, True), (1, 1, 2.0, 1.0, False)])
def test_gemm(ta, tb, alpha, beta, c):
    a = rand(5, 3) if ta else rand(3, 5)
    b = rand(4, 5) if tb else rand(5, 4)
    consts = {"b": b, **({"c": rand(4)} if c else {})}
    compare(one_node("Gemm", {"a": a}, consts, attrs=dict(transA=ta, transB=tb, alpha=alpha, beta=beta)), {"a": a})


@pytest.mark.parametrize("sa,sb", [((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (3, 4, 2)), ((4,), (2, 4, 3))])
def test_matmul(sa, sb):
    ins = {"a": rand(*sa), "b": rand(*sb)}
    compare(one_node("MatMul", ins), ins)


def test_einsum():
    ins = {"a": rand(2, 3, 4, 5), "b": rand(2, 3, 6, 5)}
    compare(one_node("Einsum", ins, attrs={"equation": "bhtd,bhsd->bhts"}), ins)


# ------------------------------------------------------------------------------------------ convolution
@pytest.mark.parametrize("S", [1, 2, 3])
@pytest.mark.parametrize("attrs", [
    {}, {"group": 2}, {"strides": "2", "pads": "1"}, {"dilations": "2", "pads": "2", "group": 4},
    {"pads": "asym"}, {"auto_pad": "SAME_UPPER", "strides": "2"}, {"auto_pad": "SAME_LOWER"}, {"auto_pad": "VALID"},
])
def test_conv(S, attrs):
    shape = {1: (2, 4, 9), 2: (2, 4, 7, 6), 3: (1, 4, 5, 6, 5)}[S]
    k = 3
    a = dict(attrs)
    for key in ("strides", "dilations"):
        if key in a:
            a[key] = [int(a[key])] * S
    if a.get("pads") == "asym":
        a["pads"] = [0] * S + [1] * S
    elif "pads" in a:
        a["pads"] = [int(a["pads"])] * (2 * S)
    group = a.get("group", 1)
    if a.get("auto_pad", "").startswith("SAME") and S == 3:
        a.pop("strides", None)
    x = rand(*shape)
    w = rand(6 if group != 4 else 8, 4 // group, *[k] * S)
    compare(one_node("Conv", {"x": x}, {"w": w, "b": rand(w.shape[0])}, attrs=a), {"x": x})


@pytest.mark.parametrize("attrs", [
    {}, {"strides": [2, 2]}, {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
    {"group": 2, "dilations": [2, 2]}, {"pads": [0, 1, 1, 0], "strides": [2, 1]},
    {"strides": [2, 2], "output_shape": [10, 9]}, {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
])
def test_conv_transpose(attrs):
    x = rand(2, 4, 4, 5)
    w = rand(4, 3, 3, 3)
    compare(one_node("ConvTranspose", {"x": x}, {"w": w, "b": rand(3 * attrs.get("group", 1))}, attrs=attrs),
            {"x": x})


def test_conv_transpose_1d_no_bias():
    x = rand(2, 4, 6)
    compare(one_node("ConvTranspose", {"x": x}, {"w": rand(4, 2, 3)}, attrs={"strides": [3], "pads": [1, 1]}),
            {"x": x})


# ------------------------------------------------------------------------------------------------- pooling
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [2, 2], "strides": [2, 2]}, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 2], "pads": [0, 1, 2, 0], "strides": [2, 1]},
    {"kernel_shape": [2, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]},
    {"kernel_shape": [3, 3], "auto_pad": "VALID"},
    {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
    {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},  # 7x6: ORT agrees here (no window in the pads)
    {"kernel_shape": [2, 2], "dilations": [2, 2]},
])
def test_pool(op, attrs):
    a = dict(attrs)
    if op == "MaxPool":
        a.pop("count_include_pad", None)
    compare(one_node(op, {"x": X4}, attrs=a, opset=19), {"x": X4})


@pytest.mark.parametrize("S", [1, 3])
def test_pool_1d_3d(S):
    x = rand(*(2, 3) + (7, 6, 5)[:S])
    for op in ("MaxPool", "AveragePool"):
        compare(one_node(op, {"x": x}, attrs={"kernel_shape": [2] * S, "strides": [2] * S, "pads": [1] * 2 * S}),
                {"x": x})


@pytest.mark.parametrize("include", [0, 1])
def test_pool_ceil_mode_like_torch(include):
    """ceil_mode where the last window starts in the end padding: torch's (= ONNX opset 19's) count, and torch's
    divisors (ORT 1.19 differs here: onnxfuse/core/windows.py)."""
    x = rand(2, 3, 8, 7)
    for op in ("MaxPool", "AveragePool"):
        attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}
        if op == "AveragePool":
            attrs["count_include_pad"] = include
        mod = OnnxModule(one_node(op, {"x": x}, attrs=attrs, opset=19))
        got = mod(x=torch.from_numpy(x))[0]
        t = torch.from_numpy(x)
        ref = torch.nn.functional.max_pool2d(t, 3, 2, 1, ceil_mode=True) if op == "MaxPool" else \
            torch.nn.functional.avg_pool2d(t, 3, 2, 1, ceil_mode=True, count_include_pad=bool(include))
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=1e-6)


def test_maxpool_indices():
    compare(one_node("MaxPool", {"x": X4}, attrs={"kernel_shape": [2, 2], "strides": [2, 2]}, n_out=2), {"x": X4})


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"])
def test_global_pool(op):
    compare(one_node(op, {"x": X4}), {"x": X4})


def test_lp_pool():
    compare(one_node("LpPool", {"x": X4}, attrs={"kernel_shape": [2, 3], "p": 3, "pads": [1, 0, 1, 1]}), {"x": X4},
            tol=1e-4)


# ------------------------------------------------------------------------------------------- normalization
def _bn_model(opset, training, n_out, momentum=0.9, shape=(4, 3, 5, 5)):
    x = rand(*shape)
    C = shape[1]
    consts = {"s": rand(C), "b": rand(C), "m": rand(C), "v": RNG.uniform(0.5, 1.5, C).astype(np.float32)}
    attrs = {"epsilon": 1e-3, "momentum": momentum}
    if opset >= 14:
        attrs["training_mode"] = int(training)
    return one_node("BatchNormalization", {"x": x}, consts, attrs=attrs, opset=opset, n_out=n_out), x


@pytest.mark.parametrize("opset,training,n_out", [(15, 0, 1), (15, 1, 3), (14, 1, 3), (13, 1, 5), (13, 0, 1)])
def test_batchnorm_onnx_spec(opset, training, n_out):
    """ONNX's running statistics (biased variance), as onnxruntime computes them; opset 9 saved outputs too."""
    model, x = _bn_model(opset, training, n_out)
    compare(model, {"x": x}, trainable=["s", "b"], buffers=["m", "v"],
            options=TorchOptions(running_var="biased", update_stats=False))


@pytest.mark.parametrize("shape", [(8, 3, 5, 5), (6, 4, 7)])
@pytest.mark.parametrize("update_stats", [True, False])
def test_batchnorm_is_torch(shape, update_stats):
    """Training mode: y and the running statistics bit-identical to torch.nn.BatchNorm (unbiased running_var), in
    place in the module's buffers or returned; eval mode uses them."""
    model, x = _bn_model(17, True, 3, momentum=0.7, shape=shape)
    mod = OnnxModule(model, trainable=["s", "b"], buffers=["m", "v"], options=TorchOptions(update_stats=update_stats))
    bn = (torch.nn.BatchNorm2d if len(shape) == 4 else torch.nn.BatchNorm1d)(shape[1], eps=1e-3, momentum=0.3)
    with torch.no_grad():
        bn.weight.copy_(mod.parameter("s")), bn.bias.copy_(mod.parameter("b"))
        bn.running_mean.copy_(mod.buffer("m")), bn.running_var.copy_(mod.buffer("v"))
    before = mod.buffer("v").clone()
    t = torch.from_numpy(x)
    y, rm, rv = mod(x=t)
    ref = bn.train()(t)
    assert torch.equal(y, ref)
    assert torch.equal(rm, bn.running_mean) and torch.equal(rv, bn.running_var)
    assert torch.equal(mod.buffer("v"), bn.running_var if update_stats else before)
    assert not rm.requires_grad and y.requires_grad
    mod.eval()
    with torch.no_grad():
        mod.buffer("m").copy_(bn.running_mean), mod.buffer("v").copy_(bn.running_var)
    assert torch.allclose(mod(x=t)[0], bn.eval()(t), atol=1e-6)


@pytest.mark.parametrize("axis,n_out,opset", [(-1, 1, 17), (1, 1, 17), (2, 3, 17), (-2, 1, 20)])
def test_layernorm(axis, n_out, opset):
    x = rand(2, 3, 4, 5)
    shape = x.shape[axis:]
    compare(one_node("LayerNormalization", {"x": x}, {"s": rand(*shape), "b": rand(*shape)},
                     attrs={"axis": axis, "epsilon": 1e-5}, n_out=n_out, opset=opset), {"x": x})


def test_layernorm_ones_zeros_and_instancenorm():
    x = rand(2, 3, 4, 5)
    compare(one_node("LayerNormalization", {"x": x}, {"s": np.ones(5, np.float32), "b": np.zeros(5, np.float32)}),
            {"x": x})
    compare(one_node("InstanceNormalization", {"x": x}, {"s": rand(3), "b": rand(3)}, attrs={"epsilon": 1e-4}),
            {"x": x})


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("axis", [-1, 1, 0])
def test_softmax(op, axis):
    compare(one_node(op, {"x": X4}, attrs={"axis": axis}), {"x": X4})


# ------------------------------------------------------------------------------------------------ reductions
REDUCE = ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceLogSumExp", "ReduceSumSquare", "ReduceLogSum"]


@pytest.mark.parametrize("op", REDUCE)
@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axes,keepdims", [([1], 1), ([-1, 1], 0), (None, 1), (None, 0)])
def test_reduce(op, opset, axes, keepdims):
    x = np.abs(rand(2, 3, 4)) + 0.5 if op == "ReduceLogSum" else rand(2, 3, 4)
    as_input = opset >= (13 if op == "ReduceSum" else 18)
    consts = {"axes": np.array(axes, np.int64)} if axes is not None and as_input else {}
    attrs = {"keepdims": keepdims}
    if axes is not None and not as_input:
        attrs["axes"] = axes
    compare(one_node(op, {"x": x}, consts, attrs=attrs, opset=opset), {"x": x}, tol=1e-5)


def test_reduce_noop_with_empty_axes():
    x = torch.randn(2, 3)  # (onnxruntime 1.19 fails on this graph, so torch is the reference)
    for op in ("ReduceSum", "ReduceMean"):
        mod = OnnxModule(one_node(op, {"x": x.numpy()}, attrs={"noop_with_empty_axes": 1}, opset=18))
        assert torch.equal(mod(x=x)[0], x)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("attrs", [{}, {"axis": 1, "keepdims": 0}, {"axis": -1, "select_last_index": 1}])
def test_argmax(op, attrs):
    x = np.round(rand(3, 4, 5))  # ties
    compare(one_node(op, {"x": x}, attrs=attrs), {"x": x})


@pytest.mark.parametrize("exclusive,reverse,axis", [(0, 0, 1), (1, 0, 1), (0, 1, -1), (1, 1, 0)])
def test_cumsum(exclusive, reverse, axis):
    x = rand(3, 4)
    compare(one_node("CumSum", {"x": x}, {"a": np.array(axis, np.int64)}, attrs=dict(exclusive=exclusive,
                                                                                         reverse=reverse)), {"x": x})


# ---------------------------------------------------------------------------------------------- shape ops
def test_shape_size_and_runtime_reshape():
    """x.view(x.size(0), -1)-style: Shape -> Gather -> Unsqueeze -> Concat -> Reshape, on the host."""
    x = rand(3, 4, 5)
    nodes = [h.make_node("Shape", ["x"], ["s"]), h.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             h.make_node("Unsqueeze", ["n", "ax0"], ["n1"]), h.make_node("Concat", ["n1", "minus1"], ["t"], axis=0)]
    consts = {"zero": np.array(0, np.int64), "ax0": np.array([0], np.int64), "minus1": np.array([-1], np.int64)}
    compare(one_node("Reshape", {"x": x}, consts, order=["x", "t"], nodes=nodes), {"x": x})
    for attrs in ({}, {"start": 1}, {"start": -2, "end": -1}):
        compare(one_node("Shape", {"x": x}, attrs=attrs, opset=15), {"x": x})
    compare(one_node("Size", {"x": x}), {"x": x})


@pytest.mark.parametrize("target,allowzero", [([0, -1], 0), ([0, 2, -1], 0), ([-1], 0), ([3, 20], 1)])
def test_reshape(target, allowzero):
    x = rand(3, 4, 5)
    compare(one_node("Reshape", {"x": x}, {"t": np.array(target, np.int64)}, attrs={"allowzero": allowzero},
                     opset=14), {"x": x})


def test_reshape_channels_last():
    """A channels-last (non-contiguous) input is reshaped, never viewed."""
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    mod = OnnxModule(one_node("Reshape", {"x": x.numpy()}, {"t": np.array([2, -1], np.int64)}))
    assert torch.equal(mod(x=x)[0], x.reshape(2, -1))


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_flatten(axis):
    compare(one_node("Flatten", {"x": X4}, attrs={"axis": axis}), {"x": X4})


@pytest.mark.parametrize("perm", [None, [0, 2, 3, 1], [1, 0, 3, 2]])
def test_transpose(perm):
    compare(one_node("Transpose", {"x": X4}, attrs={} if perm is None else {"perm": perm}), {"x": X4})


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axes", [[1], [0, -1], None])
def test_squeeze_unsqueeze(opset, axes):
    x = rand(1, 3, 1, 4, 1)
    if axes is None:
        compare(one_node("Squeeze", {"x": x}, opset=opset), {"x": x})
        return
    ax = [a if a >= 0 else a for a in axes]
    sq_axes = [0, -1] if len(ax) == 2 else [2]
    for op, a in (("Squeeze", sq_axes), ("Unsqueeze", ax)):
        if opset >= 13:
            compare(one_node(op, {"x": x}, {"axes": np.array(a, np.int64)}, opset=opset), {"x": x})
        else:
            compare(one_node(op, {"x": x}, attrs={"axes": a}, opset=opset), {"x": x})


@pytest.mark.parametrize("xs,target", [((3, 1), [2, 3, 4]), ((2, 3, 4), [3, 1]), ((1,), [2, 2])])
def test_expand(xs, target):
    x = rand(*xs)
    compare(one_node("Expand", {"x": x}, {"t": np.array(target, np.int64)}), {"x": x})


def test_tile_concat():
    x = rand(2, 3)
    compare(one_node("Tile", {"x": x}, {"r": np.array([2, 3], np.int64)}), {"x": x})
    ins = {"a": rand(2, 3), "b": rand(2, 1), "c": rand(2, 4)}
    compare(one_node("Concat", ins, attrs={"axis": -1}), ins)


@pytest.mark.parametrize("opset,form", [(13, "input"), (13, "equal"), (18, "num_outputs"), (18, "input"),
                                        (11, "attr")])
def test_split(opset, form):
    x = rand(2, 7, 3)
    if form == "input":
        m = one_node("Split", {"x": x}, {"s": np.array([1, 6], np.int64)}, attrs={"axis": 1}, n_out=2, opset=opset)
    elif form == "attr":
        m = one_node("Split", {"x": x}, attrs={"axis": 1, "split": [2, 5]}, n_out=2, opset=opset)
    elif form == "num_outputs":
        m = one_node("Split", {"x": x}, attrs={"axis": 1, "num_outputs": 3}, n_out=3, opset=opset)
    else:
        x = rand(2, 6, 3)
        m = one_node("Split", {"x": x}, attrs={"axis": 1}, n_out=3, opset=opset)
    compare(m, {"x": x})


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1], [3], [1], None), ([0, 1], [2**63 - 1, -1], [0, -1], None), ([-1], [-2**63], [2], [-1]),
    ([5, 0], [0, 6], [1, 2], [-2, 2]), ([1], [100], None, [2]),
])
def test_slice(starts, ends, axes, steps):
    x = rand(3, 6, 7)
    consts = {"s": np.array(starts, np.int64), "e": np.array(ends, np.int64)}
    order = ["x", "s", "e"]
    if axes is not None:
        consts["a"] = np.array(axes, np.int64)
        order.append("a")
    if steps is not None:
        if axes is None:
            consts["a"] = np.arange(len(starts), dtype=np.int64)
            order.append("a")
        consts["st"] = np.array(steps, np.int64)
        order.append("st")
    compare(one_node("Slice", {"x": x}, consts, order=order), {"x": x})


def test_slice_runtime_starts():
    x = rand(4, 6)
    ins = {"x": x, "s": np.array([1], np.int64), "e": np.array([-1], np.int64)}
    compare(one_node("Slice", ins, {"a": np.array([1], np.int64)}), ins)


@pytest.mark.parametrize("mode,opset", [("constant", 17), ("reflect", 17), ("edge", 17), ("wrap", 19)])
@pytest.mark.parametrize("pads", [[0, 0, 1, 2, 0, 0, 2, 1], [0, 1, 0, 0, 0, 0, 0, 2]])
def test_pad(mode, opset, pads):
    x = rand(2, 3, 4, 5)
    consts = {"p": np.array(pads, np.int64)}
    order = ["x", "p"]
    if mode == "constant":
        consts["v"] = np.array(1.5, np.float32)
        order.append("v")
    compare(one_node("Pad", {"x": x}, consts, attrs={"mode": mode}, order=order, opset=opset), {"x": x})


def test_pad_axes_and_negative():
    x = rand(2, 3, 4, 5)
    compare(one_node("Pad", {"x": x}, {"p": np.array([1, -1, 2, 1], np.int64), "a": np.array([-1, 1], np.int64)},
                     order=["x", "p", "", "a"], opset=18), {"x": x})


@pytest.mark.parametrize("op,mode", [("DepthToSpace", "CRD"), ("DepthToSpace", "DCR"), ("SpaceToDepth", None)])
def test_depth_space(op, mode):
    x = rand(2, 8, 4, 6)
    compare(one_node(op, {"x": x}, attrs={"blocksize": 2, **({"mode": mode} if mode else {})}), {"x": x})


@pytest.mark.parametrize("idx,axis", [(np.array(1), 0), (np.array([[0, -1], [2, 1]]), 1), (np.array([3, 0]), -1)])
@pytest.mark.parametrize("runtime", [False, True])
def test_gather(idx, axis, runtime):
    x = rand(4, 3, 5)
    i = idx.astype(np.int64)
    if runtime:
        compare(one_node("Gather", {"x": x, "i": i}, attrs={"axis": axis}), {"x": x, "i": i})
    else:
        compare(one_node("Gather", {"x": x}, {"i": i}, attrs={"axis": axis}), {"x": x})


def test_gather_elements():
    x, i = rand(3, 4), np.array([[0, -1, 2, 1], [3, 0, 0, 1]], np.int64)
    compare(one_node("GatherElements", {"x": x, "i": i}, attrs={"axis": 1}), {"x": x, "i": i})


def test_constants_and_generators():
    """Constant in each form; ConstantOfShape and Range from run-time (host) shape values."""
    x = rand(3, 4)
    for attrs in ({"value": nh.from_array(rand(2, 2))}, {"value_float": 2.5}, {"value_floats": [1.0, 2.0]},
                  {"value_int": 3}, {"value_ints": [1, 2]}):
        compare(one_node("Constant", {}, attrs=attrs), {})
    nodes = [h.make_node("Shape", ["x"], ["s"])]
    compare(one_node("ConstantOfShape", {"x": x}, order=["s"], nodes=nodes,
                     attrs={"value": nh.from_array(np.array([7], np.int64))}), {"x": x})
    nodes = [h.make_node("Shape", ["x"], ["s"]), h.make_node("Gather", ["s", "one"], ["n"], axis=0)]
    compare(one_node("Range", {"x": x}, {"one": np.array(1, np.int64), "z": np.array(0, np.int64)},
                     order=["z", "n", "one"], nodes=nodes), {"x": x})


# ---------------------------------------------------------------------------------------------------- Resize
@pytest.mark.parametrize("mode,ctm,nearest", [
    ("nearest", "asymmetric", "floor"), ("linear", "half_pixel", None), ("linear", "align_corners", None),
    ("linear", "pytorch_half_pixel", None), ("linear", "asymmetric", None),
    ("nearest", "half_pixel", "round_prefer_floor"), ("nearest", "half_pixel", "round_prefer_ceil"),
    ("nearest", "align_corners", "round_prefer_floor"), ("nearest", "tf_half_pixel_for_nn", "ceil"),
    ("cubic", "half_pixel", None), ("cubic", "align_corners", None),
])
@pytest.mark.parametrize("by", ["scales", "sizes"])
def test_resize(mode, ctm, nearest, by):
    x = rand(2, 3, 5, 4)
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm}
    if nearest:
        attrs["nearest_mode"] = nearest
    if by == "scales":
        consts, order = {"sc": np.array([1, 1, 2.0, 1.5], np.float32)}, ["x", "", "sc"]
    else:
        consts, order = {"sz": np.array([2, 3, 9, 7], np.int64)}, ["x", "", "", "sz"]
    compare(one_node("Resize", {"x": x}, consts, attrs=attrs, order=order, opset=13), {"x": x}, tol=1e-5)


def test_resize_opset18_axes_and_fused_layout():
    """Opset 18 ``axes``; and a [B, N, C, H, W] tensor (the fused stacked layout) resized on its last two axes."""
    x = rand(2, 3, 5, 4)
    compare(one_node("Resize", {"x": x}, {"sc": np.array([2.0, 3.0], np.float32)}, order=["x", "", "sc"], opset=18,
                     attrs={"mode": "linear", "axes": [2, 3]}), {"x": x})
    x5 = rand(2, 2, 3, 4, 4)
    compare(one_node("Resize", {"x": x5}, {"sc": np.array([1, 1, 1, 2.0, 2.0], np.float32)}, order=["x", "", "sc"],
                     attrs={"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                            "nearest_mode": "floor"}),
            {"x": x5})


# ------------------------------------------------------------------------------------------------- Dropout
def test_dropout():
    """Off (identity, mask all True) unless training_mode and module.train(); then torch's dropout: kept elements
    scaled by 1/(1-p), about p dropped, and the mask says which."""
    x = rand(200, 50)
    consts = {"r": np.array(0.3, np.float32), "t": np.array(True)}
    compare(one_node("Dropout", {"x": x}, {"r": consts["r"]}, n_out=2), {"x": x})
    m = one_node("Dropout", {"x": x}, consts, n_out=2)
    mod = OnnxModule(m, trainable=[])
    y, mask = mod(x=torch.from_numpy(x))
    assert abs(1 - float(mask.float().mean()) - 0.3) < 0.02
    assert torch.allclose(y[mask], torch.from_numpy(x)[mask] / 0.7) and bool((y[~mask] == 0).all())
    y2, mask2 = mod.eval()(x=torch.from_numpy(x))
    assert torch.equal(y2, torch.from_numpy(x)) and bool(mask2.all())


def test_unsupported_op_is_one_clear_line():
    m = one_node("SplitToSequence", {"x": rand(1, 4, 4)})
    with pytest.raises(UnsupportedTorchOpError) as e:
        OnnxModule(m)
    msg = str(e.value)
    assert "SplitToSequence_node" in msg and "opset 17" in msg and "To fix this" in msg and "\n" not in msg


def test_state_names_and_folding():
    """Initializers with dots keep their ONNX names (mapped to sanitized keys); constant subgraphs are folded."""
    x = rand(2, 3)
    nodes = [h.make_node("Add", ["c1", "c2"], ["c3"])]
    m = one_node("Add", {"x": x}, {"lin.weight": rand(3), "c1": rand(3), "c2": rand(3)},
                 order=["x", "c3"], nodes=nodes + [h.make_node("Mul", ["x", "lin.weight"], ["unused"])])
    mod = OnnxModule(m, trainable=["lin.weight"])
    assert isinstance(mod.parameter("lin.weight"), torch.nn.Parameter)
    assert list(mod.onnx_state()) == ["lin.weight"]
    assert len(mod._programs[True].steps) == 2  # the constant Add is folded
    compare(m, {"x": x})


# ------------------------------------------------------------------------------- model level: zoo and fuzz
def _zoo_modules(name, B):
    fac = ZOO[name].factory
    kw = {"dropout": 0.0} if "dropout" in inspect.signature(fac).parameters else {}
    mods = []
    for b in range(B):
        torch.manual_seed(b)
        mods.append(fac(**kw).train())
    return mods


def _zoo_input(name, n, seed):
    e = ZOO[name]
    g = torch.Generator().manual_seed(seed)
    shape = (n,) + tuple(e.input_shape[1:])
    return torch.randint(0, e.input_high, shape, generator=g) if e.input_dtype == "int64" else \
        torch.randn(shape, generator=g)


FORWARD_TOL, GRAD_TOL = 1e-5, 1e-4


def _check_fused_forward(paths, x, per_model=()):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fa = fuse_models(paths, per_model_inputs=per_model)
    mod = OnnxModule.from_array(fa.model, fa.spec)
    ref = run_onnx(standard_onnx(fa.model), {"input": x.numpy()})  # a batched recurrence as B standard nodes
    got = mod(input=x)
    errs = [rel_err(g.detach().numpy(), r) for g, r in zip(got, ref)]
    assert max(errs) < FORWARD_TOL, errs
    return max(errs)


def _check_original_gradients(path, module, x, tol=GRAD_TOL):
    """The converted exported model's parameter gradients and BatchNorm statistics equal the torch module's.

    A gradient that float32 itself cannot pin down (a bias right before a normalization has a true gradient of 0,
    so both sides hold rounding noise) is judged against torch's own float32-vs-float64 difference instead."""
    model = onnx.load(path)
    conv = OnnxModule(model)
    refs = {}
    for dtype in (torch.float32, torch.float64):
        m = copy.deepcopy(module).to(dtype).train()
        xd = x.to(dtype) if x.is_floating_point() else x
        refs[dtype] = (m, m(xd))
    ref_mod, ref = refs[torch.float32]
    out = conv(input=x)[0]
    assert rel_err(out.detach().numpy(), ref.detach().numpy()) < FORWARD_TOL
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    for m, y in refs.values():
        (y * w.to(y.dtype)).sum().backward()
    (out * w).sum().backward()
    params = dict(ref_mod.named_parameters())
    params64 = dict(refs[torch.float64][0].named_parameters())
    # an embedding's padding rows: the exported Gather passes them a gradient, which the runtimes mask from the
    # exporter's record (onnxfuse/core/semantics.py, tested against torch in test_semantics.py); here, as they do
    meta = next((json.loads(m.value) for m in model.metadata_props if m.key == "onnxfuse"), {})
    for table, rows in meta.get("padding_rows", {}).items():
        conv.onnx_state()[table].grad[rows] = 0
    worst = 0.0
    for name, p in conv.onnx_state().items():
        if isinstance(p, torch.nn.Parameter):
            g_ref = params[name].grad
            if g_ref is None:
                assert p.grad is None or float(p.grad.abs().max()) == 0.0, name
                continue
            err = rel_err(p.grad.numpy(), g_ref.numpy())
            sensitivity = rel_err(g_ref.numpy(), params64[name].grad.numpy())
            assert err < max(tol, 10 * sensitivity), (name, err, sensitivity)
            if sensitivity < tol / 10:
                worst = max(worst, err)
        else:  # buffers: BatchNorm running statistics after one training forward, torch's rule
            err = rel_err(p.numpy(), ref_mod.state_dict()[name].numpy())
            assert err < 1e-6, (name, err)
            worst = max(worst, err)
    return worst


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo(name, tmp_path):
    mods = _zoo_modules(name, 2)
    x = _zoo_input(name, 4, 1)
    paths = []
    for b, m in enumerate(mods):
        paths.append(str(tmp_path / f"m{b}.onnx"))
        export_module(m, paths[-1], example_inputs=(x,))
    _check_fused_forward(paths, _zoo_input(name, 5, 2))
    _check_original_gradients(paths[0], mods[0], _zoo_input(name, 6, 3))


def _check_fuzz(seed, tmp_path):
    case, paths, per_model = fuzz_case(seed, tmp_path)
    _check_fused_forward(paths, case.inputs(), per_model)
    x = case.inputs()
    _check_original_gradients(paths[0], case.mods[0], case.model_input(x, 0))


@pytest.mark.parametrize("seed", range(40))
def test_fuzz(seed, tmp_path):
    _check_fuzz(seed, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40, 400))
def test_fuzz_sweep(seed, tmp_path):
    _check_fuzz(seed, tmp_path)


# --------------------------------------------------- the rest of ONNX's default domain (issue 39), against ORT
def compare_reference(model, inputs: dict, tol: float = 1e-5) -> float:
    """As :func:`compare`, judged by ONNX's own reference implementation (onnx.reference) where onnxruntime has no
    kernel (DeformConv)."""
    from onnx.reference import ReferenceEvaluator

    ref = ReferenceEvaluator(model).run(None, inputs)
    got = OnnxModule(model, trainable=[])(**{k: torch.from_numpy(np.array(v)) for k, v in inputs.items()})
    worst = max(float(np.max(np.abs(g.detach().numpy() - r)) / max(1.0, float(np.max(np.abs(r)))))
                for g, r in zip(got, ref))
    assert worst <= tol, worst
    return worst


def gradients(model, inputs: dict, wrt: list[str], reference, seed: int = 0) -> None:
    """The kernel's gradients w.r.t. the inputs ``wrt`` equal those of ``reference`` (torch's own function of the
    same inputs, as tensors by name), for a random weighting of the first output."""
    mine = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in inputs.items()}
    theirs = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in inputs.items()}
    out = OnnxModule(model, trainable=[])(**mine)[0]
    ref = reference(**theirs)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    for k in wrt:
        assert rel_err(mine[k].grad.numpy(), theirs[k].grad.numpy()) < 1e-6, k


@pytest.mark.parametrize("op,low", [("Tan", -1.2), ("Asin", -0.9), ("Acos", -0.9), ("Atan", -3), ("Sinh", -3),
                                    ("Cosh", -3), ("Asinh", -3), ("Acosh", 1.1), ("Atanh", -0.9)])
def test_trigonometric(op, low):
    x = (np.linspace(low, -low if low < 0 else 3.0, 24, dtype=np.float32)).reshape(4, 6)
    compare(one_node(op, {"x": x}), {"x": x})


@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot"])
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int64])
def test_bitwise(op, dtype):
    a = RNG.integers(0, 120, (3, 5)).astype(dtype)
    b = RNG.integers(0, 120, (3, 5)).astype(dtype)
    feeds = {"a": a} if op == "BitwiseNot" else {"a": a, "b": b}
    compare(one_node(op, feeds, opset=18), feeds)


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.uint64])
def test_bit_shift(direction, dtype):
    a = np.array([1, 7, 200, 255, 16, 3], dtype)
    if dtype == np.uint64:
        a[3] = np.uint64(2 ** 64 - 1)  # the top bit set: a logical right shift clears it
    s = np.array([0, 1, 2, 3, 4, 7], dtype)
    compare(one_node("BitShift", {"a": a, "s": s}, attrs={"direction": direction}), {"a": a, "s": s})


@pytest.mark.parametrize("batch_dims,idx", [(0, np.array([[0, 1], [2, -1]])), (0, np.array([[1], [0]])),
                                             (1, np.array([[1], [0], [2]]))])
def test_gather_nd(batch_dims, idx):
    x = rand(3, 4, 5)
    i = idx.astype(np.int64)
    m = one_node("GatherND", {"x": x, "i": i}, attrs={"batch_dims": batch_dims})
    compare(m, {"x": x, "i": i})
    ii = torch.from_numpy(np.where(i < 0, i + 4, i))
    if batch_dims == 0:
        def ref(x, i):
            return x[tuple(ii.unbind(-1))]
    else:
        def ref(x, i):
            return torch.stack([x[b][tuple(ii[b].unbind(-1))] for b in range(3)])
    gradients(m, {"x": x, "i": i}, ["x"], ref)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_elements(reduction):
    """Message passing: updates [N, E] scattered into [N, V] at edge targets (repeats combine unless 'none')."""
    x, u = rand(3, 6), rand(3, 8)
    i = RNG.integers(-6, 6, (3, 8)).astype(np.int64)
    if reduction == "none":  # duplicate targets have no defined winner: one target each
        i = np.stack([RNG.permutation(6)[:8 if False else 6] for _ in range(3)]).astype(np.int64)
        u = u[:, :6]
    m = one_node("ScatterElements", {"x": x, "i": i, "u": u}, attrs={"axis": 1, "reduction": reduction}, opset=18)
    compare(m, {"x": x, "i": i, "u": u})
    if reduction in ("none", "add"):
        ii = torch.from_numpy(np.where(i < 0, i + 6, i))
        f = torch.scatter if reduction == "none" else torch.scatter_add
        gradients(m, {"x": x, "i": i, "u": u}, ["x", "u"], lambda x, i, u: f(x, 1, ii, u))


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_nd(reduction):
    x = rand(4, 3, 2)
    i = np.array([[1, 0], [3, 2], [1, 0], [-1, 1]] if reduction != "none" else [[1, 0], [3, 2], [0, 1]], np.int64)
    u = rand(len(i), 2)
    m = one_node("ScatterND", {"x": x, "i": i, "u": u}, attrs={"reduction": reduction}, opset=18)
    compare(m, {"x": x, "i": i, "u": u})


def test_compress_nonzero_unique():
    x = rand(4, 5)
    for attrs, cond in (({"axis": 0}, np.array([True, False, True], bool)), ({"axis": -1}, np.array([0, 1, 1, 0, 1],
                        bool)), ({}, np.array([1, 0, 0, 1] * 5, bool))):
        compare(one_node("Compress", {"x": x, "c": cond}, attrs=attrs), {"x": x, "c": cond})
    z = np.array([[0, 1.5, 0], [2, 0, -1]], np.float32)
    compare(one_node("NonZero", {"z": z}), {"z": z})
    for attrs in ({}, {"sorted": 0}, {"axis": 0}, {"axis": 1, "sorted": 0}):
        u = np.array([[2, 1, 2], [0, 1, 0], [2, 1, 2], [3, 3, 3]], np.float32)
        compare(one_node("Unique", {"u": u}, attrs=attrs, n_out=4), {"u": u})


@pytest.mark.parametrize("largest,axis", [(1, -1), (0, 1), (1, 0)])
def test_top_k(largest, axis):
    """TopK routing: the k best experts' scores and indices; the scores' gradient is torch.topk's."""
    x = rand(4, 7)
    m = one_node("TopK", {"x": x}, {"k": np.array([3], np.int64)}, attrs={"axis": axis, "largest": largest}, n_out=2)
    compare(m, {"x": x})
    gradients(m, {"x": x}, ["x"], lambda x: torch.topk(x, 3, axis, bool(largest))[0])
    rk = one_node("TopK", {"x": x, "k": np.array([2], np.int64)}, attrs={"axis": axis}, n_out=2)
    compare(rk, {"x": x, "k": np.array([2], np.int64)})


def test_one_hot_eye_like_trilu():
    i = np.array([[0, 3, -1], [5, 2, -4]], np.int64)
    vals = np.array([-1.0, 2.0], np.float32)
    for axis in (-1, 0, 1):
        compare(one_node("OneHot", {"i": i}, {"d": np.array(4, np.int64), "v": vals}, attrs={"axis": axis}), {"i": i})
    x = rand(3, 5)
    for k in (0, 2, -1):
        compare(one_node("EyeLike", {"x": x}, attrs={"k": k}), {"x": x})
    compare(one_node("EyeLike", {"x": x}, attrs={"dtype": TP.INT64}), {"x": x})
    x3 = rand(2, 4, 5)
    for upper in (0, 1):
        for k in (0, 1, -2):
            m = one_node("Trilu", {"x": x3}, {"k": np.array(k, np.int64)}, attrs={"upper": upper})
            compare(m, {"x": x3})
        compare(one_node("Trilu", {"x": x3}, attrs={"upper": upper}), {"x": x3})


@pytest.mark.parametrize("time_axis,batch_axis", [(0, 1), (1, 0)])
def test_reverse_sequence(time_axis, batch_axis):
    x = rand(5, 3, 2) if time_axis == 0 else rand(3, 5, 2)
    lens = np.array([5, 2, 1], np.int64)
    m = one_node("ReverseSequence", {"x": x, "l": lens}, attrs={"time_axis": time_axis, "batch_axis": batch_axis})
    compare(m, {"x": x, "l": lens})


@pytest.mark.parametrize("shape,axes", [([3, 6], None), ([7, 2], [1, 2]), ([5], [-1])])
def test_center_crop_pad(shape, axes):
    x = rand(2, 4, 5) if axes else rand(4, 5)
    attrs = {"axes": axes} if axes else {}
    compare(one_node("CenterCropPad", {"x": x}, {"s": np.array(shape, np.int64)}, attrs=attrs, opset=18), {"x": x})


@pytest.mark.parametrize("opset,groups", [(18, 2), (21, 2), (21, 4)])
def test_group_normalization(opset, groups):
    x = rand(2, 4, 3, 3)
    n = groups if opset < 21 else 4
    s, b = rand(n), rand(n)
    m = one_node("GroupNormalization", {"x": x, "s": s, "b": b}, attrs={"num_groups": groups, "epsilon": 1e-5},
                 opset=opset)
    compare(m, {"x": x, "s": s, "b": b})
    expand = (lambda t: t.repeat_interleave(4 // groups)) if opset < 21 else (lambda t: t)
    gradients(m, {"x": x, "s": s, "b": b}, ["x", "s", "b"],
              lambda x, s, b: torch.nn.functional.group_norm(x, groups, expand(s), expand(b), 1e-5))


def _lrn_by_the_specification(x, size, alpha, beta, bias):
    """The specification's text, element by element: square_sum[n, c] = sum of x[n, i]^2 for i in
    [c - floor((size - 1) / 2), c + ceil((size - 1) / 2)] within the channels (onnxruntime takes odd sizes only)."""
    out = np.empty_like(x)
    for c in range(x.shape[1]):
        lo, hi = max(0, c - (size - 1) // 2), min(x.shape[1] - 1, c + -(-(size - 1) // 2))
        sq = (x[:, lo:hi + 1].astype(np.float64) ** 2).sum(1)
        out[:, c] = x[:, c] / (bias + alpha / size * sq) ** beta
    return out


@pytest.mark.parametrize("size", [3, 4])
def test_lrn_lp_mvn(size):
    x = rand(2, 6, 3, 4)
    m = one_node("LRN", {"x": x}, attrs={"size": size, "alpha": 0.1, "beta": 0.6, "bias": 1.5})
    if size % 2:
        compare(m, {"x": x})
    got, = OnnxModule(m, trainable=[])(x=torch.from_numpy(x))
    assert rel_err(got.numpy(), _lrn_by_the_specification(x, size, 0.1, 0.6, 1.5)) < 1e-6
    for p in (1, 2):
        compare(one_node("LpNormalization", {"x": x}, attrs={"axis": 1, "p": p}), {"x": x})
    for axes in ([0, 2, 3], [1]):
        compare(one_node("MeanVarianceNormalization", {"x": x}, attrs={"axes": axes}), {"x": x}, tol=1e-4)
    if size == 3:  # odd windows are centred alike: torch's own local_response_norm is the gradient's judge
        m = one_node("LRN", {"x": x}, attrs={"size": 3, "alpha": 0.1, "beta": 0.6, "bias": 1.5})
        gradients(m, {"x": x}, ["x"], lambda x: torch.nn.functional.local_response_norm(x, 3, 0.1, 0.6, 1.5))


def test_det_and_max_unpool():
    a = rand(3, 4, 4)
    m = one_node("Det", {"a": a})
    compare(m, {"a": a}, tol=1e-4)
    gradients(m, {"a": a}, ["a"], lambda a: torch.linalg.det(a))
    x = rand(2, 3, 6, 6)
    pool = h.make_node("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2])
    compare(one_node("MaxUnpool", {"x": x}, attrs={"kernel_shape": [2, 2], "strides": [2, 2]}, order=["p", "i"],
                     nodes=[pool]), {"x": x})
    compare(one_node("MaxUnpool", {"x": x}, {"s": np.array([2, 3, 7, 7], np.int64)},
                     attrs={"kernel_shape": [2, 2], "strides": [2, 2]}, order=["p", "i", "s"], nodes=[pool]), {"x": x})


def test_col2im():
    """The inverse of unfold: F.fold's values, asymmetric pads and 3-D images included."""
    x = rand(2, 3 * 4, 12)
    compare(one_node("Col2Im", {"x": x}, {"im": np.array([4, 5], np.int64), "bl": np.array([2, 2], np.int64)},
                     opset=18), {"x": x})
    x2 = rand(1, 2 * 6, 6)
    compare(one_node("Col2Im", {"x": x2}, {"im": np.array([3, 5], np.int64), "bl": np.array([2, 3], np.int64)},
                     attrs={"pads": [1, 0, 0, 0], "strides": [2, 1], "dilations": [1, 1]}, opset=18), {"x": x2})
    m = one_node("Col2Im", {"x": x}, {"im": np.array([4, 5], np.int64), "bl": np.array([2, 2], np.int64)}, opset=18)
    gradients(m, {"x": x}, ["x"], lambda x: torch.nn.functional.fold(x, (4, 5), (2, 2)))


@pytest.mark.parametrize("mask,groups", [(False, 1), (True, 2)])
def test_deform_conv(mask, groups):
    """Against ONNX's reference (onnxruntime 1.19 has no DeformConv); zero offsets and mask 1 are a convolution."""
    x, w = rand(1, 4, 5, 5), rand(4, 4 // groups, 3, 3)
    off = (rand(1, 2 * 9 * 2, 5, 5) * 0.7).astype(np.float32)
    feeds = {"x": x, "w": w, "o": off}
    order = ["x", "w", "o"]
    if mask:
        feeds["m"] = np.abs(rand(1, 2 * 9, 5, 5))
        order += ["", "m"]
    m = one_node("DeformConv", feeds, attrs={"pads": [1, 1, 1, 1], "group": groups, "offset_group": 2,
                                             "kernel_shape": [3, 3]}, order=order, opset=19)
    compare_reference(m, feeds, tol=1e-5)
    plain = one_node("DeformConv", {"x": x, "w": w, "o": np.zeros_like(off)},
                     attrs={"pads": [1, 1, 1, 1], "group": groups, "offset_group": 2}, opset=19)
    gradients(plain, {"x": x, "w": w, "o": np.zeros_like(off)}, ["x", "w"],
              lambda x, w, o: torch.nn.functional.conv2d(x, w, padding=1, groups=groups))


@pytest.mark.parametrize("mode,padding,align", [("linear", "zeros", 0), ("nearest", "border", 1),
                                                ("cubic", "reflection", 0), ("linear", "reflection", 1)])
def test_grid_sample_and_affine_grid(mode, padding, align):
    """A spatial transformer: AffineGrid then GridSample (opset 20), against ORT; gradients are torch's."""
    x = rand(2, 3, 5, 6)
    theta = (np.array([[1, 0.2, 0.1], [-0.1, 0.9, 0.2]], np.float32) + rand(2, 2, 3) * 0.1).astype(np.float32)
    size = np.array([2, 3, 4, 7], np.int64)
    grid = h.make_node("AffineGrid", ["theta", "size"], ["g"], align_corners=align)
    m = one_node("GridSample", {"x": x, "theta": theta}, {"size": size}, order=["x", "g"], nodes=[grid], opset=20,
                 attrs={"mode": mode, "padding_mode": padding, "align_corners": align})
    compare(m, {"x": x, "theta": theta}, tol=1e-5)
    tmode = {"linear": "bilinear", "cubic": "bicubic"}.get(mode, mode)
    F = torch.nn.functional
    wrt = ["x", "theta"] if mode != "nearest" else ["x"]
    gradients(m, {"x": x, "theta": theta}, wrt, lambda x, theta: F.grid_sample(
        x, F.affine_grid(theta, [2, 3, 4, 7], bool(align)), tmode, padding, bool(align)))
    compare(one_node("AffineGrid", {"t": theta}, {"s": size}, attrs={"align_corners": align}, opset=20), {"t": theta})
    g16 = rand(2, 4, 7, 2)
    compare(one_node("GridSample", {"x": x, "g": g16}, opset=16,
                     attrs={"mode": {"linear": "bilinear", "cubic": "bicubic"}.get(mode, mode),
                            "padding_mode": padding, "align_corners": align}), {"x": x, "g": g16})


def test_roi_ops_and_nms():
    x = rand(2, 3, 8, 9)
    rois = np.array([[0.5, 1.0, 6.2, 7.1], [2.0, 0.0, 4.0, 3.5], [0, 0, 8.5, 8.5]], np.float32)
    bi = np.array([0, 1, 1], np.int64)
    for attrs in ({"output_height": 2, "output_width": 3, "sampling_ratio": 2},
                  {"output_height": 3, "output_width": 2, "sampling_ratio": 0, "spatial_scale": 0.5},
                  {"output_height": 2, "output_width": 2, "mode": "max", "sampling_ratio": 2},
                  {"output_height": 2, "output_width": 2, "coordinate_transformation_mode": "output_half_pixel"}):
        compare(one_node("RoiAlign", {"x": x, "r": rois, "b": bi}, attrs=attrs, opset=16),
                {"x": x, "r": rois, "b": bi})
    r5 = np.array([[0, 1, 1, 6, 5], [1, 0.4, 2.5, 8, 7.5], [1, 3, 3, 3, 3]], np.float32)
    compare(one_node("MaxRoiPool", {"x": x, "r": r5}, attrs={"pooled_shape": [2, 3], "spatial_scale": 1.0}),
            {"x": x, "r": r5})
    boxes = np.array([[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, -0.1, 1, 0.9], [0, 10, 1, 11], [0, 10.1, 1, 11.1],
                       [0, 100, 1, 101]]], np.float32)
    scores = np.array([[[0.9, 0.75, 0.6, 0.95, 0.5, 0.3], [0.1, 0.2, 0.9, 0.3, 0.8, 0.95]]], np.float32)
    for limit, thr, floor_, centre in ((3, 0.5, 0.0, 0), (10, 0.2, 0.4, 0), (2, 0.7, None, 1)):
        consts = {"n": np.array([limit], np.int64), "t": np.array([thr], np.float32)}
        order = ["b", "s", "n", "t"]
        if floor_ is not None:
            consts["f"] = np.array([floor_], np.float32)
            order.append("f")
        compare(one_node("NonMaxSuppression", {"b": boxes, "s": scores}, consts, order=order,
                         attrs={"center_point_box": centre}), {"b": boxes, "s": scores})


@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize("inverse,onesided", [(0, 0), (0, 1), (1, 0)])
def test_dft(opset, inverse, onesided):
    if inverse and onesided:
        return
    x = rand(2, 8, 1) if not inverse else rand(2, 8, 2)
    if opset == 17:
        m = one_node("DFT", {"x": x}, attrs={"inverse": inverse, "onesided": onesided, "axis": 1}, opset=17)
    else:
        m = one_node("DFT", {"x": x}, {"n": np.array(6, np.int64), "a": np.array(-2, np.int64)},
                     attrs={"inverse": inverse, "onesided": onesided}, opset=20)
    compare(m, {"x": x}, tol=1e-5)
    gradients(m, {"x": x}, ["x"], lambda x: torch.stack(torch.view_as_real(
        (torch.fft.ifft if inverse else torch.fft.fft)(torch.complex(x[..., 0], x[..., 1] if x.shape[-1] == 2 else
                                                                     torch.zeros_like(x[..., 0])),
                                                        8 if opset == 17 else 6, 1)).unbind(-1), -1
    ).narrow(1, 0, ((8 if opset == 17 else 6) // 2 + 1) if onesided else (8 if opset == 17 else 6)))


def test_stft_windows_mel():
    """A spectrogram front end: a window, the STFT of a signal, and the mel filter bank."""
    sig = rand(2, 64, 1)
    for op in ("HannWindow", "HammingWindow", "BlackmanWindow"):
        for periodic in (0, 1):
            compare(one_node(op, {}, {"n": np.array(16, np.int64)}, attrs={"periodic": periodic}), {})
    win = h.make_node("HannWindow", ["n"], ["w"])
    m = one_node("STFT", {"s": sig}, {"step": np.array(8, np.int64), "n": np.array(16, np.int64)},
                 order=["s", "step", "w"], nodes=[win])
    compare(m, {"s": sig}, tol=1e-5)
    compare(one_node("STFT", {"s": sig}, {"step": np.array(5, np.int64), "fl": np.array(12, np.int64)},
                     order=["s", "step", "", "fl"], attrs={"onesided": 0}), {"s": sig}, tol=1e-5)
    w = torch.hann_window(16, periodic=True, dtype=torch.float32)
    gradients(m, {"s": sig}, ["s"], lambda s: torch.view_as_real(
        torch.stft(s[..., 0], 16, 8, window=w, center=False, return_complex=True).transpose(1, 2)))
    compare(one_node("MelWeightMatrix", {}, {"m": np.array(8, np.int64), "d": np.array(64, np.int64),
                                             "r": np.array(8000, np.int64), "lo": np.array(60.0, np.float32),
                                             "hi": np.array(3800.0, np.float32)}), {})


@pytest.mark.parametrize("axis_scales", [False, True])
@pytest.mark.parametrize("zp_type", [np.uint8, np.int8, None])
def test_quantize_dequantize_and_fake_quantize(axis_scales, zp_type):
    """QuantizeLinear and DequantizeLinear against ORT; the pair, as a QAT export writes it, trains with torch's
    fake-quant (FakeQuantize: the same values, the straight-through gradient)."""
    x = rand(2, 3, 4) * 3
    scale = np.array([0.05, 0.02, 0.1], np.float32) if axis_scales else np.array(0.04, np.float32)
    consts = {"s": scale}
    if zp_type is not None:
        consts["z"] = (np.array([3, -2, 0]) if axis_scales else np.array(5)).astype(zp_type) \
            if zp_type == np.int8 else (np.array([128, 120, 130]) if axis_scales else np.array(128)).astype(zp_type)
    order = ["x", "s"] + (["z"] if zp_type is not None else [])
    q = one_node("QuantizeLinear", {"x": x}, consts, order=order, attrs={"axis": 1})
    compare(q, {"x": x})
    xq = RNG.integers(-100, 100, (2, 3, 4)).astype(zp_type or np.uint8)
    compare(one_node("DequantizeLinear", {"xq": xq}, consts, order=["xq"] + order[1:], attrs={"axis": 1}), {"xq": xq})
    deq = h.make_node("DequantizeLinear", ["q"] + order[1:], ["y0"], axis=1)
    quant = h.make_node("QuantizeLinear", order, ["q"], axis=1)
    g = h.make_graph([quant, deq], "g", [_vi("x", x)], [_vi("y0")],
                     [nh.from_array(np.asarray(v), n) for n, v in consts.items()])
    qdq = onnx.shape_inference.infer_shapes(h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=8))
    compare(qdq, {"x": x})
    assert [n.op_type for n in __import__("onnxfuse.runtime.torch.patterns", fromlist=["x"]).torch_forms(
        qdq.graph, ["y0"])] == ["FakeQuantize"]
    zp = torch.from_numpy(consts["z"].astype(np.int32)) if zp_type is not None else torch.zeros(scale.shape,
                                                                                               dtype=torch.int32)
    lo, hi = (-128, 127) if zp_type == np.int8 else (0, 255)
    s = torch.from_numpy(scale)
    gradients(qdq, {"x": x}, ["x"], lambda x: torch.fake_quantize_per_channel_affine(x, s, zp, 1, lo, hi)
              if axis_scales else torch.fake_quantize_per_tensor_affine(x, s, zp, lo, hi))


def test_random_ops_draw_from_the_nodes_generator():
    """RandomNormal / RandomUniform (and *Like), Bernoulli, Multinomial: shapes, dtypes and moments as the
    specification says; a node with a seed draws the same stream in every module built from it (and another
    seed another one); the streams' state carries over (``RandomStreams.state`` / ``load``)."""
    x = rand(400, 50)
    normal = one_node("RandomNormalLike", {"x": x}, attrs={"mean": 2.0, "scale": 0.5, "seed": 3.0})
    a, = OnnxModule(normal, trainable=[])(x=torch.from_numpy(x))
    assert a.shape == (400, 50) and abs(float(a.mean()) - 2.0) < 0.01 and abs(float(a.std()) - 0.5) < 0.01
    mod = OnnxModule(normal, trainable=[])
    first, = mod(x=torch.from_numpy(x))
    assert torch.equal(first, a)
    saved = mod.random_streams.state()
    second, = mod(x=torch.from_numpy(x))
    assert not torch.equal(second, first)
    mod.random_streams.load(saved)
    assert torch.equal(mod(x=torch.from_numpy(x))[0], second)
    other = one_node("RandomNormalLike", {"x": x}, attrs={"mean": 2.0, "scale": 0.5, "seed": 4.0})
    assert not torch.equal(OnnxModule(other, trainable=[])(x=torch.from_numpy(x))[0], a)
    u, = OnnxModule(one_node("RandomUniform", {}, attrs={"shape": [300, 40], "low": -1.0, "high": 3.0}))()
    assert u.shape == (300, 40) and float(u.min()) >= -1.0 and float(u.max()) < 3.0 and abs(float(u.mean()) - 1) < 0.05
    n, = OnnxModule(one_node("RandomNormal", {}, attrs={"shape": [300, 40], "seed": 1.0}))()
    assert abs(float(n.mean())) < 0.05 and abs(float(n.std()) - 1) < 0.05
    ul, = OnnxModule(one_node("RandomUniformLike", {"x": x}, attrs={"dtype": TP.DOUBLE}), trainable=[])(
        x=torch.from_numpy(x))
    assert ul.dtype == torch.float64 and ul.shape == x.shape and 0 <= float(ul.min()) and float(ul.max()) < 1
    p = np.full((500, 40), 0.3, np.float32)
    b, = OnnxModule(one_node("Bernoulli", {"p": p}), trainable=[])(p=torch.from_numpy(p))
    assert set(b.unique().tolist()) <= {0.0, 1.0} and abs(float(b.mean()) - 0.3) < 0.02
    logits = np.log(np.array([[0.1, 0.6, 0.3]], np.float32))
    mm, = OnnxModule(one_node("Multinomial", {"l": logits}, attrs={"sample_size": 4000}), trainable=[])(
        l=torch.from_numpy(logits))
    assert mm.dtype == torch.int32 and mm.shape == (1, 4000)
    assert np.allclose(np.bincount(mm.numpy()[0], minlength=3) / 4000, [0.1, 0.6, 0.3], atol=0.03)


def test_control_flow_if_loop_scan():
    """If (a branch reading an outer tensor), Loop (a trip count, a carried value and a scan output) and Scan (a
    running sum over the time axis), their subgraphs run as programs of their own, against onnxruntime; the
    gradient flows through a branch to the outer tensor it reads."""
    x = rand(3, 4)
    w = rand(4, 4)
    then = h.make_graph([h.make_node("MatMul", ["x", "w"], ["t"])], "then", [], [_vi("t", x @ w)])
    other = h.make_graph([h.make_node("Neg", ["x"], ["e"])], "else", [], [_vi("e", x)])
    for flag in (True, False):
        m = one_node("If", {"c": np.array(flag), "x": x, "w": w}, order=["c"],
                     attrs={"then_branch": then, "else_branch": other})
        compare(m, {"c": np.array(flag), "x": x, "w": w})
    m = one_node("If", {"c": np.array(True), "x": x, "w": w}, order=["c"],
                 attrs={"then_branch": then, "else_branch": other})
    gradients(m, {"c": np.array(True), "x": x, "w": w}, ["x", "w"], lambda c, x, w: x @ w)

    body = h.make_graph(
        [h.make_node("Identity", ["cond_in"], ["cond_out"]), h.make_node("Mul", ["v_in", "x"], ["v_out"]),
         h.make_node("Cast", ["i"], ["fi"], to=TP.FLOAT), h.make_node("Add", ["v_out", "fi"], ["scan_out"])],
        "body", [h.make_tensor_value_info("i", TP.INT64, []), h.make_tensor_value_info("cond_in", TP.BOOL, []),
                 _vi("v_in", x)], [h.make_tensor_value_info("cond_out", TP.BOOL, []), _vi("v_out", x),
                                   _vi("scan_out", x)])
    feeds = {"v0": np.ones((3, 4), np.float32), "x": x * 0.5}
    compare(one_node("Loop", feeds, {"trip": np.array(3, np.int64), "go": np.array(True)},
                     order=["trip", "go", "v0"], attrs={"body": body}, n_out=2), feeds)

    step = h.make_graph([h.make_node("Add", ["acc_in", "xt"], ["acc_out"]), h.make_node("Relu", ["acc_out"], ["y"])],
                        "step", [_vi("acc_in", rand(4)), _vi("xt", rand(4))], [_vi("acc_out", rand(4)), _vi("y", rand(4))])
    seq = rand(5, 4)
    for direction in (0, 1):
        m = one_node("Scan", {"acc0": np.zeros(4, np.float32), "seq": seq}, n_out=2,
                     attrs={"body": step, "num_scan_inputs": 1, "scan_input_directions": [direction]})
        compare(m, {"acc0": np.zeros(4, np.float32), "seq": seq})


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_loss_ops(reduction, weighted):
    """SoftmaxCrossEntropyLoss (with its log_prob output) and NegativeLogLikelihoodLoss, ignore_index and class
    weights included, against onnxruntime; their gradients are F.cross_entropy's and F.nll_loss's."""
    x, labels = rand(6, 5, 3), np.array([[0, 4, 2], [1, 1, -1], [3, 0, 2], [4, 4, 4], [2, -1, 0], [1, 3, 2]], np.int64)
    feeds = {"x": x, "y": labels}
    consts = {"w": np.abs(rand(5)) + 0.1} if weighted else {}
    attrs = {"reduction": reduction, "ignore_index": -1}
    sce = one_node("SoftmaxCrossEntropyLoss", feeds, consts, attrs=attrs, n_out=2)
    compare(sce, feeds)
    w = torch.from_numpy(consts["w"]) if weighted else None
    gradients(sce, feeds, ["x"], lambda x, y: torch.nn.functional.cross_entropy(x, y, w, ignore_index=-1,
                                                                                reduction=reduction))
    logp = np.log(np.exp(x) / np.exp(x).sum(1, keepdims=True)).astype(np.float32)
    nll = one_node("NegativeLogLikelihoodLoss", {"x": logp, "y": labels}, consts, attrs=attrs)
    compare(nll, {"x": logp, "y": labels})
