"""Rules for ops along axes (gather, norms, concat/split/slice/pad, reshapes, reductions, einsum, resize, conv
transpose, attention) on hand-built graphs: B models with different weights, fused == each model."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from tests.conftest import check_fused, graph_model, rand_init, vinfo
from onnxfuse import fuse_models

Bs = [1, 2, 5]


def i64(name, v):
    return nh.from_array(np.array(v, np.int64), name)


def conv_in(r, cin=2, cout=4, name="c"):
    """A 1x1 Conv from the shared input x: gives a channel-packed per-model tensor."""
    return h.make_node("Conv", ["x", "w_" + name], [name]), rand_init(r, "w_" + name, [cout, cin, 1, 1])


X = {"x": np.random.default_rng(5).standard_normal((3, 2, 4, 6)).astype(np.float32)}


@pytest.mark.parametrize("B", Bs)
def test_embedding_positions_layernorm_attention(B):
    V, T, D, H = 11, 5, 8, 2

    def build(r):
        inits = [rand_init(r, "emb", [V, D]), rand_init(r, "pos", [T, D]), rand_init(r, "g", [D]),
                 rand_init(r, "b", [D]), rand_init(r, "wq", [D, D]), rand_init(r, "wk", [D, D]),
                 rand_init(r, "wv", [D, D]), i64("heads", [0, T, H, D // H]), i64("merged", [0, T, D]),
                 nh.from_array(np.array(np.sqrt(D // H), np.float32), "scale"),
                 nh.from_array(np.triu(np.full((T, T), -1e4, np.float32), 1), "mask"), i64("zero", 0)]
        nodes = [h.make_node("Gather", ["emb", "tok"], ["e"]), h.make_node("Add", ["e", "pos"], ["e2"]),
                 h.make_node("LayerNormalization", ["e2", "g", "b"], ["n"], axis=-1, epsilon=1e-5)]
        for k in "qkv":
            nodes += [h.make_node("MatMul", ["n", "w" + k], [k + "0"]),
                      h.make_node("Reshape", [k + "0", "heads"], [k + "1"]),
                      h.make_node("Transpose", [k + "1"], [k], perm=[0, 2, 1, 3])]
        nodes += [h.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
                  h.make_node("MatMul", ["q", "kt"], ["s0"]), h.make_node("Div", ["s0", "scale"], ["s1"]),
                  h.make_node("Add", ["s1", "mask"], ["s2"]), h.make_node("Softmax", ["s2"], ["p"], axis=-1),
                  h.make_node("MatMul", ["p", "v"], ["o0"]), h.make_node("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3]),
                  h.make_node("Reshape", ["o1", "merged"], ["o"]),
                  h.make_node("Gather", ["o", "zero"], ["cls"], axis=1),  # x[:, 0]
                  h.make_node("Concat", ["cls", "cls"], ["out"], axis=1)]
        return graph_model(nodes, [vinfo("tok", ["N", T], TP.INT64)], [vinfo("out", ["N", 2 * D])], inits)

    tok = np.random.default_rng(0).integers(0, V, (3, T)).astype(np.int64)
    check_fused(build, B, {"tok": tok})


@pytest.mark.parametrize("B", Bs)
def test_concat_split_slice_pad_on_the_channel_axis(B):
    def build(r):
        n1, w1 = conv_in(r, cout=4, name="c1")
        n2, w2 = conv_in(r, cout=3, name="c2")
        inits = [w1, w2, rand_init(r, "w3", [5, 9, 1, 1]), i64("split", [2, 3]), i64("s0", [1, 0]), i64("e0", [3, 5]),
                 i64("ax", [1, 3]), i64("pads", [0, 1, 0, 2, 0, 0, 1, 1])]
        nodes = [n1, n2,
                 h.make_node("Concat", ["c1", "c2", "x"], ["cat"], axis=1),          # per-model + shared channels
                 h.make_node("Conv", ["cat", "w3"], ["c3"]),
                 h.make_node("Split", ["c3", "split"], ["p1", "p2"], axis=1),
                 h.make_node("Slice", ["p2", "s0", "e0", "ax"], ["sl"]),             # channels 1..2, width 0..4
                 h.make_node("Pad", ["sl", "pads"], ["pd"]),                         # pads channels and H, W
                 h.make_node("ReduceMean", ["pd"], ["m"], axes=[1], keepdims=1),
                 h.make_node("Mul", ["p1", "m"], ["out0"]) if False else h.make_node("Identity", ["m"], ["mm"]),
                 h.make_node("Concat", ["p1", "p1"], ["out"], axis=-1)]
        return graph_model(nodes, [vinfo("x", ["N", 2, 4, 6])], [vinfo("out", ["N", 2, 4, 12]),
                                                                   vinfo("pd", ["N", 3, 5, 8])], inits)

    check_fused(build, B, X)


@pytest.mark.parametrize("B", Bs)
@pytest.mark.parametrize("op", ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2", "ReduceLogSumExp"])
@pytest.mark.parametrize("axes,keepdims", [([1], 0), ([2, 3], 1), ([0, 2], 0), (None, 0), ([-1], 1)])
def test_reductions(B, op, axes, keepdims):
    def build(r):
        n, w = conv_in(r)
        inits = [w]
        attrs = {"keepdims": keepdims}
        ins = ["c"]
        if axes is not None:
            if op == "ReduceSum":
                inits.append(i64("axes", axes))
                ins.append("axes")
            else:
                attrs["axes"] = axes
        nodes = [n, h.make_node(op, ins, ["red"], **attrs), h.make_node("Identity", ["red"], ["out"])]
        return graph_model(nodes, [vinfo("x", ["N", 2, 4, 6])], [vinfo("out", None if False else [None] * (
            (4 if keepdims else 4 - (len(axes) if axes else 4))))], inits)

    check_fused(build, B, X)


@pytest.mark.parametrize("B", Bs)
def test_argmax_cumsum_squeeze_unsqueeze_expand_tile(B):
    def build(r):
        n, w = conv_in(r)
        inits = [w, i64("cax", 3), i64("u", [0, 3]), i64("sq", [0]), i64("shape", [3, 4, 4, 6]), i64("reps", [1, 2, 1, 1])]
        nodes = [n, h.make_node("ArgMax", ["c"], ["am"], axis=2, keepdims=0),
                 h.make_node("Cast", ["am"], ["amf"], to=TP.FLOAT),
                 h.make_node("CumSum", ["c", "cax"], ["cs"], reverse=1),
                 h.make_node("ReduceMax", ["cs"], ["rm"], axes=[1], keepdims=1),        # [N, 1, 4, 6]
                 h.make_node("Unsqueeze", ["rm", "u"], ["un"]),                          # [1, N, 1, 1, 4, 6]
                 h.make_node("Squeeze", ["un", "sq"], ["sq1"]),                           # [N, 1, 1, 4, 6]
                 h.make_node("Squeeze", ["sq1"], ["sq2"]),                                # [N, 4, 6] (N != 1)
                 h.make_node("Expand", ["rm", "shape"], ["ex"]),                          # [3, 4, 4, 6]
                 h.make_node("Tile", ["ex", "reps"], ["ti"]),                             # [3, 8, 4, 6]
                 h.make_node("Add", ["sq2", "amf"], ["out"])]
        return graph_model(nodes, [vinfo("x", [3, 2, 4, 6])], [vinfo("out", [3, 4, 6]), vinfo("ti", [3, 8, 4, 6])],
                           inits)

    check_fused(build, B, X)


@pytest.mark.parametrize("B", Bs)
@pytest.mark.parametrize("group,stride,out_pad", [(1, 2, 1), (2, 2, 0), (1, 1, 0)])
def test_conv_transpose(B, group, stride, out_pad):
    def build(r):
        n, w = conv_in(r, cout=4)
        inits = [w, rand_init(r, "wt", [4, 6 // group, 3, 3]), rand_init(r, "bt", [6])]
        nodes = [n, h.make_node("ConvTranspose", ["c", "wt", "bt"], ["out"], group=group, strides=[stride, stride],
                                pads=[1, 1, 1, 1], output_padding=[out_pad, out_pad])]
        return graph_model(nodes, [vinfo("x", ["N", 2, 4, 6])], [vinfo("out", ["N", 6, None, None])], inits)

    check_fused(build, B, X)


@pytest.mark.parametrize("B", Bs)
@pytest.mark.parametrize("equation", ["nchw,ck->nkhw", "nchw,nchv->nwv", "nchw", "ij,jk"])
def test_einsum(B, equation):
    def build(r):
        n, w = conv_in(r)
        inits = [w, rand_init(r, "wk", [4, 3])]
        if equation == "nchw,ck->nkhw":
            nodes = [n, h.make_node("Einsum", ["c", "wk"], ["out"], equation=equation)]
        elif equation == "nchw,nchv->nwv":
            nodes = [n, h.make_node("Einsum", ["c", "c"], ["out"], equation=equation)]
        elif equation == "nchw":   # implicit output: a transpose to 'chnw'... sorted letters: 'chnw'
            nodes = [n, h.make_node("Einsum", ["c"], ["out"], equation=equation)]
        else:                      # shared x flattened with a per-model weight
            inits = [rand_init(r, "wk", [12, 3]), i64("s", [-1, 12])]
            nodes = [h.make_node("Reshape", ["x", "s"], ["xf"]), h.make_node("Einsum", ["xf", "wk"], ["out"],
                                                                                 equation=equation)]
        return graph_model(nodes, [vinfo("x", [3, 2, 4, 6])], [vinfo("out", None and [] or [None] * {
            "nchw,ck->nkhw": 4, "nchw,nchv->nwv": 3, "nchw": 4, "ij,jk": 2}[equation])], inits)

    check_fused(build, B, X)


@pytest.mark.parametrize("B", Bs)
@pytest.mark.parametrize("mode,scales", [("nearest", [1, 1, 2, 2]), ("linear", [1, 1, 2, 3])])
def test_resize(B, mode, scales):
    def build(r):
        n, w = conv_in(r)
        inits = [w, nh.from_array(np.array(scales, np.float32), "scales")]
        nodes = [n, h.make_node("Resize", ["c", "", "scales"], ["out"], mode=mode)]
        return graph_model(nodes, [vinfo("x", ["N", 2, 4, 6])], [vinfo("out", ["N", 4, None, None])], inits)

    check_fused(build, B, X)


@pytest.mark.parametrize("B", Bs)
def test_instance_norm_and_group_conv_depthwise(B):
    def build(r):
        n, w = conv_in(r)
        inits = [w, rand_init(r, "s", [4]), rand_init(r, "o", [4]), rand_init(r, "dw", [4, 1, 3, 3])]
        nodes = [n, h.make_node("InstanceNormalization", ["c", "s", "o"], ["i"]),
                 h.make_node("Conv", ["i", "dw"], ["out"], group=4, pads=[1, 1, 1, 1], dilations=[2, 2])]
        return graph_model(nodes, [vinfo("x", ["N", 2, 4, 6])], [vinfo("out", ["N", 4, None, None])], inits)

    check_fused(build, B, X)


@pytest.mark.parametrize("B", Bs)
def test_node_without_rule_runs_per_model(B):
    def build(r):
        n, w = conv_in(r)
        inits = [w, nh.from_array(np.array([1, 0, 1, 1, 0, 1], bool), "keep")]
        nodes = [n, h.make_node("Compress", ["c", "keep"], ["v"], axis=3, name="compress"),
                 h.make_node("Relu", ["v"], ["out"])]
        return graph_model(nodes, [vinfo("x", ["N", 2, 4, 6])], [vinfo("out", ["N", 4, 4, 4])], inits)

    with pytest.warns(UserWarning, match=r"run once per model instead of fused: compress \(Compress\)"):
        fa = check_fused(build, B, X)
    assert fa.spec.summary["per_model"] == 1 and fa.spec.summary["unfused"][0]["op_type"] == "Compress"


def test_per_model_inputs(rng):
    B = 3

    def build(r):
        n, w = conv_in(r)
        return graph_model([n, h.make_node("Relu", ["c"], ["out"])], [vinfo("x", ["N", 2, 4, 6])],
                           [vinfo("out", ["N", 4, 4, 6])], [w])

    models = [build(np.random.default_rng(100 + b)) for b in range(B)]
    fa = fuse_models(models, per_model_inputs=["x"])
    xs = rng.standard_normal((B, 3, 2, 4, 6)).astype(np.float32)  # a different batch for every model
    from tests.conftest import rel_err, run_onnx

    fused = run_onnx(fa.model, {"x": xs})[0]
    for b in range(B):
        assert rel_err(fused[b], run_onnx(models[b], {"x": xs[b]})[0]) < 1e-6
    assert fa.spec.inputs[0]["per_model"] is True
