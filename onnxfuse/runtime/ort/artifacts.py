"""Training artifacts for a fused array: one ONNX Runtime training graph that does forward, loss, backward,
BatchNorm statistics and the per-model optimizer update in a single session call, plus an eval graph.

Passes, in order (each a function of the model):

0. ``legalize``              rewrite what onnxruntime-training 1.19 cannot differentiate (LayerNorm outputs,
                            ReduceMax, HardSwish, ConvTranspose, Resize, ...) into equivalent trainable forms
   ``static_shapes_pass``   every tensor's shape declared (some of ORT's gradient kernels read declared shapes)
1. ``add_loss_pass``        per-model losses [B] and their sum (the gradient root; ``graph_passes``, both runtimes')
2. ``batchnorm_pass``       BatchNorm in training mode computes batch statistics only (dummy running stats,
                            momentum 0, so outputs 1 and 2 are the batch mean and biased variance); the running
                            statistics are updated with torch's rule, including the unbiased variance n/(n-1)
3. ``optimizer_state_pass`` zero-initialized optimizer state as extra (frozen) checkpoint parameters
4. gradient graph (onnxruntime.training.onnxblock); ``rename_added_initializers_pass`` renames what its
   transformers added (they run again at session start and would add the same names)
   ``padding_rows_pass``    an embedding's padding rows get no gradient from their lookups (``padding_idx``)
5. ``update_pass``          drop ORT's gradient accumulation, append the running-stat writes and the optimizer
                            update (one flat [B, P] update that reads every gradient, so no parameter is
                            overwritten before the backward pass is done with it)
6. ``eval_model``           BatchNorm on running statistics, Dropout off, same parameter names (``graph_passes``'
                            ``inference_loss_pass`` and ``weights_as_inputs_pass``)
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxfuse.core._graph import Names, all_nodes, node_label, producers
from onnxfuse.core._opset import is_training_batchnorm, onnx_opset
from onnxfuse.core.errors import ConfigError, OnnxFuseError, UntrainableOpError, as_user_error
from onnxfuse.core.registry import op_key, op_names
from onnxfuse.core.semantics import Lookup, padding_lookups, row_mask
from onnxfuse.core.source import FLOAT_TYPES
from onnxfuse.core.standard import standard_onnx
from onnxfuse.core.weights import ArraySpec

from onnxfuse.core._builder import GraphBuilder
from onnxfuse.recipe.losses import LossSpec
from onnxfuse.recipe.optim import HYPER_INPUT, STATE_PREFIX, UpdateRule
from onnxfuse.runtime.ort.legalize import legalize
from onnxfuse.runtime.graph_passes import add_loss_pass, inference_loss_pass, weights_as_inputs_pass
from onnxfuse.runtime.protocol import parameter_names

__all__ = ["TrainingArtifacts", "build_artifacts", "ort_failure"]

log = logging.getLogger("onnxfuse")

UPDATED = "updated"
OK = "model_ok"  # [B] int32: 1 where the model's step was applied (active and finite)


@dataclass
class TrainingArtifacts:
    folder: str
    training_model: str
    eval_model: str
    checkpoint: str
    user_inputs: list[str]  # what the training graph takes each step, in order
    eval_inputs: list[str]
    eval_outputs: list[str]  # per_model_loss, then the fused model outputs
    trainable: list[str]
    buffers: list[str]
    optimizer_state: list[str]
    legalized: list[str]  # the trainability rewrites applied, one line each


def _value_info(name: str, dtype: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def static_shapes_pass(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every tensor's shape recorded in the graph, with shape arithmetic propagated (``data_prop``): some gradient
    kernels of onnxruntime-training 1.19 size their output from the graph's declared shapes, not from the tensors
    they get (MaxPoolGrad's input gradient got an unknown channel count as 0 after a GroupNorm's computed Reshape,
    and the train step failed). Only the batch stays symbolic."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # the graph is checked elsewhere; without the shapes ORT infers what it can
        return model


def batchnorm_pass(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """Rewrite training-mode BatchNorms; returns [(running stat, its new value)] to write after the step.

    torch: running_mean = (1-m)*running_mean + m*mean;  running_var = (1-m)*running_var + m*var*n/(n-1)
    (ONNX's momentum attribute is 1 - m). n = elements per channel = Size(x) / channels.
    """
    g = model.graph
    opset = onnx_opset(model)
    gb = GraphBuilder(g, opset, "bn/")
    inits = {t.name: t for t in g.initializer}
    writes: list[tuple[str, str]] = []
    for node in list(g.node):
        if not is_training_batchnorm(node, opset):
            continue
        attrs = {a.name: a for a in node.attribute}
        m = 1.0 - (attrs["momentum"].f if "momentum" in attrs else 0.9)
        rm, rv = node.input[3], node.input[4]
        C = int(inits[rm].dims[0]) if rm in inits else None
        if C is None:
            raise ConfigError(f"BatchNorm node '{node.name}': running statistics are not initializers")
        # Batch statistics only: with momentum 0 outputs 1, 2 are the batch mean and biased variance, whatever the
        # stats fed in. ORT's kernel writes those outputs into its stat inputs in place, so the stats fed in must be
        # scratch buffers computed each step (zeros from Sub(stat, stat)): constant initializers there were merged
        # by ORT's ConstantSharing, and even distinct ones corrupted other tensors once written (seen with 1.19.2).
        node.input[3] = gb.one("Sub", [rm, rm])
        node.input[4] = gb.one("Sub", [rv, rv])
        for a in node.attribute:
            if a.name == "momentum":
                a.f = 0.0
        if not any(a.name == "momentum" for a in node.attribute):
            node.attribute.append(helper.make_attribute("momentum", 0.0))
        while len(node.output) < 3:
            node.output.append("")
        for k in (1, 2):
            if not node.output[k]:
                node.output[k] = gb.name(f"batch_stat{k}")
        mean, var = node.output[1], node.output[2]
        count = gb.one("Cast", [gb.one("Div", [gb.one("Size", [node.input[0]]), gb.const(C, np.int64)])],
                       to=onnx.TensorProto.FLOAT)
        unbias = gb.one("Div", [count, gb.one("Sub", [count, gb.const(1.0)])])
        keep, mom = gb.const(1.0 - m), gb.const(m)
        new_rm = gb.one("Add", [gb.one("Mul", [rm, keep]), gb.one("Mul", [mean, mom])], output=gb.name("new_rm"))
        new_rv = gb.one("Add", [gb.one("Mul", [rv, keep]), gb.one("Mul", [gb.one("Mul", [var, unbias]), mom])],
                        output=gb.name("new_rv"))
        writes += [(rm, new_rm), (rv, new_rv)]
    gb.flush()
    for _, value in writes:
        g.output.append(_value_info(value, onnx.TensorProto.FLOAT, None))
    return writes


def optimizer_state_pass(model: onnx.ModelProto, params: list[str], opt: UpdateRule) -> list[str]:
    """Zero flat [B, P] state buffers (P = parameters per model, in ``params`` order) as initializers."""
    sizes = {t.name: int(np.prod(t.dims)) for t in model.graph.initializer}
    per_model = sum(sizes[p] for p in params) // opt.B
    names = []
    for s in opt.state_names():
        name = STATE_PREFIX + s
        model.graph.initializer.append(numpy_helper.from_array(np.zeros((opt.B, per_model), np.float32), name))
        names.append(name)
    return names


@contextlib.contextmanager
def _native_stderr_captured():
    """ORT's gradient builder logs every graph transformer at INFO level to the C++ stderr, whatever the Python
    logger severity: hold that output in a temporary file; if building fails, its tail goes to the debug log
    (``onnxfuse -v``), so that the failure itself stays one error line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as native:
        os.dup2(native.fileno(), 2)
        try:
            yield
        except Exception:
            os.dup2(saved, 2)
            native.seek(0)
            tail = native.read().decode(errors="replace").strip().splitlines()[-20:]
            if tail:
                log.debug("ONNX Runtime's log before the failure:\n%s", "\n".join(tail))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


# How ONNX Runtime 1.19 names the node a failure is about (most specific first): a kernel failing while it runs,
# kernel creation or shape inference, a missing gradient builder, graph resolution, a missing kernel.
_NODE_IN_MESSAGE = [re.compile(p) for p in (
    r"running (?P<op>[\w.:]+) node\. Name:'(?P<node>[^']*)'",
    r"Node \((?P<node>[^)]*)\) Op \((?P<op>[^)]*)\)",
    r"registered: (?P<op>[\w.:]+) for node (?P<node>\S+)",
    r"In Node, \(\"(?P<node>[^\"]*)\", (?P<op>[\w.:]+),",
    r"implementation for (?P<op>[\w.:]+)\(\d+\) node with name '(?P<node>[^']*)'",
    r"\bnode[:= ]+'(?P<node>[^']+)'",
)]


def _ort_cause(text: str) -> str:
    """The part of an ONNX Runtime message that says what went wrong: without the C++ source location, function
    signature and status code that open it ("module.cc:312 onnxruntime::...::Module(...) [ONNXRuntimeError] :
    6 : RUNTIME_EXCEPTION : ...")."""
    at = [m.end() for m in re.finditer(r"\S+\.(?:cc|h|cpp):\d+ ", text)]
    if at:  # after the last source location: the function it names, then the cause
        i = at[-1]
        j = text.find("(", i)
        if j != -1 and ". " not in text[i:j]:  # skip "[ret type] name(args) [const]" by its parentheses
            depth = 0
            for k in range(j, len(text)):
                depth += {"(": 1, ")": -1}.get(text[k], 0)
                if depth == 0:
                    i = k + 1
                    break
            text = re.sub(r"^\s*const\b", "", text[i:])
        else:
            text = text[i:]
    text = re.sub(r"^\s*\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text.strip())
    text = text.split(" was false. ", 1)[-1]  # ORT_ENFORCE's condition: what it says after it is the cause
    return text.strip().rstrip(".")[:300]


def _failing_node(text: str, graphs: Sequence[onnx.ModelProto]) -> tuple[str | None, str | None, int]:
    """(node name, op type, how many other nodes of that op type) of the node ONNX Runtime's message is about:
    the node it names, else the op type it names as a kernel (``GRUTraining``, ``GRUGrad``, ``GRU(``) when the
    graph has that op."""
    by_name = {n.name: n.op_type for m in graphs for n in all_nodes(m.graph) if n.name}
    ops = {}
    for m in graphs:
        for n in all_nodes(m.graph):
            ops.setdefault(n.op_type, []).append(node_label(n))
    count = lambda op: max(0, len(set(ops.get(op, []))) - 1)  # noqa: E731
    for pattern in _NODE_IN_MESSAGE:
        m = pattern.search(text)
        if m:
            node = m.group("node").strip("'\".,")
            op = by_name.get(node) or (m.groupdict().get("op") or None)
            return node, op, 0
    found = []
    for op in ops:
        m = re.search(rf"(?<![A-Za-z]){re.escape(op)}(?:Grad|Training|\(| kernel)|::{re.escape(op.lower())}::", text)
        if m:
            found.append((m.start(), op))
    if found:
        op = min(found)[1]
        return ops[op][0], op, count(op)
    return None, None, 0


def _torch_cannot(fused: onnx.ModelProto, device: str) -> str | None:
    """Why the torch runtime cannot train ``fused`` on ``device`` (None: it has a kernel for every op of the graph
    and runs there); the same test the torch runtime makes when it converts a graph (``torch_graph.py``)."""
    from onnxfuse.recipe.device import Device
    from onnxfuse.runtime.torch.kernels import OPS

    missing = op_names({op_key(n) for n in all_nodes(fused.graph) if OPS.lookup(n) is None})
    if missing:
        return (f"op type{'s' if len(missing) > 1 else ''} {', '.join(repr(t) for t in missing[:4])} "
                f"ha{'ve' if len(missing) > 1 else 's'} no torch kernel")
    try:  # the torch runtime runs wherever torch does (TorchTrainer.unavailable)
        why = Device.of(device).available()
    except ConfigError as e:
        why = str(e)
    return f"it cannot run on {device} ({why})" if why else None


def ort_failure(e: Exception, fused: onnx.ModelProto, device: str, doing: str, path: str | None = None,
                graphs: Sequence[onnx.ModelProto] = ()) -> OnnxFuseError:
    """``e``, raised by onnxruntime(-training) while ``doing`` (e.g. "building the gradient graph"), as the user
    error it is. A full disk or out of memory first, as ``as_user_error`` says (ORT words those too; ``path``: the
    file being written); else an UntrainableOpError naming the node ORT's message is about (looked up in ``fused``
    and ``graphs``, the graphs handed to ORT), with the fix: ``--runtime torch`` exactly when the torch runtime
    has a kernel for every op of ``fused`` and runs on ``device``."""
    user = as_user_error(e, path)
    if user is not None:
        return user
    text = " ".join(str(e).split())
    node, op, more = _failing_node(text, [fused, *graphs])
    if node:
        others = f", and {more} more {op} node{'s' if more > 1 else ''}" if more else ""
        subject = f"node '{node}' ({op}{others})" if op else f"node '{node}'"
    else:
        subject = "the fused graph"
    layer = f"replace the layer that exports to {op}" if op else "export the model without the layer it rejects"
    torch_cannot = _torch_cannot(fused, device)
    if torch_cannot is None:
        fix = f"train this array with --runtime torch (it has a kernel for every op of this graph), or {layer}"
    else:
        fix = f"{layer} (--runtime torch cannot train this array either: {torch_cannot})"
    return UntrainableOpError(f"{subject}: onnxruntime-training 1.19 failed while {doing}: {_ort_cause(text)}. "
                              f"To fix this, {fix}.")


# Ops whose ORT 1.19 gradient kernel crashes the process (a segmentation fault in the first step) when an input
# needs a gradient and a weight does not: LSTMGrad and GRUGrad write every weight's gradient unconditionally.
_WEIGHT_GRADIENTS_WRITTEN = ("LSTM", "GRU")


def weights_ort_must_differentiate(model: onnx.ModelProto, untrained: Sequence[str]) -> list[str]:
    """The untrained weights (frozen parameters; ``untrained``) that ORT must still differentiate: those an
    LSTM or GRU reads (:data:`_WEIGHT_GRADIENTS_WRITTEN`), directly or through the ops that slice or lay out the
    fused weight for it. Their gradients are computed and never applied (the update reads the trained
    parameters' alone), so they stay as they are, as requires_grad=False leaves them."""
    nodes = list(model.graph.node)
    made = producers(nodes)
    floats = {t.name for t in model.graph.initializer if t.data_type in FLOAT_TYPES}
    keep, found, seen = set(untrained) & floats, set(), set()
    todo = [i for n in model.graph.node if n.op_type in _WEIGHT_GRADIENTS_WRITTEN and n.domain in ("", "ai.onnx")
            for k, i in enumerate(n.input) if i and k not in (0, 4)]  # not X, not sequence_lens
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in keep:
            found.add(name)
        elif name in made and nodes[made[name][0]].op_type not in ("Shape", "Size"):  # shapes carry no gradient
            todo.extend(i for i in nodes[made[name][0]].input if i)
    return [w for w in untrained if w in found]


def _build_gradient(model: onnx.ModelProto, trainable: list[str], frozen: list[str], outputs: list[str]):
    from onnxruntime.training import onnxblock

    class _Passthrough(onnxblock.TrainingBlock):
        def build(self, *names):
            return tuple(names)

    block = _Passthrough()
    for p in trainable:
        block.requires_grad(p, True)
    for p in frozen:
        block.requires_grad(p, False)
    with onnxblock.base(model), _native_stderr_captured():
        block(*outputs)
        training_model, _ = block.to_model_proto()
        parameters = block.parameters()
    return training_model, parameters


def rename_added_initializers_pass(tm: onnx.ModelProto, before: set[str]) -> None:
    """Give the initializers ORT's graph transformers added while building the gradient graph names of their own.

    The same transformers run again when the training session starts and add their initializers under the same
    fixed names: GatherSliceToSplitFusion's ``squeeze_axes`` (an nn.MultiheadAttention array with SGD momentum)
    then already existed and the session failed to start ("Initializer with same name exists")."""
    g = tm.graph
    taken = {t.name for t in g.initializer} | {i.name for i in g.input} | {o for n in g.node for o in n.output}
    renames = {}
    for t in g.initializer:
        if t.name not in before:
            new, k = f"{t.name}__onnxfuse", 0
            while new in taken:
                k += 1
                new = f"{t.name}__onnxfuse{k}"
            taken.add(new)
            renames[t.name] = new
            t.name = new
    for node in g.node:
        node.input[:] = [renames.get(x, x) for x in node.input]


def padding_rows_pass(tm: onnx.ModelProto, lookups: Sequence[Lookup]) -> None:
    """Each padding-row lookup's gradient without those rows (``nn.Embedding(padding_idx=)``, see
    ``onnxfuse/core/semantics.py``): ORT differentiates the lookup ``Gather(table, idx)`` as ``GatherGrad(shape, idx,
    dY)``, a scatter-add of dY into the table's rows; its result times a row mask (ones, zeros at the rows) is that
    lookup's gradient with the padding lookups' share left out, as torch's embedding backward leaves it out. The
    table's other readers (a tied output projection) still add theirs."""
    g = tm.graph
    names = Names.of(g)
    after: dict[int, list[onnx.NodeProto]] = {}
    for lk in lookups:
        grads = [k for k, n in enumerate(g.node) if n.op_type == "GatherGrad" and len(n.input) > 1
                 and n.input[1] == lk.indices]
        if not grads:
            raise OnnxFuseError(f"internal error: no GatherGrad reads lookup '{lk.node}''s indices '{lk.indices}' in "
                                "the gradient graph, so its padding rows cannot be kept; train with --runtime torch")
        mask = names.fresh(f"{lk.table}__padding_mask")
        g.initializer.append(numpy_helper.from_array(row_mask(lk.shape[0], lk.rows, len(lk.shape)), mask))
        for k in grads:
            node = g.node[k]
            raw = names.fresh(f"{node.output[0]}__with_padding")
            after.setdefault(k, []).append(helper.make_node("Mul", [raw, mask], [node.output[0]],
                                                            name=names.fresh(f"{lk.node}/keep_padding_rows")))
            node.output[0] = raw
    nodes = [m for k, n in enumerate(g.node) for m in [n, *after.get(k, [])]]
    del g.node[:]
    g.node.extend(nodes)


def update_pass(tm: onnx.ModelProto, writes: list[tuple[str, str]], trainable: list[str],
                opt: UpdateRule, n_user_inputs: int) -> None:
    g = tm.graph
    # ORT's gradient accumulation (grad buffers += grad) is not needed: updates read the fresh gradients. The
    # buffer inputs stay because the training Module binds them.
    keep = [n for n in g.node if not (n.op_type == "InPlaceAccumulatorV2" and n.output[0].endswith(".accumulation.out"))]
    del g.node[:]
    g.node.extend(keep)
    gb = GraphBuilder(g, onnx_opset(tm), "update/")
    true = gb.const([True], np.bool_, "overwrite")
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in g.input}
    # a non-finite new running statistic rejects the model's step like a non-finite parameter would
    updates, ok = opt.append_update(gb, [(p, f"{p}_grad", shapes[p]) for p in trainable], HYPER_INPUT,
                                    "per_model_loss", buffers=writes)
    done = [gb.one("InPlaceAccumulatorV2", [target, value, true], domain="com.microsoft")
            for target, value in updates]
    flags = gb.one("Concat", done, axis=0)
    gb.one("ReduceMin", [gb.one("Cast", [flags], to=onnx.TensorProto.INT32)], output=UPDATED, keepdims=0)
    gb.one("Cast", [gb.one("Reshape", [ok, gb.const([-1], np.int64)])], output=OK, to=onnx.TensorProto.INT32)
    gb.flush()
    outs = [o for o in g.output if o.name in ("loss", "per_model_loss")]
    del g.output[:]
    g.output.extend(outs + [_value_info(UPDATED, onnx.TensorProto.INT32, []),
                            _value_info(OK, onnx.TensorProto.INT32, [opt.B])])
    hyper_vi = _value_info(HYPER_INPUT, onnx.TensorProto.FLOAT, [len(opt.rows()), opt.B, 1])
    g.input.insert(n_user_inputs, hyper_vi)
    if "com.microsoft" not in {o.domain for o in tm.opset_import}:
        tm.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def eval_model(fused: onnx.ModelProto, spec: ArraySpec, loss: LossSpec, params: list[str],
               unused: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    """Inference-mode fused graph + loss for the training Module, which feeds every checkpoint parameter to the
    eval graph too, in the training graph's order: so ``params`` must follow that order and ``unused`` (optimizer
    state) are declared as inputs as well."""
    return weights_as_inputs_pass(inference_loss_pass(fused, spec, loss), params, unused)


def refuse_fake_quantization(model: onnx.ModelProto) -> None:
    """Quantization-aware training (QuantizeLinear -> DequantizeLinear) is one error naming the node: ORT 1.19 has no
    gradient for QuantizeLinear, and a straight-through estimator needs a gradient stop that ONNX cannot say (its
    build fails with "corrupted protobuf data" otherwise)."""
    node = next((n for n in model.graph.node if n.op_type == "QuantizeLinear" and not n.domain), None)
    if node is not None:
        raise UntrainableOpError(
            f"node '{node.name or node.output[0]}' (QuantizeLinear): onnxruntime-training 1.19 has no gradient for "
            "fake quantization (QuantizeLinear -> DequantizeLinear). To fix this, train this array with --runtime "
            "torch (it trains fake quantization with torch's straight-through estimator)")


def build_artifacts(fused: onnx.ModelProto, spec: ArraySpec, loss: LossSpec, opt: UpdateRule,
                    folder: str, device: str = "cpu") -> TrainingArtifacts:
    """Write training_model.onnx, eval_model.onnx and checkpoint to ``folder``. A failure of onnxruntime-training
    is one error naming the node it is about (``ort_failure``; ``device``: where the array is to train)."""
    import onnxruntime
    from onnxruntime.training import onnxblock

    onnxruntime.set_default_logger_severity(3)
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    trainable, buffers = parameter_names(spec)
    user_inputs = [i["name"] for i in spec.inputs]

    # ops ORT 1.19 cannot differentiate -> equivalent trainable forms
    fwd, legalized = legalize(fused, parameters=set(trainable) | set(buffers))
    refuse_fake_quantization(fwd)
    fwd = static_shapes_pass(fwd)
    fwd, _ = add_loss_pass(fwd, spec, loss)
    writes = batchnorm_pass(fwd)
    state = optimizer_state_pass(fwd, trainable, opt)
    untrained = weights_ort_must_differentiate(fwd, buffers)
    frozen = [b for b in buffers if b not in untrained] + state
    outputs = ["loss", "per_model_loss"] + [v for _, v in writes]
    try:
        tm, parameters = _build_gradient(fwd, trainable + untrained, frozen, outputs)
    except OnnxFuseError:
        raise
    except Exception as e:
        raise ort_failure(e, fused, device, "building the gradient graph", graphs=[fwd]) from e
    rename_added_initializers_pass(tm, {t.name for t in fwd.graph.initializer})
    padding_rows_pass(tm, padding_lookups(fwd, spec))
    update_pass(tm, writes, trainable, opt, n_user_inputs=len(user_inputs) + 1)
    param_inputs = [i for i in tm.graph.input if i.name in set(trainable) | set(buffers) | set(state)]
    em = eval_model(standard_onnx(fused), spec, loss, [i.name for i in param_inputs],
                    [i for i in param_inputs if i.name in set(state)])

    paths = {k: os.path.join(folder, f) for k, f in
             (("train", "training_model.onnx"), ("eval", "eval_model.onnx"), ("ckpt", "checkpoint"))}
    for key, write in (("train", lambda p: onnx.save(tm, p)), ("eval", lambda p: onnx.save(em, p)),
                       ("ckpt", lambda p: onnxblock.save_checkpoint(parameters, p))):
        try:
            write(paths[key])
        except Exception as e:  # a full disk, a read-only folder (Python's OSError, or ORT's words for them)
            raise (as_user_error(e, paths[key]) or e) from e
    return TrainingArtifacts(
        folder=folder, training_model=paths["train"], eval_model=paths["eval"], checkpoint=paths["ckpt"],
        user_inputs=user_inputs + ["labels", HYPER_INPUT], eval_inputs=user_inputs + ["labels"],
        eval_outputs=["per_model_loss"] + [o["name"] for o in spec.outputs],
        trainable=trainable, buffers=buffers, optimizer_state=state, legalized=legalized,
    )
