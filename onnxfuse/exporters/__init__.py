"""Framework -> ONNX exporters (the layer above the core): ``torch_export.py`` (a torch module -> the ONNX graph fusion
reads) and ``zoo.py`` (small real models)."""
from __future__ import annotations

from onnxfuse.exporters.torch_export import DEFAULT_OPSET, export_array, export_module, load_factory

__all__ = ["export_module", "export_array", "load_factory", "DEFAULT_OPSET"]
