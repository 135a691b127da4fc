"""The sweep spec: one YAML file (``docs/sweep.example.yaml`` documents every key).

A spec is a run configuration (``docs/run.example.yaml``: data, loss, optimizer, schedule, steps, ...) that every
trial shares, without its ``model`` and ``grid`` sections, plus the sections of a sweep:

    model       factory, input_shape, input_dtype, args (fixed factory keyword arguments), seed (the models'
                init seed), per_model_inputs
    search      space: {key: [values] | {low, high, log, int}}; method (grid | random), samples and seed (random):
                how ``onnxfuse sweep`` draws its trials (a range is for random; Optuna samples ranges itself)
    metric      eval_loss | eval_accuracy | train_loss (what the report sorts by and Optuna optimizes; each
                trial's best state by an eval metric is kept, its run's keep_best, and ranked by)
    arrays      size (a number, or auto: array sizing, run on a worker), max_size
    resources   cpus, gpus per array (Ray resources; a fraction of a GPU shares it)
    retries     how often a failed array is run again (default 1)
    halving     the run setting, sweep-wide: at each of these steps every array stops, the best ``halving_keep``
                of all trials still training (by the metric at that step) go on, the others stop there; each
                group's survivors are re-fused into the fewest arrays (with their optimizer state)

What a search-space key changes decides where the trials it tells apart can train:

    model.<arg>      a factory argument: may change the graph (trials are grouped by the graph identity check,
                     never by this label)
    seed             the model's init seed (torch.manual_seed before the factory): only the weights
    per-model keys   the optimizer's per-model hyper-parameters, clip_grad_norm, schedule.<param>: fused, each
                     model of an array with its own value (config.per_model_keys)
    any other key    a run setting every model of an array shares (batch_size, steps, loss.label_smoothing, ...):
                     trials that differ in it train in different arrays

The sweep-only sections are pydantic models (their errors become one ConfigError line naming the key); the run
part is checked by ``recipe.config.normalize_config``, once for every distinct set of array-wide values.
"""
from __future__ import annotations

import copy
import functools
import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError, field_validator

from onnxfuse.core.errors import ConfigError
from onnxfuse.recipe.device import Device
from onnxfuse.recipe.ranking import EVAL_METRICS, METRICS, OFF  # METRICS: metric -> the direction that is better

__all__ = ["SweepSpec", "load_spec", "parse_spec", "METRICS", "SWEEP_SECTIONS"]

EXAMPLE = "docs/sweep.example.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# what torch.manual_seed takes (a larger seed is a raw ValueError when the trial is exported)
SEED_RANGE = (-2 ** 63, 2 ** 64 - 1)
SEED_TAKES = f"an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]} (what torch.manual_seed takes)"


