"""Run-time verification: `onnxfuse train` checks its first step(s) of every model against the model trained alone
and `onnxfuse check` does it on demand. On a correct array every model matches (and "alone" is each model itself:
its loss equals torch's on its own batch); a planted defect that zeroes one model's gradient of one tensor, the
way onnxruntime-training's ConvGrad defect did, stops training before anything is written, naming the model and
the tensor; the check leaves the run bit-identical to an unchecked one."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import helper as h
from onnx import numpy_helper as nh
from safetensors.numpy import load_file

from tests.conftest import MODELS, export_all, make_modules
from onnxfuse import fuse_models, save_array
from onnxfuse.cli.main import main
from onnxfuse.core.errors import ConfigError
from onnxfuse.training.run import TrainConfig, train_array
from onnxfuse.recipe.config import normalize_config
from onnxfuse.training.run import verify_array
from onnxfuse.core.weights import ArraySpec

B, N = 3, 8


def make_array(folder, name: str, per_model_inputs=()) -> tuple[str, list[torch.nn.Module]]:
    mods = make_modules(name, B, seed0=10)
    paths = export_all(mods, MODELS[name][1], folder / f"{name}_jobs")
    array = folder / f"{name}_array"
    save_array(fuse_models(paths, per_model_inputs=per_model_inputs), array)
    return str(array), mods


def data_file(folder, name: str, n: int = 48) -> str:
    rng = np.random.default_rng(1)
    path = folder / f"{name}.npz"
    np.savez(path, input=rng.standard_normal((n,) + MODELS[name][1][1:]).astype(np.float32),
             labels=rng.integers(0, 10, n))
    return str(path)


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify")
    out = {}
    for name in ("lenet", "cnn_bn"):
        array, mods = make_array(d, name)
        out[name] = (array, mods, data_file(d, name))
    return d, out


def _plant(array_dir: str, tensor: str, b: int, planted) -> None:
    """Make every node of the fused graph read W_used instead of the fused weight W that holds model b's
    ``tensor``: ``planted(W, value, block)`` -> (new initializers, nodes computing 'planted_w'), ``block`` the
    slice of W's rows that are model b's."""
    spec = ArraySpec.load(os.path.join(array_dir, "array.json"))
    fw = next(f for f in spec.weights.values() if f.sources[b] == tensor)
    path = os.path.join(array_dir, "fused.onnx")
    m = onnx.load(path)
    value = nh.to_array(next(t for t in m.graph.initializer if t.name == fw.name))
    inits, nodes = planted(fw.name, value, slice(b * fw.block_len, (b + 1) * fw.block_len))
    m.graph.initializer.extend(inits)
    for node in m.graph.node:
        node.input[:] = ["planted_w" if x == fw.name else x for x in node.input]
        nodes.append(node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    onnx.checker.check_model(m)
    onnx.save(m, path)


def plant_zero_gradient(array_dir: str, tensor: str, b: int) -> None:
    """Make the fused graph give model b's block of ``tensor`` a zero gradient with the forward unchanged:
    W_used = W * mask + W0 * (1 - mask), W0 a constant copy of W and mask 0 on model b's block."""
    def planted(w, value, block):
        mask = np.ones([value.shape[0]] + [1] * (value.ndim - 1), np.float32)
        mask[block] = 0
        return ([nh.from_array(value, "planted_copy"), nh.from_array(mask, "planted_mask"),
                 nh.from_array(1 - mask, "planted_keep")],
                [h.make_node("Mul", [w, "planted_mask"], ["planted_a"]),
                 h.make_node("Mul", ["planted_copy", "planted_keep"], ["planted_b"]),
                 h.make_node("Add", ["planted_a", "planted_b"], ["planted_w"])])

    _plant(array_dir, tensor, b, planted)


def plant_wrong_mapping(array_dir: str, tensor: str, b: int) -> None:
    """Corrupt the fused graph's weight mapping of ``tensor`` for model b: every node reads
    W_used = Gather(Concat(W, W0), rows), whose rows send model b's block to model 0's block of W0, a constant copy
    of the initial W (model b computes with model 0's weights there; the other models are untouched)."""
    def planted(w, value, block):
        rows = np.arange(len(value))
        rows[block] = len(value) + rows[: block.stop - block.start]
        return ([nh.from_array(rows.astype(np.int64), "planted_rows"), nh.from_array(value, "planted_copy")],
                [h.make_node("Concat", [w, "planted_copy"], ["planted_both"], axis=0),
                 h.make_node("Gather", ["planted_both", "planted_rows"], ["planted_w"], axis=0)])

    _plant(array_dir, tensor, b, planted)


