"""Fused training == each model trained alone by torch.optim from the same weights on the same batches."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import MODELS, export_all, make_modules, rel_err
from onnxfuse import fuse_models
from onnxfuse.core.split import split_weights
from onnxfuse.recipe.data import make_dataset
from onnxfuse.recipe.optim import make_optimizer
from onnxfuse.runtime.trainers import make_trainer

STEPS = 6
CONFIGS = {  # per-model hyper-parameters: every value differs between models
    "sgd": dict(lr=[0.05, 0.1, 0.02], momentum=[0.9, 0.5, 0.0], weight_decay=[0.0, 1e-3, 1e-2]),
    "sgd-nesterov": dict(lr=[0.05, 0.1, 0.02], momentum=[0.9, 0.8, 0.5], weight_decay=[1e-4, 0.0, 1e-2],
                         nesterov=[True, True, False], dampening=[0.0, 0.0, 0.3]),
    "adamw": dict(lr=[1e-3, 3e-3, 1e-2], weight_decay=[0.0, 1e-2, 1e-1], betas=[(0.9, 0.999), (0.8, 0.99), (0.95, 0.9)],
                  eps=[1e-8, 1e-6, 1e-8]),
}


def torch_optimizers(kind, mods, cfg):
    opts = []
    for b, m in enumerate(mods):
        if kind.startswith("sgd"):
            opts.append(torch.optim.SGD(m.parameters(), lr=cfg["lr"][b], momentum=cfg["momentum"][b],
                                        weight_decay=cfg["weight_decay"][b],
                                        nesterov=cfg.get("nesterov", [False] * 3)[b],
                                        dampening=cfg.get("dampening", [0.0] * 3)[b]))
        else:
            opts.append(torch.optim.AdamW(m.parameters(), lr=cfg["lr"][b], weight_decay=cfg["weight_decay"][b],
                                          betas=cfg["betas"][b], eps=cfg["eps"][b]))
    return opts


def train_both(name, kind, tmp_path, runtime, B=3, steps=STEPS, batch=8):
    mods = make_modules(name, B, seed0=10)
    shape = MODELS[name][1]
    fa = fuse_models(export_all(mods, shape, tmp_path))
    cfg = CONFIGS[kind]
    opt = make_optimizer("sgd" if kind.startswith("sgd") else "adamw", B, **cfg)
    trainer = make_trainer(runtime, fa.model, fa.spec, "cross-entropy", opt, workdir=str(tmp_path / "art"))
    topts = torch_optimizers(kind, mods, cfg)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        x = rng.standard_normal((batch,) + shape[1:]).astype(np.float32)
        y = rng.integers(0, 10, batch)
        fused_loss = trainer.step({"input": x, "labels": y})
        for b, m in enumerate(mods):
            m.train()
            topts[b].zero_grad()
            loss = torch.nn.functional.cross_entropy(m(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            topts[b].step()
            assert abs(fused_loss[b] - loss.item()) <= 1e-5 * max(1.0, abs(loss.item()))
    return mods, fa, trainer


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("name", ["lenet", "cnn_bn", "mlp"])
def test_split_tensors_equal_torch_optim(name, kind, runtime, tmp_path):
    mods, fa, trainer = train_both(name, kind, tmp_path, runtime)
    split = split_weights(fa.spec, trainer.weights(), steps=STEPS)
    for b, m in enumerate(mods):
        sd = m.state_dict()
        assert set(split[b]) == set(sd)
        for key, ref in sd.items():
            got, ref = split[b][key], ref.numpy()
            if key.endswith("num_batches_tracked"):
                assert int(got) == int(ref) == STEPS
            elif "running_" in key:
                assert rel_err(got, ref) < 1e-5, (b, key)
            else:
                assert rel_err(got, ref) < 1e-4, (b, key)


def test_nesterov_dampening_per_model(runtime, tmp_path):
    mods, fa, trainer = train_both("cnn_bn", "sgd-nesterov", tmp_path, runtime)
    split = split_weights(fa.spec, trainer.weights(), steps=STEPS)
    for b, m in enumerate(mods):
        for key, ref in m.state_dict().items():
            if ref.dtype.is_floating_point:
                assert rel_err(split[b][key], ref.numpy()) < (1e-5 if "running_" in key else 1e-4), (b, key)


def test_models_are_independent(runtime, tmp_path):
    """Changing model 1's learning rate leaves models 0 and 2 bit-identical."""
    outs = []
    for lr1 in (0.1, 0.5):
        mods = make_modules("lenet", 3, seed0=10)
        fa = fuse_models(export_all(mods, MODELS["lenet"][1], tmp_path / f"m{lr1}"))
        trainer = make_trainer(runtime, fa.model, fa.spec, "cross-entropy",
                               make_optimizer("sgd", 3, lr=[0.05, lr1, 0.02], momentum=0.9))
        rng = np.random.default_rng(1)
        for _ in range(3):
            trainer.step({"input": rng.standard_normal((8, 1, 28, 28)).astype(np.float32),
                          "labels": rng.integers(0, 10, 8)})
        outs.append(split_weights(fa.spec, trainer.weights()))
    for b in (0, 2):
        for k in outs[0][b]:
            assert outs[0][b][k].tobytes() == outs[1][b][k].tobytes(), (b, k)
    assert any(outs[0][1][k].tobytes() != outs[1][1][k].tobytes() for k in outs[0][1])


