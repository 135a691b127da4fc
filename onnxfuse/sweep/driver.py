"""Running a sweep on Ray: the driver plans, submits one Ray task per array, retries failed arrays, shows progress
and writes every result into the sweep folder as it arrives.

* Ray: ``ray.init()`` starts a local Ray on this machine (nothing to set up) unless ``address`` names a running
  cluster (``ray start --head`` on one machine, ``ray start --address HEAD:6379`` on the others). Each array is a
  task asking for ``resources.cpus`` CPUs and ``resources.gpus`` GPUs (a fraction shares a GPU; Ray sets
  ``CUDA_VISIBLE_DEVICES``, so ``device: cuda`` is the GPU it gave), spread over the nodes (``SPREAD``).
* Shipping: a task gets its trials' ONNX files and the data (a ``sklearn:`` name, or a .npz file's arrays through
  Ray's object store) and returns weights, metrics and results as data: workers share no storage with the driver.
* Failures: a task that raises, or whose worker process or node dies, is run again ``retries`` times (default
  once) by the driver itself (Ray's own task retries are off, so every attempt is counted in result.json); then
  the array is recorded as failed and the sweep goes on. A finished array's result is on disk before the next
  result is waited for, so no failure loses it.
* Resume: ``--resume`` reads the folder's spec and plan and runs only the arrays with no result, or a failed one.
* Progress: tasks report their step through a Ray queue (``ray.util.queue``); ``status.json`` lists every array as
  done, running (attempt, host, pid, node, step), queued or failed, and a bar shows the counts.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from ..errors import ConfigError, InputFileError
from .layout import SweepDir
from .planning import plan_sweep
from .report import collect, failed_result, write_array_result, write_report
from .spec import SweepSpec, load_spec, parse_spec

__all__ = ["run_sweep", "SweepResult"]

log = logging.getLogger("onnxfuse.sweep")


@dataclass
class SweepResult:
    path: str
    rows: list[dict]  # every trial, best first (results.csv)
    arrays: int
    ran: list[str] = field(default_factory=list)  # the arrays this call trained
    failed: list[str] = field(default_factory=list)
    metric: str = ""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    cause = getattr(e, "cause", None)  # a RayTaskError carries the task's own exception
    if cause is not None and str(cause):
        text = f"{type(cause).__name__}: {' '.join(str(cause).split())}"
    return (text or type(e).__name__)[:500]


def _array_task(job: dict, models: dict, data, eval_data, queue, attempt: int) -> dict:
    """The body of an array's Ray task."""
    from .worker import run_array

    return run_array(job, models, data, eval_data, report=queue.put_nowait if queue is not None else None,
                     attempt=attempt)


def _plan_task(model: bytes, settings: dict, max_B: int) -> tuple[int, str]:
    """The array-sizing planner on a worker: B for the group's model on the device the arrays get."""
    import tempfile

    from onnxfuse.training.plan import plan_array

    from .worker import node_of_this_process

    with tempfile.TemporaryDirectory(prefix="onnxfuse-sweep-plan-") as tmp:
        path = os.path.join(tmp, "model.onnx")
        with open(path, "wb") as f:
            f.write(model)
        plan = plan_array(path, runtime=settings.get("runtime", "auto"), device=settings.get("device", "cpu"),
                          batch=settings["batch_size"], optimizer=settings.get("optimizer", "sgd"),
                          threads=settings.get("threads", 0), max_B=max_B)
    return plan.recommended_B, f"planner on {node_of_this_process()['host']}: {plan.reason}"


