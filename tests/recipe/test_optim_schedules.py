"""Every optimizer x schedule x clipping combination, with different values per model, equals torch.optim +
torch.optim.lr_scheduler + clip_grad_norm_ on each model alone over 12 steps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import MODELS, export_all, make_modules, rel_err
from onnxfuse import fuse_models
from onnxfuse.core.split import split_weights
from onnxfuse.recipe.optim import make_optimizer
from onnxfuse.runtime.trainers import make_trainer
from onnxfuse.recipe.schedules import PerModelSchedules, check_schedules

B, STEPS = 3, 12
OPTIMIZERS = {  # per-model values; every one differs between models
    "sgd": dict(lr=[0.05, 0.1, 0.02], momentum=[0.9, 0.5, 0.0], dampening=[0.0, 0.2, 0.0],
                nesterov=[True, False, False], weight_decay=[0.0, 1e-3, 1e-2]),
    "adam": dict(lr=[1e-3, 3e-3, 1e-2], betas=[(0.9, 0.999), (0.8, 0.99), (0.95, 0.9)], eps=[1e-8, 1e-6, 1e-8],
                 weight_decay=[0.0, 1e-2, 1e-3], amsgrad=[False, True, True]),
    "adamw": dict(lr=[1e-3, 3e-3, 1e-2], betas=[(0.9, 0.999), (0.8, 0.99), (0.95, 0.9)], eps=[1e-8, 1e-6, 1e-8],
                  weight_decay=[1e-2, 0.0, 1e-1], amsgrad=[True, False, True]),
}
SCHEDULES = {  # per model: (our spec, a function building torch's scheduler for the reference, written out)
    "constant": [None] * B,
    "step": [{"name": "step", "step_size": k, "gamma": g} for k, g in ((3, 0.5), (4, 0.7), (5, 0.9))],
    "multistep": [{"name": "multistep", "milestones": m, "gamma": 0.5} for m in ([2, 5], [3, 8], [10])],
    "exponential": [{"name": "exponential", "gamma": g} for g in (0.9, 0.95, 0.8)],
    "cosine": [{"name": "cosine", "warmup_steps": w} for w in (0, 3, 5)],
    "linear": [{"name": "linear", "warmup_steps": w, "end_factor": e} for w, e in ((2, 0.0), (4, 0.1), (0, 0.5))],
    "onecycle": [{"name": "onecycle", "max_lr": m, "pct_start": p} for m, p in ((0.05, 0.3), (0.02, 0.5), (0.1, 0.2))],
    "mixed": [{"name": "step", "step_size": 3}, {"name": "cosine", "warmup_steps": 2},
              {"name": "onecycle", "max_lr": 0.03}],
}


def torch_scheduler(opt, spec):
    """The reference, spelled out with torch's classes (not through onnxfuse)."""
    s = torch.optim.lr_scheduler
    if spec is None:
        return None
    name = spec["name"]
    if name == "step":
        return s.StepLR(opt, spec["step_size"], gamma=spec.get("gamma", 0.1))
    if name == "multistep":
        return s.MultiStepLR(opt, spec["milestones"], gamma=spec.get("gamma", 0.1))
    if name == "exponential":
        return s.ExponentialLR(opt, spec["gamma"])
    if name == "onecycle":
        return s.OneCycleLR(opt, max_lr=spec["max_lr"], total_steps=STEPS, pct_start=spec.get("pct_start", 0.3))
    w = spec.get("warmup_steps", 0)
    main = s.CosineAnnealingLR(opt, T_max=STEPS - w) if name == "cosine" else \
        s.LinearLR(opt, start_factor=1.0, end_factor=spec.get("end_factor", 0.0), total_iters=STEPS - w)
    if not w:
        return main
    return s.SequentialLR(opt, [s.LinearLR(opt, start_factor=1e-3, end_factor=1.0, total_iters=w), main], [w])


def torch_optimizer(kind, params, b):
    cfg = OPTIMIZERS[kind]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=cfg["lr"][b], momentum=cfg["momentum"][b], dampening=cfg["dampening"][b],
                               nesterov=cfg["nesterov"][b], weight_decay=cfg["weight_decay"][b])
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    return cls(params, lr=cfg["lr"][b], betas=cfg["betas"][b], eps=cfg["eps"][b],
               weight_decay=cfg["weight_decay"][b], amsgrad=cfg["amsgrad"][b])


@pytest.mark.parametrize("clip", [None, [0.5, float("inf"), 2.0]])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_optimizer_schedule_clipping_match_torch(kind, schedule, clip, runtime, tmp_path):
    _against_torch(kind, schedule, clip, runtime, tmp_path, planned=False)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_planned_coefficients_match_torch(kind, schedule, tmp_path, monkeypatch):
    """The run loop's path on the torch runtime: the schedules' values handed ahead and the coefficients computed
    a window at a time (windows of 5 here: 5 + 5 + 2 steps), against torch.optim and its schedulers alone."""
    from onnxfuse.runtime.torch.train_step import TrainStep

    monkeypatch.setattr(TrainStep, "WINDOW", 5)
    _against_torch(kind, schedule, None, "torch", tmp_path, planned=True)


def _against_torch(kind, schedule, clip, runtime, tmp_path, planned):
    import warnings

    name = "cnn_bn" if schedule == "mixed" else "mlp"
    mods = make_modules(name, B, seed0=20)
    shape = MODELS[name][1]
    fa = fuse_models(export_all(mods, shape, tmp_path))
    opt = make_optimizer(kind, B, max_norm=clip, **OPTIMIZERS[kind])
    specs = check_schedules(SCHEDULES[schedule], B, STEPS)
    schedules = PerModelSchedules(specs, opt, STEPS)
    opt.momentum_varies = schedules.moves_momentum
    trainer = make_trainer(runtime, fa.model, fa.spec, "cross-entropy", opt)
    topts = [torch_optimizer(kind, m.parameters(), b) for b, m in enumerate(mods)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tscheds = [torch_scheduler(o, s) for o, s in zip(topts, SCHEDULES[schedule])]
    rng = np.random.default_rng(3)
    for _ in range(STEPS):
        x = rng.standard_normal((8,) + shape[1:]).astype(np.float32)
        y = rng.integers(0, 10, 8)
        feeds, values = {"input": x, "labels": y}, schedules.values([True] * B)
        if planned:
            trainer.launch(feeds, values, lambda n: schedules.ahead([True] * B, min(n, STEPS - schedules.taken)))
        else:
            trainer.step(feeds, values)
        schedules.advance()
        for b, m in enumerate(mods):
            topts[b].zero_grad()
            torch.nn.functional.cross_entropy(m.train()(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip[b])
            topts[b].step()
            if tscheds[b] is not None:
                tscheds[b].step()
    split = split_weights(fa.spec, trainer.weights(), steps=STEPS)
    for b, m in enumerate(mods):
        assert schedules.values([True] * B).lr[b] == topts[b].param_groups[0]["lr"]
        for key, ref in m.state_dict().items():
            assert rel_err(split[b][key], ref.numpy()) < 1e-4, (b, key)
