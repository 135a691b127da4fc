"""The automatic choices measure instead of assuming (issue 35, item 4).

``--compile auto`` predicts the remaining steps' end-to-end time eager and compiled from what was measured on this
machine (``compile-times.json``, which ``--compile on`` writes too) and never compiles when the compiled steps
measured here are not faster than the eager ones; verification's reference is compiled only when the checked
step was. ``--precision bf16|fp16`` on a CPU that emulates them warns once with the slow-down measured here.

The records below are written by the tests in the format the code writes, so no test but the one marked slow
compiles anything; each uses a cache folder of its own."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from tests.conftest import MODELS, export_all, make_modules
from onnxfuse import fuse_models, save_array
from onnxfuse.runtime.torch import precision as precision_module
from onnxfuse.runtime.torch.train_step import (ASSUMED_COMPILE_S, auto_decision, machine_description, read_times,
                                         times_path)
from onnxfuse.training.run import TrainConfig, train_array


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A cache folder (and so a compile-times.json) of the test's own."""
    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def auto_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("--compile auto")]


def test_auto_predicts_both_end_to_end_times_and_never_compiles_a_step_measured_not_faster():
    eager = 0.020
    # compiled steps measured here not faster than eager ones: eager, however long the run, saying the figures
    for known in ({"compile_s": 0.1, "compiled_step_s": 0.025},  # slower than the 20 ms measured now
                  {"compile_s": 0.1, "compiled_step_s": 0.019, "eager_step_s": 0.018}):  # than the eager beside it
        d = auto_decision(10 ** 6, eager, {**known, "machine": "AMD EPYC (AVX2), 2 cores, 1 thread"})
        assert not d.compile and "not faster" in d.why and f"{known['compiled_step_s'] * 1000:.1f} ms" in d.why
        assert "AMD EPYC (AVX2)" in d.why and "\n" not in d.why
    # faster steps: compiled exactly when compile_s + n * compiled < n * eager (200 steps: 4 s eager)
    known = {"compile_s": 1.5, "compiled_step_s": 0.010, "eager_step_s": 0.020}
    assert auto_decision(200, eager, known).compile  # 1.5 + 2.0 = 3.5 s < 4 s
    d = auto_decision(200, eager, {**known, "compile_s": 2.5})  # 2.5 + 2.0 = 4.5 s > 4 s
    assert not d.compile and "4.0 s" in d.why and "4.5 s" in d.why and "measured here before" in d.why
    # nothing measured here: the assumptions, named as such
    d = auto_decision(200, eager, None)
    assert not d.compile and "assumed" in d.why and f"{ASSUMED_COMPILE_S:.1f} s compile" in d.why
    assert auto_decision(10 ** 5, eager, None).compile


@pytest.fixture
def compiles(monkeypatch) -> list:
    """What is handed to ``torch.compile`` (the trainers' steps), which here returns the step itself: a run
    takes every path of a compiled one at an eager step's cost."""
    import onnxfuse.runtime.torch.train_step as train_step_module

    handed = []
    monkeypatch.setattr(train_step_module, "compiled", lambda method: handed.append(method.__self__) or method)
    return handed


def test_verification_compiles_its_reference_only_when_the_checked_step_ran_compiled(tmp_path, own_cache,
                                                                                     compiles):
    """An eager run (auto's first steps are its eager probe) is checked against an eager reference, never a cold
    compile of one; a compiled run against a compiled reference (like with like: a max-pool's ties); a bf16 run,
    checked in fp32 in a trainer of its own, eagerly: only the run's own step is compiled."""
    from tests.training.test_run import data_file, make_array

    data = data_file(tmp_path, n=64)
    arr, _ = make_array(tmp_path, 2)
    common = dict(steps=4, batch_size=16, lr=0.01, runtime="torch", verify_steps=1)
    train_array(arr, data, TrainConfig(compile="auto", **common), progress=False)  # 4 steps: stays eager
    assert compiles == []
    train_array(arr, data, TrainConfig(compile="on", **common), progress=False)
    assert len(compiles) == 2 and compiles[0].array.B == 2 and compiles[1].array.B == 1, compiles
    train_array(arr, data, TrainConfig(compile="on", precision="bf16", **common), progress=False)
    assert len(compiles) == 3 and compiles[2].array.B == 2 and compiles[2].precision == "bf16", compiles


