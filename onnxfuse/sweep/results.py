"""What a sweep leaves for its user: every trial's files (written as each array finishes) and, at the end,
``results.csv`` and ``report.md`` (every trial, best first by ``trial_score``: its best state's metric when the
sweep keeps them, else its final one) and ``report.png`` (the metric against each searched hyper-parameter, and the
trials' curves). TensorBoard event files are TensorBoard's own records (its ``RecordWriter`` and ``Event`` protos,
torch's ``scalar`` summaries, the HParams plugin's session protos), one run per trial named by its parameters
(``t003/lr=0.01,seed=1``), so that the HParams dashboard lists every trial with its parameters and metrics:
``tensorboard --logdir SWEEP_DIR/trials``.

Every file is written whole or not at all (``SweepDir.write_bytes``; a trial's folder as one temporary folder
renamed into place, ``SweepDir.replacing``), and a write that fails (a full disk) names the file.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import re
import socket
import time

from onnxfuse.core.errors import as_user_error
from onnxfuse.recipe.ranking import rank_key, ranked_state, score
from onnxfuse.sweep.folder import METRICS, TRIAL_FILES, TRIAL_WEIGHTS, SweepDir
from onnxfuse.sweep.worker import RESULT_COLUMNS, TRIAL_METRICS, number

__all__ = ["write_array_result", "close_rung", "failed_result", "collect", "best_first", "trial_score",
           "write_report", "table", "all_arrays", "run_name"]

log = logging.getLogger("onnxfuse.sweep")
_warned_tb = False


def _tensorboard(rows: list[dict], params: dict, status: str, best: dict | None) -> tuple[str, bytes] | None:
    """A trial's TensorBoard event file, (its name, its bytes) as TensorBoard's SummaryWriter names and writes
    one; None without the tensorboard package. Its curves (``train/loss``, ``eval/loss``, ...), its kept best
    state's value (``best/<metric>``) and, for the HParams plugin, the session of the trial: its parameters
    (``params``, the search-space keys) and how it ended. Made in memory, so that it is written whole like every
    other file (SummaryWriter's background thread would leave a half-written file on a full disk, and report the
    error on stderr)."""
    global _warned_tb
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter
        from torch.utils.tensorboard.summary import scalar
    except ImportError:
        if not _warned_tb:
            log.warning("no TensorBoard event files: install the tensorboard package (pip install "
                        "'onnxfuse[sweep]'); metrics.csv has every curve")
            _warned_tb = True
        return None
    buf = io.BytesIO()
    w, now = RecordWriter(buf), time.time()

    def hparams(tag: str, **data) -> None:
        meta = metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(**data))
        w.write(Event(wall_time=now, summary=Summary(value=[Summary.Value(tag=tag, metadata=meta)]))
                .SerializeToString())

    w.write(Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
    start = plugin_data_pb2.SessionStartInfo(start_time_secs=now)
    for k, v in params.items():
        if isinstance(v, bool):
            start.hparams[k].bool_value = v
        elif isinstance(v, (int, float)):
            start.hparams[k].number_value = v
        else:
            start.hparams[k].string_value = v if isinstance(v, str) else json.dumps(v)
    hparams(metadata.SESSION_START_INFO_TAG, session_start_info=start)
    for r in rows:
        step = int(r["step"])
        for col in ("loss", "accuracy", "lr"):
            v = number(r.get(col, ""))
            if math.isfinite(v):
                w.write(Event(wall_time=now, step=step, summary=scalar(f"{r['split']}/{col}", v)).SerializeToString())
    if best:
        w.write(Event(wall_time=now, step=best["step"], summary=scalar(f"best/{best['metric']}", best["value"]))
                .SerializeToString())
    ended = api_pb2.STATUS_FAILURE if status in ("diverged", "failed") else api_pb2.STATUS_SUCCESS
    hparams(metadata.SESSION_END_INFO_TAG, session_end_info=plugin_data_pb2.SessionEndInfo(status=ended,
                                                                                          end_time_secs=now))
    events = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.0"
    return f"{run_name(params)}/{events}", buf.getvalue()


def run_name(params: dict) -> str:
    """A trial's TensorBoard run, under its folder (``t003/lr=0.01,hidden=32,seed=1``): its parameters, each named
    by the last part of its key where that is unique (``optimizer.lr`` -> ``lr``)."""
    short = {k: k.rpartition(".")[2] for k in params}
    named = [(short[k] if list(short.values()).count(short[k]) == 1 else k, v) for k, v in params.items()]
    text = ",".join(f"{k}={_fmt(float(v)) if isinstance(v, float) else v}" for k, v in named) or "run"
    return re.sub(r"[/\\\x00-\x1f]", "_", text).lstrip(".")[:200]


def _record(job: dict, out: dict, attempts: int) -> dict:
    return {"array": job["id"], "state": "done", "attempts": attempts,
            **{k: out.get(k) for k in ("host", "node", "pid", "steps", "elapsed_s", "started_at", "first_step_at",
                                 "stopped")},
            "trials": {tid: {k: t.get(k) for k in RESULT_COLUMNS + ("best",)} for tid, t in out["trials"].items()}}


def write_array_result(sweep: SweepDir, job: dict, out: dict, attempts: int, params: dict[str, dict],
                       segment: int | None = None) -> dict:
    """Write an array's trials (weights, metrics, event files) and its metrics as they are now, then its
    result.json (last: its presence marks the array done); with ``segment`` k (successive halving), its folder as
    ``state_<k>.tar`` and ``segment_<k>.json`` instead: the array stopped at rung k. Returns the record."""
    _write_trials(sweep, job, out, params)
    record = _record(job, out, attempts)
    if segment is None:
        sweep.write_json(sweep.result_path(job["id"]), record)
    else:
        sweep.write_bytes(sweep.state_path(job["id"], segment), out["state"])
        sweep.write_json(sweep.segment_path(job["id"], segment), record)
    return record


def close_rung(sweep: SweepDir, job: dict, segment: int, moved: dict[str, str]) -> dict:
    """An array at rung ``segment``, decided: its result is its record there, each trial either gone on
    (``continued``, ``to`` the array ``moved`` names) or stopped there."""
    record = sweep.read_json(sweep.segment_path(job["id"], segment), "a segment record")
    for tid, t in record["trials"].items():
        if tid in moved:
            t.update(status="continued", to=moved[tid])
        elif t["status"] == "finished":
            t["status"] = "stopped"
    sweep.write_json(sweep.result_path(job["id"]), record)
    return record


def _read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _write_trials(sweep: SweepDir, job: dict, out: dict, params: dict[str, dict]) -> None:
    for tid, t in out["trials"].items():
        if job.get("sources"):  # it went on from a rung: its curve so far comes first
            first = min((int(r["step"]) for r in t["metrics"]), default=math.inf)
            t["metrics"] = [r for r in _read_rows(sweep.trial_file(tid, METRICS)) if int(r["step"]) < first] + \
                t["metrics"]
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, TRIAL_METRICS)
        w.writeheader()
        w.writerows(t["metrics"])
        files = {**t["files"], METRICS: buf.getvalue().encode()}
        events = _tensorboard(t["metrics"], params[tid], t["status"], t.get("best"))
        if events:
            files[events[0]] = events[1]
        # the trial's folder whole, or as it was (an earlier attempt's, or none)
        with sweep.replacing(sweep.trial_path(tid)) as tmp:
            for name, data in files.items():
                _write_new(os.path.join(tmp, name), data, sweep.trial_file(tid, name))
    sweep.write_bytes(sweep.array_metrics_path(job["id"]), out["metrics_csv"].encode())


def _write_new(path: str, data: bytes, shown: str) -> None:
    """A file of a folder being built (renamed into place when it is complete); a failure names ``shown``, the
    file's name in its final place."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)  # a TensorBoard run's folder
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise (as_user_error(e, shown) or e) from e


