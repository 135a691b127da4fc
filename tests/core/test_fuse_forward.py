"""Fused forward == every model's own forward, for exported torch models."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import MODELS, export_all, make_modules, rel_err, run_onnx
from onnxfuse import fuse_models


@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("name", ["lenet", "cnn_bn", "mlp"])
def test_fused_forward_equals_each_model(name, B, tmp_path, rng):
    mods = make_modules(name, B)
    shape = MODELS[name][1]
    paths = export_all(mods, shape, tmp_path)
    fa = fuse_models(paths)
    x = rng.standard_normal((6,) + shape[1:]).astype(np.float32)  # another batch size than the export's
    fused = run_onnx(fa.model, {"input": x})[0]
    assert fused.shape[0] == B
    singles = [run_onnx(p, {"input": x})[0] for p in paths]
    for b in range(B):
        assert rel_err(fused[b], singles[b]) < 1e-5, f"model {b}"
        with torch.no_grad():  # and the torch module itself (train mode: BatchNorm on batch statistics)
            assert rel_err(fused[b], mods[b].train()(torch.from_numpy(x)).numpy()) < 1e-5
    if B > 1:  # the models really differ, so a mix-up would be caught
        assert rel_err(singles[0], singles[1]) > 1e-2
    # one structural check: B convolutions became one
    n_conv = sum(n.op_type == "Conv" for n in fa.model.graph.node)
    assert n_conv == sum(n.op_type == "Conv" for n in fa.sources[0].nodes)
