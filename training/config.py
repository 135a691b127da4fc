"""Run configuration files: every training setting of `onnxfuse train` in one YAML (or TOML) file.

``load_config(path)`` reads the file and returns a normalized dict: every section and key present (defaults
filled in), numbers as int/float, names checked. Per-model settings stay as written (a scalar for every model,
or a list with one value per model, or a ``grid``); ``expand_per_model(cfg, B)`` turns them into lists of B once
the number of models is known, and ``total_steps(cfg, n)`` resolves ``epochs`` once the data size is known.
Every problem is one :class:`ConfigError` line naming the key path, the bad value and what is allowed.
``docs/run.example.yaml`` documents every key.

Normalized form (what the trainer reads)::

    model       None, or {factory, count, seeds, input_shape, per_model_inputs}
    data        {train, eval, eval_fraction, shuffle, seed, order, per_model_labels}
    loss        {name, label_smoothing, ignore_index, class_axis}
    optimizer   {name, lr, weight_decay, + momentum/dampening/nesterov (sgd) or betas/eps/amsgrad (adam, adamw)}
    grid        {"optimizer.lr": [...], ...}   (empty when not used)
    schedule    {name, + its parameters}  or a list of such dicts, one per model
    clip_grad_norm, steps, epochs (one of them None), batch_size, eval_every, eval_batch_size,
    checkpoint_every, keep_checkpoints, on_diverge, halving, halving_keep, log_every, device, verify_steps,
    allow_nonfinite_data
"""
from __future__ import annotations

import itertools
import math
import os
import re
from typing import Any, Callable

from onnxfuse.errors import ConfigError

from .datasets import NAMED_DATASETS, is_named
from .losses import LOSSES, get_loss

__all__ = ["load_config", "normalize_config", "expand_per_model", "total_steps", "OPTIMIZER_NAMES",
           "SCHEDULES", "ORDERS", "ON_DIVERGE", "TOP_KEYS", "PER_MODEL_KEYS"]

OPTIMIZER_NAMES = ("sgd", "adam", "adamw")
ORDERS = ("shared", "per-model", "shards")
ON_DIVERGE = ("freeze", "stop")
ANNEAL = ("cos", "linear")
_REQUIRED = object()  # a schedule parameter without a default

TOP_KEYS = ("model", "data", "loss", "optimizer", "grid", "schedule", "clip_grad_norm", "steps", "epochs",
            "batch_size", "eval_every", "eval_batch_size", "checkpoint_every", "keep_checkpoints", "on_diverge",
            "halving", "halving_keep", "log_every", "device", "verify_steps", "allow_nonfinite_data")
MODEL_KEYS = ("factory", "count", "seeds", "input_shape", "per_model_inputs")
DATA_KEYS = ("train", "eval", "eval_fraction", "shuffle", "seed", "order", "per_model_labels")
LOSS_KEYS = ("name", "label_smoothing", "ignore_index", "class_axis")
# which optimizer keys each optimizer takes; defaults are torch.optim's
OPTIMIZER_KEYS = {
    "sgd": ("lr", "momentum", "dampening", "nesterov", "weight_decay"),
    "adam": ("lr", "weight_decay", "betas", "eps", "amsgrad"),
    "adamw": ("lr", "weight_decay", "betas", "eps", "amsgrad"),
}
OPTIMIZER_DEFAULTS = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "betas": [0.9, 0.999],
                      "eps": 1e-8, "amsgrad": False}
WEIGHT_DECAY_DEFAULT = {"sgd": 0.0, "adam": 0.0, "adamw": 1e-2}
# schedule name -> {parameter: default} (torch.optim.lr_scheduler's); a None default is left out of the normalized
# schedule when not given: t_max / total are then derived from the total steps, and max_lr is the model's lr
SCHEDULES = {
    "constant": {},
    "step": {"step_size": _REQUIRED, "gamma": 0.1},
    "multistep": {"milestones": _REQUIRED, "gamma": 0.1},
    "exponential": {"gamma": _REQUIRED},
    "cosine": {"warmup_steps": 0, "warmup_start_factor": 1e-3, "eta_min": 0.0, "t_max": None},
    "linear": {"warmup_steps": 0, "warmup_start_factor": 1e-3, "end_factor": 0.0, "total": None},
    "onecycle": {"max_lr": None, "pct_start": 0.3, "div_factor": 25.0, "final_div_factor": 1e4,
                 "anneal_strategy": "cos", "three_phase": False, "cycle_momentum": True, "base_momentum": 0.85,
                 "max_momentum": 0.95},
}
# settings that may differ per model (a list of B, or a grid axis)
PER_MODEL_KEYS = tuple(f"optimizer.{k}" for k in ("lr", "momentum", "dampening", "nesterov", "weight_decay",
                                                  "betas", "eps", "amsgrad")) + ("clip_grad_norm",)
