"""Trainability legalization: every rewrite, on a real torch export between trainable layers, gives torch's forward
and torch's parameter gradients after one onnxruntime-training step; without it, ORT 1.19 cannot train the model."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import rel_err, run_onnx
from fuzz.native import native_output_to
from onnxfuse.core.errors import NotFusibleError, UntrainableOpError
from onnxfuse.exporters import export_module
from onnxfuse.runtime.ort.legalize import legalize

TOL = 1e-5


def _train_step(model: onnx.ModelProto, params: list[str], x: np.ndarray, target: np.ndarray, folder: str):
    """generate_artifacts with MSE loss, one Module train step; returns {param: grad}."""
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module

    os.makedirs(folder, exist_ok=True)
    with native_output_to(2):  # ORT's gradient builder logs INFO lines to the C++ stderr
        artifacts.generate_artifacts(model, requires_grad=params, loss=artifacts.LossType.MSELoss, optimizer=None,
                                     artifact_directory=folder)
        state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
        module = Module(os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx"))
        module.train()
        module(x, target)
    return {p: np.array(state.parameters[p].grad) for p in params}


class Around(nn.Module):
    """pre -> fn -> post, so that gradients must cross the op to reach ``pre``'s parameters."""

    def __init__(self, pre: nn.Module, fn, post: nn.Module, **extra: nn.Module):
        super().__init__()
        self.pre, self.fn, self.post = pre, fn, post
        for k, v in extra.items():
            setattr(self, k, v)

    def forward(self, x):
        return self.post(self.fn(self, self.pre(x)))


def check_legalized_training(module: nn.Module, shape: tuple, tmp_path, raw_error: str, opset: int = 17, edit=None,
                             scale: float = 1.0, expect: str | None = None) -> list[str]:
    """Export (batch 2), legalize, train one step on batch 3 with ORT; compare output and every parameter gradient
    with torch autograd on the same MSE loss; check that the model as exported fails to train with ``raw_error``
    (a regex). ``edit`` changes the exported ONNX model in place (to reach ONNX attributes torch never sets);
    ``module`` must then compute the edited semantics in torch. ``expect``: a word of the rewrite's description."""
    torch.manual_seed(0)
    path = os.path.join(tmp_path, "model.onnx")
    model = export_module(module, path, example_inputs=(scale * torch.randn(2, *shape[1:]),), opset=opset)
    if edit is not None:
        edit(model)
    legal, applied = legalize(model)
    assert applied, "nothing was legalized"
    if expect is not None:
        assert any(expect in line for line in applied), applied
    onnx.checker.check_model(legal, full_check=True)

    inits = {t.name for t in model.graph.initializer}
    params = [n for n, p in module.named_parameters() if n in inits]
    assert params
    x = scale * torch.randn(*shape)
    out = module(x)
    target = torch.randn_like(out)
    module.zero_grad()
    F.mse_loss(out, target).backward()
    torch_grads = {n: p.grad.numpy() for n, p in module.named_parameters() if n in params}

    x_np, target_np = x.numpy(), target.detach().numpy()
    (ort_out,) = run_onnx(legal, {"input": x_np})
    assert ort_out.shape == tuple(out.shape)
    assert rel_err(ort_out, out.detach().numpy()) < TOL
    grads = _train_step(legal, params, x_np, target_np, os.path.join(tmp_path, "legal"))
    for name in params:
        assert grads[name].shape == torch_grads[name].shape, name
        assert rel_err(grads[name], torch_grads[name]) < TOL, (name, rel_err(grads[name], torch_grads[name]))
    with pytest.raises(Exception, match=raw_error):
        _train_step(model, params, x_np, target_np, os.path.join(tmp_path, "raw"))
    return applied


def lin(i, o):
    return nn.Linear(i, o)


class _ExportFlag(Around):
    exporting = True

    def forward(self, x):
        type(self).exporting = torch.onnx.is_in_onnx_export()
        return super().forward(x)


