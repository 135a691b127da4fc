"""Issue 19, items 4 and 5 (in part): failures a user causes in a sweep or with the ort runtime are one
`onnxfuse: error:` line (exit status 2) naming the file, key or node, on real CLI runs:

* A. every search range and sweep section value of a spec is checked before anything runs (nothing is written);
* B. a disk that fills up during a sweep's trial writes (a real tmpfs) is one line naming the file; no record is
  0 bytes or half-written, status.json says what stopped the sweep, and `sweep --resume` then completes;
* C. an ONNX Runtime training session that cannot start names the node, and suggests `--runtime torch` exactly
  when the torch runtime has a kernel for every op of the graph.

(Sweep helpers follow tests/sweep/test_sweep.py; cli, one_error_line, have_userns and in_tmpfs are copies of
tests/training/test_reliability.py's.)"""
from __future__ import annotations

import csv
import json
import os
import subprocess

import numpy as np
import onnx
import pytest

from tests.conftest import EXE, cli, have_userns, in_tmpfs, one_error_line, write_spec

SHAPE = [8, 3, 4, 4]  # zoo.MLP(in_features=48)


# ---------------------------------------------------------------------------------------------------- helpers
def data_file(folder, n=120) -> str:
    rng = np.random.default_rng(0)
    path = folder / "data.npz"
    np.savez(path, input=rng.standard_normal([n] + SHAPE[1:]).astype(np.float32), labels=rng.integers(0, 10, n))
    return str(path)


def base_spec(folder, **over) -> dict:
    raw = {"model": {"factory": "onnxfuse.exporters.zoo:MLP", "input_shape": SHAPE, "args": {"in_features": 48}},
           "search": {"space": {"optimizer.lr": [0.01, 0.001]}}, "arrays": {"size": 2},
           "data": {"train": data_file(folder), "eval_fraction": 0.25}, "loss": "cross-entropy",
           "optimizer": {"name": "adamw"}, "steps": 2, "batch_size": 16}
    raw.update(over)
    return raw


def random_search(**space) -> dict:
    return {"search": {"method": "random", "samples": 3, "space": space}}


def grid(**space) -> dict:
    return {"search": {"space": space}}


# ------------------------------------------------------------------------------ A. the spec, before anything runs
@pytest.mark.parametrize("over, named, says", [
    (random_search(**{"optimizer.lr": {"low": 0.1, "high": 0.001}}), "search.space.optimizer.lr",
     "low 0.1 is above high 0.001"),
    (random_search(batch_size={"low": 32, "high": 8, "int": True}), "search.space.batch_size",
     "low 32 is above high 8"),
    (random_search(**{"optimizer.lr": {"low": 0.0, "high": 0.1, "log": True}}), "search.space.optimizer.lr",
     "needs low > 0"),
    (random_search(**{"model.hidden": {"low": 8.5, "high": 16, "int": True}}), "search.space.model.hidden",
     "whole-number bounds"),
    (random_search(**{"optimizer.lr": {"low": 0.0, "high": float("inf")}}), "search.space.optimizer.lr",
     "high must be finite"),
    (random_search(**{"optimizer.lr": {"low": 0.1}}), "search.space.optimizer.lr", "needs low and high"),
    (random_search(**{"optimizer.lr": {"low": 0.1, "high": 0.2, "step": 0.01}}), "search.space.optimizer.lr",
     "unknown key 'step'"),
    (random_search(**{"optimizer.lr": {"low": "0.001", "high": 0.1}}), "search.space.optimizer.lr",
     "low must be a number"),
    (random_search(batch_size={"low": 8, "high": 32}), "search.space.batch_size.low", "needs int: true"),
    (random_search(seed={"low": 0, "high": 9}), "search.space.seed", "needs int: true"),
    ({"search": {"method": "random", "samples": 3, "seed": -1, "space": {"optimizer.lr": [0.1]}}}, "search.seed",
     "greater than or equal to 0"),
    (grid(**{"optimizer.lr": []}), "search.space.optimizer.lr", "empty list"),
    (grid(**{"optimizer.lr": [[0.1, 0.01]]}), "search.space.optimizer.lr[0]", "not a number"),
    (grid(**{"optimizer.lr": [{"low": 0.1, "high": 0.2}]}), "search.space.optimizer.lr[0]", "a range inside a list"),
    (grid(**{"optimizer.lr": [0.1, -1]}), "search.space.optimizer.lr[1]", ">= 0"),
    (grid(**{"optimizer.lr": 0.1}), "search.space.optimizer.lr", "give a list of values"),
    (grid(seed=[0, 2 ** 70]), "search.space.seed[1]", "torch.manual_seed"),
    ({"resources": {"cpus": float("inf")}}, "resources.cpus", "finite"),
    ({"resources": {"cpus": 1e-6}}, "resources.cpus", "smallest fraction Ray counts"),
    ({"resources": {"gpus": float("nan")}}, "resources.gpus", "finite"),
    ({"arrays": {"size": "4"}}, "arrays.size", "a positive integer or auto"),
], ids=["reversed", "reversed-int", "log-from-zero", "int-fractional", "infinite", "no-high", "unknown-range-key",
        "string-bound", "float-range-of-int-setting", "seed-float-range", "negative-search-seed", "empty-list",
        "nested-list", "range-in-list", "bad-per-model-value", "scalar", "seed-too-large", "cpus-inf",
        "cpus-below-ray-unit", "gpus-nan", "size-string"])
