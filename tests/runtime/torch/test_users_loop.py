"""The array in a PyTorch user's own training loop: ``onnxfuse.fuse`` (a torch module fused in memory) and
``onnxfuse.optim`` (per-model optimizers), against each model trained alone by torch.optim in the same loop.

The models are written here (a BatchNorm CNN and an MLP, not zoo classes), the data is scikit-learn's digits, and
the reference is plain torch: the modules themselves, torch.optim's optimizers, torch's schedulers and
``torch.nn.utils.clip_grad_norm_``."""
from __future__ import annotations

import copy
import math
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import onnxfuse
from tests.conftest import ROOT, rel_err
from onnxfuse.core.errors import ConfigError, DataError, NotFusibleError
from onnxfuse.exporters.torch_export import export_module

B, N = 3, 32


class DigitsCNN(nn.Module):
    def __init__(self, width: int = 6):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 8, 3, stride=2, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 3 * 3, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.flatten(1))


class DigitsMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x.flatten(1)))))


@pytest.fixture(scope="module")
def digits():
    d = load_digits()
    x = torch.from_numpy((d.data / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8)
    return x, torch.from_numpy(d.target.astype(np.int64))


def smoothed_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A hand-written loss over stacked outputs [M, N, 10] -> [M]: label-smoothed cross-entropy per model."""
    logp = out.log_softmax(-1)
    nll = -logp.gather(-1, y.expand(out.shape[0], -1)[..., None]).squeeze(-1)
    return (0.9 * nll - 0.1 * logp.mean(-1)).mean(-1)


def schedulers(opts):
    """One scheduler of another kind per model (torch's classes), on each model's optimizer."""
    lrs = torch.optim.lr_scheduler
    return [lrs.StepLR(opts[0], step_size=2, gamma=0.5), lrs.CosineAnnealingLR(opts[1], T_max=6),
            lrs.LambdaLR(opts[2], lambda t: min(1.0, (t + 1) / 3))]


def train_both(make, kind, hyper, clip, digits, steps=6, accumulate=2):
    """The same plain loop twice: the fused array with onnxfuse.optim, and each model alone with torch.optim."""
    torch.manual_seed(0)
    mods = [make() for _ in range(B)]
    alone = [copy.deepcopy(m) for m in mods]
    x, y = digits
    arr = onnxfuse.fuse(mods, x[:2])
    opt = getattr(onnxfuse.optim, kind)(arr, **hyper)
    fused_scheds = schedulers([opt.model(b) for b in range(B)])
    torch_opts = [getattr(torch.optim, kind)(m.parameters(), **{k: v[b] for k, v in hyper.items()})
                  for b, m in enumerate(alone)]
    torch_scheds = schedulers(torch_opts)
    for step in range(steps):
        for micro in range(accumulate):
            rows = slice((step * accumulate + micro) * N, (step * accumulate + micro + 1) * N)
            xb, yb = x[rows], y[rows]
            (smoothed_loss(arr(xb), yb).sum() / accumulate).backward()
            for m in alone:
                (smoothed_loss(m(xb)[None], yb)[0] / accumulate).backward()
        onnxfuse.optim.clip_grad_norm_(arr, clip)
        opt.step()
        opt.zero_grad()
        for m, o, c in zip(alone, torch_opts, clip):
            if math.isfinite(c):
                torch.nn.utils.clip_grad_norm_(m.parameters(), c)
            o.step()
            o.zero_grad()
        for s in fused_scheds + torch_scheds:
            s.step()
    return arr, opt, mods, alone


def check_same(arr, alone, make):
    states = arr.state_dicts()
    for b, ref_module in enumerate(alone):
        ref = ref_module.state_dict()
        assert states[b].keys() == ref.keys()
        for key, value in ref.items():
            got = states[b][key]
            assert isinstance(got, torch.Tensor) and got.dtype == value.dtype and got.shape == value.shape, key
            if value.dtype == torch.int64:  # num_batches_tracked
                assert torch.equal(got, value), (b, key)
            else:
                assert rel_err(got, value) < (1e-5 if "running_" in key else 1e-4), (b, key, rel_err(got, value))
        loaded = make()
        loaded.load_state_dict(states[b], strict=True)


@pytest.mark.parametrize("make, kind, hyper, clip", [
    (DigitsCNN, "AdamW", {"lr": [3e-3, 1e-3, 5e-3], "weight_decay": [0.01, 0.0, 0.05],
                          "betas": [(0.9, 0.999), (0.8, 0.99), (0.9, 0.98)]}, [1.0, math.inf, 0.5]),
    (DigitsMLP, "SGD", {"lr": [0.1, 0.05, 0.02], "momentum": [0.9, 0.0, 0.5], "nesterov": [True, False, False],
                        "weight_decay": [0.0, 1e-4, 0.0]}, [math.inf, 0.5, 2.0]),
], ids=["bn-cnn-adamw", "mlp-sgd"])
def test_a_plain_torch_loop_trains_each_model_as_torch_optim_trains_it_alone(digits, make, kind, hyper, clip):
    arr, opt, mods, alone = train_both(make, kind, hyper, clip, digits)
    check_same(arr, alone, make)
    # the schedulers moved each model's own lr, as torch's moved each optimizer's
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([o.param_groups[0]["lr"] for o in
                                                                  schedulers_lrs(alone, kind, hyper)], rel=1e-12)
    # the source modules were not touched; load_into copies the trained state in
    arr.load_into(mods)
    x, _ = digits
    for m, ref in zip(mods, alone):
        m.eval(), ref.eval()
        assert rel_err(m(x[:64]).detach(), ref(x[:64]).detach()) < 1e-4


def schedulers_lrs(alone, kind, hyper):
    """torch's own optimizers after the same 6 scheduler steps (the lr each reaches)."""
    opts = [getattr(torch.optim, kind)(m.parameters(), **{k: v[b] for k, v in hyper.items()})
            for b, m in enumerate(alone)]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheds = schedulers(opts)
        for _ in range(6):
            for s in scheds:
                s.step()
    return opts


def test_fused_outputs_are_each_models_stacked_and_eval_mode_uses_running_statistics(digits):
    x, _ = digits
    torch.manual_seed(1)
    mods = [DigitsCNN() for _ in range(B)]
    arr = onnxfuse.fuse(mods, x[:2])
    out = arr(x[:16])
    assert out.shape == (B, 16, 10)
    for b, m in enumerate(mods):  # training mode: batch statistics (each module's own forward moves its stats)
        assert rel_err(out[b].detach(), m.train()(x[:16]).detach()) < 1e-5
    arr.eval()
    out = arr(x[16:48])
    for b, m in enumerate(mods):
        assert rel_err(out[b].detach(), m.eval()(x[16:48]).detach()) < 1e-5
    assert int(arr.forwards) == 1 and all(int(sd["bn1.num_batches_tracked"]) == 1 for sd in arr.state_dicts())


@pytest.mark.slow
def test_torch_compile_gives_the_outputs_of_the_array(digits):
    """A training-mode forward and backward of the compiled array equal the array's own: outputs, gradients and
    the BatchNorm statistics it updates in place."""
    x, y = digits
    torch.manual_seed(2)
    mods = [DigitsCNN() for _ in range(B)]
    arr, twin = onnxfuse.fuse(mods, x[:2]), onnxfuse.fuse(mods, x[:2])
    want, got = arr(x[:32]), torch.compile(twin)(x[:32])
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    smoothed_loss(want, y[:32]).sum().backward()
    smoothed_loss(got, y[:32]).sum().backward()
    for p, q in zip(arr.parameters(), twin.parameters()):
        assert q.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    for a, b in zip(arr.state_dicts(), twin.state_dicts()):
        for k in a:
            assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-5, atol=1e-7), k


def test_autocast_runs_the_array_as_it_runs_each_model(digits):
    x, y = digits
    torch.manual_seed(3)
    mods = [DigitsMLP() for _ in range(B)]
    arr = onnxfuse.fuse(mods, x[:2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = arr(x[:32])
        refs = [m(x[:32]) for m in mods]
    plain = arr(x[:32])
    for b in range(B):  # each model's ops in the precision autocast runs them alone: the same bf16 values
        assert out.dtype == refs[b].dtype == torch.bfloat16
        assert torch.equal(out[b], refs[b]), rel_err(out[b].float().detach(), refs[b].float().detach())
        assert rel_err(out[b].float().detach(), plain[b].detach()) > 1e-4
    smoothed_loss(out.float(), y[:32]).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in arr.parameters())


def test_per_model_inputs_and_onnx_inputs(digits, tmp_path):
    x, _ = digits
    torch.manual_seed(4)
    mods = [DigitsMLP() for _ in range(B)]
    # ONNX files and ModelProtos fuse as modules do
    paths = []
    for b, m in enumerate(mods):
        paths.append(str(tmp_path / f"m{b}.onnx"))
        export_module(m, paths[-1], example_inputs=(x[:2],))
    import onnx

    for models in (paths, [onnx.load(p) for p in paths]):
        arr = onnxfuse.fuse(models, per_model_inputs=[0])
        xs = torch.stack([x[:8], x[8:16], x[16:24]])
        out = arr(xs)
        for b, m in enumerate(mods):
            assert rel_err(out[b].detach(), m(xs[b]).detach()) < 1e-5
    with pytest.raises(DataError, match=r"input .input. has shape \[8, 1, 8, 8\], but the array takes "
                                        r"\[B=3, N, 1, 8, 8\] \(per model\); it is per model"):
        arr(x[:8])


def test_optimizer_state_dict_resumes_exactly_and_whole_optimizer_schedulers_work(digits):
    x, y = digits
    torch.manual_seed(5)
    mods = [DigitsMLP() for _ in range(B)]

    def run(arr, opt, steps):
        for t in steps:
            smoothed_loss(arr(x[t * N:(t + 1) * N]), y[t * N:(t + 1) * N]).sum().backward()
            opt.step()
            opt.zero_grad()

    straight = onnxfuse.fuse(mods, x[:2])
    opt = onnxfuse.optim.Adam(straight, lr=[1e-2, 1e-3, 3e-3], amsgrad=[True, False, True])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda t: 1.0, lambda t: 0.5 ** t, lambda t: 2.0])
    run(straight, opt, range(2))
    saved_arr = copy.deepcopy(straight.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    run(straight, opt, range(2, 4))

    resumed = onnxfuse.fuse(mods, x[:2])
    resumed.load_state_dict(saved_arr)
    opt2 = onnxfuse.optim.Adam(resumed, lr=0.5)
    opt2.load_state_dict(saved_opt)
    assert opt2.state["step"] == 2 and set(opt2.state) >= {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    run(resumed, opt2, range(2, 4))
    for a, b in zip(straight.state_dicts(), resumed.state_dicts()):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-2, 5e-4, 6e-3])


