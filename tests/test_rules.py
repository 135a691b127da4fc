"""Each rule on small hand-built graphs (onnx.helper), B models with different weights: fused == per model."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from conftest import check_fused, graph_model, rand_init, rel_err, run_onnx, vinfo  # noqa: F401
from onnxfuse import UnsupportedOpError, fuse_models


@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("group,bias", [(1, True), (2, False), (4, True)])
def test_conv_groups_bias_then_batchnorm_pool(B, group, bias, rng):
    C = 4

    def build(r):
        ins = ["h", "w"] + (["b"] if bias else [])
        inits = [rand_init(r, "w", [8, C // group, 3, 3])] + ([rand_init(r, "b", [8])] if bias else [])
        inits += [rand_init(r, "s", [8]), rand_init(r, "o", [8]), rand_init(r, "m", [8]),
                  nh.from_array(np.abs(r.standard_normal(8)).astype(np.float32) + 0.5, "v"),
                  rand_init(r, "w0", [C, 2, 1, 1])]
        nodes = [h.make_node("Conv", ["x", "w0"], ["h"]),  # shared input -> per-model channels
                 h.make_node("Conv", ins, ["c"], group=group, pads=[1, 1, 1, 1], strides=[2, 1]),
                 h.make_node("BatchNormalization", ["c", "s", "o", "m", "v"], ["y"]),
                 h.make_node("AveragePool", ["y"], ["p"], kernel_shape=[2, 2]),
                 h.make_node("GlobalMaxPool", ["p"], ["out"])]
        return graph_model(nodes, [vinfo("x", ["N", 2, 6, 6])], [vinfo("out", ["N", 8, 1, 1])], inits)

    check_fused(build, B, {"x": rng.standard_normal((3, 2, 6, 6)).astype(np.float32)}, rng)


@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("transA,transB,alpha,beta,c_shape", [
    (0, 1, 1.0, 1.0, [5]), (1, 0, 0.5, 2.0, [3, 5]), (0, 0, 1.0, 1.0, None), (0, 1, 1.0, 0.5, [1, 5]),
])
def test_gemm_variants(B, transA, transB, alpha, beta, c_shape, rng):
    def build(r):
        inits = [rand_init(r, "w0", [4, 4]), rand_init(r, "w", [5, 4] if transB else [4, 5])]
        ins = ["h", "w"]
        if c_shape:
            inits.append(rand_init(r, "c", c_shape))
            ins.append("c")
        first = h.make_node("MatMul", ["x", "w0"], ["h0"])
        pre = [first, h.make_node("Transpose", ["h0"], ["h"], perm=[1, 0])] if transA else \
            [first, h.make_node("Identity", ["h0"], ["h"])]
        nodes = pre + [h.make_node("Gemm", ins, ["out"], transA=transA, transB=transB, alpha=alpha, beta=beta)]
        return graph_model(nodes, [vinfo("x", [3, 4])], [vinfo("out", [3, 5])], inits)

    check_fused(build, B, {"x": rng.standard_normal((3, 4)).astype(np.float32)}, rng)


@pytest.mark.parametrize("B", [1, 2, 5])
def test_matmul_3d_weight_softmax_axes(B, rng):
    def build(r):
        inits = [rand_init(r, "w", [6, 5]), rand_init(r, "bias", [5])]
        nodes = [h.make_node("MatMul", ["x", "w"], ["a"]),            # [N, T, 6] @ [6, 5], shared x
                 h.make_node("Add", ["a", "bias"], ["b"]),
                 h.make_node("Softmax", ["b"], ["s1"], axis=1),        # over T
                 h.make_node("LogSoftmax", ["s1"], ["out"], axis=-1)]  # over features
        return graph_model(nodes, [vinfo("x", ["N", 4, 6])], [vinfo("out", ["N", 4, 5])], inits)

    check_fused(build, B, {"x": rng.standard_normal((2, 4, 6)).astype(np.float32)}, rng)


@pytest.mark.parametrize("B", [1, 2, 5])
def test_elementwise_broadcast_weights_of_every_rank(B, rng):
    def build(r):
        inits = [rand_init(r, "w0", [3, 4, 1, 1]), rand_init(r, "k3", [3, 1, 1]), rand_init(r, "k1", [5]), rand_init(r, "k4", [1, 3, 1, 5]),
                 nh.from_array(np.array(0.5, np.float32), "half"), rand_init(r, "slope", [3, 1, 1])]
        nodes = [h.make_node("Conv", ["x", "w0"], ["c"]),               # [N, 3, 4, 5] channel-packed
                 h.make_node("Mul", ["c", "k3"], ["m1"]),
                 h.make_node("Add", ["m1", "k1"], ["m2"]),              # rank-1 weight over the last axis
                 h.make_node("Sub", ["k4", "m2"], ["m3"]),              # weight first, rank 4 with size-1 dims
                 h.make_node("Mul", ["m3", "half"], ["m4"]),            # shared scalar constant
                 h.make_node("Add", ["m4", "x2"], ["m5"]),              # shared graph input broadcast
                 h.make_node("PRelu", ["m5", "slope"], ["m6"]),
                 h.make_node("Max", ["m6", "c", "m1"], ["m7"]),         # variadic, all per-model
                 h.make_node("Sigmoid", ["m7"], ["out"])]
        return graph_model(nodes, [vinfo("x", ["N", 4, 4, 5]), vinfo("x2", [4, 5])], [vinfo("out", ["N", 3, 4, 5])], inits)

    feeds = {"x": rng.standard_normal((2, 4, 4, 5)).astype(np.float32),
             "x2": rng.standard_normal((4, 5)).astype(np.float32)}
    check_fused(build, B, feeds, rng)


@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("axis", [0, 1, 2, 3])
def test_flatten_every_axis(B, axis, rng):
    def build(r):
        inits = [rand_init(r, "w0", [6, 2, 1, 1]), rand_init(r, "k", [1])]
        nodes = [h.make_node("Conv", ["x", "w0"], ["c"]), h.make_node("Flatten", ["c"], ["f"], axis=axis),
                 h.make_node("Mul", ["f", "k"], ["out"])]
        return graph_model(nodes, [vinfo("x", [2, 2, 3, 4])], [vinfo("out", [None, None])], inits)

    check_fused(build, B, {"x": rng.standard_normal((2, 2, 3, 4)).astype(np.float32)}, rng)


@pytest.mark.parametrize("B", [1, 3])
def test_reshape_dynamic_batch_shape_chain(B, rng):
    """x.view(x.size(0), -1) as the TorchScript exporter writes it, then a Gemm."""
    def build(r):
        inits = [rand_init(r, "w0", [4, 2, 3, 3]), rand_init(r, "fw", [3, 4 * 4 * 4]),
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
        return graph_model(nodes, [vinfo("x", ["N", 2, 4, 4])], [vinfo("out", ["N", 3])], inits)

    check_fused(build, B, {"x": rng.standard_normal((5, 2, 4, 4)).astype(np.float32)}, rng)


def test_unsupported_op_names_node_and_supported_ops(rng):
    def build(r):
        nodes = [h.make_node("MatMul", ["x", "w"], ["a"]), h.make_node("TopK", ["a", "k"], ["out", "idx"], name="my_topk")]
        inits = [rand_init(r, "w", [4, 5]), nh.from_array(np.array([2], np.int64), "k")]
        return graph_model(nodes, [vinfo("x", [3, 4])], [vinfo("out", [3, 2])], inits)

    with pytest.raises(UnsupportedOpError) as e:
        fuse_models([build(rng), build(rng)], strict=True)
    msg = str(e.value)
    assert "my_topk" in msg and "'TopK'" in msg and "Conv" in msg and "Gemm" in msg
