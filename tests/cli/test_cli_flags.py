"""Errors raised below the command line name Python parameters (``strategy: ...``, ``which='best'``, ``pass
initial=True``) and the command words them as its flags (``--strategy: ...``, ``--which best``, ``pass --initial``):
one table in ``onnxfuse/cli/_flags.py``, whose every flag is one the command takes."""
from __future__ import annotations

import argparse
import ast
import os
import re

import pytest

from onnxfuse.cli._flags import COMMAND_FLAGS, FLAGS, SUBJECT_FLAGS, as_flags
from onnxfuse.cli.main import build_parser, main
from onnxfuse.core.errors import ConfigError

from tests.conftest import ROOT

BELOW_THE_CLI = ["core", "exporters", "measure", "placement"]


@pytest.mark.parametrize("message, command, worded", [
    ("strategy: unknown form 'x'; the rules offer: grouped", None, "--strategy: unknown form 'x'; the rules offer: grouped"),
    ("which='bogus': split writes the final or the best state", None, "--which bogus: split writes the final or the best state"),
    ("or pass initial=True to split the initial weights", None, "or pass --initial to split the initial weights"),
    ("train with eval data, eval_data= or eval_fraction=, to keep them", None,
     "train with eval data, --eval-data or --eval-fraction, to keep them"),
    ("per_model_inputs=['a', 'b']: 'a' is not", None, "--per-model-inputs a,b: 'a' is not"),
    ("give its size with dims={'N': VALUE}", None, "give its size with --dims N=VALUE"),
    ("give memory='1.5GiB' or more devices", None, "give --memory 1.5GiB or more devices"),
    ("count=4 but device spec 'd.yaml' describes 2 devices; drop count=", "place",
     "--devices 4 but device spec 'd.yaml' describes 2 devices; drop --devices"),
    ("count=0: give the number of models", "export", "--count 0: give the number of models"),
    ("B: array sizes must be integers", None, "--B: array sizes must be integers"),
    # left as they are: a size B=4 in a sentence, an argument inside a call, a message that names the flag already
    ("predicted for B=4", None, "predicted for B=4"),
    ("pass split_array(like=...)", None, "pass split_array(like=...)"),
    ("set batch_size=32 (--batch-size 32)", None, "set batch_size=32 (--batch-size 32)"),
    ("the models differ", None, "the models differ"),
])
def test_a_message_is_worded_as_flags(message, command, worded):
    assert as_flags(message, command) == worded


def _flags_of(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        found.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _flags_of(sub)
    return found


def test_every_flag_of_the_table_is_one_the_command_takes():
    takes = _flags_of(build_parser())
    table = {**FLAGS, **SUBJECT_FLAGS, **{k: v for t in COMMAND_FLAGS.values() for k, v in t.items()}}
    assert not {p: f for p, f in table.items() if f not in takes}


def _linear_models(folder) -> list[str]:
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    paths = []
    for b in range(2):
        w = numpy_helper.from_array(np.full((4, 3), b + 1.0, dtype=np.float32), "w")
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "linear",
                                  [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
                                  [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])], [w])
        paths.append(str(folder / f"model_{b}.onnx"))
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), paths[-1])
    return paths


def test_the_python_api_names_the_parameter_and_the_command_the_flag(tmp_path, capsys):
    from onnxfuse.core.passes import fuse_models

    paths = _linear_models(tmp_path)
    with pytest.raises(ConfigError, match=r"^per_model_inputs: 'nope' is not a graph input"):
        fuse_models(paths, per_model_inputs=["nope"])
    assert main(["fuse", *paths, "-o", str(tmp_path / "array"), "--per-model-inputs", "nope"]) == 2
    assert "onnxfuse: error: --per-model-inputs: 'nope' is not a graph input" in capsys.readouterr().err


def _raised_texts(path: str) -> list[tuple[int, str]]:
    """The string constants of every ``raise`` and ``g.fail``/``ctx.error`` call in a module, but a command line
    spelled whole (``shell('onnxfuse', 'train', ..., '--resume')``)."""
    found = []

    class Visitor(ast.NodeVisitor):
        def visit_Call(self, node: ast.Call) -> None:
            if isinstance(node.func, ast.Name) and node.func.id == "shell":
                return
            self.generic_visit(node)

        def visit_Constant(self, node: ast.Constant) -> None:
            if isinstance(node.value, str):
                found.append((node.lineno, node.value))

    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            Visitor().visit(node.exc)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("fail", "error"):
            for arg in node.args:
                Visitor().visit(arg)
    return found


def _modules_below_the_cli() -> list[str]:
    return sorted(os.path.relpath(os.path.join(folder, f), ROOT)
                  for layer in BELOW_THE_CLI for folder, _, files in os.walk(os.path.join(ROOT, "onnxfuse", layer))
                  for f in files if f.endswith(".py"))


@pytest.mark.parametrize("module", _modules_below_the_cli())
def test_errors_below_the_command_line_name_no_flag(module):
    """A flag in an error of the core, the exporters, measure or placement would reach a Python caller as it is;
    ``--verbose`` (the command's own switch, no parameter's) aside."""
    flagged = [(line, text) for line, text in _raised_texts(os.path.join(ROOT, module))
               if re.search(r"(?<![\w-])--(?!verbose\b)[a-zA-Z]", text)]
    assert not flagged, f"{module}: name the parameter (as_flags words it as the flag): {flagged}"