def _is_seed(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and SEED_RANGE[0] <= v <= SEED_RANGE[1]

# Ray counts resources in units of 1/10000 (a finer fraction is a raw ValueError when the task is submitted)
RAY_UNIT = 1e-4


class ModelSection(_Strict):
    factory: str = Field(min_length=1)
    # the example inputs and the factory's arguments: checked by onnxfuse/exporters/factory.py (parse_spec), as
    # `onnxfuse export`'s flags and a run config's model section are
    input_shape: Any
    input_dtype: Any = None
    args: Any = None
    seed: int = Field(0, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    per_model_inputs: list[str] = []


class Range(_Strict):
    """A continuous (or integer) range a random search samples from: uniform, or log-uniform with ``log``.
    ``_range_problem`` checks a range as written in the spec, before it is made."""
    low: float
    high: float
    log: bool = False
    integer: bool = Field(False, alias="int")

    def bounds(self) -> list[float | int]:
        """[low, high] as the values a sample can take (ints for an integer range)."""
        return [int(self.low), int(self.high)] if self.integer else [float(self.low), float(self.high)]

    def sample(self, rng: np.random.Generator) -> float | int:
        if self.log:
            v = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            v = rng.uniform(self.low, self.high)
        return int(round(v)) if self.integer else float(v)


class SearchSection(_Strict):
    method: Literal["grid", "random"] = "grid"
    samples: PositiveInt | None = None
    seed: NonNegativeInt = 0  # numpy's generator takes no negative seed
    space: dict[str, Union[list, Range]] = Field(min_length=1)  # each entry checked first (_space_problem)


class ArraysSection(_Strict):
    size: PositiveInt | Literal["auto"] = "auto"
    max_size: PositiveInt = 16


def _ray_quantity(v: float, what: str, zero: bool) -> float:
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero) or 0 < v < RAY_UNIT:
        low = "0 or at least" if zero else "at least"
        raise ValueError(f"must be a finite number of {what}, {low} {RAY_UNIT:g} (the smallest fraction Ray "
                         f"counts), got {v!r}")
    return v


class ResourcesSection(_Strict):
    cpus: float = 1.0
    gpus: float | None = None  # default: 1 when the run's device is cuda, else 0

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: float) -> float:
        return _ray_quantity(v, "CPUs", zero=False)

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: float | None) -> float | None:
        return v if v is None else _ray_quantity(v, "GPUs", zero=True)


class SweepSections(_Strict):
    model: ModelSection
    search: SearchSection | None = None
    metric: Literal["eval_loss", "eval_accuracy", "train_loss"] | None = None
    arrays: ArraysSection = ArraysSection()
    resources: ResourcesSection = ResourcesSection()
    retries: NonNegativeInt = 1


SWEEP_SECTIONS = tuple(SweepSections.model_fields)


# keys whose pydantic message (the first branch of a union) would not say what the key takes
_TAKES = {"arrays.size": "must be a positive integer or auto"}


def _pydantic_error(e: ValidationError, where: str) -> ConfigError:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]
                   if not str(p).startswith(("function-", "union[", "literal[", "constrained-")))
    msg = _TAKES.get(loc, err["msg"].removeprefix("Value error, "))
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    if err["type"] == "missing":
        msg = "is required"
    value = "" if err["type"] in ("missing", "extra_forbidden") or "got " in msg else f" (got {err.get('input')!r})"
    return ConfigError(f"{where}{loc}: {msg}{value}; see {EXAMPLE}")


_RANGE_KEYS = ("low", "high", "log", "int")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _range_problem(r: dict) -> str | None:
    """What is wrong with a range ``{low, high, log, int}`` as written (None: nothing): each problem is one a
    sampler would otherwise meet as a raw exception (numpy's "high - low < 0", math's "domain error") or as a
    trial value no setting takes."""
    unknown = [k for k in r if k not in _RANGE_KEYS]
    if unknown:
        return f"unknown key '{unknown[0]}' (a range has low, high, log and int)"
    missing = [k for k in ("low", "high") if k not in r]
    if missing:
        return f"a range needs low and high (it has no {' and no '.join(missing)})"
    for k in ("low", "high"):
        if not _number(r[k]):
            return f"{k} must be a number, got {r[k]!r}"
        if not math.isfinite(r[k]):
            return f"{k} must be finite, got {r[k]!r}"
    for k in ("log", "int"):
        if k in r and not isinstance(r[k], bool):
            return f"{k} must be true or false, got {r[k]!r}"
    low, high = r["low"], r["high"]
    if low > high:
        return f"low {low!r} is above high {high!r}; swap them"
    if r.get("int") and not (float(low).is_integer() and float(high).is_integer()):
        return f"int: true needs whole-number bounds, got low {low!r} and high {high!r}"
    if r.get("log") and low <= 0:
        return f"log: true samples log-uniformly, which needs low > 0, got low {low!r}; give a positive low"
    return None


