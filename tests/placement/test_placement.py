"""Device placement without running anything: traversal orders, the simulator against hand-computed schedules,
memory limits, device specs, and the calibration fit."""
from __future__ import annotations

import math
import random

import networkx as nx
import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

from tests.conftest import graph_model, vinfo
from onnxfuse.core.errors import ConfigError, PlacementError
from onnxfuse.placement import (CostTable, Dag, DeviceSpec, build_graph, cost_table, greedy_placement, heft_placement,
                                make_devices, place, placement_memory, simulate, traversal_order)
from onnxfuse.placement.devices import load_device_spec, parse_rate, parse_size, parse_time
from onnxfuse.placement.orders import ORDER_NAMES, CycleError
from onnxfuse.placement.partition import assign_stages
from onnxfuse.placement.profile import fit_calibration

# ---------------------------------------------------------------- traversal orders on a hand-built DAG
#
#    in(0) ──> zeta(1) ──> beta(3) ──> join(4) ──> out(7)
#      └─────> alpha(2) ─────────────────┘ │          ^
#                 └──────> gamma(6) <── side(5)       │
#                             └───────────────────────┘
NAMES = ["in", "zeta", "alpha", "beta", "join", "side", "gamma", "out"]
EDGES = [(0, 1), (0, 2), (1, 3), (3, 4), (2, 4), (2, 6), (5, 6), (4, 7), (6, 7)]
EXPECTED = {
    "topo": [0, 1, 2, 3, 4, 5, 6, 7],
    "reversed_topo": [7, 6, 5, 4, 3, 2, 1, 0],
    "lexicographic_topo": [0, 2, 5, 6, 1, 3, 4, 7],  # ready set by name: in; alpha < side < zeta; gamma < zeta
    "dfs_preorder": [0, 1, 3, 4, 7, 2, 6, 5],
    "dfs_postorder": [7, 4, 3, 1, 6, 2, 0, 5],
    "reversed_postorder": [5, 0, 2, 6, 1, 3, 4, 7],
    "bfs": [0, 1, 2, 3, 4, 6, 7, 5],  # from in: 0 | 1 2 | 3 4 6 | 7; then from side: 5 (6, 7 already listed)
    "by_name": [2, 3, 6, 0, 4, 7, 5, 1],
}


@pytest.mark.parametrize("order", ORDER_NAMES)
def test_order_on_hand_built_dag(order):
    dag = Dag.from_edges(NAMES, EDGES)
    assert traversal_order(dag, order) == EXPECTED[order]


def test_orders_break_ties_by_index():
    dag = Dag.from_edges(["same"] * 4, [(0, 3), (1, 3), (2, 3)])
    assert traversal_order(dag, "by_name") == [0, 1, 2, 3]
    assert traversal_order(dag, "lexicographic_topo") == [0, 1, 2, 3]
    assert traversal_order(dag, "bfs") == [0, 3, 1, 2]
    assert traversal_order(dag, "dfs_postorder") == [3, 0, 1, 2]


def _paper_bfs(G):
    """The paper's BFS: from every zero-in-degree node in order, bfs_edges, duplicates removed."""
    out = []
    for s in sorted((v for v, d in G.in_degree() if d == 0)):
        out += [s] + [v for _, v in nx.bfs_edges(G, s)]
    seen = set()
    return [v for v in out if not (v in seen or seen.add(v))]


