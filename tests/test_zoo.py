"""Every zoo model: the fused forward equals each model's own forward (B = 1 and 4)."""
from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch

from conftest import rel_err, run_onnx
from onnxfuse import fuse_models
from onnxfuse.exporters import export_module
from onnxfuse.exporters.zoo import ZOO


def zoo_modules(name: str, B: int, seed0: int = 0) -> list[torch.nn.Module]:
    """B instances with different weights; dropout off, since random masks cannot match between frameworks."""
    factory = ZOO[name].factory
    kwargs = {"dropout": 0.0} if "dropout" in inspect.signature(factory).parameters else {}
    mods = []
    for b in range(B):
        torch.manual_seed(seed0 + b)
        mods.append(factory(**kwargs))
    return mods


def zoo_input(name: str, n: int, seed: int = 1) -> torch.Tensor:
    e = ZOO[name]
    shape = (n,) + tuple(e.input_shape[1:])
    gen = torch.Generator().manual_seed(seed)
    if e.input_dtype == "int64":
        return torch.randint(0, e.input_high, shape, generator=gen)
    return torch.randn(shape, generator=gen)


def export_zoo(name: str, mods, folder) -> list[str]:
    paths = []
    for b, m in enumerate(mods):
        paths.append(str(folder / f"model_{b}.onnx"))
        export_module(m, paths[-1], example_inputs=(zoo_input(name, 8),))
    return paths


@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_fused_forward(name, B, tmp_path):
    mods = zoo_modules(name, B)
    paths = export_zoo(name, mods, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every zoo model fuses completely: no per-model fallback
        fa = fuse_models(paths)
    assert fa.spec.summary["fused_fraction"] == 1.0
    x = zoo_input(name, 5, seed=2)
    fused = run_onnx(fa.model, {"input": x.numpy()})[0]
    for b, m in enumerate(mods):
        with torch.no_grad():
            ref = m.train()(x).numpy()
        assert rel_err(fused[b], ref) < 1e-4, (name, b)
