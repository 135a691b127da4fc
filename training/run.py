"""A training run of a fused array, as a sweep needs it: per-model schedules, evaluation every K steps, fault
isolation, successive halving, periodic checkpoints and exact resume.

Files in the array folder:

    metrics.csv                      step,model,split,loss,accuracy,lr,elapsed_s,status   (model = original index)
    checkpoints/step_00000120/       weights, optimizer state, dropped models, state.json; written atomically,
                                     the last ``keep_checkpoints`` kept
    trained/                         the final state: weights.safetensors of the surviving array (array.json
                                     describes it), dropped/model_<b>.safetensors, train_state.json

Before a fresh run trains, it verifies its first ``verify_steps`` steps against every model trained alone
(``verify.py``); a mismatch stops it before anything is written. ``verify_array`` runs the same check on demand.

A resumed run restores weights, optimizer state, schedule position, data position and RNG state from the newest
checkpoint, so its final weights are those of an uninterrupted run.
"""
from __future__ import annotations

import csv
import glob
import json
import logging
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from onnxfuse._io import atomic_dir
from onnxfuse.errors import ConfigError, DataError, InputFileError, TrainingStoppedError
from onnxfuse.passes import fuse_models
from onnxfuse.split import TRAINED_DIR, split_weights
from onnxfuse.weights import ArraySpec

from .data import BatchSampler, Dataset, load_npz, make_dataset
from .losses import LABELS, LOSS_OPTIONS, LossSpec, get_loss
from .optim import OptimizerConfig, StepValues, make_optimizer
from .schedules import PerModelSchedules, check_schedules
from .trainer import FusedTrainer, check_device, load_array
from .verify import VerifyReport, has_random_dropout, verify_steps, without_dropout

__all__ = ["TrainConfig", "TrainResult", "train_array", "verify_array", "TrainingStopped", "METRICS_HEADER"]

log = logging.getLogger("onnxfuse.train")
METRICS_HEADER = ["step", "model", "split", "loss", "accuracy", "lr", "elapsed_s", "status"]
CHECKPOINTS = "checkpoints"


TrainingStopped = TrainingStoppedError  # the run stopped early on purpose (on_diverge="stop"); its state is saved


@dataclass
class TrainConfig:
    """Everything a run takes; per-model values are a scalar or a list of B (see ``onnxfuse train --help``)."""

    batch_size: int
    steps: int | None = None
    epochs: int | None = None
    loss: str = "cross-entropy"
    loss_options: dict = field(default_factory=dict)  # label_smoothing, ignore_index, class_axis (see get_loss)
    per_model_labels: bool = False  # labels [B, n, ...], one set per model
    optimizer: str = "sgd"
    lr: float | list[float] | None = None
    momentum: float | list[float] = 0.0
    dampening: float | list[float] = 0.0
    nesterov: bool | list[bool] = False
    weight_decay: float | list[float] | None = None
    betas: tuple | list = (0.9, 0.999)
    eps: float | list[float] = 1e-8
    amsgrad: bool | list[bool] = False
    clip_grad_norm: float | list[float] | None = None
    schedule: object = None  # None, a name, a dict, or a list of B (see training.schedules)
    shuffle: bool = True
    seed: int = 0
    data_order: str = "shared"  # shared | per-model (each model its own shuffle) | shards (model b: shard b)
    eval_every: int = 0  # 0: evaluate only at the end (when there is eval data)
    eval_batch_size: int = 256
    eval_fraction: float = 0.0  # carve a held-out split off the training data when no eval data is given
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    on_diverge: str = "freeze"  # freeze | stop
    halving: list[int] | None = None  # steps at which the best `halving_keep` of the models (by eval loss) stay
    halving_keep: float = 0.5
    device: str = "cpu"
    log_every: int = 1
    verify_steps: int = 1  # check the first K steps of every model against it trained alone (0: skip)

    def optimizer_config(self, B: int) -> OptimizerConfig:
        return make_optimizer(self.optimizer, B, lr=self.lr, momentum=self.momentum, dampening=self.dampening,
                              nesterov=self.nesterov, weight_decay=self.weight_decay, betas=self.betas, eps=self.eps,
                              amsgrad=self.amsgrad, max_norm=self.clip_grad_norm)

    def loss_spec(self) -> LossSpec:
        unknown = sorted(set(self.loss_options) - set(LOSS_OPTIONS))
        if unknown:
            raise ConfigError(f"unknown loss option '{unknown[0]}'; the options are {', '.join(LOSS_OPTIONS)}")
        return get_loss(self.loss, per_model_labels=self.per_model_labels or self.data_order != "shared",
                        **self.loss_options)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown training setting '{unknown[0]}'")
        return cls(**d)


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


