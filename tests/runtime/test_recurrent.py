"""Recurrent nets (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``; uni- and bidirectional, batch_first, initial states): each
fused at B = 1, 2, 3 in its default form (``core/rules/recurrent.py``: LSTM per-model, GRU and RNN batched) and every
other form, trained on both runtimes, against torch.optim on each model alone, with the differential fuzzer's checks
and bounds (``fuzz/harness.py``: the forward, 3 SGD-momentum steps, 3 AdamW steps); and hand-built ONNX nodes in
the forms torch never exports (layout 1, weights as initializers, sequence_lens, every output) against each model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import helper as h
from onnx import numpy_helper as nh

from tests.conftest import graph_model, rand_init, rel_err, run_onnx, vinfo
from fuzz.grammar import Rendered
from fuzz.harness import check_source
from onnxfuse import fuse_models
from onnxfuse.core.rules import RULES

HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n"

NETS = {  # name: (layer, how the classifier reads it)
    "lstm": ("nn.LSTM(8, 12, batch_first=True)", "y, (h, c) = self.rnn(x)\n        z = h[-1]"),
    "lstm-bi": ("nn.LSTM(8, 12, batch_first=True, bidirectional=True)",
                "y, _ = self.rnn(x)\n        z = y[:, -1]"),
    "gru": ("nn.GRU(8, 12, batch_first=True)", "y, h = self.rnn(x)\n        z = h[-1]"),
    "gru-bi": ("nn.GRU(8, 12, batch_first=True, bidirectional=True)", "y, h = self.rnn(x)\n        z = y.mean(1)"),
    "rnn": ("nn.RNN(8, 12, batch_first=True)", "y, h = self.rnn(x)\n        z = h[-1]"),
    "rnn-relu-bi": ("nn.RNN(8, 12, nonlinearity='relu', batch_first=True, bidirectional=True)",
                    "y, h = self.rnn(x)\n        z = y[:, 0]"),
    "lstm-seq2seq": ("nn.LSTM(8, 12)", "y, _ = self.rnn(x.transpose(0, 1))\n        z = y.transpose(0, 1)"),
    # two layers (the second reads a per-model sequence) from a per-model initial state computed from x
    "gru-2-layers-h0": ("nn.GRU(8, 12, num_layers=2, batch_first=True)\n        self.h0 = nn.Linear(8, 12)",
                        "h0 = torch.tanh(self.h0(x.mean(1))).expand(2, -1, -1).contiguous()\n"
                        "        y, h = self.rnn(x, h0)\n        z = h[-1]"),
}


def rendered(name: str) -> Rendered:
    layer, read = NETS[name]
    width = 24 if "bi" in name else 12
    seq = name.endswith("seq2seq")
    source = HEADER + f"""class FuzzNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = {layer}
        self.head = nn.Linear({width}, 5)

    def forward(self, x):
        {read}
        return self.head(z)