# --- LayerNormalization --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [17, 20])
def test_layernorm_gets_statistics_outputs(tmp_path, opset):
    torch.manual_seed(1)
    m = Around(lin(6, 8), lambda s, h: s.norm(h), lin(8, 4), norm=nn.LayerNorm(8))
    applied = check_legalized_training(m, (3, 5, 6), tmp_path, r"OutputDefs\(\)\.size\(\)", opset=opset)
    assert applied == ["LayerNormalization '/norm/LayerNormalization' -> LayerNormalization with 3 outputs (was 1)"]


# --- ReduceMax / ReduceMin -----------------------------------------------------------------------------------------

REDUCTIONS = {
    "amax_two_axes": (lambda s, h: torch.amax(h, dim=(1, 2)), (3, 3, 4, 6), 5, 5),
    "max_dim_values": (lambda s, h: h.max(dim=1)[0], (3, 4, 6), 5, 5),
    "min_keepdim_last": (lambda s, h: h.min(dim=-1, keepdim=True)[0], (3, 4, 6), 5, 1),
    "max_all": (lambda s, h: h + h.max(), (3, 4, 6), 5, 5),
    "min_all": (lambda s, h: h * h.min(), (3, 4, 6), 5, 5),
}


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("variant", sorted(REDUCTIONS))
def test_reduce_max_min(tmp_path, variant, opset):
    fn, shape, hidden, post_in = REDUCTIONS[variant]
    torch.manual_seed(2)
    m = Around(lin(shape[-1], hidden), fn, lin(post_in, 3))
    check_legalized_training(m, shape, tmp_path, "gradient builder has not been registered: Reduce(Max|Min)",
                             opset=opset, expect="Equal")


def _retype_reduction(op_type):
    def edit(model):
        for n in model.graph.node:
            if n.op_type == "ReduceL1":
                n.op_type = op_type
    return edit


SUM_REDUCTIONS = {
    # torch.norm(p=1) exports ReduceL1; torch exports nothing as ReduceSumSquare / ReduceLogSum, so the ReduceL1 is
    # retyped and torch computes the retyped meaning
    "ReduceL1": (lambda s, h: torch.norm(h, p=1, dim=1)),
    "ReduceSumSquare": (lambda s, h: torch.norm(h, p=1, dim=1) if s.exporting else (h * h).sum(1)),
    "ReduceLogSum": (lambda s, h: torch.norm(h.abs() + 1, p=1, dim=1) if s.exporting else
                     torch.log((h.abs() + 1).sum(1))),
}


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("op", list(SUM_REDUCTIONS))
def test_reductions_via_sum(tmp_path, op, opset):
    torch.manual_seed(12)
    m = _ExportFlag(lin(6, 5), SUM_REDUCTIONS[op], lin(5, 3))
    check_legalized_training(m, (3, 4, 6), tmp_path, f"gradient builder has not been registered: {op}", opset=opset,
                             edit=None if op == "ReduceL1" else _retype_reduction(op), expect="ReduceSum")


# --- Activations: HardSwish, HardSigmoid, Elu, Selu, Celu, Softplus (Mish), PRelu ----------------------------------

ACTIVATIONS = {
    "hardswish": (lambda: nn.Hardswish(), "HardSwish", 14),
    "hardsigmoid": (lambda: nn.Hardsigmoid(), "HardSigmoid", 14),
    "elu": (lambda: nn.ELU(alpha=0.7), "Elu", 13),
    "selu": (lambda: nn.SELU(), "Selu", 13),
    "celu": (lambda: nn.CELU(alpha=1.3), "Celu", 13),
    "softplus": (lambda: nn.Softplus(), "Softplus", 13),
    "mish": (lambda: nn.Mish(), "Softplus", 17),
    "prelu_shared": (lambda: nn.PReLU(), "PRelu", 13),
    "prelu_per_feature": (lambda: nn.PReLU(16, init=0.1), "PRelu", 13),
}


