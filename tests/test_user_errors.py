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


# ------------------------------------------------------------------------------------------- small messages
def _bad_data(work, case) -> tuple[str, str]:
    """(data file, what its error says) for a data file that is not what it should be."""
    path = work / f"{case}.npz"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96,) + SHAPE[1:]).astype(np.float32)
    if case == "text":
        path.write_text("input,labels\n1,2\n")
        return path, "is not an .npz archive"
    if case == "npy":
        with open(path, "wb") as f:
            np.save(f, x)
        return path, "is a single .npy array, not an .npz archive"
    if case == "empty":
        path.write_bytes(b"")
        return path, "is empty"
    if case == "pickled":
        np.savez(path, input=np.array([object()] * 96, dtype=object), labels=np.zeros(96, np.int64))
        return path, "holds an object array (pickled Python objects)"
    if case == "complex":
        np.savez(path, input=x + 1j * x, labels=rng.integers(0, 10, 96))
        return path, "'input' holds complex numbers (complex64), but the graph reads it as float32"
    np.savez(path, input=np.full((96,) + SHAPE[1:], "a"), labels=rng.integers(0, 10, 96))
    return path, "'input' holds text (<U1)"


@pytest.mark.parametrize("case", ["text", "npy", "empty", "pickled", "complex", "strings"])
def test_a_data_file_that_is_not_numbers_in_an_npz_says_what_it_is(case, work, capsys):
    """A text file given as .npz was blamed on "pickled data"; complex input was cast to float32 with only
    numpy's ComplexWarning (training on the real part)."""
    path, says = _bad_data(work, case)
    before = snapshot(work / "array")
    code, _, err = cli(capsys, "train", work / "array", "--data", path, "--batch-size", 16, "--steps", 2, "-q")
    line = one_error_line(err)
    assert code == 2 and f"{path.name}" in line and says in line, line
    assert snapshot(work / "array") == before


def test_small_messages_say_what_is_true(work, capsys):
    """Each was misleading: "array folder 'good.npz' does not exist" for a file; "Nodes in a graph must be
    topologically sorted" for a graph without its weights; `batch_size is 16.0 ... 32.0`; a suggested command
    that breaks on a path with a space; `nan / nan%` for an evaluation that never ran; plan -o DIR refused only
    after its probes trained; bench of a weightless model an internal error."""
    arr, data = work / "array", work / "data.npz"
    code, _, err = cli(capsys, "train", data, "--data", data, "--batch-size", 16, "--steps", 2)
    assert code == 2 and "'" + str(data) + "' is a file, not an array folder" in one_error_line(err)
    for cmd in (["split", data, "-o", work / "models"], ["report", data]):
        code, _, err = cli(capsys, *cmd)
        assert code == 2 and "is a file, not an array folder" in one_error_line(err), cmd

    code, _, err = cli(capsys, "fuse", arr / "sources" / "model_0.onnx", arr / "sources" / "model_1.onnx", "-o",
                       work / "weightless")
    line = one_error_line(err)
    assert code == 2 and "reads 'fc1.weight', which is neither a graph input, an initializer" in line
    assert "lacks its weights" in line and "topologically" not in line

    code, _, err = cli(capsys, "train", arr, "--resume", "--batch-size", 32, "--steps", 12)
    assert code == 2 and "setting 'batch_size' is 32 but run " in one_error_line(err) and "trained with 16 " in err

    spaced = work / "my arrays" / "a 1"
    shutil.copytree(arr, spaced)
    os.remove(spaced / "metrics.csv")
    code, _, err = cli(capsys, "report", spaced)
    assert code == 2 and f"`onnxfuse train '{spaced}' ...`" in one_error_line(err)

    code, out, err = cli(capsys, "train", arr, "--data", data, "--batch-size", 16, "--steps", 2, "-q")
    assert code == 0, err
    table = out.splitlines()[2:]
    assert len(table) == 3 and all(r.split()[2:4] == ["-", "-"] for r in table) and "nan" not in out

    (work / "pdir").mkdir()
    code, out, err = cli(capsys, "plan", "lenet", "--probe", "1,2", "--batch", 2, "-o", work / "pdir")
    assert code == 2 and "is a folder; give a file path" in one_error_line(err) and out == ""

    (work / "nop.py").write_text("import torch\n\nclass M(torch.nn.Module):\n    def forward(self, x):\n"
                                 "        return torch.relu(x).flatten(1)\n\ndef make():\n    return M()\n")
    assert cli(capsys, "export", f"{work / 'nop.py'}:make", "--count", 1, "--input-shape", "4,3,4,4", "-o",
               work / "nop")[0] == 0
    for cmd in (["bench", "--models", work / "nop" / "model_0.onnx", "--B", 1, "--steps", 1, "--rounds", 1,
                 "--warmup", 0, "--modes", "torch", "-o", work / "bench"],
                ["plan", work / "nop" / "model_0.onnx", "--probe", "1,2", "--batch", 2]):
        code, _, err = cli(capsys, *cmd)
        assert code == 2 and "has no weights" in one_error_line(err), cmd
    assert not (work / "bench").exists()
