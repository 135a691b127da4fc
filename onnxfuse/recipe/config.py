"""Run configuration files: every training setting of `onnxfuse train` in one YAML (or TOML) file.

``load_config(path)`` reads the file and returns a normalized dict: every section and key present (defaults
filled in), numbers as int/float, names checked. Per-model settings stay as written (a scalar for every model,
or a list with one value per model, or a ``grid``); ``expand_per_model(cfg, B)`` turns them into lists of B once
the number of models is known, and ``total_steps(cfg, n)`` resolves ``epochs`` once the data size is known.
Every problem is one :class:`ConfigError` line naming the key path, the bad value and what is allowed.
``docs/run.example.yaml`` documents every key. The keys, their types, defaults and ranges are declared once in
``settings.py`` (which validates a file's mapping: :func:`normalize_config`); this module reads the file and
expands the per-model settings.

Normalized form (what the trainer reads)::

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
from typing import Any

from onnxfuse.core.errors import ConfigError

from onnxfuse.recipe.settings import (OPTIMIZERS, Origins, check_halving, flat_settings, is_per_model_list,
                                      normalize_config, per_model_keys)

__all__ = ["load_config", "normalize_config", "expand_per_model", "total_steps", "config_to_train_settings",
           "settings_from_config", "read_config_file", "array_size"]


def _fail(where: str, msg: str) -> ConfigError:
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


def array_size(cfg: dict, array_dir: str | os.PathLike) -> int:
    """The number of models B of the array in ``array_dir``. When that folder has no fused array yet and the
    normalized config ``cfg`` has a ``model`` section, the models are exported (one per seed) and fused there
    first."""
    import logging

    from onnxfuse.core.array import ArrayDir

    array = ArrayDir(array_dir)
    if not os.path.exists(array.fused_path) and cfg.get("model"):
        _build_array(cfg["model"], array.path)
        logging.getLogger("onnxfuse.train").info("built the array in %s from model.factory %s", array.path,
                                                 cfg["model"]["factory"])
    array.check_exists()
    return array.load_spec().B


def config_to_train_settings(cfg: dict, array_dir: str | os.PathLike) -> tuple[dict, str | None, str | None]:
    """The ``TrainConfig`` settings, training data and eval data of a normalized config, for the array in
    ``array_dir`` (built first from the ``model`` section where it is not there yet: :func:`array_size`)."""
    return settings_from_config(cfg, array_size(cfg, array_dir))


def settings_from_config(cfg: dict, B: int) -> tuple[dict, str | None, str | None]:
    """The ``TrainConfig`` settings, training data and eval data of a normalized config for an array of B models
    (its per-model settings expanded to B values)."""
    c = expand_per_model(cfg, B)
    settings = flat_settings(c)
    if all(v is None for v in settings["clip_grad_norm"]):
        settings["clip_grad_norm"] = None
    return {k: v for k, v in settings.items() if v is not None or k in ("steps", "epochs")}, c["data"]["train"], \
        c["data"]["eval"]


def _build_array(model: dict, array_dir: str) -> None:
    """export (one model per seed) + fuse, as `onnxfuse export` and `onnxfuse fuse` would."""
    import tempfile

    from onnxfuse.exporters import export_array
    from onnxfuse.core.passes import fuse_models, save_array

    with tempfile.TemporaryDirectory(prefix="onnxfuse-jobs-") as jobs:
        paths = export_array(model["factory"], os.path.join(jobs, "jobs"), model["count"],
                             model["input_shape"], seeds=model["seeds"], factory_args=model["args"],
                             input_dtype=model["input_dtype"])
        # never over an existing folder: one that is not empty (and holds no array) is refused
        save_array(fuse_models(paths, per_model_inputs=model.get("per_model_inputs") or ()), array_dir)
