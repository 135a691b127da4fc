"""The import paths users see keep working: every ``onnxfuse.<path>`` the README and docs/ name, every import line
of the README's Python examples, and the paths the README showed before the package's folders became its layers
(``onnxfuse.split``, ``onnxfuse.training.plan``, ...), which ``onnxfuse.MOVED`` maps to the modules they are now."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest

import onnxfuse

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
DOCS = [os.path.join(ROOT, "README.md")] + [os.path.join(ROOT, "docs", f)
                                             for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")]

# what the README of 0.1.0 (before the layer folders) named, as it named it
README_BEFORE = ["onnxfuse.ArrayDir", "onnxfuse.errors.ArrayBusyError", "onnxfuse.exporters.zoo",
                 "onnxfuse.integrations.optuna", "onnxfuse.placement.place_model", "onnxfuse.split.split_weights",
                 "onnxfuse.sweep.run_sweep", "onnxfuse.training.bench_ort", "onnxfuse.training.forms.measured_strategy",
                 "onnxfuse.training.gan.FusedGAN", "onnxfuse.training.plan.plan_array",
                 "onnxfuse.training.plan.recommend_B", "onnxfuse.training.verify_array",
                 "onnxfuse.training.make_optimizer", "onnxfuse.training.make_trainer", "onnxfuse.training.TrainConfig",
                 "onnxfuse.exporters.export_module", "onnxfuse.fuse_models", "onnxfuse.save_array"]


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


def _named_in_docs() -> list[str]:
    found = set()
    for path in DOCS:
        text = open(path, encoding="utf-8").read()
        # not a file name (.onnxfuse.lock), a logger or key in quotes, a path (onnxfuse/...) or an op's domain
        # (onnxfuse.torch::MatMulAdd)
        found |= {m.group(1) for m in re.finditer(r"(?<![\w.\"'/-])(onnxfuse(?:\.[A-Za-z_]\w*)+)(?!\w|::)", text)}
    return sorted(found)


def test_the_search_finds_the_paths():
    named = _named_in_docs()
    assert "onnxfuse.placement.place_model" in named and "onnxfuse.integrations.optuna" in named
    assert not [n for n in named if n.endswith(".lock") or n == "onnxfuse.checkpoint"]


@pytest.mark.parametrize("path", _named_in_docs())
def test_every_path_the_docs_name_resolves(path):
    resolve(path)


@pytest.mark.parametrize("path", README_BEFORE)
def test_the_paths_the_readme_showed_before_still_work(path):
    resolve(path)


def test_the_readmes_python_examples_import():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    lines = [line.strip() for block in re.findall(r"```python\n(.*?)```", text, re.S) for line in block.split("\n")
             if re.match(r"\s*(from onnxfuse[\w.]* import|import onnxfuse)", line)]
    assert len(lines) >= 4
    for line in lines:
        exec(line, {})


@pytest.mark.parametrize("old", sorted(onnxfuse.MOVED))
def test_a_moved_path_is_the_module_itself(old):
    new = onnxfuse.MOVED[old]
    assert importlib.import_module(old) is importlib.import_module(new)
    # no real module hides under an old name, and the new name is where the file is
    parts = old.split(".")
    assert not os.path.exists(os.path.join(ROOT, *parts) + ".py") and not os.path.isdir(os.path.join(ROOT, *parts))
    assert os.path.exists(os.path.join(ROOT, *new.split(".")) + ".py") or \
        os.path.isdir(os.path.join(ROOT, *new.split(".")))


def test_old_paths_work_in_a_fresh_interpreter():
    """``from onnxfuse.training.plan import plan_array`` as a first import, and a patch through the old name is
    the patch of the module (one module object under both names)."""
    code = ("from onnxfuse.training.plan import plan_array\n"
            "import onnxfuse.training.plan as old, onnxfuse.measure.sizing as new\n"
            "from onnxfuse.errors import ArrayBusyError\n"
            "old.marker = 1\n"
            "assert new.marker == 1 and plan_array is new.plan_array\n"
            "import onnxfuse.core.errors as e; assert ArrayBusyError is e.ArrayBusyError\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
