"""`onnxfuse sweep`: the spec, grouping by graph identity, the arrays on a real Ray (local with 2 CPUs, and a
two-node cluster from Ray's own test utility), every trial's weights against torch.optim training it alone,
killed workers and drivers, and the Optuna helper."""
from __future__ import annotations

import copy
import csv
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from onnxfuse.core.errors import ConfigError, InputFileError
from onnxfuse.exporters import zoo
from onnxfuse.sweep import parse_spec, run_sweep
from onnxfuse.sweep.planning import array_sizes, plan_sweep
from onnxfuse.sweep.folder import SweepDir

from tests.conftest import rel_err, write_spec

SHAPE = [8, 3, 4, 4]  # zoo.MLP(in_features=48)
LRS = [0.02, 0.005, 0.001]


def data_file(folder, n=120, seed=0):
    rng = np.random.default_rng(seed)
    path = folder / "data.npz"
    np.savez(path, input=rng.standard_normal([n] + SHAPE[1:]).astype(np.float32), labels=rng.integers(0, 10, n))
    return path


def base_spec(folder, steps=8, **over) -> dict:
    raw = {"model": {"factory": "onnxfuse.exporters.zoo:MLP", "input_shape": SHAPE, "args": {"in_features": 48}},
           "search": {"space": {"model.hidden": [16, 32], "optimizer.lr": LRS, "seed": [0, 1]}},
           "arrays": {"size": 4}, "data": {"train": str(data_file(folder)), "eval_fraction": 0.25, "seed": 3},
           "loss": "cross-entropy", "optimizer": {"name": "adamw"}, "steps": steps, "batch_size": 16,
           "eval_every": 4}
    raw.update(over)
    return raw


def rows(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def torch_alone(hidden, seed, lr, batches):
    """The trial trained by itself: its model as the factory builds it, torch.optim.AdamW, its batches."""
    torch.manual_seed(seed)
    mod = zoo.MLP(in_features=48, hidden=hidden)
    opt = torch.optim.AdamW(mod.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(mod.train()(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in mod.state_dict().items()}


def check_trials_as_alone(out: SweepDir, plan: dict, raw: dict, steps: dict[str, int]) -> None:
    """Every trial's split weights against torch.optim training it alone for its ``steps`` on the batches the
    sweep drew (the spec's held-out split and shuffle seed: 0.25, 3; batch 16)."""
    from safetensors.numpy import load_file

    from onnxfuse.recipe.data import BatchSampler
    from onnxfuse.recipe.datasets import split_holdout

    train, _ = split_holdout(dict(np.load(raw["data"]["train"])), 0.25, 3)
    sampler = BatchSampler(len(train["labels"]), 16, True, 3)
    batches = [(train["input"][i], train["labels"][i]) for i in (sampler.next() for _ in range(max(steps.values())))]
    for t in plan["trials"]:
        p = t["params"]
        got = load_file(out.trial_file(t["id"], "model.safetensors"))
        ref = torch_alone(p.get("model.hidden", 64), p.get("seed", 0), p["optimizer.lr"], batches[:steps[t["id"]]])
        assert sorted(got) == sorted(ref)
        for k, v in ref.items():
            assert rel_err(got[k], v) < 1e-4, (t["id"], k)


# ------------------------------------------------------------------------------------------------- the spec
def test_grid_and_random_trials(tmp_path):
    spec = parse_spec(base_spec(tmp_path))
    trials = spec.trials()
    assert len(trials) == 12 and trials[0] == {"model.hidden": 16, "optimizer.lr": 0.02, "seed": 0}
    assert trials[1]["seed"] == 1 and trials[-1] == {"model.hidden": 32, "optimizer.lr": 0.001, "seed": 1}
    assert [spec.kind(k) for k in trials[0]] == ["model", "per-model", "seed"]
    assert spec.kind("batch_size") == "array" and spec.metric == "eval_loss" and spec.direction == "minimize"
    raw = base_spec(tmp_path, search={"method": "random", "samples": 5, "seed": 7, "space": {
        "optimizer.lr": {"low": 1e-4, "high": 1e-1, "log": True}, "model.hidden": {"low": 8, "high": 64, "int": True}}})
    a, b = parse_spec(raw).trials(), parse_spec(copy.deepcopy(raw)).trials()
    assert a == b and len(a) == 5  # seeded
    assert all(1e-4 <= t["optimizer.lr"] <= 1e-1 and isinstance(t["model.hidden"], int) for t in a)
    assert len({t["optimizer.lr"] for t in a}) == 5


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("model"), "model is required"),
    (lambda r: r["model"].pop("input_shape"), "model.input_shape: is required"),
    (lambda r: r.update(searhc={}), "unknown key 'searhc'"),
    (lambda r: r["arrays"].update(size=0), "arrays.size"),
    (lambda r: r.update(metric="accuracy"), "metric"),
    (lambda r: r["search"].update(space={"optimizer.lr": {"low": 0.1, "high": 1}}), "a range, which a grid cannot"),
    (lambda r: r["search"].update(method="random"), "needs search.samples"),
    (lambda r: r.update(grid={"optimizer.lr": [0.1]}), "search.space"),
    (lambda r: r["data"].update(order="per-model"), "shared batch order"),
    (lambda r: (r["data"].pop("eval_fraction"), r.update(metric="eval_accuracy")), "metric eval_accuracy needs"),
    (lambda r: r.update(device="cuda", resources={"gpus": 0}), "needs resources.gpus"),
    (lambda r: r["search"]["space"].update(batch_size=[16, 0]), "batch_size = 0"),
    (lambda r: r["search"]["space"].update(stepz=[1]), "unknown key 'stepz'"),
    (lambda r: r.update(optimizer={"name": "adamw", "momentum": 0.9}), "optimizer.momentum"),
])
def test_bad_specs_are_one_line_errors(tmp_path, change, message):
    raw = base_spec(tmp_path)
    change(raw)
    with pytest.raises(ConfigError) as e:
        parse_spec(raw, "spec.yaml").trials()
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_array_sizes():
    assert array_sizes(6, 4) == [3, 3] and array_sizes(7, 4) == [4, 3] and array_sizes(8, 4) == [4, 4]
    assert array_sizes(1, 4) == [1] and array_sizes(5, 1) == [1] * 5 and array_sizes(9, 4) == [3, 3, 3]