"""
    if seq:  # one class per time step: [N, T, 5], classes on the last axis
        return Rendered(source, (6, 8), "float", (6, 5), "cross-entropy", -1, 5)
    return Rendered(source, (6, 8), "float", (5,), "cross-entropy", 1, 5)


@pytest.mark.parametrize("name", list(NETS))
def test_a_recurrent_classifier_trains_as_torch_trains_it_alone(name, runtime):
    out = check_source(rendered(name), seed=5, runtime=runtime)
    assert out.status in ("pass", "sensitive"), (name, runtime, out.B, out.stage, out.message)
    assert out.fused_fraction == 1.0, (name, out.fused_fraction)


@pytest.mark.parametrize("precision,name", [("bf16", "gru-bi"), ("bf16", "gru-2-layers-h0"), ("fp16", "rnn")])
def test_the_batched_form_trains_as_torch_autocast_trains_each_model_alone(precision, name):
    """The batched kernel under torch.autocast computes what ``nn.GRU`` / ``nn.RNN`` compute alone under it (the
    fuzzer's ratio bounds): the input product of a strided sequence rounded as torch's linear rounds it, the
    weights cast once as autocast's cache casts a module's."""
    out = check_source(rendered(name), seed=5, runtime="torch", precision=precision)
    assert out.status in ("pass", "sensitive"), (precision, name, out.B, out.stage, out.message)


def _forms(op: str) -> tuple[str, ...]:
    """The forms of ``op``'s rule, its default first."""
    return RULES[("", op)].forms


def _op(name: str) -> str:
    return NETS[name][0].split("(")[0].removeprefix("nn.")


# each form that is not its op's default, once on both runtimes (the rest of the product: slow)
OTHER_FORMS = [("batched", "lstm-bi"), ("per-model", "gru-bi"), ("block-diagonal", "gru-2-layers-h0"),
               ("block-diagonal", "rnn-relu-bi")]
ALL_FORMS = [(form, name) for name in NETS for form in _forms(_op(name))]


@pytest.mark.parametrize("form,name", [
    pytest.param(f, n, marks=[] if (f, n) in OTHER_FORMS else [pytest.mark.slow])
    for f, n in ALL_FORMS if f != _forms(_op(n))[0]])
def test_every_form_trains_as_torch_trains_each_model_alone(form, name, runtime):
    out = check_source(rendered(name), seed=5, runtime=runtime, strategy=form, Bs=(2, 3))
    assert out.status in ("pass", "sensitive"), (form, name, runtime, out.B, out.stage, out.message)
    assert out.fused_fraction == 1.0, (form, name, out.fused_fraction)


# ---- ONNX nodes as torch does not export them: layout 1, weights as initializers, no bias, sequence_lens, every output
def _node_models(op: str, direction: str, layout: int, B: int, bias: bool = True, T=5, N=3, I=4, H=6):
    G, D = {"LSTM": 4, "GRU": 3, "RNN": 1}[op], 2 if direction == "bidirectional" else 1
    x_shape = [N, T, I] if layout else [T, N, I]
    state = [N, D, H] if layout else [D, N, H]
    outs = ["y", "y_h"] + (["y_c"] if op == "LSTM" else [])
    ins = ["x", "w", "r", "b" if bias else "", "lens", "h0"] + (["c0"] if op == "LSTM" else [])
    y_shape = [N, T, D, H] if layout else [T, D, N, H]
    attrs = {"linear_before_reset": 1} if op == "GRU" else {}
    models = []
    for b in range(B):
        r = np.random.default_rng(10 + b)
        inits = [rand_init(r, "w", [D, G * H, I]), rand_init(r, "r", [D, G * H, H]),
                 nh.from_array(np.full([N], T, np.int32), "lens"), rand_init(r, "h0", state)]
        inits += [rand_init(r, "b", [D, 2 * G * H])] if bias else []
        inits += [rand_init(r, "c0", state)] if op == "LSTM" else []
        node = h.make_node(op, ins, outs, hidden_size=H, direction=direction, layout=layout, **attrs)
        models.append(graph_model([node], [vinfo("x", x_shape)],
                                  [vinfo("y", y_shape)] + [vinfo(o, state) for o in outs[1:]], inits))
    return models, x_shape


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction,layout,bias", [("forward", 1, True), ("reverse", 0, False),
                                                   ("bidirectional", 1, True)])
