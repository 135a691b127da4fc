"""Normalizations: BatchNormalization (training and inference, torch's running-statistics rule),
LayerNormalization (and the runtime's ``LayerNormAffine`` for autocast), InstanceNormalization, GroupNormalization,
LRN, LpNormalization, MeanVarianceNormalization."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onnxfuse.core._opset import is_training_batchnorm
from onnxfuse.runtime.torch.kernels._base import OPS, Kernel, NodeSpec, kern, norm_axis, op


@op("BatchNormalization")
def batch_norm(spec: NodeSpec) -> Kernel:
    """BatchNormalization(x, scale, bias, mean, var) per channel (axis 1).

    Inference (training_mode 0, or the module in eval mode): y = scale * (x - mean) / sqrt(var + eps) + bias on the
    running statistics; outputs 1 and 2, if any, are the running statistics unchanged.

    Training (training_mode 1 from opset 14; opset < 14: more than one output), module in train mode:
    y normalizes with the batch mean and the biased batch variance (over N and the spatial axes). Outputs 1 and 2
    are the new running statistics, with ONNX's momentum (the weight of the old value; torch's is 1 - it):

        running_mean' = momentum * running_mean + (1 - momentum) * batch_mean
        running_var'  = momentum * running_var  + (1 - momentum) * batch_var * n / (n - 1)

    with n = elements per channel: torch's rule and what the ORT runtime's ``batchnorm_pass`` writes (the ONNX
    specification's biased batch_var with ``TorchOptions(running_var="biased")``). Computed by F.batch_norm, the
    kernel of torch.nn.BatchNorm*, so bit-identical to torch. The statistics carry no gradient. With
    ``update_stats`` and statistics that are module buffers read by this node alone, they are updated in place
    (outputs 1 and 2 are then those buffers); otherwise copies are. Opset 9 outputs 3 and 4 (saved mean, saved
    variance) are the batch mean and 1/sqrt(batch_var + eps), as ONNX Runtime writes them.
    """
    eps = float(spec.attr("epsilon", 1e-5))
    momentum = float(spec.attr("momentum", 0.9))
    train_mode = is_training_batchnorm(spec.node, spec.opset)
    n_out = spec.n_outputs
    if not (train_mode and spec.training):
        def infer(x, w, b, rm, rv):
            y = F.batch_norm(x, rm, rv, w, b, False, 0.0, eps)
            return (y, rm, rv, rm, rv)[:n_out] if n_out > 1 else y
        return kern(infer, 0, 1, 2, 3, 4)
    torch_momentum = 1.0 - momentum
    inplace = spec.options.update_stats and len(spec.writable) > 4 and spec.writable[3] and spec.writable[4]
    saved = n_out > 3 and any(spec.used_outputs[3:5])
    if spec.options.running_var == "biased" or saved:
        def stats_fn(x, w, b, rm, rv):
            y = F.batch_norm(x, None, None, w, b, True, 0.0, eps)
            with torch.no_grad():
                dims = [0] + list(range(2, x.dim()))
                var, mean = torch.var_mean(x, dims, correction=0)
                n = x.numel() // x.shape[1]
                v_run = var if spec.options.running_var == "biased" else var * (n / max(n - 1, 1))
                new_rm = rm * momentum + mean * torch_momentum
                new_rv = rv * momentum + v_run * torch_momentum
                if inplace:
                    rm.copy_(new_rm)
                    rv.copy_(new_rv)
                    new_rm, new_rv = rm, rv
            outs = (y, new_rm, new_rv, mean, torch.rsqrt(var + eps))
            return outs[:n_out] if n_out > 1 else y
        return kern(stats_fn, 0, 1, 2, 3, 4)

    def train(x, w, b, rm, rv):
        if not inplace:
            rm, rv = rm.detach().clone(), rv.detach().clone()
        y = F.batch_norm(x, rm, rv, w, b, True, torch_momentum, eps)
        return (y, rm, rv)[:n_out] if n_out > 1 else y
    return kern(train, 0, 1, 2, 3, 4)


def _is(c: torch.Tensor | None, value: float) -> bool:
    return c is not None and c.is_floating_point() and bool((c == value).all())


@op("LayerNormalization")
def layer_norm(spec: NodeSpec) -> Kernel:
    """Normalize over axes [axis, rank): F.layer_norm (a constant scale of ones or bias of zeros is dropped). Mean and
    InvStdDev (outputs 1, 2, when read) keep size-1 normalized axes, as ONNX defines them."""
    axis, eps = int(spec.attr("axis", -1)), float(spec.attr("epsilon", 1e-5))
    w_in = None if _is(spec.const(1), 1.0) else 1
    b_in = None if (not spec.has(2) or _is(spec.const(2), 0.0)) else 2
    ins = (0,) + tuple(i for i in (w_in, b_in) if i is not None)
    extra = spec.n_outputs > 1 and any(spec.used_outputs[1:])
    n_out = spec.n_outputs

    def fn(x, *wb):
        a = norm_axis(axis, x.dim())
        w = wb[0] if w_in is not None else None
        b = wb[-1] if b_in is not None else None
        y = F.layer_norm(x, x.shape[a:], w, b, eps)
        if not extra:
            return y if n_out == 1 else (y,) + (None,) * (n_out - 1)
        dims = tuple(range(a, x.dim()))
        var, mean = torch.var_mean(x, dims, correction=0, keepdim=True)
        return (y, mean, torch.rsqrt(var + eps))[:n_out]
    return kern(fn, *ins)


@OPS.register("LayerNormAffine", domain="onnxfuse.torch")
def layer_norm_affine(spec: NodeSpec) -> Kernel:
    """``LayerNormalization(x, 1, 0) -> Mul(W) -> Add(C)`` of a fused LayerNorm (``runtime/torch/precision.py``'s
    ``norms_in_fp32``); x ``[B, .., *S]`` over the normalized axes S from ``axis``, W and C ``[B, 1.., *S]``.
    Without autocast, or for a float32 input, those three ops (their bits). Under autocast for a bf16 / fp16
    input, each model's ``F.layer_norm(x[b], S, W[b], C[b])``: the mixed-dtype kernel the model alone runs, its
    affine's gradient included; where W or C is not one per model, the three ops in float32, rounded once."""
    axis, eps = int(spec.attr("axis", -1)), float(spec.attr("epsilon", 1e-5))

    def fn(x, w, c):
        a = norm_axis(axis, x.dim())
        shape = x.shape[a:]
        if x.dtype == torch.float32 or not torch.is_autocast_enabled(x.device.type):
            return F.layer_norm(x, shape, None, None, eps) * w + c
        B = x.shape[0]
        if a >= 1 and all(t.dim() == x.dim() and t.shape[0] == B and all(d == 1 for d in t.shape[1:a])
                          for t in (w, c)):
            ws, cs = (t.reshape(B, *t.shape[a:]).expand(B, *shape) for t in (w, c))
            return torch.stack([F.layer_norm(x[b], shape, ws[b], cs[b], eps) for b in range(B)])
        return (F.layer_norm(x.float(), shape, None, None, eps) * w + c).to(x.dtype)
    return kern(fn, 0, 1, 2)


@op("InstanceNormalization")
def instance_norm(spec: NodeSpec) -> Kernel:
    eps = float(spec.attr("epsilon", 1e-5))
    return kern(lambda x, w, b: F.instance_norm(x, None, None, w, b, True, 0.0, eps), 0, 1, 2)


@op("GroupNormalization")
def group_norm(spec: NodeSpec) -> Kernel:
    """x [N, C, *S] normalized per sample over each of ``num_groups`` groups of C / G channels, then
    ``scale * . + bias``: F.group_norm, torch.nn.GroupNorm's kernel. From opset 21 scale and bias are per channel
    [C]; before, per group [G] (each group's value repeated over its channels). ``stash_type`` 1 (float32, the
    default) is how torch computes a float32 input."""
    G, eps = int(spec.attr("num_groups")), float(spec.attr("epsilon", 1e-5))
    per_group = spec.opset < 21

    def fn(x, scale, bias):
        if per_group:
            scale, bias = (t.repeat_interleave(x.shape[1] // G) for t in (scale, bias))
        return F.group_norm(x, G, scale, bias, eps)
    return kern(fn, 0, 1, 2)


@op("LRN")
def lrn(spec: NodeSpec) -> Kernel:
    """Local response normalization across channels: y = x / (bias + alpha / size * sum of x^2 over channels
    [c - floor((size-1)/2), c + ceil((size-1)/2)])^beta. torch's F.local_response_norm centres an even window the
    other way, so the sum is an average pool of x^2 over ONNX's window (zero-padded at the ends), times size."""
    size, alpha = int(spec.attr("size")), float(spec.attr("alpha", 1e-4))
    beta, bias = float(spec.attr("beta", 0.75)), float(spec.attr("bias", 1.0))
    before, after = (size - 1) // 2, size // 2

    def fn(x):
        sq = (x * x).reshape(x.shape[0], 1, x.shape[1], -1)  # [N, 1, C, rest]
        mean = F.avg_pool2d(F.pad(sq, [0, 0, before, after]), (size, 1), 1)
        return x / (bias + alpha * mean.reshape(x.shape)).pow(beta)
    return kern(fn, 0)


@op("LpNormalization")
def lp_normalization(spec: NodeSpec) -> Kernel:
    """x / ||x||_p along ``axis`` (p 1 or 2), no epsilon: the specification's division."""
    axis, p = int(spec.attr("axis", -1)), int(spec.attr("p", 2))
    return kern(lambda x: x / torch.linalg.vector_norm(x, p, norm_axis(axis, x.dim()), keepdim=True), 0)


@op("MeanVarianceNormalization")
def mean_variance_normalization(spec: NodeSpec) -> Kernel:
    """(x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9) over ``axes`` (default [0, 2, 3]): the specification's
    function, in its order of operations."""
    axes = tuple(int(a) for a in spec.attr("axes", [0, 2, 3]))

    def fn(x):
        mean = x.mean(axes, keepdim=True)
        std = ((x * x).mean(axes, keepdim=True) - mean * mean).sqrt()
        return (x - mean) / (std + 1e-9)
    return kern(fn, 0)
