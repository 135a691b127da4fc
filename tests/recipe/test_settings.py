"""The settings schema (onnxfuse/recipe/settings.py): the optimizer and schedule registries are what the CLI, config files,
TrainConfig and placement accept; a new optimizer or schedule is one registration; a command line and the
equivalent config file give the same run."""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import textwrap

import numpy as np
import pytest
import torch
import yaml

from tests.conftest import ROOT, export_all, make_modules, rel_err
from onnxfuse import fuse_models, save_array
from onnxfuse.cli.main import build_parser, main
from onnxfuse.core.errors import ConfigError
from onnxfuse.cli.place import _optimizer_choices, _state_slots
from onnxfuse.core.split import final_states
from onnxfuse.training.run import TrainConfig
from onnxfuse.cli.train_flags import flags_to_raw
from onnxfuse.recipe.config import load_config, normalize_config
from onnxfuse.recipe.optim import LR, STATE_PREFIX, WEIGHT_DECAY, Optimizer, make_optimizer
from onnxfuse.recipe.schedules import PerModelSchedules, check_schedules
from onnxfuse.recipe.settings import (OPTIMIZERS, REQUIRED, RUN_SETTINGS, SCHEDULES, Param, integer, raw_to_flat, real,
                                      register_optimizer, register_schedule)
from onnxfuse.recipe.train_config import run_config
from onnxfuse.core.weights import ArraySpec

EXAMPLE = os.path.join(ROOT, "docs", "run.example.yaml")
SAMPLE = {"step_size": 2, "milestones": [2, 4], "gamma": 0.5}  # a value for each required schedule parameter


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def choices(command: str, flag: str) -> list:
    return list(subparser(command)._option_string_actions[flag].choices)


def required(schedule: str) -> dict:
    return {p.name: SAMPLE[p.name] for p in SCHEDULES[schedule].params if p.default is REQUIRED}


def config_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


# ------------------------------------------------------------------------------------- (a) one list everywhere
@pytest.mark.parametrize("command", ["train", "check"])
def test_cli_choices_are_the_registries(command):
    assert choices(command, "--optimizer") == list(OPTIMIZERS) == ["sgd", "adam", "adamw"]
    assert choices(command, "--schedule") == list(SCHEDULES) == ["constant", "step", "multistep", "exponential",
                                                                  "cosine", "linear", "onecycle"]
    flags = subparser(command)._option_string_actions
    for spec in list(OPTIMIZERS.values()) + list(SCHEDULES.values()):
        for p in spec.params:  # every hyper-parameter has its flag (a switch says the non-default)
            assert (p.flag if p.default is not True else "--no-" + p.flag[2:]) in flags, (spec.name, p.name)
    for s in RUN_SETTINGS:
        assert s.cli in flags or "--no-" + s.cli[2:] in flags, s.name


def test_config_schema_accepts_exactly_the_registries():
    for name, spec in OPTIMIZERS.items():
        cfg = normalize_config({"steps": 1, "optimizer": name})
        assert cfg["optimizer"] == {"name": name, **{p.name: p.default if not isinstance(p.default, tuple)
                                                      else list(p.default) for p in spec.params}}
        assert all(p.name in {f.name for f in dataclasses.fields(TrainConfig)} for p in spec.params)
    for name in SCHEDULES:
        assert normalize_config({"steps": 1, "schedule": {"name": name, **required(name)}})["schedule"]["name"] == name
    msg = config_error(normalize_config, {"steps": 1, "optimizer": "rmsprop"}, source="")
    assert msg.endswith("must be one of: " + ", ".join(OPTIMIZERS))
    msg = config_error(normalize_config, {"steps": 1, "schedule": "warmup"}, source="")
    assert msg.endswith("must be one of: " + ", ".join(SCHEDULES))


def test_placement_offers_every_registered_optimizer():
    assert set(OPTIMIZERS) <= set(_optimizer_choices())
    for name in OPTIMIZERS:
        args = build_parser().parse_args(["place", "m.onnx", "-o", "out", "--training", "--optimizer", name])
        assert args.optimizer == name


