"""A sweep's report.png: what a sweep's user looks at first.

Top: one panel per searched hyper-parameter, every trial's metric against its value (a log axis where the search
samples log-uniformly: the spec's range, or the plan's ``space``, which an Optuna study derives from the
distributions it sampled; without either, where more than 5 positive values span a decade or more; a value that
is not a number on an axis of its own), each dot in its trial's colour of the curves and the legend (grey past
:data:`CURVES_SHOWN`), the best trial starred. Bottom: the training curves (train loss smoothed over its raw
values, eval loss, and eval accuracy when that is the metric) of every trial up to :data:`CURVES_SHOWN`, best
first; the caption says which are shown. The legend below names each trial by its searched values.
"""
from __future__ import annotations

import csv
import io
import math
import os
from typing import Any

from onnxfuse.sweep.folder import METRICS, SweepDir
from onnxfuse.sweep.worker import number

__all__ = ["report_png", "sweep_figure", "CURVES_SHOWN"]

CURVES_SHOWN = 20  # trials whose curves are drawn (the best ones): more are not told apart by colour
PARAMS_PER_ROW = 4
_NO_RESULT = ("failed", "not run")
_OTHERS = (0.72, 0.72, 0.72, 1.0)  # the dots of trials past CURVES_SHOWN: no colour of the legend


def report_png(sweep: SweepDir, plan: dict, rows: list[dict], scores: dict[str, float]) -> bytes | None:
    """report.png's bytes (None when no trial has a result to draw); ``scores``: each trial's value as results.csv
    ranks it (``results.trial_score``)."""
    from onnxfuse.core._plot import save

    fig = sweep_figure(sweep, plan, rows, scores)
    if fig is None:
        return None
    png = io.BytesIO()
    save(fig, png, dpi=110)
    return png.getvalue()


def _space(sweep: SweepDir, plan: dict) -> dict[str, Any]:
    """The search space: the plan's ``space`` when it has one (an Optuna study's), else the spec's as the sweep
    folder keeps it ({} when it cannot be read: axes then follow the values alone)."""
    if plan.get("space") is not None:
        return dict(plan["space"])
    try:
        saved = sweep.read_json(sweep.spec_path, "the sweep's spec")
        return dict((saved.get("spec", {}).get("search") or {}).get("space") or {})
    except Exception:  # noqa: BLE001 - the picture does without the spec's log flags
        return {}


def _curve(sweep: SweepDir, trial: str, split: str, column: str) -> tuple[list[int], list[float]]:
    path = sweep.trial_file(trial, METRICS)
    if not os.path.exists(path):
        return [], []
    with open(path, encoding="utf-8") as f:
        pts = [(int(r["step"]), number(r.get(column))) for r in csv.DictReader(f) if r["split"] == split]
    pts = [(s, v) for s, v in pts if math.isfinite(v)]
    return [s for s, _ in pts], [v for _, v in pts]


def _short(key: str, keys: list[str]) -> str:
    """``optimizer.lr`` as ``lr`` when no other key ends the same way."""
    leaf = key.rsplit(".", 1)[-1]
    return leaf if sum(k.rsplit(".", 1)[-1] == leaf for k in keys) == 1 else key


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _axis(key: str, values: list, space: dict) -> str:
    """How a hyper-parameter's axis is drawn: ``log`` (a range the spec samples log-uniformly), ``linear`` (any
    other range), ``values`` (a list of values: one column each, in order). Without the spec: a range when there
    are more than 5 distinct numbers, log when they are positive and span a decade or more."""
    spec = space.get(key)
    if isinstance(spec, dict):
        return "log" if spec.get("log") else "linear"
    numbers = [v for v in values if _is_number(v)]
    if isinstance(spec, list) or len(numbers) < len(values) or len(set(numbers)) <= 5:
        return "values"
    return "log" if min(numbers) > 0 and max(numbers) / min(numbers) >= 10 else "linear"


