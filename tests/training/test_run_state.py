"""An array's run state says what it is (issues 36 and 37): every record is checked when it is read, every file a
record names is read from inside the array, a resume writes nothing twice and says "resumed" only once it can, and
``--resume`` continues the last run started -- never an earlier one, even when that run was killed in its first
seconds, before it had trained a step or reached a checkpoint.

Each case was an internal error, a wrong answer with exit status 0, or a resume of the wrong run before."""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.conftest import EXE, cli, kill, mlp_array, one_error_line, snapshot, wait_until
from onnxfuse import fuse_models, save_array

SHAPE = (8, 3, 4, 4)  # the MLP of conftest: 48 inputs
# A: 20 steps, checkpoints at 10 and 20, evaluations at 10 and 20 (each model's best state kept)
RUN_A = ["--batch-size", 16, "--steps", 20, "--checkpoint-every", 10, "--eval-every", 10, "--eval-fraction", 0.25,
         "--lr", 0.05, "--compile", "off"]
# a data factory that says it was called and waits for $GO: a run killed while its data loads
FACTORY = """import os, time
import numpy as np

def make():
    open(os.environ["IN_FACTORY"], "w").close()
    while not os.path.exists(os.environ["GO"]):
        time.sleep(0.02)
    with np.load(os.path.join(os.path.dirname(__file__), "data.npz")) as d:
        return {k: d[k] for k in d.files}

def broken():
    raise RuntimeError("no data today")
"""


# ---------------------------------------------------------------------------------------------------- helpers
def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def edit_json(path, change) -> None:
    record = read_json(path)
    changed = change(record)  # in place (None), or a new record
    record = record if changed is None else changed
    with open(path, "w") as f:
        json.dump(record, f)


