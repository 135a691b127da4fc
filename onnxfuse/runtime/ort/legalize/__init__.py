"""Trainability legalization: rewrite nodes onnxruntime-training 1.19 cannot differentiate or run backward on CPU
into equivalent forms it can (same forward up to float rounding, same gradient as torch).

    legal_model, applied = legalize(model)   # applied: ["ReduceMax '/ReduceMax' -> ArgMax + GatherElements", ...]

The rewrite engine (``onnxfuse/core/rewrite.py``) applies one registered rewrite per op type (the catalog:
``_registry.REWRITES``, with the standard forms of onnxfuse's own ops, ``core/standard.py``'s ``STANDARD_FORMS``,
which write the recurrent rule's batched form back as standard nodes); each family module holds its rewrites:
``norm`` (LayerNormalization outputs, InstanceNormalization), ``reduce`` (ReduceMax/Min/L1/SumSquare/LogSum),
``conv`` (1-D and grouped N-D Conv), ``pad`` (reflect, edge, wrap), ``pool`` (AveragePool, GlobalMaxPool),
``activation`` (HardSigmoid, HardSwish, Elu, Selu, Celu, Softplus, PRelu, Sign), ``einsum``, ``cumsum``,
``conv_transpose``, ``resize``, ``depth_space`` (DepthToSpace, SpaceToDepth), ``split`` (unused outputs),
``slicing`` (a negative step on the last axis), ``sampling`` (AffineGrid), ``scatter`` (ScatterElements max/min)
and ``recurrent`` (reverse and bidirectional LSTM / GRU, RNN). A node that needs a rewrite but has a form none
supports raises :class:`onnxfuse.core.errors.UntrainableOpError` naming it.
"""
from __future__ import annotations

import onnx

from onnxfuse.core.errors import UntrainableOpError
from onnxfuse.core.rewrite import apply_rewrites
from onnxfuse.core.standard import STANDARD_FORMS
# importing a family module registers its rewrites
from onnxfuse.runtime.ort.legalize import (activation, conv, conv_transpose, cumsum, depth_space,  # noqa: F401
                                           einsum, norm, pad, pool, recurrent, reduce, resize, sampling, scatter,
                                           slicing, split)
from onnxfuse.runtime.ort.legalize._registry import REWRITES

__all__ = ["legalize", "REWRITES"]


_MAX_ROUNDS = 8


def legalize(model: onnx.ModelProto, parameters: set[str] | None = None) -> tuple[onnx.ModelProto, list[str]]:
    """A new model in which every node ORT 1.19 cannot train is replaced by a trainable equivalent, and one
    human-readable line per rewrite applied. The input model is not modified. ``parameters``: the initializers that
    are trained (None: any initializer may be).

    Rewrites run to a fixed point: a replacement may itself need legalizing (ConvTranspose 1-D becomes a 1-D Conv,
    which becomes a 2-D one), and each round sees the shapes of what the previous round emitted."""
    applied: list[str] = []
    for _ in range(_MAX_ROUNDS):
        model, new = apply_rewrites(model, [STANDARD_FORMS, REWRITES], parameters)
        if not new:
            return model, applied
        applied += new
    raise UntrainableOpError(f"legalization did not reach a fixed point in {_MAX_ROUNDS} rounds (last: {new[:3]}); "
                             "report it with the model")

