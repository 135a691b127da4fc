"""Run configuration files: the example loads, defaults are filled, per-model values and grids expand to B, and
every bad setting is one ConfigError line naming the key, the value and what is allowed."""
from __future__ import annotations

import os
import sys
import textwrap

import pytest

from onnxfuse.core.errors import ConfigError
from onnxfuse.recipe.config import expand_per_model, load_config, normalize_config, total_steps

from tests.conftest import ROOT

EXAMPLE = os.path.join(ROOT, "docs", "run.example.yaml")


def write(tmp_path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def load(tmp_path, text: str) -> dict:
    return load_config(write(tmp_path, text))


def error_of(fn, *args) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_example_file_loads_and_expands():
    cfg = load_config(EXAMPLE)
    assert cfg["optimizer"]["name"] == "adamw" and cfg["steps"] == 300 and cfg["epochs"] is None
    assert cfg["schedule"]["name"] == "cosine" and "t_max" not in cfg["schedule"]  # derived
    assert cfg["data"]["train"] == "sklearn:digits" and cfg["halving"] == [100, 200]
    e = expand_per_model(cfg, cfg["model"]["count"])
    assert e["optimizer"]["lr"] == [0.01, 0.01, 0.001, 0.001]
    assert e["optimizer"]["weight_decay"] == [0.0, 1e-4, 0.0, 1e-4]
    assert e["clip_grad_norm"] == [1.0] * 4 and len(e["schedule"]) == 4 and e["grid"] == {}


def test_defaults_and_normalization(tmp_path):
    cfg = load(tmp_path, """
        steps: 10
        loss: mse
        optimizer: {lr: 1e-3}
        data: {train: sub/train.npz}
    """)
    assert cfg["optimizer"] == {"name": "sgd", "lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "nesterov": False,
                                "weight_decay": 0.0}  # YAML reads 1e-3 as a string; it is a number here
    assert cfg["loss"] == {"name": "mse", "label_smoothing": 0.0, "ignore_index": -100, "class_axis": 1}
    assert cfg["schedule"] == {"name": "constant"} and cfg["grid"] == {} and cfg["model"] is None
    assert cfg["data"]["train"] == os.path.join(str(tmp_path), "sub", "train.npz")  # relative to the file
    assert cfg["data"]["order"] == "shared" and cfg["data"]["eval_fraction"] == 0.0
    assert (cfg["batch_size"], cfg["eval_every"], cfg["on_diverge"], cfg["clip_grad_norm"]) == (32, 0, "freeze", None)
    assert load(tmp_path, "steps: 1\noptimizer: adamw\n")["optimizer"]["weight_decay"] == 0.01  # torch's default


def test_per_model_lists_and_schedules_expand(tmp_path):
    cfg = load(tmp_path, """
        epochs: 2
        optimizer: {name: adam, lr: [0.1, 0.2, 0.3], betas: [[0.9, 0.99], [0.8, 0.99], [0.5, 0.9]], amsgrad: true}
        schedule: [{name: step, step_size: 5}, cosine, {name: onecycle, pct_start: 0.25}]
        clip_grad_norm: [1.0, null, 2.0]
    """)
    e = expand_per_model(cfg, 3)
    assert e["optimizer"]["lr"] == [0.1, 0.2, 0.3] and e["optimizer"]["betas"][1] == [0.8, 0.99]
    assert e["optimizer"]["amsgrad"] == [True] * 3 and e["optimizer"]["eps"] == [1e-8] * 3
    assert [s["name"] for s in e["schedule"]] == ["step", "cosine", "onecycle"]
    assert e["schedule"][0]["gamma"] == 0.1 and e["schedule"][2]["max_lr"] == 0.3  # onecycle: the model's lr
    assert e["clip_grad_norm"] == [1.0, None, 2.0]
    assert total_steps(cfg, 100) == 2 * (100 // 32)
    assert expand_per_model(e, 3)["optimizer"]["lr"] == [0.1, 0.2, 0.3]  # expanding twice changes nothing


def test_grid_is_the_cartesian_product_in_key_order(tmp_path):
    cfg = load(tmp_path, """
        steps: 5
        optimizer: {name: sgd, momentum: 0.9}
        schedule: {name: linear}
        grid:
          optimizer.lr: [0.1, 0.01, 0.001]
          schedule.end_factor: [0.0, 0.5]
    """)
    e = expand_per_model(cfg, 6)
    assert e["optimizer"]["lr"] == [0.1, 0.1, 0.01, 0.01, 0.001, 0.001]
    assert [s["end_factor"] for s in e["schedule"]] == [0.0, 0.5] * 3
    assert e["models"][3] == {"optimizer.lr": 0.01, "schedule.end_factor": 0.5}
    assert e["optimizer"]["momentum"] == [0.9] * 6


def test_toml_config(tmp_path):
    if sys.version_info < (3, 11):
        assert "need Python >= 3.11" in error_of(load_config, write(tmp_path, "steps = 3\n", "run.toml"))
        return
    cfg = load_config(write(tmp_path, """
        steps = 3
        [optimizer]
        name = "adamw"
        lr = [0.1, 0.2]
    """, "run.toml"))
    assert cfg["optimizer"]["lr"] == [0.1, 0.2]
    assert "malformed TOML" in error_of(load_config, write(tmp_path, "steps = \n", "bad.toml"))


BAD = [  # (config text, words the message must contain)
    ("steps: 1\nlearning_rate: 0.1", ["unknown key 'learning_rate'", "valid keys: model, data"]),
    ("steps: 1\noptimizer: {name: sgd, momentun: 0.9}", ["unknown key 'optimizer.momentun'", "momentum"]),
    ("steps: 1\noptimizer: rmsprop", ["optimizer.name = 'rmsprop'", "sgd, adam, adamw"]),
    ("steps: 1\nschedule: {name: warmup}", ["schedule.name = 'warmup'", "constant, step, multistep"]),
    ("steps: 1\nschedule: {name: cosine, gamma: 0.5}", ["schedule.gamma does not apply to the cosine", "eta_min"]),
    ("steps: 1\nschedule: {name: step}", ["schedule.step_size is missing"]),
    ("steps: 1\nschedule: {name: multistep, milestones: [5, 3]}", ["schedule.milestones = [5, 3]", "increasing"]),
    ("steps: 1\nschedule: {name: onecycle, anneal_strategy: cubic}", ["anneal_strategy = 'cubic'", "cos, linear"]),
    ("steps: 1\nloss: hinge", ["loss.name = 'hinge'", "cross-entropy, nll, mse"]),
    ("steps: 1\nloss: {name: mse, label_smoothing: 0.1}", ["loss.label_smoothing applies to cross-entropy only"]),
    ("steps: 1\ndata: {order: random}", ["data.order = 'random'", "shared, per-model, shards"]),
    ("steps: 1\non_diverge: ignore", ["on_diverge = 'ignore'", "freeze, stop"]),
    ("steps: 1\noptimizer: {lr: -0.1}", ["optimizer.lr = -0.1", "finite and >= 0"]),
    ("steps: 1\noptimizer: {lr: [0.1, .nan]}", ["optimizer.lr[1] = nan", "finite"]),
    ("steps: 1\noptimizer: {lr: .inf}", ["optimizer.lr = inf", "finite"]),
    ("steps: 1\noptimizer: {lr: fast}", ["optimizer.lr = 'fast' is not a number"]),
    ("steps: 1\noptimizer: {weight_decay: -1.0e-4}", ["optimizer.weight_decay = -0.0001", ">= 0"]),
    ("steps: 1\noptimizer: {name: adamw, eps: 0}", ["optimizer.eps = 0", "> 0"]),
    ("steps: 1\noptimizer: {momentum: 1.0}", ["optimizer.momentum = 1.0", "[0, 1)"]),
    ("steps: 1\noptimizer: {momentum: [0.9, -0.1]}", ["optimizer.momentum[1] = -0.1", "[0, 1)"]),
    ("steps: 1\noptimizer: {name: adam, betas: [0.9, 1.0]}", ["optimizer.betas = [0.9, 1.0]", "[0, 1)"]),
    ("steps: 1\noptimizer: {name: adam, betas: [[0.9, 0.99], [1.5, 0.9]]}", ["optimizer.betas[1]", "[0, 1)"]),
    ("steps: 1\noptimizer: {name: adamw, momentum: 0.9}", ["optimizer.momentum does not apply to adamw"]),
    ("steps: 10.5", ["steps = 10.5 must be a positive integer"]),
    ("steps: 0", ["steps = 0 must be a positive integer"]),
    ("epochs: -2", ["epochs = -2 must be a positive integer"]),
    ("steps: 1\nbatch_size: 0", ["batch_size = 0 must be a positive integer"]),
    ("steps: 1\nbatch_size: '64'", ["batch_size = '64' must be a positive integer"]),
    ("steps: 10\nepochs: 2", ["exactly one of steps and epochs (both are set)"]),
    ("batch_size: 8", ["exactly one of steps and epochs (neither is set)"]),
    ("steps: 500\ndata: {eval_fraction: 0.1}\nhalving: [300, 200]", ["halving = [300, 200]", "increasing"]),
    ("steps: 500\ndata: {eval_fraction: 0.1}\nhalving: [200, 600]",
     ["halving step 600 is not before the last of the run's 500"]),
    ("steps: 500\ndata: {eval_fraction: 0.1}\nhalving: [500]", ["halving step 500 is not before", "< 500"]),
    ("steps: 500\nhalving: [200]", ["halving needs eval data", "data.eval_fraction"]),
    ("steps: 1\nhalving_keep: 1.0", ["halving_keep = 1.0", "(0, 1)"]),
    ("steps: 1\noptimizer: {lr: [0.1, 0.2]}\ngrid: {optimizer.lr: [0.1, 0.01]}",
     ["optimizer.lr is set both in grid and as optimizer.lr"]),
    ("steps: 1\noptimizer: {lr: 0.1}\ngrid: {optimizer.lr: [0.1, 0.01]}", ["optimizer.lr is set both in grid"]),
    ("steps: 1\ngrid: {optimizer.betas: [[0.9, 0.99]]}", ["grid key 'optimizer.betas' is not a per-model setting",
                                                          "optimizer.lr"]),
    ("steps: 1\ngrid: {optimizer.lr: 0.1}", ["grid.optimizer.lr = 0.1 must be a non-empty list"]),
    ("steps: 1\ngrid: {optimizer.lr: [0.1, -1]}", ["grid.optimizer.lr[1] = -1", ">= 0"]),
    ("steps: 1\nclip_grad_norm: 0", ["clip_grad_norm = 0", "> 0"]),
    ("steps: 1\ndevice: tpu", ["device = 'tpu'", "cpu, cuda or cuda:N"]),
    ("steps: 1\ndata: {train: data.csv}", ["data.train = 'data.csv'", "sklearn:digits"]),
    ("steps: 1\ndata: {train: 'sklearn:mnist'}", ["data.train = 'sklearn:mnist' is not a bundled", "sklearn:iris"]),
    ("steps: 1\ndata: {eval: e.npz, eval_fraction: 0.2}", ["data.eval and data.eval_fraction are both set"]),
    ("steps: 1\nmodel: {factory: LeNet, count: 2, input_shape: [1, 4]}", ["model.factory = 'LeNet'", "MODULE:FACTORY"]),
    ("steps: 1\nmodel: {factory: 'm.py:f', count: 2, seeds: [1], input_shape: [4]}", ["model.seeds = [1]",
                                                                                    "model.count = 2"]),
    ("steps: 1\nsteps: 2", ["line 2", "key 'steps' is given twice"]),
    ("- steps: 1", ["must be a mapping"]),
]


@pytest.mark.parametrize("text,words", BAD, ids=[f"{i}-{w[0][:30]}" for i, (_, w) in enumerate(BAD)])
def test_bad_config_is_one_line(tmp_path, text, words):
    msg = error_of(load_config, write(tmp_path, text + "\n"))
    assert msg.startswith(str(tmp_path)), msg  # names the file
    for w in words:
        assert w in msg, msg


def test_malformed_yaml_names_the_line(tmp_path):
    msg = error_of(load_config, write(tmp_path, "steps: 10\noptimizer:\n  name: sgd\n   lr: [0.1\n"))
    assert "malformed YAML at line 4" in msg, msg


def test_missing_and_wrongly_named_files(tmp_path):
    assert "config file" in error_of(load_config, tmp_path / "gone.yaml")
    assert "does not exist" in error_of(load_config, tmp_path / "gone.yaml")
    assert "must end in .yaml, .yml or .toml" in error_of(load_config, write(tmp_path, "steps: 1", "run.json"))


@pytest.mark.parametrize("text,B,words", [
    ("optimizer: {lr: [0.1, 0.2, 0.3]}", 4, ["optimizer.lr has 3 values but the array has B=4 models"]),
    ("clip_grad_norm: [1.0, 2.0]", 3, ["clip_grad_norm has 2 values but the array has B=3"]),
    ("optimizer: {name: adamw, betas: [[0.9, 0.99], [0.9, 0.9]]}", 3, ["optimizer.betas has 2 values"]),
    ("schedule: [cosine, constant]", 3, ["schedule has 2 entries but the array has B=3"]),
    ("grid: {optimizer.lr: [0.1, 0.01], optimizer.momentum: [0.0, 0.9]}", 3,
     ["the grid has 4 combinations (2 x 2) but the array has B=3"]),
    ("model: {factory: 'onnxfuse.exporters.zoo:MLP', count: 2, input_shape: [4, 64]}", 3,
     ["model.count = 2 but the array has B=3"]),
    ("optimizer: {nesterov: [true, false], momentum: [0.0, 0.9]}", 2, ["model 0: optimizer.nesterov needs momentum"]),
])
def test_expand_per_model_errors(tmp_path, text, B, words):
    cfg = load(tmp_path, "steps: 5\n" + text + "\n")
    msg = error_of(expand_per_model, cfg, B)
    for w in words:
        assert w in msg, msg


def test_total_steps_checks_halving_against_epochs():
    cfg = normalize_config({"epochs": 2, "batch_size": 10, "halving": [5, 30], "data": {"eval_fraction": 0.1}})
    assert total_steps(cfg, 200) == 40
    assert "halving step 30 is not before the last of the run's 20 steps" in error_of(total_steps, cfg, 100)
    assert "fewer than one batch" in error_of(total_steps, cfg, 5)
