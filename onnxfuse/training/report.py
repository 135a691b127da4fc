"""`onnxfuse report`: a summary, a plot and a JSON file from an array's ``metrics.csv``.

``metrics.csv`` has one row per model per logged training step and per evaluation::

    step,model,split,loss,accuracy,lr,elapsed_s,status

``split`` is ``train`` or ``eval``; ``accuracy`` is empty for train rows and regression losses; ``status`` is empty,
``diverged`` (the model's loss or update became non-finite at that step; it is frozen from then on) or ``dropped``
(removed by successive halving at that step). The older header ``step,model,loss,lr,elapsed_s`` is read too: a
missing column means train rows without accuracy or status.

:func:`make_report` writes ``ARRAY_DIR/report.png`` (a panel per series the run logged: train loss, smoothed over
its raw values drawn faint; eval loss; eval accuracy in percent, as the table prints it, on a logit axis once it
passes 90 % so that models that all learn are told apart; diverged / dropped models marked where it happened; each
model's kept best state marked on the eval panels at its step, a ring, the best model's a star, and the best
model's curves drawn thicker; the legend below the panels names each model by the hyper-parameters that differ
between the models, and says which is best and by what) and ``ARRAY_DIR/report.json`` (the summary plus, per
panel, the curves plotted and the kept best states marked), and returns the same summary.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from onnxfuse.core._io import atomic_file, claim_output
from onnxfuse.core.array import ArrayDir
from onnxfuse.core.errors import ConfigError, InputFileError, shell
from onnxfuse.core.records import METRICS_HEADER, MetricsRow, read_metrics_rows
from onnxfuse.recipe.ranking import best_of, default_metric, ranked_state, score

__all__ = ["METRICS_COLUMNS", "read_metrics", "summarize", "summarize_array", "make_report", "report_figure",
           "format_table"]

METRICS_COLUMNS = tuple(METRICS_HEADER)  # the columns, declared with the row (onnxfuse/core/records.py)
MARKERS = {"diverged": "x", "dropped": "v"}  # other statuses get "o"


@dataclass
class ModelLog:
    """One model's rows, in file order: (step, value) pairs per series, and its status events."""

    model: int
    train_loss: list[tuple[int, float]] = field(default_factory=list)
    eval_loss: list[tuple[int, float]] = field(default_factory=list)
    eval_accuracy: list[tuple[int, float]] = field(default_factory=list)
    lr: list[tuple[int, float]] = field(default_factory=list)
    events: list[tuple[str, int]] = field(default_factory=list)  # (status, first step it appeared)


# ---------------------------------------------------------------- reading
def _open_metrics(array_dir: str) -> str:
    ArrayDir(array_dir).check_exists()
    path = ArrayDir(array_dir).metrics_path
    if not os.path.isfile(path):
        raise InputFileError(f"'{path}' is missing; train the array first with `{shell('onnxfuse', 'train', array_dir)} ...`")
    return path


def read_metrics(path: str, B: int | None = None) -> dict[int, ModelLog]:
    """Parse a metrics.csv (either header) into one :class:`ModelLog` per model id, sorted by id; every row is
    checked (``records.read_metrics_rows``; ``B``: the array's, for the model indices), a bad one is one
    InputFileError naming the file and the line."""
    _, rows = read_metrics_rows(path, B, "re-run `onnxfuse train`")
    logs: dict[int, ModelLog] = {}
    for _, _, row in rows:
        _add_row(row, logs)
    if not logs:
        raise InputFileError(f"'{path}' has no rows; train for at least one logged step")
    return dict(sorted(logs.items()))


def _add_row(row: MetricsRow, logs: dict[int, ModelLog]) -> None:
    step = row.step
    log = logs.setdefault(row.model, ModelLog(row.model))
    loss = math.nan if row.loss is None else row.loss
    if row.split == "train":
        log.train_loss.append((step, loss))
        if row.lr is not None:
            log.lr.append((step, row.lr))
    else:
        log.eval_loss.append((step, loss))
        if row.accuracy is not None:
            log.eval_accuracy.append((step, row.accuracy))
    status = row.status
    if status and status not in {s for s, _ in log.events}:
        log.events.append((status, step))


# ---------------------------------------------------------------- summary
def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _best(series: list[tuple[int, float]], pick) -> tuple[float | None, int | None]:
    finite = [(v, s) for s, v in series if math.isfinite(v)]
    if not finite:
        return None, None
    v, s = pick(finite, key=lambda t: t[0])
    return v, s


