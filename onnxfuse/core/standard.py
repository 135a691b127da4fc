"""onnxfuse's own ops in standard ONNX: the nodes of the torch runtime's domain (``onnxfuse.torch``) that a fusion
rule emits (the recurrent rule's batched form), each rewritten into standard ONNX ops computing the same values.

    standard = standard_onnx(fused)     # what an array's fused.onnx holds: any ONNX runtime opens it

The catalog is :data:`STANDARD_FORMS` (one rewrite per own op type, run by the rewrite engine, ``rewrite.py``):
the batched RNN unrolled with a model axis, the batched LSTM / GRU as one standard node per model. Array saving
(``array.py``), split and placement read graphs through :func:`standard_onnx`; ONNX Runtime's legalization
(``runtime/ort/legalize/``) applies this catalog with its own, and unrolls a plain RNN with :func:`unrolled_rnn`.
"""
from __future__ import annotations

import copy

import onnx

from onnxfuse.core._graph import node_label
from onnxfuse.core.errors import NotFusibleError, UntrainableOpError
from onnxfuse.core.registry import Registry
from onnxfuse.core.rewrite import Context, Emitter, Rewrite, apply_rewrites
from onnxfuse.core.rules.recurrent import BATCHED, TORCH_DOMAIN

__all__ = ["STANDARD_FORMS", "standard_form", "own_ops", "standard_onnx", "recurrent_inputs", "recurrent_axes",
           "sequence_length", "unrolled_rnn", "batched_rnn_unrolled", "batched_per_model"]

STANDARD_FORMS: Registry[Rewrite] = Registry("standard form")


def standard_form(*op_types: str):
    """Register the decorated function as the standard ONNX form of onnxfuse's own op types ``op_types``."""
    return STANDARD_FORMS.register(*op_types, domain=TORCH_DOMAIN)


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
    out, _ = apply_rewrites(model, [STANDARD_FORMS])
    left = own_ops(out)
    if left:  # every op a rule emits in the domain has its standard form (below)
        raise NotFusibleError(f"internal error: node '{node_label(left[0])}' ({TORCH_DOMAIN}::{left[0].op_type}) "
                              "has no standard ONNX form")
    kept = [o for o in out.opset_import if o.domain != TORCH_DOMAIN]
    del out.opset_import[:]
    out.opset_import.extend(kept)
    return out


def recurrent_inputs(node: onnx.NodeProto) -> list[str]:
    """A recurrent node's eight inputs, the missing optional ones as ''."""
    return list(node.input) + [""] * (8 - len(node.input))


def recurrent_axes(layout: int) -> tuple[int, int, int]:
    """(time axis of X and Y, direction axis of Y, direction axis of Y_h / Y_c) for ``layout``."""
    return (1, 2, 1) if layout else (0, 1, 0)


def sequence_length(node: onnx.NodeProto, ctx: Context, ins: list[str], model_axes: int = 0) -> int:
    """The static sequence length (X's time axis after ``model_axes`` leading model axes); refuses sequence_lens
    other than a constant full length (a reversed direction would reverse within each length; the rewrites drop
    full lengths)."""
    layout = int(ctx.attrs(node).get("layout", 0))
    T = ctx.static_dim(node, ins[0], recurrent_axes(layout)[0] + model_axes,
                       "reversing the sequence of a recurrent op")
    lens = ctx.constant(ins[4]) if ins[4] else None
    if ins[4] and (lens is None or bool((lens != T).any())):
        raise ctx.error(node, "it has sequence_lens, which its reverse direction cannot be rewritten with",
                        "pad the sequences to one length without sequence_lens, or train it with runtime='torch'")
    return T


