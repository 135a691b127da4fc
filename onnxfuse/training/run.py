"""A training run of a fused array, as a sweep needs it: per-model schedules, evaluation every K steps, fault
isolation, successive halving, periodic checkpoints and exact resume.

Files in the array folder (``onnxfuse.core.array.ArrayDir`` owns them; a run holds the folder's lock throughout):

    run.json                         the current run: id, settings hash, data hash, start time
    metrics.csv                      step,model,split,loss,accuracy,lr,elapsed_s,status,run   (model = original index)
    checkpoints/step_00000120/       weights, optimizer state, dropped models, state.json (with the run's id);
                                     written atomically, the last ``keep_checkpoints`` kept
    trained/                         the final state: weights.safetensors of the surviving array (array.json
                                     describes it), dropped/model_<b>.safetensors, train_state.json (the run's id)
    runs/<run id>/                   an earlier run's outputs, moved there when a new run has trained its first step

Before a fresh run trains, it checks its data (no NaN or inf unless ``allow_nonfinite_data``) and verifies its
first ``verify_steps`` steps against every model trained alone (``verify.py``); a failure stops it before anything
is written. ``verify_array`` runs the same check on demand.

A resumed run continues the folder's current run, from its newest checkpoint, and only with the same settings
(those in ``RESUMABLE`` may change) and the same data; it restores weights, optimizer state, schedule position,
data position and RNG state, so its final weights are those of an uninterrupted run.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import logging
import math
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx

from onnxfuse.core._io import atomic_dir
from onnxfuse.core.array import ArrayDir, complete_lines
from onnxfuse.core.errors import ConfigError, DataError, InputFileError, OnnxFuseError, OutOfMemoryError, OutputError, \
    TrainingStoppedError, as_user_error, shell
from onnxfuse.core.passes import fuse_models, fused_initial_weights
from onnxfuse.core.split import model_steps, split_weights
from onnxfuse.core.weights import ArraySpec

from onnxfuse.recipe.data import BatchSampler, Dataset, check_finite, load_npz, make_dataset
from onnxfuse.recipe.losses import LABELS, LossSpec, get_loss
from onnxfuse.recipe.optim import STATE_PREFIX, OptimizerConfig, StepValues, make_optimizer
from onnxfuse.recipe.schedules import PerModelSchedules, check_schedules
from onnxfuse.recipe.settings import OPTIMIZERS, RESUMABLE, TrainSettings, check_halving, train_config_model
from onnxfuse.recipe.runtimes import Runtime, make_trainer, resolve_runtime
from onnxfuse.runtime.ort_runtime import FusedTrainer, load_array
from onnxfuse.training.verify import VerifyReport, has_random_dropout, verify_steps, without_dropout

__all__ = ["TrainConfig", "TrainResult", "train_array", "verify_array", "TrainingStopped", "METRICS_HEADER",
           "RESUMABLE", "settings_hash", "checkpoint_models", "seed_run", "CheckpointModels"]

log = logging.getLogger("onnxfuse.train")
METRICS_HEADER = ["step", "model", "split", "loss", "accuracy", "lr", "elapsed_s", "status", "run"]


TrainingStopped = TrainingStoppedError  # the run stopped early on purpose (on_diverge="stop"); its state is saved


class _TrainConfigMethods(TrainSettings):
    """What a run does with its settings (the fields come from ``settings.py``)."""

    def optimizer_config(self, B: int) -> OptimizerConfig:
        hyper = {p.name: getattr(self, p.name, None) for p in OPTIMIZERS[self.optimizer].params}
        return make_optimizer(self.optimizer, B, max_norm=self.clip_grad_norm, **hyper)

    def loss_spec(self) -> LossSpec:
        return get_loss(self.loss, per_model_labels=self.per_model_labels or self.data_order != "shared",
                        **self.loss_options)


# Everything a run takes (see ``onnxfuse train --help``): every setting of settings.RUN_SETTINGS and every
# hyper-parameter of the registered optimizers, a scalar or (per model) a list of B; the schedule; the loss options.
# Checked when made: a bad value is one ConfigError line.
TrainConfig = train_config_model(_TrainConfigMethods)


@dataclass
class TrainResult:
    steps: int
    final_loss: list[float]  # per original model (NaN for a model dropped before the end)
    elapsed_s: float
    samples_per_s: float
    metrics_path: str
    trained_dir: str
    status: dict = field(default_factory=dict)  # original model -> {"status": diverged|dropped, "step": t}
    eval: dict = field(default_factory=dict)  # the last evaluation: {"loss": [...], "accuracy": [...]} per model
    survivors: list[int] = field(default_factory=list)
    run_id: str = ""


# ---------------------------------------------------------------------------------------------------- validation
def _validate(config: TrainConfig, spec: ArraySpec) -> None:
    """The settings against the array, before anything is read or written: one clear line per problem. Every
    value alone was checked when ``config`` was made; made again here, in case a field was set since."""
    config = type(config).from_dict(config.as_dict())
    if config.data_order != "shared":
        shared = [i["name"] for i in spec.inputs if not i.get("per_model")]
        if shared:
            raise ConfigError(f"--data-order {config.data_order} gives every model other samples, but graph input "
                              f"'{shared[0]}' is shared: fuse with --per-model-inputs {','.join(shared)}")
    resolve_runtime(config.runtime, config.device)
    config.loss_spec()
    config.optimizer_config(spec.B)


# ---------------------------------------------------------------------------------------------------------- data
def _load_arrays(data, spec: ArraySpec, what: str) -> tuple[dict, str]:
    """A .npz path, "sklearn:<name>", a dict of arrays or a torch Dataset -> (arrays, a name for messages)."""
    if data is None:
        raise ConfigError(f"no {what} data given (--data)")
    if isinstance(data, dict):
        return dict(data), what
    if isinstance(data, (str, os.PathLike)):
        text = os.fspath(data)
        if text.startswith("sklearn:"):
            from onnxfuse.recipe import datasets

            arrays = datasets.load_named(text)
            shapes = {i["name"]: i["shape"] for i in spec.inputs}
            return {k: datasets.reshape_for_input(v, shapes[k]) if k in shapes else v for k, v in arrays.items()}, text
        return load_npz(text), text
    try:
        import torch

        if isinstance(data, torch.utils.data.DataLoader):
            # onnxfuse batches itself (--batch-size, --seed), so that a resumed run draws the same batches: the
            # loader's dataset is what is used
            data = data.dataset
        if isinstance(data, torch.utils.data.Dataset):
            from onnxfuse.recipe import datasets

            return datasets.from_torch_dataset(data, [i["name"] for i in spec.inputs]), what
    except ImportError:  # pragma: no cover
        pass
    raise ConfigError(f"{what} data must be a .npz path, 'sklearn:<name>', a dict of arrays or a torch Dataset, "
                      f"got {type(data).__name__}")


def _datasets(data, eval_data, config: TrainConfig, spec: ArraySpec, loss: LossSpec) -> tuple[Dataset, Dataset | None]:
    arrays, source = _load_arrays(data, spec, "training")
    eval_arrays, eval_source = (None, None) if eval_data is None else _load_arrays(eval_data, spec, "evaluation")
    if not config.allow_nonfinite_data:  # before any split or shard: indices as in the file
        dtypes = {i["name"]: i["dtype"] for i in spec.inputs}
        if loss.label_dtype is not None:
            dtypes[LABELS] = np.dtype(loss.label_dtype).name
        for a, src in ((arrays, source), (eval_arrays, eval_source)):
            if a is not None:
                check_finite(a, dtypes, src)
    per_model = {i["name"] for i in spec.inputs if i.get("per_model")}
    if config.data_order == "shards":
        from onnxfuse.recipe import datasets

        arrays = datasets.shard(arrays, spec.B, set())
        per_model_arrays = set(arrays)
    else:
        per_model_arrays = per_model | ({LABELS} if config.per_model_labels else set())
    if eval_arrays is None and config.eval_fraction > 0:
        from onnxfuse.recipe import datasets

        arrays, eval_arrays = datasets.split_holdout(arrays, config.eval_fraction, config.seed, per_model_arrays)
        eval_source = f"{source} (held-out {config.eval_fraction:g})"
    out_shape = spec.outputs[0]["shape"]
    loss.check_output(out_shape, spec.outputs[0]["name"])

    def build(a, src, sharded):
        inputs = [dict(i, per_model=i["name"] in per_model_arrays if sharded else i.get("per_model", False))
                  for i in spec.inputs]
        labels_pm = (LABELS in per_model_arrays) if sharded else loss.per_model_labels
        if config.data_order == "per-model" and not sharded:
            # shared arrays, indexed per model by the sampler: [n, ...] in, [B, N, ...] out
            inputs = [dict(i, per_model=False) for i in spec.inputs]
            labels_pm = False
        ds = make_dataset(a, inputs, loss.label_dtype, loss.label_shape(out_shape), source=src, B=spec.B,
                          per_model_labels=labels_pm)
        _check_labels(ds, loss, out_shape, src)
        return ds

    train = build(arrays, source, config.data_order == "shards")
    evaluation = None if eval_arrays is None else build(eval_arrays, eval_source, config.data_order == "shards")
    return train, evaluation


def _check_labels(ds: Dataset, loss: LossSpec, out_shape, source: str) -> None:
    K = loss.num_classes(out_shape)
    if K is None or LABELS not in ds.arrays:
        return
    labels = ds.arrays[LABELS]
    labels = labels[labels != loss.ignore_index]
    if labels.size and (labels.min() < 0 or labels.max() >= K):
        raise DataError(f"{source}: 'labels' must be class indices in [0, {K}) (or the ignore index "
                        f"{loss.ignore_index}) for the model's {K} classes, found {labels.min()}..{labels.max()}")


def _full_batch(ds: Dataset, idx: np.ndarray) -> dict[str, np.ndarray]:
    """The step's arrays for every model of the array."""
    if idx.ndim == 2:  # per-model order: [B, N] indices into shared arrays -> [B, N, ...]
        return {k: v[idx] for k, v in ds.arrays.items()}
    return ds.batch(idx)


