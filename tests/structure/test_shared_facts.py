"""One owner per idea, where a copy could drift silently: the default-domain opset (``core._opset.onnx_opset``),
"is this BatchNorm in training mode" (``core._opset.is_training_batchnorm``, opset 13 spells it with outputs, 14+
with an attribute), an array's trainable parameters and buffers (``ArraySpec.parameter_names``)."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from onnxfuse.core._opset import is_training_batchnorm, onnx_opset
from onnxfuse.core.errors import InputFileError
from onnxfuse.exporters import export_module


def _model(opsets) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])


def test_the_opset_is_the_default_domains_and_there_is_no_default():
    assert onnx_opset(_model([("com.microsoft", 1), ("", 15)])) == 15
    assert onnx_opset(_model([("ai.onnx", 13)])) == 13
    with pytest.raises(InputFileError, match=r"^m.onnx imports no default-domain ONNX opset \(opset_import: "
                                             r"'com.microsoft'\); re-export it"):
        onnx_opset(_model([("com.microsoft", 1)]), "m.onnx")


def test_every_reader_of_the_opset_refuses_a_model_without_one(tmp_path):
    """Placement assumed opset 17, the torch runtime 1, the legalizer raised its own error; now one error."""
    from onnxfuse.runtime.ort.legalize import legalize
    from onnxfuse.placement import build_graph
    from onnxfuse.runtime.torch.program import OnnxModule

    path = str(tmp_path / "m.onnx")
    model = _model([("com.microsoft", 1)])
    onnx.save(model, path)
    for call in (lambda: build_graph(path, batch_size=2), lambda: legalize(model), lambda: OnnxModule(model)):
        with pytest.raises(InputFileError, match="imports no default-domain ONNX opset"):
            call()


def _bn(outputs: int, **attrs) -> onnx.NodeProto:
    return helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], [f"o{k}" for k in range(outputs)],
                            **attrs)


def test_training_mode_batchnorm_at_opset_13_and_15():
    assert is_training_batchnorm(_bn(5), 13) and is_training_batchnorm(_bn(3, training_mode=1), 15)
    assert not is_training_batchnorm(_bn(1), 13) and not is_training_batchnorm(_bn(1), 15)
    assert not is_training_batchnorm(_bn(3), 15)  # opset 14+: the attribute decides (default 0)
    assert not is_training_batchnorm(_bn(1, training_mode=0), 15)
    unused = _bn(5)
    del unused.output[1:]
    unused.output.extend(["", "", "", ""])  # optional outputs left empty: inference at opset 13
    assert not is_training_batchnorm(unused, 13)
    assert not is_training_batchnorm(helper.make_node("Relu", ["x"], ["y"]), 15)


class _ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.Linear(108, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


@pytest.mark.parametrize("opset", [13, 15])
@pytest.mark.parametrize("runtime", ["torch", "ort"])
def test_both_runtimes_update_batchnorm_statistics_as_torch_does(tmp_path, opset, runtime):
    """An opset-13 export marks training-mode BatchNorm by its 5 outputs: the ort runtime looked for the opset-14
    attribute only, left ONNX Runtime's own update of the statistics in place (biased variance) and so trained
    running_var differently from torch (0.92636 for torch's 0.92655)."""
    from onnxfuse.core.passes import fuse_models
    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.trainers import make_trainer

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 2, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 4, 4).astype(np.int64)
    torch.manual_seed(0)
    module = _ConvBN()
    path = os.path.join(tmp_path, "m.onnx")
    export_module(module, path, input_shape=(4, 2, 8, 8), opset=opset)
    module.train()(torch.from_numpy(x))  # what torch's BatchNorm does with the same batch
    fa = fuse_models([path, path])
    trainer = make_trainer(runtime, fa.model, fa.spec, "cross-entropy", make_optimizer("sgd", 2, lr=0.0),
                           workdir=str(tmp_path / "work"))
    trainer.step({"input": x, "labels": labels})
    w = trainer.weights()
    by_source = {fw.sources[0]: name for name, fw in fa.spec.weights.items()}
    for key in ("bn.running_mean", "bn.running_var"):
        got = w[by_source[key]].reshape(2, -1)
        want = getattr(module.bn, key.split(".")[1]).numpy()
        np.testing.assert_allclose(got, np.stack([want, want]), rtol=1e-5, atol=1e-6, err_msg=key)


