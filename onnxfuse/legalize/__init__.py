"""Trainability legalization: rewrite nodes onnxruntime-training 1.19 cannot differentiate or run backward on CPU
into equivalent forms it can (same forward up to float rounding, same gradient as torch).

    fused_model, applied = legalize(model)   # applied: ["ReduceMax '/ReduceMax' -> ArgMax + GatherElements", ...]

The engine (``_engine.py``) applies one registered rewrite per op type; each family module holds its rewrites:
``norm`` (LayerNormalization outputs), ``reduce`` (ReduceMax/ReduceMin), ``activation`` (HardSigmoid/HardSwish),
``einsum``, ``cumsum``, ``conv_transpose``, ``resize`` and ``split`` (unused outputs). A node that needs a rewrite
but has a form none supports raises :class:`onnxfuse.errors.UntrainableOpError` naming it.
"""
from __future__ import annotations

import onnx

from . import activation, conv_transpose, cumsum, einsum, norm, reduce, resize, split  # noqa: F401  (registers)
from ._engine import REWRITES, apply_rewrites

__all__ = ["legalize", "legalized_ops"]


def legalize(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A new model in which every node ORT 1.19 cannot train is replaced by a trainable equivalent, and one
    human-readable line per rewrite applied. The input model is not modified."""
    return apply_rewrites(model)


def legalized_ops() -> list[str]:
    """The op types that have a legalization rewrite."""
    return sorted(op if not domain else f"{domain}::{op}" for domain, op in REWRITES)
