"""How a fused tensor holds the B per-model copies of one original tensor.

For an original tensor of shape S = [d0, ..., d(r-1)] the fused tensor is one of

- ``SHARED``      the same value for every model (graph inputs, constants, shape arithmetic); shape S.
- ``stacked(a)``  a new model axis at position a: shape S[:a] + [B] + S[a:]; model b is ``take(b, axis=a)``.
- ``packed(a)``   models concatenated along axis a: shape S with d_a -> B*d_a; model b is the slice
                  ``[b*d_a, (b+1)*d_a)`` of axis a (model-major within the axis).

packed(a) and stacked(a) hold the same bytes in the same order, so converting between them is a free Reshape.
Convolution tensors are channel-packed, ``packed(1)`` = [N, B*C, H, W]; matrix products use ``stacked(0)`` =
[B, N, F]. Graph outputs are always returned as ``stacked(0)``: ``fused[out][b] == model_b[out]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Layout", "SHARED", "stacked", "packed"]


@dataclass(frozen=True)
class Layout:
    kind: str  # "shared" | "stacked" | "packed"
    axis: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("shared", "stacked", "packed"):
            raise ValueError(f"unknown layout kind {self.kind!r}")

    @property
    def is_shared(self) -> bool:
        return self.kind == "shared"

    def fused_shape(self, shape: Sequence, B: int) -> list:
        """The fused tensor's shape for an original tensor of shape ``shape`` (symbolic dims pass through)."""
        s = list(shape)
        if self.kind == "shared":
            return s
        if self.kind == "stacked":
            return s[: self.axis] + [B] + s[self.axis :]
        d = s[self.axis]
        s[self.axis] = d * B if isinstance(d, int) else None
        return s

    def fused_axis(self, axis: int) -> int:
        """Where original axis ``axis`` (non-negative) sits in the fused tensor."""
        if self.kind == "stacked" and axis >= self.axis:
            return axis + 1
        return axis

    def __str__(self) -> str:
        return "shared" if self.is_shared else f"{self.kind}({self.axis})"


SHARED = Layout("shared")


def stacked(axis: int) -> Layout:
    return Layout("stacked", axis)


def packed(axis: int) -> Layout:
    return Layout("packed", axis)
