"""``fuse --like``: the torch class the models were made from, as the truth at fuse time.

An ONNX file from any of torch's export routes holds each model's weights, but not what they are: a registered
buffer (rotary tables, a causal mask of -inf, fixed boxes) is an initializer like a parameter, an eval-mode export
folded BatchNorm into the Conv and merged equal values into one tensor, an exporter may have translated an op
into one that computes something else. With the class, each file becomes what ``onnxfuse export`` would have
written for the module holding the file's weights (:func:`adopt`):

1. the module is built by the factory; :func:`~onnxfuse.exporters.state_map.map_state` finds each of its
   state_dict entries in the file, and what it cannot find is refused (a parameter the forward reads) or named
   (a BatchNorm counter, a buffer the export computed into a constant, a parameter the forward never reads);
2. the file's values are loaded into the module, and the file's forward is checked against the module's in eval
   mode (``agreement.check_agreement``): the values are the module's, or the file is refused with the first
   output that differs and why;
3. the module is exported by onnxfuse's exporter (TorchScript, training mode, names kept, every entry recorded:
   parameters, buffers, ties, padding rows, requires_grad), and that graph is checked in training mode, so that
   what the array trains is the module's training forward. Where that exporter cannot export the module, the
   file's own graph is kept with the module's record, when every weight it holds is found by name.

The record names the factory (``LIKE_KEY``), so that split and verification know the class too.
"""
from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from onnxfuse.core._io import read_model
from onnxfuse.core._opset import MIN_OPSET
from onnxfuse.core.errors import ConfigError, ExportMismatchError, OnnxFuseError
from onnxfuse.core.source import LIKE_KEY, METADATA_KEY, tensor_shape
from onnxfuse.core.weights import MISSING
from onnxfuse.exporters.state_map import StateMap, map_state
from onnxfuse.exporters.torch_export import (build_module, example_error, export_module, max_torchscript_opset,
                                             module_extra_state)
from onnxfuse.runtime.torch.agreement import check_agreement, forward_parameters, parameters_read, sample_inputs

__all__ = ["Adopted", "adopt", "adopt_files", "EXPORT_FIX"]

log = logging.getLogger("onnxfuse.fuse")

EXPORT_FIX = ("export with `onnxfuse export`, or torch.onnx.export(..., dynamo=False, "
              "training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False), which keep every parameter")


@dataclass
class Adopted:
    """One file made the module's: the graph the array fuses, and what was taken from where."""

    proto: onnx.ModelProto
    smap: StateMap
    kept_file: bool = False  # the file's own graph (onnxfuse's exporter could not export the module)
    notes: list[str] = field(default_factory=list)


def _axes(proto: onnx.ModelProto) -> dict[str, dict[int, str]]:
    """The file's symbolic dimensions, as torch.onnx's ``dynamic_axes``."""
    out = {}
    inits = {t.name for t in proto.graph.initializer}
    for vi in list(proto.graph.input) + list(proto.graph.output):
        if vi.name in inits:
            continue
        dims = {k: d for k, d in enumerate(tensor_shape(vi.type) or []) if isinstance(d, str) and d}
        if dims:
            out[vi.name] = dims
    return out


def _lost_words(smap: StateMap, module: torch.nn.Module) -> str:
    """Why the keys the file lost are lost, as far as the module's structure says."""
    modules = dict(module.named_modules())
    bns = sorted({k.rpartition(".")[0] for k in smap.lost
                  if isinstance(modules.get(k.rpartition(".")[0]), torch.nn.modules.batchnorm._BatchNorm)})
    if bns:
        return (f"BatchNorm {', '.join(repr(b) for b in bns[:3])} folded into the layer before it (an eval-mode "
                "export, or torch's dynamo exporter)")
    return "computed into other tensors by the export (constant folding)"


def _load(module: torch.nn.Module, values: Mapping[str, np.ndarray]) -> None:
    """Write ``values`` (by state_dict key, non-persistent buffers included) into ``module``'s tensors."""
    with torch.no_grad():
        for key, v in values.items():
            holder, _, name = key.rpartition(".")
            t = getattr(module.get_submodule(holder) if holder else module, name)
            t.copy_(torch.as_tensor(np.array(v)).to(t.dtype).reshape(t.shape))


