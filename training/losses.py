"""Per-model losses appended to a fused graph: ``loss = sum_b mean(loss_b)``, so that the gradient of model b's
parameters is exactly the gradient of its own mean loss."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from onnxfuse.errors import ConfigError

from ._builder import GraphBuilder

__all__ = ["LOSSES", "LossSpec", "get_loss", "add_loss"]

LABELS = "labels"


@dataclass(frozen=True)
class LossSpec:
    name: str
    label_dtype: type
    description: str


LOSSES = {
    "cross-entropy": LossSpec("cross-entropy", np.int64, "softmax cross-entropy on logits [N, K], labels [N] int"),
    "mse": LossSpec("mse", np.float32, "mean squared error, targets shaped like the output"),
}


def get_loss(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ConfigError(f"unknown loss '{name}'; choose one of: {', '.join(LOSSES)}")
    return LOSSES[name]


def add_loss(b: GraphBuilder, loss: LossSpec, output: str, orig_shape: list, B: int) -> tuple[str, str, onnx.ValueInfoProto]:
    """Append the loss of fused output ``output`` ([B] + orig_shape, stacked(0)). Returns (loss, per_model_loss,
    labels input)."""
    per_model = "per_model_loss"
    if loss.name == "cross-entropy":
        if len(orig_shape) != 2:
            raise ConfigError(f"cross-entropy needs a [N, classes] output; '{output}' has shape {orig_shape}")
        K = orig_shape[1]
        labels = helper.make_tensor_value_info(LABELS, onnx.TensorProto.INT64, [orig_shape[0]])
        # [B, N, K] -> [B*N, K] rows of model b are b*N..; labels [N] tiled B times line up with them.
        flat = b.one("Reshape", [output, b.const([-1, K], np.int64)])
        lab = b.one("Tile", [LABELS, b.const([B], np.int64)])
        ce, _log_prob = b.node("SoftmaxCrossEntropyLoss", [flat, lab], 2, reduction="none")
        per_row = b.one("Reshape", [ce, b.const([B, -1], np.int64)])
    else:
        labels = helper.make_tensor_value_info(LABELS, onnx.TensorProto.FLOAT, list(orig_shape))
        diff = b.one("Sub", [output, LABELS])  # [B, N, ...] - [N, ...] broadcasts over the model axis
        sq = b.one("Mul", [diff, diff])
        per_row = b.one("Reshape", [sq, b.const([B, -1], np.int64)])
    b.reduce("ReduceMean", per_row, [1], keepdims=0, output=per_model)
    total = b.reduce("ReduceSum", per_model, [0], keepdims=0, output="loss")
    return total, per_model, labels
