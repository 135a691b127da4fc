"""Graph identity: independent of node order and names; a mismatch names the differing nodes."""
from __future__ import annotations

import random

import onnx
import pytest
import torch

from tests.conftest import MODELS, export_all, make_modules, rel_err, run_onnx
from onnxfuse import NotFusibleError, fuse_models
from onnxfuse.exporters import zoo
from onnxfuse.core.identity import canonical_order
from onnxfuse.core.passes import toposort_pass
from onnxfuse.core.source import load_source


def _scramble(model: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """The same graph as another tool might write it: nodes in another topological order, every node, tensor and
    initializer renamed, no onnxfuse metadata."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.metadata_props[:]
    g = m.graph
    keep = {i.name for i in g.input if i.name not in {t.name for t in g.initializer}} | {o.name for o in g.output}
    names = {}
    for n in g.node:
        for t in list(n.input) + list(n.output):
            if t and t not in keep:
                names.setdefault(t, f"renamed_{len(names)}")
    for t in g.initializer:
        names.setdefault(t.name, f"renamed_{len(names)}")
    for n in g.node:
        n.name = f"node_{random.Random(seed).random()}"
        n.input[:] = [names.get(t, t) for t in n.input]
        n.output[:] = [names.get(t, t) for t in n.output]
    for t in g.initializer:
        t.name = names[t.name]
    for vi in g.value_info:
        vi.name = names.get(vi.name, vi.name)
    nodes = list(g.node)
    random.Random(seed).shuffle(nodes)
    del g.node[:]
    g.node.extend(nodes)
    return toposort_pass(m)  # a valid order again, but not the original one


@pytest.mark.parametrize("name", ["lenet", "cnn_bn"])
def test_canonical_order_ignores_order_and_names(name, tmp_path):
    mods = make_modules(name, 1)
    path = export_all(mods, MODELS[name][1], tmp_path)[0]
    model = onnx.load(path)
    a = load_source(model)
    b = load_source(_scramble(model, 1), label="scrambled")
    assert [n.op_type for n in a.nodes] != [n.op_type for n in b.nodes] or name == "cnn_bn"
    ops_a = [a.nodes[i].op_type for i in canonical_order(a)]
    ops_b = [b.nodes[i].op_type for i in canonical_order(b)]
    assert ops_a == ops_b


def test_fuse_models_with_renamed_tensors(tmp_path, rng):
    name = "lenet"
    mods = make_modules(name, 2)
    paths = export_all(mods, MODELS[name][1], tmp_path)
    m1 = onnx.load(paths[1])
    renamed = _scramble(m1, 3)
    fa = fuse_models([paths[0], renamed])
    x = rng.standard_normal((5, 1, 28, 28)).astype("float32")
    fused = run_onnx(fa.model, {"input": x})[0]
    for b, p in enumerate(paths):
        assert rel_err(fused[b], run_onnx(p, {"input": x})[0]) < 1e-5
    assert all(fw.sources[1].startswith("renamed_") for fw in fa.spec.weights.values())


class _LeNetK3(zoo.LeNet):
    def __init__(self):
        super().__init__()
        self.conv2 = torch.nn.Conv2d(6, 16, 5, padding=0, dilation=1, stride=1)
        self.conv2.kernel_size = (5, 5)
        self.conv2.padding = (1, 1)  # same weights' shape, different attribute
        self.fc1 = torch.nn.Linear(16 * 5 * 5, 120)


def test_mismatched_attribute_names_both_nodes(tmp_path):
    torch.manual_seed(0)
    a = export_all([zoo.LeNet()], (2, 1, 28, 28), tmp_path / "a")[0]
    b = export_all([_LeNetK3()], (2, 1, 28, 28), tmp_path / "b")[0]
    with pytest.raises(NotFusibleError) as e:
        fuse_models([a, b])
    msg = str(e.value)
    assert "/conv2/Conv" in msg and "pads" in msg and "model_0.onnx" in msg


def test_mismatched_width_names_shape(tmp_path):
    a = export_all([zoo.MLP(48, 32)], (2, 3, 4, 4), tmp_path / "a")[0]
    b = export_all([zoo.MLP(48, 16)], (2, 3, 4, 4), tmp_path / "b")[0]
    with pytest.raises(NotFusibleError, match=r"/fc1/Gemm.*shape"):
        fuse_models([a, b])


class _TanhMLP(zoo.MLP):
    def forward(self, x):
        x = torch.flatten(x, 1)
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def test_mismatched_op_type(tmp_path):
    a = export_all([zoo.MLP(48, 32)], (2, 3, 4, 4), tmp_path / "a")[0]
    b = export_all([_TanhMLP(48, 32)], (2, 3, 4, 4), tmp_path / "b")[0]
    with pytest.raises(NotFusibleError, match="op type Tanh vs Relu"):
        fuse_models([a, b])
