"""The graph layer under the core, the legalization, the training graph and placement: which node reads and writes
each tensor, topological order, dead-node cleanup, unique names, and emitting nodes and constants.

One implementation of each, on ``onnx`` protos as they are (no conversion to another IR and back):

    node_label(node)             how messages and reports name a node: its name, else its first output
    reads(node)                  the names a node reads, its subgraphs' outer-scope reads included
    producers / dependencies     tensor -> (node, output); node -> the nodes it reads from
    last_readers(steps, keep)    liveness: after which step each value is last needed (freed after it)
    topological_order(preds)     Kahn's algorithm, the ready node with the smallest key first (default: its index);
                                 a cycle raises CycleError naming the nodes on it. Identity's canonical order, the
                                 fused graph's order and placement's traversal orders are all this one function
    live_nodes, cleanup_pass     dead-node and unused-initializer removal
    toposort_pass                the graph's nodes in topological order, ties by file position
    name_nodes                   a unique, non-empty name for every node
    Names                        fresh unique names: ``hint``, else ``hint_1``, ``hint_2`` ...
    Emitter                      appends nodes and constant initializers under fresh names, with the opset-dependent
                                 forms (axes as an attribute or an input) chosen in one place

Why not onnx-ir or onnx-graphsurgeon (compared in docs/architecture.md): neither sort takes a key, and both order
differently (onnx-ir's ``Graph.sort`` pops the latest ready node from the sinks up; graphsurgeon's ``toposort`` sorts
by depth from the inputs, recursively, so a long chain reaches Python's recursion limit); onnx-ir's
``RemoveUnusedNodesPass`` also drops unused optional outputs (the Mean and InvStdDev outputs the legalization adds
to a LayerNormalization on purpose, Dropout's mask), and both need a round trip through their own IR.
"""
from __future__ import annotations

import heapq
import re
from typing import Callable, Collection, Hashable, Iterable, Iterator, Sequence, TypeVar

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["CycleError", "node_label", "subgraphs", "all_nodes", "reads", "outer_reads", "rename_outer",
           "rename_subgraph_reads", "producers", "dependencies", "last_readers", "topological_order", "live_nodes",
           "cleanup_pass", "toposort_pass", "name_nodes", "Names", "Emitter"]


class CycleError(ValueError):
    """The graph has a cycle: no topological order exists."""


def node_label(node: onnx.NodeProto) -> str:
    """How messages and reports name ``node``: its name, else its first output's name (unique in a graph, as every
    output is), else ``<unnamed OpType>`` (a node with no named output)."""
    return node.name or next((o for o in node.output if o), f"<unnamed {node.op_type}>")


# ---------------------------------------------------------------------------------------------------- subgraphs
def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs ``node``'s attributes hold (If branches, Loop and Scan bodies)."""
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))]


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph`` and, after each, those of its subgraphs, however deep."""
    for node in graph.node:
        yield node
        for g in subgraphs(node):
            yield from all_nodes(g)


# ---------------------------------------------------------------------------------------------------- who reads what
def outer_reads(node: onnx.NodeProto) -> list[str]:
    """The outer-scope names ``node``'s subgraphs (If, Loop, Scan bodies) read: dependencies not in ``node.input``."""
    found: list[str] = []
    for g in subgraphs(node):
        local = {i.name for i in g.input} | {t.name for t in g.initializer}
        for n in g.node:
            for t in list(n.input) + outer_reads(n):
                if t and t not in local and t not in found:
                    found.append(t)
            local.update(n.output)
    return found


def rename_outer(graph: onnx.GraphProto, mapping: dict[str, str]) -> onnx.GraphProto:
    """A copy of subgraph ``graph`` whose reads of outer-scope names (not its own inputs, initializers or node
    outputs: those shadow them) are renamed by ``mapping``, in its nested subgraphs too."""
    out = onnx.GraphProto()
    out.CopyFrom(graph)
    local = {i.name for i in out.input} | {t.name for t in out.initializer}
    for n in out.node:
        n.input[:] = [mapping.get(t, t) if t and t not in local else t for t in n.input]
        rename_subgraph_reads(n, {k: v for k, v in mapping.items() if k not in local})
        local.update(n.output)
    return out


def rename_subgraph_reads(node: onnx.NodeProto, mapping: dict[str, str]) -> None:
    """In place: what ``node``'s subgraphs read from outside them, renamed by ``mapping`` (:func:`rename_outer`)."""
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            a.g.CopyFrom(rename_outer(a.g, mapping))
        elif a.type == onnx.AttributeProto.GRAPHS:
            renamed = [rename_outer(g, mapping) for g in a.graphs]
            del a.graphs[:]
            a.graphs.extend(renamed)


