"""train_array with a torch DataLoader: every step trains on the loader's next batch, drawn then (its batch size,
sampler, shuffle and augmentation), never materialized; its batches checked (one line each); resume continues the
data order exactly; an eval DataLoader; a sweep whose data factory returns a loader. Real torch DataLoaders over
scikit-learn's digits; an MLP array of two models."""
from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.conftest import cli, export_all, one_error_line, rel_err, write_spec
from onnxfuse import fuse_models, save_array
from onnxfuse.core.errors import ConfigError, DataError
from onnxfuse.core.split import final_states
from onnxfuse.core.weights import ArraySpec
from onnxfuse.exporters import zoo
from onnxfuse.recipe.datasets import load_named
from onnxfuse.training.run import TrainConfig, train_array

SHAPE = (16, 1, 8, 8)  # digits
N, B, LR = 16, 2, 0.1
DIGITS = load_named("sklearn:digits")


def mlps(B=B, seed0=50):
    mods = []
    for b in range(B):
        torch.manual_seed(seed0 + b)
        mods.append(zoo.MLP(in_features=64, hidden=16))
    return mods


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """An array of two MLPs (shared input) and one with a per-model input, fused once for the module."""
    folder = tmp_path_factory.mktemp("arrays")
    save_array(fuse_models(export_all(mlps(), SHAPE, folder / "jobs")), folder / "shared")
    save_array(fuse_models(export_all(mlps(), SHAPE, folder / "jobs_pm"), per_model_inputs=["input"]),
               folder / "per_model")
    return folder


@pytest.fixture
def array(template, tmp_path):
    shutil.copytree(template / "shared", tmp_path / "array")
    return tmp_path / "array"


def states(array_dir):
    return final_states(str(array_dir), ArraySpec.load(os.path.join(array_dir, "array.json")))


class NoisyDigits(torch.utils.data.Dataset):
    """The first ``n`` digits plus Gaussian noise drawn in ``__getitem__`` (from a generator of its own, seeded, or
    from torch's global one); it records every index asked for and the noise each got."""

    def __init__(self, n=160, seed=0, own_generator=True):
        self.x, self.y = torch.from_numpy(DIGITS["input"][:n]), torch.from_numpy(DIGITS["labels"][:n])
        self.gen = torch.Generator().manual_seed(seed) if own_generator else None
        self.calls: list[int] = []
        self.noise: dict[int, list[torch.Tensor]] = {}

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.calls.append(int(i))
        noise = 0.1 * torch.randn(self.x[i].shape, generator=self.gen)
        self.noise.setdefault(int(i), []).append(noise)
        return self.x[i] + noise, self.y[i]


def loader_of(ds, seed=7, **kw):
    return torch.utils.data.DataLoader(ds, batch_size=N, shuffle=True, generator=torch.Generator().manual_seed(seed),
                                       **kw)


def sgd(steps, **kw):
    return TrainConfig(steps=steps, optimizer="sgd", lr=LR, **kw)


def torch_alone(mod, batches):
    opt = torch.optim.SGD(mod.parameters(), lr=LR)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(mod.train()(x), y).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in mod.state_dict().items()}


