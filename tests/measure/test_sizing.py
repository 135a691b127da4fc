"""`onnxfuse plan` (onnxfuse/measure/sizing.py): the recommendation rule on synthetic curves (a pure function, no timing), the
memory budget's parsing, and a real plan of small LeNet arrays. No assertion reads a time: the machines that run
these tests are shared and their speed swings 2x."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from onnxfuse.cli.main import main
from onnxfuse.core.errors import ConfigError
from onnxfuse.measure.sizing import candidate_sizes, choose_B, fit_line, parse_memory, size_array

MiB = 2 ** 20
SMALL = dict(batch=8, probe=(1, 2), max_B=16, warmup=1, steps=2, rounds=1)  # a plan in about a second


# ------------------------------------------------------------------------------------------- the rule, pure
def _linear(a: float, b: float, Bs, per_model_mib: float = 1.0):
    return [a + b * B for B in Bs], [per_model_mib * MiB * B for B in Bs]


@pytest.mark.parametrize("a, b", [(1.0, 0.1), (0.004, 0.001), (0.02, 0.00003), (1.0, 2.0)])
def test_linear_time_recommends_the_first_power_of_two_above_4_5_a_over_b(a, b):
    # s(2B) / s(B) = 2(a + bB) / (a + 2bB) < 1.1  <=>  B > 4.5 a / b
    Bs = candidate_sizes(1 << 20)
    step_s, memory = _linear(a, b, Bs)
    B, why = choose_B(Bs, step_s, memory, batch=32, budget=math.inf)
    assert B == next(B for B in Bs if B > 4.5 * a / b)
    assert "samples/s" in why


def test_flat_throughput_recommends_one_model():
    Bs = candidate_sizes(64)
    step_s, memory = _linear(0.0, 0.01, Bs)  # no overhead to share: B=2 is exactly as fast per sample
    assert choose_B(Bs, step_s, memory, batch=32, budget=math.inf)[0] == 1


def test_the_memory_budget_caps_B():
    Bs = candidate_sizes(1024)
    step_s, memory = _linear(1.0, 0.001, Bs)  # throughput would grow up to B=8192
    B, why = choose_B(Bs, step_s, memory, batch=32, budget=10.5 * MiB)
    assert B == 8 and "memory budget" in why


def test_max_B_caps_B_and_a_last_size_that_is_no_doubling_is_judged_per_doubling():
    assert candidate_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    Bs = candidate_sizes(48)
    B, why = choose_B(Bs, *_linear(1.0, 1e-6, Bs), batch=32, budget=math.inf)
    assert B == 48 and "--max-B" in why
    # 32 -> 48 raises samples/s 1.2x: per doubling 1.2 ** (1 / log2(1.5)) = 1.57, worth it
    assert choose_B([32, 48], [1.0, 1.0 * 48 / 32 / 1.2], [0, 0], batch=1, budget=1)[0] == 48


def test_a_budget_below_the_smallest_array_is_an_error_naming_the_parameter():
    Bs = candidate_sizes(8)
    with pytest.raises(ConfigError, match=r"memory_budget: .* below the 1.0 MiB predicted for B=1"):
        choose_B(Bs, *_linear(1.0, 0.1, Bs), batch=32, budget=MiB / 2)


def test_fit_line():
    assert fit_line([1, 2, 4], [3, 5, 9]) == pytest.approx((1.0, 2.0))
    a, b = fit_line([1, 2, 4], [1.0, 3.0, 7.0], nonnegative_intercept=True)  # -1 + 2B: through the origin instead
    assert a == 0.0 and b == pytest.approx(np.dot([1, 2, 4], [1, 3, 7]) / 21)
    with pytest.raises(ConfigError, match="probe: "):
        fit_line([2, 2], [1.0, 1.0])


@pytest.mark.parametrize("text, size", [("8GiB", 8 * 2 ** 30), ("512MiB", 512 * MiB), ("2GB", 2e9), ("1.5 KiB", 1536),
                                        ("1e9", 1e9), (4096, 4096), ("100B", 100)])
def test_parse_memory(text, size):
    assert parse_memory(text) == int(size)


@pytest.mark.parametrize("text", ["8bananas", "GiB", "-1GiB", "0", "", "inf"])
def test_parse_memory_rejects(text):
    with pytest.raises(ConfigError, match="memory_budget: "):
        parse_memory(text)


# ---------------------------------------------------------------------------------------- a real plan (LeNet)
@pytest.fixture(scope="module")
def lenet_plan():
    return size_array("lenet", memory_budget="1GiB", **SMALL)


def test_lenet_plan_recommends_a_B_within_the_budget(lenet_plan):
    p = lenet_plan
    assert p.runtime == "torch" and [q.B for q in p.probes] == [1, 2]
    assert [r.B for r in p.rows] == [1, 2, 4, 8, 16]
    rec = next(r for r in p.rows if r.B == p.recommended_B)
    assert rec.memory <= p.memory_budget == 2 ** 30 and p.reason
    assert all(r.step_s > 0 and r.samples_s > 0 for r in p.rows)
    assert [r.memory for r in p.rows] == sorted(r.memory for r in p.rows)
    assert "<- recommended" in p.table() and f"recommended B={p.recommended_B}" in p.summary()


def test_the_cpu_memory_estimate_is_near_what_torch_allocates(lenet_plan):
    # the graph count (estimate_step_memory) against the bytes torch's CPU allocator held at the step's peak
    for q in lenet_plan.probes:
        assert q.memory is not None and 0.5 < q.memory_estimate / q.memory < 2.0, (q.B, q.memory_estimate, q.memory)


def test_a_tiny_budget_caps_the_recommended_B(lenet_plan):
    budget = int(lenet_plan.predict(2).memory * 1.05)  # B=2 fits, B=4 cannot
    p = size_array("lenet", memory_budget=budget, **SMALL)
    assert p.recommended_B <= 2 and not p.rows[-1].fits and p.rows[-1].B <= 4
    assert all(r.fits for r in p.rows if r.B <= p.recommended_B)


def test_a_budget_below_one_model_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"memory_budget: 1.0 KiB is below the .* predicted for B=1; raise"):
        size_array("lenet", memory_budget="1KiB", **SMALL)


def test_an_onnx_file_with_two_data_inputs_is_refused(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Add", ["x", "y"], ["z"])], "g",
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 4]) for n in "xy"],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 4])])
    onnx.save(helper.make_model(g), tmp_path / "two.onnx")
    with pytest.raises(ConfigError, match="2 data inputs"):
        size_array(str(tmp_path / "two.onnx"), **SMALL)


# ---------------------------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("budget", ["8bananas", "0", "-2GiB"])
def test_cli_bad_memory_budget_is_one_line(capsys, budget):
    assert main(["plan", "lenet", f"--memory-budget={budget}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("onnxfuse: error: --memory-budget")


def test_cli_plan_prints_the_table_and_writes_json(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "lenet", "--batch", "8", "--probe", "1,2", "--max-B", "8", "--memory-budget", "1GiB",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert "<- recommended" in text and f"recommended B={saved['recommended_B']} for lenet" in text
    assert [r["B"] for r in saved["rows"]] == [1, 2, 4, 8] and saved["memory_budget"] == 2 ** 30
