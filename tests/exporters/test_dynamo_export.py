"""Files from torch's dynamo exporter (``torch.onnx.export(..., dynamo=True)``, torch's default since 2.9, opset 20;
needs onnxscript) as a user brings them, without onnxfuse's metadata: the zoo fuses completely and computes each
model's forward; exported with ``optimize=False``, the zoo's models without BatchNorm and a
``nn.TransformerEncoderLayer`` classifier train like torch on the default runtime. What that exporter loses for
training is said in one warning each: a training-mode BatchNorm (written as an inference-mode one, and folded into
the Conv before it by the default optimizer), parameters its optimizer merged or dropped. Its record (the exported
program's graph signature, each node's torch.fx node) tells the module's buffers (not trained) and the constants of
the forward's code (not weights) from its parameters."""
from __future__ import annotations

import contextlib
import copy
import io
import warnings

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from tests.conftest import check_fused, cli, rel_err, run_onnx, vinfo
from onnxfuse import fuse_models
from onnxfuse.exporters import export_module
from onnxfuse.exporters.torch_export import lost_batchnorm_warning
from onnxfuse.exporters.zoo import ZOO, CNNBN
from tests.exporters.test_zoo import assert_matches_torch, run_zoo, zoo_input, zoo_modules

try:
    import onnxscript  # noqa: F401  torch's dynamo exporter needs it
    HAVE_ONNXSCRIPT = True
except ImportError:
    HAVE_ONNXSCRIPT = False
exports = pytest.mark.skipif(not HAVE_ONNXSCRIPT, reason="torch's dynamo exporter needs onnxscript (pip install .[dev])")


def dynamo_export(module: nn.Module, x: torch.Tensor, path=None, optimize: bool = True) -> onnx.ModelProto:
    """``module`` exported as a user of torch's default exporter does, in training mode, batch axis dynamic
    (``optimize``: torch.onnx.export's, onnxscript's graph optimizer after the export)."""
    module = copy.deepcopy(module).train()  # the export runs a training forward (BatchNorm statistics move)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (x,), dynamo=True, training=torch.onnx.TrainingMode.TRAINING,
                                    optimize=optimize, input_names=["input"], output_names=["output"],
                                    dynamic_shapes=({0: torch.export.Dim("N")},))
    proto = program.model_proto
    if path is not None:
        onnx.save(proto, str(path))
    return proto


def _has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def _fuse_saying(models):
    """fuse_models, and the warnings it gives (one line each; "run once per model" fails the test)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fa = fuse_models(models)
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "run once per model" in m], said
    assert not [m for m in said if "\n" in m], said
    return fa, said


def _lost_batchnorm(said) -> bool:
    return any("training-mode BatchNorm" in m for m in said)


def _rewritten(said) -> bool:
    return any("optimizer rewrote parameters" in m for m in said)


# every zoo model exports with the dynamo exporter (torch 2.13, onnxscript 0.7.2). The default suite holds one model
# with BatchNorm (folded by the default optimizer) and one transformer (every Reshape with allowzero=1, Clip-free),
# the whole zoo both ways `make test-all`
FAST = {("dcgan_discriminator", True), ("transformer_lm", False)}
WITHOUT_BATCHNORM = ("lenet", "transformer_lm", "bert_tiny", "vit_tiny")


@exports
@pytest.mark.parametrize("name, optimize", [
    pytest.param(name, optimize, id=f"{name}-{'optimized' if optimize else 'unoptimized'}",
                 marks=[] if (name, optimize) in FAST else [pytest.mark.slow])
    for name in ZOO for optimize in (True, False)])
def test_zoo_exported_by_dynamo_fuses_completely_and_computes_each_model(name, optimize, tmp_path):
    B = 2
    mods = zoo_modules(name, B)
    paths = [str(tmp_path / f"model_{b}.onnx") for b in range(B)]
    for m, path in zip(mods, paths):
        dynamo_export(m, zoo_input(name, 8), path, optimize=optimize)
    fa, said = _fuse_saying(paths)
    assert fa.spec.summary["fused_fraction"] == 1.0, fa.spec.summary["unfused"]
    # a BatchNorm is exported as an inference-mode one: what each file computes is the model in eval mode
    bn = _has_batchnorm(mods[0])
    assert _lost_batchnorm(said) == bn, said
    if not optimize:
        assert not _rewritten(said), said
    x = zoo_input(name, 5, seed=2)
    fused = run_onnx(fa.model, {"input": x.numpy()})[0]
    for b, m in enumerate(mods):
        alone = run_onnx(onnx.load(paths[b]), {"input": x.numpy()})[0]
        with torch.no_grad():
            ref = (m.eval() if bn else m.train())(x).numpy()
        assert rel_err(fused[b], alone) < 1e-5, (name, b)
        assert rel_err(fused[b], ref) < 1e-4, (name, b)


def _dynamo_zoo(name, mods, folder) -> list[str]:
    """test_zoo's export_zoo with the dynamo exporter, its optimizer off."""
    paths = [str(folder / f"model_{b}.onnx") for b in range(len(mods))]
    for m, path in zip(mods, paths):
        dynamo_export(m, zoo_input(name, 8), path, optimize=False)
    return paths


