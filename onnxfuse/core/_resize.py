"""ONNX Resize's coordinate maths, written once: where each output index samples the input along one axis.

Used by the ORT legalization (``runtime/ort/legalize/resize.py``, which builds Gather / MatMul forms from these indices) and by
the torch runtime's Resize kernel (``onnxfuse/runtime/torch/kernels/resize.py``), so both read the specification the same way.

    x_original = f(i)  for output index i, per ``coordinate_transformation_mode``:
      half_pixel            (i + 0.5) / scale - 0.5
      pytorch_half_pixel    the same, 0 when out_len == 1
      align_corners         i * (in_len - 1) / (out_len - 1), 0 when out_len == 1
      asymmetric            i / scale
      tf_half_pixel_for_nn  (i + 0.5) / scale
      half_pixel_symmetric  in_len / 2 * (1 - out_len / (scale * in_len)) + (i + 0.5) / scale - 0.5   (opset 19)
"""
from __future__ import annotations

import numpy as np

__all__ = ["COORDINATE_MODES", "source_coords", "nearest_index"]

COORDINATE_MODES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn",
                    "half_pixel_symmetric")


def source_coords(out_len: int, in_len: int, scale: float, coord: str, dtype=np.float64) -> np.ndarray:
    """The source coordinate of each output index, computed in ``dtype`` (float32 is what ONNX Runtime's kernels
    compute; the legalization uses float64)."""
    i = np.arange(out_len, dtype=dtype)
    s = dtype(scale)
    if coord == "half_pixel":
        return (i + dtype(0.5)) / s - dtype(0.5)
    if coord == "pytorch_half_pixel":
        return (i + dtype(0.5)) / s - dtype(0.5) if out_len > 1 else np.zeros(out_len, dtype)
    if coord == "align_corners":
        return i * dtype((in_len - 1) / (out_len - 1)) if out_len > 1 else np.zeros(out_len, dtype)
    if coord == "asymmetric":
        return i / s
    if coord == "tf_half_pixel_for_nn":
        return (i + dtype(0.5)) / s
    if coord == "half_pixel_symmetric":
        adjustment = dtype(out_len / (scale * in_len))
        return dtype(in_len / 2) * (1 - adjustment) + (i + dtype(0.5)) / s - dtype(0.5)
    raise ValueError(f"unknown coordinate_transformation_mode {coord!r}")


def nearest_index(xs: np.ndarray, nearest_mode: str, in_len: int) -> np.ndarray:
    """The input index ``mode="nearest"`` reads for each source coordinate, clamped to the axis."""
    if nearest_mode == "round_prefer_floor":
        idx = np.ceil(xs - 0.5)
    elif nearest_mode == "round_prefer_ceil":
        idx = np.floor(xs + 0.5)
    elif nearest_mode == "floor":
        idx = np.floor(xs)
    else:
        idx = np.ceil(xs)
    return np.clip(idx, 0, in_len - 1).astype(np.int64)