# ------------------------------------------------------------------------------------- (b) one registration
class EmaSGD(Optimizer):
    """The toy optimizer: SGD on an exponential moving average of the gradient.
    g = g + wd*p;  m = m + (1-rho)*(g - m);  p = p - lr*m      (one state buffer, m, zero at first)"""

    rows = ("wd", "one_minus_rho", "lr")

    def state_names(self, config):
        return ["ema"]

    def coefficients(self, step, v):
        return [v["weight_decay"], 1.0 - v["rho"], v["lr"]]

    def emit(self, gb, P, G, row, config):
        if config.uses("weight_decay"):
            G = gb.one("Add", [G, gb.one("Mul", [P, row["wd"]])])
        M = STATE_PREFIX + "ema"
        Mn = gb.one("Add", [M, gb.one("Mul", [gb.one("Sub", [G, M]), row["one_minus_rho"]])])
        return gb.one("Sub", [P, gb.one("Mul", [Mn, row["lr"]])]), [(M, Mn)]

    def received_gradient(self, rows, before, after):
        """g = m_{t-1} + (m_t - m_{t-1}) / (1 - rho)"""
        return before["ema"] + (after["ema"] - before["ema"]) / rows["one_minus_rho"], 0.0


@pytest.fixture
def toy_registrations():
    """A schedule and an optimizer with a hyper-parameter of its own, registered and removed again."""
    @register_schedule("halve_once", (Param("at", integer(ge=1), REQUIRED, "the step at which to halve"),
                                      Param("factor", real(gt=0.0, le=1.0), 0.5, "the lr factor from then on")),
                       "MultiStepLR with one milestone")
    def halve_once(lrs, opt, s, steps):
        return lrs.MultiStepLR(opt, milestones=[s["at"]], gamma=s["factor"])

    register_optimizer(EmaSGD("toy", (LR, WEIGHT_DECAY, Param("rho", real(ge=0.0, lt=1.0), 0.9, "toy decay",
                                                                per_model=True)), "a toy"))
    yield
    del SCHEDULES["halve_once"], OPTIMIZERS["toy"]


def test_a_registered_schedule_and_optimizer_need_no_other_edit(toy_registrations):
    assert "halve_once" in choices("train", "--schedule") and "toy" in choices("train", "--optimizer")
    args = build_parser().parse_args(["train", "arr", "--optimizer", "toy", "--rho", "0.5,0.6", "--schedule",
                                      "halve_once", "--at", "3", "--steps", "6", "--batch-size", "4"])
    raw, named = flags_to_raw(args)
    assert raw["schedule"] == {"name": "halve_once", "at": 3} and raw["optimizer"]["rho"] == [0.5, 0.6]
    assert named["optimizer.rho"] == "--rho"
    config = TrainConfig.from_dict(raw_to_flat(raw))
    assert config.rho == [0.5, 0.6] and config.as_dict()["rho"] == [0.5, 0.6]
    assert config.for_array(2).hyper["rho"] == (0.5, 0.6)
    assert "'halve_once' needs 'at'" in config_error(TrainConfig, steps=1, schedule="halve_once")
    assert "TrainConfig(rho=...): optimizer.rho = 1.5 must be finite and in [0, 1)" in config_error(
        TrainConfig, steps=1, optimizer="toy", rho=1.5)

    cfg = normalize_config({"steps": 6, "optimizer": {"name": "toy", "rho": 0.7},
                            "schedule": {"name": "halve_once", "at": 3}, "grid": {"schedule.factor": [0.5, 0.1]}})
    assert cfg["optimizer"] == {"name": "toy", "lr": 1e-3, "weight_decay": 0.0, "rho": 0.7}
    assert cfg["schedule"] == {"name": "halve_once", "at": 3, "factor": 0.5}
    assert "schedule.at is missing" in config_error(normalize_config, {"steps": 1, "schedule": "halve_once"})
    assert "optimizer.rho = 2 must be finite and in [0, 1)" in config_error(
        normalize_config, {"steps": 1, "optimizer": {"name": "toy", "rho": 2}})
    assert build_parser().parse_args(["place", "m.onnx", "-o", "o", "--optimizer", "toy"]).optimizer == "toy"

    # and the schedule's maths is the registered function: lr 0.1 until step 3, then 0.1 * factor
    specs = check_schedules([{"name": "halve_once", "at": 3}, {"name": "halve_once", "at": 2, "factor": 0.1}], 2, 6)
    sched = PerModelSchedules(specs, make_optimizer("sgd", 2, lr=0.1), 6)
    lrs = []
    for _ in range(5):
        lrs.append(sched.values([True, True]).lr)
        sched.advance()
    assert [lr[0] for lr in lrs] == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05])
    assert [lr[1] for lr in lrs] == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.01])