# ---------------------------------------------------------------------------------------------------- validation
def _validate(config: TrainConfig, spec: ArraySpec) -> None:
    """Every setting, before anything is read or written: one clear line per problem."""
    def positive_int(name, value, allow_zero=False):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < (0 if allow_zero else 1):
            raise ConfigError(f"{name} must be an integer >= {0 if allow_zero else 1}, got {value!r}")

    if (config.steps is None) == (config.epochs is None):
        raise ConfigError("give exactly one of --steps and --epochs")
    positive_int("--steps" if config.steps is not None else "--epochs", config.steps or config.epochs)
    positive_int("--batch-size", config.batch_size)
    positive_int("--log-every", config.log_every)
    positive_int("--eval-every", config.eval_every, allow_zero=True)
    positive_int("--checkpoint-every", config.checkpoint_every, allow_zero=True)
    positive_int("--keep-checkpoints", config.keep_checkpoints)
    positive_int("--eval-batch-size", config.eval_batch_size)
    positive_int("--verify-steps", config.verify_steps, allow_zero=True)
    if config.on_diverge not in ("freeze", "stop"):
        raise ConfigError(f"--on-diverge must be freeze or stop, got '{config.on_diverge}'")
    if config.data_order not in ("shared", "per-model", "shards"):
        raise ConfigError(f"--data-order must be shared, per-model or shards, got '{config.data_order}'")
    if not 0.0 <= config.eval_fraction < 1.0:
        raise ConfigError(f"--eval-fraction must be in [0, 1), got {config.eval_fraction}")
    if not 0.0 < config.halving_keep < 1.0:
        raise ConfigError(f"halving_keep must be in (0, 1), got {config.halving_keep}")
    if config.data_order != "shared":
        shared = [i["name"] for i in spec.inputs if not i.get("per_model")]
        if shared:
            raise ConfigError(f"--data-order {config.data_order} gives every model other samples, but graph input "
                              f"'{shared[0]}' is shared: fuse with --per-model-inputs {','.join(shared)}")
    if config.halving:
        h = list(config.halving)
        if any(not isinstance(s, (int, np.integer)) or s < 1 for s in h) or h != sorted(set(h)):
            raise ConfigError(f"--halving must be increasing step numbers >= 1, got {h}")
    check_device(config.device)
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
            from . import datasets

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
            from . import datasets

            return datasets.from_torch_dataset(data, [i["name"] for i in spec.inputs]), what
    except ImportError:  # pragma: no cover
        pass
    raise ConfigError(f"{what} data must be a .npz path, 'sklearn:<name>', a dict of arrays or a torch Dataset, "
                      f"got {type(data).__name__}")


