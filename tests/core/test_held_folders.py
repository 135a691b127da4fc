"""Nothing lost from above, nothing touched outside (issue 36): every output goes through one helper
(``_io.claim_output`` / ``atomic_dir``), which

- refuses to replace a folder holding, at any depth, a folder another command holds (``split X -o P --overwrite``
  deleted ``P/A`` while ``train P/A`` ran), naming that command, and leaves it byte-identical;
- refuses an empty or blank output path (``-o '' --overwrite`` replaced the current folder);
- opens a folder's lock file without following a link, and only a regular file (a ``.onnxfuse.lock`` symlink had
  its target emptied);
- writes the files of a command whole or not at all (``bench -o`` on a full disk left bench.csv/json/md), a full
  disk naming the file, and every file with the mode a new file gets under the umask (``split`` wrote its
  .safetensors 0600, its .onnx 0644).

And every model file is read checked: data shorter than its shape, a negative dimension, an input shape its
weights cannot take, an opset onnxfuse does not read are one line naming the file and the tensor, never an
internal error; two models differing in a weight's dtype say so."""
from __future__ import annotations

import os
import resource
import signal
import stat
import re
import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from tests.conftest import (EXE, cli, have_userns, holder_pid, in_tmpfs, mlp_array, one_error_line, snapshot,
                            wait_until)
from onnxfuse import ArrayDir, fuse_models, save_array
from onnxfuse.core.errors import ArrayBusyError, ConfigError, OnnxFuseError

FACTORY = "from onnxfuse.exporters.zoo import MLP\n\n\ndef make():\n    return MLP(in_features=48, hidden=32)\n"


def models_in(folder) -> list[str]:
    return sorted(str(p) for p in folder.glob("*.onnx"))


@pytest.fixture
def work(tmp_path):
    """P/Q/A, an array two levels down; OTHER, another array; jobs2, its models; data; a factory file."""
    mlp_array(tmp_path, 3, seed0=30, n=96, array=os.path.join("P", "Q", "A"))
    mlp_array(tmp_path, 3, seed0=40, n=None, array="OTHER", jobs="jobs2")
    (tmp_path / "factory.py").write_text(FACTORY)
    return tmp_path


