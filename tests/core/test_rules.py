"""Each rule on small hand-built graphs (onnx.helper), B models with different weights: fused == per model."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from tests.conftest import check_fused, graph_model, rand_init, rel_err, run_onnx, vinfo  # noqa: F401
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


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("allowzero", [0, 1])
def test_reshape_allowzero_heads_split_and_merged(B, allowzero, rng):
    """Attention's head split [N, T, C] -> [N, T, H, D] with a target computed from the batch size, and the merge
    back with a constant target, as torch's dynamo exporter writes them: allowzero=1 on every Reshape (no 0 in
    either target, so it means what allowzero=0 does)."""
    def build(r):
        inits = [rand_init(r, "w", [8, 8]), nh.from_array(np.array([0], np.int64), "lo"),
                 nh.from_array(np.array([2], np.int64), "hi"), nh.from_array(np.array([2, 4], np.int64), "hd"),
                 nh.from_array(np.array([-1, 4, 8], np.int64), "merged")]
        nodes = [h.make_node("MatMul", ["x", "w"], ["m"]),
                 h.make_node("Shape", ["m"], ["s"]), h.make_node("Slice", ["s", "lo", "hi"], ["nt"]),
                 h.make_node("Concat", ["nt", "hd"], ["t"], axis=0),
                 h.make_node("Reshape", ["m", "t"], ["heads"], allowzero=allowzero),
                 h.make_node("Transpose", ["heads"], ["ht"], perm=[0, 2, 1, 3]),
                 h.make_node("Softmax", ["ht"], ["p"], axis=-1),
                 h.make_node("Transpose", ["p"], ["pt"], perm=[0, 2, 1, 3]),
                 h.make_node("Reshape", ["pt", "merged"], ["out"], allowzero=allowzero)]
        return graph_model(nodes, [vinfo("x", ["N", 4, 8])], [vinfo("out", ["N", 4, 8])], inits, opset=20)

    fa = check_fused(build, B, {"x": rng.standard_normal((3, 4, 8)).astype(np.float32)}, rng)
    assert fa.spec.summary["fused_fraction"] == 1.0, fa.spec.summary["unfused"]


@pytest.mark.parametrize("B", [1, 3])
def test_reshape_allowzero_literal_zero(B, rng):
    """allowzero=1 with a 0 in the target: an empty dim, not a copy of the input's (the fused node keeps it)."""
    def build(r):
        inits = [rand_init(r, "w", [6, 6]), nh.from_array(np.array([0, 3, 2], np.int64), "t")]
        nodes = [h.make_node("MatMul", ["x", "w"], ["m"]),
                 h.make_node("Reshape", ["m", "t"], ["out"], allowzero=1)]
        return graph_model(nodes, [vinfo("x", [0, 6])], [vinfo("out", [0, 3, 2])], inits, opset=20)

    models = [build(np.random.default_rng(100 + b)) for b in range(B)]
    fa = fuse_models(models)
    assert fa.spec.summary["fused_fraction"] == 1.0, fa.spec.summary["unfused"]
    out = run_onnx(fa.model, {"x": np.zeros((0, 6), np.float32)})[0]
    assert out.shape == (B, 0, 3, 2)


@pytest.mark.parametrize("B", [1, 3])
def test_castlike_of_a_constant_an_activation_and_a_weight(B, rng):
    """CastLike as torch's dynamo exporter writes it (a Python scalar cast like the activation it meets), of a
    per-model activation (to float16 and back) and of a per-model float64 weight: a Cast to the target's type, the
    layout kept."""
    def build(r):
        inits = [rand_init(r, "w", [4, 4]), nh.from_array(r.standard_normal([4]).astype(np.float64), "w64")]
        nodes = [h.make_node("MatMul", ["x", "w"], ["m"]),
                 h.make_node("Constant", [], ["k"], value=nh.from_array(np.array(0.5, np.float64))),
                 h.make_node("Constant", [], ["half"], value=nh.from_array(np.array(1, np.float16))),
                 h.make_node("CastLike", ["k", "m"], ["k32"]),
                 h.make_node("CastLike", ["m", "half"], ["m16"]),
                 h.make_node("CastLike", ["m16", "m"], ["back"]),
                 h.make_node("CastLike", ["w64", "m"], ["w32"]),
                 h.make_node("Mul", ["back", "k32"], ["p"]),
                 h.make_node("Add", ["p", "w32"], ["out"])]
        return graph_model(nodes, [vinfo("x", ["N", 4])], [vinfo("out", ["N", 4])], inits, opset=20)

    fa = check_fused(build, B, {"x": rng.standard_normal((3, 4)).astype(np.float32)}, rng, tol=1e-3)
    assert fa.spec.summary["fused_fraction"] == 1.0, fa.spec.summary["unfused"]