def _batch(ds: Dataset, idx: np.ndarray, run: "_Run") -> dict[str, np.ndarray]:
    """The step's arrays for the models still in the array."""
    if idx.ndim == 2 or len(run.models) == run.spec0.B:
        return _full_batch(ds, idx)
    rows = np.asarray(run.models)[:, None]  # per-model arrays: the surviving models' rows only
    return {k: (v[rows, idx[None, :]] if k in ds.per_model else v[idx]) for k, v in ds.arrays.items()}


# ----------------------------------------------------------------------------------------------------- the run
class _Run:
    """The mutable state of one run: the current (possibly shrunk) array and everything needed to checkpoint it."""

    def __init__(self, array_dir: str, config: TrainConfig, fused: onnx.ModelProto, spec: ArraySpec,
                 loss: LossSpec, total_steps: int, workdir: str):
        self.array_dir, self.config, self.loss, self.total = array_dir, config, loss, total_steps
        self.array = ArrayDir(array_dir)
        self.workdir = workdir
        self.spec0 = spec  # the original array (all B models)
        self.models = list(range(spec.B))  # original index of each model of the current array
        self.status: dict[int, dict] = {}  # original model -> {"status": ..., "step": ...}
        self.active = [True] * spec.B
        self.dropped: dict[int, dict[str, np.ndarray]] = {}  # original model -> its state_dict when dropped
        self.opt0, self.schedules = _optimizer_and_schedules(config, spec.B, total_steps)
        self.opt = self.opt0
        self.fused, self.spec = fused, spec
        self.trainer = self._trainer()
        self.step = 0
        self.last_loss = np.full(spec.B, np.nan)
        self.last_eval: dict = {}
        self.last_eval_step = -1
        self.config_record: dict = config.as_dict()
        self.run_record: dict = {}  # the run's id, settings hash and data hash (written with every state)

    def _trainer(self) -> Runtime:
        os.makedirs(self.workdir, exist_ok=True)
        folder = os.path.join(self.workdir, f"artifacts_{len(os.listdir(self.workdir))}_b{len(self.models)}")
        return make_trainer(self.config.runtime, self.fused, self.spec, self.loss, self.opt, self.config.device,
                            workdir=folder, threads=self.config.threads or None)

    # ---- state
    def state(self) -> dict:
        return {"step": self.step, "models": self.models, "active": self.active, "trainer_steps": self.trainer.steps,
                "status": {str(k): v for k, v in self.status.items()}}

    def per_model_states(self) -> list[dict[str, np.ndarray]]:
        # num_batches_tracked counts the steps each model took: a diverged model's stopped with it
        steps = [model_steps(self.status.get(b), self.trainer.steps) for b in self.models]
        return split_weights(self.spec, self.trainer.weights(), steps=steps)

    def load(self, weights: dict, opt_state: dict) -> None:
        self.trainer.load({**weights, **opt_state})

    # ---- shrinking
    def keep(self, positions: Sequence[int], reason: str) -> None:
        """Re-fuse the array with only the models at ``positions``, with their current weights, optimizer state
        and schedule position; the others are recorded as ``reason`` (e.g. dropped) at this step."""
        positions = list(positions)
        states = self.per_model_states()
        opt_state = self.trainer.optimizer_state()
        for i, b in enumerate(self.models):
            if i not in positions:
                self.dropped[b] = states[i]
                before = self.status.get(b, {})
                self.status[b] = {"status": reason, "step": self.step,
                                  **({"diverged": before["step"]} if before.get("status") == "diverged" else {})}
        survivors = [self.models[i] for i in positions]
        self.fused, self.spec = self.array.refuse(survivors, [states[i] for i in positions], fuse_models)
        self.opt = self.opt.select(positions)
        self.schedules = self.schedules.select(positions)
        steps = self.trainer.steps
        self.trainer = self._trainer()
        self.trainer.steps = steps
        self.load({}, {k: v[positions] for k, v in opt_state.items()})
        self.active = [self.active[i] for i in positions]
        self.models = survivors
        self.last_loss = self.last_loss[positions]