@exports
@pytest.mark.parametrize("name, kind", [
    pytest.param(name, kind, marks=[] if (name, kind) == ("transformer_lm", "adamw") else [pytest.mark.slow])
    for name in WITHOUT_BATCHNORM for kind in ("adamw", "sgd")])
def test_zoo_exported_by_dynamo_trains_like_torch(name, kind, tmp_path, monkeypatch):
    """test_zoo's training check (B = 3, per-model learning rates, every state_dict tensor) on files from the dynamo
    exporter with ``optimize=False``: every parameter is an initializer named by its state_dict key, and the causal
    mask (a buffer) is not trained. The torch runtime; the default suite runs one model."""
    from tests.exporters import test_zoo

    monkeypatch.setattr(test_zoo, "export_zoo", _dynamo_zoo)
    assert_matches_torch(run_zoo(name, kind, 3, tmp_path, "torch"), tmp_path)


class EncoderClassifier(nn.Module):
    """A CLS token before [N, T, D] features, one ``nn.TransformerEncoderLayer`` (batch first, no dropout), the CLS
    position's features to ``classes`` logits."""

    def __init__(self, dim: int = 16, heads: int = 2, classes: int = 3):
        super().__init__()
        self.cls = nn.Parameter(0.1 * torch.randn(1, 1, dim))
        self.encoder = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        return self.head(self.encoder(h)[:, 0])


