"""docs/ops.md's operator table: every operator of ONNX's default domain (``onnx.defs``) and what onnxfuse does with
it, generated from the registries and measured where a registry cannot say.

    python benchmarks/op_table.py          # rewrites the table between its markers in docs/ops.md (~1 min)

Columns:

- **op**, and the opset of its current definition (onnx 1.17);
- **torch kernel**: the module of ``onnxfuse/runtime/torch/kernels/`` with its builder, or ``excluded`` and its
  family (``kernels.EXCLUDED``; the families' reasons follow the table);
- **fusion**: the module of ``onnxfuse/core/rules/`` with its rule, or ``per model`` (B copies of the node on each
  model's slices; a node whose inputs are all shared is emitted once, whatever its op);
- **ORT training**: what onnxruntime-training 1.19 does with the op's test graphs (below), probed here: ``yes``
  (it builds their gradient w.r.t. their float graph inputs, the data), ``legalized where ORT needs it``
  (onnxfuse rewrites the forms ORT cannot train first: ``runtime/ort/legalize/<module>``), ``no gradient`` (ORT has no gradient builder: the ort runtime refuses the array in
  one line, the torch runtime trains it), ``nothing to differentiate`` (integer or boolean data only, or an
  output that does not depend on the data's values), ``no kernel`` (ORT cannot even run it), ``–`` (excluded, or
  no test graph), or ``no:`` and ORT's own reason;
- **test**: the tests of ``tests/runtime/torch/test_kernels.py`` that run the kernel against onnxruntime (or ONNX's reference
  implementation) on one-node graphs, which are also the graphs the ORT column probes.

``tests/runtime/torch/test_op_table.py`` regenerates every column but the probed one and compares: a missing or wrong row fails.
"""
from __future__ import annotations

import ast
import os
import re
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
KERNEL_TESTS = os.path.join(ROOT, "tests", "runtime", "torch", "test_kernels.py")
DOC = os.path.join(ROOT, "docs", "ops.md")
BEGIN = "<!-- op table: python benchmarks/op_table.py writes what follows -->"
END = "<!-- op table ends -->"


@dataclass
class Row:
    op: str
    since: int
    kernel: str
    fusion: str
    ort: str
    tests: str

    def markdown(self) -> str:
        return f"| `{self.op}` | {self.since} | {self.kernel} | {self.fusion} | {self.ort} | {self.tests} |"


def operators() -> dict[str, int]:
    """Every non-deprecated operator of the default domain, with the opset of its newest definition."""
    import onnx

    newest = {s.name: s.since_version for s in onnx.defs.get_all_schemas() if s.domain == "" and not s.deprecated}
    return dict(sorted(newest.items()))


def _tests_naming(path: str, ops) -> dict[str, list[str]]:
    """The test functions of one test file naming each op as a string: in the function, its decorators, a
    module-level list it reads, or a helper function it calls."""
    source = open(path, encoding="utf-8").read()
    tree = ast.parse(source)
    names = {}  # module-level lists and helpers: name -> source
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            names[node.targets[0].id] = ast.get_source_segment(source, node) or ""
        elif isinstance(node, ast.FunctionDef) and not node.name.startswith("test_"):
            names[node.name] = ast.get_source_segment(source, node) or ""
    found: dict[str, list[str]] = {op: [] for op in ops}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            text = "\n".join(ast.get_source_segment(source, d) or "" for d in node.decorator_list)
            text += ast.get_source_segment(source, node) or ""
            text += "".join(v for k, v in names.items() if re.search(rf"\b{k}\b", text))
            for op in ops:
                if f'"{op}"' in text:
                    found[op].append(node.name)
    return found


def tests_by_op(ops) -> dict[str, list[str]]:
    """The tests that run each op's kernel: tests/runtime/torch/test_kernels.py's (against onnxruntime), else those of the
    other test files that name it (``file::test``)."""
    own = _tests_naming(KERNEL_TESTS, ops)
    tests = os.path.join(ROOT, "tests")
    files = sorted((os.path.join(d, f) for d, _, fs in os.walk(tests) for f in fs
                    if f.startswith("test_") and f.endswith(".py") and os.path.join(d, f) != KERNEL_TESTS),
                   key=os.path.basename)
    for path in files:
        for op, found in _tests_naming(path, [o for o in ops if not own[o]]).items():
            own[op] += [f"{os.path.basename(path)}::{t}" for t in found]
    return own


def static_columns() -> list[Row]:
    """Every row with its ORT column left empty: what the registries say."""
    import onnx

    from onnxfuse.core.rules import RULES
    from onnxfuse.runtime.torch.kernels import EXCLUDED, OPS

    ops = operators()
    tests = tests_by_op(ops)
    rows = []
    for op, since in ops.items():
        builder = OPS.get(("", op))
        kernel = f"`{builder.__module__.rsplit('.', 1)[-1]}`" if builder else f"excluded ({EXCLUDED[op]})"
        rule = RULES.get(("", op))
        fusion = f"`{rule.fuse.__module__.rsplit('.', 1)[-1]}`" if rule else "–" if op in EXCLUDED else \
            "shared (emitted once)" if onnx.defs.get_schema(op).max_input == 0 else "per model"
        rows.append(Row(op, since, kernel, fusion, "", ", ".join(f"`{t}`" for t in tests[op][:3]) or "–"))
    return rows


