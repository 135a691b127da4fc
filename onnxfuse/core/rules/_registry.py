"""The rule catalog: op type -> rule, a :class:`~onnxfuse.core.registry.Registry`. Rules register themselves with
:func:`rule`; ``passes.fuse_models`` hands the table to the engine, which only looks rules up in it (the engine
imports no rule)."""
from __future__ import annotations

from onnxfuse.core.engine import Rule
from onnxfuse.core.registry import Registry

__all__ = ["Rule", "RULES", "rule", "supported_ops"]


RULES: Registry[Rule] = Registry("fusion rule")


def rule(*op_types: str, domain: str = "", shared_passthrough: bool = True, forms: tuple[str, ...] = ()):
    """Register the decorated function as the fusion rule of ``op_types`` (``forms``: see :class:`Rule`)."""
    return RULES.register(*op_types, domain=domain,
                          entry=lambda fn, op: Rule(op, fn, domain, shared_passthrough, tuple(forms)))


def supported_ops() -> list[str]:
    return RULES.names()