def test_unsupported_op_names_node_and_supported_ops(rng):
    def build(r):
        nodes = [h.make_node("MatMul", ["x", "w"], ["a"]), h.make_node("Det", ["a"], ["out"], name="my_det")]
        inits = [rand_init(r, "w", [4, 4])]
        return graph_model(nodes, [vinfo("x", [3, 4, 4])], [vinfo("out", [3])], inits)

    with pytest.raises(UnsupportedOpError) as e:
        fuse_models([build(rng), build(rng)], strict=True)
    msg = str(e.value)
    assert "my_det" in msg and "'Det'" in msg and "Conv" in msg and "Gemm" in msg


# ---------------------------------------------------------------- the ops a training graph may hold (issue 39)
def _one_op(nodes, inputs, outputs, inits, opset=18):
    return graph_model(nodes, inputs, outputs, inits, opset=opset)


@pytest.mark.parametrize("B", [1, 2, 5])
def test_message_passing_scatter_gather_fuses_into_one_op_each(B, rng):
    """A graph network's message passing: features gathered at edge sources (GatherElements), transformed by a
    per-model weight, scatter-added at the targets (ScatterElements add) and read back with GatherND: each one
    node for the B models, equal to each model."""
    def build(r):
        inits = [rand_init(r, "w", [4, 4]), nh.from_array(np.zeros((1, 4, 4), np.float32), "zeros"),
                 nh.from_array(np.repeat(np.array([0, 1, 2, 3, 0], np.int64)[None, :, None], 4, 2), "src"),
                 nh.from_array(np.repeat(np.array([1, 2, 3, 0, 2], np.int64)[None, :, None], 4, 2), "dst"),
                 nh.from_array(np.array([[[0, 1], [0, 3]]], np.int64), "pick")]
        nodes = [h.make_node("MatMul", ["x", "w"], ["hx"]),                                  # [1, V=4, 4]
                 h.make_node("GatherElements", ["hx", "src"], ["msg"], axis=1),           # [1, E, 4]
                 h.make_node("ScatterElements", ["zeros", "dst", "msg"], ["agg"], axis=1, reduction="add"),
                 h.make_node("Relu", ["agg"], ["a"]),
                 h.make_node("GatherND", ["a", "pick"], ["out"])]                           # [1, 2, 4]
        return _one_op(nodes, [vinfo("x", [1, 4, 4])], [vinfo("out", [1, 2, 4])], inits)

    fa = check_fused(build, B, {"x": rng.standard_normal((1, 4, 4)).astype(np.float32)}, rng)
    assert fa.spec.summary["per_model"] == 0, fa.spec.summary["unfused"]


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("reduction", ["none", "add", "max"])
def test_scatter_nd_with_per_model_updates(B, reduction, rng):
    def build(r):
        idx = [[1, 0], [3, 2], [0, 1]] if reduction == "none" else [[1, 0], [3, 2], [1, 0]]
        inits = [rand_init(r, "w", [2, 2]), nh.from_array(np.array(idx, np.int64), "idx")]
        nodes = [h.make_node("MatMul", ["u", "w"], ["uw"]),                     # [3, 2] per model
                 h.make_node("ScatterND", ["x", "idx", "uw"], ["out"], reduction=reduction)]
        return _one_op(nodes, [vinfo("x", [4, 3, 2]), vinfo("u", [3, 2])], [vinfo("out", [4, 3, 2])], inits)

    fa = check_fused(build, B, {"x": rng.standard_normal((4, 3, 2)).astype(np.float32),
                                "u": rng.standard_normal((3, 2)).astype(np.float32)}, rng)
    assert fa.spec.summary["per_model"] == 0, fa.spec.summary["unfused"]