@pytest.mark.parametrize("late_opset", [False, True])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_activations(tmp_path, act, late_opset):
    make, op, first_opset = ACTIVATIONS[act]
    torch.manual_seed(3)
    m = Around(lin(6, 16), lambda s, h: s.act(h), lin(16, 4), act=make())
    # inputs of scale 4 put pre-activations on every piece (< -3, between, > 3)
    check_legalized_training(m, (8, 6), tmp_path, f"gradient builder has not been registered: {op}",
                             opset=20 if late_opset else first_opset, scale=4.0, expect=op)


# --- Einsum --------------------------------------------------------------------------------------------------------

EINSUMS = {
    "bij,bjk->bik": lambda s, h: torch.einsum("bij,bjk->bik", h, s.other(h).transpose(1, 2)),
    "bij->bj": lambda s, h: torch.einsum("bij->bj", h),
    "bij,jk->bik (parameter operand)": lambda s, h: torch.einsum("bij,jk->bik", h, s.w),
    "bij,bkj (implicit: ->ik)": lambda s, h: h[:, :, :4] * torch.einsum("bij,bkj", h, s.other(h)),
    "...ij,...kj->...ik": lambda s, h: torch.einsum("...ij,...kj->...ik", h, s.other(h)),
    "bij,bij->bi (elementwise)": lambda s, h: torch.einsum("bij,bij->bi", h, s.other(h)),
    "bi,bj->bij (outer)": lambda s, h: torch.einsum("bi,bj->bij", h[:, 0], s.other(h)[:, 1]),
}


@pytest.mark.parametrize("equation", list(EINSUMS))
def test_einsum(tmp_path, equation):
    torch.manual_seed(4)
    m = Around(lin(6, 5), EINSUMS[equation], nn.LazyLinear(3), other=lin(5, 5), w=nn.Parameter(torch.randn(5, 4)))
    x = torch.randn(3, 4, 6)
    m(x)  # materializes the lazy layer
    check_legalized_training(m, (3, 4, 6), tmp_path, "gradient builder has not been registered: Einsum",
                             expect="Einsum")


# --- CumSum --------------------------------------------------------------------------------------------------------


def _set_cumsum_attrs(**attrs):
    def edit(model):
        for n in model.graph.node:
            if n.op_type == "CumSum":
                n.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
    return edit


def _exclusive(h, dim):
    return torch.cumsum(h, dim) - h


CUMSUMS = {
    "dim1": (lambda s, h: torch.cumsum(h, dim=1), (3, 4, 5), None),
    "dim-1": (lambda s, h: torch.cumsum(h, dim=-1), (3, 4, 5), None),
    "4d_dim1": (lambda s, h: torch.cumsum(h, dim=1), (3, 3, 4, 5), None),
    "reversed_via_flip": (lambda s, h: torch.cumsum(h.flip(1), dim=1).flip(1), (3, 4, 5), None),
    # torch never sets exclusive/reverse: the attribute is set on the exported node, torch computes the meaning
    "exclusive": (lambda s, h: torch.cumsum(h, 1) if s.exporting else _exclusive(h, 1), (3, 4, 5),
                  dict(exclusive=1)),
    "reverse": (lambda s, h: torch.cumsum(h, 1) if s.exporting else torch.cumsum(h.flip(1), 1).flip(1), (3, 4, 5),
                dict(reverse=1)),
    "reverse_exclusive": (lambda s, h: torch.cumsum(h, 1) if s.exporting else
                          _exclusive(h.flip(1), 1).flip(1), (3, 4, 5), dict(exclusive=1, reverse=1)),
}


