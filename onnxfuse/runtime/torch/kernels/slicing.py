"""Pieces of a tensor: Split, Slice (ONNX's clamping, negative steps), Pad (constant, reflect, edge, wrap),
DepthToSpace, SpaceToDepth, Trilu, ReverseSequence, CenterCropPad."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, identity, kern, norm_axis, op


@op("Split")
def split(spec: NodeSpec) -> Kernel:
    """Pieces of the given sizes (``split`` input from opset 13, attribute before), else equal pieces: the number of
    outputs (``num_outputs`` from opset 18; the last piece smaller when uneven)."""
    axis, n = int(spec.attr("axis", 0)), len(spec.node.output)
    if spec.opset >= 13:
        spec.need_const(1, "split")
        sizes = spec.ints(1)
    else:
        sizes = spec.attr("split")
    if n == 1:
        return kern(identity, 0)
    if sizes:
        sizes = [int(s) for s in sizes]
        return kern(lambda x: torch.split(x, sizes, axis), 0)
    return kern(lambda x: torch.split(x, -(-x.shape[axis] // n), axis), 0)


def _slice_index(x, starts, ends, axes, steps):
    """x[starts:ends:steps] on ``axes`` with ONNX's (numpy's) clamping; negative steps through a flip."""
    idx: list = [slice(None)] * x.dim()
    flips = []
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = norm_axis(a, x.dim())
        if st > 0:
            idx[a] = slice(s, e, st)
        else:
            r = range(x.shape[a])[slice(s, e, st)]
            if len(r) == 0:
                idx[a] = slice(0, 0)
            else:  # element r[j] of x is element (L-1-r[j]) of x.flip(a)
                L = x.shape[a]
                idx[a] = slice(L - 1 - r.start, L - 1 - r.start + (len(r) - 1) * (-st) + 1, -st)
                flips.append(a)
    if flips:
        x = x.flip(flips)
    return x[tuple(idx)]


@op("Slice")
def slice_(spec: NodeSpec) -> Kernel:
    """Slice(x, starts, ends, axes, steps) (opset >= 10 inputs): constant ones are one precomputed index."""
    if spec.opset < 10:
        starts, ends = list(spec.attr("starts")), list(spec.attr("ends"))
        axes = list(spec.attr("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = spec.ints(1), spec.ints(2)
        spec.need_const(3, "axes")
        spec.need_const(4, "steps")
        axes, steps = spec.ints(3), spec.ints(4)
    if starts is not None and ends is not None:
        axes = list(axes) if axes is not None else list(range(len(starts)))
        steps = list(steps) if steps is not None else [1] * len(starts)
        if all(st > 0 for st in steps) and all(a >= 0 for a in axes):
            idx: list = [slice(None)] * (max(axes) + 1 if axes else 0)
            for s, e, a, st in zip(starts, ends, axes, steps):
                idx[a] = slice(s, e, st)
            index = tuple(idx)
            return kern(lambda x: x[index], 0)
        return kern(lambda x: _slice_index(x, starts, ends, axes, steps), 0)

    def dynamic(x, s, e):
        s, e = s.tolist(), e.tolist()
        a = list(axes) if axes is not None else list(range(len(s)))
        st = list(steps) if steps is not None else [1] * len(s)
        return _slice_index(x, s, e, a, st)
    return kern(dynamic, 0, 1, 2, host=(1, 2))


@op("Pad")
def pad(spec: NodeSpec) -> Kernel:
    """Pad(x, pads, constant_value, axes) (opset >= 11); modes constant, reflect, edge (replicate), wrap (circular).
    Negative pads crop."""
    mode = spec.attr("mode", "constant")
    if spec.opset < 11:
        pads, value, axes = list(spec.attr("pads")), float(spec.attr("value", 0.0)), None
    else:
        spec.need_const(1, "pads")
        spec.need_const(2, "constant_value")
        spec.need_const(3, "axes")
        pads, value, axes = spec.ints(1), spec.scalar(2, 0), spec.ints(3)
    tmode = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}.get(mode)
    if tmode is None:
        spec.fail(f"pad mode '{mode}' is not supported", "use constant, reflect, edge or wrap")

    def fn(x):
        r = x.dim()
        ax = [norm_axis(a, r) for a in axes] if axes is not None else list(range(r))
        n = len(ax)
        full_b, full_e = [0] * r, [0] * r
        for j, a in enumerate(ax):
            full_b[a], full_e[a] = pads[j], pads[n + j]
        padded = [a for a in range(r) if full_b[a] or full_e[a]]
        if not padded:
            return x
        first = padded[0]
        tp: list[int] = []
        for a in reversed(range(first, r)):
            tp += [full_b[a], full_e[a]]
        if tmode == "constant":
            return F.pad(x, tp, "constant", value)
        k = r - first  # torch's other modes pad the last 1..3 axes of a [N, C, *S] tensor
        if k > 3:
            spec.fail(f"{mode} padding of {k} trailing axes", "pad at most the last 3 axes")
        lead = x.shape[:first]
        y = F.pad(x.reshape((1, math.prod(lead)) + tuple(x.shape[first:])), tp, tmode)
        return y.reshape(tuple(lead) + tuple(y.shape[2:]))
    return kern(fn, 0)


@op("DepthToSpace")
def depth_to_space(spec: NodeSpec) -> Kernel:
    """[N, C*b*b, H, W] -> [N, C, H*b, W*b]; CRD is F.pixel_shuffle, DCR reads the depth as (b, b, C)."""
    b = int(spec.attr("blocksize"))
    if spec.attr("mode", "DCR") == "CRD":
        return kern(lambda x: F.pixel_shuffle(x, b), 0)

    def dcr(x):
        N, C, H, W = x.shape
        return x.reshape(N, b, b, C // (b * b), H, W).permute(0, 3, 4, 1, 5, 2).reshape(N, C // (b * b), H * b, W * b)
    return kern(dcr, 0)


@op("SpaceToDepth")
def space_to_depth(spec: NodeSpec) -> Kernel:
    """[N, C, H*b, W*b] -> [N, b*b*C, H, W], the depth ordered (b, b, C) as ONNX defines it."""
    b = int(spec.attr("blocksize"))

    def fn(x):
        N, C, H, W = x.shape
        return x.reshape(N, C, H // b, b, W // b, b).permute(0, 3, 5, 1, 2, 4).reshape(N, C * b * b, H // b, W // b)
    return kern(fn, 0)


@op("Trilu")
def trilu(spec: NodeSpec) -> Kernel:
    """The upper (``upper`` 1: torch.triu) or lower (torch.tril) triangle of the last two axes from diagonal k
    (input 1, a host value, default 0), zeros elsewhere."""
    f = torch.triu if int(spec.attr("upper", 1)) else torch.tril
    if not spec.has(1):
        return kern(f, 0)
    return kern(lambda x, k: f(x, int(k.reshape(-1)[0])), 0, 1, host=(1,))


@op("ReverseSequence")
def reverse_sequence(spec: NodeSpec) -> Kernel:
    """Each batch entry's first ``sequence_lens[b]`` steps along ``time_axis`` reversed, the rest as they are: one
    gather along time with index ``len[b] - 1 - t`` for t < len[b], else t."""
    t_axis, b_axis = int(spec.attr("time_axis", 0)), int(spec.attr("batch_axis", 1))

    def fn(x, lens):
        T = x.shape[t_axis]
        t = torch.arange(T, device=x.device).unsqueeze(1)  # [T, batch]
        lens = lens.to(torch.int64).to(x.device).unsqueeze(0)
        src = torch.where(t < lens, lens - 1 - t, t)
        if t_axis > b_axis:
            src = src.t()
        src = src.reshape(src.shape + (1,) * (x.dim() - 2)).expand(x.shape)
        return torch.gather(x, t_axis, src)
    return kern(fn, 0, 1)


@op("CenterCropPad")
def center_crop_pad(spec: NodeSpec) -> Kernel:
    """Each of ``axes`` (default all) cropped or zero-padded to ``shape``, centred: a crop of d elements drops
    floor(d/2) at the start, a pad of d adds floor(d/2) at the start (the odd one at the end). shape is a host
    value."""
    axes = spec.attr("axes")

    def fn(x, shape):
        target = [int(v) for v in shape.reshape(-1).tolist()]
        ax = [norm_axis(int(a), x.dim()) for a in axes] if axes is not None else list(range(x.dim()))
        for a, n in zip(ax, target):
            d = x.shape[a] - n
            if d > 0:
                x = x.narrow(a, d // 2, n)
            elif d < 0:
                x = F.pad(x, [0, 0] * (x.dim() - 1 - a) + [(-d) // 2, -d - (-d) // 2])
        return x
    return kern(fn, 0, 1, host=(1,))
