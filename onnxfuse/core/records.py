"""What an array folder's records hold, declared once (pydantic v2) and used both to write them and to read them
back: a run's record (``run.json``, and the record of a run started but not yet trained a step),
``trained/train_state.json``, a checkpoint's ``state.json`` and the rows of ``metrics.csv``. (``array.json`` is
declared beside ``ArraySpec``, in ``weights.py``; where each file lives is ``array.py``'s business.)

A record is checked when it is written (a bug shows where the record is made) and when it is read: a file edited
by hand, cut short or taken from another array is one :class:`InputFileError` line naming the file, the key and
what is wrong, and saying how to go on, never an exception from deeper down. Model indices are checked against
the array's B, given as the validation ``context`` (``{"B": B}``). Keys a newer onnxfuse adds are kept, and keys
added since a record was first written are optional, so the folders of earlier versions still read.

JSON has no NaN or infinity: a number that may be one (a loss, a metric) is written as the string ``"NaN"``,
``"Infinity"`` or ``"-Infinity"`` (older files: ``"nan"``, ``"inf"``) and read back as the float.
"""
from __future__ import annotations

import csv
import io
import json
import re
from typing import Annotated, Any, Literal, Mapping, Sequence

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      ValidationError, ValidationInfo, model_validator)

from onnxfuse.core.errors import InputFileError

__all__ = ["EVAL_METRICS", "RunIdentity", "RunRecord", "ModelStatus", "BestEntry", "KeptBestRecord",
           "TrainStateRecord", "CheckpointRecord", "MetricsRow", "METRICS_HEADER", "read_record", "record_json",
           "read_metrics_rows", "problem", "invalid"]

# the metrics a model's best state is kept by (--keep-best): those of an evaluation (recipe/ranking.py ranks by them)
EVAL_METRICS = ("eval_loss", "eval_accuracy")


# ------------------------------------------------------------------------------------------------ value types
def _number(v: Any) -> Any:
    if isinstance(v, bool):  # pydantic reads True as 1.0; in a record it is a mistake
        raise ValueError("is a boolean, not a number")
    return v


def _model_index(b: int, info: ValidationInfo) -> int:
    B = (info.context or {}).get("B")
    if B is not None and b >= B:
        raise ValueError(f"is not a model of this array, which has {B} (0 to {B - 1})")
    return b


def _model_key(key: str, info: ValidationInfo) -> str:
    if not key.isdigit() or (key != "0" and key.startswith("0")):
        raise ValueError("is not a model index (a key must be a model's index, '0', '1', ...)")
    return str(_model_index(int(key), info))