def planted_copy(arrays, name: str, tensor: str) -> tuple[str, str]:
    d, made = arrays
    target = str(d / f"{name}_planted_{tensor.replace('.', '_')}")
    if not os.path.exists(target):
        shutil.copytree(made[name][0], target)
        plant_zero_gradient(target, tensor, 1)
    return target, made[name][2]


def snapshot(folder: str) -> dict:
    out = {}
    for root, dirs, files in os.walk(folder):
        for f in dirs + files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest() \
                if os.path.isfile(p) else "dir"
    return out


def torch_first_loss(mod: torch.nn.Module, data: str, rows: slice) -> float:
    d = np.load(data)
    x, y = torch.from_numpy(d["input"][rows]), torch.from_numpy(d["labels"][rows])
    return float(torch.nn.functional.cross_entropy(mod.train()(x), y))


# ------------------------------------------------------------------------------------------- a correct array
@pytest.mark.parametrize("name, optimizer, extra", [
    ("lenet", "sgd", {"momentum": 0.9, "weight_decay": [0.0, 1e-3, 0.0]}),
    ("cnn_bn", "adamw", {"weight_decay": [0.0, 0.01, 0.1]}),
])
def test_check_passes_on_a_correct_array_and_alone_is_each_model(arrays, name, optimizer, extra, runtime):
    _, made = arrays
    array, mods, data = made[name]
    lrs = [0.1, 0.03, 0.01] if optimizer == "sgd" else [1e-3, 3e-3, 1e-2]
    cfg = TrainConfig(batch_size=N, steps=5, optimizer=optimizer, lr=lrs, shuffle=False, verify_steps=2,
                      runtime=runtime, **extra)
    report = verify_array(array, data, cfg)
    assert report.ok, report.table()
    assert report.steps == 2 and len(report.checks) == 2 * B
    for c in report.checks:
        state = mods[c.model].state_dict()
        compared = {t.name for t in c.tensors}
        assert compared == {k for k in state if not k.endswith("num_batches_tracked")}
        assert max(t.rel for t in c.tensors) < 1e-4  # rounding, far below the tolerance
    first = [c for c in report.checks if c.step == 1]
    for c in first:  # the reference really is model b: its step-1 loss is torch's on the first batch
        assert c.loss_alone == pytest.approx(torch_first_loss(mods[c.model], data, slice(0, N)), rel=1e-5)
    assert len({round(c.loss_alone, 6) for c in first}) == B  # three different models, not one three times


def test_shards_give_each_model_its_own_batch(tmp_path):
    array, mods = make_array(tmp_path, "mlp", per_model_inputs=["input"])
    data = data_file(tmp_path, "mlp", n=48)
    cfg = TrainConfig(batch_size=N, steps=2, optimizer="adam", lr=[1e-3, 1e-2, 1e-1], data_order="shards",
                      shuffle=False)
    report = verify_array(array, data, cfg)
    assert report.ok, report.table()
    shard = 48 // B
    for c in report.checks:  # model b's first batch is the start of shard b
        rows = slice(c.model * shard, c.model * shard + N)
        assert c.loss_alone == pytest.approx(torch_first_loss(mods[c.model], data, rows), rel=1e-5)


class DropoutMLP(torch.nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.fc1, self.drop, self.fc2 = torch.nn.Linear(48, 32), torch.nn.Dropout(p), torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x.flatten(1)))))


def test_dropout_masks_are_random_so_the_check_runs_without_them(tmp_path):
    """Masks drawn by ONNX Runtime differ between the array and alone: with p > 0 the check switches Dropout off
    on both sides (and reports it); with p = 0 it checks the graph as it trains."""
    data = data_file(tmp_path, "mlp")
    cfg = TrainConfig(batch_size=N, steps=3, optimizer="adamw", lr=[1e-3, 1e-2, 1e-1])
    for p in (0.5, 0.0):
        mods = []
        for b in range(B):
            torch.manual_seed(b)
            mods.append(DropoutMLP(p))
        array = tmp_path / f"array_{p}"
        save_array(fuse_models(export_all(mods, MODELS["mlp"][1], tmp_path / f"jobs_{p}")), array)
        report = verify_array(array, data, cfg)
        assert report.ok and report.dropout_off == (p > 0), report.table()
        assert ("Dropout off" in report.summary()) == (p > 0)


