"""Trainability legalization: rewrite nodes onnxruntime-training 1.19 cannot differentiate or run backward on CPU
into equivalent forms it can (same forward up to float rounding, same gradient as torch).

    legal_model, applied = legalize(model)   # applied: ["ReduceMax '/ReduceMax' -> ArgMax + GatherElements", ...]

The engine (``_engine.py``) applies one registered rewrite per op type; each family module holds its rewrites:
``norm`` (LayerNormalization outputs, InstanceNormalization), ``reduce`` (ReduceMax/Min/L1/SumSquare/LogSum),
``conv`` (1-D and grouped N-D Conv), ``pad`` (reflect, edge, wrap), ``pool`` (AveragePool, GlobalMaxPool), ``activation`` (HardSigmoid, HardSwish, Elu, Selu, Celu, Softplus, PRelu, Sign), ``einsum``, ``cumsum``,
``conv_transpose``, ``resize``, ``depth_space`` (DepthToSpace, SpaceToDepth), ``split`` (unused outputs),
``slicing`` (a negative step on the last axis), ``sampling`` (AffineGrid), ``scatter`` (ScatterElements max/min) and ``recurrent`` (reverse and bidirectional LSTM / GRU, RNN,
the recurrent rule's batched form). A node that needs a rewrite but has a form none supports raises
:class:`onnxfuse.core.errors.UntrainableOpError` naming it.
"""
from __future__ import annotations

import copy

import onnx

# importing a family module registers its rewrites
from onnxfuse.core.legalize import (activation, conv, conv_transpose, cumsum, depth_space, einsum, norm,  # noqa: F401
                                    pad, pool, recurrent, reduce, resize, sampling, scatter, slicing, split)
from onnxfuse.core._graph import node_label
from onnxfuse.core.errors import NotFusibleError, UntrainableOpError
from onnxfuse.core.legalize._engine import REWRITES, apply_rewrites
from onnxfuse.core.rules.recurrent import TORCH_DOMAIN

__all__ = ["legalize", "legalized_ops", "own_ops", "standard_onnx"]


_MAX_ROUNDS = 8


def legalize(model: onnx.ModelProto, parameters: set[str] | None = None) -> tuple[onnx.ModelProto, list[str]]:
    """A new model in which every node ORT 1.19 cannot train is replaced by a trainable equivalent, and one
    human-readable line per rewrite applied. The input model is not modified. ``parameters``: the initializers that
    are trained (None: any initializer may be).

    Rewrites run to a fixed point: a replacement may itself need legalizing (ConvTranspose 1-D becomes a 1-D Conv,
    which becomes a 2-D one), and each round sees the shapes of what the previous round emitted."""
    applied: list[str] = []
    for _ in range(_MAX_ROUNDS):
        model, new = apply_rewrites(model, parameters)
        if not new:
            return model, applied
        applied += new
    raise UntrainableOpError(f"legalization did not reach a fixed point in {_MAX_ROUNDS} rounds (last: {new[:3]}); "
                             "report it with the model")


def own_ops(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes of ``model`` in onnxfuse's own domain (the torch runtime's ops that a fusion rule emits: the
    recurrent rule's batched form), which no other ONNX runtime knows."""
    return [n for n in model.graph.node if n.domain == TORCH_DOMAIN]


def standard_onnx(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the nodes of onnxfuse's own domain (:func:`own_ops`) rewritten into standard ONNX ops computing
    the same values, and nothing else changed but the domain's opset import: a graph any ONNX runtime runs as it is
    (an onnxruntime ``InferenceSession``), with every initializer of ``model`` under its name (the rewrites add
    constants of their own). What an array's ``fused.onnx`` holds. The input is not modified."""
    if not own_ops(model):
        return copy.deepcopy(model)
    out, _ = apply_rewrites(model, only=lambda node: node.domain == TORCH_DOMAIN)
    left = own_ops(out)
    if left:  # every op a rule emits in the domain has its rewrite (legalize/recurrent.py)
        raise NotFusibleError(f"internal error: node '{node_label(left[0])}' ({TORCH_DOMAIN}::{left[0].op_type}) "
                              "has no standard ONNX form")
    kept = [o for o in out.opset_import if o.domain != TORCH_DOMAIN]
    del out.opset_import[:]
    out.opset_import.extend(kept)
    return out


def legalized_ops() -> list[str]:
    """The op types that have a legalization rewrite."""
    return REWRITES.names()