@pytest.mark.parametrize("seed", range(6))
def test_orders_match_networkx_on_random_dags(seed):
    """On DAGs whose node indices are topological (as in an ONNX file) the orders equal networkx's."""
    rnd = random.Random(seed)
    n = rnd.randint(5, 40)
    edges = [(i, j) for j in range(n) for i in range(j) if rnd.random() < 0.15]
    names = [f"n{rnd.randint(0, 9)}" for _ in range(n)]
    dag = Dag.from_edges(names, edges)
    G = nx.DiGraph()
    G.add_nodes_from(range(n))
    G.add_edges_from(sorted(edges))
    assert traversal_order(dag, "topo") == list(nx.lexicographical_topological_sort(G))
    assert traversal_order(dag, "lexicographic_topo") == list(
        nx.lexicographical_topological_sort(G, key=lambda i: (names[i], i)))
    assert traversal_order(dag, "dfs_preorder") == list(nx.dfs_preorder_nodes(G))
    assert traversal_order(dag, "dfs_postorder") == list(nx.dfs_postorder_nodes(G))
    assert traversal_order(dag, "bfs") == _paper_bfs(G)
    for order in ("topo", "lexicographic_topo", "reversed_postorder"):
        seq = traversal_order(dag, order)
        pos = {v: k for k, v in enumerate(seq)}
        assert all(pos[a] < pos[b] for a, b in edges), order
    for order in ORDER_NAMES:
        assert sorted(traversal_order(dag, order)) == list(range(n))


def test_cycle_is_named_and_deep_graphs_do_not_recurse():
    dag = Dag.from_edges(["a", "b", "c", "d"], [(0, 1), (1, 2), (2, 3), (3, 1)])
    for order in ORDER_NAMES:
        with pytest.raises(CycleError, match="cycle: 'b' -> 'c' -> 'd' -> 'b'"):
            traversal_order(dag, order)
    chain = Dag.from_edges(20000, [(i, i + 1) for i in range(19999)])
    assert traversal_order(chain, "dfs_postorder")[0] == 19999


def test_unknown_order():
    with pytest.raises(ConfigError, match="unknown traversal order 'zigzag'"):
        traversal_order(Dag.from_edges(1, []), "zigzag")


# ---------------------------------------------------------------- the simulator against hand-computed schedules
N = 1000  # float32 elements: every tensor is 4000 bytes


def diamond():
    """x -> A -> a;  a -> B -> b;  a -> C -> c;  (b, c) -> D -> y."""
    nodes = [h.make_node("Relu", ["x"], ["a"], name="A"), h.make_node("Neg", ["a"], ["b"], name="B"),
             h.make_node("Abs", ["a"], ["c"], name="C"), h.make_node("Add", ["b", "c"], ["y"], name="D")]
    return build_graph(graph_model(nodes, [vinfo("x", [N])], [vinfo("y", [N])], []), label="diamond")


def hand_costs(graph, ms, devices):
    """compute[i][d] = ms[name] milliseconds on every device."""
    return CostTable([[ms[n] * 1e-3] * len(devices) for n in graph.names], devices, "estimated")


LINK = dict(latency=1e-3, bandwidth=4e6)  # 4000 bytes: 1 ms + 1 ms = 2 ms per transfer


def test_simulator_stage_schedule_by_hand():
    g = diamond()
    devs = make_devices(2, call_overhead="0.5ms", **LINK)
    costs = hand_costs(g, {"A": 1, "B": 3, "C": 3, "D": 1}, devs)
    # A, B, D on device 0, C on device 1: stages  dev0 {A, B} | dev1 {C} | dev0 {D}
    assert assign_stages(g.dag, [0, 0, 1, 0]) == [0, 0, 1, 2]
    r = simulate(g, costs, [0, 0, 1, 0], "stage")
    # dev0 stage 0: 0 + 0.5 call, A 0.5-1.5, B 1.5-4.5 -> a exists at 4.5 (end of the session call)
    # link0: a 4.5-6.5;  dev1: 6.5 + 0.5, C 7.0-10.0;  link1: c 10.0-12.0;  dev0: 12.0 + 0.5, D 12.5-13.5
    assert r.step_time == pytest.approx(13.5e-3)
    assert [round(t * 1e3, 6) for t in r.start] == [0.5, 1.5, 7.0, 12.5]
    assert r.busy == pytest.approx([6.0e-3, 3.5e-3])
    assert r.link_busy == pytest.approx([2e-3, 2e-3])
    assert r.bytes_moved == 8000 and len(r.transfers) == 2