TOP_DEFAULTS = {"clip_grad_norm": None, "steps": None, "epochs": None, "batch_size": 32, "eval_every": 0,
                "eval_batch_size": 256, "checkpoint_every": 0, "keep_checkpoints": 2, "on_diverge": "freeze",
                "halving": [], "halving_keep": 0.5, "log_every": 1, "device": "cpu", "verify_steps": 1,
                "allow_nonfinite_data": False}


# ---------------------------------------------------------------- value checks (each raises one ConfigError line)
def _fail(where: str, msg: str) -> ConfigError:
    return ConfigError(" ".join(f"{where}{msg}".split()))


def _show(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def _float(where: str, key: str, v: Any) -> float:
    """A real number; numeric strings are accepted because YAML 1.1 reads ``1e-3`` (no dot) as a string."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise _fail(where, f"{key} = {_show(v)} is not a number")
    try:
        return float(v)
    except ValueError:
        raise _fail(where, f"{key} = {_show(v)} is not a number") from None


def _ranged(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Callable[[str, str, Any], float]:
    """A checker for a finite number in [lo, hi] (bounds open as asked; math.inf for no upper bound)."""
    left, right = "(" if lo_open else "[", ")" if hi_open or hi == math.inf else "]"
    allowed = f"in {left}{lo:g}, {hi:g}{right}" if hi != math.inf else (f"> {lo:g}" if lo_open else f">= {lo:g}")

    def check(where: str, key: str, v: Any) -> float:
        x = _float(where, key, v)
        ok = math.isfinite(x) and (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi)
        if not ok:
            raise _fail(where, f"{key} = {_show(v)} must be finite and {allowed}")
        return x

    return check


def _int(where: str, key: str, v: Any, minimum: int | None = 1) -> int:
    """An integer (not a bool, not 2.0) of at least ``minimum`` (None: any integer)."""
    if isinstance(v, bool) or not isinstance(v, int) or (minimum is not None and v < minimum):
        what = {None: "an integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise _fail(where, f"{key} = {_show(v)} must be {what}")
    return v


def _pos_int(where: str, key: str, v: Any) -> int:
    return _int(where, key, v, 1)


def _nonneg_int(where: str, key: str, v: Any) -> int:
    return _int(where, key, v, 0)


def _bool(where: str, key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _fail(where, f"{key} = {_show(v)} must be true or false")
    return v


def _choice(where: str, key: str, v: Any, allowed: tuple) -> str:
    if v not in allowed:
        raise _fail(where, f"{key} = {_show(v)} is not allowed; choose one of: {', '.join(allowed)}")
    return v


def _optional(check: Callable) -> Callable:
    return lambda where, key, v: None if v is None else check(where, key, v)


def _section(where: str, key: str, v: Any, allowed: tuple) -> dict:
    """A mapping whose keys are all in ``allowed``."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _fail(where, f"{key} must be a mapping of settings (key: value), got {_show(v)}")
    for k in v:
        if k not in allowed:
            raise _fail(where, f"unknown key '{key}.{k}'; valid keys under {key}: {', '.join(allowed)}")
    return v


def _betas(where: str, key: str, v: Any) -> list[float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise _fail(where, f"{key} = {_show(v)} must be a pair [beta1, beta2]")
    out = [_float(where, key, x) for x in v]
    if not all(math.isfinite(x) and 0.0 <= x < 1.0 for x in out):
        raise _fail(where, f"{key} = {_show(v)}: each beta must be in [0, 1)")
    return out


def _clip(where: str, key: str, v: Any) -> float | None:
    return None if v is None else _ranged(0.0, math.inf, lo_open=True)(where, key, v)


# per-model optimizer settings: key -> checker of one model's value
_OPTIMIZER_CHECKS = {
    "lr": _ranged(0.0, math.inf),
    "momentum": _ranged(0.0, 1.0, hi_open=True),
    "dampening": _ranged(0.0, 1.0),
    "nesterov": _bool,
    "weight_decay": _ranged(0.0, math.inf),
    "betas": _betas,
    "eps": _ranged(0.0, math.inf, lo_open=True),
    "amsgrad": _bool,
}


def _is_per_model_list(key: str, v: Any) -> bool:
    """A list that gives one value per model (for betas: a list of pairs, since one pair is a plain value)."""
    if not isinstance(v, (list, tuple)):
        return False
    if key.endswith("betas"):
        return len(v) > 0 and all(isinstance(x, (list, tuple)) for x in v)
    return True


def _per_model_value(where: str, key: str, v: Any, check: Callable) -> Any:
    """One value for every model, or a non-empty list with one value per model (each checked)."""
    if _is_per_model_list(key, v):
        if len(v) == 0:
            raise _fail(where, f"{key} is an empty list; give one value, or one per model")
        return [check(where, f"{key}[{i}]", x) for i, x in enumerate(v)]
    return check(where, key, v)


# ---------------------------------------------------------------- sections
def _resolve(path: Any, base_dir: str | None) -> Any:
    """A relative file path in the config is relative to the config file's folder."""
    if base_dir is None or not isinstance(path, str) or is_named(path) or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base_dir, path))


