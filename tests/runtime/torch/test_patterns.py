"""The torch runtime's own forms (onnxfuse/runtime/torch/patterns.py, torch/kernels/gemm.py folded_matmul): the same values
as the ONNX graph node by node, in fewer or larger kernels."""
from __future__ import annotations

import math

import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper as h

from tests.conftest import export_module
from onnxfuse.runtime.torch.patterns import torch_forms
from onnxfuse.runtime.torch.program import OnnxModule
from onnxfuse.runtime.torch.kernels import folded_matmul


class _HFGelu(torch.nn.Module):  # HF BERT's gelu: x * 0.5 * (1 + erf(x / sqrt(2)))
    def forward(self, x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


@pytest.mark.parametrize("act", [torch.nn.GELU(), _HFGelu()], ids=["nn.GELU", "hf-gelu"])
def test_exported_gelu_runs_as_one_gelu_and_equals_torch(act, tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), act, torch.nn.Linear(8, 3))
    model = export_module(net, tmp_path / "m.onnx", example_inputs=(torch.randn(4, 6),), opset=17)
    ops = [n.op_type for n in torch_forms(model.graph, [])]
    assert "Gelu" in ops and "Erf" not in ops, ops
    mod = OnnxModule(model)
    x = torch.randn(5, 6, requires_grad=True)
    got, = mod(x)
    want = net(x)
    assert torch.allclose(got, want, atol=1e-6)
    g1, = torch.autograd.grad(got.sum(), x)
    g2, = torch.autograd.grad(want.sum(), x)
    assert torch.allclose(g1, g2, atol=1e-6)


def _erf_chain(sqrt2: float, extra_reader: bool):
    c = lambda name, v: h.make_node("Constant", [], [name], value=h.make_tensor(name, TP.FLOAT, [], [v]))
    nodes = [c("s", sqrt2), c("one", 1.0), c("half", 0.5),
             h.make_node("Div", ["x", "s"], ["d"]), h.make_node("Erf", ["d"], ["e"]),
             h.make_node("Add", ["e", "one"], ["a"]), h.make_node("Mul", ["x", "a"], ["m"]),
             h.make_node("Mul", ["m", "half"], ["y"])]
    outs = [h.make_tensor_value_info("y", TP.FLOAT, [3])]
    if extra_reader:
        outs.append(h.make_tensor_value_info("e", TP.FLOAT, [3]))
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.FLOAT, [3])], outs)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


@pytest.mark.parametrize("sqrt2,extra_reader", [(1.4, False), (math.sqrt(2.0), True)],
                         ids=["not-sqrt2", "erf-read-elsewhere"])
def test_a_chain_that_is_not_exactly_gelu_is_left_alone(sqrt2, extra_reader):
    model = _erf_chain(sqrt2, extra_reader)
    assert "Gelu" not in [n.op_type for n in torch_forms(model.graph, [])]
    x = torch.randn(3)
    got = OnnxModule(model)(x)[0]
    want = x * 0.5 * (1 + torch.erf(x / sqrt2))
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("a,b", [((4, 5, 6, 7), (4, 1, 7, 3)), ((4, 5, 2, 6, 7), (4, 1, 1, 7, 3)),
                                 ((4, 5, 6, 7), (1, 1, 7, 3)), ((4, 5, 6, 7), (4, 5, 7, 3)),
                                 ((5, 6, 7), (7, 3)), ((6, 7), (4, 7, 3)), ((4, 5, 6, 7), (4, 1, 1, 7, 3))])
def test_folded_matmul_equals_torch_matmul_with_its_gradients(a, b):
    x, w = torch.randn(*a, dtype=torch.float64, requires_grad=True), torch.randn(*b, dtype=torch.float64,
                                                                               requires_grad=True)
    got, want = folded_matmul(x, w), torch.matmul(x, w)
    assert got.shape == want.shape and torch.allclose(got, want)
    g = torch.randn(want.shape, dtype=torch.float64)
    assert all(torch.allclose(p, q) for p, q in zip(torch.autograd.grad(got, (x, w), g),
                                                     torch.autograd.grad(want, (x, w), g)))