# ------------------------------------------------------------------------------------ fresh batches every step
def test_every_step_draws_the_loaders_next_batch(array, runtime):
    """The issue's test: __getitem__ runs steps x batch size times (the verified first step's batch is drawn once,
    and trained on); in the loader's batch size and shuffled order (each epoch a new permutation), with fresh noise
    every epoch; and each model trains as torch.optim trains it alone on those very batches."""
    S = 25  # 2.5 epochs of 10 batches
    ds = NoisyDigits()
    res = train_array(array, loader_of(ds), sgd(S, runtime=runtime), progress=False)
    assert res.steps == S and len(ds.calls) == S * N
    same = loader_of(range(160))  # the loader's own order: the same sampler and generator, over indices
    order = [int(i) for _ in range(3) for batch in same for i in batch]
    assert ds.calls == order[:S * N]
    epochs = [ds.calls[k * 160:(k + 1) * 160] for k in range(2)]
    assert all(sorted(e) == list(range(160)) for e in epochs) and epochs[0] != epochs[1]
    assert epochs[0] != list(range(160))
    i = epochs[0][0]  # augmentation is drawn afresh: the same sample has other noise in epoch 2
    assert len(ds.noise[i]) >= 2 and not torch.equal(ds.noise[i][0], ds.noise[i][1])
    again = loader_of(NoisyDigits())  # the same batches again (same seeds, same order of calls)
    batches = [b for _, b in zip(range(S), (b for _ in range(3) for b in again))]
    got = states(array)
    for b, mod in enumerate(mlps()):
        for k, v in torch_alone(mod, batches).items():
            assert rel_err(got[b][k], v) < 1e-5, (b, k)


def test_partial_batches_count_as_their_size(array):
    """drop_last=False keeps an epoch's last, partial batch: the throughput counts the samples trained on."""
    ds = torch.utils.data.TensorDataset(torch.from_numpy(DIGITS["input"][:50]), torch.from_numpy(DIGITS["labels"][:50]))
    loader = torch.utils.data.DataLoader(ds, batch_size=N)
    res = train_array(array, loader, TrainConfig(epochs=2), progress=False)
    assert res.steps == 2 * 4
    assert res.samples_per_s * res.elapsed_s == pytest.approx(B * 2 * 50, rel=1e-6)


# --------------------------------------------------------------------------------------------------- errors
class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(64):
            yield torch.from_numpy(DIGITS["input"][i]), int(DIGITS["labels"][i])


class _Named(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"image": torch.from_numpy(DIGITS["input"][i]), "labels": int(DIGITS["labels"][i])}


def _pairs(x=None, y=None, extra=False):
    x = torch.from_numpy(DIGITS["input"][:64]) if x is None else x
    y = torch.from_numpy(DIGITS["labels"][:64]) if y is None else y
    return torch.utils.data.TensorDataset(*((x, y, y) if extra else (x, y)))


def _nan_at(k):
    x = torch.from_numpy(DIGITS["input"][:64].copy())
    x[k, 0, 2, 3] = float("nan")
    return _pairs(x)


LOADER_ERRORS = [  # (loader, settings, error, message)
    (lambda: torch.utils.data.DataLoader(_pairs(), batch_size=N), dict(batch_size=8), ConfigError,
     r"^the training DataLoader \(TensorDataset\) has batch size 16 but the run's batch size .* is 8: .* set "
     r"batch_size=16 \(--batch-size 16\), or give the DataLoader batch_size=8$"),
    (lambda: torch.utils.data.DataLoader(_pairs(torch.from_numpy(DIGITS["input"][:64]).reshape(64, 64)),
                                         batch_size=N), {}, DataError,
     r"^the training DataLoader \(TensorDataset\), batch 1: 'input' has shape \[16, 64\] but the graph expects "
     r"\[n, 1, 8, 8\]$"),
    (lambda: torch.utils.data.DataLoader(_pairs(y=torch.zeros(64)), batch_size=N), {}, DataError,
     r"batch 1: 'labels' must hold integer class indices for this loss, got float32$"),
    (lambda: torch.utils.data.DataLoader(_pairs(y=torch.full((64,), 12)), batch_size=N), {}, DataError,
     r"batch 1: 'labels' must be class indices in \[0, 10\) .* found 12\.\.12$"),
    (lambda: torch.utils.data.DataLoader(_pairs(extra=True), batch_size=N), {}, DataError,
     r"batch 1 has 3 parts but the graph's inputs \['input'\] take 1 and an optional label"),
    (lambda: torch.utils.data.DataLoader(_Named(), batch_size=N), {}, DataError,
     r"\(_Named\), batch 1 has no array 'input' \(a graph input\); it holds: image, labels$"),
    (lambda: torch.utils.data.DataLoader(_nan_at(3), batch_size=N), {}, DataError,
     r"batch 1: 'input' holds nan at index \[3, 0, 2, 3\]: every model would diverge on it; .*"
     r"--allow-nonfinite-data"),
    (lambda: torch.utils.data.DataLoader(_pairs(), batch_size=None), {}, ConfigError,
     r"\(TensorDataset\) has batch_size=None \(it yields single samples\): give it a batch size"),
    (lambda: torch.utils.data.DataLoader(_Stream(), batch_size=N), dict(epochs=1, steps=None), ConfigError,
     r"\(_Stream\) has no length \(an iterable-style dataset\), so --epochs cannot say .* give --steps"),
    (lambda: torch.utils.data.DataLoader(_pairs(), batch_size=N), dict(eval_fraction=0.2), ConfigError,
     r"^--eval-fraction holds out part of arrays, but the training DataLoader \(TensorDataset\) cannot be split; "
     r"give evaluation data"),
]


