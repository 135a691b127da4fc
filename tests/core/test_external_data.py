"""External data never leaves the model's folder: every ONNX file onnxfuse reads (a model given to `fuse`, `plan`,
`bench`, `place`; an array's own `fused.onnx` and `sources/`) has its external data read only from inside the folder
the .onnx file is in, symlinks followed. A location that leads out of it (a symlink, `../`, an absolute path) is one
error line naming the file, the tensor and the location, and no byte of the file it points to reaches any output.
A bad model file or data file (missing, truncated, not ONNX, empty) is one line saying which."""
from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch
from safetensors.numpy import load_file

from onnxfuse.core.array import ArrayDir
from tests.conftest import cli, one_error_line
from onnxfuse.exporters import export_module

# What the file outside the model's folder holds: found in an output, it leaked. As float32 both halves are finite
# (2.1e11 and 5.5e-19), so a loader that follows the link reads weights it can train on.
PATTERN = b"OUTSIDE!"


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> list[onnx.ModelProto]:
    """Two exports of the same MLP with different weights, data inline."""
    folder = tmp_path_factory.mktemp("exported")
    protos = []
    for b in range(2):
        export_module(_module(b), folder / f"model_{b}.onnx", input_shape=(4, 16))
        protos.append(onnx.load(folder / f"model_{b}.onnx"))
    return protos


def save_external(proto: onnx.ModelProto, path: Path, location: str) -> None:
    """``proto`` at ``path`` with every initializer's data in the one file ``location`` next to it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(copy.deepcopy(proto), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0)


def move_out(data: Path, outside: Path) -> None:
    """Replace the data file ``data`` by ``outside``, a file of the same length filled with PATTERN."""
    size = data.stat().st_size
    outside.parent.mkdir(parents=True, exist_ok=True)
    outside.write_bytes((PATTERN * (size // len(PATTERN) + 1))[:size])
    data.unlink()


def relocate(path: Path, location: str) -> None:
    """Point every external tensor of the model at ``path`` to ``location``, its data left where it is."""
    proto = onnx.load(str(path), load_external_data=False)
    for t in proto.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(proto, str(path))


def leaked(root: Path, outside: Path) -> list[str]:
    """Files under ``root`` other than ``outside`` (and the links to it) that hold its pattern."""
    return [str(p) for p in root.rglob("*") if p.is_file() and not p.is_symlink()
            and p.resolve() != outside.resolve() and PATTERN in p.read_bytes()]


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """Temporary files of the command (and of any process it starts) under tmp_path, where `leaked` looks."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def jobs_with_external_data(exported, jobs: Path) -> list[Path]:
    """model_b.onnx in ``jobs``, each with its weights in wb.bin beside it."""
    paths = []
    for b, proto in enumerate(exported):
        save_external(proto, jobs / f"model_{b}.onnx", f"w{b}.bin")
        paths.append(jobs / f"model_{b}.onnx")
    return paths


def _command(name: str, jobs: Path, model: Path, out: Path) -> list:
    return {
        "fuse": ["fuse", jobs, "-o", out],
        "plan": ["plan", model, "--probe", "1,2", "--max-B", "2", "--batch", "2", "--runtime", "torch",
                 "-o", out],
        "bench": ["bench", "--models", model, "--B", "1", "--steps", "1", "--rounds", "1", "--warmup", "0",
                  "--modes", "torch", "--batch", "2", "-o", out],
        "place": ["place", model, "--devices", "2", "-o", out],
    }[name]


@pytest.mark.parametrize("command", ["fuse", "plan", "bench", "place"])
def test_a_symlink_out_of_the_models_folder_is_refused_and_nothing_of_its_target_is_written(
        command, exported, tmp_path, private_tmp, capsys):
    jobs, outside, out = tmp_path / "jobs", tmp_path / "elsewhere" / "secret.bin", tmp_path / "out"
    model = jobs_with_external_data(exported, jobs)[1]
    move_out(jobs / "w1.bin", outside)
    (jobs / "w1.bin").symlink_to(outside)
    tensor = exported[1].graph.initializer[0].name
    code, _, err = cli(capsys, *_command(command, jobs, model, out))
    line = one_error_line(err)
    assert code == 2
    assert "model_1.onnx" in line and f"tensor '{tensor}'" in line and "'w1.bin'" in line, line
    assert "outside the model's folder" in line and str(outside) in line, line
    assert not out.exists()
    assert leaked(tmp_path, outside) == []


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_a_parent_or_absolute_location_is_refused_as_outside_the_models_folder(where, exported, tmp_path,
                                                                                 private_tmp, capsys):
    jobs, outside, out = tmp_path / "jobs", tmp_path / "elsewhere" / "secret.bin", tmp_path / "out"
    model = jobs_with_external_data(exported, jobs)[1]
    move_out(jobs / "w1.bin", outside)
    location = "../elsewhere/secret.bin" if where == "parent" else str(outside)
    relocate(model, location)
    code, _, err = cli(capsys, "fuse", jobs, "-o", out)
    line = one_error_line(err)
    assert code == 2
    assert "model_1.onnx" in line and f"'{location}'" in line and "outside the model's folder" in line, line
    assert "ValidationError" not in line, line
    assert not out.exists()
    assert leaked(tmp_path, outside) == []


