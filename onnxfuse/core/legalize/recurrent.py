"""Recurrent nets in ORT 1.19: its LSTMGrad and GRUGrad kernels train the forward direction only ("LSTM and
LSTMGrad kernel only supports the forward direction for now"), and RNN has no gradient builder. A reverse or
bidirectional LSTM / GRU becomes one forward node per direction, the reverse one on the sequence reversed; an RNN
is unrolled over its (static) time steps into MatMul, Add and its activation. The recurrent rule's batched form, the
torch runtime's own op, becomes one standard node per model (LSTM, GRU: which the rewrites above then legalize), or
for an RNN the unrolled steps with a model axis (one batched MatMul per step for all models; B standard RNN nodes
where it cannot be unrolled). These last rewrites are also ``standard_onnx``'s: what an array's ``fused.onnx``
holds in place of the batched node."""
from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.core.errors import UntrainableOpError
from onnxfuse.core.legalize._engine import Context, Emitter, rewrite
from onnxfuse.core.rules.recurrent import BATCHED, TORCH_DOMAIN

__all__ = ["lstm_gru_directions", "rnn_unrolled", "batched_rnn_unrolled", "batched_per_model"]

_STATES = {"LSTM": 2, "GRU": 1, "RNN": 1}  # Y_h (and Y_c) after Y


def _inputs(node: onnx.NodeProto) -> list[str]:
    return list(node.input) + [""] * (8 - len(node.input))


def _axes(layout: int) -> tuple[int, int, int]:
    """(time axis of X and Y, direction axis of Y, direction axis of Y_h / Y_c) for ``layout``."""
    return (1, 2, 1) if layout else (0, 1, 0)


def _check(node: onnx.NodeProto, ctx: Context, ins: list[str], model_axes: int = 0) -> int:
    """The static sequence length (X's time axis after ``model_axes`` leading model axes); refuses sequence_lens
    other than a constant full length (a reversed direction would reverse within each length; the rewrites drop
    full lengths)."""
    layout = int(ctx.attrs(node).get("layout", 0))
    T = ctx.static_dim(node, ins[0], _axes(layout)[0] + model_axes, "reversing the sequence of a recurrent op")
    lens = ctx.constant(ins[4]) if ins[4] else None
    if ins[4] and (lens is None or bool((lens != T).any())):
        raise ctx.error(node, "it has sequence_lens, which its reverse direction cannot be rewritten with",
                        "pad the sequences to one length without sequence_lens, or train it with runtime='torch'")
    return T


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
    ins = _inputs(node)
    T = _check(node, ctx, ins)
    layout = int(attrs.get("layout", 0))
    t_axis, y_dir, h_dir = _axes(layout)
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
    """RNN  ==>  per direction, T steps of H_t = f(X_t W^T + Wb + H_{t-1} R^T + Rb) (f: Tanh or Relu), X_t a
    Gather of time step t (reversed order for the reverse direction), H_0 the initial state or zeros; Y the H_t
    stacked on time (Unsqueeze, Concat) and the directions concatenated; Y_h each direction's last H.

    Layout: X [T, N, I] (layout 1: [N, T, I]), W [D, H, I], R [D, H, H], B [D, 2H], initial_h [D, N, H]
    ([N, D, H]); Y [T, D, N, H] ([N, T, D, H]), Y_h [D, N, H] ([N, D, H]).
    Math: ONNX's (and torch's) recurrence, step by step; ORT differentiates each op.
    """
    return _unrolled(node, ctx, models=False)