@pytest.mark.parametrize("make, settings, error, message", LOADER_ERRORS,
                         ids=["batch-size", "shape", "float-labels", "label-range", "parts", "names", "nan",
                              "batch-size-none", "iterable-epochs", "eval-fraction"])
def test_a_loader_that_does_not_fit_is_one_line_before_anything_is_written(array, make, settings, error, message):
    with pytest.raises(error, match=message) as e:
        train_array(array, make(), TrainConfig(**{"steps": 3, **settings}), progress=False)
    assert "\n" not in str(e.value)
    assert not {"metrics.csv", "run.json", "trained", "checkpoints"} & set(os.listdir(array))


def test_a_bad_batch_later_in_the_run_names_it(array):
    loader = torch.utils.data.DataLoader(_nan_at(40), batch_size=N)  # sample 40 is in batch 3
    with pytest.raises(DataError, match=r"batch 3: 'input' holds nan at index \[8, 0, 2, 3\]"):
        train_array(array, loader, TrainConfig(steps=4), progress=False)
    res = train_array(array, loader, TrainConfig(steps=4, allow_nonfinite_data=True), progress=False)
    assert res.steps == 4


LOADERS_PY = '''
import torch
from onnxfuse.recipe.datasets import load_named

def make(batch_size=16):
    d = load_named("sklearn:digits")
    ds = torch.utils.data.TensorDataset(torch.from_numpy(d["input"][:96]), torch.from_numpy(d["labels"][:96]))
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True,
                                       generator=torch.Generator().manual_seed(3))

def nothing():
    return 42
'''


def test_a_data_factory_on_the_command_line(array, tmp_path, capsys):
    """--data MODULE:FUNCTION: the loader it returns trains the run, in its own batch size unless --batch-size
    says another (one line); a factory that returns no data is one line."""
    (tmp_path / "loaders.py").write_text(LOADERS_PY)
    factory = f"{tmp_path / 'loaders.py'}:make"
    code, _, err = cli(capsys, "train", array, "--data", factory, "--steps", "2", "--batch-size", "8", "-q")
    assert code == 2 and "has batch size 16 but the run's batch size (--batch-size, batch_size) is 8" in \
        one_error_line(err)
    code, _, err = cli(capsys, "train", array, "--data", f"{tmp_path / 'loaders.py'}:nothing", "--steps", "2", "-q")
    assert code == 2 and one_error_line(err).endswith(
        "loaders.py:nothing() returned int; it must return a torch DataLoader, a torch Dataset or a dict of arrays")
    code, out, err = cli(capsys, "train", array, "--data", factory, "--epochs", "1", "-q")
    assert code == 0 and "trained 2 models for 6 steps" in out


