"""Recurrent nets in ORT 1.19: its LSTMGrad and GRUGrad kernels train the forward direction only ("LSTM and
LSTMGrad kernel only supports the forward direction for now"), and RNN has no gradient builder. A reverse or
bidirectional LSTM / GRU becomes one forward node per direction, the reverse one on the sequence reversed; an RNN
is unrolled over its (static) time steps into MatMul, Add and its activation (``core/standard.py``'s
``unrolled_rnn``, which also unrolls the recurrent rule's batched RNN with a model axis: the batched forms'
standard ONNX, ``STANDARD_FORMS``, which legalization applies with this catalog)."""
from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.core.rewrite import Context, Emitter
from onnxfuse.core.standard import recurrent_axes, recurrent_inputs, sequence_length, unrolled_rnn
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["lstm_gru_directions", "rnn_unrolled"]

_STATES = {"LSTM": 2, "GRU": 1, "RNN": 1}  # Y_h (and Y_c) after Y


def _direction(em: Emitter, name: str, d: int) -> str:
    """Direction d of a per-direction tensor (axis 0: W, R, B, and initial states in layout 0)."""
    return em.slice(name, [d], [d + 1], [0]) if name else ""


def _state(em: Emitter, name: str, d: int, layout: int) -> str:
    return em.slice(name, [d], [d + 1], [1 if layout else 0]) if name else ""


def _reversed(em: Emitter, x: str, T: int, axis: int) -> str:
    return em.op("Gather", [x, em.const(np.arange(T - 1, -1, -1), hint="reversed")], axis=axis)


@rewrite("LSTM", "GRU")
def lstm_gru_directions(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """LSTM / GRU with direction reverse or bidirectional  ==>  per direction d, the same op with direction forward
    on W[d], R[d], B[d] and the initial states' d; the reverse one reads X reversed along time (Gather) and its Y is
    reversed back; Y, Y_h, Y_c are the directions concatenated (forward first, as ONNX orders them).

    Layout: X [T, N, I] (layout 1: [N, T, I]), Y [T, D, N, H] ([N, T, D, H]), Y_h [D, N, H] ([N, D, H]).
    Math: a reverse direction is the forward recurrence over the reversed sequence, its outputs at reversed time
    steps; the gradient flows through the same Gathers.
    """
    attrs = ctx.attrs(node)
    direction = attrs.get("direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    if direction == "forward":
        return None
    ins = recurrent_inputs(node)
    T = sequence_length(node, ctx, ins)
    layout = int(attrs.get("layout", 0))
    t_axis, y_dir, h_dir = recurrent_axes(layout)
    em = Emitter(node, ctx)
    kept = {k: v for k, v in attrs.items() if k not in ("direction", "activations", "activation_alpha",
                                                        "activation_beta")}
    acts = attrs.get("activations")
    n_acts = len(acts) // (2 if direction == "bidirectional" else 1) if acts else 0
    dirs = [0, 1] if direction == "bidirectional" else [0]
    outs = [o for o in node.output]
    n_states = _STATES[node.op_type]
    results: list[list[str]] = []
    for d in dirs:
        reverse = direction == "reverse" or d == 1
        x = _reversed(em, ins[0], T, t_axis) if reverse else ins[0]
        sub = [x, _direction(em, ins[1], d), _direction(em, ins[2], d), _direction(em, ins[3], d), "",
               _state(em, ins[5], d, layout)]
        if node.op_type == "LSTM":
            sub += [_state(em, ins[6], d, layout), _direction(em, ins[7], d)]
        while sub and not sub[-1]:
            sub.pop()
        extra = {"activations": list(acts[d * n_acts:(d + 1) * n_acts])} if acts else {}
        o = em.op(node.op_type, sub, 1 + n_states, direction="forward", **kept, **extra)
        y, *states = o
        if reverse:
            y = _reversed(em, y, T, t_axis)
        results.append([y, *states])
    for k, out in enumerate(outs):
        if not out:
            continue
        parts = [r[k] for r in results]
        axis = y_dir if k == 0 else h_dir
        if len(parts) == 1:
            em.op("Identity", parts, [out])
        else:
            em.op("Concat", parts, [out], axis=axis)
    return em.nodes


@rewrite("RNN")
def rnn_unrolled(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """RNN  ==>  per direction, T steps of H_t = f(X_t W^T + Wb + H_{t-1} R^T + Rb) (f: Tanh or Relu): the
    recurrence unrolled (:func:`~onnxfuse.core.standard.unrolled_rnn`).

    Layout: X [T, N, I] (layout 1: [N, T, I]), W [D, H, I], R [D, H, H], B [D, 2H], initial_h [D, N, H]
    ([N, D, H]); Y [T, D, N, H] ([N, T, D, H]), Y_h [D, N, H] ([N, D, H]).
    Math: ONNX's (and torch's) recurrence, step by step; ORT differentiates each op.
    """
    return unrolled_rnn(node, ctx, models=False)
