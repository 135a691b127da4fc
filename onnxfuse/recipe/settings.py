"""Every training setting, declared once: its type, default, range, whether it may differ per model, and its help.

Everything else is derived from these declarations:

- the one validation of a run's settings, :func:`normalize_config`: a config file's mapping, the same mapping
  with flags merged over it (:func:`flags_to_raw`, :func:`merge_raw`), and ``TrainConfig``'s arguments
  (:func:`raw_from_flat`) all go through it, so every rule holds whichever way a value is given;
- ``TrainConfig`` (``train_config.py``): the flat settings of a run (its fields are checked against
  :data:`RUN_SETTINGS` and the registered optimizers' hyper-parameters by a test), and the run's plan;
- the flags of ``onnxfuse train`` / ``check`` (:func:`add_flags`), which are also the overrides of a resumed run;
- the error messages: one :class:`ConfigError` line naming the key (``optimizer.lr[1] = nan must be ...``),
  begun by where the value came from (``run.yaml: ``, ``--lr: ``: :class:`Origins`), made in one place
  (:func:`_message`).

Optimizers and schedules are registered once each, next to their maths: ``optim.py`` calls
:func:`register_optimizer` with an :class:`OptimizerSpec` (its hyper-parameters as :class:`Param` s),
``schedules.py`` decorates each torch scheduler builder with :func:`register_schedule`. The CLI's choices, the
config schema, placement's optimizer choices and the grid's per-model keys all read :data:`OPTIMIZERS` and
:data:`SCHEDULES`.

Values are validated by pydantic (v2): each :class:`Kind` below is a pydantic type plus how a command line writes
it; a :class:`Param` is a named, documented setting of a kind.
"""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Annotated, Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
from pydantic import (AfterValidator, BeforeValidator, Discriminator, Field, Strict, Tag, TypeAdapter, ValidationError,
                      ValidationInfo, WrapValidator)
from pydantic_core import PydanticCustomError

from onnxfuse.core.errors import ConfigError
from onnxfuse.exporters.factory import factory_args, model_inputs

from onnxfuse.recipe.datasets import NAMED_DATASETS, is_data_factory, is_named
from onnxfuse.recipe.device import DEVICE_TAKES, Device
from onnxfuse.recipe.losses import LOSSES
from onnxfuse.recipe.ranking import EVAL_METRICS, KEEP_BEST_CHOICES, OFF
from onnxfuse.recipe.runtimes import COMPILE_CHOICES, PRECISIONS, LossScale, RUNTIME_CHOICES, RUNTIMES

__all__ = ["Kind", "Param", "OptimizerSpec", "ScheduleSpec", "OPTIMIZERS", "SCHEDULES", "register_optimizer",
           "register_schedule", "RUN_SETTINGS", "LOSS_PARAMS", "RESUMABLE", "real", "integer", "BOOL", "choice",
           "pair", "step_list", "text", "DEVICE", "CLIP", "check_value", "check_model_value", "check_schedule_entry",
           "check_halving", "check_held_out", "Origins", "normalize_config", "per_model_keys", "is_per_model_list",
           "add_flags", "flags_to_raw", "flag_of", "merge_raw", "raw_from_flat", "raw_to_flat", "flat_settings",
           "raw_key", "hyper_params", "flat_default", "set_dotted", "get_dotted", "REQUIRED"]

REQUIRED: Any = object()  # a parameter without a default (a schedule's step_size)


# ------------------------------------------------------------------------------------------------ the vocabulary
@dataclass(frozen=True)
class Kind:
    """A type of setting: what pydantic validates (``annotation``) and how a command line writes one value
    (``parse``: str -> value; None for a switch, a bool)."""

    annotation: Any
    parse: Callable[[str], Any] | None = float
    choices: Callable[[], Sequence[str]] | None = None  # called when a parser is built: registries grow
    metavar: str | None = None


def _phrase(text: str | Callable[[str], str]) -> WrapValidator:
    """Reword a failed check as one phrase about the whole value ("must be finite and in [0, 1)"), in the style
    asked for through the validation context ("file": key = value ...; "flag": --key ..., got value)."""
    def wrap(value: Any, handler: Callable, info: ValidationInfo) -> Any:
        try:
            return handler(value)
        except ValidationError as e:
            kind = e.errors()[0]["type"]
            style = (info.context or {}).get("style", "flag")
            msg = "is not a number" if kind in ("float_parsing", "float_type") else \
                (text(style) if callable(text) else text)
            raise PydanticCustomError("setting", msg.replace("{", "{{").replace("}", "}}")) from None
    return WrapValidator(wrap)


def _not_bool(v: Any) -> Any:
    # pydantic reads True as 1.0; a boolean where a number belongs is a mistake
    if isinstance(v, (bool, np.bool_)):
        raise PydanticCustomError("float_type", "is not a number")
    return v


def _plain_int(v: Any) -> Any:
    return int(v) if isinstance(v, np.integer) else v


def _plain_bool(v: Any) -> Any:
    return bool(v) if isinstance(v, np.bool_) else v


def _bounds(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    lo, lo_open = (gt, True) if gt is not None else (ge, False)
    hi, hi_open = (lt, True) if lt is not None else (le, False)
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo:g}" if lo is not None else "a number"
    return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def real(ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
         finite: bool = True) -> Kind:
    """A real number in the given bounds (``finite=False``: inf allowed, e.g. "no clipping"). Numeric strings
    are accepted: YAML 1.1 reads ``1e-3`` (no dot) as a string."""
    where = _bounds(ge, gt, le, lt)
    said = f"finite and {where}" if finite else where
    ann = Annotated[float, Field(ge=ge, gt=gt, le=le, lt=lt, allow_inf_nan=not finite), BeforeValidator(_not_bool),
                    _phrase(f"must be {said}")]
    return Kind(ann, float)