def test_evaluate_uses_running_statistics_like_torch_eval(runtime, tmp_path):
    mods, fa, trainer = train_both("cnn_bn", "adamw", tmp_path, runtime)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((40,) + MODELS["cnn_bn"][1][1:]).astype(np.float32)
    y = rng.integers(0, 10, 40)
    data = make_dataset({"input": x, "labels": y}, fa.spec.inputs, np.int64, ["N"])
    ev = trainer.evaluate(data, batch_size=16)  # batches of 16, 16, 8
    for b, m in enumerate(mods):
        with torch.no_grad():
            logits = m.eval()(torch.from_numpy(x))
        ref_loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()
        assert abs(ev["loss"][b] - ref_loss) < 1e-4 * max(1, abs(ref_loss))
        assert ev["accuracy"][b] == float((logits.argmax(1).numpy() == y).mean())


def test_node_without_rule_runs_per_model_and_trains_like_torch(runtime, tmp_path, monkeypatch):
    """Take away the Tanh rule: the MLP's Tanh runs once per model (fallback), and training still matches torch."""
    import warnings

    from onnxfuse.core.errors import UnsupportedOpError
    from onnxfuse.core.rules import RULES

    monkeypatch.delitem(RULES, ("", "Tanh"))
    mods = make_modules("mlp", 3, seed0=10)
    paths = export_all(mods, MODELS["mlp"][1], tmp_path)
    with pytest.raises(UnsupportedOpError, match="'Tanh', which has no fusion rule"):
        fuse_models(paths, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fa = fuse_models(paths)
    assert any("run once per model instead of fused" in str(w.message) for w in caught)
    assert fa.spec.summary["per_model"] == 1 and fa.spec.summary["fused_fraction"] < 1
    cfg = CONFIGS["adamw"]
    trainer = make_trainer(runtime, fa.model, fa.spec, "cross-entropy", make_optimizer("adamw", 3, **cfg))
    topts = torch_optimizers("adamw", mods, cfg)
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        x = rng.standard_normal((8,) + MODELS["mlp"][1][1:]).astype(np.float32)
        y = rng.integers(0, 10, 8)
        trainer.step({"input": x, "labels": y})
        for b, m in enumerate(mods):
            topts[b].zero_grad()
            torch.nn.functional.cross_entropy(m.train()(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            topts[b].step()
    split = split_weights(fa.spec, trainer.weights(), steps=STEPS)
    for b, m in enumerate(mods):
        for key, ref in m.state_dict().items():
            assert rel_err(split[b][key], ref.numpy()) < 1e-4, (b, key)