# ---------------------------------------------------------------------------------------------- a planted defect
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_planted_defect_is_found_in_the_right_model_and_tensor(arrays, optimizer):
    array, data = planted_copy(arrays, "lenet", "conv2.weight")
    cfg = TrainConfig(batch_size=N, steps=3, optimizer=optimizer, lr=[1e-3, 1e-2, 1e-1], verify_steps=2)
    report = verify_array(array, data, cfg)
    assert not report.ok
    bad = [c for c in report.per_model() if not c.ok]
    assert [c.model for c in bad] == [1] and bad[0].step == 1
    assert bad[0].worst.name == "conv2.weight" and bad[0].worst.rel == pytest.approx(1.0)  # the whole gradient
    assert bad[0].loss_ok  # the forward pass is untouched
    message = str(report.error())
    assert "model 1" in message and "'conv2.weight'" in message and "--verify-steps 0" in message


def test_a_corrupted_weight_mapping_stops_training_naming_the_model(arrays, capsys):
    """The fused graph gives model 1 model 0's block of fc1.weight: its forward and gradients are another model's
    there, and `onnxfuse train` stops before it writes anything, naming model 1."""
    d, made = arrays
    array = str(d / "lenet_wrong_mapping")
    if not os.path.exists(array):
        shutil.copytree(made["lenet"][0], array)
        plant_wrong_mapping(array, "fc1.weight", 1)
    before = snapshot(array)
    flags = ["--data", made["lenet"][2], "--optimizer", "adamw", "--lr", "0.001", "--steps", "2", "--batch-size", N,
             "-q"]
    assert main(["train", array, *map(str, flags)]) == 4
    err = capsys.readouterr().err
    assert "model 1" in err and "model 0" not in err and "model 2" not in err, err
    assert snapshot(array) == before