def _model(where: str, raw: Any, base_dir: str | None) -> dict | None:
    if raw is None:
        return None
    m = _section(where, "model", raw, MODEL_KEYS)
    for key in ("factory", "count", "input_shape"):
        if key not in m:
            raise _fail(where, f"model.{key} is missing; the model section needs factory, count and input_shape "
                               "(or remove the section when the array is fused already)")
    factory = m["factory"]
    if not isinstance(factory, str) or ":" not in factory:
        raise _fail(where, f"model.factory = {_show(factory)} must be MODULE:FACTORY, e.g. "
                           "onnxfuse.exporters.zoo:LeNet or my_models.py:make")
    module, _, attr = factory.rpartition(":")
    if module.endswith(".py"):
        factory = f"{_resolve(module, base_dir)}:{attr}"
    count = _pos_int(where, "model.count", m["count"])
    seeds = m.get("seeds") if m.get("seeds") is not None else list(range(count))
    if not isinstance(seeds, list) or len(seeds) != count:
        raise _fail(where, f"model.seeds = {_show(seeds)} must be a list of model.count = {count} integers")
    seeds = [_nonneg_int(where, f"model.seeds[{i}]", s) for i, s in enumerate(seeds)]
    shape = m["input_shape"]
    if not isinstance(shape, list) or not shape:
        raise _fail(where, f"model.input_shape = {_show(shape)} must be a list of positive integers like "
                           "[32, 1, 28, 28]")
    shape = [_pos_int(where, f"model.input_shape[{i}]", d) for i, d in enumerate(shape)]
    pmi = m.get("per_model_inputs") or []
    if not isinstance(pmi, list) or not all(isinstance(n, str) and n for n in pmi):
        raise _fail(where, f"model.per_model_inputs = {_show(pmi)} must be a list of graph input names")
    return {"factory": factory, "count": count, "seeds": seeds, "input_shape": shape, "per_model_inputs": pmi}


def _data_source(where: str, key: str, v: Any, base_dir: str | None) -> str | None:
    if v is None:
        return None
    if isinstance(v, str) and is_named(v):
        if v not in NAMED_DATASETS:
            raise _fail(where, f"{key} = {_show(v)} is not a bundled data set; choose one of: "
                               f"{', '.join(NAMED_DATASETS)}")
        return v
    if not isinstance(v, str) or not v.endswith(".npz"):
        raise _fail(where, f"{key} = {_show(v)} must be a .npz file or one of: {', '.join(NAMED_DATASETS)}")
    return _resolve(v, base_dir)


def _data(where: str, raw: Any, base_dir: str | None) -> dict:
    d = _section(where, "data", raw, DATA_KEYS)
    out = {
        "train": _data_source(where, "data.train", d.get("train"), base_dir),
        "eval": _data_source(where, "data.eval", d.get("eval"), base_dir),
        "eval_fraction": _ranged(0.0, 1.0, hi_open=True)(where, "data.eval_fraction", d.get("eval_fraction", 0.0)),
        "shuffle": _bool(where, "data.shuffle", d.get("shuffle", True)),
        "seed": _nonneg_int(where, "data.seed", d.get("seed", 0)),
        "order": _choice(where, "data.order", d.get("order", "shared"), ORDERS),
        "per_model_labels": _bool(where, "data.per_model_labels", d.get("per_model_labels", False)),
    }
    if out["eval"] is not None and out["eval_fraction"] > 0:
        raise _fail(where, "data.eval and data.eval_fraction are both set; give held-out data one way")
    return out


