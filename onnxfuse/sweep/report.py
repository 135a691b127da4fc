"""What a sweep leaves for its user: every trial's files (written as each array finishes) and, at the end,
``results.csv`` and ``report.md`` (every trial, best first by the spec's metric) and ``report.png`` (the best
trials' curves). TensorBoard event files are written with TensorBoard's own writer (``torch.utils.tensorboard``),
one run per trial: ``tensorboard --logdir SWEEP_DIR/trials``.
"""
from __future__ import annotations

import csv
import glob
import io
import logging
import math
import os
import shutil

from .layout import METRICS, TRIAL_ONNX, TRIAL_WEIGHTS, SweepDir
from .worker import RESULT_COLUMNS, TRIAL_METRICS, number, rank

__all__ = ["write_array_result", "close_rung", "failed_result", "collect", "write_report", "table", "all_arrays"]

log = logging.getLogger("onnxfuse.sweep")
_warned_tb = False


def _tensorboard(folder: str, rows: list[dict], hparams: dict) -> None:
    global _warned_tb
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if not _warned_tb:
            log.warning("no TensorBoard event files: install the tensorboard package (pip install "
                        "'onnxfuse[sweep]'); metrics.csv has every curve")
            _warned_tb = True
        return
    for old in glob.glob(os.path.join(folder, "events.out.tfevents.*")):  # an earlier attempt's
        os.remove(old)
    w = SummaryWriter(log_dir=folder)
    try:
        for r in rows:
            step = int(r["step"])
            for col in ("loss", "accuracy", "lr"):
                v = number(r.get(col, ""))
                if math.isfinite(v):
                    w.add_scalar(f"{r['split']}/{col}", v, step)
        w.add_text("hyper-parameters", "  \n".join(f"{k} = {v}" for k, v in hparams.items()))
    finally:
        w.close()


def _record(job: dict, out: dict, attempts: int) -> dict:
    return {"array": job["id"], "state": "done", "attempts": attempts,
            **{k: out[k] for k in ("host", "node", "pid", "steps", "elapsed_s", "stopped")},
            "trials": {tid: {k: t[k] for k in RESULT_COLUMNS} for tid, t in out["trials"].items()}}


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
        from .._io import atomic_write_bytes

        atomic_write_bytes(sweep.state_path(job["id"], segment), out["state"])
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
        folder = sweep.trial_path(tid)
        if os.path.isdir(folder):  # an earlier attempt's, from a driver killed while writing
            shutil.rmtree(folder)
        os.makedirs(folder)
        for name, data in t["files"].items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        with open(sweep.trial_file(tid, METRICS), "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, TRIAL_METRICS)
            w.writeheader()
            w.writerows(t["metrics"])
        _tensorboard(folder, t["metrics"], params[tid])
    os.makedirs(sweep.array_path(job["id"]), exist_ok=True)
    with open(sweep.array_metrics_path(job["id"]), "w", encoding="utf-8") as f:
        f.write(out["metrics_csv"])


def failed_result(sweep: SweepDir, job: dict, attempts: int, error: str) -> dict:
    record = {"array": job["id"], "state": "failed", "attempts": attempts, "error": error,
              "trials": {tid: {"status": "failed"} for tid in job["trials"]}}
    sweep.write_json(sweep.result_path(job["id"]), record)
    return record


def all_arrays(sweep: SweepDir, plan: dict) -> list[dict]:
    """The plan's arrays, then those successive halving formed at each rung (halving.json), in order."""
    rungs = sweep.read_json(sweep.halving_path, "halving.json") if os.path.exists(sweep.halving_path) else []
    return plan["arrays"] + [a for d in rungs for a in d["arrays"]]


def collect(sweep: SweepDir, plan: dict) -> list[dict]:
    """One row per trial, from the last array it trained in; best first by the plan's metric, trials without a
    finite metric last, in id order."""
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
    rows = []
    for tid, (a, res, t) in last.items():
        done = res["state"] == "done"
        rows.append({"trial": tid, "array": a["id"], **{k: trials[tid]["params"].get(k, "") for k in keys},
                     "status": t["status"], metric: t.get(metric, math.nan),
                     **{k: t.get(k, math.nan) for k in RESULT_COLUMNS[1:] if k != metric},
                     "checkpoint": sweep.relative(sweep.trial_file(tid, TRIAL_WEIGHTS)) if done else "",
                     "onnx": sweep.relative(sweep.trial_file(tid, TRIAL_ONNX)) if done else "",
                     "node": (res.get("node") or "")[:8], "host": res.get("host", ""),
                     "attempts": res.get("attempts", 0), "error": res.get("error", "")})

    return sorted(rows, key=lambda r: rank(number(r[metric]), plan["direction"], r["trial"]))


def _fmt(v) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return str(v)


def table(rows: list[dict], limit: int | None = None) -> str:
    """A plain-text table of the rows (the first ``limit``)."""
    if not rows:
        return "(no trials)"
    cols = [c for c in rows[0] if c not in ("checkpoint", "onnx", "error", "host")]
    shown = rows[:limit] if limit else rows
    cells = [[_fmt(r[c]) for c in cols] for r in shown]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in cells]
    if limit and len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more in results.csv")
    return "\n".join(lines)


def _curves(sweep: SweepDir, tid: str, split: str) -> tuple[list[int], list[float]]:
    path = sweep.trial_file(tid, METRICS)
    if not os.path.exists(path):
        return [], []
    with open(path, encoding="utf-8") as f:
        pts = [(int(r["step"]), number(r["loss"])) for r in csv.DictReader(f) if r["split"] == split]
    pts = [(s, v) for s, v in pts if math.isfinite(v)]
    return [s for s, _ in pts], [v for _, v in pts]


def write_report(sweep: SweepDir, plan: dict, rows: list[dict], best: int = 5) -> None:
    """results.csv, report.md and report.png (the ``best`` trials' training and eval loss curves)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, list(rows[0]) if rows else ["trial"])
    w.writeheader()
    w.writerows({k: _fmt(v) for k, v in r.items()} for r in rows)
    from .._io import atomic_write_bytes

    atomic_write_bytes(sweep.results_path, buf.getvalue().encode())
    done = sum(r["status"] != "failed" and r["status"] != "not run" for r in rows)
    md = [f"# Sweep report: {len(rows)} trials in {len(plan['arrays'])} arrays",
          "", f"Sorted by {plan['metric']} ({plan['direction']}); {done} trials have results.", "",
          "```", table(rows), "```", ""]
    atomic_write_bytes(sweep.report_md_path, "\n".join(md).encode())
    top = [r["trial"] for r in rows[:best] if r["status"] not in ("failed", "not run")]
    trials = {t["id"]: t for t in plan["trials"]}
    if not top:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for tid in top:
        params = trials[tid]["params"]
        label = f"{tid} " + ", ".join(f"{k}={_fmt(v)}" for k, v in params.items())
        for ax, split in zip(axes, ("train", "eval")):
            x, y = _curves(sweep, tid, split)
            if x:
                ax.plot(x, y, marker="o" if split == "eval" and len(x) < 30 else None, ms=3, label=label)
    for ax, split in zip(axes, ("train", "eval")):
        ax.set_title(f"{split} loss, best {len(top)} by {plan['metric']}")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    tmp = sweep.report_png_path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, sweep.report_png_path)