def integer(ge: int | None = None) -> Kind:
    """An integer (not a bool, not 2.0, not "2") of at least ``ge``."""
    def said(style: str) -> str:
        if style == "flag" and ge is not None:
            return f"must be an integer >= {ge}"
        return "must be " + {None: "an integer", 1: "a positive integer"}.get(ge, f"an integer >= {ge}")
    ann = Annotated[int, BeforeValidator(_plain_int), Strict(), Field(ge=ge), _phrase(said)]
    return Kind(ann, int)


BOOL = Kind(Annotated[bool, BeforeValidator(_plain_bool), Strict(), _phrase("must be true or false")], None)


def choice(names: Callable[[], Sequence[str]] | Sequence[str]) -> Kind:
    """One of ``names`` (a callable for a registry, read at each validation so that a registration counts)."""
    get = names if callable(names) else (lambda: tuple(names))

    def check(v: Any) -> str:
        if not isinstance(v, str) or v not in get():
            raise PydanticCustomError("setting", "must be one of: " + ", ".join(get()))
        return v
    return Kind(Annotated[Any, BeforeValidator(check)], str, choices=get)


def text(check: Callable[[str], bool], said: str) -> Kind:
    """A string ``check`` accepts (``said``: what is allowed)."""
    def validate(v: Any) -> str:
        if not isinstance(v, str) or not check(v):
            raise PydanticCustomError("setting", f"must be {said}")
        return v
    return Kind(Annotated[Any, BeforeValidator(validate)], str)


def pair(element: Kind, said: str) -> Kind:
    """Two values, written ``a,b`` on a command line (Adam's betas)."""
    ann = Annotated[list[element.annotation], Field(min_length=2, max_length=2), _phrase(f"must be {said}")]
    return Kind(ann, lambda s: [float(x) for x in s.split(",")], metavar="A,B")


def _increasing(v: list[int]) -> list[int]:
    if any(b <= a for a, b in zip(v, v[1:])):
        raise ValueError("not increasing")
    return v


def step_list(non_empty: bool) -> Kind:
    """Strictly increasing step numbers (>= 1), written ``a,b,c`` on a command line."""
    said = "a non-empty list of strictly increasing step numbers >= 1" if non_empty else \
        "strictly increasing step numbers >= 1, e.g. [200, 400]"
    step = Annotated[int, BeforeValidator(_plain_int), Strict(), Field(ge=1)]
    ann = Annotated[list[step], Field(min_length=1 if non_empty else 0), BeforeValidator(
        lambda v: list(v) if isinstance(v, tuple) else v), WrapValidator(lambda v, h: _increasing(h(v))),
        _phrase(f"must be {said}")]
    return Kind(ann, lambda s: [int(x) for x in s.split(",")], metavar="T1,T2,...")


@dataclass(frozen=True)
class Param:
    """A named setting: its kind, default (:data:`REQUIRED`: none), help, and whether it may differ per model."""

    name: str
    kind: Kind
    default: Any = None
    help: str = ""
    per_model: bool = False

    def with_default(self, default: Any) -> "Param":
        return replace(self, default=default)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def is_per_model_list(name: str, v: Any) -> bool:
    """A list giving one value per model (for a pair such as betas: a list of pairs, one pair being one value)."""
    if not isinstance(v, (list, tuple, np.ndarray)):
        return False
    if name.endswith("betas"):
        return len(v) > 0 and all(isinstance(x, (list, tuple)) for x in v)
    return True


def _annotation(p: Param, optional: bool = False) -> Any:
    ann = p.kind.annotation
    if p.per_model and p.default is None:  # None is a value of its own for a model (clip_grad_norm: off)
        ann = Optional[ann]
    if p.per_model:
        as_list = lambda v: v.tolist() if isinstance(v, np.ndarray) else v  # noqa: E731
        either = Annotated[Union[Annotated[ann, Tag("one")], Annotated[list[ann], Field(min_length=1), Tag("each")]],
                           Discriminator(lambda v: "each" if is_per_model_list(p.name, v) else "one")]
        ann = Annotated[either, BeforeValidator(as_list)]
    return Optional[ann] if optional else ann


@lru_cache(maxsize=None)
def _adapter(p: Param, optional: bool) -> TypeAdapter:
    return TypeAdapter(_annotation(p, optional))


