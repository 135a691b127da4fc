"""Spatial window attributes shared by convolution and pooling: ONNX pads to torch's, pads that depend on the
input length (auto_pad SAME_*, ceil_mode) resolved per call (``onnxfuse.core.windows``' rules)."""
from __future__ import annotations

from typing import Sequence

from onnxfuse.core.windows import floor_mode_end_pad, output_length, same_pads
from onnxfuse.runtime.torch.kernels._base import NodeSpec


def torch_pad(pads: Sequence[int], S: int) -> list[int]:
    """ONNX pads [b1..bS, e1..eS] over the spatial axes -> F.pad's (bS, eS, ..., b1, e1)."""
    out: list[int] = []
    for a in reversed(range(S)):
        out += [pads[a], pads[S + a]]
    return out


class Window:
    """Spatial window attributes, with the pads resolved per input length when they depend on it (auto_pad SAME_*,
    ceil_mode: onnxfuse.core.windows' rules, the ONNX specification's since opset 19 and torch's)."""

    def __init__(self, spec: NodeSpec, S: int, kernel: Sequence[int] | None):
        self.S = S
        self.kernel = list(kernel) if kernel is not None else None
        self.strides = list(spec.attr("strides", [1] * S))
        self.dilations = list(spec.attr("dilations", [1] * S))
        self.auto_pad = spec.attr("auto_pad", "NOTSET")
        self.ceil = bool(spec.attr("ceil_mode", 0))
        self.pads = list(spec.attr("pads", [0] * (2 * S)))
        if self.auto_pad == "VALID":
            self.pads = [0] * (2 * S)
        self.static = self.auto_pad in ("NOTSET", "VALID") and not self.ceil

    def resolve(self, spatial: Sequence[int], kernel: Sequence[int] | None = None, ceil: bool | None = None
                ) -> list[int]:
        """Explicit pads [b.., e..] for these input lengths, in floor mode (``ceil``: the ceil-mode extra end pad,
        default the node's ceil_mode)."""
        k, S = list(kernel or self.kernel), self.S
        pads = list(self.pads)
        if self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            sp = [same_pads(spatial[a], k[a], self.strides[a], self.dilations[a], self.auto_pad == "SAME_UPPER")
                  for a in range(S)]
            pads = [p[0] for p in sp] + [p[1] for p in sp]
        if self.ceil if ceil is None else ceil:
            ends = []
            for a in range(S):
                n = output_length(spatial[a], k[a], self.strides[a], pads[a], pads[S + a], self.dilations[a], True)
                ends.append(floor_mode_end_pad(spatial[a], k[a], self.strides[a], pads[a], pads[S + a],
                                               self.dilations[a], n))
            pads = pads[:S] + ends
        return pads


def symmetric(pads: Sequence[int], S: int) -> bool:
    return all(pads[a] == pads[S + a] for a in range(S))
