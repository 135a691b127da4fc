"""Weight mapping between B per-model tensors and one fused tensor, and the ``array.json`` that records it.

Every fused weight is *model-major*: model b's block is the slice ``[b*L, (b+1)*L)`` of axis 0. A per-model tensor
w (original shape S) is placed as

    block_b = reshape(transpose(w, perm), block_shape)      # block_shape[0] == L
    fused   = concatenate([block_0, ..., block_(B-1)], axis=0)

and recovered exactly by the inverse (slice, reshape, inverse transpose): only data movement, so the round trip is
bit-identical. Because blocks are contiguous, the optimizer can view any fused weight as ``[B, -1]`` and apply
per-model coefficients ``[B, 1]``.

One set of B tensors read in two slots (a tied weight, e.g. an embedding table [V, D] that is also the output
projection) is packed once; the other slot is computed from it by :func:`relayout` (Reshape, Transpose, Reshape),
again only data movement.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Sequence

import numpy as np
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator)

from onnxfuse.core.errors import InputFileError
from onnxfuse.core.records import read_record

__all__ = ["WeightSlot", "FusedWeight", "ArraySpec", "pack_weights", "unpack_weight", "relayout", "ARRAY_FORMAT",
           "MISSING"]

ARRAY_FORMAT = "onnxfuse-array/1"
MISSING = "missing"  # the extra_state kind of a key the array holds no value for (split refuses it)


@dataclass(frozen=True)
class WeightSlot:
    """How one original tensor is laid out as one model's block of a fused weight."""

    perm: tuple[int, ...] | None  # transpose applied to the original tensor first (None: identity)
    block_shape: tuple[int, ...]  # shape of the model's block after the transpose; block_shape[0] = L

    def to_block(self, w: np.ndarray) -> np.ndarray:
        t = np.transpose(w, self.perm) if self.perm is not None else w
        return np.reshape(t, self.block_shape)

    def from_block(self, block, orig_shape: Sequence[int]):
        """The original tensor from its block: a numpy array, or a torch tensor (a view where torch can give one),
        by the methods both have."""
        if self.perm is None:
            return block.reshape(tuple(orig_shape))
        inverse = tuple(int(k) for k in np.argsort(self.perm))
        t = block.reshape(tuple(self.transposed_shape(orig_shape)))
        return t.permute(inverse) if hasattr(t, "permute") else t.transpose(inverse)

    def transposed_shape(self, orig_shape: Sequence[int]) -> list[int]:
        """The original shape after ``perm`` (what the block is a reshape of)."""
        return list(orig_shape) if self.perm is None else [int(orig_shape[p]) for p in self.perm]


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


def unpack_weight(fw: FusedWeight, fused, b: int):
    """Model b's original tensor from the fused one (exact inverse of :func:`pack_weights`), contiguous: a numpy
    array from a numpy array, a torch tensor of its own on the same device from a torch tensor."""
    t = fw.slot.from_block(fw.block(fused, b), fw.orig_shape)
    return t.clone().contiguous() if hasattr(t, "clone") else np.ascontiguousarray(t)


def relayout(src: WeightSlot, dst: WeightSlot, orig_shape: Sequence[int], B: int) -> list[tuple[str, list[int]]]:
    """The steps that turn B tensors packed in slot ``src`` into the same tensors packed in slot ``dst``:
    ``[(op, arg), ...]`` with op "Reshape" (arg: the new shape) or "Transpose" (arg: perm); a step that would change
    nothing is left out (the same slot: no steps).

        fused_src [B*L1, ...]  --Reshape-->    [B, *T1]   model b's transposed tensor, T1 = orig_shape[src.perm]
                               --Transpose-->  [B, *T2]   perm [0, 1 + q...]: axis k of T2 is original axis
                                                          dst.perm[k], which sits at q[k] = src.perm^-1[dst.perm[k]]
                               --Reshape-->    [B*L2, *dst.block_shape[1:]] = fused_dst

    Model b's block stays block b throughout (axis 0 is only ever split into [B, ...] and merged back), so
    ``apply(relayout(s1, s2), pack_weights(s1, ws)) == pack_weights(s2, ws)`` bit for bit.
    """
    n = len(orig_shape)
    identity = list(range(n))
    inv_src = np.argsort(src.perm if src.perm is not None else identity)
    q = [int(inv_src[p]) for p in (dst.perm if dst.perm is not None else identity)]
    steps: list[tuple[str, list[int]]] = []
    shape = [B * src.block_shape[0], *src.block_shape[1:]]
    if q != identity:
        per_model = [B, *src.transposed_shape(orig_shape)]
        if per_model != shape:
            steps.append(("Reshape", per_model))
        steps.append(("Transpose", [0] + [1 + k for k in q]))
        shape = [B, *dst.transposed_shape(orig_shape)]
    target = [B * dst.block_shape[0], *dst.block_shape[1:]]
    if target != shape:
        steps.append(("Reshape", target))
    return steps


