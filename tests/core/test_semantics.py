"""Training semantics a module has and its graph cannot hold (``onnxfuse/core/semantics.py``): an embedding's
``padding_idx`` row and frozen parameters, trained by both runtimes and in a user's own loop as torch.optim trains
each model alone; what no runtime can train is refused in one line; a plain export is warned about and takes the
facts as options."""
from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn

import onnxfuse
from tests.conftest import RUNTIME_PARAMS, rel_err
from onnxfuse import fuse_models
from onnxfuse.core.errors import ConfigError
from onnxfuse.core.split import split_weights
from onnxfuse.exporters.torch_export import export_module
from onnxfuse.runtime.trainers import make_trainer
from onnxfuse.recipe.optim import make_optimizer

V, D, T, K = 12, 8, 5, 3
STEPS = 4
CONFIGS = {  # model 0 without weight decay: its padding row must not move at all
    "sgd": dict(lr=[0.1, 0.05, 0.2], momentum=[0.9, 0.5, 0.0], weight_decay=[0.0, 1e-3, 1e-2]),
    "adamw": dict(lr=[1e-2, 3e-3, 2e-2], weight_decay=[0.0, 1e-2, 1e-1], betas=[(0.9, 0.999)] * 3, eps=[1e-8] * 3),
}


class TokenNet(nn.Module):
    """BERT-style: token embeddings with a padding row, LayerNorm, a Linear; a classifier, or (``tied``) logits over
    the vocabulary from the embedding table itself, whose padding row then gets the head's gradient."""

    def __init__(self, tied: bool = False, frozen: bool = False):
        super().__init__()
        self.tied = tied
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.norm = nn.LayerNorm(D)
        self.body = nn.Linear(D, D)
        self.head = nn.Linear(D, K)
        if frozen:
            self.body.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.body(self.norm(self.emb(x)))).mean(1)
        return h @ self.emb.weight.t() if self.tied else self.head(h)


def _modules(B, **kw):
    mods = []
    for b in range(B):
        torch.manual_seed(20 + b)
        m = TokenNet(**kw)
        with torch.no_grad():
            m.emb.weight[0].normal_()  # a padding row that is not zero, so that weight decay shows too
        mods.append(m)
    return mods


def _batches(classes: int):
    rng = np.random.default_rng(3)
    for _ in range(STEPS):
        x = rng.integers(0, V, (6, T))
        x[:, -2:] = 0  # padded sequences: row 0 is looked up in every sample
        yield x.astype(np.int64), rng.integers(0, classes, 6).astype(np.int64)


