"""Framework -> ONNX exporters (installed as ``onnxfuse.exporters``)."""
from __future__ import annotations

from .torch_export import DEFAULT_OPSET, export_array, export_module, load_factory

__all__ = ["export_module", "export_array", "load_factory", "DEFAULT_OPSET"]
