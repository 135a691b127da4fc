"""``TrainConfig``: every setting of a run, checked where it is given; and ``RunSettings``: the same settings made
for one array of B models, on this machine, with its data: the one object a run reads.

Neither lists a setting: their fields are made from the one declaration (``settings.RUN_SETTINGS`` and the
registered optimizers' hyper-parameters) by :func:`_declared`. Every way of giving settings goes through the one
validation, ``config.normalize_config``:

    onnxfuse train --lr 0.1,0.01     argv -> the flags as a mapping (cli/train_flags.py), over --config's -> run_config
    TrainConfig(lr=[0.1, 0.01])      arguments -> settings.raw_from_flat -> normalize_config
    a resumed run                    its recorded settings, the flags over them -> TrainConfig.resumed
    a sweep's array                  the spec with the array's values -> TrainConfig.from_config (shipped to the worker)

``train_array`` makes the run's ``RunSettings`` once (:meth:`TrainConfig.for_array`, ``training/prepare.py``):
every per-model value a tuple of B, "no clipping" None, the runtime chosen (``auto`` resolved on the device), the
metric best states are kept by, and the batch size a DataLoader gives; nothing below checks a setting again.
``TrainConfig.as_dict()`` is the settings as given: the record run.json, a checkpoint and a sweep's plan hold and
the settings hash reads (unchanged, so that runs written before resume); ``RunSettings.record`` is the run's.
An optimizer registered after this module was imported has its hyper-parameters in ``TrainConfig.extra`` (read as
attributes, ``config.rho``).
"""
from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

import numpy as np

from onnxfuse.core.array import ArrayDir
from onnxfuse.core.errors import ConfigError

from onnxfuse.recipe.config import check_held_out, expand_per_model, normalize_config, read_config_file
from onnxfuse.recipe.device import Device
from onnxfuse.recipe.losses import LossSpec, get_loss
from onnxfuse.recipe.optim import UpdateRule, max_norms, per_model
from onnxfuse.recipe.ranking import kept_metric
from onnxfuse.recipe.runtimes import LossScale
from onnxfuse.recipe.schedules import moves_momentum
from onnxfuse.recipe.settings import (RUN_SETTINGS, Origins, flag_of, flat_default, flat_settings, get_dotted,
                                      hyper_params, merge_raw, raw_from_flat, raw_key)

__all__ = ["TrainConfig", "RunSettings", "run_config", "as_train_config"]

PerModel = Union[Any, Sequence[Any]]  # one value for every model, or a list with one per model


def _declared(defaults: bool) -> Callable[[type], type]:
    """A frozen dataclass of ``cls`` with a field per declared setting before the fields its body declares: each
    run setting of ``RUN_SETTINGS`` and, with ``defaults`` (the settings as given), each hyper-parameter of the
    optimizers registered now, with their defaults. The one list of settings is the declaration."""
    def make(cls: type) -> type:
        declared = {s.name: s.param.default for s in RUN_SETTINGS}
        if defaults:
            declared.update({name: flat_default(name) for name in hyper_params()})
        own = dict(cls.__dict__.get("__annotations__", {}))
        cls.__annotations__ = {**{name: Any for name in declared}, **own}
        for name, default in declared.items() if defaults else ():
            setattr(cls, name, default)
        return dataclass(frozen=True, init=not defaults)(cls)
    return make