SHAPE = (8, 3, 4, 4)  # the MLP of conftest: 48 inputs


def toy_alone(mod, lr, rho, wd, batches):
    """The toy's maths on one model alone, in torch: g = grad + wd*p; m += (1-rho)*(g - m); p -= lr*m."""
    ema = {n: torch.zeros_like(p) for n, p in mod.named_parameters()}
    for x, y in batches:
        mod.zero_grad()
        torch.nn.functional.cross_entropy(mod.train()(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        with torch.no_grad():
            for n, p in mod.named_parameters():
                g = p.grad + wd * p
                ema[n] += (1 - rho) * (g - ema[n])
                p -= lr * ema[n]
    return {k: v.detach().numpy() for k, v in mod.state_dict().items()}


@pytest.mark.parametrize("recovers_gradient", [True, False])
def test_a_registered_optimizer_trains_as_its_maths_says(toy_registrations, recovers_gradient, tmp_path):
    """The registration is all `onnxfuse train --optimizer toy` needs: its first step is verified against each
    model alone (through the gradient the toy says it received, or, when it says nothing, its new parameters),
    the run trains, and the weights are what the toy's maths gives for each model alone (in torch)."""
    if not recovers_gradient:
        class Plain(EmaSGD):
            received_gradient = Optimizer.received_gradient
        OPTIMIZERS["toy"] = Plain("toy", OPTIMIZERS["toy"].params, "a toy")
    assert _state_slots("toy") == 1  # placement plans its one buffer
    mods = make_modules("mlp", 2, seed0=40)
    save_array(fuse_models(export_all(mods, SHAPE, tmp_path / "jobs")), tmp_path / "array")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((48,) + SHAPE[1:]).astype(np.float32)
    y = rng.integers(0, 10, 48)
    np.savez(tmp_path / "data.npz", input=x, labels=y)
    lr, rho, wd = (0.1, 0.05), (0.5, 0.8), (0.0, 0.01)
    assert main(["train", str(tmp_path / "array"), "--data", str(tmp_path / "data.npz"), "--optimizer", "toy",
                 "--lr", "0.1,0.05", "--rho", "0.5,0.8", "--weight-decay", "0,0.01", "--steps", "5",
                 "--batch-size", "16", "--no-shuffle", "--verify-steps", "2", "--quiet"]) == 0
    trained = final_states(str(tmp_path / "array"), ArraySpec.load(str(tmp_path / "array" / "array.json")))
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 48, 16)] * 2
    for b, mod in enumerate(make_modules("mlp", 2, seed0=40)):
        start = {k: v.clone() for k, v in mod.state_dict().items()}
        ref = toy_alone(mod, lr[b], rho[b], wd[b], batches[:5])
        for k, v in ref.items():
            assert rel_err(trained[b][k], v) < 1e-4, (b, k)
            assert rel_err(trained[b][k], start[k].numpy()) > 1e-3, (b, k)  # it did train


def test_the_toy_registrations_are_gone_again():
    assert "halve_once" not in SCHEDULES and "toy" not in OPTIMIZERS
    assert "halve_once" not in choices("train", "--schedule")


