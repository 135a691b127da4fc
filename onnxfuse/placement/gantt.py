"""Gantt chart of a simulated step, with the measured one beside it: per device a row of its simulated compute
(its nodes coloured by op type, each session call's calibrated overhead hatched at the start of its stage), a row
of the session calls measured in the last timed step (when ``--run``), and a row for its outgoing link only when
the placement sends anything over it."""
from __future__ import annotations

from typing import Sequence

from onnxfuse.placement.devices import DeviceSpec
from onnxfuse.placement.graph import PlacementGraph
from onnxfuse.placement.simulate import SimResult

__all__ = ["gantt_png", "gantt_figure"]

SHOWN_OPS = 9  # op types with a colour of their own (those taking the most time; tab10 but its grey); the rest grey
MS = 1e3
OTHER = "#c8c8c8"  # the op types without a colour of their own


def gantt_png(graph: PlacementGraph, result: SimResult, devices: Sequence[DeviceSpec], path: str, title: str = "",
              measured: Sequence[tuple[int, int, float, float]] | None = None,
              measured_step: float | None = None) -> str:
    """Draw :func:`gantt_figure` to ``path``; return it."""
    from onnxfuse.core._plot import save

    save(gantt_figure(graph, result, devices, title, measured, measured_step), path, dpi=110)
    return path


