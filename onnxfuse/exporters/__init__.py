"""Framework -> ONNX exporters (the layer above the core): ``torch_export.py`` (a torch module -> the ONNX graph fusion
reads) and ``zoo.py`` (small real models); ``factory.py`` (how the models are built and traced: the factory, its
arguments, the example inputs; checked without torch, so that the command line and config checks need none).
``torch_export``'s names are imported from it when first used."""
from __future__ import annotations

import importlib

from onnxfuse.exporters.factory import DEFAULT_OPSET, load_factory

__all__ = ["export_module", "export_array", "build_module", "load_factory", "DEFAULT_OPSET"]

_TORCH_EXPORT = ("export_module", "export_array", "build_module")


def __getattr__(name: str):
    if name not in _TORCH_EXPORT:
        raise AttributeError(f"module 'onnxfuse.exporters' has no attribute '{name}'")
    return getattr(importlib.import_module("onnxfuse.exporters.torch_export"), name)
