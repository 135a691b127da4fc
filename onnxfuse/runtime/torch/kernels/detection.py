"""Object-detection ops: RoiAlign, MaxRoiPool (features of boxes; gradients to the feature map) and
NonMaxSuppression (box indices, no gradient). Each follows the specification's reference computation and
onnxruntime's (the sampling grid, rounding and tie rules), with a Python loop over boxes and vectorized work
inside each; the boxes are host values."""
from __future__ import annotations

import math

import torch

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, kern, op


def _round_half_away(v: float) -> int:
    """std::round: halves away from zero (torch.round and Python's round go to even)."""
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def _bilinear_corners(coords: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """RoiAlign's sampling along one axis: for each coordinate its low and high neighbours and their weights;
    outside [-1, size] both weights are 0, else the coordinate is clamped to [0, size - 1] first."""
    outside = (coords < -1.0) | (coords > size)
    c = coords.clamp(min=0.0)
    low = c.floor().to(torch.int64)
    at_end = low >= size - 1
    low = torch.where(at_end, torch.full_like(low, size - 1), low)
    high = torch.where(at_end, low, low + 1)
    c = torch.where(at_end, low.to(c.dtype), c)
    frac = c - low.to(c.dtype)
    w_low, w_high = 1.0 - frac, frac
    zero = torch.zeros_like(frac)
    return low, high, torch.where(outside, zero, w_low), torch.where(outside, zero, w_high)


@op("RoiAlign")
def roi_align(spec: NodeSpec) -> Kernel:
    """RoiAlign(X [N, C, H, W], rois [R, 4] (x1, y1, x2, y2), batch_indices [R]) -> [R, C, out_h, out_w]: each bin
    averages (``mode`` avg) or takes the largest of (max: onnxruntime's, the largest weighted corner of each
    sample) bilinear samples on a grid of sampling_ratio (0: ceil(roi size / bins)) per axis; boxes scaled by
    spatial_scale and shifted by half a pixel (``coordinate_transformation_mode`` half_pixel, opset 16's default)
    or not (output_half_pixel, where a box is at least 1 x 1)."""
    mode = spec.attr("mode", "avg")
    PH, PW = int(spec.attr("output_height", 1)), int(spec.attr("output_width", 1))
    ratio, scale = int(spec.attr("sampling_ratio", 0)), float(spec.attr("spatial_scale", 1.0))
    half = spec.attr("coordinate_transformation_mode", "half_pixel" if spec.opset >= 16 else
                     "output_half_pixel") == "half_pixel"

    def one(x, box):
        C, H, W = x.shape
        off = 0.5 if half else 0.0
        x1, y1, x2, y2 = (float(v) * scale - off for v in box)
        rw, rh = x2 - x1, y2 - y1
        if not half:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        bh, bw = rh / PH, rw / PW
        gh = ratio if ratio > 0 else math.ceil(rh / PH)
        gw = ratio if ratio > 0 else math.ceil(rw / PW)
        ys = torch.tensor([[y1 + p * bh + (i + 0.5) * bh / gh for i in range(gh)] for p in range(PH)],
                          dtype=x.dtype, device=x.device).reshape(-1)  # [PH * gh]
        xs = torch.tensor([[x1 + p * bw + (i + 0.5) * bw / gw for i in range(gw)] for p in range(PW)],
                          dtype=x.dtype, device=x.device).reshape(-1)  # [PW * gw]
        ylo, yhi, wyl, wyh = _bilinear_corners(ys, H)
        xlo, xhi, wxl, wxh = _bilinear_corners(xs, W)
        flat = x.reshape(C, H * W)
        outside = (ys.unsqueeze(1) < -1.0) | (ys.unsqueeze(1) > H) | (xs < -1.0) | (xs > W)  # [PH*gh, PW*gw]
        corners = []
        for yi, wy in ((ylo, wyl), (yhi, wyh)):
            for xi, wx in ((xlo, wxl), (xhi, wxh)):
                pos = (yi.unsqueeze(1) * W + xi).reshape(-1)
                w = torch.where(outside, 0.0, wy.unsqueeze(1) * wx).reshape(-1)
                pos = torch.where(outside.reshape(-1), 0, pos)
                corners.append(flat.index_select(1, pos) * w)  # [C, samples]
        if mode == "avg":
            v = (corners[0] + corners[1] + corners[2] + corners[3]).reshape(C, PH, gh, PW, gw)
            return v.sum((2, 4)) / max(gh * gw, 1)
        v = torch.stack(corners).amax(0).reshape(C, PH, gh, PW, gw)
        return v.amax(4).amax(2)

    def fn(x, rois, batch_indices):
        boxes, batches = rois.tolist(), [int(b) for b in batch_indices.reshape(-1).tolist()]
        if not boxes:
            return x.new_zeros(0, x.shape[1], PH, PW)
        return torch.stack([one(x[b], box) for box, b in zip(boxes, batches)])
    return kern(fn, 0, 1, 2, host=(1, 2))


@op("MaxRoiPool")
def max_roi_pool(spec: NodeSpec) -> Kernel:
    """MaxRoiPool(X [N, C, H, W], rois [R, 5] (batch, x1, y1, x2, y2)) -> [R, C, *pooled_shape]: the box scaled by
    spatial_scale and rounded (halves away from zero), at least 1 x 1, split into bins [floor(p * size / n),
    ceil((p + 1) * size / n)); each bin's largest value, 0 for an empty bin (onnxruntime's rule)."""
    PH, PW = (int(v) for v in spec.attr("pooled_shape"))
    scale = float(spec.attr("spatial_scale", 1.0))

    def bins(start: int, length: int, n: int, limit: int) -> list[tuple[int, int]]:
        size = length / n
        return [(min(max(math.floor(p * size) + start, 0), limit), min(max(math.ceil((p + 1) * size) + start, 0),
                                                                       limit)) for p in range(n)]

    def one(x, roi):
        b, x1, y1, x2, y2 = int(roi[0]), *(_round_half_away(v * scale) for v in roi[1:])
        rows = bins(y1, max(y2 - y1 + 1, 1), PH, x.shape[2])
        cols = bins(x1, max(x2 - x1 + 1, 1), PW, x.shape[3])
        feat = x[b]
        out = [[feat[:, h0:h1, w0:w1].amax((1, 2)) if h1 > h0 and w1 > w0 else feat.new_zeros(feat.shape[0])
                for w0, w1 in cols] for h0, h1 in rows]
        return torch.stack([torch.stack(r, -1) for r in out], -2)  # [C, PH, PW]

    def fn(x, rois):
        boxes = rois.tolist()
        if not boxes:
            return x.new_zeros(0, x.shape[1], PH, PW)
        return torch.stack([one(x, roi) for roi in boxes])
    return kern(fn, 0, 1, host=(1,))


@op("NonMaxSuppression")
def non_max_suppression(spec: NodeSpec) -> Kernel:
    """NonMaxSuppression(boxes [N, n, 4], scores [N, classes, n], max_output_boxes_per_class?, iou_threshold?,
    score_threshold?) -> [selected, 3] (batch, class, box): per batch and class, boxes scoring above
    score_threshold taken greedily by score (ties: the lower index first), each dropping the rest whose IoU with
    it exceeds iou_threshold, at most max_output_boxes_per_class. Boxes are corners [y1, x1, y2, x2] in any order
    (``center_point_box`` 0) or [x_centre, y_centre, width, height] (1)."""
    centre = bool(spec.attr("center_point_box", 0))
    given = [i for i in range(5) if spec.has(i)]

    def corners(b: list[float]) -> tuple[float, float, float, float]:
        if centre:
            x, y, w, h = b
            return y - h / 2, x - w / 2, y + h / 2, x + w / 2
        y1, x1, y2, x2 = b
        return min(y1, y2), min(x1, x2), max(y1, y2), max(x1, x2)

    def iou(a, b) -> float:
        h = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
        w = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
        inter = h * w
        union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
        return inter / union if inter > 0 and union > 0 else 0.0

    def fn(boxes, scores, *rest):
        got = dict(zip(given[2:], rest))
        limit = int(got[2].reshape(-1)[0]) if 2 in got else 0
        thr = float(got[3].reshape(-1)[0]) if 3 in got else 0.0
        floor_ = float(got[4].reshape(-1)[0]) if 4 in got else None
        out = []
        for n, (bs, ss) in enumerate(zip(boxes.tolist(), scores.tolist())):
            bs = [corners(b) for b in bs]
            for c, s in enumerate(ss):
                order = sorted((i for i in range(len(s)) if floor_ is None or s[i] > floor_), key=lambda i: (-s[i], i))
                kept: list[int] = []
                for i in order:
                    if len(kept) >= limit:
                        break
                    if all(iou(bs[i], bs[j]) <= thr for j in kept):
                        kept.append(i)
                out += [[n, c, i] for i in kept]
        return torch.tensor(out, dtype=torch.int64, device=boxes.device).reshape(-1, 3)
    return kern(fn, *given, host=tuple(given))
