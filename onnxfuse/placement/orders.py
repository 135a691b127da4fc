"""Traversal orders: the sequence in which a sequential placer visits a graph's nodes.

Wang et al. (arXiv 2201.09676) compare these orders for sequential device placement; each function here takes a
:class:`Dag` and returns every node index exactly once. All are deterministic: wherever a choice is free (which
ready node next, which child first, which root first) the lowest original node index goes first, except in the
two name-based orders, which compare names and fall back to the index. A cycle raises :class:`CycleError`
naming the nodes on it (iterative code throughout: no RecursionError on deep graphs).

=======================  ===========================================================================
``topo``                 Kahn's algorithm; among ready nodes the lowest index first. For an ONNX graph
                         (whose nodes are stored topologically sorted) this is the file order.
``reversed_topo``        ``topo`` reversed: sinks first.
``lexicographic_topo``   Kahn's algorithm; among ready nodes the smallest name first.
``dfs_preorder``         depth-first from every source (in-degree 0) in index order, children in index
                         order; a node is listed when first reached.
``dfs_postorder``        the same search; a node is listed when all its children are finished.
``reversed_postorder``   ``dfs_postorder`` reversed: a topological order that keeps a branch together.
``bfs``                  breadth-first from each source in index order, each search on its own (as
                         networkx.bfs_edges), concatenated, duplicates removed (first occurrence kept).
``by_name``              sorted by node name (the paper's "alpha"); ties by index.
=======================  ===========================================================================

The paper sorts BFS sources by name; here they go by index like every other tie, so that ``bfs`` differs from
``by_name``-influenced orders only where the graph makes it differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from onnxfuse.core._graph import CycleError as GraphCycleError
from onnxfuse.core._graph import topological_order
from onnxfuse.core.errors import PlacementError

__all__ = ["Dag", "CycleError", "ORDERS", "ORDER_NAMES", "traversal_order", "check_acyclic",
           "topological", "reversed_topological", "lexicographic_topological", "dfs_preorder", "dfs_postorder",
           "reversed_postorder", "bfs", "by_name"]


class CycleError(PlacementError, GraphCycleError):
    """The graph has a cycle, so no traversal order (and no placement) exists."""


@dataclass(frozen=True)
class Dag:
    """Nodes 0..n-1 with names, and sorted, duplicate-free successor and predecessor lists."""

    names: tuple[str, ...]
    succs: tuple[tuple[int, ...], ...]
    preds: tuple[tuple[int, ...], ...]

    @classmethod
    def from_edges(cls, nodes: int | Sequence[str], edges: Iterable[tuple[int, int]]) -> "Dag":
        """``Dag.from_edges(["a", "b", "c"], [(0, 1), (0, 2)])``; an int gives names '0', '1', ..."""
        names = tuple(str(k) for k in range(nodes)) if isinstance(nodes, int) else tuple(nodes)
        n = len(names)
        succ: list[set[int]] = [set() for _ in range(n)]
        pred: list[set[int]] = [set() for _ in range(n)]
        for a, b in edges:
            if not (0 <= a < n and 0 <= b < n):
                raise ValueError(f"edge ({a}, {b}) names a node outside 0..{n - 1}")
            succ[a].add(b)
            pred[b].add(a)
        return cls(names, tuple(tuple(sorted(s)) for s in succ), tuple(tuple(sorted(p)) for p in pred))

    def __len__(self) -> int:
        return len(self.names)

    @property
    def sources(self) -> list[int]:
        return [i for i in range(len(self)) if not self.preds[i]]


def _kahn(dag: Dag, key: Callable[[int], object]) -> list[int]:
    """Kahn's algorithm (the graph layer's one topological order), the ready node with the smallest key first;
    raises CycleError naming the nodes on a cycle."""
    try:
        return topological_order(dag.preds, key, dag.names)
    except GraphCycleError as e:
        raise CycleError(f"{e}; a computation graph must be acyclic (check the model with onnx.checker and "
                         "re-export it)") from None


def check_acyclic(dag: Dag) -> None:
    """Raise CycleError (naming the nodes on a cycle) unless the graph is a DAG."""
    _kahn(dag, key=lambda i: i)


def topological(dag: Dag) -> list[int]:
    """Kahn's order, ready nodes by lowest index."""
    return _kahn(dag, key=lambda i: i)