@pytest.mark.parametrize("variant", list(CUMSUMS))
def test_cumsum(tmp_path, variant):
    fn, shape, attrs = CUMSUMS[variant]
    torch.manual_seed(5)
    m = _ExportFlag(lin(shape[-1], 5), fn, lin(5, 3))
    check_legalized_training(m, shape, tmp_path, "gradient builder has not been registered: CumSum",
                             edit=_set_cumsum_attrs(**attrs) if attrs else None, expect="MatMul")


# --- InstanceNormalization (nn.InstanceNorm*d, nn.GroupNorm) -------------------------------------------------------

NORMS = {
    "instancenorm2d_affine": (lambda: nn.InstanceNorm2d(4, affine=True), (3, 3, 5, 6)),
    "instancenorm1d": (lambda: nn.InstanceNorm1d(4), (3, 3, 7)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), (3, 3, 5, 6)),
}


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("variant", list(NORMS))
def test_instance_and_group_norm(tmp_path, variant, opset):
    make, shape = NORMS[variant]
    torch.manual_seed(10)
    conv = nn.Conv1d if len(shape) == 3 else nn.Conv2d
    norm = make()
    with torch.no_grad():  # non-trivial affine parameters
        for p in norm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    # no bias before an instance norm: its true gradient is exactly zero, and float noise is not comparable
    m = Around(conv(3, 4, 1, bias=variant == "groupnorm"), lambda s, h: s.norm(h), conv(4, 2, 1), norm=norm)
    check_legalized_training(m, shape, tmp_path, "gradient builder has not been registered: InstanceNormalization",
                             opset=opset, expect="ReduceMean")


# --- DepthToSpace (nn.PixelShuffle) / SpaceToDepth -----------------------------------------------------------------


def _space_to_depth(h, b=2):
    """ONNX SpaceToDepth's definition in torch (torch's pixel_unshuffle orders channels differently)."""
    n, c, hh, ww = h.shape
    return h.reshape(n, c, hh // b, b, ww // b, b).permute(0, 3, 5, 1, 2, 4).reshape(n, c * b * b, hh // b, ww // b)


def _middle_as(op_type, **attrs):
    """Replace every node between the pre and post layers of an exported Around with one ``op_type`` node."""
    def edit(model):
        pre = next(n for n in model.graph.node if n.name.startswith("/pre/"))
        post = next(n for n in model.graph.node if n.name.startswith("/post/"))
        middle = helper.make_node(op_type, [pre.output[0]], [post.input[0]], name=f"/{op_type}", **attrs)
        del model.graph.node[:]
        model.graph.node.extend([pre, middle, post])
    return edit


def test_pixel_shuffle_depth_to_space(tmp_path):
    torch.manual_seed(11)
    m = Around(nn.Conv2d(3, 8, 1), lambda s, h: s.shuffle(h), nn.Conv2d(2, 2, 1), shuffle=nn.PixelShuffle(2))
    check_legalized_training(m, (3, 3, 4, 6), tmp_path, "gradient builder has not been registered: DepthToSpace",
                             expect="DepthToSpace")


def test_space_to_depth(tmp_path):
    # torch exports PixelUnshuffle as Reshape/Transpose: the middle of the exported graph is replaced by the op
    torch.manual_seed(11)
    m = Around(nn.Conv2d(3, 2, 1), lambda s, h: _space_to_depth(h), nn.Conv2d(8, 2, 1))
    check_legalized_training(m, (3, 3, 4, 6), tmp_path, "gradient builder has not been registered: SpaceToDepth",
                             edit=_middle_as("SpaceToDepth", blocksize=2), expect="SpaceToDepth")


# --- ConvTranspose -------------------------------------------------------------------------------------------------

CONV_TRANSPOSES = {
    "2d_stride2_pad1_outpad1_groups2": (nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
                                        (3, 3, 5, 5)),
    "1d_stride3_pad2_dilation2": (nn.ConvTranspose1d(4, 5, 4, stride=3, padding=2, dilation=2), (3, 3, 6)),
    "1d_pad_beyond_kernel_nobias": (nn.ConvTranspose1d(4, 3, 3, stride=2, padding=3, bias=False), (3, 3, 7)),
    "2d_stride1": (nn.ConvTranspose2d(4, 2, (2, 3)), (3, 3, 4, 5)),
    "2d_depthwise_rect_stride": (nn.ConvTranspose2d(4, 4, (3, 2), stride=(1, 2), padding=(1, 0), groups=4),
                                 (3, 3, 4, 5)),
}


@pytest.mark.parametrize("variant", list(CONV_TRANSPOSES))
def test_conv_transpose(tmp_path, variant):
    layer, shape = CONV_TRANSPOSES[variant]
    torch.manual_seed(6)
    conv = nn.Conv1d if len(shape) == 3 else nn.Conv2d
    m = Around(conv(3, 4, 1), lambda s, h: s.up(h), conv(layer.out_channels, 2, 1), up=layer)
    check_legalized_training(m, shape, tmp_path, "implementation for ConvTransposeGrad", expect="Conv")


# --- Resize --------------------------------------------------------------------------------------------------------

RESIZES = {
    "nearest_2d_x2": (lambda h: F.interpolate(h, scale_factor=2, mode="nearest"), (3, 2, 4, 5)),
    "nearest_1d_x3": (lambda h: F.interpolate(h, scale_factor=3, mode="nearest"), (3, 2, 5)),
    "nearest_2d_x1.5_gather": (lambda h: F.interpolate(h, scale_factor=1.5, mode="nearest"), (3, 2, 4, 6)),
    "bilinear_x2": (lambda h: F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False), (3, 2, 4, 5)),
    "bilinear_align_corners_size": (lambda h: F.interpolate(h, size=(7, 9), mode="bilinear", align_corners=True),
                                    (3, 2, 4, 5)),
    "bilinear_x1.5_x0.5": (lambda h: F.interpolate(h, scale_factor=(1.5, 0.5), mode="bilinear"), (3, 2, 4, 6)),
    "linear_1d_x2.5": (lambda h: F.interpolate(h, scale_factor=2.5, mode="linear"), (3, 2, 4)),
    "linear_1d_align_corners": (lambda h: F.interpolate(h, scale_factor=2, mode="linear", align_corners=True),
                                (3, 2, 5)),
}


