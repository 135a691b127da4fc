"""onnxfuse: fuse B same-architecture training jobs into one horizontally fused ONNX graph.

The package's folders are its layers, each importing only the ones before it (docs/architecture.md):
``core`` (ONNX alone: identity, fusion, weights, the array folder), ``exporters`` (torch -> ONNX), ``recipe``
(what a run is made of: settings, data, losses, optimizers, schedules), ``runtime`` (what trains the fused graph:
torch, ONNX Runtime), ``measure`` (benchmarks, sizing, measured forms), ``training`` (the run), ``placement``,
``sweep``, ``integrations`` and ``cli``. This module is the package's face: ``__all__`` and docs/python-api.md are
the public API (tests/structure/test_public_api.py holds them to each other); no module of the package imports it.
"""
from __future__ import annotations

import importlib

from onnxfuse.core._version import __version__
from onnxfuse.core.array import ArrayDir
from onnxfuse.core.errors import (ConfigError, DataError, InputFileError, NotFusibleError, OnnxFuseError,
                                  UnsupportedOpError)
from onnxfuse.core.layout import SHARED, Layout, packed, stacked
from onnxfuse.core.passes import FusedGraph, fuse_models, save_array
from onnxfuse.core.rules import supported_ops
from onnxfuse.core.weights import ArraySpec, FusedWeight, WeightSlot, pack_weights, unpack_weight


__all__ = [
    "fuse", "FusedArray", "optim", "fuse_models", "save_array", "FusedGraph", "ArrayDir", "ArraySpec", "FusedWeight", "WeightSlot", "pack_weights",
    "unpack_weight", "Layout", "SHARED", "stacked", "packed", "supported_ops",
    "OnnxFuseError", "InputFileError", "NotFusibleError", "UnsupportedOpError", "ConfigError", "DataError",
]

# The PyTorch face, imported when first used (``import onnxfuse`` stays free of torch): ``onnxfuse.fuse`` and
# ``onnxfuse.FusedArray`` (the array as a torch module), ``onnxfuse.optim`` (its per-model optimizers).
_TORCH_FACE = {"fuse": ("onnxfuse.runtime.torch.array_module", "fuse"),
               "FusedArray": ("onnxfuse.runtime.torch.array_module", "FusedArray"),
               "optim": ("onnxfuse.runtime.torch.optimizers", None)}


def __getattr__(name: str):
    if name not in _TORCH_FACE:
        raise AttributeError(f"module 'onnxfuse' has no attribute '{name}'")
    module, attr = _TORCH_FACE[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)