# ------------------------------------------------------------------------------------- (c) round trips
def test_every_key_in_the_example_is_a_key_of_the_schema():
    raw = yaml.safe_load(open(EXAMPLE))
    cfg = load_config(EXAMPLE)
    for key, value in raw.items():
        assert key in cfg
        if isinstance(value, dict) and key not in ("grid",):
            assert set(value) <= set(cfg[key]), key
    # the commented-out keys (other values, defaults) load too, each under its section
    section, tried = None, 0
    for line in open(EXAMPLE):
        top = re.match(r"^(\w+):", line)
        section = top.group(1) if top else section
        hidden = re.match(r"^\s+# (\w+): (\[[^\]]*\]|[^\s#]+)\s+#", line)  # "# key: value  # comment"
        if hidden and section in ("data", "optimizer", "loss"):
            key, value = hidden.groups()
            changed = {**raw, section: {**raw[section], key: yaml.safe_load(value)}}
            if key in ("momentum", "dampening", "nesterov"):
                changed[section]["name"] = "sgd"
                for k in ("betas", "eps", "amsgrad"):
                    changed[section].pop(k, None)
            if key in raw.get("grid", {}) or f"{section}.{key}" in raw.get("grid", {}):
                changed["grid"] = {k: v for k, v in raw["grid"].items() if k != f"{section}.{key}"}
            if key == "eval":
                changed[section] = {k: v for k, v in changed[section].items() if k != "eval_fraction"}
                changed.pop("halving")
            normalize_config(changed, base_dir=os.path.dirname(EXAMPLE))
            tried += 1
    assert tried >= 6


@pytest.fixture(scope="module")
def array_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("settings")
    save_array(fuse_models(export_all(make_modules("mlp", 2, seed0=1), (8, 3, 4, 4), d / "jobs")), d / "array")
    return d / "array"


def test_a_command_line_and_its_config_file_are_the_same_run(array_dir, tmp_path):
    flags = ["--optimizer", "adam", "--lr", "0.1,0.2", "--betas", "0.8,0.99", "--eps", "1e-6", "--amsgrad",
             "--weight-decay", "0.01", "--clip-grad-norm", "1.0,inf", "--schedule", "cosine", "--warmup-steps", "2",
             "--steps", "7", "--batch-size", "16", "--seed", "3", "--no-shuffle", "--data-order", "per-model",
             "--eval-fraction", "0.2", "--eval-every", "2", "--halving", "3", "--halving-keep", "0.5",
             "--loss", "cross-entropy", "--label-smoothing", "0.1", "--checkpoint-every", "2", "--keep-checkpoints",
             "3", "--on-diverge", "stop", "--log-every", "2", "--verify-steps", "0", "--allow-nonfinite-data",
             "--data", "d.npz"]
    from_flags, _, _, _ = run_config(array_dir, *flags_to_raw(build_parser().parse_args(["train", "a", *flags])))
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent("""
        optimizer: {name: adam, lr: [0.1, 0.2], betas: [0.8, 0.99], eps: 1.0e-6, amsgrad: true, weight_decay: 0.01}
        clip_grad_norm: [1.0, null]
        schedule: {name: cosine, warmup_steps: 2}
        steps: 7
        batch_size: 16
        data: {train: d.npz, seed: 3, shuffle: false, order: per-model, eval_fraction: 0.2}
        eval_every: 2
        halving: [3]
        halving_keep: 0.5
        loss: {name: cross-entropy, label_smoothing: 0.1}
        checkpoint_every: 2
        keep_checkpoints: 3
        on_diverge: stop
        log_every: 2
        verify_steps: 0
        allow_nonfinite_data: true
    """))
    from_file, _, _, _ = run_config(array_dir, config_file=path)
    assert from_flags.as_dict() == from_file.as_dict()
    assert from_flags.for_array(2) == from_file.for_array(2)
    # and the same settings given to the Python API
    without_record = lambda settings: dataclasses.replace(settings, record={})  # noqa: E731
    assert without_record(TrainConfig(**from_file.as_dict()).for_array(2, has_eval=False)) == \
        without_record(from_file.for_array(2, has_eval=False))
