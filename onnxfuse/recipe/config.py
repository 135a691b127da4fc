"""Run configuration files: every training setting of `onnxfuse train` in one YAML (or TOML) file, and the one
validation of a run's settings, whichever way they were given.

``read_config_file(path)`` reads a file's mapping; :func:`normalize_config` validates such a mapping (a file's, the
flags merged over it, ``TrainConfig``'s arguments, a resumed run's record, a sweep's array) and returns it
normalized: every section and key present (defaults filled in), numbers as int/float, names checked. Its keys are
made from the settings' declaration (``settings.py``: :func:`file_keys`). Per-model settings stay as written (a
scalar for every model, or a list with one value per model, or a ``grid``); ``expand_per_model(cfg, B)`` turns
them into lists of B once the number of models is known, and ``total_steps(cfg, n)`` resolves ``epochs`` once the
data size is known. Every problem is one :class:`ConfigError` line naming the key path, the bad value and what is
allowed. ``docs/run.example.yaml`` documents every key. Reading a config builds nothing: a file's ``model``
section is built into an array by the caller (``exporters.torch_export.build_array``).

Normalized form (what ``TrainConfig`` is made from)::

    model       None, or {factory, args, count, seeds, input_shape ({name: shape}), input_dtype ({name: dtype}),
                per_model_inputs}
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
import os
from dataclasses import replace
from typing import Any, Mapping

from onnxfuse.core.errors import ConfigError
from onnxfuse.exporters.factory import factory_args, model_inputs

from onnxfuse.recipe.datasets import NAMED_DATASETS, is_data_factory, is_named
from onnxfuse.recipe.ranking import EVAL_METRICS, OFF
from onnxfuse.recipe.settings import (FP16_ONLY, LOSS_PARAMS, OPTIMIZERS, RUN_SETTINGS, SCHEDULES, Origins, Param,
                                      Setting, check_halving, check_schedule, check_value, get_dotted, hyper_params,
                                      integer, is_per_model_list, run_setting, shown)
from onnxfuse.recipe.settings import config_error as _error

__all__ = ["load_config", "normalize_config", "expand_per_model", "total_steps", "read_config_file", "file_keys",
           "check_held_out", "per_model_keys", "check_model_value", "resolve_factory"]

_POS, _NONNEG = integer(ge=1), integer(ge=0)


def _file_error(where: str, msg: str) -> ConfigError:
    return ConfigError(" ".join(f"{where}{msg}".split()))


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
        raise _file_error(f"{path}: ", f"malformed YAML{at}: {problem}; fix the syntax there") from None


def _read_toml(path: str, text: str) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise ConfigError(f"{path}: TOML configs need Python >= 3.11 (tomllib); write the config as YAML "
                          "(.yaml) instead") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # its message ends with "(at line L, column C)"
        raise _file_error(f"{path}: ", f"malformed TOML: {e}; fix the syntax there") from None


def read_config_file(path: str | os.PathLike, what: str = "config file",
                     example: str = "docs/run.example.yaml") -> Any:
    """The mapping a ``.yaml``/``.yml`` (or ``.toml`` on Python >= 3.11) file holds, unvalidated; every problem
    reading it is one ConfigError line naming the file (``what`` and ``example`` word the messages)."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".yaml", ".yml", ".toml"):
        raise ConfigError(f"{what} '{path}' must end in .yaml, .yml or .toml")
    if not os.path.isfile(path):
        raise ConfigError(f"{what} '{path}' does not exist; check the path ({example} is an example)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} '{path}' cannot be read ({type(e).__name__}: {e})") from None
    raw = _read_toml(path, text) if ext == ".toml" else _read_yaml(path, text)
    return {} if raw is None else raw


def load_config(path: str | os.PathLike) -> dict:
    """Read a run configuration (``.yaml``/``.yml``, or ``.toml`` on Python >= 3.11) and return it normalized
    and validated (see :func:`normalize_config`). Relative paths in it are relative to the file's folder."""
    path = os.fspath(path)
    return normalize_config(read_config_file(path), source=path, base_dir=os.path.dirname(os.path.abspath(path)))


# ---------------------------------------------------------------- the schema: every key of a file, validated
_SECTIONS = ("model", "data", "loss", "optimizer", "grid", "schedule")
_MODEL_KEYS = ("factory", "args", "count", "seeds", "input_shape", "input_dtype", "per_model_inputs")


