"""What onnxfuse guesses of a file that does not say which initializers are parameters, and what it says about it.

A file with onnxfuse's metadata (``onnxfuse export``, ``onnxfuse.fuse``, ``fuse --like``) or a dynamo export's graph
signature says which initializers torch trains. Any other file does not: every float initializer is trained, as a
guess. Nothing is guessed in silence:

- An initializer holding a non-finite value (a causal mask's ``-inf``) is never trained, whatever the file says:
  its update would be non-finite (:func:`never_trained`).
- So are what the file's producer is known to write as initializers though they are no weights: tf2onnx writes a
  Keras RNN's zero initial state so (:data:`PRODUCERS`).
- One warning names the trained initializers that look like buffers or constants: read in no weight slot of any
  node (a table multiplied or added elementwise, a RoiAlign's boxes, an STFT's window), holding only integers, or
  named by the exporter itself (``onnx::``), each with why (:func:`guess_warnings`).
- One warning names the signatures of an eval-mode export (torch's default ``training=EVAL``): BatchNorm folded into
  a Conv, a BatchNorm in inference mode, an initializer several layers read; and, per producer, the lossy steps it
  is known to take (tf2onnx: zero biases removed, BatchNormalization folded, a one-bias LSTM's recurrent bias).

The fix is said in the producer's language: a torch file points to ``fuse --like`` / ``onnxfuse export``, a Keras one
to what to change before tf2onnx runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from onnxfuse.core._graph import node_label
from onnxfuse.core._opset import is_training_batchnorm, onnx_opset

__all__ = ["never_trained", "guess_warnings", "trained_note", "Producer", "PRODUCERS", "producer_of",
           "WEIGHT_INPUTS"]

Arrays = Callable[[str], np.ndarray]  # an initializer's value by name (SourceModel.array: converted once)
_SHOWN = 4  # initializers named in a warning before "and N more"
# the inputs of each op that hold a layer's weights (positions; "*": every input)
WEIGHT_INPUTS: dict[str, tuple | str] = {
    "Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "MatMul": (0, 1), "Einsum": "*", "Gather": (0,),
    "LayerNormalization": (1, 2), "BatchNormalization": (1, 2), "InstanceNormalization": (1, 2),
    "GroupNormalization": (1, 2), "LSTM": (1, 2, 3), "GRU": (1, 2, 3), "RNN": (1, 2, 3), "PRelu": (1,),
}
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div"}  # a vector read here is a bias or a scale; a table may be a buffer


@dataclass(frozen=True)
class Producer:
    """What onnxfuse knows of one exporter (a file's ``producer_name``): how to say the fix, what it writes as an
    initializer that is no weight."""

    name: str
    framework: str  # whose model the file was: what it keeps fixed is the truth
    fix: str  # what to do instead, in the producer's language
    # writes the constants of the model's code as float initializers (an RNN's zero initial state), its weights
    # only where layers read them
    constants_outside_weights: bool = False


PRODUCERS = {
    "pytorch": Producer("torch's TorchScript exporter", "the torch module", "fuse with like=MODULE:FACTORY (the "
                        "torch class, which says which are buffers), or export with `onnxfuse export`"),
    "tf2onnx": Producer("tf2onnx", "the Keras model", "freeze those Keras does not train with frozen=NAME",
                        constants_outside_weights=True),
}
_OTHER = Producer("its exporter", "the model it came from", "freeze what is not a weight with frozen=NAME")


def producer_of(model: onnx.ModelProto) -> Producer:
    return PRODUCERS.get(model.producer_name, _OTHER)


def _listed(items: list[str]) -> str:
    more = len(items) - _SHOWN
    return ", ".join(items[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def never_trained(model: onnx.ModelProto, weights: set[str], array: Arrays) -> dict[str, str]:
    """Weights of ``model`` (their values by ``array``) that no run trains, by name, with why: non-finite values
    (any file); what the producer writes as an initializer that is a constant of the model's code (tf2onnx: the
    zero an RNN's initial state is expanded from)."""
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for name in sorted(weights & inits):
        v = array(name)
        if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v).all():
            out[name] = "holds non-finite values (a mask): a constant, never trained"
    if producer_of(model).constants_outside_weights:
        readers = _readers(model)
        computed = {o for n in model.graph.node for o in n.output}
        for name in sorted(weights & inits):
            uses = readers.get(name, [])
            if uses and not any(_in_weight_slot(n, i, array(name), computed) for n, i in uses):
                node = uses[0][0]
                out[name] = (f"read by '{node_label(node)}' ({node.op_type}) in no weight slot: a constant of the "
                             f"model's code ({producer_of(model).name} writes them as initializers), never trained")
    return out


