"""Split a fused array back into B ordinary models: ``model_{b}.onnx`` (inference-ready, the original graph with
its trained weights) and ``model_{b}.safetensors`` (the original state_dict keys, loadable with
``load_state_dict(strict=True)``).

The weights are the array's trained ones, of the folder's current run (``ArrayDir.trained``): each model's final
state, or its best one by the run's ``--keep-best`` metric (``which="best"``); an array without them (never
trained, or its run did not finish) is refused unless the initial weights are asked for (``initial``). Every file
written says in its metadata which state it holds, from which step (and, for a best state, by which metric and
value)."""
from __future__ import annotations

import json
import logging
import os
from typing import Collection, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from onnxfuse.core._graph import cleanup_pass
from onnxfuse.core._io import atomic_dir
from onnxfuse.core._opset import is_training_batchnorm, onnx_opset
from onnxfuse.core.array import ArrayDir, check_output_location, model_file, model_weights_file
from onnxfuse.core.errors import ConfigError, InputFileError
from onnxfuse.core.source import METADATA_KEY
from onnxfuse.core.weights import MISSING, ArraySpec, unpack_weight

__all__ = ["to_inference", "split_weights", "with_extra_state", "missing_keys", "check_missing", "model_steps",
           "final_states", "split_states", "split_array", "check_like", "WHICH"]

log = logging.getLogger("onnxfuse")
WHICH = ("final", "best")  # the states of a trained model split writes (--which); "initial" is --initial's


def to_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """BatchNorm on running statistics (one output) and Dropout off, in place; returns the model."""
    opset = onnx_opset(model)
    for node in model.graph.node:
        if is_training_batchnorm(node, opset):
            for a in node.attribute:
                if a.name == "training_mode":
                    a.i = 0
            del node.output[1:]
        elif node.op_type == "Dropout" and len(node.input) > 2:
            node.input[2] = ""
    return model


def model_steps(status: dict | None, steps: int) -> int:
    """The optimizer steps a model took when the array took ``steps``: a model that diverged at step t kept the
    state of step t - 1 (its step t was rejected); ``status`` is its entry in a run's status (None: trained on)."""
    status = status or {}
    diverged = status.get("step") if status.get("status") == "diverged" else status.get("diverged")
    return steps if diverged is None else min(steps, int(diverged) - 1)


def split_weights(spec: ArraySpec, fused: dict[str, np.ndarray], steps: int | Sequence[int] = 0,
                  like: dict | None = None, models: Sequence[int] | None = None) -> list[dict[str, np.ndarray]]:
    """Per-model {state_dict key: tensor}: every key the exporter recorded, so that torch's
    ``load_state_dict(strict=True)`` accepts it. ``steps``: the optimizer steps taken, one for all models or one
    per model (``model_steps``).

    Fused weights are unpacked (one entry per tensor, however many nodes read it). The entries of
    ``spec.extra_state`` are state that is not a graph initializer: ``alias`` of another key (tied weights: the
    trained value of the key it aliases, copied; ``transposed``: of a 2-D initializer that holds it transposed),
    ``bn_counter`` (BatchNorm's num_batches_tracked, advanced by the number of training steps, as torch does once
    per training forward), ``constant`` (its value at export time) and ``missing`` (no value: left out;
    :func:`check_missing` refuses it first). Arrays made before aliases were recorded carry tied weights as
    constants (their export-time value). ``fused`` may hold torch tensors: the unpacked weights are then torch
    tensors too (the extra state stays numpy). ``like``: extra state of the same kinds, for the keys the array does
    not know under the module's names (a graph from a plain export holds no record of them):
    :func:`onnxfuse.exporters.state_map.split_plan`.
    ``models``: only these models' (positions in the array), in that order."""
    per_model = list(steps) if isinstance(steps, (list, tuple)) else [steps] * spec.B
    out = []
    for b in range(spec.B) if models is None else models:
        state = {fw.sources[b]: unpack_weight(fw, fused[fw.name], b) for fw in spec.weights.values()}
        out.append(with_extra_state(state, {**(like or {}), **spec.extra_state[b]}, per_model[b], spec.sources[b]))
    return out


