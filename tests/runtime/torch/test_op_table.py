"""docs/ops.md's operator table (benchmarks/op_table.py) lists every operator of ONNX's default domain once, and
what it says of each agrees with the registries: the torch kernel's family module or the exclusion, the fusion
rule's module, the legalization, the tests that run the kernel. (Its ORT column is measured by the script; here
only its form is checked.)"""
from __future__ import annotations

import os
import sys

import onnx
import pytest

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import op_table  # noqa: E402

TABLE = op_table.read_table()
STATIC = {r.op: r for r in op_table.static_columns()}


def test_every_default_domain_operator_has_one_row_in_order():
    ops = [row[0].strip("`") for row in TABLE]
    expected = sorted(s.name for s in onnx.defs.get_all_schemas() if s.domain == "" and not s.deprecated)
    assert ops == expected


@pytest.mark.parametrize("row", TABLE, ids=[r[0].strip("`") for r in TABLE])
def test_each_row_says_what_the_registries_say(row):
    from onnxfuse.runtime.ort.legalize import REWRITES

    op, since, kernel, fusion, ort, tests = row
    want = STATIC[op.strip("`")]
    assert [since, kernel, fusion, tests] == [str(want.since), want.kernel, want.fusion, want.tests], \
        "run python benchmarks/op_table.py"
    rewrite = REWRITES.get(("", want.op))
    if rewrite is not None:
        assert ort == op_table.legalized(rewrite)
    else:
        assert ort in op_table.ORT_VERDICTS or ort.startswith("no: "), ort
    if not kernel.startswith("excluded"):
        assert tests != "–", f"{want.op} has a kernel and no test in tests/runtime/torch/test_kernels.py"


def test_the_torch_runtime_covers_every_operator_but_the_named_exclusions():
    from onnxfuse.runtime.torch.kernels import EXCLUDED, EXCLUDED_FAMILIES, OPS

    every = {s.name for s in onnx.defs.get_all_schemas() if s.domain == "" and not s.deprecated}
    assert every - set(EXCLUDED) <= {name for (domain, name) in OPS if domain == ""}
    assert set(EXCLUDED.values()) == set(EXCLUDED_FAMILIES)
