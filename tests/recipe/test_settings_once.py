"""Settings declared once and resolved once: every view of a setting (``TrainConfig``'s and ``RunSettings``' fields,
the flags, the config file's keys, the record a run writes, a sweep's array) is made from the one declaration
(``settings.RUN_SETTINGS`` and the registries); flags, config files, ``TrainConfig``, a resumed run's settings and a
sweep's arrays go through one validation (``config.normalize_config``), so every rule holds however a value is
given and a flag's message is the config file's; the run reads one frozen object made once (``RunSettings``:
the runtime chosen once, nothing checked again below); the device is one value (``Device``), parsed once."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest

from tests.conftest import cli, export_all, make_modules, mlp_array, one_error_line
from onnxfuse import fuse_models, save_array
from onnxfuse.core.array import ArrayDir
from onnxfuse.core.errors import ConfigError
from onnxfuse.recipe import config, settings
from onnxfuse.recipe.config import load_config
from onnxfuse.recipe.device import Device
from onnxfuse.recipe.optim import OptimizerConfig
from onnxfuse.recipe.settings import OPTIMIZERS, RUN_SETTINGS, flat_default
from onnxfuse.recipe.train_config import RunSettings, TrainConfig

B, N = 2, 8


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return mlp_array(tmp_path_factory.mktemp("once"), B, seed0=3)


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
        TrainConfig(steps=2, lr=[0.1, 0.2, 0.3]).for_array(2)
    # every field round-trips (as_dict holds the hyper-parameters of other optimizers at their defaults)
    adam = TrainConfig(steps=2, optimizer="adam", lr=[0.1, 0.2])
    assert TrainConfig.from_dict(adam.as_dict()) == adam == dataclasses.replace(adam)
    # held-out data: the rules wait for the run to say whether it has eval data
    assert TrainConfig(steps=4, eval_fraction=0.2).for_array(2, has_eval=False).eval_fraction == 0.2
    with pytest.raises(ConfigError, match="data.eval and data.eval_fraction are both set"):
        TrainConfig(steps=4, eval_fraction=0.2).for_array(2, has_eval=True)
    with pytest.raises(ConfigError, match="halving needs eval data"):
        TrainConfig(steps=4, halving=[2]).for_array(2, has_eval=False)


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
    """A real `onnxfuse train` in this process: the lr is validated once (check_value, by the config
    key), the device text parsed once (Device.parse) and asked once whether torch runs there (Device.available),
    the runtime chosen once with what it is asked to do (precision, compile: ``check_runtime_takes``) and no layer
    below checks a precision or a compile mode again (the Python API's checks are never called); the update
    graph's coefficients carry the lr as given, and the trainers are handed the run's settings themselves as
    their update rule (no other shape of them between the run and the update graph)."""
    from onnxfuse.runtime import trainers
    from onnxfuse.runtime.torch import array_step
    from onnxfuse.training import run, run_state

    rules = []
    for module in (run, run_state):
        build = module.build_trainer
        monkeypatch.setattr(module, "build_trainer", lambda runtime, fused, spec, loss, optimizer, *a, build=build,
                            **k: rules.append(optimizer) or build(runtime, fused, spec, loss, optimizer, *a, **k))

    checked, parsed, fed, asked, chosen, again = [], [], [], [], [], []
    check_value, parse, available = settings.check_value, Device.parse.__func__, Device.available
    takes = trainers.check_runtime_takes
    monkeypatch.setattr(Device, "available", lambda self: asked.append(str(self)) or available(self))
    monkeypatch.setattr(trainers, "check_runtime_takes", lambda *a, **k: chosen.append(a) or takes(*a, **k))
    for module in (trainers, array_step):
        for name in ("check_precision", "check_compile"):
            monkeypatch.setattr(module, name, lambda *a, name=name, **k: again.append(name))

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
    monkeypatch.setattr(config, "check_value", counting_check)  # the config file's schema checks by the table
    monkeypatch.setattr(Device, "parse", classmethod(counting_parse))
    monkeypatch.setattr(OptimizerConfig, "coefficients", recording)
    code, _, err = cli(capsys, "train", work / "array", "--data", work / "data.npz", "--lr", "0.1,0.01",
                       "--device", "cpu", "--steps", 2, "--batch-size", N, "-q")
    assert code == 0, err
    assert checked == [[0.1, 0.01]]
    assert parsed == ["cpu"]
    assert asked == ["cpu"] and len(chosen) == 1 and again == []
    array = [row for hyper, row in fed if len(hyper) == B]  # the array's steps (the verification's one-model
    assert len(array) >= 2 and all(hyper == [0.1, 0.01] for hyper, _ in fed if len(hyper) == B)  # reference too)
    assert all(np.array_equal(row, np.float32([0.1, 0.01])) for row in array)
    assert rules and all(isinstance(rule, RunSettings) for rule in rules), rules


def test_the_run_settings_are_made_once_typed_and_per_model():
    config = TrainConfig(steps=3, optimizer="adam", lr=[0.1, 0.2], clip_grad_norm=[1.0, float("inf")],
                         device="cpu", eval_fraction=0.25)
    run = config.for_array(2, has_eval=False, runtime="torch", batch_size=16)
    assert isinstance(run, RunSettings) and run.B == 2
    assert run.hyper["lr"] == (0.1, 0.2) and run.hyper["betas"] == ((0.9, 0.999), (0.9, 0.999))
    assert run.clip_grad_norm == (1.0, None)  # "no clipping" is None, one form
    assert run.device == Device("cpu") and len(run.schedules) == 2
    assert all(len(v) == 2 for v in run.hyper.values())
    # made where the run is: the runtime chosen (auto resolved), the metric best states are kept by (eval data
    # held out: eval_loss), a DataLoader's batch size, the record saying so
    assert (run.runtime, run.keep_best, run.batch_size, run.record["batch_size"]) == ("torch", "eval_loss", 16, 16)
    assert config.runtime == "auto" and config.keep_best is None and config.batch_size == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.batch_size = 4
    # the update graph reads the run's settings themselves: no other form of them on the way
    from onnxfuse.recipe.optim import UpdateRule
    assert isinstance(run, UpdateRule) and (run.kind, run.B) == ("adam", 2)
    assert run.max_norm == [1.0, float("inf")]  # the coefficient row's form of "no clipping"
    rows = run.coefficients(1)
    assert rows.shape == (len(run.rows()), 2, 1) and rows[run.rows().index("max_norm"), :, 0].tolist() == [1.0, float("inf")]


def test_every_view_of_a_setting_is_made_from_the_one_declaration(tmp_path):
    """TrainConfig's fields (with their defaults) and RunSettings' are the run settings of settings.RUN_SETTINGS
    (and the registered optimizers' hyper-parameters); the flags of train and check, the keys of a config file,
    the record a run writes (run.json, checkpoints, a sweep's plan) and a sweep's array are made from the same
    declaration. Nothing else lists a setting, so a setting added to the declaration is in every view."""
    import argparse

    from onnxfuse.cli.main import build_parser
    from onnxfuse.recipe.config import file_keys
    from onnxfuse.recipe.settings import LOSS_PARAMS, SCHEDULES, flag_params
    from onnxfuse.sweep import parse_spec
    from onnxfuse.sweep.planning import array_settings

    run = {s.name for s in RUN_SETTINGS}
    hyper = {p.name for spec in OPTIMIZERS.values() for p in spec.params}
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert set(fields) == run | hyper | {"schedule", "loss_options", "extra"}
    for s in RUN_SETTINGS:
        assert fields[s.name].default == s.param.default, s.name
    for name in hyper:
        assert fields[name].default == flat_default(name), name
    assert {f.name for f in dataclasses.fields(RunSettings)} == run | {"B", "loss_options", "hyper", "schedules",
                                                                       "models", "record"}
    # the flags: one per setting with a flag (run settings, hyper-parameters, loss options, schedule parameters)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("train", "check"):
        flags = set(sub.choices[command]._option_string_actions)
        made = {("--no-" + f[2:]) if p.kind.parse is None and p.default is True else f for p, f, _ in flag_params()}
        assert made | {"--schedule"} <= flags
        assert flags - made - {"--schedule"} <= {"-h", "--help", "-q", "--quiet", "-v", "--verbose", "--config",
                                                  "--data", "--eval-data", "--resume"}, command
    named = {flag: what for _, flag, what in flag_params()}
    assert {s.name for s in RUN_SETTINGS if s.cli} | hyper | {f"loss_options.{p.name}" for p in LOSS_PARAMS} <= \
        set(named.values())
    for p in (p for spec in SCHEDULES.values() for p in spec.params):  # one flag, shared with a same-named setting
        assert named[p.flag] in (f"schedule.{p.name}", p.name), p.flag
    # a config file's keys: each run setting's path
    for s in RUN_SETTINGS:
        section, _, leaf = s.path.rpartition(".")
        assert (leaf or s.path) in file_keys(section), s.path
    # the record a run writes, and a sweep's array: the TrainConfig's fields, by name
    record = TrainConfig(steps=1).as_dict()
    assert set(record) == set(fields) - {"extra"}
    spec = parse_spec({"model": {"factory": "onnxfuse.exporters.zoo:MLP", "input_shape": [4, 64]},
                       "search": {"space": {"optimizer.lr": [0.1, 0.01]}}, "data": {"train": "sklearn:digits"},
                       "steps": 2})
    trials = [{"id": f"t{i}", "array_values": {}, "per_model": {"optimizer.lr": lr}} for i, lr in enumerate((0.1, 0.01))]
    shipped, data, _ = array_settings(spec, trials, None)
    assert isinstance(shipped, TrainConfig) and shipped.lr == [0.1, 0.01] and data == "sklearn:digits"
    assert set(shipped.as_dict()) == set(record) and TrainConfig.from_dict(shipped.as_dict()) == shipped


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
    from onnxfuse.runtime.ort.trainer import check_device

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
    assert config.for_array(B).clip_grad_norm == (None, 1.0) and config.as_dict()["momentum"] == 0.9