def test_a_model_whose_gradient_is_not_finite_keeps_its_state_and_the_others_step(digits):
    x, y = digits
    torch.manual_seed(6)
    arr = onnxfuse.fuse([DigitsMLP() for _ in range(B)], x[:2])
    opt = onnxfuse.optim.SGD(arr, lr=0.1)
    before = arr.state_dicts()
    out = arr(x[:N])
    losses = smoothed_loss(out, y[:N])
    (losses * torch.tensor([1.0, float("nan"), 1.0])).sum().backward()
    opt.step(per_model_loss=losses)
    assert opt.last_ok.tolist() == [True, False, True]
    after = arr.state_dicts()
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    assert not torch.equal(before[0]["fc1.weight"], after[0]["fc1.weight"])


def test_save_writes_an_array_folder_the_cli_trains_from(digits, tmp_path, capsys):
    from onnxfuse.cli.main import main
    from onnxfuse.core.split import final_states
    from onnxfuse.core.weights import ArraySpec

    x, y = digits
    torch.manual_seed(7)
    arr = onnxfuse.fuse([DigitsCNN() for _ in range(B)], x[:2])
    opt = onnxfuse.optim.SGD(arr, lr=0.05, momentum=0.9)
    smoothed_loss(arr(x[:N]), y[:N]).sum().backward()
    opt.step()
    folder = arr.save(tmp_path / "array")
    saved = final_states(folder, ArraySpec.load(os.path.join(folder, "array.json")), initial=True)
    for got, want in zip(saved, arr.state_dicts()):
        for k, v in want.items():
            assert np.array_equal(np.asarray(got[k]), v.cpu().numpy()), k
    data = tmp_path / "digits.npz"
    np.savez(data, input=x.numpy(), labels=y.numpy())
    assert main(["train", folder, "--data", str(data), "--steps", "3", "--batch-size", "16", "--quiet"]) == 0
    assert os.path.exists(os.path.join(folder, "trained"))


