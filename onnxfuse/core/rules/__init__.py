"""The rule catalog. Each module covers one op family and registers its rules by ONNX op type.

Adding an op = one function with ``@rule("OpType")`` in the family's module (and a test); nothing else changes.
"""
from __future__ import annotations

from onnxfuse.core.rules import (conv, einsum, elementwise, gather, gemm,  # (importing a module registers its rules)
                                 norm, pool, quantize, random, recurrent, reduce, resize, shape, signal, slicing,
                                 softmax)
from onnxfuse.core.rules._registry import RULES, Rule, rule, supported_ops

__all__ = ["RULES", "Rule", "rule", "supported_ops"]