def test_the_trainable_parameters_and_buffers_of_an_array():
    """One split of an array's weights by role, which the optimizer state's shape, both runtimes and the GAN use."""
    from onnxfuse.core.errors import ConfigError
    from onnxfuse.core.weights import ArraySpec, FusedWeight, WeightSlot
    from onnxfuse.runtime.protocol import parameter_names

    def weight(name, role, n):
        return FusedWeight(name, WeightSlot(None, (n,)), (n,), "float32", role, [f"{name}.{b}" for b in range(2)])

    roles = [("w", "param", 3), ("rm", "buffer", 4), ("e", "frozen", 5), ("v", "param", 6)]
    spec = ArraySpec(B=2, sources=["a", "b"], inputs=[], outputs=[],
                     weights={n: weight(n, r, k) for n, r, k in roles}, extra_state=[{}, {}])
    assert spec.parameter_names() == (["w", "v"], ["rm", "e"]) == parameter_names(spec)
    assert spec.optimizer_shape() == (2, 3 + 6)
    frozen = ArraySpec(B=2, sources=["a", "b"], inputs=[], outputs=[], weights={"e": weight("e", "frozen", 5)},
                       extra_state=[{}, {}])
    assert frozen.parameter_names() == ([], ["e"])
    with pytest.raises(ConfigError, match="no trainable parameters"):
        parameter_names(frozen)


