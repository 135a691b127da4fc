"""Nothing lost: every command that writes into a folder holds that folder, and every onnxfuse folder around it,
first (issue 19, item 1). ``train A`` held A's lock while ``split OTHER -o A --overwrite`` (and ``export``,
``place``) deleted A's files and exit 0; the output-folder helper (``_io.claim_output``, under ``atomic_dir``) now
takes the lock, whichever command writes, so each of them is one error line naming the holder and A stays as it
was. A folder another command is still writing (not an array) is protected the same way, a killed writer's
leftovers are cleared by the next command, and an output given as a symbolic link is written where it points."""
from __future__ import annotations

import os
import signal
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import EXE, cli, holder_pid, mlp_array, one_error_line, snapshot, wait_until

# a factory that waits until the file $ONNXFUSE_TEST_GO exists: an export that is still writing its -o folder
SLOW_FACTORY = """import os, time
from onnxfuse.exporters.zoo import MLP

def make():
    while not os.path.exists(os.environ["ONNXFUSE_TEST_GO"]):
        time.sleep(0.02)
    return MLP(in_features=48, hidden=32)

def broken():
    return 42
"""


def leftovers(folder) -> list[str]:
    """Temporary names (``.X.tmp-*``, ``.X.old-*``) in ``folder``."""
    return sorted(n for n in os.listdir(folder) if ".tmp-" in n or ".old-" in n)


def array_files(folder) -> dict:
    """The array's own files (what the commands deleted): fused.onnx, array.json, sources/."""
    return {k: v for k, v in snapshot(folder).items()
            if k in ("fused.onnx", "array.json") or k.startswith("sources" + os.sep)}


@pytest.fixture
def work(tmp_path):
    """An array A and another array OTHER (3 MLPs each, OTHER trained), their jobs, data, a factory file."""
    mlp_array(tmp_path, 3, seed0=30, n=96, array="A")
    mlp_array(tmp_path, 3, seed0=40, n=None, array="OTHER", jobs="jobs2")
    (tmp_path / "factory.py").write_text(SLOW_FACTORY)
    return tmp_path


