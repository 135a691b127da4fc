"""Loading one source model: the graph, its shapes, and which initializers are per-model weights."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import InputFileError

__all__ = ["SourceModel", "load_source", "METADATA_KEY", "FLOAT_TYPES", "tensor_shape", "np_dtype"]

# The exporter writes a JSON document under this metadata key: which initializers are trainable parameters,
# which are buffers, and the state_dict entries that are not in the graph (e.g. num_batches_tracked).
METADATA_KEY = "onnxfuse"

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def tensor_shape(type_proto: onnx.TypeProto) -> list | None:
    """Dims of a tensor type: int for static, str for symbolic, None for unknown; None if the rank is unknown."""
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    dims = []
    for d in type_proto.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def np_dtype(elem_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


@dataclass
class SourceModel:
    label: str
    model: onnx.ModelProto
    opset: int
    initializers: dict[str, onnx.TensorProto]
    inputs: list[onnx.ValueInfoProto]
    outputs: list[onnx.ValueInfoProto]
    shapes: dict[str, list]
    dtypes: dict[str, int]
    meta: dict
    weight_names: set[str] = field(default_factory=set)
    _arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def nodes(self) -> list[onnx.NodeProto]:
        return list(self.model.graph.node)

    def array(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self.initializers[name])
        return self._arrays[name]

    @property
    def trainable(self) -> set[str] | None:
        """Names the exporter marked trainable, or None when the file carries no onnxfuse metadata."""
        t = self.meta.get("trainable")
        return None if t is None else set(t)


def _read_model(path: str) -> onnx.ModelProto:
    if not os.path.exists(path):
        raise InputFileError(f"model file '{path}' does not exist")
    if os.path.isdir(path):
        raise InputFileError(f"'{path}' is a folder, not an ONNX model file")
    try:
        return onnx.load(path)
    except Exception as e:  # protobuf raises DecodeError, RuntimeWarning, ...
        raise InputFileError(f"'{path}' is not a readable ONNX model ({type(e).__name__}); re-export it") from e


def load_source(model: str | os.PathLike | onnx.ModelProto, label: str | None = None) -> SourceModel:
    """Load, check and shape-infer one model. ``label`` names it in error messages (default: file name)."""
    if isinstance(model, onnx.ModelProto):
        proto, label = model, label or "model"
    else:
        path = os.fspath(model)
        proto, label = _read_model(path), label or os.path.basename(path)
    try:
        onnx.checker.check_model(proto)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputFileError(f"{label}: not a valid ONNX model: {first}") from e
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < 13:
        raise InputFileError(f"{label}: ONNX opset {opset} is too old; export with opset_version between 13 and 20")
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception as e:
        raise InputFileError(f"{label}: ONNX shape inference failed ({str(e).splitlines()[0]})") from e
    g = inferred.graph
    inits = {t.name: t for t in proto.graph.initializer}
    shapes: dict[str, list] = {}
    dtypes: dict[str, int] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        s = tensor_shape(vi.type)
        if s is not None:
            shapes[vi.name] = s
        if vi.type.HasField("tensor_type"):
            dtypes[vi.name] = vi.type.tensor_type.elem_type
    for t in proto.graph.initializer:
        shapes[t.name] = [int(d) for d in t.dims]
        dtypes[t.name] = t.data_type
    meta = {}
    for p in proto.metadata_props:
        if p.key == METADATA_KEY:
            try:
                meta = json.loads(p.value)
            except json.JSONDecodeError as e:
                raise InputFileError(f"{label}: metadata '{METADATA_KEY}' is not valid JSON") from e
    if "trainable" in meta or "buffers" in meta:
        weights = (set(meta.get("trainable", [])) | set(meta.get("buffers", []))) & set(inits)
    else:
        weights = {n for n, t in inits.items() if t.data_type in FLOAT_TYPES}
    return SourceModel(
        label=label,
        model=proto,
        opset=opset,
        initializers=inits,
        inputs=[i for i in proto.graph.input if i.name not in inits],
        outputs=list(proto.graph.output),
        shapes=shapes,
        dtypes=dtypes,
        meta=meta,
        weight_names=weights,
    )
