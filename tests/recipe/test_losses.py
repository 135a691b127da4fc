"""Every loss and loss option: B models with different learning rates trained fused == each trained alone with
torch.optim and torch.nn.functional's loss (per-model losses every step, split weights after the last)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import rel_err
from onnxfuse import fuse_models
from onnxfuse.exporters import export_module
from onnxfuse.core.split import split_weights
from onnxfuse.recipe.data import make_dataset
from onnxfuse.recipe.losses import get_loss
from onnxfuse.recipe.optim import make_optimizer
from onnxfuse.runtime.trainers import make_trainer

B, N, STEPS = 3, 8, 4
LR = [0.05, 0.2, 0.5]


class Classifier(nn.Module):  # [N, F] -> [N, C]
    def __init__(self, features=6, classes=5, log_probs=False):
        super().__init__()
        self.fc1, self.fc2, self.log_probs = nn.Linear(features, 12), nn.Linear(12, classes), log_probs

    def forward(self, x):
        y = self.fc2(torch.relu(self.fc1(x)))
        return torch.log_softmax(y, 1) if self.log_probs else y


class Segmenter(nn.Module):  # [N, 3, L] -> [N, C, L]
    def __init__(self, classes=4):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(3, 8, 3, padding=1), nn.Conv1d(8, classes, 1)

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(x)))


class TokenScorer(nn.Module):  # [N, T, F] -> [N, T, V], language-model style logits
    def __init__(self, features=6, vocab=7):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(features, 10), nn.Linear(10, vocab)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Regressor(nn.Module):  # [N, F] -> [N, 2] (or [N, 1] logits)
    def __init__(self, out=2):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 10), nn.Linear(10, out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class SelfLoss(nn.Module):  # [N, F] -> [] : the model computes its own loss
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 10), nn.Linear(10, 1)

    def forward(self, x):
        return ((self.fc2(torch.relu(self.fc1(x))) - 1.0) ** 2).mean()


def _class_labels(rng, shape, classes, ignore=None, frac=0.3):
    y = rng.integers(0, classes, shape)
    if ignore is not None:
        y[rng.random(shape) < frac] = ignore
    return y


# name -> (module factory, input shape per sample, loss name, loss options, labels(rng, batch) or None, torch loss)
CASES = {
    "ce": (Classifier, (6,), "cross-entropy", {}, lambda r, n: r.integers(0, 5, n),
           lambda out, y: F.cross_entropy(out, y)),
    "ce-smoothing-ignore": (Classifier, (6,), "cross-entropy", dict(label_smoothing=0.2),
                            lambda r, n: _class_labels(r, n, 5, -100),
                            lambda out, y: F.cross_entropy(out, y, label_smoothing=0.2)),
    "ce-segmentation-ignore": (Segmenter, (3, 5), "cross-entropy", dict(ignore_index=255),
                               lambda r, n: _class_labels(r, (n, 5), 4, 255),
                               lambda out, y: F.cross_entropy(out, y, ignore_index=255)),
    "ce-lm-class-axis": (TokenScorer, (4, 6), "cross-entropy", dict(class_axis=-1, label_smoothing=0.1, ignore_index=0),
                         lambda r, n: _class_labels(r, (n, 4), 7, 0),
                         lambda out, y: F.cross_entropy(out.movedim(-1, 1), y, ignore_index=0, label_smoothing=0.1)),
    "nll-ignore": (lambda: Classifier(log_probs=True), (6,), "nll", dict(ignore_index=1),
                   lambda r, n: r.integers(0, 5, n), lambda out, y: F.nll_loss(out, y, ignore_index=1)),
    "mse": (Regressor, (6,), "mse", {}, lambda r, n: r.standard_normal((n, 2)).astype(np.float32),
            lambda out, y: F.mse_loss(out, y)),
    "l1": (Regressor, (6,), "l1", {}, lambda r, n: r.standard_normal((n, 2)).astype(np.float32),
           lambda out, y: F.l1_loss(out, y)),
    "bce-with-logits": (lambda: Regressor(1), (6,), "bce-with-logits", {},
                        lambda r, n: r.random((n, 1)).astype(np.float32),
                        lambda out, y: F.binary_cross_entropy_with_logits(out, y)),
    "model": (SelfLoss, (6,), "model", {}, None, lambda out, y: out),
}


def _export(factory, sample_shape, folder, per_model_inputs=()):
    mods, paths = [], []
    os.makedirs(folder, exist_ok=True)
    for b in range(B):
        torch.manual_seed(20 + b)
        mods.append(factory())
        paths.append(os.path.join(folder, f"model_{b}.onnx"))
        export_module(mods[b], paths[b], input_shape=(N,) + sample_shape)
    return mods, fuse_models(paths, per_model_inputs=per_model_inputs)


def train_and_compare(case, tmp_path, runtime, per_model_labels=False, per_model_inputs=False, momentum=0.9):
    factory, sample_shape, loss_name, options, make_labels, torch_loss = CASES[case]
    mods, fa = _export(factory, sample_shape, tmp_path / "jobs", ["input"] if per_model_inputs else [])
    loss = get_loss(loss_name, per_model_labels=per_model_labels, **options)
    trainer = make_trainer(runtime, fa.model, fa.spec, loss, make_optimizer("sgd", B, lr=LR, momentum=momentum),
                           workdir=str(tmp_path / "art"))
    opts = [torch.optim.SGD(m.parameters(), lr=LR[b], momentum=momentum) for b, m in enumerate(mods)]
    rng = np.random.default_rng(3)
    for _ in range(STEPS):
        x = rng.standard_normal(((B,) if per_model_inputs else ()) + (N,) + sample_shape).astype(np.float32)
        feeds = {"input": x}
        if make_labels is not None:
            feeds["labels"] = np.stack([make_labels(rng, N) for _ in range(B)]) if per_model_labels \
                else make_labels(rng, N)
        fused_loss = trainer.step(feeds)
        for b, m in enumerate(mods):
            xb = x[b] if per_model_inputs else x
            yb = None if make_labels is None else torch.from_numpy(feeds["labels"][b] if per_model_labels
                                                                   else feeds["labels"])
            opts[b].zero_grad()
            ref = torch_loss(m(torch.from_numpy(xb)), yb)
            ref.backward()
            opts[b].step()
            assert abs(fused_loss[b] - ref.item()) <= 1e-5 * max(1.0, abs(ref.item())), (b, fused_loss[b], ref.item())
    split = split_weights(fa.spec, trainer.weights(), steps=STEPS)
    worst = 0.0
    for b, m in enumerate(mods):
        for key, ref in m.state_dict().items():
            err = rel_err(split[b][key], ref.numpy())
            worst = max(worst, err)
            assert err < 1e-4, (b, key, err)
    return trainer, mods, fa, worst


@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_torch_per_model(case, runtime, tmp_path):
    train_and_compare(case, tmp_path, runtime)


@pytest.mark.parametrize("case", ["ce-segmentation-ignore", "mse"])
def test_per_model_labels(case, runtime, tmp_path):
    train_and_compare(case, tmp_path, runtime, per_model_labels=True)


def test_per_model_inputs_and_labels(runtime, tmp_path):
    """Inputs fused with per_model_inputs take [B, N, ...]: model b trains (and is evaluated) on x[b] only."""
    trainer, mods, fa, _ = train_and_compare("ce", tmp_path, runtime, per_model_labels=True, per_model_inputs=True)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((B, 12, 6)).astype(np.float32)
    y = rng.integers(0, 5, (B, 12))
    data = make_dataset({"input": x, "labels": y}, fa.spec.inputs, np.int64, ["N"], B=B, per_model_labels=True)
    ev = trainer.evaluate(data, batch_size=5)
    for b, m in enumerate(mods):
        with torch.no_grad():
            out = m.eval()(torch.from_numpy(x[b]))
        assert abs(ev["loss"][b] - F.cross_entropy(out, torch.from_numpy(y[b])).item()) < 1e-5
        assert ev["accuracy"][b] == pytest.approx(float((out.argmax(1).numpy() == y[b]).mean()))


def test_model_loss_evaluate(runtime, tmp_path):
    trainer, mods, fa, _ = train_and_compare("model", tmp_path, runtime)
    x = np.random.default_rng(2).standard_normal((10, 6)).astype(np.float32)
    ev = trainer.evaluate(make_dataset({"input": x}, fa.spec.inputs, None, None), batch_size=10)
    for b, m in enumerate(mods):
        with torch.no_grad():
            assert abs(ev["loss"][b] - m.eval()(torch.from_numpy(x)).item()) < 1e-5
    assert "accuracy" not in ev


def test_zoo_transformer_lm_class_axis_minus_one(runtime, tmp_path):
    """The zoo's GPT-style LM (token ids [N, T] -> logits [N, T, V]) with class_axis=-1, label smoothing and
    ignored positions, against torch's cross_entropy on the logits moved to [N, V, T]."""
    from onnxfuse.exporters import zoo

    V, T = 64, 16
    mods, paths = [], []
    for b in range(B):
        torch.manual_seed(30 + b)
        mods.append(zoo.TransformerLM(vocab_size=V, block_size=T, dropout=0.0))
        paths.append(str(tmp_path / f"lm_{b}.onnx"))
        export_module(mods[b], paths[b], example_inputs=(torch.zeros(N, T, dtype=torch.long),))
    fa = fuse_models(paths)
    loss = get_loss("cross-entropy", class_axis=-1, label_smoothing=0.1, ignore_index=-1)
    trainer = make_trainer(runtime, fa.model, fa.spec, loss, make_optimizer("sgd", B, lr=LR, momentum=0.9))
    opts = [torch.optim.SGD(m.parameters(), lr=LR[b], momentum=0.9) for b, m in enumerate(mods)]
    rng = np.random.default_rng(6)
    for _ in range(3):
        x = rng.integers(0, V, (N, T))
        y = _class_labels(rng, (N, T), V, -1, frac=0.2)
        fused_loss = trainer.step({"input": x, "labels": y})
        for b, m in enumerate(mods):
            opts[b].zero_grad()
            ref = F.cross_entropy(m(torch.from_numpy(x)).movedim(-1, 1), torch.from_numpy(y), ignore_index=-1,
                                  label_smoothing=0.1)
            ref.backward()
            opts[b].step()
            assert abs(fused_loss[b] - ref.item()) < 1e-5 * max(1.0, ref.item()), b
    split = split_weights(fa.spec, trainer.weights())
    for b, m in enumerate(mods):
        for key, ref in m.state_dict().items():
            assert rel_err(split[b][key], ref.numpy()) < 1e-4, (b, key)