def test_simulator_op_schedule_by_hand():
    g = diamond()
    devs = make_devices(2, call_overhead="0.5ms", **LINK)  # no session calls at op granularity
    costs = hand_costs(g, {"A": 1, "B": 3, "C": 3, "D": 1}, devs)
    r = simulate(g, costs, [0, 0, 1, 0], "op")
    # A 0-1; a -> dev1 1-3; B 1-4 on dev0; C 3-6 on dev1; c -> dev0 6-8; D 8-9
    assert r.step_time == pytest.approx(9e-3)
    assert [round(t * 1e3, 6) for t in r.start] == [0, 1, 3, 8]
    # one device: no transfers, the sum of the costs (+ one call per stage)
    assert simulate(g, costs, [0] * 4, "op").step_time == pytest.approx(8e-3)
    assert simulate(g, costs, [0] * 4, "stage").step_time == pytest.approx(8.5e-3)


def test_simulator_one_link_sends_one_transfer_at_a_time():
    """A's output is read on devices 1 and 2: two transfers queue on device 0's single link (by destination)."""
    nodes = [h.make_node("Relu", ["x"], ["a"], name="A"), h.make_node("Neg", ["a"], ["b"], name="B"),
             h.make_node("Abs", ["a"], ["c"], name="C")]
    g = build_graph(graph_model(nodes, [vinfo("x", [N])], [vinfo("b", [N]), vinfo("c", [N])], []))
    devs = make_devices(3, **LINK)
    r = simulate(g, hand_costs(g, {"A": 1, "B": 3, "C": 3}, devs), [0, 1, 2], "op")
    # link0: a -> dev1 1-3, a -> dev2 3-5;  B 3-6 on dev1, C 5-8 on dev2
    assert [(t.dst, round(t.start * 1e3, 6), round(t.end * 1e3, 6)) for t in r.transfers] == [(1, 1, 3), (2, 3, 5)]
    assert r.step_time == pytest.approx(8e-3)


def test_simulator_contention_by_hand():
    """Two devices of one host with contention 0.5 run at 1/1.5 while both compute (processor sharing)."""
    nodes = [h.make_node("Relu", ["x"], ["a"], name="A"), h.make_node("Neg", ["x"], ["b"], name="B")]
    g = build_graph(graph_model(nodes, [vinfo("x", [N])], [vinfo("a", [N]), vinfo("b", [N])], []))
    shared = make_devices(2, host="local", contention=0.5)
    r = simulate(g, hand_costs(g, {"A": 1, "B": 2}, shared), [0, 1], "op")
    # both at rate 2/3: A's 1 ms of work ends at 1.5; B has done 1 ms, its last 1 ms at full speed: ends at 2.5
    assert r.end == pytest.approx([1.5e-3, 2.5e-3]) and r.step_time == pytest.approx(2.5e-3)
    assert r.busy == pytest.approx([1.5e-3, 2.5e-3])
    apart = make_devices(2, contention=0.5)  # no shared host: independent
    assert simulate(g, hand_costs(g, {"A": 1, "B": 2}, apart), [0, 1], "op").step_time == pytest.approx(2e-3)


def test_simulated_memory_by_hand():
    """Diamond on one device: x (input) held all step; a live from A's start to the end of B and C; b, c until D;
    y (graph output) until the end. Peak: x + a + b + c = 16000 bytes (during C, before B's b is freed)."""
    g = diamond()
    devs = make_devices(1)
    r = simulate(g, hand_costs(g, {"A": 1, "B": 1, "C": 1, "D": 1}, devs), [0] * 4, "op")
    assert r.peak_memory == [16000]
    assert r.static_memory == [20000]  # the placer's bound keeps every tensor: x, a, b, c, y