def failed_result(sweep: SweepDir, job: dict, attempts: int, error: str) -> dict:
    record = {"array": job["id"], "state": "failed", "attempts": attempts, "error": error,
              "trials": {tid: {"status": "failed"} for tid in job["trials"]}}
    sweep.write_json(sweep.result_path(job["id"]), record)
    return record


def all_arrays(sweep: SweepDir, plan: dict) -> list[dict]:
    """The plan's arrays, then those successive halving formed at each rung (halving.json), in order."""
    rungs = sweep.read_json(sweep.halving_path, "halving.json") if os.path.exists(sweep.halving_path) else []
    return plan["arrays"] + [a for d in rungs for a in d["arrays"]]


def trial_score(row: dict, metric: str) -> float:
    """The value a trial (a row of :func:`collect`) is ranked by, and Optuna is told: ``ranking.score`` of its
    final value of ``metric`` and its kept best state's (``best_<metric>``, when the sweep keeps them)."""
    return score(number(row[metric]), number(row.get(f"best_{metric}")))


def collect(sweep: SweepDir, plan: dict) -> list[dict]:
    """One row per trial, from the last array it trained in: its parameters, status, the final value of the
    plan's metric and, when the sweep keeps best states, its best state's value and step
    (``best_<metric>``, ``best_step``), its other final metrics and its files: ``checkpoint`` and ``onnx`` are
    the state it is ranked by (``ranking.ranked_state``: ``state``, its best one when kept, whose value
    :func:`trial_score` is), and when the sweep keeps best states ``final_checkpoint`` the final state's weights
    (whose value is the ``<metric>`` column); best first by :func:`trial_score`, trials without a finite one
    last, in id order."""
    metric = plan["metric"]
    keys = list(dict.fromkeys(k for t in plan["trials"] for k in t["params"]))
    trials = {t["id"]: t for t in plan["trials"]}
    last: dict[str, tuple] = {}  # trial -> (array, its result, the trial's entry there)
    for a in all_arrays(sweep, plan):
        res = sweep.result(a["id"]) or {"state": "not run", "trials": {}}
        for tid in a["trials"]:
            t = res["trials"].get(tid, {"status": res["state"]})
            if t["status"] != "continued":
                last[tid] = (a, res, t)
    kept = any(t.get("best") for _, _, t in last.values())
    rows = []
    for tid, (a, res, t) in last.items():
        done, best = res["state"] == "done", t.get("best") or {}
        state = ranked_state(best.get("value"))
        onnx, weights = TRIAL_FILES[state]

        def file(name: str) -> str:
            return sweep.relative(sweep.trial_file(tid, name)) if done else ""

        rows.append({"trial": tid, "array": a["id"], **{k: trials[tid]["params"].get(k, "") for k in keys},
                     "status": t["status"], metric: t.get(metric, math.nan),
                     **({f"best_{metric}": best.get("value", math.nan), "best_step": best.get("step", "")}
                        if kept else {}),
                     **{k: t.get(k, math.nan) for k in RESULT_COLUMNS[1:] if k != metric},
                     **({"state": state if done else ""} if kept else {}),
                     "checkpoint": file(weights), "onnx": file(onnx),
                     **({"final_checkpoint": file(TRIAL_WEIGHTS)} if kept else {}),
                     "node": (res.get("node") or "")[:8], "host": res.get("host", ""),
                     "attempts": res.get("attempts", 0), "error": res.get("error", "")})

    return best_first(rows, metric, plan["direction"])