def _loss(where: str, raw: Any) -> dict:
    if raw is None:
        raw = {}
    elif isinstance(raw, str):
        raw = {"name": raw}
    d = _section(where, "loss", raw, LOSS_KEYS)
    name = _choice(where, "loss.name", d.get("name", "cross-entropy"), tuple(LOSSES))
    out = {
        "name": name,
        "label_smoothing": _ranged(0.0, 1.0)(where, "loss.label_smoothing", d.get("label_smoothing", 0.0)),
        "ignore_index": _int(where, "loss.ignore_index", d.get("ignore_index", -100), minimum=None),
        "class_axis": _int(where, "loss.class_axis", d.get("class_axis", 1), minimum=None),
    }
    if out["label_smoothing"] and name != "cross-entropy":
        raise _fail(where, f"loss.label_smoothing applies to cross-entropy only, not to {name} (as in torch)")
    if out["class_axis"] == 0:
        raise _fail(where, "loss.class_axis = 0 is the batch axis; use 1 ([N, C, ...]) or -1 ([N, ..., C])")
    try:  # the loss's own rules, as a backstop
        get_loss(name, label_smoothing=out["label_smoothing"], ignore_index=out["ignore_index"],
                 class_axis=out["class_axis"])
    except ConfigError as e:
        raise _fail(where, f"loss: {e}") from None
    return out


def _optimizer(where: str, raw: Any) -> tuple[dict, dict]:
    """The normalized optimizer section, and the keys the file set explicitly (for grid conflicts)."""
    if isinstance(raw, str):
        raw = {"name": raw}
    d = _section(where, "optimizer", raw, ("name",) + tuple(_OPTIMIZER_CHECKS))
    name = d.get("name", "sgd")
    if name not in OPTIMIZER_NAMES:
        raise _fail(where, f"optimizer.name = {_show(name)} is not an optimizer; choose one of: "
                           f"{', '.join(OPTIMIZER_NAMES)}")
    takes = OPTIMIZER_KEYS[name]
    for k in d:
        if k != "name" and k not in takes:
            raise _fail(where, f"optimizer.{k} does not apply to {name}; {name} takes: {', '.join(takes)}")
    out = {"name": name}
    for k in takes:
        default = WEIGHT_DECAY_DEFAULT[name] if k == "weight_decay" else OPTIMIZER_DEFAULTS[k]
        out[k] = _per_model_value(where, f"optimizer.{k}", d.get(k, default), _OPTIMIZER_CHECKS[k])
    return out, d


def _schedule_one(where: str, key: str, raw: Any) -> dict:
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict):
        raise _fail(where, f"{key} must be a mapping with a name (or a list of them, one per model), got {_show(raw)}")
    name = raw.get("name", "constant")
    if name not in SCHEDULES:
        raise _fail(where, f"{key}.name = {_show(name)} is not a schedule; choose one of: {', '.join(SCHEDULES)}")
    params = SCHEDULES[name]
    for k in raw:
        if k != "name" and k not in params:
            takes = ", ".join(params) or "no parameters"
            raise _fail(where, f"{key}.{k} does not apply to the {name} schedule; {name} takes: {takes}")
    out = {"name": name}
    for k, default in params.items():
        if k not in raw and default is _REQUIRED:
            raise _fail(where, f"{key}.{k} is missing; the {name} schedule needs it")
        value = _SCHEDULE_CHECKS[k](where, f"{key}.{k}", raw.get(k, default))
        if value is not None:  # absent = derived (see SCHEDULES)
            out[k] = value
    return out


def _milestones(where: str, key: str, v: Any) -> list[int]:
    if not isinstance(v, list) or not v:
        raise _fail(where, f"{key} = {_show(v)} must be a non-empty list of step numbers")
    steps = [_pos_int(where, f"{key}[{i}]", s) for i, s in enumerate(v)]
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise _fail(where, f"{key} = {steps} must be strictly increasing")
    return steps