def with_extra_state(state: dict, extra: dict, steps: int, source: str) -> dict:
    """``state`` with the entries of ``extra`` it lacks (see :func:`split_weights`) for a model that took
    ``steps`` optimizer steps; ``source`` names the model in messages."""
    state = dict(state)
    aliases = {}
    for key, e in extra.items():
        if key in state:
            continue
        if e.get("kind") == "alias":
            aliases[key] = (e["of"], e.get("transposed", False))
            continue
        if e.get("kind") == MISSING:  # no value: split_array refuses it, or leaves it out when told to
            continue
        value = np.array(e["value"], dtype=e["dtype"]).reshape(e["shape"])
        if e.get("kind") == "bn_counter":
            value = np.asarray(value + steps, dtype=e["dtype"])
        state[key] = value
    for key, (of, transposed) in aliases.items():
        if of not in state:
            raise InputFileError(f"{source}: state_dict entry '{key}' is an alias of '{of}', which the array does not "
                                 "hold; re-export the model and re-run `onnxfuse fuse`")
        value = state[of].T if transposed else state[of]
        state[key] = value.clone() if hasattr(value, "clone") else np.ascontiguousarray(value).copy()
    return state


def missing_keys(spec: ArraySpec, like: dict | None = None) -> list[str]:
    """The state_dict keys the array holds no value for (extra state of kind ``missing``), sorted."""
    extra = {**(like or {}), **spec.extra_state[0]}
    return sorted(k for k, e in extra.items() if e.get("kind") == MISSING)


def check_missing(spec: ArraySpec, like: dict | None, allow_missing: bool) -> None:
    """One ConfigError for an array whose models lack values for some of their keys, unless ``allow_missing``."""
    missing = missing_keys(spec, like)
    if missing and not allow_missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ConfigError(f"the array holds no value for {len(missing)} key(s) of the models' state_dicts: {shown} "
                          "(its files held none, and the forward never reads them), so load_state_dict(strict=True) "
                          "would fail; pass allow_missing=True to write the split without them, "
                          "and load it with strict=False")


def final_states(array_dir: str | os.PathLike, spec: ArraySpec, initial: bool = False, like: dict | None = None
                 ) -> list[dict[str, np.ndarray]]:
    """Every original model's state_dict after the current run (``initial``: as fused), from what
    :meth:`ArrayDir.trained` gives. A run that shrank the array (successive halving) stored the surviving array
    and each dropped model's state at the step it was dropped. A diverged model's ``num_batches_tracked`` stopped
    with it."""
    which = "initial" if initial else "final"
    return [state for state, _ in split_states(array_dir, spec, which, like)]


