"""``TrainConfig``: every setting of a run, as the Python API gives them; and ``RunPlan``: the same settings
validated and expanded to the B models of an array, which is all a run reads.

A setting is validated once, by ``settings.normalize_config``, whichever way it was given:

    onnxfuse train --lr 0.1,0.01     argv -> flags_to_raw -> (merged over --config's mapping) -> normalize_config
    TrainConfig(lr=[0.1, 0.01])      arguments -> raw_from_flat -> normalize_config
    a resumed run                    its recorded settings, the flags over them -> normalize_config

``TrainConfig.plan(B)`` then gives every per-model value as a tuple of B (``config.expand_per_model``), the device
as a ``Device`` and "no clipping" as None; a run builds its optimizer, loss and schedules from the plan without
checking anything again. ``TrainConfig.as_dict()`` is the settings as given, the form a checkpoint records and the
settings hash reads (unchanged, so that runs written before resume).

The fields below are the run settings of ``settings.RUN_SETTINGS`` and the hyper-parameters of the built-in
optimizers, with their defaults (``tests/test_settings_once.py`` checks that they are exactly those); an optimizer
registered later has its hyper-parameters in ``extra`` (read as attributes, ``config.rho``).
"""
from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Iterable, Mapping, Sequence, Union

import numpy as np

from onnxfuse.core.errors import ConfigError

from onnxfuse.recipe.config import array_size, expand_per_model, read_config_file
from onnxfuse.recipe.device import Device
from onnxfuse.recipe.losses import LossSpec, get_loss
from onnxfuse.recipe.optim import OptimizerConfig, optimizer_config, per_model
from onnxfuse.recipe.runtimes import LossScale
from onnxfuse.recipe.settings import (RUN_SETTINGS, Origins, check_held_out, flag_of, flat_default, flat_settings,
                                      get_dotted, hyper_params, merge_raw, normalize_config, raw_from_flat, raw_key)

__all__ = ["TrainConfig", "RunPlan", "run_config", "as_train_config"]

PerModel = Union[Any, Sequence[Any]]  # one value for every model, or a list with one per model


