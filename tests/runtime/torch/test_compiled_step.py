"""The compiled step (``--compile on``: ``onnxfuse/runtime/torch/train_step.py``) keeps every promise of the eager one:
each model equals torch.optim training it alone, a diverging model is frozen at its exact step with the others
bit-identical to a run without it (compiled on both sides), a SIGKILLed compiled run resumes bit-identical to an
uninterrupted compiled run, halving keeps survivors as in the full compiled array, and `check` compares a compiled
array with a compiled reference. Between two logged steps nothing is read back to the host.

Compiling costs seconds per graph on this CPU (inductor; the session's cache is conftest's): the tests share few
graphs. The campaign over every zoo model and fuzz seed is behind ``make test-all`` / ``make fuzz``."""
from __future__ import annotations

import glob
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.conftest import export_all, make_modules, rel_err
from onnxfuse import fuse_models, save_array
from onnxfuse.training.run import TrainConfig, train_array
from tests.training.test_run import (SHAPE, _torch_alone, assert_same_trained_weights, data_file, first_nonfinite_step,
                      make_array, metrics, states)


def _regression_data(tmp_path, n=96):
    rng = np.random.default_rng(0)  # with MSE a too-large lr blows up exponentially
    x = rng.standard_normal((n,) + SHAPE[1:]).astype(np.float32)
    y = rng.standard_normal((n, 10)).astype(np.float32)
    np.savez(tmp_path / "data.npz", input=x, labels=y)
    return tmp_path / "data.npz", x, y


def test_compiled_run_equals_each_model_trained_alone_and_the_eager_run(tmp_path):
    """Adam with per-model learning rates, compiled: every model within 1e-4 of torch.optim.Adam alone, and within
    rounding of the same run eager (the README's figure)."""
    data = data_file(tmp_path, n=96)
    lrs = [0.01, 0.003, 0.001]
    cfg = dict(batch_size=16, steps=12, optimizer="adam", lr=lrs, shuffle=False, runtime="torch")
    arr_c, _ = make_array(tmp_path / "c", 3)
    arr_e, _ = make_array(tmp_path / "e", 3)
    res = train_array(arr_c, data, TrainConfig(compile="on", **cfg), progress=False)
    train_array(arr_e, data, TrainConfig(compile="off", **cfg), progress=False)
    d = dict(np.load(data))
    batches = [(d["input"][i:i + 16], d["labels"][i:i + 16]) for i in range(0, 96, 16)] * 2
    mods = make_modules("mlp", 3, seed0=30)
    compiled, eager = states(arr_c), states(arr_e)
    for b, lr in enumerate(lrs):
        ref = _torch_alone(mods[b], torch.optim.Adam, lr, batches, "cross-entropy")
        for k, v in ref.items():
            assert rel_err(compiled[b][k], v) < 1e-4, (b, k)
            assert rel_err(compiled[b][k], eager[b][k]) < 1e-5, (b, k)
    assert np.isfinite(res.final_loss).all()


@pytest.mark.slow
def test_compiled_divergence_is_frozen_at_its_step_and_the_others_are_bit_identical(tmp_path):
    """Model 1's lr blows it up; the compiled run records it at the step torch alone first goes non-finite (read
    only every 4th step: the step is kept on the device) and models 0 and 2 are bit-identical to a compiled run
    where model 1 did not diverge."""
    data, x, y = _regression_data(tmp_path)
    cfg = dict(batch_size=16, steps=16, optimizer="sgd", shuffle=False, loss="mse", runtime="torch", compile="on",
               log_every=4)
    arr_a, _ = make_array(tmp_path / "a", 3)
    arr_b, _ = make_array(tmp_path / "b", 3)
    res = train_array(arr_a, data, TrainConfig(lr=[0.05, 100.0, 0.02], **cfg), progress=False)
    train_array(arr_b, data, TrainConfig(lr=[0.05, 0.01, 0.02], **cfg), progress=False)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 96, 16)] * 3
    expected = first_nonfinite_step(make_modules("mlp", 3, seed0=30)[1], 100.0, batches)
    assert expected is not None and expected % 4 != 0  # found at a read after the step it happened
    assert res.status == {1: {"status": "diverged", "step": expected}}
    rows = [r for r in metrics(arr_a) if r["status"] == "diverged"]
    assert [(r["model"], int(r["step"])) for r in rows] == [("1", expected)]
    steps = [int(r["step"]) for r in metrics(arr_a) if r["model"] == "0"]
    assert steps == [4, 8, 12, 16]  # log_every 4
    sa, sb = states(arr_a), states(arr_b)
    for b in (0, 2):
        for k in sa[b]:
            assert sa[b][k].tobytes() == sb[b][k].tobytes(), (b, k)
    assert all(np.isfinite(v).all() for v in sa[1].values())