def test_evaluate_segmentation_accuracy_over_kept_labels(runtime, tmp_path):
    trainer, mods, fa, _ = train_and_compare("ce-segmentation-ignore", tmp_path, runtime)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((20, 3, 5)).astype(np.float32)
    y = _class_labels(rng, (20, 5), 4, 255)
    loss = trainer.loss
    data = make_dataset({"input": x, "labels": y}, fa.spec.inputs, loss.label_dtype,
                        loss.label_shape(fa.spec.outputs[0]["shape"]), B=B)
    ev = trainer.evaluate(data, batch_size=8)  # batches of 8, 8, 4
    keep = y != 255
    for b, m in enumerate(mods):
        with torch.no_grad():
            out = m.eval()(torch.from_numpy(x))
        ref = F.cross_entropy(out, torch.from_numpy(y), ignore_index=255).item()
        assert abs(ev["loss"][b] - ref) < 1e-5 * max(1.0, ref)
        assert ev["accuracy"][b] == pytest.approx(float((out.argmax(1).numpy() == y)[keep].mean()))


def test_loss_options_are_checked():
    from onnxfuse.core.errors import ConfigError

    with pytest.raises(ConfigError, match="label-smoothing applies to cross-entropy only"):
        get_loss("nll", label_smoothing=0.1)
    with pytest.raises(ConfigError, match=r"must be in \[0, 1\]"):
        get_loss("cross-entropy", label_smoothing=1.5)
    with pytest.raises(ConfigError, match="takes no labels"):
        get_loss("model", per_model_labels=True)
    with pytest.raises(ConfigError, match="does not fit the model output"):
        get_loss("cross-entropy", class_axis=3).label_shape(["N", 10])
    with pytest.raises(ConfigError, match=r"needs an output that is the loss \(shape \[\] or \[1\]\)"):
        get_loss("model").check_output(["N", 10])