def _model_summary(log: ModelLog) -> dict:
    finite_train = [(s, v) for s, v in log.train_loss if math.isfinite(v)]
    best_loss, best_loss_step = _best(log.eval_loss, min)
    best_acc, best_acc_step = _best(log.eval_accuracy, max)
    status, status_step = log.events[0] if log.events else ("ok", None)
    return {
        "model": log.model,
        "lr": max(v for _, v in log.lr) if log.lr else None,  # the peak: a warm-up starts far below it
        "final_lr": log.lr[-1][1] if log.lr else None,
        "last_train_loss": finite_train[-1][1] if finite_train else None,
        "last_train_step": finite_train[-1][0] if finite_train else None,
        "best_eval_loss": best_loss,
        "best_eval_loss_step": best_loss_step,
        "last_eval_loss": _finite(log.eval_loss[-1][1]) if log.eval_loss else None,
        "best_eval_accuracy": best_acc,
        "best_eval_accuracy_step": best_acc_step,
        "last_eval_accuracy": _finite(log.eval_accuracy[-1][1]) if log.eval_accuracy else None,
        "status": status,
        "status_step": status_step,
        "events": [{"status": s, "step": st} for s, st in log.events],
    }


FINAL = {"eval_loss": "last_eval_loss", "eval_accuracy": "last_eval_accuracy", "train_loss": "last_train_loss"}


def summarize(logs: dict[int, ModelLog], kept: dict | None = None, differing: dict[str, list] | None = None
              ) -> dict:
    """The per-model summary of parsed metrics (JSON-ready: non-finite values are None), each model ranked by
    ``ranking.score``: by the metric the run kept best states by (``kept``: trained/'s record, see
    ``ArrayDir.kept_best``) and the value of its kept best state, else by eval loss (train loss without
    evaluations) and its final value; its ``state`` says which (best or final: ``split --which`` writes it).
    ``differing``: the per-model settings that differ between the models, one value per original model
    (``RunSettings.differing``), shown per model as ``hparams``."""
    models = [_model_summary(log) for log in logs.values()]
    metric = kept["metric"] if kept else default_metric(any(log.eval_loss for log in logs.values()))
    scores = {}
    for m in models:
        entry = (kept or {}).get("models", {}).get(str(m["model"]))
        m["hparams"] = {k: v[m["model"]] for k, v in (differing or {}).items() if m["model"] < len(v)}
        m["kept_best"] = {"step": entry["step"], "value": entry["value"]} if entry else None
        final, best = m[FINAL[metric]], entry["value"] if entry else None
        scores[m["model"]] = score(math.nan if final is None else final, best)
        m["score"] = _finite(scores[m["model"]])
        m["state"] = ranked_state(best)  # the state of the score: what `split --which` writes for it
    steps = [s for log in logs.values() for s, _ in log.train_loss + log.eval_loss]
    return {"B": len(models), "last_step": max(steps) if steps else None, "best_model": best_of(scores, metric),
            "ranked_by": {"metric": metric, "state": "best" if kept else "final"},
            "hparams": sorted(differing or {}), "models": models}


def summarize_array(array_dir: str | os.PathLike) -> dict:
    """:func:`summarize` of an array's current run: its metrics.csv, the best states trained/ kept and the
    per-model settings it recorded (what ``train``'s final table and ``report`` print)."""
    array = ArrayDir(os.fspath(array_dir))
    return {**summarize(read_metrics(_open_metrics(array.path), array.known_B()), *_recorded(array)),
            "precision": _precision(array)}


def _precision(array: ArrayDir) -> str:
    """The precision the current run's losses and accuracies were measured in (``--precision``: bf16 / fp16 under
    autocast, as it trained), from its settings in run.json or, where run.json holds none, trained/'s record; fp32
    for a run from before either recorded it."""
    config = (array.read_run() or {}).get("config")
    if config is None and os.path.exists(array.train_state_path):
        try:
            with open(array.train_state_path) as f:
                config = json.load(f).get("config")
        except (OSError, ValueError, AttributeError) as e:
            raise InputFileError(f"'{array.train_state_path}' is not readable ({type(e).__name__}); train again") \
                from e
    return (config or {}).get("precision") or "fp32"


def _recorded(array: ArrayDir) -> tuple[dict | None, dict[str, list] | None]:
    """What the current run recorded beside its metrics: the best states trained/ kept, and the per-model
    settings that differ between its models (run.json's; None for a run from before they were recorded)."""
    return array.kept_best(), (array.read_run() or {}).get("differing")