def reversed_topological(dag: Dag) -> list[int]:
    """``topological`` reversed."""
    return topological(dag)[::-1]


def lexicographic_topological(dag: Dag) -> list[int]:
    """Kahn's order, ready nodes by smallest (name, index)."""
    return _kahn(dag, key=lambda i: (dag.names[i], i))


def _dfs(dag: Dag) -> tuple[list[int], list[int]]:
    """One depth-first search from every source in index order: (preorder, postorder)."""
    check_acyclic(dag)
    visited = [False] * len(dag)
    pre: list[int] = []
    post: list[int] = []
    for root in dag.sources:
        if visited[root]:
            continue
        visited[root] = True
        pre.append(root)
        stack = [(root, 0)]  # (node, index of the next child to try)
        while stack:
            node, k = stack[-1]
            children = dag.succs[node]
            while k < len(children) and visited[children[k]]:
                k += 1
            if k == len(children):
                stack.pop()
                post.append(node)
                continue
            stack[-1] = (node, k + 1)
            child = children[k]
            visited[child] = True
            pre.append(child)
            stack.append((child, 0))
    return pre, post


def dfs_preorder(dag: Dag) -> list[int]:
    """Depth-first preorder from every source in index order, children in index order."""
    return _dfs(dag)[0]


def dfs_postorder(dag: Dag) -> list[int]:
    """Depth-first postorder (children finished first) of the same search."""
    return _dfs(dag)[1]


def reversed_postorder(dag: Dag) -> list[int]:
    """``dfs_postorder`` reversed: topological, and a branch stays contiguous."""
    return _dfs(dag)[1][::-1]


def bfs(dag: Dag) -> list[int]:
    """Breadth-first from each source (index order), each search with its own visited set, concatenated,
    first occurrences kept."""
    check_acyclic(dag)
    seen_global = [False] * len(dag)
    order: list[int] = []
    for root in dag.sources:
        seen = {root}
        frontier = [root]
        while frontier:
            nxt = []
            for node in frontier:
                if not seen_global[node]:
                    seen_global[node] = True
                    order.append(node)
                for child in dag.succs[node]:
                    if child not in seen:
                        seen.add(child)
                        nxt.append(child)
            frontier = nxt
    return order


def by_name(dag: Dag) -> list[int]:
    """Sorted by (name, index); not topological in general."""
    check_acyclic(dag)
    return sorted(range(len(dag)), key=lambda i: (dag.names[i], i))


ORDERS: dict[str, Callable[[Dag], list[int]]] = {
    "topo": topological,
    "reversed_topo": reversed_topological,
    "lexicographic_topo": lexicographic_topological,
    "dfs_preorder": dfs_preorder,
    "dfs_postorder": dfs_postorder,
    "reversed_postorder": reversed_postorder,
    "bfs": bfs,
    "by_name": by_name,
}
ORDER_NAMES = list(ORDERS)
_ALIASES = {"alpha": "by_name", "name": "by_name", "lex_topo": "lexicographic_topo", "topological": "topo",
            "reversed_topological": "reversed_topo"}


def traversal_order(dag: Dag, name: str) -> list[int]:
    """The named order (see ORDERS; 'alpha', 'lex_topo' are accepted aliases)."""
    key = _ALIASES.get(name, name)
    if key not in ORDERS:
        from onnxfuse.core.errors import ConfigError

        raise ConfigError(f"unknown traversal order '{name}'; choose from {', '.join(ORDER_NAMES)} (or 'all')")
    return ORDERS[key](dag)