# ---- command line: the loss flags and per-model data files
@pytest.fixture(scope="module")
def cli_array(tmp_path_factory):
    """3 MLPs exported and fused by the CLI with a per-model input (each model gets its own images)."""
    from onnxfuse.cli.main import main

    d = tmp_path_factory.mktemp("cli_losses")
    assert main(["export", "onnxfuse.exporters.zoo:MLP", "--count", "3", "--seeds", "1,2,3", "--input-shape", "4,1,8,8",
                 "-o", str(d / "jobs")]) == 0
    assert main(["fuse", str(d / "jobs"), "-o", str(d / "array"), "--per-model-inputs", "input"]) == 0
    return d


def test_cli_loss_flags_with_per_model_data(cli_array, capsys):
    """--label-smoothing, --ignore-index and --per-model-labels reach the loss: the step-1 losses in metrics.csv
    are torch's for each model on its own slice of the data."""
    import csv
    import json

    from onnxfuse.cli.main import main
    from onnxfuse.exporters import zoo

    d = cli_array
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 16, 1, 8, 8)).astype(np.float32)
    y = _class_labels(rng, (3, 16), 10, 7)
    np.savez(d / "data.npz", input=x, labels=y)
    code = main(["train", str(d / "array"), "--data", str(d / "data.npz"), "--loss", "cross-entropy",
                 "--label-smoothing", "0.1", "--ignore-index", "7", "--per-model-labels", "--lr", "0.1,0.2,0.3",
                 "--steps", "2", "--batch-size", "8", "--no-shuffle", "-q"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = [r for r in csv.DictReader(open(d / "array" / "metrics.csv")) if r["step"] == "1"]
    for b, seed in enumerate([1, 2, 3]):
        torch.manual_seed(seed)  # as `onnxfuse export --seeds` builds model b
        m = zoo.MLP()
        with torch.no_grad():
            ref = F.cross_entropy(m(torch.from_numpy(x[b, :8])), torch.from_numpy(y[b, :8]), label_smoothing=0.1,
                                  ignore_index=7).item()
        assert abs(float(rows[b]["loss"]) - ref) < 1e-5, (b, rows[b], ref)
    state = json.load(open(d / "array" / "trained" / "train_state.json"))
    # recorded as a config file records them: every loss option, the defaults filled in
    assert state["config"]["loss_options"] == {"label_smoothing": 0.1, "ignore_index": 7, "class_axis": 1}
    assert state["config"]["per_model_labels"] is True


@pytest.mark.parametrize("case", ["wrong_B", "shared_labels_per_model_flag"])
def test_cli_per_model_data_with_wrong_leading_size(case, cli_array, tmp_path, capsys):
    from onnxfuse.cli.main import main
    from tests.cli.test_cli import snapshot

    d = cli_array
    labels = np.zeros(16, np.int64)
    if case == "wrong_B":
        x, expect = np.zeros((2, 16, 1, 8, 8), np.float32), \
            "'input' is per model and needs a leading model axis of B=3, [3, n, 1, 8, 8]; it has shape [2, 16, 1, 8, 8]"
        flags = []
    else:
        x = np.zeros((3, 16, 1, 8, 8), np.float32)
        expect = "'labels' is per model and needs a leading model axis of B=3"
        flags = ["--per-model-labels"]
    np.savez(tmp_path / "bad.npz", input=x, labels=labels)
    before = snapshot(d / "array")
    code = main(["train", str(d / "array"), "--data", str(tmp_path / "bad.npz"), "--steps", "1", "--batch-size", "4",
                 "-q", *flags])
    _, err = capsys.readouterr()
    assert code == 2 and expect in err and err.count("\n") == 1, err
    assert snapshot(d / "array") == before