@pytest.mark.parametrize("B", [1, 2, 5])
def test_top_k_routing_one_hot_and_trilu(B, rng):
    """Top-k routing over per-model router scores, a one-hot of the chosen expert, and a causal triangle."""
    def build(r):
        inits = [rand_init(r, "wr", [6, 5]), nh.from_array(np.array([2], np.int64), "k"),
                 nh.from_array(np.array(5, np.int64), "depth"), rand_init(r, "wq", [6, 6])]
        values = nh.from_array(np.array([0.0, 1.0], np.float32), "v")  # a Constant node, as torch exports F.one_hot
        nodes = [h.make_node("Constant", [], ["v"], value=values),
                 h.make_node("MatMul", ["x", "wr"], ["scores"]),                 # [N, T, 5]
                 h.make_node("TopK", ["scores", "k"], ["top", "which"], axis=-1),
                 h.make_node("OneHot", ["which", "depth", "v"], ["hot"], axis=-1),  # [N, T, 2, 5]
                 h.make_node("Identity", ["hot"], ["mask"]),
                 h.make_node("MatMul", ["x", "wq"], ["q"]),
                 h.make_node("Trilu", ["q"], ["tri"], upper=0)]
        return _one_op(nodes, [vinfo("x", ["N", 6, 6])],
                       [vinfo("top", ["N", 6, 2]), vinfo("mask", ["N", 6, 2, 5]), vinfo("tri", ["N", 6, 6])], inits)

    fa = check_fused(build, B, {"x": rng.standard_normal((3, 6, 6)).astype(np.float32)}, rng)
    assert fa.spec.summary["per_model"] == 0, fa.spec.summary["unfused"]


@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("opset", [18, 21])
def test_group_norm_lrn_lp_mvn(B, opset, rng):
    def build(r):
        G, n = 2, (4 if opset >= 21 else 2)
        inits = [rand_init(r, "w", [4, 3, 1, 1]), rand_init(r, "s", [n]), rand_init(r, "b", [n])]
        nodes = [h.make_node("Conv", ["x", "w"], ["c"]),                                      # [N, 4, 5, 5]
                 h.make_node("GroupNormalization", ["c", "s", "b"], ["gn"], num_groups=G, epsilon=1e-5),
                 h.make_node("LRN", ["gn"], ["l"], size=3, alpha=0.1, beta=0.7, bias=1.2),
                 h.make_node("LpNormalization", ["l"], ["p"], axis=1, p=2),
                 h.make_node("MeanVarianceNormalization", ["p"], ["out"])]
        return _one_op(nodes, [vinfo("x", ["N", 3, 5, 5])], [vinfo("out", ["N", 4, 5, 5])], inits, opset=opset)

    fa = check_fused(build, B, {"x": rng.standard_normal((2, 3, 5, 5)).astype(np.float32)}, rng, tol=1e-4)
    assert fa.spec.summary["per_model"] == 0, fa.spec.summary["unfused"]


