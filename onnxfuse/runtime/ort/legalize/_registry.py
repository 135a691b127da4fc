"""The legalization catalog: op type -> rewrite, a :class:`~onnxfuse.core.registry.Registry`. Each family module
registers its rewrites with :func:`rewrite`; ``legalize`` hands the catalog to the rewrite engine
(``core/rewrite.py``), which knows no op."""
from __future__ import annotations

from onnxfuse.core.registry import Registry
from onnxfuse.core.rewrite import Rewrite

__all__ = ["REWRITES", "rewrite"]

REWRITES: Registry[Rewrite] = Registry("legalization rewrite")


def rewrite(*op_types: str, domain: str = ""):
    """Register the decorated function as the legalization rewrite of ``op_types``."""
    return REWRITES.register(*op_types, domain=domain)
