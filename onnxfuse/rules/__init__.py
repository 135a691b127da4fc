"""The rule catalog. Each module covers one op family and registers its rules by ONNX op type.

Adding an op = one function with ``@rule("OpType")`` in the family's module (and a test); nothing else changes.
"""
from __future__ import annotations

from . import conv, elementwise, gemm, norm, pool, shape, softmax  # noqa: F401  (registration)
from ._registry import RULES, Rule, rule, supported_ops

__all__ = ["RULES", "Rule", "rule", "supported_ops"]