def sweep_figure(sweep: SweepDir, plan: dict, rows: list[dict], scores: dict[str, float]):
    """The figure of report.png (module docstring), trials valued by ``scores``; None when no trial has a result."""
    from matplotlib import colormaps

    from onnxfuse.core._plot import figure, legend_below, log_ticks, smoothed

    metric, direction = plan["metric"], plan["direction"]
    kept = bool(rows) and f"best_{metric}" in rows[0]  # ranked by each trial's best state's value
    params = {t["id"]: t["params"] for t in plan["trials"]}
    ranked = [r["trial"] for r in rows if r["status"] not in _NO_RESULT]  # best first
    if not ranked:
        return None
    keys = list(dict.fromkeys(k for t in plan["trials"] for k in t["params"]))
    space = _space(sweep, plan)
    percent = metric.endswith("accuracy")
    value = {r["trial"]: scores[r["trial"]] * (100 if percent else 1) for r in rows}
    scored = [t for t in ranked if math.isfinite(value[t])]
    best = scored[0] if scored else None
    shown = ranked[:CURVES_SHOWN]
    # a trial's one colour, in every panel and the legend: tab20's dark shades for the best ten, its light ones
    # after, so that no two neighbours in rank look alike
    palette = [colormaps["tab20"](2 * k) for k in range(10)] + [colormaps["tab20"](2 * k + 1) for k in range(10)]
    colour = {t: palette[k % 20] for k, t in enumerate(shown)}

    curve_panels = [("train", "loss", "train loss"), ("eval", "loss", "eval loss")]
    if percent:
        curve_panels.append(("eval", "accuracy", "eval accuracy"))
    curves = {(t, p): _curve(sweep, t, p[0], p[1]) for t in shown for p in curve_panels}
    curve_panels = [p for p in curve_panels if any(curves[t, p][0] for t in shown)]

    per_row = min(PARAMS_PER_ROW, max(1, len(keys)))
    param_rows = math.ceil(len(keys) / per_row) if keys else 0
    width = max(11.0, 3.4 * per_row)
    fig = figure(width, 3.0 * param_rows + (3.4 if curve_panels else 0) + 0.3)
    subfigs = fig.subfigures(2 if param_rows and curve_panels else 1, 1, squeeze=False,
                             height_ratios=[3.0 * param_rows, 3.4] if param_rows and curve_panels else None)[:, 0]
    top = subfigs[0] if param_rows else None
    bottom = subfigs[-1] if curve_panels else None

    metric_label = metric.replace("_", " ") + (" (%)" if percent else "")
    if top is not None:
        _draw_param_panels(top, keys, scored, shown, params, value, best, colour, space, percent, metric_label,
                           metric_label + (" (its best state's)" if kept else ""), direction, per_row, param_rows)
    handles, labels = [], []
    if bottom is not None or top is not None:
        handles, labels = _trial_legend(keys, shown, params, colour, best)
    if bottom is not None:
        axes = bottom.subplots(1, len(curve_panels), squeeze=False)[0]
        for ax, panel in zip(axes, curve_panels):
            _curve_panel(ax, panel, shown, curves, colour, best, smoothed, log_ticks)
        which = (f"all {len(ranked)} trials with results" if len(shown) == len(ranked) else
                 f"the best {len(shown)} of the {len(ranked)} trials with results, by {metric}")
        bottom.suptitle(f"Training curves of {which}", fontsize=10)
    unscored = len(ranked) - len(scored)
    note = (f"{unscored} trial{'s' if unscored != 1 else ''} without a finite {metric}: not in the top panels. "
            if unscored else "")
    failed = len(rows) - len(ranked)
    note += f"{failed} trial{'s' if failed != 1 else ''} failed or did not run. " if failed else ""
    title = "trial: its searched values (its colour in every panel)" if handles else None
    legend_below(fig, handles, labels, title=title, note=note.strip() or None)
    return fig


def _draw_param_panels(top, keys: list[str], scored: list[str], shown: list[str], params: dict, value: dict,
                       best: str | None, colour: dict, space: dict, percent: bool, metric_label: str, ranked_by: str,
                       direction: str, per_row: int, param_rows: int) -> None:
    """The top panels: each trial's metric against each searched hyper-parameter."""
    from onnxfuse.core._plot import accuracy_axis, log_ticks

    axes = top.subplots(param_rows, per_row, squeeze=False).ravel()
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    ys = [value[t] for t in scored]
    log_y = not percent and ys and min(ys) > 0 and max(ys) / min(ys) >= 10
    for k, (ax, key) in enumerate(zip(axes, keys)):
        _param_panel(ax, key, keys, scored, params, value, best, colour,
                     _axis(key, [params[t].get(key) for t in scored], space))
        if log_y:
            ax.set_yscale("log")
            log_ticks(ax, ys)
        logit = percent and accuracy_axis(ax, ys) == "logit"  # trials that all learn, told apart
        if k % per_row == 0:
            ax.set_ylabel(metric_label + (" (logit scale)" if logit else ""))
    grey = "; grey: past the legend" if len(scored) > len(shown) else ""
    top.suptitle(f"Each trial's {ranked_by} against each searched hyper-parameter "
                 f"({'lower' if direction == 'minimize' else 'higher'} is better; the star: the best trial{grey})",
                 fontsize=10)


