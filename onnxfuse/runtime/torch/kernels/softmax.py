"""Softmax, LogSoftmax, Hardmax and the loss ops SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, all_inputs, kern, norm_axis, op


@op("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
def loss_op(spec: NodeSpec) -> Kernel:
    """SoftmaxCrossEntropyLoss(scores [N, C, d...], labels [N, d...], weights?) -> loss, log_prob? and
    NegativeLogLikelihoodLoss(log_prob, labels, weights?) -> loss, as F.cross_entropy / F.nll_loss with the same
    ``reduction`` and ``ignore_index`` (an ignored label contributes 0 and no gradient; "mean" divides by the
    summed weights of the kept labels, as both ONNX and torch do). Output 1 of SoftmaxCrossEntropyLoss is
    log_softmax(scores) along axis 1."""
    reduction = spec.attr("reduction", "mean")
    ignore = spec.attr("ignore_index", None)
    ignore = -100 if ignore is None else int(ignore)  # torch's default matches no valid class index either
    soft = spec.op_type == "SoftmaxCrossEntropyLoss"
    with_log_prob = soft and spec.n_outputs > 1

    def f(x, labels, weight=None):
        logp = torch.log_softmax(x, 1) if soft else x
        loss = F.nll_loss(logp, labels.long(), weight=weight, ignore_index=ignore, reduction=reduction)
        return (loss, logp) if with_log_prob else loss

    return kern(f, *all_inputs(spec))


@op("Softmax", "LogSoftmax", "Hardmax")
def softmax(spec: NodeSpec) -> Kernel:
    """Along ``axis`` (opset >= 13); opset < 13 flattens to 2-D at ``axis`` first."""
    axis = int(spec.attr("axis", -1 if spec.opset >= 13 else 1))
    if spec.op_type == "Hardmax":
        def hard(x):
            a = norm_axis(axis, x.dim())
            return F.one_hot(x.argmax(a), x.shape[a]).movedim(-1, a).to(x.dtype)
        f = hard
    else:
        f = (lambda x: torch.softmax(x, axis)) if spec.op_type == "Softmax" else (lambda x: torch.log_softmax(x, axis))
    if spec.opset >= 13:
        return kern(f, 0)

    def coerced(x):
        a = norm_axis(axis, x.dim())
        return (torch.softmax if spec.op_type == "Softmax" else torch.log_softmax)(
            x.reshape(math.prod(x.shape[:a]), -1), 1).reshape(x.shape)
    return kern(coerced, 0)