@pytest.mark.slow
def test_no_host_read_between_two_logged_steps_of_a_compiled_run(tmp_path, monkeypatch):
    """Every way a tensor reaches the host (item, cpu, numpy, tolist, __array__, float/int/bool) is counted; a
    compiled run logging every 5th step makes none during the steps in between. Nor does the host compute any
    step's coefficients after the first: the run's 15 steps (less than a window) are computed there at once."""
    from onnxfuse.recipe.optim import OptimizerConfig

    data = data_file(tmp_path, n=96)
    arr, _ = make_array(tmp_path, 3)
    reads, computed = [], []
    original_coefficients = OptimizerConfig.coefficients
    monkeypatch.setattr(OptimizerConfig, "coefficients",
                        lambda self, *a, **k: computed.append(1) or original_coefficients(self, *a, **k))
    for name in ("item", "cpu", "numpy", "tolist", "__array__", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            reads.append(_name)
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    marks = {}
    train_array(arr, data, TrainConfig(batch_size=16, steps=15, optimizer="adamw", lr=[0.01, 0.003, 0.001],
                                       runtime="torch", compile="on", log_every=5, verify_steps=0),
                progress=False, on_step=lambda step, total: marks.setdefault(step, (len(reads), len(computed))))
    assert len(marks) == 15
    for first, last in ((6, 9), (11, 14)):  # after logged step 5 (10) up to the last step before 10 (15)
        assert marks[last][0] == marks[first][0], (first, last, reads[marks[first][0]:marks[last][0]])
    assert marks[10][0] > marks[9][0]  # the logged step reads
    assert marks[1][1] == 15 and marks[15][1] == 15  # every step's coefficients, computed at the first


@pytest.mark.slow
def test_a_partial_last_batch_never_recompiles(tmp_path):
    """A DataLoader of 40 samples in batches of 16 ends each epoch with 8: that step runs the same body eagerly,
    and the compiled graph is built once (dynamo's count of frames compiled)."""
    from torch._dynamo.utils import counters

    arr, _ = make_array(tmp_path, 2)
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((40,) + SHAPE[1:]).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, 40))
    loader = torch.utils.data.DataLoader(list(zip(x, y)), batch_size=16)
    before = counters["stats"]["unique_graphs"]
    res = train_array(arr, loader, TrainConfig(epochs=3, optimizer="sgd", lr=0.05, runtime="torch", compile="on",
                                               batch_size=16), progress=False)
    assert res.steps == 9 and np.isfinite(res.final_loss).all()
    assert counters["stats"]["unique_graphs"] - before <= 2  # the step's graph (and the eval's, if any)


@pytest.mark.slow
def test_compiled_halving_keeps_the_survivors_as_in_the_full_compiled_array(tmp_path):
    data = data_file(tmp_path, n=128)
    lrs = [0.2, 0.01, 0.1, 0.001]
    cfg = dict(batch_size=16, steps=8, optimizer="adam", lr=lrs, eval_fraction=0.25, eval_every=4, seed=3,
               runtime="torch", compile="on")
    arr_full, _ = make_array(tmp_path / "full", 4)
    arr_half, _ = make_array(tmp_path / "half", 4)
    train_array(arr_full, data, TrainConfig(**cfg), progress=False)
    res = train_array(arr_half, data, TrainConfig(halving=[4], **cfg), progress=False)
    assert len(res.survivors) == 2
    full, half = states(arr_full), states(arr_half)
    for b in res.survivors:  # the re-fused array of 2 is another graph, compiled again: equal within rounding
        for k, v in full[b].items():
            assert rel_err(half[b][k], v) < 1e-5, (b, k)


@pytest.mark.slow
def test_check_compares_a_compiled_array_with_a_compiled_reference(tmp_path, capsys):
    from onnxfuse.cli.main import main

    data = data_file(tmp_path, n=64)
    arr, _ = make_array(tmp_path, 2)
    code = main(["check", str(arr), "--data", str(data), "--batch-size", "16", "--steps", "2", "--lr", "0.01,0.02",
                 "--optimizer", "adam", "--runtime", "torch", "--compile", "on"])
    out, err = capsys.readouterr()
    assert code == 0, err