def test_groups_come_from_the_graphs_not_the_labels(tmp_path):
    """A factory argument that leaves the graph alone shares an array; one that changes it never does; trials
    that differ in an array-wide setting (batch_size) never share one either."""
    (tmp_path / "models.py").write_text(
        "from onnxfuse.exporters.zoo import MLP\n"
        "def make(hidden=16, label='a'):\n"
        "    return MLP(in_features=48, hidden=hidden)\n")
    raw = base_spec(tmp_path, search={"space": {"model.label": ["a", "b"], "model.hidden": [16, 32],
                                                "optimizer.lr": [0.01, 0.001]}}, arrays={"size": 8})
    raw["model"] = {"factory": "models.py:make", "input_shape": SHAPE}
    spec = parse_spec(raw, "spec.yaml", str(tmp_path))
    sweep = SweepDir(tmp_path / "sw")
    plan = plan_sweep(spec, spec.trials(), sweep, None, None, progress=False)
    groups = [g["trials"] for g in plan["groups"]]
    hidden = {t["id"]: t["params"]["model.hidden"] for t in plan["trials"]}
    assert len(groups) == 2 and all(len(g) == 4 and len({hidden[t] for t in g}) == 1 for g in groups)
    assert [len(a["trials"]) for a in plan["arrays"]] == [4, 4]
    a0 = plan["arrays"][0]
    assert a0["settings"].lr == [plan["trials"][int(t[1:])]["params"]["optimizer.lr"] for t in a0["trials"]]
    # the same with two batch sizes: four groups
    raw["search"]["space"]["batch_size"] = [8, 16]
    spec = parse_spec(raw, "spec.yaml", str(tmp_path))
    plan = plan_sweep(spec, spec.trials(), SweepDir(tmp_path / "sw2"), None, None, progress=False)
    assert len(plan["groups"]) == 4 and sorted({a["settings"].batch_size for a in plan["arrays"]}) == [8, 16]


# ------------------------------------------------------------------------------------------ a sweep on Ray
@pytest.fixture(scope="module")
def sweep12(tmp_path_factory):
    """12 trials (2 architectures x 3 learning rates x 2 seeds) at B <= 4 on a local Ray with 2 CPUs."""
    folder = tmp_path_factory.mktemp("sweep12")
    raw = base_spec(folder)
    res = run_sweep(write_spec(folder, raw), folder / "out", num_cpus=2, progress=False)
    return folder, raw, res


