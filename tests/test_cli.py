"""The command line end to end, and every bad input: one clear line, exit code 2, nothing written."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from conftest import snapshot
from onnxfuse.cli.main import main


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def array_dir(tmp_path_factory):
    """export (CLI) -> fuse (CLI) for 3 LeNets, and a data file: shared by the tests below."""
    d = tmp_path_factory.mktemp("cli")
    assert main(["export", "onnxfuse.exporters.zoo:LeNet", "--count", "3", "--seeds", "5,6,7",
                 "--input-shape", "4,1,28,28", "-o", str(d / "jobs")]) == 0
    assert main(["fuse", str(d / "jobs"), "-o", str(d / "array")]) == 0
    rng = np.random.default_rng(0)
    np.savez(d / "data.npz", input=rng.standard_normal((40, 1, 28, 28)).astype(np.float32),
             labels=rng.integers(0, 10, 40))
    return d


def test_export_fuse_train_split(array_dir, capsys):
    d = array_dir
    code, out, _ = run_cli(["train", d / "array", "--data", d / "data.npz", "--optimizer", "sgd",
                            "--lr", "0.1,0.05,0.01", "--momentum", "0.9", "--steps", "4", "--batch-size", "8",
                            "--no-shuffle", "-q"], capsys)
    assert code == 0 and "trained 3 models for 4 steps" in out
    rows = list(csv.DictReader(open(d / "array" / "metrics.csv")))
    assert len(rows) == 12 and {r["lr"] for r in rows} == {"0.1", "0.05", "0.01"}
    code, out, _ = run_cli(["split", d / "array", "-o", d / "models"], capsys)
    assert code == 0
    assert sorted(os.listdir(d / "models")) == sorted(f"model_{b}.{e}" for b in range(3) for e in ("onnx", "safetensors"))


def test_console_script_prints_one_line_without_traceback(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "onnxfuse")
    r = subprocess.run([exe, "fuse", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert "nope.onnx' does not exist" in r.stderr
    assert not (tmp_path / "out").exists()


def _topk_model(path):
    g = h.make_graph([h.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
                      h.make_node("TopK", ["a", "k"], ["y", "i"], name="pick_top2")], "g",
                     [h.make_tensor_value_info("x", TP.FLOAT, [3, 4])], [h.make_tensor_value_info("y", TP.FLOAT, [3, 2])],
                     [nh.from_array(np.ones((4, 5), np.float32), "w"), nh.from_array(np.array([2], np.int64), "k")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


@pytest.mark.parametrize("case", ["not_identical", "unsupported_op", "corrupt", "missing"])
def test_fuse_bad_input(case, array_dir, tmp_path, capsys):
    jobs = array_dir / "jobs"
    if case == "not_identical":
        assert main(["export", "onnxfuse.exporters.zoo:MLP", "--count", "1", "--input-shape", "4,1,8,8",
                     "-o", str(tmp_path / "mlp")]) == 0
        capsys.readouterr()
        files, expect = [jobs / "model_0.onnx", tmp_path / "mlp" / "model_0.onnx"], "fuse only models that are"
    elif case == "unsupported_op":
        files = [_topk_model(tmp_path / "a.onnx"), _topk_model(tmp_path / "b.onnx")]
        expect = "node 'pick_top2' has op type 'TopK', which has no fusion rule"
    elif case == "corrupt":
        (tmp_path / "bad.onnx").write_bytes(b"\x08\x07 this is not protobuf \xff\xfe" * 10)
        files, expect = [jobs / "model_0.onnx", tmp_path / "bad.onnx"], "is not a readable ONNX model"
    else:
        files, expect = [jobs / "model_0.onnx", tmp_path / "gone.onnx"], "gone.onnx' does not exist"
    out_dir = tmp_path / "array_out"
    code, _, err = run_cli(["fuse", *files, "-o", out_dir, "--strict"], capsys)
    assert code == 2 and expect in err and err.count("\n") == 1, err
    assert not out_dir.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".array_out")]  # no temporary leftovers


@pytest.mark.parametrize("case", ["lr_length", "missing_input", "missing_data_file", "negative_lr", "bad_labels",
                                  "no_cuda"])
def test_train_bad_input_leaves_array_untouched(case, array_dir, tmp_path, capsys):
    d = array_dir
    data = d / "data.npz"
    lr = "0.1,0.05,0.01"
    if case == "lr_length":
        lr, expect = "0.1,0.05", "--lr: optimizer.lr has 2 values but the array has B=3 models"
    elif case == "missing_input":
        np.savez(tmp_path / "d.npz", image=np.zeros((8, 1, 28, 28), np.float32), labels=np.zeros(8, np.int64))
        data, expect = tmp_path / "d.npz", "has no array 'input'"
    elif case == "missing_data_file":
        data, expect = tmp_path / "none.npz", "none.npz' does not exist"
    elif case == "bad_labels":
        np.savez(tmp_path / "d.npz", input=np.zeros((8, 1, 28, 28), np.float32), labels=np.arange(8) * 2)
        data, expect = tmp_path / "d.npz", "'labels' must be class indices in [0, 10)"
    elif case == "no_cuda":  # the CPU build of onnxruntime-training has no CUDA provider
        import onnxruntime

        if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            pytest.skip("the GPU build is installed")
        expect = "--device cuda: this onnxruntime-training build has no CUDA support"
    else:
        lr, expect = "0.1,-0.05,0.01", "--lr: optimizer.lr[1] = -0.05 must be finite and >= 0"
    before = snapshot(d / "array")
    device = ["--device", "cuda"] if case == "no_cuda" else []
    code, _, err = run_cli(["train", d / "array", "--data", data, "--lr", lr, "--steps", "2", "--batch-size", "4",
                            "-q", *device], capsys)
    assert code == 2 and expect in err and err.count("\n") == 1, err
    assert snapshot(d / "array") == before
    assert not [p for p in os.listdir(d / "array") if p.startswith(".") and p != ".onnxfuse.lock"]  # no temporaries


def test_fuse_refuses_to_overwrite(array_dir, capsys):
    before = snapshot(array_dir / "array")
    code, _, err = run_cli(["fuse", array_dir / "jobs", "-o", array_dir / "array"], capsys)
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert snapshot(array_dir / "array") == before


def test_export_bad_input_shape_is_one_line(tmp_path, capsys):
    code, _, err = run_cli(["export", "onnxfuse.exporters.zoo:LeNet", "--count", "2", "--input-shape", "4,3,28,28",
                            "-o", tmp_path / "jobs"], capsys)
    assert code == 2 and "could not export LeNet with input shape(s) [[4, 3, 28, 28]]" in err
    assert err.count("\n") == 1 and not (tmp_path / "jobs").exists()


def test_fuse_falls_back_per_model_and_reports_it(tmp_path, capsys):
    files = [_topk_model(tmp_path / "a.onnx"), _topk_model(tmp_path / "b.onnx")]
    code, out, err = run_cli(["fuse", *files, "-o", tmp_path / "arr"], capsys)
    assert code == 0
    assert "onnxfuse: warning: 1 node(s) run once per model instead of fused: pick_top2 (TopK)" in err
    assert "1 run per model" in out and "fused fraction 50.0%" in out