def test_each_form_of_a_node_computes_and_differentiates_as_each_model(op, direction, layout, bias):
    """Each form's fused node on the torch runtime against each model's node run alone by the torch runtime
    (torch's own ``_VF`` kernels): every output, and the gradient of every weight and of the per-model input."""
    from onnxfuse.runtime.torch.program import OnnxModule

    B = 3
    models, x_shape = _node_models(op, direction, layout, B, bias)
    x = torch.randn(B, *x_shape, generator=torch.Generator().manual_seed(0))
    outs_alone, grads_alone = [], []
    for b, m in enumerate(models):
        mod = OnnxModule(m)
        xb = x[b].clone().requires_grad_()
        ys = mod(x=xb)
        sum(((y * (k + 1)).sin().sum() for k, y in enumerate(ys))).backward()
        outs_alone.append([y.detach() for y in ys])
        grads_alone.append({n: p.grad for n, p in mod.onnx_state().items()} | {"x": xb.grad})
    layouts = set()
    for form in _forms(op):
        fa = fuse_models(models, per_model_inputs=["x"], strategy=form)
        assert set(fa.spec.summary["forms"].values()) == {form}
        # array.json, checkpoints and split read weights by their slots: every form packs them the same way (the
        # block-diagonal weights are computed from them in the graph: their zero blocks are no parameters)
        layouts.add(repr(sorted((n, w.slot, w.orig_shape) for n, w in fa.spec.weights.items())))
        mod = OnnxModule.from_array(fa.model, fa.spec)
        xf = x.clone().requires_grad_()
        ys = mod(x=xf)
        sum(((y * (k + 1)).sin().sum() for k, y in enumerate(ys))).backward()
        grads = {n: p.grad for n, p in mod.onnx_state().items()} | {"x": xf.grad}
        for b in range(B):
            for k, (y, ref) in enumerate(zip(ys, outs_alone[b])):
                assert rel_err(y[b].detach().numpy(), ref.numpy()) < 1e-5, (form, b, k)
            for n, ref in grads_alone[b].items():
                assert rel_err(grads[n][b].numpy(), ref.numpy()) < 1e-5, (form, b, n)
    assert len(layouts) == 1


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_each_form_runs_in_onnx_runtime_as_each_model(op):
    """The fused graph in every form as plain ONNX (``standard_onnx``: the batched node written as B standard
    nodes) run by an onnxruntime InferenceSession, against each model run by it alone (ORT runs layout 0 only)."""
    from onnxfuse.core.standard import standard_onnx

    B = 3
    models, x_shape = _node_models(op, "bidirectional", 0, B)
    x = np.random.default_rng(0).standard_normal([B, *x_shape]).astype(np.float32)
    for form in _forms(op):
        fa = fuse_models(models, per_model_inputs=["x"], strategy=form)
        fused = run_onnx(standard_onnx(fa.model), {"x": x})
        for b, m in enumerate(models):
            for k, ref in enumerate(run_onnx(m, {"x": x[b]})):
                assert rel_err(fused[k][b], ref) < 1e-5, (form, b, k)


def test_the_auto_strategy_measures_a_recurrent_node(tmp_path, monkeypatch):
    """A recurrent node's batch is its second axis (X [T, N, I], transposed from the graph input [N, T, I] as torch
    exports ``batch_first``): ``--strategy auto`` sets it and measures every form instead of leaving the node in its
    default form unmeasured."""
    from onnxfuse.measure.forms import measured_strategy

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))

    def build(r):
        nodes = [h.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
                 h.make_node("GRU", ["xt", "w", "r", "b"], ["y"], name="gru", hidden_size=6, linear_before_reset=1)]
        return graph_model(nodes, [vinfo("x", ["N", 5, 4])], [vinfo("y", [5, 1, "N", 6])],
                           [rand_init(r, "w", [1, 18, 4]), rand_init(r, "r", [1, 18, 6]), rand_init(r, "b", [1, 36])])

    said = []
    auto = measured_strategy("torch", "cpu", batch=4, threads=1, progress=said.append)
    fa = fuse_models([build(np.random.default_rng(b)) for b in range(2)], strategy=auto)
    assert len(said) == 1 and "measured" in said[0], said
    assert set(auto.costs["gru"]) == set(_forms("GRU")) and fa.spec.summary["forms"]["gru"] in _forms("GRU")


def test_placement_places_the_batched_form_as_standard_onnx():
    """``onnxfuse place`` profiles and runs a graph in onnxruntime sessions: a fused array's batched node (the
    torch runtime's own op) is placed as the standard nodes ``standard_onnx`` writes for it."""
    from onnxfuse.placement.graph import build_graph

    models, _ = _node_models("GRU", "forward", 0, 2)
    fa = fuse_models(models, per_model_inputs=["x"])
    assert set(fa.spec.summary["forms"].values()) == {"batched"}
    graph = build_graph(fa.model)
    assert "GRU" in graph.op_types and "BatchedGRU" not in graph.op_types
