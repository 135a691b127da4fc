"""Process-wide settings are opt-in (issue 38 item 5): the Python API (import, ``onnxfuse.fuse``, a step of the
array in a user's loop, ``train_array``) leaves torch's thread count, its denormal mode and glibc's allocator as
the user's process had them; ``tune_process()`` and the command line make them.

Each is read from the process itself, in a fresh interpreter: ``torch.get_num_threads()``; whether a float32
denormal survives a multiplication (flushing turns it into 0); whether anything looked up glibc's ``mallopt``
(the only way to change its thresholds: glibc has no call that reads them back)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import mlp_array

B = 2

PROBE = r'''
import ctypes, json, sys
looked_up = []

class _Recording(ctypes.CDLL):
    def __getattr__(self, name):
        looked_up.append(name)
        return super().__getattr__(name)

ctypes.CDLL = _Recording
import torch

torch.set_num_threads(3)
tiny = torch.tensor([1e-39])  # a float32 denormal

def state():
    return {"threads": torch.get_num_threads(), "denormals": float((tiny * 1.0)[0]) != 0.0,
            "mallopt": "mallopt" in looked_up}

states = {"before": state()}
import onnxfuse

nets = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)) for _ in range(2)]
arr = onnxfuse.fuse(nets, torch.randn(5, 4))
opt = onnxfuse.optim.SGD(arr, lr=[0.1, 0.01])
arr(torch.randn(5, 4)).sum().backward()
opt.step()
step = onnxfuse.optim.train_step(arr, opt, lambda out, y: (out - y).pow(2).flatten(1).mean(1), compile="off")
step(torch.randn(5, 4), torch.randn(5, 3))
states["fuse and steps"] = state()
if sys.argv[1] != "-":
    from onnxfuse.training.run import TrainConfig, train_array

    train_array(sys.argv[1], sys.argv[2], TrainConfig(steps=2, batch_size=8, verify_steps=1), progress=False)
    states["train_array"] = state()
from onnxfuse.runtime.process import tune_process

tune_process()
states["tune_process()"] = state()
print(json.dumps(states))
'''


def probe(*args) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return mlp_array(tmp_path_factory.mktemp("process"), B, seed0=5, n=32)


def test_the_python_api_leaves_the_process_as_it_found_it_and_tune_process_tunes_it(work):
    states = probe(work / "array", work / "data.npz")
    untouched = {"threads": 3, "denormals": True, "mallopt": False}
    assert states["before"] == untouched
    assert states["fuse and steps"] == untouched
    assert states["train_array"] == untouched
    tuned = states["tune_process()"]
    assert tuned["threads"] == 1 and not tuned["denormals"]
    assert tuned["mallopt"] == sys.platform.startswith("linux")


def test_a_run_that_asks_for_threads_or_tuning_gets_them(work):
    """``threads`` given is asked for; ``tune_process=True`` makes what the command line makes."""
    code = r'''
import json, sys, torch
torch.set_num_threads(3)
from onnxfuse.training.run import TrainConfig, train_array
train_array(sys.argv[1], sys.argv[2], TrainConfig(steps=2, batch_size=8, verify_steps=1, threads=2), progress=False)
asked = torch.get_num_threads()
train_array(sys.argv[1], sys.argv[2], TrainConfig(steps=2, batch_size=8, verify_steps=1), progress=False,
            tune_process=True)
print(json.dumps([asked, torch.get_num_threads(), float((torch.tensor([1e-39]) * 1.0)[0])]))
'''
    out = subprocess.run([sys.executable, "-c", code, str(work / "array"), str(work / "data.npz")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [2, 1, 0.0]


def test_the_command_line_tunes_its_process(work, monkeypatch, capsys):
    """``onnxfuse train`` in this process: it sets one thread (the tests' own count is put back after)."""
    import torch

    from tests.conftest import cli

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        code, _, err = cli(capsys, "train", work / "array", "--data", work / "data.npz", "--steps", 2,
                           "--batch-size", 8, "-q")
        assert code == 0, err
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_every_process_that_measures_is_tuned_as_a_training_process_is():
    """A benchmark script or a bench mode's worker process that set only torch's threads measured in a process
    unlike the one `onnxfuse train` and `onnxfuse bench` run in (denormals kept, glibc's heap returned): a compiled
    dense ResNet-18 forward and backward took 582 ms there against 422 in a tuned process (AVX2, 2-core EPYC).
    Threads are set by ``tune_process`` alone; only it and the torch trainer (which applies a run's ``threads``
    setting) call ``torch.set_num_threads``."""
    import pathlib

    from tests.conftest import ROOT

    allowed = {"onnxfuse/runtime/process.py", "onnxfuse/runtime/torch/trainer.py"}
    root = pathlib.Path(ROOT)
    callers = sorted(str(p.relative_to(root)) for folder in ("onnxfuse", "benchmarks", "fuzz", "examples")
                     for p in (root / folder).rglob("*.py")
                     if "set_num_threads(" in p.read_text())
    assert [c for c in callers if c not in allowed] == [], "call onnxfuse.runtime.process.tune_process instead"
    assert set(callers) == allowed  # the scan finds what it looks for
