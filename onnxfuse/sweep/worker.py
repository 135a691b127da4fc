"""One array of a sweep, where it runs: fuse the trials' models, train the array, split it into one checkpoint per
trial, and hand everything back as data (the driver writes it). It works in a temporary folder of its own, so a
worker needs no storage shared with the driver; it runs the same in a Ray task and in the driver's process.

Each trial's status: ``finished``; ``diverged`` (its loss or update became non-finite; it was frozen at its last
finite state, ``on_diverge: freeze``); ``stopped`` (dropped by the run's own successive halving, or the whole run
stopped by ``on_diverge: stop``). Its metrics are the last evaluation's (``eval_loss``, ``eval_accuracy``) and
its last finite training loss (``train_loss``); with ``keep_best``, also its best state's step and value (``best``)
and that state's files beside the final ones.
"""
from __future__ import annotations

import csv
import io
import math
import os
import socket
import tarfile
import tempfile
import time
from typing import Callable

import numpy as np

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core.array import ArrayDir, model_file, model_weights_file
from onnxfuse.recipe.batches import same_position
from onnxfuse.training.run import METRICS_HEADER
from onnxfuse.sweep.folder import TRIAL_FILES

__all__ = ["run_array", "node_of_this_process", "number", "RESULT_COLUMNS", "TRIAL_METRICS"]

RESULT_COLUMNS = ("status", "steps", "train_loss", "eval_loss", "eval_accuracy")
TRIAL_METRICS = tuple(c for c in METRICS_HEADER if c not in ("model", "run"))  # a trial's metrics.csv
Report = Callable[[dict], None]


def node_of_this_process() -> dict:
    """Where this code runs: host name, pid, and the Ray node's id when it runs in Ray."""
    where = {"host": socket.gethostname(), "pid": os.getpid(), "node": ""}
    try:
        import ray

        if ray.is_initialized():
            where["node"] = ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return where


def number(text) -> float:
    """A number of metrics.csv (NaN for an empty cell)."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def _pack(folder: str) -> bytes:
    """An array folder as tar bytes (without onnxruntime's scratch artifacts, which every run rebuilds)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(folder, arcname="array", filter=lambda ti: None if "/artifacts" in ti.name else ti)
    return buf.getvalue()


def _unpack(state: bytes, tmp: str) -> str:
    with tarfile.open(fileobj=io.BytesIO(state), mode="r") as tar:
        try:
            tar.extractall(tmp, filter="data")
        except TypeError:  # a Python without extraction filters (before 3.10.12 / 3.11.4)
            tar.extractall(tmp)
    return os.path.join(tmp, "array")


def _refuse(job: dict, paths: list[str], seg: dict, config, array_dir: str, tmp: str) -> None:
    """This array's trials, each with its weights and optimizer state at the last rung (from the arrays the
    previous segment returned), fused into ``array_dir`` and made a run that resumes there."""
    from onnx import numpy_helper

    from onnxfuse.core._io import read_onnx
    from onnxfuse.core.passes import fuse_models, save_array
    from onnxfuse.training.run import checkpoint_models, seed_run

    sources = {}
    for aid, state in seg["states"].items():
        os.makedirs(os.path.join(tmp, f"from_{aid}"))
        sources[aid] = checkpoint_models(_unpack(state, os.path.join(tmp, f"from_{aid}")))
    protos, optimizer, status, best, template = [], [], [], [], None
    for tid, path in zip(job["trials"], paths):
        aid, place = seg["sources"][tid]
        src = sources[aid]
        template = template or src.record
        proto = read_onnx(path, "run the sweep again")
        state = src.states[place]
        for init in proto.graph.initializer:
            if init.name in state:
                init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(state[init.name]), init.name))
        protos.append(proto)
        optimizer.append(src.optimizer[place])
        status.append(src.status.get(place))
        best.append(src.best.get(place))
    if any(not same_position(s.record["sampler"], template["sampler"]) or s.record["step"] != template["step"]
           for s in sources.values()):
        raise RuntimeError(f"array {job['id']}: its trials' arrays stopped at different steps or batches")
    save_array(fuse_models(protos, labels=job["trials"], per_model_inputs=job["per_model_inputs"]), array_dir)
    seed_run(array_dir, config, optimizer, status, template, best)


