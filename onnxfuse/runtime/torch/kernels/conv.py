"""Convolutions: Conv (with group: B fused convolutions are one grouped one, ``core/rules/conv.py``) and
ConvTranspose, as F.conv{1,2,3}d / F.conv_transpose{1,2,3}d."""
from __future__ import annotations

import torch.nn.functional as F

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, kern, op
from onnxfuse.runtime.torch.kernels._window import Window, symmetric, torch_pad

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@op("Conv")
def conv(spec: NodeSpec) -> Kernel:
    """F.conv{1,2,3}d with group; asymmetric or size-dependent (SAME_*) pads are an explicit F.pad first."""
    w = spec.const(1)
    kshape = spec.attr("kernel_shape") or (list(w.shape[2:]) if w is not None else None)
    S = len(kshape) if kshape is not None else len(spec.attr("strides", spec.attr("dilations", [1, 1])))
    if S not in _CONV:
        spec.fail(f"{S}-D convolution has no torch kernel", "use 1-, 2- or 3-D convolutions")
    win = Window(spec, S, kshape)
    f, group, stride, dil = _CONV[S], int(spec.attr("group", 1)), win.strides, win.dilations
    ins = (0, 1, 2) if spec.has(2) else (0, 1)
    if win.static and symmetric(win.pads, S):
        padding = win.pads[:S]
        return kern(lambda x, w, b=None: f(x, w, b, stride, padding, dil, group), *ins)

    def fn(x, w, b=None):
        pads = win.resolve(x.shape[2:], w.shape[2:])
        if symmetric(pads, S):
            return f(x, w, b, stride, pads[:S], dil, group)
        return f(F.pad(x, torch_pad(pads, S)), w, b, stride, 0, dil, group)
    return kern(fn, *ins)


@op("ConvTranspose")
def conv_transpose(spec: NodeSpec) -> Kernel:
    """F.conv_transpose{1,2,3}d. Output length per axis: s*(L-1) + op + d*(k-1) + 1 - pb - pe. Pads that torch cannot
    express (asymmetric, output_shape, auto_pad, output_padding >= stride) run as pads 0 and a crop/zero-pad of the
    full result, with the bias added after."""
    w = spec.const(1)
    kshape = spec.attr("kernel_shape") or (list(w.shape[2:]) if w is not None else None)
    S = len(kshape) if kshape is not None else len(spec.attr("strides", [1, 1]))
    f, group = _CONV_T[S], int(spec.attr("group", 1))
    stride, dil = list(spec.attr("strides", [1] * S)), list(spec.attr("dilations", [1] * S))
    op_ = list(spec.attr("output_padding", [0] * S))
    pads0 = list(spec.attr("pads", [0] * (2 * S)))
    out_shape = spec.attr("output_shape")
    auto_pad = spec.attr("auto_pad", "NOTSET")
    ins = (0, 1, 2) if spec.has(2) else (0, 1)
    simple = out_shape is None and auto_pad in ("NOTSET", "VALID") and symmetric(pads0, S) and \
        all(o < max(s, d) for o, s, d in zip(op_, stride, dil))
    if simple:
        padding = pads0[:S] if auto_pad == "NOTSET" else [0] * S
        return kern(lambda x, w, b=None: f(x, w, b, stride, padding, op_, group, dil), *ins)

    def pads_for(L, k):
        if auto_pad == "VALID":
            return [0] * (2 * S)
        if out_shape is None and auto_pad == "NOTSET":
            return pads0
        target = list(out_shape)[-S:] if out_shape is not None else [L[a] * stride[a] for a in range(S)]
        pb, pe = [], []
        for a in range(S):
            total = stride[a] * (L[a] - 1) + op_[a] + (k[a] - 1) * dil[a] + 1 - target[a]
            if auto_pad == "SAME_UPPER":
                pb.append(total // 2); pe.append(total - total // 2)  # noqa: E702
            else:
                pb.append(total - total // 2); pe.append(total // 2)  # noqa: E702
        return pb + pe

    def fn(x, w, b=None):
        L, k = x.shape[2:], w.shape[2:]
        pads = pads_for(L, k)
        y = f(x, w, None, stride, 0, 0, group, dil)
        for a in range(S):
            full = y.shape[2 + a]
            want = full + op_[a] - pads[a] - pads[S + a]
            stop = pads[a] + want
            if stop > full:
                y = F.pad(y, [0, 0] * (S - 1 - a) + [0, stop - full])
            y = y.narrow(2 + a, pads[a], want)
        return y if b is None else y + b.reshape([-1] + [1] * S)
    return kern(fn, *ins)