def _plain(v: Any) -> Any:
    """numpy values as Python's (what a record holds: JSON)."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, Device):
        return str(v)
    return v


@dataclass(frozen=True, init=False)
class TrainConfig:
    """Everything a run takes (``onnxfuse train --help`` says each): a per-model value is one value for every
    model or a list with one per model. Checked when made (one ConfigError line naming the argument and the
    config key, e.g. ``TrainConfig(lr=...): optimizer.lr[1] = -1 must be finite and >= 0``)."""

    # the run settings (settings.RUN_SETTINGS, in its order)
    steps: int | None = None
    epochs: int | None = None
    batch_size: int = 32
    loss: str = "cross-entropy"
    per_model_labels: bool = False
    optimizer: str = "sgd"
    clip_grad_norm: PerModel | None = None  # float > 0 per model; None (or inf): no clipping
    shuffle: bool = True
    seed: int = 0
    data_order: str = "shared"
    eval_every: int = 0
    eval_batch_size: int = 256
    eval_fraction: float = 0.0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    on_diverge: str = "freeze"
    keep_best: str | None = None  # eval_loss, eval_accuracy or off; None: eval_loss when the run has eval data
    halving: Sequence[int] | None = None
    halving_keep: float = 0.5
    device: str = "cpu"  # or a Device
    runtime: str = "auto"
    threads: int = 0
    compile: str = "auto"
    precision: str = "fp32"
    loss_scale: PerModel = 2.0 ** 16
    loss_scale_growth: float = 2.0
    loss_scale_backoff: float = 0.5
    loss_scale_interval: int = 2000
    log_every: int = 1
    verify_steps: int = 1
    allow_nonfinite_data: bool = False
    # the built-in optimizers' hyper-parameters, per model (None: each optimizer's own default)
    lr: PerModel = 1e-3
    weight_decay: PerModel | None = None
    momentum: PerModel = 0.0
    dampening: PerModel = 0.0
    nesterov: PerModel = False
    betas: PerModel = (0.9, 0.999)
    eps: PerModel = 1e-8
    amsgrad: PerModel = False
    # None, a name, a mapping {name, parameters...}, or a list of those, one per model
    schedule: Any = None
    loss_options: Mapping[str, Any] = field(default_factory=dict)  # label_smoothing, ignore_index, class_axis
    # the hyper-parameters of optimizers registered after this class, by name
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __init__(self, **settings: Any) -> None:
        settings = {**{k: v for k, v in settings.items() if k != "extra"}, **(settings.get("extra") or {})}
        named = _named(settings, lambda name: f"TrainConfig({name}=...)")
        cfg = normalize_config(raw_from_flat(settings), source="", named=named, with_data=False)
        explicit = {k for k, v in settings.items() if v is not None}
        self._set(settings, cfg, Origins("", named), None, explicit=explicit)

    # ---- the other ways to make one
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        return cls(**d)

    @classmethod
    def from_normalized(cls, cfg: dict, B: int | None = None, where: Origins | None = None,
                        explicit: Iterable[str] | None = None) -> "TrainConfig":
        """The settings of a config validated already (``normalize_config``: a file, flags merged over it);
        ``B``: its per-model values are expanded to B already (``expand_per_model``; a grid needs it). ``where``
        says where its values came from, for the messages of a later expansion; ``explicit``: the settings the
        config sets (None: not known, each counts as set; see :meth:`given`)."""
        self = object.__new__(cls)
        self._set(flat_settings(cfg), cfg, where or Origins(), B, held_out=True, explicit=explicit)
        return self

    @classmethod
    def resumed(cls, record: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> "TrainConfig":
        """A resumed run's settings: its ``record`` (as a checkpoint holds it) with ``overrides`` (flat names, e.g.
        more steps: a resumed run's flags) over it, validated as any settings are. Hyper-parameters in the record
        that its optimizer does not take are left out of the validation (runs before that was refused recorded
        them; they did nothing), and kept in ``as_dict()`` (the run's settings hash reads them)."""
        overrides = dict(overrides or {})
        own = {**record, **({"steps": None} if "epochs" in overrides else {})}  # --epochs instead of the steps
        named = _named(overrides, flag_of)
        where = Origins("the resumed run's settings", named)
        raw = merge_raw(raw_from_flat({k: v for k, v in own.items() if k not in overrides}, recorded=True),
                        raw_from_flat(overrides))
        cfg = normalize_config(raw, source=where.source, named=named, with_data=False)
        self = object.__new__(cls)
        self._set({**own, **overrides}, cfg, where, None, explicit=overrides)
        return self

    def _set(self, given: Mapping[str, Any], cfg: dict, where: Origins, B: int | None,
             held_out: bool = False, explicit: Iterable[str] | None = None) -> None:
        values = {f.name: f.default_factory() if f.default_factory is not MISSING else f.default
                  for f in fields(self) if f.name != "extra"}
        extra = {name: flat_default(name) for name in hyper_params() if name not in values}
        for k, v in given.items():
            if k in values:
                values[k] = _plain(v)
            else:  # raw_from_flat refused any other name
                extra[k] = _plain(v)
        for k, v in values.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "extra", extra)
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "_where", where)
        object.__setattr__(self, "_B", B)
        object.__setattr__(self, "_held_out", held_out)
        object.__setattr__(self, "_explicit", None if explicit is None else frozenset(explicit))

    def __getattr__(self, name: str) -> Any:  # a later-registered optimizer's hyper-parameter
        extra = self.__dict__.get("extra") or {}
        if name in extra:
            return extra[name]
        raise AttributeError(f"'TrainConfig' object has no attribute '{name}'")

    # ---- what a run reads
    def given(self, name: str) -> bool:
        """Whether setting ``name`` was given (an argument, a flag, a config file's key, a resumed run's override)
        rather than left at its default: a run whose DataLoader has its own batch size takes that one when
        ``batch_size`` was not given. True when not known (settings made from a normalized config alone)."""
        return self._explicit is None or name in self._explicit

    def as_dict(self) -> dict:
        """Every setting by name, as given (what a checkpoint records and the settings hash reads)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}, **self.extra}

    def plan(self, B: int, has_eval: bool | None = None) -> "RunPlan":
        """The run of an array of B models (``has_eval``: whether the run has eval data, for the rules about
        held-out data; None: not known here)."""
        cfg = self._cfg if self._B == B else expand_per_model(self._cfg, B, self._where)
        if has_eval is not None and not self._held_out:
            check_held_out(cfg, has_eval, self._where)
        return RunPlan.of(cfg, B, self.as_dict())

    def optimizer_config(self, B: int) -> OptimizerConfig:
        return self.plan(B).optimizer_config()

    def loss_spec(self) -> LossSpec:
        return _loss_spec(self._cfg)


def as_train_config(config: Any, name: str = "config") -> TrainConfig:
    """``config`` if it is a TrainConfig; anything else (a dict of settings, a file path) is one ConfigError naming
    the argument and saying how to make one: the Python API reads no guessed form of the settings."""
    if isinstance(config, TrainConfig):
        return config
    if config is None:
        raise ConfigError(f"no training configuration given ({name}=None); give {name}=TrainConfig(steps=..., ...)")
    if isinstance(config, Mapping):
        raise ConfigError(f"{name} is a {type(config).__name__}, not a TrainConfig; give "
                          f"{name}=TrainConfig(**settings) (TrainConfig's fields, e.g. steps, lr, batch_size)")
    raise ConfigError(f"{name} is a {type(config).__name__}, not a TrainConfig; give {name}=TrainConfig(steps=..., "
                      "...)")


def run_config(array_dir: str | os.PathLike, given: Mapping | None = None, named: Mapping[str, str] | None = None,
               config_file: str | os.PathLike | None = None) -> tuple[TrainConfig, str | None, str | None]:
    """The settings of ``onnxfuse train``/``check`` on the array in ``array_dir``: ``given`` (a config mapping:
    the flags, ``settings.flags_to_raw``; ``named`` says which flag gave which key) over ``config_file``'s
    mapping, validated as one and expanded to the array's B models; and the run's training and eval data. The
    array is built from the file's ``model`` section when the folder has none yet."""
    given, named = dict(given or {}), dict(named or {})
    raw, where = given, Origins("", named)
    if config_file is not None:
        config_file = os.fspath(config_file)
        file_raw = read_config_file(config_file)
        raw = merge_raw(file_raw, given) if isinstance(file_raw, dict) else file_raw
        where = Origins(config_file, named, os.path.dirname(os.path.abspath(config_file)))
    cfg = normalize_config(raw, where.source, where.base_dir, named)
    if cfg["data"]["train"] is None:  # before an array is built
        raise ConfigError("--data is required (a .npz file, sklearn:<name> or MODULE:FUNCTION returning a "
                          "DataLoader), or data.train in --config")
    B = array_size(cfg, array_dir)
    cfg = expand_per_model(cfg, B, where)
    explicit = [s.name for s in RUN_SETTINGS if get_dotted(raw, s.path) is not None]
    return TrainConfig.from_normalized(cfg, B, where, explicit), cfg["data"]["train"], cfg["data"]["eval"]