def test_sweep_forms_arrays_and_every_trial_trains_as_alone(sweep12):
    folder, raw, res = sweep12
    out = SweepDir(folder / "out")
    plan = json.load(open(out.plan_path))
    assert len(plan["groups"]) == 2 and res.arrays == 4 and len(res.ran) == 4 and not res.failed
    assert sorted(len(a["trials"]) for a in plan["arrays"]) == [3, 3, 3, 3]
    table = rows(out.results_path)
    assert len(table) == 12 and all(r["status"] == "finished" and r["steps"] == "8" for r in table)
    best = [float(r["best_eval_loss"]) for r in table]  # each trial's best state's, kept at an evaluation
    assert best == sorted(best) and all(b <= float(r["eval_loss"]) for b, r in zip(best, table))  # best first
    check_trials_as_alone(out, plan, raw, {t["id"]: 8 for t in plan["trials"]})


def hparams_sessions(logdir: str) -> dict[str, dict]:
    """What TensorBoard's HParams dashboard lists for ``logdir``, read by TensorBoard's own code (its event
    multiplexer, data provider and the HParams plugin's handler): {run: {"hparams": {...}, "metrics": {tag:
    value}, "status": ...}}."""
    from google.protobuf import json_format
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    runs = plugin_event_multiplexer.EventMultiplexer()
    runs.AddRunsFromDirectory(logdir)
    runs.Reload()
    tb = base_plugin.TBContext(logdir=logdir, multiplexer=runs,
                               data_provider=data_provider.MultiplexerDataProvider(runs, logdir))
    request = api_pb2.ListSessionGroupsRequest(start_index=0, slice_size=1000, aggregation_type=api_pb2.AGGREGATION_AVG,
                                               allowed_statuses=[api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE])
    groups = list_session_groups.Handler(context.RequestContext(), backend_context.Context(tb), "", request).run()
    out = {}
    for group in groups.session_groups:
        (session,) = group.sessions
        out[session.name] = {"hparams": {k: json_format.MessageToDict(v) for k, v in group.hparams.items()},
                             "metrics": {m.name.tag: m.value for m in session.metric_values},
                             "status": api_pb2.Status.Name(session.status)}
    return out


def test_sweep_files(sweep12):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from onnxfuse.sweep.results import run_name

    folder, _, res = sweep12
    out = SweepDir(folder / "out")
    plan = json.load(open(out.plan_path))
    params = {t["id"]: t["params"] for t in plan["trials"]}
    t = res.rows[0]["trial"]
    curve = rows(out.trial_file(t, "metrics.csv"))
    assert [r["step"] for r in curve if r["split"] == "eval"] == ["4", "8"]
    # TensorBoard's HParams dashboard lists every trial, named by its parameters, with them and its metrics
    sessions = hparams_sessions(out.trial_path(""))
    assert sorted(sessions) == sorted(f"{tid}/{run_name(p)}" for tid, p in params.items())
    assert f"{t}/hidden={params[t]['model.hidden']},lr={params[t]['optimizer.lr']:g},seed={params[t]['seed']}" \
        in sessions
    for r in res.rows:
        s = sessions[f"{r['trial']}/{run_name(params[r['trial']])}"]
        assert s["hparams"] == params[r["trial"]] and s["status"] == "STATUS_SUCCESS"
        assert s["metrics"]["best/eval_loss"] == pytest.approx(r["best_eval_loss"], rel=1e-6)
        assert s["metrics"]["eval/loss"] == pytest.approx(r["eval_loss"], rel=1e-6)
    ev = EventAccumulator(out.trial_file(t, run_name(params[t])))
    ev.Reload()
    assert [s.step for s in ev.Scalars("eval/loss")] == [4, 8]
    assert ev.Scalars("eval/loss")[-1].value == pytest.approx(float(res.rows[0]["eval_loss"]), rel=1e-6)
    assert len(ev.Scalars("train/loss")) == 8
    import onnx

    onnx.checker.check_model(onnx.load(out.trial_file(t, "model.onnx")))
    assert os.path.getsize(out.report_png_path) > 10_000 and "12 trials in 4 arrays" in open(out.report_md_path).read()
    status = json.load(open(out.status_path))
    assert status["done"] == 4 and status["queued"] == status["running"] == status["failed"] == 0


