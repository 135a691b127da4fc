"""Runs as sweeps need them: a diverging model is frozen and changes no other model; successive halving leaves
the survivors as if the array had not shrunk; a run killed at any moment resumes to the same final weights. The
divergence, halving and data-order tests also compare with torch.optim training each model alone on its batches."""
from __future__ import annotations

import csv
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.conftest import export_all, make_modules, rel_err
from onnxfuse import fuse_models, save_array
from onnxfuse.core.split import final_states
from onnxfuse.training.run import TrainConfig, train_array
from onnxfuse.core.errors import ConfigError
from onnxfuse.core.weights import ArraySpec

SHAPE = (8, 3, 4, 4)  # the MLP of conftest: 48 inputs


def make_array(folder, B, seed0=30, name="mlp"):
    mods = make_modules(name, B, seed0=seed0)
    save_array(fuse_models(export_all(mods, SHAPE, folder / "jobs")), folder / "array")
    return folder / "array", mods


def assert_same_trained_weights(arr_ref, arr) -> None:
    """The two array folders' trained weights are bit-identical, tensor by tensor, and so are the best states they
    kept (--keep-best: which step of each model, its value, its state)."""
    ref = load_file(str(arr_ref / "trained" / "weights.safetensors"))
    got = load_file(str(arr / "trained" / "weights.safetensors"))
    assert set(ref) == set(got)
    for k in ref:
        assert ref[k].tobytes() == got[k].tobytes(), k
    kept = [json.load(open(a / "trained" / "train_state.json"))["best"] for a in (arr_ref, arr)]
    assert kept[0] == kept[1]
    for e in (kept[0] or {}).get("models", {}).values():
        assert open(arr_ref / "best" / e["file"], "rb").read() == open(arr / "best" / e["file"], "rb").read()


def data_file(folder, n=96, seed=0):
    rng = np.random.default_rng(seed)
    path = folder / "data.npz"
    np.savez(path, input=rng.standard_normal((n,) + SHAPE[1:]).astype(np.float32), labels=rng.integers(0, 10, n))
    return path


def states(array_dir):
    return final_states(str(array_dir), ArraySpec.load(os.path.join(array_dir, "array.json")))


def metrics(array_dir):
    with open(os.path.join(array_dir, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


def first_nonfinite_step(mod, lr, batches):
    """The step at which torch.optim.SGD on this model alone first has a non-finite loss or parameter (MSE)."""
    opt = torch.optim.SGD(mod.parameters(), lr=lr)
    for t, (x, y) in enumerate(batches, 1):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(mod.train()(torch.from_numpy(x)), torch.from_numpy(y))
        if not torch.isfinite(loss):
            return t
        loss.backward()
        opt.step()
        if not all(torch.isfinite(p).all() for p in mod.parameters()):
            return t
    return None


def test_diverging_model_is_frozen_and_the_others_are_bit_identical(runtime, tmp_path):
    rng = np.random.default_rng(0)  # regression targets: with MSE a too-large lr blows up exponentially
    x = rng.standard_normal((96,) + SHAPE[1:]).astype(np.float32)
    y = rng.standard_normal((96, 10)).astype(np.float32)
    np.savez(tmp_path / "data.npz", input=x, labels=y)
    cfg = dict(batch_size=16, steps=16, optimizer="sgd", shuffle=False, loss="mse", runtime=runtime)
    arr_a, _ = make_array(tmp_path / "a", 3)
    arr_b, _ = make_array(tmp_path / "b", 3)
    res_a = train_array(arr_a, tmp_path / "data.npz", TrainConfig(lr=[0.05, 100.0, 0.02], **cfg), progress=False)
    train_array(arr_b, tmp_path / "data.npz", TrainConfig(lr=[0.05, 0.01, 0.02], **cfg), progress=False)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 96, 16)] * 3
    expected = first_nonfinite_step(make_modules("mlp", 3, seed0=30)[1], 100.0, batches)
    assert expected is not None and res_a.status == {1: {"status": "diverged", "step": expected}}
    rows = [r for r in metrics(arr_a) if r["status"] == "diverged"]
    assert [(r["model"], int(r["step"])) for r in rows] == [("1", expected)]
    sa, sb = states(arr_a), states(arr_b)
    for b in (0, 2):  # bit-identical to the run where model 1 did not diverge
        for k in sa[b]:
            assert sa[b][k].tobytes() == sb[b][k].tobytes(), (b, k)
    assert all(np.isfinite(v).all() for v in sa[1].values())  # frozen at its last finite values
    mods = make_modules("mlp", 3, seed0=30)
    for b, lr in ((0, 0.05), (2, 0.02)):  # and what torch.optim computes for each alone
        ref = _torch_alone(mods[b], torch.optim.SGD, lr, batches[:16], "mse")
        for k, v in ref.items():
            assert rel_err(sa[b][k], v) < 1e-4, (b, k)
    # and to an array without model 1 at all
    mods = make_modules("mlp", 3, seed0=30)
    save_array(fuse_models(export_all([mods[0], mods[2]], SHAPE, tmp_path / "c" / "jobs")), tmp_path / "c" / "array")
    train_array(tmp_path / "c" / "array", tmp_path / "data.npz", TrainConfig(lr=[0.05, 0.02], **cfg), progress=False)
    sc = states(tmp_path / "c" / "array")
    for b, c in ((0, 0), (2, 1)):
        for k in sa[b]:
            assert sa[b][k].tobytes() == sc[c][k].tobytes(), (b, k)


