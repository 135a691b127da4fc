"""A reference trainer for one model that shares no code with onnxfuse: plain onnxruntime-training on the model's
own (unfused) exported graph, with torch.optim's update rules and torch's BatchNorm running statistics in numpy.

    state, losses = train_alone(module, "cross-entropy", "sgd", 1e-3, {"momentum": 0.9}, batches, workdir)

tests/exporters/test_zoo.py and the fuzzer's harness use it where torch and ONNX Runtime's kernels themselves disagree.

What it uses, and nothing else:

- export: ``torch.onnx.export`` in training mode (the TorchScript exporter, the call FACTS.md gives), the
  module's state restored afterwards;
- gradients: ``onnxruntime.training.artifacts.generate_artifacts(optimizer=None)`` with a loss built here from
  standard ONNX ops, run by ``onnxruntime.training.api.Module``; each step's gradients are read from
  ``CheckpointState.parameters[name].grad`` and the weights written back from numpy;
- update: torch.optim's SGD (momentum, dampening, Nesterov, weight decay) and AdamW written out in numpy, in
  float64 from the float32 values and rounded to float32 after every step, like torch's float32 tensors;
- BatchNorm running statistics: the training-mode node's momentum is set to 0, so ONNX Runtime writes the batch
  mean and *biased* batch variance into the running-stat buffers; torch's rule (the module's own momentum, the
  unbiased variance var * n / (n - 1), num_batches_tracked + 1) is applied here.

Nothing from ``onnxfuse`` is imported: not its exporter, identity check, fusion rules, legalization, loss or
optimizer graphs. Where onnxruntime-training 1.19.2 cannot differentiate an op at all on the CPU, the op is
rewritten here by a few lines of standard ONNX written independently of ``onnxfuse.runtime.ort.legalize`` (``_trainable``):
LayerNormalization gets its Mean/InvStdDev outputs, HardSigmoid/HardSwish become Relu forms, ReduceMax the
tie-splitting form of ``torch.amax``'s gradient, ConvTranspose (group 1) a Conv over the zero-upsampled input with
the flipped, transposed weight. What remains shared with a fused run is ONNX Runtime's kernels themselves — which
is the point: this is "the same model trained alone in ONNX Runtime".
"""
from __future__ import annotations

import contextlib
import io
import os
import warnings
from typing import Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from .native import native_output_to

__all__ = ["train_alone"]

OPSET = 17


def export_training_graph(module: torch.nn.Module, example: torch.Tensor, opset: int = OPSET) -> onnx.ModelProto:
    """``module`` as a training-mode ONNX graph for inputs shaped like ``example`` (static shapes); initializers
    are named by state_dict key. Export runs one training forward, so the module's state is restored after it."""
    snapshot = {k: v.detach().clone() for k, v in module.state_dict().items()}
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.onnx.export(module.train(), (example,), buf, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                              do_constant_folding=False, opset_version=opset, input_names=["input"],
                              output_names=["output"])
    finally:
        module.load_state_dict(snapshot)
    model = onnx.load_from_string(buf.getvalue())
    for init in model.graph.initializer:  # the values from before the export's forward
        if init.name in snapshot:
            init.CopyFrom(numpy_helper.from_array(snapshot[init.name].numpy(), init.name))
    model.ir_version = min(model.ir_version, 10)  # onnxruntime 1.19 loads IR <= 10
    return model


# ---------------------------------------------------------------- ops onnxruntime-training 1.19.2 cannot differentiate
def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class _Nodes:
    """Emit replacement nodes for ``node`` with unique names; ``const`` adds an initializer."""

    def __init__(self, node: onnx.NodeProto, inits: list):
        self.prefix, self.inits, self.nodes, self.k = f"ref/{node.name or node.output[0]}/", inits, [], 0

    def name(self) -> str:
        self.k += 1
        return f"{self.prefix}{self.k}"

    def op(self, op_type: str, inputs: Sequence[str], output: str | None = None, **attrs) -> str:
        out = output or self.name()
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=self.name(), **attrs))
        return out

    def const(self, value, dtype=np.float32) -> str:
        name = self.name()
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name


def _hard_sigmoid(em: _Nodes, x: str, alpha: float, beta: float, output: str | None = None) -> str:
    # clip(t, 0, 1) = relu(t) - relu(t - 1), t = alpha x + beta: gradient alpha where 0 < t < 1, as torch's
    t = em.op("Add", [em.op("Mul", [x, em.const(alpha)]), em.const(beta)])
    return em.op("Sub", [em.op("Relu", [t]), em.op("Relu", [em.op("Sub", [t, em.const(1.0)])])], output)