def _samples() -> dict[str, list[tuple]]:
    """The one-node graphs (with their inputs) that tests/runtime/torch/test_kernels.py builds for each op, recorded by running
    those tests with their comparison helpers wrapped."""
    import pytest

    seen: dict[str, list[tuple]] = {}

    class Recorder:
        def pytest_collection_finish(self, session):
            module = sys.modules.get("tests.runtime.torch.test_kernels")
            for name in ("compare", "compare_reference", "gradients"):
                original = getattr(module, name)

                def wrapped(model, inputs, *args, __original=original, **kw):
                    ops = [n.op_type for n in model.graph.node if not n.domain]
                    if ops:
                        seen.setdefault(ops[-1], []).append((model, dict(inputs)))
                    return __original(model, inputs, *args, **kw)
                setattr(module, name, wrapped)

    pytest.main([KERNEL_TESTS, "-q", "-x", "-p", "no:cacheprovider", "-k", "not zoo and not fuzz",
                 "-W", "ignore"], plugins=[Recorder()])
    return seen


def _probe(model, inputs) -> str:
    """Whether onnxruntime-training builds the gradient of ``model`` (its float inputs made initializers) w.r.t.
    every float initializer, the float outputs summed as the loss."""
    import numpy as np
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper as nh
    from onnxruntime.training import artifacts

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    params = []  # the test graph's float inputs (its data; its initializers are attributes-like constants)
    for vi in list(g.input):
        value = np.asarray(inputs.get(vi.name)) if vi.name in inputs else None
        if value is not None and value.dtype == np.float32:
            g.initializer.append(nh.from_array(value, vi.name))
            g.input.remove(vi)
            params.append(vi.name)
    outs = [o.name for o in g.output if o.type.tensor_type.elem_type == TP.FLOAT]
    if not params or not outs:
        return NOTHING
    sums = [f"{o}__sum" for o in outs]
    g.node.extend(h.make_node("ReduceSum", [o], [s], keepdims=0) for o, s in zip(outs, sums))
    total = sums[0]
    for k, s in enumerate(sums[1:]):  # Add, not Sum: ORT 1.19 has no gradient for Sum
        g.node.append(h.make_node("Add", [total, s], [f"loss__{k}"]))
        total = f"loss__{k}"
    g.node.append(h.make_node("Identity", [total], ["loss"]))
    del g.output[:]
    g.output.append(h.make_tensor_value_info("loss", TP.FLOAT, []))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            artifacts.generate_artifacts(m, requires_grad=params, loss=None, optimizer=None, artifact_directory=tmp)
            return "yes"
        except Exception as e:  # noqa: BLE001 - the message says which
            text = str(e)
            missing = re.search(r"gradient builder has not been registered: (\w+)", text)
            if missing:
                return "no gradient" if missing.group(1) in {n.op_type for n in model.graph.node} else \
                    f"no: {missing.group(1)} has no gradient"
            if "unreachable from the output" in text:  # the output does not depend on the data's values
                return NOTHING
            if "NOT_IMPLEMENTED" in text or "Could not find an implementation" in text:
                return "no kernel"
            return "no: " + " ".join(text.split())[-100:].split(") ", 1)[-1]


def legalized(rewrite) -> str:
    return f"legalized where ORT needs it (`{rewrite.__module__.rsplit('.', 1)[-1]}`)"


def ort_column(rows: list[Row]) -> None:
    """Fill each row's ORT column: legalized ops by the rewrite registry, the rest by probing their test graphs."""
    from onnxfuse.runtime.ort.legalize import REWRITES

    samples = _samples()
    for row in rows:
        rewrite = REWRITES.get(("", row.op))
        if rewrite is not None:
            row.ort = legalized(rewrite)
        elif row.kernel.startswith("excluded") or row.op not in samples:
            row.ort = "–"
        else:
            verdicts = [_probe(m, feeds) for m, feeds in samples[row.op][:3]]
            row.ort = "yes" if "yes" in verdicts else verdicts[0]


NOTHING = "nothing to differentiate"
ORT_VERDICTS = ("yes", "no gradient", "no kernel", NOTHING, "–")  # or "legalized (...)", or "no: <ORT's reason>"

HEADER = ["| op | opset | torch kernel (`runtime/torch/kernels/`) | fusion (`core/rules/`) | ORT training "
          "(probed) | test (`tests/runtime/torch/test_kernels.py`) |", "|---|---|---|---|---|---|"]


def render(rows: list[Row]) -> str:
    from onnxfuse.runtime.torch.kernels import EXCLUDED_FAMILIES

    legend = ["", "Excluded, by family:", ""] + [f"- **{family}**: {why}." for family, why in
                                                 EXCLUDED_FAMILIES.items()]
    return "\n".join(HEADER + [r.markdown() for r in rows] + legend)


def read_table(path: str = DOC) -> list[list[str]]:
    """The rows of the generated table in ``path``, as cell lists."""
    text = open(path, encoding="utf-8").read()
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in body.strip().splitlines()[2:]
            if line.startswith("| `")]


def main() -> None:
    rows = static_columns()
    ort_column(rows)
    text = open(DOC, encoding="utf-8").read()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{render(rows)}\n{END}{tail}")
    print(f"wrote {len(rows)} rows to {os.path.relpath(DOC, ROOT)}")


if __name__ == "__main__":
    main()