def _space_problem(key: str, v) -> str | None:
    """What is wrong with the search entry ``key: v`` as written (None: nothing), whatever the key: a list of
    values, or a range. The problem follows the key in the message: from ``[i]``, `` = ...``, `` is ...`` on."""
    if isinstance(v, dict):
        return _range_problem(v)
    if not isinstance(v, list):
        return (f" = {v!r}: give a list of values (e.g. [{v!r}]), or for method random a range "
                "{low: ..., high: ...}")
    if not v:
        return " is an empty list, which gives no trials; give at least one value"
    for i, x in enumerate(v):
        if isinstance(x, dict) and ("low" in x or "high" in x):
            return (f"[{i}] is a range inside a list; give the range itself ({key}: {{low: ..., high: ...}}, "
                    "method random) or a list of values")
    return None


@dataclass
class SweepSpec:
    """A parsed, checked sweep spec. ``run`` is the raw run mapping (every trial's shared settings); ``source``
    names the file in messages, ``base_dir`` is the folder its relative paths are relative to."""
    sections: SweepSections
    run: dict
    source: str
    base_dir: str
    halving: list[int] = field(default_factory=list)  # sweep-wide successive halving: the rung steps
    halving_keep: float = 0.5

    @property
    def model(self) -> ModelSection:
        return self.sections.model

    @property
    def metric(self) -> str:
        return self.sections.metric or ("eval_loss" if self._has_eval() else "train_loss")

    @property
    def direction(self) -> str:
        return METRICS[self.metric]

    @functools.cached_property
    def device(self) -> Device:
        """The run's device (its text checked by ``normalized``, as the rest of the run part)."""
        return Device.of(self.run.get("device", "cpu"))

    @property
    def gpus(self) -> float:
        g = self.sections.resources.gpus
        return (1.0 if self.device.is_cuda else 0.0) if g is None else g

    @property
    def cpus(self) -> float:
        return self.sections.resources.cpus

    def _has_eval(self) -> bool:
        data = self.run.get("data") or {}
        return bool(data.get("eval") or data.get("eval_fraction"))

    def as_dict(self) -> dict:
        """What a sweep folder keeps of the spec (``parse_spec`` reads it back)."""
        halving = {"halving": self.halving, "halving_keep": self.halving_keep} if self.halving else {}
        return {**self.sections.model_dump(by_alias=True, exclude_none=True), **copy.deepcopy(self.run), **halving}

    # ---------------------------------------------------------------------------------------------- keys
    @functools.cached_property
    def _per_model_keys(self) -> tuple[str, ...]:
        from onnxfuse.recipe.config import per_model_keys

        cfg = self.normalized()
        return tuple(per_model_keys(cfg["optimizer"]["name"], cfg["schedule"]))

    def per_model_keys(self) -> list[str]:
        """The keys every model of an array may have its own value of (``config.per_model_keys``)."""
        return list(self._per_model_keys)

    def kind(self, key: str) -> str:
        """``model``, ``seed``, ``per-model`` or ``array`` (see the module docstring)."""
        if key.startswith("model."):
            return "model"
        if key == "seed":
            return "seed"
        return "per-model" if key in self.per_model_keys() else "array"

    def normalized(self, array_values: dict | None = None, what: str = "") -> dict:
        """The run part with ``array_values`` ({dotted key: value}) set, normalized and checked."""
        from onnxfuse.recipe.config import normalize_config
        from onnxfuse.recipe.settings import set_dotted

        raw = copy.deepcopy(self.run)
        for key, value in (array_values or {}).items():
            set_dotted(raw, key, value)
        return normalize_config(raw, source=f"{self.source}{what}", base_dir=self.base_dir)

    # ---------------------------------------------------------------------------------------------- trials
    def trials(self) -> list[dict]:
        """Every trial's parameters {space key: value}, in order: the grid's product (the first key varies
        slowest), or ``search.samples`` draws from a generator seeded with ``search.seed``. (``search.method`` is
        how ``onnxfuse sweep`` draws the trials from the space; Optuna's sampler draws them without it, a range
        being a distribution to sample from: ``integrations.optuna.suggest_from_space``.)"""
        search = self.sections.search
        if search is None:
            raise ConfigError(f"{self.source}: search is required (search.space: the values to try); see {EXAMPLE}")
        where = f"{self.source}: "
        if search.method == "grid":
            ranged = [k for k, v in search.space.items() if isinstance(v, Range)]
            if ranged:
                raise ConfigError(f"{where}search.space.{ranged[0]} is a range, which a grid cannot enumerate; give a "
                                  "list of values, or use search.method: random (with samples), or Optuna "
                                  "(onnxfuse.integrations.optuna), which samples a range")
            if search.samples is not None:
                raise ConfigError(f"{where}search.samples applies to method random; a grid tries every combination "
                                  "of search.space")
        elif search.samples is None:
            raise ConfigError(f"{where}search.method random needs search.samples (how many trials)")
        space = search.space
        if search.method == "grid":
            return [dict(zip(space, combo)) for combo in itertools.product(*space.values())]
        rng = np.random.default_rng(search.seed)
        return [{k: (v.sample(rng) if isinstance(v, Range) else v[int(rng.integers(len(v)))])
                 for k, v in space.items()} for _ in range(search.samples)]

    def check_params(self, params: dict, where: str) -> None:
        """A trial's keys: known, and of a kind the sweep can vary."""
        for key, value in params.items():
            if key in ("model.seed",):
                raise ConfigError(f"{where}{key}: the init seed is the search key 'seed'")
            if key == "seed" and not _is_seed(value):
                raise ConfigError(f"{where}seed must be {SEED_TAKES}, got {value!r}")
            if key == "grid" or key.startswith("grid."):
                raise ConfigError(f"{where}{key}: a sweep has no grid; put the values in search.space")
            if key.startswith("data.order"):
                raise ConfigError(f"{where}{key}: a sweep trains every trial on the shared batch order")


