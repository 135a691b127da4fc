"""Shared helpers: build real torch models, export them, run ONNX with onnxruntime, compare numbers."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh
import onnxruntime as ort
import pytest
import torch

from onnxfuse.exporters import export_module, zoo

ort.set_default_logger_severity(3)

#: the repository's root (README.md, docs/, benchmarks/), whatever folder of tests/ a test is in
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchvision_importable() -> None:
    """PyPI's torchvision wheel does not load its C++ ops beside torch's CPU build (2.13.0+cpu), and its import
    then fails registering fake kernels for two of them ("operator torchvision::nms does not exist"); transformers
    imports torchvision wherever it is installed, so that failure would take transformers down too. The models the
    tests build (torchvision's RegNet, transformers' BERT, GPT-2, T5) use none of those ops: where the import
    fails that way, the two ops are declared (never run) and torchvision imported again."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        for key in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[key]
        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        globals()["_TORCHVISION_OPS"] = lib  # the declarations live as long as the library object
        import torchvision  # noqa: F401,F811


_torchvision_importable()

# onnxfuse's compile cache (inductor's code, and the compile times --compile auto decides by) is this session's
# own: what a developer compiled before changes neither the decisions nor the timings the tests see. Subprocesses
# inherit it.
if "ONNXFUSE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["ONNXFUSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="onnxfuse-test-cache-")

# name -> (factory, example input shape)
MODELS = {
    "lenet": (lambda: zoo.LeNet(), (8, 1, 28, 28)),
    "cnn_bn": (lambda: zoo.CNNBN(in_ch=3, width=8), (8, 3, 12, 12)),
    "mlp": (lambda: zoo.MLP(in_features=48, hidden=32), (8, 3, 4, 4)),
}


def rel_err(actual, expected) -> float:
    """Norm-wise relative error ||a - e|| / ||e|| (0 when both are zero)."""
    a, e = np.asarray(actual, np.float64).ravel(), np.asarray(expected, np.float64).ravel()
    denom = np.linalg.norm(e)
    return float(np.linalg.norm(a - e) / denom) if denom > 0 else float(np.linalg.norm(a - e))


def make_modules(name: str, B: int, seed0: int = 0) -> list[torch.nn.Module]:
    factory, _ = MODELS[name]
    mods = []
    for b in range(B):
        torch.manual_seed(seed0 + b)
        mods.append(factory())
    return mods


def export_all(mods, shape, folder) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    paths = []
    for b, m in enumerate(mods):
        p = os.path.join(folder, f"model_{b}.onnx")
        export_module(m, p, input_shape=shape)
        paths.append(p)
    return paths


def run_onnx(model, feeds: dict) -> list[np.ndarray]:
    """Run with graph optimizations off: onnxruntime 1.19's ConvBNFusion ignores BatchNormalization's
    training_mode, so an optimized session computes a training-mode graph wrongly (seen on exported models)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# The runtimes every equivalence test runs on (onnxfuse/recipe/runtimes.py's RUNTIMES): ONNX Runtime training and PyTorch.
# A test that takes ``runtime`` keeps each promise on both; one about an ORT-specific defect names "ort" itself.
# Where onnxruntime-training is not installed (the torch extra alone), the "ort" cases are skipped.
def _have_ort_training() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("onnxruntime.training") is not None
    except ImportError:
        return False


RUNTIME_NAMES = ("ort", "torch")
RUNTIME_PARAMS = [pytest.param("ort", id="ort", marks=pytest.mark.skipif(
                      not _have_ort_training(), reason="onnxruntime-training is not installed (pip install .[cpu])")),
                  pytest.param("torch", id="torch")]


@pytest.fixture(params=RUNTIME_PARAMS)
def runtime(request) -> str:
    return request.param


# ---- small hand-built graphs (onnx.helper) for rule tests
def mlp_array(folder, B: int, seed0: int = 0, n: int | None = 64, array: str = "array", jobs: str = "jobs"):
    """``folder``/``array``: B of conftest's MLPs, exported to ``folder``/``jobs`` and fused (inputs [N, 3, 4, 4]);
    ``folder``/data.npz: ``n`` random samples with 10 classes (None: no data file). Returns ``folder``."""
    from onnxfuse import fuse_models, save_array

    save_array(fuse_models(export_all(make_modules("mlp", B, seed0=seed0), (8, 3, 4, 4), folder / jobs)),
               folder / array)
    if n is None:
        return folder
    rng = np.random.default_rng(0)
    np.savez(folder / "data.npz", input=rng.standard_normal((n, 3, 4, 4)).astype(np.float32),
             labels=rng.integers(0, 10, n))
    return folder


def fuzz_case(seed: int, tmp_path):
    """The fuzzer's model of ``seed`` at B = 2, exported: ``(case, paths, per-model inputs)``; a skip where torch
    cannot export it."""
    from fuzz.grammar import generate, render
    from fuzz.harness import _Case, _Invalid, _export

    spec = generate(seed)
    case = _Case(render(spec), seed, spec.per_model_inputs, 2)
    try:
        paths = _export(case, str(tmp_path))
    except _Invalid as e:
        pytest.skip(f"torch cannot export seed {seed}: {e}")
    return case, paths, ("input",) if spec.per_model_inputs else ()


def holder_pid(folder) -> int | None:
    """The pid in ``folder``'s lock file (the process that holds it), None when nobody does."""
    import json

    try:
        text = open(os.path.join(folder, ".onnxfuse.lock")).read().strip()
        return json.loads(text).get("pid") if text else None
    except (OSError, ValueError):
        return None


