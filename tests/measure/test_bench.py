"""`onnxfuse bench` writes its four files with every mode measured; it does not judge speed (a benchmark's
figures belong in the README, not in a test on a shared machine)."""
from __future__ import annotations

import csv
import json
import math
import multiprocessing
import os
import signal

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxfuse.cli.main import main
from onnxfuse.core._plot import data_overlap
from onnxfuse.exporters import export_module
from onnxfuse.exporters.zoo import MLP
from onnxfuse.measure import bench_concurrent, bench_modes, bench_report
from onnxfuse.measure.workloads import file_protos, interleaved_rounds, load_onnx_file, zoo_batch
from onnxfuse.runtime._machine import cpu_description


def test_bench_writes_json_csv_md_and_png(tmp_path, capsys):
    out = tmp_path / "bench"
    modes = ["torch", "seq-torch", "hfta", "dense"]
    assert main(["bench", "--models", "lenet", "--B", "1,2", "--steps", "1", "--rounds", "1", "--warmup", "0",
                 "--modes", ",".join(modes), "-o", str(out)]) == 0
    assert capsys.readouterr().out.count("lenet B=") == 2  # a progress line per measurement

    result = json.loads((out / "bench.json").read_text())
    assert result["modes"] == modes and [(r["model"], r["B"]) for r in result["rows"]] == [("lenet", 1), ("lenet", 2)]
    for row in result["rows"]:
        for mode in modes:
            m = row["modes"][mode]
            assert m["samples_s"] > 0 and math.isfinite(m["over_seq_torch"]) and m["of_dense"] > 0, (mode, m)
            # on Linux, the memory each mode's steps took above what the process held (its peak RSS reset first)
            assert m["peak_mib"] is not None and m["peak_mib"] >= 0, (mode, m)
        assert row["modes"]["seq-torch"]["over_seq_torch"] == 1.0 and row["modes"]["dense"]["of_dense"] == 1.0
        assert row["peak_mib"] > 0

    with open(out / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["B"]) for r in rows] == [("lenet", "1"), ("lenet", "2")]
    assert all(float(r[f"{m} samples_s"]) > 0 for r in rows for m in modes)

    for row in result["rows"]:  # the verdict: the fastest mode, and the fused array's best against dense
        assert row["winner"] == max(row["modes"], key=lambda m: row["modes"][m]["samples_s"])
        assert (row["fused_best"], row["ceiling_best"]) == ("torch", "dense") and row["fused_of_ceiling"] > 0
        assert all(row["modes"][m]["first_call_s"] > 0 for m in modes)

    md = (out / "bench.md").read_text()
    assert result["command"] in md and "onnxfuse bench --models lenet --B 1,2" in md
    # the figures name the CPU they come from: model, instruction set, cores, in bench.json and above the tables
    assert result["env"]["cpu"] == cpu_description() and cpu_description() in md
    # a line per B, then a line per B and mode, then how it scales: a line per B
    assert md.count("| lenet |") == 2 + 2 * len(modes) + 2
    scaling = md.split("How the fused array scales with B:", 1)[1]
    for r in result["rows"]:
        per_model = r["modes"]["torch"]["peak_mib"] / r["B"]
        assert (f"| lenet | fp32 | {r['B']} | torch | {r['modes']['torch']['samples_s']:,.0f} | "
                f"{r['fused_of_ceiling']:.2f} (dense) | {per_model:,.1f} |") in scaling
    assert all(f"- lenet B={r['B']} fp32: {r['winner']} won" in md for r in result["rows"])
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the plot drawn from bench.json: a line per mode whose y data are its ratios to PyTorch one after another
    # (the baseline is the line at 1x), the legend below the panel
    fig = bench_report.bench_figure(result["rows"], result["modes"], result["env"])
    (ax,) = fig.axes
    by_mode = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
    assert sorted(by_mode) == sorted(m for m in modes if m != "seq-torch")
    for mode, line in by_mode.items():
        assert list(line.get_ydata()) == pytest.approx([r["modes"][mode]["over_seq_torch"] for r in result["rows"]])
    assert data_overlap(fig, fig.legends[0], ax) == 0
    assert any(cpu_description() in " ".join(t.get_text().split()) for t in fig.texts)  # the caption names it too


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if ppid == pid:
                out.add(int(entry))
    return out