def parse_spec(raw: Any, source: str = "spec", base_dir: str | None = None) -> SweepSpec:
    """Check a spec mapping (as read from the file) and return it parsed; bad input is one ConfigError line."""
    where = f"{source}: "
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}a sweep spec is a mapping of settings (key: value); see {EXAMPLE}")
    sweep = {k: raw[k] for k in SWEEP_SECTIONS if k in raw}
    run = {k: v for k, v in raw.items() if k not in SWEEP_SECTIONS}
    if "model" not in sweep:
        raise ConfigError(f"{where}model is required (model.factory and model.input_shape); see {EXAMPLE}")
    if "grid" in run:
        raise ConfigError(f"{where}grid: a sweep puts the values to try in search.space")
    space = (sweep.get("search") or {}).get("space") if isinstance(sweep.get("search"), dict) else None
    for key, v in (space.items() if isinstance(space, dict) else ()):
        problem = _space_problem(key, v)
        if problem:
            sep = "" if problem.startswith(("[", " ")) else ": "
            raise ConfigError(f"{where}search.space.{key}{sep}{problem}; see {EXAMPLE}")
    try:
        sections = SweepSections.model_validate(sweep)
    except ValidationError as e:
        raise _pydantic_error(e, where) from None
    from onnxfuse.exporters.factory import factory_args, model_inputs

    model = sections.model
    model.args = factory_args(model.args, "model.args", where)
    model_inputs(model.input_shape, model.input_dtype, where)
    spec = SweepSpec(sections, run, source, base_dir or os.getcwd())
    cfg = spec.normalized()  # the shared run settings alone: their errors name the key
    if cfg["halving"]:  # across the sweep, not within each array
        if cfg["steps"] is None:
            raise ConfigError(f"{where}halving in a sweep needs steps (not epochs): the rungs are steps of every "
                              "array")
        spec.halving, spec.halving_keep = list(cfg["halving"]), cfg["halving_keep"]
        spec.run = {k: v for k, v in run.items() if k not in ("halving", "halving_keep")}
    if cfg["data"]["train"] is None:
        raise ConfigError(f"{where}data.train is required (a .npz file, sklearn:<name>, or MODULE:FUNCTION "
                          "returning a DataLoader, a Dataset or arrays)")
    if cfg["data"]["order"] != "shared":
        raise ConfigError(f"{where}data.order {cfg['data']['order']}: a sweep trains every trial on the shared "
                          "batch order (per-model orders would tie a trial's batches to its place in an array)")
    if spec.metric.startswith("eval") and not spec._has_eval():
        raise ConfigError(f"{where}metric {spec.metric} needs held-out data: set data.eval or data.eval_fraction")
    keep = cfg["keep_best"]
    if keep is None:  # every trial's best state by the metric the trials are ranked by, when it is an evaluation's
        spec.run = {**spec.run, "keep_best": spec.metric if spec.metric in EVAL_METRICS else OFF}
    elif keep not in (OFF, spec.metric):
        raise ConfigError(f"{where}keep_best {keep} is not the sweep's metric {spec.metric}, which ranks the trials "
                          f"by the state it kept; set keep_best: {spec.metric} (or {OFF}), or metric: {keep}")
    if spec.device.is_cuda and spec.gpus == 0:
        raise ConfigError(f"{where}device {spec.device} needs resources.gpus > 0 (a fraction shares one GPU)")
    if sections.search is not None:
        _check_search(spec, sections.search, where)
    return spec


