"""Settings resolved once: flags, config files, ``TrainConfig`` and a resumed run's settings go through one
validation (``settings.normalize_config``), so every rule holds however a value is given and a flag's message is
the config file's; the run reads one typed plan (``RunPlan``); the device is one value (``Device``), parsed once."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest

from conftest import cli, export_all, make_modules, one_error_line
from onnxfuse import fuse_models, save_array
from onnxfuse.core.array import ArrayDir
from onnxfuse.core.errors import ConfigError
from onnxfuse.recipe import settings
from onnxfuse.recipe.config import load_config
from onnxfuse.recipe.device import Device
from onnxfuse.recipe.optim import OptimizerConfig
from onnxfuse.recipe.settings import OPTIMIZERS, RUN_SETTINGS, flat_default
from onnxfuse.recipe.train_config import RunPlan, TrainConfig

B, N = 2, 8


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("once")
    save_array(fuse_models(export_all(make_modules("mlp", B, seed0=3), (N, 3, 4, 4), d / "jobs")), d / "array")
    rng = np.random.default_rng(0)
    np.savez(d / "data.npz", input=rng.standard_normal((64, 3, 4, 4)).astype(np.float32),
             labels=rng.integers(0, 10, 64))
    return d


def file_message(tmp_path, text: str) -> str:
    """The message the config file ``text`` gets, without the file's name before it."""
    path = tmp_path / "run.yaml"
    path.write_text("steps: 2\n" + text + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    return msg[len(f"{path}: "):]


# ------------------------------------------------------------------------ flags and config files: one set of rules
DISAGREED = [  # (flags, the same settings in a config file, the flags that message names)
    (["--optimizer", "adam", "--momentum", "0.9"], "optimizer: {name: adam, momentum: 0.9}", "--momentum, --optimizer"),
    (["--optimizer", "adam", "--dampening", "0.1"], "optimizer: {name: adam, dampening: 0.1}",
     "--dampening, --optimizer"),
    (["--optimizer", "adamw", "--nesterov"], "optimizer: {name: adamw, nesterov: true}", "--nesterov, --optimizer"),
    (["--betas", "0.8,0.99"], "optimizer: {betas: [0.8, 0.99]}", "--betas"),
    (["--eps", "1e-6"], "optimizer: {eps: 1.0e-6}", "--eps"),
    (["--amsgrad"], "optimizer: {amsgrad: true}", "--amsgrad"),
    (["--eval-data", "{data}", "--eval-fraction", "0.2"], "data: {eval: e.npz, eval_fraction: 0.2}",
     "--eval-data, --eval-fraction"),
    (["--lr", "0.1,,0.2"], "optimizer: {lr: [0.1, '', 0.2]}", "--lr"),
    (["--lr", "0.1,,0.2,0.3"], "optimizer: {lr: [0.1, '', 0.2, 0.3]}", "--lr"),
    (["--lr", "0.1,abc"], "optimizer: {lr: [0.1, abc]}", "--lr"),
    (["--halving", "3,,5", "--eval-fraction", "0.2"], "halving: ['3', '', '5']\ndata: {eval_fraction: 0.2}",
     "--halving"),
    (["--gamma", "0.5"], "schedule: {gamma: 0.5}", "--gamma"),
]


@pytest.mark.parametrize("flags,text,named", DISAGREED, ids=[" ".join(f) for f, _, _ in DISAGREED])
def test_a_flag_gets_the_config_files_message(flags, text, named, work, tmp_path, capsys):
    """Each of these trained (or silently dropped a value) from flags while the config file refused it: now both
    are refused with one message, the flag's begun by the flags that gave the values."""
    flags = [f.replace("{data}", str(work / "data.npz")) for f in flags]
    code, _, err = cli(capsys, "train", work / "array", "--data", work / "data.npz", "--steps", 2, "-q", *flags)
    line = one_error_line(err)
    assert code == 2
    assert line == f"onnxfuse: error: {named}: {file_message(tmp_path, text)}", line
    assert not os.path.exists(work / "array" / "trained")


def test_flags_over_a_config_file_are_checked_with_it(work, tmp_path, capsys):
    """A flag merged over a file's value is checked with the file's: --eval-data with the file's eval_fraction,
    --optimizer adam with the file's momentum; the message names both."""
    path = tmp_path / "run.yaml"
    path.write_text("steps: 2\ndata: {eval_fraction: 0.2}\noptimizer: {name: sgd, momentum: 0.9}\n")
    code, _, err = cli(capsys, "train", work / "array", "--config", path, "--data", work / "data.npz",
                       "--eval-data", work / "data.npz", "-q")
    assert code == 2 and one_error_line(err).startswith(
        f"onnxfuse: error: --eval-data, {path}: data.eval and data.eval_fraction are both set"), err
    code, _, err = cli(capsys, "train", work / "array", "--config", path, "--data", work / "data.npz",
                       "--optimizer", "adam", "-q")
    assert code == 2 and one_error_line(err).startswith(
        f"onnxfuse: error: --optimizer, {path}: optimizer.momentum does not apply to adam"), err


def test_the_python_api_follows_the_same_rules():
    for kwargs, said in [(dict(optimizer="adam", momentum=0.9), "optimizer.momentum does not apply to adam"),
                         (dict(lr=[0.1, -1]), "optimizer.lr[1] = -1 must be finite and >= 0"),
                         (dict(device="gpu"), "device = 'gpu' must be cpu, cuda or cuda:N")]:
        with pytest.raises(ConfigError) as e:
            TrainConfig(steps=2, **kwargs)
        assert said in str(e.value) and str(e.value).startswith("TrainConfig("), str(e.value)
    with pytest.raises(ConfigError, match=r"TrainConfig\(lr=\.\.\.\): optimizer.lr has 3 values but the array "
                                          r"has B=2 models"):
        TrainConfig(steps=2, lr=[0.1, 0.2, 0.3]).plan(2)
    # every field round-trips (as_dict holds the hyper-parameters of other optimizers at their defaults)
    adam = TrainConfig(steps=2, optimizer="adam", lr=[0.1, 0.2])
    assert TrainConfig.from_dict(adam.as_dict()) == adam == dataclasses.replace(adam)
    # held-out data: the rules wait for the run to say whether it has eval data
    assert TrainConfig(steps=4, eval_fraction=0.2).plan(2, has_eval=False).eval_fraction == 0.2
    with pytest.raises(ConfigError, match="data.eval and data.eval_fraction are both set"):
        TrainConfig(steps=4, eval_fraction=0.2).plan(2, has_eval=True)
    with pytest.raises(ConfigError, match="halving needs eval data"):
        TrainConfig(steps=4, halving=[2]).plan(2, has_eval=False)


def test_batch_size_defaults_to_32_as_the_help_says(work, capsys):
    from onnxfuse.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert "(default 32)" in sub.choices["train"]._option_string_actions["--batch-size"].help
    code, _, err = cli(capsys, "train", work / "array", "--data", work / "data.npz", "--steps", 1,
                       "--verify-steps", 0, "-q")
    assert code == 0, err
    state = json.loads((work / "array" / "trained" / "train_state.json").read_text())
    assert state["config"]["batch_size"] == 32


# ------------------------------------------------------------------------ once: one validation, one parse, one plan
def test_lr_and_device_are_validated_once_from_the_flag_to_the_update_graph(work, monkeypatch, capsys):
    """A real `onnxfuse train` in this process: the lr is validated once (settings.check_value, by the config
    key), the device text parsed once (Device.parse), and the update graph's coefficients carry the lr as given."""
    checked, parsed, fed = [], [], []
    check_value, parse = settings.check_value, Device.parse.__func__

    def counting_check(p, value, key=None, *args, **kwargs):
        if key == "optimizer.lr":
            checked.append(value)
        return check_value(p, value, key, *args, **kwargs)

    def counting_parse(cls, text, where=""):
        parsed.append(text)
        return parse(cls, text, where)

    coefficients = OptimizerConfig.coefficients

    def recording(self, step, values=None):
        out = coefficients(self, step, values)
        fed.append((list(self.hyper["lr"]), out[self.rows().index("lr"), :, 0].copy()))
        return out

    monkeypatch.setattr(settings, "check_value", counting_check)
    monkeypatch.setattr(Device, "parse", classmethod(counting_parse))
    monkeypatch.setattr(OptimizerConfig, "coefficients", recording)
    code, _, err = cli(capsys, "train", work / "array", "--data", work / "data.npz", "--lr", "0.1,0.01",
                       "--device", "cpu", "--steps", 2, "--batch-size", N, "-q")
    assert code == 0, err
    assert checked == [[0.1, 0.01]]
    assert parsed == ["cpu"]
    array = [row for hyper, row in fed if len(hyper) == B]  # the array's steps (the verification's one-model
    assert len(array) >= 2 and all(hyper == [0.1, 0.01] for hyper, _ in fed if len(hyper) == B)  # reference too)
    assert all(np.array_equal(row, np.float32([0.1, 0.01])) for row in array)


def test_the_plan_is_typed_and_per_model():
    plan = TrainConfig(steps=3, optimizer="adam", lr=[0.1, 0.2], clip_grad_norm=[1.0, float("inf")],
                       device="cpu").plan(2)
    assert isinstance(plan, RunPlan) and plan.B == 2
    assert plan.hyper["lr"] == (0.1, 0.2) and plan.hyper["betas"] == ((0.9, 0.999), (0.9, 0.999))
    assert plan.clip_grad_norm == (1.0, None)  # "no clipping" is None, one form
    assert plan.device == Device("cpu") and len(plan.schedules) == 2
    assert all(len(v) == 2 for v in plan.hyper.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.batch_size = 4
    opt = plan.optimizer_config()
    assert opt.hyper["lr"] is plan.hyper["lr"]  # the plan's own values, not another form of them
    assert opt.max_norm == [1.0, float("inf")]  # the coefficient row's form of "no clipping"


def test_fields_are_declared_and_match_the_table():
    """TrainConfig's fields are the run settings of settings.RUN_SETTINGS plus the built-in optimizers'
    hyper-parameters (with their defaults), the schedule, the loss options and the later registrations; RunPlan
    has a field for every run setting. A setting added to one and not the other fails here."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    hyper = {p.name for spec in OPTIMIZERS.values() for p in spec.params}
    assert set(fields) == {s.name for s in RUN_SETTINGS} | hyper | {"schedule", "loss_options", "extra"}
    for s in RUN_SETTINGS:
        assert fields[s.name].default == s.param.default, s.name
    for name in hyper:
        assert fields[name].default == flat_default(name), name
    plan_fields = {f.name for f in dataclasses.fields(RunPlan)}
    assert {s.name for s in RUN_SETTINGS} - {"clip_grad_norm"} <= plan_fields and "clip_grad_norm" in plan_fields


# ------------------------------------------------------------------------ the device
@pytest.mark.parametrize("text", ["gpu", "cuda:x", "cuda:-1", "cpu:0", "CUDA", ""])
def test_a_malformed_device_is_one_message(text, work, capsys):
    with pytest.raises(ConfigError) as e:
        Device.parse(text)
    assert str(e.value) == f"device = {text!r} must be cpu, cuda or cuda:N"
    said = f"onnxfuse: error: --device: {e.value}"  # the same line from every command that takes --device
    code, _, err = cli(capsys, "train", work / "array", "--data", work / "data.npz", "--steps", 1, "--device",
                       text, "-q")
    assert code == 2 and one_error_line(err) == said
    code, _, err = cli(capsys, "plan", "lenet", "--device", text)
    assert code == 2 and one_error_line(err) == said
    code, _, err = cli(capsys, "fuse", work / "jobs", "-o", work / "never", "--strategy", "auto", "--device", text)
    assert code == 2 and one_error_line(err) == said and not os.path.exists(work / "never")


def test_the_device_value():
    from onnxfuse.runtime.ort_runtime import check_device

    d = Device.parse("cuda:1")
    assert (d.kind, d.index, str(d), d.device_id) == ("cuda", 1, "cuda:1", 1)
    assert d.ort_provider() == ("CUDAExecutionProvider", {"device_id": 1})
    assert str(d.torch()) == "cuda:1"
    cpu = Device.parse("cpu")
    assert cpu.available() is None and cpu.ort_provider() == ("CPUExecutionProvider", {})
    assert check_device("cpu") == cpu and Device.of(cpu) is cpu
    import torch

    if not torch.cuda.is_available():
        assert "sees no CUDA device" in Device.parse("cuda").available()
    else:
        assert "torch sees" in Device("cuda", torch.cuda.device_count()).available()


# ------------------------------------------------------------------------ resume
def test_resume_flags_follow_the_rules_and_old_records_resume(work, tmp_path, capsys):
    arr = tmp_path / "array"
    save_array(fuse_models(export_all(make_modules("mlp", B, seed0=3), (N, 3, 4, 4), tmp_path / "jobs")), arr)
    data = work / "data.npz"
    code, _, err = cli(capsys, "train", arr, "--data", data, "--optimizer", "adam", "--lr", "0.01,0.02",
                       "--clip-grad-norm", "inf,1.0", "--steps", 4, "--batch-size", N, "--checkpoint-every", 2, "-q")
    assert code == 0, err
    code, _, err = cli(capsys, "train", arr, "--resume", "--steps", 6, "--momentum", "0.9", "-q")
    assert code == 2 and one_error_line(err).startswith(
        "onnxfuse: error: --momentum, the resumed run's settings: optimizer.momentum does not apply to adam"), err

    # a record as onnxfuse wrote it before: "inf" as a string, and a hyper-parameter adam does not take (the CLI
    # recorded --momentum with adam then); its settings hash is the one of those settings
    from onnxfuse.training.checkpoints import _trajectory

    ckpt = ArrayDir(arr).checkpoints()[-1]
    record = ArrayDir(arr).checkpoint_record(ckpt, "")
    record["config"].update(clip_grad_norm=["inf", 1.0], momentum=0.9, weight_decay=None)
    old = {k: v for k, v in record["config"].items() if not k.startswith("_")}
    old = {k: (float(v) if v == "inf" else [float(x) if x == "inf" else x for x in v] if isinstance(v, list) else v)
           for k, v in old.items()}
    record["run"]["settings_hash"] = hashlib.sha256(json.dumps(_trajectory(old), sort_keys=True).encode()
                                                    ).hexdigest()[:16]
    ArrayDir.write_checkpoint_record(ckpt, record)
    code, out, err = cli(capsys, "train", arr, "--resume", "--steps", 6, "-q")
    assert code == 0, err
    assert "for 6 steps" in out
    config = TrainConfig.resumed(old)
    assert config.plan(B).clip_grad_norm == (None, 1.0) and config.as_dict()["momentum"] == 0.9