def _call_args(module: torch.nn.Module, names: Sequence[str], inputs: tuple) -> tuple:
    """The example the export traces with: the inputs by keyword (a trailing dict) where every name is a
    parameter of the module's forward (and not its first ones, in order), as the check runs it."""
    params = forward_parameters(module)
    if names and all(n in params for n in names) and list(names) != params[:len(names)]:
        return (dict(zip(names, inputs)),)
    return tuple(inputs)


def adopt(file, factory, args: Mapping[str, Any] | None, spec: str, shapes: dict | None = None,
          label: str | None = None) -> Adopted:
    """File ``file`` (a path or ModelProto) as the module ``factory(**args)`` (``spec``: its MODULE:FACTORY)
    holding its weights: see the module docstring. One ExportMismatchError or ConfigError line on a file
    that is not the module's."""
    proto, label = read_model(file, label)
    module = build_module(factory, 0, args, name=spec)
    names, inputs = sample_inputs(proto, shapes)
    try:
        read = parameters_read(module, names, inputs)
    except OnnxFuseError:
        raise
    except Exception as e:
        raise example_error(module, inputs, e) from e
    smap = map_state(module, proto, read=read)
    cls = type(module).__name__
    if smap.lost:
        more = f" and {len(smap.lost) - 3} more" if len(smap.lost) > 3 else ""
        raise ExportMismatchError(f"{label}: the file holds no value for parameter(s) {', '.join(smap.lost[:3])}"
                                  f"{more} of {cls}, which its forward reads ({_lost_words(smap, module)}); "
                                  f"{EXPORT_FIX}", node="")
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    _load(module, smap.state(inits))
    check_agreement(module, proto, names, inputs, False, f"{label} (--like {spec})",
                    f"give the class (and --args) the file was exported from, or {EXPORT_FIX}")
    record = {LIKE_KEY: {"factory": spec, "args": dict(args or {}), "file": label}}
    trains = f"{label} (--like {spec}, as onnxfuse trains it)"
    try:
        new = _export(module, proto, names, inputs, record)
        _mark_missing(new, smap)
        check_agreement(module, new, names, inputs, True, trains, "rewrite the op that node exports from in the "
                        "module, or train the file as it is (fuse it without --like)")
        return Adopted(new, smap, False, _notes(smap, label, False))
    except (ConfigError, ExportMismatchError) as first:  # the file's own graph, if it trains as the module does
        try:
            kept = _keep_file(proto, module, smap, record, label, first)
            _mark_missing(kept, smap)
            check_agreement(module, kept, names, inputs, True, trains, EXPORT_FIX)
        except OnnxFuseError:
            raise first from None
        return Adopted(kept, smap, True, _notes(smap, label, True))


