"""What every onnxfuse picture shares: a figure drawn without pyplot, a legend beside the panels (never over a
curve or a bar), smoothing of noisy training curves, a footer in small type, and the check the tests use.

The pictures are ``training/report.py``'s report.png, ``sweep/results.py``'s report.png, ``measure/bench.py``'s
bench.png and ``placement/gantt.py``'s gantt.png. A figure here uses matplotlib's constrained layout: a legend
placed "outside" and the footer are given their own room, so that a picture is as wide as its panels need and no
wider.
"""
from __future__ import annotations

import io
import math
import os
from typing import Sequence

__all__ = ["figure", "legend_below", "footer", "wrapped", "save", "smoothed", "legend_columns", "data_overlap",
           "log_ticks", "accuracy_axis"]


def figure(width: float, height: float, **kwargs):
    """A matplotlib Figure (inches) on its own Agg canvas, with constrained layout: nothing global (pyplot's
    state, the backend) is touched, and the figure is freed when it is no longer referenced."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained", **kwargs)
    FigureCanvasAgg(fig)
    return fig


def legend_columns(labels: Sequence[str], width_in: float, fontsize: float = 8.0) -> int:
    """How many legend columns of these labels fit side by side in ``width_in`` inches (at least one)."""
    longest = max((len(s) for s in labels), default=1)
    # a character is ~0.55 em wide; the handle, its gap and the column gap are ~4 em
    column_in = (0.55 * longest + 4.0) * fontsize / 72
    return max(1, min(len(labels), int(width_in / column_in)))


def legend_below(fig, handles: Sequence, labels: Sequence[str], title: str | None = None, fontsize: float = 8.0,
                 ncol: int | None = None, note: str | None = None):
    """The figure's legend in a band below every panel, as many columns as fit the figure's width, and ``note``
    (see :func:`footer`) under it: the figure grows by their height, so the panels keep theirs and the legend
    never lies over one."""
    ncol = ncol or legend_columns(list(labels), fig.get_figwidth() * 0.95, fontsize)
    legend = fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=fontsize, title=title,
                        title_fontsize=fontsize, frameon=False, columnspacing=1.2, handlelength=1.8)
    _below(fig, legend, note)
    return legend


def footer(fig, text: str, fontsize: float = 7.0):
    """Lines of small grey type under everything (how the figures were measured, what is not shown): the figure
    grows by their height."""
    return _below(fig, None, text, fontsize)


def _below(fig, legend, note: str | None, fontsize: float = 7.0):
    """Grow the figure by the legend's and the note's heights and keep the panels' layout above them."""
    gap = 0.06  # inches between the blocks
    legend_in = 0.0
    if legend is not None:
        fig.canvas.draw()  # the legend's size is known once drawn
        legend_in = legend.get_window_extent(fig.canvas.get_renderer()).height / fig.dpi + gap
    note = wrapped(note, fig.get_figwidth(), fontsize) if note else note
    note_in = ((note.count("\n") + 1) * 1.35 * fontsize / 72 + gap) if note else 0.0
    height = fig.get_figheight() + legend_in + note_in
    fig.set_figheight(height)
    text = None
    if note:
        text = fig.text(0.5, (note_in / 2) / height, note, fontsize=fontsize, color="0.35", ha="center",
                        va="center")
    if legend is not None:
        legend.set_bbox_to_anchor((0.5, note_in / height), transform=fig.transFigure)
    bottom = (legend_in + note_in) / height
    fig.get_layout_engine().set(rect=(0, bottom, 1, 1 - bottom))
    return text