_SCHEDULE_CHECKS = {
    "step_size": _pos_int,
    "gamma": _ranged(0.0, math.inf, lo_open=True),
    "milestones": _milestones,
    "warmup_steps": _nonneg_int,
    "warmup_start_factor": _ranged(0.0, 1.0, lo_open=True),
    "eta_min": _ranged(0.0, math.inf),
    "t_max": _optional(_pos_int),
    "end_factor": _ranged(0.0, 1.0),
    "total": _optional(_pos_int),
    "max_lr": _optional(_ranged(0.0, math.inf, lo_open=True)),
    "pct_start": _ranged(0.0, 1.0, lo_open=True, hi_open=True),
    "div_factor": _ranged(0.0, math.inf, lo_open=True),
    "final_div_factor": _ranged(0.0, math.inf, lo_open=True),
    "anneal_strategy": lambda where, key, v: _choice(where, key, v, ANNEAL),
    "three_phase": _bool,
    "cycle_momentum": _bool,
    "base_momentum": _ranged(0.0, 1.0, hi_open=True),
    "max_momentum": _ranged(0.0, 1.0, hi_open=True),
}


def _schedule(where: str, raw: Any) -> dict | list[dict]:
    if raw is None:
        return {"name": "constant"}
    if isinstance(raw, list):
        if not raw:
            raise _fail(where, "schedule is an empty list; give one schedule, or one per model")
        return [_schedule_one(where, f"schedule[{i}]", s) for i, s in enumerate(raw)]
    return _schedule_one(where, "schedule", raw)