# ---------------------------------------------------------------- plot
# (name, panel title, y label, log scale allowed, y scale factor): accuracy drawn in percent, as the table prints it
PANELS = (("train_loss", "train loss", "loss", True, 1.0), ("eval_loss", "eval loss", "loss", True, 1.0),
          ("eval_accuracy", "eval accuracy", "accuracy (%)", False, 100.0))
MARKER_NAMES = {"diverged": "diverged (frozen from here)", "dropped": "dropped by halving"}


def _colors(B: int) -> list:
    from matplotlib import colormaps

    if B <= 10:
        return [colormaps["tab10"](b) for b in range(B)]
    if B <= 20:
        return [colormaps["tab20"](b) for b in range(B)]
    return [colormaps["viridis"](b / (B - 1)) for b in range(B)]


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_value(x) for x in v) + ")"
    return "off" if v is None else str(v)


def _labels(logs: dict[int, ModelLog], summaries: dict[int, dict]) -> dict[int, str]:
    """Each model's legend entry: its id and the per-model settings that differ between the models, as the
    summary holds them (``hparams``: "3: lr 0.03, momentum 0.9"); without a record of the settings, the peak lr
    of metrics.csv when it differs; the id alone when nothing differs."""
    models = list(logs)
    differ = {m: dict(summaries[m].get("hparams") or {}) for m in models}
    if not any(differ.values()):
        lrs = {m: summaries[m]["lr"] for m in models}
        if len({v for v in lrs.values()}) > 1:
            differ = {m: {"lr": lrs[m]} if lrs[m] is not None else {} for m in models}
    return {m: f"{m}: " + ", ".join(f"{k} {_value(v)}" for k, v in differ[m].items()) if differ[m] else f"model {m}"
            for m in models}


def _marker_at(series: list[tuple[int, float]], step: int) -> tuple[int, float] | None:
    """Where the marker of an event at ``step`` goes: at that step, at the height of the last finite value at or
    before it (the loss at a divergence itself is not finite)."""
    before = [v for s, v in series if s <= step and math.isfinite(v)]
    return (step, before[-1]) if before else None


def _draw_panel(ax, panel: tuple, logs: dict[int, ModelLog], labels: dict[int, str], colors: dict,
                best_model: int | None, kept: dict[int, int]) -> dict:
    """Draw one series of every model on ``ax``: a curve with many points as its smoothed trend over the raw
    values drawn faint; the best model's (``best_model``) thicker and on top; on an eval panel, each model's kept
    best state (``kept``: model -> its step) marked where it was evaluated (a ring; the best model's a star).
    Return the panel's record for report.json."""
    from onnxfuse.core._plot import accuracy_axis, log_ticks, smoothed

    name, title, ylabel, allow_log, scale = panel
    series_of = {m: [(s, v * scale) for s, v in getattr(log, name) if math.isfinite(v)] for m, log in logs.items()}
    values = [v for pts in series_of.values() for _, v in pts]
    log = allow_log and bool(values) and min(values) > 0
    curves, markers, best_marks, smooth_any = [], [], [], False
    for model, points in series_of.items():
        if not points:
            continue
        xs, ys = zip(*points)
        top = model == best_model
        z = 3 if top else 2
        smooth = len(points) > 15  # a few evaluations are drawn as they are, with a dot each
        if smooth:
            ax.plot(xs, ys, color=colors[model], linewidth=0.8, alpha=0.25, zorder=z)
            ax.plot(xs, smoothed(ys, log=log), color=colors[model], linewidth=2.6 if top else 1.6, zorder=z)
        else:
            ax.plot(xs, ys, color=colors[model], linewidth=2.6 if top else 1.4, marker=".", zorder=z)
        smooth_any |= smooth
        curves.append({"label": labels[model], "model": model, "points": len(points), "smoothed": smooth})
        for status, step in logs[model].events:
            at = _marker_at(points, step)
            if at is None:
                continue
            ax.plot([at[0]], [at[1]], linestyle="none", marker=MARKERS.get(status, "o"), markersize=9,
                    markeredgewidth=2, color=colors[model], markerfacecolor="none" if status == "dropped" else None)
            markers.append({"model": model, "status": status, "step": step, "at": [at[0], at[1] / scale]})
        at = dict(points).get(kept.get(model)) if name.startswith("eval") else None
        if at is not None:  # evaluated at the step its best state was kept at
            ax.plot([kept[model]], [at], linestyle="none", zorder=4, **_best_marker(colors[model], top))
            best_marks.append({"model": model, "step": kept[model], "at": at / scale})
    yscale = "log" if log else "linear"
    ax.set_yscale(yscale)
    if log:
        log_ticks(ax, values)
    elif name == "eval_accuracy":
        yscale = accuracy_axis(ax, values)
    ax.set_title(title + (" (smoothed; raw values faint)" if smooth_any else ""), fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel + (" (logit scale)" if yscale == "logit" else ""))
    ax.grid(True, alpha=0.3)
    return {"name": name, "title": title, "yscale": yscale, "curves": curves, "markers": markers,
            "kept_best": best_marks}