def test_stop_on_diverge(runtime, tmp_path, capsys):
    from onnxfuse.cli.main import main

    arr, _ = make_array(tmp_path, 2)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", input=rng.standard_normal((96,) + SHAPE[1:]).astype(np.float32),
             labels=rng.standard_normal((96, 10)).astype(np.float32))
    code = main(["train", str(arr), "--data", str(tmp_path / "d.npz"), "--loss", "mse", "--lr", "0.05,100",
                 "--steps", "30", "--batch-size", "16", "--on-diverge", "stop", "--runtime", runtime, "-q"])
    err = capsys.readouterr().err
    assert code == 3 and "diverged at step" in err and "--on-diverge stop" in err
    assert os.path.exists(arr / "trained" / "weights.safetensors")


def test_successive_halving_keeps_survivors_as_in_the_full_array(runtime, tmp_path):
    data = data_file(tmp_path, n=128)
    lrs = [0.2, 0.01, 0.1, 0.001, 0.05, 0.3, 0.02, 0.005]
    cfg = dict(batch_size=16, steps=12, optimizer="adam", lr=lrs, eval_fraction=0.25, eval_every=4, seed=3,
               runtime=runtime)
    arr_full, _ = make_array(tmp_path / "full", 8)
    arr_half, _ = make_array(tmp_path / "half", 8)
    train_array(arr_full, data, TrainConfig(**cfg), progress=False)
    res = train_array(arr_half, data, TrainConfig(halving=[6], **cfg), progress=False)
    assert len(res.survivors) == 4 and sorted(res.status) == sorted(set(range(8)) - set(res.survivors))
    assert all(s["status"] == "dropped" and s["step"] == 6 for s in res.status.values())
    # the survivors are the 4 best by eval loss at step 6
    ev6 = {int(r["model"]): float(r["loss"]) for r in metrics(arr_full) if r["split"] == "eval" and r["step"] == "4"}
    assert len(ev6) == 8
    full, half = states(arr_full), states(arr_half)
    for b in res.survivors:
        for k, v in full[b].items():
            assert half[b][k].tobytes() == v.tobytes(), (b, k)  # bit-identical
    # the survivors, as in the full array, are what torch.optim.Adam computes for each alone on the same batches
    from onnxfuse.recipe.data import BatchSampler
    from onnxfuse.recipe.datasets import split_holdout

    train, _ = split_holdout(dict(np.load(data)), 0.25, 3)
    sampler = BatchSampler(len(train["labels"]), 16, True, 3)
    batches = [(train["input"][i], train["labels"][i]) for i in (sampler.next() for _ in range(12))]
    mods = make_modules("mlp", 8, seed0=30)
    for b in res.survivors:
        ref = _torch_alone(mods[b], torch.optim.Adam, lrs[b], batches, "cross-entropy")
        for k, v in ref.items():
            assert rel_err(half[b][k], v) < 1e-4, (b, k)
    for b in res.status:  # dropped models keep the state they had when dropped: not trained further
        assert any(rel_err(half[b][k], v) > 1e-6 for k, v in full[b].items() if v.dtype.kind == "f")