def test_bad_spec_is_one_line_naming_the_key_before_anything_runs(over, named, says, tmp_path, capsys):
    spec = write_spec(tmp_path, base_spec(tmp_path, **over))
    code, _, err = cli(capsys, "sweep", spec, "-o", tmp_path / "out", "--cpus", 2, "-q")
    line = one_error_line(err)
    assert code == 2 and line.startswith(f"onnxfuse: error: {spec}") and named in line and says in line, line
    assert not (tmp_path / "out").exists()


def test_an_integer_range_of_an_integer_setting_is_sampled(tmp_path):
    """The other side of the checks: `{low: 8, high: 32, int: true}` for batch_size is accepted, and every
    trial gets a whole number in the range (its bounds were checked as the floats 8.0 and 32.0 before)."""
    from onnxfuse.sweep import parse_spec

    trials = parse_spec(base_spec(tmp_path, **random_search(batch_size={"low": 8, "high": 32, "int": True})),
                        "spec.yaml").trials()
    assert len(trials) == 3 and all(isinstance(t["batch_size"], int) and 8 <= t["batch_size"] <= 32 for t in trials)


@pytest.mark.slow
def test_an_array_asking_for_more_cpus_than_the_local_ray_has_is_one_line(tmp_path):
    """resources.cpus 3 on a local Ray of 2 CPUs: no array could ever start (Ray would only warn, and the sweep
    would wait forever); one line naming the key, and the -o folder is left as it was (absent)."""
    spec = write_spec(tmp_path, base_spec(tmp_path, resources={"cpus": 3}))
    r = subprocess.run([EXE, "sweep", spec, "-o", str(tmp_path / "out"), "--cpus", "2", "-q"], capture_output=True,
                       text=True, timeout=120)
    line = one_error_line(r.stderr)
    assert r.returncode == 2 and f"{spec}: resources.cpus 3 is more than the 2 CPUs of the local Ray" in line, line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------- B. a disk that fills up
@pytest.mark.slow
def test_full_disk_during_a_sweep_names_the_file_leaves_no_broken_record_and_resume_completes(tmp_path):
    """A sweep folder on a tmpfs sized to fill during the trial writes: 4 trials of a 325 KB MLP in 2 arrays;
    the models, the plan and the space a driver holds back fit, one trial's files (2 x 325 KB) fit, a second's
    do not. Then the tmpfs is made larger (the space freed) and --resume completes every trial."""
    if not have_userns():
        pytest.skip("no user and mount namespaces (unshare -rm): no small disk to fill")
    from onnxfuse.exporters import export_module, zoo
    from onnxfuse.sweep import folder as layout

    raw = base_spec(tmp_path, search={"space": {"optimizer.lr": [0.01, 0.001], "seed": [0, 1]}})
    raw["model"]["args"]["hidden"] = 256
    spec = write_spec(tmp_path, raw)
    export_module(zoo.MLP(in_features=48, hidden=256), str(tmp_path / "m.onnx"), input_shape=SHAPE)
    model = os.path.getsize(tmp_path / "m.onnx")  # each of models/<trial>.onnx, trials/<t>/model.onnx, .safetensors
    reserve = getattr(layout, "RESERVE_BYTES", 0)  # what a driver holds back to record why it stopped
    size = 4 * model + reserve + 3 * model + (64 << 10)
    disk = tmp_path / "disk"
    disk.mkdir()
    r = in_tmpfs('set +e\n"$EXE" sweep "$SPEC" -o "$DISK/out" --cpus 2 -q\necho "sweep $?" >&2\n'
                 'cp -a "$DISK/out" "$WORK/stopped"\n'
                 'mount -o remount,size=256m "$DISK"\n'
                 '"$EXE" sweep --resume "$DISK/out" --cpus 2 -q\necho "resume $?" >&2\n'
                 'cp -a "$DISK/out" "$WORK/resumed"', str(disk), f"size={size}",
                 EXE=EXE, SPEC=spec, DISK=disk, WORK=tmp_path)
    err = r.stderr.splitlines()
    assert "sweep 2" in err and "resume 0" in err, r.stderr
    line = one_error_line("\n".join(err[:err.index("sweep 2")]))
    assert f"'{disk}/out/trials/t" in line and "the disk is full" in line, line  # the file it was writing
    assert f"onnxfuse sweep --resume {disk}/out" in line, line

    stopped = tmp_path / "stopped"
    files = {os.path.relpath(os.path.join(d, f), stopped): os.path.getsize(os.path.join(d, f))
             for d, _, fs in os.walk(stopped) for f in fs}
    assert not [f for f in files if ".tmp-" in f], files  # no temporary left
    assert not [f for f, n in files.items() if n == 0 and os.path.basename(f) != ".onnxfuse.lock"], files
    for f in files:
        if f.endswith(".json"):
            json.load(open(stopped / f))  # every record whole
    status = json.load(open(stopped / "status.json"))
    assert "the disk is full" in status["stopped"]["error"] and status["running"] == status["queued"] == 0, status
    assert not [a for a, s in status["arrays"].items() if s["state"] in ("running", "queued")], status

    resumed = tmp_path / "resumed"
    with open(resumed / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and all(t["status"] == "finished" and t["steps"] == "2" for t in table), table
    for t in table:
        for name in ("model.onnx", "model.safetensors", "metrics.csv"):
            assert os.path.getsize(resumed / "trials" / t["trial"] / name) > 0
    status = json.load(open(resumed / "status.json"))
    assert status["done"] == 2 and "stopped" not in status and not (resumed / ".space-reserve").exists()


# -------------------------------------------------------------------------- C. ONNX Runtime session failures
ROUND_PY = """import torch
import torch.nn as nn


class Net(nn.Module):  # round(h): its gradient is 0, and onnxruntime-training 1.19 has no gradient for Round
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h + torch.round(h))


def make():
    return Net()
"""


def _array(tmp_path, capsys, source: str, shape: list[int]) -> tuple[str, str]:
    """Two models of ``source`` exported and fused into tmp_path/arr; a data file for them."""
    (tmp_path / "net.py").write_text(source)
    assert cli(capsys, "export", f"{tmp_path / 'net.py'}:make", "--count", 2, "--input-shape",
               ",".join(map(str, shape)), "-o", tmp_path / "jobs")[0] == 0
    assert cli(capsys, "fuse", tmp_path / "jobs", "-o", tmp_path / "arr")[0] == 0
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", input=rng.standard_normal([32] + shape[1:]).astype(np.float32),
             labels=rng.integers(0, 3, 32))
    return str(tmp_path / "arr"), str(tmp_path / "d.npz")


