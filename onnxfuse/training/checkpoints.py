"""Checkpoints and exact resume: a run's identity (settings and data hashes, ``run.json``), the state folders a run
writes (``checkpoints/step_<t>/``, ``trained/``), finding and checking the point a resumed run continues from
(:class:`ResumePoint`: the last run started, at its newest checkpoint or from its start), and moving models
between arrays at a checkpoint (``checkpoint_models``, ``seed_run``: a sweep's halving).

The records are declared in ``onnxfuse/core/records.py`` and checked there when read and written."""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from onnxfuse.core._io import atomic_dir
from onnxfuse.core.array import ArrayDir
from onnxfuse.core.errors import ConfigError, DataError, InputFileError
from onnxfuse.core.passes import fuse_models, fused_initial_weights
from onnxfuse.core.split import split_weights
from onnxfuse.recipe.batches import BatchSource
from onnxfuse.recipe.data import Dataset
from onnxfuse.recipe.optim import STATE_PREFIX
from onnxfuse.recipe.settings import RESUMABLE
from onnxfuse.runtime.ort.trainer import OrtTrainer
from onnxfuse.recipe.train_config import RunSettings, TrainConfig
from onnxfuse.training.best import KeptBest, prune_best
from onnxfuse.training.run_state import RunState


log = logging.getLogger("onnxfuse.train")


def _save_state(run: RunState, folder: str) -> None:
    ArrayDir.write_state(folder, run.trainer.weights(), run.trainer.optimizer_state(), run.spec, run.dropped)