def reads(node: onnx.NodeProto) -> list[str]:
    """Every name ``node`` reads: its inputs (``""`` for an absent optional one) and its subgraphs' outer reads."""
    return list(node.input) + outer_reads(node)


def producers(nodes: Sequence[onnx.NodeProto]) -> dict[str, tuple[int, int]]:
    """tensor -> (index of the node that writes it, output position)."""
    return {o: (i, j) for i, n in enumerate(nodes) for j, o in enumerate(n.output) if o}


def dependencies(nodes: Sequence[onnx.NodeProto]) -> list[set[int]]:
    """For every node, the indices of the nodes whose outputs it reads."""
    made = producers(nodes)
    return [{made[t][0] for t in reads(n) if t in made} for n in nodes]


V = TypeVar("V", bound=Hashable)


def _node_io(node: onnx.NodeProto) -> tuple[Iterable[str], Iterable[str]]:
    return reads(node), node.output


def last_readers(steps: Iterable, keep: Collection = (),
                 io: Callable[[object], tuple[Iterable[V], Iterable[V]]] = _node_io) -> dict[V, int]:
    """Liveness of a program run in order: for every value a step writes, the index of the last step that needs it
    (its last reader, or its writer when no later step reads it), after which it can be freed. Values in ``keep``
    (graph outputs) and values no step writes (inputs, weights) are left out; ``""`` (an absent input or output)
    too. ``steps`` are ONNX nodes in execution order by default; ``io(step)`` gives a step's (reads, writes).

    One owner of "free after the last reader": the torch runtime's program (over its slots) and the memory
    estimate's walk (over a graph's nodes) both ask it."""
    last: dict = {}
    for k, step in enumerate(steps):
        ins, outs = io(step)
        for v in ins:
            if v in last:
                last[v] = k
        for v in outs:
            if v != "" and v not in keep:
                last[v] = k
    return last