def test_ort_session_failure_names_the_node_and_no_torch_suggestion_without_a_torch_kernel(tmp_path, capsys):
    """An antialiased Resize: onnxruntime-training cannot train it, and the torch runtime's Resize kernel does not
    cover antialias either. One line naming the node and ORT's cause, and no --runtime torch suggestion (it says
    the torch runtime cannot run it). (Det was this test's model until the torch runtime had a kernel for every
    operator; a bidirectional GRU before that.)"""
    from onnx import TensorProto, helper, numpy_helper

    jobs = tmp_path / "jobs"
    jobs.mkdir()
    for b in range(2):
        w = np.random.default_rng(b).standard_normal((3, 2 * 8 * 8)).astype(np.float32)
        graph = helper.make_graph(
            [helper.make_node("Resize", ["input", "", "scales"], ["big"], name="smooth", mode="linear", antialias=1),
             helper.make_node("Flatten", ["big"], ["flat"]),
             helper.make_node("Gemm", ["flat", "w"], ["output"], transB=1)],
            "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 2, 4, 4])],
            [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 3])],
            [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"), numpy_helper.from_array(w, "w")])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8),
                  str(jobs / f"model_{b}.onnx"))
    assert cli(capsys, "fuse", jobs, "-o", tmp_path / "arr")[0] == 0
    np.savez(tmp_path / "d.npz", input=np.ones((8, 2, 4, 4), np.float32), labels=np.zeros(8, np.int64))
    code, _, err = cli(capsys, "train", tmp_path / "arr", "--data", tmp_path / "d.npz", "--runtime", "ort",
                       "--steps", 1, "--batch-size", 8, "-q")
    line = one_error_line(err)
    assert code == 2 and "smooth" in line and "(Resize" in line, line
    assert "--runtime torch (" not in line and "antialias" in line, line


def test_ort_failure_suggests_the_torch_runtime_exactly_when_it_can_train_the_array(tmp_path, capsys):
    """round(): onnxruntime-training has no gradient builder for Round (the training graph cannot be built, and
    today its log floods stderr); the torch runtime has a kernel for every op. One line naming the node and
    suggesting --runtime torch, and that suggestion holds: the same array trains with it."""
    arr, data = _array(tmp_path, capsys, ROUND_PY, [8, 4])
    args = ["--data", data, "--steps", 2, "--batch-size", 8, "-q"]
    code, _, err = cli(capsys, "train", arr, "--runtime", "ort", *args)
    line = one_error_line(err)
    assert code == 2 and "node '/Round' (Round)" in line and "gradient builder has not been registered" in line, line
    assert "train this array with --runtime torch" in line, line
    code, out, err = cli(capsys, "train", arr, "--runtime", "torch", *args)
    assert code == 0, err