def _datasets(data, eval_data, config: TrainConfig, spec: ArraySpec, loss: LossSpec) -> tuple[Dataset, Dataset | None]:
    arrays, source = _load_arrays(data, spec, "training")
    eval_arrays, eval_source = (None, None) if eval_data is None else _load_arrays(eval_data, spec, "evaluation")
    per_model = {i["name"] for i in spec.inputs if i.get("per_model")}
    if config.data_order == "shards":
        from . import datasets

        arrays = datasets.shard(arrays, spec.B, set())
        per_model_arrays = set(arrays)
    else:
        per_model_arrays = per_model | ({LABELS} if config.per_model_labels else set())
    if eval_arrays is None and config.eval_fraction > 0:
        from . import datasets

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
        self.config_record: dict = asdict(config)

    def _trainer(self) -> FusedTrainer:
        os.makedirs(self.workdir, exist_ok=True)
        folder = os.path.join(self.workdir, f"artifacts_{len(os.listdir(self.workdir))}_b{len(self.models)}")
        return FusedTrainer(self.fused, self.spec, self.loss, self.opt, self.config.device, workdir=folder)

    # ---- state
    def state(self) -> dict:
        return {"step": self.step, "models": self.models, "active": self.active, "trainer_steps": self.trainer.steps,
                "status": {str(k): v for k, v in self.status.items()}}

    def per_model_states(self) -> list[dict[str, np.ndarray]]:
        return split_weights(self.spec, self.trainer.weights(), steps=self.trainer.steps)

    def load(self, weights: dict, opt_state: dict) -> None:
        for name, value in list(weights.items()) + list(opt_state.items()):
            self.trainer.state.parameters[name].data = np.ascontiguousarray(value)

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
        self.fused, self.spec = _refuse(self.array_dir, survivors, [states[i] for i in positions], self.spec0)
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


def _refuse(array_dir: str, models: list[int], states: list[dict], spec0: ArraySpec):
    """The fused array of ``models`` (original indices) with the given per-model states."""
    protos = []
    for b, state in zip(models, states):
        path = os.path.join(array_dir, "sources", f"model_{b}.onnx")
        if not os.path.exists(path):
            raise InputFileError(f"'{path}' is missing; re-run `onnxfuse fuse`")
        proto = onnx.load(path)
        names = {t for n in proto.graph.node for t in n.input}
        have = {t.name for t in proto.graph.initializer}
        proto.graph.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in state.items()
                                       if k in names and k not in have)
        protos.append(proto)
    per_model = [i["name"] for i in spec0.inputs if i.get("per_model")]
    fa = fuse_models(protos, labels=[spec0.sources[b] for b in models], per_model_inputs=per_model)
    fa.spec.extra_state = [spec0.extra_state[b] for b in models]
    return fa.model, fa.spec


# ----------------------------------------------------------------------------------------------------- metrics
class _Metrics:
    def __init__(self, path: str, resume_step: int | None):
        self.path = path
        rows = []
        if resume_step is not None and os.path.exists(path):
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        self.f = open(path, "w", newline="")
        self.w = csv.DictWriter(self.f, METRICS_HEADER)
        self.w.writeheader()
        self.w.writerows(rows)
        self.f.flush()

    def write(self, rows: list[dict]) -> None:
        self.w.writerows(rows)
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def _fmt(v) -> str:
    return "" if v is None else f"{v:.7g}"


# ------------------------------------------------------------------------------------------------- checkpoints
def _save_state(run: _Run, folder: str, save_file) -> None:
    save_file(run.trainer.weights(), os.path.join(folder, "weights.safetensors"))
    state = run.trainer.optimizer_state()
    if state:
        save_file(state, os.path.join(folder, "optimizer_state.safetensors"))
    run.spec.save(os.path.join(folder, "array.json"))
    if run.dropped:
        os.makedirs(os.path.join(folder, "dropped"))
        for b, sd in run.dropped.items():
            save_file({k: np.ascontiguousarray(v) for k, v in sd.items()},
                      os.path.join(folder, "dropped", f"model_{b}.safetensors"))


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


def latest_checkpoint(array_dir: str) -> str | None:
    found = sorted(glob.glob(os.path.join(array_dir, CHECKPOINTS, "step_*")))
    return found[-1] if found else None


def _restore(run: _Run, path: str, sampler: BatchSampler) -> float:
    from safetensors.numpy import load_file

    with open(os.path.join(path, "state.json")) as f:
        st = json.load(f)
    dropped = {}
    for p in glob.glob(os.path.join(path, "dropped", "model_*.safetensors")):
        dropped[int(os.path.basename(p)[6:-12])] = load_file(p)
    weights = load_file(os.path.join(path, "weights.safetensors"))
    opt_file = os.path.join(path, "optimizer_state.safetensors")
    opt_state = load_file(opt_file) if os.path.exists(opt_file) else {}
    models = st["models"]
    if models != run.models:  # the array had shrunk: rebuild it for the survivors
        ckpt_spec = ArraySpec.load(os.path.join(path, "array.json"))
        states = split_weights(ckpt_spec, weights, steps=st["trainer_steps"])
        run.fused, run.spec = _refuse(run.array_dir, models, states, run.spec0)
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