def _trial_legend(keys: list[str], shown: list[str], params: dict, colour: dict, best: str | None
                  ) -> tuple[list, list[str]]:
    """A legend entry per trial shown: its colour, and its values of the keys that differ between them."""
    from matplotlib.lines import Line2D

    handles, labels = [], []
    differ = [k for k in keys if len({repr(params[t].get(k)) for t in shown}) > 1]
    for t in shown:
        handles.append(Line2D([], [], color=colour[t], linewidth=2.4 if t == best else 1.6, marker="o",
                              markersize=5))
        labels.append(f"{t}: " + ", ".join(f"{_short(k, keys)} {_fmt(params[t].get(k))}" for k in differ)
                      if differ else t)
    return handles, labels


def _param_panel(ax, key: str, keys: list[str], trials: list[str], params: dict, value: dict, best: str | None,
                 colour: dict, axis: str) -> None:
    """Every trial's metric against its value of ``key`` (``axis``: see :func:`_axis`), a dot in the trial's
    ``colour`` (grey for a trial without one), the best drawn last; values met more than once spread a little
    sideways, so that equal ones do not hide each other."""
    xs = [params[t].get(key) for t in trials]
    ys = [value[t] for t in trials]
    numeric = axis != "values"
    log_x = axis == "log"
    if numeric:
        positions = _spread(xs, log_x)
    else:
        distinct = {_fmt(x): x for x in xs}  # by its text: a value may be a list
        names = sorted(distinct, key=lambda n: (0, distinct[n], "") if _is_number(distinct[n]) else (1, 0, n))
        index = {n: k for k, n in enumerate(names)}
        positions = _spread([index[_fmt(x)] for x in xs], False, width=0.25)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names)
        ax.set_xlim(-0.6, len(names) - 0.4)
    order = list(reversed(range(len(trials))))  # best first in ``trials``: drawn last, on top
    ax.scatter([positions[k] for k in order], [ys[k] for k in order], s=26, linewidths=0.4, edgecolors="white",
               c=[colour.get(trials[k], _OTHERS) for k in order], zorder=2)
    if best is not None:
        k = trials.index(best)
        ax.scatter([positions[k]], [ys[k]], s=190, marker="*", color=colour.get(best, _OTHERS), edgecolors="black",
                   linewidths=0.8, zorder=3)
    if numeric and log_x:
        from onnxfuse.core._plot import log_ticks

        ax.set_xscale("log")
        log_ticks(ax, xs, axis="x")
    ax.set_xlabel(_short(key, keys) + (" (log scale)" if numeric and log_x else ""))
    ax.grid(True, alpha=0.3)


def _spread(xs: list, log: bool, width: float | None = None) -> list[float]:
    """Positions for values drawn at ``xs``: a value met n > 1 times spread evenly over a small width around it
    (``width`` in data units; else 3 % of the axis' range, in log space on a log axis)."""
    groups: dict[Any, list[int]] = {}
    for k, x in enumerate(xs):
        groups.setdefault(x, []).append(k)
    if width is None:
        t = [math.log10(x) for x in xs] if log else list(xs)
        width = 0.03 * ((max(t) - min(t)) or 1.0)
    out = [float(x) for x in xs]
    for x, members in groups.items():
        n = len(members)
        for j, k in enumerate(members):
            offset = width * (j / (n - 1) - 0.5) if n > 1 else 0.0
            out[k] = x * 10 ** offset if log else x + offset
    return out


def _curve_panel(ax, panel: tuple, shown: list[str], curves: dict, colour: dict, best: str | None, smoothed,
                 log_ticks) -> None:
    split, column, title = panel
    scale = 100.0 if column == "accuracy" else 1.0
    values = [v * scale for t in shown for v in curves[t, panel][1]]
    log = column == "loss" and values and min(values) > 0
    smooth_any = False
    for t in reversed(shown):  # the best drawn last, on top
        xs, ys = curves[t, panel]
        if not xs:
            continue
        ys = [v * scale for v in ys]
        width = 2.4 if t == best else 1.4
        if len(xs) > 15:
            ax.plot(xs, ys, color=colour[t], linewidth=0.7, alpha=0.25)
            ax.plot(xs, smoothed(ys, log=log), color=colour[t], linewidth=width)
            smooth_any = True
        else:
            ax.plot(xs, ys, color=colour[t], linewidth=width, marker=".")
    logit = False
    if log:
        ax.set_yscale("log")
        log_ticks(ax, values)
    elif column == "accuracy":
        from onnxfuse.core._plot import accuracy_axis

        logit = accuracy_axis(ax, values) == "logit"
    ax.set_title(title + (" (smoothed; raw values faint)" if smooth_any else ""), fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel(("accuracy (%)" + (" (logit scale)" if logit else "")) if column == "accuracy" else "loss")
    ax.grid(True, alpha=0.3)