def jsonable(d):
    if isinstance(d, dict):
        return {k: jsonable(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [jsonable(v) for v in d]
    if isinstance(d, float) and not math.isfinite(d):
        return str(d)
    return d


def _unjson(v):
    if isinstance(v, list):
        return [_unjson(x) for x in v]
    return float(v) if v in ("inf", "-inf", "nan") else v


def checkpoint_folders(array_dir: str) -> list[str]:
    """The checkpoint folders, oldest first."""
    return ArrayDir(array_dir).checkpoints()


CHECKPOINT_FIX = "remove that checkpoint folder to resume from the one before it, or start a new run without --resume"


def _read_state(array: ArrayDir, path: str) -> dict:
    """The record of the checkpoint ``path``, checked (``records.CheckpointRecord``)."""
    try:
        return array.checkpoint_record(path, CHECKPOINT_FIX)
    except FileNotFoundError:
        record = os.path.basename(ArrayDir.checkpoint_record_path(path))
        raise InputFileError(f"checkpoint '{path}' is incomplete or corrupt (it has no {record}); "
                             f"{CHECKPOINT_FIX}") from None


@dataclass
class ResumePoint:
    """Where ``--resume`` continues: the last run started (``run``: its record), at its newest checkpoint
    (``checkpoint``, whose record is ``state``), or from its start (None: it reached none)."""

    run: dict
    checkpoint: str | None = None
    state: dict | None = field(default=None, repr=False)
    source: str = ""  # the file the run's record was read from, for messages

    @property
    def config(self) -> dict:
        """The run's settings, data and loss, as recorded (``records.RunConfig``)."""
        return self.state["config"] if self.state is not None else self.run["config"]

    @property
    def step(self) -> int:
        return self.state["step"] if self.state is not None else 0

    @property
    def complete(self) -> bool:
        """Whether the record holds the run's inputs as validated (its data's hash, its loss): not a run killed
        while its data was read, recorded with its settings as given."""
        return self.state is not None or self.run["data_hash"] is not None

    @property
    def where(self) -> str:
        """The record this point was read from, as messages name it."""
        return f"checkpoint '{self.checkpoint}'" if self.checkpoint else f"'{self.source}'"


def resume_point(array_dir: str) -> ResumePoint:
    """Where a resumed run continues: the last run started, never an earlier one. That is the run a started
    record names when that run trained no step (from its start), else the folder's current run (run.json), from
    its newest checkpoint, or from its start when it reached none (a run recorded with its settings)."""
    array = ArrayDir(array_dir)
    started, current = array.read_started(), array.read_run()
    if started is not None and (current is None or started["id"] != current["id"]):
        if started["config"] is None:
            raise InputFileError(f"--resume: '{array.started_path}' names run {started['id']} without its settings; "
                                 "start a new run without --resume")
        return ResumePoint(started, source=array.started_path)
    found = array.checkpoints()
    if current is None:
        if found:
            raise InputFileError(f"--resume: the checkpoints in '{array.checkpoints_path}' do not say "
                                 "which run wrote them (an onnxfuse from before runs were recorded); start a new "
                                 "run without --resume")
        raise InputFileError(f"--resume: '{array_dir}' has no run to resume; train it first (with --checkpoint-every "
                             "to resume from a checkpoint)")
    for path in reversed(found):
        st = _read_state(array, path)
        if (st["run"] or {}).get("id") == current["id"]:
            return ResumePoint(current, path, st, array.run_path)
    if current["config"] is not None:
        return ResumePoint(current, source=array.run_path)
    raise InputFileError(f"--resume: the current run of '{array_dir}', {current['id']} (started "
                         f"{current['started'] or '?'}), has no checkpoint (it ran without --checkpoint-every, or "
                         "stopped before its first); start a new run without --resume")


def saved_settings(config: dict) -> dict:
    """The settings of a run's recorded ``config`` (``ResumePoint.config``), without its data and loss."""
    return {k: _unjson(v) for k, v in config.items() if not k.startswith("_")}


def _canon(v):
    """A setting's value in one form, so that equal settings hash equally however they were given (a value for
    every model or a list of one, 1 or 1.0, a tuple or a list, inf or "inf")."""
    if isinstance(v, dict):
        return {str(k): _canon(x) for k, x in sorted(v.items())}
    if isinstance(v, (list, tuple, np.ndarray)):
        items = [_canon(x) for x in v]
        return items[0] if len(items) == 1 else items
    if v is None or isinstance(v, (bool, np.bool_, str)):
        return bool(v) if isinstance(v, np.bool_) else v
    if isinstance(v, (int, float, np.integer, np.floating)):
        return float(v) if math.isfinite(float(v)) else str(float(v))
    return str(v)


def _trajectory(settings: dict) -> dict:
    """The settings that decide what a step computes (all but ``RESUMABLE``), canonical."""
    return {k: _canon(v) for k, v in settings.items() if k not in RESUMABLE and not k.startswith("_")}


def settings_hash(config: TrainConfig | RunSettings) -> str:
    """A run's settings hash: what its steps compute, not how long it runs or what it logs (``RESUMABLE``)."""
    return hashlib.sha256(json.dumps(_trajectory(config.as_dict()), sort_keys=True).encode()).hexdigest()[:16]


def data_hash(*sources) -> str:
    """The training and evaluation data as the run reads them (after the held-out split and sharding): arrays by
    their bytes; a DataLoader by what it says of itself (``LoaderBatches.identity``: its contents are not read)."""
    h = hashlib.blake2b(digest_size=16)
    for src in sources:
        ds = getattr(src, "data", src)  # ArrayBatches -> its Dataset
        if ds is None:
            h.update(b"none;")
            continue
        if not isinstance(ds, Dataset):
            h.update(f"{src.identity()};".encode())
            continue
        for name in sorted(ds.arrays):
            a = np.ascontiguousarray(ds.arrays[name])
            h.update(f"{name}:{a.dtype.str}:{a.shape}:{name in ds.per_model};".encode())
            h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def new_run(identity: dict, differing: dict | None = None, config: dict | None = None) -> dict:
    """A new run's record (``records.RunRecord``): a fresh id, ``identity`` (its settings and data hashes), when
    and by whom, the per-model settings that tell its models apart (``differing``: ``RunSettings.differing()``,
    the columns of its tables) and its recorded ``config`` (settings, data and loss: what a resume from its start
    trains with)."""
    return {"id": time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3), **identity,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "pid": os.getpid(),
            **({"differing": jsonable(differing)} if differing is not None else {}),
            **({"config": jsonable(config)} if config is not None else {})}


def check_resumable(point: ResumePoint, config: TrainConfig | RunSettings, identity: dict, data) -> None:
    """One clear error unless ``config`` and the data are those of the run ``point`` continues (a run killed
    while its data was read recorded no data hash: it trained on nothing yet)."""
    record = (point.state or {}).get("run") or point.run
    if record["settings_hash"] != identity["settings_hash"]:
        saved, given = saved_settings(point.config), config.as_dict()
        before, now = _trajectory(saved), _trajectory(given)
        key = next((k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)), None)
        # shown as given (16, not the canonical 16.0 the comparison uses)
        what = f"setting '{key}' is {given.get(key)!r} but run {record['id']} trained with {saved.get(key)!r}" \
            if key else f"the settings differ from run {record['id']}'s"
        raise ConfigError(f"--resume: {what} ({point.where}); a resumed run may change only "
                          f"{', '.join(RESUMABLE)}: resume with the run's settings, or start a new run without "
                          "--resume")
    if record["data_hash"] is not None and record["data_hash"] != identity["data_hash"]:
        shown = os.fspath(data) if isinstance(data, (str, os.PathLike)) else "the data given"
        raise DataError(f"--resume: {shown} is not the data run {record['id']} trained on ({point.where}); "
                        "resume with that run's data, or start a new run without --resume")