# ---------------------------------------------------------------- placers and memory
def wide_graph(branches: int = 6, width: int = 64):
    """x -> MatMul with its own weight per branch -> Add of all branches: parallel work with weights."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for k in range(branches):
        inits.append(h.make_tensor(f"w{k}", TP.FLOAT, [width, width], rng.standard_normal(width * width).tolist()))
        nodes.append(h.make_node("MatMul", ["x", f"w{k}"], [f"m{k}"], name=f"mm{k}"))
    acc = "m0"
    for k in range(1, branches):
        nodes.append(h.make_node("Add", [acc, f"m{k}"], [f"s{k}"], name=f"add{k}"))
        acc = f"s{k}"
    nodes.append(h.make_node("Identity", [acc], ["y"], name="out"))
    return build_graph(graph_model(nodes, [vinfo("x", ["N", width])], [vinfo("y", ["N", width])], inits),
                       batch_size=32, label="wide")


def test_greedy_parallelises_branches_and_heft_too():
    g = wide_graph()
    devs = make_devices(2, flops="1GFLOP/s", latency="1us", bandwidth="100GB/s")
    costs = cost_table(g, devs)
    one = simulate(g, costs, [0] * len(g), "op").step_time
    for p in (greedy_placement(g, costs, "topo"), heft_placement(g, costs)):
        assert p.devices_used() == 2
        assert simulate(g, costs, p, "op").step_time < 0.75 * one


@pytest.mark.parametrize("order", ORDER_NAMES)
@pytest.mark.parametrize("fraction", [0.3, 0.45, 0.7])
def test_placements_never_exceed_device_memory(order, fraction):
    g = wide_graph()
    total = placement_memory(g, [0] * len(g), 1)[0]
    devs = make_devices(3, memory=fraction * total, flops="1GFLOP/s")
    costs = cost_table(g, devs)
    try:
        p = place(g, costs, "greedy", order)
    except PlacementError as e:
        assert "smallest memory per device" in str(e)
        return
    used = placement_memory(g, p.device_of, 3)
    sim = simulate(g, costs, p)
    assert max(used) <= fraction * total and max(sim.peak_memory) <= fraction * total


def test_model_that_cannot_fit_names_the_smallest_memory():
    g = wide_graph()
    weight = 64 * 64 * 4
    devs = make_devices(2, memory=weight, flops="1GFLOP/s")  # one weight fits, with nothing else
    with pytest.raises(PlacementError) as e:
        place(g, cost_table(g, devs), "heft")
    msg = str(e.value)
    assert "does not fit on 2 device(s)" in msg and "smallest memory per device" in msg and "memory=" in msg
    need = msg.split("memory=")[1].split(" ")[0].strip("'")
    ok = make_devices(2, memory=need, flops="1GFLOP/s")
    p = place(g, cost_table(g, ok), "heft")
    assert max(placement_memory(g, p.device_of, 2)) <= parse_size(need)


def test_training_memory_counts_gradients_and_optimizer_state():
    g = wide_graph()
    t = build_graph(g.model, batch_size=32, training=True, optimizer="adamw")
    w = g.weight_bytes
    assert placement_memory(t, [0] * len(t), 1)[0] - placement_memory(g, [0] * len(g), 1)[0] == pytest.approx(3 * w)


# ---------------------------------------------------------------- devices
def test_units():
    assert parse_size("16GiB") == 16 * 2 ** 30 and parse_size("1.5MB") == 1.5e6 and math.isinf(parse_size("inf"))
    assert parse_rate("10GB/s") == 1e10 and parse_rate("20TFLOP/s") == 2e13 and parse_rate(5e9) == 5e9
    assert parse_time("20us") == pytest.approx(2e-5) and parse_time("1.5ms") == pytest.approx(1.5e-3)
    with pytest.raises(ConfigError, match="not a size"):
        parse_size("lots")


def test_device_spec_yaml(tmp_path):
    f = tmp_path / "devices.yaml"
    f.write_text("defaults: {memory: 8GiB, bandwidth: 12GB/s, latency: 10us}\n"
                 "devices:\n  - {name: gpu0, kind: cuda, device_id: 0}\n"
                 "  - {name: small, memory: 1GiB, flops: 1TFLOP/s}\n  - {name: cpu, count: 2, threads: 2}\n")
    devs = load_device_spec(f)
    assert [d.name for d in devs] == ["gpu0", "small", "cpu0", "cpu1"]
    assert devs[1].memory == 2 ** 30 and devs[0].memory == 8 * 2 ** 30 and devs[2].threads == 2
    assert devs[0].latency == pytest.approx(1e-5) and devs[3].bandwidth == 1.2e10
    with pytest.raises(ConfigError, match="count=3 but device spec"):
        load_device_spec(f, count=3)
    f.write_text("devices:\n  - {name: a, colour: red}\n")
    with pytest.raises(ConfigError, match="unknown device field 'colour'"):
        load_device_spec(f)


# ---------------------------------------------------------------- calibration fit
def test_fit_calibration_recovers_known_overheads():
    c, o, s, lat, bw = 30e-6, 2e-6, 1.1, 40e-6, 5e9
    kernels, nodes = 4e-3, 50
    handoff = [(b, c + lat + b / bw) for b in (1024.0, 4 * 2 ** 20)]
    cal = fit_calibration(c + o, c + 64 * o, 64, c + s * kernels + nodes * o, kernels, nodes, handoff)
    assert cal.call_overhead == pytest.approx(c) and cal.op_overhead == pytest.approx(o)
    assert cal.kernel_scale == pytest.approx(s) and cal.latency == pytest.approx(lat)
    assert cal.bandwidth == pytest.approx(bw)
    dev = cal.apply([DeviceSpec()])[0]
    assert dev.speed == pytest.approx(1 / s) and dev.call_overhead == pytest.approx(c)
    # noise that makes a fit negative is clamped, never a negative cost
    # (chain faster than one node: o < 0; hand-off faster than a call: latency < 0; larger hand-off faster: no
    # bandwidth to fit, a free link; kernels slower than the whole model: s < 0.5; contention outside [0, 1])
    bad = fit_calibration(50e-6, 40e-6, 64, 1e-3, 4e-3, 10, [(1024.0, 1e-6), (4e6, 0.5e-6)], contention=1.7)
    assert bad.op_overhead == 0 and bad.call_overhead == pytest.approx(50e-6) and bad.latency == 0
    assert bad.kernel_scale == 0.5 and bad.bandwidth >= 1e12 and bad.contention == 1.0
    assert fit_calibration(50e-6, 40e-6, 64, 1e-3, 4e-3, 10, contention=-0.3).contention == 0.0


def test_gantt_rows_are_the_used_devices_and_links_and_every_bar_kind_is_in_the_legend(tmp_path):
    """Three devices, the diamond on two of them (stages dev0 {A, B} | dev1 {C} | dev0 {D}), two measured calls
    on device 0: a row per used device's simulated compute, measured calls and link, none for the idle device
    or an idle link; the legend (below the chart, over none of it) names the op types, the call overhead, the
    measured calls and each transfer's destination."""
    from onnxfuse.core._plot import data_overlap
    from onnxfuse.placement.gantt import gantt_figure, gantt_png

    g = diamond()
    devs = make_devices(3, call_overhead="0.5ms", **LINK)
    sim = simulate(g, hand_costs(g, {"A": 1, "B": 3, "C": 3, "D": 1}, devs), [0, 0, 1, 0], "stage")
    measured = [(0, 0, 0.0001, 0.005), (1, 1, 0.0065, 0.0101), (0, 2, 0.012, 0.0136)]
    fig = gantt_figure(g, sim, devs, "diamond", measured, measured_step=0.0137)
    (ax,) = fig.axes
    names = [t.get_text().replace("\n", " ") for t in ax.get_yticklabels()]
    assert names == ["cpu0 simulated", "cpu0 measured", "cpu0 link simulated", "cpu1 simulated", "cpu1 measured",
                     "cpu1 link simulated"]
    rows_drawn = {round(p.get_y() + p.get_height() / 2) for p in ax.patches}
    assert rows_drawn == set(range(len(names)))  # no empty row
    legend = fig.legends[0]
    labels = [t.get_text() for t in legend.get_texts()]
    assert {"Relu", "Neg", "Abs", "Add", "session call overhead (calibrated)", "measured session call",
            "transfer to cpu0", "transfer to cpu1"} == set(labels)
    assert data_overlap(fig, legend, ax) == 0
    assert "measured 13.700 ms (median)" in ax.get_title() and "simulated step 13.500 ms" in ax.get_title()
    assert gantt_png(g, sim, devs, str(tmp_path / "gantt.png")) and (tmp_path / "gantt.png").stat().st_size > 5000