def _verify(array_dir: str, fused: onnx.ModelProto, spec: ArraySpec, trainer: FusedTrainer | None, ds: Dataset,
            sampler: BatchSampler, config: TrainConfig, total: int, K: int) -> VerifyReport:
    """Check the first K steps of the array ``fused`` against every model trained alone in a one-model array
    fused from ``sources/model_0.onnx`` with model 0's weights (see ``verify.py``). ``trainer``: the run's trainer
    of ``fused`` at step 0 (left as it was), or None to build one for the check. An array with random Dropout is
    checked with Dropout off, in a trainer of its own."""
    t0 = time.perf_counter()
    dropout_off = has_random_dropout(fused)
    if trainer is None or dropout_off:
        opt, _ = _optimizer_and_schedules(config, spec.B, total)
        trainer = FusedTrainer(without_dropout(fused) if dropout_off else fused, spec, config.loss_spec(), opt,
                               config.device)
    with warnings.catch_warnings():  # nodes fused per model were reported when the array was fused
        warnings.simplefilter("ignore")
        model, one_spec = _refuse(array_dir, [0], split_weights(spec, trainer.weights())[:1], spec)
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
    if config.halving and config.halving[-1] >= total:
        raise ConfigError(f"--halving step {config.halving[-1]} is not before the last step {total}")
    return _Prepared(config, loss, train_ds, eval_ds, sampler, total)


def verify_array(array_dir: str | os.PathLike, data=None, config: TrainConfig | None = None,
                 eval_data=None) -> VerifyReport:
    """The check a fresh ``train_array`` makes before it trains (see ``verify.py``), on demand: the first
    ``config.verify_steps`` steps of every model of the array in ``array_dir`` against the model trained alone,
    with the run's data, batches, loss and hyper-parameters. Nothing is written to ``array_dir``; the report says
    per model what was compared (``report.ok``, ``report.table()``, ``report.error()``)."""
    array_dir = os.fspath(array_dir)
    fused, spec = load_array(array_dir)
    p = _prepare(spec, config, data, eval_data)
    if p.config.verify_steps < 1:
        raise ConfigError("--verify-steps must be >= 1 to check anything, got 0")
    return _verify(array_dir, fused, spec, None, p.train, p.sampler, p.config, p.total,
                   min(p.config.verify_steps, p.total))


