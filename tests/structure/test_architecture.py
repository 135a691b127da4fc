"""The package's shape, read from its folders: every module lives in ``onnxfuse/<layer>/``, the layers are the ones
docs/architecture.md lists, in its order, and a module imports only modules of its own layer or of layers before
it, and no import cycles -- function-level imports and ``if TYPE_CHECKING:`` blocks included in both; no two modules
share a file name, except the op-family catalogs (the files of a layer's sub-packages: ``core/rules/``,
``runtime/ort/legalize/``).

Imports are read from the source (``ast``). ``from package import name`` counts as an import of ``package.name``
when that is a module."""
from __future__ import annotations

import ast
import os
import re

import pytest

from tests.conftest import ROOT

PACKAGE = os.path.join(ROOT, "onnxfuse")


def _layers_of_the_document() -> list[str]:
    """The layer folders docs/architecture.md's "Layers" diagram names, first (lowest) to last."""
    text = open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8").read()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    return [m.group(1) for m in re.finditer(r"^onnxfuse/(\w+)/", block, re.M)]


LAYERS = _layers_of_the_document()


def _modules() -> dict[str, str]:
    found = {}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        rel = os.path.relpath(folder, ROOT).replace(os.sep, "/").split("/")
        for f in sorted(files):
            if f.endswith(".py"):
                found[".".join(rel) if f == "__init__.py" else ".".join(rel + [f[:-3]])] = os.path.join(folder, f)
    return found


MODULES = _modules()


