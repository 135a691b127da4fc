"""Split a fused array back into B ordinary models: ``model_{b}.onnx`` (inference-ready, the original graph with
its trained weights) and ``model_{b}.safetensors`` (the original state_dict keys, loadable with
``load_state_dict(strict=True)``)."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
from onnx import numpy_helper

from ._io import atomic_dir
from .errors import InputFileError
from .weights import ArraySpec, unpack_weight

__all__ = ["to_inference", "load_fused_weights", "split_weights", "final_states", "split_array", "TRAINED_DIR"]

TRAINED_DIR = "trained"


def to_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """BatchNorm on running statistics (one output) and Dropout off, in place; returns the model."""
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            for a in node.attribute:
                if a.name == "training_mode":
                    a.i = 0
            del node.output[1:]
        elif node.op_type == "Dropout" and len(node.input) > 2:
            node.input[2] = ""
    return model


def load_fused_weights(array_dir: str) -> tuple[dict[str, np.ndarray], dict]:
    """Trained fused weights if the array was trained, else the initial ones from fused.onnx; plus train state."""
    trained = os.path.join(array_dir, TRAINED_DIR)
    wfile, sfile = os.path.join(trained, "weights.safetensors"), os.path.join(trained, "train_state.json")
    if os.path.exists(wfile):
        from safetensors.numpy import load_file

        with open(sfile) as f:
            return load_file(wfile), json.load(f)
    fused = os.path.join(array_dir, "fused.onnx")
    if not os.path.exists(fused):
        raise InputFileError(f"'{array_dir}' has no fused.onnx; create the array with `onnxfuse fuse`")
    try:
        model = onnx.load(fused)
    except Exception as e:
        raise InputFileError(f"'{fused}' is not a readable ONNX model; re-run `onnxfuse fuse`") from e
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}, {"steps": 0}


def split_weights(spec: ArraySpec, fused: dict[str, np.ndarray], steps: int = 0) -> list[dict[str, np.ndarray]]:
    """Per-model {state_dict key: tensor}: every key the exporter recorded, so that torch's
    ``load_state_dict(strict=True)`` accepts it.

    Fused weights are unpacked (one entry per tensor, however many nodes read it). The entries of
    ``spec.extra_state`` are state that is not a graph initializer: ``alias`` of another key (tied weights: the
    trained value of the key it aliases, copied), ``bn_counter`` (BatchNorm's num_batches_tracked, advanced by the
    number of training steps, as torch does once per training forward) and ``constant`` (its value at export time).
    Arrays made before aliases were recorded carry tied weights as constants (their export-time value)."""
    out = []
    for b in range(spec.B):
        state = {fw.sources[b]: unpack_weight(fw, fused[fw.name], b) for fw in spec.weights.values()}
        aliases = {}
        for key, e in spec.extra_state[b].items():
            if e.get("kind") == "alias":
                aliases[key] = e["of"]
                continue
            value = np.array(e["value"], dtype=e["dtype"]).reshape(e["shape"])
            if e.get("kind") == "bn_counter":
                value = np.asarray(value + steps, dtype=e["dtype"])
            state[key] = value
        for key, of in aliases.items():
            if of not in state:
                raise InputFileError(f"{spec.sources[b]}: state_dict entry '{key}' is an alias of '{of}', which the "
                                     "array does not hold; re-export the model and re-run `onnxfuse fuse`")
            state[key] = state[of].copy()
        out.append(state)
    return out


def final_states(array_dir: str, spec: ArraySpec) -> list[dict[str, np.ndarray]]:
    """Every original model's state_dict after training (or as fused when untrained). A run that shrank the
    array (successive halving) stored the surviving array (``trained/array.json``) and each dropped model's state
    at the step it was dropped (``trained/dropped/model_<b>.safetensors``)."""
    from safetensors.numpy import load_file

    fused, train_state = load_fused_weights(array_dir)
    trained = os.path.join(array_dir, TRAINED_DIR)
    current = spec
    if os.path.exists(os.path.join(trained, "array.json")):
        current = ArraySpec.load(os.path.join(trained, "array.json"))
    missing = [n for n in current.weights if n not in fused]
    if missing:
        raise InputFileError(f"'{array_dir}': fused weight '{missing[0]}' is missing from the stored weights; "
                             "re-run `onnxfuse fuse` or `onnxfuse train`")
    models = train_state.get("models", list(range(current.B)))
    states: list = [None] * spec.B
    for b, state in zip(models, split_weights(current, fused, int(train_state.get("steps", 0)))):
        states[b] = state
    for b in range(spec.B):
        if states[b] is None:
            path = os.path.join(trained, "dropped", f"model_{b}.safetensors")
            if not os.path.exists(path):
                raise InputFileError(f"'{path}' is missing: model {b} was dropped but its state was not saved")
            states[b] = load_file(path)
    return states


def split_array(array_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> list[str]:
    """Write model_{b}.onnx and model_{b}.safetensors for every model of the array; returns the ONNX paths."""
    from safetensors.numpy import save_file

    array_dir, out_dir = os.fspath(array_dir), os.fspath(out_dir)
    if not os.path.isdir(array_dir):
        raise InputFileError(f"array folder '{array_dir}' does not exist; create it with `onnxfuse fuse`")
    spec = ArraySpec.load(os.path.join(array_dir, "array.json"))
    per_model = final_states(array_dir, spec)
    sources = []
    for b in range(spec.B):
        path = os.path.join(array_dir, "sources", f"model_{b}.onnx")
        if not os.path.exists(path):
            raise InputFileError(f"'{path}' is missing; re-run `onnxfuse fuse`")
        sources.append(onnx.load(path))
    paths = []
    with atomic_dir(out_dir, overwrite) as tmp:
        for b, (src, state) in enumerate(zip(sources, per_model)):
            graph_names = {i for n in src.graph.node for i in n.input}
            src.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in state.items() if k in graph_names)
            onnx.save(to_inference(src), os.path.join(tmp, f"model_{b}.onnx"))
            save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, os.path.join(tmp, f"model_{b}.safetensors"))
            paths.append(os.path.join(out_dir, f"model_{b}.onnx"))
    return paths
