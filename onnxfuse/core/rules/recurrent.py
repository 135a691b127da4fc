"""Recurrent ops: B LSTMs / GRUs / RNNs as one batched node, as B nodes, or as one node over block-diagonal weights.

ONNX's recurrent ops, one layer each (``nn.LSTM``/``nn.GRU``/``nn.RNN`` export one node per layer), inputs
X [T, N, I] (layout 1: [N, T, I]), W [D, G*H, I], R [D, G*H, H], B [D, 2*G*H], sequence_lens [N], initial_h and
initial_c [D, N, H] ([N, D, H]), P [D, 3*H] (LSTM's peepholes); outputs Y [T, D, N, H] ([N, T, D, H]), Y_h and
Y_c [D, N, H] ([N, D, H]); D directions, G gates (LSTM 4, GRU 3, RNN 1), H hidden units.

The forms, measured on a 2-core CPU (``benchmarks/recurrent_forms.py``, README "Recurrent nets"):

    batched         one ``onnxfuse.torch::Batched<op>`` node: every input and output with a leading model axis
                    ([B, ...], stacked(0)); the recurrence runs once over all models, each step one batched
                    product per direction (``torch.baddbmm``). The torch runtime's own op (``runtime/torch/kernels/recurrent.py``); for
                    ONNX Runtime the legalization writes it back as B standard nodes (LSTM, GRU: ORT's own
                    kernels) or one RNN unrolled with a model axis (its standard forms, ``core/standard.py``).
                    Fastest for GRU and RNN on the torch runtime (torch's CPU GRU/RNN is a loop of small products
                    per model). The default of GRU and RNN.
    per-model       B standard nodes on each model's slices (what ran before the rule existed): torch runs
                    ``_VF.lstm`` per model, whose CPU kernel is oneDNN's fused LSTM, faster than any batched
                    loop of torch ops measured here. The default of LSTM.
    block-diagonal  one standard node over all models: hidden size B*H, W' [D, G*B*H, B*I] block-diagonal (model b's
                    gate-g rows g*B*H + b*H .. read only its own inputs), computed in the graph from the packed
                    weights times an identity mask, so the zero blocks are no parameters and get no update.
                    B times the FLOPs of the others in both products; won only at B = 2 with a small H (an RNN).

Every form keeps each model's weights stacked [B, ...] (the same slots) and computes each model's recurrence alone.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from onnxfuse.core.layout import packed, stacked
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup

__all__ = ["TORCH_DOMAIN", "BATCHED"]

TORCH_DOMAIN = "onnxfuse.torch"  # the torch runtime's own ops
BATCHED = {op: f"Batched{op}" for op in ("LSTM", "GRU", "RNN")}  # the batched form's op type, by ONNX op
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_X, _W, _R, _B, _LENS, _H0, _C0, _P = range(8)


def _per_model_lens(g: "NodeGroup") -> None:
    if not g.is_shared(_LENS):
        g.fail("its sequence_lens differ per model, which only the per-model form reads; fuse it with "
               "strategy='per-model'")


def _batched(g: "NodeGroup") -> None:
    """Layout: X [B, T, N, I] stacked(0), or shared [T, N, I] (read once by every model); W, R, B, P [B, ...] stacked(0);
    initial states [B, D, N, H] stacked(0) or shared [D, N, H]; sequence_lens shared. Outputs stacked(0).
    Math: model b's outputs = op(X_b, W_b, R_b, B_b, ...), the attributes unchanged (see the kernel)."""
    _per_model_lens(g)
    ins = []
    for i in range(g.num_inputs):
        if not g.has_input(i):
            ins.append("")
        elif i in (_X, _LENS, _H0, _C0) and g.is_shared(i):
            ins.append(g.shared(i))
        else:
            ins.append(g.get(i, stacked(0)))
    outs = [g.out_name(j) if o else "" for j, o in enumerate(g.node.output)]
    g.emit(BATCHED[g.op_type], ins, outs, domain=TORCH_DOMAIN, **g.attrs())
    for j, o in enumerate(outs):
        if o:
            g.set_output(j, o, stacked(0))


