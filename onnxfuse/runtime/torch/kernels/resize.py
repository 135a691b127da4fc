"""Resampling: Resize (F.interpolate where it computes what ONNX defines, else separable index_select / lerp per
axis), GridSample and AffineGrid (a spatial transformer's grid and sampler)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from onnxfuse.core._resize import nearest_index, source_coords
from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, kern, norm_axis, op

_TORCH_LINEAR = {1: "linear", 2: "bilinear", 3: "trilinear"}


@op("Resize")
def resize(spec: NodeSpec) -> Kernel:
    """Resize(X, roi, scales, sizes) with constant scales or sizes (opsets 13..19; axes from 18).

    Per resized axis: output length = sizes[a], or floor(L * scales[a]); x_original from
    coordinate_transformation_mode. torch's F.interpolate where it computes the same (nearest + asymmetric + floor;
    linear + half_pixel / align_corners; cubic with a = -0.75, exclude_outside 0); otherwise nearest and linear
    run separably per axis with index_select (exactly ONNX's definition), and other forms are refused.
    """
    ctm = spec.attr("coordinate_transformation_mode", "half_pixel")
    if ctm == "tf_crop_and_resize":
        spec.fail("tf_crop_and_resize is not supported", "use another coordinate_transformation_mode")
    if int(spec.attr("antialias", 0)) or spec.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        spec.fail("antialias / keep_aspect_ratio_policy are not supported", "resize without them")
    spec.need_const(2, "scales")
    spec.need_const(3, "sizes")
    scales = spec.const(2) if spec.has(2) and spec.const(2).numel() else None
    r = _Resize(mode=spec.attr("mode", "nearest"), ctm=ctm,
                nearest_mode=spec.attr("nearest_mode", "round_prefer_floor"),
                cubic_a=float(spec.attr("cubic_coeff_a", -0.75)), exclude=int(spec.attr("exclude_outside", 0)),
                scales=[float(s) for s in scales.tolist()] if scales is not None else None,
                sizes=spec.ints(3) if spec.has(3) else None, axes=spec.attr("axes"))

    if r.mode == "cubic":
        def cubic(x):
            out, sc = r.output_shape(x.shape)
            y = r.interpolate(x, out, sc)
            if y is None:
                spec.fail(f"cubic resize with {r.ctm}, a = {r.cubic_a}, exclude_outside {r.exclude} is not "
                          "supported", "use half_pixel or align_corners with a = -0.75, or linear")
            return y
        return kern(cubic, 0)

    def fn(x):
        out, sc = r.output_shape(x.shape)
        y = r.interpolate(x, out, sc)
        return r.separable(x, out, sc) if y is None else y
    return kern(fn, 0)


@dataclass
class _Resize:
    """One Resize node's attributes and constant scales or sizes, and the two ways to compute it."""

    mode: str
    ctm: str  # coordinate_transformation_mode
    nearest_mode: str
    cubic_a: float
    exclude: int
    scales: list[float] | None
    sizes: list[int] | None
    axes: list[int] | None
    cache: dict = field(default_factory=dict)  # per axis and length: the separable path's indices and weights

    def output_shape(self, shape) -> tuple[list[int], list[float]]:
        """The output's shape and each axis's scale (1 where it is not resized)."""
        r = len(shape)
        axes = [norm_axis(int(a), r) for a in self.axes] if self.axes is not None else list(range(r))
        out, sc = list(shape), [1.0] * r
        for j, a in enumerate(axes):
            if self.sizes is not None:
                out[a], sc[a] = self.sizes[j], self.sizes[j] / shape[a]
            else:
                out[a], sc[a] = int(math.floor(shape[a] * self.scales[j])), self.scales[j]
        return out, sc

    def interpolate(self, x, out, sc):
        """F.interpolate where it computes what ONNX defines for this node; None where it does not."""
        mode, ctm = self.mode, self.ctm
        resized = [a for a in range(x.dim()) if out[a] != x.shape[a] or sc[a] != 1.0]
        if not resized:
            return x
        first = min(resized)
        S = x.dim() - first
        if mode == "nearest" and not (ctm == "asymmetric" and self.nearest_mode == "floor"):
            return None
        if mode == "linear" and ctm not in ("half_pixel", "pytorch_half_pixel", "align_corners"):
            return None
        if mode == "cubic" and (ctm not in ("half_pixel", "pytorch_half_pixel", "align_corners") or
                                abs(self.cubic_a + 0.75) > 1e-6 or self.exclude or S > 2):
            return None
        if S > 3 or (ctm == "pytorch_half_pixel" and any(out[a] == 1 for a in resized)):
            return None
        lead = x.shape[:first]
        y = x.reshape((1, math.prod(lead)) + tuple(x.shape[first:]))
        size = out[first:]
        if mode == "cubic" and S == 1:
            y = y.unsqueeze(2)
            size = [1] + size
        if self.sizes is None and ctm != "align_corners":  # ONNX maps coordinates with the given scales, not out/in
            kw = dict(scale_factor=sc[first:] if not (mode == "cubic" and S == 1) else [1.0] + sc[first:],
                      recompute_scale_factor=False)
        else:
            kw = dict(size=size)
        if mode == "nearest":
            y = F.interpolate(y, mode="nearest", **kw)
        elif mode == "linear":
            y = F.interpolate(y, mode=_TORCH_LINEAR[S], align_corners=ctm == "align_corners", **kw)
        else:
            y = F.interpolate(y, mode="bicubic", align_corners=ctm == "align_corners", **kw)
        if mode == "cubic" and S == 1:
            y = y.squeeze(2)
        return y.reshape(tuple(lead) + tuple(y.shape[2:]))

    def separable(self, x, out, sc):
        """Nearest or linear, one axis at a time with index_select: ONNX's definition exactly."""
        for a in range(x.dim()):
            if out[a] == x.shape[a] and sc[a] == 1.0:  # onnxruntime leaves such axes as they are
                continue
            key = (a, x.shape[a], out[a], sc[a], x.device)
            if key not in self.cache:
                # float32 coordinates, as onnxruntime computes them
                xs = source_coords(out[a], x.shape[a], sc[a], self.ctm, np.float32)
                if self.mode == "nearest":
                    self.cache[key] = (torch.from_numpy(nearest_index(xs, self.nearest_mode, x.shape[a])).to(x.device),)
                else:
                    xo = torch.from_numpy(xs).clamp(0, x.shape[a] - 1)
                    i0 = xo.floor().to(torch.int64)
                    i1 = (i0 + 1).clamp(max=x.shape[a] - 1)
                    w = (xo - i0).to(x.dtype).reshape([-1] + [1] * (x.dim() - 1 - a))
                    self.cache[key] = (i0.to(x.device), i1.to(x.device), w.to(x.device))
            c = self.cache[key]
            if self.mode == "nearest":
                x = x.index_select(a, c[0])
            else:
                x = torch.lerp(x.index_select(a, c[0]), x.index_select(a, c[1]), c[2])
        return x


# GridSample's modes: opset 16's names and opset 20's, as F.grid_sample names them
_SAMPLE_MODES = {"bilinear": "bilinear", "linear": "bilinear", "nearest": "nearest", "bicubic": "bicubic",
                 "cubic": "bicubic"}


@op("GridSample")
def grid_sample(spec: NodeSpec) -> Kernel:
    """GridSample(X [N, C, *S], grid [N, *S_out, len(S)]): X sampled at the grid's normalized coordinates (x first,
    in [-1, 1]), F.grid_sample with the same mode, padding_mode (zeros, border, reflection) and align_corners, for
    2-D and 3-D images (cubic: 2-D, as torch). A spatial transformer's sampler."""
    mode = _SAMPLE_MODES.get(spec.attr("mode", "bilinear" if spec.opset < 20 else "linear"))
    padding, align = spec.attr("padding_mode", "zeros"), bool(spec.attr("align_corners", 0))
    if mode is None:
        spec.fail(f"mode '{spec.attr('mode')}' is not a GridSample mode", "use linear, nearest or cubic")

    def fn(x, grid):
        if x.dim() not in (4, 5) or (mode == "bicubic" and x.dim() != 4):
            spec.fail(f"{mode} sampling of a {x.dim() - 2}-D image has no torch kernel",
                      "sample 2-D images (or 3-D ones with linear or nearest)")
        return F.grid_sample(x, grid.to(x.dtype), mode, padding, align)
    return kern(fn, 0, 1)


@op("AffineGrid")
def affine_grid(spec: NodeSpec) -> Kernel:
    """AffineGrid(theta [N, 2, 3] or [N, 3, 4], size [N, C, *S]) -> [N, *S, 2|3]: F.affine_grid, the normalized
    coordinates of the affine map of each output pixel (align_corners as given). size is a host value."""
    align = bool(spec.attr("align_corners", 0))
    return kern(lambda theta, size: F.affine_grid(theta, [int(v) for v in size.reshape(-1).tolist()], align), 0, 1,
                host=(1,))
