"""The rule catalog. Each module covers one op family and registers its rules by ONNX op type.

Adding an op = one function with ``@rule("OpType")`` in the family's module (and a test); nothing else changes.
"""
from __future__ import annotations

from . import (conv, einsum, elementwise, gather, gemm, norm, pool, reduce, resize, shape, slicing,  # noqa: F401
               softmax)  # (importing a module registers its rules)
from ._registry import RULES, Rule, rule, supported_ops

__all__ = ["RULES", "Rule", "rule", "supported_ops"]