def test_fuse_says_in_one_line_what_is_wrong(digits):
    x, _ = digits
    with pytest.raises(NotFusibleError) as e:
        onnxfuse.fuse([DigitsMLP(), DigitsCNN()], x[:2])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="example_inputs"):
        onnxfuse.fuse([DigitsMLP(), DigitsMLP()])
    with pytest.raises(ConfigError, match=r"^fuse_models: model 0 is a DigitsMLP, not an ONNX file or ModelProto; "
                                          r"fuse torch modules with onnxfuse.fuse\(modules, example_inputs\)$"):
        onnxfuse.fuse_models([DigitsMLP(), DigitsMLP()])
    with pytest.raises(ConfigError, match="model 1 is a int; give torch modules, ONNX files"):
        onnxfuse.fuse([DigitsMLP(), 42], x[:2])
    arr = onnxfuse.fuse([DigitsMLP(), DigitsMLP()], x[:2])
    with pytest.raises(ConfigError, match=r"^SGD\(lr=...\): optimizer.lr has 3 values but the array has B=2"):
        onnxfuse.optim.SGD(arr, lr=[0.1, 0.2, 0.3])
    with pytest.raises(ConfigError, match="step the array's optimizer"):
        onnxfuse.optim.SGD(arr, lr=0.1).model(0).step()
    with pytest.raises(ConfigError, match="load_into: module 1"):
        arr.load_into([DigitsMLP(), DigitsCNN()])