# --------------------------------------------------------------------------------------------------------- ordering
def topological_order(preds: Sequence[Collection[int]], key: Callable[[int], object] | None = None,
                      names: Sequence[str] | None = None) -> list[int]:
    """Kahn's algorithm over nodes 0..n-1 whose predecessors are ``preds[i]``: among the ready nodes the one with
    the smallest ``key(i)`` first (default: the smallest index), so the order is deterministic. A cycle raises
    :class:`CycleError` naming the nodes on one (``names``, default their indices); iterative, so deep graphs
    never hit the recursion limit."""
    n = len(preds)
    rank = key if key is not None else (lambda i: i)
    succs: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for i, ps in enumerate(preds):
        for p in set(ps):
            if p != i:
                succs[p].append(i)
                indeg[i] += 1
            else:
                indeg[i] += 1  # a node reading itself is a cycle of one
    ready = [(rank(i), i) for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for s in succs[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(ready, (rank(s), s))
    if len(order) != n:
        raise CycleError(_describe_cycle(preds, set(range(n)) - set(order), names))
    return order


def _describe_cycle(preds: Sequence[Collection[int]], stuck: set[int], names: Sequence[str] | None) -> str:
    """Walk predecessors inside the nodes Kahn could not order until a node repeats: that loop is a cycle."""
    i = min(stuck)
    seen: dict[int, int] = {}
    path: list[int] = []
    while i not in seen:
        seen[i] = len(path)
        path.append(i)
        i = min(p for p in preds[i] if p in stuck)  # every stuck node has a stuck predecessor
    cycle = list(reversed(path[seen[i]:]))
    k = cycle.index(min(cycle))  # start the loop at its lowest node index
    cycle = cycle[k:] + cycle[:k]
    label = (lambda j: f"'{names[j]}'") if names is not None else str
    return f"the graph has a cycle: {' -> '.join(label(j) for j in cycle + cycle[:1])}"


def toposort_pass(model: onnx.ModelProto) -> onnx.ModelProto:
    """Order the nodes topologically, in place; ties keep the original node order. A cycle raises CycleError."""
    g = model.graph
    nodes = list(g.node)
    order = topological_order(dependencies(nodes), names=[node_label(n) for n in nodes])
    del g.node[:]
    g.node.extend(nodes[i] for i in order)
    return model


# ---------------------------------------------------------------------------------------------------------- cleanup
def live_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes of ``graph`` that some graph output depends on, in graph order (dead code dropped)."""
    needed = {o.name for o in graph.output}
    keep = []
    for n in reversed(list(graph.node)):
        if any(o in needed for o in n.output if o):
            keep.append(n)
            needed.update(t for t in reads(n) if t)
    return keep[::-1]


def cleanup_pass(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop nodes none of whose outputs is used (e.g. a layout change a rule made but did not need) and the
    initializers nothing reads, in place. Nodes keep all their outputs, used or not."""
    g = model.graph
    keep = live_nodes(g)
    used = {t for n in keep for t in reads(n)} | {o.name for o in g.output}
    inits = [t for t in g.initializer if t.name in used]
    del g.node[:]
    g.node.extend(keep)
    del g.initializer[:]
    g.initializer.extend(inits)
    return model


# ------------------------------------------------------------------------------------------------------------ names
def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every node a unique, non-empty name ('{op}_{index}' where missing or repeated), in place."""
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        name = node.name
        if not name or name in seen:
            name = f"{node.op_type}_{i}"
            while name in seen:
                name += "_"
            node.name = name
        seen.add(name)
    return model


def graph_names(graph: onnx.GraphProto) -> set[str]:
    """Every name in use in ``graph``: values, initializers and nodes."""
    taken = {t.name for t in graph.initializer}
    taken.update(vi.name for vi in list(graph.input) + list(graph.output) + list(graph.value_info))
    for n in graph.node:
        taken.update(n.input)
        taken.update(n.output)
        taken.add(n.name)
    taken.discard("")
    return taken


class Names:
    """Fresh names in one graph: ``fresh(hint)`` is the hint (characters outside ``[A-Za-z0-9_./:-]`` made ``_``)
    when it is free, else the first free of ``hint_1``, ``hint_2`` ...; every name it returns is then taken."""

    def __init__(self, taken: Iterable[str] = ()):
        self.taken = set(taken)

    @classmethod
    def of(cls, graph: onnx.GraphProto) -> "Names":
        return cls(graph_names(graph))

    def fresh(self, hint: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_./:-]", "_", hint) or "t"
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name


# --------------------------------------------------------------------------------------------------------- emitting
class Emitter:
    """Appends nodes and constant initializers under fresh names (``prefix`` + a hint), and chooses the forms that
    depend on the opset: Unsqueeze/Squeeze axes an input from opset 13, Reduce* axes an input from opset 18
    (ReduceSum: 13). ``nodes`` and ``initializers`` collect what was emitted (``initializers`` may be a list shared
    by several emitters); :meth:`flush` appends both to a graph."""

    def __init__(self, names: Names, opset: int, prefix: str = "",
                 initializers: list[onnx.TensorProto] | None = None):
        self.names, self.opset, self.prefix = names, opset, prefix
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = [] if initializers is None else initializers

    def emit(self, op_type: str, inputs: Sequence[str], outputs: int | Sequence[str] = 1, domain: str = "",
             **attrs) -> list[str]:
        """Append one node; returns its output names (``outputs`` given, or that many fresh ones)."""
        outs = ([self.names.fresh(f"{self.prefix}{op_type}_output") for _ in range(outputs)]
                if isinstance(outputs, int) else list(outputs))
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.names.fresh(f"{self.prefix}{op_type}"),
                                           domain=domain, **attrs))
        return outs

    def one(self, op_type: str, inputs: Sequence[str], output: str | None = None, domain: str = "", **attrs) -> str:
        """Append a node with one output (named ``output``, or fresh) and return it."""
        return self.emit(op_type, inputs, [output] if output else 1, domain=domain, **attrs)[0]

    def const(self, value, dtype, hint: str = "const") -> str:
        """A constant initializer of ``value`` as ``dtype``."""
        name = self.names.fresh(f"{self.prefix}{hint}")
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def unsqueeze(self, x: str, axes: Sequence[int], output: str | None = None) -> str:
        if self.opset >= 13:
            return self.one("Unsqueeze", [x, self.const(list(axes), np.int64, "axes")], output)
        return self.one("Unsqueeze", [x], output, axes=list(axes))

    def squeeze(self, x: str, axes: Sequence[int], output: str | None = None) -> str:
        if self.opset >= 13:
            return self.one("Squeeze", [x, self.const(list(axes), np.int64, "axes")], output)
        return self.one("Squeeze", [x], output, axes=list(axes))

    def reduce(self, op_type: str, x: str, axes: Sequence[int] | None, keepdims: int = 0,
               output: str | None = None) -> str:
        """Reduce* over ``axes`` (None: all): an input from opset 18 (ReduceSum: 13), an attribute before."""
        if axes is None:
            return self.one(op_type, [x], output, keepdims=keepdims)
        if self.opset >= (13 if op_type == "ReduceSum" else 18):
            return self.one(op_type, [x, self.const(list(axes), np.int64, "axes")], output, keepdims=keepdims)
        return self.one(op_type, [x], output, axes=list(axes), keepdims=keepdims)

    def flush(self, graph: onnx.GraphProto) -> None:
        """Append the emitted nodes and initializers to ``graph`` (nodes after the graph's own)."""
        graph.node.extend(self.nodes)
        graph.initializer.extend(self.initializers)
        self.nodes, self.initializers = [], []
