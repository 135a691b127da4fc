"""Every pointer to a checkpoint names the state whose metric it reports, by the one ranking (recipe/ranking.py):
Optuna's ``onnxfuse.checkpoint`` attribute, the ``checkpoint`` / ``onnx`` / ``final_checkpoint`` columns of a
sweep's and a study's results.csv, and report.json's per-model ``state``. Each file is loaded (a torch module, or
onnxruntime for the .onnx) and scored on the held-out data the run evaluated on, to the value reported beside it.

The trials train on random labels with a large learning rate, so that their held-out loss is lowest early and
grows as they memorise the training set: each one's best state is not its last."""
from __future__ import annotations

import csv
import math
import os

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.conftest import ROOT, rel_err, run_onnx
from onnxfuse.exporters import zoo

SHAPE = [8, 3, 4, 4]  # zoo.MLP(in_features=48)
EVAL_FRACTION, DATA_SEED = 0.25, 3


def data_file(folder, n=160):
    rng = np.random.default_rng(0)
    path = folder / "data.npz"
    np.savez(path, input=rng.standard_normal([n] + SHAPE[1:]).astype(np.float32), labels=rng.integers(0, 10, n))
    return path


def held_out(path) -> tuple[np.ndarray, np.ndarray]:
    from onnxfuse.recipe.datasets import split_holdout

    _, ev = split_holdout(dict(np.load(path)), EVAL_FRACTION, DATA_SEED)
    return ev["input"], ev["labels"]


def eval_loss_of(weights_file, hidden: int, data) -> float:
    """The mean cross-entropy on the held-out data of a zoo.MLP loaded from ``weights_file`` (strict)."""
    x, y = data
    m = zoo.MLP(in_features=48, hidden=hidden)
    m.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in load_file(str(weights_file)).items()}, strict=True)
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(m.eval()(torch.from_numpy(x)), torch.from_numpy(y)))


def onnx_eval_loss(model_file, data) -> float:
    x, y = data
    logits = torch.from_numpy(run_onnx(str(model_file), {"input": x})[0])
    return float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)))


def rows(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_every_pointer_of_an_optuna_study_loads_to_the_value_it_reports(tmp_path):
    """A study of 2 trials (one round, one array of 2): the study is told each trial's best state's eval loss;
    the attribute ``onnxfuse.checkpoint`` (``study.best_trial``'s as docs/sweeps.md reads it) and the results.csv
    rows of the study and of its round name files that score exactly that; ``final_checkpoint`` scores the final
    eval loss."""
    import optuna

    from onnxfuse.integrations.optuna import optimize
    from onnxfuse.sweep import parse_spec
    from onnxfuse.sweep.results import trial_score

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    data = data_file(tmp_path)
    raw = {"model": {"factory": "onnxfuse.exporters.zoo:MLP", "input_shape": SHAPE,
                     "args": {"in_features": 48, "hidden": 32}},
           # a range and no search.method: Optuna's distribution (suggest_float, log)
           "search": {"space": {"optimizer.lr": {"low": 0.2, "high": 0.5, "log": True}}},
           "arrays": {"size": 2}, "data": {"train": str(data), "eval_fraction": EVAL_FRACTION, "seed": DATA_SEED},
           "loss": "cross-entropy", "optimizer": {"name": "sgd", "momentum": 0.9}, "steps": 24, "batch_size": 16,
           "eval_every": 4}
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0))
    out = tmp_path / "study"
    optimize(study, parse_spec(raw, "spec", str(tmp_path)), n_trials=2, out_dir=out, batch=2, num_cpus=2,
             progress=False)
    ev = held_out(data)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert all(t.distributions["optimizer.lr"].log for t in study.trials)
    table = {r["trial"]: r for r in rows(out / "results.csv")}
    assert any(int(r["best_step"]) < 24 for r in table.values())  # a best state before the last step
    for t in study.trials:
        row = table[t.user_attrs["onnxfuse.trial"]]
        best, final = float(row["best_eval_loss"]), float(row["eval_loss"])
        assert t.value == pytest.approx(best, rel=1e-5) and t.user_attrs["onnxfuse.state"] == "best"
        here = eval_loss_of(t.user_attrs["onnxfuse.checkpoint"], 32, ev)
        assert rel_err(here, t.value) < 1e-5, (t.number, here, t.value, final)
        assert rel_err(onnx_eval_loss(t.user_attrs["onnxfuse.onnx"], ev), t.value) < 1e-5
        if int(row["best_step"]) < 24:  # the two states are told apart by far more than the tolerance
            assert rel_err(final, best) > 1e-3
    winner = study.best_trial
    assert eval_loss_of(winner.user_attrs["onnxfuse.checkpoint"], 32, ev) == pytest.approx(study.best_value, rel=1e-5)
    # results.csv of the study (paths under its trials/ links) and of the round (its own folder)
    round_dir = out / "rounds" / "round_000"
    for folder in (out, round_dir):
        for r in rows(folder / "results.csv"):
            assert r["state"] == "best"
            assert rel_err(eval_loss_of(folder / r["checkpoint"], 32, ev), trial_score(r, "eval_loss")) < 1e-5
            assert rel_err(onnx_eval_loss(folder / r["onnx"], ev), trial_score(r, "eval_loss")) < 1e-5
            assert rel_err(eval_loss_of(folder / r["final_checkpoint"], 32, ev), float(r["eval_loss"])) < 1e-5
    assert not math.isnan(study.best_value)
    check_study_picture(out, {t.user_attrs["onnxfuse.trial"]: t.params["optimizer.lr"] for t in study.trials})


