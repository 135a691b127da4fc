"""onnxfuse: fuse B same-architecture training jobs into one horizontally fused ONNX graph.

The package's folders are its layers, each importing only the ones before it (docs/architecture.md):
``core`` (ONNX alone: identity, fusion, weights, the array folder), ``exporters`` (torch -> ONNX), ``recipe``
(what a run is made of: settings, data, losses, optimizers, schedules), ``runtime`` (what trains the fused graph:
torch, ONNX Runtime), ``measure`` (benchmarks, sizing, measured forms), ``training`` (the run), ``placement``,
``sweep``, ``integrations`` and ``cli``. This module is the package's face: it re-exports the core API and keeps
the import paths of earlier versions working; no module of the package imports it.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

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
_TORCH_FACE = {"fuse": ("onnxfuse.runtime.array_module", "fuse"),
               "FusedArray": ("onnxfuse.runtime.array_module", "FusedArray"),
               "optim": ("onnxfuse.runtime.torch_optim", None)}


def __getattr__(name: str):
    if name not in _TORCH_FACE:
        raise AttributeError(f"module 'onnxfuse' has no attribute '{name}'")
    module, attr = _TORCH_FACE[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


# Import paths of the flat layout before the layer folders (0.1.0), each the module it now is.
MOVED = {f"onnxfuse.{m}": f"onnxfuse.core.{m}" for m in (
    "array", "engine", "errors", "identity", "layout", "passes", "rules", "legalize", "source", "split", "weights",
    "windows")} | {f"onnxfuse.training.{m}": f"onnxfuse.recipe.{m}" for m in (
        "config", "data", "datasets", "losses", "optim", "schedules", "settings")} | {
    "onnxfuse.training.runtime": "onnxfuse.recipe.runtimes",
    "onnxfuse.training.torch_runtime": "onnxfuse.runtime.torch_runtime",
    "onnxfuse.training.torch_graph": "onnxfuse.runtime.torch_graph",
    "onnxfuse.training.torch_ops": "onnxfuse.runtime.torch.kernels",
    "onnxfuse.training.trainer": "onnxfuse.runtime.ort_runtime",
    "onnxfuse.training.artifacts": "onnxfuse.runtime.ort_artifacts",
    "onnxfuse.training.plan": "onnxfuse.measure.sizing",
    "onnxfuse.training.demo": "onnxfuse.cli.demo",
    "onnxfuse.sweep.report": "onnxfuse.sweep.results",
    "onnxfuse.sweep.layout": "onnxfuse.sweep.folder",
    "onnxfuse.placement.report": "onnxfuse.placement.result",
    "onnxfuse.optim": "onnxfuse.runtime.torch_optim",  # not moved: the public name of the per-model optimizers
} | {f"onnxfuse.training.{m}": f"onnxfuse.measure.{m}" for m in (
    "bench", "bench_ort", "forms", "hfta_models", "workloads")}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import onnxfuse.training.plan`` gives the module ``onnxfuse.measure.sizing`` itself (one module object
    under both names, so a patch through either name is seen by both)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