def train_array(array_dir: str | os.PathLike, data=None, config: TrainConfig | None = None, progress: bool = True,
                eval_data=None, resume: bool = False, overrides: dict | None = None) -> TrainResult:
    """Train every model of the array in ``array_dir``; ``metrics.csv``, ``checkpoints/`` and ``trained/`` go
    there. Everything is validated before anything is written; a fresh run then checks its first
    ``config.verify_steps`` steps against every model trained alone (``verify.py``) and raises
    ``VerificationError``, having written nothing, on a mismatch. ``resume``: continue from the newest checkpoint,
    with its saved settings unless ``config`` is given (``overrides`` changes single settings, e.g. more steps)."""
    from tqdm import tqdm

    array_dir = os.fspath(array_dir)
    fused, spec = load_array(array_dir)
    ckpt = latest_checkpoint(array_dir) if resume else None
    if resume and ckpt is None:
        raise InputFileError(f"--resume: '{array_dir}' has no checkpoint; train with --checkpoint-every first")
    if ckpt is not None:
        with open(os.path.join(ckpt, "state.json")) as f:
            saved = json.load(f)["config"]
        data = data if data is not None else saved.get("_data")
        eval_data = eval_data if eval_data is not None else saved.get("_eval_data")
        if config is None:  # the run's own settings (inf was written as a string)
            settings = {k: _unjson(v) for k, v in saved.items() if not k.startswith("_")}
            if overrides and "epochs" in overrides:
                settings["steps"] = None
            config = TrainConfig.from_dict({**settings, **(overrides or {})})
    p = _prepare(spec, config, data, eval_data)
    config, loss, train_ds, eval_ds, sampler, total = p.config, p.loss, p.train, p.eval, p.sampler, p.total

    trained = os.path.join(array_dir, TRAINED_DIR)
    with atomic_dir(trained, overwrite=True) as tmp:  # removed again if anything below fails
        run = _Run(array_dir, config, fused, spec, loss, total, os.path.join(tmp, "artifacts"))
        elapsed0 = _restore(run, ckpt, sampler) if ckpt is not None else 0.0
        if ckpt is None and config.verify_steps:  # before metrics.csv is touched
            report = _verify(array_dir, fused, spec, run.trainer, train_ds, sampler, config, total,
                             min(config.verify_steps, total))
            log.info("%s", report.summary())
            if not report.ok:
                raise report.error()
        metrics = _Metrics(os.path.join(array_dir, "metrics.csv"), run.step if ckpt is not None else None)
        data_record = {"_data": os.fspath(data) if isinstance(data, (str, os.PathLike)) else None,
                       "_eval_data": os.fspath(eval_data) if isinstance(eval_data, (str, os.PathLike)) else None}
        run.config_record = {**asdict(config), **data_record}  # what a checkpoint needs to resume by itself
        bar = tqdm(total=total, initial=run.step, unit="step", file=sys.stderr, disable=not progress,
                   dynamic_ncols=True, desc=f"training {spec.B} models")
        t0 = time.perf_counter() - elapsed0
        samples, stopped = 0, None
        try:
            while run.step < total:
                run.step += 1
                values = run.schedules.values(run.active)
                losses = run.trainer.step(_batch(train_ds, sampler.next(), run), values)
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
            if eval_ds is not None and run.last_eval_step != run.step:
                _evaluate(run, eval_ds, metrics, time.perf_counter() - t0)
        finally:
            bar.close()
            metrics.close()
        elapsed = time.perf_counter() - t0
        _write_trained(run, tmp, elapsed, stopped)
    if stopped:
        raise TrainingStopped(f"stopped: {stopped}; state saved in {trained}")
    final = np.full(spec.B, np.nan)
    for i, b in enumerate(run.models):
        final[b] = run.last_loss[i]
    return TrainResult(steps=run.step, final_loss=final.tolist(), elapsed_s=elapsed,
                       samples_per_s=samples / max(elapsed - elapsed0, 1e-9),
                       metrics_path=os.path.join(array_dir, "metrics.csv"), trained_dir=trained,
                       status=dict(run.status), eval=run.last_eval, survivors=list(run.models))


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
    """Write checkpoints/step_<t>/ atomically (temporary folder + rename) and keep the newest keep_checkpoints."""
    from safetensors.numpy import save_file

    root = os.path.join(run.array_dir, CHECKPOINTS)
    path = os.path.join(root, f"step_{run.step:08d}")
    with atomic_dir(path, overwrite=True) as tmp:
        _save_state(run, tmp, save_file)
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump({**run.state(), "sampler": sampler.state_dict(), "elapsed_s": elapsed,
                       "config": _jsonable(run.config_record)}, f)
    for old in sorted(glob.glob(os.path.join(root, "step_*")))[:-run.config.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint at step %d: %s", run.step, path)


def _write_trained(run: _Run, folder: str, elapsed: float, stopped: str | None) -> None:
    from safetensors.numpy import save_file

    _save_state(run, folder, save_file)
    run.trainer.save_checkpoint(os.path.join(folder, "ort_checkpoint"))
    final = {b: float(run.last_loss[i]) for i, b in enumerate(run.models)}
    with open(os.path.join(folder, "train_state.json"), "w") as f:
        json.dump(_jsonable({"steps": run.trainer.steps, "step": run.step, "models": run.models,
                             "status": {str(k): v for k, v in run.status.items()},
                             "final_loss": {str(k): v for k, v in final.items()}, "elapsed_s": elapsed,
                             "stopped": stopped, "config": run.config_record}), f, indent=1)