def best_first(rows: list[dict], metric: str, direction: str) -> list[dict]:
    """Rows of :func:`collect` (of one sweep or several: an Optuna study's rounds) best first by
    :func:`trial_score`, trials without a finite one last, in id order."""
    return sorted(rows, key=lambda r: rank_key(trial_score(r, metric), direction, r["trial"]))


def _fmt(v) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return str(v)


def table(rows: list[dict], limit: int | None = None) -> str:
    """A plain-text table of the rows (the first ``limit``)."""
    if not rows:
        return "(no trials)"
    cols = [c for c in rows[0] if c not in ("state", "checkpoint", "onnx", "final_checkpoint", "error", "host")]
    shown = rows[:limit] if limit else rows
    cells = [[_fmt(r[c]) for c in cols] for r in shown]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in cells]
    if limit and len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more in results.csv")
    return "\n".join(lines)


def _ranked_by(rows: list[dict], metric: str) -> str:
    if rows and f"best_{metric}" in rows[0]:
        return (f"best_{metric}, each trial's best state's (kept at best_step), or its final {metric} without one; "
                f"results.csv's checkpoint and onnx columns are that state's files (state: best or final), "
                f"final_checkpoint the final state's")
    return metric


def write_report(sweep: SweepDir, plan: dict, rows: list[dict]) -> None:
    """results.csv, report.md and report.png (``_report_plot``: the metric against each searched hyper-parameter,
    and the curves of every trial up to its limit, best first)."""
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, list(rows[0]) if rows else ["trial"])
    w.writeheader()
    w.writerows({k: _fmt(v) for k, v in r.items()} for r in rows)
    sweep.write_bytes(sweep.results_path, buf.getvalue().encode())
    done = sum(r["status"] != "failed" and r["status"] != "not run" for r in rows)
    md = [f"# Sweep report: {len(rows)} trials in {len(plan['arrays'])} arrays",
          "", f"Sorted by {_ranked_by(rows, plan['metric'])} ({plan['direction']}); {done} trials have results.",
          "",
          "```", table(rows), "```", ""]
    sweep.write_bytes(sweep.report_md_path, "\n".join(md).encode())
    from onnxfuse.sweep._report_plot import report_png

    png = report_png(sweep, plan, rows, {r["trial"]: trial_score(r, plan["metric"]) for r in rows})
    if png is not None:
        sweep.write_bytes(sweep.report_png_path, png)