def rows(arr) -> list[dict]:
    with open(os.path.join(arr, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


def files(arr) -> dict:
    """``snapshot`` of the array but its lock file (which names the last holder: a killed one's pid)."""
    return {k: v for k, v in snapshot(arr).items() if k != ".onnxfuse.lock"}


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """3 MLPs fused into ``array``, trained by run A (``RUN_A``), and a data file; copied fresh for each test."""
    from onnxfuse.cli.main import main

    d = tmp_path_factory.mktemp("run_state")
    mlp_array(d, 3, seed0=30, n=96)
    (d / "factory.py").write_text(FACTORY)
    assert main(["train", str(d / "array"), "--data", str(d / "data.npz"), *map(str, RUN_A), "-q"]) == 0
    return d


@pytest.fixture
def work(template, tmp_path):
    for name in ("array", "jobs"):
        shutil.copytree(template / name, tmp_path / name, symlinks=True)
    for name in ("data.npz", "factory.py"):
        shutil.copy(template / name, tmp_path / name)
    return tmp_path


# ------------------------------------------------------------------------------- 1. every record checked when read
def _records(arr):
    return {"train_state": arr / "trained" / "train_state.json", "checkpoint": arr / "checkpoints" / "step_00000020" /
            "state.json", "array": arr / "array.json", "run": arr / "run.json", "metrics": arr / "metrics.csv"}


def _first_weight(record):
    next(iter(record["fused_weights"].values()))["slot"]["perm"] = [0, 0]


CORRUPT = {
    # case: (record, how it is edited, the command that reads it, what the line says)
    "train_state_model_7": ("train_state", lambda r: r.update(models=[0, 1, 7]), "split",
                            "models.2 is not a model of this array, which has 3"),
    "train_state_metric": ("train_state", lambda r: r["best"].update(metric="bogus"), "report", "best.metric"),
    "train_state_status_key": ("train_state", lambda r: r.update(status={"x": {"status": "diverged", "step": 3}}),
                               "split", "key 'status.x' is not a model index"),
    "metrics_random_bytes": ("metrics", bytes(range(256)) * 4, "report", "not UTF-8"),
    "metrics_model_7": ("metrics", b"step,model,split,loss\n1,0,train,2.3\n1,7,train,2.3\n", "report",
                        "line 3: model is not a model of this array"),
    "checkpoint_sampler": ("checkpoint", lambda r: r.update(sampler="x"), "resume", "sampler"),
    # the sampler's inner values (an internal TypeError mid-run; an offset of -5 trained on NaN losses)
    "checkpoint_sampler_epoch": ("checkpoint", lambda r: r["sampler"].update(epoch="x"), "resume",
                                 "epoch is 'x', not an integer"),
    "checkpoint_sampler_offset": ("checkpoint", lambda r: r["sampler"].update(offset=-5), "resume",
                                  "offset is -5, not an integer"),
    "checkpoint_sampler_orders": ("checkpoint", lambda r: r["sampler"].update(orders=[[0, 0, 1]]), "resume",
                                  "orders are not permutations"),
    "checkpoint_models": ("checkpoint", lambda r: r.update(models=[0, 1, 5]), "resume", "models.2"),
    "checkpoint_active": ("checkpoint", lambda r: r.update(active=[True]), "resume",
                          "active has 1 entries for the 3 models"),
    "checkpoint_step": ("checkpoint", lambda r: r.update(step=7), "resume", "step 7 is not its folder's (20)"),
    "array_list": ("array", lambda r: [], "split", "it is not a JSON object"),
    "array_B": ("array", lambda r: r.update(B=5), "split", "B is 5 but models lists 3"),
    "array_perm": ("array", _first_weight, "split", "is not a permutation"),
    "run_id_number": ("run", lambda r: r.update(id=5), "train", "id input should be a valid string"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_a_corrupt_or_edited_record_is_one_line_naming_the_file(case, work, capsys):
    """Each record, hand-edited or corrupt, is one `onnxfuse: error:` line (exit 2) naming the file and what is
    wrong, whichever command reads it (issue 36, item 6: IndexError, UnicodeDecodeError, TypeError,
    AttributeError, or a wrong answer before)."""
    arr, data = work / "array", work / "data.npz"
    name, change, command, what = CORRUPT[case]
    path = _records(arr)[name]
    if isinstance(change, bytes):
        path.write_bytes(change)
    else:
        edit_json(path, change)
    args = {"split": ["split", arr, "-o", work / "out"], "report": ["report", arr],
            "resume": ["train", arr, "--resume", "--steps", 30, "-q"],
            "train": ["train", arr, "--data", data, "--steps", 2, "--batch-size", 16, "-q"]}[command]
    before = snapshot(arr)
    code, _, err = cli(capsys, *args)
    line = one_error_line(err)
    assert code == 2 and f"'{path}'" in line and what in line, line
    assert snapshot(arr) == before and not (work / "out").exists()


# ------------------------------------------------------------------------ 2. what a record names stays inside
@pytest.mark.parametrize("where", ["absolute", "parent", "symlinked_best"])
def test_a_best_state_outside_the_array_is_refused(where, work, capsys):
    """Model 1's best state named by an absolute path, a `../` path, or a best/ that is a symbolic link out of the
    array: split --which best refuses in one line and writes nothing (before: the outside file's tensors were
    written as model 1's with exit 0, or the `../` path reported as "missing")."""
    arr = work / "array"
    state = arr / "trained" / "train_state.json"
    name = read_json(state)["best"]["models"]["1"]["file"]
    outside = work / "elsewhere"
    outside.mkdir()
    planted = {k: np.full_like(v, 7.0) for k, v in load_file(arr / "best" / name).items()}
    if where == "symlinked_best":
        for f in os.listdir(arr / "best"):
            save_file(planted, outside / f)
        shutil.rmtree(arr / "best")
        os.symlink(outside, arr / "best")
        what = "leads out of the array folder"
    else:
        save_file(planted, outside / name)
        named = str(outside / name) if where == "absolute" else f"../../elsewhere/{name}"
        edit_json(state, lambda r: r["best"]["models"]["1"].update(file=named))
        what = f"best.models.1.file is '{named}'"
    code, _, err = cli(capsys, "split", arr, "-o", work / "out", "--which", "best")
    line = one_error_line(err)
    assert code == 2 and what in line, line
    assert not (work / "out").exists()


def test_a_checkpoint_naming_a_best_state_outside_is_refused_by_resume(work, capsys):
    arr = work / "array"
    ckpt = arr / "checkpoints" / "step_00000020" / "state.json"
    name = read_json(ckpt)["best"]["models"]["0"]["file"]
    shutil.copy(arr / "best" / name, work / name)
    edit_json(ckpt, lambda r: r["best"]["models"]["0"].update(file=str(work / name)))
    before = snapshot(arr)
    code, _, err = cli(capsys, "train", arr, "--resume", "--steps", 30, "-q")
    line = one_error_line(err)
    assert code == 2 and f"'{ckpt}'" in line and "best.models.0.file" in line, line
    assert snapshot(arr) == before


def test_a_best_folder_linked_out_of_the_array_is_neither_read_nor_written_by_resume(work, capsys):
    """best/ a symbolic link to another folder: `train --resume` refuses in one line, and the other folder keeps
    its files (before: the resumed run wrote its new best states there and removed the ones no record named)."""
    arr = work / "array"
    shutil.copytree(arr / "best", work / "elsewhere")
    (work / "elsewhere" / "model_0_step_00000001.safetensors").write_bytes(b"someone else's")
    shutil.rmtree(arr / "best")
    os.symlink(work / "elsewhere", arr / "best")
    outside = snapshot(work / "elsewhere")
    code, _, err = cli(capsys, "train", arr, "--resume", "--steps", 40, "-q")
    line = one_error_line(err)
    assert code == 2 and "leads out of the array folder" in line, line
    assert snapshot(work / "elsewhere") == outside


def test_a_run_id_that_is_a_path_is_refused_and_nothing_moves_out(work, capsys):
    """A new run moves the previous run's outputs to runs/<its id>/: an id `../../outside` moved them out of the
    array before."""
    arr = work / "array"
    edit_json(arr / "run.json", lambda r: r.update(id="../../outside"))
    before = snapshot(arr)
    code, _, err = cli(capsys, "train", arr, "--data", work / "data.npz", "--steps", 2, "--batch-size", 16, "-q")
    line = one_error_line(err)
    assert code == 2 and f"'{arr / 'run.json'}'" in line and "id is not a run id" in line, line
    assert snapshot(arr) == before and not (work / "outside").exists()


# ---------------------------------------------------------------------- 3. a resume writes nothing twice
def test_a_resume_from_the_last_step_changes_nothing(work, capsys):
    """Run A's checkpoint at its last step: `train --resume` says there is nothing left to train and changes no
    file (before: the step-20 evaluation rows twice in metrics.csv, final losses "nan", "(0 samples/s)"). The
    same when trained/ is missing, as a kill right after that checkpoint leaves it: the resume writes trained/
    from the checkpoint with the run's own final losses, weights and best states, and metrics.csv stays as
    it was."""
    arr = work / "array"
    before = snapshot(arr)
    state = read_json(arr / "trained" / "train_state.json")
    assert all(np.isfinite(v) for v in state["final_loss"].values())
    code, out, err = cli(capsys, "train", arr, "--resume")
    assert code == 0, err
    assert "nothing left to train: run " in out and "samples/s" not in out
    assert snapshot(arr) == before

    shutil.rmtree(arr / "trained")
    os.makedirs(arr / ".trained.tmp-killed")
    code, out, err = cli(capsys, "train", arr, "--resume", "-q")
    assert code == 0, err
    assert "nothing left to train" in out
    after = snapshot(arr)
    assert {k: v for k, v in after.items() if not k.startswith("trained")} == \
        {k: v for k, v in before.items() if not k.startswith("trained")}  # metrics.csv, best/, checkpoints/
    again = read_json(arr / "trained" / "train_state.json")
    for key in ("final_loss", "best", "eval", "steps", "step", "status", "run"):
        assert again[key] == state[key], key
    assert after["trained/weights.safetensors"] == before["trained/weights.safetensors"]


def test_a_resume_after_a_kill_at_the_last_checkpoint_writes_each_row_once(work, capsys):
    """A real SIGKILL as soon as the last checkpoint appears (trained/ written or not by then): the resume ends
    with every metrics row once and the run's finite final losses."""
    arr = work / "array"
    shutil.rmtree(arr)
    shutil.copytree(work / "jobs", work / "jobs_b")
    save_array(fuse_models([str(work / "jobs_b" / f"model_{b}.onnx") for b in range(3)]), arr)
    p = subprocess.Popen([EXE, "train", str(arr), "--data", str(work / "data.npz"), *map(str, RUN_A), "-q"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    last = arr / "checkpoints" / "step_00000020"
    while not last.exists() and p.poll() is None:
        time.sleep(0.005)
    kill(p)
    code, out, err = cli(capsys, "train", arr, "--resume", "-q")
    assert code == 0, err
    keys = [(r["step"], r["model"], r["split"]) for r in rows(arr)]
    assert len(keys) == len(set(keys)) and ("20", "2", "eval") in keys
    assert all(np.isfinite(v) for v in read_json(arr / "trained" / "train_state.json")["final_loss"].values())


def test_a_resume_past_the_steps_asked_for_says_only_that(work, capsys):
    """`train --resume --steps 5` on a run at step 20 is one error line, before anything says "resumed from"."""
    arr = work / "array"
    before = snapshot(arr)
    code, _, err = cli(capsys, "train", arr, "--resume", "--steps", 5)
    line = one_error_line(err)
    assert code == 2 and "has trained 20 steps, past the 5 steps asked for" in line
    assert snapshot(arr) == before


# ------------------------------------------------------------------ 4. --resume continues the last run started
def test_a_run_killed_while_its_data_loads_is_the_one_resume_continues(work, capsys, monkeypatch):
    """Run A finished (checkpoints 10 and 20); run B, other settings, is killed in its first seconds, while its
    data loads. A run that then fails before its first step changes nothing; `train --resume` continues B from its
    start, not A (before: "resumed from ... step_00000020" and A's table, exit 0)."""
    arr = work / "array"
    run_a = read_json(arr / "run.json")["id"]
    env = {**os.environ, "IN_FACTORY": str(work / "in_factory"), "GO": str(work / "go")}
    monkeypatch.setenv("GO", str(work / "go"))
    monkeypatch.setenv("IN_FACTORY", str(work / "in_factory"))
    p = subprocess.Popen([EXE, "train", str(arr), "--data", f"{work / 'factory.py'}:make", "--steps", "12",
                          "--batch-size", "16", "--lr", "0.001", "-q"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env)
    wait_until(p, lambda: (work / "in_factory").exists())
    kill(p)
    assert read_json(arr / "run.json")["id"] == run_a  # B changed nothing of A's

    killed = files(arr)  # A's outputs, and B's record of itself
    code, _, err = cli(capsys, "train", arr, "--data", f"{work / 'factory.py'}:broken", "--steps", 4, "-q")
    assert code == 2 and "no data today" in one_error_line(err)
    assert files(arr) == killed  # a run that failed changed nothing: B is still the last run started

    code, _, err = cli(capsys, "train", arr, "--resume", "-q")  # B's data is code: given again, never run by itself
    assert code == 2 and f"--data was {work / 'factory.py'}:make, a function that runs code" in one_error_line(err)
    (work / "go").write_text("")
    code, out, err = cli(capsys, "train", arr, "--resume", "--data", f"{work / 'factory.py'}:make", "-q")
    assert code == 0, err
    run_b = read_json(arr / "run.json")["id"]
    assert run_b != run_a and read_json(arr / "trained" / "train_state.json")["run"]["id"] == run_b
    assert {r["lr"] for r in rows(arr)} == {"0.001"} and {r["run"] for r in rows(arr)} == {run_b}
    assert [int(r["step"]) for r in rows(arr) if r["model"] == "0"] == list(range(1, 13))
    assert sorted(os.listdir(arr / "runs")) == [run_a]  # A's outputs, moved aside when B trained its first step
    assert "0.05" in {r["lr"] for r in rows(arr / "runs" / run_a)}


def test_a_run_killed_before_its_first_checkpoint_resumes_from_its_start(work, capsys):
    """Run B trains without checkpoints and is killed after some steps: `train --resume` trains B again from its
    start (before: refused), to the weights of B uninterrupted, each metrics row once."""
    arr, data = work / "array", work / "data.npz"
    b_run = ["--data", data, "--batch-size", 16, "--lr", 0.001, "--momentum", 0.9, "--compile", "off", "-q"]
    p = subprocess.Popen([EXE, "train", str(arr), *map(str, b_run), "--steps", "100000"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_until(p, lambda: os.path.exists(arr / "metrics.csv") and any(r["lr"] == "0.001" for r in rows(arr)))
    kill(p)
    run_b = read_json(arr / "run.json")["id"]
    code, _, err = cli(capsys, "train", arr, "--resume", "--steps", 15, "-q")
    assert code == 0, err
    assert read_json(arr / "run.json")["id"] == run_b
    assert [int(r["step"]) for r in rows(arr) if r["model"] == "0"] == list(range(1, 16))

    ref = work / "ref"
    save_array(fuse_models([str(work / "jobs" / f"model_{b}.onnx") for b in range(3)]), ref)
    assert cli(capsys, "train", ref, *b_run, "--steps", 15)[0] == 0
    want, got = (load_file(a / "trained" / "weights.safetensors") for a in (ref, arr))
    assert all(want[k].tobytes() == got[k].tobytes() for k in want)