@exports
def test_transformer_encoder_classifier_exported_by_dynamo_trains_like_torch(tmp_path):
    """B = 3 classifiers (``optimize=False``) with per-model learning rates, 5 AdamW steps on the torch runtime: each
    model's losses and its trained weights (split, put back into its own file, run by ONNX Runtime) equal torch.optim
    training it alone."""
    from onnxfuse.core.split import split_weights
    from onnxfuse.runtime.trainers import make_trainer
    from onnxfuse.recipe.optim import make_optimizer

    B, steps, T, D = 3, 5, 6, 16
    mods = []
    for b in range(B):
        torch.manual_seed(b)
        mods.append(EncoderClassifier(D))
    protos = [dynamo_export(m, torch.randn(4, T, D), optimize=False) for m in mods]
    fa, said = _fuse_saying(protos)
    assert fa.spec.summary["fused_fraction"] == 1.0, fa.spec.summary["unfused"]
    assert not said, said

    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, T, D, generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in range(steps)]
    lrs, extra = [1e-3, 3e-3, 5e-4], {"weight_decay": 1e-2, "eps": 1e-6}
    trainer = make_trainer("torch", fa.model, fa.spec, "cross-entropy", make_optimizer("adamw", B, lr=lrs, **extra),
                           workdir=str(tmp_path / "art"))
    fused_losses = np.array([trainer.step({"input": x.numpy(), "labels": y.numpy()}) for x, y in batches])
    states = split_weights(fa.spec, trainer.weights(), steps=steps)

    probe = torch.randn(5, T, D, generator=gen)
    for b, m in enumerate(mods):
        assert set(states[b]) >= set(dict(m.named_parameters())), b  # every parameter, by its state_dict key
        opt = torch.optim.AdamW(m.parameters(), lr=lrs[b], **extra)
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m.train()(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        np.testing.assert_allclose(fused_losses[:, b], losses, rtol=1e-5, atol=1e-6)
        for key, value in m.state_dict().items():
            got, ref = np.asarray(states[b][key]), value.numpy()
            if key == "encoder.self_attn.in_proj_bias":  # the key bias's true gradient is 0: Adam steps on noise
                got, ref = np.delete(got, np.s_[D:2 * D]), np.delete(ref, np.s_[D:2 * D])
            assert rel_err(got, ref) < 1e-4, (b, key)
        trained = onnx.ModelProto()
        trained.CopyFrom(protos[b])
        for init in trained.graph.initializer:
            if init.name in states[b]:
                init.CopyFrom(onnx.numpy_helper.from_array(np.asarray(states[b][init.name]), init.name))
        with torch.no_grad():
            ref = m.train()(probe).numpy()
        assert rel_err(run_onnx(protos[b], {"input": probe.numpy()})[0], ref) > 1e-3  # training moved the outputs
        assert rel_err(run_onnx(trained, {"input": probe.numpy()})[0], ref) < 1e-4, b


@exports
def test_parameters_the_default_optimizer_merged_or_dropped_are_warned_about():
    """With ``optimize=True`` (torch's default) onnxscript's optimizer merges initializers of equal value (a fresh
    model's two LayerNorm weights, all ones) and drops all-zero biases: the array fuses and computes the forward,
    and one warning names what it would not train as torch does, and the fix."""
    mods = []
    for b in range(2):
        torch.manual_seed(b)
        mods.append(EncoderClassifier())
    fa, said = _fuse_saying([dynamo_export(m, torch.randn(4, 6, 16)) for m in mods])
    assert fa.spec.summary["fused_fraction"] == 1.0
    rewrote = [m for m in said if "optimizer rewrote parameters" in m]
    assert len(rewrote) == 1, said
    assert "encoder.norm2.weight" in rewrote[0] and "encoder.self_attn.out_proj.bias" in rewrote[0]
    assert "optimize=False" in rewrote[0]


class TiedLM(nn.Module):
    """An embedding whose table is also the output layer's weight (tied), a LayerNorm, and a learned 0-d
    temperature read twice."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight
        self.t = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.head(self.ln(self.emb(x))) * self.t + self.t


@exports
def test_tied_weights_are_not_taken_for_rewritten_parameters():
    """torch.export reads a tied table through one of its two names: the other name, read by no node, is no
    parameter the optimizer rewrote (nothing is warned about but the plain export's embedding lookup)."""
    mods = []
    for b in range(2):
        torch.manual_seed(b)
        mods.append(TiedLM())
    fa, said = _fuse_saying([dynamo_export(m, torch.randint(0, 20, (4, 5)), optimize=False) for m in mods])
    assert fa.spec.summary["fused_fraction"] == 1.0
    assert [m for m in said if "looked up" not in m] == [], said


@exports
@pytest.mark.parametrize("optimize", [True, False], ids=["optimized", "unoptimized"])
def test_lost_batchnorm_is_warned_about(optimize, tmp_path, capsys):
    """A file whose training-mode BatchNorm the dynamo exporter wrote as an inference-mode one (folded into the Conv
    before it by its optimizer) is warned about in one line naming the file and the fix; the same model exported by
    onnxfuse keeps a training-mode BatchNormalization, and nothing is said."""
    torch.manual_seed(0)
    m = CNNBN(in_ch=1, width=4)
    x = torch.randn(4, 1, 8, 8)
    paths = [tmp_path / f"model_{b}.onnx" for b in range(2)]
    for p in paths:
        dynamo_export(m, x, p, optimize=optimize)
    _, said = _fuse_saying([str(p) for p in paths])
    lost = [w for w in said if "BatchNorm" in w]
    assert len(lost) == 1, said
    assert lost[0].startswith("model_0.onnx: ") and "2 training-mode BatchNorm" in lost[0]
    assert "dynamo=False" in lost[0] and "onnxfuse export" in lost[0]
    code, _, err = cli(capsys, "fuse", *paths, "-o", tmp_path / "array")  # the command line: the same one line
    assert code == 0 and f"onnxfuse: warning: {lost[0]}\n" in err, err

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        proto = export_module(m, tmp_path / "kept.onnx", example_inputs=(x,))
        fuse_models([str(tmp_path / "kept.onnx")] * 2)
    assert any(n.op_type == "BatchNormalization" for n in proto.graph.node)


@exports
def test_a_module_whose_export_lost_its_batchnorm_is_warned_about(monkeypatch, tmp_path):
    """Where the module is known (``onnxfuse.fuse``, ``onnxfuse export``): BatchNorm layers that ran in the export
    but left no BatchNormalization in the graph are one warning. Seen here by making onnxfuse's export use the
    dynamo exporter (its optimizer folds them); with its own exporter nothing is said (the test above)."""
    real_export = torch.onnx.export

    def dynamo(*args, **kwargs):
        for key in ("do_constant_folding", "opset_version"):
            kwargs.pop(key, None)
        return real_export(*args, **{**kwargs, "dynamo": True})

    monkeypatch.setattr(torch.onnx, "export", dynamo)
    torch.manual_seed(0)
    m = CNNBN(in_ch=1, width=4)
    with pytest.warns(UserWarning, match=r"CNNBN: its training-mode forward runs BatchNorm layer\(s\) 'bn1', 'bn2'"):
        export_module(m, tmp_path / "m.onnx", example_inputs=(torch.randn(4, 1, 8, 8),))
    assert lost_batchnorm_warning(m, [], onnx.load(str(tmp_path / "m.onnx"))) is None  # no BatchNorm ran


# ---- the exporter's record, on a hand-built graph (no torch export): which initializers are weights, which trained

SIGNATURE = """
# inputs
p_fc_weight: PARAMETER target='fc.weight'
p_fc_bias: PARAMETER target='fc.bias'
b_shift: BUFFER target='shift' persistent=True
x: USER_INPUT

# outputs
add: USER_OUTPUT
"""


def _fx(node: onnx.NodeProto, line: str) -> onnx.NodeProto:
    node.metadata_props.add(key="pkg.torch.onnx.fx_node", value=line)
    return node


def _dynamo_like(r: np.random.Generator, record: bool = True) -> onnx.ModelProto:
    """Linear (W.T folded into ``val_1``) -> ReLU6 (Clip bounds as initializers) -> * 0.5 (an initializer) -> + a
    buffer, as the dynamo exporter writes ``relu6(fc(x)) * 0.5 + self.shift``; ``record``: with its metadata."""
    from onnx import helper as h, numpy_helper as nh

    call = "%{} : [num_users=1] = call_function[target=torch.ops.aten.{}.default](args = ({}), kwargs = {{}})"
    nodes = [_fx(h.make_node("MatMul", ["x", "val_1"], ["mm"]), call.format("linear", "linear",
                                                                           "%x, %p_fc_weight, %p_fc_bias")),
             _fx(h.make_node("Add", ["mm", "fc.bias"], ["linear"]), call.format("linear", "linear",
                                                                                "%x, %p_fc_weight, %p_fc_bias")),
             _fx(h.make_node("Clip", ["linear", "min_val_cast", "max_val_cast"], ["hardtanh"]),
                 call.format("hardtanh", "hardtanh", "%linear, 0.0, 6.0")),
             _fx(h.make_node("Mul", ["hardtanh", "val_2"], ["mul"]), call.format("mul", "mul", "%hardtanh, 0.5")),
             _fx(h.make_node("Add", ["mul", "shift"], ["add"]), call.format("add", "add", "%mul, %b_shift"))]
    f32 = np.float32
    inits = [nh.from_array(r.standard_normal((4, 3)).astype(f32), "val_1"),
             nh.from_array(r.standard_normal(3).astype(f32), "fc.bias"),
             nh.from_array(np.array(0.0, f32), "min_val_cast"), nh.from_array(np.array(6.0, f32), "max_val_cast"),
             nh.from_array(np.array(0.5, f32), "val_2"), nh.from_array(r.standard_normal(3).astype(f32), "shift")]
    graph = h.make_graph(nodes, "main_graph", [vinfo("x", ["N", 4])], [vinfo("add", ["N", 3])], inits)
    if record:
        graph.metadata_props.add(key="pkg.torch.export.ExportedProgram.graph_signature", value=SIGNATURE)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], producer_name="pytorch")
    model.ir_version = 10
    return model