def test_replacing_a_folder_that_holds_a_held_array_is_refused_naming_the_holder(work, capsys):
    """`train P/Q/A` runs (stopped with SIGSTOP once it holds A): every command and Python call that would replace
    P or P/Q (which hold A) exits 2 / raises naming train's pid and the held folder, and A is byte-identical;
    train then finishes. Before, `split OTHER -o P --overwrite` exited 0 and A was gone."""
    import onnxfuse
    from onnxfuse.core.split import split_array

    A = work / "P" / "Q" / "A"
    (work / "P" / "notes.txt").write_text("mine")
    p = subprocess.Popen([EXE, "train", A, "--data", work / "data.npz", "--batch-size", "16", "--steps", "1000000",
                          "-q", "--compile", "off"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(p, lambda: holder_pid(A) == p.pid and os.path.exists(A / "run.json"), "train did not start")
        p.send_signal(signal.SIGSTOP)
        before = snapshot(work / "P")
        refused = f"holds '{{}}', which is in use by `onnxfuse train` (pid {p.pid},"
        for out, inner in ((work / "P", os.path.join(work / "P", "Q", "A")), (work / "P" / "Q", str(A))):
            attempts = {
                "split": ["split", work / "OTHER", "-o", out, "--overwrite", "--initial"],
                "fuse": ["fuse", work / "jobs2", "-o", out, "--overwrite"],
                "export": ["export", f"{work / 'factory.py'}:make", "--count", 1, "--input-shape", "8,3,4,4",
                           "-o", out, "--overwrite"],
                "place": ["place", work / "OTHER", "--devices", 2, "-o", out, "--overwrite", "-q"],
            }
            for what, args in attempts.items():
                code, _, err = cli(capsys, *args)
                line = one_error_line(err)
                assert code == 2 and f"output folder '{out}' {refused.format(inner)}" in line, (what, line)
            calls = {
                "save_array": lambda: save_array(fuse_models(models_in(work / "jobs2")), out, overwrite=True),
                "FusedArray.save": lambda: onnxfuse.fuse(models_in(work / "jobs2")).save(
                    out, overwrite=True),
                "split_array": lambda: split_array(work / "OTHER", out, overwrite=True, initial=True),
            }
            for what, call in calls.items():
                with pytest.raises(ArrayBusyError) as e:
                    call()
                assert refused.format(inner) in str(e.value), (what, str(e.value))
            assert snapshot(work / "P") == before
        assert sorted(os.listdir(work)) == ["OTHER", "P", "data.npz", "factory.py", "jobs", "jobs2"]  # no leftovers
    finally:
        p.send_signal(signal.SIGCONT)
        p.send_signal(signal.SIGINT)
    p.communicate(timeout=120)
    assert ArrayDir.is_array(A) and (work / "P" / "notes.txt").read_text() == "mine"
    # free again, P is replaced as asked: the folders inside it go with it
    code, _, err = cli(capsys, "split", work / "OTHER", "-o", work / "P", "--overwrite", "--initial")
    assert code == 0, err
    assert sorted(os.listdir(work / "P")) == [f"model_{b}.{e}" for b in range(3) for e in ("onnx", "safetensors")]


@pytest.mark.parametrize("blank", ["", " ", "\t "])
def test_an_empty_or_blank_output_path_is_refused_everywhere(work, capsys, monkeypatch, blank):
    """`-o ''` resolved to the current folder: `fuse ../jobs -o '' --overwrite` deleted every file in it. Every
    command and the Python API refuse it in one line, and the current folder keeps its files."""
    cwd = work / "cwd"
    cwd.mkdir()
    (cwd / "mine.txt").write_text("keep me")
    monkeypatch.chdir(cwd)
    before = snapshot(cwd), sorted(os.listdir(cwd))
    attempts = {
        "fuse": ["fuse", work / "jobs2", "-o", blank, "--overwrite"],
        "split": ["split", work / "OTHER", "-o", blank, "--overwrite", "--initial"],
        "export": ["export", f"{work / 'factory.py'}:make", "--count", 1, "--input-shape", "8,3,4,4", "-o", blank,
                   "--overwrite"],
        "place": ["place", work / "OTHER", "--devices", 2, "-o", blank, "--overwrite", "-q"],
        "plan": ["plan", work / "jobs2" / "model_0.onnx", "--probe", "1,2", "--batch", 2, "-o", blank],
        "bench": ["bench", "--models", "lenet", "--B", 1, "--steps", 1, "--rounds", 1, "--warmup", 0, "--modes",
                  "torch", "-o", blank],
        "demo": ["demo", "-o", blank, "--steps", 1],
    }
    for what, args in attempts.items():
        code, _, err = cli(capsys, *args)
        line = one_error_line(err)
        assert code == 2 and f"the output path {blank!r} is " in line, (what, line)
    from onnxfuse.core.split import split_array

    from onnxfuse.core._io import atomic_write_bytes

    for call in (lambda: save_array(fuse_models(models_in(work / "jobs2")), blank, overwrite=True),
                 lambda: split_array(work / "OTHER", blank, overwrite=True, initial=True),
                 lambda: atomic_write_bytes(blank, b"x")):  # every single file written (plan.save, ...)
        with pytest.raises(ConfigError, match="would name the current folder"):
            call()
    assert (snapshot(cwd), sorted(os.listdir(cwd))) == before


def test_a_lock_file_that_is_not_a_regular_file_is_refused_and_a_linked_file_keeps_its_bytes(work, capsys):
    """`ln -sf $PWD/v.txt A2/.onnxfuse.lock; onnxfuse report A2` emptied v.txt (the lock was opened following the
    link, then truncated and written). The lock file is opened without following links: a link, a folder or a
    FIFO there is one line saying what it is, for every command, and v.txt keeps its bytes."""
    A2 = work / "OTHER"
    assert cli(capsys, "train", A2, "--data", work / "data.npz", "--batch-size", 16, "--steps", 2, "-q")[0] == 0
    victim = work / "v.txt"
    victim.write_bytes(b"precious bytes\n")
    lock = A2 / ".onnxfuse.lock"
    commands = {"report": ["report", A2], "split": ["split", A2, "-o", work / "models"],
                "train": ["train", A2, "--data", work / "data.npz", "--batch-size", 16, "--steps", 1, "-q"],
                "place": ["place", A2, "--devices", 2, "-o", work / "placed", "-q"],
                "fuse into it": ["fuse", work / "jobs2", "-o", A2 / "sub"]}
    for kind, make in (("a symbolic link", lambda: os.symlink(victim, lock)),
                       ("a FIFO", lambda: os.mkfifo(lock)), ("a folder", lambda: os.mkdir(lock))):
        lock.unlink()
        make()
        for what, args in commands.items():
            code, _, err = cli(capsys, *args)
            line = one_error_line(err)
            assert code == 2 and f"the lock file '{lock}' is {kind}" in line, (kind, what, line)
        assert victim.read_bytes() == b"precious bytes\n"
        assert not (work / "models").exists() and not (work / "placed").exists() and not (A2 / "sub").exists()
        lock.rmdir() if kind == "a folder" else lock.unlink()
        lock.write_bytes(b"")


# ---------------------------------------------------------------- model files
def _mlp(rng, in_features=64, opset=17, dtype=np.float32, input_dim=None) -> onnx.ModelProto:
    """x [N, in_features] -> Gemm(W [16, in_features], transB) -> Relu: a model as an exporter writes it."""
    w = nh.from_array(rng.standard_normal((16, in_features)).astype(dtype), "fc.weight")
    b = nh.from_array(rng.standard_normal(16).astype(np.float32), "fc.bias")
    nodes = [h.make_node("Gemm", ["x", "fc.weight", "fc.bias"], ["h"], name="fc", transB=1),
             h.make_node("Relu", ["h"], ["y"], name="relu")]
    g = h.make_graph(nodes, "mlp", [h.make_tensor_value_info("x", TP.FLOAT, ["N", input_dim or in_features])],
                     [h.make_tensor_value_info("y", TP.FLOAT, ["N", 16])], [w, b])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _save_models(folder, models) -> list[str]:
    folder.mkdir()
    paths = []
    for b, m in enumerate(models):
        paths.append(str(folder / f"model_{b}.onnx"))
        onnx.save(m, paths[-1])
    return paths


def _short_raw(m):
    w = m.graph.initializer[0]
    w.raw_data = w.raw_data[:-8]  # 1022 of 1024 floats: "cannot reshape array of size 1022 into shape (16,64)"


def _short_typed(m):
    w = m.graph.initializer[0]
    values = nh.to_array(w).ravel()[:-3]
    w.ClearField("raw_data")
    w.float_data.extend(values.tolist())


def _negative_dim(m):
    m.graph.initializer[0].dims[0] = -16


def _negative_input(m):
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_value = -4


def _huge_input(m):
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 10 ** 12


def _opset_99(m):
    m.opset_import[0].version = 99


BAD_MODELS = {  # how model 1 is damaged -> what the one line says
    "short raw_data": (_short_raw, "initializer 'fc.weight' has 4088 bytes of data, but a FLOAT tensor of shape "
                                   "[16, 64] needs 4096"),
    "short float_data": (_short_typed, "initializer 'fc.weight' holds 1021 values in float_data, but a FLOAT "
                                       "tensor of shape [16, 64] needs 1024"),
    "negative dim": (_negative_dim, "initializer 'fc.weight' has shape [-16, 64]: a dimension is negative"),
    "negative input dim": (_negative_input, "input 'x' has shape ['N', -4]: a dimension is negative"),
    "opset 99": (_opset_99, "imports ONNX opset 99, which onnxfuse does not read: it reads opsets 13 to"),
}


@pytest.mark.parametrize("case", sorted(BAD_MODELS))
def test_a_damaged_model_file_is_one_line_naming_the_file_and_the_tensor(tmp_path, capsys, case):
    """fuse, plan, bench and place (its --costs estimate accepted a short initializer) each refuse model 1 in one
    line naming its file and what is wrong in it; nothing is written."""
    damage, says = BAD_MODELS[case]
    rng = np.random.default_rng(0)
    models = [_mlp(rng) for _ in range(2)]
    damage(models[1])
    paths = _save_models(tmp_path / "jobs", models)
    commands = {"fuse": ["fuse", tmp_path / "jobs", "-o", tmp_path / "array"],
                "plan": ["plan", paths[1], "--batch", 2],
                "bench": ["bench", "--models", paths[1], "--B", 1, "--steps", 1, "--rounds", 1, "--warmup", 0,
                          "--modes", "torch", "--batch", 2, "-o", tmp_path / "bench"],
                "place": ["place", paths[1], "--devices", 2, "--costs", "estimate", "-o", tmp_path / "placed", "-q"]}
    for what, args in commands.items():
        code, _, err = cli(capsys, *args)
        line = one_error_line(err)
        assert code == 2 and f"'{paths[1]}'" in line and says in line, (what, line)
    assert sorted(os.listdir(tmp_path)) == ["jobs"]
    with pytest.raises(OnnxFuseError, match=re.escape(says)):
        fuse_models([models[0], models[1]])  # in memory too


def test_an_input_shape_the_weights_cannot_take_is_one_line_naming_the_model_and_node(tmp_path, capsys):
    """An input dimension of 10**12 where the Gemm's weight takes 64 gave "internal error: the fused graph is not
    valid ONNX"; a MatMul's likewise (ONNX's inference of the model itself finds it, strictly)."""
    rng = np.random.default_rng(0)
    models = []
    for _ in range(2):
        m = _mlp(rng)
        _huge_input(m)
        models.append(m)
    _save_models(tmp_path / "jobs", models)
    code, _, err = cli(capsys, "fuse", tmp_path / "jobs", "-o", tmp_path / "array")
    line = one_error_line(err)
    assert code == 2 and "internal error" not in line, line
    assert "model_0.onnx: node 'fc' (Gemm)" in line and "1000000000000 and 64 differ" in line, line

    def matmul(seed):
        w = nh.from_array(np.random.default_rng(seed).standard_normal((64, 16)).astype(np.float32), "w")
        g = h.make_graph([h.make_node("Flatten", ["x"], ["f"], name="flat"),
                          h.make_node("MatMul", ["f", "w"], ["y"], name="mm")], "g",
                         [h.make_tensor_value_info("x", TP.FLOAT, ["N", 10 ** 12, 4])],
                         [h.make_tensor_value_info("y", TP.FLOAT, ["N", 16])], [w])
        m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
        m.ir_version = 8
        return m

    with pytest.raises(OnnxFuseError) as e:
        fuse_models([matmul(0), matmul(1)], labels=["a.onnx", "b.onnx"])
    assert "a.onnx: the model's shapes do not agree" in str(e.value) and "internal" not in str(e.value)


def test_models_differing_in_a_weights_dtype_say_dtype(tmp_path, capsys):
    """A float64 initializer in one model said "shape [16, 64] vs [16, 64]"."""
    rng = np.random.default_rng(0)
    _save_models(tmp_path / "jobs", [_mlp(rng), _mlp(rng, dtype=np.float64)])
    code, _, err = cli(capsys, "fuse", tmp_path / "jobs", "-o", tmp_path / "array")
    line = one_error_line(err)
    assert code == 2 and "weight 'fc.weight' differs in dtype: float64 [16, 64] vs 'fc.weight' float32 [16, 64]" \
        in line, line


def test_export_offers_only_opsets_onnxfuse_reads(capsys, tmp_path):
    """One declaration of the opsets onnxfuse reads: export refuses outside it, and reading refuses what export
    refuses (opset 12 and 99 alike)."""
    from onnxfuse.core._opset import MAX_OPSET, MIN_OPSET

    (tmp_path / "factory.py").write_text(FACTORY)
    for opset in (MIN_OPSET - 1, MAX_OPSET + 1, 99):
        code, _, err = cli(capsys, "export", f"{tmp_path / 'factory.py'}:make", "--count", 1, "--input-shape",
                           "8,48", "--opset", opset, "-o", tmp_path / "jobs")
        assert code == 2 and f"onnxfuse reads opsets {MIN_OPSET} to {MAX_OPSET}" in one_error_line(err)
        with pytest.raises(OnnxFuseError, match=f"imports ONNX opset {opset}, which onnxfuse does not read"):
            fuse_models([_mlp(np.random.default_rng(b), opset=opset) for b in range(2)])


# ---------------------------------------------------------------- whole or absent, the file named, modes alike
def _limited(size: int):
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return limit


def test_a_file_too_large_names_the_file_for_train_report_and_bench(work):
    """A write that fails (a file size limit: the same error path as a full disk) said "a file: ..." in train
    (a best state, written by safetensors), report and bench; each names its file now, and bench leaves no
    bench folder behind."""
    A = work / "OTHER"
    train = [EXE, "train", A, "--data", work / "data.npz", "--batch-size", 16, "--steps", 4, "-q", "--compile", "off",
             "--eval-fraction", "0.25", "--eval-every", 2, "--keep-best", "eval_loss"]
    r = subprocess.run([str(a) for a in train], capture_output=True, text=True, preexec_fn=_limited(4096))
    line = one_error_line(r.stderr)
    assert r.returncode == 2 and f"'{A / 'best'}{os.sep}model_0_step_00000002.safetensors': the file is larger" \
        in line, line

    assert subprocess.run([str(a) for a in train], capture_output=True).returncode == 0
    r = subprocess.run([EXE, "report", str(A)], capture_output=True, text=True, preexec_fn=_limited(8192))
    line = one_error_line(r.stderr)
    assert r.returncode == 2 and f"'{A / 'report.png'}': the file is larger" in line, line

    onnx.save(_mlp(np.random.default_rng(0)), work / "tiny.onnx")  # bench's own temporary files fit the limit
    bench = [EXE, "bench", "--models", str(work / "tiny.onnx"), "--B", "1", "--steps", "1", "--rounds", "1",
             "--warmup", "0", "--modes", "torch", "--batch", "2", "-o", str(work / "b")]
    r = subprocess.run(bench, capture_output=True, text=True, preexec_fn=_limited(16384))
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("onnxfuse: error: ") and f"'{work / 'b' / 'bench.png'}': the file is larger" in line, line
    assert not (work / "b").exists()


@pytest.mark.skipif(not have_userns(), reason="needs user namespaces for a tmpfs of its own")
def test_bench_on_a_full_disk_leaves_no_folder(tmp_path):
    """`bench -o /full-disk/b` exited 2 but left a new b/ with bench.csv, bench.json and bench.md."""
    disk = tmp_path / "disk"
    disk.mkdir()
    onnx.save(_mlp(np.random.default_rng(0)), tmp_path / "tiny.onnx")
    r = in_tmpfs('set +e\n"$EXE" bench --models "$MODEL" --B 1 --steps 1 --rounds 1 --warmup 0 --modes torch '
                 '--batch 2 -o "$DISK/b" -q\necho "bench $?" >&2\nls -A "$DISK" >&2', str(disk), "size=24k",
                 EXE=EXE, DISK=disk, MODEL=tmp_path / "tiny.onnx")
    err = r.stderr.strip().splitlines()
    assert "bench 2" in err, r.stderr
    line = err[err.index("bench 2") - 1]
    assert line.startswith("onnxfuse: error: ") and "the disk is full" in line and f"'{disk}/b" in line, r.stderr
    assert err[-1] == "bench 2", r.stderr  # ls lists nothing: no b/


@pytest.mark.skipif(not have_userns(), reason="needs user namespaces for a tmpfs of its own")
def test_report_on_a_full_disk_names_report_json(work, capsys):
    """report's report.json (written after its plot, here elsewhere) on a full disk said "a file: the disk is full";
    it names the file now, and leaves none half-written."""
    A = work / "OTHER"
    assert cli(capsys, "train", A, "--data", work / "data.npz", "--batch-size", 16, "--steps", 2, "-q")[0] == 0
    disk = work / "disk"
    disk.mkdir()
    # one page left: the lock's holder record fits, report.json does not
    r = in_tmpfs('cp -a "$ARR" "$DISK/A"\navail=$(df -k --output=avail "$DISK" | tail -1)\n'
                 'dd if=/dev/zero of="$DISK/fill" bs=1k count=$((avail - 4)) 2>/dev/null\nset +e\n'
                 '"$EXE" report "$DISK/A" -o "$PNG"\necho "report $?" >&2\nls -A "$DISK/A" >&2',
                 str(disk), "size=1m", EXE=EXE, ARR=A, DISK=disk, PNG=work / "report.png")
    err = r.stderr.strip().splitlines()
    assert "report 2" in err, r.stderr
    line = err[err.index("report 2") - 1]
    assert line == f"onnxfuse: error: '{disk}/A/report.json': the disk is full; free space on it, then run the " \
                   "command again", r.stderr
    assert not any("report.json" in name for name in err[err.index("report 2") + 1:]), r.stderr


def test_every_file_written_gets_the_mode_the_umask_gives(work, capsys):
    """split wrote its .safetensors 0600 (safetensors' own) and its .onnx 0644: every file onnxfuse writes, in a
    folder (atomic_dir) or alone (atomic_file: a best state, run.json, metrics.csv), is 0666 less the umask,
    every folder 0777 less it."""
    old = os.umask(0o027)
    try:
        assert cli(capsys, "train", work / "OTHER", "--data", work / "data.npz", "--batch-size", 16, "--steps", 4,
                   "-q", "--eval-fraction", 0.25, "--eval-every", 2, "--keep-best", "eval_loss",
                   "--checkpoint-every", 2)[0] == 0
        assert cli(capsys, "split", work / "OTHER", "-o", work / "models")[0] == 0
        assert cli(capsys, "fuse", work / "jobs2", "-o", work / "array")[0] == 0
    finally:
        os.umask(old)
    modes = {}
    for top in ("models", "array", "OTHER/trained", "OTHER/best", "OTHER/checkpoints"):
        for root, dirs, files in os.walk(work / top):
            for name in dirs + files:
                modes[os.path.relpath(os.path.join(root, name), work)] = stat.S_IMODE(os.lstat(
                    os.path.join(root, name)).st_mode)
    for name in ("run.json", "metrics.csv"):
        modes[f"OTHER/{name}"] = stat.S_IMODE(os.stat(work / "OTHER" / name).st_mode)
    assert any(k.endswith(".safetensors") for k in modes) and any(k.endswith(".onnx") for k in modes)
    wrong = {k: oct(v) for k, v in modes.items()
             if v != (0o750 if os.path.isdir(work / k) else 0o640)}
    assert wrong == {}, wrong


def test_demo_holds_its_folder_and_writes_nothing_into_one_another_command_holds(tmp_path, capsys):
    """`onnxfuse demo -o D` while another command holds D: one line naming the holder, and D stays as it was
    (the demo wrote its data file before claiming the folder)."""
    import sys

    D = tmp_path / "D"
    D.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom onnxfuse.core._lock import folder_lock\n"
                               "with folder_lock(sys.argv[1], 'train'):\n    print('held', flush=True)\n"
                               "    time.sleep(120)\n", str(D)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(D)
        code, _, err = cli(capsys, "demo", "-o", D, "--steps", 1, "--models", 2, "-q")
        line = one_error_line(err)
        assert code == 2 and f"is in use by `onnxfuse train` (pid {holder.pid}," in line, line
        assert snapshot(D) == before
    finally:
        holder.kill()
        holder.wait()