def test_sweep_cli_errors(tmp_path, capsys, sweep12):
    from onnxfuse.cli.main import main

    folder, raw, _ = sweep12
    spec = write_spec(tmp_path, raw)
    for argv, message in ((["sweep", spec], "-o SWEEP_DIR"),
                          (["sweep", spec, "-o", str(folder / "out")], "continue it with --resume"),
                          (["sweep", "--resume", str(tmp_path)], "not a sweep folder"),
                          (["sweep", spec, "--resume", str(folder / "out")], "give neither"),
                          (["sweep", str(tmp_path / "nope.yaml"), "-o", str(tmp_path / "o")], "does not exist")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    # resuming a finished sweep trains nothing
    assert main(["sweep", "--resume", str(folder / "out"), "--cpus", "2", "-q"]) == 0
    assert "0 arrays trained now" in capsys.readouterr().out


@pytest.mark.slow
def test_a_sweep_says_its_plan_once_and_ray_says_nothing(tmp_path):
    """The command as a user runs it (its own process, a new local Ray, progress bars on): the plan line once, the
    table, the summary; on stderr nothing but the bars (Ray's notices, e.g. that it turned token authentication
    on, only with --verbose)."""
    from tests.conftest import EXE

    raw = base_spec(tmp_path, steps=2, search={"space": {"optimizer.lr": [0.01, 0.001]}})
    r = subprocess.run([EXE, "sweep", write_spec(tmp_path, raw), "-o", str(tmp_path / "out"), "--cpus", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    plan = "2 trials in 1 group of identical graphs, 1 array"
    assert (r.stdout + r.stderr).count(plan) == 1 and r.stdout.startswith(plan + "\n"), r.stdout
    assert "2 of 2 trials have results (1 array trained now, 0 failed)" in r.stdout.splitlines()[-1]
    bars = ("sweep", "exporting trials")  # tqdm redraws its bars with \r
    said = [s for s in re.split(r"[\r\n]", r.stderr) if s.strip() and not s.startswith(bars)]
    assert not said, r.stderr


def test_a_training_run_imports_no_dynamo(tmp_path):
    """torch.optim.Optimizer.add_param_group imports torch._dynamo on its first call (2-5 s on 2 cores, in every
    sweep worker before its first step); the fused optimizer and the schedules' stand-ins go around it, so a whole
    run (one-cycle schedules, the torch runtime) imports none."""
    code = f"""if True:
        import sys
        from onnxfuse import fuse_models, save_array
        from onnxfuse.exporters import export_module, zoo
        from onnxfuse.training.run import TrainConfig, train_array
        paths = [f"{tmp_path}/m{{b}}.onnx" for b in range(2)]
        for p in paths:
            export_module(zoo.MLP(in_features=48, hidden=16), p, input_shape={SHAPE})
        save_array(fuse_models(paths), "{tmp_path}/arr")
        train_array("{tmp_path}/arr", "{data_file(tmp_path)}", TrainConfig(steps=2, batch_size=8, runtime="torch",
                    schedule={{"name": "onecycle", "max_lr": 0.01}}), progress=False)
        print("torch._dynamo" in sys.modules)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["False"], r.stdout + r.stderr


@pytest.mark.slow
def test_a_failing_array_is_retried_once_and_loses_no_other_result(tmp_path, capsys):
    """batch_size 200 > the 90 training samples: that array fails in its worker, twice; the others finish."""
    from onnxfuse.cli.main import main

    raw = base_spec(tmp_path, search={"space": {"batch_size": [16, 200], "optimizer.lr": [0.01, 0.001]}})
    assert main(["sweep", write_spec(tmp_path, raw), "-o", str(tmp_path / "out"), "--cpus", "2", "-q"]) == 5
    out = SweepDir(tmp_path / "out")
    table = {r["trial"]: r for r in rows(out.results_path)}
    bad = [r for r in table.values() if r["status"] == "failed"]
    assert len(bad) == 2 and all(r["attempts"] == "2" and "fewer than one batch" in r["error"] for r in bad)
    assert sum(r["status"] == "finished" for r in table.values()) == 2
    assert "2 of 4 trials have results" in capsys.readouterr().out


# --------------------------------------------------------------------------------- killing workers and drivers
def _descendants(pid: int) -> set[int]:
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out.update(kids)
        todo.extend(kids)
    return out


def _wait_status(out: SweepDir, proc, ok, timeout=120) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()
        try:
            st = json.load(open(out.status_path))
        except (OSError, ValueError):
            st = None
        if st and ok(st):
            return st
        time.sleep(0.1)
    raise AssertionError("the sweep never reached the state waited for")


def _start(spec, out, *flags):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "onnxfuse", "sweep", spec, "-o", str(out), "-q", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_a_killed_worker_is_retried_and_every_result_is_there(tmp_path):
    raw = base_spec(tmp_path, steps=1500, search={"space": {"optimizer.lr": LRS, "seed": [0, 1]}},
                    arrays={"size": 3}, eval_every=500)
    out = SweepDir(tmp_path / "out")
    proc = _start(write_spec(tmp_path, raw), out.path, "--cpus", "2")
    try:
        st = _wait_status(out, proc, lambda s: any(a["state"] == "running" and a.get("step", 0) > 0
                                                  for a in s["arrays"].values()))
        victim, info = next((k, a) for k, a in st["arrays"].items() if a["state"] == "running" and a.get("step"))
        os.kill(info["pid"], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert f"array {victim} failed (attempt 1" in stderr
    result = json.load(open(out.result_path(victim)))
    assert result["state"] == "done" and result["attempts"] == 2 and result["pid"] != info["pid"]
    table = rows(out.results_path)
    assert len(table) == 6 and all(r["status"] == "finished" and r["steps"] == "1500" for r in table)


@pytest.mark.slow
@pytest.mark.parametrize("halving", [False, True])
def test_a_killed_driver_resumes_without_retraining_finished_arrays(tmp_path, halving):
    """Killed while the arrays (with halving: of the first rung) are half done; --resume runs only the rest."""
    raw = base_spec(tmp_path, steps=400, arrays={"size": 3}, eval_every=200, **({"halving": [200]} if halving else {}))
    out = SweepDir(tmp_path / "out")
    record = out.segment_path if halving else (lambda a, k: out.result_path(a))
    proc = _start(write_spec(tmp_path, raw), out.path, "--cpus", "1")
    try:
        _wait_status(out, proc, lambda s: s["done"] >= 1 and s["running"] >= 1 and s["done"] < 4)
        family = _descendants(proc.pid)
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    for pid in family:  # Ray's processes of the killed driver's own local cluster (its agents outlive it)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    arrays = [a["id"] for a in json.load(open(out.plan_path))["arrays"]]
    done = {a: open(record(a, 0), "rb").read() for a in arrays if os.path.exists(record(a, 0))}
    assert 1 <= len(done) < 4
    res = run_sweep(None, out.path, resume=True, num_cpus=2, progress=False)
    if not halving:
        assert sorted(res.ran) == sorted(set(arrays) - set(done))
    for a, before in done.items():  # not trained again: the very same record
        assert open(record(a, 0), "rb").read() == before
    table = rows(out.results_path)
    assert len(table) == 12 and all(r["status"] in ("finished", "stopped") for r in table)
    if halving:
        assert sorted(int(r["steps"]) for r in table) == [200] * 6 + [400] * 6


# ----------------------------------------------------------------------------------- a two-node Ray cluster
@pytest.mark.slow
def test_sweep_on_a_two_node_cluster(tmp_path):
    """Ray's own test-cluster utility: a head node and a second node, one CPU each, on this machine."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        raw = base_spec(tmp_path, steps=40, arrays={"size": 3}, eval_every=20)
        res = run_sweep(write_spec(tmp_path, raw), tmp_path / "out", address=cluster.address, progress=False)
        assert not ray.is_initialized()  # run_sweep connected, and disconnected
    finally:
        cluster.shutdown()
    out = SweepDir(tmp_path / "out")
    nodes = {json.load(open(out.result_path(a)))["node"] for a in res.ran}
    assert len(res.ran) == 4 and len(nodes) == 2
    assert len(res.rows) == 12 and all(r["status"] == "finished" for r in res.rows)


# -------------------------------------------------------------------------------------------------- Optuna
@pytest.mark.slow
def test_optuna_study_runs_as_arrays(tmp_path):
    import optuna

    from onnxfuse.integrations.optuna import optimize

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from safetensors.numpy import load_file

    from onnxfuse import fuse_models, save_array
    from onnxfuse.core.split import split_array
    from onnxfuse.sweep.results import trial_score
    from onnxfuse.training.run import TrainConfig, train_array
    from onnxfuse.training.report import summarize_array

    raw = base_spec(tmp_path, search={"method": "random", "samples": 1, "space": {
        "optimizer.lr": {"low": 1e-3, "high": 3e-2, "log": True}, "model.hidden": [16, 32]}})
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0))
    results = optimize(study, parse_spec(raw, "spec", str(tmp_path)), n_trials=8, out_dir=tmp_path / "study",
                       batch=4, num_cpus=2, progress=False)
    assert len(results) == 2 and len(study.trials) == 8
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    for k, (res, trials) in enumerate(zip(results, (study.trials[:4], study.trials[4:]))):
        plan = json.load(open(os.path.join(res.path, "plan.json")))
        assert len(plan["arrays"]) < 4  # fused: fewer arrays than trials
        by_id = {r["trial"]: r for r in res.rows}
        for i, t in enumerate(trials, 4 * k):  # trial ids run on across the rounds
            row = by_id[t.user_attrs["onnxfuse.trial"]]
            # told its best state's eval loss: what results.csv ranks it by
            assert row["trial"] == f"t{i:03d}" and t.value == trial_score(row, "eval_loss") == row["best_eval_loss"]
            assert t.params["optimizer.lr"] == row["optimizer.lr"]
        told = {t.user_attrs["onnxfuse.trial"]: t.value for t in trials}
        assert [r["trial"] for r in rows(os.path.join(res.path, "results.csv"))] == sorted(told, key=lambda k: (
            told[k], k))  # results.csv's order is the study's
    # an array of the first round trained again here: `report` (and train's table) rank its trials as results.csv
    # and Optuna do, and split --which best writes the states the sweep kept
    res = results[0]
    by_id = {r["trial"]: r for r in res.rows}
    job = json.load(open(os.path.join(res.path, "plan.json")))["arrays"][0]
    assert any(by_id[tid]["best_step"] < 8 for tid in job["trials"])  # a best state before the last step
    arr = tmp_path / "again"
    save_array(fuse_models([os.path.join(res.path, "models", f"{tid}.onnx") for tid in job["trials"]]), arr)
    train_array(arr, job["data"], TrainConfig.from_dict(job["settings"]), eval_data=job["eval_data"], progress=False)
    summary = summarize_array(arr)
    assert summary["ranked_by"] == {"metric": "eval_loss", "state": "best"}
    assert [m["score"] for m in summary["models"]] == [trial_score(by_id[tid], "eval_loss") for tid in job["trials"]]
    assert job["trials"][summary["best_model"]] == min(job["trials"], key=lambda tid: (
        trial_score(by_id[tid], "eval_loss"), tid))
    split_array(arr, tmp_path / "best", which="best")
    for b, tid in enumerate(job["trials"]):
        here = load_file(str(tmp_path / "best" / f"model_{b}.safetensors"))
        swept = load_file(os.path.join(res.path, "trials", tid, "best.safetensors"))
        assert sorted(here) == sorted(swept) and all(here[k].tobytes() == swept[k].tobytes() for k in here), tid
    with pytest.raises(ConfigError, match="direction"):
        optimize(optuna.create_study(direction="maximize"), parse_spec(raw, "spec", str(tmp_path)), 1, tmp_path / "x")


@pytest.mark.slow
def test_an_optuna_study_is_one_folder_and_resumes_without_redoing_trials(tmp_path):
    """Two rounds of 2 trials (arrays of 1, on one CPU): trial ids run on across the rounds, one results.csv holds
    every trial. A call stopped by a real SIGINT while its second round runs is resumed: no finished array is
    trained again, no trial is asked again, the study in a database is told the trials it holds as running; then
    a new in-memory study resumed from the folder gets every trial as it ended, and nothing trains."""
    import signal
    import threading

    import optuna
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    from onnxfuse.integrations.optuna import optimize

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    raw = base_spec(tmp_path, steps=60, eval_every=30, arrays={"size": 1}, search={
        "method": "random", "samples": 1, "space": {"optimizer.lr": {"low": 1e-3, "high": 3e-2, "log": True}}})
    spec, out, storage = parse_spec(raw, "spec", str(tmp_path)), tmp_path / "study", f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(direction="minimize", storage=storage, study_name="s",
                                sampler=optuna.samplers.TPESampler(seed=0))
    round1 = SweepDir(out / "rounds" / "round_001")

    def interrupt():  # Ctrl-C once the second round has one array done and one to go
        while True:
            try:
                st = json.load(open(round1.status_path))
            except (OSError, ValueError):
                st = {}
            if st.get("done") == 1:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.02)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        optimize(study, spec, n_trials=4, out_dir=out, batch=2, num_cpus=1, progress=False)
    record = json.load(open(out / "study.json"))["trials"]
    assert [(t["id"], t["round"], t["told"] is None) for t in record] == [
        ("t000", 0, False), ("t001", 0, False), ("t002", 1, True), ("t003", 1, True)]
    results = sorted(glob.glob(str(out / "rounds" / "*" / "arrays" / "*" / "result.json")))
    before = {p: open(p, "rb").read() for p in results}
    assert len(before) == 3

    study = optuna.load_study(study_name="s", storage=storage, sampler=optuna.samplers.TPESampler(seed=0))
    ran = optimize(study, None, n_trials=4, out_dir=out, batch=2, num_cpus=1, progress=False, resume=True)
    assert [len(r.ran) for r in ran] == [1]  # the stopped round's array without a result, alone
    assert all(open(p, "rb").read() == b for p, b in before.items())  # not trained again
    ids = [f"t{i:03d}" for i in range(4)]
    assert [t.user_attrs["onnxfuse.trial"] for t in study.trials] == ids  # none asked again
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    value = {t.user_attrs["onnxfuse.trial"]: t.value for t in study.trials}
    table = rows(out / "results.csv")  # every trial of the study, best first as the study ranks them
    assert [r["trial"] for r in table] == sorted(ids, key=lambda k: (value[k], k))
    assert sorted((r["trial"], r["round"]) for r in table) == [(t, str(i // 2)) for i, t in enumerate(ids)]
    assert all(os.path.isfile(out / r["checkpoint"]) for r in table)  # trials/<id>: its folder in its round
    runs = EventMultiplexer()
    runs.AddRunsFromDirectory(str(out / "trials"))
    assert sorted({run.split("/")[0] for run in runs.Runs()}) == ids  # TensorBoard sees every trial there

    fresh = optuna.create_study(direction="minimize")  # a new process's study: the folder's trials, no training
    assert optimize(fresh, None, n_trials=4, out_dir=out, resume=True) == []
    assert [(t.params, t.value, t.state) for t in fresh.trials] == [(t.params, t.value, t.state) for t in study.trials]
    with pytest.raises(InputFileError, match="resume=True"):
        optimize(fresh, spec, n_trials=4, out_dir=out)
    with pytest.raises(ConfigError, match="spec differs"):
        optimize(fresh, parse_spec({**raw, "steps": 9}, "spec", str(tmp_path)), 4, out, resume=True)


def test_resume_refuses_a_folder_that_is_no_sweep(tmp_path):
    with pytest.raises(InputFileError, match="not a sweep folder"):
        run_sweep(None, tmp_path, resume=True)


# --------------------------------------------------------------------------- successive halving across arrays
@pytest.mark.slow
def test_successive_halving_across_arrays(tmp_path):
    """8 trials in 4 arrays of 2; rungs at steps 4 and 8 keep the best half of the trials still training, by eval
    loss at the rung, whatever array they are in, and re-fuse the survivors into the fewest arrays of 2. A survivor
    equals its trial trained alone for all 12 steps; a trial stopped at a rung equals it trained alone up to
    that rung."""
    raw = base_spec(tmp_path, steps=12, halving=[4, 8], arrays={"size": 2},
                    search={"space": {"seed": [0, 1, 2, 3], "optimizer.lr": [0.03, 0.0003]}})
    res = run_sweep(write_spec(tmp_path, raw), tmp_path / "out", num_cpus=2, progress=False)
    out = SweepDir(tmp_path / "out")
    plan = json.load(open(out.plan_path))
    assert plan["halving"] == {"steps": [4, 8], "keep": 0.5} and res.arrays == 4
    decisions = json.load(open(out.halving_path))
    assert [len(d["survivors"]) for d in decisions] == [4, 2]
    assert [[len(a["trials"]) for a in d["arrays"]] for d in decisions] == [[2, 2], [2]]
    # each rung's decision, from the trials' own eval curves
    evals = {t["id"]: {int(r["step"]): float(r["loss"]) for r in rows(out.trial_file(t["id"], "metrics.csv"))
                       if r["split"] == "eval"} for t in plan["trials"]}
    alive = sorted(evals)
    for d in decisions:
        best = sorted(alive, key=lambda t: (evals[t][d["step"]], t))[:len(alive) // 2]
        assert d["survivors"] == sorted(best)
        alive = sorted(best)
    # survivors of different arrays were fused into one (each array of the first rung held one lr-0.03 trial)
    assert any(len({src for src, _ in a["sources"].values()}) == 2 for d in decisions for a in d["arrays"])
    steps = {r["trial"]: int(r["steps"]) for r in res.rows}
    status = {r["trial"]: r["status"] for r in res.rows}
    assert sorted(steps.values()) == [4, 4, 4, 4, 8, 8, 12, 12]
    assert all(status[t] == ("finished" if steps[t] == 12 else "stopped") for t in steps)
    assert all(len([r for r in rows(out.trial_file(t, "metrics.csv")) if r["split"] == "train"]) == steps[t]
               for t in steps)  # every curve whole, across the arrays it trained in
    check_trials_as_alone(out, plan, raw, steps)
    for r in res.rows:  # each trial's best state, kept across the arrays it trained in
        step, value = min(evals[r["trial"]].items(), key=lambda sv: (sv[1], sv[0]))
        assert (r["best_step"], r["best_eval_loss"]) == (step, pytest.approx(value, rel=1e-6))
    assert not [f for a in os.listdir(os.path.join(out.path, "arrays"))
                for f in os.listdir(out.array_path(a)) if f.endswith(".tar")]  # no rung folder left


@pytest.mark.slow
def test_auto_array_size_comes_from_the_planner_on_a_worker(tmp_path):
    raw = base_spec(tmp_path, steps=4, arrays={"size": "auto", "max_size": 2},
                    search={"space": {"optimizer.lr": LRS}})
    res = run_sweep(write_spec(tmp_path, raw), tmp_path / "out", num_cpus=2, progress=False)
    plan = json.load(open(SweepDir(tmp_path / "out").plan_path))
    (group,) = plan["groups"]
    assert group["B_from"].startswith("planner on ") and 1 <= group["B"] <= 2
    assert [len(a["trials"]) for a in plan["arrays"]] == ([2, 1] if group["B"] == 2 else [1, 1, 1])
    assert len(res.rows) == 3 and all(r["status"] == "finished" for r in res.rows)


@pytest.mark.slow
def test_a_sweep_that_fails_before_its_plan_leaves_nothing(tmp_path, capsys):
    """A factory argument the factory does not take: one line naming the trial; the -o folder is left as it was
    (absent), so the fixed spec runs there."""
    from onnxfuse.cli.main import main

    raw = base_spec(tmp_path, steps=2, search={"space": {"model.hiden": [16]}})
    out = tmp_path / "out"
    assert main(["sweep", write_spec(tmp_path, raw), "-o", str(out), "--cpus", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert "trial t000" in err and "hiden" in err and err.count("\n") == 1, err
    assert not out.exists()
    raw["search"]["space"] = {"model.hidden": [16]}
    assert main(["sweep", write_spec(tmp_path, raw), "-o", str(out), "--cpus", "1", "-q"]) == 0


# ------------------------------------------------------------------------------------------ report.png
def test_report_png_plots_the_metric_against_each_hyper_parameter_and_the_best_curves(tmp_path):
    """24 finished trials of a random search (lr log-uniform, weight decay uniform, hidden from a list), written as a
    sweep leaves them: a panel per searched key (a log axis for the log-uniform lr, a column per listed value),
    every trial's metric in it; the curves of the best 20, the caption saying so; the legend over no panel."""
    from onnxfuse.core._plot import data_overlap
    from onnxfuse.sweep._report_plot import CURVES_SHOWN, sweep_figure

    sweep = SweepDir(tmp_path / "sw")
    space = {"model.hidden": [32, 64], "optimizer.lr": {"low": 1e-4, "high": 1e-1, "log": True},
             "optimizer.weight_decay": {"low": 0.0, "high": 0.1}}
    sweep.write_json(sweep.spec_path, {"spec": {"search": {"method": "random", "space": space}}})
    rng = np.random.default_rng(0)
    trials, rows = [], []
    for k in range(24):
        p = {"model.hidden": [32, 64][k % 2], "optimizer.lr": float(10 ** rng.uniform(-4, -1)),
             "optimizer.weight_decay": float(rng.uniform(0, 0.1))}
        final = abs(np.log10(p["optimizer.lr"]) + 2) + 0.1  # best near lr 0.01
        trials.append({"id": f"t{k:03d}", "params": p})
        rows.append({"trial": f"t{k:03d}", **p, "status": "finished", "eval_loss": final})
        curve = ["step,split,loss,accuracy,lr"] + [f"{s},train,{2 / s + final},,0.1" for s in range(1, 31)]
        curve += [f"{s},eval,{2 / s + final},0.5,," for s in (10, 20, 30)]
        sweep.write_bytes(sweep.trial_file(f"t{k:03d}", "metrics.csv"), "\n".join(curve).encode())
    rows.sort(key=lambda r: r["eval_loss"])
    fig = sweep_figure(sweep, {"metric": "eval_loss", "direction": "minimize", "trials": trials}, rows,
                       {r["trial"]: r["eval_loss"] for r in rows})
    hidden, lr, wd, train, evaluation = fig.axes
    assert [t.get_text() for t in hidden.get_xticklabels()] == ["32", "64"]
    assert (lr.get_xscale(), wd.get_xscale()) == ("log", "linear")
    dots = lr.collections[0].get_offsets()  # every trial: its lr, its eval loss
    assert sorted(dots[:, 1]) == pytest.approx(sorted(r["eval_loss"] for r in rows))
    assert sorted(dots[:, 0]) == pytest.approx(sorted(t["params"]["optimizer.lr"] for t in trials))
    assert len(train.get_lines()) == 2 * CURVES_SHOWN and len(evaluation.get_lines()) == CURVES_SHOWN  # raw + smoothed
    assert "the best 20 of the 24 trials" in fig.subfigs[1]._suptitle.get_text()
    legend = fig.legends[0]
    assert len(legend.get_texts()) == CURVES_SHOWN and legend.get_texts()[0].get_text().startswith(rows[0]["trial"])
    assert data_overlap(fig, legend) == 0  # over no panel