@pytest.mark.parametrize("opset", [13, 19])
@pytest.mark.parametrize("variant", list(RESIZES))
def test_resize(tmp_path, variant, opset):
    fn, shape = RESIZES[variant]
    torch.manual_seed(7)
    conv = nn.Conv1d if len(shape) == 3 else nn.Conv2d
    m = Around(conv(2, 3, 1), lambda s, h: fn(h), conv(3, 2, 1))
    check_legalized_training(m, shape, tmp_path, "implementation for ResizeGrad", opset=opset, expect="Resize")


# --- Split with an unused output -----------------------------------------------------------------------------------

SPLITS = {
    "sizes_middle_unused": (lambda s, h: (lambda a, b, c: torch.cat([a, c], 1))(*torch.split(h, [2, 1, 1], dim=1)),
                            (3, 4, 6)),
    "last_axis_first_only": (lambda s, h: torch.split(h, [3, 2], dim=-1)[0], (3, 4, 6)),
    "equal_chunks_unbind": (lambda s, h: h.unbind(1)[2], (3, 4, 6)),
}


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("variant", list(SPLITS))
def test_split_with_unused_output(tmp_path, variant, opset):
    fn, shape = SPLITS[variant]
    torch.manual_seed(8)
    m = Around(lin(6, 5), fn, nn.LazyLinear(3))
    m(torch.randn(*shape))
    # ORT builds a gradient of the wrong shape: a later kernel fails on it
    check_legalized_training(m, shape, tmp_path, "Dimension mismatch|cannot be reshaped", opset=opset, expect="Split")


