"""Running a sweep on Ray: the driver plans, submits one Ray task per array, retries failed arrays, shows progress
and writes every result into the sweep folder as it arrives.

* Ray: ``address`` names a running cluster (``ray start --head`` on one machine, ``ray start --address HEAD:6379``
  on the others); without it, a Ray already running on this machine (``ray start --head``, or ``RAY_ADDRESS``) is
  used, else a local Ray is started for the sweep (``num_cpus``: always a local Ray of that many CPUs). Ray starts
  while the driver exports and groups the trials (the plan is made in a thread beside it: both are the first
  seconds of a sweep), and says nothing below an error unless onnxfuse's log is at debug level (``--verbose``).
  Each array is a task asking for ``resources.cpus`` CPUs and ``resources.gpus`` GPUs (a fraction shares a GPU;
  Ray sets ``CUDA_VISIBLE_DEVICES``, so ``device: cuda`` is the GPU it gave), spread over the nodes (``SPREAD``).
* Shipping: a task gets its trials' ONNX files and the data (a ``sklearn:`` name, or a .npz file's arrays through
  Ray's object store) and returns weights, metrics and results as data: workers share no storage with the driver.
* Failures: a task that raises, or whose worker process or node dies, is run again ``retries`` times (default
  once) by the driver itself (Ray's own task retries are off, so every attempt is counted in result.json); then
  the array is recorded as failed and the sweep goes on. A finished array's result is on disk before the next
  result is waited for, so no failure loses it.
* Resume: ``--resume`` reads the folder's spec and plan and runs only the arrays with no result, or a failed one.
* Successive halving (``halving`` in the spec): every array runs to the rung and stops there with a checkpoint
  (its folder comes back as ``state_<k>.tar``); the driver ranks every trial still training, and forms the next
  rung's arrays from each group's survivors; their tasks re-fuse them from the folders they were in.
* Progress: each array's task is a streaming task: its progress events (step, host, pid, node) come back in its
  own stream before its result (no actor to start); ``status.json`` lists every array as done, running (attempt,
  host, pid, node, step), queued or failed, and a bar shows the counts.
* Stopping: whatever stops the driver once it has a plan (a full disk, Ctrl-C, a bug) is written into
  ``status.json`` (``stopped``: the error and when; every array not done or failed is ``stopped``), best effort:
  for a full disk the driver holds some space back from the start to be able to (``SweepDir.reserve_space``).
  A failure the user can fix is one error line that names the file and says to ``--resume``.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from onnxfuse.core.errors import (ArrayBusyError, ConfigError, InputFileError, OutOfMemoryError, OutputError,
                                  as_user_error, shell)
from onnxfuse.recipe.ranking import rank_key
from onnxfuse.recipe.train_config import TrainConfig
from onnxfuse.sweep.folder import SweepDir
from onnxfuse.sweep.planning import PlanStopped, Sizer, plan_sweep
from onnxfuse.sweep.results import all_arrays, close_rung, collect, failed_result, write_array_result, write_report
from onnxfuse.sweep.spec import SweepSpec, load_spec, parse_spec
from onnxfuse.sweep.worker import number

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
    trial_ids: list[str] = field(default_factory=list)  # in the order of the trials given (or the search's)

    def summary(self) -> str:
        """The line a sweep ends with: how many trials have results, where the files are."""
        done = sum(r["status"] not in ("failed", "not run") for r in self.rows)
        return (f"{done} of {_count(len(self.rows), 'trial')} {'has' if len(self.rows) == 1 else 'have'} results "
                f"({_count(len(self.ran), 'array')} trained now, {len(self.failed)} failed), best first by "
                f"{self.metric}: {os.path.join(self.path, 'results.csv')}, report.md, report.png; curves: "
                f"{shell('tensorboard', '--logdir', os.path.join(self.path, 'trials'))}")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    cause = getattr(e, "cause", None)  # a RayTaskError carries the task's own exception
    if cause is not None and str(cause):
        text = f"{type(cause).__name__}: {' '.join(str(cause).split())}"
    return (text or type(e).__name__)[:500]


def _array_task(job: dict, models: dict, data, eval_data, attempt: int, segment: dict) -> Iterator[dict]:
    """The body of an array's Ray task, a generator (a streaming task): ``{"event": ...}`` for each progress report
    of ``run_array`` (run in a thread of the task), then ``{"result": what it returned}``; what it raised is raised
    here. Progress comes back in the task's own stream, not through an actor: an actor is one more process to
    start, which the first array's first step waited for (1.5-2 s on 2 cores)."""
    import queue
    import threading

    from onnxfuse.sweep.worker import run_array

    events: queue.SimpleQueue = queue.SimpleQueue()
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["result"] = run_array(job, models, data, eval_data, report=events.put, attempt=attempt,
                                          segment=segment)
        except BaseException as e:  # raised again below, in the task's own thread
            outcome["error"] = e
        finally:
            events.put(None)

    threading.Thread(target=train, name=f"onnxfuse-array-{job['id']}", daemon=True).start()
    while (event := events.get()) is not None:
        yield {"event": event}
    if "error" in outcome:
        raise outcome["error"]
    yield {"result": outcome["result"]}