def test_compile_on_needs_the_torch_runtime(tmp_path, capsys):
    from tests.conftest import _have_ort_training
    from onnxfuse.cli.main import main

    if not _have_ort_training():
        pytest.skip("onnxruntime-training is not installed")
    data = data_file(tmp_path, n=32)
    arr, _ = make_array(tmp_path, 2)
    code = main(["train", str(arr), "--data", str(data), "--steps", "2", "--runtime", "ort", "--compile", "on", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--compile on" in err[0] and "--runtime torch" in err[0]
    assert not os.path.exists(arr / "metrics.csv")


def test_auto_decides_from_the_run_length_and_remembers_the_measured_compile_time(tmp_path, caplog):
    """A short run stays eager and says why; a run whose measured compile time pays off compiles, and a run
    resumed from its checkpoint keeps the decision the run made."""
    import logging

    from onnxfuse.runtime.torch.train_step import auto_decision

    assert not auto_decision(100, 0.01, None).compile  # 100 x 10 ms cannot pay for the assumed 60 s
    assert auto_decision(100_000, 0.01, None).compile
    assert auto_decision(1000, 0.01, {"compile_s": 2.0, "eager_step_s": 0.01, "compiled_step_s": 0.005}).compile
    assert not auto_decision(1000, 0.01, {"compile_s": 2.0, "eager_step_s": 0.01, "compiled_step_s": 0.02}).compile
    data = data_file(tmp_path, n=64)
    arr, _ = make_array(tmp_path, 2)
    with caplog.at_level(logging.INFO, logger="onnxfuse.train"):
        train_array(arr, data, TrainConfig(steps=6, batch_size=16, lr=0.01, runtime="torch"), progress=False)
    said = [r.getMessage() for r in caplog.records if "--compile auto" in r.getMessage()]
    assert len(said) == 1 and "not compiling" in said[0] and "steps of" in said[0], said


def _killed_and_resumed(tmp_path, args, kills_wanted=2):
    exe = os.path.join(os.path.dirname(sys.executable), "onnxfuse")
    arr_ref, _ = make_array(tmp_path / "ref", 3)
    subprocess.run([exe, "train", str(arr_ref), *args], check=True, capture_output=True)
    arr, _ = make_array(tmp_path / "killed", 3)
    rnd, kills = random.Random(0), 0
    while True:
        latest = sorted(glob.glob(os.path.join(arr, "checkpoints", "step_*")))
        cmd = [exe, "train", str(arr), *(["--resume", "-q"] if latest else args)]
        log = open(tmp_path / "stderr.txt", "w+")
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        if kills < kills_wanted:  # wait for a newer checkpoint (the folders kept may stay as many), then kill
            start, deadline = latest[-1:], time.time() + 120
            while p.poll() is None and sorted(glob.glob(os.path.join(arr, "checkpoints", "step_*")))[-1:] <= start \
                    and time.time() < deadline:
                time.sleep(0.02)
            time.sleep(rnd.uniform(0.0, 0.2))
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
                kills += 1
                continue
        code = p.wait()
        log.seek(0)
        assert code == 0, log.read()[-2000:]
        return arr_ref, arr, kills


@pytest.mark.slow
def test_a_killed_compiled_run_resumes_bit_identical_to_an_uninterrupted_compiled_run(tmp_path):
    data = data_file(tmp_path, n=128)
    args = ["--data", str(data), "--steps", "400", "--batch-size", "16", "--optimizer", "adamw",
            "--lr", "0.01,0.003,0.001", "--schedule", "cosine", "--clip-grad-norm", "1", "--eval-fraction", "0.2",
            "--eval-every", "100", "--checkpoint-every", "20", "--keep-checkpoints", "100", "--runtime", "torch",
            "--compile", "on", "--log-every", "10", "-q"]
    arr_ref, arr, kills = _killed_and_resumed(tmp_path, args)
    assert kills == 2
    assert_same_trained_weights(arr_ref, arr)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lenet", "cnn_bn"])
def test_compiled_conv_nets_equal_each_model_trained_alone(name, tmp_path):
    """Convolutions and BatchNorm (its running statistics written by the compiled update) compiled."""
    _conv_net_trains_as_torch_alone(name, [0.01, 0.03], 7, tmp_path)


def test_the_model_by_model_form_trains_each_model_as_torch_alone(tmp_path, monkeypatch):
    """The ``model-by-model`` form (``TrainStep.FORMS``): each model's forward and backward through a one-model array's
    graph on its own blocks of the weights, BatchNorm statistics included, then one update. Three models with
    their own learning rates (model b's block is at b, not only 0), SGD with momentum: within 1e-4 of torch.optim
    on each model alone (the bound of the whole step's test above), and the form was the one recorded."""
    from onnxfuse.runtime.torch.train_step import TrainStep, read_times

    monkeypatch.setattr(TrainStep, "FORMS", ("model-by-model",))
    before = read_times()
    _conv_net_trains_as_torch_alone("cnn_bn", [0.01, 0.03, 0.02], 4, tmp_path)
    assert _forms_recorded_since(before) == ["model-by-model"]


def test_the_nchw_form_trains_each_model_as_torch_alone_with_its_convolutions_left_nchw(tmp_path, monkeypatch):
    """The ``partitioned-nchw`` form (``TrainStep.FORMS``): the partitioned step with inductor's layout
    optimization off for its loss (``FORM_OPTIONS``), so that the grouped convolutions stay NCHW. Within 1e-4 of
    torch.optim on each model alone, the form recorded, and the option given to torch.compile."""
    from onnxfuse.runtime.torch import train_step
    from onnxfuse.runtime.torch.train_step import TrainStep

    given = []
    compile_ = torch.compile

    def recording(fn, **kw):
        given.append(kw.get("options", {}))
        return compile_(fn, **kw)

    monkeypatch.setattr(torch, "compile", recording)
    monkeypatch.setattr(TrainStep, "FORMS", ("partitioned-nchw",))
    before = train_step.read_times()
    _conv_net_trains_as_torch_alone("cnn_bn", [0.01, 0.03, 0.02], 5, tmp_path)
    assert _forms_recorded_since(before) == ["partitioned-nchw"]
    assert {"fallback_random": True, "layout_optimization": False} in given, given


def test_the_nchw_form_is_offered_only_to_graphs_that_convolve(tmp_path):
    """Without a convolution inductor's layout optimization changes nothing: a second compile of the partitioned
    form would be all the NCHW form is."""
    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.trainers import make_trainer
    from tests.conftest import MODELS

    def forms(name):
        shape = MODELS[name][1]
        graph = fuse_models(export_all(make_modules(name, 2), shape, tmp_path / name))
        trainer = make_trainer("torch", graph.model, graph.spec, "cross-entropy", make_optimizer("adamw", 2, lr=1e-3),
                               workdir=str(tmp_path / f"{name}-work"), compile="on")
        return trainer.stepper.forms

    assert "partitioned-nchw" in forms("cnn_bn")
    assert "partitioned-nchw" not in forms("mlp") and "partitioned" in forms("mlp")


def test_an_array_without_its_source_graph_still_trains_compiled(tmp_path, caplog):
    """The model-by-model form needs the first model's source graph (``sources/``); an array folder without it
    trains compiled in the other forms and says once why that form is missing (it trained before the form came)."""
    import logging

    arr, _ = make_array(tmp_path, 2)
    os.remove(arr / "sources" / "model_0.onnx")
    with caplog.at_level(logging.INFO, logger="onnxfuse"):
        res = train_array(arr, data_file(tmp_path, n=64), TrainConfig(steps=2, batch_size=16, runtime="torch",
                                                                       compile="on", verify_steps=0), progress=False)
    assert res.steps == 2
    said = [r.getMessage() for r in caplog.records if "no model-by-model form" in r.getMessage()]
    assert len(said) == 1 and "model_0.onnx" in said[0], said


def _forms_recorded_since(before: dict) -> list[str]:
    """The compiled step forms recorded (``compile-times.json``) since the record was ``before``."""
    from onnxfuse.runtime.torch.train_step import read_times

    return [t["form"] for k, t in read_times().items() if "form" in t and before.get(k) != t]


def _conv_net_trains_as_torch_alone(name: str, lrs: list[float], seed0: int, tmp_path) -> None:
    """len(lrs) models of conftest's ``name`` fused and trained compiled (6 steps of SGD with momentum, batches of
    16): each within 1e-4 of torch.optim training it alone."""
    from tests.conftest import MODELS

    shape, B = MODELS[name][1], len(lrs)
    save_array(fuse_models(export_all(make_modules(name, B, seed0=seed0), shape, tmp_path / "jobs")),
               tmp_path / "array")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((48,) + shape[1:]).astype(np.float32)
    y = rng.integers(0, 10, 48)
    np.savez(tmp_path / "d.npz", input=x, labels=y)
    train_array(tmp_path / "array", tmp_path / "d.npz",
                TrainConfig(steps=6, batch_size=16, optimizer="sgd", momentum=0.9, lr=lrs, shuffle=False,
                            runtime="torch", compile="on"), progress=False)
    got = states(tmp_path / "array")
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 48, 16)] * 2
    for b, lr in enumerate(lrs):
        mod = make_modules(name, B, seed0=seed0)[b]
        opt = torch.optim.SGD(mod.parameters(), lr=lr, momentum=0.9)
        for xb, yb in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(mod.train()(torch.from_numpy(xb)), torch.from_numpy(yb)).backward()
            opt.step()
        for k, v in mod.state_dict().items():
            assert rel_err(got[b][k], v.detach().numpy()) < 1e-4, (name, b, k)