# --- Slice with a negative step on the last axis -------------------------------------------------------------------

FLIPS = {
    "flip_last": (lambda s, h: h.flip(-1), (3, 4, 6)),
    "flip_last_two": (lambda s, h: h.flip(-1, -2), (3, 4, 6)),
    "flip_last_rank2": (lambda s, h: h.flip(-1), (3, 6)),
}


@pytest.mark.parametrize("variant", list(FLIPS))
def test_slice_reversing_the_last_axis(tmp_path, variant):
    fn, shape = FLIPS[variant]
    torch.manual_seed(9)
    m = Around(lin(6, 5), fn, lin(5, 3))
    check_legalized_training(m, shape, tmp_path, "narrowing_error", expect="Slice")


# --- nodes that need nothing, and forms that cannot be legalized ---------------------------------------------------


def _graph_model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_trainable_nodes_are_left_alone():
    nodes = [
        helper.make_node("LayerNormalization", ["x", "s"], ["ln", "mean", "inv"], name="ln", axis=-1),
        helper.make_node("Split", ["ln", "sp"], ["a", "b"], name="split", axis=1),
        helper.make_node("Add", ["a", "b"], ["y"], name="add"),
    ]
    inits = [numpy_helper.from_array(np.ones(4, np.float32), "s"), numpy_helper.from_array(np.array([2, 2]), "sp")]
    model = _graph_model(nodes, [_vi("x", ["N", 4, 4])], [_vi("y", None)], inits)
    legal, applied = legalize(model)
    assert applied == []
    assert [n.op_type for n in legal.graph.node] == ["LayerNormalization", "Split", "Add"]