def _plain(v: Any) -> Any:
    """numpy values as Python's, a Device as its text (what a record holds: JSON)."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, Device):
        return str(v)
    return v


@_declared(defaults=True)
class TrainConfig:
    """Everything a run takes (``onnxfuse train --help`` says each; its fields are the declared settings, with their
    defaults): a per-model value is one value for every model or a list with one per model; ``device`` is a
    ``Device`` (given as its text). Checked when made (one ConfigError line naming the argument and the config
    key, e.g. ``TrainConfig(lr=...): optimizer.lr[1] = -1 must be finite and >= 0``)."""

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
        self._set(settings, cfg, Origins("", named), explicit=explicit)

    # ---- the other ways to make one
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        return cls(**d)

    @classmethod
    def from_config(cls, cfg: dict, where: Origins | None = None, explicit: Iterable[str] | None = None
                    ) -> "TrainConfig":
        """The settings of a config validated already (``normalize_config``: a file, flags merged over it), its
        per-model values perhaps expanded to B already (``expand_per_model``; a grid needs it). ``where`` says
        where its values came from, for the messages of a later expansion; ``explicit``: the settings the config
        sets (None: not known, each counts as set; see :meth:`given`)."""
        self = object.__new__(cls)
        self._set(flat_settings(cfg), cfg, where or Origins(), held_out=True, explicit=explicit)
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
        self._set({**own, **overrides}, cfg, where, explicit=overrides)
        return self

    def _set(self, given: Mapping[str, Any], cfg: dict, where: Origins, held_out: bool = False,
             explicit: Iterable[str] | None = None) -> None:
        """The fields from ``given`` (as given; the device as the one parsed), and what a run's settings are made
        from: ``cfg`` (normalized), where its values came from, whether the rules about held-out data were checked
        (a config file says its data), and the settings given (None: not known)."""
        values = {f.name: f.default_factory() if f.default_factory is not MISSING else f.default
                  for f in fields(self) if f.name != "extra"}
        extra = {name: flat_default(name) for name in hyper_params() if name not in values}
        for k, v in given.items():
            if k in values:
                values[k] = _plain(v)
            else:  # raw_from_flat refused any other name
                extra[k] = _plain(v)
        values["device"] = cfg["device"]
        for k, v in values.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "extra", extra)
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "_where", where)
        object.__setattr__(self, "_held_out", held_out)
        object.__setattr__(self, "_explicit", None if explicit is None else frozenset(explicit))

    def __getattr__(self, name: str) -> Any:  # a later-registered optimizer's hyper-parameter
        extra = self.__dict__.get("extra") or {}
        if name in extra:
            return extra[name]
        raise AttributeError(f"'TrainConfig' object has no attribute '{name}'")

    # ---- what a run is made from
    def given(self, name: str) -> bool:
        """Whether setting ``name`` was given (an argument, a flag, a config file's key, a resumed run's override)
        rather than left at its default: a run whose DataLoader has its own batch size takes that one when
        ``batch_size`` was not given. True when not known (settings made from a normalized config alone)."""
        return self._explicit is None or name in self._explicit

    def as_dict(self) -> dict:
        """Every setting by name, as given (what a checkpoint records and the settings hash reads)."""
        return {**{f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "extra"}, **self.extra}

    def for_array(self, B: int, has_eval: bool | None = None, runtime: str | None = None,
                  batch_size: int | None = None) -> "RunSettings":
        """The settings of a run of an array of B models: ``has_eval``, whether the run has eval data (the rules
        about held-out data, and the metric best states are kept by; None: not known, ``keep_best`` as given);
        ``runtime``, the runtime chosen for it (``runtime.trainers.resolve_runtime``; None: as given);
        ``batch_size``, its DataLoader's, when that is the run's (None: the setting's)."""
        cfg = self._cfg if len(self._cfg.get("models", ())) == B else expand_per_model(self._cfg, B, self._where)
        if has_eval is not None and not self._held_out:
            check_held_out(cfg, has_eval, self._where)
        keep_best = cfg["keep_best"] if has_eval is None else \
            kept_metric(cfg["keep_best"], has_eval or cfg["data"]["eval_fraction"] > 0)
        record = self.as_dict() if batch_size is None else {**self.as_dict(), "batch_size": batch_size}
        return RunSettings.of(cfg, B, record, runtime=runtime or cfg["runtime"], keep_best=keep_best,
                              batch_size=batch_size or cfg["batch_size"])

    def differing(self, B: int) -> dict[str, list]:
        """The per-model settings whose value differs between the B models (:meth:`RunSettings.differing`)."""
        return self.for_array(B).differing()

    def loss_spec(self) -> LossSpec:
        loss, data = self._cfg["loss"], self._cfg["data"]
        return get_loss(loss["name"], per_model_labels=data["per_model_labels"] or data["order"] != "shared",
                        **{k: v for k, v in loss.items() if k != "name"})


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
               config_file: str | os.PathLike | None = None
               ) -> tuple[TrainConfig, str | None, str | None, dict | None]:
    """The run of ``onnxfuse train``/``check`` on the array in ``array_dir``: ``given`` (a config mapping: the
    flags; ``named`` says which flag gave which key) over ``config_file``'s mapping, validated as one and expanded
    to the array's B models (a grid needs them); the run's training and eval data; and the file's ``model``
    section when ``array_dir`` holds no array yet (the caller builds it there: ``exporters.build_array``; its
    ``count`` is the array's B), else None. Nothing is written."""
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
    array = ArrayDir(array_dir)
    build = cfg["model"] if cfg["model"] and not os.path.exists(array.fused_path) else None
    if build is None:
        array.check_exists()
    B = build["count"] if build is not None else array.load_spec().B
    cfg = expand_per_model(cfg, B, where)
    explicit = [s.name for s in RUN_SETTINGS if get_dotted(raw, s.path) is not None]
    return TrainConfig.from_config(cfg, where, explicit), cfg["data"]["train"], cfg["data"]["eval"], build


