"""An array's ``fused.onnx`` is standard ONNX (issue 39): every array the tests build (the zoo, the recurrent forms,
the fuzz grammar's models, ``onnxfuse.fuse`` + ``arr.save``), saved to a folder, opens in an onnxruntime
``InferenceSession`` from the file and computes the array's own forward: the torch runtime's, of the graph the
folder gives back (``ArrayDir.load``: with the torch runtime's own ops where the array has them, from
``fused.own-ops.pb``, weights from ``fused.onnx`` under the same names)."""
from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper as h

from tests.conftest import fuzz_case, graph_model, rand_init, rel_err, vinfo
from onnxfuse import ArrayDir, InputFileError, fuse_models, save_array
from onnxfuse.core.standard import own_ops
from onnxfuse.core.rules import RULES
from onnxfuse.exporters import export_module
from onnxfuse.exporters.zoo import ZOO
from onnxfuse.runtime.torch.program import OnnxModule
from tests.runtime.test_recurrent import _node_models
from tests.exporters.test_zoo import export_zoo, zoo_input, zoo_modules

TOL = 1e-4  # ONNX Runtime's kernels against torch's: the zoo test's forward bound


def session_forward(array_dir, feeds: dict) -> list[np.ndarray]:
    """``ARRAY_DIR/fused.onnx`` run by onnxruntime from the file, as any ONNX tool would open it (optimizations
    off: ORT 1.19's Conv+BatchNorm fusion ignores training_mode, docs/limits.md)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(os.path.join(array_dir, "fused.onnx"), so, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def check_folder(array_dir, fused: onnx.ModelProto | None, feeds: dict) -> None:
    """The folder's fused.onnx opens in onnxruntime and equals the torch runtime's forward of the graph the folder
    gives back, which is ``fused`` as fusion made it (byte for byte: the same nodes, weights and names)."""
    model, spec = ArrayDir(array_dir).load()
    if fused is not None:
        assert model.SerializeToString() == fused.SerializeToString()
    assert os.path.exists(ArrayDir(array_dir).own_ops_path) == bool(own_ops(model))
    got = session_forward(array_dir, feeds)
    with torch.no_grad():
        ref = OnnxModule.from_array(model, spec)(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert rel_err(g, r.numpy()) < TOL


def _fuse(paths, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fuse_models(paths, **kw)


# ------------------------------------------------------------------------------------------------------ the zoo
ZOO_FAST = ("lenet", "transformer_lm")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in ZOO_FAST else [pytest.mark.slow]) for n in ZOO])
def test_a_zoo_array_opens_in_onnx_runtime(name, tmp_path):
    paths = export_zoo(name, zoo_modules(name, 2), tmp_path)
    fa = _fuse(paths)
    save_array(fa, tmp_path / "array")
    check_folder(tmp_path / "array", fa.model, {"input": zoo_input(name, 3, seed=2).numpy()})


# --------------------------------------------------------------------------------------------- recurrent forms
def _forms(op: str) -> tuple[str, ...]:
    return RULES[("", op)].forms


class _Recurrent(torch.nn.Module):
    def __init__(self, op: str):
        super().__init__()
        self.rnn = getattr(torch.nn, op)(8, 12, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(24, 5)

    def forward(self, x):
        return self.head(self.rnn(x)[0].mean(1))


@pytest.mark.parametrize("op", ["GRU", "LSTM", "RNN"])
def test_every_recurrent_form_opens_in_onnx_runtime(op, tmp_path):
    """A bidirectional ``nn.GRU`` / ``nn.LSTM`` / ``nn.RNN`` classifier in each form: the batched one (the torch
    runtime's ``Batched<op>``) is B standard nodes in fused.onnx, or for the RNN its batched unroll."""
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))
    paths = []
    for b in range(2):
        torch.manual_seed(b)
        paths.append(str(tmp_path / f"model_{b}.onnx"))
        export_module(_Recurrent(op), paths[-1], example_inputs=(x,))
    for form in _forms(op):
        fa = _fuse(paths, strategy=form)
        assert set(fa.spec.summary["forms"].values()) == {form}
        save_array(fa, tmp_path / form)
        assert not own_ops(onnx.load(tmp_path / form / "fused.onnx"))
        check_folder(tmp_path / form, fa.model, {"input": x.numpy()})