def _run_id(run_id: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", run_id):
        raise ValueError("is not a run id (up to 100 letters, digits, '.', '_' and '-': it names a folder in runs/)")
    return run_id


def _run_config(config: dict) -> dict:
    for key in ("_data", "_eval_data", "_loss"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise ValueError(f"{key} is {config[key]!r}, not a path or a name")
    return config


def _empty_is_none(v: Any) -> Any:
    return None if v in ({}, "") else v


Count = Annotated[StrictInt, Field(ge=0)]
# a float that may be NaN or infinite (see the module's docstring); never a boolean
Real = Annotated[float, BeforeValidator(_number)]
ModelIndex = Annotated[StrictInt, Field(ge=0), AfterValidator(_model_index)]
ModelKey = Annotated[str, AfterValidator(_model_key)]  # a model index as a JSON object's key
# a run's id names a folder (runs/<id>/): one path component, no way out of runs/
RunId = Annotated[StrictStr, AfterValidator(_run_id)]
# a run's settings (validated as settings are when it resumes: ``TrainConfig.resumed``), its data and eval data
# (``_data``, ``_eval_data``: a path or a data set's name; None when given in memory) and its Python loss's name
RunConfig = Annotated[dict[str, Any], AfterValidator(_run_config)]


def _distinct(models: Sequence[int]) -> None:
    if len(set(models)) != len(models):
        raise ValueError(f"models {list(models)} names a model twice")


class _Record(BaseModel):
    # extra: a newer onnxfuse's keys are kept (and written back); a JSON record writes non-finite floats as strings
    model_config = ConfigDict(extra="allow", ser_json_inf_nan="strings")


# ------------------------------------------------------------------------------------------------ run records
class RunIdentity(_Record):
    """Which run a state belongs to: its id and the hashes of its settings and data (``checkpoints.py``)."""

    id: RunId
    settings_hash: StrictStr
    data_hash: StrictStr


class RunRecord(RunIdentity):
    """A run's record, written before the run changes anything in the folder: ``run.json`` (the run whose outputs
    the folder holds) and the record of the last run started (until it trains its first step; ``data_hash`` None
    while its data has not been read)."""

    data_hash: StrictStr | None
    started: StrictStr | None = None
    pid: StrictInt | None = None
    # the per-model settings that tell the models apart: one value per model (a table's columns)
    differing: dict[str, list] | None = None
    # the run's settings, data and loss as a checkpoint records them: what a resume from its start trains with
    # (None: a run recorded before runs recorded them)
    config: RunConfig | None = None

    @model_validator(mode="after")
    def _one_value_per_model(self, info: ValidationInfo) -> "RunRecord":
        B = (info.context or {}).get("B")
        for key, values in (self.differing or {}).items():
            if B is not None and len(values) != B:
                raise ValueError(f"differing.{key} has {len(values)} values, not one for each of the {B} models")
        return self


class ModelStatus(_Record):
    """A stopped model: ``diverged`` (frozen from ``step``) or ``dropped`` (by halving at ``step``; ``diverged``:
    the step it had diverged at before)."""

    status: StrictStr
    step: Count
    diverged: Count | None = None


class BestEntry(_Record):
    """A model's best state so far: the step it is from, its metric there, the optimizer steps it had taken, and
    its file in ``best/`` (``ArrayDir.best_file`` of the model and that step)."""

    step: Count
    value: Real
    steps: Count
    file: StrictStr


class KeptBestRecord(_Record):
    """The best states a run keeps (``best.KeptBest``): by ``metric`` since step ``since``, per original model."""

    metric: Literal[EVAL_METRICS]
    since: Count = 0
    models: dict[ModelKey, BestEntry] = {}


class LastEval(_Record):
    """The last evaluation: each metric per original model."""

    loss: dict[ModelKey, Real]
    accuracy: dict[ModelKey, Real] | None = None


# ------------------------------------------------------------------------------------------------ state records
class TrainStateRecord(_Record):
    """``trained/train_state.json``: the optimizer steps the array took, the original index of each model of the
    array ``trained/`` holds (the surviving one after halving; its length is that array's B, checked by
    ``ArrayDir.trained``), each stopped model's status, the run, and what the run ended with."""

    steps: Count
    models: list[ModelIndex] | None = None
    status: dict[ModelKey, ModelStatus] = {}
    run: Annotated[RunIdentity | None, BeforeValidator(_empty_is_none)] = None
    step: Count | None = None
    final_loss: dict[ModelKey, Real] | None = None
    eval: Annotated[LastEval | None, BeforeValidator(_empty_is_none)] = None
    elapsed_s: Real | None = None
    stopped: StrictStr | None = None
    config: RunConfig | None = None
    best: KeptBestRecord | None = None

    @model_validator(mode="after")
    def _distinct_models(self) -> "TrainStateRecord":
        _distinct(self.models or [])
        return self


class CheckpointRecord(_Record):
    """A checkpoint's ``state.json``: where the run was (step, the models in the array and which are active, the
    optimizer steps, each stopped model's status, the data position), its settings and identity, the best states
    kept so far, and what a resume needs to write nothing twice (the last losses and evaluation, and how many rows
    of ``metrics.csv`` the run had written)."""

    step: Count
    models: Annotated[list[ModelIndex], Field(min_length=1)]
    active: list[StrictBool]
    trainer_steps: Count
    status: dict[ModelKey, ModelStatus] = {}
    sampler: dict[str, Any]
    elapsed_s: Real
    config: RunConfig
    run: Annotated[RunIdentity | None, BeforeValidator(_empty_is_none)] = None
    best: KeptBestRecord | None = None
    compiled: StrictBool | None = None
    loss_scales: dict[str, Any] | None = None
    # the torch runtime's random nodes' generators: {"train"|"eval": {node: base64 generator state}}
    random: dict[Literal["train", "eval"], dict[str, StrictStr]] | None = None
    last_loss: list[Real] | None = None  # per model of the array, as ``models``
    last_eval: Annotated[LastEval | None, BeforeValidator(_empty_is_none)] = None
    last_eval_step: Count | None = None
    metrics_rows: Count | None = None

    @model_validator(mode="after")
    def _per_model_lists(self) -> "CheckpointRecord":
        _distinct(self.models)
        for name in ("active", "last_loss"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.models):
                raise ValueError(f"{name} has {len(values)} entries for the {len(self.models)} models {self.models}")
        return self


# ------------------------------------------------------------------------------------------------ metrics.csv
def _cell(v: Any) -> Any:
    return None if v is None or (isinstance(v, str) and v.strip() == "") else v


Cell = Annotated[float | None, BeforeValidator(_cell)]


class MetricsRow(BaseModel):
    """A row of ``metrics.csv``: a model's train loss at a logged step (``split`` train) or its evaluation
    (``split`` eval). ``model``: the original index; ``loss_scale``: fp16's after that step; ``status``: empty,
    ``diverged``, ``skipped`` (fp16: an overflowed step skipped) or ``dropped``; ``run``: the run's id. The
    columns are these fields, in this order; a file from before a column existed reads it as empty."""

    model_config = ConfigDict(extra="ignore")

    step: Annotated[int, Field(ge=0)]  # cells are text: read as numbers (not strict)
    model: Annotated[int, Field(ge=0), AfterValidator(_model_index)]
    split: Annotated[Literal["train", "eval"], BeforeValidator(lambda v: (_cell(v) or "train").strip())] = "train"
    loss: Cell = None
    accuracy: Cell = None
    lr: Cell = None
    loss_scale: Cell = None
    elapsed_s: Cell = None
    status: Annotated[str, BeforeValidator(lambda v: (v or "").strip())] = ""
    run: Annotated[str, BeforeValidator(lambda v: (v or "").strip())] = ""


METRICS_HEADER = list(MetricsRow.model_fields)
REQUIRED_COLUMNS = ("step", "model", "loss")


def read_metrics_rows(path: str, B: int | None = None, fix: str = "train the array again"
                      ) -> tuple[list[str], list[tuple[int, dict[str, str], MetricsRow]]]:
    """The header and the rows of the metrics.csv at ``path``: (line number, the row as written, the row read),
    every row checked (``B``: the array's, for the model indices). A last line without its line end was cut short
    (a full disk, a kill) and never written as far as readers are concerned. A file that is not UTF-8 text, not
    CSV, lacks a required column or has a bad cell is one InputFileError naming the file and the line."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise InputFileError(f"'{path}' is not a metrics file (not UTF-8 text at byte {e.start}); {fix}") from None
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    out = []
    try:
        reader = csv.DictReader(io.StringIO("".join(lines)))
        header = [c for c in reader.fieldnames or []]
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        if missing:
            shown = ",".join(header)[:200] or "none"
            raise InputFileError(f"'{path}' has no column '{missing[0]}' (header: {shown}); expected "
                                 f"{','.join(METRICS_HEADER)}")
        for raw in reader:
            raw.pop(None, None)  # cells beyond the header's
            try:
                out.append((reader.line_num, raw, MetricsRow.model_validate(raw, context={"B": B})))
            except ValidationError as e:
                raise InputFileError(f"'{path}' line {reader.line_num}: {problem(e)}; the file is corrupt, {fix}"
                                     ) from None
    except csv.Error as e:
        raise InputFileError(f"'{path}' is not a metrics file (CSV: {e}); {fix}") from None
    return header, out


# ------------------------------------------------------------------------------------------------ reading, writing
def problem(e: ValidationError) -> str:
    """The first problem of a pydantic error as words: where (``best.models.2.file``), what, and the value."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"] if p != "[key]")
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    if err["type"] == "missing":
        return f"{where} is missing"
    if err["type"] in ("model_type", "dict_type") and not where:
        return f"it is not a JSON object (it is {type(value).__name__ if value is not None else 'null'})"
    if "[key]" in err["loc"]:
        return f"key {where!r} {msg}"
    if not where or isinstance(value, dict):  # a rule across keys (a model validator): its message names them
        return f"{where + ': ' if where else ''}{msg}"
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"{where} {msg[:1].lower() + msg[1:]} (got {shown})"