def restore(run: RunState, path: str, st: dict, source: BatchSource) -> float:
    """Put ``run`` where the checkpoint ``path`` (record ``st``) left it: weights, optimizer state, schedules,
    data position, best states, and what it last read and evaluated; returns the run's seconds until then."""
    fix = CHECKPOINT_FIX
    weights, opt_state, dropped = ArrayDir.read_state(path, fix, run.array.load_spec(),
                                                      [STATE_PREFIX + s for s in run.opt.state_names()])
    models = st["models"]
    if models != run.models:  # the array had shrunk: rebuild it for the survivors
        states = split_weights(ArrayDir.state_spec(path), weights, steps=st["trainer_steps"])
        run.fused, run.spec = run.array.refuse(models, states, fuse_models)
        positions = [run.models.index(b) for b in models]
        run.opt = run.settings.select(positions)
        run.schedules = run.schedules.select(positions)
        run.loss_scale = run.loss_scale.select(positions) if run.loss_scale else None
        run.models = models
        run.trainer = run._trainer()
        run.last_loss = np.full(len(models), np.nan)
    run.load(weights, opt_state)
    run.trainer.steps = st["trainer_steps"]
    if st.get("loss_scales") is not None:
        run.trainer.load_loss_scales(st["loss_scales"])
    if st.get("random") and hasattr(run.trainer, "load_random_state"):
        run.trainer.load_random_state(st["random"])
    run.keep_decision(st.get("compiled"))
    run.step = st["step"]
    run.active = st["active"]
    run.status = {int(k): v for k, v in st["status"].items()}
    run.dropped = dropped
    run.schedules.advance(st["step"])
    run.best = KeptBest.resumed(st.get("best"), run.settings.keep_best, st["step"], run.array, path)
    if st.get("last_loss") is not None:
        run.last_loss = np.array(st["last_loss"], dtype=np.float64)
    if st.get("last_eval_step") is not None:
        run.last_eval_step = st["last_eval_step"]
        run.last_eval = {metric: {int(b): v for b, v in values.items()}
                         for metric, values in (st.get("last_eval") or {}).items() if values is not None}
    try:
        source.load_state_dict(st["sampler"])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        what = f"sampler: {' '.join(str(e).split())[:160]}"
        raise InputFileError(f"'{ArrayDir.checkpoint_record_path(path)}' is not valid ({what}); {fix}") from None
    streams = getattr(source, "streams", None)  # the per-model data order's index streams
    if streams is not None and streams != len(models):
        raise InputFileError(f"checkpoint '{path}' does not match the data order; resume with the same settings")
    return float(st["elapsed_s"])


def _last_eval(run: RunState) -> dict | None:
    """The run's last evaluation as a record holds it (model indices as strings), None before the first."""
    return {metric: {str(b): v for b, v in values.items()} for metric, values in run.last_eval.items()} or None


def write_checkpoint(run: RunState, source: BatchSource, elapsed: float, metrics_rows: int | None) -> None:
    """Write checkpoints/step_<t>/ atomically (temporary folder + rename) and keep the newest keep_checkpoints
    (checkpoints/ holds the current run's only: a new run moves the previous run's aside before its first).
    ``metrics_rows``: the rows of metrics.csv the run has written by now (a resume keeps exactly these)."""
    path = run.array.checkpoint_path(run.step)
    with atomic_dir(path, overwrite=True, command="train") as tmp:
        _save_state(run, tmp)
        ArrayDir.write_checkpoint_record(tmp, jsonable({
            **run.state(), "sampler": source.state_dict(), "elapsed_s": elapsed, "config": run.config_record,
            "run": run.run_record, "best": run.best.record(), "last_loss": [float(v) for v in run.last_loss],
            "last_eval": _last_eval(run), "last_eval_step": run.last_eval_step if run.last_eval_step >= 0 else None,
            "metrics_rows": metrics_rows}))
    run.array.prune_checkpoints(run.settings.keep_checkpoints)
    prune_best(run.array, run.best)
    log.info("checkpoint at step %d: %s", run.step, path)


@dataclass
class CheckpointModels:
    """Every model of an array at its current run's newest checkpoint, one by one (original index -> ...)."""
    record: dict  # the checkpoint's state.json: step, sampler, run (id, settings and data hashes), ...
    states: dict[int, dict[str, np.ndarray]]  # state_dicts
    optimizer: dict[int, dict[str, np.ndarray]]  # each model's slice of every optimizer buffer
    status: dict[int, dict]  # a diverged model's {"status", "step"}
    best: dict[int, dict]  # a model's best state so far: its entry of the kept record (step, value...) and "state"


