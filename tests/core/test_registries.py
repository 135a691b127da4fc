"""The op catalogs share one registry class; node labels and liveness have one owner (core/_graph.py)."""
from __future__ import annotations

import pytest
from onnx import helper

from onnxfuse.core._graph import last_readers, node_label
from onnxfuse.core.registry import Registry
from onnxfuse.core.rules import RULES, rule
from onnxfuse.core.rules.recurrent import TORCH_DOMAIN
from onnxfuse.core.standard import STANDARD_FORMS, standard_form
from onnxfuse.runtime.ort.legalize._registry import REWRITES, rewrite
from onnxfuse.runtime.torch.kernels import OPS, op

CATALOGS = [(RULES, rule, "", "Conv"), (STANDARD_FORMS, standard_form, TORCH_DOMAIN, "BatchedLSTM"),
            (REWRITES, rewrite, "", "InstanceNormalization"), (OPS, op, "", "Relu")]


@pytest.mark.parametrize("table,decorator,domain,taken", CATALOGS,
                         ids=["rules", "standard forms", "legalization rewrites", "torch kernels"])
def test_each_catalog_is_a_registry_that_refuses_a_second_entry(table, decorator, domain, taken):
    assert isinstance(table, Registry)
    before = dict(table)
    first = table[(domain, taken)]

    def impostor(*args):
        raise AssertionError("never called")

    # a registration of several op types, one of them taken, registers none of them
    name = f"{domain}::{taken}" if domain else taken
    with pytest.raises(ValueError, match=rf"two {table.kind}s for op type '{name}': .+ and "
                                         rf"{__name__}\..*impostor"):
        decorator("NotAnOnnxOp", taken)(impostor)
    assert dict(table) == before and table[(domain, taken)] is first
    assert (domain, "NotAnOnnxOp") not in table


def test_a_registry_looks_up_by_node_and_names_its_op_types():
    table: Registry = Registry("test op")

    @table.register("Relu", "Tanh")
    def act(x):
        return x

    @table.register("Foo", domain="com.example")
    def foo(x):
        return x

    assert table.lookup(helper.make_node("Relu", ["x"], ["y"])) is act
    assert table.lookup(helper.make_node("Relu", ["x"], ["y"], domain="ai.onnx")) is act  # the default domain
    assert table.lookup(helper.make_node("Foo", ["x"], ["y"])) is None
    assert table.lookup(helper.make_node("Foo", ["x"], ["y"], domain="com.example")) is foo
    assert table.names() == ["Relu", "Tanh", "com.example::Foo"]
    entry = table.pop(("", "Tanh"))  # a test may take an entry out and put it back (monkeypatch.delitem)
    table[("", "Tanh")] = entry
    with pytest.raises(ValueError, match=r"two test ops for op type 'Tanh': .*\.act and .*\.act"):
        table[("", "Tanh")] = entry


def test_node_label_is_the_name_else_the_first_output():
    assert node_label(helper.make_node("Relu", ["x"], ["y"], name="act")) == "act"
    assert node_label(helper.make_node("Relu", ["x"], ["y"])) == "y"
    assert node_label(helper.make_node("Dropout", ["x"], ["", "mask"])) == "mask"
    assert node_label(helper.make_node("Print", ["x"], [])) == "<unnamed Print>"


def test_last_readers_frees_after_the_last_reader_or_the_unread_writer():
    nodes = [helper.make_node("Relu", ["x"], ["a"]),            # 0
             helper.make_node("Dropout", ["a"], ["b", "m"]),     # 1: mask m never read
             helper.make_node("Add", ["a", "b"], ["c"]),         # 2: last reader of a and b
             helper.make_node("Neg", ["c"], ["out"])]            # 3
    assert last_readers(nodes, keep={"out"}) == {"a": 2, "b": 2, "m": 1, "c": 3}
    # any program: (reads, writes) per step, e.g. the torch runtime's slots
    steps = [((0,), (5,)), ((5, 1), (6, 7)), ((6,), (8,))]
    assert last_readers(steps, keep={8}, io=lambda s: s) == {5: 1, 6: 2, 7: 1}
