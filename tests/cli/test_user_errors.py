"""Nothing a user or a disk can cause is an "internal error" (issue 19, items 4 and 6): state files are checked
against the array they belong to when read, every bad value is one `onnxfuse: error:` line (exit status 2) naming
the file, key or setting, and the small messages say what is true."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.conftest import cli, fresh_copy, mlp_array, one_error_line, snapshot
from onnxfuse.cli.main import main

SHAPE = (8, 3, 4, 4)  # the MLP of conftest: 48 inputs


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """3 MLPs fused, a data file, and a finished 10-step SGD-momentum run with checkpoints at 5 and 10."""
    d = tmp_path_factory.mktemp("user_errors")
    mlp_array(d, 3, seed0=30, n=96)
    assert main(["train", str(d / "array"), "--data", str(d / "data.npz"), "--batch-size", "16", "--steps", "10",
                 "--momentum", "0.9", "--lr", "0.05", "--checkpoint-every", "5", "-q"]) == 0
    return d


@pytest.fixture
def work(template, tmp_path):
    return fresh_copy(template, tmp_path)


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
    header, *table, best = out.splitlines()[1:]  # an evaluation that never ran has no columns (not nan)
    assert "eval" not in header and len(table) == 3 and best.startswith("best: model ") and "nan" not in out

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


def test_a_sweep_into_a_file_is_one_line_and_the_file_stays(work, capsys):
    """`onnxfuse sweep spec.yaml -o AFILE` ended in FileExistsError (exit 1)."""
    (work / "spec.yaml").write_text(
        "model: {factory: onnxfuse.exporters.zoo:MLP, input_shape: [8, 3, 4, 4], args: {in_features: 48}}\n"
        "search: {space: {optimizer.lr: [0.1, 0.01]}}\narrays: {size: 2}\n"
        "data: {train: data.npz}\nsteps: 2\nbatch_size: 16\n")
    (work / "afile").write_text("mine")
    for out, says in ((work / "afile", "exists and is not a folder"), (work / "afile" / "sub", "is a file, not a folder")):
        code, _, err = cli(capsys, "sweep", work / "spec.yaml", "-o", out, "-q")
        line = one_error_line(err)
        assert code == 2 and str(out) in line and says in line, line
    assert (work / "afile").read_text() == "mine"


# ------------------------------------------------------------------------------- every kind of user error
def _user_error_classes() -> set[type]:
    """Every OnnxFuseError subclass the product defines, its modules imported (onnxfuse, training, exporters)."""
    import importlib
    import pkgutil

    from onnxfuse.core.errors import OnnxFuseError

    for package in ("onnxfuse", "onnxfuse.training", "onnxfuse.exporters"):
        root = importlib.import_module(package)
        for m in pkgutil.walk_packages(root.__path__, package + "."):
            if not m.name.endswith("__main__"):
                importlib.import_module(m.name)
    found, todo = set(), [OnnxFuseError]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub)
            todo.append(sub)
    return found


# exit statuses of their own, each with its tests; and a placer's internal signal, caught by the planner
OWN_EXIT = {"VerificationError": "exit 4: tests/training/test_verify.py", "TrainingStoppedError": "exit 3: tests/training/test_run.py",
            "DoesNotFit": "caught in onnxfuse/placement/placers.py, reported as PlacementError"}
ELSEWHERE = {  # classes whose bad input needs a machine condition, tested where that condition is made
    "OutOfMemoryError": "tests/training/test_reliability.py::test_out_of_memory_says_so_and_leaves_the_previous_run_as_it_was",
    "ConcurrentWorkerError":  # a process of `onnxfuse bench --modes concurrent` that fails or is killed
        "tests/measure/test_bench.py::test_a_concurrent_process_that_fails_is_one_error_naming_it_and_every_process_stops",
}


def _graph_file(path, nodes, inputs, outputs, inits=(), opset=17):
    import onnx
    from onnx import helper

    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _det_model(path):
    """x [N, 4, 4] @ W -> Det: an op with no fusion rule, and no gradient in onnxruntime-training."""
    from onnx import TensorProto, helper, numpy_helper

    return _graph_file(path, [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
                              helper.make_node("Det", ["m"], ["y"], name="det")],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
                       [numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")])


def _antialias_model(path):
    """x [N, 2, 4, 4] * w -> Resize(linear, antialias=1): a form the torch runtime's Resize kernel does not cover
    (every op type has a kernel; an attribute form may not)."""
    from onnx import TensorProto, helper, numpy_helper

    return _graph_file(path, [helper.make_node("Mul", ["x", "w"], ["m"], name="scale"),
                              helper.make_node("Resize", ["m", "", "s"], ["y"], name="smooth_resize", mode="linear",
                                               antialias=1)],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 8, 8])],
                       [numpy_helper.from_array(np.full(1, 0.5, np.float32), "w"),
                        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "s")], opset=18)


def _cyclic_model(path):
    from onnx import TensorProto, helper

    return _graph_file(path, [helper.make_node("Add", ["x", "b"], ["a"], name="add"),
                              helper.make_node("Relu", ["a"], ["b"], name="relu")],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                       [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 4])])


def _case(name: str, work) -> tuple[list, "str | None"]:
    """(CLI arguments, the text the line must hold) for the bad input of case ``name``; work/array is idle."""
    arr, data = work / "array", work / "data.npz"
    train = ["train", arr, "--data", data, "--batch-size", 16, "--steps", 2, "-q"]
    if name == "ConfigError":
        return [*train, "--lr", "fast"], "--lr"
    if name == "InputFileError":
        return ["split", work / "no-such-array", "-o", work / "models"], "no-such-array"
    if name == "NotFusibleError":
        return ["fuse", work / "jobs" / "model_0.onnx", _det_model(work / "det.onnx"), "-o", work / "f"], \
            "fuse only models that are the same graph up to weight values"
    if name == "UnsupportedOpError":
        return ["fuse", _det_model(work / "det.onnx"), work / "det.onnx", "--strict", "-o", work / "f"], "'Det'"
    if name == "UnsupportedTorchOpError":  # a form the torch runtime has no kernel for: an antialiased Resize
        assert main(["fuse", str(_antialias_model(work / "aa.onnx")), str(work / "aa.onnx"), "-o", str(work / "d"),
                     "--overwrite"]) == 0
        np.savez(work / "aa.npz", x=np.ones((8, 2, 4, 4), np.float32), labels=np.ones((8, 2, 8, 8), np.float32))
        return ["train", work / "d", "--data", work / "aa.npz", "--loss", "mse", "--batch-size", 4, "--steps", 1,
                "--runtime", "torch", "-q"], "antialias"
    if name == "UntrainableOpError":  # an op ORT cannot differentiate: Det
        pytest.importorskip("onnxruntime.training")
        assert main(["fuse", str(_det_model(work / "det.onnx")), str(work / "det.onnx"), "-o", str(work / "d"),
                     "--overwrite"]) == 0
        np.savez(work / "det.npz", x=np.ones((8, 4, 4), np.float32), labels=np.ones(8, np.float32))
        return ["train", work / "d", "--data", work / "det.npz", "--loss", "mse", "--batch-size", 4, "--steps", 1,
                "--runtime", "ort", "-q"], "Det"
    if name == "DataError":
        np.savez(work / "bad.npz", image=np.zeros((16,) + SHAPE[1:], np.float32), labels=np.zeros(16, np.int64))
        return [*train[:3], work / "bad.npz", *train[4:]], "has no array 'input'"
    if name == "PlacementError":
        return ["place", arr, "--devices", 2, "--memory", "1B", "--costs", "estimate", "-o", work / "p", "-q"], \
            "does not fit"
    if name == "CycleError":
        return ["place", _cyclic_model(work / "cyc.onnx"), "--devices", 2, "-o", work / "p", "-q"], \
            "cyc.onnx: the graph has a cycle: 'add' -> 'relu' -> 'add'"
    if name == "ExportMismatchError":  # TorchScript writes index_add_ over repeated indices as a plain Scatter
        import sys

        import torch

        (work / "ia.py").write_text(INDEX_ADD)
        sys.path.insert(0, str(work))
        try:
            torch.onnx.export(__import__("ia").IA(), (torch.ones(5, 4),), work / "ia.onnx", dynamo=False,
                              input_names=["x"])
        finally:
            sys.path.remove(str(work))
            sys.modules.pop("ia", None)
        return ["fuse", work / "ia.onnx", work / "ia.onnx", "-o", work / "ia", "--like", f"{work / 'ia.py'}:IA"], \
            "'/ScatterElements'"
    if name == "OutputError":
        return ["split", arr, "--initial", "-o", "/proc/onnxfuse-test/models"], "/proc/onnxfuse-test/models"
    raise AssertionError(f"no case for {name}: add one to _case")


INDEX_ADD = ("import torch\nclass IA(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
             "        self.lin = torch.nn.Linear(4, 4)\n        self.register_buffer('dst', torch.tensor([1, 2, 2, 0, 0]))\n"
             "    def forward(self, x):\n        return torch.zeros(5, 4).index_add_(0, self.dst, self.lin(x))\n")


HOLDER = ("import sys, time\nfrom onnxfuse.core._lock import folder_lock\nwith folder_lock(sys.argv[1], 'train'):\n"
          "    print('held', flush=True)\n    time.sleep(120)\n")


def test_every_kind_of_user_error_is_one_line_and_exit_status_2(work, capsys):
    """Each exception class a command meets from bad input (every OnnxFuseError subclass the product defines,
    found by walking its modules, so a new one needs a case here) reaches the user as one `onnxfuse: error:` line
    with exit status 2, and is that class (checked in the --verbose traceback)."""
    import subprocess
    import sys

    classes = {c.__name__ for c in _user_error_classes()}
    assert classes >= {"ConfigError", "InputFileError", "DataError", "ArrayBusyError", "UnsupportedTorchOpError"}
    shutil.copytree(work / "array", work / "busy")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(work / "busy")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for name in sorted(classes - set(OWN_EXIT) - set(ELSEWHERE)):
            args, says = (["report", work / "busy"], f"pid {holder.pid}") if name == "ArrayBusyError" else \
                _case(name, work)
            capsys.readouterr()  # what making the case printed
            code, _, err = cli(capsys, *args)
            line = one_error_line(err)
            assert code == 2 and says in line, (name, line)
            code, _, err = cli(capsys, "-v", *args)
            assert code == 2 and err.strip().splitlines()[-1] == line
            assert f".{name}: " in err, (name, err[-600:])  # the traceback ends in this very class
    finally:
        holder.kill()
        holder.wait()