def _check_search(spec: SweepSpec, search: SearchSection, where: str) -> None:
    """The search as a whole, and every value it can give each key checked as that key's setting takes it,
    before anything runs: a value that would fail a trial later fails the spec now, naming the key. (How the
    trials are drawn, ``search.method``, is checked where they are drawn: ``SweepSpec.trials``.)"""
    spec.check_params({k: None for k in search.space if k != "seed"}, where + "search.space.")
    from onnxfuse.recipe.config import check_model_value

    cfg = spec.normalized()
    for key, v in search.space.items():
        # the values a trial can get: each of a list's, or a range's bounds (a range is an interval, and so is
        # every setting's constraint: the bounds stand for the samples)
        if isinstance(v, Range):
            values, labels = v.bounds(), [f"search.space.{key}.low", f"search.space.{key}.high"]
        else:
            values, labels = v, [f"search.space.{key}[{i}]" for i in range(len(v))]
        kind = spec.kind(key)
        if kind == "seed":
            if isinstance(v, Range) and not v.integer:
                raise ConfigError(f"{where}search.space.seed: a range of seeds needs int: true")
            for label, x in zip(labels, values):
                if not _is_seed(x):
                    raise ConfigError(f"{where}{label} = {x!r}: a seed is {SEED_TAKES}")
        elif kind == "per-model":  # one value for one model, checked as a run config's grid checks it
            for label, x in zip(labels, values):
                check_model_value(key, x, label, cfg, where)
        elif kind == "array":  # each value, with the rest of the run settings
            for label, x in zip(labels, values):
                try:
                    spec.normalized({key: x}, f" ({label} = {x!r})")
                except ConfigError as e:
                    if isinstance(v, Range) and not v.integer and _takes(spec, key, int(x)):
                        raise ConfigError(f"{e}; a range of a whole-number setting needs int: true") from None
                    raise


def _takes(spec: SweepSpec, key: str, value) -> bool:
    try:
        spec.normalized({key: value})
    except ConfigError:
        return False
    return True


def load_spec(path: str | os.PathLike) -> SweepSpec:
    """Read and check a sweep spec file (``.yaml``/``.yml``, or ``.toml`` on Python >= 3.11)."""
    from onnxfuse.recipe.config import read_config_file

    path = os.fspath(path)
    raw = read_config_file(path, "sweep spec", EXAMPLE)
    return parse_spec(raw, path, os.path.dirname(os.path.abspath(path)))
