"""Trainability legalization: every rewrite, on a real torch export between trainable layers, gives torch's forward
and torch's parameter gradients after one onnxruntime-training step; without it, ORT 1.19 cannot train the model."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.errors import NotFusibleError, UntrainableOpError
from onnxfuse.exporters import export_module
from onnxfuse.legalize import legalize

from .conftest import rel_err, run_onnx

TOL = 1e-5


@contextlib.contextmanager
def _quiet_native_stderr():
    """ORT's gradient builder logs INFO lines to the C++ stderr whatever the Python severity: swallow them."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _train_step(model: onnx.ModelProto, params: list[str], x: np.ndarray, target: np.ndarray, folder: str):
    """generate_artifacts with MSE loss, one Module train step; returns {param: grad}."""
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module

    os.makedirs(folder, exist_ok=True)
    with _quiet_native_stderr():
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


def check_legalized_training(module: nn.Module, shape: tuple, tmp_path, opset: int = 17, fails_without: bool = True,
                             edit=None, scale: float = 1.0, expect=None) -> list[str]:
    """Export (batch 2), legalize, train one step on batch 3 with ORT; compare output and every parameter gradient
    with torch autograd on the same MSE loss. ``edit`` changes the exported ONNX model in place (to reach ONNX
    attributes torch never sets); ``module`` must then compute the edited semantics in torch."""
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
    if fails_without:
        with pytest.raises(Exception):
            _train_step(model, params, x_np, target_np, os.path.join(tmp_path, "raw"))
    return applied


def lin(i, o):
    return nn.Linear(i, o)


# --- 1. LayerNormalization -------------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [17, 20])
def test_layernorm_gets_statistics_outputs(tmp_path, opset):
    torch.manual_seed(1)
    m = Around(lin(6, 8), lambda s, h: s.norm(h), lin(8, 4), norm=nn.LayerNorm(8))
    applied = check_legalized_training(m, (3, 5, 6), tmp_path, opset=opset)
    assert applied == ["LayerNormalization '/norm/LayerNormalization' -> LayerNormalization with 3 outputs (was 1)"]


# --- 2. ReduceMax / ReduceMin ----------------------------------------------------------------------------------

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
    check_legalized_training(m, shape, tmp_path, opset=opset, expect="GatherElements")


# --- 3. HardSwish / HardSigmoid --------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [14, 20])
@pytest.mark.parametrize("act", ["hardswish", "hardsigmoid"])
def test_hard_activations(tmp_path, act, opset):
    torch.manual_seed(3)
    layer = nn.Hardswish() if act == "hardswish" else nn.Hardsigmoid()
    m = Around(lin(6, 16), lambda s, h: s.act(h), lin(16, 4), act=layer)
    # inputs of scale 4 put pre-activations on every piece (< -3, between, > 3)
    check_legalized_training(m, (8, 6), tmp_path, opset=opset, scale=4.0, expect="Clip")


# --- 4. Einsum -------------------------------------------------------------------------------------------------

EINSUMS = {
    "bij,bjk->bik": lambda s, h: torch.einsum("bij,bjk->bik", h, s.other(h).transpose(1, 2)),
    "bij->bj": lambda s, h: torch.einsum("bij->bj", h),
    "bij,jk->bik (parameter operand)": lambda s, h: torch.einsum("bij,jk->bik", h, s.w),
    "bij,bkj (implicit)": lambda s, h: torch.einsum("bij,bkj", h, s.other(h)).unsqueeze(0).expand(3, -1, -1),
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
    check_legalized_training(m, (3, 4, 6), tmp_path, expect="Einsum")


# --- 5. CumSum -------------------------------------------------------------------------------------------------


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


class _ExportFlag(Around):
    exporting = True

    def forward(self, x):
        type(self).exporting = torch.onnx.is_in_onnx_export()
        return super().forward(x)


@pytest.mark.parametrize("variant", list(CUMSUMS))
def test_cumsum(tmp_path, variant):
    fn, shape, attrs = CUMSUMS[variant]
    torch.manual_seed(5)
    m = _ExportFlag(lin(shape[-1], 5), fn, lin(5, 3))
    check_legalized_training(m, shape[:-1] + (shape[-1],), tmp_path,
                             edit=_set_cumsum_attrs(**attrs) if attrs else None, expect="MatMul")


# --- 6. ConvTranspose ------------------------------------------------------------------------------------------

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
    check_legalized_training(m, shape, tmp_path, expect="Conv")


# --- 7. Resize -------------------------------------------------------------------------------------------------

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
    check_legalized_training(m, shape, tmp_path, opset=opset, expect="Resize")


# --- 8. Split with an unused output ----------------------------------------------------------------------------

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
    check_legalized_training(m, shape, tmp_path, opset=opset, expect="Split")


# --- nodes that need nothing, and forms that cannot be legalized -----------------------------------------------


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
    red = (helper.make_node("ReduceMax", ["h", "ax"], ["r"], keepdims=0) if axes_input
           else helper.make_node("ReduceMax", ["h"], ["r"], axes=[1], keepdims=0))
    split = (helper.make_node("Split", ["h"], ["s0", "s1", "s2"], axis=2, num_outputs=3) if opset >= 18
             else helper.make_node("Split", ["h"], ["s0", "s1", "s2"], axis=2))
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),                       # [N, 4, 6]
        red,                                                                  # [N, 6]
        split,                                                                # s1 [N, 4, 2]; s0, s2 unused
        helper.make_node("CumSum", ["s1", "one"], ["c"], reverse=1),          # [N, 4, 2]
        helper.make_node("Resize", ["c", "", "scales"], ["u"], mode="linear",
                         coordinate_transformation_mode="half_pixel"),       # [N, 4, 4]
        helper.make_node("ReduceMin", ["u", "ax"] if axes_input else ["u"], ["m"],
                         **({} if axes_input else {"axes": [1]})),            # [N, 1, 4]
        helper.make_node("Unsqueeze", ["r", "zero"], ["r3"]),                 # [1, N, 6]... broadcast below
        helper.make_node("ReduceSum", ["r3", "zero"], ["rs"], keepdims=0),    # [N, 6]
        helper.make_node("MatMul", ["m", "v"], ["mv"]),                       # [N, 1, 6]
        helper.make_node("Add", ["mv", "rs1"], ["y"]),
        helper.make_node("Unsqueeze", ["rs", "one1"], ["rs1"]),               # [N, 1, 6]
    ]
    nodes = nodes[:-2] + [nodes[-1], nodes[-2]]
    inits = [numpy_helper.from_array(rng.standard_normal((5, 6)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "v"),
             numpy_helper.from_array(np.array([1]), "ax"), numpy_helper.from_array(np.array(1), "one"),
             numpy_helper.from_array(np.array([0]), "zero"), numpy_helper.from_array(np.array([1]), "one1"),
             numpy_helper.from_array(np.array([1, 1, 2], np.float32), "scales")]
    model = _graph_model(nodes, [_vi("x", ["N", 4, 5])], [_vi("y", None)], inits, opset)
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