# --------------------------------------------------------------------------------------------------- resume
def _interrupted(array, make_loader, config, stop_at, before_resume=None, eval_data=None):
    """Train to ``stop_at`` (a checkpoint there), then resume with a new loader (as a new process would) to the
    end; the resumed run's dataset."""
    train_array(array, make_loader(), config, progress=False, stop_at=stop_at, eval_data=eval_data)
    if before_resume is not None:
        before_resume()
    loader = make_loader()
    train_array(array, loader, config, progress=False, resume=True, eval_data=eval_data)
    return loader.dataset


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded-generators", "global-generator"])
def test_resume_continues_the_data_order_exactly(template, tmp_path, seeded):
    """Killed at step 12 (epoch 2, batch 2) and resumed: the final weights are bit for bit an uninterrupted run's.
    With seeded generators (the loader's, the dataset's own); and with neither (shuffle and noise from torch's
    global generator, which onnxfuse restores: another global state before the resume changes nothing, and the
    evaluations before each checkpoint, a shuffled eval loader drawing from it too, are accounted for). The
    resumed run draws the epoch's first 2 batches again (and drops them) before its 4 steps."""
    def make():
        return loader_of(NoisyDigits(), seed=7) if seeded else torch.utils.data.DataLoader(
            NoisyDigits(own_generator=False), batch_size=N, shuffle=True)

    config = sgd(16, checkpoint_every=4, eval_every=4)
    runs = {}
    for name in ("whole", "resumed"):
        shutil.copytree(template / "shared", tmp_path / name)
        torch.manual_seed(0)
        held = torch.utils.data.DataLoader(NoisyDigits(n=48, own_generator=False), batch_size=32, shuffle=True)
        if name == "whole":
            train_array(tmp_path / name, make(), config, progress=False, eval_data=held)
        else:
            ds = _interrupted(tmp_path / name, make, config, 12, before_resume=lambda: torch.manual_seed(999),
                              eval_data=held)
            assert len(ds.calls) == (2 + 4) * N
        runs[name] = states(tmp_path / name)
    for b in range(B):
        for k, v in runs["whole"][b].items():
            assert v.tobytes() == runs["resumed"][b][k].tobytes(), (b, k)


def test_resume_says_when_the_data_order_cannot_be_the_same(array):
    """persistent_workers keep their random state from one epoch to the next, which no checkpoint holds: the run
    resumes, and says that its data order differs."""
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Catch(logging.WARNING)
    logger = logging.getLogger("onnxfuse.train")
    logger.addHandler(handler)
    try:
        _interrupted(array, lambda: loader_of(NoisyDigits(), num_workers=1, persistent_workers=True), sgd(14), 12)
    finally:
        logger.removeHandler(handler)
    assert any("the data order after this resume differs from an uninterrupted run's: its persistent_workers" in m
               for m in seen), seen
    assert load_file(os.path.join(array, "trained", "weights.safetensors"))


def test_every_kind_of_generator_resumes_where_it_was():
    """The states a checkpoint records (JSON) put every kind of generator a loader or dataset may hold back where
    it was: the next draws are the same."""
    import json
    import random

    from onnxfuse.recipe.loader import _get_state, _set_state

    rngs = ["torch", "numpy", "random", torch.Generator().manual_seed(1), np.random.default_rng(2),
            np.random.RandomState(3), random.Random(4)]

    def draw(r):
        if r == "torch":
            return torch.rand(3).tolist()
        if r == "numpy":
            return np.random.rand(3).tolist()
        if r == "random":
            return [random.random() for _ in range(3)]
        if isinstance(r, torch.Generator):
            return torch.rand(3, generator=r).tolist()
        if isinstance(r, (np.random.Generator, np.random.RandomState)):
            return r.standard_normal(3).tolist()  # RandomState: a cached Gaussian is part of the state
        return [r.gauss(0, 1) for _ in range(3)]

    for r in rngs:
        draw(r)
        state = json.loads(json.dumps(_get_state(r)))
        first = draw(r)
        draw(r)
        _set_state(r, state)
        assert draw(r) == first, r