def _trial_results(array_dir: str, trials: list[str], stopped: str, tmp: str) -> tuple[int, str, dict]:
    """What the array trained in ``array_dir`` gives back: its steps, its metrics.csv, and per trial (the array's
    models, in order) its status, metrics and files (each model split out of the array into ``tmp``)."""
    from onnxfuse.core.split import model_steps, split_array

    array = ArrayDir(array_dir)
    state = array.trained()
    split_dirs = {which: os.path.join(tmp, f"split_{which}") for which in ("final", "best")
                  if which == "final" or state.best}
    for which, folder in split_dirs.items():
        split_array(array_dir, folder, which=which)
    with open(array.metrics_path, encoding="utf-8") as f:
        metrics_csv = f.read()
    rows = list(csv.DictReader(io.StringIO(metrics_csv)))
    out = {}
    for b, tid in enumerate(trials):
        mine = [r for r in rows if r["model"] == str(b)]
        train = [number(r["loss"]) for r in mine if r["split"] == "train" and math.isfinite(number(r["loss"]))]
        evals = [r for r in mine if r["split"] == "eval"]
        st = state.status.get(str(b))
        status = ("diverged" if st["status"] == "diverged" else "stopped") if st else \
            ("stopped" if stopped else "finished")
        files = {}
        for which, folder in split_dirs.items():
            for name, src in zip(TRIAL_FILES[which], (model_file(b), model_weights_file(b))):
                with open(os.path.join(folder, src), "rb") as f:
                    files[name] = f.read()
        best = ((state.best or {}).get("models") or {}).get(str(b))
        out[tid] = {
            "status": status, "steps": model_steps(st, state.steps),
            "train_loss": train[-1] if train else math.nan,
            "eval_loss": number(evals[-1]["loss"]) if evals else math.nan,
            "eval_accuracy": number(evals[-1]["accuracy"]) if evals else math.nan,
            "best": {"metric": state.best["metric"], "step": best["step"], "value": best["value"]} if best else None,
            "metrics": [{k: r[k] for k in TRIAL_METRICS} for r in mine],
            "files": files}
    return state.steps, metrics_csv, out


def run_array(job: dict, models: dict[str, bytes], data, eval_data, report: Report | None = None,
              attempt: int = 1, segment: dict | None = None) -> dict:
    """Train one planned array (``job``: an entry of plan.json's arrays) from its trials' exported models
    (``models``: trial id -> ONNX bytes) on ``data``/``eval_data`` (a source name or a dict of arrays). ``report``
    receives progress events: {"array", "attempt", "pid", "node", "step", "total"}.

    ``segment`` (successive halving across arrays): {"until": the rung step to stop at, or None for the end;
    "sources": {trial: [array, place]} and "states": {array: its folder as the previous rung's segment returned
    it}: where each trial of this array was at the last rung (no sources: fuse the exported models afresh)}. A
    segment that stops at a rung returns the array folder as ``state``."""
    from onnxfuse.core.errors import TrainingStoppedError
    from onnxfuse.core.passes import fuse_models, save_array
    from onnxfuse.training.run import train_array

    where = node_of_this_process()
    watch = Stopwatch()
    last = [0.0]
    started_at, first_step_at = time.time(), [None]  # this node's clock: when the task began, its first step ended

    def tell(step: int, total: int) -> None:
        if step >= 1 and first_step_at[0] is None:
            first_step_at[0] = time.time()
        now = watch.seconds
        if report is not None and (step in (0, total) or now - last[0] > 0.5):
            last[0] = now
            try:
                report({"array": job["id"], "attempt": attempt, **where, "step": step, "total": total})
            except Exception:  # progress is never worth a failed array
                pass

    trials = job["trials"]
    tell(0, 0)
    with tempfile.TemporaryDirectory(prefix=f"onnxfuse-sweep-{job['id']}-") as tmp:
        paths = []
        for tid in trials:
            paths.append(os.path.join(tmp, f"{tid}.onnx"))
            with open(paths[-1], "wb") as f:
                f.write(models[tid])
        seg = segment or {}
        array_dir = os.path.join(tmp, "array")
        config = job["settings"]  # the TrainConfig the driver made (plan.json holds its record)
        go_on = bool(seg.get("sources"))
        if go_on:  # the trials where the last rung left them, re-fused into this array
            _refuse(job, paths, seg, config, array_dir, tmp)
        else:
            save_array(fuse_models(paths, labels=trials, per_model_inputs=job["per_model_inputs"]), array_dir)
        stopped = ""
        try:
            train_array(array_dir, data, config, progress=False, eval_data=eval_data, on_step=tell, resume=go_on,
                        stop_at=seg.get("until"), tune_process=True)  # a Ray worker: onnxfuse's own process
        except TrainingStoppedError as e:
            stopped = str(e)
        steps, metrics_csv, results = _trial_results(array_dir, trials, stopped, tmp)
        out = {"array": job["id"], "attempt": attempt, **where, "steps": steps, "stopped": stopped,
               "metrics_csv": metrics_csv, "trials": results}
        if seg.get("until") is not None:
            out["state"] = _pack(array_dir)
    out.update(elapsed_s=watch.seconds, started_at=started_at, first_step_at=first_step_at[0])
    tell(out["steps"], out["steps"])
    return out

