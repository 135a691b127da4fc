"""Weight mapping between B per-model tensors and one fused tensor, and the ``array.json`` that records it.

Every fused weight is *model-major*: model b's block is the slice ``[b*L, (b+1)*L)`` of axis 0. A per-model tensor
w (original shape S) is placed as

    block_b = reshape(transpose(w, perm), block_shape)      # block_shape[0] == L
    fused   = concatenate([block_0, ..., block_(B-1)], axis=0)

and recovered exactly by the inverse (slice, reshape, inverse transpose): only data movement, so the round trip is
bit-identical. Because blocks are contiguous, the optimizer can view any fused weight as ``[B, -1]`` and apply
per-model coefficients ``[B, 1]``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .errors import InputFileError

__all__ = ["WeightSlot", "FusedWeight", "ArraySpec", "pack_weights", "unpack_weight", "ARRAY_FORMAT"]

ARRAY_FORMAT = "onnxfuse-array/1"


@dataclass(frozen=True)
class WeightSlot:
    """How one original tensor is laid out as one model's block of a fused weight."""

    perm: tuple[int, ...] | None  # transpose applied to the original tensor first (None: identity)
    block_shape: tuple[int, ...]  # shape of the model's block after the transpose; block_shape[0] = L

    def to_block(self, w: np.ndarray) -> np.ndarray:
        t = np.transpose(w, self.perm) if self.perm is not None else w
        return np.reshape(t, self.block_shape)

    def from_block(self, block: np.ndarray, orig_shape: Sequence[int]) -> np.ndarray:
        if self.perm is None:
            return np.reshape(block, orig_shape)
        transposed_shape = [orig_shape[p] for p in self.perm]
        return np.transpose(np.reshape(block, transposed_shape), np.argsort(self.perm))


@dataclass
class FusedWeight:
    """One fused initializer and where each model's original tensor lives in it."""

    name: str
    slot: WeightSlot
    orig_shape: tuple[int, ...]
    dtype: str
    role: str  # "param" (trainable), "buffer" (e.g. BatchNorm running statistics) or "frozen"
    sources: list[str]  # sources[b]: model b's original initializer name
    extra: dict = field(default_factory=dict)  # rule-specific notes, e.g. {"stat": "running_var"}

    @property
    def block_len(self) -> int:
        return self.slot.block_shape[0]

    @property
    def fused_shape(self) -> list[int]:
        return [self.slot.block_shape[0] * len(self.sources), *self.slot.block_shape[1:]]

    def block(self, fused: np.ndarray, b: int) -> np.ndarray:
        L = self.block_len
        return fused[b * L : (b + 1) * L]

    def to_json(self) -> dict:
        return {
            "slot": {"perm": list(self.slot.perm) if self.slot.perm is not None else None,
                     "block_shape": list(self.slot.block_shape)},
            "orig_shape": list(self.orig_shape),
            "dtype": self.dtype,
            "role": self.role,
            "sources": self.sources,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, name: str, d: dict) -> "FusedWeight":
        s = d["slot"]
        return cls(
            name=name,
            slot=WeightSlot(tuple(s["perm"]) if s["perm"] is not None else None, tuple(s["block_shape"])),
            orig_shape=tuple(d["orig_shape"]),
            dtype=d["dtype"],
            role=d["role"],
            sources=list(d["sources"]),
            extra=dict(d.get("extra", {})),
        )


def pack_weights(slot: WeightSlot, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Model-major fused tensor from the B per-model tensors."""
    return np.ascontiguousarray(np.concatenate([slot.to_block(w) for w in arrays], axis=0))


def unpack_weight(fw: FusedWeight, fused: np.ndarray, b: int) -> np.ndarray:
    """Model b's original tensor from the fused one (exact inverse of :func:`pack_weights`)."""
    return np.ascontiguousarray(fw.slot.from_block(fw.block(fused, b), fw.orig_shape))


@dataclass
class ArraySpec:
    """Everything ``array.json`` records about a fused array."""

    B: int
    sources: list[str]
    inputs: list[dict]  # {"name", "shape", "dtype"} of the original inputs (shared by all models)
    outputs: list[dict]  # original outputs; the fused ones gain a leading model axis
    weights: dict[str, FusedWeight]
    extra_state: list[dict]  # per model: state_dict entries that are not in the graph
    summary: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        per_model = []
        for b in range(self.B):
            entries = {}
            for fw in self.weights.values():
                entries[fw.sources[b]] = {
                    "fused": fw.name,
                    "axis": 0,
                    "offset": b * fw.block_len,
                    "length": fw.block_len,
                    "transpose": list(fw.slot.perm) if fw.slot.perm is not None else None,
                    "block_shape": list(fw.slot.block_shape),
                }
            per_model.append({"index": b, "source": self.sources[b], "weights": entries,
                              "extra_state": self.extra_state[b]})
        return {
            "format": ARRAY_FORMAT,
            "B": self.B,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "fused_weights": {n: fw.to_json() for n, fw in self.weights.items()},
            "models": per_model,
            "summary": self.summary,
        }

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ArraySpec":
        path = os.fspath(path)
        if not os.path.exists(path):
            raise InputFileError(f"'{path}' does not exist; create the array with `onnxfuse fuse`")
        try:
            with open(path) as f:
                d = json.load(f)
            if d.get("format") != ARRAY_FORMAT:
                raise ValueError(f"format {d.get('format')!r}")
            return cls(
                B=int(d["B"]),
                sources=[m["source"] for m in d["models"]],
                inputs=d["inputs"],
                outputs=d["outputs"],
                weights={n: FusedWeight.from_json(n, w) for n, w in d["fused_weights"].items()},
                extra_state=[m.get("extra_state", {}) for m in d["models"]],
                summary=d.get("summary", {}),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise InputFileError(f"'{path}' is not an onnxfuse array description ({e}); re-run `onnxfuse fuse`") from e