# -------------------------------------------------------------------------------- evaluation, per-model, halving
def test_an_eval_dataloader_evaluates_as_arrays_do(array):
    """Evaluation data given as a DataLoader (its own batch size, a partial last batch) gives the losses and
    accuracies the same samples give as arrays."""
    train = torch.utils.data.DataLoader(_pairs(), batch_size=N)
    held = {"input": DIGITS["input"][1000:1100], "labels": DIGITS["labels"][1000:1100]}
    eval_loader = torch.utils.data.DataLoader(_pairs(torch.from_numpy(held["input"]), torch.from_numpy(held["labels"])),
                                              batch_size=30)
    a = train_array(array, train, sgd(4, eval_every=2), progress=False, eval_data=eval_loader)
    b = train_array(array, train, sgd(4, eval_every=2), progress=False, eval_data=held)
    for key in ("loss", "accuracy"):
        for m in range(B):
            assert a.eval[key][m] == pytest.approx(b.eval[key][m], rel=1e-5)


class _PerModel(torch.utils.data.Dataset):
    """Each sample holds every model's own view: [B, 1, 8, 8] (model b's digit is shifted by b rows)."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        x = torch.from_numpy(DIGITS["input"][i])
        return torch.stack([torch.roll(x, b, dims=1) for b in range(B)]), int(DIGITS["labels"][i])


def test_per_model_inputs_and_halving_with_a_loader(template, tmp_path):
    """A per-model input's batch is [N, B, ...]: model b trains on its own view; halving at step 3 keeps the
    better model, which then trains on as if the array had not shrunk (torch.optim alone on its views). A
    per-model data order with a loader is one line."""
    shutil.copytree(template / "per_model", tmp_path / "array")
    arr = tmp_path / "array"
    loader = torch.utils.data.DataLoader(_PerModel(), batch_size=N)
    with pytest.raises(ConfigError, match=r"--data-order per-model gives every model other samples, but a DataLoader "
                                          r"gives every model the same batches; use --data-order shared"):
        train_array(arr, loader, sgd(4, data_order="per-model"), progress=False)
    res = train_array(arr, loader, sgd(6, halving=[3], halving_keep=0.5), progress=False, eval_data=loader)
    assert res.steps == 6 and len(res.survivors) == 1
    (b,) = res.survivors
    batches = [(x[:, b], y) for x, y in loader] * 2
    got = states(arr)[b]
    for k, v in torch_alone(mlps()[b], batches[:6]).items():
        assert rel_err(got[k], v) < 1e-5, k


# ---------------------------------------------------------------------------------------------------- sweep
@pytest.mark.slow
def test_a_sweep_whose_data_factory_returns_a_loader(tmp_path):
    """data.train / data.eval: MODULE:FUNCTION returning DataLoaders; each array's worker calls them and trains
    on the loader's batches: a trial's weights equal torch.optim training it alone on them."""
    from onnxfuse.sweep import run_sweep
    from onnxfuse.sweep.folder import SweepDir

    (tmp_path / "loaders.py").write_text(LOADERS_PY)
    factory = f"{tmp_path / 'loaders.py'}:make"
    raw = {"model": {"factory": "onnxfuse.exporters.zoo:MLP", "input_shape": list(SHAPE),
                     "args": {"in_features": 64, "hidden": 16}},
           "search": {"space": {"optimizer.lr": [0.1, 0.05]}}, "arrays": {"size": 2},
           "data": {"train": factory, "eval": factory}, "optimizer": {"name": "sgd"}, "steps": 4, "batch_size": 16}
    res = run_sweep(write_spec(tmp_path, raw), tmp_path / "out", num_cpus=1, progress=False)
    assert not res.failed and len(res.rows) == 2 and all(r["status"] == "finished" for r in res.rows)
    namespace = {}
    exec(LOADERS_PY, namespace)
    batches = list(namespace["make"]())[:4]
    out = SweepDir(tmp_path / "out")
    for row in res.rows:
        lr = float(row["optimizer.lr"])
        torch.manual_seed(0)
        mod = zoo.MLP(in_features=64, hidden=16)
        opt = torch.optim.SGD(mod.parameters(), lr=lr)
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(mod.train()(x), y).backward()
            opt.step()
        got = load_file(out.trial_file(row["trial"], "model.safetensors"))
        for k, v in mod.state_dict().items():
            assert rel_err(got[k], v.detach().numpy()) < 1e-5, (row["trial"], k)


# ---------------------------------------------------------------------------------------------- a Python loss
def smoothed(output, batch):
    """A Python loss: label-smoothed cross-entropy per model over the stacked output [M, N, 10] -> [M]."""
    logp = output.log_softmax(-1)
    y = batch["labels"].expand(output.shape[0], -1)
    return (0.9 * -logp.gather(-1, y[..., None]).squeeze(-1) - 0.1 * logp.mean(-1)).mean(-1)


def test_a_python_loss_trains_each_model_as_torch_trains_it_alone(array, tmp_path):
    """train_array(..., loss=fn) with a DataLoader: each model's weights are what torch.optim.SGD gives the model
    alone with the same function on the same batches; the run's verification passed on the way."""
    ds = NoisyDigits(n=96)
    res = train_array(array, loader_of(ds, seed=3),
                      TrainConfig(steps=6, lr=LR, optimizer="sgd", verify_steps=2, runtime="torch"),
                      progress=False, loss=smoothed)
    assert len(ds.calls) == 6 * N
    alone = mlps()
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in alone]
    replay = NoisyDigits(n=96)
    for x, y in loader_of(replay, seed=3):
        for m, o in zip(alone, opts):
            smoothed(m.train()(x)[None], {"labels": y})[0].backward()
            o.step()
            o.zero_grad()
        if len(replay.calls) == 6 * N:
            break
    for b, (got, m) in enumerate(zip(states(array), alone)):
        for k, v in m.state_dict().items():
            assert rel_err(got[k], v.detach().numpy()) < 1e-5, (b, k)
    assert res.steps == 6 and np.isfinite(res.final_loss).all()