def _rewrite(node: onnx.NodeProto, shapes: dict, inits: list) -> list[onnx.NodeProto] | None:
    """Trainable standard-ONNX nodes computing what ``node`` computes with torch's gradient, or None to keep it."""
    a, em = _attrs(node), _Nodes(node, inits)
    if node.op_type == "LayerNormalization" and len(node.output) == 1:
        # ORT builds LayerNorm's gradient from its saved Mean and InvStdDev outputs: declare them
        extra = helper.make_node("LayerNormalization", list(node.input), [node.output[0], em.name(), em.name()],
                                 name=node.name, **a)
        return [extra]
    if node.op_type == "HardSigmoid":
        _hard_sigmoid(em, node.input[0], a.get("alpha", 0.2), a.get("beta", 0.5), node.output[0])
        return em.nodes
    if node.op_type == "HardSwish":  # x * hardsigmoid(x): d/dx = x / 3 + 1/2 on (-3, 3), torch's hardswish_backward
        em.op("Mul", [node.input[0], _hard_sigmoid(em, node.input[0], 1 / 6, 0.5)], node.output[0])
        return em.nodes
    if node.op_type == "ReduceMax":
        # torch.amax's gradient splits evenly among tied maxima: y = sum(x * mask) / sum(mask), mask = (x == max x),
        # and the mask carries no gradient (Equal is not differentiable)
        x, axes, keep = node.input[0], a["axes"], a.get("keepdims", 1)
        mask = em.op("Cast", [em.op("Equal", [x, em.op("ReduceMax", [x], axes=axes, keepdims=1)])],
                     to=TensorProto.FLOAT)
        ax = em.const(axes, np.int64)
        em.op("Div", [em.op("ReduceSum", [em.op("Mul", [x, mask]), ax], keepdims=keep),
                      em.op("ReduceSum", [mask, ax], keepdims=keep)], node.output[0])
        return em.nodes
    if node.op_type == "ConvTranspose":
        return _conv_transpose(node, a, em, shapes)
    return None


def _conv_transpose(node: onnx.NodeProto, a: dict, em: _Nodes, shapes: dict) -> list[onnx.NodeProto]:
    """ConvTranspose(X [N, C, *S], W [C, M, *K]; strides s, pads (b, e), output_padding o), group 1, dilation 1
    ==> Conv(pad(upsample_s(X), K - 1 - b, K - 1 - e + o), flip_K(W^T)): the transposed convolution is the
    convolution of X with s - 1 zeros between its elements, by the flipped kernel with channels swapped."""
    x, w = node.input[0], node.input[1]
    S, K = shapes[x][2:], shapes[w][2:]
    r = len(S)
    s, o = a.get("strides", [1] * r), a.get("output_padding", [0] * r)
    pads = a.get("pads", [0] * 2 * r)
    if a.get("group", 1) != 1 or any(d != 1 for d in a.get("dilations", [1] * r)) or \
            a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or "output_shape" in a:
        raise NotImplementedError(f"reference: ConvTranspose '{node.name}' with {a}")
    before = [K[i] - 1 - pads[i] for i in range(r)]
    after = [K[i] - 1 - pads[r + i] + o[i] for i in range(r)]
    if min(before + after) < 0:
        raise NotImplementedError(f"reference: ConvTranspose '{node.name}' pads larger than its kernel")
    if any(v > 1 for v in s):
        # [N, C, S1, .., Sr] -> [N, C, S1, 1, .., Sr, 1] -> pad each unit axis to s_i -> [N, C, S1 s1, ..] -> drop the
        # s_i - 1 zeros after the last element
        x = em.op("Unsqueeze", [x, em.const([3 + 2 * i for i in range(r)], np.int64)])
        x = em.op("Pad", [x, em.const(_upsample_pads(s), np.int64)])
        x = em.op("Reshape", [x, em.const([0, 0] + [S[i] * s[i] for i in range(r)], np.int64)])
        x = em.op("Slice", [x, em.const([0] * r, np.int64), em.const([(S[i] - 1) * s[i] + 1 for i in range(r)],
                                                                     np.int64),
                            em.const(list(range(2, 2 + r)), np.int64)])
    x = em.op("Pad", [x, em.const([0, 0] + before + [0, 0] + after, np.int64)])
    wt = em.op("Transpose", [w], perm=[1, 0] + list(range(2, 2 + r)))
    for i in range(r):  # flip axis 2 + i (Gather: a Slice with step -1 has no working gradient in ORT 1.19)
        wt = em.op("Gather", [wt, em.const(np.arange(K[i] - 1, -1, -1), np.int64)], axis=2 + i)
    em.op("Conv", [x, wt] + list(node.input[2:3]), node.output[0])
    return em.nodes