# ------------------------------------------------------------------------------------------------ the messages
def _show(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def _fail(msg: str) -> ConfigError:
    return ConfigError(" ".join(msg.split()))


def _message(e: ValidationError, key: str, style: str, where: str = "") -> ConfigError:
    """The first problem of a pydantic error as one line: ``key[i] = value must be ...`` (file style) or
    ``--key must be ..., got value`` (flag style, for flags and the Python API)."""
    err = e.errors()[0]
    for part in err["loc"]:
        if isinstance(part, int) and style == "file":  # the index in a per-model list; tags are names
            key += f"[{part}]"
    value = err.get("input")
    msg = err["msg"]
    if err["type"] == "too_short":
        msg = "is an empty list; give one value, or one per model"
    elif err["type"] == "missing":
        return _fail(f"{where}{key} is missing")
    elif err["type"] != "setting":
        msg = f"is not valid ({msg})"
    if style == "file":
        return _fail(f"{where}{key} = {_show(value)} {msg}")
    return _fail(f"{where}{key} {msg}, got {_show(value)}")


def check_value(p: Param, value: Any, key: str | None = None, style: str = "flag", where: str = "",
                optional: bool = False) -> Any:
    """``value`` validated as ``p`` (a per-model parameter: one value or a list of them); one ConfigError line
    naming ``key`` (default: the flag) otherwise."""
    try:
        return _adapter(p, optional).validate_python(value, context={"style": style})
    except ValidationError as e:
        raise _message(e, key or p.flag, style, where) from None


# ------------------------------------------------------------------------------------------------ the registries
@dataclass
class OptimizerSpec:
    """An optimizer's declaration: its hyper-parameters (with torch.optim's defaults) and a rule tying
    hyper-parameters of one model together (returns a problem, or None). What is registered is a subclass that
    adds its maths, ``optim.Optimizer`` (``optim.py``); placement plans memory by its state buffers."""

    name: str
    params: tuple[Param, ...]
    help: str = ""
    check: Callable[[dict], str | None] | None = None

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


@dataclass
class ScheduleSpec:
    """A learning-rate schedule: its parameters and ``build(lr_scheduler, optimizer, spec, steps)``, which returns
    torch's scheduler (None: constant) for one model; ``spec`` has every parameter (defaults filled, None for a
    derived one)."""

    name: str
    params: tuple[Param, ...]
    build: Callable
    help: str = ""

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


OPTIMIZERS: dict[str, OptimizerSpec] = {}
SCHEDULES: dict[str, ScheduleSpec] = {}


def register_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    """Add an optimizer (an ``optim.Optimizer``: hyper-parameters and maths): the CLI, config files, the trainer
    and placement accept it from then on."""
    if not callable(getattr(spec, "emit", None)):
        raise TypeError(f"optimizer '{spec.name}': register an onnxfuse.recipe.optim.Optimizer subclass, which "
                        "carries the update maths with the hyper-parameters")
    OPTIMIZERS[spec.name] = spec
    return spec


def register_schedule(name: str, params: Sequence[Param] = (), help: str = "") -> Callable:
    """Decorator: ``build`` becomes the schedule ``name`` with ``params``."""
    def add(build: Callable) -> Callable:
        SCHEDULES[name] = ScheduleSpec(name, tuple(params), build, help)
        return build
    return add


def _all_params(specs: Iterable) -> dict[str, Param]:
    """Each parameter name once, as first declared (a shared one, such as lr, is the same Param)."""
    out: dict[str, Param] = {}
    for s in specs:
        for p in s.params:
            out.setdefault(p.name, p)
    return out


# ------------------------------------------------------------------------------------------------ run settings
@dataclass(frozen=True)
class Setting:
    """A setting of a run: ``param`` plus where a config file keeps it (``path``, dotted; "" = not in a file),
    its flag ("" = derived from the name, None = none) and whether a resumed run may change it."""

    param: Param
    path: str
    flag: str | None = ""
    resumable: bool = False

    @property
    def name(self) -> str:
        return self.param.name

    @property
    def cli(self) -> str | None:
        return self.param.flag if self.flag == "" else self.flag


_POS, _NONNEG = integer(ge=1), integer(ge=0)
LOSS_PARAMS = (  # TrainConfig.loss_options
    Param("label_smoothing", real(ge=0.0, le=1.0), 0.0, "cross-entropy label smoothing in [0, 1]"),
    Param("ignore_index", integer(), -100, "cross-entropy / nll: labels with this value count for nothing"),
    Param("class_axis", integer(), 1, "class axis of the output: 1 for [N, C, ...], -1 for [N, T, V] language models"),
)
ORDERS = ("shared", "per-model", "shards")


def _device(v: Any) -> Device:
    # the one parse of a device's text (a Device given is one already)
    if isinstance(v, Device):
        return v
    try:
        return Device.parse(v)
    except ConfigError:
        raise PydanticCustomError("setting", f"must be {DEVICE_TAKES}") from None


DEVICE = Kind(Annotated[Any, BeforeValidator(_device)], str)


def _no_limit(v: Any) -> Any:
    # "no clipping" has one form from here on: None (a file's .inf / null, a flag's inf)
    return None if v == float("inf") else v


# clip_grad_norm: > 0, or inf / null for no clipping
CLIP = Kind(Annotated[real(gt=0.0, finite=False).annotation, AfterValidator(_no_limit)], float)


# the run's settings besides the optimizer's hyper-parameters and the schedule, in the order a config file lists
# them (TrainConfig's fields, the flags of `onnxfuse train` and config keys are all made from this table)
RUN_SETTINGS: tuple[Setting, ...] = (
    Setting(Param("steps", _POS, None, "optimizer steps (or --epochs)"), "steps", resumable=True),
    Setting(Param("epochs", _POS, None, "passes over the data (or --steps)"), "epochs", resumable=True),
    Setting(Param("batch_size", _POS, 32, "samples per model per step"), "batch_size"),
    Setting(Param("loss", choice(lambda: tuple(LOSSES)), "cross-entropy",
                  "cross-entropy / nll: labels are class indices; mse, l1, bce-with-logits: targets shaped like the "
                  "output; model: the output is the loss (no labels)"), "loss.name"),
    Setting(Param("per_model_labels", BOOL, False, "'labels' in the data file is [B, n, ...]: one set of labels "
                  "per model"), "data.per_model_labels"),
    Setting(Param("optimizer", choice(lambda: tuple(OPTIMIZERS)), "sgd", "optimizer (torch.optim semantics)"),
            "optimizer.name"),
    Setting(Param("clip_grad_norm", CLIP, None, "clip each model's gradient norm to this "
                  "(inf or null: no clipping)", per_model=True), "clip_grad_norm"),
    Setting(Param("shuffle", BOOL, True, "reshuffle the batches every epoch, with --seed; off, they come in file "
                  "order"),
            "data.shuffle"),
    Setting(Param("seed", _NONNEG, 0, "shuffling and hold-out seed"), "data.seed"),
    Setting(Param("data_order", choice(ORDERS), "shared", "shared batches, an own shuffle per model, or shard b "
                  "for model b"), "data.order"),
    Setting(Param("eval_every", _NONNEG, 0, "evaluate every K steps (0: at the end only)"), "eval_every",
            resumable=True),
    Setting(Param("eval_batch_size", _POS, 256, "evaluation batch size"), "eval_batch_size", resumable=True),
    Setting(Param("eval_fraction", real(ge=0.0, lt=1.0), 0.0, "hold out this fraction of --data for evaluation"),
            "data.eval_fraction"),
    Setting(Param("checkpoint_every", _NONNEG, 0, "write a checkpoint every K steps (0: never)"), "checkpoint_every",
            resumable=True),
    Setting(Param("keep_checkpoints", _POS, 2, "how many checkpoints to keep"), "keep_checkpoints", resumable=True),
    Setting(Param("on_diverge", choice(("freeze", "stop")), "freeze", "a model whose loss or update is not "
                  "finite: freeze it or stop the run"), "on_diverge"),
    Setting(Param("keep_best", choice(KEEP_BEST_CHOICES), None, "keep each model's best state by this metric "
                  "(checked at every evaluation) beside its final one, for split --which best: eval_loss, "
                  "eval_accuracy or off (default: eval_loss when the run has eval data, else off)"), "keep_best",
            resumable=True),
    Setting(Param("halving", step_list(non_empty=False), None, "steps at which successive halving keeps the best "
                  "--halving-keep of the models by eval loss"), "halving"),
    Setting(Param("halving_keep", real(gt=0.0, lt=1.0), 0.5, "fraction kept at each halving"), "halving_keep"),
    Setting(Param("device", DEVICE, "cpu", "cpu or cuda[:id]"), "device",
            resumable=True),
    Setting(Param("runtime", choice(RUNTIME_CHOICES), "auto", "what trains the fused graph: " + ", ".join(
        f"{r.name} ({r.help})" for r in RUNTIMES.values()) + ", auto (the first of these that can run on the device)"),
        "runtime"),
    Setting(Param("threads", _NONNEG, 0, "CPU threads of the runtime (0: 1 for torch, whose OpenMP threads slow "
                  "down many-fold when another process holds a core; onnxruntime's default for ort); not resumable: the "
                  "thread count can change how reductions round"), "threads"),
    Setting(Param("compile", choice(COMPILE_CHOICES), "auto", "capture the torch runtime's whole step with "
                  "torch.compile: on, off, or auto (compile when the run is long enough for the measured compile "
                  "time to pay off; it says what it decided)"), "compile", resumable=True),
    Setting(Param("precision", choice(PRECISIONS), "fp32", "the forward and backward under torch.autocast in bf16 "
                  "or fp16 (weights, optimizer state, BatchNorm statistics and the update stay fp32; fp16 with a "
                  "loss scale per model), or fp32 throughout"), "precision"),
    Setting(Param("loss_scale", real(gt=0.0), LossScale.INIT, "fp16: each model's initial loss scale "
                  "(torch.amp.GradScaler's init_scale)", per_model=True), "loss_scale"),
    Setting(Param("loss_scale_growth", real(gt=1.0), LossScale.growth, "fp16: a model's scale is multiplied by "
                  "this after --loss-scale-interval steps without overflow (GradScaler's growth_factor)"),
            "loss_scale_growth"),
    Setting(Param("loss_scale_backoff", real(gt=0.0, lt=1.0), LossScale.backoff, "fp16: a model's scale is "
                  "multiplied by this at a step whose gradient overflows, and that model's step is skipped "
                  "(GradScaler's backoff_factor)"), "loss_scale_backoff"),
    Setting(Param("loss_scale_interval", _POS, LossScale.interval, "fp16: steps without overflow before a model's "
                  "scale grows (GradScaler's growth_interval)"), "loss_scale_interval"),
    Setting(Param("log_every", _POS, 1, "write training metrics (and read the losses back from the device) every K "
                  "steps"), "log_every", resumable=True),
    Setting(Param("verify_steps", _NONNEG, 1, "before training, check the first K steps of every model against "
                  "the model trained alone on the same runtime (0: skip; a resumed run skips it)"), "verify_steps",
            resumable=True),
    Setting(Param("allow_nonfinite_data", BOOL, False, "train on data with NaN or inf in its inputs or float labels "
                  "(by default that is an error naming the first such value)"), "allow_nonfinite_data",
            resumable=True),
)
_RUN = {s.name: s for s in RUN_SETTINGS}
# fp16's loss scaling: these settings do nothing in another precision, so giving one there is refused
FP16_ONLY = tuple(s.name for s in RUN_SETTINGS if s.name.startswith("loss_scale"))
# settings a resumed run may change: how long it runs, what it logs and checks, where it runs; every other setting
# decides what a step computes, and a run resumed with another value would not be the run its checkpoint began
RESUMABLE = tuple(s.name for s in RUN_SETTINGS if s.resumable)


@dataclass(frozen=True)
class Origins:
    """Where the values of a config mapping came from, for the start of a message: a file (``source``, "" for
    none) and, by dotted key, the values given some other way (``named``: ``{"optimizer.lr": "--lr"}`` for flags,
    ``TrainConfig(lr=...)`` for the Python API). ``base_dir``: the folder a file's relative paths are relative to
    (a flag's path is relative to where the command runs)."""

    source: str = ""
    named: Mapping[str, str] = field(default_factory=dict)
    base_dir: str | None = None

    def __call__(self, *keys: str) -> str:
        """The start of a message about ``keys``: the flags (or arguments) that gave them, and the file for the
        rest, e.g. ``"--momentum: "``, ``"--eval-data, run.yaml: "`` or ``""``."""
        names, from_file = [], not keys
        for key in keys:
            name = self._name(re.sub(r"\[\d+\]", "", key))
            if name is None:
                from_file = True
            elif name not in names:
                names.append(name)
        parts = names + ([self.source] if from_file and self.source else [])
        return ", ".join(parts) + ": " if parts else ""

    def _name(self, key: str) -> str | None:
        """How ``key`` or the section holding it was given (``schedule``: all of a schedule), None: the file."""
        while key:
            if key in self.named:
                return self.named[key]
            key = key.rpartition(".")[0]
        return None

    def base(self, key: str) -> str | None:
        return None if self._name(key) is not None else self.base_dir


def _at(where: str | Origins, *keys: str) -> str:
    return where(*keys) if callable(where) else where


def check_halving(halving: Sequence[int] | None, total: int, style: str = "flag", where: str = "") -> None:
    """Halving steps must come before the last step (a halving after it would train nothing)."""
    if halving and halving[-1] >= total:
        name = "halving" if style == "file" else "--halving"
        raise _fail(f"{where}{name} step {halving[-1]} is not before the last of the run's {total} steps; halving "
                    f"steps must be < {total}")


def check_schedule_entry(raw: Any, key: str, style: str = "flag", where: str | Origins = "",
                         fill: bool = False) -> Any:
    """One model's schedule (None, a name or a mapping with a name), checked against the registry: the same
    shape back with its values validated (``fill``: a mapping with every parameter, a None default left out)."""
    if raw is None:
        return {"name": "constant"} if fill else None
    entry = {"name": raw} if isinstance(raw, str) else raw
    if not isinstance(entry, dict):
        raise _fail(f"{_at(where, key)}{key} must be a mapping with a name (or a list of them, one per model), got "
                    f"{_show(raw)}")
    name = entry.get("name", "constant")
    if name not in SCHEDULES:
        said = f"{key}.name = {_show(name)}" if style == "file" else f"{key}: unknown schedule {_show(name)};"
        raise _fail(f"{_at(where, key + '.name')}{said} must be one of: {', '.join(SCHEDULES)}")
    spec = SCHEDULES[name]
    for k in entry:
        if k != "name" and spec.param(k) is None:
            takes = ", ".join(p.name for p in spec.params) or "no parameters"
            raise _fail(f"{_at(where, f'{key}.{k}', key + '.name')}{key}.{k} does not apply to the {name} schedule; "
                        f"{name} takes: {takes}")
    out = {"name": name}
    for p in spec.params:
        if p.name in entry:
            at = f"{key}.{p.name}"
            out[p.name] = check_value(p, entry[p.name], at, style, _at(where, at), optional=p.default is None)
        elif p.default is REQUIRED:
            raise _fail(f"{_at(where, key + '.name')}{key}.{p.name} is missing: '{name}' needs '{p.name}' ({p.flag})")
        elif fill and p.default is not None:
            out[p.name] = p.default
    return out if fill or not isinstance(raw, str) else raw


def _check_schedule(raw: Any, style: str, where: str | Origins = "", fill: bool = False) -> Any:
    """None / one schedule / a non-empty list of them (one per model)."""
    if isinstance(raw, (list, tuple)):
        if not raw:
            raise _fail(f"{_at(where, 'schedule')}schedule is an empty list; give one schedule, or one per model")
        return [check_schedule_entry(s, f"schedule[{i}]", style, where, fill) for i, s in enumerate(raw)]
    return check_schedule_entry(raw, "schedule", style, where, fill)


# ------------------------------------------------------------------------------------------------ TrainConfig's names
def flat_default(name: str) -> Any:
    """A hyper-parameter's default as a ``TrainConfig`` field: the one every optimizer taking it shares, else None
    (each optimizer's own, e.g. weight_decay: AdamW 0.01, otherwise 0)."""
    defaults = {repr(s.param(name).default) for s in OPTIMIZERS.values() if s.param(name) is not None}
    return OPTIMIZERS[next(s for s in OPTIMIZERS if OPTIMIZERS[s].param(name))].param(name).default \
        if len(defaults) == 1 else None


def hyper_params() -> dict[str, Param]:
    """Every registered optimizer's hyper-parameters, each name once (a ``TrainConfig`` setting each)."""
    return _all_params(OPTIMIZERS.values())


def raw_key(name: str) -> str:
    """The dotted config key of the ``TrainConfig`` setting ``name``: a run setting's path, ``optimizer.<name>``
    for a hyper-parameter, ``loss.<option>`` for ``loss_options.<option>``, ``schedule[.<parameter>]``."""
    s = _RUN.get(name)
    if s is not None:
        return s.path
    if name == "schedule" or name.startswith("schedule."):
        return name
    if name.startswith("loss_options."):
        return "loss." + name[len("loss_options."):]
    return "optimizer." + name


def set_dotted(raw: dict, key: str, value: Any) -> None:
    """``raw[a][b] = value`` for ``key`` "a.b" in a config mapping: the section made when missing, a section given
    as a name alone (``loss: mse``) made a mapping with that name, the section a new mapping (not the one it was,
    which another mapping may share)."""
    section, _, leaf = key.partition(".")
    if leaf:
        sub = raw.get(section)
        if isinstance(sub, str):
            sub = {"name": sub}
        raw[section] = {**(sub or {}), leaf: value}
    else:
        raw[section] = value


def get_dotted(cfg: Mapping, key: str, default: Any = None) -> Any:
    section, _, leaf = key.partition(".")
    if not leaf:
        return cfg.get(section, default)
    inner = cfg.get(section)
    return inner.get(leaf, default) if isinstance(inner, Mapping) else default


def raw_from_flat(flat: Mapping[str, Any], recorded: bool = False) -> dict:
    """``TrainConfig`` settings (by their flat names; None: the default) as a config mapping, for the one
    validation (:func:`normalize_config`). A hyper-parameter the optimizer does not take is left out when it has
    ``TrainConfig``'s default (``as_dict()`` holds every field), and always when ``recorded``: a run's recorded
    settings (a run before onnxfuse refused them recorded them; they did nothing)."""
    raw: dict[str, Any] = {}
    kind = flat.get("optimizer") or _RUN["optimizer"].param.default
    takes = {p.name for p in OPTIMIZERS[kind].params} if kind in OPTIMIZERS else None
    hyper = hyper_params()
    for name, v in flat.items():
        if v is None or (recorded and name in FP16_ONLY and flat.get("precision") != "fp16"):
            continue  # a recorded run's loss scale outside fp16 did nothing (runs before that was refused)
        if name == "loss_options":
            if not isinstance(v, Mapping):
                raise _fail(f"loss_options must be a mapping of {', '.join(p.name for p in LOSS_PARAMS)}, got "
                            f"{_show(v)}")
            for option, x in v.items():
                if x is not None:
                    set_dotted(raw, f"loss.{option}", x)
        elif name == "schedule" or name in _RUN:
            set_dotted(raw, raw_key(name), v)
        elif name in hyper:
            idle = takes is not None and name not in takes and (recorded or _as_lists(v) == _as_lists(
                flat_default(name)))
            if not idle:
                set_dotted(raw, raw_key(name), v)
        else:
            raise _fail(f"unknown training setting '{name}'; the settings are those of `onnxfuse train --help` "
                        "(TrainConfig's fields)")
    return raw


def _as_lists(v: Any) -> Any:
    return [_as_lists(x) for x in v] if isinstance(v, (list, tuple)) else v


def raw_to_flat(raw: Mapping) -> dict:
    """The settings a config mapping has (only those) by their ``TrainConfig`` names: ``raw_from_flat``'s inverse
    (a resumed run's flags as overrides of its recorded settings)."""
    out: dict[str, Any] = {}
    for s in RUN_SETTINGS:
        v = get_dotted(raw, s.path)
        if v is not None:
            out[s.name] = v
    for section, prefix in (("optimizer", ""), ("loss", "loss_options.")):
        for k, v in (raw.get(section) or {}).items() if isinstance(raw.get(section), Mapping) else ():
            if k != "name":
                if prefix:
                    out.setdefault("loss_options", {})[k] = v
                else:
                    out[k] = v
    if raw.get("schedule") is not None:
        out["schedule"] = raw["schedule"]
    return out


def flat_settings(cfg: Mapping) -> dict:
    """A normalized config's settings by their ``TrainConfig`` names (what a run records and hashes): every run
    setting, the optimizer's hyper-parameters, the schedule and the loss options; the device as its text."""
    if cfg.get("grid"):
        raise ValueError("a config with a grid has per-model values only once B is known: expand_per_model first")
    out = {s.name: get_dotted(cfg, s.path) for s in RUN_SETTINGS}
    out.update({k: v for k, v in cfg["optimizer"].items() if k != "name"})
    out["device"] = str(out["device"])
    out["halving"] = out["halving"] or None
    out["schedule"] = cfg["schedule"]
    out["loss_options"] = {k: v for k, v in cfg["loss"].items() if k != "name"}
    return out


# ------------------------------------------------------------------------------------------------ config files
_SECTIONS = ("model", "data", "loss", "optimizer", "grid", "schedule")
_MODEL_KEYS = ("factory", "args", "count", "seeds", "input_shape", "input_dtype", "per_model_inputs")


def _file_keys(section: str) -> tuple[str, ...]:
    """The keys a config file takes under ``section`` ("" = top level), from the tables."""
    if section == "":
        return _SECTIONS + tuple(s.path for s in RUN_SETTINGS if "." not in s.path)
    if section == "data":
        return ("train", "eval") + tuple(s.path[5:] for s in RUN_SETTINGS if s.path.startswith("data."))
    if section == "loss":
        return ("name",) + tuple(p.name for p in LOSS_PARAMS)
    if section == "optimizer":
        return ("name",) + tuple(_all_params(OPTIMIZERS.values()))
    return _MODEL_KEYS


def _section(where: Origins, key: str, v: Any) -> dict:
    """A mapping whose keys are all known under ``key``."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _fail(f"{where(key)}{key} must be a mapping of settings (key: value), got {_show(v)}")
    allowed = _file_keys(key)
    for k in v:
        if k not in allowed:
            raise _fail(f"{where(f'{key}.{k}')}unknown key '{key}.{k}'; valid keys under {key}: {', '.join(allowed)}")
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
            raise _fail(f"{where}model.{key} is missing; the model section needs factory, count and input_shape "
                        "(or remove the section when the array is fused already)")
    factory = m["factory"]
    if not isinstance(factory, str) or ":" not in factory:
        raise _fail(f"{where}model.factory = {_show(factory)} must be MODULE:FACTORY, e.g. "
                    "onnxfuse.exporters.zoo:LeNet or my_models.py:make")
    factory = resolve_factory(factory, base_dir)
    count = check_value(Param("count", _POS), m["count"], "model.count", "file", where)
    seeds = m.get("seeds") if m.get("seeds") is not None else list(range(count))
    if not isinstance(seeds, list) or len(seeds) != count:
        raise _fail(f"{where}model.seeds = {_show(seeds)} must be a list of model.count = {count} integers")
    seeds = [check_value(Param("seed", _NONNEG), s, f"model.seeds[{i}]", "file", where) for i, s in enumerate(seeds)]
    shapes, dtypes = model_inputs(m["input_shape"], m.get("input_dtype"), where)  # as `onnxfuse export` checks them
    pmi = m.get("per_model_inputs") or []
    if not isinstance(pmi, list) or not all(isinstance(n, str) and n for n in pmi):
        raise _fail(f"{where}model.per_model_inputs = {_show(pmi)} must be a list of graph input names")
    return {"factory": factory, "args": factory_args(m.get("args"), "model.args", where), "count": count,
            "seeds": seeds, "input_shape": shapes, "input_dtype": dtypes, "per_model_inputs": pmi}


def _data_source(at: Origins, key: str, v: Any) -> str | None:
    if v is None:
        return None
    where = at(key)
    if isinstance(v, str) and is_named(v):
        if v not in NAMED_DATASETS:
            raise _fail(f"{where}{key} = {_show(v)} is not a bundled data set; choose one of: "
                        f"{', '.join(NAMED_DATASETS)}")
        return v
    if isinstance(v, str) and is_data_factory(v):  # a function that returns a DataLoader, Dataset or arrays
        return resolve_factory(v, at.base(key))
    if not isinstance(v, str) or not v.endswith(".npz"):
        raise _fail(f"{where}{key} = {_show(v)} must be a .npz file, MODULE:FUNCTION (a function returning a "
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
    s = _RUN.get(key)
    return s.param if s is not None else None


def _grid(at: Origins, raw: Any, cfg: dict, explicit: dict) -> dict:
    """Grid axes ``{dotted key: [values]}``; each value is checked like the setting itself."""
    if raw is None:
        return {}
    where = at("grid")
    if not isinstance(raw, dict):
        raise _fail(f"{where}grid must be a mapping of setting: [values], e.g. optimizer.lr: [0.1, 0.01]; got "
                    f"{_show(raw)}")
    valid = per_model_keys(cfg["optimizer"]["name"], cfg["schedule"])
    out = {}
    for key, values in raw.items():
        if key not in valid:
            raise _fail(f"{where}grid key '{key}' is not a per-model setting of this run; valid grid keys: "
                        f"{', '.join(valid)}")
        section, _, leaf = key.partition(".")
        given = explicit.get(section) if leaf else explicit
        if isinstance(given, dict) and given.get(leaf or key) is not None:
            raise _fail(f"{at('grid', key)}{key} is set both in grid and as {key}; give its values in one place")
        if not isinstance(values, list) or not values:
            raise _fail(f"{where}grid.{key} = {_show(values)} must be a non-empty list of values")
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
        raise _fail(f"{at()}the config must be a mapping of settings (key: value), got {type(raw).__name__}")
    top = _file_keys("")
    for k in raw:
        if k not in top:
            raise _fail(f"{at(k)}unknown key '{k}'; valid keys: {', '.join(top)}")
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
    cfg["data"] = {k: cfg["data"][k] for k in _file_keys("data")}  # the documented key order
    loss = cfg["loss"]
    if loss["label_smoothing"] and loss["name"] != "cross-entropy":
        raise _fail(f"{at('loss.label_smoothing', 'loss.name')}loss.label_smoothing applies to cross-entropy only, "
                    f"not to {loss['name']} (as in torch)")
    if loss["class_axis"] == 0:
        raise _fail(f"{at('loss.class_axis')}loss.class_axis = 0 is the batch axis; use 1 ([N, C, ...]) or -1 "
                    "([N, ..., C])")
    from onnxfuse.recipe.losses import get_loss

    try:  # the loss's own rules, as a backstop
        get_loss(loss["name"], **{p.name: loss[p.name] for p in LOSS_PARAMS})
    except ConfigError as e:
        raise _fail(f"{at(*(f'loss.{k}' for k in loss))}loss: {e}") from None
    cfg["optimizer"] = _optimizer(at, raw["optimizer"], value["optimizer"])
    cfg["schedule"] = _check_schedule(raw.get("schedule"), "file", at, fill=True)
    cfg["grid"] = _grid(at, raw.get("grid"), cfg, raw)
    for s in RUN_SETTINGS:
        if "." not in s.path:
            cfg[s.path] = value[s.name]
    cfg["halving"] = cfg["halving"] or []
    if (cfg["steps"] is None) == (cfg["epochs"] is None):
        both = "both are set" if cfg["steps"] is not None else "neither is set"
        raise _fail(f"{at('steps', 'epochs')}give exactly one of steps and epochs ({both})")
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
        v, default = get_dotted(raw, _RUN[name].path), _RUN[name].param.default
        return v is not None and any(x != default for x in (v if isinstance(v, (list, tuple)) else [v]))
    keys = [_RUN[n].path for n in FP16_ONLY if given(n)] + [k for k in cfg["grid"] if k in FP16_ONLY]
    if keys:
        raise _fail(f"{at(*keys, 'precision')}{', '.join(keys)} {'applies' if len(keys) == 1 else 'apply'} to "
                    f"precision fp16 only (its loss scaling), and this run trains in {cfg['precision']}; remove "
                    f"{'it' if len(keys) == 1 else 'them'} or train in fp16")


def check_held_out(cfg: Mapping, has_eval: bool, where: Origins | str = "") -> None:
    """The rules about held-out data of a normalized config, for a run that has eval data (``has_eval``) or not:
    eval data is given one way, and successive halving and best states have some to rank the models by."""
    eval_fraction = cfg["data"]["eval_fraction"]
    if has_eval and eval_fraction > 0:
        raise _fail(f"{_at(where, 'data.eval', 'data.eval_fraction')}data.eval and data.eval_fraction are both "
                    "set; give held-out data one way")
    if cfg["halving"] and not has_eval and eval_fraction == 0:
        raise _fail(f"{_at(where, 'halving')}halving needs eval data to rank the models; set data.eval or "
                    "data.eval_fraction")
    if cfg["keep_best"] in EVAL_METRICS and not has_eval and eval_fraction == 0:
        raise _fail(f"{_at(where, 'keep_best')}keep_best {cfg['keep_best']} needs eval data to pick each model's "
                    f"best state by; set data.eval or data.eval_fraction, or keep_best {OFF}")


def _optimizer(where: Origins, given: dict, name: str) -> dict:
    """The optimizer section: its name and each of its hyper-parameters (default filled in)."""
    spec = OPTIMIZERS[name]
    takes = [p.name for p in spec.params]
    for k in given:
        if k != "name" and k not in takes:
            raise _fail(f"{where(f'optimizer.{k}', 'optimizer.name')}optimizer.{k} does not apply to {name}; "
                        f"{name} takes: {', '.join(takes)}")
    out = {"name": name}
    for p in spec.params:
        v = given.get(p.name)
        key = f"optimizer.{p.name}"
        out[p.name] = check_value(p, p.default if v is None else v, key, "file", where(key))
    return out


# ------------------------------------------------------------------------------------------------ the command line
def _flag_params() -> list[tuple[Param, str, str]]:
    """(param, flag, the TrainConfig name or "schedule." / "loss_options." + parameter), for every setting that
    has a flag: run settings, the optimizers' hyper-parameters, the loss options and the schedules' parameters."""
    out = [(s.param, s.cli, s.name) for s in RUN_SETTINGS if s.cli]
    out += [(p, p.flag, p.name) for p in _all_params(OPTIMIZERS.values()).values()]
    out += [(p, p.flag, f"loss_options.{p.name}") for p in LOSS_PARAMS]
    taken = {flag for _, flag, _ in out}
    out += [(p, p.flag, f"schedule.{p.name}") for p in _all_params(SCHEDULES.values()).values() if p.flag not in taken]
    return out


def _dest(name: str) -> str:
    return "setting_" + name.replace(".", "__")


def _help(p: Param, what: str) -> str:
    said = p.help
    if p.per_model and p.kind.parse is not None and p.kind.metavar is None:
        said += "; one value, or one per model (comma-separated)"
    elif p.per_model and p.kind.parse is None:
        said += " (per model: --config)"
    if what.startswith("schedule."):
        users = [s.name for s in SCHEDULES.values() if s.param(p.name) is not None]
        said = f"{'/'.join(users)}: {said}"
    elif what in _all_params(OPTIMIZERS.values()):
        users = [s.name for s in OPTIMIZERS.values() if s.param(p.name) is not None]
        if len(users) < len(OPTIMIZERS):
            said = f"{'/'.join(users)}: {said}"
        defaults = {s.name: s.param(p.name).default for s in OPTIMIZERS.values() if s.param(p.name) is not None}
        if len({repr(v) for v in defaults.values()}) > 1:
            return f"{said} (default: " + ", ".join(f"{k} {v}" for k, v in defaults.items()) + ")"
    if p.default is not None and p.default is not REQUIRED and p.kind.parse is not None:
        said += f" (default {p.default})"
    elif p.kind.parse is None and p.default is True:  # the flag is --no-<name>: it says the non-default
        said += " (on by default; this flag turns it off)"
    return said.replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of every setting (``onnxfuse train`` / ``check``), read from the tables and registries now."""
    for p, flag, what in _flag_params():
        dest, h = _dest(what), _help(p, what)
        if p.kind.parse is None:  # a switch: says the non-default
            if p.default is True:
                parser.add_argument("--no-" + flag[2:], dest=dest, action="store_const", const=False, help=h)
            else:
                parser.add_argument(flag, dest=dest, action="store_const", const=True, help=h)
        elif p.kind.choices is not None:
            parser.add_argument(flag, dest=dest, choices=list(p.kind.choices()), help=h)
        elif p.per_model or p.kind.metavar:
            parser.add_argument(flag, dest=dest, metavar=p.kind.metavar or "V[,V...]", help=h)
        else:
            metavar = {int: "N", float: "X"}.get(p.kind.parse, p.name.upper())
            parser.add_argument(flag, dest=dest, type=p.kind.parse, metavar=metavar, help=h)
    parser.add_argument("--schedule", dest=_dest("schedule"), choices=list(SCHEDULES),
                        help="learning-rate schedule (torch.optim.lr_scheduler): " + ", ".join(
                            f"{s.name}{' (' + s.help + ')' if s.help else ''}" for s in SCHEDULES.values()))


def _flag_value(p: Param, text: str) -> Any:
    """A flag's text as a config file would give the value: per-model numbers comma-separated (one value, or one
    per model), a pair or a list of steps ``a,b``. What is not a number stays the text it is (an empty value
    ``''`` too), for the validation to name it as it names a file's."""
    def one(piece: str) -> Any:
        try:
            return p.kind.parse(piece)
        except ValueError:
            return piece
    if p.per_model and p.kind.metavar is None:  # a pair (betas) is one value, written a,b
        values = [one(v.strip()) for v in str(text).split(",")]
        return values[0] if len(values) == 1 else values
    try:
        return p.kind.parse(text)
    except ValueError:
        return [v.strip() for v in str(text).split(",")]


def flags_to_raw(args: argparse.Namespace) -> tuple[dict, dict[str, str]]:
    """The settings given as flags (only those: they override a config file, or a resumed run's own settings) as
    a config mapping, the shape of a config file (``{"optimizer": {"name": "adam", "lr": [0.1, 0.01]},
    "schedule": {...}, "data": {"train": ...}, "batch_size": 16, ...}``), and the flag that gave each dotted key
    (for messages). ``--data`` and ``--eval-data`` are the command's own flags (``cli/main.py``)."""
    raw: dict[str, Any] = {}
    named: dict[str, str] = {}
    for p, flag, what in _flag_params():
        v = getattr(args, _dest(what), None)
        if v is None:
            continue
        if isinstance(v, str) and p.kind.choices is None and p.kind.parse is not None and \
                (p.per_model or p.kind.metavar):
            v = _flag_value(p, v)
        key = raw_key(what)
        set_dotted(raw, key, v)
        named[key] = flag_of(what)
    name = getattr(args, _dest("schedule"), None)
    if name:
        raw["schedule"] = {"name": name, **raw.get("schedule", {})}
        named["schedule.name"] = "--schedule"
    for key, flag, path in (("train", "--data", getattr(args, "data", None)),  # the data flags of the CLI's own
                            ("eval", "--eval-data", getattr(args, "eval_data", None))):
        if path is not None:
            set_dotted(raw, f"data.{key}", os.fspath(path))
            named[f"data.{key}"] = flag
    return raw, named


def flag_of(name: str) -> str:
    """The flag of the ``TrainConfig`` setting ``name`` (``loss_options.<option>`` for a loss option)."""
    if name == "schedule":
        return "--schedule"
    for p, flag, what in _flag_params():
        if what == name:
            return "--no-" + flag[2:] if p.kind.parse is None and p.default is True else flag
    return "--" + name.rpartition(".")[2].replace("_", "-")


def merge_raw(base: Mapping, over: Mapping) -> dict:
    """The config mapping ``over`` over ``base`` (flags over a config file, or over a run's own settings): a
    section key by key; a schedule with a name replaces ``base``'s, its parameters alone go into it (into each
    model's, for a list of them)."""
    out = dict(base)
    for k, v in over.items():
        b = out.get(k)
        if k in ("optimizer", "loss", "schedule") and isinstance(b, str):
            b = {"name": b}
        if k == "schedule" and isinstance(v, dict) and "name" not in v and isinstance(b, list):
            out[k] = [{**({"name": e} if isinstance(e, str) else e or {}), **v} for e in b]
        elif isinstance(v, dict) and isinstance(b, dict) and not (k == "schedule" and "name" in v):
            out[k] = {**b, **v}
        else:
            out[k] = v
    return out