@dataclass
class ArraySpec:
    """Everything ``array.json`` records about a fused array."""

    B: int
    sources: list[str]
    inputs: list[dict]  # {"name", "shape", "dtype"} of the original inputs (shared by all models)
    outputs: list[dict]  # original outputs; the fused ones gain a leading model axis
    weights: dict[str, FusedWeight]
    # per model: state_dict entries that are not graph initializers, by key: {"kind": "alias", "of": key} (the
    # same tensor as another key: tied weights), or a value with kind "bn_counter" or "constant"
    extra_state: list[dict]
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
        record = self.to_json()
        ArrayRecord.model_validate(record)  # what load reads back: a record that does not validate is a bug here
        with open(path, "w") as f:
            json.dump(record, f, indent=1)

    # what the array's state files must hold: {name: (shape, dtype)}, checked when they are read
    def fused_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every fused weight (parameters and buffers): what a state folder's weights.safetensors holds."""
        return {n: (tuple(fw.fused_shape), fw.dtype) for n, fw in self.weights.items()}

    def parameter_names(self) -> tuple[list[str], list[str]]:
        """(trainable parameters, buffers) by fused name, in the spec's order, which every runtime keeps: role
        "param" is trained; "buffer" (BatchNorm's running statistics) and "frozen" are state, not trained."""
        trainable = [n for n, fw in self.weights.items() if fw.role == "param"]
        return trainable, [n for n, fw in self.weights.items() if fw.role != "param"]

    def optimizer_shape(self) -> tuple[int, int]:
        """``(B, P)``: every optimizer state buffer is one float32 row of P numbers per model, P = the trainable
        numbers of one model (``onnxfuse/recipe/optim.py``)."""
        P = sum(int(np.prod(self.weights[n].fused_shape)) for n in self.parameter_names()[0]) // self.B
        return self.B, P

    def model_tensors(self, b: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Model b's state_dict entries (``split``'s output, a dropped model's saved state)."""
        out = {fw.sources[b]: (tuple(fw.orig_shape), fw.dtype) for fw in self.weights.values()}
        aliases = {}
        for key, e in self.extra_state[b].items():
            if e.get("kind") == "alias":
                aliases[key] = e["of"]
            else:
                out[key] = (tuple(e["shape"]), str(np.dtype(e["dtype"])))
        out.update({key: out[of] for key, of in aliases.items() if of in out})
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ArraySpec":
        """The array ``array.json`` at ``path`` describes, checked (:class:`ArrayRecord`): a file that is not one
        is an InputFileError naming it and what is wrong."""
        path = os.fspath(path)
        try:
            d = read_record(path, ArrayRecord, "re-run `onnxfuse fuse`")
        except FileNotFoundError:
            raise InputFileError(f"'{path}' does not exist; create the array with `onnxfuse fuse`") from None
        return cls(
            B=d["B"],
            sources=[m["source"] for m in d["models"]],
            inputs=d["inputs"],
            outputs=d["outputs"],
            weights={n: FusedWeight.from_json(n, w) for n, w in d["fused_weights"].items()},
            extra_state=[m["extra_state"] for m in d["models"]],
            summary=d["summary"],
        )


# ---------------------------------------------------------------------------------------------- array.json
# What ``ArraySpec.to_json`` writes and ``ArraySpec.load`` reads, checked both ways (pydantic v2): every count and
# shape, the layout of each fused weight against its original shape, one entry per model everywhere.
class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")  # keys a newer onnxfuse adds are kept


def _dtype(name: str) -> str:
    try:
        np.dtype(name)
    except TypeError:
        raise ValueError(f"{name!r} is not a numpy dtype") from None
    return name


Dim = Annotated[StrictInt, Field(ge=0)]
DType = Annotated[StrictStr, AfterValidator(_dtype)]


class _Slot(_Part):
    perm: list[Dim] | None
    block_shape: Annotated[list[Annotated[StrictInt, Field(ge=1)]], Field(min_length=1)]


class _FusedWeightRecord(_Part):
    slot: _Slot
    orig_shape: list[Dim]
    dtype: StrictStr  # checked against each state file's tensors (a dtype numpy may not name: bfloat16)
    role: Literal["param", "buffer", "frozen"]
    sources: list[StrictStr]
    extra: dict[str, Any] = {}

    @model_validator(mode="after")
    def _layout(self) -> "_FusedWeightRecord":
        n = len(self.orig_shape)
        if self.slot.perm is not None and sorted(self.slot.perm) != list(range(n)):
            raise ValueError(f"slot.perm {self.slot.perm} is not a permutation of the {n} axes of orig_shape")
        if math.prod(self.slot.block_shape) != math.prod(self.orig_shape):
            raise ValueError(f"slot.block_shape {self.slot.block_shape} does not hold orig_shape {self.orig_shape}")
        return self


class _Alias(_Part):
    kind: Literal["alias"]
    of: StrictStr
    transposed: StrictBool = False  # the 2-D tensor ``of`` holds transposed (an exporter's folded W^T)


class _Missing(_Part):
    """A key the array holds no value for (the file held none and the forward never reads it): split refuses it
    unless told to leave it out."""

    kind: Literal["missing"]
    dtype: DType
    shape: list[Dim]
    why: StrictStr = ""


class _Value(_Part):
    kind: Literal["bn_counter", "constant"] = "constant"
    dtype: DType
    shape: list[Dim]
    value: list[Any]

    @model_validator(mode="after")
    def _size(self) -> "_Value":
        if len(self.value) != math.prod(self.shape):
            raise ValueError(f"value has {len(self.value)} numbers, not the {math.prod(self.shape)} of shape "
                             f"{self.shape}")
        return self


def _extra_entry(v: Any) -> Any:
    if isinstance(v, dict) and v.get("kind") == "alias":
        return _Alias.model_validate(v).model_dump(exclude_defaults=True)
    if isinstance(v, dict) and v.get("kind") == MISSING:
        return _Missing.model_validate(v).model_dump()
    return _Value.model_validate(v).model_dump()


class _TensorInfo(_Part):
    name: StrictStr
    shape: list[StrictInt | StrictStr | None] | None  # a dim: static, symbolic (its name) or unknown
    dtype: StrictStr
    per_model: StrictBool = False


class _ModelRecord(_Part):
    index: Dim
    source: StrictStr
    extra_state: dict[str, Annotated[Any, AfterValidator(_extra_entry)]] = {}


class ArrayRecord(_Part):
    """``array.json``: the format, B, the original inputs and outputs, each fused weight and its layout, and per
    model its label and extra state."""

    format: Literal[ARRAY_FORMAT]
    B: Annotated[StrictInt, Field(ge=1)]
    inputs: list[_TensorInfo]
    outputs: list[_TensorInfo]
    fused_weights: dict[str, _FusedWeightRecord]
    models: list[_ModelRecord]
    summary: dict[str, Any] = {}

    @model_validator(mode="after")
    def _one_per_model(self) -> "ArrayRecord":
        if len(self.models) != self.B:
            raise ValueError(f"B is {self.B} but models lists {len(self.models)}")
        for b, m in enumerate(self.models):
            if m.index != b:
                raise ValueError(f"models[{b}] has index {m.index}")
        for name, fw in self.fused_weights.items():
            if len(fw.sources) != self.B:
                raise ValueError(f"fused weight {name!r} has {len(fw.sources)} sources, not one per model ({self.B})")
        return self