def file_keys(section: str) -> tuple[str, ...]:
    """The keys a config file takes under ``section`` ("" = top level), made from the declaration."""
    if section == "":
        return _SECTIONS + tuple(s.path for s in RUN_SETTINGS if "." not in s.path)
    if section == "data":
        return ("train", "eval") + tuple(s.path[5:] for s in RUN_SETTINGS if s.path.startswith("data."))
    if section == "loss":
        return ("name",) + tuple(p.name for p in LOSS_PARAMS)
    if section == "optimizer":
        return ("name",) + tuple(hyper_params())
    return _MODEL_KEYS


def _section(where: Origins, key: str, v: Any) -> dict:
    """A mapping whose keys are all known under ``key``."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _error(f"{where(key)}{key} must be a mapping of settings (key: value), got {shown(v)}")
    allowed = file_keys(key)
    for k in v:
        if k not in allowed:
            raise _error(f"{where(f'{key}.{k}')}unknown key '{key}.{k}'; valid keys under {key}: {', '.join(allowed)}")
    return v


def _resolve(path: Any, base_dir: str | None) -> Any:
    """A relative file path in the config is relative to the config file's folder."""
    if base_dir is None or not isinstance(path, str) or is_named(path) or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base_dir, path))


def resolve_factory(factory: str, base_dir: str | None) -> str:
    """``MODULE:FACTORY`` with a ``.py`` file's path made relative to ``base_dir`` (the config file's folder)."""
    module, _, attr = factory.rpartition(":")
    return f"{_resolve(module, base_dir)}:{attr}" if module.endswith(".py") else factory


def _model(at: Origins, raw: Any) -> dict | None:
    if raw is None:
        return None
    m = _section(at, "model", raw)
    where, base_dir = at("model"), at.base("model")
    for key in ("factory", "count", "input_shape"):
        if key not in m:
            raise _error(f"{where}model.{key} is missing; the model section needs factory, count and input_shape "
                         "(or remove the section when the array is fused already)")
    factory = m["factory"]
    if not isinstance(factory, str) or ":" not in factory:
        raise _error(f"{where}model.factory = {shown(factory)} must be MODULE:FACTORY, e.g. "
                     "onnxfuse.exporters.zoo:LeNet or my_models.py:make")
    factory = resolve_factory(factory, base_dir)
    count = check_value(Param("count", _POS), m["count"], "model.count", "file", where)
    seeds = m.get("seeds") if m.get("seeds") is not None else list(range(count))
    if not isinstance(seeds, list) or len(seeds) != count:
        raise _error(f"{where}model.seeds = {shown(seeds)} must be a list of model.count = {count} integers")
    seeds = [check_value(Param("seed", _NONNEG), s, f"model.seeds[{i}]", "file", where) for i, s in enumerate(seeds)]
    shapes, dtypes = model_inputs(m["input_shape"], m.get("input_dtype"), where)  # as `onnxfuse export` checks them
    pmi = m.get("per_model_inputs") or []
    if not isinstance(pmi, list) or not all(isinstance(n, str) and n for n in pmi):
        raise _error(f"{where}model.per_model_inputs = {shown(pmi)} must be a list of graph input names")
    return {"factory": factory, "args": factory_args(m.get("args"), "model.args", where), "count": count,
            "seeds": seeds, "input_shape": shapes, "input_dtype": dtypes, "per_model_inputs": pmi}


def _data_source(at: Origins, key: str, v: Any) -> str | None:
    if v is None:
        return None
    where = at(key)
    if isinstance(v, str) and is_named(v):
        if v not in NAMED_DATASETS:
            raise _error(f"{where}{key} = {shown(v)} is not a bundled data set; choose one of: "
                         f"{', '.join(NAMED_DATASETS)}")
        return v
    if isinstance(v, str) and is_data_factory(v):  # a function that returns a DataLoader, Dataset or arrays
        return resolve_factory(v, at.base(key))
    if not isinstance(v, str) or not v.endswith(".npz"):
        raise _error(f"{where}{key} = {shown(v)} must be a .npz file, MODULE:FUNCTION (a function returning a "
                     f"DataLoader, a Dataset or arrays) or one of: {', '.join(NAMED_DATASETS)}")
    return _resolve(v, at.base(key))


