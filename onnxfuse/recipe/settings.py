"""Every training setting, declared once: its type, default, range, whether it may differ per model, and its help.

Every other view of a setting is made from these declarations (``tests/recipe/test_settings_once.py`` derives each):

- the fields of ``TrainConfig`` (the settings as given) and of ``RunSettings`` (the settings a run reads),
  ``train_config.py``; the record a run writes (run.json, checkpoints, a sweep's plan) is ``TrainConfig.as_dict()``;
- the config file's keys and its one validation, ``config.normalize_config``: a config file's mapping, the same
  mapping with flags merged over it (:func:`merge_raw`), ``TrainConfig``'s arguments (:func:`raw_from_flat`), a
  resumed run's record and a sweep's array all go through it, so every rule holds whichever way a value is given;
- the flags of ``onnxfuse train`` / ``check`` (``cli/train_flags.py``, from :func:`flag_params`), which are also
  the overrides of a resumed run;
- the error messages: one :class:`ConfigError` line naming the key (``optimizer.lr[1] = nan must be ...``),
  begun by where the value came from (``run.yaml: ``, ``--lr: ``: :class:`Origins`), made in one place
  (:func:`_message`).

Optimizers and schedules are registered once each, next to their maths: ``optim.py`` calls
:func:`register_optimizer` with an :class:`OptimizerSpec` (its hyper-parameters as :class:`Param` s),
``schedules.py`` decorates each torch scheduler builder with :func:`register_schedule`. The CLI's choices, the
config schema, placement's optimizer choices and the grid's per-model keys all read :data:`OPTIMIZERS` and
:data:`SCHEDULES`; the runtimes a run may choose are ``runtimes.py``'s ``RUNTIMES``.

Values are validated by pydantic (v2): each :class:`Kind` below is a pydantic type plus how a command line writes
it; a :class:`Param` is a named, documented setting of a kind.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Annotated, Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
from pydantic import (AfterValidator, BeforeValidator, Discriminator, Field, Strict, Tag, TypeAdapter, ValidationError,
                      ValidationInfo, WrapValidator)
from pydantic_core import PydanticCustomError

from onnxfuse.core.errors import ConfigError

from onnxfuse.recipe.device import DEVICE_TAKES, Device
from onnxfuse.recipe.losses import LOSSES
from onnxfuse.recipe.ranking import KEEP_BEST_CHOICES
from onnxfuse.recipe.runtimes import COMPILE_CHOICES, PRECISIONS, LossScale, RUNTIME_CHOICES, RUNTIMES

__all__ = ["Kind", "Param", "Setting", "OptimizerSpec", "ScheduleSpec", "OPTIMIZERS", "SCHEDULES",
           "register_optimizer", "register_schedule", "RUN_SETTINGS", "LOSS_PARAMS", "RESUMABLE", "FP16_ONLY", "ORDERS",
           "real", "integer", "BOOL", "choice", "pair", "step_list", "text", "DEVICE", "CLIP", "check_value",
           "check_schedule_entry", "check_schedule", "check_halving", "Origins", "is_per_model_list", "run_setting",
           "flag_params", "flag_of", "merge_raw", "raw_from_flat", "raw_to_flat", "flat_settings", "raw_key",
           "hyper_params", "flat_default", "set_dotted", "get_dotted", "config_error", "shown", "REQUIRED"]

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
def shown(v: Any) -> str:
    """A value as a message shows it (a string quoted)."""
    return repr(v) if isinstance(v, str) else str(v)


def config_error(msg: str) -> ConfigError:
    """``msg`` as one ConfigError line."""
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
        return config_error(f"{where}{key} is missing")
    elif err["type"] != "setting":
        msg = f"is not valid ({msg})"
    if style == "file":
        return config_error(f"{where}{key} = {shown(value)} {msg}")
    return config_error(f"{where}{key} {msg}, got {shown(value)}")


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
    Setting(Param("threads", _NONNEG, 0, "CPU threads of the runtime (0: for torch 1 from the command line, whose "
                  "OpenMP threads slow down many-fold when another process holds a core, and the process's own count "
                  "from the Python API unless tune_process; onnxruntime's default for ort); not resumable: the "
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


def run_setting(name: str) -> Setting | None:
    """The run setting ``name`` of RUN_SETTINGS (None: no run setting has that name)."""
    return _RUN.get(name)

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
        raise config_error(f"{where}{name} step {halving[-1]} is not before the last of the run's {total} steps; "
                           f"halving steps must be < {total}")


def check_schedule_entry(raw: Any, key: str, style: str = "flag", where: str | Origins = "",
                         fill: bool = False) -> Any:
    """One model's schedule (None, a name or a mapping with a name), checked against the registry: the same
    shape back with its values validated (``fill``: a mapping with every parameter, a None default left out)."""
    if raw is None:
        return {"name": "constant"} if fill else None
    entry = {"name": raw} if isinstance(raw, str) else raw
    if not isinstance(entry, dict):
        raise config_error(f"{_at(where, key)}{key} must be a mapping with a name (or a list of them, one per "
                           f"model), got {shown(raw)}")
    name = entry.get("name", "constant")
    if name not in SCHEDULES:
        said = f"{key}.name = {shown(name)}" if style == "file" else f"{key}: unknown schedule {shown(name)};"
        raise config_error(f"{_at(where, key + '.name')}{said} must be one of: {', '.join(SCHEDULES)}")
    spec = SCHEDULES[name]
    for k in entry:
        if k != "name" and spec.param(k) is None:
            takes = ", ".join(p.name for p in spec.params) or "no parameters"
            raise config_error(f"{_at(where, f'{key}.{k}', key + '.name')}{key}.{k} does not apply to the {name} "
                               f"schedule; {name} takes: {takes}")
    out = {"name": name}
    for p in spec.params:
        if p.name in entry:
            at = f"{key}.{p.name}"
            out[p.name] = check_value(p, entry[p.name], at, style, _at(where, at), optional=p.default is None)
        elif p.default is REQUIRED:
            raise config_error(f"{_at(where, key + '.name')}{key}.{p.name} is missing: '{name}' needs '{p.name}' "
                               f"({p.flag})")
        elif fill and p.default is not None:
            out[p.name] = p.default
    return out if fill or not isinstance(raw, str) else raw


def check_schedule(raw: Any, style: str, where: str | Origins = "", fill: bool = False) -> Any:
    """None / one schedule / a non-empty list of them (one per model)."""
    if isinstance(raw, (list, tuple)):
        if not raw:
            raise config_error(f"{_at(where, 'schedule')}schedule is an empty list; give one schedule, or one per "
                               "model")
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
                raise config_error(f"loss_options must be a mapping of {', '.join(p.name for p in LOSS_PARAMS)}, got "
                                   f"{shown(v)}")
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
            raise config_error(f"unknown training setting '{name}'; the settings are those of `onnxfuse train --help` "
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


# ------------------------------------------------------------------------------------------------ the flags
def flag_params() -> list[tuple[Param, str, str]]:
    """(param, flag, the TrainConfig name or "schedule." / "loss_options." + parameter), for every setting that
    has a flag: run settings, the optimizers' hyper-parameters, the loss options and the schedules' parameters."""
    out = [(s.param, s.cli, s.name) for s in RUN_SETTINGS if s.cli]
    out += [(p, p.flag, p.name) for p in _all_params(OPTIMIZERS.values()).values()]
    out += [(p, p.flag, f"loss_options.{p.name}") for p in LOSS_PARAMS]
    taken = {flag for _, flag, _ in out}
    out += [(p, p.flag, f"schedule.{p.name}") for p in _all_params(SCHEDULES.values()).values() if p.flag not in taken]
    return out


def flag_of(name: str) -> str:
    """The flag of the ``TrainConfig`` setting ``name`` (``loss_options.<option>`` for a loss option)."""
    if name == "schedule":
        return "--schedule"
    for p, flag, what in flag_params():
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