def _torch_alone(mods, kind, classes):
    cfg = CONFIGS[kind]
    opts = []
    for b, m in enumerate(mods):
        if kind == "sgd":
            opts.append(torch.optim.SGD(m.parameters(), lr=cfg["lr"][b], momentum=cfg["momentum"][b],
                                        weight_decay=cfg["weight_decay"][b]))
        else:
            opts.append(torch.optim.AdamW(m.parameters(), lr=cfg["lr"][b], weight_decay=cfg["weight_decay"][b],
                                          betas=cfg["betas"][b], eps=cfg["eps"][b]))
    losses = []
    for x, y in _batches(classes):
        step = []
        for m, opt in zip(mods, opts):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m.train()(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            opt.step()
            step.append(loss.item())
        losses.append(step)
    return losses


def _assert_trained_like_torch(trained: list[dict], mods, initial: list[dict]):
    for b, m in enumerate(mods):
        for key, ref in m.state_dict().items():
            got = np.asarray(trained[b][key])
            assert rel_err(got, ref.numpy()) < 1e-4, (b, key)
        # the padding row as torch leaves it: what moved it (weight decay, a tied head's gradient) and nothing else
        moved = np.asarray(trained[b]["emb.weight"])[0] - initial[b]["emb.weight"][0].numpy()
        ref = m.state_dict()["emb.weight"][0].numpy() - initial[b]["emb.weight"][0].numpy()
        assert np.abs(moved - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max()), (b, moved, ref)
        if not m.tied and b == 0:  # no weight decay, no other reader: the row stays exactly where it was
            assert np.array_equal(np.asarray(trained[b]["emb.weight"])[0], initial[b]["emb.weight"][0].numpy())


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("tied", [False, True], ids=["classifier", "tied"])
def test_padding_row_trains_as_torch_trains_it(kind, tied, runtime, tmp_path):
    B, classes = 3, (V if tied else K)
    mods = _modules(B, tied=tied)
    initial = [{k: v.clone() for k, v in m.state_dict().items()} for m in mods]
    example = (torch.zeros(1, T, dtype=torch.int64),)
    fa = fuse_models([export_module(m, None, example_inputs=example) for m in mods])
    assert fa.spec.weights["emb.weight"].extra["padding_rows"] == [[0]] * B
    opt = make_optimizer(kind, B, **CONFIGS[kind])
    trainer = make_trainer(runtime, fa.model, fa.spec, "cross-entropy", opt, workdir=str(tmp_path / "art"))
    fused_losses = [trainer.step({"input": x, "labels": y}) for x, y in _batches(classes)]
    alone = _torch_alone(mods, kind, classes)
    np.testing.assert_allclose(np.asarray(fused_losses), np.asarray(alone), rtol=1e-5)
    _assert_trained_like_torch(split_weights(fa.spec, trainer.weights(), steps=STEPS), mods, initial)


def test_padding_row_in_a_users_own_loop():
    """``onnxfuse.fuse`` + ``onnxfuse.optim`` + the user's own backward: the padding row is kept there too."""
    mods = _modules(2, tied=True)
    initial = [{k: v.clone() for k, v in m.state_dict().items()} for m in mods]
    arr = onnxfuse.fuse(mods, torch.zeros(1, T, dtype=torch.int64))
    cfg = {k: v[:2] for k, v in CONFIGS["adamw"].items()}
    opt = onnxfuse.optim.AdamW(arr, **cfg)
    for x, y in _batches(V):
        out = arr(torch.from_numpy(x))
        losses = nn.functional.cross_entropy(out.flatten(0, 1), torch.from_numpy(y).repeat(2), reduction="none")
        opt.zero_grad()
        losses.view(2, -1).mean(1).sum().backward()
        opt.step()
    _torch_alone(mods, "adamw", V)
    _assert_trained_like_torch([{k: v.numpy() for k, v in sd.items()} for sd in arr.state_dicts()], mods, initial)


def test_a_frozen_submodule_stays_as_torch_leaves_it(runtime, tmp_path):
    mods = _modules(2, frozen=True)
    before = [m.body.weight.detach().clone() for m in mods]
    example = (torch.zeros(1, T, dtype=torch.int64),)
    fa = fuse_models([export_module(m, None, example_inputs=example) for m in mods])
    assert fa.spec.weights["body.weight"].role == "frozen"
    cfg = {k: v[:2] for k, v in CONFIGS["adamw"].items()}
    trainer = make_trainer(runtime, fa.model, fa.spec, "cross-entropy", make_optimizer("adamw", 2, **cfg),
                           workdir=str(tmp_path / "art"))
    for x, y in _batches(K):
        trainer.step({"input": x, "labels": y})
    _torch_alone(mods, "adamw", K)
    split = split_weights(fa.spec, trainer.weights(), steps=STEPS)
    for b, m in enumerate(mods):
        assert torch.equal(m.body.weight, before[b])  # torch.optim leaves it: it never has a gradient
        assert np.array_equal(np.asarray(split[b]["body.weight"]), before[b].numpy())
        assert rel_err(split[b]["head.weight"], m.head.weight.detach().numpy()) < 1e-4


def _plain_exports(folder, **kw) -> list[str]:
    """Plain TorchScript exports (no onnxfuse metadata) of two TokenNets."""
    paths = []
    for b, m in enumerate(_modules(2, **kw)):
        paths.append(str(folder / f"m{b}.onnx"))
        torch.onnx.export(m.train(), (torch.zeros(1, T, dtype=torch.int64),), paths[-1], dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["input"], output_names=["output"], dynamic_axes={"input": {0: "N"}})
    return paths


def test_plain_export_is_warned_about_and_takes_the_facts_as_options(tmp_path):
    paths = _plain_exports(tmp_path, frozen=True)
    with pytest.warns(UserWarning, match=r"'emb\.weight' is looked up .* --padding-rows emb\.weight=ROW"):
        plain = fuse_models(paths)
    assert "padding_rows" not in plain.spec.weights["emb.weight"].extra
    assert plain.spec.weights["body.weight"].role == "param"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        told = fuse_models(paths, padding_rows={"emb.weight": [0]}, frozen=["body.*"])
    assert told.spec.weights["emb.weight"].extra["padding_rows"] == [[0], [0]]
    assert told.spec.weights["body.weight"].role == "frozen" and told.spec.weights["body.bias"].role == "frozen"
    with pytest.raises(ConfigError, match="frozen: 'nothing.*' matches no weight"):
        fuse_models(paths, frozen=["nothing.*"])
    with pytest.raises(ConfigError, match="padding_rows: 'norm.weight' is of shape \\[8\\], not an embedding"):
        fuse_models(paths, padding_rows={"norm.weight": [0]})


@pytest.mark.parametrize("module, words", [
    (nn.Embedding(V, D, max_norm=1.0), "max_norm=1.0: its forward renormalizes"),
    (nn.Embedding(V, D, scale_grad_by_freq=True), "scale_grad_by_freq=True"),
    (nn.BatchNorm1d(D, momentum=None), "momentum=None"),
])
def test_what_no_runtime_can_train_is_refused_at_export(module, words):
    x = torch.zeros(2, T, dtype=torch.int64) if isinstance(module, nn.Embedding) else torch.randn(2, D)
    with pytest.raises(ConfigError, match=words):
        export_module(module, None, example_inputs=(x,))


def test_fuse_cli_takes_the_facts_and_keeps_them_with_the_sources(tmp_path, capsys):
    """``onnxfuse fuse --padding-rows --frozen``: array.json has them, and so do the array's source graphs, which
    a re-fusion (halving, verification's reference) reads; a name that matches nothing is one line, exit 2."""
    from onnxfuse.cli.main import main
    from onnxfuse.core.array import ArrayDir
    from onnxfuse.core.weights import ArraySpec

    paths = _plain_exports(tmp_path, frozen=True)
    assert main(["fuse", *paths, "-o", str(tmp_path / "arr"), "--padding-rows", "emb.weight=0",
                 "--frozen", "body.*"]) == 0
    assert "warning" not in capsys.readouterr().err
    spec = ArraySpec.load(tmp_path / "arr" / "array.json")
    assert spec.weights["emb.weight"].extra["padding_rows"] == [[0], [0]]
    for b in range(2):
        source = onnx.load(ArrayDir(str(tmp_path / "arr")).source_path(b))
        meta = json.loads(next(p.value for p in source.metadata_props if p.key == "onnxfuse"))
        assert meta["padding_rows"] == {"emb.weight": [0]} and set(meta["frozen"]) == {"body.weight", "body.bias"}
    assert main(["fuse", *paths, "-o", str(tmp_path / "bad"), "--padding-rows", "emb.weight=x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not NAME=ROW" in err[0], err


@pytest.mark.parametrize("layer", ["nn.LSTM(8, 4, batch_first=True, bidirectional=True)",
                                   "nn.GRU(8, 4, batch_first=True)"])
@pytest.mark.parametrize("runtime", [RUNTIME_PARAMS[0]])  # ort: the torch runtime is in the fuzz seeds
def test_a_frozen_recurrent_layer_trains_what_is_around_it(layer, runtime):
    """A frozen LSTM / GRU between trained layers: ORT 1.19's LSTMGrad and GRUGrad crashed the process (a
    segmentation fault) when the input needs a gradient and the weights do not; they are differentiated and not
    updated (``runtime/ort/artifacts.weights_ort_must_differentiate``). Fuzz seed 1007 found it."""
    from fuzz.grammar import Rendered
    from fuzz.harness import check_source

    source = ("import torch\nimport torch.nn as nn\n\n\nclass FuzzNet(nn.Module):\n    def __init__(self):\n"
              "        super().__init__()\n        self.pre = nn.Linear(8, 8)\n"
              f"        self.rnn = {layer}\n"
              "        self.head = nn.Linear(self.rnn.hidden_size * (1 + self.rnn.bidirectional), 5)\n"
              "        self.rnn.requires_grad_(False)\n\n    def forward(self, x):\n"
              "        return self.head(self.rnn(self.pre(x))[0][:, -1])\n")
    out = check_source(Rendered(source, (6, 8), "float", (5,), "cross-entropy", 1, 5), seed=5, runtime=runtime,
                       Bs=(1, 2))
    assert out.status in ("pass", "sensitive"), (out.B, out.stage, out.message)