def _record_not_faster(key_entry: dict, eager_s: float) -> dict:
    """A record as `--compile on` then `auto` leave it on a CPU where compiled steps do not pay: a compile of 2 s
    (warm) and compiled steps 25 % slower than the eager steps measured here."""
    return {**key_entry, "compile_s": 2.0, "compiled_step_s": 1.25 * eager_s, "eager_step_s": eager_s}


def _decides_eager_with_the_record(run, caplog) -> str:
    """``run()`` once (auto: it records this workload's eager step under its key), the record then completed as
    a compiled run would have left it, and ``run()`` again: auto keeps the step eager and says why in one line."""
    with caplog.at_level(logging.INFO, logger="onnxfuse.train"):
        run()
    times = read_times()
    assert len(times) == 1, times  # the run's workload; the eager reference of verification records nothing
    (key, entry), = times.items()
    assert entry["machine"] == machine_description(torch.device("cpu")) and entry["eager_step_s"] > 0
    recorded = _record_not_faster(entry, entry["eager_step_s"])
    with open(times_path(), "w") as f:
        json.dump({key: recorded}, f)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="onnxfuse.train"):
        run()
    said = auto_lines(caplog)
    assert len(said) == 1 and said[0].startswith("--compile auto: not compiling the step: "), said
    assert "not faster" in said[0] and f"{recorded['compiled_step_s'] * 1000:.1f} ms" in said[0], said
    assert read_times()[key]["compile_s"] == 2.0  # nothing compiled (a compile records its time)
    return said[0]


def test_auto_keeps_a_4_model_cnn_of_200_steps_eager_when_the_record_says_compiling_does_not_pay(
        tmp_path, own_cache, caplog, compiles):
    factory, shape = MODELS["cnn_bn"]
    save_array(fuse_models(export_all(make_modules("cnn_bn", 4), shape, tmp_path / "jobs")), tmp_path / "array")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", input=rng.standard_normal((64,) + shape[1:]).astype(np.float32),
             labels=rng.integers(0, 10, 64))
    config = TrainConfig(steps=200, batch_size=16, lr=0.01, runtime="torch", compile="auto")
    # stop_at: the run's schedules and auto's remaining steps are a 200-step run's; 5 steps are enough to decide
    _decides_eager_with_the_record(
        lambda: train_array(tmp_path / "array", tmp_path / "data.npz", config, progress=False, stop_at=5), caplog)


def test_auto_keeps_the_readme_demo_eager_when_the_record_says_compiling_does_not_pay(tmp_path, own_cache,
                                                                                        caplog, monkeypatch,
                                                                                        compiles):
    """`onnxfuse demo` as the README runs it (8 DigitsCNNs, 300 steps, batch 64), its training stopped after the
    decision: the run is the demo's own configuration, nothing else changed."""
    import onnxfuse.training.run as run_module
    from onnxfuse.cli.demo import run_demo

    real = run_module.train_array

    class Decided(Exception):
        pass

    def decided(*args, **kwargs):
        real(*args, **kwargs, stop_at=5)
        raise Decided

    monkeypatch.setattr(run_module, "train_array", decided)

    def demo():
        with pytest.raises(Decided):
            run_demo(str(tmp_path / "demo"), progress=False)
    _decides_eager_with_the_record(demo, caplog)
    assert compiles == []