def test_onnxfuse_train_runs_through_a_fused_array_and_onnxfuse_optim(digits):
    """The run loop's trainer is the user's objects: a FusedArray and its onnxfuse.optim optimizer; one trainer
    step equals the same step taken in a plain loop on a FusedArray of the same weights."""
    from onnxfuse.recipe.optim import StepValues, make_optimizer
    from onnxfuse.runtime.trainers import make_trainer
    from onnxfuse.runtime.torch.array_module import FusedArray

    x, y = digits
    torch.manual_seed(8)
    mods = [DigitsCNN() for _ in range(B)]
    user = onnxfuse.fuse(mods, x[:2])
    lrs = [1e-2, 3e-3, 1e-3]
    trainer = make_trainer("torch", user._graph, user.spec, "cross-entropy",
                           make_optimizer("adamw", B, lr=lrs, weight_decay=0.05))
    assert isinstance(trainer.array, FusedArray) and isinstance(trainer.optimizer, onnxfuse.optim.AdamW)
    trainer.step({"input": x[:N].numpy(), "labels": y[:N].numpy()}, StepValues(lrs, [0.9] * B, [True] * B))

    opt = onnxfuse.optim.AdamW(user, lr=lrs, weight_decay=0.05)
    out = user(x[:N])
    F.cross_entropy(out.flatten(0, 1), y[:N].repeat(B), reduction="none").view(B, N).mean(1).sum().backward()
    opt.step()
    for got, want in zip(trainer.array.state_dicts(), user.state_dicts()):
        for k in want:
            if k.endswith("num_batches_tracked"):
                continue  # the trainer counts optimizer steps, not forwards (split advances them by steps)
            assert rel_err(got[k], want[k]) < 1e-6, k
    # the trainer's array converts its own forward at its first call (lazy), and runs as the user's
    assert rel_err(trainer.array.eval()(x[:N]).detach(), user.eval()(x[:N]).detach()) < 1e-5


