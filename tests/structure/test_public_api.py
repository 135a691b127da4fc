"""The public API is what ``onnxfuse.__all__`` and docs/python-api.md name, and nothing else: every name of
``__all__`` is importable and listed on that page (and the page lists no other), every module the page lists
imports and has the names it gives, and every ``onnxfuse.…`` path and every ``import`` line of the README, docs/
and examples/ is a name of ``__all__`` or lies in a listed module, and resolves. ``import onnxfuse`` installs no
import hook: a path is the module at that path."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest

import onnxfuse
from tests.conftest import ROOT

API_PAGE = os.path.join(ROOT, "docs", "python-api.md")
DOCS = [os.path.join(ROOT, "README.md")] + [os.path.join(ROOT, "docs", f)
                                             for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")]
EXAMPLES = [os.path.join(ROOT, "examples", f) for f in sorted(os.listdir(os.path.join(ROOT, "examples")))
            if f.endswith(".py")]
LAYERS = sorted(d for d in os.listdir(os.path.join(ROOT, "onnxfuse"))
                if os.path.isfile(os.path.join(ROOT, "onnxfuse", d, "__init__.py")))


def _public_section() -> tuple[str, str]:
    """docs/python-api.md's "What is public": (the list of what ``import onnxfuse`` gives, the table of modules)."""
    text = open(API_PAGE, encoding="utf-8").read().split("## What is public\n", 1)[1].split("\n## ", 1)[0]
    face, table = text.split("\nModules:\n", 1)
    return face.split("\n`import onnxfuse`", 1)[1], table


def face_names() -> set[str]:
    """The names the page says ``import onnxfuse`` gives: ``onnxfuse.NAME`` in its list, NAME not a layer folder."""
    face, _ = _public_section()
    return {m.group(1) for m in re.finditer(r"`onnxfuse\.(\w+)", face)} - set(LAYERS)


def documented_modules() -> dict[str, list[str]]:
    """The page's table of modules: module -> the names its row gives (backticked identifiers)."""
    _, table = _public_section()
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`(onnxfuse(?:\.\w+)+)`", cells[0]) if len(cells) == 2 else None
        if m:
            rows[m.group(1)] = re.findall(r"`([A-Za-z_]\w*)`", cells[1])
    return rows


def resolve(path: str):
    """The module or object ``path`` names: the longest importable prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def is_public(path: str) -> bool:
    """``onnxfuse.NAME[...]`` with NAME in ``__all__``, or a listed module or a name inside one."""
    parts = path.split(".")
    if len(parts) >= 2 and parts[0] == "onnxfuse" and (parts[1] in onnxfuse.__all__ or
                                                       re.fullmatch(r"__\w+__", parts[1])):  # __all__, __version__
        return True
    return path == "onnxfuse" or any(path == m or path.startswith(m + ".") for m in documented_modules())


def _named_in_docs() -> list[str]:
    found = set()
    for path in DOCS:
        text = open(path, encoding="utf-8").read()
        # not a file name (.onnxfuse.lock), a logger or key in quotes, a path (onnxfuse/...) or an op's domain
        # (onnxfuse.torch::MatMulAdd)
        found |= {m.group(1) for m in re.finditer(r"(?<![\w.\"'/-])(onnxfuse(?:\.[A-Za-z_]\w*)+)(?!\w|::)", text)}
    return sorted(found)


def _import_lines() -> list[tuple[str, str]]:
    """(file, line) for every ``import onnxfuse…`` / ``from onnxfuse… import …`` of the README's and docs' Python
    blocks and of examples/."""
    lines = []
    for path in DOCS:
        text = open(path, encoding="utf-8").read()
        for block in re.findall(r"```python\n(.*?)```", text, re.S):
            lines += [(os.path.relpath(path, ROOT), line.strip()) for line in block.split("\n")
                      if re.match(r"\s*(from onnxfuse[\w.]* import|import onnxfuse)", line)]
    for path in EXAMPLES:
        lines += [(os.path.relpath(path, ROOT), line.strip()) for line in open(path, encoding="utf-8")
                  if re.match(r"\s*(from onnxfuse[\w.]* import|import onnxfuse)", line)]
    return lines


def test_the_page_and_the_searches_are_read():
    assert {"fuse", "fuse_models", "ArrayDir", "ConfigError"} <= face_names()
    modules = documented_modules()
    assert "onnxfuse.training.run" in modules and "train_array" in modules["onnxfuse.training.run"]
    named = _named_in_docs()
    assert "onnxfuse.placement.place_model" in named and "onnxfuse.integrations.optuna" in named
    assert not [n for n in named if n.endswith(".lock") or n == "onnxfuse.checkpoint"]
    assert len(_import_lines()) >= 8
    assert is_public("onnxfuse.optim.AdamW") and is_public("onnxfuse.core.split.split_weights")
    assert not is_public("onnxfuse.core.passes") and not is_public("onnxfuse.runtime.torch.trainer.TorchTrainer")


def test_all_is_exactly_what_the_page_lists_and_each_name_imports():
    assert sorted(face_names()) == sorted(onnxfuse.__all__)
    for name in onnxfuse.__all__:
        assert getattr(onnxfuse, name) is not None
        exec(f"from onnxfuse import {name}", {})


@pytest.mark.parametrize("module", sorted(documented_modules()))
def test_every_listed_module_imports_and_has_the_names_its_row_gives(module):
    mod = importlib.import_module(module)
    for name in documented_modules()[module]:
        assert hasattr(mod, name), f"docs/python-api.md: {module} gives `{name}`, which it does not define"


@pytest.mark.parametrize("path", _named_in_docs())
def test_every_path_the_docs_name_is_public_and_resolves(path):
    assert is_public(path), (f"the docs name {path}: neither a name of onnxfuse.__all__ nor in a module "
                             "docs/python-api.md lists under 'What is public'")
    resolve(path)


@pytest.mark.parametrize("where,line", _import_lines())
def test_every_import_line_of_the_docs_and_examples_is_public_and_runs(where, line):
    m = re.match(r"from (\S+) import (.+)|import (\S+)", line)
    module = m.group(1) or m.group(3)
    names = [n.strip().split(" as ")[0] for n in (m.group(2) or "").split("#")[0].strip("() ").split(",") if n.strip()]
    for name in names or [None]:
        path = module if name is None else f"{module}.{name}"
        assert is_public(path) or (module == "onnxfuse" and name in onnxfuse.__all__), f"{where}: {line}"
    exec(line.split("#")[0], {})


def test_import_onnxfuse_installs_no_import_hook():
    """A path is the module at that path: no meta-path finder maps old paths (0.1.0 was never installed by anyone
    under another layout), and ``import onnxfuse`` imports neither torch nor a runtime."""
    code = ("import sys; before = list(sys.meta_path); import onnxfuse, onnxfuse.training\n"
            "assert sys.meta_path == before, sys.meta_path\n"
            "assert not hasattr(onnxfuse, 'MOVED')\n"
            "assert 'torch' not in sys.modules and 'onnxruntime' not in sys.modules\n"
            "import importlib\n"
            "try:\n    importlib.import_module('onnxfuse.split')\nexcept ModuleNotFoundError:\n    pass\n"
            "else:\n    raise AssertionError('onnxfuse.split imports')\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