def _optimizer_and_schedules(config: TrainConfig, B: int, total_steps: int
                             ) -> tuple[OptimizerConfig, PerModelSchedules]:
    """The array's optimizer configuration and its per-model schedules at step 0."""
    opt = config.optimizer_config(B)
    schedules = PerModelSchedules(check_schedules(config.schedule, B, total_steps), opt, total_steps)
    opt.momentum_varies = schedules.moves_momentum  # one-cycle moves SGD's momentum: keep a momentum buffer
    return opt, schedules


# ----------------------------------------------------------------------------------------------------- metrics
class _Metrics:
    """metrics.csv of one run: every row carries the run's id. A resumed run keeps its rows up to the checkpoint's
    step and writes the rest again."""

    def __init__(self, path: str, run_id: str, resume_step: int | None):
        self.path, self.run_id = path, run_id
        rows = []
        if resume_step is not None and os.path.exists(path):
            rows = [r for r in csv.DictReader(complete_lines(path))
                    if r.get("run") == run_id and int(r["step"]) <= resume_step]
        # the kept rows go to a temporary file renamed into place: a kill while they are written leaves the old
        # file whole (and the temporary file, which the next command removes)
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, METRICS_HEADER)
                w.writeheader()
                w.writerows(rows)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self.f = open(path, "a", newline="")
            self.w = csv.DictWriter(self.f, METRICS_HEADER)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise (as_user_error(e, path) or e) from e

    def write(self, rows: list[dict]) -> None:
        try:
            self.w.writerows([{**r, "run": self.run_id} for r in rows])
            self.f.flush()
        except OSError as e:
            raise (as_user_error(e, self.path) or e) from e

    def close(self) -> None:
        try:
            self.f.close()
        except OSError:  # reported by the write that failed
            pass


def _fmt(v) -> str:
    return "" if v is None else f"{v:.7g}"