def _upsample_pads(s: Sequence[int]) -> list[int]:
    """Pad amounts for [N, C, S1, 1, ..., Sr, 1]: s_i - 1 zeros after each unit axis (begins, then ends)."""
    ends = [0, 0] + sum(([0, v - 1] for v in s), [])
    return [0] * len(ends) + ends


def _trainable(model: onnx.ModelProto, shapes: dict) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits: list = []
    nodes = []
    for node in model.graph.node:
        new = _rewrite(node, shapes, inits)
        nodes += [node] if new is None else new
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(inits)
    return out


def _shapes(model: onnx.ModelProto, x: np.ndarray, names: Sequence[str]) -> dict[str, list[int]]:
    """Shapes of the tensors ``names`` (and of every initializer) when ``model`` runs on ``x``: run it once with
    them as outputs (onnx shape inference loses ranks behind Expand/Tile with computed shapes)."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in known)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # Conv+BN fusion ignores training_mode
    sess = ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
    values = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"input": x})))
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    shapes.update({n: list(values[n].shape) for n in names})
    return shapes


# ---------------------------------------------------------------- loss (torch's mean reductions)
def _loss_block(loss: str, class_axis: int, target: onnx.ValueInfoProto):
    from onnxruntime.training import onnxblock

    class TorchLoss(onnxblock.Block):
        """cross-entropy: F.cross_entropy with the classes on ``class_axis`` (moved to axis 1 for ONNX);
        mse: F.mse_loss. Both mean over every element, as torch's default reduction."""

        def build(self, output: str) -> str:
            g = self.base.graph
            g.input.append(target)
            if loss == "cross-entropy":
                scores = output
                rank = len(target.type.tensor_type.shape.dim) + 1
                if class_axis % rank != 1:
                    perm = [0, rank - 1] + list(range(1, rank - 1))  # [N, d.., C] -> [N, C, d..]
                    g.node.append(helper.make_node("Transpose", [output], ["ref_loss/scores"], perm=perm))
                    scores = "ref_loss/scores"
                g.node.append(helper.make_node("SoftmaxCrossEntropyLoss", [scores, target.name],
                                               ["ref_loss/loss", "ref_loss/log_prob"], reduction="mean"))
            elif loss == "mse":
                g.node.extend([helper.make_node("Sub", [output, target.name], ["ref_loss/diff"]),
                               helper.make_node("Mul", ["ref_loss/diff", "ref_loss/diff"], ["ref_loss/sq"]),
                               helper.make_node("ReduceMean", ["ref_loss/sq"], ["ref_loss/loss"], keepdims=0)])
            else:
                raise ValueError(f"reference: no loss '{loss}'")
            return "ref_loss/loss"

    return TorchLoss()


# ---------------------------------------------------------------- torch.optim's update rules
class _SGD:
    """torch.optim.SGD: g += wd p; buf = g (first step) else momentum buf + (1 - dampening) g;
    g = g + momentum buf (Nesterov) else buf; p -= lr g."""

    def __init__(self, lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0):
        self.lr, self.mu, self.damp, self.nesterov, self.wd = lr, momentum, dampening, nesterov, weight_decay
        self.buf: dict[str, np.ndarray] = {}

    def step(self, name: str, p: np.ndarray, g: np.ndarray) -> np.ndarray:
        p64, g64 = p.astype(np.float64), g.astype(np.float64)
        g64 = g64 + self.wd * p64 if self.wd else g64
        if self.mu:
            buf = g64 if name not in self.buf else self.mu * self.buf[name].astype(np.float64) + (1 - self.damp) * g64
            self.buf[name] = buf.astype(np.float32)
            buf = self.buf[name].astype(np.float64)
            g64 = g64 + self.mu * buf if self.nesterov else buf
        return (p64 - self.lr * g64).astype(np.float32)


