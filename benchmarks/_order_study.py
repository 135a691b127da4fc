"""The traversal-order study: every order x placer on graphs of several families and device counts, and which
order wins where.

``study_rows`` runs :func:`compare_placements` on each case; ``study_table`` prints one row per case with the
simulated step of every candidate, and ``order_summary`` ranks the traversal orders per family:

    slowdown(order, case) = step(greedy with that order) / step(best greedy order in that case)

reported as its geometric mean over the family's cases, with the number of cases the order wins (ties count for
every tied order). The ONNX graphs come from the caller (``benchmarks/placement_study.py`` exports the zoo);
nothing here needs torch. Research code for that script: the package does not import it.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Sequence

from onnxfuse.placement.devices import DeviceSpec
from onnxfuse.placement.graph import PlacementGraph
from onnxfuse.placement.orders import ORDER_NAMES
from onnxfuse.placement.compare import Comparison, compare_placements
from onnxfuse.placement.shard import Sharding

__all__ = ["StudyCase", "run_study", "study_table", "order_summary", "ORDER_SHORT"]

ORDER_SHORT = {"topo": "topo", "reversed_topo": "rev-topo", "lexicographic_topo": "lex-topo",
               "dfs_preorder": "dfs-pre", "dfs_postorder": "dfs-post", "reversed_postorder": "rev-post",
               "bfs": "bfs", "by_name": "name"}


@dataclass
class StudyCase:
    """One graph on one set of devices."""

    family: str
    label: str
    graph: PlacementGraph
    devices: list[DeviceSpec]
    setting: str = ""
    shard: Sharding | None = None
    comparison: Comparison | None = None


def run_study(cases: Sequence[StudyCase], granularity: str = "stage", progress: bool = True) -> list[StudyCase]:
    """Comparison every case with every placer and every order (in place; returns the cases)."""
    for k, case in enumerate(cases):
        if progress:
            print(f"[{k + 1}/{len(cases)}] {case.label} on {len(case.devices)} devices ({case.setting})",
                  file=sys.stderr, flush=True)
        placers = ["greedy", "heft"] + (["shard"] if case.shard is not None else [])
        case.comparison = compare_placements(case.graph, case.devices, placers, ORDER_NAMES, case.shard, granularity)
    return cases


def _step(comparison: Comparison, placer: str, order: str | None = None) -> float:
    c = next((c for c in comparison.candidates if c.placer == placer and c.order == order and c.ok), None)
    return c.sim.step_time if c is not None else math.nan


def study_table(cases: Sequence[StudyCase]) -> str:
    """One row per case: simulated step (ms) of one device, greedy with every order, HEFT, sharding; the
    fastest greedy order(s) and the fastest placement overall."""
    head = ["family", "graph", "setting", "D", "nodes", "1 device"] + [ORDER_SHORT[o] for o in ORDER_NAMES] + \
           ["heft", "shard", "best order", "best placement"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in cases:
        comparison = case.comparison
        greedy = {o: _step(comparison, "greedy", o) for o in ORDER_NAMES}
        fastest = min(greedy.values())
        winners = [ORDER_SHORT[o] for o, t in greedy.items() if t <= fastest * 1.0005]
        best = comparison.best()
        base = _step(comparison, "single")
        cells = [case.family, case.label, case.setting, str(len(case.devices)), str(len(case.graph)), _ms(base)]
        cells += [_ms(greedy[o], bold=greedy[o] <= fastest * 1.0005) for o in ORDER_NAMES]
        cells += [_ms(_step(comparison, "heft")), _ms(_step(comparison, "shard"))]
        cells += [", ".join(winners) if len(winners) < len(ORDER_NAMES) else "all equal",
                  f"{best.label} ({base / best.sim.step_time:.2f}x)"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def order_summary(cases: Sequence[StudyCase]) -> str:
    """Per family: each order's geometric-mean slowdown against the best order of each case, and its wins."""
    families = list(dict.fromkeys(c.family for c in cases))
    head = ["family", "cases"] + [ORDER_SHORT[o] for o in ORDER_NAMES] + ["winner"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fam in families:
        group = [c for c in cases if c.family == fam]
        logs = {o: 0.0 for o in ORDER_NAMES}
        wins = {o: 0 for o in ORDER_NAMES}
        for case in group:
            greedy = {o: _step(case.comparison, "greedy", o) for o in ORDER_NAMES}
            fastest = min(greedy.values())
            for o, t in greedy.items():
                logs[o] += math.log(t / fastest)
                wins[o] += t <= fastest * 1.0005
        mean = {o: math.exp(logs[o] / len(group)) for o in ORDER_NAMES}
        top = min(mean.values())
        winner = ", ".join(ORDER_SHORT[o] for o in ORDER_NAMES if mean[o] <= top * 1.0005)
        cells = [fam, str(len(group))] + [f"{mean[o]:.3f} ({wins[o]})" for o in ORDER_NAMES] + [winner]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _ms(t: float, bold: bool = False) -> str:
    if t is None or math.isnan(t):
        return "–"
    text = f"{t * 1e3:.3f}"
    return f"**{text}**" if bold else text