# ------------------------------------------------------------------------------------------------- checkpoints
def _save_state(run: _Run, folder: str) -> None:
    ArrayDir.write_state(folder, run.trainer.weights(), run.trainer.optimizer_state(), run.spec, run.dropped)


def _jsonable(d):
    if isinstance(d, dict):
        return {k: _jsonable(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [_jsonable(v) for v in d]
    if isinstance(d, float) and not math.isfinite(d):
        return str(d)
    return d


def _unjson(v):
    if isinstance(v, list):
        return [_unjson(x) for x in v]
    return float(v) if v in ("inf", "-inf", "nan") else v


def _checkpoints(array_dir: str) -> list[str]:
    """The checkpoint folders, oldest first."""
    return ArrayDir(array_dir).checkpoints()


def _damaged(path: str, what: str) -> InputFileError:
    return InputFileError(f"checkpoint '{path}' is incomplete or corrupt ({what}); remove that folder to resume "
                          "from the checkpoint before it, or start a new run without --resume")


def _read_state(path: str) -> dict:
    record = os.path.basename(ArrayDir.checkpoint_record_path(path))
    try:
        st = ArrayDir.read_checkpoint_record(path)
        for key in ("step", "models", "active", "trainer_steps", "status", "sampler", "elapsed_s", "config"):
            st[key]
    except FileNotFoundError:
        raise _damaged(path, f"it has no {record}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _damaged(path, f"{record}: {type(e).__name__} {e}") from e
    return st


def _resume_point(array_dir: str) -> tuple[str, dict]:
    """The newest checkpoint of the folder's current run, and its state: a resumed run continues that run only."""
    array = ArrayDir(array_dir)
    current = array.read_run()
    found = array.checkpoints()
    if current is None:
        if found:
            raise InputFileError(f"--resume: the checkpoints in '{array.checkpoints_path}' do not say "
                                 "which run wrote them (an onnxfuse from before runs were recorded); start a new "
                                 "run without --resume")
        raise InputFileError(f"--resume: '{array_dir}' has no checkpoint; train with --checkpoint-every first")
    for path in reversed(found):
        st = _read_state(path)
        if (st.get("run") or {}).get("id") == current["id"]:
            return path, st
    raise InputFileError(f"--resume: the current run of '{array_dir}', {current['id']} (started "
                         f"{current.get('started', '?')}), has no checkpoint (it ran without --checkpoint-every, or "
                         "stopped before its first); start a new run without --resume")


def _saved_settings(st: dict) -> dict:
    return {k: _unjson(v) for k, v in st["config"].items() if not k.startswith("_")}


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


def settings_hash(config: TrainConfig) -> str:
    """A run's settings hash: what its steps compute, not how long it runs or what it logs (``RESUMABLE``)."""
    return hashlib.sha256(json.dumps(_trajectory(config.as_dict()), sort_keys=True).encode()).hexdigest()[:16]


def _data_hash(*datasets: Dataset | None) -> str:
    """The training and evaluation data as the run reads them (after the held-out split and sharding)."""
    h = hashlib.blake2b(digest_size=16)
    for ds in datasets:
        if ds is None:
            h.update(b"none;")
            continue
        for name in sorted(ds.arrays):
            a = np.ascontiguousarray(ds.arrays[name])
            h.update(f"{name}:{a.dtype.str}:{a.shape}:{name in ds.per_model};".encode())
            h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def _new_run(identity: dict) -> dict:
    """A new run's record (run.json): a fresh id, ``identity`` (its settings and data hashes), when and by whom."""
    return {"id": time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3), **identity,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "pid": os.getpid()}


def _check_resumable(ckpt: str, st: dict, config: TrainConfig, identity: dict, data) -> dict:
    """The checkpoint's run record, when ``config`` and the data are those of its run; else one clear error."""
    record = st.get("run") or {}
    if record.get("settings_hash") != identity["settings_hash"]:
        saved, given = _saved_settings(st), config.as_dict()
        before, now = _trajectory(saved), _trajectory(given)
        key = next((k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)), None)
        # shown as given (16, not the canonical 16.0 the comparison uses)
        what = f"setting '{key}' is {given.get(key)!r} but run {record.get('id')} trained with {saved.get(key)!r}" \
            if key else f"the settings differ from run {record.get('id')}'s"
        raise ConfigError(f"--resume: {what} (checkpoint '{ckpt}'); a resumed run may change only "
                          f"{', '.join(RESUMABLE)}: resume with the run's settings, or start a new run without "
                          "--resume")
    if record.get("data_hash") != identity["data_hash"]:
        shown = os.fspath(data) if isinstance(data, (str, os.PathLike)) else "the data given"
        raise DataError(f"--resume: {shown} is not the data run {record.get('id')} trained on (checkpoint "
                        f"'{ckpt}'); resume with that run's data, or start a new run without --resume")
    return record


def _restore(run: _Run, path: str, st: dict, sampler: BatchSampler) -> float:
    fix = "remove that checkpoint folder to resume from the one before it, or start a new run without --resume"
    weights, opt_state, dropped = ArrayDir.read_state(path, fix, run.array.load_spec(),
                                                      [STATE_PREFIX + s for s in run.opt.state_names()])
    models = st["models"]
    if models != run.models:  # the array had shrunk: rebuild it for the survivors
        states = split_weights(ArrayDir.state_spec(path), weights, steps=st["trainer_steps"])
        run.fused, run.spec = run.array.refuse(models, states, fuse_models)
        positions = [run.models.index(b) for b in models]
        run.opt = run.opt0.select(positions)
        run.schedules = run.schedules.select(positions)
        run.models = models
        run.trainer = run._trainer()
        run.last_loss = np.full(len(models), np.nan)
    run.load(weights, opt_state)
    run.trainer.steps = st["trainer_steps"]
    run.step = st["step"]
    run.active = st["active"]
    run.status = {int(k): v for k, v in st["status"].items()}
    run.dropped = dropped
    run.schedules.advance(st["step"])
    sampler.load_state_dict(st["sampler"])
    if sampler.per_model is not None and sampler.per_model != len(models):
        raise InputFileError(f"checkpoint '{path}' does not match the data order; resume with the same settings")
    log.info("resumed from %s (step %d)", path, run.step)
    return float(st["elapsed_s"])


# -------------------------------------------------------------------------------------------------- evaluation
def _evaluate(run: _Run, data: Dataset | None, metrics: _Metrics, elapsed: float) -> dict:
    if data is None:
        return {}
    ev = run.trainer.evaluate(_model_view(data, run), run.config.eval_batch_size)
    lrs = run.schedules.values(run.active).lr
    metrics.write([{"step": run.step, "model": b, "split": "eval", "loss": _fmt(ev["loss"][i]),
                    "accuracy": _fmt(ev["accuracy"][i]) if "accuracy" in ev else "", "lr": _fmt(lrs[i]),
                    "elapsed_s": f"{elapsed:.4f}", "status": ""} for i, b in enumerate(run.models)])
    run.last_eval_step = run.step
    run.last_eval = {"loss": dict(zip(run.models, ev["loss"].tolist())),
                     **({"accuracy": dict(zip(run.models, ev["accuracy"].tolist()))} if "accuracy" in ev else {})}
    return ev


def _model_view(data: Dataset, run: _Run) -> Dataset:
    """Per-model arrays restricted to the models still in the array."""
    if not data.per_model or len(run.models) == run.spec0.B:
        return data
    return Dataset({k: (v[run.models] if k in data.per_model else v) for k, v in data.arrays.items()}, data.per_model)


def _halve(run: _Run, ev: dict) -> list[int]:
    """Successive halving: keep the best ``halving_keep`` of the models by eval loss (diverged ones last)."""
    loss = np.where(np.isfinite(ev["loss"]) & np.array(run.active), ev["loss"], np.inf)
    k = max(1, math.ceil(len(run.models) * run.config.halving_keep))
    order = sorted(range(len(run.models)), key=lambda i: (loss[i], i))
    keep = sorted(order[:k])
    dropped = [run.models[i] for i in range(len(run.models)) if i not in keep]
    log.info("step %d: successive halving keeps models %s, drops %s", run.step, [run.models[i] for i in keep], dropped)
    run.keep(keep, "dropped")
    return keep


# ------------------------------------------------------------------------------------------------ verification
def _first_steps(ds: Dataset, sampler: BatchSampler, config: TrainConfig, B: int, total: int, K: int
                 ) -> tuple[list[dict[str, np.ndarray]], list[StepValues]]:
    """The batches and per-model step values of a fresh run's first K steps, drawn without moving ``sampler``."""
    position = sampler.state_dict()
    batches = [_full_batch(ds, sampler.next()) for _ in range(K)]
    sampler.load_state_dict(position)
    _, schedules = _optimizer_and_schedules(config, B, total)
    values = []
    for _ in range(K):
        values.append(schedules.values([True] * B))
        schedules.advance()
    return batches, values


def _verify(array_dir: str, fused: onnx.ModelProto, spec: ArraySpec, trainer: Runtime | None, ds: Dataset,
            sampler: BatchSampler, config: TrainConfig, total: int, K: int) -> VerifyReport:
    """Check the first K steps of the array ``fused`` against every model trained alone in a one-model array
    fused from ``sources/model_0.onnx`` with model 0's weights (see ``verify.py``). ``trainer``: the run's trainer
    of ``fused`` at step 0 (left as it was), or None to build one for the check. An array with random Dropout is
    checked with Dropout off, in a trainer of its own."""
    t0 = time.perf_counter()
    dropout_off = has_random_dropout(fused)
    if trainer is None or dropout_off:
        opt, _ = _optimizer_and_schedules(config, spec.B, total)
        trainer = make_trainer(config.runtime, without_dropout(fused) if dropout_off else fused, spec,
                               config.loss_spec(), opt, config.device, threads=config.threads or None)
    model, one_spec = ArrayDir(array_dir).refuse([0], split_weights(spec, trainer.weights())[:1], fuse_models)
    batches, values = _first_steps(ds, sampler, config, spec.B, total, K)
    report = verify_steps(trainer, (without_dropout(model) if dropout_off else model, one_spec), batches, values)
    # the time includes the reference's fusion and, with Dropout, the check's own trainer
    return replace(report, seconds=time.perf_counter() - t0, dropout_off=dropout_off)


# ---------------------------------------------------------------------------------------------------------- main
@dataclass
class _Prepared:
    """A run's inputs, validated: nothing is written before this exists."""

    config: TrainConfig
    loss: LossSpec
    train: Dataset
    eval: Dataset | None
    sampler: BatchSampler
    total: int


def _prepare(spec: ArraySpec, config: TrainConfig | None, data, eval_data) -> _Prepared:
    """Validate the settings against the array, load the data, and count the run's steps."""
    if config is None:
        raise ConfigError("no training configuration given")
    if len(spec.outputs) != 1:
        raise ConfigError(f"the array has {len(spec.outputs)} outputs; training needs exactly one")
    _validate(config, spec)
    loss = config.loss_spec()
    train_ds, eval_ds = _datasets(data, eval_data, config, spec, loss)
    if config.halving and eval_ds is None:
        raise ConfigError("--halving ranks models by eval loss: give --eval-data or --eval-fraction")
    sampler = BatchSampler(len(train_ds), config.batch_size, config.shuffle, config.seed,
                           per_model=spec.B if config.data_order == "per-model" else None)
    total = config.steps if config.steps is not None else config.epochs * sampler.batches_per_epoch
    check_halving(config.halving, total)
    return _Prepared(config, loss, train_ds, eval_ds, sampler, total)


def verify_array(array_dir: str | os.PathLike, data=None, config: TrainConfig | None = None,
                 eval_data=None) -> VerifyReport:
    """The check a fresh ``train_array`` makes before it trains (see ``verify.py``), on demand: the first
    ``config.verify_steps`` steps of every model of the array in ``array_dir`` against the model trained alone,
    with the run's data, batches, loss and hyper-parameters. Nothing is written to ``array_dir``; the report says
    per model what was compared (``report.ok``, ``report.table()``, ``report.error()``)."""
    array_dir = os.fspath(array_dir)
    fused, spec = load_array(array_dir)
    with ArrayDir(array_dir).locked("check"):
        p = _prepare(spec, config, data, eval_data)
        if p.config.verify_steps < 1:
            raise ConfigError("--verify-steps must be >= 1 to check anything, got 0")
        return _verify(array_dir, fused, spec, None, p.train, p.sampler, p.config, p.total,
                       min(p.config.verify_steps, p.total))


def train_array(array_dir: str | os.PathLike, data=None, config: TrainConfig | None = None, progress: bool = True,
                eval_data=None, resume: bool = False, overrides: dict | None = None,
                on_step: Callable[[int, int], None] | None = None, stop_at: int | None = None) -> TrainResult:
    """Train every model of the array in ``array_dir``; ``metrics.csv``, ``checkpoints/`` and ``trained/`` go
    there, holding the folder's lock throughout (``ArrayBusyError`` when another process holds it).

    Everything is validated before anything is written, the data included (no NaN or inf unless
    ``config.allow_nonfinite_data``); a fresh run then checks its first ``config.verify_steps`` steps against every
    model trained alone (``verify.py``) and raises ``VerificationError``, having written nothing, on a mismatch.
    When its first step has trained, a fresh run becomes the folder's current run (``run.json``): the previous
    run's outputs move to ``runs/<its id>/``. ``resume``: continue the current run from its newest checkpoint,
    with its saved settings unless ``config`` is given (``overrides`` changes single settings, e.g. more steps);
    settings other than ``RESUMABLE`` and the data must be the run's own. ``on_step(step, total)`` is called
    after every step (a sweep reports progress with it).

    ``stop_at`` ends the run at that step with a checkpoint there (its schedules still span every step, so
    ``resume`` continues exactly): a sweep's successive halving stops every array at each rung."""
    array_dir = os.fspath(array_dir)
    fused, spec = load_array(array_dir)
    with ArrayDir(array_dir).locked("train"):
        return _train(array_dir, fused, spec, data, config, progress, eval_data, resume, overrides, on_step,
                      stop_at)


def _train(array_dir: str, fused: onnx.ModelProto, spec: ArraySpec, data, config: TrainConfig | None,
           progress: bool, eval_data, resume: bool, overrides: dict | None,
           on_step: Callable[[int, int], None] | None = None, stop_at: int | None = None) -> TrainResult:
    from tqdm import tqdm

    ckpt, saved = _resume_point(array_dir) if resume else (None, None)
    if ckpt is not None:
        data = data if data is not None else saved["config"].get("_data")
        eval_data = eval_data if eval_data is not None else saved["config"].get("_eval_data")
        if config is None:  # the run's own settings (inf was written as a string)
            settings = _saved_settings(saved)
            if overrides and "epochs" in overrides:
                settings["steps"] = None
            config = TrainConfig.from_dict({**settings, **(overrides or {})})
    p = _prepare(spec, config, data, eval_data)
    config, loss, train_ds, eval_ds, sampler, total = p.config, p.loss, p.train, p.eval, p.sampler, p.total
    identity = {"settings_hash": settings_hash(config), "data_hash": _data_hash(train_ds, eval_ds)}
    if ckpt is not None:
        record = _check_resumable(ckpt, saved, config, identity, data)
    else:
        record = _new_run(identity)
    run_id = record["id"]
    array = ArrayDir(array_dir)
    metrics_path = array.metrics_path

    trained = array.trained_path
    with atomic_dir(trained, overwrite=True, command="train") as tmp:  # removed again if anything below fails
        run = _Run(array_dir, config, fused, spec, loss, total, ArrayDir.scratch_path(tmp))
        run.run_record = {k: record[k] for k in ("id", "settings_hash", "data_hash")}
        elapsed0 = _restore(run, ckpt, saved, sampler) if ckpt is not None else 0.0
        if run.step > total:
            raise ConfigError(f"--resume: run {run_id}'s newest checkpoint is at step {run.step}, past the {total} "
                              "steps asked for; resume with more --steps (or --epochs)")
        if ckpt is None and config.verify_steps:  # before anything is written
            report = _verify(array_dir, fused, spec, run.trainer, train_ds, sampler, config, total,
                             min(config.verify_steps, total))
            log.info("%s", report.summary())
            if not report.ok:
                raise report.error()
        # a fresh run's outputs begin once its first step has trained (see below): until then a failure leaves
        # the folder as it was
        metrics = _Metrics(metrics_path, run_id, run.step) if ckpt is not None else None
        end = total if stop_at is None else min(stop_at, total)
        data_record = {"_data": os.fspath(data) if isinstance(data, (str, os.PathLike)) else None,
                       "_eval_data": os.fspath(eval_data) if isinstance(eval_data, (str, os.PathLike)) else None}
        run.config_record = {**config.as_dict(), **data_record}  # what a checkpoint needs to resume by itself
        bar = tqdm(total=total, initial=run.step, unit="step", file=sys.stderr, disable=not progress,
                   dynamic_ncols=True, desc=f"training {spec.B} model{'s' if spec.B != 1 else ''}")
        t0 = time.perf_counter() - elapsed0
        samples, stopped = 0, None
        try:
            while run.step < end:
                run.step += 1
                values = run.schedules.values(run.active)
                losses = run.trainer.step(_batch(train_ds, sampler.next(), run), values)
                if metrics is None:  # this run is now the folder's run; the previous one's outputs move aside
                    moved = array.move_previous_run()
                    if moved:
                        log.info("the previous run's outputs are now in %s", moved)
                    array.write_run(record)
                    metrics = _Metrics(metrics_path, run_id, None)
                run.schedules.advance()
                samples += len(run.models) * config.batch_size
                run.last_loss = losses
                events = _statuses(run, run.trainer.last_ok, losses)
                el = time.perf_counter() - t0
                if run.step % config.log_every == 0 or run.step == total or events:
                    metrics.write([{"step": run.step, "model": b, "split": "train", "loss": _fmt(losses[i]),
                                    "accuracy": "", "lr": _fmt(values.lr[i]), "elapsed_s": f"{el:.4f}",
                                    "status": events.get(b, "")} for i, b in enumerate(run.models)])
                if events and config.on_diverge == "stop":
                    stopped = f"model(s) {sorted(events)} diverged at step {run.step} (--on-diverge stop)"
                    break
                ev = None
                if eval_ds is not None and config.eval_every and run.step % config.eval_every == 0:
                    ev = _evaluate(run, eval_ds, metrics, el)
                if config.halving and run.step in config.halving:
                    ev = ev if ev is not None else _evaluate(run, eval_ds, metrics, el)
                    before = list(run.models)
                    sampler.keep(_halve(run, ev))
                    metrics.write([{"step": run.step, "model": b, "split": "train", "loss": "", "accuracy": "",
                                    "lr": "", "elapsed_s": f"{el:.4f}", "status": "dropped"}
                                   for b in before if b not in run.models])
                if config.checkpoint_every and run.step % config.checkpoint_every == 0:
                    _checkpoint(run, sampler, el)
                finite = losses[np.isfinite(losses)]
                bar.set_postfix_str((f"loss best {finite.min():.4g} worst {finite.max():.4g} | " if finite.size else "")
                                    + f"{samples / max(el - elapsed0, 1e-9):,.0f} samples/s"
                                    + (f" | {len(run.status)} stopped" if run.status else ""))
                bar.update(1)
                if on_step is not None:
                    on_step(run.step, total)
            if eval_ds is not None and run.last_eval_step != run.step:
                _evaluate(run, eval_ds, metrics, time.perf_counter() - t0)
            if stop_at is not None and not stopped and run.step < total and \
                    not os.path.isdir(run.array.checkpoint_path(run.step)):  # where a resumed run continues
                _checkpoint(run, sampler, time.perf_counter() - t0)
        except Exception as e:
            user = _as_run_error(e, array_dir, run_id, metrics is not None)
            if user is None:
                raise
            raise user from e
        finally:
            bar.close()
            if metrics is not None:
                metrics.close()
        elapsed = time.perf_counter() - t0
        _write_trained(run, tmp, elapsed, stopped)
        shutil.rmtree(ArrayDir.scratch_path(tmp), ignore_errors=True)  # ONNX Runtime's, rebuilt by each run
    if stopped:
        raise TrainingStopped(f"stopped: {stopped}; state saved in {trained}")
    final = np.full(spec.B, np.nan)
    for i, b in enumerate(run.models):
        final[b] = run.last_loss[i]
    return TrainResult(steps=run.step, final_loss=final.tolist(), elapsed_s=elapsed,
                       samples_per_s=samples / max(elapsed - elapsed0, 1e-9),
                       metrics_path=metrics_path, trained_dir=trained,
                       status=dict(run.status), eval=run.last_eval, survivors=list(run.models), run_id=run_id)


def _as_run_error(e: Exception, array_dir: str, run_id: str, started: bool) -> OnnxFuseError | None:
    """A failure during a run as the user error it is (a full disk, out of memory...), saying how to continue
    when the run has a checkpoint; None for anything else (re-raised as it is)."""
    user = as_user_error(e)
    if user is None:
        return None
    if started and isinstance(user, (OutputError, OutOfMemoryError)):
        own = _checkpoints(array_dir)
        hint = (f"`{shell('onnxfuse', 'train', array_dir, '--resume')}` then continues run {run_id} from step "
                f"{ArrayDir.checkpoint_step(own[-1])}" if own else
                f"run {run_id} has no checkpoint to resume from (--checkpoint-every): train again")
        return type(user)(f"{user}; {hint}")
    return None if user is e else user


def _statuses(run: _Run, ok: np.ndarray, losses: np.ndarray) -> dict[int, str]:
    """Models whose step was rejected although active: diverged now, frozen from here on."""
    events = {}
    for i, b in enumerate(run.models):
        if run.active[i] and not ok[i]:
            run.active[i] = False
            run.status[b] = {"status": "diverged", "step": run.step}
            events[b] = "diverged"
            log.warning("model %d diverged at step %d (loss %s); it is frozen at its last finite state", b,
                        run.step, losses[i])
    return events


def _checkpoint(run: _Run, sampler: BatchSampler, elapsed: float) -> None:
    """Write checkpoints/step_<t>/ atomically (temporary folder + rename) and keep the newest keep_checkpoints
    (checkpoints/ holds the current run's only: a new run moves the previous run's aside before its first)."""
    path = run.array.checkpoint_path(run.step)
    with atomic_dir(path, overwrite=True, command="train") as tmp:
        _save_state(run, tmp)
        ArrayDir.write_checkpoint_record(tmp, {**run.state(), "sampler": sampler.state_dict(), "elapsed_s": elapsed,
                                               "config": _jsonable(run.config_record), "run": run.run_record})
    run.array.prune_checkpoints(run.config.keep_checkpoints)
    log.info("checkpoint at step %d: %s", run.step, path)


@dataclass
class CheckpointModels:
    """Every model of an array at its current run's newest checkpoint, one by one (original index -> ...)."""
    record: dict  # the checkpoint's state.json: step, sampler, run (id, settings and data hashes), ...
    states: dict[int, dict[str, np.ndarray]]  # state_dicts
    optimizer: dict[int, dict[str, np.ndarray]]  # each model's slice of every optimizer buffer
    status: dict[int, dict]  # a diverged model's {"status", "step"}


def checkpoint_models(array_dir: str | os.PathLike) -> CheckpointModels:
    """The models of the array in ``array_dir`` as its newest checkpoint holds them, each on its own: what
    :func:`seed_run` puts together again in another array (a sweep's successive halving re-fuses the survivors
    of several arrays into one)."""
    array_dir = os.fspath(array_dir)
    path, st = _resume_point(array_dir)
    weights, opt_state, _ = ArrayDir.read_state(path, "train the array again", ArrayDir(array_dir).load_spec())
    models = st["models"]
    states = split_weights(ArrayDir.state_spec(path), weights, steps=st["trainer_steps"])
    return CheckpointModels(st, dict(zip(models, states)),
                            {b: {k: v[i] for k, v in opt_state.items()} for i, b in enumerate(models)},
                            {int(k): v for k, v in st["status"].items() if int(k) in models})


def seed_run(array_dir: str | os.PathLike, config: TrainConfig, optimizer: Sequence[Mapping[str, np.ndarray]],
             status: Sequence[dict | None], template: dict) -> None:
    """Make the array in ``array_dir`` (fused from models as :func:`checkpoint_models` gave them: its initial
    weights are their current ones) a run that ``train_array(..., resume=True)`` continues, at the step of the
    checkpoint record ``template`` (its sampler position and data hash: every source array trained on the same
    data and batches), with model b's optimizer state ``optimizer[b]`` and its diverged ``status[b]``."""
    array = ArrayDir(array_dir)
    fused, spec = array.load()
    weights = fused_initial_weights(fused)
    opt_state = {k: np.stack([o[k] for o in optimizer]) for k in optimizer[0]} if optimizer and optimizer[0] else {}
    record = _new_run({"settings_hash": settings_hash(config), "data_hash": template["run"]["data_hash"]})
    run_record = {k: record[k] for k in ("id", "settings_hash", "data_hash")}
    st = {k: template[k] for k in ("step", "trainer_steps", "sampler", "elapsed_s")}
    st.update(models=list(range(spec.B)), active=[not (s and s.get("status") == "diverged") for s in status],
              status={str(b): s for b, s in enumerate(status) if s}, config=_jsonable(config.as_dict()),
              run=run_record)
    with atomic_dir(array.checkpoint_path(st["step"]), command="train") as tmp:
        ArrayDir.write_state(tmp, weights, opt_state, spec, {})
        ArrayDir.write_checkpoint_record(tmp, st)
    array.write_run(record)


def _write_trained(run: _Run, folder: str, elapsed: float, stopped: str | None) -> None:
    _save_state(run, folder)
    if isinstance(run.trainer, FusedTrainer):  # onnxruntime's own checkpoint, for users of its training API
        run.trainer.save_checkpoint(ArrayDir.ort_checkpoint_path(folder))
    final = {b: float(run.last_loss[i]) for i, b in enumerate(run.models)}
    ArrayDir.write_train_state(folder, **_jsonable({
        "steps": run.trainer.steps, "models": run.models, "status": {str(k): v for k, v in run.status.items()},
        "run": run.run_record, "step": run.step, "final_loss": {str(k): v for k, v in final.items()},
        "elapsed_s": elapsed, "stopped": stopped, "config": run.config_record}))
