"""onnxfuse: fuse B same-architecture training jobs into one horizontally fused ONNX graph.

Core (this package) works on ONNX alone; ``onnxfuse.exporters`` turns torch modules into ONNX and
``onnxfuse.training`` trains a fused array with ONNX Runtime.
"""
from __future__ import annotations

from .array import ArrayDir
from .errors import (ConfigError, DataError, InputFileError, NotFusibleError, OnnxFuseError,
                     UnsupportedOpError)
from .layout import SHARED, Layout, packed, stacked
from .passes import FusedArray, fuse_models, save_array
from .rules import supported_ops
from .weights import ArraySpec, FusedWeight, WeightSlot, pack_weights, unpack_weight

__version__ = "0.1.0"

__all__ = [
    "fuse_models", "save_array", "FusedArray", "ArrayDir", "ArraySpec", "FusedWeight", "WeightSlot", "pack_weights",
    "unpack_weight", "Layout", "SHARED", "stacked", "packed", "supported_ops",
    "OnnxFuseError", "InputFileError", "NotFusibleError", "UnsupportedOpError", "ConfigError", "DataError",
]
