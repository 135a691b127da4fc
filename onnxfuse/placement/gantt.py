"""Gantt chart of a simulated (or measured) step: one row per device's compute, one per device's outgoing link."""
from __future__ import annotations

from typing import Sequence

from onnxfuse.placement.devices import Device
from onnxfuse.placement.graph import PlacementGraph
from onnxfuse.placement.simulate import SimResult

__all__ = ["gantt_png"]


def gantt_png(graph: PlacementGraph, result: SimResult, devices: Sequence[Device], path: str, title: str = "",
              measured: Sequence[tuple[int, int, float, float]] | None = None) -> str:
    """Draw the step: nodes coloured by op type on each device's row, transfers on each link's row, and (when
    given) the measured stage spans (device, stage, start, end) as outlines on a row per device. Returns path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    D = len(devices)
    rows = [f"{d.name}" for d in devices] + [f"{d.name} link" for d in devices]
    if measured:
        rows += [f"{d.name} measured" for d in devices]
    ms = 1e3
    ops = sorted(set(graph.op_types), key=lambda op: -sum(result.end[i] - result.start[i]
                                                          for i in range(len(graph)) if graph.op_types[i] == op))
    cmap = plt.get_cmap("tab20")
    colour = {op: cmap(k % 20) for k, op in enumerate(ops)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * len(rows)))
    shown = [i for i in range(len(graph)) if result.end[i] > result.start[i]]
    if shown:  # one call per artist kind: a training graph has thousands of bars
        ax.barh([result.device_of[i] for i in shown], [(result.end[i] - result.start[i]) * ms for i in shown],
                left=[result.start[i] * ms for i in shown], height=0.8,
                color=[colour[graph.op_types[i]] for i in shown], linewidth=0)
    if result.transfers:
        ax.barh([D + t.src for t in result.transfers], [(t.end - t.start) * ms for t in result.transfers],
                left=[t.start * ms for t in result.transfers], height=0.6,
                color=[cmap((2 * t.dst + 1) % 20) for t in result.transfers], edgecolor="black", linewidth=0.3)
    if measured:
        ax.barh([2 * D + d for d, _, _, _ in measured], [(e - s) * ms for _, _, s, e in measured],
                left=[s * ms for _, _, s, _ in measured], height=0.6, fill=False, edgecolor="black")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"{graph.label}: simulated step {result.step_time * ms:.3f} ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[op]) for op in ops[:12]]
    ax.legend(handles, ops[:12], loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