def _named(settings: Mapping[str, Any], label) -> dict[str, str]:
    """{config key: how the setting was given} for the flat ``settings``, e.g. {"optimizer.lr": "--lr"}."""
    out = {}
    for name, v in settings.items():
        if name == "loss_options" and isinstance(v, Mapping):
            out.update({f"loss.{k}": label(f"loss_options.{k}") for k in v})
        else:
            out[raw_key(name)] = label(name)
    return out


@_declared(defaults=False)
class RunSettings(UpdateRule):
    """A run of an array of B models, its settings validated and made for it (:meth:`TrainConfig.for_array`): a
    field per declared run setting, each per-model one a tuple of B (``clip_grad_norm``: None for a model not
    clipped; ``loss_scale``: each model's initial fp16 scale), ``halving`` a tuple, ``device`` a ``Device``,
    ``runtime`` the one chosen, ``keep_best`` the metric best states are kept by (None: none), ``batch_size`` the
    one the steps train with. What a run (``training/``) reads, and the update rule its trainer builds the update
    graph from (``optim.UpdateRule``: the optimizer, each model's hyper-parameters and clipping); nothing here is
    checked again."""

    B: int
    loss_options: Mapping[str, Any]
    hyper: Mapping[str, tuple]  # each of the optimizer's hyper-parameters, one value per model
    schedules: tuple[Mapping[str, Any], ...]  # each model's schedule, with every parameter
    models: tuple[Mapping[str, Any], ...]  # each model's grid point ({} without a grid)
    record: Mapping[str, Any]  # the settings as given (TrainConfig.as_dict()), the run's batch size in it

    @classmethod
    def of(cls, cfg: Mapping, B: int, record: Mapping[str, Any], runtime: str, keep_best: str | None,
           batch_size: int) -> "RunSettings":
        """The settings of ``cfg``, normalized and expanded to B models (``expand_per_model``)."""
        flat = flat_settings(cfg)
        run = {s.name: flat[s.name] for s in RUN_SETTINGS}
        run.update(clip_grad_norm=per_model(cfg["clip_grad_norm"]), loss_scale=per_model(cfg["loss_scale"]),
                   halving=tuple(cfg["halving"]), device=cfg["device"], runtime=runtime, keep_best=keep_best,
                   batch_size=batch_size)
        opt = cfg["optimizer"]
        return cls(B=B, **run, loss_options={k: v for k, v in cfg["loss"].items() if k != "name"},
                   hyper={k: per_model(v) for k, v in opt.items() if k != "name"},
                   schedules=tuple(cfg["schedule"]), models=tuple(cfg["models"]), record=dict(record))

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

    # ---- the update rule (optim.UpdateRule): what the update graph reads, the run's own values
    @property
    def kind(self) -> str:
        return self.optimizer

    @property
    def max_norm(self) -> list[float]:
        return max_norms(self.clip_grad_norm)

    @property
    def momentum_varies(self) -> bool:
        return moves_momentum(self.schedules)

    def loss_scale_config(self) -> LossScale | None:
        """fp16's per-model loss scaling (None in another precision)."""
        if self.precision != "fp16":
            return None
        return LossScale(tuple(float(v) for v in self.loss_scale), self.loss_scale_growth, self.loss_scale_backoff,
                         self.loss_scale_interval)

    def loss_spec(self) -> LossSpec:
        return get_loss(self.loss, per_model_labels=self.per_model_labels or self.data_order != "shared",
                        **self.loss_options)