def test_a_python_loss_reads_labels_as_given_and_is_refused_where_it_cannot_run(array, tmp_path):
    float_targets = {"input": DIGITS["input"][:64], "labels": DIGITS["input"][:64].reshape(64, -1)[:, :10] * 1.0}

    def mse(output, batch):  # float targets [N, 10]: the data's dtype, no class check
        assert batch["labels"].dtype == torch.float32
        return ((output - batch["labels"]) ** 2).mean(dim=(1, 2))

    train_array(array, float_targets, TrainConfig(steps=2, batch_size=16, runtime="torch"), progress=False, loss=mse)
    with pytest.raises(ConfigError, match="only the torch runtime runs; train with runtime='torch'"):
        train_array(array, float_targets, TrainConfig(steps=2, batch_size=16, runtime="ort"), progress=False,
                    loss=mse)
    with pytest.raises(ConfigError, match=r"returned \[16\]; it must return one loss per model, a tensor of shape "
                                          r"\[2\]"):
        train_array(array, float_targets, TrainConfig(steps=2, batch_size=16, runtime="torch"), progress=False,
                    loss=lambda output, batch: output.mean(dim=(0, 2)))
    with pytest.raises(ConfigError, match="loss= takes a loss name or a Python function"):
        train_array(array, float_targets, TrainConfig(steps=2, batch_size=16), progress=False, loss=3)


def test_a_run_with_a_python_loss_resumes_only_given_it(array):
    cfg = TrainConfig(steps=4, batch_size=16, checkpoint_every=2, runtime="torch")
    data = {"input": DIGITS["input"][:64], "labels": DIGITS["labels"][:64]}
    train_array(array, data, cfg, progress=False, loss=smoothed, stop_at=2)
    with pytest.raises(ConfigError, match=r"was trained with the Python loss tests.recipe.test_dataloader.smoothed, not the "
                                          r"settings loss; resume it with train_array\(..., loss=smoothed"):
        train_array(array, data, progress=False, resume=True)
    assert train_array(array, data, progress=False, resume=True, loss=smoothed).steps == 4
