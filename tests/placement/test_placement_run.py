"""Device placement for real: partitioned execution gives the whole model's outputs (zoo models, fused arrays,
a training graph), and `onnxfuse place` end to end."""
from __future__ import annotations

import json
import os
import random
import statistics

import numpy as np
import onnx
import pytest

from tests.conftest import MODELS, export_all, make_modules
from onnxfuse import fuse_models, save_array
from onnxfuse.cli.main import main
from onnxfuse.placement import (Placement, build_graph, cost_table, example_feeds, find_array, make_devices,
                                partition_graph, place, shard_array, simulate)
from onnxfuse.placement.execute import max_rel_error, run_partition, run_whole
from onnxfuse.placement.profile import calibrate, profile_graph
from onnxfuse.placement.shard import shard_groups, shard_partition
from tests.exporters.test_zoo import export_zoo, zoo_input, zoo_modules

DEVS3 = make_devices(3)


def _placements(graph, seed=0):
    """Placements that cut the graph everywhere: alternating devices, halves, random, and the two placers."""
    n = len(graph)
    rnd = random.Random(seed)
    costs = cost_table(graph, make_devices(3, latency="1us", bandwidth="100GB/s"))
    return {
        "alternating": [i % 2 for i in range(n)],
        "halves": [0 if i < n // 2 else 1 for i in range(n)],
        "random": [rnd.randrange(3) for _ in range(n)],
        "greedy/dfs_preorder": place(graph, costs, "greedy", "dfs_preorder").device_of,
        "heft": place(graph, costs, "heft").device_of,
    }


@pytest.mark.parametrize("name", ["lenet", "resnet18", "transformer_lm"])
def test_partitioned_zoo_model_equals_whole(name, tmp_path):
    path = export_zoo(name, zoo_modules(name, 1), tmp_path)[0]
    g = build_graph(path, batch_size=4)
    feeds = {"input": zoo_input(name, 4, seed=3).numpy()}
    expected = run_whole(g.model, feeds)
    for label, device_of in _placements(g).items():
        part = partition_graph(g, device_of, 3)
        if label == "alternating":
            assert max(s.index for s in part.stages) > 2  # it does ping-pong between devices
        got = run_partition(part, DEVS3, feeds, warmup=0, repeats=1).outputs
        assert max_rel_error(got, expected) < 1e-6, label


@pytest.fixture(scope="module")
def lenet_array(tmp_path_factory):
    d = tmp_path_factory.mktemp("array")
    paths = export_all(make_modules("lenet", 3), MODELS["lenet"][1], d / "jobs")
    save_array(fuse_models(paths), d / "array")
    return d / "array"


def _array_graph_builder(info, feeds, batch):
    def build(model, label, b0, b1):
        sub = {k: (v[b0:b1] if k in info.per_model_inputs else v) for k, v in feeds.items()}
        return build_graph(model, label=label, batch_size=batch, feeds=sub)
    return build


def test_sharded_array_equals_whole_fused(lenet_array):
    info = find_array(lenet_array / "fused.onnx")
    g = build_graph(lenet_array / "fused.onnx", batch_size=5)
    feeds = example_feeds(g.model)
    sharding = shard_array(info, make_devices(2), _array_graph_builder(info, feeds, 5))
    assert sharding.groups == [(0, 0, 2), (1, 2, 3)]
    got = run_partition(shard_partition(sharding, 2), make_devices(2), feeds, warmup=0, repeats=1).outputs
    assert got["output"].shape[0] == 3
    assert max_rel_error(got, run_whole(g.model, feeds)) < 1e-6
    # no tensor crosses devices, and the fused graph cut by op placement still computes the same
    costs = cost_table(sharding.union, make_devices(2))
    assert simulate(sharding.union, costs, sharding.placement).bytes_moved == 0
    cut = run_partition(partition_graph(g, _placements(g)["alternating"], 2), make_devices(2), feeds, 0, 1).outputs
    assert max_rel_error(cut, run_whole(g.model, feeds)) < 1e-6


def test_sharding_slices_per_model_inputs(tmp_path):
    paths = export_all(make_modules("mlp", 3), MODELS["mlp"][1], tmp_path / "jobs")
    save_array(fuse_models(paths, per_model_inputs=["input"]), tmp_path / "array")
    info = find_array(tmp_path / "array" / "fused.onnx")
    g = build_graph(tmp_path / "array" / "fused.onnx", batch_size=6)
    feeds = example_feeds(g.model)
    assert feeds["input"].shape[:2] == (3, 6)
    sharding = shard_array(info, make_devices(3), _array_graph_builder(info, feeds, 6))
    part = shard_partition(sharding, 3)
    got = run_partition(part, make_devices(3), feeds, warmup=0, repeats=1).outputs
    assert max_rel_error(got, run_whole(g.model, feeds)) < 1e-6


def test_shard_groups_follow_device_speed():
    from onnxfuse.placement import DeviceSpec

    assert shard_groups(8, make_devices(4)) == [(0, 0, 2), (1, 2, 4), (2, 4, 6), (3, 6, 8)]
    assert shard_groups(5, make_devices(3)) == [(0, 0, 2), (1, 2, 4), (2, 4, 5)]
    assert shard_groups(2, make_devices(4)) == [(0, 0, 1), (1, 1, 2)]
    fast_slow = [DeviceSpec(name="fast", speed=3.0), DeviceSpec(name="slow", speed=1.0)]
    assert shard_groups(8, fast_slow) == [(0, 0, 6), (1, 6, 8)]


def test_partitioned_training_graph_equals_whole(tmp_path):
    """The ORT training graph (forward, loss, backward, in-place optimizer update) cut over three devices."""
    pytest.importorskip("onnxruntime.training")
    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.ort.artifacts import build_artifacts
    from onnxfuse.recipe.losses import get_loss

    paths = export_all(make_modules("lenet", 2), MODELS["lenet"][1], tmp_path / "jobs")
    fa = fuse_models(paths)
    os.makedirs(tmp_path / "art")
    art = build_artifacts(fa.model, fa.spec, get_loss("cross-entropy"), make_optimizer("adamw", 2, lr=0.01),
                          str(tmp_path / "art"))
    g = build_graph(art.training_model, batch_size=4)
    assert g.kind == "training graph" and any(op == "ConvGrad" for op in g.op_types)
    feeds = example_feeds(g.model)
    feeds["optim.hyper"] = np.abs(feeds["optim.hyper"]) * 0.01
    expected = run_whole(g.model, feeds)
    for label in ("random", "heft"):
        part = partition_graph(g, _placements(g)[label], 3)
        got = run_partition(part, DEVS3, feeds, warmup=0, repeats=2, fresh_feeds=True).outputs
        assert max_rel_error(got, expected) < 1e-5, label


def _held_out_errors(g, feeds) -> tuple[float, float, float]:
    """Calibrate on this machine, then run the multi-device placements the placers choose for ``g`` and a cut at its
    middle node, none of which the fit sees, and predict their measured steps. Returns the median relative error over those
    placements of the calibrated simulator (overheads from ``calibrate``, kernel scale and contention re-fitted on
    the one-device step and two copies at once measured in the same rounds, as ``place --run`` does), of the
    simulator with default devices, and of default devices given the same re-fitted kernel scale and contention
    (only the overheads ``calibrate`` fits differ from the calibrated simulator)."""
    from onnxfuse.placement.compare import Candidate, measure_candidates, compare_placements, rescale_to_measured

    cal = calibrate(g, make_devices(2), feeds, repeats=40)
    comparison = compare_placements(g, cal.apply(make_devices(2)), ["greedy", "heft"])
    halves = Placement(_placements(g)["halves"], "halves")
    comparison.candidates.append(Candidate("halves", None, g, comparison.candidates[0].costs, halves,
                                           simulate(g, comparison.candidates[0].costs, halves)))
    measure_candidates(comparison, feeds, warmup=2, repeats=20, rounds=5, probe_contention=True)
    refit = rescale_to_measured(comparison, cal)
    held_out = [c for c in comparison.candidates if c.same_as is None and c.placement.devices_used() == 2]
    assert len(held_out) >= 2, [c.label for c in held_out]
    unfitted = cost_table(g, make_devices(2))
    anchored = cost_table(g, make_devices(2, speed=1 / refit.kernel_scale, host="local",
                                          contention=refit.contention))

    def error(predict) -> float:
        return statistics.median(abs(predict(c) / c.measured.median - 1) for c in held_out)

    return (error(lambda c: c.sim.step_time), error(lambda c: simulate(g, unfitted, c.placement).step_time),
            error(lambda c: simulate(g, anchored, c.placement).step_time))


# A comparison of measured step times, so a shared machine's swings can flip it: it failed 2 of ~8 default-suite
# runs on 2026-12-01 and passed on rerun each time. Speed-dependent checks stay out of `make test` (`make test-all`
# runs it; benchmarks/placement_calibration.py measures the same thing on more graphs).
@pytest.mark.slow
def test_calibration_predicts_held_out_placements_better(tmp_path):
    """What calibration is for: the simulator with this machine's fitted overheads predicts the measured step of
    placements it was not fitted on better than with default devices (no session-call, per-op or hand-off costs),
    and better than default devices given the same re-fitted kernel scale and contention (so the overheads
    ``calibrate`` fits carry the improvement, not only what ``rescale_to_measured`` re-fits alongside). The
    machine's speed swings 2x within seconds: every placement is measured in interleaved rounds alongside the
    one-device step, and the verdict is on medians over five calibrate-and-measure repetitions of the median
    error over the placements (with three, a loaded machine once made the median lose)."""
    path = export_zoo("lenet", zoo_modules("lenet", 1), tmp_path)[0]
    g = profile_graph(build_graph(path, batch_size=32))
    feeds = example_feeds(g.model)
    assert sum(g.measured_s) > 0
    fitted, default, anchored = (statistics.median(e) for e in zip(*(_held_out_errors(g, feeds) for _ in range(5))))
    assert fitted < default and fitted < anchored, (fitted, default, anchored)


def test_measured_run_refits_kernel_scale_and_contention(tmp_path):
    from onnxfuse.placement.compare import measure_candidates, compare_placements, rescale_to_measured

    path = export_zoo("lenet", zoo_modules("lenet", 1), tmp_path)[0]
    g = profile_graph(build_graph(path, batch_size=8), runs=4, warmup=1)
    feeds = example_feeds(g.model)
    cal = calibrate(g, make_devices(2), feeds, repeats=8)
    comparison = compare_placements(g, cal.apply(make_devices(2)), ["greedy", "heft"], ["topo"])
    measure_candidates(comparison, feeds, warmup=1, repeats=4, rounds=2, probe_contention=True)
    assert comparison.contention_measured is not None and all(c.measured is not None for c in comparison.candidates)
    refit = rescale_to_measured(comparison, cal)
    # the contention comes from the two-copies probe run alongside (clamped to [0, 1]), not from calibrate's
    assert refit.contention == min(max(comparison.contention_measured, 0.0), 1.0) == comparison.devices[0].contention
    if 0.5 < refit.kernel_scale < 2.0:  # not clamped (a machine swinging 2x in one run clamps it): exact fit
        assert comparison.baseline.sim.step_time == pytest.approx(comparison.baseline.measured.median, rel=1e-6)


# ---------------------------------------------------------------- the command line
def test_cli_place_array_shard_wins_on_equal_devices(lenet_array, tmp_path, capsys):
    out = tmp_path / "place"
    code = main(["place", str(lenet_array / "fused.onnx"), "--devices", "2", "--costs", "estimate",
                 "--batch-size", "16", "--run", "--repeats", "2", "--warmup", "1", "-q", "-o", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    doc = json.load(open(out / "placement.json"))
    sim = {(c["placer"], c["order"]): c["step_time_s"] for c in doc["candidates"] if c["error"] is None}
    assert sim[("shard", None)] == min(sim.values())
    assert all(c["output_max_rel_error"] < 1e-5 for c in doc["candidates"] if c["error"] is None)
    assert {"placement.json", "results.md", "gantt.png", "device_0.onnx"} <= set(os.listdir(out))
    for f in doc["best"]["files"]:  # the recommended placement's sub-models (by measured time: noise decides)
        if f.endswith(".onnx"):
            onnx.checker.check_model(onnx.load(out / f))
    assert "| greedy | dfs_preorder |" in text and "measured ms" in text


def test_cli_place_single_model_and_memory_error(tmp_path, capsys):
    path = export_zoo("lenet", zoo_modules("lenet", 1), tmp_path)[0]
    code = main(["place", path, "--devices", "2", "--costs", "estimate", "--order", "topo,bfs", "--placer",
                 "greedy,heft", "-q", "-o", str(tmp_path / "p")])
    out = capsys.readouterr().out
    assert code == 0 and "| greedy | bfs |" in out and "| shard |" not in out
    code = main(["place", path, "--devices", "2", "--memory", "100KiB", "--costs", "estimate", "-q",
                 "-o", str(tmp_path / "q")])
    err = capsys.readouterr().err
    assert code == 2 and "does not fit on 2 device(s)" in err and "--memory" in err and len(err.splitlines()) == 1
    assert not os.path.exists(tmp_path / "q")


@pytest.mark.parametrize("args, message", [
    (["--order", "zigzag"], "unknown traversal order 'zigzag'"),
    (["--placer", "shard"], "model-axis sharding needs a fused array"),
    (["--dims", "T"], "is not NAME=POSITIVE_INTEGER"),
    (["--memory", "lots"], "is not a size"),
])
def test_cli_place_bad_input(args, message, tmp_path, capsys):
    path = export_zoo("lenet", zoo_modules("lenet", 1), tmp_path)[0]
    code = main(["place", path, "--costs", "estimate", "-q", "-o", str(tmp_path / "p")] + args)
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