@pytest.mark.parametrize("inductor", [pytest.param(True, marks=pytest.mark.slow), False])
def test_compile_on_records_its_times_and_auto_decides_from_them(inductor, tmp_path, own_cache, capsys,
                                                                  request):
    """`--compile on` writes the compile time and the steady-state compiled step under the workload's key;
    `--compile auto` on the same workload then decides from those figures (which way depends on this CPU: the
    message says measured, not assumed). With inductor a real compile (the tests' small MLP, ~20 s on 2 cores);
    without, ``torch.compile`` is the step itself, the same records from the same code for nothing."""
    from onnxfuse.cli.main import main
    from tests.training.test_run import data_file, make_array

    if not inductor:
        request.getfixturevalue("compiles")
    data = data_file(tmp_path, n=64)
    arr, _ = make_array(tmp_path, 2)
    common = ["--data", str(data), "--steps", "8", "--batch-size", "16", "--lr", "0.01", "--runtime", "torch",
              "--verify-steps", "0", "-q"]
    assert main(["train", str(arr), *common, "--compile", "on"]) == 0, capsys.readouterr().err
    (key, entry), = read_times().items()
    assert entry["compile_s"] > 0 and entry["compiled_step_s"] > 0, entry
    assert entry["machine"] == machine_description(torch.device("cpu"))
    capsys.readouterr()
    assert main(["train", str(arr), *common[:-1], "--compile", "auto"]) == 0  # not -q: its info lines
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("onnxfuse: --compile auto")]
    assert len(said) == 1 and "measured here" in said[0] and "assumed" not in said[0], said
    assert read_times()[key]["eager_step_s"] > 0


# ---- --precision on a CPU that emulates it
@pytest.fixture
def fresh_warnings(monkeypatch):
    """No precision warned about yet in this process."""
    monkeypatch.setattr(precision_module, "_WARNED", set())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "native" in r.getMessage()]


def _two_train_steps(precision: str) -> None:
    """Two training steps made in one process (a run and its verification's, a sweep's arrays...)."""
    import onnxfuse
    from onnxfuse.exporters.zoo import DigitsCNN

    torch.manual_seed(0)
    arr = onnxfuse.fuse([DigitsCNN() for _ in range(2)], torch.zeros(2, 1, 8, 8))
    for _ in range(2):
        onnxfuse.optim.train_step(arr, onnxfuse.optim.SGD(arr, lr=0.1), lambda out, y: out.sum((1, 2)),
                                  compile="off", precision=precision)


@pytest.mark.parametrize("precision, dtype", [("bf16", "bfloat16"), ("fp16", "float16")])
def test_reduced_precision_on_a_cpu_without_native_support_warns_once_with_the_measured_slow_down(
        precision, dtype, monkeypatch, fresh_warnings, caplog):
    asked = []
    monkeypatch.setattr(precision_module, "native_low_precision", lambda name: asked.append(name) or False)
    with caplog.at_level(logging.INFO, logger="onnxfuse.train"):
        _two_train_steps(precision)
    said = _warnings(caplog)
    assert len(said) == 1 and asked == [dtype], (said, asked)
    factor = precision_module.emulation_slowdown(precision)
    assert said[0].startswith(f"this CPU ({precision_module.cpu_description()}) has no native {dtype} (no ")
    # the line gives the probe's factor either way: "17.5x slower" where emulated, "1.3x faster ... even so" on a
    # CPU whose conv/matmul are faster in the low precision all the same (the probe, not the flags, times it)
    shown = f"{factor:.1f}x slower" if factor >= 1 else f"{1 / factor:.1f}x faster"
    assert shown in said[0] and "\n" not in said[0], said


def test_reduced_precision_warns_nothing_where_the_cpu_has_it_or_the_device_is_a_gpu(monkeypatch, fresh_warnings,
                                                                                    caplog):
    monkeypatch.setattr(precision_module, "native_low_precision", lambda name: True)
    with caplog.at_level(logging.INFO, logger="onnxfuse.train"):
        _two_train_steps("bf16")
    monkeypatch.setattr(precision_module, "native_low_precision", lambda name: False)
    with caplog.at_level(logging.INFO, logger="onnxfuse.train"):
        precision_module.warn_if_emulated("bf16", torch.device("cuda"))  # a GPU: no CPU probe, no warning
        precision_module.warn_if_emulated("fp32", torch.device("cpu"))
    assert _warnings(caplog) == []