@pytest.mark.parametrize("opset", [13, 15, 17, 18, 19, 20])
def test_every_opset_forward_matches_and_trains(tmp_path, opset):
    """Reduce*/Split/Resize/CumSum written the way each opset spells them: the legalized graph computes what the
    original does (ORT forward) and trains."""
    rng = np.random.default_rng(opset)
    axes_input = opset >= 18

    def reduce(op, x, y, keepdims):
        if axes_input:
            return helper.make_node(op, [x, "ax"], [y], keepdims=keepdims)
        return helper.make_node(op, [x], [y], axes=[1], keepdims=keepdims)

    split_attrs = {"num_outputs": 3} if opset >= 18 else {}
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),                                 # [N, 4, 6]
        reduce("ReduceMax", "h", "r", keepdims=0),                                      # [N, 6]
        helper.make_node("Split", ["h"], ["s0", "s1", "s2"], axis=2, **split_attrs),    # [N, 4, 2] each; s1 used
        helper.make_node("CumSum", ["s1", "one"], ["c"], reverse=1),                    # [N, 4, 2]
        helper.make_node("Resize", ["c", "", "scales"], ["u"], mode="linear",           # [N, 4, 4]
                         **({"axes": [2]} if opset >= 18 else {})),
        reduce("ReduceMin", "u", "m", keepdims=1),                                      # [N, 1, 4]
        helper.make_node("MatMul", ["m", "v"], ["mv"]),                                 # [N, 1, 6]
        helper.make_node("Unsqueeze", ["r", "ax"], ["r1"]),                             # [N, 1, 6]
        helper.make_node("Add", ["mv", "r1"], ["y"]),
    ]
    inits = [numpy_helper.from_array(rng.standard_normal((5, 6)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "v"),
             numpy_helper.from_array(np.array([1]), "ax"), numpy_helper.from_array(np.array(1), "one"),
             numpy_helper.from_array(np.array([2] if opset >= 18 else [1, 1, 2], np.float32), "scales")]
    model = _graph_model(nodes, [_vi("x", ["N", 4, 5])], [_vi("y", ["N", 1, 6])], inits, opset)
    onnx.checker.check_model(model, full_check=True)
    legal, applied = legalize(model)
    assert sorted(line.split()[0] for line in applied) == ["CumSum", "ReduceMax", "ReduceMin", "Resize", "Split"]
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    (expected,) = run_onnx(model, {"x": x})
    (actual,) = run_onnx(legal, {"x": x})
    assert rel_err(actual, expected) < TOL
    grads = _train_step(legal, ["w", "v"], x, np.zeros_like(expected), str(tmp_path))
    assert all(np.isfinite(g).all() and np.abs(g).sum() > 0 for g in grads.values())


def _expect_error(node, inputs, inits=(), opset=17, match=""):
    model = _graph_model([node], inputs, [_vi(node.output[0], None)], inits, opset)
    with pytest.raises(UntrainableOpError, match=match) as info:
        legalize(model)
    assert isinstance(info.value, NotFusibleError)
    assert f"'{node.name}'" in str(info.value) and node.op_type in str(info.value) and "To fix this" in str(info.value)


def test_einsum_diagonal_is_refused():
    _expect_error(helper.make_node("Einsum", ["x"], ["y"], name="diag", equation="bii->bi"), [_vi("x", ["N", 3, 3])],
                  match="repeats index 'i'")


def test_resize_cubic_is_refused():
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    _expect_error(helper.make_node("Resize", ["x", "", "scales"], ["y"], name="up", mode="cubic"),
                  [_vi("x", ["N", 2, 3, 3])], [scales], match="mode is 'cubic'")


def test_linear_resize_of_a_symbolic_axis_is_refused():
    scales = numpy_helper.from_array(np.array([1, 1, 2], np.float32), "scales")
    _expect_error(helper.make_node("Resize", ["x", "", "scales"], ["y"], name="up", mode="linear"),
                  [_vi("x", ["N", 2, "L"])], [scales], match="static length")


def test_cumsum_along_a_symbolic_axis_is_refused():
    axis = numpy_helper.from_array(np.array(0), "axis")
    _expect_error(helper.make_node("CumSum", ["x", "axis"], ["y"], name="cs"), [_vi("x", ["N", 4])], [axis],
                  match="dim 0 of 'x' is N")


def _n(op, inputs, output, **attrs):
    return helper.make_node(op, inputs, [output], **attrs)


_BIG = int(np.iinfo(np.int64).max)
# name: (nodes after h = x @ w [N, T, 3] and ht = h^T [N, 3, T], output rank); x is [N, T, 4], T symbolic
SYMBOLIC = {
    "einsum_two_unknown_groups": ([_n("Einsum", ["h", "h"], "z", equation="ntc,nsd->tcsd")], 4),
    "nearest_x2_symbolic_axis": ([_n("Resize", ["h", "", "scales"], "z", mode="nearest",
                                     coordinate_transformation_mode="asymmetric", nearest_mode="floor")], 3),
    "flip_symbolic_last_axis": ([_n("Slice", ["ht", "minus1", "minus_big", "minus1", "minus1"], "z")], 3),
    "reducemax_symbolic_axis": ([_n("ReduceMax", ["h"], "z", axes=[1], keepdims=1)], 3),
    "depth_to_space_symbolic_hw": ([_n("Concat", ["ht", "ht", "ht", "ht"], "h12", axis=1),     # [N, 12, T]
                                    _n("Unsqueeze", ["h12", "three"], "col"),                   # [N, 12, T, 1]
                                    _n("Transpose", ["col"], "row", perm=[0, 1, 3, 2]),         # [N, 12, 1, T]
                                    _n("MatMul", ["col", "row"], "h4"),                         # [N, 12, T, T]
                                    _n("DepthToSpace", ["h4"], "z", blocksize=2, mode="CRD")], 4),
    "conv_transpose_symbolic_length": ([_n("ConvTranspose", ["ht", "ct_w"], "z", strides=[2], pads=[1, 0],
                                           output_padding=[1])], 3),
}


@pytest.mark.parametrize("case", list(SYMBOLIC))
def test_symbolic_dims_beyond_the_batch(tmp_path, case):
    """Rewrites that need no static size work when dims other than the batch are symbolic too: the legalized graph
    computes what the original computes (ORT forward, two sizes of T) and trains."""
    tail, out_rank = SYMBOLIC[case]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((3, 2, 3)).astype(np.float32), "ct_w"),
             numpy_helper.from_array(np.array([1, 2, 2], np.float32), "scales"),
             numpy_helper.from_array(np.array([-1]), "minus1"), numpy_helper.from_array(np.array([-_BIG]), "minus_big"),
             numpy_helper.from_array(np.array([3]), "three")]
    nodes = [_n("MatMul", ["x", "w"], "h"), _n("Transpose", ["h"], "ht", perm=[0, 2, 1])] + tail
    out = _vi("z", [f"z{k}" for k in range(out_rank)])
    model = _graph_model(nodes, [_vi("x", ["N", "T", 4])], [out], inits, opset=17)
    onnx.checker.check_model(model, full_check=True)
    legal, applied = legalize(model)
    assert applied
    onnx.checker.check_model(legal, full_check=True)
    for t in (4, 6):
        x = rng.standard_normal((2, t, 4)).astype(np.float32)
        (expected,) = run_onnx(model, {"x": x})
        (actual,) = run_onnx(legal, {"x": x})
        assert actual.shape == expected.shape
        assert rel_err(actual, expected) < TOL
    params = ["w", "ct_w"] if "ct_w" in {i for n in nodes for i in n.input} else ["w"]
    grads = _train_step(legal, params, x, np.zeros_like(expected), str(tmp_path))
    assert all(np.isfinite(g).all() and np.abs(g).sum() > 0 for g in grads.values())