def _best_marker(color, top: bool) -> dict:
    """How a kept best state is marked: a ring in the model's colour; the best model's, a star."""
    if top:
        return {"marker": "*", "markersize": 15, "markerfacecolor": color, "markeredgecolor": "black",
                "markeredgewidth": 0.8}
    return {"marker": "o", "markersize": 9, "markerfacecolor": "none", "markeredgecolor": color,
            "markeredgewidth": 1.8}


def _plot(logs: dict[int, ModelLog], summary: dict, out_png: str) -> list[dict]:
    """Write the report figure (:func:`report_figure`) to ``out_png``; return its panel records."""
    from onnxfuse.core._plot import save

    fig, records = report_figure(logs, summary)
    save(fig, out_png, dpi=110)
    return records


def report_figure(logs: dict[int, ModelLog], summary: dict):
    """The report figure of :func:`read_metrics`' logs and their summary: a panel per series that has values
    (train loss, eval loss, eval accuracy in %), the legend below them naming each model by the per-model settings
    that differ between the models, the summary's ``note`` under it. Returns (the matplotlib Figure, the panel
    records)."""
    from matplotlib.lines import Line2D

    from onnxfuse.core._plot import figure, legend_below

    summaries = {m["model"]: m for m in summary["models"]}
    labels = _labels(logs, summaries)
    colors = dict(zip(logs, _colors(len(logs))))
    best_model = summary.get("best_model")
    kept = {m["model"]: m["kept_best"]["step"] for m in summary["models"] if m.get("kept_best")}
    panels = [p for p in PANELS if any(math.isfinite(v) for log in logs.values() for _, v in getattr(log, p[0]))]
    panels = panels or PANELS[:1]
    fig = figure(max(6.4, 4.6 * len(panels) + 0.4), 3.4)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    records = [_draw_panel(ax, panel, logs, labels, colors, best_model, kept) for ax, panel in zip(axes, panels)]
    for ax, rec in zip(axes, records):
        if not rec["curves"]:
            ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes, color="gray")
    handles = [Line2D([], [], color=colors[m], linewidth=2.6 if m == best_model else 2) for m in logs]
    ranked = summary["ranked_by"]
    names = [labels[m] + (f" (best by {'its best' if ranked['state'] == 'best' else 'its final'} "
                          f"{ranked['metric'].replace('_', ' ')})" if m == best_model else "") for m in logs]
    for status in sorted({mk["status"] for rec in records for mk in rec["markers"]}):
        handles.append(Line2D([], [], linestyle="none", marker=MARKERS.get(status, "o"), markersize=8,
                              markeredgewidth=2, color="0.3", markerfacecolor="none" if status == "dropped" else None))
        names.append(MARKER_NAMES.get(status, status))
    if any(rec["kept_best"] for rec in records):
        handles.append(Line2D([], [], linestyle="none", **_best_marker("0.3", False)))
        names.append("kept best state (split --which best)")
        if any(mk["model"] == best_model for rec in records for mk in rec["kept_best"]):
            handles.append(Line2D([], [], linestyle="none", **_best_marker("0.3", True)))
            names.append("the best model's kept best state")
    differ = any(": " in s for s in names)
    no_eval = None if any(p[0].startswith("eval") for p in panels) else (
        "no evaluation in this run: train with --eval-data (or eval_fraction) and eval_every to plot eval loss "
        "and accuracy")
    note = "\n".join(n for n in (summary.get("note"), no_eval) if n) or None
    legend_below(fig, handles, names, title="model: the hyper-parameters that differ" if differ else None, note=note)
    return fig, records