def check_study_picture(out, lr_of: dict[str, float]) -> None:
    """The study's report.png: the log-searched lr on a log axis (few values: without the study's distributions
    it was drawn as a column per value), each trial's dot in its legend entry's colour, the best one starred."""
    from matplotlib.colors import to_rgba

    from onnxfuse.integrations.optuna import _Study
    from onnxfuse.sweep._report_plot import sweep_figure
    from onnxfuse.sweep.results import trial_score

    study = _Study(out)
    study.load()
    plan, table = study.report("eval_loss", "minimize")
    assert plan["space"]["optimizer.lr"] == {"low": 0.2, "high": 0.5, "log": True}
    fig = sweep_figure(study.folder, plan, table, {r["trial"]: trial_score(r, "eval_loss") for r in table})
    lr = fig.axes[0]
    assert lr.get_xscale() == "log" and "lr (log scale)" == lr.get_xlabel()
    legend = fig.legends[0]
    legend_colour = {text.get_text().split(":")[0]: to_rgba(handle.get_color())
                     for text, handle in zip(legend.get_texts(), legend.legend_handles)}
    assert sorted(legend_colour) == sorted(lr_of)
    dots, star = lr.collections[:2]
    for (x, _), colour in zip(dots.get_offsets(), dots.get_facecolors()):
        trial = min(lr_of, key=lambda t: abs(lr_of[t] - x))
        assert tuple(colour) == pytest.approx(legend_colour[trial]), trial
    assert tuple(star.get_facecolors()[0]) == pytest.approx(legend_colour[table[0]["trial"]])
    assert len({legend_colour[t] for t in lr_of}) == len(lr_of)


def test_report_json_names_the_state_each_model_is_ranked_by(tmp_path, capsys):
    """Two MLPs trained as one array with evaluations and best states kept: report.json's per-model ``state`` is
    the state of its ``score``, and `split --which STATE` writes a file that scores it; the other state scores
    the other value."""
    from tests.conftest import cli
    from onnxfuse import fuse_models, save_array
    from onnxfuse.exporters import export_module
    from onnxfuse.training.run import TrainConfig, train_array
    from onnxfuse.training.report import make_report

    data = data_file(tmp_path)
    paths = []
    for b in range(2):
        torch.manual_seed(b)
        paths.append(str(tmp_path / f"m{b}.onnx"))
        export_module(zoo.MLP(in_features=48, hidden=32), paths[-1], input_shape=SHAPE)
    save_array(fuse_models(paths), tmp_path / "array")
    train_array(tmp_path / "array", str(data), TrainConfig(
        steps=24, batch_size=16, optimizer="sgd", lr=[0.3, 0.4], momentum=0.9, eval_fraction=EVAL_FRACTION,
        eval_every=4, seed=DATA_SEED, runtime="torch", verify_steps=0), progress=False)
    summary = make_report(tmp_path / "array")
    ev = held_out(data)
    for which in ("best", "final"):
        assert cli(capsys, "split", tmp_path / "array", "-o", tmp_path / which, "--which", which, "-q")[0] == 0
    assert any(m["kept_best"]["step"] < 24 for m in summary["models"])
    for m in summary["models"]:
        b = m["model"]
        assert m["state"] == "best"
        assert rel_err(eval_loss_of(tmp_path / "best" / f"model_{b}.safetensors", 32, ev), m["score"]) < 1e-5
        assert rel_err(eval_loss_of(tmp_path / "final" / f"model_{b}.safetensors", 32, ev),
                       m["last_eval_loss"]) < 1e-5


def documented_study_spec() -> str:
    """The YAML block of docs/sweeps.md's Optuna section, as a reader copies it into study.yaml."""
    import re

    text = open(os.path.join(ROOT, "docs", "sweeps.md"), encoding="utf-8").read()
    section = text[text.index("**Optuna**"):]
    return re.search(r"```yaml\n(.*?)```", section, re.S).group(1)


def test_the_documented_optuna_spec_runs_unmodified(tmp_path):
    """docs/sweeps.md's study.yaml (ranges and no search.method) as it is written, two trials: the study samples
    the log range log-uniformly, and the best trial's checkpoint loads into the factory's module (strict) and
    scores the value the study was told."""
    import optuna

    from onnxfuse.integrations.optuna import optimize
    from onnxfuse.recipe.datasets import load_named, split_holdout

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    (tmp_path / "study.yaml").write_text(documented_study_spec())
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0))
    optimize(study, tmp_path / "study.yaml", n_trials=2, out_dir=tmp_path / "study", batch=2, num_cpus=2,
             progress=False)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    lr = study.trials[0].distributions["optimizer.lr"]
    assert (lr.low, lr.high, lr.log) == (1e-4, 1e-1, True)
    best = study.best_trial
    _, ev = split_holdout(load_named("sklearn:digits"), 0.2, 0)
    m = zoo.MLP(in_features=64, hidden=best.params["model.hidden"])
    m.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in
                       load_file(best.user_attrs["onnxfuse.checkpoint"]).items()}, strict=True)
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(m(torch.from_numpy(ev["input"])), torch.from_numpy(ev["labels"]))
    assert rel_err(float(loss), study.best_value) < 1e-5