# --- ScatterElements max / min -------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduce", ["amax", "amin"])
def test_scatter_reduce_extremum_gradient_is_torchs(tmp_path, reduce):
    """scatter_reduce amax / amin (message passing's max aggregation): ORT 1.19 trains the node, but gives every
    update the output's gradient at its index, winner or not; legalized, each gradient is torch's (to the elements
    equal to the result, ties split). The raw node's gradient is wrong, which is why the rewrite exists."""
    from onnxfuse.core.source import load_source

    dst = torch.tensor([1, 0, 1, 3, 3, 2, 1])

    class Messages(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.post = lin(4, 4), lin(4, 2)

        def forward(self, x):  # x [N, 5 nodes, 4]
            m = torch.tanh(self.pre(x[:, [0, 1, 2, 3, 4, 0, 2]]))
            agg = torch.zeros_like(x).scatter_reduce(1, dst.view(1, -1, 1).expand(x.shape[0], -1, 4), m,
                                                     reduce=reduce, include_self=True)
            return self.post(x + agg)

    torch.manual_seed(3)
    module = Messages()
    path = os.path.join(tmp_path, "model.onnx")
    export_module(module, path, example_inputs=(torch.randn(2, 5, 4),), opset=18)
    model = load_source(path).model  # the export's If on a static condition resolved
    legal, applied = legalize(model)
    assert any("ScatterElements" in line for line in applied), applied
    params = [n for n, _ in module.named_parameters()]
    x = torch.randn(3, 5, 4)
    out = module(x)
    target = torch.randn_like(out)
    module.zero_grad()
    F.mse_loss(out, target).backward()
    want = {n: p.grad.numpy() for n, p in module.named_parameters()}
    got = _train_step(legal, params, x.numpy(), target.detach().numpy(), os.path.join(tmp_path, "legal"))
    assert all(rel_err(got[n], want[n]) < TOL for n in params), {n: rel_err(got[n], want[n]) for n in params}
    raw = _train_step(model, params, x.numpy(), target.detach().numpy(), os.path.join(tmp_path, "raw"))
    assert rel_err(raw["pre.weight"], want["pre.weight"]) > 10 * TOL
