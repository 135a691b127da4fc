"""The graph passes both runtimes run, so that neither writes the training maths again: the fused graph with each
model's loss (:func:`add_loss_pass`: the torch runtime's train program, the ONNX Runtime training graph's forward),
the inference graph with the loss (:func:`inference_loss_pass`: both runtimes evaluate with it) and the weights as
graph inputs (:func:`weights_as_inputs_pass`: the torch runtime feeds its parameters, ONNX Runtime's eval graph
takes its checkpoint's), and every Dropout off (:func:`without_dropout`: run-time verification and the check of a
file against its torch module compare without randomness). Each is a function of the model; ONNX Runtime's own
passes are in ``ort/artifacts.py``."""
from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import onnx
from onnx import helper

from onnxfuse.core._builder import GraphBuilder
from onnxfuse.core._opset import onnx_opset
from onnxfuse.core.errors import ConfigError
from onnxfuse.core.split import to_inference
from onnxfuse.core.weights import ArraySpec
from onnxfuse.recipe.losses import LossSpec, add_loss

__all__ = ["add_loss_pass", "inference_loss_pass", "weights_as_inputs_pass", "has_random_dropout", "without_dropout"]


def _value_info(name: str, dtype: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def add_loss_pass(model: onnx.ModelProto, spec: ArraySpec, loss: LossSpec
                  ) -> tuple[onnx.ModelProto, onnx.ValueInfoProto | None]:
    """``model`` (changed in place) with each model's loss on its output: outputs ``loss`` (their sum, the gradient
    root) and ``per_model_loss`` [B], input ``labels`` appended unless the loss takes none; returns the model and
    that input."""
    if len(spec.outputs) != 1:
        raise ConfigError(f"the model has {len(spec.outputs)} outputs; training needs exactly one "
                          "(the logits or prediction the loss reads)")
    out = spec.outputs[0]
    gb = GraphBuilder(model.graph, onnx_opset(model), "loss/")
    _, _, labels = add_loss(gb, loss, out["name"], out["shape"], spec.B)
    gb.flush()
    if labels is not None:  # the 'model' loss takes none
        model.graph.input.append(labels)
    del model.graph.output[:]
    model.graph.output.extend([_value_info("loss", onnx.TensorProto.FLOAT, []),
                               _value_info("per_model_loss", onnx.TensorProto.FLOAT, [spec.B])])
    return model, labels


def inference_loss_pass(fused: onnx.ModelProto, spec: ArraySpec, loss: LossSpec) -> onnx.ModelProto:
    """The inference-mode fused graph (BatchNorm on running statistics, Dropout off) + the per-model loss: outputs
    ``[per_model_loss [B], the fused model outputs...]``, inputs the graph's own plus ``labels`` (unless the loss
    takes none). Both runtimes evaluate with it."""
    m = to_inference(copy.deepcopy(fused))
    model_outputs = [o.name for o in m.graph.output]
    gb = GraphBuilder(m.graph, onnx_opset(m), "loss/")
    _, per_model, labels = add_loss(gb, loss, spec.outputs[0]["name"], spec.outputs[0]["shape"], spec.B)
    gb.flush()
    if labels is not None:
        m.graph.input.append(labels)
    outs = {o.name: o for o in m.graph.output}
    del m.graph.output[:]
    m.graph.output.extend([_value_info(per_model, onnx.TensorProto.FLOAT, [spec.B])] + [outs[n] for n in model_outputs])
    return m


def weights_as_inputs_pass(model: onnx.ModelProto, names: Sequence[str],
                           absent: Sequence[onnx.ValueInfoProto] = ()) -> onnx.ModelProto:
    """``model`` with graph inputs appended for ``names``, in that order: an initializer of that name moves to the
    inputs (the runtime feeds it); a name the graph has no initializer for is declared from ``absent``."""
    by_name = {t.name: t for t in model.graph.initializer}
    absent_by_name = {vi.name: vi for vi in absent}
    for name in names:
        if name in by_name:
            t = by_name.pop(name)
            model.graph.input.append(_value_info(name, t.data_type, list(t.dims)))
        else:
            model.graph.input.append(absent_by_name[name])
    del model.graph.initializer[:]
    model.graph.initializer.extend(by_name.values())
    return model


# ---------------------------------------------------------------------------------------------------- Dropout
def _constant(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    """The value of ``name`` when it is an initializer or a Constant node's output with a tensor value."""
    for t in model.graph.initializer:
        if t.name == name:
            return onnx.numpy_helper.to_array(t)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            value = next((a for a in node.attribute if a.name == "value"), None)
            return None if value is None else onnx.numpy_helper.to_array(value.t)
    return None


def has_random_dropout(model: onnx.ModelProto) -> bool:
    """Whether a Dropout node of ``model`` may drop something: training mode on (or not known to be off) and a
    ratio that is not a constant 0 (the default ratio is 0.5)."""
    for node in model.graph.node:
        if node.op_type != "Dropout" or len(node.input) < 3 or not node.input[2]:
            continue  # without training_mode, Dropout passes its input through
        training = _constant(model, node.input[2])
        ratio = _constant(model, node.input[1]) if node.input[1] else np.array(0.5)
        if (training is None or bool(training)) and (ratio is None or float(ratio) != 0.0):
            return True
    return False


def without_dropout(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose Dropout nodes pass their input through (training_mode input removed), everything
    else (BatchNorm in training mode included) as it is."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.op_type == "Dropout" and len(node.input) > 2:
            node.input[2] = ""
    return out