@standard_form(BATCHED["RNN"])
def batched_rnn_unrolled(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """``onnxfuse.torch::BatchedRNN`` (B models' RNNs)  ==>  the unrolled RNN of :func:`unrolled_rnn` with a leading
    model axis: each step one batched MatMul over the models, [B, N, I] @ [B, I, H] (a shared X_t [N, I] and H_0
    broadcast over the models), instead of B unrolled RNNs.

    Layout: X [B, T, N, I] or shared [T, N, I]; W [B, D, H, I], R [B, D, H, H], B [B, D, 2H]; initial_h
    [B, D, N, H] or shared [D, N, H]; outputs [B, ...] (layout 1 as for RNN, after the model axis).
    Math: MatMul broadcasting pairs model b's operands only; each model's recurrence is a plain RNN's unrolled.

    A node the unroll cannot take (a dynamic sequence length, sequence_lens, other activations, clip) becomes B
    standard RNN nodes instead (:func:`batched_per_model`): a graph any ONNX runtime runs (``standard_onnx``);
    legalizing those for ORT training then refuses it in one line, naming what the unroll needs."""
    if not _unrollable(node, ctx, models=True):
        return batched_per_model(node, ctx)
    return unrolled_rnn(node, ctx, models=True)


def _unrollable(node: onnx.NodeProto, ctx: Context, models: bool) -> bool:
    """Whether :func:`unrolled_rnn` takes ``node``: a static sequence length, no sequence_lens other than a constant
    full length, Tanh or Relu activations and no clip."""
    try:
        sequence_length(node, ctx, recurrent_inputs(node), int(models and ctx.rank(node, node.input[0]) == 4))
    except UntrainableOpError:
        return False
    attrs = ctx.attrs(node)
    acts = [a.decode() if isinstance(a, bytes) else a for a in attrs.get("activations") or ["Tanh"]]
    return all(a in ("Tanh", "Relu") for a in acts) and attrs.get("clip") is None


def unrolled_rnn(node: onnx.NodeProto, ctx: Context, models: bool) -> list[onnx.NodeProto]:
    """RNN  ==>  per direction, T steps of H_t = f(X_t W^T + Wb + H_{t-1} R^T + Rb) (f: Tanh or Relu), X_t a
    Gather of time step t (reversed order for the reverse direction), H_0 the initial state or zeros; Y the H_t
    stacked on time (Unsqueeze, Concat) and the directions concatenated; Y_h each direction's last H.
    ``models``: every weight has a leading model axis, X and initial_h have one where their rank says so, and so
    does every output (ORT's legalization unrolls a plain RNN with ``models=False``)."""
    attrs = ctx.attrs(node)
    ins = recurrent_inputs(node)
    m = int(models)  # the weights' and outputs' model axis offset
    xo = int(models and ctx.rank(node, ins[0]) == 4)  # X's
    so = int(models and bool(ins[5]) and ctx.rank(node, ins[5]) == 4)  # initial_h's
    layout = int(attrs.get("layout", 0))
    T = sequence_length(node, ctx, ins, xo)
    t_axis, y_dir, h_dir = (a + m for a in recurrent_axes(layout))
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
            x_t = em.op("Gather", [ins[0], em.const(t, hint="t")], axis=recurrent_axes(layout)[0] + xo)  # [(B,) N, I]
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


@standard_form(BATCHED["LSTM"], BATCHED["GRU"])
def batched_per_model(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto]:
    """``onnxfuse.torch::Batched<op>`` (B models' recurrences, every per-model tensor [B, ...])  ==>  per model b,
    the standard op on its slices (Gather b on the model axis) with the same attributes; each output the B results
    stacked again (Unsqueeze, Concat on axis 0).

    Layout: X [B, T, N, I] or shared [T, N, I] (rank 3); initial states [B, D, N, H] or shared [D, N, H]; weights
    [B, ...]; sequence_lens shared. Math: the batched op is defined as exactly these B recurrences.
    """
    op_type = next(op for op, batched in BATCHED.items() if batched == node.op_type)
    em = Emitter(node, ctx)
    ins = recurrent_inputs(node)[:len(node.input)]
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