def _gate_major(g: "NodeGroup", x: str, rows: int, H: int) -> str:
    """[B, D, rows*H] (model-major) -> [D, rows*B*H]: block k of H units of every model, then block k+1 (the
    order a node of hidden size B*H reads its gates, biases and peepholes in)."""
    B = g.B
    x = g.emit("Reshape", [x, g.new_const([B, -1, rows, H])])[0]
    x = g.emit("Transpose", [x], perm=[1, 2, 0, 3])[0]
    return g.emit("Reshape", [x, g.new_const([0, -1])])[0]


def _block_diagonal(g: "NodeGroup", w: str, G: int, H: int, cols: int, shared_x: bool) -> str:
    """W [B, D, G*H, cols] -> W' [D, G*B*H, B*cols] with W'[d, g*B*H + b*H + h, b'*cols + k] = W[b, d, g*H + h, k]
    if b == b' else 0 (the product of the gate-major weights [D, G, B, H, 1, cols] and an identity mask
    [B, 1, B, 1]); for a shared input read by every model (``shared_x``), no zeros: W' [D, G*B*H, cols]."""
    B = g.B
    w = g.emit("Reshape", [w, g.new_const([B, -1, G, H, cols])])[0]
    w = g.emit("Transpose", [w], perm=[1, 2, 0, 3, 4])[0]  # [D, G, B, H, cols]
    if shared_x:
        return g.emit("Reshape", [w, g.new_const([0, G * B * H, cols])])[0]
    w = g.emit("Unsqueeze", [w, g.new_const([4])])[0]  # [D, G, B, H, 1, cols]
    mask = g.new_const(np.eye(B, dtype=np.float32).reshape(B, 1, B, 1), "block_diagonal_mask", np.float32)
    w = g.emit("Mul", [w, mask])[0]  # [D, G, B, H, B, cols]
    return g.emit("Reshape", [w, g.new_const([0, G * B * H, B * cols])])[0]


def _block_diagonal_form(g: "NodeGroup") -> None:
    """Layout: X packed on its last axis [T, N, B*I] ([N, T, B*I]), or shared [T, N, I]; W, R stacked(0) and made
    block-diagonal in the graph (:func:`_block_diagonal`), B and P gate-major (:func:`_gate_major`); initial states
    packed(2) [D, N, B*H] ([N, D, B*H]); Y packed(3) [T, D, N, B*H], Y_h / Y_c packed(2).
    Math: hidden unit b*H + h of gate g is model b's unit h: its pre-activation reads model b's inputs and hidden
    units only (the other blocks are exact zeros), and every ONNX activation, clip and the GRU's reset acts per unit."""
    _per_model_lens(g)
    G, H = _GATES[g.op_type], int(g.attr("hidden_size"))
    shared_x = g.is_shared(_X)
    x_shape = g.input_shape(_X)
    if x_shape is None or not isinstance(x_shape[-1], int):
        g.fail("the input size (the last dim of X) is not static")
    I = x_shape[-1]
    ins = [g.shared(_X) if shared_x else g.get(_X, packed(2)),
           _block_diagonal(g, g.get(_W, stacked(0)), G, H, I, shared_x),
           _block_diagonal(g, g.get(_R, stacked(0)), G, H, H, False)]
    for i in range(_B, g.num_inputs):
        if not g.has_input(i):
            ins.append("")
        elif i in (_B, _P):  # B: 2*G blocks of H (Wb's gates, then Rb's); P: 3 blocks
            ins.append(_gate_major(g, g.get(i, stacked(0)), 2 * G if i == _B else 3, H))
        elif i == _LENS:
            ins.append(g.shared(i))
        else:
            ins.append(g.get(i, packed(2)))
    outs = [g.out_name(j) if o else "" for j, o in enumerate(g.node.output)]
    g.emit(g.op_type, ins, outs, **{**g.attrs(), "hidden_size": g.B * H})
    for j, o in enumerate(outs):
        if o:
            g.set_output(j, o, packed(3 if j == 0 else 2))


def fuse_recurrent(g: "NodeGroup") -> None:
    """B LSTMs / GRUs / RNNs -> the chosen form (see the module docstring for each form's layout and cost)."""
    if g.form == "per-model":
        g.per_model()
    elif g.form == "block-diagonal":
        _block_diagonal_form(g)
    else:
        _batched(g)


# the default first: measured fastest on the torch runtime (module docstring)
rule("LSTM", forms=("per-model", "batched", "block-diagonal"))(fuse_recurrent)
rule("GRU", "RNN", forms=("batched", "per-model", "block-diagonal"))(fuse_recurrent)
