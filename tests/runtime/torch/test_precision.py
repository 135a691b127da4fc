"""Mixed precision (``--precision bf16|fp16``): each model of a reduced-precision array against that model trained
alone by plain torch, under ``torch.autocast`` (+ one ``torch.amp.GradScaler`` per model for fp16) with
torch.optim, on the same batches.

The models are a BatchNorm CNN (this file's, as in test_users_loop) and the zoo's Transformer LM (LayerNorm,
attention, GELU, embeddings); the data is scikit-learn's digits and random tokens.

The bound. A reduced-precision step rounds every product to 8 (bf16) or 11 (fp16) bits; the fused array sums in
other orders (a grouped convolution against a plain one, a batched matmul against a single one), so its roundings
fall elsewhere, and the difference to the model alone is of the order of that rounding. The model's own
reduced-vs-fp32 difference over the same steps is the scale of it: at step 1, from identical weights, the fused
gradient must be within ``STEP1`` of it (measured: ~0.05-0.35); after several steps, where the optimizer amplifies
any rounding (Adam's first steps are ~lr*sign(g)), within ``DRIFT`` (measured: up to ~0.9). An array that ran an
op in another precision than the model alone (fp32 where torch.autocast runs bf16) is off by the whole
reduced-vs-fp32 difference at step 1 (ratio ~1). fp16's loss scales and skipped steps are compared exactly."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import onnxfuse
from onnxfuse.core.errors import ConfigError
from onnxfuse.exporters.zoo import TransformerLM
from fuzz.harness import DRIFT_RATIO, STEP1_RATIO
from tests.runtime.torch.test_users_loop import DigitsCNN, DigitsMLP  # the same BatchNorm CNN and LayerNorm MLP

B, N = 3, 32
STEP1, DRIFT = STEP1_RATIO, DRIFT_RATIO  # the fuzzer's bounds (0.5, sqrt(2)): one definition
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def class_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per model of stacked outputs [M, N, C] (or [M, N, T, V]) -> [M]."""
    M = out.shape[0]
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1).repeat(M),
                           reduction="none").reshape(M, -1).mean(1)