def gantt_figure(graph: PlacementGraph, result: SimResult, devices: Sequence[DeviceSpec], title: str = "",
                 measured: Sequence[tuple[int, int, float, float]] | None = None,
                 measured_step: float | None = None):
    """The chart as a matplotlib Figure. ``title``: what is placed (default the graph's label; the step times
    follow it); ``measured``: the (device, stage, start, end) of each session call of a measured step, seconds
    from the step's start; ``measured_step``: the measured step time to quote (the median), when given. Rows per
    device that has nodes: simulated compute, measured calls, the outgoing link (when it sends anything)."""
    from onnxfuse.core._plot import figure, legend_below

    measured = list(measured or [])
    rows, used, links = _rows(result, devices, measured)
    ops, colour = _op_colours(graph, result)
    fig = figure(11, 0.9 + 0.5 * len(rows))
    ax = fig.subplots()
    calls = _draw_bars(ax, graph, result, measured, {(kind, d): k for k, (_, kind, d) in enumerate(rows)}, colour)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _, _ in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first device on top
    ax.set_xlim(left=0)
    ax.set_xlabel("time from the start of the step (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    step = f"simulated step {result.step_time * MS:.3f} ms"
    if measured_step is not None:
        step += f", measured {measured_step * MS:.3f} ms (median)"
    ax.set_title(f"{title or graph.label}: {step}", fontsize=10)
    handles, labels = _legend_entries(ops, colour, calls, measured, result, devices)
    legend_below(fig, handles, labels, fontsize=8, note=_note(measured, links, used, len(devices)) + ".")
    return fig


def _rows(result: SimResult, devices: Sequence[DeviceSpec], measured: list
          ) -> tuple[list[tuple[str, str, int]], list[int], list[int]]:
    """The chart's rows (label, kind, device), the devices with a row, and those whose link sends anything."""
    links = sorted({t.src for t in result.transfers})
    used = sorted(set(result.device_of) | {m[0] for m in measured})  # a device with nothing placed: no row
    rows: list[tuple[str, str, int]] = []
    for d in used:
        rows.append((f"{devices[d].name}\nsimulated", "sim", d))
        if any(m[0] == d for m in measured):
            rows.append((f"{devices[d].name}\nmeasured", "measured", d))
        if d in links:
            rows.append((f"{devices[d].name} link\nsimulated", "link", d))
    return rows, used, links


def _op_colours(graph: PlacementGraph, result: SimResult) -> tuple[list[str], dict[str, tuple]]:
    """Every op type by the time it takes (most first), and a colour for the ``SHOWN_OPS`` that take the most."""
    from matplotlib import colormaps

    time_of = {}
    for i in range(len(graph)):
        time_of[graph.op_types[i]] = time_of.get(graph.op_types[i], 0.0) + result.end[i] - result.start[i]
    ops = sorted(time_of, key=lambda op: -time_of[op])
    named = ops if len(ops) <= SHOWN_OPS + 1 else ops[:SHOWN_OPS]
    palette = [colormaps["tab10"](k) for k in (0, 1, 2, 3, 4, 5, 6, 8, 9)]
    return ops, {op: palette[k % len(palette)] for k, op in enumerate(named)}


def _draw_bars(ax, graph: PlacementGraph, result: SimResult, measured: list, y: dict, colour: dict
               ) -> list[tuple[int, float, float]]:
    """The bars: nodes, session-call overheads, transfers, measured calls; returns the overheads drawn."""
    from matplotlib import colormaps

    shown = [i for i in range(len(graph)) if result.end[i] > result.start[i]]
    if shown:  # one call per artist kind: a training graph has thousands of bars
        ax.barh([y["sim", result.device_of[i]] for i in shown], [(result.end[i] - result.start[i]) * MS for i in shown],
                left=[result.start[i] * MS for i in shown], height=0.7,
                color=[colour.get(graph.op_types[i], OTHER) for i in shown], linewidth=0)
    calls = _call_overheads(result)
    if calls:
        ax.barh([y["sim", d] for d, _, _ in calls], [(e - s) * MS for _, s, e in calls],
                left=[s * MS for _, s, _ in calls], height=0.7, color="white", edgecolor="0.45", hatch="////",
                linewidth=0.5)
    if result.transfers:
        ax.barh([y["link", t.src] for t in result.transfers], [(t.end - t.start) * MS for t in result.transfers],
                left=[t.start * MS for t in result.transfers], height=0.5,
                color=[colormaps["Set2"](t.dst % 8) for t in result.transfers], edgecolor="black", linewidth=0.3)
    if measured:
        ax.barh([y["measured", d] for d, _, _, _ in measured], [(e - s) * MS for _, _, s, e in measured],
                left=[s * MS for _, _, s, _ in measured], height=0.5, color="#e8e8e8", edgecolor="black",
                linewidth=0.8)
        several = len({s for _, s, _, _ in measured}) > len({d for d, _, _, _ in measured})
        if several:  # more than one stage on a device: say which call is which
            for d, stage, s, e in measured:
                ax.text((s + e) / 2 * MS, y["measured", d], f"stage {stage}", ha="center", va="center", fontsize=7)
    return calls


def _legend_entries(ops: list[str], colour: dict, calls: list, measured: list, result: SimResult,
                    devices: Sequence[DeviceSpec]) -> tuple[list, list[str]]:
    from matplotlib import colormaps
    from matplotlib.patches import Patch

    named = list(colour)
    handles = [Patch(color=colour[op]) for op in named] + ([Patch(color=OTHER)] if len(named) < len(ops) else [])
    labels = list(named) + ([f"{len(ops) - len(named)} other op types"] if len(named) < len(ops) else [])
    if calls:
        handles.append(Patch(facecolor="white", edgecolor="0.45", hatch="////"))
        labels.append("session call overhead (calibrated)")
    if measured:
        handles.append(Patch(facecolor="#e8e8e8", edgecolor="black"))
        labels.append("measured session call")
    for dst in sorted({t.dst for t in result.transfers}):
        handles.append(Patch(facecolor=colormaps["Set2"](dst % 8), edgecolor="black"))
        labels.append(f"transfer to {devices[dst].name}")
    return handles, labels


def _note(measured: list, links: list[int], used: list[int], D: int) -> str:
    """What the rows show, below the legend."""
    note = ("simulated rows: the placement's step as the simulator predicts it, each stage one session call "
            "(its overhead first, then its nodes); ")
    note += ("measured rows: each session call of the last timed step, from the step's start (a call begins when "
             "its device's thread starts it: a gap before it is the hand-over to that thread and the wait for a "
             "core)" if measured else
             "run with --run to measure the step and draw its session calls beside")
    if not links and len(used) > 1:
        note += "; no link rows: nothing crosses between devices"
    if len(used) < D:
        idle = D - len(used)
        note += (f"; {idle} of the {D} devices {'has' if idle == 1 else 'have'} nothing placed on "
                 f"{'it' if idle == 1 else 'them'}")
    return note


def _call_overheads(result: SimResult) -> list[tuple[int, float, float]]:
    """(device, start, end) of each stage's session-call overhead in the simulation: from the stage's start to its
    first node's (stage granularity only)."""
    if result.granularity != "stage" or not result.units:
        return []
    out = []
    for d, _, s, e in result.units:
        begin = min((result.start[i] for i in range(len(result.start))
                     if result.device_of[i] == d and s - 1e-12 <= result.start[i] <= e + 1e-12), default=s)
        if begin > s:
            out.append((d, s, begin))
    return out