@pytest.mark.parametrize("B", [1, 3])
def test_the_record_tells_parameters_buffers_and_constants(B, rng):
    """The folded W.T and the bias are trained; the buffer is per-model state, not trained; the Clip bounds and the
    scale stand for no parameter: constants, so ReLU6 fuses (per-model "weights" it could not) and nothing trains
    them."""
    fa = check_fused(_dynamo_like, B, {"x": rng.standard_normal((5, 4)).astype(np.float32)}, rng)
    assert fa.spec.summary["fused_fraction"] == 1.0, fa.spec.summary["unfused"]
    roles = {fw.sources[0]: fw.role for fw in fa.spec.weights.values()}
    assert roles == {"val_1": "param", "fc.bias": "param", "shift": "frozen"}, roles


def test_without_the_record_every_float_initializer_is_a_trained_weight():
    """The same graph without the exporter's metadata: nothing tells a constant from a weight, so every float
    initializer is trained (as for any plain export), and the Clip with per-model bounds runs per model."""
    models = [_dynamo_like(np.random.default_rng(b), record=False) for b in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fa = fuse_models(models)
    roles = {fw.sources[0]: fw.role for fw in fa.spec.weights.values()}
    assert set(roles) == {"val_1", "fc.bias", "shift", "min_val_cast", "max_val_cast", "val_2"}
    assert set(roles.values()) == {"param"}