def test_no_command_writes_into_an_array_while_train_holds_it(work, capsys, monkeypatch):
    """`train A` runs (stopped with SIGSTOP after its first checkpoint, so it holds A's lock throughout); every
    command that would write into A or replace it exits 2 with one line naming train's pid; nothing of A changes;
    train then finishes normally with every step."""
    A = work / "A"
    monkeypatch.setenv("ONNXFUSE_TEST_GO", str(work / "go"))
    (work / "go").write_text("")
    (work / "sweep.yaml").write_text(
        "model: {factory: onnxfuse.exporters.zoo:MLP, input_shape: [8, 3, 4, 4], args: {in_features: 48}}\n"
        "search: {space: {optimizer.lr: [0.1, 0.01]}}\narrays: {size: 2}\n"
        "data: {train: data.npz}\nsteps: 2\nbatch_size: 16\n")
    steps = 3000
    p = subprocess.Popen([EXE, "train", A, "--data", work / "data.npz", "--batch-size", "16", "--steps", str(steps),
                          "--checkpoint-every", "50", "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(p, lambda: os.path.isdir(A / "checkpoints") and any(
            n.startswith("step_") for n in os.listdir(A / "checkpoints")))
        p.send_signal(signal.SIGSTOP)  # holding A's lock, mid-run
        before = array_files(A)
        names_before = sorted(os.listdir(A))
        attempts = {
            "split onto A": ["split", work / "OTHER", "-o", A, "--overwrite", "--initial"],
            "split into A": ["split", work / "OTHER", "-o", A / "models", "--initial"],
            "export onto A": ["export", f"{work / 'factory.py'}:make", "--count", 2, "--input-shape", "8,3,4,4",
                              "-o", A, "--overwrite"],
            "place onto A": ["place", work / "OTHER", "--devices", 2, "-o", A, "--overwrite", "-q"],
            "fuse onto A": ["fuse", work / "jobs2", "-o", A, "--overwrite"],
            "bench into A": ["bench", "--models", "lenet", "--B", 1, "--steps", 1, "--rounds", 1, "--warmup", 0,
                             "--modes", "torch", "-o", A],
            "plan into A": ["plan", "lenet", "--probe", "1,2", "--batch", 2, "-o", A / "plan.json"],
            "sweep into A": ["sweep", work / "sweep.yaml", "-o", A / "sweep", "-q"],
        }
        for what, args in attempts.items():
            code, _, err = cli(capsys, *args)
            line = one_error_line(err)
            assert code == 2 and f"is in use by `onnxfuse train` (pid {p.pid}," in line, (what, line)
        assert sorted(os.listdir(A)) == names_before and leftovers(work) == []
        assert array_files(A) == before
    finally:
        p.send_signal(signal.SIGCONT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert f"for {steps} steps" in out
    import csv

    with open(A / "metrics.csv", newline="") as f:
        assert sorted({int(r["step"]) for r in csv.DictReader(f) if r["split"] == "train"})[-1] == steps


def test_a_folder_being_written_is_held_and_a_killed_writers_leftovers_are_cleared(work, capsys, monkeypatch):
    """`export -o M` is still running (its factory waits): `split -o M --overwrite` and `export -o M` exit 2
    naming it; after it finishes M holds its models. A killed export leaves M holding only its lock and a
    temporary folder beside it: the next export into M needs no --overwrite and clears the leftovers."""
    go, M = work / "go", work / "M"
    env = {**os.environ, "ONNXFUSE_TEST_GO": str(go)}
    monkeypatch.setenv("ONNXFUSE_TEST_GO", str(go))
    export = [EXE, "export", f"{work / 'factory.py'}:make", "--count", "2", "--input-shape", "8,3,4,4", "-o", str(M)]
    p = subprocess.Popen(export, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_until(p, lambda: holder_pid(M) == p.pid)  # M exists, held by the export
        for args in (["split", work / "OTHER", "-o", M, "--overwrite", "--initial"], export[1:]):
            code, _, err = cli(capsys, *args)
            line = one_error_line(err)
            assert code == 2 and f"is in use by `onnxfuse export` (pid {p.pid}," in line, line
    finally:
        go.write_text("")
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert sorted(os.listdir(M)) == ["jobs.json", "model_0.onnx", "model_1.onnx"] and leftovers(work) == []

    go.unlink()
    M2 = work / "M2"
    p = subprocess.Popen([*export[:-1], str(M2)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_until(p, lambda: holder_pid(M2) == p.pid and leftovers(work))
    p.kill()
    p.wait()
    assert os.listdir(M2) == [".onnxfuse.lock"] and leftovers(work)  # what the kill left
    go.write_text("")
    code, _, err = cli(capsys, *export[1:-1], M2)  # no --overwrite: M2 holds nothing of anyone's
    assert code == 0, err
    assert "model_1.onnx" in os.listdir(M2) and leftovers(work) == []


def test_a_failed_command_leaves_an_existing_folder_as_it_was_and_a_new_one_absent(work, capsys):
    """The lock file a command adds to a folder it did not make goes again when the command fails; a folder it
    created for its output is removed."""
    keep = work / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("my notes")
    before = snapshot(keep), sorted(os.listdir(keep))
    for out, flags in ((keep, ["--overwrite"]), (work / "new", [])):
        code, _, err = cli(capsys, "export", f"{work / 'factory.py'}:broken", "--count", 1, "--input-shape", "8,48",
                           "-o", out, *flags)
        assert code == 2 and "not a torch.nn.Module" in one_error_line(err)
    assert (snapshot(keep), sorted(os.listdir(keep))) == before
    assert not (work / "new").exists() and leftovers(work) == []


def test_an_output_given_as_a_symbolic_link_is_written_where_it_points(work, capsys):
    """`-o LINK --overwrite` replaced the link by a folder and left a hidden `.LINK.old-*` link beside it: the
    folder the link names is replaced, the link stays, nothing is left behind."""
    real, link = work / "store" / "models", work / "models"
    real.mkdir(parents=True)
    (real / "old.txt").write_text("old")
    os.symlink(real, link)
    assert cli(capsys, "train", work / "OTHER", "--data", work / "data.npz", "--batch-size", 16, "--steps", 2,
               "-q")[0] == 0
    code, _, err = cli(capsys, "split", work / "OTHER", "-o", link, "--overwrite")
    assert code == 0, err
    assert os.path.islink(link) and os.readlink(link) == str(real)
    assert sorted(n for n in os.listdir(real)) == [
        f"model_{b}.{ext}" for b in range(3) for ext in ("onnx", "safetensors")]
    assert leftovers(work) == [] and leftovers(work / "store") == []
    trained = load_file(str(real / "model_0.safetensors"))
    assert trained and all(np.isfinite(v).all() for v in trained.values())