class _AdamW:
    """torch.optim.AdamW: p *= 1 - lr wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)."""

    def __init__(self, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        self.t: dict[str, int] = {}

    def step(self, name: str, p: np.ndarray, g: np.ndarray) -> np.ndarray:
        t = self.t[name] = self.t.get(name, 0) + 1
        g64 = g.astype(np.float64)
        p64 = (p.astype(np.float64) * (1 - self.lr * self.wd)).astype(np.float32).astype(np.float64)
        m = self.m[name] = (self.b1 * self.m.get(name, np.zeros_like(p)) + (1 - self.b1) * g64).astype(np.float32)
        v = self.v[name] = (self.b2 * self.v.get(name, np.zeros_like(p)) + (1 - self.b2) * g64 * g64
                            ).astype(np.float32)
        denom = np.sqrt(v.astype(np.float64)) / np.sqrt(1 - self.b2 ** t) + self.eps
        return (p64 - self.lr / (1 - self.b1 ** t) * m.astype(np.float64) / denom).astype(np.float32)


OPTIMIZERS = {"sgd": _SGD, "adamw": _AdamW}


# ---------------------------------------------------------------- the trainer
def train_alone(module: torch.nn.Module, loss: str, optimizer: str, lr: float, hyper: dict,
                batches: Sequence[tuple[torch.Tensor, torch.Tensor]], workdir: str | os.PathLike,
                class_axis: int = 1, opset: int = OPSET) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Train ``module`` (not modified) alone on ``batches`` [(x, y)] in plain onnxruntime-training with torch.optim's
    ``optimizer`` ("sgd" or "adamw"; ``lr`` and torch's keyword ``hyper``) and ``loss`` ("cross-entropy" with
    the classes on ``class_axis``, or "mse"). Returns the state_dict after training (numpy, every key of the
    module's) and the per-step losses."""
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module

    state_dict = {k: v.detach().clone().numpy() for k, v in module.state_dict().items()}
    params = [n for n, _ in module.named_parameters()]
    x0, y0 = batches[0]
    model = export_training_graph(module, x0, opset)
    shapes = _shapes(model, x0.numpy(), [n.input[0] for n in model.graph.node
                                         if n.op_type in ("BatchNormalization", "ConvTranspose")])
    missing = [p for p in params if p not in shapes]
    if missing:
        raise ValueError(f"reference: parameters {missing[:3]} are not initializers of the exported graph")
    # BatchNorm: momentum 0 makes the running-stat outputs the batch mean and biased variance (ONNX's
    # running = momentum * running + (1 - momentum) * batch); the update is torch's, with the module's momentum
    bn = {}  # running_mean name -> (running_var name, torch momentum, elements per channel)
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and len(node.output) == 3:
            a = _attrs(node)
            x_shape = shapes[node.input[0]]
            momentum = module.get_submodule(node.input[3][: -len(".running_mean")]).momentum
            if momentum is None:
                raise NotImplementedError(f"reference: BatchNorm '{node.name}' with a cumulative average")
            bn[node.input[3]] = (node.input[4], momentum, int(np.prod(x_shape)) // x_shape[1])
            del node.attribute[:]
            node.attribute.extend([helper.make_attribute("epsilon", a.get("epsilon", 1e-5)),
                                   helper.make_attribute("momentum", 0.0),
                                   helper.make_attribute("training_mode", 1)])
    stats = [n for rm, (rv, _, _) in bn.items() for n in (rm, rv)]
    model = _trainable(model, shapes)
    y_dtype = TensorProto.INT64 if loss == "cross-entropy" else TensorProto.FLOAT
    target = helper.make_tensor_value_info("ref_target", y_dtype, list(y0.shape))
    folder = os.fspath(workdir)
    os.makedirs(folder, exist_ok=True)
    with native_output_to(2, os.path.join(folder, "generate_artifacts.log")):
        artifacts.generate_artifacts(model, requires_grad=params, frozen_params=stats,
                                     loss=_loss_block(loss, class_axis, target), optimizer=None,
                                     artifact_directory=folder)
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    trainer = Module(os.path.join(folder, "training_model.onnx"), state, device="cpu")
    trainer.train()
    opt = OPTIMIZERS[optimizer](lr, **hyper)
    weights = {p: state_dict[p].astype(np.float32) for p in params}
    losses = []
    for x, y in batches:
        for p in params:
            state.parameters[p] = weights[p]
        trainer.lazy_reset_grad()
        y_np = y.numpy().astype(np.int64 if loss == "cross-entropy" else np.float32)
        losses.append(float(trainer(x.numpy(), y_np)))
        grads = {p: np.array(state.parameters[p].grad, copy=True) for p in params}
        for p in params:
            weights[p] = opt.step(p, weights[p], grads[p])
        for rm, (rv, momentum, n) in bn.items():
            mean = state.parameters[rm].data.astype(np.float64)
            var = state.parameters[rv].data.astype(np.float64) * n / (n - 1)  # torch keeps the unbiased variance
            state_dict[rm] = ((1 - momentum) * state_dict[rm] + momentum * mean).astype(np.float32)
            state_dict[rv] = ((1 - momentum) * state_dict[rv] + momentum * var).astype(np.float32)
            tracked = rm[: -len("running_mean")] + "num_batches_tracked"
            if tracked in state_dict:
                state_dict[tracked] = state_dict[tracked] + 1
    state_dict.update(weights)
    return state_dict, np.array(losses)
