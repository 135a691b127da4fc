"""The array folder never lies: every case of issue 9 as a careful user met it, on real CLI runs, real files and
real SIGKILLs. (1) a resumed run is the folder's own run, (2) fault isolation covers BatchNorm statistics,
(3) one command at a time per folder, (4) split refuses an untrained array, (5) --overwrite never replaces an
input, (6) non-finite data is an error, (7) failures the user can fix are one error line with exit status 2,
(8) killed runs leave nothing behind, (9) small messages. The README's "What onnxfuse guarantees" cites these."""
from __future__ import annotations

import csv
import json
import os
import resource
import shutil
import signal
import subprocess

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.conftest import (EXE, cli, fresh_copy, have_userns, in_tmpfs, make_modules, mlp_array,
                            one_error_line, snapshot, kill, wait_until)
from onnxfuse import fuse_models, save_array

SHAPE = (8, 3, 4, 4)  # the MLP of conftest: 48 inputs


# ---------------------------------------------------------------------------------------------------- helpers
def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def rows(arr) -> list[dict]:
    with open(os.path.join(arr, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


def checkpoints(arr) -> dict[int, str]:
    """step -> the id of the run that wrote the checkpoint (None if it does not say)."""
    root, out = os.path.join(arr, "checkpoints"), {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name.startswith("step_"):
            try:
                out[int(name[5:])] = (read_json(os.path.join(root, name, "state.json")).get("run") or {}).get("id")
            except (OSError, ValueError):
                pass
    return out


def temporaries(arr) -> list[str]:
    found = []
    for folder in (arr, os.path.join(arr, "checkpoints")):
        if os.path.isdir(folder):
            found += [n for n in os.listdir(folder) if ".tmp-" in n or ".old-" in n]
    return found


def start_train(arr, *flags, **popen) -> subprocess.Popen:
    return subprocess.Popen([EXE, "train", str(arr), *[str(f) for f in flags]], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, **popen)


def weights(arr) -> dict:
    return load_file(os.path.join(arr, "trained", "weights.safetensors"))


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """3 MLPs exported and fused, a data file; copied fresh for each test."""
    d = tmp_path_factory.mktemp("reliability")
    mlp_array(d, 3, seed0=30, n=96)
    return d


@pytest.fixture
def work(template, tmp_path):
    return fresh_copy(template, tmp_path)


# ------------------------------------------------------------------------------------------ 1. run identity
def test_resume_continues_the_folders_own_run_never_an_earlier_one(runtime, work, capsys):
    """Run A finishes (checkpoints 35, 40); run B is killed at step >= 15; --resume continues B, not A: the
    metrics, trained/ and run.json are B's, its weights bit-identical to B uninterrupted, and A's outputs are in
    runs/<A>/. A killed run's temporary folders are gone after the next command (case 8). Resuming with other
    settings or other data is refused."""
    arr, data = work / "array", work / "data.npz"
    # eager steps (a long run would compile with --compile auto): the compiled resume is
    # test_compiled_step.py's
    common = ["--data", data, "--batch-size", "16", "--checkpoint-every", "5", "--runtime", runtime, "-q",
              "--compile", "off"]
    assert cli(capsys, "train", arr, *common, "--lr", "0.05", "--momentum", "0.9", "--steps", "40")[0] == 0
    run_a = read_json(arr / "run.json")["id"]
    p = start_train(arr, *common, "--lr", "0.001", "--steps", "100000")
    wait_until(p, lambda: any(step >= 15 and rid not in (None, run_a) for step, rid in checkpoints(arr).items()))
    kill(p)
    assert [n for n in os.listdir(arr) if n.startswith(".trained.tmp-")]  # what the killed run left
    os.makedirs(arr / "checkpoints" / ".step_00099999.tmp-killed")  # as a kill during a checkpoint write leaves
    ckpts = checkpoints(arr)
    run_b = ckpts[max(ckpts)]
    assert run_b != run_a and set(ckpts.values()) == {run_b}  # checkpoints/ holds run B's only
    t = max(ckpts) + 10

    code, out, err = cli(capsys, "train", arr, "--resume", "--steps", t, "-q")
    assert code == 0, err
    assert temporaries(arr) == []
    assert read_json(arr / "run.json")["id"] == run_b
    assert read_json(arr / "trained" / "train_state.json")["run"]["id"] == run_b
    metrics = rows(arr)
    assert {r["run"] for r in metrics} == {run_b} and {r["lr"] for r in metrics} == {"0.001"}
    assert [int(r["step"]) for r in metrics if r["model"] == "0"] == list(range(1, t + 1))
    earlier = arr / "runs" / run_a
    assert sorted(os.listdir(earlier / "checkpoints")) == ["step_00000035", "step_00000040"]
    assert {r["lr"] for r in rows(earlier)} == {"0.05"} and (earlier / "trained" / "weights.safetensors").exists()

    ref = work / "ref"
    shutil.copytree(work / "jobs", ref / "jobs")
    save_array(fuse_models([str(ref / "jobs" / f"model_{b}.onnx") for b in range(3)]), ref / "array")
    assert cli(capsys, "train", ref / "array", *common, "--lr", "0.001", "--steps", t)[0] == 0
    want, got = weights(ref / "array"), weights(arr)
    assert all(want[k].tobytes() == got[k].tobytes() for k in want)  # B as if never killed

    before = snapshot(arr)
    code, _, err = cli(capsys, "train", arr, "--resume", "--steps", t + 10, "--lr", "0.05", "-q")
    assert code == 2 and "setting 'lr' is 0.05 but run " + run_b in one_error_line(err)
    rng = np.random.default_rng(1)
    np.savez(work / "other.npz", input=rng.standard_normal((96,) + SHAPE[1:]).astype(np.float32),
             labels=rng.integers(0, 10, 96))
    code, _, err = cli(capsys, "train", arr, "--resume", "--steps", t + 10, "--data", work / "other.npz", "-q")
    assert code == 2 and "other.npz is not the data run " + run_b in one_error_line(err)
    code, _, err = cli(capsys, "train", arr, "--resume", "--steps", t - 20, "-q")
    assert code == 2 and "past the" in one_error_line(err)
    assert snapshot(arr) == before


def test_split_and_report_refuse_one_runs_weights_with_anothers_metrics(work, capsys):
    """What two unlocked processes left (case 3): run A's trained/ next to run B's metrics, or metrics.csv
    interleaving two runs. split and report refuse, naming both runs."""
    arr, data = work / "array", work / "data.npz"
    for lr in ("0.1", "0.01"):
        assert cli(capsys, "train", arr, "--data", data, "--batch-size", 16, "--steps", 3, "--lr", lr, "-q")[0] == 0
    run_b = read_json(arr / "run.json")["id"]
    (run_a,) = os.listdir(arr / "runs")
    shutil.move(arr / "trained", work / "trained_b")
    shutil.copytree(arr / "runs" / run_a / "trained", arr / "trained")
    for args in (["split", arr, "-o", work / "models"], ["report", arr]):
        code, _, err = cli(capsys, *args)
        line = one_error_line(err)
        assert code == 2 and f"weights of run {run_a}" in line and f"metrics of run {run_b}" in line
    assert not (work / "models").exists()
    shutil.rmtree(arr / "trained")
    shutil.move(work / "trained_b", arr / "trained")
    with open(arr / "metrics.csv", "a") as f:
        f.writelines(open(arr / "runs" / run_a / "metrics.csv").readlines()[1:])
    code, _, err = cli(capsys, "report", arr)
    assert code == 2 and "mixes rows of runs" in one_error_line(err)


# --------------------------------------------------------------------------------------------- 2. fault isolation
def _torch_first_nonfinite(mod, lr, x, y, steps, seed=0) -> int | None:
    """torch.optim.SGD(momentum 0.9) on ``mod`` alone over the run's batches: the first step at which the loss,
    a gradient, a parameter or a buffer (BatchNorm's running statistics) is not finite (None: no step)."""
    from onnxfuse.recipe.data import BatchSampler

    opt = torch.optim.SGD(mod.parameters(), lr=lr, momentum=0.9)
    sampler = BatchSampler(len(y), 32, True, seed)
    for t in range(1, steps + 1):
        idx = sampler.next()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(mod.train()(torch.from_numpy(x[idx])), torch.from_numpy(y[idx]))
        loss.backward()
        opt.step()
        if not torch.isfinite(loss) or any(not torch.isfinite(p.grad).all() for p in mod.parameters()) or \
                any(not torch.isfinite(v.float()).all() for v in mod.state_dict().values()):
            return t
    return None


def test_frozen_model_state_is_entirely_finite_and_stops_where_torch_first_goes_nonfinite(runtime, tmp_path, capsys):
    """DigitsCNN, SGD momentum 0.9, lr 3, 10, 30, 200, 1000 (case 2): at lr 10 and 200 the loss stayed finite
    while bn2.running_var overflowed, and those models ended "ok" with NaN statistics. Each model is now flagged at
    the step where torch alone first has anything non-finite, its split state is finite everywhere,
    num_batches_tracked stopped with it (case 9), and the models still "ok" evaluate to a finite loss."""
    from onnxfuse.exporters import zoo
    from onnxfuse.recipe.datasets import load_named

    lrs, steps = [3.0, 10.0, 30.0, 200.0, 1000.0], 30
    assert cli(capsys, "export", "onnxfuse.exporters.zoo:DigitsCNN", "--count", len(lrs), "--input-shape",
               "32,1,8,8", "-o", tmp_path / "jobs")[0] == 0
    assert cli(capsys, "fuse", tmp_path / "jobs", "-o", tmp_path / "arr")[0] == 0
    code, _, err = cli(capsys, "train", tmp_path / "arr", "--data", "sklearn:digits", "--eval-data", "sklearn:digits",
                       "--lr", ",".join(map(str, lrs)), "--momentum", "0.9", "--batch-size", 32, "--steps", steps,
                       "--runtime", runtime, "-q")
    assert code == 0, err
    assert cli(capsys, "split", tmp_path / "arr", "-o", tmp_path / "models")[0] == 0
    status = {int(k): v for k, v in read_json(tmp_path / "arr" / "trained" / "train_state.json")["status"].items()}
    evals = {int(r["model"]): float(r["loss"]) for r in rows(tmp_path / "arr") if r["split"] == "eval"}
    digits = load_named("sklearn:digits")
    first = {}
    for b, lr in enumerate(lrs):
        torch.manual_seed(b)  # export's seeds 0..B-1
        first[b] = _torch_first_nonfinite(zoo.DigitsCNN(), lr, digits["input"], digits["labels"], steps)
    assert first[0] is None and all(first[b] is not None for b in range(1, len(lrs)))
    assert {b: s["step"] for b, s in status.items() if s["status"] == "diverged"} == \
        {b: t for b, t in first.items() if t is not None}
    assert np.isfinite(evals[0])  # the model still training evaluates to a finite loss
    train_rows = rows(tmp_path / "arr")
    caught_by_statistics = [b for b in status if all(np.isfinite(float(r["loss"])) for r in train_rows if
                                                     r["model"] == str(b) and r["split"] == "train" and
                                                     int(r["step"]) == first[b])]
    assert caught_by_statistics  # finite loss at the step: the statistics alone stopped it, as in the issue
    for b in range(len(lrs)):
        state = load_file(str(tmp_path / "models" / f"model_{b}.safetensors"))
        assert all(np.isfinite(v).all() for v in state.values()), b
        counter = state["bn2.num_batches_tracked"]
        assert counter.shape == () and int(counter) == (steps if first[b] is None else first[b] - 1), b


# ------------------------------------------------------------------------------------------------------- 3. lock
def test_one_command_at_a_time_per_array_folder_and_a_killed_holder_is_taken_over(work, capsys):
    """While `train` runs, every other command on the folder is one error line naming its pid and start time and
    writes nothing (case 3). After a SIGKILL its lock file stays; the next command takes it over. A first run that
    was killed leaves no trained weights to split (case 4)."""
    arr, data = work / "array", work / "data.npz"
    p = start_train(arr, "--data", data, "--batch-size", 16, "--steps", 100000, "--checkpoint-every", 5, "--lr",
                    "0.01", "-q", "--compile", "off")
    wait_until(p, lambda: checkpoints(arr))  # training: it holds the lock
    holder = read_json(arr / ".onnxfuse.lock")
    assert holder["pid"] == p.pid and holder["command"] == "train"
    for args in (["train", arr, "--data", data, "--batch-size", 16, "--steps", 3, "-q"],
                 ["split", arr, "-o", work / "models", "--initial"],
                 ["place", arr, "--devices", 2, "-o", work / "place", "-q"],
                 ["fuse", work / "jobs", "-o", arr, "--overwrite"],
                 ["report", arr],
                 ["check", arr, "--data", data, "--batch-size", 16, "--steps", 1]):
        code, _, err = cli(capsys, *args)
        line = one_error_line(err)
        assert code == 2 and f"pid {p.pid}, started {holder['started']}" in line, (args[0], line)
    assert not (work / "models").exists() and not (work / "place").exists()
    kill(p)
    assert read_json(arr / ".onnxfuse.lock")["pid"] == p.pid  # the killed holder's
    code, _, err = cli(capsys, "split", arr, "-o", work / "models")
    takeover, line = err.strip().splitlines()  # the stale lock is detected, said, and taken over
    assert f"pid {p.pid}, started {holder['started']}) ended without releasing its lock" in takeover
    assert code == 2 and line.startswith("onnxfuse: error: ")
    assert "did not finish" in line and "--resume" in line and "--initial" in line
    t = max(checkpoints(arr)) + 3
    assert cli(capsys, "train", arr, "--resume", "--steps", t, "-q")[0] == 0
    assert (arr / ".onnxfuse.lock").read_text() == "" and temporaries(arr) == []  # released: it names nobody
    assert cli(capsys, "split", arr, "-o", work / "models")[0] == 0


# ------------------------------------------------------------------------------------------------------ 4. split
def test_split_refuses_an_untrained_array_unless_initial(work, capsys):
    arr = work / "array"
    code, _, err = cli(capsys, "split", arr, "-o", work / "models")
    line = one_error_line(err)
    assert code == 2 and "has not been trained" in line and "--initial" in line
    assert not (work / "models").exists()
    code, out, _ = cli(capsys, "split", arr, "-o", work / "models", "--initial")
    assert code == 0 and "initial weights" in out
    mods = make_modules("mlp", 3, seed0=30)
    for b, m in enumerate(mods):
        state = load_file(str(work / "models" / f"model_{b}.safetensors"))
        assert all(state[k].tobytes() == v.numpy().tobytes() for k, v in m.state_dict().items())


# ------------------------------------------------------------------------------------------------ 5. --overwrite
@pytest.mark.parametrize("case", ["split_onto_array", "split_into_trained", "split_onto_parent", "fuse_onto_jobs",
                                  "fuse_onto_folder_of_files", "place_onto_array", "export_onto_factory",
                                  "demo_onto_folder"])
def test_overwrite_never_replaces_an_input(case, work, capsys):
    """`split arr -o arr --overwrite` deleted fused.onnx, the trained weights and the checkpoints (case 5): an
    output that is, is inside, or contains an input is refused before anything is written or deleted. The demo,
    which replaces its own subfolders, refuses a folder holding anything else."""
    arr, jobs = work / "array", work / "jobs"
    if case == "split_into_trained":
        assert cli(capsys, "train", arr, "--data", work / "data.npz", "--batch-size", 16, "--steps", 2, "-q")[0] == 0
    (work / "factory.py").write_text("from onnxfuse.exporters.zoo import MLP\n\ndef make():\n    return MLP()\n")
    args, what = {
        "split_onto_array": (["split", arr, "-o", arr], "is the input"),
        "split_into_trained": (["split", arr, "-o", arr / "trained"], "is inside the input"),
        "split_onto_parent": (["split", arr, "-o", work, "--initial"], "contains the input"),
        "fuse_onto_jobs": (["fuse", jobs, "-o", jobs], "is the input"),
        "fuse_onto_folder_of_files": (["fuse", jobs / "model_0.onnx", jobs / "model_1.onnx", "-o", jobs],
                                      "contains the input"),
        "place_onto_array": (["place", arr, "-o", arr, "-q"], "is the input"),
        "export_onto_factory": (["export", f"{work / 'factory.py'}:make", "--count", 1, "--input-shape",
                                 "4,64", "-o", work], "contains the input"),
        "demo_onto_folder": (["demo", "-o", work, "-q"], "which `onnxfuse demo` did not write"),
    }[case]
    before = snapshot(work)
    code, _, err = cli(capsys, *args, *([] if case == "demo_onto_folder" else ["--overwrite"]))
    line = one_error_line(err)
    assert code == 2 and what in line and "give -o a " in line
    assert snapshot(work) == before


# --------------------------------------------------------------------------------------------------------- 6. data
@pytest.mark.parametrize("case", ["nan_pixel", "inf_label", "beyond_float32"])
def test_nonfinite_data_is_an_error_naming_file_key_and_index(case, work, capsys):
    """One NaN pixel made every model "diverge at step 1" (case 6): the data is checked first, and
    --allow-nonfinite-data trains on it anyway."""
    arr, rng = work / "array", np.random.default_rng(0)
    x = rng.standard_normal((96,) + SHAPE[1:]).astype(np.float32)
    y = rng.integers(0, 10, 96)
    loss = []
    if case == "nan_pixel":
        x[17, 0, 1, 2] = np.nan
        key, index = "input", "[17, 0, 1, 2]"
    elif case == "inf_label":
        y = rng.standard_normal((96, 10)).astype(np.float32)
        y[40, 3] = -np.inf
        key, index, loss = "labels", "[40, 3]", ["--loss", "mse"]
    else:
        x = x.astype(np.float64)
        x[5, 2, 3, 0] = 1e39
        key, index = "input", "[5, 2, 3, 0]"
    np.savez(work / "bad.npz", input=x, labels=y)
    before = snapshot(arr)
    code, _, err = cli(capsys, "train", arr, "--data", work / "bad.npz", "--batch-size", 16, "--steps", 4, *loss, "-q")
    line = one_error_line(err)
    assert code == 2 and "bad.npz" in line and f"'{key}'" in line and f"at index {index}" in line
    assert "--allow-nonfinite-data" in line and ("beyond the range of float32" in line) == (case == "beyond_float32")
    assert snapshot(arr) == before
    if case == "nan_pixel":
        code, out, _ = cli(capsys, "train", arr, "--data", work / "bad.npz", "--batch-size", 96, "--steps", 1,
                           "--allow-nonfinite-data", "--no-shuffle", "--verify-steps", 0, "-q")
        assert code == 0 and out.count("diverged at step 1") == 3  # as asked: the NaN reaches every model


# ----------------------------------------------------------------------------------------------- 7. error lines
@pytest.fixture
def trained(work, capsys):
    """``work`` with a finished run: 10 steps, checkpoints at 5 and 10."""
    assert cli(capsys, "train", work / "array", "--data", work / "data.npz", "--batch-size", 16, "--steps", 10,
               "--checkpoint-every", 5, "-q")[0] == 0
    return work


@pytest.mark.parametrize("case", ["file_as_folder", "truncated_weights", "empty_checkpoint", "corrupt_checkpoint",
                                  "truncated_checkpoint", "report_format"])
def test_user_caused_failures_are_one_error_line(case, trained, capsys):
    """Case 7: each was "internal error", exit 1; each is one `onnxfuse: error:` line naming the file, exit 2."""
    arr = trained / "array"
    ckpt = arr / "checkpoints" / "step_00000010"
    if case == "file_as_folder":
        (trained / "file").write_text("")
        args, named, what = ["split", arr, "-o", trained / "file" / "sub"], "file", "is a file, not a folder"
    elif case == "truncated_weights":
        path = arr / "trained" / "weights.safetensors"
        path.write_bytes(path.read_bytes()[:1000])
        args, named, what = ["split", arr, "-o", trained / "models"], str(path), "truncated or corrupt"
    elif case in ("empty_checkpoint", "corrupt_checkpoint", "truncated_checkpoint"):
        if case == "empty_checkpoint":
            shutil.rmtree(ckpt)
            os.makedirs(ckpt)
            named, what = str(ckpt), "it has no state.json"
        elif case == "corrupt_checkpoint":
            (ckpt / "state.json").write_text('{"step": 10, "models": [0, 1')
            named, what = str(ckpt), "incomplete or corrupt"
        else:
            path = ckpt / "weights.safetensors"
            path.write_bytes(path.read_bytes()[:100])
            named, what = str(path), "truncated or corrupt"
        args = ["train", arr, "--resume", "--steps", 20, "-q"]
    else:
        args, named, what = ["report", arr, "-o", trained / "r.xyz"], "r.xyz", "matplotlib cannot write .xyz"
    code, _, err = cli(capsys, *args)
    line = one_error_line(err)
    assert code == 2 and named in line and what in line, line


def test_read_only_output_location_is_one_error_line(trained, capsys):
    arr = trained / "array"
    if os.geteuid() != 0:  # permissions stop a user; root needs a read-only mount
        (trained / "ro").mkdir()
        os.chmod(trained / "ro", 0o555)
        code, _, err = cli(capsys, "split", arr, "-o", trained / "ro" / "models")
        assert code == 2 and "ro/models': permission denied" in one_error_line(err)
        return
    if not have_userns():
        pytest.skip("running as root without user namespaces: no read-only location to test with")
    (trained / "ro").mkdir()
    r = in_tmpfs('"$EXE" split "$ARR" -o "$RO/models"', str(trained / "ro"), "ro", EXE=EXE, ARR=arr, RO=trained / "ro")
    assert r.returncode == 2, r.stderr
    assert "ro/models': the location is read-only" in one_error_line(r.stderr)


def test_full_disk_is_one_error_line_and_leaves_no_half_written_state(work):
    """A run on a disk that fills up (a small tmpfs; without namespaces, a file size limit): one error line that
    says so and how to continue, no temporary folder left, and split then refuses the unfinished run (case 4)."""
    arr, data = work / "array", work / "data.npz"
    args = ["--data", str(data), "--batch-size", "16", "--steps", "100000", "-q", "--compile", "off"]
    if have_userns():
        args += ["--checkpoint-every", "1", "--keep-checkpoints", "100000"]  # filling the disk
        disk = work / "disk"
        disk.mkdir()
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(arr) for f in fs) + (2 << 20)
        r = in_tmpfs('cp -a "$ARR" "$DISK/array"\nset +e\n"$EXE" train "$DISK/array" ' + " ".join(args) +
                     '\necho "train $?" >&2\n"$EXE" split "$DISK/array" -o "$DISK/models"\necho "split $?" >&2\n'
                     'ls -a "$DISK/array" "$DISK/array/checkpoints" >&2', str(disk), f"size={size}",
                     EXE=EXE, ARR=arr, DISK=disk)
        err = r.stderr.splitlines()
        assert "train 2" in err and "split 2" in err, r.stderr
        train_line, split_line = err[err.index("train 2") - 1], err[err.index("split 2") - 1]
        assert train_line.startswith("onnxfuse: error: ") and "the disk is full" in train_line, r.stderr
        assert not any(".tmp-" in line for line in err), r.stderr
    else:  # no file may grow past 256 KiB: metrics.csv reaches it after ~1,400 steps
        args += ["--checkpoint-every", "20"]

        def limited():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

        r = subprocess.run([EXE, "train", str(arr), *args], capture_output=True, text=True, preexec_fn=limited)
        assert r.returncode == 2, r.stderr
        train_line = one_error_line(r.stderr)
        assert "larger than this system allows" in train_line
        assert temporaries(arr) == []
        s = subprocess.run([EXE, "split", str(arr), "-o", str(work / "models")], capture_output=True, text=True)
        assert s.returncode == 2
        split_line = one_error_line(s.stderr)
    assert "then run the command again" in train_line and "--resume" in train_line
    assert "did not finish" in split_line, split_line


def test_out_of_memory_says_so_and_leaves_the_previous_run_as_it_was(tmp_path, capsys):
    """A batch too large for the memory the process may use (RLIMIT_AS): "out of memory" with ONNX Runtime's
    cause and a smaller --batch-size, exit 2; the failed run leaves the previous run's outputs as they were
    (case 7, case 8)."""
    (tmp_path / "wide.py").write_text(
        "import torch.nn as nn\n\n\ndef make():  # 512 channels at 8x8: 128 KiB of activation per sample\n"
        "    return nn.Sequential(nn.Conv2d(1, 512, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(512 * 64, 10))\n")
    assert cli(capsys, "export", f"{tmp_path / 'wide.py'}:make", "--count", 2, "--input-shape", "32,1,8,8",
               "-o", tmp_path / "jobs")[0] == 0
    assert cli(capsys, "fuse", tmp_path / "jobs", "-o", tmp_path / "arr")[0] == 0
    n = 60_000  # its first activation alone: 7.3 GiB for one model, beyond the 5 GiB limit
    np.savez(tmp_path / "big.npz", input=np.zeros((n, 1, 8, 8), np.float32), labels=np.zeros(n, np.int64))
    assert cli(capsys, "train", tmp_path / "arr", "--data", tmp_path / "big.npz", "--batch-size", 32, "--steps", 2,
               "-q")[0] == 0
    before = snapshot(tmp_path / "arr")

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (5 << 30, 5 << 30))

    r = subprocess.run([EXE, "train", str(tmp_path / "arr"), "--data", str(tmp_path / "big.npz"), "--batch-size",
                        str(n), "--steps", "1", "-q"], capture_output=True, text=True, preexec_fn=limited)
    line = one_error_line(r.stderr)
    assert r.returncode == 2 and "out of memory" in line and "smaller --batch-size" in line, r.stderr
    assert snapshot(tmp_path / "arr") == before


# ---------------------------------------------------------------------------------------------------- 9. small
def test_small_messages(work, capsys):
    code, _, err = cli(capsys, "train", work / "array", "--data", work / "data.npz", "--batch-size", 16, "--steps", 0)
    assert code == 2 and "--steps: steps = 0 must be a positive integer" in one_error_line(err)
    code, _, err = cli(capsys, "export", "onnxfuse.exporters.zoo:MLP", "--count", 1, "--input-shape", "4,48",
                       "--opset", 99, "-o", work / "j")
    line = one_error_line(err)
    assert code == 2 and "--opset 99 is not supported" in line and "--input-shape" not in line
    code, out, _ = cli(capsys, "fuse", work / "jobs" / "model_0.onnx", "-o", work / "one")
    assert code == 0 and out.startswith("fused 1 model into")