def read_record(path: str, model: type[BaseModel], fix: str, B: int | None = None) -> dict:
    """The record of type ``model`` in the JSON file at ``path``, checked (``B``: the array's, for model indices),
    as a plain dict with every declared key (absent optional ones None). A missing file raises FileNotFoundError
    (callers say what its absence means); an unreadable, non-JSON or invalid one is one InputFileError naming the
    file and the problem, ending with ``fix``."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise InputFileError(f"'{path}' cannot be read ({e.strerror or e}); {fix}") from None
    try:
        raw = json.loads(data)  # Python's JSON: NaN and Infinity as json.dump writes them
    except UnicodeDecodeError:
        raise InputFileError(f"'{path}' is incomplete or corrupt (not UTF-8 text); {fix}") from None
    except (ValueError, RecursionError) as e:
        raise InputFileError(f"'{path}' is incomplete or corrupt (not valid JSON: {e}); {fix}") from None
    try:
        return model.model_validate(raw, context={"B": B}).model_dump()
    except ValidationError as e:
        raise invalid(path, problem(e), fix) from None


def invalid(path: str, what: str, fix: str) -> InputFileError:
    """The error of a record that reads but says something it cannot (``what``)."""
    return InputFileError(f"'{path}' is not valid: {what}; {fix}")


def record_json(record: Mapping | _Record, model: type[_Record], indent: int | None = None) -> bytes:
    """``record`` as ``model`` writes it (checked first: a record that does not validate is a bug where it was
    made, raised as pydantic's ValidationError)."""
    checked = record if isinstance(record, model) else model.model_validate(dict(record))
    return checked.model_dump_json(indent=indent).encode()