def _latest(arr):
    found = sorted(glob.glob(os.path.join(arr, "checkpoints", "step_*")))
    return found[-1] if found else None


def _newest_step(arr) -> int:
    found = _latest(arr)
    return int(os.path.basename(found)[5:]) if found else 0


def test_killed_run_resumes_to_identical_weights(runtime, tmp_path):
    """SIGKILL at random moments (mid-step, mid-checkpoint), resume each time; the final weights are bit-identical
    to an uninterrupted run's, and every checkpoint that exists is complete."""
    data = data_file(tmp_path, n=128)
    exe = os.path.join(os.path.dirname(sys.executable), "onnxfuse")
    args = ["--data", str(data), "--steps", "3000", "--batch-size", "16", "--optimizer", "adamw",
            "--lr", "0.01,0.003,0.001", "--schedule", "cosine", "--warmup-steps", "50", "--clip-grad-norm", "1",
            "--eval-fraction", "0.2", "--eval-every", "100", "--checkpoint-every", "20", "--runtime", runtime, "-q"]
    arr_ref, _ = make_array(tmp_path / "ref", 3)
    subprocess.run([exe, "train", str(arr_ref), *args], check=True, capture_output=True)
    arr, _ = make_array(tmp_path / "killed", 3)
    rnd = random.Random(0)
    kills = 0
    while True:
        cmd = [exe, "train", str(arr), *(["--resume", "-q"] if _latest(arr) else args)]
        log = open(tmp_path / "stderr.txt", "w+")
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        if kills < 3:
            start, deadline = _newest_step(arr), time.time() + 60
            while p.poll() is None and _newest_step(arr) <= start and time.time() < deadline:
                time.sleep(0.02)  # wait for this run to make progress, then kill it at a random moment
            time.sleep(rnd.uniform(0.0, 0.2))  # short: on a fast machine a run must not reach its end first
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
                kills += 1
                for ck in glob.glob(os.path.join(arr, "checkpoints", "step_*")):  # never half-written
                    assert {"array.json", "state.json", "weights.safetensors"} <= set(os.listdir(ck)), ck
                    load_file(os.path.join(ck, "weights.safetensors"))
                continue
        code = p.wait()
        log.seek(0)
        assert code == 0, log.read()[-2000:]
        break
    assert kills == 3
    assert_same_trained_weights(arr_ref, arr)
    assert json.load(open(arr / "trained" / "train_state.json"))["best"]["metric"] == "eval_loss"  # eval data: kept
    steps = [int(r["step"]) for r in metrics(arr) if r["split"] == "train" and r["model"] == "0"]
    assert steps == list(range(1, 3001))  # a resumed run rewrites the metrics from its checkpoint on: each once


def test_config_file_builds_trains_halves_and_reports(tmp_path, capsys):
    """A YAML run: build the array from a factory, grid of learning rates, cosine warm-up, clipping, evaluation,
    checkpoints and successive halving, then `onnxfuse report`."""
    from onnxfuse.cli.main import main

    (tmp_path / "run.yaml").write_text("""
model: {factory: "onnxfuse.exporters.zoo:DigitsCNN", count: 4, input_shape: [32, 1, 8, 8]}
data: {train: "sklearn:digits", eval_fraction: 0.2}
optimizer: {name: sgd, momentum: 0.9}
grid: {optimizer.lr: [0.01, 0.05, 0.1, 0.2]}
schedule: {name: cosine, warmup_steps: 5}
clip_grad_norm: 5.0
steps: 40
batch_size: 32
eval_every: 10
checkpoint_every: 10
halving: [20]
""")
    arr = tmp_path / "array"
    assert main(["train", str(arr), "--config", str(tmp_path / "run.yaml"), "-q"]) == 0
    out = capsys.readouterr().out
    assert out.count("dropped at step 20") == 2
    assert len(glob.glob(str(arr / "checkpoints" / "step_*"))) == 2  # the last two kept
    lrs = {r["model"]: float(r["lr"]) for r in metrics(arr) if r["split"] == "train" and r["step"] == "10"}
    assert len(lrs) == 4 and lrs["0"] < lrs["1"] < lrs["2"] < lrs["3"]  # the grid, one lr per model
    assert main(["report", str(arr)]) == 0
    import json

    import matplotlib.image

    report = json.loads((arr / "report.json").read_text())
    assert matplotlib.image.imread(str(arr / "report.png")).shape[0] > 100
    assert sum(m["status"] == "dropped" for m in report["models"]) == 2
    assert main(["split", str(arr), "-o", str(tmp_path / "models")]) == 0  # survivors and dropped models alike
    assert len(glob.glob(str(tmp_path / "models" / "model_*.safetensors"))) == 4