def digits_batches() -> list:
    """scikit-learn's digits in batches of N: (images [N, 1, 8, 8], labels [N])."""
    d = load_digits()
    x = torch.from_numpy((d.data / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8)
    return [(x[t * N:(t + 1) * N], torch.from_numpy(d.target[t * N:(t + 1) * N].astype(np.int64)))
            for t in range(len(x) // N)]


def token_batches() -> list:
    """20 batches of random token sequences: (tokens [16, 16], the next tokens [16, 16])."""
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 64, (20, 16, 17), generator=g)
    return [(s[:, :-1], s[:, 1:]) for s in seq]


BATCHES = {"digits": digits_batches, "tokens": token_batches}


@pytest.fixture(scope="module")
def digits():
    return digits_batches()


@pytest.fixture(scope="module")
def tokens():
    return token_batches()


def measured_ratios(case: str, precision: str, batches=None) -> tuple[list[float], list[float], list, dict]:
    """Each model's ratio at step 1 (SGD at lr 1: the gradient) and after 6 steps of the case's optimizer (each
    model's own hyper-parameters), with the 6-step run's models alone and its trace (see ``train``)."""
    batches = batches if batches is not None else BATCHES[CASES[case][3]]()
    one = (CASES[case][0], "SGD", {"lr": [1.0] * B}, None)
    arr, reduced, full, trace = train(case, batches, precision, 6)
    return ratios(*train(one, batches, precision, 1)[:3]), ratios(arr, reduced, full), reduced, trace


def mlp_digits(digits):
    return [(x.reshape(N, 64), y) for x, y in digits]


CASES = {  # name: (model, optimizer, per-model hyper-parameters, data fixture)
    "bn-cnn-adamw": (DigitsCNN, "AdamW", {"lr": [3e-3, 1e-3, 5e-3], "weight_decay": [0.01, 0.0, 0.05]}, "digits"),
    "transformer-sgd": (lambda: TransformerLM(dropout=0.0), "SGD",
                        {"lr": [0.05, 0.02, 0.1], "momentum": [0.9, 0.0, 0.5]}, "tokens"),
}


def _flat(module_or_state) -> torch.Tensor:
    state = module_or_state if isinstance(module_or_state, dict) else module_or_state.state_dict()
    return torch.cat([v.detach().float().reshape(-1) for k, v in sorted(state.items()) if v.is_floating_point()])


class Alone:
    """One model trained by plain torch: torch.autocast (+ its own GradScaler for fp16) and torch.optim, or fp32."""

    def __init__(self, module, kind, hyper, precision, init_scale=2.0 ** 16, growth_interval=2000):
        self.m, self.precision = module, precision
        self.opt = getattr(torch.optim, kind)(module.parameters(), **hyper)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval) \
            if precision == "fp16" else None
        self.scales, self.skipped = [], []

    def step(self, x, y):
        if self.precision == "fp32":
            class_loss(self.m(x)[None], y)[0].backward()
            self.opt.step()
        else:
            with torch.autocast("cpu", dtype=DTYPES[self.precision]):
                loss = class_loss(self.m(x)[None], y)[0]
            if self.scaler is None:
                loss.backward()
                self.opt.step()
            else:
                before = self.scaler.get_scale()
                self.scaler.scale(loss).backward()
                self.scaler.step(self.opt)
                self.scaler.update()
                self.scales.append(self.scaler.get_scale())
                self.skipped.append(self.scaler.get_scale() < before)  # a backoff is a skipped step
        self.opt.zero_grad()


def train(case, batches, precision, steps, compile="off", loss_scale=None, scales=None, interval=2000,
          modify=None):
    """The array (train_step, ``precision``) and each model alone (torch, same precision) and alone in fp32, from
    the same initial weights on the same batches. ``scales``: each model's initial loss scale (fp16)."""
    make, kind, hyper, _ = CASES[case] if isinstance(case, str) else case
    torch.manual_seed(0)
    mods = [make() for _ in range(B)]
    if modify is not None:
        modify(mods)
    reduced = [Alone(copy.deepcopy(m), kind, {k: v[b] for k, v in hyper.items()}, precision,
                     *(() if scales is None else (scales[b],)), growth_interval=interval) for b, m in enumerate(mods)]
    full = [Alone(copy.deepcopy(m), kind, {k: v[b] for k, v in hyper.items()}, "fp32") for b, m in enumerate(mods)]
    arr = onnxfuse.fuse(mods, batches[0][0][:2])
    opt = getattr(onnxfuse.optim, kind)(arr, **hyper)
    from onnxfuse.recipe.runtimes import LossScale

    scaling = LossScale(tuple(scales or [LossScale.INIT] * B), interval=interval) if precision == "fp16" else None
    step = onnxfuse.optim.train_step(arr, opt, class_loss, compile=compile, precision=precision, loss_scale=scaling)
    trace = {"scales": [], "skipped": [], "failed_at": None}
    for t in range(steps):
        x, y = batches[t]
        step(x, y)
        seen = step.observe()
        if precision == "fp16":
            trace["scales"].append(seen.scale.tolist())
            trace["skipped"].append((~seen.ok).tolist())
        for a in reduced + full:
            a.step(x, y)
    trace["failed_at"] = step.observe().failed_at.tolist()
    return arr, reduced, full, trace


def ratios(arr, reduced, full):
    """Per model: ||fused - alone|| / ||alone - alone in fp32||, over every weight and buffer."""
    states = arr.state_dicts()
    out = []
    for b in range(B):
        fused, alone, fp32 = _flat(states[b]), _flat(reduced[b].m), _flat(full[b].m)
        out.append(float((fused - alone).norm() / (alone - fp32).norm()))
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_model_trains_as_torch_autocast_trains_it_alone(case, precision, digits, tokens):
    batches = {"digits": digits, "tokens": tokens}[CASES[case][3]]
    step1, drift, reduced, trace = measured_ratios(case, precision, batches)
    assert max(step1) < STEP1, step1
    assert max(drift) < DRIFT, drift
    if precision == "fp16":  # every model's loss scale and skipped steps are its GradScaler's
        assert [list(s) for s in zip(*trace["scales"])] == [a.scales for a in reduced]
        assert [list(s) for s in zip(*trace["skipped"])] == [a.skipped for a in reduced]
    assert trace["failed_at"] == [0] * B


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_compiled_step_trains_as_torch_autocast_too(precision, digits):
    arr, reduced, full, trace = train("bn-cnn-adamw", digits, precision, 4, compile="on")
    assert max(ratios(arr, reduced, full)) < DRIFT
    if precision == "fp16":
        assert [list(s) for s in zip(*trace["scales"])] == [a.scales for a in reduced]


@pytest.mark.parametrize("compile", ["off", pytest.param("on", marks=pytest.mark.slow)])  # on: make test-all
def test_an_overflowing_model_skips_and_backs_off_alone(compile, digits):
    """Model 1 starts at a loss scale of 2**24: its scaled gradients overflow fp16 until GradScaler's backoff
    brings the scale down, then it trains and its scale grows every 3 steps. Its scales and skipped steps are
    GradScaler's on that model alone; models 0 and 2 are bit-identical to the same array without the overflow."""
    scales = [2.0 ** 16, 2.0 ** 24, 2.0 ** 16]
    arr, reduced, _, trace = train("bn-cnn-adamw", digits, "fp16", 14, compile, scales=scales, interval=3)
    calm, _, _, calm_trace = train("bn-cnn-adamw", digits, "fp16", 14, compile, scales=[2.0 ** 16] * 3, interval=3)
    own = [list(s) for s in zip(*trace["skipped"])]
    assert own[1] == reduced[1].skipped and sum(own[1]) >= 5, own  # it overflowed, then recovered
    assert [s[1] for s in trace["scales"]] == reduced[1].scales
    states, calm_states = arr.state_dicts(), calm.state_dicts()
    for b in (0, 2):
        assert [s[b] for s in trace["scales"]] == [s[b] for s in calm_trace["scales"]]
        for k, v in calm_states[b].items():
            assert torch.equal(states[b][k], v), (b, k)
    assert any(not torch.equal(states[1][k], v) for k, v in calm_states[1].items())
    assert trace["failed_at"] == [0, 0, 0]


def test_a_model_that_overflows_at_the_minimum_scale_is_diverged_and_the_others_train(digits):
    """Model 1's first layer is so large that its fp16 forward overflows at every step: it skips each step (its
    weights stay the initial ones) and backs off until its scale is 1, where the next overflow is a divergence."""
    def blow_up(mods):
        with torch.no_grad():
            mods[1].fc1.weight.mul_(1e5)
    case = (DigitsMLP, "AdamW", {"lr": [1e-3] * B}, None)
    arr, reduced, _, trace = train(case, mlp_digits(digits), "fp16", 5, scales=[4.0] * B, modify=blow_up)
    assert trace["failed_at"] == [0, 3, 0]  # overflow at 4 (-> 2), at 2 (-> 1), at 1: diverged at step 3
    assert [s[1] for s in trace["skipped"]] == [True] * 5
    assert reduced[1].skipped == [True] * 5  # GradScaler alone skips the same steps
    torch.manual_seed(0)
    first = [DigitsMLP() for _ in range(B)][1]
    with torch.no_grad():
        first.fc1.weight.mul_(1e5)
    for k, v in first.state_dict().items():
        assert torch.equal(arr.state_dicts()[1][k], v), k
    assert not any(trace["skipped"][-1][b] for b in (0, 2))


def test_precision_is_checked_in_one_line(digits):
    torch.manual_seed(0)
    arr = onnxfuse.fuse([DigitsCNN() for _ in range(B)], digits[0][0][:2])
    opt = onnxfuse.optim.SGD(arr, lr=0.1)
    with pytest.raises(ConfigError, match="precision.*one of fp32, bf16, fp16"):
        onnxfuse.optim.train_step(arr, opt, class_loss, precision="fp8")
    with pytest.raises(ConfigError, match="2 initial scales for an array of B=3"):
        onnxfuse.optim.train_step(arr, opt, class_loss, precision="fp16", loss_scale=[1.0, 2.0])


@pytest.mark.slow
def test_a_killed_fp16_run_resumes_to_the_uninterrupted_runs_weights_and_scales(tmp_path):
    """``onnxfuse train --precision fp16`` SIGKILLed twice at random moments and resumed: the final weights are
    bit-identical to an uninterrupted run's, and so is every model's loss scale in metrics.csv (the scales grow
    every 25 steps and back off at overflows: both happen in this run)."""
    from tests.training.test_run import assert_same_trained_weights, data_file, metrics
    from tests.runtime.torch.test_compiled_step import _killed_and_resumed

    data = data_file(tmp_path, n=128)
    args = ["--data", str(data), "--steps", "600", "--batch-size", "16", "--optimizer", "adamw", "--lr",
            "0.01,0.003,0.001", "--precision", "fp16", "--loss-scale", "1e6", "--loss-scale-interval", "25",
            "--checkpoint-every", "20", "--runtime", "torch", "--compile", "off", "-q"]
    arr_ref, arr, kills = _killed_and_resumed(tmp_path, args)
    assert kills == 2
    assert_same_trained_weights(arr_ref, arr)

    def scales(folder):
        return [(r["step"], r["model"], r["loss_scale"], r["status"]) for r in metrics(folder) if r["split"] == "train"]
    assert scales(arr) == scales(arr_ref)
    seen = scales(arr_ref)
    assert any(s == "skipped" for *_, s in seen) and len({v for _, _, v, _ in seen}) > 3


def test_onnxfuse_train_takes_precision_and_the_ort_runtime_refuses_it_in_one_line(tmp_path, capsys):
    """--precision bf16 and fp16 through the CLI (fp16 with successive halving: the survivors keep their scales),
    the config key, and the ort runtime's one-line refusal."""
    from tests.conftest import cli, one_error_line
    from tests.training.test_run import data_file, make_array, metrics

    data = data_file(tmp_path, n=128)
    common = ["--data", str(data), "--steps", "20", "--batch-size", "16", "--lr", "0.01,0.003,0.001", "-q"]
    arr, _ = make_array(tmp_path / "bf16", 3)
    code, out, err = cli(capsys, "train", str(arr), *common, "--precision", "bf16")
    assert code == 0, err
    assert all(r["loss_scale"] == "" for r in metrics(arr))
    arr, _ = make_array(tmp_path / "fp16", 3)
    code, out, err = cli(capsys, "train", str(arr), *common, "--precision", "fp16", "--loss-scale", "1e9",
                         "--halving", "10", "--eval-fraction", "0.25")
    assert code == 0, err
    rows = [r for r in metrics(arr) if r["split"] == "train"]
    assert len({r["model"] for r in rows if r["step"] == "20"}) == 2  # halving kept 2 of 3
    assert all(float(r["loss_scale"]) > 0 for r in rows if r["status"] != "dropped"), rows
    assert any(r["status"] == "skipped" for r in rows)
    arr, _ = make_array(tmp_path / "ort", 3)
    code, _, err = cli(capsys, "train", str(arr), *common, "--precision", "fp16", "--runtime", "ort")
    assert code != 0
    assert one_error_line(err) == ("onnxfuse: error: --precision fp16: the ort runtime trains in fp32 only; use "
                                   "--runtime torch, or --precision fp32")


def zoo_batches(name: str) -> tuple:
    """Two batches of 8 random inputs and labels for zoo model ``name``, and its factory with Dropout off."""
    from onnxfuse.exporters.zoo import ZOO

    e, g = ZOO[name], torch.Generator().manual_seed(0)
    shape = (8,) + tuple(e.input_shape[1:])
    labels = shape if e.task == "lm" else (8,)
    x = [torch.randint(0, e.input_high, shape, generator=g) if e.input_dtype == "int64"
         else torch.randn(shape, generator=g) for _ in range(2)]

    def make():
        m = e.factory()
        for mod in m.modules():
            if isinstance(mod, nn.Dropout):
                mod.p = 0.0
        return m
    return [(xb, torch.randint(0, e.num_classes, labels, generator=g)) for xb in x], make


@pytest.mark.parametrize("name", ["lenet", "mobilenetv2", "pointnet_cls", "vit_tiny", "bert_tiny", "transformer_lm"])
def test_zoo_models_in_bf16_take_the_step_torch_autocast_takes_alone(name):
    """Step 1 of every model of a bf16 array of the zoo model against torch.autocast alone (measured: 0.000 for
    each). fp16 on this CPU: 0.000 for the convolutional models, 0.03-0.97 for ViT and BERT, whose attention
    products run through CPU fp16 kernels that sum differently for the fused and the single shapes."""
    batches, make = zoo_batches(name)
    ratio = ratios(*train((make, "SGD", {"lr": [1.0] * B}, None), batches, "bf16", 1)[:3])
    assert max(ratio) < STEP1, ratio


@pytest.mark.parametrize("case", list(CASES))
def test_a_users_own_loop_under_torch_autocast_trains_as_each_model_alone(case, digits, tokens):
    """The array in a user's own loop (``arr(x)`` under ``torch.autocast(bf16)``, a torch loss, ``backward``,
    ``onnxfuse.optim``): each model as torch.autocast trains it alone. The array's module runs each fused Linear
    as nn.Linear runs under autocast (one product with its bias); without that, step 1 is ~1."""
    make, kind, hyper, data = CASES[case]
    batches = {"digits": digits, "tokens": tokens}[data]
    for one_step in (True, False):
        kind_, hyper_, steps = ("SGD", {"lr": [1.0] * B}, 1) if one_step else (kind, hyper, 6)
        torch.manual_seed(0)
        mods = [make() for _ in range(B)]
        reduced = [Alone(copy.deepcopy(m), kind_, {k: v[b] for k, v in hyper_.items()}, "bf16")
                   for b, m in enumerate(mods)]
        full = [Alone(copy.deepcopy(m), kind_, {k: v[b] for k, v in hyper_.items()}, "fp32")
                for b, m in enumerate(mods)]
        arr = onnxfuse.fuse(mods, batches[0][0][:2])
        opt = getattr(onnxfuse.optim, kind_)(arr, **hyper_)
        for x, y in batches[:steps]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = class_loss(arr(x), y).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            for a in reduced + full:
                a.step(x, y)
        assert max(ratios(arr, reduced, full)) < (STEP1 if one_step else DRIFT), (one_step, ratios(arr, reduced, full))
