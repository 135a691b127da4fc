"""A training run of a fused array, as a sweep needs it: per-model schedules, evaluation every K steps, fault
isolation, successive halving, periodic checkpoints and exact resume.

Files in the array folder (``onnxfuse.core.array.ArrayDir`` owns them; a run holds the folder's lock throughout):

    run.json                         the current run: id, settings and data hashes, start time, settings
    started.json                     the last run started, written before it changes anything; it becomes
                                     run.json when the run has trained its first step
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

A resumed run continues the last run started (``checkpoints.resume_point``): from its newest checkpoint, or from
its start when it reached none (a run killed in its first seconds), never an earlier run; and only with the same
settings (those in ``RESUMABLE`` may change) and the same data. It restores weights, optimizer state, schedule
position, data position and RNG state, so its final weights are those of an uninterrupted run, and keeps exactly
the rows of metrics.csv its checkpoint counted, so that no row is written twice. A run that had trained all its
steps has nothing left to train: its resume changes nothing.

This module is the loop (``_Loop``) and the run's entry points; each other part of a run has its own module:
``prepare.py`` (validation and data), ``run_state.py`` (the mutable state, shrinking the array), ``metrics.py``
(metrics.csv, evaluation rows), ``checkpoints.py`` (identity, checkpoints, resume), ``best.py`` (each model's
best state), ``halving.py`` (the rungs),
``verify.py`` (the check of the first steps), and ``onnxfuse/recipe/train_config.py`` (``TrainConfig``).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import sys
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import onnx

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core._io import atomic_dir
from onnxfuse.core.array import ArrayDir, load_array
from onnxfuse.core.errors import (ConfigError, InputFileError, OnnxFuseError, OutOfMemoryError, OutputError,
                                  TrainingStoppedError, as_user_error, shell)
from onnxfuse.core.guesses import trained_note
from onnxfuse.core.passes import fuse_models
from onnxfuse.core.split import split_weights
from onnxfuse.core.weights import ArraySpec
from onnxfuse.recipe.batches import BatchSource
from onnxfuse.recipe.datasets import is_data_factory
from onnxfuse.recipe.losses import LossSpec, PythonLoss
from onnxfuse.recipe.optim import StepValues
from onnxfuse.recipe.schedules import PerModelSchedules
from onnxfuse.runtime.process import tune_process as tune
from onnxfuse.runtime.protocol import Runtime
from onnxfuse.runtime.trainers import build_trainer
from onnxfuse.recipe.settings import RESUMABLE
from onnxfuse.recipe.train_config import RunSettings, TrainConfig, as_train_config
from onnxfuse.training.best import keep_best, prune_best
from onnxfuse.training.checkpoints import (CheckpointModels, ResumePoint, check_resumable, checkpoint_folders,
                                           checkpoint_models, data_hash, jsonable, new_run, restore, resume_point,
                                           saved_settings, seed_run, settings_hash, write_checkpoint, write_trained)
from onnxfuse.training.halving import halving_rung
from onnxfuse.training.metrics import METRICS_HEADER, Metrics, evaluate, fmt
from onnxfuse.training.prepare import Prepared, prepare
from onnxfuse.training.run_state import RunState, mark_diverged
from onnxfuse.runtime.graph_passes import has_random_dropout, without_dropout
from onnxfuse.training.verify import VerifyReport, verify_steps

__all__ = ["TrainConfig", "TrainResult", "train_array", "verify_array", "METRICS_HEADER",
           "RESUMABLE", "settings_hash", "checkpoint_models", "seed_run", "CheckpointModels"]


log = logging.getLogger("onnxfuse.train")


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
    steps_trained: int = 0  # the steps this call trained (a resumed run's since its checkpoint)

    def summary(self) -> str:
        """One line saying what was trained (what ``onnxfuse train`` prints)."""
        if self.steps_trained == 0:
            return (f"nothing left to train: run {self.run_id} had trained its {self.steps} steps (resume with more "
                    f"--steps or --epochs to go on); metrics in {self.metrics_path}")
        B = len(self.final_loss)
        return (f"trained {B} model{'s' if B != 1 else ''} for {self.steps} steps in {self.elapsed_s:.1f}s "
                f"({self.samples_per_s:,.0f} samples/s); metrics in {self.metrics_path}")


def _first_steps(source: BatchSource, config: RunSettings, B: int, total: int, K: int
                 ) -> tuple[list[dict[str, np.ndarray]], list[StepValues]]:
    """The batches and per-model step values of a fresh run's first K steps, without moving ``source``: the
    steps then train on these same batches (a DataLoader's are drawn once, and kept)."""
    batches = source.peek(K)
    schedules = PerModelSchedules(config.schedules, config, total)
    values = []
    for _ in range(K):
        values.append(schedules.values([True] * B))
        schedules.advance()
    return batches, values


def _verify(array_dir: str, fused: onnx.ModelProto, spec: ArraySpec, trainer: Runtime | None, source: BatchSource,
            config: RunSettings, total: int, K: int, loss: LossSpec) -> VerifyReport:
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
        trainer = build_trainer(config.runtime, without_dropout(fused) if dropout_off else fused, spec,
                                loss, config, config.device, threads=config.threads or None,
                                compile=config.compile if trainer is None else "off", total_steps=K)
    model, one_spec = ArrayDir(array_dir).refuse([0], split_weights(spec, trainer.weights())[:1], fuse_models)
    batches, values = _first_steps(source, config, spec.B, total, K)
    report = verify_steps(trainer, (without_dropout(model) if dropout_off else model, one_spec), batches, values)
    # the time includes the reference's fusion and, with Dropout, the check's own trainer
    return replace(report, seconds=watch.seconds, dropout_off=dropout_off)


def verify_array(array_dir: str | os.PathLike, data=None, config: TrainConfig | None = None,
                 eval_data=None, loss=None, tune_process: bool = False) -> VerifyReport:
    """The check a fresh ``train_array`` makes before it trains (see ``verify.py``), on demand: the first
    ``config.verify_steps`` steps of every model of the array in ``array_dir`` against the model trained alone,
    with the run's data, batches, loss and hyper-parameters. Nothing is written to ``array_dir``; the report says
    per model what was compared (``report.ok``, ``report.table()``, ``report.error()``). ``tune_process``: as
    ``train_array``'s."""
    array_dir = os.fspath(array_dir)
    fused, spec = load_array(array_dir)
    with ArrayDir(array_dir).locked("check"):
        p = prepare(spec, config, data, eval_data, loss=loss)
        if tune_process:
            tune(p.settings.threads, p.settings.device)
        if p.settings.verify_steps < 1:
            raise ConfigError("--verify-steps must be >= 1 to check anything, got 0")
        return _verify(array_dir, fused, spec, None, p.train, p.settings, p.total, min(p.settings.verify_steps, p.total),
                       p.loss)


def train_array(array_dir: str | os.PathLike, data=None, config: TrainConfig | None = None, progress: bool = True,
                eval_data=None, resume: bool = False, overrides: dict | None = None,
                on_step: Callable[[int, int], None] | None = None, stop_at: int | None = None,
                loss=None, tune_process: bool = False) -> TrainResult:
    """Train every model of the array in ``array_dir``; ``metrics.csv``, ``checkpoints/`` and ``trained/`` go
    there, holding the folder's lock throughout (``ArrayBusyError`` when another process holds it).

    A fresh run first records itself (its id and settings, written whole: what ``resume`` continues after a kill);
    then everything is validated before anything else is written, the data included (no NaN or inf unless
    ``config.allow_nonfinite_data``), and the run checks its first ``config.verify_steps`` steps against every
    model trained alone (``verify.py``), raising ``VerificationError`` on a mismatch. A run that fails before its
    first step leaves the folder as it was. When its first step has trained, a fresh run becomes the folder's
    current run (``run.json``): the previous run's outputs move to ``runs/<its id>/``. ``resume``: continue the last
    run started, from its newest checkpoint (or from its start when it reached none), with its recorded settings
    unless ``config`` is given (``overrides`` changes single settings, e.g. more steps); settings other than
    ``RESUMABLE`` and the data must be the run's own. A run that had trained all its steps has nothing left to
    train: the result says so (``steps_trained`` 0) and nothing is written. ``on_step(step, total)`` is called
    after every step (a sweep reports progress with it).

    ``stop_at`` ends the run at that step with a checkpoint there (its schedules still span every step, so
    ``resume`` continues exactly): a sweep's successive halving stops every array at each rung.

    ``loss``: a Python function ``(output [B, N, ...], batch) -> [B]`` in place of the settings' loss (the torch
    runtime; see ``onnxfuse.recipe.losses.PythonLoss``); a run trained with one resumes only given it again.

    ``tune_process``: first make the process-wide settings the command line makes (one torch thread on a CPU
    unless the settings give ``threads``, denormals flushed, the heap kept: ``onnxfuse.runtime.process``); by
    default the process is left as it was, but for the torch threads a run's ``threads`` setting asks for."""
    array_dir = os.fspath(array_dir)
    fused, spec = load_array(array_dir)
    with ArrayDir(array_dir).locked("train"):
        return _train(array_dir, fused, spec, data, config, progress, eval_data, resume, overrides, on_step,
                      stop_at, loss, tune_process)


def _train(array_dir: str, fused: onnx.ModelProto, spec: ArraySpec, data, config: TrainConfig | None,
           progress: bool, eval_data, resume: bool, overrides: dict | None,
           on_step: Callable[[int, int], None] | None = None, stop_at: int | None = None,
           loss=None, tune_process: bool = False) -> TrainResult:
    array = ArrayDir(array_dir)
    current = array.read_run()  # the run whose outputs the folder holds (its record checked before anything)
    point = resume_point(array_dir) if resume else None
    if point is None:
        # a new run records itself before anything else (its settings as given; its data's hash once read): a
        # --resume after a kill, even while the data loads, continues this run, never an earlier one
        config = as_train_config(config)
        record = new_run({"settings_hash": settings_hash(config), "data_hash": None},
                         config=_config_record(config, data, eval_data, None))
        before = array.write_started(record)
    else:
        data, eval_data, config = _resumed_inputs(point, data, eval_data, config, overrides)
        record = point.run
    # own: the folder's outputs are this run's already (a resume of its current run)
    own = point is not None and (current or {}).get("id") == record["id"]
    try:
        p = prepare(spec, config, data, eval_data, resuming=point is not None and point.checkpoint is not None,
                    loss=loss)
        if tune_process:
            tune(p.settings.threads, p.settings.device)
        if point is None:
            log.info("%s", trained_note(spec))
        if point is not None and point.complete:
            _check_resumed_loss(point.config, p.loss)
        identity = {"settings_hash": settings_hash(p.settings), "data_hash": data_hash(p.train, p.eval)}
        config_record = _config_record(p.settings, data, eval_data, p.loss)
        if point is not None:
            check_resumable(point, p.settings, identity, data)
            done = _finished(array, point, record, p.total, spec.B)
            if done is not None:  # done.summary() says so
                return done
            _say_resumed(point)
        record = {**record, **identity}  # what the run is (equal to what it recorded: checked above)
        if not own:  # the record as run.json will hold it, once the run has trained its first step
            record = {**record, "differing": jsonable(p.settings.differing()), "config": config_record}
            if point is None:
                array.write_started(record)
        return _run(array, fused, spec, p, point if point is not None and point.checkpoint else None, record,
                    config_record, own, progress, on_step, stop_at)
    except Exception:  # an interruption (a kill, Ctrl-C) keeps the record: --resume continues this run
        if point is None and (array.read_run() or {}).get("id") != record["id"]:  # it failed before its first step
            array.restore_started(before)
        raise


def _config_record(config: TrainConfig | RunSettings, data, eval_data, loss: LossSpec | None) -> dict:
    """The run's settings, data (a path or a data set's name; None when given in memory) and Python loss, as its
    records hold them: what a resume needs to continue it by itself."""
    return jsonable({**config.as_dict(),
                     **{k: os.fspath(v) if isinstance(v, (str, os.PathLike)) else None
                        for k, v in (("_data", data), ("_eval_data", eval_data))},
                     "_loss": loss.label if isinstance(loss, PythonLoss) else None})


def _run(array: ArrayDir, fused: onnx.ModelProto, spec: ArraySpec, p: Prepared, point: ResumePoint | None,
         record: dict, config_record: dict, own: bool, progress: bool,
         on_step: Callable[[int, int], None] | None, stop_at: int | None) -> TrainResult:
    """The run itself, from ``point``'s checkpoint (None: from its start); ``own``: the folder's outputs are this
    run's already (a resume)."""
    trained = array.trained_path
    with atomic_dir(trained, overwrite=True, command="train") as tmp:  # removed again if anything below fails
        run = RunState(array.path, p.settings, fused, spec, p.loss, p.total, ArrayDir.scratch_path(tmp))
        run.run_record = {k: record[k] for k in ("id", "settings_hash", "data_hash")}
        run.config_record = config_record
        elapsed0 = restore(run, point.checkpoint, point.state, p.train) if point is not None else 0.0
        if point is None and p.settings.verify_steps:  # before anything is written
            report = _verify(array.path, fused, spec, run.trainer, p.train, p.settings, p.total,
                             min(p.settings.verify_steps, p.total), p.loss)
            log.info("%s", report.summary())
            if not report.ok:
                raise report.error()
        loop = _Loop(run, p, record, own, point, elapsed0)
        loop.train(stop_at, progress, on_step)
        write_trained(run, tmp, loop.elapsed, loop.stopped)
        shutil.rmtree(ArrayDir.scratch_path(tmp), ignore_errors=True)  # ONNX Runtime's, rebuilt by each run
    prune_best(run.array, run.best)  # trained/ names the final best states now: the earlier ones may go
    if loop.stopped:
        raise TrainingStoppedError(f"stopped: {loop.stopped}; state saved in {trained}")
    final = np.full(spec.B, np.nan)
    for i, b in enumerate(run.models):
        final[b] = run.last_loss[i]
    return TrainResult(steps=run.step, final_loss=final.tolist(), elapsed_s=loop.elapsed,
                       samples_per_s=loop.samples / max(loop.elapsed - elapsed0, 1e-9),
                       metrics_path=run.array.metrics_path, trained_dir=trained,
                       status=dict(run.status), eval=run.last_eval, survivors=list(run.models), run_id=record["id"],
                       best=run.best.record(), steps_trained=loop.trained)


def _say_resumed(point: ResumePoint) -> None:
    if point.checkpoint is not None:
        log.info("resumed from %s (step %d)", point.checkpoint, point.step)
    else:
        log.warning("--resume: run %s (started %s) reached no checkpoint: it trains from its start (step 0)",
                    point.run["id"], point.run["started"] or "?")


def _finished(array: ArrayDir, point: ResumePoint, record: dict, total: int, B: int) -> TrainResult | None:
    """What the resumed run had ended with, when it had trained all its ``total`` steps (``trained/`` holds its
    state of that step), else None. A run that had gone past ``total`` is refused (before anything is said)."""
    state = array.train_state()
    mine = state is not None and (state["run"] or {}).get("id") == record["id"] and state["step"] is not None
    reached = max(point.step, state["step"] if mine else 0)
    if reached > total:
        raise ConfigError(f"--resume: run {record['id']} has trained {reached} steps, past the {total} steps asked "
                          "for; resume with more --steps (or --epochs)")
    if not mine or state["step"] != total or state["stopped"]:
        return None
    final = [math.nan] * B
    for b, v in (state["final_loss"] or {}).items():
        final[int(b)] = v
    ev = {metric: {int(b): v for b, v in values.items()} for metric, values in (state["eval"] or {}).items()
          if values is not None}
    return TrainResult(steps=state["step"], final_loss=final, elapsed_s=state["elapsed_s"] or 0.0, samples_per_s=0.0,
                       metrics_path=array.metrics_path, trained_dir=array.trained_path,
                       status={int(b): v for b, v in state["status"].items()}, eval=ev,
                       survivors=list(state["models"] if state["models"] is not None else range(B)),
                       run_id=record["id"], best=state["best"], steps_trained=0)


def _check_resumed_loss(saved: dict, loss: LossSpec) -> None:
    """A run trained with a Python loss resumes with that function given again (its name is what the run
    recorded), and only such a run takes one. ``saved``: the run's recorded config."""
    was = saved.get("_loss")
    now = loss.label if isinstance(loss, PythonLoss) else None
    if was != now:
        what = f"the Python loss {was}" if was else "its settings' loss"
        fix = (f"resume it with train_array(..., loss={was.rsplit('.', 1)[-1]}, resume=True)" if was else
               "resume it without loss=")
        raise ConfigError(f"--resume: the run was trained with {what}, not "
                          f"{'the Python loss ' + now if now else 'the settings loss'}; {fix}")


def _resumed_inputs(point: ResumePoint, data, eval_data, config: TrainConfig | None, overrides: dict | None):
    """A resumed run's data (the recorded one unless given) and settings: the run's own unless ``config`` is
    given, with ``overrides`` (e.g. more steps) applied. The recorded settings are checked alone first: an error
    there is the record's, not the flags'. Recorded data that a function makes is not called: an array folder
    runs no code of its own (it is given again)."""
    recorded = point.config
    for flag, key, given in (("--data", "_data", data), ("--eval-data", "_eval_data", eval_data)):
        if given is None and is_data_factory(recorded.get(key)):
            raise ConfigError(f"--resume: run {point.run['id']}'s {flag} was {recorded[key]}, a function that runs "
                              f"code, which an array folder never runs by itself: give {flag} {recorded[key]} "
                              "again to resume it")
    data = data if data is not None else recorded.get("_data")
    eval_data = eval_data if eval_data is not None else recorded.get("_eval_data")
    if config is None:  # the run's own settings, the overrides validated over them as any settings are
        try:
            TrainConfig.resumed(saved_settings(recorded), None)
        except ConfigError as e:
            raise InputFileError(f"{point.where}: the run's recorded settings are not valid ({e}); start a new run "
                                 "without --resume") from None
        config = TrainConfig.resumed(saved_settings(recorded), overrides)
    return data, eval_data, config


class _Loop:
    """The steps of one run from ``run.step`` on: train, log, evaluate, halve, checkpoint, report progress.

    A new run's outputs begin once its first step has trained: until then a failure leaves the folder as it
    was (the previous run's outputs move aside and ``run.json`` is written after that step). ``own``: the
    folder's outputs are this run's already (a resume, from ``point``'s checkpoint or from its start: its rows of
    metrics.csv are kept as far as the checkpoint counted them, none from its start)."""

    def __init__(self, run: RunState, p: Prepared, record: dict, own: bool, point: ResumePoint | None,
                 elapsed0: float):
        self.run, self.p, self.record, self.elapsed0 = run, p, record, elapsed0
        self.metrics = Metrics(run.array, record["id"], run.step, point.state["metrics_rows"] if point else 0) \
            if own else None
        self.samples, self.stopped, self.elapsed, self.trained = 0, None, 0.0, 0
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
                write_checkpoint(run, self.p.train, self._elapsed(), self.metrics.rows if self.metrics else None)
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
        run, config, source = self.run, self.p.settings, self.p.train
        run.step += 1
        self.trained += 1
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
            self.metrics = Metrics(run.array, self.record["id"], None)
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
            write_checkpoint(run, source, el, self.metrics.rows)
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