def _connect(address: str | None, num_cpus: int | None) -> bool:
    """Connect to Ray (start a local one without ``address``); True when this call did (and shuts it down)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("onnxfuse sweep needs Ray: pip install 'onnxfuse[sweep]' (or pip install ray)") from None
    if ray.is_initialized():
        return False
    opts = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        if address:
            if num_cpus is not None:
                raise ConfigError("--cpus sizes a local Ray; a cluster at --address has the CPUs its nodes have")
            ray.init(address=address, **opts)
        else:
            ray.init(num_cpus=num_cpus, **opts)
    except ConnectionError as e:
        raise ConfigError(f"--address {address}: no Ray cluster answers there ({_one_line(e)}); start one with "
                          "`ray start --head`, or leave --address out for a local Ray") from None
    return True


def _data_ref(source):
    """A data source as a task can use it anywhere: sklearn names as they are, a .npz file's arrays in Ray's object
    store (read once, here)."""
    import ray

    from onnxfuse.training.datasets import is_named

    if source is None or is_named(source):
        return source
    import numpy as np

    try:
        with np.load(source, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise InputFileError(f"data file '{source}' cannot be read ({type(e).__name__}: {e}); give a .npz file "
                             "of arrays or sklearn:<name>") from None
    return ray.put(arrays)


class _Progress:
    """status.json and the bar: every array done / running / queued / failed."""

    def __init__(self, sweep: SweepDir, plan: dict, show: bool):
        from tqdm import tqdm

        self.sweep = sweep
        self.state: dict[str, dict] = {}
        for a in plan["arrays"]:
            res = sweep.result(a["id"])
            self.state[a["id"]] = {"state": "done" if res and res["state"] == "done" else "queued",
                                   "trials": len(a["trials"])}
        self.bar = tqdm(total=len(plan["arrays"]), initial=self.count("done"), unit="array", desc="sweep",
                        disable=not show, dynamic_ncols=True)
        self.write()

    def count(self, state: str) -> int:
        return sum(s["state"] == state for s in self.state.values())

    def event(self, ev: dict) -> None:
        s = self.state.get(ev.get("array"))
        if s is not None and s["state"] in ("queued", "running"):
            s.update(state="running", **{k: ev[k] for k in ("attempt", "host", "pid", "node", "step", "total")})

    def set(self, aid: str, state: str, **info) -> None:
        before = self.state[aid]["state"]
        self.state[aid] = {"state": state, "trials": self.state[aid]["trials"], **info}
        if state in ("done", "failed") and before not in ("done", "failed"):
            self.bar.update(1)

    def write(self) -> None:
        counts = {k: self.count(k) for k in ("done", "running", "queued", "failed")}
        running = [f"{a} {s.get('step', 0)}/{s.get('total') or '?'}" for a, s in self.state.items()
                   if s["state"] == "running"]
        self.bar.set_postfix_str(", ".join(f"{v} {k}" for k, v in counts.items()) +
                                 (f" | {', '.join(running)}" if running else ""))
        self.sweep.write_json(self.sweep.status_path, {"updated": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                       **counts, "arrays": self.state})

    def close(self) -> None:
        self.bar.close()


def _execute(sweep: SweepDir, spec: SweepSpec, plan: dict, progress: bool) -> tuple[list[str], list[str]]:
    import ray
    from ray.util.queue import Empty, Queue

    todo = [a for a in plan["arrays"] if (sweep.result(a["id"]) or {}).get("state") != "done"]
    if len(todo) < len(plan["arrays"]):
        log.info("%d of %d arrays are done already; running %d", len(plan["arrays"]) - len(todo),
                 len(plan["arrays"]), len(todo))
    if not todo:
        return [], []
    params = {t["id"]: t["params"] for t in plan["trials"]}
    queue = Queue(actor_options={"num_cpus": 0})
    task = ray.remote(_array_task).options(num_cpus=spec.cpus, num_gpus=spec.gpus, max_retries=0,
                                           scheduling_strategy="SPREAD")
    data = {}
    for a in todo:
        for src in (a["data"], a["eval_data"]):
            if src not in data:
                data[src] = _data_ref(src)
    pending = {}

    def submit(job: dict, attempt: int) -> None:
        models = {}
        for tid in job["trials"]:
            with open(sweep.model_path(tid), "rb") as f:
                models[tid] = f.read()
        ref = task.remote(job, models, data[job["data"]], data[job["eval_data"]], queue, attempt)
        pending[ref] = (job, attempt)

    bar = _Progress(sweep, plan, progress)
    ran, failed = [], []
    try:
        for job in todo:
            submit(job, 1)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            while True:
                try:
                    bar.event(queue.get_nowait())
                except Empty:
                    break
            for ref in ready:
                job, attempt = pending.pop(ref)
                try:
                    out = ray.get(ref)
                except Exception as e:  # the task raised, or its worker or node died
                    why = _one_line(e)
                    if attempt <= spec.sections.retries:
                        log.warning("array %s failed (attempt %d: %s); running it again", job["id"], attempt, why)
                        bar.set(job["id"], "queued", attempt=attempt + 1)
                        submit(job, attempt + 1)
                    else:
                        log.error("array %s failed %d time(s), its trials have no result: %s", job["id"], attempt,
                                  why)
                        failed_result(sweep, job, attempt, why)
                        bar.set(job["id"], "failed", attempts=attempt, error=why)
                        failed.append(job["id"])
                    continue
                rec = write_array_result(sweep, job, out, attempt, params)
                bar.set(job["id"], "done", attempts=attempt, host=rec["host"], node=rec["node"],
                        elapsed_s=round(rec["elapsed_s"], 2))
                ran.append(job["id"])
            bar.write()
    finally:
        bar.close()
        for ref in pending:
            ray.cancel(ref, force=True)
    return ran, failed


def _ray_sizer(spec: SweepSpec) -> Callable[[str, dict], tuple[int, str]]:
    import ray

    task = ray.remote(_plan_task).options(num_cpus=spec.cpus, num_gpus=spec.gpus, max_retries=1)

    def size_of(model_path: str, settings: dict) -> tuple[int, str]:
        with open(model_path, "rb") as f:
            model = f.read()
        log.info("sizing arrays: the planner trains %s at B = 1, 2, 4 on a worker", os.path.basename(model_path))
        return ray.get(task.remote(model, settings, spec.sections.arrays.max_size))

    return size_of


def run_sweep(spec: str | os.PathLike | SweepSpec | None, out_dir: str | os.PathLike, *, resume: bool = False,
              address: str | None = None, runtime: str | None = None, num_cpus: int | None = None,
              progress: bool = True, trials: list[dict] | None = None) -> SweepResult:
    """Run a sweep (see the module docstring) into ``out_dir``; with ``resume``, continue the sweep there (``spec``
    None: the folder's own). ``trials``: the trials' parameters ({space key: value} each) instead of the spec's
    search (the Optuna helper passes the trials it asked for). ``runtime`` overrides the spec's for the arrays
    still to run."""
    sweep = SweepDir(out_dir)
    if resume:
        if not sweep.is_sweep():
            raise InputFileError(f"--resume: '{sweep.path}' is not a sweep folder (no spec.json); start a sweep "
                                 f"with `onnxfuse sweep SPEC.yaml -o {sweep.path}`")
        if spec is not None:
            raise ConfigError("--resume continues the sweep with the spec in its folder; give the folder alone")
    else:
        if spec is None:
            raise ConfigError("give a sweep spec (SPEC.yaml) and -o SWEEP_DIR, or --resume SWEEP_DIR")
        if os.path.isdir(sweep.path) and os.listdir(sweep.path):
            hint = "continue it with --resume" if sweep.is_sweep() else "choose an empty or new folder"
            raise InputFileError(f"-o: '{sweep.path}' is not empty; {hint}")
        spec = spec if isinstance(spec, SweepSpec) else load_spec(spec)
        params = trials if trials is not None else spec.trials()
        if not params:
            raise ConfigError(f"{spec.source}: the search gives no trials")
    with sweep.locked():
        if resume:
            saved = sweep.read_json(sweep.spec_path, "the sweep's spec")
            spec = parse_spec(saved["spec"], saved["source"], saved["base_dir"])
            params = saved["params"]
        else:
            sweep.write_json(sweep.spec_path, {"spec": spec.as_dict(), "source": spec.source,
                                               "base_dir": spec.base_dir, "params": params})
        started = _connect(address, num_cpus)
        try:
            if os.path.exists(sweep.plan_path):
                plan = sweep.read_json(sweep.plan_path, "the sweep's plan")
                if runtime:
                    for a in plan["arrays"]:
                        a["settings"]["runtime"] = runtime
            else:
                plan = plan_sweep(spec, params, sweep, _ray_sizer(spec) if spec.sections.arrays.size == "auto"
                                  else None, runtime, progress)
                sweep.write_json(sweep.plan_path, plan)
            if progress:
                print(f"{len(plan['trials'])} trials in {len(plan['groups'])} group(s) of identical graphs, "
                      f"{len(plan['arrays'])} arrays", flush=True)
            ran, failed = _execute(sweep, spec, plan, progress)
        finally:
            if started:
                import ray

                ray.shutdown()
        rows = collect(sweep, plan)
        write_report(sweep, plan, rows)
    return SweepResult(sweep.path, rows, len(plan["arrays"]), ran, failed, plan["metric"])

