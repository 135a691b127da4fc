"""Each rule on small hand-built graphs (onnx.helper), B models with different weights: fused == per model."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from conftest import rel_err, run_onnx
from onnxfuse import UnsupportedOpError, fuse_models


def _model(nodes, inputs, outputs, inits, opset=17):
    g = h.make_graph(nodes, "g", inputs, outputs, inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _vi(name, shape, dtype=TP.FLOAT):
    return h.make_tensor_value_info(name, dtype, shape)


def _w(rng, name, shape):
    return nh.from_array(rng.standard_normal(shape).astype(np.float32), name)


def _check(build, B, feeds, rng, tol=1e-5):
    models = [build(np.random.default_rng(100 + b)) for b in range(B)]
    fa = fuse_models(models)
    fused = run_onnx(fa.model, feeds)
    for b, m in enumerate(models):
        for out, ref in zip(fused, run_onnx(m, feeds)):
            assert rel_err(out[b], ref) < tol, f"model {b}"
    return fa


@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("group,bias", [(1, True), (2, False), (4, True)])
def test_conv_groups_bias_then_batchnorm_pool(B, group, bias, rng):
    C = 4

    def build(r):
        ins = ["h", "w"] + (["b"] if bias else [])
        inits = [_w(r, "w", [8, C // group, 3, 3])] + ([_w(r, "b", [8])] if bias else [])
        inits += [_w(r, "s", [8]), _w(r, "o", [8]), _w(r, "m", [8]),
                  nh.from_array(np.abs(r.standard_normal(8)).astype(np.float32) + 0.5, "v"),
                  _w(r, "w0", [C, 2, 1, 1])]
        nodes = [h.make_node("Conv", ["x", "w0"], ["h"]),  # shared input -> per-model channels
                 h.make_node("Conv", ins, ["c"], group=group, pads=[1, 1, 1, 1], strides=[2, 1]),
                 h.make_node("BatchNormalization", ["c", "s", "o", "m", "v"], ["y"]),
                 h.make_node("AveragePool", ["y"], ["p"], kernel_shape=[2, 2]),
                 h.make_node("GlobalMaxPool", ["p"], ["out"])]
        return _model(nodes, [_vi("x", ["N", 2, 6, 6])], [_vi("out", ["N", 8, 1, 1])], inits)

    _check(build, B, {"x": rng.standard_normal((3, 2, 6, 6)).astype(np.float32)}, rng)


@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("transA,transB,alpha,beta,c_shape", [
    (0, 1, 1.0, 1.0, [5]), (1, 0, 0.5, 2.0, [3, 5]), (0, 0, 1.0, 1.0, None), (0, 1, 1.0, 0.5, [1, 5]),
])
def test_gemm_variants(B, transA, transB, alpha, beta, c_shape, rng):
    def build(r):
        inits = [_w(r, "w0", [4, 4]), _w(r, "w", [5, 4] if transB else [4, 5])]
        ins = ["h", "w"]
        if c_shape:
            inits.append(_w(r, "c", c_shape))
            ins.append("c")
        first = h.make_node("MatMul", ["x", "w0"], ["h0"])
        pre = [first, h.make_node("Transpose", ["h0"], ["h"], perm=[1, 0])] if transA else \
            [first, h.make_node("Identity", ["h0"], ["h"])]
        nodes = pre + [h.make_node("Gemm", ins, ["out"], transA=transA, transB=transB, alpha=alpha, beta=beta)]
        return _model(nodes, [_vi("x", [3, 4])], [_vi("out", [3, 5])], inits)

    _check(build, B, {"x": rng.standard_normal((3, 4)).astype(np.float32)}, rng)


@pytest.mark.parametrize("B", [1, 2, 5])
def test_matmul_3d_weight_softmax_axes(B, rng):
    def build(r):
        inits = [_w(r, "w", [6, 5]), _w(r, "bias", [5])]
        nodes = [h.make_node("MatMul", ["x", "w"], ["a"]),            # [N, T, 6] @ [6, 5], shared x
                 h.make_node("Add", ["a", "bias"], ["b"]),
                 h.make_node("Softmax", ["b"], ["s1"], axis=1),        # over T
                 h.make_node("LogSoftmax", ["s1"], ["out"], axis=-1)]  # over features
        return _model(nodes, [_vi("x", ["N", 4, 6])], [_vi("out", ["N", 4, 5])], inits)

    _check(build, B, {"x": rng.standard_normal((2, 4, 6)).astype(np.float32)}, rng)


@pytest.mark.parametrize("B", [1, 2, 5])
def test_elementwise_broadcast_weights_of_every_rank(B, rng):
    def build(r):
        inits = [_w(r, "w0", [3, 4, 1, 1]), _w(r, "k3", [3, 1, 1]), _w(r, "k1", [5]), _w(r, "k4", [1, 3, 1, 5]),
                 nh.from_array(np.array(0.5, np.float32), "half"), _w(r, "slope", [3, 1, 1])]
        nodes = [h.make_node("Conv", ["x", "w0"], ["c"]),               # [N, 3, 4, 5] channel-packed
                 h.make_node("Mul", ["c", "k3"], ["m1"]),
                 h.make_node("Add", ["m1", "k1"], ["m2"]),              # rank-1 weight over the last axis
                 h.make_node("Sub", ["k4", "m2"], ["m3"]),              # weight first, rank 4 with size-1 dims
                 h.make_node("Mul", ["m3", "half"], ["m4"]),            # shared scalar constant
                 h.make_node("Add", ["m4", "x2"], ["m5"]),              # shared graph input broadcast
                 h.make_node("PRelu", ["m5", "slope"], ["m6"]),
                 h.make_node("Max", ["m6", "c", "m1"], ["m7"]),         # variadic, all per-model
                 h.make_node("Sigmoid", ["m7"], ["out"])]
        return _model(nodes, [_vi("x", ["N", 4, 4, 5]), _vi("x2", [4, 5])], [_vi("out", ["N", 3, 4, 5])], inits)

    feeds = {"x": rng.standard_normal((2, 4, 4, 5)).astype(np.float32),
             "x2": rng.standard_normal((4, 5)).astype(np.float32)}
    _check(build, B, feeds, rng)


@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("axis", [0, 1, 2, 3])
def test_flatten_every_axis(B, axis, rng):
    def build(r):
        inits = [_w(r, "w0", [6, 2, 1, 1]), _w(r, "k", [1])]
        nodes = [h.make_node("Conv", ["x", "w0"], ["c"]), h.make_node("Flatten", ["c"], ["f"], axis=axis),
                 h.make_node("Mul", ["f", "k"], ["out"])]
        return _model(nodes, [_vi("x", [2, 2, 3, 4])], [_vi("out", [None, None])], inits)

    _check(build, B, {"x": rng.standard_normal((2, 2, 3, 4)).astype(np.float32)}, rng)


@pytest.mark.parametrize("B", [1, 3])
def test_reshape_dynamic_batch_shape_chain(B, rng):
    """x.view(x.size(0), -1) as the TorchScript exporter writes it, then a Gemm."""
    def build(r):
        inits = [_w(r, "w0", [4, 2, 3, 3]), _w(r, "fw", [3, 4 * 4 * 4]),
                 nh.from_array(np.array(0, np.int64), "i0"), nh.from_array(np.array([0], np.int64), "ax"),
                 nh.from_array(np.array([-1], np.int64), "m1")]
        nodes = [h.make_node("Conv", ["x", "w0"], ["c"], pads=[1, 1, 1, 1]),
                 h.make_node("Relu", ["c"], ["r"]),
                 h.make_node("Shape", ["r"], ["s"]), h.make_node("Gather", ["s", "i0"], ["n"], axis=0),
                 h.make_node("Unsqueeze", ["n", "ax"], ["n1"]), h.make_node("Concat", ["n1", "m1"], ["t"], axis=0),
                 h.make_node("Reshape", ["r", "t"], ["v"]),
                 h.make_node("Size", ["v"], ["sz"]), h.make_node("Cast", ["sz"], ["szf"], to=TP.FLOAT),
                 h.make_node("Gemm", ["v", "fw"], ["g"], transB=1),
                 h.make_node("Div", ["g", "szf"], ["out"])]
        return _model(nodes, [_vi("x", ["N", 2, 4, 4])], [_vi("out", ["N", 3])], inits)

    _check(build, B, {"x": rng.standard_normal((5, 2, 4, 4)).astype(np.float32)}, rng)


def test_unsupported_op_names_node_and_supported_ops(rng):
    def build(r):
        nodes = [h.make_node("MatMul", ["x", "w"], ["a"]), h.make_node("TopK", ["a", "k"], ["out", "idx"], name="my_topk")]
        inits = [_w(r, "w", [4, 5]), nh.from_array(np.array([2], np.int64), "k")]
        return _model(nodes, [_vi("x", [3, 4])], [_vi("out", [3, 2])], inits)

    with pytest.raises(UnsupportedOpError) as e:
        fuse_models([build(rng), build(rng)])
    msg = str(e.value)
    assert "my_topk" in msg and "'TopK'" in msg and "Conv" in msg and "Gemm" in msg