def _sizing_task(model: bytes, settings: TrainConfig, max_B: int) -> tuple[int, str]:
    """Array sizing (``size_array``) on a worker: B for the group's model on the device the arrays get (its reason
    begins "planner on HOST", as plan.json has always recorded it)."""
    import tempfile

    from onnxfuse.measure.sizing import size_array

    from onnxfuse.sweep.worker import node_of_this_process

    with tempfile.TemporaryDirectory(prefix="onnxfuse-sweep-plan-") as tmp:
        path = os.path.join(tmp, "model.onnx")
        with open(path, "wb") as f:
            f.write(model)
        sizing = size_array(path, runtime=settings.runtime, device=settings.device, batch=settings.batch_size,
                            optimizer=settings.optimizer, threads=settings.threads, max_B=max_B)
    return sizing.recommended_B, f"planner on {node_of_this_process()['host']}: {sizing.reason}"


def _connect(address: str | None, num_cpus: int | None) -> bool:
    """Connect to Ray (see the module docstring); True when this call did (and shuts it down)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("onnxfuse sweep needs Ray: pip install 'onnxfuse[sweep]' (or pip install ray)") from None
    if ray.is_initialized():
        return False
    # Ray's notices (token authentication on by default, the local instance it started) are not the sweep's: shown
    # with --verbose only
    level = logging.WARNING if log.isEnabledFor(logging.DEBUG) else logging.ERROR
    opts = dict(include_dashboard=False, log_to_driver=False, logging_level=level)
    try:
        if address:
            if num_cpus is not None:
                raise ConfigError("--cpus sizes a local Ray; a cluster at --address has the CPUs its nodes have")
            ray.init(address=address, **opts)
        elif num_cpus is not None:  # "local": a new one of that size, even where a Ray runs already
            ray.init(address="local", num_cpus=num_cpus, **opts)
        else:  # Ray's own choice: RAY_ADDRESS, else the one `ray start` started here, else a new local one
            ray.init(**opts)
    except ConnectionError as e:
        where = f"--address {address}" if address else f"RAY_ADDRESS {os.environ.get('RAY_ADDRESS')}" if \
            os.environ.get("RAY_ADDRESS") else "the Ray running on this machine"
        other = "leave --address out" if address else "give --cpus N"
        raise ConfigError(f"{where}: no Ray cluster answers there ({_one_line(e)}); start one with `ray start "
                          "--head` (a cluster with token authentication also needs RAY_AUTH_MODE=token here), or "
                          f"{other} for a local Ray of the sweep's own") from None
    log.debug("ray: %s", ray.get_runtime_context().gcs_address)
    return True


def _shutdown() -> None:
    import ray

    ray.shutdown()


def _data_ref(source):
    """A data source as a task can use it anywhere: sklearn names and data factories (``MODULE:FUNCTION``, called
    by each array's task: a DataLoader draws its batches where the array trains) as they are, a .npz file's arrays
    in Ray's object store (read once, here)."""
    import ray

    from onnxfuse.recipe.data import load_npz
    from onnxfuse.recipe.datasets import is_data_factory, is_named

    if source is None or is_named(source) or is_data_factory(source):
        return source
    return ray.put(load_npz(source))


STATES = ("done", "running", "queued", "failed")  # an array's in status.json (and "stopped": _record_stop)


class _Progress:
    """status.json and the bar: every array of the current segment done / running / queued / failed."""

    def __init__(self, sweep: SweepDir, jobs: list[dict], done: list[str], segment: str, show: bool):
        from tqdm import tqdm

        self.sweep, self.segment = sweep, segment
        self.state: dict[str, dict] = {aid: {"state": "done"} for aid in done}
        self.state.update({j["id"]: {"state": "queued", "trials": len(j["trials"])} for j in jobs})
        self.bar = tqdm(total=len(self.state), initial=len(done), unit="array",
                        desc=f"sweep ({segment})" if segment else "sweep",
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
        self.state[aid] = {"state": state, "trials": self.state[aid].get("trials"), **info}
        if state in ("done", "failed") and before not in ("done", "failed"):
            self.bar.update(1)

    def write(self) -> None:
        counts = {k: self.count(k) for k in STATES}
        running = [f"{a} {s.get('step', 0)}/{s.get('total') or '?'}" for a, s in self.state.items()
                   if s["state"] == "running"]
        self.bar.set_postfix_str(", ".join(f"{v} {k}" for k, v in counts.items()) +
                                 (f" | {', '.join(running)}" if running else ""))
        self.sweep.write_json(self.sweep.status_path, {"updated": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                       "segment": self.segment, **counts,
                                                       "arrays": self.state})

    def close(self) -> None:
        self.bar.close()


class _Runner:
    """Ray tasks for arrays: submitted, retried, their progress shown and their results written as they come."""

    def __init__(self, sweep: SweepDir, spec: SweepSpec, plan: dict, progress: bool):
        import ray

        self.sweep, self.spec, self.show = sweep, spec, progress
        self.params = {t["id"]: t["params"] for t in plan["trials"]}
        self.task = ray.remote(_array_task).options(num_cpus=spec.cpus, num_gpus=spec.gpus, max_retries=0,
                                                    scheduling_strategy="SPREAD", num_returns="streaming")
        self.data: dict = {}
        self.ran: list[str] = []
        self.failed: list[str] = []

    def _submit(self, pending: dict, job: dict, seg: dict, k: int, attempt: int) -> None:
        models = {}
        for tid in job["trials"]:
            with open(self.sweep.model_path(tid), "rb") as f:
                models[tid] = f.read()
        sent = seg
        if job.get("sources"):  # the folders of the arrays its trials were in at the last rung
            states = {}
            for aid, _ in job["sources"].values():
                if aid not in states:
                    with open(self.sweep.state_path(aid, k - 1), "rb") as f:
                        states[aid] = f.read()
            sent = {**seg, "sources": job["sources"], "states": states}
        for src in (job["data"], job["eval_data"]):
            if src not in self.data:
                self.data[src] = _data_ref(src)
        stream = self.task.remote(job, models, self.data[job["data"]], self.data[job["eval_data"]], attempt, sent)
        pending[stream] = (job, seg, attempt)

    def run(self, work: list[tuple[dict, dict]], k: int, done: list[str], label: str) -> None:
        """Run every (job, segment) of ``work``; ``k``: the segment's index (the rung it runs to, or the end)."""
        import ray

        pending: dict = {}  # each task's stream (see _array_task) -> (job, segment, attempt)
        bar = _Progress(self.sweep, [j for j, _ in work], done, label, self.show)
        try:
            for job, seg in work:
                self._submit(pending, job, seg, k, 1)
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                for stream in ready:
                    job, seg, attempt = pending[stream]
                    try:
                        item = ray.get(next(stream))
                    except StopIteration:  # (never: a stream ends with its result or an error)
                        item = {"error": "its task ended without a result"}
                    except Exception as e:  # the task raised, or its worker or node died
                        item = {"error": _one_line(e)}
                    if "event" in item:
                        bar.event(item["event"])
                        continue
                    del pending[stream]
                    if "error" in item:
                        why = item["error"]
                        if attempt <= self.spec.sections.retries:
                            log.warning("array %s failed (attempt %d: %s); running it again", job["id"], attempt,
                                        why)
                            bar.set(job["id"], "queued", attempt=attempt + 1)
                            self._submit(pending, job, seg, k, attempt + 1)
                        else:
                            log.error("array %s failed %d time(s), its trials have no result: %s", job["id"],
                                      attempt, why)
                            failed_result(self.sweep, job, attempt, why)
                            bar.set(job["id"], "failed", attempts=attempt, error=why)
                            self.failed.append(job["id"])
                        continue
                    rec = write_array_result(self.sweep, job, item["result"], attempt, self.params,
                                             None if seg["until"] is None else k)
                    bar.set(job["id"], "done", attempts=attempt, host=rec["host"], node=rec["node"],
                            elapsed_s=round(rec["elapsed_s"], 2))
                    if job["id"] not in self.ran:
                        self.ran.append(job["id"])
                bar.write()
        finally:
            bar.close()
            for stream in pending:
                ray.cancel(stream, force=True)


def _survivors(sweep: SweepDir, plan: dict, arrays: list[str], k: int) -> list[str]:
    """Rung k's decision: of the trials still training in ``arrays``, the best ``halving.keep`` by the plan's
    metric at the rung (diverged ones last, ties by trial id), at least one."""
    cands = []
    for aid in arrays:
        rec = sweep.read_json(sweep.segment_path(aid, k), "a segment record")
        for tid, t in rec["trials"].items():
            if t["status"] in ("finished", "diverged"):
                value = number(t.get(plan["metric"])) if t["status"] == "finished" else math.nan
                cands.append(rank_key(value, plan["direction"], tid))
    n = max(1, math.ceil(len(cands) * plan["halving"]["keep"]))
    return sorted(tid for *_, tid in sorted(cands)[:n])


def _next_arrays(spec: SweepSpec, plan: dict, arrays: list[dict], survivors: list[str], k: int) -> list[dict]:
    """The arrays that go on after rung k: each group's survivors, wherever they trained, re-fused into the
    fewest arrays of at most the group's B (``sources``: where each trial is, [array, place])."""
    from onnxfuse.sweep.planning import array_settings, array_sizes

    where = {tid: [a["id"], i] for a in arrays for i, tid in enumerate(a["trials"])}
    trials = {t["id"]: t for t in plan["trials"]}
    runtime = {tid: a["settings"].runtime for a in arrays for tid in a["trials"]}
    out = []
    for g in plan["groups"]:
        mine = [tid for tid in g["trials"] if tid in survivors]
        start = 0
        for n in array_sizes(len(mine), g["B"]) if mine else []:
            part = mine[start:start + n]
            start += n
            settings, data, eval_data = array_settings(spec, [trials[t] for t in part], runtime[part[0]])
            out.append({"id": f"r{k + 1}a{len(out):02d}", "group": g["group"], "trials": part, "settings": settings,
                        "data": data, "eval_data": eval_data, "per_model_inputs": list(spec.model.per_model_inputs),
                        "sources": {t: where[t] for t in part}})
    return out


def _recorded(arrays: list[dict], runtime: Mapping[str, str] | None = None) -> list[dict]:
    """The arrays of a recorded plan (plan.json, halving.json), each with the settings its worker trains: its
    record made a ``TrainConfig``, validated here where the sweep folder is read (``runtime``: a resumed sweep's
    ``--runtime``, by array id, over the record's)."""
    out = []
    for a in arrays:
        over = {"runtime": runtime[a["id"]]} if runtime and a["id"] in runtime else {}
        out.append({**a, "settings": TrainConfig.from_dict({**a["settings"], **over})})
    return out


def _execute(sweep: SweepDir, spec: SweepSpec, plan: dict, progress: bool) -> tuple[list[str], list[str]]:
    """Every array to the end: without halving, the plan's; with it, each rung's (see the module docstring)."""
    rungs = (plan.get("halving") or {}).get("steps", [])
    runner = _Runner(sweep, spec, plan, progress)
    decisions = sweep.read_json(sweep.halving_path, "halving.json") if os.path.exists(sweep.halving_path) else []
    decisions = [{**d, "arrays": _recorded(d["arrays"])} for d in decisions]
    arrays = plan["arrays"]
    for k in range(len(rungs) + 1):
        until = rungs[k] if k < len(rungs) else None
        # to run: no result, and at a rung no segment record either (a resumed sweep skips what is recorded)
        todo = [a for a in arrays if (sweep.result(a["id"]) or {}).get("state") != "done" and
                (until is None or not os.path.exists(sweep.segment_path(a["id"], k)))]
        if len(todo) < len(arrays):
            log.info("%d of %d arrays are done already; running %d", len(arrays) - len(todo), len(arrays), len(todo))
        label = "" if not rungs else f"rung {k + 1} of {len(rungs)}: to step {until}" if until else \
            "after the last rung"
        if todo:
            runner.run([(a, {"until": until}) for a in todo], k, [a["id"] for a in arrays if a not in todo], label)
        if until is None:
            break
        stopped = [a for a in arrays if os.path.exists(sweep.segment_path(a["id"], k))]
        if k >= len(decisions):  # (a resumed sweep keeps the decisions made before)
            survivors = _survivors(sweep, plan, [a["id"] for a in stopped], k)
            decisions.append({"step": until, "survivors": survivors,
                              "arrays": _next_arrays(spec, plan, stopped, survivors, k)})
            sweep.write_json(sweep.halving_path, decisions)
        d = decisions[k]
        log.info("rung %d (step %d): %d trials go on in %d arrays: %s", k + 1, until, len(d["survivors"]),
                 len(d["arrays"]), ", ".join(d["survivors"]))
        moved = {tid: a["id"] for a in d["arrays"] for tid in a["trials"]}
        for a in stopped:
            if (sweep.result(a["id"]) or {}).get("state") != "done":
                close_rung(sweep, a, k, moved)
        arrays = d["arrays"]
        if not arrays:
            break
    if not runner.failed:  # the rungs' folders: nothing needs them now
        for a in all_arrays(sweep, plan):
            for k in range(len(rungs)):
                if os.path.exists(sweep.state_path(a["id"], k)):
                    os.remove(sweep.state_path(a["id"], k))
    return runner.ran, runner.failed


def _ray_sizer(spec: SweepSpec, ray_up: threading.Event, stop: threading.Event) -> Sizer:
    """Array sizing for every group at once, each a Ray task with an array's resources (once Ray is
    up: the plan is made while it starts)."""
    import ray

    task = ray.remote(_sizing_task).options(num_cpus=spec.cpus, num_gpus=spec.gpus, max_retries=1)

    def size_of(groups: list[tuple[str, dict]]) -> list[tuple[int, str]]:
        while not ray_up.wait(0.1):
            if stop.is_set():
                raise PlanStopped("stopped before sizing the arrays")
        refs = []
        for model_path, settings in groups:
            with open(model_path, "rb") as f:
                refs.append(task.remote(f.read(), settings, spec.sections.arrays.max_size))
        log.info("sizing arrays: the planner trains each of %d group(s)' model at B = 1, 2, 4 on a worker",
                 len(groups))
        return ray.get(refs)

    return size_of


class _Beside:
    """``fn(stop)`` run in a thread beside the caller's (the plan, while Ray starts in the main thread: Ray's own
    processes die with the thread that started them). ``result()`` waits for it and raises what it raised;
    ``cancel()`` sets ``stop`` (``fn`` stops at its next check) and waits."""

    def __init__(self, fn):
        self.stop = threading.Event()
        self._out: tuple = (None, None)
        self._thread = threading.Thread(target=self._go, args=(fn,), name="onnxfuse-sweep-plan", daemon=True)
        self._thread.start()

    def _go(self, fn) -> None:
        try:
            self._out = (fn(self.stop), None)
        except BaseException as e:  # re-raised by result(), in the caller's thread
            self._out = (None, e)

    def result(self):
        self._thread.join()
        value, error = self._out
        if error is not None:
            raise error
        return value

    def cancel(self) -> None:
        self.stop.set()
        self._thread.join()


def _check_resources(spec: SweepSpec) -> None:
    """On a local Ray: an array asking for more CPUs or GPUs than the machine's Ray has would wait forever (Ray
    only warns that the task is infeasible)."""
    import ray

    have = ray.cluster_resources()
    for key, name, want in (("resources.cpus", "CPU", spec.cpus), ("resources.gpus", "GPU", spec.gpus)):
        n = have.get(name, 0.0)
        if want > n:
            where = "--cpus N, default: this machine's" if name == "CPU" else "the GPUs Ray finds on this machine"
            raise ConfigError(f"{spec.source}: {key} {want:g} is more than the {n:g} {name}s of the local Ray "
                              f"({where}), so no array could start; give {key} at most {n:g}, or run on a cluster "
                              "with --address")


def _record_stop(sweep: SweepDir, reason: str) -> None:
    """status.json as the driver left it: every array in its result's state, or ``stopped`` where it has none
    (none is left running or queued), and ``stopped``: why, when, how many arrays. Best effort: the space held
    back is freed first (a full disk), and a failure to write is logged, never raised over the error that stopped
    the sweep."""
    sweep.release_space()
    try:
        status = sweep.read_json(sweep.status_path, "status.json") if os.path.exists(sweep.status_path) else \
            {"arrays": {}}
        arrays = status.setdefault("arrays", {})
        for aid, s in arrays.items():
            res = sweep.result(aid)
            if res is not None and res.get("state") in ("done", "failed"):
                s["state"] = res["state"]
            elif s.get("state") not in ("done", "failed"):
                s["state"] = "stopped"
        states = [s["state"] for s in arrays.values()]
        status.update({k: states.count(k) for k in STATES})
        status["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
        status["stopped"] = {"error": reason, "at": status["updated"], "arrays": states.count("stopped")}
        sweep.write_json(sweep.status_path, status)
    except Exception as e:  # e.g. the disk is still full: the error line says so already
        log.info("could not record in %s why the sweep stopped: %s", sweep.status_path, _one_line(e))


@contextlib.contextmanager
def _stops_recorded(sweep: SweepDir) -> Iterator[None]:
    """Around a sweep that has a plan: what stops it is recorded in status.json (``_record_stop``); a failure the
    user fixes (a full disk, out of memory) is re-raised as one error saying to continue with --resume."""
    try:
        yield
    except BaseException as e:
        user = as_user_error(e) if isinstance(e, Exception) else None
        if isinstance(user, (OutputError, OutOfMemoryError)):
            user = type(user)(f"{user}; for a sweep that is `{shell('onnxfuse', 'sweep', '--resume', sweep.path)}`, "
                              "which trains only the arrays that have no result yet")
        reason = str(user) if user is not None else \
            "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {_one_line(e)}"
        _record_stop(sweep, " ".join(reason.split()))
        if user is not None and user is not e:
            raise user from e
        raise


def run_sweep(spec: str | os.PathLike | SweepSpec | None, out_dir: str | os.PathLike, *, resume: bool = False,
              address: str | None = None, runtime: str | None = None, num_cpus: int | None = None,
              progress: bool = True, trials: list[dict] | None = None,
              trial_ids: list[str] | None = None) -> SweepResult:
    """Run a sweep (see the module docstring) into ``out_dir``; with ``resume``, continue the sweep there (``spec``
    None: the folder's own). ``trials``: the trials' parameters ({space key: value} each) instead of the spec's
    search, ``trial_ids`` their ids (the Optuna helper passes the trials it asked for, numbered across its
    rounds). ``runtime`` overrides the spec's for the arrays still to run."""
    if num_cpus is not None and (isinstance(num_cpus, bool) or not isinstance(num_cpus, int) or num_cpus < 1):
        raise ConfigError(f"num_cpus={num_cpus!r}: a local Ray needs at least one CPU; give a count of 1 or more, "
                          "or None for this machine's")
    sweep = SweepDir(out_dir)
    if resume:
        if not sweep.is_sweep():
            raise InputFileError(f"--resume: '{sweep.path}' is not a sweep folder (no spec.json); start a sweep "
                                 f"with `{shell('onnxfuse', 'sweep', 'SPEC.yaml', '-o', sweep.path)}`")
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
        if trial_ids is not None and len(trial_ids) != len(params):
            raise ConfigError(f"{len(trial_ids)} trial ids for {len(params)} trials")
    created = not os.path.exists(sweep.path)
    try:
        return _run(sweep, spec, resume, address, runtime, num_cpus, progress, None if resume else params,
                    None if resume else trial_ids)
    except ArrayBusyError:  # another driver's folder now
        raise
    except BaseException:
        if not resume and not os.path.exists(sweep.plan_path):  # it failed before its plan: leave nothing
            for name in os.listdir(sweep.path) if os.path.isdir(sweep.path) else ():
                path = os.path.join(sweep.path, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            if created and os.path.isdir(sweep.path):
                os.rmdir(sweep.path)
        raise


def _plan(sweep: SweepDir, spec: SweepSpec, params: list[dict], ids: list[str] | None, runtime: str | None,
          progress: bool, ray_up: threading.Event, stop: threading.Event) -> dict:
    """The sweep's plan: exported, grouped and sized (``plan_sweep``); the caller writes it to plan.json. A full
    disk while exporting names the models folder when the error names no file."""
    try:
        sizer = _ray_sizer(spec, ray_up, stop) if spec.sections.arrays.size == "auto" else None
        return plan_sweep(spec, params, sweep, sizer, runtime, progress, stop=stop.is_set, ids=ids)
    except Exception as e:
        user = as_user_error(e, None if getattr(e, "filename", None) else sweep.models_path)
        if isinstance(user, OutputError) and user is not e:
            raise user from e
        raise


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def plan_line(plan: dict) -> str:
    """What a sweep says when it starts: how many trials, groups of identical graphs and arrays."""
    return (f"{_count(len(plan['trials']), 'trial')} in {_count(len(plan['groups']), 'group')} of identical graphs, "
            f"{_count(len(plan['arrays']), 'array')}")


def _run(sweep: SweepDir, spec: SweepSpec | None, resume: bool, address: str | None, runtime: str | None,
         num_cpus: int | None, progress: bool, params: list[dict] | None, ids: list[str] | None) -> SweepResult:
    with sweep.locked():
        gone = sweep.remove_temporaries()  # what a killed driver was writing
        if gone:
            log.info("removed %d half-written file(s) a killed driver left: %s", len(gone),
                     ", ".join(sweep.relative(p) for p in gone[:3]))
        if resume:
            saved = sweep.read_json(sweep.spec_path, "the sweep's spec")
            spec = parse_spec(saved["spec"], saved["source"], saved["base_dir"])
            params, ids = saved["params"], saved.get("trial_ids")
        else:
            sweep.write_json(sweep.spec_path, {"spec": spec.as_dict(), "source": spec.source,
                                               "base_dir": spec.base_dir, "params": params, "trial_ids": ids})
        sweep.reserve_space()
        ray_up = threading.Event()
        planner = None if os.path.exists(sweep.plan_path) else \
            _Beside(lambda stop: _plan(sweep, spec, params, ids, runtime, progress, ray_up, stop))
        started = False
        try:
            try:
                started = _connect(address, num_cpus)  # while the trials are exported and grouped
                if address is None:
                    _check_resources(spec)
                ray_up.set()
                plan = planner.result() if planner else sweep.read_json(sweep.plan_path, "the sweep's plan")
            except BaseException:
                if planner is not None:
                    planner.cancel()  # its exports stop (a no-op when it has ended)
                raise
            if planner is not None:
                sweep.write_json(sweep.plan_path, plan)
            else:  # the command's --runtime for the arrays not started: one past a rung goes on as it began
                plan["arrays"] = _recorded(plan["arrays"], {a["id"]: runtime for a in plan["arrays"] if runtime and
                                                            not os.path.exists(sweep.segment_path(a["id"], 0))})
            with _stops_recorded(sweep):
                if progress:
                    print(plan_line(plan), flush=True)
                ran, failed = _execute(sweep, spec, plan, progress)
                if started:  # the report needs no Ray
                    _shutdown()
                    started = False
                rows = collect(sweep, plan)
                write_report(sweep, plan, rows)
        finally:
            if started:
                _shutdown()
            sweep.release_space()
    return SweepResult(sweep.path, rows, len(plan["arrays"]), ran, failed, plan["metric"],
                       [t["id"] for t in plan["trials"]])