def _grid(where: str, raw: Any, optimizer: dict, explicit_opt: dict, schedule: Any, explicit: dict) -> dict:
    """Grid axes ``{dotted key: [values]}``; each value is checked like the setting itself."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail(where, f"grid must be a mapping of setting: [values], e.g. optimizer.lr: [0.1, 0.01]; "
                           f"got {_show(raw)}")
    out = {}
    for key, values in raw.items():
        gkey = f"grid.{key}"
        section, _, leaf = str(key).partition(".")
        if section == "optimizer" and leaf in OPTIMIZER_KEYS[optimizer["name"]]:
            check, given = _OPTIMIZER_CHECKS[leaf], explicit_opt.get(leaf) is not None
        elif key == "clip_grad_norm":
            check, given = _clip, explicit.get(key) is not None
        elif section == "schedule" and isinstance(schedule, dict) and leaf in SCHEDULES[schedule["name"]]:
            raw_schedule = explicit.get("schedule")
            check, given = _SCHEDULE_CHECKS[leaf], isinstance(raw_schedule, dict) and leaf in raw_schedule
        else:
            valid = [f"optimizer.{k}" for k in OPTIMIZER_KEYS[optimizer["name"]]] + ["clip_grad_norm"]
            if isinstance(schedule, dict):
                valid += [f"schedule.{k}" for k in SCHEDULES[schedule["name"]]]
            raise _fail(where, f"grid key '{key}' is not a per-model setting of this run; valid grid keys: "
                               f"{', '.join(valid)}")
        if given:
            raise _fail(where, f"{key} is set both in grid and as {key}; give its values in one place")
        if not isinstance(values, list) or not values:
            raise _fail(where, f"{gkey} = {_show(values)} must be a non-empty list of values")
        out[key] = [check(where, f"{gkey}[{i}]", v) for i, v in enumerate(values)]
    return out


def _halving(where: str, v: Any) -> list[int]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise _fail(where, f"halving = {_show(v)} must be a list of step numbers, e.g. [200, 400]")
    steps = [_pos_int(where, f"halving[{i}]", s) for i, s in enumerate(v)]
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise _fail(where, f"halving = {steps} must be strictly increasing step numbers")
    return steps


def _device(where: str, v: Any) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", v):
        raise _fail(where, f"device = {_show(v)} must be cpu, cuda or cuda:N")
    return v


def normalize_config(raw: dict, source: str = "config", base_dir: str | None = None) -> dict:
    """Validate a config mapping (as read from a file) and return its normalized form with defaults filled in.

    ``source`` prefixes every error message; ``base_dir``, when given, is the folder relative file paths in
    ``data`` and ``model.factory`` are relative to."""
    where = f"{source}: " if source else ""
    if not isinstance(raw, dict):
        raise _fail(where, f"the config must be a mapping of settings (key: value), got {type(raw).__name__}")
    for k in raw:
        if k not in TOP_KEYS:
            raise _fail(where, f"unknown key '{k}'; valid keys: {', '.join(TOP_KEYS)}")
    cfg: dict[str, Any] = {
        "model": _model(where, raw.get("model"), base_dir),
        "data": _data(where, raw.get("data"), base_dir),
        "loss": _loss(where, raw.get("loss")),
    }
    cfg["optimizer"], explicit_opt = _optimizer(where, raw.get("optimizer"))
    cfg["schedule"] = _schedule(where, raw.get("schedule"))
    cfg["grid"] = _grid(where, raw.get("grid"), cfg["optimizer"], explicit_opt, cfg["schedule"], raw)
    cfg["clip_grad_norm"] = _per_model_value(where, "clip_grad_norm", raw.get("clip_grad_norm"), _clip)
    _top_level(where, raw, cfg)
    return cfg


def _top_level(where: str, raw: dict, cfg: dict) -> None:
    """The scalar settings of the run (steps, batch sizes, evaluation, checkpoints, halving)."""
    get = lambda k: raw[k] if raw.get(k) is not None else TOP_DEFAULTS[k]  # noqa: E731 (null = default)
    has_steps, has_epochs = raw.get("steps") is not None, raw.get("epochs") is not None
    if has_steps == has_epochs:
        both = "both are set" if has_steps else "neither is set"
        raise _fail(where, f"give exactly one of steps and epochs ({both})")
    cfg["steps"] = _pos_int(where, "steps", raw["steps"]) if has_steps else None
    cfg["epochs"] = _pos_int(where, "epochs", raw["epochs"]) if has_epochs else None
    cfg["batch_size"] = _pos_int(where, "batch_size", get("batch_size"))
    cfg["eval_every"] = _nonneg_int(where, "eval_every", get("eval_every"))
    cfg["eval_batch_size"] = _pos_int(where, "eval_batch_size", get("eval_batch_size"))
    cfg["checkpoint_every"] = _nonneg_int(where, "checkpoint_every", get("checkpoint_every"))
    cfg["keep_checkpoints"] = _pos_int(where, "keep_checkpoints", get("keep_checkpoints"))
    cfg["on_diverge"] = _choice(where, "on_diverge", get("on_diverge"), ON_DIVERGE)
    cfg["halving"] = _halving(where, raw.get("halving"))
    cfg["halving_keep"] = _ranged(0.0, 1.0, lo_open=True, hi_open=True)(where, "halving_keep", get("halving_keep"))
    cfg["log_every"] = _pos_int(where, "log_every", get("log_every"))
    cfg["device"] = _device(where, get("device"))
    cfg["verify_steps"] = _nonneg_int(where, "verify_steps", get("verify_steps"))
    cfg["allow_nonfinite_data"] = _bool(where, "allow_nonfinite_data", get("allow_nonfinite_data"))
    if cfg["halving"]:
        if cfg["data"]["eval"] is None and cfg["data"]["eval_fraction"] == 0:
            raise _fail(where, "halving needs eval data to rank the models; set data.eval or data.eval_fraction")
        if cfg["steps"] is not None:
            _check_halving(where, cfg["halving"], cfg["steps"])


def _check_halving(where: str, halving: list[int], total: int) -> None:
    """Halving steps must come before the last step (a halving after it would train nothing)."""
    if halving and halving[-1] >= total:
        raise _fail(where, f"halving step {halving[-1]} is not before the last of the run's {total} steps; "
                           f"halving steps must be < {total}")


# ---------------------------------------------------------------- files
def _read_yaml(path: str, text: str) -> Any:
    import yaml

    class _UniqueKeyLoader(yaml.SafeLoader):
        """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"{path}: line {key_node.start_mark.line + 1}: key '{key}' is given twice; "
                                  "keep one")
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    _UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise _fail(f"{path}: ", f"malformed YAML{at}: {problem}; fix the syntax there") from None


def _read_toml(path: str, text: str) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise ConfigError(f"{path}: TOML configs need Python >= 3.11 (tomllib); write the config as YAML "
                          "(.yaml) instead") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # its message ends with "(at line L, column C)"
        raise _fail(f"{path}: ", f"malformed TOML: {e}; fix the syntax there") from None


