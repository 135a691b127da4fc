"""Ops that draw random numbers: Dropout (each element its own mask, so each fused model its own)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, identity, kern, op


@op("Dropout")
def dropout(spec: NodeSpec) -> Kernel:
    """Dropout(x, ratio, training_mode). Off unless training_mode is true and the module is in train mode; the mask
    output (if read) is True where x was kept. Each element draws its own mask, so each fused model does too."""
    if spec.opset < 12:
        ratio, on = float(spec.attr("ratio", 0.5)), spec.training
    else:
        spec.need_const(1, "ratio")
        spec.need_const(2, "training_mode")
        ratio, on = float(spec.scalar(1, 0.5)), bool(spec.scalar(2, False))
    on = on and spec.training and ratio > 0.0
    two = spec.n_outputs > 1
    want_mask = two and spec.used_outputs[1]
    if not on:
        if want_mask:
            return kern(lambda x: (x, torch.ones_like(x, dtype=torch.bool)), 0)
        return kern((lambda x: (x, None)) if two else identity, 0)
    if want_mask:
        return kern(lambda x: torch.native_dropout(x, ratio, True), 0)
    return kern((lambda x: (F.dropout(x, ratio, True), None)) if two else (lambda x: F.dropout(x, ratio, True)), 0)