@rewrite(BATCHED["RNN"], domain=TORCH_DOMAIN)
def batched_rnn_unrolled(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """``onnxfuse.torch::BatchedRNN`` (B models' RNNs)  ==>  the unrolled RNN of :func:`rnn_unrolled` with a leading
    model axis: each step one batched MatMul over the models, [B, N, I] @ [B, I, H] (a shared X_t [N, I] and H_0
    broadcast over the models), instead of B unrolled RNNs.

    Layout: X [B, T, N, I] or shared [T, N, I]; W [B, D, H, I], R [B, D, H, H], B [B, D, 2H]; initial_h
    [B, D, N, H] or shared [D, N, H]; outputs [B, ...] (layout 1 as for RNN, after the model axis).
    Math: MatMul broadcasting pairs model b's operands only; each model's recurrence is :func:`rnn_unrolled`'s.

    A node the unroll cannot take (a dynamic sequence length, sequence_lens, other activations, clip) becomes B
    standard RNN nodes instead (:func:`batched_per_model`): a graph any ONNX runtime runs (``standard_onnx``);
    legalizing those for ORT training then refuses it in one line, naming what the unroll needs."""
    if not _unrollable(node, ctx, models=True):
        return batched_per_model(node, ctx)
    return _unrolled(node, ctx, models=True)


def _unrollable(node: onnx.NodeProto, ctx: Context, models: bool) -> bool:
    """Whether :func:`_unrolled` takes ``node``: a static sequence length, no sequence_lens other than a constant
    full length, Tanh or Relu activations and no clip."""
    try:
        _check(node, ctx, _inputs(node), int(models and ctx.rank(node, node.input[0]) == 4))
    except UntrainableOpError:
        return False
    attrs = ctx.attrs(node)
    acts = [a.decode() if isinstance(a, bytes) else a for a in attrs.get("activations") or ["Tanh"]]
    return all(a in ("Tanh", "Relu") for a in acts) and attrs.get("clip") is None


def _unrolled(node: onnx.NodeProto, ctx: Context, models: bool) -> list[onnx.NodeProto]:
    """The unrolled RNN; ``models``: every weight has a leading model axis, X and initial_h have one where their
    rank says so, and so does every output."""
    attrs = ctx.attrs(node)
    ins = _inputs(node)
    m = int(models)  # the weights' and outputs' model axis offset
    xo = int(models and ctx.rank(node, ins[0]) == 4)  # X's
    so = int(models and bool(ins[5]) and ctx.rank(node, ins[5]) == 4)  # initial_h's
    layout = int(attrs.get("layout", 0))
    T = _check(node, ctx, ins, xo)
    t_axis, y_dir, h_dir = (a + m for a in _axes(layout))
    direction = attrs.get("direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    dirs = [0, 1] if direction == "bidirectional" else [0]
    acts = [a.decode() if isinstance(a, bytes) else a for a in (attrs.get("activations") or ["Tanh"] * len(dirs))]
    if any(a not in ("Tanh", "Relu") for a in acts) or attrs.get("clip") is not None:
        raise ctx.error(node, f"activations {acts} (or clip) have no rewrite", "use Tanh or Relu without clip")
    H = int(attrs["hidden_size"])
    em = Emitter(node, ctx)
    swap = [0, 2, 1] if m else [1, 0]  # the last two axes
    ys, hs = [], []
    for d in dirs:
        reverse = direction == "reverse" or d == 1
        w = em.transpose(em.squeeze(em.slice(ins[1], [d], [d + 1], [m]), [m]), swap)  # [(B,) I, H]
        r = em.transpose(em.squeeze(em.slice(ins[2], [d], [d + 1], [m]), [m]), swap)  # [(B,) H, H]
        bias = None
        if ins[3]:
            halves = em.squeeze(em.slice(ins[3], [d], [d + 1], [m]), [m])
            wb, rb = em.op("Split", [halves, em.const([H, H], hint="halves")], 2, axis=m)
            bias = em.op("Add", [wb, rb])  # [(B,) H]
            if m:
                bias = em.unsqueeze(bias, [1])  # [B, 1, H]
        if ins[5]:
            axis = (1 if layout else 0) + so
            h = em.squeeze(em.slice(ins[5], [d], [d + 1], [axis]), [axis])  # [(B,) N, H]
        else:
            n = em.op("Gather", [em.op("Shape", [ins[0]]), em.const((0 if layout else 1) + xo, hint="batch")])
            dims = [em.unsqueeze(n, [0]), em.const([H], hint="H")]
            if m:
                dims.insert(0, em.op("Gather", [em.op("Shape", [ins[1]]), em.const([0], hint="models")]))
            h = em.op("ConstantOfShape", [em.op("Concat", dims, axis=0)],
                      value=onnx.helper.make_tensor("zero", ctx.dtype(ins[0]), [1], [0]))
        steps = []
        for t in (range(T - 1, -1, -1) if reverse else range(T)):
            x_t = em.op("Gather", [ins[0], em.const(t, hint="t")], axis=_axes(layout)[0] + xo)  # [(B,) N, I]
            a = em.op("Add", [em.op("MatMul", [x_t, w]), em.op("MatMul", [h, r])])
            if bias is not None:
                a = em.op("Add", [a, bias])
            h = em.op(acts[d if len(acts) > 1 else 0], [a])
            steps.append(h)
        if reverse:
            steps = steps[::-1]
        # Y of this direction: [(B,) T, 1, N, H] (layout 1: [(B,) N, T, 1, H])
        stacked = em.op("Concat", [em.unsqueeze(s, [t_axis]) for s in steps], axis=t_axis)
        ys.append(em.unsqueeze(stacked, [y_dir]))
        hs.append(em.unsqueeze(h, [h_dir]))
    outs = list(node.output) + ["", ""]
    for out, parts, axis in ((outs[0], ys, y_dir), (outs[1], hs, h_dir)):
        if out:
            em.op("Concat", parts, [out], axis=axis) if len(parts) > 1 else em.op("Identity", parts, [out])
    return em.nodes


@rewrite(BATCHED["LSTM"], BATCHED["GRU"], domain=TORCH_DOMAIN)
def batched_per_model(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """``onnxfuse.torch::Batched<op>`` (B models' recurrences, every per-model tensor [B, ...])  ==>  per model b,
    the standard op on its slices (Gather b on the model axis) with the same attributes; each output the B results
    stacked again (Unsqueeze, Concat on axis 0).

    Layout: X [B, T, N, I] or shared [T, N, I] (rank 3); initial states [B, D, N, H] or shared [D, N, H]; weights
    [B, ...]; sequence_lens shared. Math: the batched op is defined as exactly these B recurrences.
    """
    op_type = next(op for op, batched in BATCHED.items() if batched == node.op_type)
    em = Emitter(node, ctx)
    ins = _inputs(node)[:len(node.input)]
    B = ctx.static_dim(node, ins[1], 0, "taking each model's weights")
    shared = {0: 3, 5: 3, 6: 3}  # inputs whose shared form has this rank (the others are per model, or shared lens)
    per_model = [bool(t) and k != 4 and (k not in shared or ctx.rank(node, t) > shared[k]) for k, t in enumerate(ins)]
    results = []
    for b in range(B):
        index = em.const(b, hint="model")
        sub = [em.op("Gather", [t, index], axis=0) if per_model[k] else t for k, t in enumerate(ins)]
        outs = [ctx.fresh(f"{out}__model{b}") if out else "" for out in node.output]
        results.append(em.emit(op_type, sub, outs, **ctx.attrs(node)))
    for j, out in enumerate(node.output):
        if out:
            em.op("Concat", [em.unsqueeze(r[j], [0]) for r in results], [out], axis=0)
    return em.nodes
