"""Nothing a user or a disk can cause is an "internal error" (issue 19, items 4 and 6): state files are checked
against the array they belong to when read, every bad value is one `onnxfuse: error:` line (exit status 2) naming
the file, key or setting, and the small messages say what is true."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import export_all, make_modules, snapshot
from onnxfuse import fuse_models, save_array
from onnxfuse.cli import main

SHAPE = (8, 3, 4, 4)  # the MLP of conftest: 48 inputs


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnxfuse: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """3 MLPs fused, a data file, and a finished 10-step SGD-momentum run with checkpoints at 5 and 10."""
    d = tmp_path_factory.mktemp("user_errors")
    save_array(fuse_models(export_all(make_modules("mlp", 3, seed0=30), SHAPE, d / "jobs")), d / "array")
    rng = np.random.default_rng(0)
    np.savez(d / "data.npz", input=rng.standard_normal((96,) + SHAPE[1:]).astype(np.float32),
             labels=rng.integers(0, 10, 96))
    assert main(["train", str(d / "array"), "--data", str(d / "data.npz"), "--batch-size", "16", "--steps", "10",
                 "--momentum", "0.9", "--lr", "0.05", "--checkpoint-every", "5", "-q"]) == 0
    return d


@pytest.fixture
def work(template, tmp_path):
    for name in ("array", "jobs"):
        shutil.copytree(template / name, tmp_path / name)
    shutil.copy(template / "data.npz", tmp_path / "data.npz")
    return tmp_path


def _edit(path, change) -> str:
    """Rewrite the safetensors file ``path`` with ``change(tensors)`` applied; returns the tensor changed."""
    tensors = load_file(str(path))
    name = change(tensors)
    save_file(tensors, str(path))
    return name


def _shrink(tensors) -> str:  # a tensor of the wrong shape (as in the issue: 2 numbers where 16 belong)
    name = sorted(tensors)[0]
    tensors[name] = np.zeros(2, tensors[name].dtype)
    return name


def _retype(tensors) -> str:
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].astype(np.float64)
    return name


def _drop(tensors) -> str:
    name = sorted(tensors)[-1]
    del tensors[name]
    return name


def _add(tensors) -> str:
    tensors["stranger"] = np.zeros(3, np.float32)
    return "stranger"


@pytest.mark.parametrize("change", [_shrink, _retype, _drop, _add], ids=["shape", "dtype", "missing", "extra"])
@pytest.mark.parametrize("where", ["trained", "checkpoint_weights", "checkpoint_optimizer"])
def test_a_state_tensor_that_does_not_fit_the_array_is_one_line_naming_file_and_tensor(where, change, work, capsys):
    """A wrong-shaped tensor in trained/weights.safetensors made `split` fail with "ValueError: cannot reshape
    array of size 2 into shape (16,)", the same in a checkpoint's weights or optimizer state made `train
    --resume` fail with "RuntimeError: shape '[12]' is invalid for input of size 3" (exit 1): each is checked
    against the array's spec when read (name, shape, dtype of every tensor), one line, nothing written."""
    arr = work / "array"
    if where == "trained":
        path, args = arr / "trained" / "weights.safetensors", ["split", arr, "-o", work / "models"]
    else:
        name = "weights" if where == "checkpoint_weights" else "optimizer_state"
        path = arr / "checkpoints" / "step_00000010" / f"{name}.safetensors"
        args = ["train", arr, "--resume", "--steps", 12, "-q"]
    tensor = _edit(path, change)
    before = snapshot(arr)
    code, _, err = cli(capsys, *args)
    line = one_error_line(err)
    assert code == 2 and str(path) in line and f"'{tensor}'" in line, line
    assert snapshot(arr) == before and not (work / "models").exists()