class TCN(torch.nn.Module):
    """Two Conv1d layers, a mean over time and a Linear: the shape of the reproduction in which
    onnxruntime-training 1.19.2's ConvGrad, on the grouped Conv1d of the fused array, zeroed the Linear weight's
    gradient (the Conv legalization now rewrites such convolutions)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv1d(16, 16, 3, padding=1), torch.nn.Conv1d(16, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).mean(2))


def test_the_runtime_defect_that_motivated_the_check_is_caught(tmp_path, monkeypatch):
    from onnxfuse.runtime.ort.legalize import REWRITES

    mods = []
    for b in range(B):
        torch.manual_seed(b)
        mods.append(TCN())
    array = tmp_path / "array"
    save_array(fuse_models(export_all(mods, (N, 16, 256), tmp_path / "jobs")), array)
    rng = np.random.default_rng(0)
    data = {"input": rng.standard_normal((32, 16, 256)).astype(np.float32), "labels": rng.integers(0, 10, 32)}
    cfg = TrainConfig(batch_size=N, steps=5, optimizer="adamw", lr=[1e-3, 1e-2, 1e-1], runtime="ort")  # an ORT defect
    assert verify_array(array, data, cfg).ok
    conv_rewrites = [key for key in REWRITES if key[1] == "Conv"]
    assert conv_rewrites
    for key in conv_rewrites:  # train the grouped Conv1d as it was before the legalization existed
        monkeypatch.delitem(REWRITES, key)
    report = verify_array(array, data, cfg)
    assert not report.ok
    assert {c.worst.name for c in report.per_model() if not c.ok} == {"fc.weight"}
    assert all(c.loss_ok for c in report.checks)  # the forward pass is right; only the gradient is wrong


def test_train_stops_before_writing_anything_and_runs_with_verify_steps_0(arrays, capsys):
    array, data = planted_copy(arrays, "lenet", "fc1.bias")
    flags = ["--data", data, "--optimizer", "sgd", "--lr", "0.1,0.05,0.01", "--momentum", "0.9", "--steps", "2",
             "--batch-size", N, "-q"]
    before = snapshot(array)
    code = main(["train", array, *map(str, flags)])
    err = capsys.readouterr().err
    assert code == 4 and snapshot(array) == before  # no trained/, no metrics.csv, no temporary folder left
    assert len(err.strip().splitlines()) == 1 and err.startswith("onnxfuse: error: verification failed")
    assert "model 1" in err and "'fc1.bias'" in err and "--verify-steps 0" in err

    assert main(["train", array, *map(str, flags), "--verify-steps", "0"]) == 0
    assert os.path.exists(os.path.join(array, "trained", "weights.safetensors"))
    trained = snapshot(array)
    capsys.readouterr()
    assert main(["train", array, *map(str, flags)]) == 4
    assert snapshot(array) == trained  # the earlier run's metrics.csv and trained/ are untouched


def test_check_command_prints_the_table_and_exits_by_the_verdict(arrays, capsys):
    _, made = arrays
    good, _, data = made["lenet"]
    bad, _ = planted_copy(arrays, "lenet", "fc1.bias")
    flags = ["--data", data, "--optimizer", "adamw", "--lr", "1e-3", "--steps", "10", "--batch-size", N, "-q"]
    for array, expected in ((good, 0), (bad, 4)):
        before = snapshot(array)
        code = main(["check", array, *map(str, flags)])
        out, err = capsys.readouterr()
        assert code == expected and snapshot(array) == before  # check writes nothing
        lines = out.strip().splitlines()
        assert lines[0].split()[:3] == ["model", "loss", "fused"] and len(lines) == 1 + B + 1
        verdicts = [line.split()[-1] if "MISMATCH" not in line else "MISMATCH" for line in lines[1:1 + B]]
        assert verdicts == (["ok"] * B if expected == 0 else ["ok", "MISMATCH", "ok"])
        assert (err == "") == (expected == 0)
        if expected:
            assert "model 1" in err and "'fc1.bias'" in err


# ------------------------------------------------------------------------------------ the run is left as it was
def test_verification_leaves_the_run_bit_identical(arrays, tmp_path):
    _, made = arrays
    array, _, data = made["cnn_bn"]
    weights, losses = [], []
    for k, verify in enumerate((2, 0)):
        copy = str(tmp_path / f"run{k}")
        shutil.copytree(array, copy)
        cfg = TrainConfig(batch_size=N, steps=3, optimizer="adamw", lr=[1e-3, 3e-3, 1e-2], verify_steps=verify)
        res = train_array(copy, data, cfg, progress=False)
        weights.append(load_file(os.path.join(copy, "trained", "weights.safetensors")))
        losses.append(res.final_loss)
    assert losses[0] == losses[1]
    assert weights[0].keys() == weights[1].keys()
    assert all(np.array_equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_resumed_run_skips_verification(arrays, capsys):
    array, data = planted_copy(arrays, "lenet", "conv2.weight")
    flags = ["--data", data, "--optimizer", "sgd", "--lr", "0.1", "--steps", "2", "--batch-size", N, "-q"]
    assert main(["train", array, *map(str, flags), "--verify-steps", "0", "--checkpoint-every", "2"]) == 0
    capsys.readouterr()
    assert main(["train", array, "--resume", "--steps", "3", "--verify-steps", "1"]) == 0
    assert "verified" not in capsys.readouterr().err


def test_verification_is_one_log_line_and_quiet_under_q(arrays, tmp_path):
    _, made = arrays
    array = str(tmp_path / "array")
    shutil.copytree(made["lenet"][0], array)
    cmd = [sys.executable, "-m", "onnxfuse", "train", array, "--data", made["lenet"][2], "--steps", "1",
           "--batch-size", str(N)]
    err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    lines = [line for line in err.splitlines() if "verified" in line]
    assert len(lines) == 1 and lines[0].startswith("onnxfuse: verified step 1 of 3 models")
    assert "every model matches" in lines[0] and lines[0].endswith("s")
    assert subprocess.run(cmd + ["-q"], capture_output=True, text=True, check=True).stderr == ""


def test_verify_steps_setting_in_config_and_flags(arrays, capsys):
    assert normalize_config({"steps": 5})["verify_steps"] == 1
    assert normalize_config({"steps": 5, "verify_steps": 0})["verify_steps"] == 0
    with pytest.raises(ConfigError, match="verify_steps = -1"):
        normalize_config({"steps": 5, "verify_steps": -1})
    _, made = arrays
    array, _, data = made["lenet"]
    assert main(["train", array, "--data", data, "--steps", "2", "--batch-size", str(N), "--verify-steps", "-1",
                 "-q"]) == 2
    assert "--verify-steps: verify_steps = -1 must be an integer >= 0" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(array, "trained"))
