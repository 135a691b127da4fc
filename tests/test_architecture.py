"""The package's shape: no import cycles, and each layer imports only the layers below it
(exporters -> core -> runtimes / placement -> sweep -> integrations -> CLI; see docs/architecture.md).

Imports are read from the source (``ast``), function-level ones included, ``if TYPE_CHECKING:`` blocks excluded
(they never run). ``from package import name`` counts as an import of ``package.name`` when that is a module."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
PACKAGES = {"onnxfuse": "onnxfuse", "onnxfuse.rules": "onnxfuse/rules", "onnxfuse.legalize": "onnxfuse/legalize",
            "onnxfuse.placement": "onnxfuse/placement", "onnxfuse.training": "training",
            "onnxfuse.exporters": "exporters", "onnxfuse.sweep": "onnxfuse/sweep",
            "onnxfuse.integrations": "onnxfuse/integrations"}


def _modules() -> dict[str, str]:
    found = {}
    for package, folder in PACKAGES.items():
        for f in sorted(os.listdir(os.path.join(ROOT, folder))):
            if f.endswith(".py"):
                found[package if f == "__init__.py" else f"{package}.{f[:-3]}"] = os.path.join(ROOT, folder, f)
    return found


MODULES = _modules()


def _imports(module: str, path: str) -> set[str]:
    """Every module ``module`` imports (any module, not only onnxfuse's), wherever the import statement is."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                    (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                for n in node.orelse:
                    self.visit(n)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for a in node.names:
                found.add(f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source)

    Visitor().visit(tree)
    return found


IMPORTS = {m: _imports(m, p) for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_walk_sees_the_package():
    assert len(MODULES) > 80 and "onnxfuse.engine" in MODULES and "onnxfuse.training.run" in MODULES
    assert "onnxfuse.placement.partition" in IMPORTS["onnxfuse.placement.execute"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    internal = {m: {i for i in imports if i in MODULES} for m, imports in IMPORTS.items()}
    assert _cycles(internal) == []


def _layer(module: str) -> str:
    parts = module.split(".")
    if module in ("onnxfuse.cli", "onnxfuse.__main__") or module.endswith("._cli"):
        return "cli"
    if len(parts) > 1 and parts[1] in ("training", "placement", "exporters", "sweep", "integrations"):
        return parts[1]
    return "core"


# what each layer may import (besides itself); the CLI may import everything
ALLOWED = {"core": {"core"}, "exporters": {"core"}, "training": {"core", "exporters"},
           "placement": {"core"}, "sweep": {"core", "exporters", "training"},
           "integrations": {"core", "sweep"},
           "cli": {"core", "exporters", "training", "placement", "sweep", "cli"}}
# third-party packages only the layers that run or export (or distribute) may import
RUNTIMES = {"torch": {"exporters", "training", "sweep"}, "onnxruntime": {"training", "placement", "cli"},
            "ray": {"sweep", "integrations"}, "optuna": {"integrations"}}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_layer_imports_only_the_layers_below_it(module):
    layer = _layer(module)
    for imported in sorted(IMPORTS[module]):
        if imported in MODULES:
            assert _layer(imported) in ALLOWED[layer] | {layer}, f"{module} ({layer}) imports {imported}"
        top = imported.split(".")[0]
        if top in RUNTIMES:
            assert layer in RUNTIMES[top], f"{module} ({layer}) imports {imported}"


def test_the_engine_imports_no_rule_and_placements_data_model_not_its_executor():
    assert not {i for i in IMPORTS["onnxfuse.engine"] if i.startswith("onnxfuse.rules")}
    data_model = ["graph", "devices", "orders", "costs", "placers", "partition", "simulate", "shard"]
    runners = {"onnxfuse.placement.execute", "onnxfuse.placement.profile"}
    for name in data_model:
        assert not IMPORTS[f"onnxfuse.placement.{name}"] & runners, name
    # the one session helper the data model uses (graph.py measures shapes inference cannot give) is a leaf
    assert {i for i in IMPORTS["onnxfuse.placement.session"] if i in MODULES} <= {
        "onnxfuse.errors", "onnxfuse.placement.devices"}
