"""The rule catalog: op type -> rule, a :class:`~onnxfuse.core.registry.Registry`. Rules register themselves with
:func:`rule`; ``passes.fuse_models`` hands the table to the engine, which only looks rules up in it (the engine
imports no rule)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from onnxfuse.core.registry import Registry

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup

__all__ = ["Rule", "RULES", "rule", "supported_ops"]


@dataclass(frozen=True)
class Rule:
    op_type: str
    fuse: "Callable[[NodeGroup], None]"
    domain: str = ""
    # When every input is shared (same in all models), the engine emits the node once, unchanged. Rules for ops
    # whose result must differ per model even then (random ops such as Dropout) turn this off.
    shared_passthrough: bool = True
    # The fused forms the rule can emit, the default first (e.g. Conv: "grouped", "per-model"). A fusion strategy
    # (``passes.fuse_models(strategy=...)``) picks one per node; the rule reads it as ``g.form``. Every form keeps
    # the same weight layout, so array.json, checkpoints and split do not depend on the choice.
    forms: tuple[str, ...] = ()


RULES: Registry[Rule] = Registry("fusion rule")


def rule(*op_types: str, domain: str = "", shared_passthrough: bool = True, forms: tuple[str, ...] = ()):
    """Register the decorated function as the fusion rule of ``op_types`` (``forms``: see :class:`Rule`)."""
    return RULES.register(*op_types, domain=domain,
                          entry=lambda fn, op: Rule(op, fn, domain, shared_passthrough, tuple(forms)))


def supported_ops() -> list[str]:
    return RULES.names()