def _named(settings: Mapping[str, Any], label) -> dict[str, str]:
    """{config key: how the setting was given} for the flat ``settings``, e.g. {"optimizer.lr": "--lr"}."""
    out = {}
    for name, v in settings.items():
        if name == "loss_options" and isinstance(v, Mapping):
            out.update({f"loss.{k}": label(f"loss_options.{k}") for k in v})
        else:
            out[raw_key(name)] = label(name)
    return out


def _loss_spec(cfg: Mapping) -> LossSpec:
    loss, data = cfg["loss"], cfg["data"]
    return get_loss(loss["name"], per_model_labels=data["per_model_labels"] or data["order"] != "shared",
                    **{k: v for k, v in loss.items() if k != "name"})


@dataclass(frozen=True)
class RunPlan:
    """A run of an array of B models, its settings validated and every per-model one a tuple of B: what a run
    (``training/``) reads. Made by ``TrainConfig.plan(B)``; nothing here is checked again."""

    B: int
    steps: int | None
    epochs: int | None
    batch_size: int
    loss: str
    loss_options: Mapping[str, Any]
    per_model_labels: bool
    optimizer: str
    hyper: Mapping[str, tuple]  # each of the optimizer's hyper-parameters, one value per model
    clip_grad_norm: tuple[float | None, ...]  # None: that model's gradient is not clipped
    schedules: tuple[Mapping[str, Any], ...]  # each model's schedule, with every parameter
    models: tuple[Mapping[str, Any], ...]  # each model's grid point ({} without a grid)
    shuffle: bool
    seed: int
    data_order: str
    eval_every: int
    eval_batch_size: int
    eval_fraction: float
    checkpoint_every: int
    keep_checkpoints: int
    on_diverge: str
    keep_best: str | None  # as given; the run's plan (prepare.validate) has the metric kept by, None for none
    halving: tuple[int, ...]
    halving_keep: float
    device: Device
    runtime: str
    threads: int
    compile: str
    precision: str
    loss_scale: tuple[float, ...]  # each model's initial loss scale (fp16)
    loss_scale_growth: float
    loss_scale_backoff: float
    loss_scale_interval: int
    log_every: int
    verify_steps: int
    allow_nonfinite_data: bool
    record: Mapping[str, Any]  # the settings as given (TrainConfig.as_dict())

    @classmethod
    def of(cls, cfg: Mapping, B: int, record: Mapping[str, Any]) -> "RunPlan":
        """The plan of ``cfg``, normalized and expanded to B models (``expand_per_model``)."""
        flat = flat_settings(cfg)
        run = {s.name: flat[s.name] for s in RUN_SETTINGS
               if s.name not in ("clip_grad_norm", "halving", "device", "loss_scale")}
        opt = cfg["optimizer"]
        return cls(B=B, **run, loss_options={k: v for k, v in cfg["loss"].items() if k != "name"},
                   hyper={k: per_model(v) for k, v in opt.items() if k != "name"},
                   clip_grad_norm=per_model(cfg["clip_grad_norm"]), loss_scale=per_model(cfg["loss_scale"]),
                   schedules=tuple(cfg["schedule"]),
                   models=tuple(cfg["models"]), halving=tuple(cfg["halving"]), device=cfg["device"],
                   record=dict(record))

    def as_dict(self) -> dict:
        """The settings as given: what a checkpoint records and the settings hash reads."""
        return dict(self.record)

    def differing(self) -> dict[str, list]:
        """Every per-model setting whose value differs between the models, by its ``TrainConfig`` name (a
        schedule's parameter as ``schedule.<name>``), one JSON value per model: the columns that tell the models
        apart in ``train``'s table, ``report`` and report.json."""
        columns: dict[str, Sequence] = {**self.hyper, "clip_grad_norm": self.clip_grad_norm}
        if self.precision == "fp16":
            columns["loss_scale"] = self.loss_scale
        columns["schedule"] = [s.get("name") for s in self.schedules]
        for name in dict.fromkeys(k for s in self.schedules for k in s if k != "name"):
            columns[f"schedule.{name}"] = [s.get(name) for s in self.schedules]
        plain = {k: [_plain(list(x) if isinstance(x, tuple) else x) for x in v] for k, v in columns.items()}
        return {k: v for k, v in plain.items() if any(x != v[0] for x in v)}

    def optimizer_config(self) -> OptimizerConfig:
        return optimizer_config(self.optimizer, self.hyper, self.clip_grad_norm)

    def loss_scale_config(self) -> LossScale | None:
        """fp16's per-model loss scaling (None in another precision)."""
        if self.precision != "fp16":
            return None
        return LossScale(tuple(float(v) for v in self.loss_scale), self.loss_scale_growth, self.loss_scale_backoff,
                         self.loss_scale_interval)

    def loss_spec(self) -> LossSpec:
        return get_loss(self.loss, per_model_labels=self.per_model_labels or self.data_order != "shared",
                        **self.loss_options)
