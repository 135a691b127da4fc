"""Convolutions: Conv (with group: B fused convolutions are one grouped one, ``core/rules/conv.py``) and
ConvTranspose, as F.conv{1,2,3}d / F.conv_transpose{1,2,3}d; DeformConv and Col2Im (the inverse of im2col)."""
from __future__ import annotations

import math

import torch
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


def _bilinear_zeros(x: torch.Tensor, y: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """Bilinear samples of ``x`` [N, G, C, H, W] at rows ``y`` and columns ``xs`` [N, G, P] (fractional), a corner
    outside the image counting 0 (GridSample's zeros padding, align_corners 1) -> [N, G, C, P]."""
    N, G, C, H, W = x.shape
    flat = x.reshape(N, G, C, H * W)
    y0, x0 = y.floor(), xs.floor()
    out = 0
    for dy in (0, 1):
        for dx in (0, 1):
            yy, xx = y0 + dy, x0 + dx
            w = (1 - (y - yy).abs()) * (1 - (xs - xx).abs())
            inside = (yy >= 0) & (yy <= H - 1) & (xx >= 0) & (xx <= W - 1)
            pos = (yy.clamp(0, H - 1) * W + xx.clamp(0, W - 1)).to(torch.int64)
            picked = torch.gather(flat, 3, pos.unsqueeze(2).expand(N, G, C, pos.shape[-1]))
            out = out + picked * torch.where(inside, w, torch.zeros_like(w)).unsqueeze(2)
    return out


@op("DeformConv")
def deform_conv(spec: NodeSpec) -> Kernel:
    """DeformConv(X [N, C, H, W], W [oc, C / group, kh, kw], offset [N, og * kh * kw * 2, oh, ow], B?, mask?):
    a 2-D convolution whose kernel taps are moved by ``offset`` (dy, dx per tap, offset group and output pixel) and
    weighted by ``mask`` (default 1): each input channel sampled bilinearly at the moved taps (outside the image:
    0), then one grouped product with W, plus B. The specification's reference (GridSample with align_corners 1)
    and torchvision's deform_conv2d compute the same."""
    w_const = spec.const(1)
    kshape = spec.attr("kernel_shape") or (list(w_const.shape[2:]) if w_const is not None else None)
    if kshape is not None and len(kshape) != 2:
        spec.fail(f"{len(kshape)}-D DeformConv has no torch kernel", "use a 2-D deformable convolution")
    group, og = int(spec.attr("group", 1)), int(spec.attr("offset_group", 1))
    strides, dil = list(spec.attr("strides", [1, 1])), list(spec.attr("dilations", [1, 1]))
    pads = list(spec.attr("pads", [0, 0, 0, 0]))
    given = [i for i in range(5) if spec.has(i)]

    def fn(x, w, offset, *rest):
        got = dict(zip(given[3:], rest))
        b, mask = got.get(3), got.get(4)
        N, C, H, W = x.shape
        oc, kh, kw = w.shape[0], w.shape[2], w.shape[3]
        oh, ow = offset.shape[2:]
        K = kh * kw
        off = offset.reshape(N, og, kh, kw, 2, oh, ow)
        ty = (torch.arange(kh, device=x.device) * dil[0]).reshape(kh, 1, 1, 1)
        tx = (torch.arange(kw, device=x.device) * dil[1]).reshape(1, kw, 1, 1)
        gy = (torch.arange(oh, device=x.device) * strides[0] - pads[0]).reshape(1, 1, oh, 1)
        gx = (torch.arange(ow, device=x.device) * strides[1] - pads[1]).reshape(1, 1, 1, ow)
        y = (ty + gy).to(x.dtype) + off[:, :, :, :, 0]  # [N, og, kh, kw, oh, ow]
        xs = (tx + gx).to(x.dtype) + off[:, :, :, :, 1]
        cols = _bilinear_zeros(x.reshape(N, og, C // og, H, W), y.reshape(N, og, -1), xs.reshape(N, og, -1))
        cols = cols.reshape(N, og, C // og, K, oh * ow)
        if mask is not None:
            cols = cols * mask.reshape(N, og, 1, K, oh * ow)
        cols = cols.reshape(N, group, (C // group) * K, oh * ow)
        out = torch.einsum("gok,ngkl->ngol", w.reshape(group, oc // group, (C // group) * K), cols)
        out = out.reshape(N, oc, oh, ow)
        return out if b is None else out + b.reshape(1, oc, 1, 1)
    return kern(fn, *given)


@op("Col2Im")
def col2im(spec: NodeSpec) -> Kernel:
    """Col2Im(input [N, C * prod(block), L], image_shape, block_shape): the inverse of unfolding (F.fold for any
    number of spatial axes): each column's values added into the image at its block's positions, taking strides,
    dilations and pads (cropped) into account. image_shape and block_shape are host values."""
    given_dil, given_pads, given_strides = spec.attr("dilations"), spec.attr("pads"), spec.attr("strides")

    def fn(x, image, block):
        img = [int(v) for v in image.reshape(-1).tolist()]
        k = [int(v) for v in block.reshape(-1).tolist()]
        S = len(img)
        dil = list(given_dil or [1] * S)
        st = list(given_strides or [1] * S)
        pads = list(given_pads or [0] * (2 * S))
        n = [(img[a] + pads[a] + pads[S + a] - dil[a] * (k[a] - 1) - 1) // st[a] + 1 for a in range(S)]
        N, K, L = x.shape[0], math.prod(k), math.prod(n)
        C = x.shape[1] // K
        # per (tap, block) position along each axis, then the flat image index and whether it is inside
        index = torch.zeros(K, L, dtype=torch.int64, device=x.device)
        inside = torch.ones(K, L, dtype=torch.bool, device=x.device)
        taps = torch.cartesian_prod(*[torch.arange(v, device=x.device) for v in k]).reshape(K, S)
        blocks = torch.cartesian_prod(*[torch.arange(v, device=x.device) for v in n]).reshape(L, S)
        for a in range(S):
            pos = blocks[:, a].unsqueeze(0) * st[a] - pads[a] + taps[:, a].unsqueeze(1) * dil[a]
            inside &= (pos >= 0) & (pos < img[a])
            index = index * img[a] + pos.clamp(0, img[a] - 1)
        keep = inside.reshape(-1)
        cols = x.reshape(N, C, K * L)[:, :, keep]
        y = x.new_zeros(N, C, math.prod(img)).index_add(2, index.reshape(-1)[keep], cols)
        return y.reshape(N, C, *img)
    return kern(fn, 0, 1, 2, host=(1, 2))