def load_config(path: str | os.PathLike) -> dict:
    """Read a run configuration (``.yaml``/``.yml``, or ``.toml`` on Python >= 3.11) and return it normalized
    and validated (see :func:`normalize_config`). Relative paths in it are relative to the file's folder."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".yaml", ".yml", ".toml"):
        raise ConfigError(f"config file '{path}' must end in .yaml, .yml or .toml")
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist; check the path (docs/run.example.yaml is an "
                          "example)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file '{path}' cannot be read ({type(e).__name__}: {e})") from None
    raw = _read_toml(path, text) if ext == ".toml" else _read_yaml(path, text)
    if raw is None:
        raw = {}
    return normalize_config(raw, source=path, base_dir=os.path.dirname(os.path.abspath(path)))


# ---------------------------------------------------------------- per-model expansion
def _get(cfg: dict, dotted: str) -> Any:
    section, _, leaf = dotted.partition(".")
    return cfg[section][leaf] if leaf else cfg[section]


def _set(cfg: dict, dotted: str, value: Any) -> None:
    section, _, leaf = dotted.partition(".")
    if leaf:
        cfg[section][leaf] = value
    else:
        cfg[section] = value


def _broadcast(key: str, value: Any, B: int) -> list:
    if _is_per_model_list(key, value):
        if len(value) != B:
            raise ConfigError(f"{key} has {len(value)} values but the array has B={B} models; give one value, "
                              f"or a list of {B}")
        return list(value)
    return [value] * B


def _grid_points(grid: dict, B: int) -> list[dict]:
    """The cartesian product of the grid axes in key order (the first key varies slowest), one point per model."""
    keys = list(grid)
    points = [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]
    if len(points) != B:
        sizes = " x ".join(str(len(grid[k])) for k in keys)
        raise ConfigError(f"the grid has {len(points)} combinations ({sizes}) but the array has B={B} models; "
                          "the grid must give exactly one combination per model")
    return points


def expand_per_model(cfg: dict, B: int) -> dict:
    """A copy of normalized ``cfg`` where every per-model setting is a list of B values: ``optimizer.*``
    (``betas`` a list of B pairs), ``clip_grad_norm`` (None = off for that model) and ``schedule`` (a list of B
    dicts; onecycle's ``max_lr``, when not given, becomes the model's lr). The grid is applied (and emptied),
    and ``models`` lists each model's grid point (``{}`` without a grid)."""
    if isinstance(B, bool) or not isinstance(B, int) or B < 1:
        raise ConfigError(f"the number of models B must be a positive integer, got {B}")
    if cfg.get("model") and cfg["model"]["count"] != B:
        raise ConfigError(f"model.count = {cfg['model']['count']} but the array has B={B} models; make them agree")
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfg.items()}
    out["optimizer"] = dict(cfg["optimizer"])
    schedules = cfg["schedule"]
    if isinstance(schedules, list):
        if len(schedules) != B:
            raise ConfigError(f"schedule has {len(schedules)} entries but the array has B={B} models; give one "
                              f"schedule, or a list of {B}")
        schedules = [dict(s) for s in schedules]
    else:
        schedules = [dict(schedules) for _ in range(B)]
    points = _grid_points(cfg["grid"], B) if cfg.get("grid") else [{} for _ in range(B)]
    for key in PER_MODEL_KEYS:
        section, _, leaf = key.partition(".")
        if section == "optimizer" and leaf not in out["optimizer"]:
            continue  # not a setting of this optimizer
        if key in (cfg.get("grid") or {}):
            _set(out, key, [p[key] for p in points])
        else:
            _set(out, key, _broadcast(key, _get(cfg, key), B))
    for b, point in enumerate(points):
        for key, value in point.items():
            if key.startswith("schedule."):
                schedules[b][key.partition(".")[2]] = value
    lrs = out["optimizer"]["lr"]
    for b, s in enumerate(schedules):
        if s["name"] == "onecycle" and "max_lr" not in s:
            s["max_lr"] = lrs[b]
    out["schedule"] = schedules
    out["grid"] = {}
    # a config expanded before keeps its grid points
    out["models"] = points if cfg.get("grid") or not cfg.get("models") else list(cfg["models"])
    _check_per_model(out, B)
    return out