def _concurrent_processes() -> set[int]:
    """The concurrent mode's processes still there: children of multiprocessing's fork server (this process's
    child running multiprocessing.forkserver), or of this process itself for a spawn context."""
    servers = set()
    for pid in _children(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"multiprocessing.forkserver" in f.read():
                    servers.add(pid)
        except OSError:
            continue
    return set().union(*(_children(s) for s in servers)) | {p.pid for p in multiprocessing.active_children()}


linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the process table from /proc")


def _check_new_modes(out, modes: list[str], models: list[str]) -> dict:
    result = json.loads((out / "bench.json").read_text())
    assert result["modes"] == modes and len(result["rows"]) == len(models)
    for row in result["rows"]:
        for mode in modes:
            m = row["modes"][mode]
            assert m["samples_s"] > 0 and math.isfinite(m["over_seq_torch"]) and m["first_call_s"] > 0, (mode, m)
    with open(out / "bench.csv", newline="") as f:
        assert all(float(r[f"{m} first_call_s"]) > 0 for r in csv.DictReader(f) for m in modes)
    md = (out / "bench.md").read_text()
    assert "first call s" in md and all(bench_report.mode_title(result["rows"][0], m) in md for m in modes)
    return result


@linux_only
def test_concurrent_trains_b_processes_at_once_and_stops_them(tmp_path):
    out = tmp_path / "bench"
    modes = ["seq-torch", "concurrent"]
    assert main(["bench", "--models", "lenet", "--B", "2", "--steps", "1", "--rounds", "1", "--warmup", "0",
                 "--threads", "2", "--modes", ",".join(modes), "-o", str(out)]) == 0
    row = _check_new_modes(out, modes, ["lenet"])["rows"][0]
    concurrent = row["modes"]["concurrent"]
    assert concurrent["threads_per_process"] == 1  # --threads 2 split between the 2 processes
    assert concurrent["peak_mib"] > 0  # the sum of what the processes themselves reported
    assert not _concurrent_processes()


def test_a_compiled_mode_and_concurrent_on_an_onnx_file(tmp_path, mlp_file):
    """seq-torch-compiled, dense-compiled and concurrent run the file's graph by onnxfuse's converter; the first
    call (the compile) is reported and not in samples/s."""
    out = tmp_path / "bench"
    modes = ["seq-torch", "seq-torch-compiled", "concurrent", "dense", "dense-compiled"]
    assert main(["bench", "--models", str(mlp_file), "--B", "2", "--steps", "1", "--rounds", "1", "--warmup", "0",
                 "--batch", "6", "--modes", ",".join(modes), "-o", str(out)]) == 0
    result = _check_new_modes(out, modes, [str(mlp_file)])
    row = result["rows"][0]
    assert row["ceiling_best"] in ("dense", "dense-compiled") and row["fused_best"] is None
    assert ("seq-torch, seq-torch-compiled, concurrent, dense, dense-compiled run the file's ONNX graph"
            in " ".join(result["notes"]))


@pytest.mark.slow
def test_every_compiled_mode_runs(tmp_path):
    """Each peer compiled and the fused array compiled, on LeNet (each compiles 10-40 s cold on a 2-core CPU)."""
    out = tmp_path / "bench"
    modes = ["seq-torch", "torch", "torch-compiled", "seq-torch-compiled", "vmap-compiled", "hfta-compiled",
             "dense-compiled"]
    assert main(["bench", "--models", "lenet", "--B", "2", "--steps", "1", "--rounds", "1", "--warmup", "0",
                 "--modes", ",".join(modes), "-o", str(out)]) == 0
    row = _check_new_modes(out, modes, ["lenet"])["rows"][0]
    assert row["fused_best"] in ("torch", "torch-compiled") and row["ceiling_best"] == "dense-compiled"


def test_a_stepper_that_runs_its_steps_itself_is_called_once_per_timing_with_the_count():
    calls = []
    steppers = {"a": lambda: calls.append("a"), "b": lambda n: calls.append(f"b{n}")}
    times = interleaved_rounds(steppers, 2, 3, sync=lambda: calls.append("|"), runs_steps={"b"})
    assert [len(v) for v in times.values()] == [2, 2] and "".join(calls) == "|aaa||b3||b3||aaa|"


def _pool(sources, B=2):
    import torch

    x, y = zoo_batch("lenet", 4, torch.device("cpu"))
    return bench_concurrent.Concurrent(sources, x, y, [1e-3] * B, False, torch.device("cpu"), 1)


@linux_only
def test_a_concurrent_process_that_fails_is_one_error_naming_it_and_every_process_stops():
    with pytest.raises(bench_concurrent.ConcurrentWorkerError) as e:
        _pool([("zoo", "lenet", 0), ("zoo", "no_such_model", 1)])
    message = str(e.value)
    assert "\n" not in message and "model 1's process failed while starting" in message
    assert "no_such_model" in message and "modes=" in message
    assert not _concurrent_processes()


@linux_only
def test_a_concurrent_process_killed_mid_run_is_one_error_and_the_others_stop():
    pool = _pool([("zoo", "lenet", 0), ("zoo", "lenet", 1)])
    pool(1)
    os.kill(pool.procs[0].pid, signal.SIGKILL)
    with pytest.raises(bench_concurrent.ConcurrentWorkerError, match=r"model 0's process exited \(exit code -9\) while running"):
        pool(1)
    assert not _concurrent_processes()


@linux_only
def test_the_concurrent_processes_stop_when_the_bench_is_interrupted():
    with pytest.raises(KeyboardInterrupt):
        with _pool([("zoo", "lenet", 0), ("zoo", "lenet", 1)]) as pool:
            pool(2)
            assert len(_concurrent_processes()) == 2
            raise KeyboardInterrupt
    assert not _concurrent_processes()


def _ort_training() -> bool:
    try:
        import onnxruntime.training  # noqa: F401
    except ImportError:
        return False
    return True


@linux_only
def test_every_mode_runs_in_each_precision_and_the_reduced_ones_under_autocast(tmp_path):
    """A row per precision with the fused array and every peer; each mode's loss before any update (the same B models
    and batch) agrees across the modes in fp32 and moves by bf16's rounding in bf16: the forward ran under autocast."""
    out = tmp_path / "bench"
    modes = ["torch", "seq-torch", "concurrent", "vmap", "hfta", "dense"] + (["ort"] if _ort_training() else [])
    assert main(["bench", "--models", "lenet", "--B", "2", "--steps", "1", "--rounds", "1", "--warmup", "0",
                 "--threads", "2", "--modes", ",".join(modes), "--precision", "fp32,bf16", "-o", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["precisions"] == ["fp32", "bf16"] and "--precision fp32,bf16" in result["command"]
    fp32, bf16 = result["rows"]
    assert [(r["model"], r["B"], r["precision"]) for r in result["rows"]] == [("lenet", 2, "fp32"), ("lenet", 2, "bf16")]
    assert sorted(fp32["modes"]) == sorted(modes) and sorted(bf16["modes"]) == sorted(set(modes) - {"ort"})
    for row in (fp32, bf16):
        assert row["modes"]["seq-torch"]["over_seq_torch"] == 1.0 and row["modes"]["dense"]["of_dense"] == 1.0
        assert all(c["samples_s"] > 0 and math.isfinite(c["over_seq_torch"]) for c in row["modes"].values())
        assert row["modes"]["concurrent"]["first_loss"] is None  # trained in its processes
    first = {p: {m: c["first_loss"] for m, c in row["modes"].items() if m not in ("concurrent", "dense")}
             for p, row in (("fp32", fp32), ("bf16", bf16))}
    assert np.allclose(list(first["fp32"].values()), first["fp32"]["seq-torch"], rtol=1e-5), first
    for mode in first["bf16"]:
        exact, low = first["fp32"][mode], first["bf16"][mode]
        assert low != exact and abs(low - exact) < 1e-2 * exact, (mode, exact, low)
    dense = fp32["modes"]["dense"]["first_loss"], bf16["modes"]["dense"]["first_loss"]  # model 0 alone at B*N
    assert dense[0] != dense[1] and math.isclose(*dense, rel_tol=1e-2)
    if "ort" in modes:
        assert "ort left out at bf16: the ort runtime trains in fp32 only" in result["notes"]
    with open(out / "bench.csv", newline="") as f:
        assert [r["precision"] for r in csv.DictReader(f)] == ["fp32", "bf16"]
    md = (out / "bench.md").read_text()
    assert md.count("| lenet | 2 | bf16 |") == 1 + len(bf16["modes"]) and "- lenet B=2 bf16:" in md


@pytest.mark.slow
def test_the_compiled_modes_in_fp16_precision_scale_their_losses(tmp_path):
    """fp16: the fused array compiled and each compiled peer under autocast with GradScaler (fused AdamW), on LeNet
    (each compiles 10-40 s cold on a 2-core CPU)."""
    out = tmp_path / "bench"
    modes = ["seq-torch", "torch-compiled", "seq-torch-compiled", "vmap-compiled", "hfta-compiled", "dense-compiled"]
    assert main(["bench", "--models", "lenet", "--B", "2", "--steps", "2", "--rounds", "1", "--warmup", "1",
                 "--modes", ",".join(modes), "--precision", "fp16", "-o", str(out)]) == 0
    row = _check_new_modes(out, modes, ["lenet"])["rows"][0]
    assert row["precision"] == "fp16" and row["fused_best"] == "torch-compiled"
    exact = row["modes"]["seq-torch"]["first_loss"]
    assert all(math.isclose(row["modes"][m]["first_loss"], exact, rel_tol=1e-2) for m in modes[:-1])


def test_bench_rejects_an_unknown_precision_in_one_line(tmp_path, capsys):
    assert main(["bench", "--models", "lenet", "--precision", "fp32,fp8", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--precision" in err[0] and "'fp8'" in err[0] and "bf16" in err[0], err
    assert not (tmp_path / "out").exists()


def test_bench_rejects_an_unknown_mode_with_the_choices(tmp_path, capsys):
    assert main(["bench", "--models", "lenet", "--modes", "torch,fast", "-o", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "unknown mode 'fast'" in err and "seq-torch" in err


@pytest.fixture
def mlp_file(tmp_path):
    path = tmp_path / "mlp.onnx"
    export_module(MLP(in_features=12, hidden=16, num_classes=5), path, input_shape=(4, 12))
    return path


def test_bench_measures_an_onnx_file_and_leaves_out_what_needs_a_torch_module(tmp_path, capsys, mlp_file):
    out = tmp_path / "bench"
    assert main(["bench", "--models", str(mlp_file), "--B", "1,2", "--steps", "1", "--rounds", "1", "--warmup", "0",
                 "--batch", "6", "--modes", "torch,seq-torch,vmap,hfta,dense", "-o", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert [(r["B"], r["batch"], r["source"]) for r in result["rows"]] == [(1, 6, "onnx"), (2, 6, "onnx")]
    for row in result["rows"]:
        assert sorted(row["modes"]) == ["dense", "seq-torch", "torch"]  # vmap and hfta need torch modules
        assert all(m["samples_s"] > 0 and math.isfinite(m["over_seq_torch"]) for m in row["modes"].values())
    notes = " ".join(result["notes"])
    assert "left out vmap, hfta" in notes and "onnxfuse's converter" in notes
    md = (out / "bench.md").read_text()
    assert md.count(bench_modes.FILE_TITLES["seq-torch"]) == 2 and "| torch.func" not in md


def test_an_onnx_files_models_are_its_weights_and_seeded_perturbations(mlp_file):
    f = load_onnx_file(str(mlp_file), 6)
    assert (f.input_name, f.input_shape, f.high, f.label_shape, f.classes) == ("input", [6, 12], None, [6], 5)
    protos = file_protos(f, 3)
    weights = [{t.name: numpy_helper.to_array(t) for t in p.graph.initializer} for p in protos]
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(mlp_file).graph.initializer}
    assert weights[0].keys() == original.keys() and len(original) == 6
    again = file_protos(f, 3)[2]
    for name, w in original.items():
        assert np.array_equal(weights[0][name], w)
        for b in (1, 2):
            noise = weights[b][name] - w
            assert 0.005 < noise.std() / w.std() < 0.02, (b, name)  # 1 % of the weight's spread
        assert not np.array_equal(weights[1][name], weights[2][name])
        assert np.array_equal({t.name: numpy_helper.to_array(t) for t in again.graph.initializer}[name],
                              weights[2][name])  # seeded


def test_an_int64_input_is_token_ids_below_the_rows_of_the_embedding_it_indexes(tmp_path):
    vi, rng = helper.make_tensor_value_info, np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("MatMul", ["h", "W"], ["logits"])], "lm",
        [vi("ids", onnx.TensorProto.INT64, ["N", 4])], [vi("logits", onnx.TensorProto.FLOAT, ["N", 4, 3])],
        [numpy_helper.from_array(rng.standard_normal((7, 5)).astype(np.float32), "E"),
         numpy_helper.from_array(rng.standard_normal((5, 3)).astype(np.float32), "W")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "lm.onnx")
    f = load_onnx_file(str(tmp_path / "lm.onnx"), 6)
    assert (f.input_shape, f.high, f.label_shape, f.classes, f.fixed_batch) == ([6, 4], 7, [6, 4], 3, False)


def _two_inputs(path):
    vi = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "g",
                          [vi("a", onnx.TensorProto.FLOAT, ["N", 4]), vi("b", onnx.TensorProto.FLOAT, ["N", 4])],
                          [vi("y", onnx.TensorProto.FLOAT, ["N", 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.mark.parametrize("make, expected", [
    (None, "does not exist"),
    (lambda p: p.write_bytes(b"not a protobuf"), "is not a readable ONNX model"),
    (_two_inputs, "has 2 data inputs (a, b)"),
])
def test_a_bad_onnx_file_is_one_config_error_naming_it(tmp_path, capsys, make, expected):
    path = tmp_path / "model.onnx"
    if make:
        make(path)
    assert main(["bench", "--models", f"lenet,{path}", "--B", "1", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and expected in err[0], err
    assert not (tmp_path / "out").exists()  # checked before anything is measured


def _row(model: str, round_s: dict[str, list[float]]) -> dict:
    """A bench.json row at B = 16 from each mode's round times (what _measure records, the ratios derived)."""
    base = round_s["seq-torch"]
    modes = {m: {"samples_s": 16 * 32 * 10 / sorted(t)[len(t) // 2], "round_s": t,
                 "over_seq_torch": sorted(b / x for x, b in zip(t, base))[len(t) // 2]} for m, t in round_s.items()}
    return {"model": model, "source": "zoo", "B": 16, "precision": "fp32", "batch": 32, "device": "cpu", "steps": 10,
            "warmup": 3, "rounds": 3, "modes": modes, "ceiling_best": "dense"}


def test_the_bench_plot_at_one_b_is_a_bar_per_mode_its_ratio_with_the_rounds_spread(tmp_path):
    """From a bench.json: each bar is the mode's median ratio to PyTorch one after another, its whisker the
    slowest and the fastest round; the legend lies below the panels; the title is words, not the command."""
    rows = [_row("lenet", {"torch": [0.5, 0.4, 0.45], "seq-torch": [1.0, 0.9, 1.1], "dense": [0.5, 0.5, 0.6]}),
            _row("transformer_lm", {"torch": [0.2, 0.3, 0.25], "seq-torch": [0.6, 0.6, 0.6], "dense": [0.3, 0.3, 0.3]})]
    with open(tmp_path / "bench.json", "w") as f:
        json.dump({"command": "onnxfuse bench ...", "env": {"torch": "2.13", "threads": 1, "device_name": "cpu",
                                                           "cpu_count": 2}, "modes": ["torch", "seq-torch", "dense"],
                   "rows": rows}, f)
    bench_report.plot_file(tmp_path / "bench.json", tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = bench_report.bench_figure(rows, ["torch", "seq-torch", "dense"], {})
    assert "one after another" in fig._suptitle.get_text() and "--" not in fig._suptitle.get_text()
    for ax, row in zip(fig.axes, rows):
        bars = {p.get_gid(): p for p in ax.patches if p.get_gid()}
        assert {m: b.get_width() for m, b in bars.items()} == pytest.approx(
            {m: c["over_seq_torch"] for m, c in row["modes"].items()})
    assert data_overlap(fig, fig.legends[0]) == 0
    torch_bar = fig.axes[0].patches[-1]  # the first mode is drawn last (on top)
    assert torch_bar.get_gid() == "torch" and torch_bar.get_width() == pytest.approx(2.25)  # rounds: 2, 2.25, 2.44
    (whiskers,) = [c for c in fig.axes[0].containers if hasattr(c, "has_xerr")]
    (low, _), (high, _) = whiskers.lines[2][0].get_segments()[-1]  # the torch bar's
    assert (low, high) == pytest.approx((2.0, 1.1 / 0.45))


def test_bench_under_another_instruction_set_runs_in_a_process_held_to_it(tmp_path, capsys):
    """``--isa avx2``: the measurement runs in a process whose torch dispatches to AVX2 (torch says so:
    ``torch.backends.cpu.get_cpu_capability()``, which bench.json's cpu line records), and the command that
    reproduces it names the instruction set. Where this CPU lacks AVX2, it is one error line."""
    out = tmp_path / "bench"
    argv = ["bench", "--models", "lenet", "--B", "2", "--steps", "1", "--rounds", "1", "--warmup", "0",
            "--modes", "seq-torch,torch", "--isa", "avx2", "-o", str(out), "-q"]
    if "avx2" not in open("/proc/cpuinfo").read():
        assert main(argv) == 2 and "has no AVX2" in capsys.readouterr().err
        return
    assert main(argv) == 0, capsys.readouterr().err
    result = json.loads((out / "bench.json").read_text())
    assert result["env"]["isa"] == "avx2" and "(AVX2, oneDNN AVX2)" in result["env"]["cpu"]
    assert "--isa avx2" in result["command"] and result["rows"][0]["modes"]["torch"]["samples_s"] > 0


def test_an_unknown_instruction_set_is_one_line(tmp_path, capsys):
    from onnxfuse.core.errors import ConfigError
    from onnxfuse.runtime._machine import isa_env

    with pytest.raises(SystemExit):
        main(["bench", "--isa", "sse9", "-o", str(tmp_path / "b")])
    assert "invalid choice: 'sse9'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown instruction set 'sse9'; choose from: native, avx512, avx2, default"):
        isa_env("sse9")
