"""What ``onnxfuse bench`` writes from its rows: the tables of bench.md, bench.csv, and the figure of bench.png
(``plot_file`` draws it again from a bench.json)."""
from __future__ import annotations

import csv
import json
import os

from onnxfuse.measure.bench_modes import BASELINE, CEILINGS, FILE_TITLES, FUSED_MODES, MODE_TITLES

__all__ = ["mode_title", "table", "wide_table", "verdicts", "write_csv", "machine", "write_png", "plot_file",
           "bench_figure"]


def mode_title(row: dict, mode: str) -> str:
    """What ``mode`` measured for this row: an ONNX file's seq-torch and dense run its graph by onnxfuse's converter."""
    return FILE_TITLES.get(mode, MODE_TITLES[mode]) if row.get("source") == "onnx" else MODE_TITLES[mode]


def table(rows: list[dict], modes: list[str]) -> str:
    """One line per model, B, precision and mode measured: samples/s, the ratio to PyTorch one after another and to
    the dense ceiling (both in the row's precision), the first step alone (compiling, for a compiled mode), peak
    memory (the allocator's per mode and precision on CUDA, and concurrent's processes'; "–" on the CPU, where the
    process's RSS is one figure for the whole run)."""
    lines = ["| model | B | precision | mode | samples/s | ÷ PyTorch one after another | ÷ dense (ceiling) "
             "| first call s | peak MiB |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        for m in (m for m in modes if m in r["modes"]):
            c = r["modes"][m]
            dense = "–" if c["of_dense"] is None else f"{c['of_dense']:.2f}"
            peak = "–" if c["peak_mib"] is None else f"{c['peak_mib']:,.0f}"
            lines.append(f"| {r['model']} | {r['B']} | {r['precision']} | {mode_title(r, m)} | {c['samples_s']:,.0f} "
                         f"| {c['over_seq_torch']:.2f}× | {dense} | {c['first_call_s']:.1f} | {peak} |")
    return "\n".join(lines)


def _fused_of_ceiling(r: dict) -> str:
    of = r.get("fused_of_ceiling")
    return "–" if of is None else f"{of:.2f} ({r['fused_best']} ÷ {r['ceiling_best']})"


def wide_table(rows: list[dict], modes: list[str]) -> str:
    """One line per model, B and precision, one column per mode: samples/s and, in brackets, the ratio to PyTorch
    one after another in that precision; then the mode that won (highest samples/s) and the fused array's best mode
    as a fraction of the better of dense and dense-compiled. A mode no row has is left out."""
    modes = [m for m in modes if any(m in r["modes"] for r in rows)]
    head = [MODE_TITLES[m] for m in modes]
    lines = ["| model | B | precision | " + " | ".join(head) + " | won | fused best ÷ best dense |",
             "|---|---:|---|" + "---:|" * len(modes) + "---|---:|"]
    for r in rows:
        cells = [f"{r['modes'][m]['samples_s']:,.0f} ({r['modes'][m]['over_seq_torch']:.2f}×)" if m in r["modes"]
                 else "–" for m in modes]
        lines.append(f"| {r['model']} | {r['B']} | {r['precision']} | " + " | ".join(cells)
                     + f" | {r['winner']} | {_fused_of_ceiling(r)} |")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> str:
    """A line per model, B and precision: which mode won, and how near the fused array's best mode came to the
    ceiling."""
    lines = []
    for r in rows:
        won = r["modes"][r["winner"]]["samples_s"]
        line = f"- {r['model']} B={r['B']} {r['precision']}: {r['winner']} won ({won:,.0f} samples/s)"
        if r.get("fused_of_ceiling") is not None:
            line += (f"; the fused array's best mode, {r['fused_best']}, reached {r['fused_of_ceiling']:.2f} of "
                     f"{r['ceiling_best']}, the better dense")
        lines.append(line)
    return "\n".join(lines)


def scaling_table(rows: list[dict]) -> str:
    """How the fused array scales with B, one line per model, precision and B (a run measured at more than one B):
    the fused array's best mode, its samples/s, the ratio to the better dense mode, and the memory one step takes
    per model, of the fused mode and of that dense (its peak memory over B: see bench.md's note on peak memory)."""
    def per_model(r: dict, mode: str | None) -> str:
        peak = r["modes"].get(mode, {}).get("peak_mib") if mode else None
        return "–" if peak is None else f"{peak / r['B']:,.1f}"

    lines = ["| model | precision | B | fused best | samples/s | ÷ best dense | step MiB per model, fused | "
             "step MiB per model, dense |", "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["precision"], r["B"])):
        fused, dense = r.get("fused_best"), r.get("ceiling_best")
        if fused is None:
            continue
        of = "–" if r.get("fused_of_ceiling") is None else f"{r['fused_of_ceiling']:.2f} ({dense})"
        lines.append(f"| {r['model']} | {r['precision']} | {r['B']} | {fused} | "
                     f"{r['modes'][fused]['samples_s']:,.0f} | {of} | {per_model(r, fused)} | {per_model(r, dense)} |")
    return "\n".join(lines)


_PER_MODE = ("samples_s", "over_seq_torch", "of_dense", "first_call_s", "first_loss", "peak_mib")


def write_csv(path: str, rows: list[dict], modes: list[str]) -> None:
    cols = ["model", "B", "precision", "batch", "device", "steps", "rounds", "peak_mib", "winner", "fused_best",
            "ceiling_best", "fused_of_ceiling"]
    per_mode = [f"{m} {k}" for m in modes for k in _PER_MODE]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols + per_mode)
        for r in rows:
            w.writerow([r[c] for c in cols] + [r["modes"].get(m, {}).get(k) for m in modes for k in _PER_MODE])


def _round_ratios(row: dict, mode: str) -> list[float]:
    """The mode's speed over PyTorch one after another in each round (the baseline's round time over the mode's,
    both in the row's precision): the ratios whose median is ``over_seq_torch``."""
    return [b / t for t, b in zip(row["modes"][mode]["round_s"], row["modes"][BASELINE]["round_s"])]


def _spread(row: dict, mode: str) -> tuple[float, float, float]:
    """(median, slowest, fastest) of the mode's per-round ratios to PyTorch one after another."""
    r = _round_ratios(row, mode)
    return row["modes"][mode]["over_seq_torch"], min(r), max(r)


def machine(env: dict, device_type: str) -> str:
    """The machine a bench.json's figures come from: on the CPU its model, instruction set and cores (env's
    ``cpu``, :func:`onnxfuse.runtime._machine.cpu_description`), on CUDA the GPU and its host's CPU. A bench.json
    written before ``cpu`` was recorded: the device name and the core count it has."""
    if "cpu" not in env:
        cores = f" ({env['cpu_count']} cores)" if env.get("cpu_count") and device_type == "cpu" else ""
        return f"{env.get('device_name') or device_type}{cores}"
    return env["cpu"] if device_type == "cpu" else f"{env.get('device_name', device_type)}, host {env['cpu']}"


def _caption(rows: list[dict], env: dict) -> str:
    """How the figures were measured, in words, and where the command is (bench.md, bench.json)."""
    r = rows[0] if rows else {}
    threads = env.get("threads", "?")
    where = machine(env, r.get("device", "cpu").split(":")[0])
    how = (f"{where}, torch {env.get('torch', '?')}, {threads} thread{'s' if threads != 1 else ''}; batch "
           f"{r.get('batch', '?')} per model, AdamW, {r.get('steps', '?')} steps x {r.get('rounds', '?')} rounds after "
           f"{r.get('warmup', '?')} warm-up, the modes interleaved in each round")
    return (how + ".\nMarker or bar: the median of the per-round ratios; whiskers: the slowest and the fastest "
            "round. The command that reproduces it: bench.md, bench.json.")


def _title(rows: list[dict]) -> str:
    Bs = sorted({r["B"] for r in rows})
    which = f"B = {Bs[0]} models" if len(Bs) == 1 else "B models"
    return f"Training {which} at once: speed relative to PyTorch training them one after another"


def write_png(path: str, rows: list[dict], modes: list[str], env: dict | None = None) -> None:
    """Write :func:`bench_figure` to ``path``."""
    from onnxfuse.core._plot import save

    save(bench_figure(rows, modes, env or {}), path, dpi=120)


def plot_file(json_path: str | os.PathLike, png_path: str | os.PathLike) -> None:
    """Draw bench.png again from a bench.json (``run_bench``'s): the same figure, e.g. after the plot changed."""
    with open(json_path) as f:
        result = json.load(f)
    write_png(os.fspath(png_path), result["rows"], result["modes"], result.get("env"))


def bench_figure(rows: list[dict], modes: list[str], env: dict):
    """The figure of bench.png: one panel per model and precision, each mode's speed as its ratio to PyTorch one
    after another (the baseline, 1x) with the spread of the rounds; the dense ceiling marked. One B: a bar per
    mode; several: a line per mode against B. The legend and how it was measured are below the panels."""
    from onnxfuse.core._plot import figure, legend_below, wrapped

    panels = list(dict.fromkeys(_panel(r) for r in rows)) or [("(no measurement)", "fp32")]
    one_b = len({r["B"] for r in rows}) <= 1
    n_modes = max([len(r["modes"]) for r in rows] or [1])
    if one_b:
        fig = figure(max(7.5, 5.8 * len(panels) + 1.0), 0.36 * n_modes + 1.0)
        handles, labels = _bar_panels(fig, rows, modes, panels)
    else:
        fig = figure(max(7.5, 4.6 * len(panels) + 0.4), 3.6)
        handles, labels = _line_panels(fig, rows, modes, panels)
    fig.suptitle(wrapped(_title(rows), fig.get_figwidth(), 11), fontsize=11)
    legend_below(fig, handles, labels, note=_caption(rows, env) if rows else None)
    return fig


def _bar_panels(fig, rows: list[dict], modes: list[str], panels: list[tuple[str, str]]) -> tuple[list, list]:
    """A bar per mode: the median ratio, whiskers from the slowest to the fastest round, the ratio and samples/s
    written beside it; fused modes dark, the others grey, the baseline and the ceilings hatched; a line at 1x and
    a dotted one at the better dense ceiling. Returns the legend's handles and labels."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    fused_c, other_c = "#1f4e99", "#9aa5b1"
    for ax, panel in zip(axes, panels):
        row = next((r for r in rows if _panel(r) == panel), None)
        if row is None:
            ax.text(0.5, 0.5, "no measurement", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        mine = [m for m in modes if m in row["modes"]][::-1]  # the first mode on top
        spread = [_spread(row, m) for m in mine]
        med = [s[0] for s in spread]
        err = [[s[0] - s[1] for s in spread], [s[2] - s[0] for s in spread]]
        bars = ax.barh([mode_title(row, m) for m in mine], med, xerr=err, color=[
            fused_c if m in FUSED_MODES else other_c for m in mine], error_kw={"elinewidth": 1, "capsize": 2.5,
                                                                              "ecolor": "0.15"})
        top = max(s[2] for s in spread)
        for bar, m, (median, _, fastest) in zip(bars, mine, spread):
            bar.set_gid(m)  # which mode a bar is, for a reader of the figure (the tests)
            if m == BASELINE or m in CEILINGS:
                bar.set_hatch("//")
            ax.text(fastest + top * 0.02, bar.get_y() + bar.get_height() / 2,
                    f"{median:.2f}×  ({row['modes'][m]['samples_s']:,.0f}/s)", va="center", fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6}, zorder=3)
        ax.axvline(1.0, color="0.2", linewidth=0.9)
        if row.get("ceiling_best") in row["modes"]:
            ax.axvline(row["modes"][row["ceiling_best"]]["over_seq_torch"], color="0.2", linewidth=1, linestyle=":")
        ax.set_xlim(0, top * 1.45)  # room for the text beside the longest whisker
        ax.set_title(f"{_panel_title(panel, rows)}, B = {row['B']}", fontsize=10)
        ax.set_xlabel("× PyTorch one after another (samples/s over all B models in brackets)", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(True, axis="x", alpha=0.3)
    handles = [Patch(color=fused_c), Patch(color=other_c), Patch(facecolor=other_c, hatch="//"),
               Line2D([], [], color="0.2", linewidth=0.9), Line2D([], [], color="0.2", linewidth=1, linestyle=":")]
    labels = ["the fused array (onnxfuse)", "the other ways to train the B models",
              "the baseline and the ceiling (one model at batch B*N)", "1× = PyTorch one after another",
              "the ceiling: the better of one model at batch B*N, eager or compiled"]
    return handles, labels


def _line_panels(fig, rows: list[dict], modes: list[str], panels: list[tuple[str, str]]) -> tuple[list, list]:
    """A line per mode against B (log2), each point the median ratio with the rounds' spread as whiskers; the
    fused modes solid and thick, the ceilings dashed. Returns the legend's handles and labels (one per title)."""
    import matplotlib.ticker
    from matplotlib import colormaps

    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    palette = [colormaps["tab10"](k) for k in range(10)] + [colormaps["Dark2"](k) for k in range(8)]
    colour = {m: palette[k % len(palette)] for k, m in enumerate(modes)}
    seen: dict[str, object] = {}
    for ax, panel in zip(axes, panels):
        mine = sorted((r for r in rows if _panel(r) == panel), key=lambda r: r["B"])
        for mode in modes:
            pts = [(r["B"], *_spread(r, mode)) for r in mine if mode in r["modes"]]
            if not pts or mode == BASELINE:
                continue
            Bs, med, lo, hi = zip(*pts)
            nudge = 2 ** (0.025 * (modes.index(mode) - len(modes) / 2))  # side by side: whiskers apart
            h = ax.errorbar([b * nudge for b in Bs], med, yerr=[[m - a for m, a in zip(med, lo)],
                                                                [b - m for m, b in zip(med, hi)]],
                            color=colour[mode], marker="o", markersize=4, capsize=2.5,
                            linewidth=2.2 if mode in FUSED_MODES else 1.2,
                            linestyle="--" if mode in CEILINGS else "-")
            h.lines[0].set_gid(mode)
            seen.setdefault(mode_title(mine[0], mode), h)
        base = ax.axhline(1.0, color="0.2", linewidth=0.9)
        seen.setdefault(f"{mode_title(mine[0], BASELINE) if mine else MODE_TITLES[BASELINE]} (1×)", base)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["B"] for r in mine}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_title(_panel_title(panel, rows), fontsize=10)
        ax.set_xlabel("B (models in the array)")
        ax.set_ylabel("× PyTorch one after another")
        ax.grid(True, alpha=0.3)
    return list(seen.values()), list(seen)


def _panel(row: dict) -> tuple[str, str]:
    """The plot's panel a row is drawn in: one per model and precision."""
    return row["model"], row["precision"]


def _panel_title(panel: tuple[str, str], rows: list[dict]) -> str:
    """The model's file name, and the precision where the run measured more than one."""
    name, precision = panel
    return os.path.basename(name) + (f" ({precision})" if len({r["precision"] for r in rows}) > 1 else "")
