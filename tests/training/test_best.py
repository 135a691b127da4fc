"""Best states (``--keep-best``): each model's state at its best evaluation is kept beside its final one, ``split
--which best`` writes exactly that state (and says so in its files), and ``train``'s table, ``report`` and
report.json name the same best model, by the one ranking (``onnxfuse/recipe/ranking.py``). A sweep's results.csv
and Optuna are checked against the same ranking in ``tests/sweep/test_sweep.py``; the kill-and-resume test of
``tests/training/test_run.py`` checks that a resumed run keeps the same best states."""
from __future__ import annotations

import csv
import json
import os

import numpy as np
import onnx
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from tests.conftest import export_all, make_modules
from onnxfuse import fuse_models, save_array
from onnxfuse.cli.main import main
from onnxfuse.core.array import ArrayDir
from onnxfuse.core.errors import ConfigError
from onnxfuse.core.split import split_weights
from onnxfuse.training.run import TrainConfig, train_array

SHAPE = (8, 3, 4, 4)  # conftest's MLP: 48 inputs
STEPS, EVAL_EVERY = 30, 5


def _data(folder):
    """Random labels: an eval loss that falls for a few steps, then rises as the models memorize."""
    rng = np.random.default_rng(0)
    np.savez(folder / "data.npz", input=rng.standard_normal((64,) + SHAPE[1:]).astype(np.float32),
             labels=rng.integers(0, 10, 64))
    return folder / "data.npz"


def _array(folder, B=3):
    save_array(fuse_models(export_all(make_modules("mlp", B, seed0=30), SHAPE, folder / "jobs")), folder / "array")
    return folder / "array"


def _cli(capsys, *args) -> str:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _best_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("best: "))


def test_split_which_best_writes_each_models_state_at_its_best_step(tmp_path, capsys):
    data, arr = _data(tmp_path), _array(tmp_path)
    # a checkpoint at every evaluation, all kept: each model's state at any evaluated step, for reference
    trained = _cli(capsys, "train", arr, "--data", data, "--steps", STEPS, "--batch-size", 16, "--optimizer", "adam",
                   "--lr", "0.03,0.01,0.001", "--weight-decay", "0,0,0.0001", "--eval-fraction", 0.25,
                   "--eval-every", EVAL_EVERY, "--checkpoint-every", EVAL_EVERY, "--keep-checkpoints", 10, "-q")
    header = trained.splitlines()[1].split()
    assert header[:3] == ["model", "lr", "weight_decay"] and "best" in header  # the settings that differ
    kept = json.load(open(arr / "trained" / "train_state.json"))["best"]
    assert kept["metric"] == "eval_loss" and sorted(kept["models"]) == ["0", "1", "2"]  # eval data: kept by default
    steps = {int(b): e["step"] for b, e in kept["models"].items()}
    assert min(steps.values()) < STEPS  # some model's best is not its last state
    evals = {}
    for r in csv.DictReader(open(arr / "metrics.csv")):
        if r["split"] == "eval":
            evals.setdefault(int(r["model"]), []).append((int(r["step"]), float(r["loss"])))
    spec = ArrayDir(arr).load_spec()
    _cli(capsys, "split", arr, "-o", tmp_path / "best", "--which", "best")
    _cli(capsys, "split", arr, "-o", tmp_path / "final")
    for b, e in kept["models"].items():
        b = int(b)
        first_min = min(evals[b], key=lambda sv: (sv[1], sv[0]))
        assert (e["step"], e["value"]) == (first_min[0], pytest.approx(first_min[1], rel=1e-6))
        ckpt = str(ArrayDir(arr).checkpoint_path(e["step"]))
        weights, _, _ = ArrayDir.read_state(ckpt, "", spec)
        at_step = split_weights(ArrayDir.state_spec(ckpt), weights, steps=e["step"])[b]
        got = load_file(str(tmp_path / "best" / f"model_{b}.safetensors"))
        assert sorted(got) == sorted(at_step) and all(got[k].tobytes() == at_step[k].tobytes() for k in got), b
        with safe_open(str(tmp_path / "best" / f"model_{b}.safetensors"), "np") as f:
            meta = f.metadata()
        assert (meta["onnxfuse.state"], meta["onnxfuse.step"], meta["onnxfuse.metric"]) == \
            ("best", str(e["step"]), "eval_loss") and float(meta["onnxfuse.value"]) == e["value"]
        props = {p.key: p.value for p in onnx.load(str(tmp_path / "best" / f"model_{b}.onnx")).metadata_props}
        assert props["onnxfuse.state"] == "best" and props["onnxfuse.step"] == str(e["step"])
        with safe_open(str(tmp_path / "final" / f"model_{b}.safetensors"), "np") as f:
            assert f.metadata()["onnxfuse.state"] == "final" and f.metadata()["onnxfuse.step"] == str(STEPS)
    # one ranking: the model whose kept best eval loss is lowest, in train's table, report's and report.json
    best = min(kept["models"], key=lambda b: kept["models"][b]["value"])
    reported = _cli(capsys, "report", arr)
    summary = json.load(open(arr / "report.json"))
    assert summary["best_model"] == int(best) and summary["ranked_by"] == {"metric": "eval_loss", "state": "best"}
    assert _best_line(trained) == _best_line(reported) == (
        f"best: model {best} by its best eval_loss {kept['models'][best]['value']:.4f} at step "
        f"{kept['models'][best]['step']} (`onnxfuse split --which best` writes that state)")
    assert summary["models"][0]["hparams"] == {"lr": 0.03, "weight_decay": 0.0}
    # best/ holds the files a record names, trained/'s or a checkpoint's (from which a resumed run goes on)
    named = {e["file"] for e in kept["models"].values()}
    for ckpt in ArrayDir(arr).checkpoints():
        named |= {e["file"] for e in ArrayDir(arr).checkpoint_record(ckpt, "")["best"]["models"].values()}
    assert sorted(os.listdir(arr / "best")) == sorted(named)