@pytest.mark.parametrize("op", ["GRU", "LSTM", "RNN"])
def test_a_batched_node_with_every_input_opens_in_onnx_runtime(op, tmp_path):
    """Hand-built nodes as torch does not export them (initial states and sequence_lens as weights, every output) in
    the batched form, B = 3 (layout 0: ORT runs no other)."""
    models, x_shape = _node_models(op, "bidirectional", 0, 3)
    fa = fuse_models(models, per_model_inputs=["x"], strategy="batched")
    save_array(fa, tmp_path / "array")
    x = np.random.default_rng(0).standard_normal([3, *x_shape]).astype(np.float32)
    check_folder(tmp_path / "array", fa.model, {"x": x})


def test_a_batched_rnn_of_any_sequence_length_is_saved_as_standard_nodes(tmp_path):
    """A batched RNN whose sequence length is not static cannot be unrolled: fused.onnx holds B standard RNN
    nodes, and legalizing it for ORT training still refuses it in one line."""
    from onnxfuse.core.errors import UntrainableOpError
    from onnxfuse.runtime.ort.legalize import legalize

    models = []
    for b in range(2):
        r = np.random.default_rng(b)
        node = h.make_node("RNN", ["x", "w", "r", "b"], ["y", "y_h"], hidden_size=6, direction="bidirectional")
        models.append(graph_model([node], [vinfo("x", ["T", "N", 4])], [vinfo("y", ["T", 2, "N", 6]),
                                                                       vinfo("y_h", [2, "N", 6])],
                                  [rand_init(r, "w", [2, 6, 4]), rand_init(r, "r", [2, 6, 6]),
                                   rand_init(r, "b", [2, 12])]))
    fa = fuse_models(models, per_model_inputs=["x"], strategy="batched")
    save_array(fa, tmp_path / "array")
    standard = onnx.load(tmp_path / "array" / "fused.onnx")
    assert [n.op_type for n in standard.graph.node].count("RNN") == 2
    check_folder(tmp_path / "array", fa.model, {"x": np.random.default_rng(2).standard_normal([2, 7, 3, 4])
                                                .astype(np.float32)})
    with pytest.raises(UntrainableOpError, match="static"):
        legalize(fa.model)


def test_an_array_saved_from_python_opens_in_onnx_runtime(tmp_path):
    """``onnxfuse.fuse`` -> ``FusedArray`` -> ``arr.save``: the same folder, with the array's weights as they are
    now (changed here after fusing: what the torch runtime gives back holds them)."""
    import onnxfuse

    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))
    mods = []
    for b in range(2):
        torch.manual_seed(b)
        mods.append(_Recurrent("GRU"))
    arr = onnxfuse.fuse(mods, (x,))
    with torch.no_grad():
        for p in arr.parameters():
            p.mul_(0.5)
        want = arr(x).numpy()
    arr.save(tmp_path / "array")
    assert os.path.exists(ArrayDir(tmp_path / "array").own_ops_path)  # nn.GRU's default form: batched
    check_folder(tmp_path / "array", None, {arr.input_names[0]: x.numpy()})
    got = session_forward(tmp_path / "array", {arr.input_names[0]: x.numpy()})[0]
    assert rel_err(got, want) < TOL


def test_fused_files_of_two_arrays_are_refused_in_one_line(tmp_path):
    """fused.own-ops.pb takes its weights from fused.onnx by name: a fused.onnx without one of them (another
    array's, edited) is one InputFileError naming the file and the tensor."""
    models, _ = _node_models("GRU", "forward", 0, 2)
    save_array(fuse_models(models, per_model_inputs=["x"]), tmp_path / "array")
    path = tmp_path / "array" / "fused.onnx"
    standard = onnx.load(path)
    kept = [t for t in standard.graph.initializer if t.name != "w"]
    del standard.graph.initializer[:]
    standard.graph.initializer.extend(kept)
    onnx.save(standard, path)
    with pytest.raises(InputFileError, match="fused.own-ops.pb' reads 'w'"):
        ArrayDir(tmp_path / "array").load()


# ---------------------------------------------------------------------------------------------- the fuzz grammar
FUZZ_FAST = (0, 2, 15, 30)  # recurrent layers among convolutions, routing, norms


@pytest.mark.parametrize("seed", [pytest.param(s, marks=[] if s in FUZZ_FAST else [pytest.mark.slow])
                                  for s in sorted(set(range(40)) | set(FUZZ_FAST))])
def test_a_fuzz_grammar_array_opens_in_onnx_runtime(seed, tmp_path):
    case, paths, per_model = fuzz_case(seed, tmp_path)
    fa = _fuse(paths, per_model_inputs=per_model)
    save_array(fa, tmp_path / "array")
    check_folder(tmp_path / "array", fa.model, {"input": case.inputs().numpy()})
