"""One place for each idea: the array folder's file names live in ``onnxfuse/core/array.py`` only (the per-model
``model_{b}.onnx`` / ``model_{b}.safetensors`` of sources/, trained/dropped/, a split and an export too), the lock
file's (every folder onnxfuse writes has one) in ``onnxfuse/core/_lock.py``, placement.json's in
``onnxfuse/placement/result.py``; the placer table is what ``onnxfuse place`` offers; ``place_model`` from Python
writes what the command writes.

File names are found as string constants in the source (``ast``), docstrings excluded: a constant that *is* a
file name of the folder (``"fused.onnx"``), an f-string that is a per-model one (``f"model_{b}.onnx"``, whatever
the index), or a folder name of it (``"trained"``) given to a path join or a glob. A name inside a message
(``"... without fused.onnx; ..."``) is not a path and is not counted."""
from __future__ import annotations

import ast
import json
import os

import pytest

from tests.conftest import ROOT

PACKAGES = ("onnxfuse",)
FILE_NAMES = {"fused.onnx", "fused.own-ops.pb", "array.json", "train_state.json", "run.json", "started.json",
              "metrics.csv", "report.png", "report.json", "weights.safetensors", "optimizer_state.safetensors",
              "state.json", "ort_checkpoint"}
FOLDER_NAMES = {"sources", "trained", "dropped", "checkpoints", "runs", "artifacts", "best"}
PER_MODEL_NAMES = {"model_{b}.onnx", "model_{b}.safetensors"}  # f"model_{b}.onnx", as found, with any index
LOCK_FILE = ".onnxfuse.lock"
OWNER = {name: "onnxfuse/core/array.py" for name in FILE_NAMES | FOLDER_NAMES | PER_MODEL_NAMES} | {
    "placement.json": "onnxfuse/placement/result.py", LOCK_FILE: "onnxfuse/core/_lock.py"}


def _sources() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    found[os.path.relpath(path, ROOT).replace(os.sep, "/")] = path
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _path_call(node: ast.Call) -> bool:
    """os.path.join(...), glob.glob(...) and the like: calls whose arguments are path parts."""
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    return name in ("join", "glob", "iglob")


def _per_model_name(node: ast.JoinedStr) -> str | None:
    """``"model_{b}.onnx"`` for an f-string that is exactly a per-model file name (``f"model_{i + 1}.onnx"``), else
    None (a message that names one among other words is not a path)."""
    parts = node.values
    if (len(parts) == 3 and isinstance(parts[0], ast.Constant) and parts[0].value == "model_" and
            isinstance(parts[1], ast.FormattedValue) and isinstance(parts[2], ast.Constant)):
        name = "model_{b}" + str(parts[2].value)
        return name if name in PER_MODEL_NAMES else None
    return None


def file_names_in(source: str) -> list[tuple[int, str]]:
    """(line, name) of every file name of the array folder (or placement.json) the source spells out."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in FILE_NAMES or node.value in ("placement.json", LOCK_FILE):
                found.append((node.lineno, node.value))
        if isinstance(node, ast.JoinedStr) and _per_model_name(node) is not None:
            found.append((node.lineno, _per_model_name(node)))
        if isinstance(node, ast.Call) and _path_call(node):
            for arg in node.args:
                for part in ast.walk(arg):
                    if isinstance(part, ast.Constant) and part.value in FOLDER_NAMES:
                        found.append((part.lineno, part.value))
    return sorted(set(found))


SOURCES = _sources()


def test_the_search_finds_file_names():
    assert "onnxfuse/core/array.py" in SOURCES and "onnxfuse/training/run.py" in SOURCES and "onnxfuse/exporters/zoo.py" in SOURCES
    assert file_names_in('import os\nos.path.join(d, "trained", f"model_{b}.onnx")\nx = "fused.onnx"\n') == [
        (2, "model_{b}.onnx"), (2, "trained"), (3, "fused.onnx")]
    assert file_names_in('"""fused.onnx"""\nprint(f"{d} has no fused.onnx")\nk = {"sources": 1}\n') == []
    assert file_names_in('a = f"model_{k + 1}.safetensors"\nb = f"model_{b}"\nc = f"saved model_{b}.onnx"\n') == [
        (1, "model_{b}.safetensors")]
    tree = ast.parse(open(SOURCES["onnxfuse/core/array.py"], encoding="utf-8").read())
    assert FILE_NAMES | FOLDER_NAMES <= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert PER_MODEL_NAMES == {_per_model_name(n) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr)} - {None}
    tree = ast.parse(open(SOURCES["onnxfuse/core/_lock.py"], encoding="utf-8").read())
    assert LOCK_FILE in {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_the_array_folders_file_names_are_spelled_in_one_module(module):
    stray = [(line, name) for line, name in file_names_in(open(SOURCES[module], encoding="utf-8").read())
             if OWNER[name] != module]
    assert not stray, f"{module} spells out {stray}: ask onnxfuse.core.array.ArrayDir (or the placement report) instead"


# ------------------------------------------------------------------------------------------------ the placers
def _place_action(dest: str):
    from onnxfuse.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return next(a for a in sub.choices["place"]._actions if a.dest == dest)


def test_the_placer_table_is_what_the_command_offers():
    from onnxfuse.placement import PLACER_NAMES, PLACERS, compare_placements

    action = _place_action("placer")
    assert action.metavar.split("|")[1].split(",") == PLACER_NAMES
    assert set(PLACER_NAMES) == {name for name, p in PLACERS.items() if not p.baseline}
    for name in PLACER_NAMES:
        assert f"{name} ({PLACERS[name].help})" in action.help
    assert compare_placements.__defaults__[0] == PLACER_NAMES  # the API's default is the same table


def _small_model(path: str) -> str:
    """x [N, 8] -> MatMul -> Relu -> MatMul, and a side branch: a graph the placers can cut."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("W1", (8, 16)), ("W2", (16, 4)), ("W3", (8, 4)))]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["a"], name="mm2"),
             helper.make_node("MatMul", ["x", "W3"], ["b"], name="side"),
             helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_place_model_writes_what_the_command_writes(tmp_path, capsys):
    from onnxfuse.cli.main import main
    from onnxfuse.placement import PlacementReport, make_devices, place_model

    path = _small_model(str(tmp_path / "small.onnx"))
    assert main(["place", path, "--devices", "2", "--costs", "estimate", "--batch-size", "4", "-q",
                 "-o", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    report = place_model(path, make_devices(2), costs="estimate", batch_size=4)
    assert isinstance(report, PlacementReport) and report.table in out and report.recommendation in out
    written = report.save(tmp_path / "api")
    assert sorted(w.rstrip("/") for w in written) == sorted(os.listdir(tmp_path / "cli")) == sorted(
        os.listdir(tmp_path / "api"))
    cli_doc = json.load(open(tmp_path / "cli" / "placement.json"))
    assert cli_doc == json.load(open(tmp_path / "api" / "placement.json")) == report.to_json()
    assert {c["placer"] for c in cli_doc["candidates"]} == {"single", "greedy", "heft"}  # shard: not an array