def layer(module: str) -> str | None:
    """The layer a module is in: the folder under ``onnxfuse/`` (None for the package's face, ``onnxfuse`` and
    ``onnxfuse.__main__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def _imports(module: str, source: str, is_package: bool = False) -> set[str]:
    """Every module ``module`` (whose text is ``source``) imports (any module, not only onnxfuse's), wherever the
    import statement is: at the top, inside a function, under ``if TYPE_CHECKING:``."""
    tree = ast.parse(source)
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                source_module = ".".join(base + ([node.module] if node.module else []))
            else:
                source_module = node.module
            for a in node.names:
                found.add(f"{source_module}.{a.name}" if f"{source_module}.{a.name}" in MODULES else source_module)
    return found


IMPORTS = {m: _imports(m, open(p, encoding="utf-8").read(), p.endswith("__init__.py")) for m, p in MODULES.items()}


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
    assert len(MODULES) > 100 and "onnxfuse.core.engine" in MODULES and "onnxfuse.training.run" in MODULES
    assert "onnxfuse.placement.partition" in IMPORTS["onnxfuse.placement.execute"]
    assert layer("onnxfuse.core.rules.conv") == "core" and layer("onnxfuse.cli") == "cli"
    assert layer("onnxfuse") is None and layer("onnxfuse.__main__") is None
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # a TYPE_CHECKING import and one inside a function are imports like any other
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from onnxfuse.core.engine import NodeGroup\n"
              "def f():\n    from .. import _graph\n    import onnx.helper\n")
    assert _imports("onnxfuse.core.rules._common", source) == {
        "typing", "onnxfuse.core.engine", "onnxfuse.core._graph", "onnx.helper"}
    assert _imports("onnxfuse.core", "from . import engine\n", is_package=True) == {"onnxfuse.core.engine"}


def test_the_folders_are_the_layers_of_the_document():
    folders = sorted(d for d in os.listdir(PACKAGE)
                     if os.path.isfile(os.path.join(PACKAGE, d, "__init__.py")))
    assert LAYERS[0] == "core" and LAYERS[-1] == "cli" and len(set(LAYERS)) == len(LAYERS)
    assert sorted(LAYERS) == folders
    loose = sorted(f for f in os.listdir(PACKAGE) if f.endswith(".py"))
    assert loose == ["__init__.py", "__main__.py"], "every module lives in a layer folder"


# Import cycles still to be undone, each a set of modules; a cycle found must lie inside one of them.
KNOWN_CYCLES: list[set[str]] = []


def test_no_import_cycles():
    """No cycle among the package's modules, counting every import: type-only (``if TYPE_CHECKING:``) and inside a
    function too, since each says one module needs the other."""
    internal = {m: {i for i in imports if i in MODULES} for m, imports in IMPORTS.items()}
    cycles = _cycles(internal)
    assert [c for c in cycles if not any(set(c) <= known for known in KNOWN_CYCLES)] == []
    stale = [sorted(known) for known in KNOWN_CYCLES if not any(set(c) & known for c in cycles)]
    assert not stale, f"no cycle left among {stale}: remove it from KNOWN_CYCLES"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m)))
def test_each_layer_imports_only_itself_and_the_layers_before_it(module):
    rank = LAYERS.index(layer(module))
    for imported in sorted(IMPORTS[module]):
        if imported == "onnxfuse" or imported == "onnxfuse.__main__":
            pytest.fail(f"{module} imports the package's face ({imported}); import the module that defines it")
        if imported in MODULES:
            assert LAYERS.index(layer(imported)) <= rank, \
                f"{module} ({layer(module)}) imports {imported} ({layer(imported)}), a later layer"


# third-party packages and the layers that may import them (the core works on ONNX alone)
THIRD_PARTY = {"torch": LAYERS[1:], "sklearn": LAYERS[2:], "onnxruntime": LAYERS[3:],
               "ray": ["sweep", "integrations", "cli"], "optuna": ["integrations"]}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m)))
def test_heavy_dependencies_stay_out_of_the_lower_layers(module):
    for imported in sorted(IMPORTS[module]):
        top = imported.split(".")[0]
        if top in THIRD_PARTY:
            assert layer(module) in THIRD_PARTY[top], f"{module} ({layer(module)}) imports {imported}"


#: the packages whose files are a catalog (one module per op family, named for it) or mirror each other (each
#: runtime's ``trainer.py``)
CATALOGS = ("onnxfuse.core.rules.", "onnxfuse.runtime.ort.legalize.", "onnxfuse.runtime.torch.kernels.")
MIRRORED = {"trainer.py": {"onnxfuse.runtime.torch.trainer", "onnxfuse.runtime.ort.trainer"}}


def test_no_two_modules_share_a_file_name():
    """Apart from ``__init__.py``, the op-family catalogs and each runtime's ``trainer.py``, a file name says which
    module it is, at any depth."""
    by_name: dict[str, set[str]] = {}
    for m, p in MODULES.items():
        if not p.endswith("__init__.py") and not m.startswith(CATALOGS):
            by_name.setdefault(os.path.basename(p), set()).add(m)
    shared = {n: ms for n, ms in by_name.items() if len(ms) > 1 and ms != MIRRORED.get(n)}
    assert shared == {}


def test_the_engine_imports_no_rule_and_placements_data_model_not_its_executor():
    assert not {i for i in IMPORTS["onnxfuse.core.engine"] if i.startswith("onnxfuse.core.rules")}
    data_model = ["graph", "devices", "orders", "costs", "placers", "partition", "simulate", "shard"]
    runners = {"onnxfuse.placement.execute", "onnxfuse.placement.profile"}
    for name in data_model:
        assert not IMPORTS[f"onnxfuse.placement.{name}"] & runners, name
    # the one session helper the data model uses (graph.py measures shapes inference cannot give) is a leaf
    assert {i for i in IMPORTS["onnxfuse.placement.session"] if i in MODULES} <= {
        "onnxfuse.core.errors", "onnxfuse.placement.devices"}


def test_the_tests_mirror_the_package():
    """Every folder of tests/ is a package of onnxfuse (``tests/runtime/torch`` checks ``onnxfuse/runtime/torch``),
    or ``fuzz`` (the fuzzer's campaigns), ``structure`` (the code's own shape) or ``data`` (files other
    frameworks' exporters made, beside the scripts that made them); no test file lies outside them,
    and no two share a name."""
    tests = os.path.join(ROOT, "tests")
    seen: dict[str, list[str]] = {}
    for folder, dirs, files in os.walk(tests):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = os.path.relpath(folder, tests)
        own = [f for f in files if f.startswith("test_") and f.endswith(".py")]
        if rel == ".":
            assert own == [], f"test files outside the package's folders: {own}"
            continue
        assert rel.split(os.sep)[0] in ("fuzz", "structure", "data") or \
            os.path.isdir(os.path.join(ROOT, "onnxfuse", rel)), f"tests/{rel} mirrors no package of onnxfuse"
        for f in own:
            seen.setdefault(f, []).append(rel)
    assert {f: where for f, where in seen.items() if len(where) > 1} == {}