# ---------------------------------------------------------------- entry points
def make_report(array_dir: str | os.PathLike, out_png: str | os.PathLike | None = None,
                note: str | None = None) -> dict:
    """Read ``ARRAY_DIR/metrics.csv``; write the plot (``out_png``, default ``ARRAY_DIR/report.png``) and
    ``ARRAY_DIR/report.json``; return the summary (per model: the per-model settings that differ, peak and final
    lr, last train loss, best eval loss and its step, best and last eval accuracy, its kept best state, the value
    it is ranked by, status and its step; the best model and what it was ranked by; per panel: the curves
    plotted). ``note``: a line under the figure and in the summary (the demo's: the CPU it trained on)."""
    array_dir = os.fspath(array_dir)
    array = ArrayDir(array_dir)
    png = os.fspath(out_png) if out_png is not None else array.report_png_path
    _check_plot_format(png)
    path = _open_metrics(array_dir)
    with array.locked("report"), claim_output(png, "report", is_file=True):  # a plot elsewhere: its folders too
        run_id = array.check_one_run()  # the metrics are the run whose weights trained/ holds
        logs = read_metrics(path, array.known_B())
        summary = {**summarize(logs, *_recorded(array)), "precision": _precision(array)}
        if note:
            summary["note"] = note
        json_path = array.report_json_path
        summary.update({"array_dir": array_dir, "run": run_id, "metrics": path, "png": png, "json": json_path})
        summary["panels"] = _plot(logs, summary, png)
        with atomic_file(json_path) as tmp, open(tmp, "w") as f:  # whole or not at all; a full disk names it
            json.dump(summary, f, indent=1, allow_nan=False)
    return summary


def _check_plot_format(png: str) -> None:
    """The plot's file type, from its name, is one matplotlib writes (before anything is read or drawn)."""
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(png)[1].lower().lstrip(".")
    if ext not in kinds:
        raise ConfigError(f"-o '{png}': matplotlib cannot write {'.' + ext if ext else 'a file without an extension'}"
                          f"; give a name ending in one of {', '.join('.' + k for k in sorted(kinds))}")


def _fmt(v: float | None, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec)


def _setting(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return ",".join(_setting(x) for x in v)
    return "-" if v is None else str(v)


def _metric_cell(metric: str, v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%" if metric == "eval_accuracy" else f"{v:.4f}"


def format_table(summary: dict) -> str:
    """The summary as a text table (``train``'s final table and ``report``'s): per model the per-model settings
    that differ between the models (the peak lr of metrics.csv when the run's settings are not recorded), its
    final train loss, eval loss and accuracy, its kept best state's metric and step, its status; then the best
    model by the one ranking (``ranking.score``) and which state of it that ranking read."""
    models, ranked = summary["models"], summary["ranked_by"]
    metric = ranked["metric"]
    # a metric measured in reduced precision says so: "eval acc (bf16)" (split's fp32 model may score otherwise)
    measured = "" if summary.get("precision", "fp32") == "fp32" else f" ({summary['precision']})"
    columns: list[tuple[str, Any]] = [("model", lambda m: str(m["model"]))]
    if summary.get("hparams"):
        columns += [(k, lambda m, k=k: _setting(m["hparams"].get(k))) for k in summary["hparams"]]
    elif any(m["lr"] is not None for m in models):
        columns.append(("lr", lambda m: _fmt(m["lr"])))
    columns.append((f"train loss{measured}", lambda m: _fmt(m["last_train_loss"], ".4f")))
    if any(m["last_eval_loss"] is not None for m in models):
        columns.append((f"eval loss{measured}", lambda m: _fmt(m["last_eval_loss"], ".4f")))
    if any(m["last_eval_accuracy"] is not None for m in models):
        columns.append((f"eval acc{measured}", lambda m: "-" if m["last_eval_accuracy"] is None else
                        f"{100 * m['last_eval_accuracy']:.1f}%"))
    if ranked["state"] == "best":
        columns.append((f"best {metric.replace('_', ' ')}{measured} @step", lambda m: "-" if m["kept_best"] is None else
                        f"{_metric_cell(metric, m['kept_best']['value'])} @{m['kept_best']['step']}"))
    columns.append(("status", lambda m: m["status"] if m["status_step"] is None else
                    f"{m['status']} at step {m['status_step']}"))
    cells = [[cell(m) for _, cell in columns] for m in models]
    widths = [max(len(name), *(len(row[i]) for row in cells)) for i, (name, _) in enumerate(columns)]
    lines = ["  ".join(name.rjust(w) for (name, _), w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    best = next((m for m in models if m["model"] == summary.get("best_model")), None)
    if best is not None and ranked["state"] == "best" and best["kept_best"] is not None:
        lines.append(f"best: model {best['model']} by its best {metric}{measured} "
                     f"{_metric_cell(metric, best['score'])} at step {best['kept_best']['step']} (`onnxfuse split "
                     "--which best` writes that state)")
    elif best is not None:
        lines.append(f"best: model {best['model']} by its final {metric}{measured} "
                     f"{_metric_cell(metric, best['score'])}")
    return "\n".join(lines)