def test_without_best_states_the_ranking_reads_the_final_state(tmp_path, capsys):
    """--keep-best off: nothing is kept, every table ranks by the final eval loss, and split --which best says
    why it cannot."""
    data, arr = _data(tmp_path), _array(tmp_path, B=2)
    trained = _cli(capsys, "train", arr, "--data", data, "--steps", 10, "--batch-size", 16, "--lr", "0.3,0.01",
                   "--eval-fraction", 0.25, "--eval-every", 5, "--keep-best", "off", "-q")
    assert not os.path.exists(arr / "best")
    final = {int(r["model"]): float(r["loss"]) for r in csv.DictReader(open(arr / "metrics.csv"))
             if r["split"] == "eval" and r["step"] == "10"}
    best = min(final, key=final.get)
    assert _best_line(trained) == f"best: model {best} by its final eval_loss {final[best]:.4f}"
    assert main(["split", str(arr), "-o", str(tmp_path / "m"), "--which", "best"]) == 2
    assert "kept no best states" in capsys.readouterr().err and not os.path.exists(tmp_path / "m")


def test_keep_best_settings_are_checked(tmp_path):
    data, arr = _data(tmp_path), _array(tmp_path, B=1)
    with pytest.raises(ConfigError, match="keep_best eval_loss needs eval data"):
        train_array(arr, data, TrainConfig(steps=2, keep_best="eval_loss"), progress=False)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "reg.npz", input=rng.standard_normal((32,) + SHAPE[1:]).astype(np.float32),
             labels=rng.standard_normal((32, 10)).astype(np.float32))
    with pytest.raises(ConfigError, match="the loss mse has no accuracy"):
        train_array(arr, tmp_path / "reg.npz", TrainConfig(steps=2, loss="mse", keep_best="eval_accuracy",
                                                           eval_fraction=0.25), progress=False)
    assert not os.path.exists(arr / "trained")