@pytest.mark.parametrize("B", [1, 2, 5])
def test_spatial_transformer_grid(B, rng):
    """A spatial transformer: per-model affine maps from a localization layer, AffineGrid, GridSample: one node
    each for the B models (the batch axis holds the models)."""
    def build(r):
        inits = [rand_init(r, "wl", [2 * 5 * 6, 6]), nh.from_array(np.array([1, 0, 0, 0, 1, 0], np.float32), "eye"),
                 nh.from_array(np.array([-1, 2, 3], np.int64), "theta_shape"), rand_init(r, "wc", [3, 2, 1, 1])]
        nodes = [h.make_node("Flatten", ["x"], ["f"]),
                 h.make_node("MatMul", ["f", "wl"], ["t0"]),
                 h.make_node("Mul", ["t0", "tenth"], ["t1"]),
                 h.make_node("Add", ["t1", "eye"], ["t2"]),
                 h.make_node("Reshape", ["t2", "theta_shape"], ["theta"]),
                 h.make_node("Shape", ["x"], ["size"]),
                 h.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=0),
                 h.make_node("GridSample", ["x", "grid"], ["y"]),
                 h.make_node("Conv", ["y", "wc"], ["out"])]
        inits.append(nh.from_array(np.array(0.1, np.float32), "tenth"))
        return _one_op(nodes, [vinfo("x", ["N", 2, 5, 6])], [vinfo("out", ["N", 3, 5, 6])], inits, opset=20)

    fa = check_fused(build, B, {"x": rng.standard_normal((3, 2, 5, 6)).astype(np.float32)}, rng)
    assert fa.spec.summary["per_model"] == 0, fa.spec.summary["unfused"]


@pytest.mark.parametrize("B", [1, 3])
def test_spectrogram_front_end(B, rng):
    """A window, an STFT of a per-model filtered signal and a DFT along time: windows are emitted once (shared),
    STFT and DFT fused."""
    def build(r):
        inits = [rand_init(r, "w", [1, 1]), nh.from_array(np.array(16, np.int64), "n"),
                 nh.from_array(np.array(8, np.int64), "step")]
        nodes = [h.make_node("MatMul", ["s", "w"], ["sw"]),                  # [N, 64, 1] per model
                 h.make_node("HannWindow", ["n"], ["win"]),
                 h.make_node("STFT", ["sw", "step", "win"], ["spec"]),       # [N, 7, 9, 2]
                 h.make_node("DFT", ["spec"], ["out"], axis=1)]
        return _one_op(nodes, [vinfo("s", ["N", 64, 1])], [vinfo("out", ["N", 7, 9, 2])], inits, opset=18)

    fa = check_fused(build, B, {"s": rng.standard_normal((2, 64, 1)).astype(np.float32)}, rng, tol=1e-4)
    assert fa.spec.summary["per_model"] == 0, fa.spec.summary["unfused"]


def test_random_ops_give_each_model_its_own_seed(rng):
    """A random node is one node per model, each with its own seed (a hash of the node's seed and the model's
    index): its draws do not depend on B, and no two models share a stream, even for an input-less node."""
    from onnxfuse.core.rules.random import model_seed

    def build(r):
        nodes = [h.make_node("RandomNormal", [], ["noise"], shape=[2, 3], seed=7.0),
                 h.make_node("Add", ["x", "noise"], ["out"])]
        return _one_op(nodes, [vinfo("x", [2, 3])], [vinfo("out", [2, 3])], [])

    for B in (1, 3):
        fa = fuse_models([build(None) for _ in range(B)])
        seeds = [a.f for n in fa.model.graph.node if n.op_type == "RandomNormal" for a in n.attribute
                 if a.name == "seed"]
        assert seeds == [model_seed(7.0, b) for b in range(B)] and len(set(seeds)) == B


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("axis,idx_shape", [(0, [5]), (1, [2, 3]), (2, [4]), (-1, [1])])
def test_gather_with_each_models_own_indices(B, axis, idx_shape, rng):
    """x[:, self.index_buffer]: indices that are each model's own (an integer buffer) into a shared or per-model
    tensor, along any axis: one GatherND with the model as a batch axis."""
    def build(r):
        idx = r.integers(-3, 3, idx_shape).astype(np.int64)
        inits = [rand_init(r, "w", [4, 4]), nh.from_array(idx, "index_buffer")]
        nodes = [h.make_node("Gather", ["x", "index_buffer"], ["shared_pick"], axis=axis),
                 h.make_node("MatMul", ["x", "w"], ["xw"]),
                 h.make_node("Gather", ["xw", "index_buffer"], ["own_pick"], axis=axis)]
        a = axis % 3
        out = [3, 4, 4][:a] + idx_shape + [3, 4, 4][a + 1:]
        m = graph_model(nodes, [vinfo("x", [3, 4, 4])], [vinfo("shared_pick", out), vinfo("own_pick", out)], inits)
        # as the exporter records a module's buffers: each model's own initializers, whatever their values
        h.set_model_props(m, {"onnxfuse": json.dumps({"trainable": ["w"], "buffers": ["index_buffer"]})})
        return m

    fa = check_fused(build, B, {"x": rng.standard_normal((3, 4, 4)).astype(np.float32)}, rng)
    assert fa.spec.summary["per_model"] == 0, fa.spec.summary["unfused"]