@pytest.mark.parametrize("layout", ["beside_the_model", "symlink_inside_the_folder"])
def test_external_data_inside_the_models_folder_fuses_to_the_original_weights(layout, exported, tmp_path, capsys):
    jobs = tmp_path / "jobs"
    jobs_with_external_data(exported, jobs)
    if layout == "symlink_inside_the_folder":  # w1.bin -> data/real.bin, both in jobs/
        (jobs / "data").mkdir()
        os.rename(jobs / "w1.bin", jobs / "data" / "real.bin")
        (jobs / "w1.bin").symlink_to(Path("data") / "real.bin")
    assert cli(capsys, "fuse", jobs, "-o", tmp_path / "array")[0] == 0
    assert cli(capsys, "split", tmp_path / "array", "--initial", "-o", tmp_path / "models")[0] == 0
    for b in range(2):
        written = load_file(str(tmp_path / "models" / f"model_{b}.safetensors"))
        original = {k: v.numpy() for k, v in _module(b).state_dict().items()}
        assert written.keys() == original.keys()
        for k, v in original.items():
            np.testing.assert_array_equal(written[k], v, err_msg=k)


@pytest.mark.parametrize("case, expect", [
    ("missing_data", "'w1.bin', which does not exist"),
    ("truncated_data", "truncated"),
    ("not_onnx", "not ONNX protobuf"),
    ("empty", "is empty"),
])
def test_a_bad_model_or_data_file_is_one_line_saying_which(case, expect, exported, tmp_path, capsys):
    jobs, out = tmp_path / "jobs", tmp_path / "out"
    model = jobs_with_external_data(exported, jobs)[1]
    data = jobs / "w1.bin"
    if case == "missing_data":
        data.unlink()
    elif case == "truncated_data":
        data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
    elif case == "not_onnx":
        model.write_bytes(b"\x08\x07 this is not protobuf \xff\xfe" * 10)
    else:
        model.write_bytes(b"")
    code, _, err = cli(capsys, "fuse", jobs, "-o", out)
    line = one_error_line(err)
    assert code == 2 and "model_1.onnx" in line and expect in line, line
    if case.endswith("_data"):
        assert f"tensor '{exported[1].graph.initializer[0].name}'" in line, line
    assert not out.exists()


@pytest.mark.parametrize("tampered, command", [("fused", "split"), ("fused", "train"), ("source", "split")])
def test_an_arrays_own_files_pointing_outside_are_refused(tampered, command, exported, tmp_path, private_tmp,
                                                          capsys):
    jobs, folder = tmp_path / "jobs", tmp_path / "array"
    jobs.mkdir()
    for b, proto in enumerate(exported):
        onnx.save(proto, jobs / f"model_{b}.onnx")
    assert cli(capsys, "fuse", jobs, "-o", folder)[0] == 0
    array = ArrayDir(folder)
    path = Path(array.fused_path if tampered == "fused" else array.source_path(0))
    outside = tmp_path / "elsewhere" / "secret.bin"
    proto = onnx.load(str(path))
    if not proto.graph.initializer:  # a source is its graph without weights: give it a tensor to point outside
        proto.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(16, np.float32), "extra"))
    path.unlink()
    save_external(proto, path, "data.bin")
    move_out(path.parent / "data.bin", outside)
    (path.parent / "data.bin").symlink_to(outside)
    np.savez(tmp_path / "data.npz", input=np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32),
             labels=np.arange(8) % 3)
    out = tmp_path / "models"
    args = (["split", folder, "--initial", "-o", out] if command == "split" else
            ["train", folder, "--data", tmp_path / "data.npz", "--loss", "cross-entropy", "--optimizer", "sgd",
             "--lr", "0.1", "--steps", "1", "--batch-size", "4"])
    code, _, err = cli(capsys, *args)
    line = one_error_line(err)
    assert code == 2 and path.name in line and f"tensor '{proto.graph.initializer[0].name}'" in line, line
    assert "'data.bin'" in line and "outside the model's folder" in line, line
    assert not out.exists() and not os.path.exists(array.trained_path)
    assert leaked(tmp_path, outside) == []


def test_a_model_in_memory_with_its_external_data_not_loaded_is_refused(exported, tmp_path, monkeypatch):
    """The Python API takes ModelProtos: one read with load_external_data=False would have its data read by onnx
    relative to the current folder, outside any check. It is refused naming the tensor; nothing is read from the
    current folder's file of that name."""
    from onnxfuse import fuse_models
    from onnxfuse.core.errors import InputFileError

    paths = jobs_with_external_data(exported, tmp_path / "jobs")
    protos = [onnx.load(str(p), load_external_data=False) for p in paths]
    here = tmp_path / "cwd"
    here.mkdir()
    for b in range(2):
        (here / f"w{b}.bin").write_bytes((paths[b].parent / f"w{b}.bin").read_bytes())  # bytes a loader could find
    monkeypatch.chdir(here)
    with pytest.raises(InputFileError, match=r"tensor '.*' still has its data in the external file 'w0\.bin'"):
        fuse_models(protos)
    fused = fuse_models([str(p) for p in paths])  # by path, read inside the models' folder: fine
    assert len(fused.spec.weights) == 4