def checkpoint_models(array_dir: str | os.PathLike) -> CheckpointModels:
    """The models of the array in ``array_dir`` as its newest checkpoint holds them, each on its own: what
    :func:`seed_run` puts together again in another array (a sweep's successive halving re-fuses the survivors
    of several arrays into one)."""
    array_dir = os.fspath(array_dir)
    point = resume_point(array_dir)
    path, st = point.checkpoint, point.state
    if path is None:
        raise InputFileError(f"'{array_dir}': its run {point.run['id']} has no checkpoint; train the array again")
    weights, opt_state, _ = ArrayDir.read_state(path, "train the array again", ArrayDir(array_dir).load_spec())
    models = st["models"]
    states = split_weights(ArrayDir.state_spec(path), weights, steps=st["trainer_steps"])
    array, fix = ArrayDir(array_dir), "train the array again"
    best = {int(b): {**e, "state": array.best_state(int(b), e["file"], fix)}
            for b, e in ((st.get("best") or {}).get("models") or {}).items() if int(b) in models}
    return CheckpointModels(st, dict(zip(models, states)),
                            {b: {k: v[i] for k, v in opt_state.items()} for i, b in enumerate(models)},
                            {int(k): v for k, v in st["status"].items() if int(k) in models}, best)


def seed_run(array_dir: str | os.PathLike, config: TrainConfig, optimizer: Sequence[Mapping[str, np.ndarray]],
             status: Sequence[dict | None], template: dict, best: Sequence[dict | None] = ()) -> None:
    """Make the array in ``array_dir`` (fused from models as :func:`checkpoint_models` gave them: its initial
    weights are their current ones) a run that ``train_array(..., resume=True)`` continues, at the step of the
    checkpoint record ``template`` (its sampler position and data hash: every source array trained on the same
    data and batches), with model b's optimizer state ``optimizer[b]``, its diverged ``status[b]`` and its best
    state so far ``best[b]`` (:class:`CheckpointModels`' entry; kept by the template's metric)."""
    array = ArrayDir(array_dir)
    fused, spec = array.load()
    weights = fused_initial_weights(fused)
    opt_state = {k: np.stack([o[k] for o in optimizer]) for k in optimizer[0]} if optimizer and optimizer[0] else {}
    record = new_run({"settings_hash": settings_hash(config), "data_hash": template["run"]["data_hash"]},
                     config.differing(spec.B), config.as_dict())
    kept = template.get("best")
    if kept:  # each model's best state, under its place in this array
        models = {}
        for b, entry in enumerate(best):
            if entry:
                name = ArrayDir.best_file(b, entry["step"])
                array.write_best_state(name, entry["state"])
                models[str(b)] = {**{k: v for k, v in entry.items() if k != "state"}, "file": name}
        kept = {**kept, "models": models}
    run_record = {k: record[k] for k in ("id", "settings_hash", "data_hash")}
    st = {k: template[k] for k in ("step", "trainer_steps", "sampler", "elapsed_s")}
    st.update(compiled=template.get("compiled"), models=list(range(spec.B)), active=[not (s and s.get("status") == "diverged") for s in status],
              status={str(b): s for b, s in enumerate(status) if s}, config=jsonable(config.as_dict()),
              run=run_record, best=kept)
    with atomic_dir(array.checkpoint_path(st["step"]), command="train") as tmp:
        ArrayDir.write_state(tmp, weights, opt_state, spec, {})
        ArrayDir.write_checkpoint_record(tmp, st)
    array.write_run(record)


def write_trained(run: RunState, folder: str, elapsed: float, stopped: str | None) -> None:
    _save_state(run, folder)
    if isinstance(run.trainer, OrtTrainer):  # onnxruntime's own checkpoint, for users of its training API
        run.trainer.save_checkpoint(ArrayDir.ort_checkpoint_path(folder))
    final = {b: float(run.last_loss[i]) for i, b in enumerate(run.models)}
    ArrayDir.write_train_state(folder, **jsonable({
        "steps": run.trainer.steps, "models": run.models, "status": {str(k): v for k, v in run.status.items()},
        "run": run.run_record, "step": run.step, "final_loss": {str(k): v for k, v in final.items()},
        "eval": _last_eval(run), "elapsed_s": elapsed, "stopped": stopped, "config": run.config_record,
        "best": run.best.record()}))