def wrapped(text: str, width_in: float, fontsize: float) -> str:
    """``text`` with its lines broken to fit ``width_in`` inches at ``fontsize`` (a character ~0.52 em wide)."""
    import textwrap

    chars = max(20, int(width_in * 0.95 * 72 / (0.52 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def save(fig, path_or_buffer: str | os.PathLike | io.BytesIO, dpi: int = 110) -> None:
    """Write the figure as a PNG (or the type its file name says), a file whole or not at all (``atomic_file``:
    a full disk is one error naming it)."""
    if not isinstance(path_or_buffer, io.BytesIO):
        from onnxfuse.core._io import atomic_file

        path = os.fspath(path_or_buffer)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        kind = os.path.splitext(path)[1].lstrip(".").lower() or "png"  # the temporary name has no extension
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format=kind, dpi=dpi)
    else:
        fig.savefig(path_or_buffer, format="png", dpi=dpi)


def smoothed(values: Sequence[float], log: bool = False, weight: float | None = None) -> list[float]:
    """An exponential moving average, debiased at the start (TensorBoard's smoothing): the trend a reader wants
    from a noisy per-step loss. ``log``: averaged in log space (a geometric mean: one spike of 1e4 does not lift
    the curve of a loss near 1e-3). ``weight`` (the share of the previous average) defaults to one that averages
    over about an eighth of the curve: none for 15 points or fewer, then 0.6 (TensorBoard's default) up to 40
    points, 0.86 for 100, 0.98 from 800 on."""
    n = len(values)
    if weight is None:
        weight = min(0.98, max(0.6, 1.0 - 2.0 / (n / 8.0 + 1.0))) if n > 15 else 0.0
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        x = math.log(v) if log else v
        avg = weight * avg + (1 - weight) * x
        norm = weight * norm + (1 - weight)
        y = avg / norm
        out.append(math.exp(y) if log else y)
    return out


def log_ticks(ax, values: Sequence[float], axis: str = "y") -> None:
    """Plain numbers (0.3, 2) on a log axis rather than 3x10^-1; minor labels (2, 3, 5 x 10^k) only over a short
    range, where the major ticks alone would be one or two."""
    from matplotlib.ticker import FuncFormatter

    finite = [v for v in values if v > 0 and math.isfinite(v)]
    few_decades = bool(finite) and math.log10(max(finite) / min(finite)) < 1.5
    which = ax.yaxis if axis == "y" else ax.xaxis
    which.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    which.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if few_decades and f"{v:.0e}"[0] in "235" else ""))


# where an accuracy axis may put its ticks (percent): dense near 100 %, where good models differ
ACCURACY_TICKS = (1, 2, 5, 10, 20, 50, 80, 90, 95, 98, 99, 99.5, 99.8, 99.9, 99.95, 99.98, 99.99)
ACCURACY_CLIP = 0.01  # percent: 0 % and 100 % are drawn this far inside the logit axis' open interval


def accuracy_axis(ax, values: Sequence[float], axis: str = "y") -> str:
    """The scale of an axis of accuracies in percent (``values``, as drawn): once they reach above 90 %, a logit
    scale, ``log(p / (100 - p))``, which gives 90 -> 99 % and 99 -> 99.9 % the room 50 -> 90 % has, so that
    models that all learn are told apart (on a linear axis that also holds a model at chance, 97 and 99 % are one
    line); ticks at round percentages. Below that, linear. Returns the scale's name, for the record of a panel:
    ``logit`` or ``linear``."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    finite = [v for v in values if math.isfinite(v)]
    if not finite or max(finite) <= 90:
        return "linear"

    def clip(p):
        import numpy as np

        return np.clip(p, ACCURACY_CLIP, 100 - ACCURACY_CLIP)

    def forward(p):
        import numpy as np

        q = clip(np.asarray(p, dtype=float)) / 100
        return np.log(q / (1 - q))

    def inverse(z):
        import numpy as np

        return 100 / (1 + np.exp(-np.asarray(z, dtype=float)))

    lo, hi = float(clip(min(finite))), float(clip(max(finite)))
    bottom = max((t for t in ACCURACY_TICKS if t <= lo), default=lo)  # the round percentages around the values
    top = min((t for t in ACCURACY_TICKS if t >= hi), default=hi)
    ticks = [t for t in ACCURACY_TICKS if bottom <= t <= top]
    which = ax.yaxis if axis == "y" else ax.xaxis
    (ax.set_yscale if axis == "y" else ax.set_xscale)("function", functions=(forward, inverse))
    z0, z1 = float(forward(bottom)), float(forward(top))
    pad = 0.04 * (z1 - z0 or 1.0)  # a marker on the first or last tick is drawn whole
    (ax.set_ylim if axis == "y" else ax.set_xlim)(float(inverse(z0 - pad)), float(inverse(z1 + pad)))
    which.set_major_locator(FixedLocator(ticks))
    which.set_minor_locator(NullLocator())
    which.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    return "logit"


def data_overlap(fig, artist, *axes) -> float:
    """The area (square pixels) where ``artist`` (a legend, a text) covers the plotting area of any of ``axes``
    (default: every panel of the figure) once the figure is drawn: 0 when it lies beside them. The tests' check
    that a legend is never over data."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    a = artist.get_window_extent(renderer)
    total = 0.0
    for ax in axes or fig.axes:
        b = ax.get_window_extent(renderer)
        w, h = min(a.x1, b.x1) - max(a.x0, b.x0), min(a.y1, b.y1) - max(a.y0, b.y0)
        total += max(0.0, w) * max(0.0, h)
    return total
