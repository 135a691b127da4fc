"""docs/architecture.md says only what is true: every path it names exists, every name its owner table gives is
defined in that module, and every rule it states cites the test that checks it (``tests/FILE.py::test_name``), a
test that exists."""
from __future__ import annotations

import ast
import glob
import os
import re

import pytest

from tests.conftest import ROOT

DOC = open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8").read()


def _section(title: str) -> str:
    return DOC.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _defined(path: str) -> set[str]:
    """Top-level names of a module, and Class.method for its classes' methods and class attributes."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(f"{node.name}.{item.name}")
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(f"{node.name}.{item.target.id}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    names.add(t.id)
        elif isinstance(node, ast.ImportFrom):  # a re-export
            names.update(a.asname or a.name for a in node.names)
    return names


PATHS = sorted(set(re.findall(r"(?<![\w/.])((?:onnxfuse|tests|fuzz|benchmarks|docs)/[\w/<>.*-]*[\w*])", DOC)))
CITED = sorted(set(re.findall(r"(tests/[\w/]+\.py)::(\w+)", DOC)))


def test_the_document_is_read():
    assert "onnxfuse/core/array.py" in PATHS and len(CITED) >= 10
    assert len(_owner_rows()) >= 20


@pytest.mark.parametrize("path", PATHS)
def test_every_path_named_exists(path):
    pattern = re.sub(r"<\w+>", "*", path)
    assert glob.glob(os.path.join(ROOT, pattern)), f"docs/architecture.md names {path}, which does not exist"


@pytest.mark.parametrize("path,test", CITED)
def test_every_cited_test_exists(path, test):
    assert test in _defined(path), f"docs/architecture.md cites {path}::{test}, which does not exist"


def test_every_rule_cites_its_test():
    rules = [line for line in _section("Rules the code keeps").split("\n- ")[1:]]
    assert len(rules) >= 8
    for rule in rules:
        assert re.search(r"tests/[\w/]+\.py::\w+", rule), f"a rule without the test that checks it: {rule[:80]}..."


def _owner_rows() -> list[tuple[str, str]]:
    rows = []
    for line in _section("Who owns what").split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] not in ("idea", "---") and not set(cells[0]) <= {"-"}:
            rows.append((cells[0], cells[1]))
    return rows


@pytest.mark.parametrize("idea,owner", _owner_rows())
def test_every_owner_named_defines_what_the_table_says(idea, owner):
    """``path`` (`Name`, `Class.method`): each name is defined in the module at path."""
    for part in re.split(r";\s*", owner):
        paths = re.findall(r"`((?:onnxfuse)/[\w/]+\.py)`", part)
        names = re.findall(r"`([A-Za-z_][\w.]*)`", re.sub(r"`[\w/<>]+\.py`|`onnxfuse/[\w/<>]*`", "", part))
        if not paths:
            continue
        defined = set().union(*(_defined(p) for p in paths))
        for name in names:
            assert name in defined, f"'{idea}': {name} is not defined in {', '.join(paths)}"