def wait_until(p: subprocess.Popen, condition, what: str = "no progress") -> None:
    """Poll until ``condition()`` holds while ``p`` runs; a failure if ``p`` ends first (with what it wrote) or
    after 120 s (the deadline only stops a broken run from hanging the suite)."""
    import time

    deadline = time.time() + 120
    while not condition():
        assert p.poll() is None, f"the process ended first: {p.communicate()}"
        assert time.time() < deadline, f"{what} in 120 s"
        time.sleep(0.02)


def kill(p: subprocess.Popen) -> None:
    """SIGKILL ``p`` and reap it: a process stopped where it stands, as a crash would."""
    p.kill()
    p.wait()


def graph_model(nodes, inputs, outputs, inits, opset=17):
    g = h.make_graph(nodes, "g", inputs, outputs, inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def vinfo(name, shape, dtype=TP.FLOAT):
    return h.make_tensor_value_info(name, dtype, shape)


def rand_init(rng, name, shape):
    return nh.from_array(rng.standard_normal(shape).astype(np.float32), name)


def check_fused(build, B, feeds, rng=None, tol=1e-5, strategy=None):
    """B models from ``build(rng_b)`` with different weights: the fused graph (nodes in the forms ``strategy``
    picks) equals each model."""
    from onnxfuse import fuse_models

    models = [build(np.random.default_rng(100 + b)) for b in range(B)]
    fa = fuse_models(models, strategy=strategy)
    fused = run_onnx(fa.model, feeds)
    for b, m in enumerate(models):
        for out, ref in zip(fused, run_onnx(m, feeds)):
            assert rel_err(out[b], ref) < tol, f"model {b}"
    return fa


def snapshot(folder) -> dict:
    """Every file under ``folder`` by relative path -> its sha256: equal snapshots, nothing written or changed."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


# ---- the command line as a user meets it
EXE = os.path.join(os.path.dirname(sys.executable), "onnxfuse")  # the installed command, for other processes


def cli(capsys, *args) -> tuple[int, str, str]:
    """``onnxfuse ARGS`` in this process: (exit status, stdout, stderr)."""
    from onnxfuse.cli.main import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    """The single line a failure prints (exit status 2): `onnxfuse: error: ...`, no internal error."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnxfuse: error: "), err
    return lines[0]


_USERNS: list[bool] = []


def have_userns() -> bool:
    """Whether `unshare -rm` works here (user and mount namespaces: a tmpfs of our own, root or not)."""
    if not _USERNS:
        ok = shutil.which("unshare") is not None and shutil.which("mount") is not None
        if ok:
            ok = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs /mnt || exit 1"],
                                capture_output=True).returncode == 0
        _USERNS.append(ok)
    return _USERNS[0]


def in_tmpfs(script: str, mount: str, options: str, **env) -> subprocess.CompletedProcess:
    """Run ``script`` (sh) in a mount namespace where ``mount`` is a fresh tmpfs mounted with ``options``."""
    full = f'mount -t tmpfs -o {options} tmpfs "{mount}" || exit 99\n{script}'
    return subprocess.run(["unshare", "-rm", "sh", "-ec", full], capture_output=True, text=True,
                          env={**os.environ, **{k: str(v) for k, v in env.items()}})


def fresh_copy(template, tmp_path):
    """A test's own copy of a module's prepared folder (its array, jobs and data.npz), so no test sees another's."""
    for name in ("array", "jobs"):
        shutil.copytree(template / name, tmp_path / name)
    shutil.copy(template / "data.npz", tmp_path / "data.npz")
    return tmp_path


def write_spec(folder, raw) -> str:
    """A sweep spec ``raw`` written as folder/spec.yaml."""
    import yaml

    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


# The files whose tests compare numbers with torch alone, float64 or ONNX Runtime: what another CPU's kernels can
# move. `make test-isa` runs them (marker "numerical") with torch, oneDNN and MKL told to use a lower instruction set
# (onnxfuse.runtime._machine.ISA_ENV); .ci/run runs them under AVX2 after `make test`.
NUMERICAL = {"test_dynamo_export", "test_forms", "test_fuse_forward", "test_fuzz", "test_gan", "test_hfta_models",
             "test_legalize", "test_losses", "test_optim_schedules", "test_precision", "test_real_models", "test_recurrent",
             "test_regressions", "test_rules", "test_rules_axes", "test_semantics", "test_patterns",
             "test_users_loop", "test_kernels", "test_trains_like_alone", "test_verify", "test_verify_sensitivity",
             "test_zoo"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in NUMERICAL:
            item.add_marker(pytest.mark.numerical)