def _export(module: torch.nn.Module, proto: onnx.ModelProto, names: Sequence[str], inputs: tuple, record: dict
            ) -> onnx.ModelProto:
    """onnxfuse's export of ``module`` with the file's inputs, outputs, symbolic dimensions and opset (within
    what the TorchScript exporter writes)."""
    opset = max(MIN_OPSET, min(max_torchscript_opset(), next((o.version for o in proto.opset_import
                                                               if o.domain in ("", "ai.onnx")), MIN_OPSET)))
    # an output TorchScript numbered ('303') would clash with its own numbering of the new export
    outputs = {o.name: o.name if not o.name.isdigit() else f"output_{k}" for k, o in enumerate(proto.graph.output)}
    axes = {outputs.get(n, n): a for n, a in _axes(proto).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_module(module, None, example_inputs=_call_args(module, names, inputs), input_names=names,
                             output_names=list(outputs.values()), opset=opset, dynamic_axes=axes, record=record)


def _keep_file(proto: onnx.ModelProto, module: torch.nn.Module, smap: StateMap, record: dict, label: str,
               error: Exception) -> onnx.ModelProto:
    """The file's own graph with the module's record (which of its initializers are parameters, buffers, state),
    when onnxfuse's exporter cannot export the module and every key the file holds is found by its own name."""
    renamed = sorted(k for k, s in smap.found.items() if s.init != k or s.transposed)
    if renamed:
        raise ConfigError(f"{label}: the file holds {renamed[0]} under another name "
                          f"({smap.found[renamed[0]].describe()}), so its own graph cannot be trained as the module")
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    inits = {t.name for t in out.graph.initializer}
    trainable = {k for k, i in smap.keys.items() if i.requires_grad}
    meta = {"framework": "torch", "trainable": sorted(k for k in smap.found if k in trainable and k in inits),
            "buffers": sorted(k for k in smap.found if k not in trainable and smap.keys[k].persistent
                              and k in inits),
            "extra_state": module_extra_state(module, set(smap.found) & inits), **record}
    kept = [p for p in out.metadata_props if p.key != METADATA_KEY]
    del out.metadata_props[:]
    out.metadata_props.extend(kept)
    out.metadata_props.add(key=METADATA_KEY, value=json.dumps(meta))
    return out


def _mark_missing(proto: onnx.ModelProto, smap: StateMap) -> None:
    """The parameters the file has no value for (never read by the forward) recorded as ``missing`` in
    ``proto``'s metadata: what the export recorded for them is the fresh module's, not the file's."""
    if not smap.unread:
        return
    prop = next(p for p in proto.metadata_props if p.key == METADATA_KEY)
    meta = json.loads(prop.value)
    for key in smap.unread:
        info = smap.keys[key]
        meta["extra_state"][key] = {"kind": MISSING, "shape": list(info.shape), "dtype": info.dtype,
                                    "why": "the file holds no value for it (the forward never reads it)"}
    prop.value = json.dumps(meta)


def _notes(smap: StateMap, label: str, kept: bool) -> list[str]:
    """What the array holds that is not simply the file's tensor of that name, one line each."""
    out = []
    moved = {k: s for k, s in smap.found.items() if s.how != "name" or s.transposed}
    if moved:
        shown = ", ".join(f"{k} = {s.describe()}" for k, s in list(moved.items())[:3])
        out.append(f"{label}: {len(moved)} entr{'y' if len(moved) == 1 else 'ies'} under other names in the file: "
                   f"{shown}" + (" ..." if len(moved) > 3 else ""))
    if smap.class_buffers:
        out.append(f"{label}: buffer(s) {', '.join(smap.class_buffers[:3])} are not in the file (computed into "
                   "constants by its export): the class's own values, which the file's forward agrees with")
    if smap.counters:
        out.append(f"{label}: {', '.join(smap.counters[:2])}{' ...' if len(smap.counters) > 2 else ''} not in the "
                   "file: counted from 0 at this fuse, advanced by every step trained")
    if smap.unread:
        out.append(f"{label}: parameter(s) {', '.join(smap.unread[:3])} are not in the file and the forward never "
                   "reads them: split refuses to write them (split --allow-missing leaves them out)")
    if kept:
        out.append(f"{label}: onnxfuse's exporter does not export the module as torch runs it; the file's own graph, "
                   "which does, is trained, with the module's record of its parameters and buffers")
    return out


def adopt_files(files: Sequence, spec: str, args: Mapping[str, Any] | None = None, shapes: dict | None = None,
                labels: Sequence[str] | None = None) -> tuple[list[onnx.ModelProto], list[str]]:
    """Each of ``files`` adopted by the class ``spec`` (MODULE:FACTORY or FILE.py:FUNCTION) built with ``args``:
    the graphs to fuse, and the notes to say once (those of model 0; every model's are the same)."""
    from onnxfuse.exporters.factory import load_factory

    factory = load_factory(spec)
    done = [adopt(f, factory, args, spec, shapes, labels[k] if labels else None) for k, f in enumerate(files)]
    return [a.proto for a in done], done[0].notes if done else []