@pytest.mark.parametrize("flags,message", [
    (["--optimizer", "rmsprop"], "invalid choice: 'rmsprop'"),
    # a flag's message is the config file's, begun by the flag (tests/recipe/test_settings_once.py compares the two)
    (["--lr", "0.1,0.2"], "--lr: optimizer.lr has 2 values but the array has B=3 models"),
    (["--lr", "-1"], "--lr: optimizer.lr = -1.0 must be finite and >= 0"),
    (["--schedule", "step"], "'step' needs 'step_size'"),
    (["--halving", "50"], "--halving: halving needs eval data to rank the models"),
    (["--data-order", "per-model"], "fuse with --per-model-inputs input"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm: clip_grad_norm = 0.0 must be > 0"),
    (["--epochs", "2"], "--steps, --epochs: give exactly one of steps and epochs (both are set)"),
])
def test_bad_training_settings_fail_before_training(flags, message, tmp_path, capsys):
    from onnxfuse.cli.main import main

    arr, _ = make_array(tmp_path, 3)
    before = sorted(os.listdir(arr))
    try:
        code = main(["train", str(arr), "--data", str(data_file(tmp_path)), "--steps", "5", "--batch-size", "16",
                     "-q", *flags])
    except SystemExit as e:  # argparse rejects unknown choices itself (exit 2, one usage line)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert sorted(os.listdir(arr)) == before


def _torch_alone(mod, optimizer, lr, batches, loss="cross-entropy"):
    """``mod`` trained alone by torch.optim ``optimizer`` (default hyper-parameters but lr) on ``batches``."""
    opt = optimizer(mod.parameters(), lr=lr)
    fn = torch.nn.functional.cross_entropy if loss == "cross-entropy" else torch.nn.functional.mse_loss
    for x, y in batches:
        opt.zero_grad()
        fn(mod.train()(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in mod.state_dict().items()}


def _torch_sgd_alone(mod, lr, batches):
    return _torch_alone(mod, torch.optim.SGD, lr, batches)


@pytest.mark.parametrize("order", ["per-model", "shards"])
def test_data_orders_match_torch_on_each_models_own_batches(order, runtime, tmp_path):
    """per-model: model b shuffles with its own generator (seed + b); shards: model b trains on shard b. Each
    equals torch training the model alone on exactly those batches."""
    _check_data_order(order, runtime, tmp_path)


def test_the_model_by_model_form_of_a_compiled_step_gives_each_model_its_own_batches(tmp_path, monkeypatch):
    """The model-by-model form (``TrainStep.FORMS``) runs model b on its slice of the per-model input and labels: as
    torch alone on its own batches (within the compiled steps' bound, 1e-4)."""
    from onnxfuse.runtime.torch.train_step import TrainStep

    monkeypatch.setattr(TrainStep, "FORMS", ("model-by-model",))
    _check_data_order("shards", "torch", tmp_path, compile="on", bound=1e-4)


def _check_data_order(order: str, runtime: str, tmp_path, compile: str = "off", bound: float = 1e-5) -> None:
    from onnxfuse.recipe.data import BatchSampler
    from onnxfuse.recipe.datasets import shard

    B, N, steps, lrs = 3, 8, 7, [0.05, 0.1, 0.02]
    mods = make_modules("mlp", B, seed0=40)
    save_array(fuse_models(export_all(mods, SHAPE, tmp_path / "jobs"), per_model_inputs=["input"]), tmp_path / "array")
    rng = np.random.default_rng(5)
    arrays = {"input": rng.standard_normal((60,) + SHAPE[1:]).astype(np.float32), "labels": rng.integers(0, 10, 60)}
    res = train_array(tmp_path / "array", arrays, TrainConfig(batch_size=N, steps=steps, lr=lrs, data_order=order,
                                                              seed=11, runtime=runtime, compile=compile),
                       progress=False)
    assert res.steps == steps
    got = states(tmp_path / "array")
    if order == "shards":
        parts = shard(arrays, B, set())
        sampler = BatchSampler(parts["labels"].shape[1], N, True, 11)  # one index stream over every shard
        batches = [[] for _ in range(B)]
        for _ in range(steps):
            idx = sampler.next()
            for b in range(B):
                batches[b].append((parts["input"][b][idx], parts["labels"][b][idx]))
    else:
        sampler = BatchSampler(60, N, True, 11, per_model=B)
        batches = [[] for _ in range(B)]
        for _ in range(steps):
            idx = sampler.next()
            for b in range(B):
                batches[b].append((arrays["input"][idx[b]], arrays["labels"][idx[b]]))
    for b in range(B):
        ref = _torch_sgd_alone(mods[b], lrs[b], batches[b])
        for k, v in ref.items():
            assert rel_err(got[b][k], v) < bound, (b, k)


def test_epochs_of_a_torch_dataset_and_of_a_dataloader(tmp_path):
    """A Dataset is read once and batched by onnxfuse (--batch-size, the last partial batch skipped); a DataLoader
    is drawn from, in its own batches (the last partial one kept): an epoch is len(loader) steps. A batch size given
    that is not the loader's is one line (tests/recipe/test_dataloader.py has the rest)."""
    arr, _ = make_array(tmp_path, 2)
    ds = torch.utils.data.TensorDataset(torch.randn(50, *SHAPE[1:]), torch.randint(0, 10, (50,)))
    res = train_array(arr, ds, TrainConfig(batch_size=16, epochs=3), progress=False)
    assert res.steps == 3 * (50 // 16)
    loader = torch.utils.data.DataLoader(ds, batch_size=7)
    res = train_array(arr, loader, TrainConfig(epochs=3), progress=False)
    assert res.steps == 3 * len(loader) == 3 * 8
    with pytest.raises(ConfigError, match=r"DataLoader \(TensorDataset\) has batch size 7 but the run's batch size "
                                          r".* is 16: .* set batch_size=7"):
        train_array(arr, loader, TrainConfig(batch_size=16, epochs=3), progress=False)


def test_divergence_read_late_is_recorded_at_its_own_step_and_stays_frozen(runtime, tmp_path):
    """Losses and failures are read every 4th step only: model 1's divergence between two reads is recorded at the
    step torch alone first goes non-finite, and the model stays frozen (the runtime freezes it, not the loop's
    read): its final state is its last finite one, and the others are as in a run read at every step."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96,) + SHAPE[1:]).astype(np.float32)
    y = rng.standard_normal((96, 10)).astype(np.float32)
    np.savez(tmp_path / "data.npz", input=x, labels=y)
    cfg = dict(batch_size=16, steps=16, optimizer="sgd", shuffle=False, loss="mse", runtime=runtime,
               lr=[0.05, 100.0, 0.02], compile="off")
    arr_late, _ = make_array(tmp_path / "late", 3)
    arr_each, _ = make_array(tmp_path / "each", 3)
    res = train_array(arr_late, tmp_path / "data.npz", TrainConfig(log_every=4, **cfg), progress=False)
    train_array(arr_each, tmp_path / "data.npz", TrainConfig(log_every=1, **cfg), progress=False)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 96, 16)] * 3
    expected = first_nonfinite_step(make_modules("mlp", 3, seed0=30)[1], 100.0, batches)
    assert expected is not None and expected % 4 != 0
    assert res.status == {1: {"status": "diverged", "step": expected}}
    assert [(r["model"], int(r["step"])) for r in metrics(arr_late) if r["status"]] == [("1", expected)]
    late, each = states(arr_late), states(arr_each)
    for b in range(3):
        for k in late[b]:
            assert late[b][k].tobytes() == each[b][k].tobytes(), (b, k)