def _check_per_model(cfg: dict, B: int) -> None:
    """Rules that tie two per-model settings together (as torch.optim enforces them)."""
    opt = cfg["optimizer"]
    if opt["name"] != "sgd":
        return
    for b in range(B):
        if opt["nesterov"][b] and (opt["momentum"][b] <= 0 or opt["dampening"][b] != 0):
            raise ConfigError(f"model {b}: optimizer.nesterov needs momentum > 0 and dampening 0 (as "
                              f"torch.optim.SGD), got momentum {opt['momentum'][b]} and dampening "
                              f"{opt['dampening'][b]}")


def total_steps(cfg: dict, n_samples: int) -> int:
    """The run's number of optimizer steps: ``steps``, or ``epochs`` x full batches per epoch for ``n_samples``
    training samples per model (a last partial batch is skipped, as the trainer does). Checks that the halving
    steps fit in it."""
    if cfg["steps"] is not None:
        total = cfg["steps"]
    else:
        per_epoch = n_samples // cfg["batch_size"]
        if per_epoch < 1:
            raise ConfigError(f"epochs: the data has {n_samples} samples per model, fewer than one batch of "
                              f"batch_size = {cfg['batch_size']}; lower batch_size")
        total = cfg["epochs"] * per_epoch
    _check_halving("", cfg["halving"], total)
    return total


def config_to_train_settings(cfg: dict, array_dir: str | os.PathLike) -> tuple[dict, str | None, str | None]:
    """The ``TrainConfig`` settings, training data and eval data of a normalized config, for the array in
    ``array_dir``. When that folder has no fused array yet and the config has a ``model`` section, the models are
    exported (one per seed) and fused there first."""
    import logging

    array_dir = os.fspath(array_dir)
    if not os.path.exists(os.path.join(array_dir, "fused.onnx")) and cfg.get("model"):
        _build_array(cfg["model"], array_dir)
        logging.getLogger("onnxfuse.train").info("built the array in %s from model.factory %s", array_dir,
                                                 cfg["model"]["factory"])
    from onnxfuse.weights import ArraySpec

    B = ArraySpec.load(os.path.join(array_dir, "array.json")).B
    c = expand_per_model(cfg, B)
    opt, loss, data = c["optimizer"], c["loss"], c["data"]
    settings = {
        "steps": c["steps"], "epochs": c["epochs"], "batch_size": c["batch_size"],
        "loss": loss["name"], "loss_options": {k: v for k, v in loss.items() if k != "name"},
        "per_model_labels": data["per_model_labels"], "optimizer": opt["name"],
        **{k: opt[k] for k in ("lr", "momentum", "dampening", "nesterov", "weight_decay", "eps", "amsgrad")
           if k in opt},
        "clip_grad_norm": c["clip_grad_norm"], "schedule": c["schedule"],
        "shuffle": data["shuffle"], "seed": data["seed"], "data_order": data["order"],
        "eval_every": c["eval_every"], "eval_batch_size": c["eval_batch_size"],
        "eval_fraction": data["eval_fraction"] or 0.0, "checkpoint_every": c["checkpoint_every"],
        "keep_checkpoints": c["keep_checkpoints"], "on_diverge": c["on_diverge"], "halving": c["halving"] or None,
        "halving_keep": c["halving_keep"], "device": c["device"], "log_every": c["log_every"],
        "verify_steps": c["verify_steps"], "allow_nonfinite_data": c["allow_nonfinite_data"],
    }
    if "betas" in opt:
        settings["betas"] = [tuple(p) for p in opt["betas"]]
    if all(v is None for v in settings["clip_grad_norm"] or [None]):
        settings["clip_grad_norm"] = None
    else:
        settings["clip_grad_norm"] = [float("inf") if v is None else v for v in settings["clip_grad_norm"]]
    return {k: v for k, v in settings.items() if v is not None or k in ("steps", "epochs")}, data["train"], data["eval"]


def _build_array(model: dict, array_dir: str) -> None:
    """export (one model per seed) + fuse, as `onnxfuse export` and `onnxfuse fuse` would."""
    import tempfile

    from onnxfuse.exporters import export_array, load_factory
    from onnxfuse.passes import fuse_models, save_array

    with tempfile.TemporaryDirectory(prefix="onnxfuse-jobs-") as jobs:
        paths = export_array(load_factory(model["factory"]), os.path.join(jobs, "jobs"), model["count"],
                             model["input_shape"], seeds=model["seeds"])
        # never over an existing folder: one that is not empty (and holds no array) is refused
        save_array(fuse_models(paths, per_model_inputs=model.get("per_model_inputs") or ()), array_dir)