def _setting(where: Origins, raw: dict, s: Setting) -> Any:
    """The value of run setting ``s`` in a config mapping (null or absent: the default)."""
    v = get_dotted(raw, s.path)
    v = s.param.default if v is None else v
    return None if v is None else check_value(s.param, v, s.path, "file", where(s.path))


def per_model_keys(optimizer: str, schedule: Any) -> list[str]:
    """The dotted keys a grid may vary: the optimizer's per-model hyper-parameters, clip_grad_norm, and the
    parameters of the schedule when one schedule is given."""
    keys = [f"optimizer.{p.name}" for p in OPTIMIZERS[optimizer].params if p.per_model]
    keys += [s.path for s in RUN_SETTINGS if s.param.per_model]
    if isinstance(schedule, dict):
        keys += [f"schedule.{p.name}" for p in SCHEDULES[schedule["name"]].params]
    return keys


def check_model_value(key: str, value: Any, label: str, cfg: dict, where: str = "") -> Any:
    """One model's value of the per-model setting ``key`` (a config grid's, a sweep's search), checked as the
    setting itself is (``cfg``: the normalized config, for its optimizer and schedule)."""
    p = replace(_setting_param(key, cfg["optimizer"]["name"], cfg["schedule"]), per_model=False)
    return check_value(p, value, label, "file", where, optional=p.default is None)


def _setting_param(key: str, optimizer: str, schedule: Any) -> Param | None:
    section, _, leaf = key.partition(".")
    if section == "optimizer":
        return OPTIMIZERS[optimizer].param(leaf)
    if section == "schedule" and isinstance(schedule, dict):
        return SCHEDULES[schedule["name"]].param(leaf)
    s = run_setting(key)
    return s.param if s is not None else None


def _grid(at: Origins, raw: Any, cfg: dict, explicit: dict) -> dict:
    """Grid axes ``{dotted key: [values]}``; each value is checked like the setting itself."""
    if raw is None:
        return {}
    where = at("grid")
    if not isinstance(raw, dict):
        raise _error(f"{where}grid must be a mapping of setting: [values], e.g. optimizer.lr: [0.1, 0.01]; got "
                     f"{shown(raw)}")
    valid = per_model_keys(cfg["optimizer"]["name"], cfg["schedule"])
    out = {}
    for key, values in raw.items():
        if key not in valid:
            raise _error(f"{where}grid key '{key}' is not a per-model setting of this run; valid grid keys: "
                         f"{', '.join(valid)}")
        section, _, leaf = key.partition(".")
        given = explicit.get(section) if leaf else explicit
        if isinstance(given, dict) and given.get(leaf or key) is not None:
            raise _error(f"{at('grid', key)}{key} is set both in grid and as {key}; give its values in one place")
        if not isinstance(values, list) or not values:
            raise _error(f"{where}grid.{key} = {shown(values)} must be a non-empty list of values")
        out[key] = [check_model_value(key, v, f"grid.{key}[{i}]", cfg, where) for i, v in enumerate(values)]
    return out