def test_a_compiled_step_times_its_forms_keeps_the_faster_and_a_later_run_compiles_only_that(tmp_path, monkeypatch,
                                                                                             caplog):
    """``TrainStep.FORMS``: a compiled run whose whole step is long enough (here: any) compiles the partitioned
    and the model-by-model forms too after timing the whole one (an MLP: no NCHW form), keeps the fastest and records it; training through
    the changes of form stays each model's own (within rounding of the eager run). A later run of the same
    workload compiles only the recorded form."""
    import logging

    from onnxfuse.runtime.torch.train_step import TrainStep, read_times

    monkeypatch.setattr(TrainStep, "TRY_FORMS_FROM_S", 0.0)
    before = read_times()
    data = data_file(tmp_path, n=96)
    cfg = dict(batch_size=16, steps=18, optimizer="adam", lr=[0.01, 0.003], shuffle=False, runtime="torch")
    arr_c, _ = make_array(tmp_path / "c", 2)
    arr_e, _ = make_array(tmp_path / "e", 2)
    with caplog.at_level(logging.INFO, logger="onnxfuse"):
        train_array(arr_c, data, TrainConfig(compile="on", verify_steps=0, **cfg), progress=False)
    said = [r.getMessage() for r in caplog.records if "compiled step forms" in r.getMessage()]
    offered = [f for f in TrainStep.FORMS if f != "partitioned-nchw"]  # an MLP: nothing to lay out NCHW
    assert len(said) == 1 and all(f"{form} " in said[0] for form in offered), said
    assert "partitioned-nchw" not in said[0], said
    kept = said[0].rsplit("keeping ", 1)[1]
    assert kept in offered and _forms_recorded_since(before) == [kept]
    train_array(arr_e, data, TrainConfig(compile="off", verify_steps=0, **cfg), progress=False)
    compiled, eager = states(arr_c), states(arr_e)
    for b in range(2):
        for k in eager[b]:
            assert rel_err(compiled[b][k], eager[b][k]) < 1e-5, (b, k)
    caplog.clear()
    arr_2, _ = make_array(tmp_path / "again", 2)
    with caplog.at_level(logging.INFO, logger="onnxfuse"):
        train_array(arr_2, data, TrainConfig(compile="on", verify_steps=0, **cfg), progress=False)
    assert not [r for r in caplog.records if "compiled step forms" in r.getMessage()]


def test_compiled_code_is_cached_apart_for_each_instruction_set(tmp_path):
    """A step compiled natively on an AVX-512 CPU and loaded from inductor's cache by a process held to AVX2
    (ATEN_CPU_CAPABILITY=avx2) crashed it with a segmentation fault: onnxfuse's inductor cache has one folder per
    instruction set torch dispatches to (as torch itself reports it)."""
    code = ("import os, torch; from onnxfuse.runtime.torch.train_step import use_cache; use_cache(); "
            "print(torch.backends.cpu.get_cpu_capability(), os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    folders = {}
    for isa in ("avx2", "default"):
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
        env |= {"ATEN_CPU_CAPABILITY": isa, "ONNXFUSE_CACHE_DIR": str(tmp_path)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        capability, folder = out.stdout.split()
        assert capability == isa.upper() and folder.startswith(str(tmp_path / "inductor")), out.stdout
        folders[isa] = folder
    assert folders["avx2"] != folders["default"]