def split_states(array_dir: str | os.PathLike, spec: ArraySpec, which: str = "final", like: dict | None = None
                 ) -> list[tuple[dict[str, np.ndarray], dict[str, str]]]:
    """Every original model's state_dict, ``which`` one: ``final`` (after the current run, see
    :func:`final_states`), ``best`` (its best state by the run's ``--keep-best`` metric; a model that had no
    finite value of it gets its final state) or ``initial`` (as fused); each with what it is, the metadata
    :func:`split_array` writes into its files (``onnxfuse.state``: best, final or initial; ``onnxfuse.step``,
    ``onnxfuse.run``; for a best state ``onnxfuse.metric`` and ``onnxfuse.value``)."""
    if which not in WHICH + ("initial",):
        raise ConfigError(f"which={which!r}: split writes the {' or the '.join(WHICH)} state of each model")
    array = ArrayDir(array_dir)
    trained = array.trained(which == "initial")
    if which == "best" and trained.best is None:
        raise ConfigError(f"'{array.path}' kept no best states (run {trained.run or '?'} had no eval data or "
                          "keep_best='off'); train with eval data, eval_data= or eval_fraction=, to keep them, or "
                          "split its final states, which='final'")
    current = trained.spec or spec
    missing = [n for n in current.weights if n not in trained.weights]
    if missing:
        raise InputFileError(f"'{array.path}': fused weight '{missing[0]}' is missing from the stored weights; "
                             "re-run `onnxfuse fuse` or `onnxfuse train`")
    models = trained.models if trained.models is not None else list(range(current.B))
    steps = {b: model_steps(trained.status.get(str(b)), trained.steps) for b in models}
    states: list = [None] * spec.B
    for b, state in zip(models, split_weights(current, trained.weights, [steps[b] for b in models], like)):
        states[b] = state
    for b in range(spec.B):
        if states[b] is None:
            states[b] = array.dropped_state(b, f"model {b} was dropped and its state is lost: train the array "
                                               "again, or pass --initial to split the initial weights")
            st = trained.status[str(b)]
            steps[b] = model_steps(st, st["step"])  # dropped at that step (frozen before it, if it diverged)
    if which == "initial":
        return [(state, {"onnxfuse.state": "initial"}) for state in states]
    run = {"onnxfuse.run": trained.run} if trained.run else {}
    out = [(state, {"onnxfuse.state": "final", "onnxfuse.step": str(steps[b]), **run})
           for b, state in enumerate(states)]
    if which == "best":
        kept, fix = trained.best, "train the array again (or resume its run), or split its final states"
        for b, entry in kept["models"].items():
            b = int(b)
            state = array.best_state(b, entry["file"], fix)
            out[b] = (with_extra_state(state, like or {}, entry["steps"], spec.sources[b]),
                      {"onnxfuse.state": "best", "onnxfuse.step": str(entry["step"]), "onnxfuse.metric": kept["metric"],
                       "onnxfuse.value": repr(entry["value"]), **run})
        lacking = [b for b in range(spec.B) if str(b) not in kept["models"]]
        if lacking:
            log.warning("model(s) %s had no finite %s at any evaluation: their final states are written (and say "
                        "so in their files' metadata)", lacking, kept["metric"])
    return out


def split_array(array_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False,
                initial: bool = False, like: dict | None = None, which: str = "final",
                keys: Collection[str] | None = None, allow_missing: bool = False) -> list[str]:
    """Write model_{b}.onnx and model_{b}.safetensors for every model of the array; returns the ONNX paths.

    The weights are the current run's trained ones (an array without them is refused): each model's final state,
    or with ``which="best"`` its best one by the run's ``--keep-best`` metric; ``initial``: the weights the array
    was fused with. Each file's metadata says which state it holds (see :func:`split_states`). ``like``: the keys a
    plain export's graph holds under other names or cannot hold, as found in the source module (``split --like
    MODULE:FACTORY``: :func:`onnxfuse.exporters.state_map.split_plan`); ``keys``: the keys each state_dict file
    holds (default: all). A key the array has no value for is refused unless ``allow_missing``. ``out_dir`` may
    not be, be inside, or contain the array folder. Holds the array folder's lock."""
    array, out_dir = ArrayDir(array_dir), os.fspath(out_dir)
    array.check_exists()
    check_output_location(out_dir, [array.path])
    if initial and which != "final":
        raise ConfigError(f"initial=True and which={which!r}: split writes one state of each model; give one of them")
    check_missing(array.load_spec(), like, allow_missing)
    with array.locked("split"):
        return _split_locked(array, out_dir, overwrite, "initial" if initial else which, like, keys)


def graph_keys(spec: ArraySpec) -> set[str]:
    """The state_dict keys model 0's split state has without ``like``: its weights and recorded extra state."""
    return set(_key_shapes(spec))


def _key_shapes(spec: ArraySpec) -> dict[str, list[int] | None]:
    """Model 0's split state without ``like``, as {state_dict key: shape} (every model's has the same; None: a
    tied key whose tensor the array does not hold)."""
    shapes: dict[str, list[int] | None] = {fw.sources[0]: list(fw.orig_shape) for fw in spec.weights.values()}
    extra = spec.extra_state[0]
    for key, e in extra.items():
        shapes[key] = list(e["shape"]) if e.get("kind") != "alias" else None
    for key, e in extra.items():  # a tied key: its tensor's shape
        if e.get("kind") == "alias":
            shapes[key] = shapes.get(e["of"])
    return shapes


