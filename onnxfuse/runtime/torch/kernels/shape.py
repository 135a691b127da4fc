"""Shape ops: Shape, Size, Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Expand, Tile, Concat. Their
shape-like inputs are host values (``torch_graph`` keeps shape arithmetic off the device)."""
from __future__ import annotations

import math

import torch

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, all_inputs, axes_of, kern, norm_axis, op


@op("Shape")
def shape(spec: NodeSpec) -> Kernel:
    start, end = spec.attr("start", 0), spec.attr("end")
    sl = slice(start, end)
    return kern(lambda x: torch.tensor(x.shape[sl], dtype=torch.int64), 0)


@op("Size")
def size(spec: NodeSpec) -> Kernel:
    return kern(lambda x: torch.tensor(x.numel(), dtype=torch.int64), 0)


def _reshape_target(target: list[int], allowzero: bool):
    """A function of x's shape giving the target with 0 = "copy this dim" resolved (unless allowzero)."""
    zeros = [] if allowzero else [i for i, v in enumerate(target) if v == 0]
    if not zeros:
        return None
    def resolve(shape):
        t = list(target)
        for i in zeros:
            t[i] = shape[i]
        return t
    return resolve


@op("Reshape")
def reshape(spec: NodeSpec) -> Kernel:
    allowzero = bool(spec.attr("allowzero", 0))
    target = spec.ints(1)
    if target is not None:
        resolve = _reshape_target(target, allowzero)
        if resolve is None:
            return kern(lambda x: x.reshape(target), 0)
        return kern(lambda x: x.reshape(resolve(x.shape)), 0)

    def dynamic(x, t):
        t = t.tolist()
        r = _reshape_target(t, allowzero)
        return x.reshape(r(x.shape) if r else t)
    return kern(dynamic, 0, 1, host=(1,))


@op("Flatten")
def flatten(spec: NodeSpec) -> Kernel:
    axis = int(spec.attr("axis", 1))

    def fn(x):
        a = norm_axis(axis, x.dim())
        return x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:]))
    return kern(fn, 0)


@op("Transpose")
def transpose(spec: NodeSpec) -> Kernel:
    perm = spec.attr("perm")
    if perm is None:
        return kern(lambda x: x.permute(*reversed(range(x.dim()))), 0)
    perm = [int(p) for p in perm]
    return kern(lambda x: x.permute(perm), 0)


@op("Squeeze")
def squeeze(spec: NodeSpec) -> Kernel:
    axes, given = axes_of(spec, 13)
    if not given:
        return kern(lambda x: x.squeeze(), 0)
    dims = tuple(axes)
    return kern(lambda x: x.squeeze(dims), 0)


@op("Unsqueeze")
def unsqueeze(spec: NodeSpec) -> Kernel:
    """Insert size-1 axes at output positions ``axes`` (attribute before opset 13, input from then on)."""
    axes, _ = axes_of(spec, 13)
    if axes is None:
        spec.fail("Unsqueeze without axes", "give the axes")
    if all(a >= 0 for a in axes):
        order = sorted(axes)
        if len(order) == 1:
            a0 = order[0]
            return kern(lambda x: x.unsqueeze(a0), 0)

        def fn(x):
            for a in order:
                x = x.unsqueeze(a)
            return x
        return kern(fn, 0)

    def neg(x):
        r = x.dim() + len(axes)
        for a in sorted(norm_axis(a, r) for a in axes):
            x = x.unsqueeze(a)
        return x
    return kern(neg, 0)


@op("Expand")
def expand(spec: NodeSpec) -> Kernel:
    """Bidirectional broadcast of x and the target shape (a 1 in the target keeps x's dim), as a view."""
    target = spec.ints(1)
    if target is not None:
        return kern(lambda x: x.expand(torch.broadcast_shapes(x.shape, target)), 0)
    return kern(lambda x, t: x.expand(torch.broadcast_shapes(x.shape, tuple(t.tolist()))), 0, 1, host=(1,))


@op("Tile")
def tile(spec: NodeSpec) -> Kernel:
    reps = spec.ints(1)
    if reps is not None:
        return kern(lambda x: x.repeat(reps), 0)
    return kern(lambda x, r: x.repeat(r.tolist()), 0, 1, host=(1,))


@op("Concat")
def concat(spec: NodeSpec) -> Kernel:
    axis = int(spec.attr("axis"))
    return kern(lambda *xs: torch.cat(xs, axis), *all_inputs(spec))