def normalize_config(raw: dict, source: str = "config", base_dir: str | None = None,
                     named: Mapping[str, str] | None = None, with_data: bool = True) -> dict:
    """Validate a config mapping (as read from a file, flags merged over it: :func:`merge_raw`) and return its
    normalized form with defaults filled in (see ``config.py``): the one validation of every setting, whichever
    way it was given. ``source`` starts every message about a value from the file, ``named`` names the values
    given otherwise (``{"optimizer.lr": "--lr"}``: see :class:`Origins`); ``base_dir``, when given, is the folder
    the file's relative paths in ``data`` and ``model.factory`` are relative to. ``with_data=False``: the mapping
    says nothing about the data (``TrainConfig``: the data comes with the run), and the rules about held-out
    data wait for it (:func:`check_held_out`)."""
    at = Origins(source, dict(named or {}), base_dir)
    if not isinstance(raw, dict):
        raise _error(f"{at()}the config must be a mapping of settings (key: value), got {type(raw).__name__}")
    top = file_keys("")
    for k in raw:
        if k not in top:
            raise _error(f"{at(k)}unknown key '{k}'; valid keys: {', '.join(top)}")
    raw = dict(raw)
    for section in ("loss", "optimizer"):  # a name alone
        if isinstance(raw.get(section), str):
            raw[section] = {"name": raw[section]}
    for section in ("data", "loss", "optimizer"):
        raw[section] = _section(at, section, raw.get(section))
    value = {s.name: _setting(at, raw, s) for s in RUN_SETTINGS}
    data = raw["data"]
    cfg: dict[str, Any] = {
        "model": _model(at, raw.get("model")),
        "data": {"train": _data_source(at, "data.train", data.get("train")),
                 "eval": _data_source(at, "data.eval", data.get("eval")),
                 **{s.path[5:]: value[s.name] for s in RUN_SETTINGS if s.path.startswith("data.")}},
        "loss": {"name": value["loss"], **{p.name: check_value(p, raw["loss"].get(p.name, p.default),
                                                                f"loss.{p.name}", "file", at(f"loss.{p.name}"))
                                           for p in LOSS_PARAMS}},
    }
    cfg["data"] = {k: cfg["data"][k] for k in file_keys("data")}  # the documented key order
    loss = cfg["loss"]
    if loss["label_smoothing"] and loss["name"] != "cross-entropy":
        raise _error(f"{at('loss.label_smoothing', 'loss.name')}loss.label_smoothing applies to cross-entropy only, "
                     f"not to {loss['name']} (as in torch)")
    if loss["class_axis"] == 0:
        raise _error(f"{at('loss.class_axis')}loss.class_axis = 0 is the batch axis; use 1 ([N, C, ...]) or -1 "
                     "([N, ..., C])")
    from onnxfuse.recipe.losses import get_loss

    try:  # the loss's own rules, as a backstop
        get_loss(loss["name"], **{p.name: loss[p.name] for p in LOSS_PARAMS})
    except ConfigError as e:
        raise _error(f"{at(*(f'loss.{k}' for k in loss))}loss: {e}") from None
    cfg["optimizer"] = _optimizer(at, raw["optimizer"], value["optimizer"])
    cfg["schedule"] = check_schedule(raw.get("schedule"), "file", at, fill=True)
    cfg["grid"] = _grid(at, raw.get("grid"), cfg, raw)
    for s in RUN_SETTINGS:
        if "." not in s.path:
            cfg[s.path] = value[s.name]
    cfg["halving"] = cfg["halving"] or []
    if (cfg["steps"] is None) == (cfg["epochs"] is None):
        both = "both are set" if cfg["steps"] is not None else "neither is set"
        raise _error(f"{at('steps', 'epochs')}give exactly one of steps and epochs ({both})")
    if with_data:
        check_held_out(cfg, cfg["data"]["eval"] is not None, at)
    if cfg["halving"] and cfg["steps"] is not None:
        check_halving(cfg["halving"], cfg["steps"], "file", at("halving", "steps"))
    if cfg["precision"] != "fp16":
        _check_no_loss_scale(raw, cfg, at)
    return cfg


def _check_no_loss_scale(raw: Mapping, cfg: Mapping, at: Origins) -> None:
    """A loss-scale setting given (not its default) for a run that is not fp16 is refused, as any setting that
    would do nothing is (an optimizer's hyper-parameter it does not take, a schedule's parameter)."""
    def given(name: str) -> bool:
        v, default = get_dotted(raw, run_setting(name).path), run_setting(name).param.default
        return v is not None and any(x != default for x in (v if isinstance(v, (list, tuple)) else [v]))
    keys = [run_setting(n).path for n in FP16_ONLY if given(n)] + [k for k in cfg["grid"] if k in FP16_ONLY]
    if keys:
        raise _error(f"{at(*keys, 'precision')}{', '.join(keys)} {'applies' if len(keys) == 1 else 'apply'} to "
                     f"precision fp16 only (its loss scaling), and this run trains in {cfg['precision']}; remove "
                     f"{'it' if len(keys) == 1 else 'them'} or train in fp16")


def check_held_out(cfg: Mapping, has_eval: bool, where: Origins | str = "") -> None:
    """The rules about held-out data of a normalized config, for a run that has eval data (``has_eval``) or not:
    eval data is given one way, and successive halving and best states have some to rank the models by."""
    at = where if callable(where) else (lambda *keys: where)
    eval_fraction = cfg["data"]["eval_fraction"]
    if has_eval and eval_fraction > 0:
        raise _error(f"{at('data.eval', 'data.eval_fraction')}data.eval and data.eval_fraction are both "
                     "set; give held-out data one way")
    if cfg["halving"] and not has_eval and eval_fraction == 0:
        raise _error(f"{at('halving')}halving needs eval data to rank the models; set data.eval or "
                     "data.eval_fraction")
    if cfg["keep_best"] in EVAL_METRICS and not has_eval and eval_fraction == 0:
        raise _error(f"{at('keep_best')}keep_best {cfg['keep_best']} needs eval data to pick each model's "
                     f"best state by; set data.eval or data.eval_fraction, or keep_best {OFF}")