@pytest.mark.parametrize("B", [1, 2, 5])
def test_control_flow_runs_per_model_with_each_models_outer_tensors(B, rng):
    """If, Loop and Scan have no fusion rule: each model's copy runs on its own slices, and what its subgraphs read
    from outside (a weight, an activation) is renamed to that model's slice of it."""
    def build(r):
        then = h.make_graph([h.make_node("MatMul", ["x", "w"], ["t"])], "then", [], [vinfo("t", ["N", 4])])
        other = h.make_graph([h.make_node("Mul", ["x", "w2"], ["e"])], "else", [], [vinfo("e", ["N", 4])])
        step = h.make_graph([h.make_node("Mul", ["acc_in", "w2"], ["m"]), h.make_node("Add", ["m", "xt"], ["acc_out"]),
                             h.make_node("Identity", ["acc_out"], ["y"])],
                            "step", [vinfo("acc_in", [4]), vinfo("xt", [4])], [vinfo("acc_out", [4]), vinfo("y", [4])])
        nodes = [h.make_node("ReduceSum", ["x"], ["s"], keepdims=0), h.make_node("Greater", ["s", "zero"], ["c"]),
                 h.make_node("If", ["c"], ["branch"], then_branch=then, else_branch=other),
                 h.make_node("Scan", ["acc0", "branch"], ["last", "seq"], body=step, num_scan_inputs=1)]
        inits = [rand_init(r, "w", [4, 4]), rand_init(r, "w2", [4]), rand_init(r, "acc0", [4]),
                 nh.from_array(np.array(0, np.float32), "zero")]
        return graph_model(nodes, [vinfo("x", [3, 4])], [vinfo("last", [4]), vinfo("seq", [3, 4])], inits)

    import torch

    from onnxfuse.runtime.torch.program import OnnxModule

    for sign in (1, -1):
        x = (np.abs(rng.standard_normal((3, 4))) * sign).astype(np.float32)
        fa = check_fused(build, B, {"x": x}, rng)
        got = OnnxModule.from_array(fa.model, fa.spec)(x=torch.from_numpy(x))  # the torch runtime runs it too
        for g, r in zip(got, run_onnx(fa.model, {"x": x})):
            assert rel_err(g.detach().numpy(), r) < 1e-5


@pytest.mark.parametrize("flag", [True, False])
def test_an_if_on_a_static_condition_is_its_branch(flag, rng):
    """torch's export of scatter_reduce (opset 18) branches on the index's static size: an If whose condition is a
    constant becomes the branch it takes (its own names renamed into the graph), so nothing runs per model."""
    def build(r):
        then = h.make_graph([h.make_node("MatMul", ["x", "w"], ["t"]), h.make_node("Relu", ["t"], ["tr"])], "then",
                            [], [vinfo("tr", [3, 4])])
        other = h.make_graph([h.make_node("Neg", ["x"], ["e"])], "else", [], [vinfo("e", [3, 4])])
        nodes = [h.make_node("Constant", [], ["c"], value=nh.from_array(np.array(flag))),
                 h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
                 h.make_node("Mul", ["y", "w2"], ["out"])]
        return graph_model(nodes, [vinfo("x", [3, 4])], [vinfo("out", [3, 4])],
                           [rand_init(r, "w", [4, 4]), rand_init(r, "w2", [4])])

    fa = check_fused(build, 3, {"x": rng.standard_normal((3, 4)).astype(np.float32)}, rng)
    assert fa.spec.summary["per_model"] == 0 and not any(n.op_type == "If" for n in fa.model.graph.node)