def test_fusing_and_placing_read_a_model_alike(tmp_path):
    """One loader (core._io.read_model) and one check that every tensor read is defined, with one message, for
    `fuse` and `place` (placement had its own, found only after its onnxruntime run for shapes)."""
    from onnxfuse.core.source import load_source
    from onnxfuse.placement import build_graph

    g = helper.make_graph([helper.make_node("Add", ["x", "ghost"], ["y"], name="add")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])])
    path = str(tmp_path / "broken.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    messages = []
    for call in (lambda: load_source(path), lambda: build_graph(path, batch_size=2)):
        with pytest.raises(InputFileError) as e:
            call()
        messages.append(str(e.value))
    assert messages[0] == messages[1] and messages[0].startswith("broken.onnx: node 'add' (Add) reads 'ghost'")
    missing = str(tmp_path / "none.onnx")
    for call in (lambda: load_source(missing), lambda: build_graph(missing)):
        with pytest.raises(InputFileError, match="model file '.*none.onnx' does not exist; re-export it"):
            call()


@pytest.mark.parametrize("case", ["npy", "text", "folder"])
def test_place_reads_its_inputs_with_the_data_files_reader(tmp_path, capsys, case):
    """`place --inputs` read .npz files with its own np.load (a text file: "not a readable .npz file
    (UnpicklingError)"); now recipe.data.load_npz says what the file is, naming the flag."""
    from tests.conftest import cli, one_error_line
    from tests.structure.test_ownership import _small_model

    model = _small_model(str(tmp_path / "small.onnx"))
    feeds = tmp_path / "feeds.npz"
    if case == "npy":
        np.save(open(feeds, "wb"), np.zeros((4, 8), np.float32))
    elif case == "text":
        feeds.write_text("x\n1\n")
    else:
        feeds.mkdir()
    says = {"npy": "is a single .npy array", "text": "is not an .npz archive", "folder": "is a folder"}[case]
    code, _, err = cli(capsys, "place", model, "--inputs", feeds, "--costs", "estimate", "-q", "-o", tmp_path / "out")
    line = one_error_line(err)
    assert code == 2 and f"--inputs '{feeds}' {says}" in line, line
    assert not (tmp_path / "out").exists()


def test_one_atomic_file_write(tmp_path):
    """core._io.atomic_file (under atomic_write_bytes, the forms cache and a sweep's exported trials): the old file
    or the whole new one, and no temporary left by a writer that failed."""
    from onnxfuse.core._io import atomic_file, atomic_write_bytes, remove_temporaries

    path = tmp_path / "f.json"
    atomic_write_bytes(path, b"old")
    with pytest.raises(RuntimeError):
        with atomic_file(path) as tmp:
            open(tmp, "wb").write(b"half")
            raise RuntimeError("the writer failed")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.json"]
    with atomic_file(tmp_path / "m.onnx") as tmp:
        onnx.save(_model([("", 17)]), tmp)
    assert onnx_opset(onnx.load(tmp_path / "m.onnx")) == 17 and sorted(os.listdir(tmp_path)) == ["f.json", "m.onnx"]
    with atomic_file(path) as tmp:  # a killed writer's temporary is one remove_temporaries knows
        open(tmp, "wb").write(b"left")
        assert remove_temporaries(str(tmp_path)) == [tmp]
        open(tmp, "wb").write(b"new")
    assert path.read_bytes() == b"new"


def test_one_timing_loop_for_the_benchmarks_and_the_planner():
    """interleaved_rounds (with core._clock.Stopwatch) times bench's and forms' blocks of steps and the planner's
    single steps (each_step; it had its own loop): the order alternates every round, sync brackets every timing."""
    import time

    from onnxfuse.core._clock import Stopwatch
    from onnxfuse.measure.workloads import interleaved_rounds

    calls = []
    steppers = {k: (lambda k=k: calls.append(k)) for k in ("a", "b")}
    times = interleaved_rounds(steppers, 2, 3, sync=lambda: calls.append("|"), each_step=True)
    assert [len(v) for v in times.values()] == [6, 6] and all(t >= 0 for v in times.values() for t in v)
    assert "".join(calls) == "|a|" * 3 + "|b|" * 3 + "|b|" * 3 + "|a|" * 3
    calls.clear()
    times = interleaved_rounds(steppers, 2, 3, sync=lambda: calls.append("|"))
    assert [len(v) for v in times.values()] == [2, 2] and "".join(calls) == "|aaa||bbb||bbb||aaa|"
    with Stopwatch() as watch:
        time.sleep(0.01)
    done = watch.seconds
    assert 0.01 <= done < 1 and watch.seconds == done  # stopped at the block's end
    assert Stopwatch().seconds < done


def test_training_memory_has_one_rule_for_weights(tmp_path):
    """The planner's estimate of an array's step and placement's memory plan count a trained weight alike
    (measure.sizing.training_weight_factor: the weight, its gradient, the optimizer's slots), and placement takes
    the slots from the optimizer registry (it had its own table: sgd 0, momentum 1, adam/adamw 2)."""
    from onnxfuse.core.passes import fuse_models
    from onnxfuse.measure.sizing import estimate_step_memory, training_weight_factor
    from onnxfuse.placement import build_graph
    from onnxfuse.placement.graph import optimizer_names, optimizer_state_slots
    from onnxfuse.recipe.losses import get_loss
    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.recipe.settings import OPTIMIZERS

    for name in OPTIMIZERS:
        assert optimizer_state_slots(name) == len(make_optimizer(name, 1).state_names())
    assert optimizer_state_slots("momentum") == 1 and optimizer_state_slots(3) == 3
    assert set(optimizer_names()) == set(OPTIMIZERS) | {"momentum"}

    torch.manual_seed(0)
    path = str(tmp_path / "m.onnx")
    export_module(_ConvBN(), path, input_shape=(4, 2, 8, 8))
    fa = fuse_models([path, path])
    adamw = make_optimizer("adamw", 2)
    rng = np.random.default_rng(0)
    feeds = {"input": rng.standard_normal((4, 2, 8, 8)).astype(np.float32), "labels": np.zeros(4, np.int64)}
    est = estimate_step_memory(fa.model, fa.spec, get_loss("cross-entropy"), adamw, feeds)
    trainable, buffers = fa.spec.parameter_names()
    nbytes = {t.name: onnx.numpy_helper.to_array(t).nbytes for t in fa.model.graph.initializer}
    slots = len(adamw.state_names())
    assert est.held + est.gradients == (sum(nbytes[n] for n in trainable) * training_weight_factor(slots)
                                        + sum(nbytes[n] for n in buffers))
    graph = build_graph(fa.model, batch_size=4, training=True, optimizer="adamw")
    assert graph.weight_factor == training_weight_factor(slots) == 4