def check_like(spec: ArraySpec, state_dict: Mapping, name: str) -> None:
    """``split --like`` / ``state_dicts(like=)``: the module (its ``state_dict``, key -> tensor) is the array's
    models' architecture: every key a split writes from the array is one of its keys, of the same shape. Its
    other keys are those the graph of a plain export cannot hold (tied names, BatchNorm counters): what ``like``
    is for. Otherwise one ConfigError line naming ``name`` (the module or its factory), the first difference and
    the fix, before anything is written: a split would write keys or shapes no ``load_state_dict(strict=True)``
    of the models' class accepts."""
    have = {k: list(v.shape) for k, v in state_dict.items()}
    want = _key_shapes(spec)
    fix = "give the class (and factory arguments) the models were made with"
    missing = [k for k in want if k not in have]
    if missing:
        more = f" (and {len(missing) - 1} more of the array's {len(want)} keys)" if len(missing) > 1 else ""
        theirs = ", ".join(sorted(have)[:3]) + (", ..." if len(have) > 3 else "") if have else "no keys"
        raise ConfigError(f"{name} is not the array's models' architecture: its state_dict has no "
                          f"'{missing[0]}'{more}; it has {theirs}; {fix}")
    for k, shape in want.items():
        if shape is not None and have[k] != shape:
            raise ConfigError(f"{name} is not the array's models' architecture: its '{k}' is {have[k]}, the "
                              f"models' is {shape}; {fix}")


def _safetensors_bytes(state: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """A safetensors file's bytes with the header in one order (metadata by key, tensors by offset):
    safetensors writes the metadata from a hash map, in an order that differs between processes, so that two
    identical splits would differ byte for byte."""
    from safetensors.numpy import save

    # reshape: ascontiguousarray makes a 0-d tensor (num_batches_tracked) 1-d
    raw = save({k: np.ascontiguousarray(v).reshape(np.shape(v)) for k, v in state.items()}, metadata=dict(metadata))
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", None)
    ordered = {**({"__metadata__": dict(sorted(meta.items()))} if meta else {}),
               **dict(sorted(header.items(), key=lambda kv: (kv[1]["data_offsets"], kv[0])))}
    text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]


def plain_export_note(spec: ArraySpec, sources: Sequence[onnx.ModelProto]) -> str | None:
    """What a split of models from a plain export may lack, and how to get it (None for onnxfuse's exporter,
    whose metadata records every state_dict key)."""
    if not sources or any(p.key == METADATA_KEY for p in sources[0].metadata_props):
        return None
    if sources[0].producer_name not in ("pytorch", ""):  # no torch advice to a Keras user
        return (f"the models come from {sources[0].producer_name}: the split files hold the graph's tensors under "
                "the names and in the layouts that exporter wrote (e.g. a Conv kernel as ONNX's [out, in, kH, kW]), "
                "not a checkpoint of the original framework")
    bn = any(n.op_type == "BatchNormalization" for n in sources[0].graph.node)
    lacks = "BatchNorm's num_batches_tracked, " if bn else ""
    return (f"the models come from a plain export, whose graph holds no record of the state_dict keys it cannot "
            f"hold ({lacks}tied weights' second names): the split files have the graph's tensors only; pass "
            f"--like MODULE:FACTORY (split_array(like=...)) to write every key of the module")


def _split_locked(array: ArrayDir, out_dir: str, overwrite: bool, which: str, like: dict | None = None,
                  keys: Collection[str] | None = None) -> list[str]:
    spec = array.load_spec()
    if which != "initial":
        array.check_one_run()
    per_model = split_states(array.path, spec, which, like)
    sources = [array.load_source(b) for b in range(spec.B)]
    paths = []
    with atomic_dir(out_dir, overwrite, command="split") as tmp:
        for b, (src, (state, what)) in enumerate(zip(sources, per_model)):
            graph_names = {i for n in src.graph.node for i in n.input}
            src.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in state.items() if k in graph_names)
            onnx.helper.set_model_props(src, {**{p.key: p.value for p in src.metadata_props}, **what})
            onnx.save(cleanup_pass(to_inference(src)), os.path.join(tmp, model_file(b)))  # nothing unused kept
            with open(os.path.join(tmp, model_weights_file(b)), "wb") as f:
                f.write(_safetensors_bytes({k: v for k, v in state.items() if keys is None or k in keys}, what))
            paths.append(os.path.join(out_dir, model_file(b)))
    return paths