def _readers(model: onnx.ModelProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    out: dict[str, list] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            out.setdefault(name, []).append((node, i))
    return out


def _slot_of(node: onnx.NodeProto, i: int) -> bool:
    """Input ``i`` of ``node`` is a weight input of its op (:data:`WEIGHT_INPUTS`)."""
    slots = WEIGHT_INPUTS.get(node.op_type)
    return slots == "*" or bool(slots and i in slots)


def _in_weight_slot(node: onnx.NodeProto, i: int, array: np.ndarray, computed: set[str]) -> bool:
    """Input ``i`` of ``node`` (holding ``array``) is where a layer reads a weight: a weight input of its op, or a
    vector added to or multiplied into a computed tensor (a bias, a norm's scale; ``computed``: the tensors nodes
    write), not into a graph input (an STFT-like window)."""
    if _slot_of(node, i):
        return True
    others = [x for k, x in enumerate(node.input) if k != i]
    return (node.op_type in _ELEMENTWISE and sum(d > 1 for d in array.shape) <= 1
            and all(x in computed for x in others))


def _buffer_like(model: onnx.ModelProto, trained: set[str], arrays: Arrays) -> list[str]:
    """The trained initializers that look like buffers or constants, each as "'name' (why)"."""
    inits = {t.name for t in model.graph.initializer}
    readers = _readers(model)
    computed = {o for n in model.graph.node for o in n.output}
    found = []
    for name in sorted(trained & inits):
        array = arrays(name)
        uses = readers.get(name, [])
        why = []
        if uses and not any(_in_weight_slot(n, i, array, computed) for n, i in uses):
            node, _ = uses[0]
            what = "read elementwise" if node.op_type in _ELEMENTWISE else "read"
            why.append(f"{what} by '{node_label(node)}' ({node.op_type}), in no weight slot")
        if array.size > 1 and np.all(array == np.round(array)) and len(np.unique(array)) > 2:
            why.append("holds only integers")
        if why and name.startswith(("onnx::", "val_")):
            why.append("named by the exporter")
        if why:
            found.append(f"'{name}' ({', '.join(why)})")
    return found


def _eval_signs(model: onnx.ModelProto, trained: set[str]) -> list[str]:
    """What shows ``model`` was exported for inference, each as a phrase."""
    opset = onnx_opset(model)
    signs = []
    folded = sorted({n.input[1] for n in model.graph.node if n.op_type == "Conv" and len(n.input) > 1
                     and n.input[1].startswith("onnx::Conv_")})
    if folded and model.producer_name == "pytorch":
        signs.append(f"Conv weights named by the exporter ({_listed(folded)}): BatchNorm folded into them")
    inference = [node_label(n) for n in model.graph.node
                 if n.op_type == "BatchNormalization" and not is_training_batchnorm(n, opset)]
    if inference:
        signs.append(f"BatchNorm in inference mode ({_listed(inference)}): trained with running statistics, not the "
                     "batch's")
    readers = _readers(model)
    shared = sorted(n for n in trained if len({node.op_type for node, _ in readers.get(n, [])} - {"Identity"}) > 1)
    merged = sorted(n.input[0] for n in model.graph.node if n.op_type == "Identity" and n.input[0] in trained)
    if merged or shared:
        signs.append(f"initializers read by layers of different kinds ({_listed(sorted(set(merged) | set(shared)))}"
                     "): equal values the exporter merged train as one tensor, unlike parameters of their own")
    return signs


def _tf2onnx_steps(model: onnx.ModelProto, trained: set[str]) -> list[str]:
    """What tf2onnx is known to do to a Keras model that changes its training, found in ``model``: a bias that
    was all zeros removed (a Conv without B, a MatMul on a weight with no Add of a bias after it); BatchNormalization
    folded into the Conv before it (weights named ``*_weights_fused_bn``); a one-bias LSTM written with an all-zero
    recurrent bias (the second half of B)."""
    steps = []
    inits = {t.name: t for t in model.graph.initializer}
    readers = _readers(model)
    folded = [node_label(n) for n in model.graph.node if n.op_type == "Conv" and n.input[1].endswith("_fused_bn")]
    biasless = [node_label(n) for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")
                and len(n.input) < 3]
    for n in model.graph.node:
        if n.op_type == "MatMul" and n.input[1] in trained and not any(
                r.op_type == "Add" and any(x in inits for x in r.input) for r, _ in readers.get(n.output[0], [])):
            biasless.append(node_label(n))
    if biasless:
        steps.append(f"layers without a bias ({_listed(biasless)}): tf2onnx removes a bias that is all zeros, as a "
                     "fresh Keras layer's is, so this array trains them without one; give the Keras layers "
                     "bias_initializer='random_normal' (any non-zero one) before exporting")
    if folded:
        steps.append(f"BatchNormalization folded into {_listed(folded)} with its moving statistics: this array "
                     "trains the folded Conv, without batch statistics, unlike Keras; tf2onnx writes no "
                     "training-mode BatchNormalization, so train this model in Keras")
    for n in model.graph.node:
        if n.op_type == "LSTM" and len(n.input) > 3 and n.input[3] in inits:
            b = numpy_helper.to_array(inits[n.input[3]])
            if not b[..., b.shape[-1] // 2:].any():
                steps.append(f"'{node_label(n)}' has an all-zero recurrent bias (the second half of "
                             f"'{n.input[3]}'): a one-bias Keras LSTM, whose one bias is here two, each trained, so "
                             "their sum moves twice as fast as Keras' bias; no setting trains it as Keras does")
    return steps


def guess_warnings(model: onnx.ModelProto, label: str, trained: set[str], frozen: dict[str, str],
                   arrays: Arrays) -> list[str]:
    """The warnings for a file whose parameters are guessed (``trained``: the initializers it will train;
    ``frozen``: :func:`never_trained`'s; ``arrays``: their values): what was frozen, what looks like a buffer,
    what shows an eval-mode or lossy export, each with the producer's fix. [] when there is nothing to say."""
    producer = producer_of(model)
    out = []
    if frozen:
        out.append(f"{label}: {len(frozen)} initializer(s) never trained: "
                   + _listed([f"'{n}' ({why})" for n, why in frozen.items()]))
    suspects = _buffer_like(model, trained, arrays)
    if suspects:
        out.append(f"{label}: the file does not say which initializers are parameters, and {len(suspects)} of the "
                   f"{len(trained)} it will train look like buffers or constants: {_listed(suspects)}; if they are, "
                   f"this array trains what {producer.framework} keeps fixed: {producer.fix}")
    signs = _tf2onnx_steps(model, trained) if model.producer_name == "tf2onnx" else _eval_signs(model, trained)
    if signs:
        said = ("tf2onnx changed what trains" if model.producer_name == "tf2onnx"
                else f"{producer.name} exported it for inference")
        fix = "the file is what tf2onnx wrote, not the Keras model" if model.producer_name == "tf2onnx" else (
            "export with torch.onnx.export(..., dynamo=False, training=torch.onnx.TrainingMode.TRAINING), or "
            + producer.fix)
        out.append(f"{label}: {said}: " + "; ".join(signs) + f"; {fix}")
    return out


def trained_note(spec) -> str:
    """What ``train`` says once: how many initializers the array trains per model, how many of them by guess."""
    trained = sum(fw.role == "param" for fw in spec.weights.values())
    guessed = spec.summary.get("guessed", 0)
    if not guessed:
        return f"trains {trained} initializer(s) per model, the parameters its files record"
    return (f"trains {trained} initializer(s) per model, {guessed} of them guessed: the file does not say which "
            "initializers are parameters (fuse's warnings name those that look like buffers; fuse "
            "like=MODULE:FACTORY, onnxfuse export or onnxfuse.fuse record it)")