def test_the_readme_loop_runs_and_each_model_learns(tmp_path, monkeypatch):
    """README's "In your own training loop" runs as it is shown (one epoch of the digits) and every model's loss
    falls; its state_dicts load into the nets."""
    import re

    root = ROOT
    readme = open(os.path.join(root, "README.md")).read()
    section = readme[readme.index("## In your own training loop"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    x, y = next(iter(scope["loader"]))
    with torch.no_grad():
        before = [torch.nn.functional.cross_entropy(DigitsCNN()(x), y) for _ in range(3)]  # untrained nets
        after = [torch.nn.functional.cross_entropy(n(x), y) for n in scope["nets"]]
    assert all(a < 0.8 * min(before) for a in after), (before, after)


def test_the_python_api_page_loop_is_the_example_file_and_it_runs(tmp_path):
    """docs/python-api.md's "In your own training loop" shows examples/own_training_loop.py verbatim; the file runs."""
    import re
    import subprocess
    import sys

    root = ROOT
    example = open(os.path.join(root, "examples", "own_training_loop.py")).read()
    readme = open(os.path.join(root, "docs", "python-api.md")).read()
    section = readme[readme.index("## In your own training loop"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    body = block[block.index("data = load_named"):]
    assert body in example
    env = {**os.environ, "STEPS": "8"}
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "own_training_loop.py"), str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(re.findall(r"model \d: lr [\d.e-]+, held-out accuracy [\d.]+%", r.stdout)) == 3, r.stdout
    assert os.path.exists(tmp_path / "array" / "array.json")


@pytest.mark.parametrize("compile", ["off", pytest.param("on", marks=pytest.mark.slow)])  # on: make test-all
def test_train_step_is_the_whole_step_as_one_function_and_trains_each_model_as_torch_alone(digits, compile):
    """``onnxfuse.optim.train_step``: forward, the user's loss, gradients, per-model clipping and AdamW, and the
    BatchNorm statistics as one function (compiled: one captured graph), the step onnxfuse train runs; each model
    equals torch.optim alone, and nothing is read back until ``observe()``."""
    torch.manual_seed(0)
    mods = [DigitsCNN() for _ in range(B)]
    alone = [copy.deepcopy(m) for m in mods]
    x, y = digits
    arr = onnxfuse.fuse(mods, x[:2])
    lrs, clip = [3e-3, 1e-3, 5e-3], [1.0, math.inf, 0.5]
    opt = onnxfuse.optim.AdamW(arr, lr=lrs, max_norm=clip)
    step = onnxfuse.optim.train_step(arr, opt, smoothed_loss, compile=compile)
    torch_opts = [torch.optim.AdamW(m.parameters(), lr=lr) for m, lr in zip(alone, lrs)]
    for t in range(6):
        xb, yb = x[t * N:(t + 1) * N], y[t * N:(t + 1) * N]
        step(xb, yb)
        for m, o, c in zip(alone, torch_opts, clip):
            smoothed_loss(m(xb)[None], yb)[0].backward()
            if math.isfinite(c):
                torch.nn.utils.clip_grad_norm_(m.parameters(), c)
            o.step()
            o.zero_grad()
    seen = step.observe()
    assert seen.ok.all() and (seen.failed_at == 0).all() and opt.state["step"] == 6
    check_same(arr, alone, DigitsCNN)
    with pytest.raises(ConfigError, match="one loss per model"):
        onnxfuse.optim.train_step(arr, opt, lambda out, yy: out.mean(), compile="off")(x[:N], y[:N])