def _optimizer(where: Origins, given: dict, name: str) -> dict:
    """The optimizer section: its name and each of its hyper-parameters (default filled in)."""
    spec = OPTIMIZERS[name]
    takes = [p.name for p in spec.params]
    for k in given:
        if k != "name" and k not in takes:
            raise _error(f"{where(f'optimizer.{k}', 'optimizer.name')}optimizer.{k} does not apply to {name}; "
                         f"{name} takes: {', '.join(takes)}")
    out = {"name": name}
    for p in spec.params:
        v = given.get(p.name)
        key = f"optimizer.{p.name}"
        out[p.name] = check_value(p, p.default if v is None else v, key, "file", where(key))
    return out


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


def _broadcast(key: str, value: Any, B: int, where: Origins) -> list:
    if is_per_model_list(key, value):
        if len(value) == 1:
            return list(value) * B
        if len(value) != B:
            raise ConfigError(f"{where(key)}{key} has {len(value)} values but the array has B={B} models; give one "
                              f"value, or a list of {B}")
        return list(value)
    return [value] * B


def _grid_points(grid: dict, B: int, where: Origins) -> list[dict]:
    """The cartesian product of the grid axes in key order (the first key varies slowest), one point per model."""
    keys = list(grid)
    points = [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]
    if len(points) != B:
        sizes = " x ".join(str(len(grid[k])) for k in keys)
        raise ConfigError(f"{where('grid')}the grid has {len(points)} combinations ({sizes}) but the array has B={B} "
                          "models; the grid must give exactly one combination per model")
    return points


def expand_per_model(cfg: dict, B: int, where: Origins | None = None) -> dict:
    """A copy of normalized ``cfg`` where every per-model setting is a list of B values: ``optimizer.*``
    (``betas`` a list of B pairs), ``clip_grad_norm`` (None = off for that model) and ``schedule`` (a list of B
    dicts; onecycle's ``max_lr``, when not given, becomes the model's lr). The grid is applied (and emptied),
    and ``models`` lists each model's grid point (``{}`` without a grid). ``where`` says where the settings came
    from, for the start of a message (see ``settings.Origins``)."""
    where = where or Origins()
    if isinstance(B, bool) or not isinstance(B, int) or B < 1:
        raise ConfigError(f"the number of models B must be a positive integer, got {B}")
    if cfg.get("model") and cfg["model"]["count"] != B:
        raise ConfigError(f"{where('model.count')}model.count = {cfg['model']['count']} but the array has B={B} "
                          "models; make them agree")
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfg.items()}
    out["optimizer"] = dict(cfg["optimizer"])
    schedules = cfg["schedule"]
    if isinstance(schedules, list):
        if len(schedules) != B:
            raise ConfigError(f"{where('schedule')}schedule has {len(schedules)} entries but the array has B={B} "
                              f"models; give one schedule, or a list of {B}")
        schedules = [dict(s) for s in schedules]
    else:
        schedules = [dict(schedules) for _ in range(B)]
    points = _grid_points(cfg["grid"], B, where) if cfg.get("grid") else [{} for _ in range(B)]
    for key in per_model_keys(cfg["optimizer"]["name"], None):
        if key in (cfg.get("grid") or {}):
            _set(out, key, [p[key] for p in points])
        else:
            _set(out, key, _broadcast(key, _get(cfg, key), B, where))
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
    _check_per_model(out, B, where)
    return out


def _check_per_model(cfg: dict, B: int, where: Origins) -> None:
    """The optimizer's rule tying two per-model settings together (SGD: nesterov needs momentum, as torch.optim)."""
    opt = cfg["optimizer"]
    rule = OPTIMIZERS[opt["name"]].check
    for b in range(B) if rule is not None else ():
        problem = rule({k: v[b] for k, v in opt.items() if k != "name"})
        if problem:
            keys = [f"optimizer.{k}" for k in opt if k != "name" and problem.startswith(k)] or ["optimizer"]
            raise ConfigError(f"{where(*keys)}model {b}: optimizer.{problem}")


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
    check_halving(cfg["halving"], total, "file")
    return total
