"""A training run of a fused array, as a sweep needs it: per-model schedules, evaluation every K steps, fault
isolation, successive halving, periodic checkpoints and exact resume.

Files in the array folder (``onnxfuse.core.array.ArrayDir`` owns them; a run holds the folder's lock throughout):

    run.json                         the current run: id, settings hash, data hash, start time
    metrics.csv                      step,model,split,loss,accuracy,lr,loss_scale,elapsed_s,status,run
                                     (model: the original index)
    best/                            each model's best state by --keep-best, one file per improvement (best.py)
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

This module is the loop (``_Loop``) and the run's entry points; each other part of a run has its own module:
``prepare.py`` (validation and data), ``run_state.py`` (the mutable state, shrinking the array), ``metrics.py``
(metrics.csv, evaluation rows), ``checkpoints.py`` (identity, checkpoints, resume), ``best.py`` (each model's
best state), ``halving.py`` (the rungs),
``verify.py`` (the check of the first steps), and ``onnxfuse/recipe/train_config.py`` (``TrainConfig``).
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import onnx

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core._io import atomic_dir
from onnxfuse.core.array import ArrayDir
from onnxfuse.core.errors import (ConfigError, OnnxFuseError, OutOfMemoryError, OutputError, TrainingStoppedError,
                                  as_user_error, shell)
from onnxfuse.core.passes import fuse_models
from onnxfuse.core.split import split_weights
from onnxfuse.core.weights import ArraySpec
from onnxfuse.recipe.batches import BatchSource
from onnxfuse.recipe.losses import LossSpec, PythonLoss
from onnxfuse.recipe.optim import StepValues
from onnxfuse.recipe.runtimes import Runtime, make_trainer
from onnxfuse.recipe.settings import RESUMABLE
from onnxfuse.recipe.train_config import RunPlan, TrainConfig
from onnxfuse.runtime.ort_runtime import load_array
from onnxfuse.training.best import keep_best, prune_best
from onnxfuse.training.checkpoints import (CheckpointModels, check_resumable, checkpoint_folders, checkpoint_models,
                                           data_hash, new_run, restore, resume_point, saved_settings, seed_run,
                                           settings_hash, write_checkpoint, write_trained)
from onnxfuse.training.halving import halving_rung
from onnxfuse.training.metrics import METRICS_HEADER, Metrics, evaluate, fmt
from onnxfuse.training.prepare import Prepared, prepare
from onnxfuse.training.run_state import RunState, mark_diverged, optimizer_and_schedules
from onnxfuse.training.verify import VerifyReport, has_random_dropout, verify_steps, without_dropout

__all__ = ["TrainConfig", "TrainResult", "train_array", "verify_array", "TrainingStopped", "METRICS_HEADER",
           "RESUMABLE", "settings_hash", "checkpoint_models", "seed_run", "CheckpointModels"]


log = logging.getLogger("onnxfuse.train")


TrainingStopped = TrainingStoppedError  # the run stopped early on purpose (on_diverge="stop"); its state is saved


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
    best: dict | None = None  # the best states kept (--keep-best): {"metric", "since", "models": {b: {"step", ...}}}


def _first_steps(source: BatchSource, config: RunPlan, B: int, total: int, K: int
                 ) -> tuple[list[dict[str, np.ndarray]], list[StepValues]]:
    """The batches and per-model step values of a fresh run's first K steps, without moving ``source``: the
    steps then train on these same batches (a DataLoader's are drawn once, and kept)."""
    batches = source.peek(K)
    _, schedules = optimizer_and_schedules(config, B, total)
    values = []
    for _ in range(K):
        values.append(schedules.values([True] * B))
        schedules.advance()
    return batches, values


def _verify(array_dir: str, fused: onnx.ModelProto, spec: ArraySpec, trainer: Runtime | None, source: BatchSource,
            config: RunPlan, total: int, K: int, loss: LossSpec) -> VerifyReport:
    """Check the first K steps of the array ``fused`` against every model trained alone in a one-model array
    fused from ``sources/model_0.onnx`` with model 0's weights (see ``verify.py``). ``trainer``: the run's trainer
    of ``fused`` at step 0 (left as it was), or None to build one for the check. An array with random Dropout is
    checked with Dropout off, in a trainer of its own; an array trained in bf16 or fp16 is checked in fp32 (what is
    checked is the graph's and the weights' mapping: reduced precision would hide a defect in its rounding).
    A run's trainer of its own for the check is eager: its graph is not the one the run compiles, and compiling
    it (and so the reference, verify.py) would cost two cold compiles the run never uses; ``onnxfuse check``
    (``trainer`` None) compiles as asked, to check the compiled step itself."""
    watch = Stopwatch()
    dropout_off = has_random_dropout(fused)
    if trainer is None or dropout_off or config.precision != "fp32":
        opt, _ = optimizer_and_schedules(config, spec.B, total)
        trainer = make_trainer(config.runtime, without_dropout(fused) if dropout_off else fused, spec,
                               loss, opt, config.device, threads=config.threads or None,
                               compile=config.compile if trainer is None else "off", total_steps=K)
    model, one_spec = ArrayDir(array_dir).refuse([0], split_weights(spec, trainer.weights())[:1], fuse_models)
    batches, values = _first_steps(source, config, spec.B, total, K)
    report = verify_steps(trainer, (without_dropout(model) if dropout_off else model, one_spec), batches, values)
    # the time includes the reference's fusion and, with Dropout, the check's own trainer
    return replace(report, seconds=watch.seconds, dropout_off=dropout_off)


def verify_array(array_dir: str | os.PathLike, data=None, config: TrainConfig | None = None,
                 eval_data=None, loss=None) -> VerifyReport:
    """The check a fresh ``train_array`` makes before it trains (see ``verify.py``), on demand: the first
    ``config.verify_steps`` steps of every model of the array in ``array_dir`` against the model trained alone,
    with the run's data, batches, loss and hyper-parameters. Nothing is written to ``array_dir``; the report says
    per model what was compared (``report.ok``, ``report.table()``, ``report.error()``)."""
    array_dir = os.fspath(array_dir)
    fused, spec = load_array(array_dir)
    with ArrayDir(array_dir).locked("check"):
        p = prepare(spec, config, data, eval_data, loss=loss)
        if p.config.verify_steps < 1:
            raise ConfigError("--verify-steps must be >= 1 to check anything, got 0")
        return _verify(array_dir, fused, spec, None, p.train, p.config, p.total, min(p.config.verify_steps, p.total),
                       p.loss)


def train_array(array_dir: str | os.PathLike, data=None, config: TrainConfig | None = None, progress: bool = True,
                eval_data=None, resume: bool = False, overrides: dict | None = None,
                on_step: Callable[[int, int], None] | None = None, stop_at: int | None = None,
                loss=None) -> TrainResult:
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
    ``resume`` continues exactly): a sweep's successive halving stops every array at each rung.

    ``loss``: a Python function ``(output [B, N, ...], batch) -> [B]`` in place of the settings' loss (the torch
    runtime; see ``onnxfuse.recipe.losses.PythonLoss``); a run trained with one resumes only given it again."""
    array_dir = os.fspath(array_dir)
    fused, spec = load_array(array_dir)
    with ArrayDir(array_dir).locked("train"):
        return _train(array_dir, fused, spec, data, config, progress, eval_data, resume, overrides, on_step,
                      stop_at, loss)


def _train(array_dir: str, fused: onnx.ModelProto, spec: ArraySpec, data, config: TrainConfig | None,
           progress: bool, eval_data, resume: bool, overrides: dict | None,
           on_step: Callable[[int, int], None] | None = None, stop_at: int | None = None,
           loss=None) -> TrainResult:
    ckpt, saved = resume_point(array_dir) if resume else (None, None)
    if ckpt is not None:
        data, eval_data, config = _resumed_inputs(saved, data, eval_data, config, overrides)
    p = prepare(spec, config, data, eval_data, resuming=ckpt is not None, loss=loss)
    if ckpt is not None:
        _check_resumed_loss(saved, p.loss)
    identity = {"settings_hash": settings_hash(p.config), "data_hash": data_hash(p.train, p.eval)}
    record = check_resumable(ckpt, saved, p.config, identity, data) if ckpt is not None else \
        new_run(identity, p.config)
    trained = ArrayDir(array_dir).trained_path
    with atomic_dir(trained, overwrite=True, command="train") as tmp:  # removed again if anything below fails
        run = RunState(array_dir, p.config, fused, spec, p.loss, p.total, ArrayDir.scratch_path(tmp))
        run.run_record = {k: record[k] for k in ("id", "settings_hash", "data_hash")}
        elapsed0 = restore(run, ckpt, saved, p.train) if ckpt is not None else 0.0
        if run.step > p.total:
            raise ConfigError(f"--resume: run {record['id']}'s newest checkpoint is at step {run.step}, past the "
                              f"{p.total} steps asked for; resume with more --steps (or --epochs)")
        if ckpt is None and p.config.verify_steps:  # before anything is written
            report = _verify(array_dir, fused, spec, run.trainer, p.train, p.config, p.total,
                             min(p.config.verify_steps, p.total), p.loss)
            log.info("%s", report.summary())
            if not report.ok:
                raise report.error()
        # what a checkpoint needs to resume by itself
        run.config_record = {**p.config.as_dict(), **{k: os.fspath(v) if isinstance(v, (str, os.PathLike)) else None
                                                      for k, v in (("_data", data), ("_eval_data", eval_data))},
                             "_loss": p.loss.label if isinstance(p.loss, PythonLoss) else None}
        loop = _Loop(run, p, record, resumed=ckpt is not None, elapsed0=elapsed0)
        loop.train(stop_at, progress, on_step)
        write_trained(run, tmp, loop.elapsed, loop.stopped)
        shutil.rmtree(ArrayDir.scratch_path(tmp), ignore_errors=True)  # ONNX Runtime's, rebuilt by each run
    prune_best(run.array, run.best)  # trained/ names the final best states now: the earlier ones may go
    if loop.stopped:
        raise TrainingStopped(f"stopped: {loop.stopped}; state saved in {trained}")
    final = np.full(spec.B, np.nan)
    for i, b in enumerate(run.models):
        final[b] = run.last_loss[i]
    return TrainResult(steps=run.step, final_loss=final.tolist(), elapsed_s=loop.elapsed,
                       samples_per_s=loop.samples / max(loop.elapsed - elapsed0, 1e-9),
                       metrics_path=run.array.metrics_path, trained_dir=trained,
                       status=dict(run.status), eval=run.last_eval, survivors=list(run.models), run_id=record["id"],
                       best=run.best.record())


def _check_resumed_loss(saved: dict, loss: LossSpec) -> None:
    """A run trained with a Python loss resumes with that function given again (its name is what the run
    recorded), and only such a run takes one."""
    was = saved["config"].get("_loss")
    now = loss.label if isinstance(loss, PythonLoss) else None
    if was != now:
        what = f"the Python loss {was}" if was else "its settings' loss"
        fix = (f"resume it with train_array(..., loss={was.rsplit('.', 1)[-1]}, resume=True)" if was else
               "resume it without loss=")
        raise ConfigError(f"--resume: the run was trained with {what}, not "
                          f"{'the Python loss ' + now if now else 'the settings loss'}; {fix}")


def _resumed_inputs(saved: dict, data, eval_data, config: TrainConfig | None, overrides: dict | None):
    """A resumed run's data (the checkpoint's unless given) and settings: the run's own unless ``config`` is
    given, with ``overrides`` (e.g. more steps) applied."""
    data = data if data is not None else saved["config"].get("_data")
    eval_data = eval_data if eval_data is not None else saved["config"].get("_eval_data")
    if config is None:  # the run's own settings, the overrides validated over them as any settings are
        config = TrainConfig.resumed(saved_settings(saved), overrides)
    return data, eval_data, config


class _Loop:
    """The steps of one run from ``run.step`` on: train, log, evaluate, halve, checkpoint, report progress.

    A fresh run's outputs begin once its first step has trained: until then a failure leaves the folder as it
    was (the previous run's outputs move aside and ``run.json`` is written after that step)."""

    def __init__(self, run: RunState, p: Prepared, record: dict, resumed: bool, elapsed0: float):
        self.run, self.p, self.record, self.elapsed0 = run, p, record, elapsed0
        self.metrics = Metrics(run.array.metrics_path, record["id"], run.step) if resumed else None
        self.samples, self.stopped, self.elapsed = 0, None, 0.0
        self.watch = Stopwatch()  # this process's part of the run; elapsed0 before it
        self.unread: dict[int, tuple[list, float]] = {}  # steps since the last read: their lr and elapsed time
        self.seen = None  # the last read (Observed)
        self.end = p.total

    def train(self, stop_at: int | None, progress: bool, on_step: Callable[[int, int], None] | None) -> None:
        from tqdm import tqdm

        run, total = self.run, self.p.total
        end = self.end = total if stop_at is None else min(stop_at, total)
        bar = tqdm(total=total, initial=run.step, unit="step", file=sys.stderr, disable=not progress,
                   dynamic_ncols=True, desc=f"training {run.spec0.B} model{'s' if run.spec0.B != 1 else ''}")
        try:
            while run.step < end and self._step():
                if not self.unread:  # read at this step: the losses are new
                    bar.set_postfix_str(self._postfix(), refresh=False)
                bar.update(1)
                if on_step is not None:
                    on_step(run.step, total)
            if self.p.eval is not None and run.last_eval_step != run.step:
                self._evaluate(self._elapsed())
            if stop_at is not None and not self.stopped and run.step < total and \
                    not os.path.isdir(run.array.checkpoint_path(run.step)):  # where a resumed run continues
                write_checkpoint(run, self.p.train, self._elapsed())
        except Exception as e:
            user = _as_run_error(e, run.array_dir, self.record["id"], self.metrics is not None)
            if user is None:
                raise
            raise user from e
        finally:
            bar.close()
            if self.metrics is not None:
                self.metrics.close()
        self.elapsed = self._elapsed()

    def _step(self) -> bool:
        """One step and what follows it; False when the run stops here (a model diverged, --on-diverge stop).

        The step is launched without a host read; the losses and any divergence are read (``observe``) only
        where something uses them: every ``log_every`` steps, before an evaluation, a halving rung or a
        checkpoint, at the last step, and at every step with --on-diverge stop. A divergence found there is
        recorded at the step it happened (its metrics row too: the steps between reads are remembered)."""
        run, config, source = self.run, self.p.config, self.p.train
        run.step += 1
        values = run.schedules.values(run.active)
        feeds = source.draw(run.models)
        # the schedules' next values, for a runtime that computes a window of steps' coefficients at once
        run.trainer.launch(feeds, values, lambda n: run.schedules.ahead(
            run.active, min(n, self.p.total - run.schedules.taken)))
        if self.metrics is None:  # this run is now the folder's run; the previous one's outputs move aside
            moved = run.array.move_previous_run()
            if moved:
                log.info("the previous run's outputs are now in %s", moved)
            run.array.write_run(self.record)
            self.metrics = Metrics(run.array.metrics_path, self.record["id"], None)
        run.schedules.advance()
        self.samples += len(run.models) * source.samples(feeds)  # a loader's last batch of an epoch may be partial
        el = self._elapsed()
        self.unread[run.step] = (values.lr, el)
        evaluating = bool(self.p.eval is not None and config.eval_every and run.step % config.eval_every == 0)
        halving = bool(config.halving and run.step in config.halving)
        checkpoint = bool(config.checkpoint_every and run.step % config.checkpoint_every == 0)
        logged = run.step % config.log_every == 0 or run.step == self.p.total
        if not (logged or evaluating or halving or checkpoint or config.on_diverge == "stop" or run.step == self.end):
            return True
        events = self._read()
        if logged or run.step in events.values():
            self.metrics.write([self._train_row(run.step, b, run.last_loss[i], events.get(b) == run.step)
                                for i, b in enumerate(run.models)])
        self.unread.clear()
        if events and config.on_diverge == "stop":
            self.stopped = f"model(s) {sorted(events)} diverged at step {run.step} (--on-diverge stop)"
            return False
        ev = self._evaluate(el) if evaluating else None
        if halving:
            halving_rung(run, ev if ev is not None else self._evaluate(el), source, self.metrics, el)
        if checkpoint:
            write_checkpoint(run, source, el)
        return True

    def _evaluate(self, elapsed: float) -> dict:
        """Evaluate the models in the array (metrics.csv's rows) and keep each one's best state so far."""
        ev = evaluate(self.run, self.p.eval, self.metrics, elapsed)
        keep_best(self.run, ev)
        return ev

    def _read(self) -> dict[int, int]:
        """The host read: the last step's losses, and the models that diverged since the last read ({original
        model: the step}); a divergence at an earlier step than this one gets its own metrics row there."""
        run = self.run
        seen = run.trainer.observe()
        run.last_loss = seen.losses
        self.seen = seen
        events = mark_diverged(run, seen)
        for b, (step, loss) in sorted(events.items(), key=lambda e: e[1][0]):
            if step != run.step:
                self.metrics.write([self._train_row(step, b, loss, diverged=True)])
        return {b: step for b, (step, _) in events.items()}

    def _train_row(self, step: int, b: int, loss: float, diverged: bool) -> dict:
        """Model b's train row of metrics.csv at ``step`` (its lr and time as they were at that step)."""
        lr, el = self.unread.get(step, (None, self._elapsed()))
        i = self.run.models.index(b)
        seen = self.seen if step == self.run.step else None  # what the read says of this step (a skip, the scale)
        scale = seen.scale[i] if seen is not None and seen.scale is not None else None
        skipped = scale is not None and not diverged and self.run.active[i] and not seen.ok[i]
        return {"step": step, "model": b, "split": "train", "loss": fmt(loss), "accuracy": "",
                "lr": fmt(lr[i]) if lr is not None else "", "loss_scale": fmt(scale), "elapsed_s": f"{el:.4f}",
                "status": "diverged" if diverged else ("skipped" if skipped else "")}

    def _elapsed(self) -> float:
        """Seconds of the run so far, a resumed run's earlier ones included."""
        return self.elapsed0 + self.watch.seconds

    def _postfix(self) -> str:
        run = self.run
        finite = run.last_loss[np.isfinite(run.last_loss)]
        rate = self.samples / max(self.watch.seconds, 1e-9)
        return ((f"loss best {finite.min():.4g} worst {finite.max():.4g} | " if finite.size else "")
                + f"{rate:,.0f} samples/s" + (f" | {len(run.status)} stopped" if run.status else ""))


def _as_run_error(e: Exception, array_dir: str, run_id: str, started: bool) -> OnnxFuseError | None:
    """A failure during a run as the user error it is (a full disk, out of memory...), saying how to continue
    when the run has a checkpoint; None for anything else (re-raised as it is)."""
    user = as_user_error(e)
    if user is None:
        return None
    if started and isinstance(user, (OutputError, OutOfMemoryError)):
        own = checkpoint_folders(array_dir)
        hint = (f"`{shell('onnxfuse', 'train', array_dir, '--resume')}` then continues run {run_id} from step "
                f"{ArrayDir.checkpoint_step(own[-1])}" if own else
                f"run {run_id} has no checkpoint to resume from (--checkpoint-every): train again")
        return type(user)(f"{user}; {hint}")
    return None if user is e else user
