"""The fusion pipeline as passes, each a function a test can run alone:

    load (resolve what is static: ``resolve_static_pass``) -> identity check -> fuse -> clean up
    -> topological sort -> onnx.checker
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import warnings
from dataclasses import dataclass
from typing import Mapping, Sequence

import onnx
from onnx import numpy_helper

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core._dynamo_file import dynamo_file_warnings, non_persistent_buffers
from onnxfuse.core.guesses import guess_warnings
from onnxfuse.core._graph import cleanup_pass, toposort_pass
from onnxfuse.core.array import ArrayDir
from onnxfuse.core.engine import NODE_ORIGINS, FusionResult, Strategy, fuse_aligned
from onnxfuse.core.errors import ConfigError, NotFusibleError
from onnxfuse.core.identity import check_identical
from onnxfuse.core.rules import RULES
from onnxfuse.core.semantics import apply_options, plain_export_warnings, record_semantics
from onnxfuse.core.source import (FLOAT_TYPES, METADATA_KEY, SourceModel, check_shapes_agree, load_source,
                                  resolve_static_pass)
from onnxfuse.core.weights import ArraySpec

log = logging.getLogger("onnxfuse.fuse")

__all__ = ["FusedGraph", "fuse_models", "model_files", "save_array", "summary_line", "resolve_static_pass",
           "cleanup_pass", "toposort_pass", "check_pass", "FORMS", "fixed_strategy"]

# Every fused form some rule offers (``Rule.forms``), e.g. "grouped", "per-model": the names a fixed strategy takes.
FORMS: tuple[str, ...] = tuple(dict.fromkeys(f for r in RULES.values() for f in r.forms))


def fixed_strategy(form: str) -> Strategy:
    """The strategy that emits ``form`` wherever a rule offers it, and each rule's default elsewhere."""
    if form not in FORMS:
        raise ConfigError(f"strategy: unknown form '{form}'; the rules offer: {', '.join(FORMS)}")
    return lambda g, forms: form if form in forms else forms[0]


@dataclass
class FusedGraph:
    model: onnx.ModelProto
    spec: ArraySpec
    sources: list[SourceModel]

    @property
    def B(self) -> int:
        return self.spec.B


def check_pass(model: onnx.ModelProto, sources: Sequence[SourceModel] = ()) -> onnx.ModelProto:
    """onnx.checker with shape inference: the fused graph must be valid ONNX. When it is not because a source
    model's own shapes do not agree (an input shape its weights cannot take: its dimension 10**12 where a Gemm
    expects 48), that model is named (``check_shapes_agree``); else it is onnxfuse's fault (an internal error)."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:
        for src in sources:
            check_shapes_agree(src)
        raise NotFusibleError(f"internal error: the fused graph is not valid ONNX: {str(e).splitlines()[0]}") from e
    return model


def _natural(path: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def model_files(models: str | os.PathLike | onnx.ModelProto | Sequence[str | os.PathLike | onnx.ModelProto]) -> list:
    """The models to fuse, as given: a folder stands for its *.onnx files in natural order (model_2 before
    model_10), as ``onnxfuse fuse DIR`` reads it; one path (or ModelProto) alone is a folder or one model."""
    if isinstance(models, (str, os.PathLike, onnx.ModelProto)):
        models = [models]
    out = []
    for item in models:
        if isinstance(item, (str, os.PathLike)) and os.path.isdir(item):
            found = sorted(glob.glob(os.path.join(glob.escape(os.fspath(item)), "*.onnx")), key=_natural)
            if not found:
                raise ConfigError(f"folder '{os.fspath(item)}' holds no .onnx files; give the folder `onnxfuse "
                                  "export` wrote, or the model files")
            out += found
        else:
            out.append(item)
    return out


def fuse_models(models: str | os.PathLike | Sequence[str | os.PathLike | onnx.ModelProto],
                labels: Sequence[str] | None = None,
                strict: bool = False, per_model_inputs: Sequence[str] = (),
                strategy: str | Strategy | None = None, padding_rows: Mapping[str, Sequence[int]] | None = None,
                frozen: Sequence[str] = (), model_ids: Sequence[int] | None = None) -> FusedGraph:
    """Fuse B models that are the same graph up to weights into one horizontally fused model.

    ``per_model_inputs`` names graph inputs that differ per model: the fused graph takes them as [B, ...].
    A node without a fusion rule runs once per model (with a warning) unless ``strict``, which raises
    ``UnsupportedOpError`` instead. ``strategy`` picks the form of nodes whose rule offers several (every form is
    the same maths and the same weight layout): None or "default" (each rule's first: grouped convolutions), a form
    name (:data:`FORMS`, that form wherever offered), or a callable (:data:`onnxfuse.core.engine.Strategy`;
    ``onnxfuse.measure.forms.measured_strategy`` measures each node's forms on a runtime and device).
    ``padding_rows`` ({embedding table: rows}) and ``frozen`` (weight names or glob patterns) say what a plain
    export's graph cannot (:mod:`onnxfuse.core.semantics`; onnxfuse's exporter records both): without them, each
    embedding lookup of a plain export is warned about. ``models``: files, ModelProtos, or folders of .onnx files
    (:func:`model_files`). ``model_ids``: each model's index in its array (default 0..B-1; an array re-fused
    without some of its models passes the survivors' own), which a random op's per-model seed reads.
    """
    if isinstance(strategy, str):
        strategy = None if strategy == "default" else fixed_strategy(strategy)
    sources = _load_sources(model_files(models), labels, per_model_inputs)
    with Stopwatch() as watch:
        aligned = check_identical(sources)
    if len(sources) > 1:
        log.debug("identity check: the %d models are one graph up to weights (%.2f s)", len(sources), watch.seconds)
    with Stopwatch() as watch:
        result = fuse_aligned(aligned, RULES, strict=strict, per_model_inputs=set(per_model_inputs),
                              strategy=strategy, model_ids=model_ids)
    log.debug("fused by the rules in %.2f s (%d fused, %d run per model, %d shared)", watch.seconds,
              result.summary["fused"], result.summary["per_model"], result.summary["shared"])
    for node, form in result.summary.get("forms", {}).items():
        log.debug("form of node '%s': %s (%s)", node, form, "the strategy's choice" if strategy else "the rule's "
                  "first, strategy='default'")
    _training_semantics(result, sources, padding_rows, frozen)
    with Stopwatch() as watch:
        model = check_pass(toposort_pass(cleanup_pass(result.model)), sources)
    log.debug("clean-up, topological sort and onnx.checker: %d -> %d nodes in %.2f s", len(result.model.graph.node),
              len(model.graph.node), watch.seconds)
    return FusedGraph(model=model, spec=_array_spec(model, result, sources, per_model_inputs), sources=sources)


def _load_sources(models: list, labels: Sequence[str] | None, per_model_inputs: Sequence[str]) -> list[SourceModel]:
    """Each model read and loaded (:func:`~onnxfuse.core.source.load_source`); ``per_model_inputs`` checked
    against the graph's inputs."""
    for k, m in enumerate(models):
        if not isinstance(m, (str, os.PathLike, onnx.ModelProto)):
            module = hasattr(m, "state_dict") and hasattr(m, "forward")  # a torch module, without importing torch
            raise ConfigError(f"fuse_models: model {k} is a {type(m).__name__}, not an ONNX file or ModelProto"
                              + ("; fuse torch modules with onnxfuse.fuse(modules, example_inputs)" if module else ""))
    if labels is None:
        labels = _labels(models)
    watch = Stopwatch()
    sources = [load_source(m, labels[k]) for k, m in enumerate(models)]
    log.debug("read %d model%s in %.2f s: %d nodes each, inputs %s", len(sources), "s" * (len(sources) != 1),
              watch.seconds, len(sources[0].nodes), ", ".join(vi.name for vi in sources[0].inputs))
    names = {vi.name for vi in sources[0].inputs}
    unknown = [n for n in per_model_inputs if n not in names]
    if unknown:
        raise ConfigError(f"per_model_inputs: '{unknown[0]}' is not a graph input of {sources[0].label} "
                          f"(its inputs: {', '.join(sorted(names))})")
    return sources


def _training_semantics(result: FusionResult, sources: list[SourceModel],
                        padding_rows: Mapping[str, Sequence[int]] | None, frozen: Sequence[str]) -> None:
    """What the fused weights need besides the graph (padding rows, frozen weights: recorded in them), and the
    warnings for what the files lost or the rules could not fuse. Warns at fuse_models' caller."""
    for message in dynamo_file_warnings(sources[0].dynamo, sources[0].label):  # what torch's dynamo export lost
        warnings.warn(message, stacklevel=3)
    metas = [s.meta for s in sources]
    if padding_rows or frozen:
        apply_options(result.weights, metas, padding_rows, frozen)
    elif not sources[0].meta:  # a plain export, and nothing said about it
        for message in plain_export_warnings(sources[0].model, sources[0].weight_names):
            warnings.warn(message, stacklevel=3)
    record_semantics(result.weights, metas)
    trained = {fw.sources[0] for fw in result.weights.values() if fw.role == "param"}
    guessed = sources[0].trainable is None
    result.summary["guessed"] = len(trained) if guessed else 0  # `train` says how many were guessed
    for message in (guess_warnings(sources[0].model, sources[0].label, trained, sources[0].never_trained,
                                   sources[0].array) if guessed else []):
        warnings.warn(message, stacklevel=3)
    if result.summary["unfused"]:
        listed = ", ".join(f"{u['node']} ({u['op_type']})" for u in result.summary["unfused"][:10])
        more = len(result.summary["unfused"]) - 10
        warnings.warn(f"{len(result.summary['unfused'])} node(s) run once per model instead of fused: {listed}"
                      + (f" and {more} more" if more > 0 else "") + "; see array.json summary.unfused for why",
                      stacklevel=3)


def _array_spec(model: onnx.ModelProto, result: FusionResult, sources: list[SourceModel],
                per_model_inputs: Sequence[str]) -> ArraySpec:
    """The weight mapping and record of the fused ``model``: array.json."""
    src = sources[0]

    def io(vis, per_model=()):
        return [{"name": v.name, "shape": src.shapes.get(v.name),
                 "dtype": onnx.helper.tensor_dtype_to_np_dtype(src.dtypes.get(v.name, onnx.TensorProto.FLOAT)).name,
                 "per_model": v.name in per_model} for v in vis]

    summary = dict(result.summary)
    summary["fused_nodes"] = len(model.graph.node)
    # the fused nodes the clean-up kept, by what emitted them: they add up to fused_nodes (docs/cli.md, "fuse")
    kept = [result.origins.get(n.name, "rules") for n in model.graph.node]
    summary["fused_nodes_from"] = {origin: kept.count(origin) for origin in NODE_ORIGINS}
    return ArraySpec(
        B=len(sources),
        sources=[s.label for s in sources],
        inputs=io(src.inputs, set(per_model_inputs)),
        outputs=io(src.outputs),
        weights=result.weights,
        extra_state=[_extra_state(s) for s in sources],
        summary=summary,
    )


# a state_dict key: a name, or a dotted module path and name (an export's own constants are "onnx::Reshape_3",
# "/Constant_output_0"; the dynamo exporter's "val_3", told from keys by its signature)
_STATE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


def _extra_state(src: SourceModel) -> dict:
    """State that ``split`` writes besides the trained weights: the exporter's record (aliases, BatchNorm counters,
    constants); for a graph from a plain export, which has none, every non-float initializer named like a
    state_dict key (a module's integer buffer, e.g. Swin's ``relative_position_index`` or a graph network's edge
    list ``src``), as the constant it is; in a dynamo export, the persistent buffers its signature names."""
    extra = dict(src.meta.get("extra_state", {}))
    if "trainable" in src.meta:
        return extra
    keys = None if src.dynamo is None else {k for k, kind in src.dynamo.kinds.items() if kind in (
        "PARAMETER", "BUFFER")} - non_persistent_buffers(src.model)
    for name, t in src.initializers.items():
        if t.data_type in FLOAT_TYPES or name in src.weight_names or name in extra or not _STATE_KEY.match(name):
            continue
        if keys is not None and name not in keys:
            continue
        arr = src.array(name)
        extra[name] = {"dtype": str(arr.dtype), "shape": list(arr.shape), "value": arr.reshape(-1).tolist(),
                       "kind": "constant"}
    return extra


_FROM_LABELS = {"rules": "by rules", "per_model": "per-model copies", "shared": "shared",
                "layout": "layout conversions", "output": "output renames"}


def summary_line(spec: ArraySpec) -> str:
    """The fusion in one line, each part adding up (docs/cli.md, "fuse"): the nodes of one model by what became
    of them (fused by a rule, run once per model, shared), then the fused graph's nodes by what emitted them."""
    s = spec.summary
    line = (f"{s['nodes']} nodes per model ({s['fused']} fused by rules, {s['per_model']} run per model, "
            f"{s['shared']} shared) -> {s['fused_nodes']} fused nodes")
    parts = s.get("fused_nodes_from")
    if parts:  # arrays fused before the breakdown was recorded have none
        line += " (" + ", ".join(f"{n} {_FROM_LABELS[k]}" for k, n in parts.items() if n or k == "rules") + ")"
    return (f"{line}; fused fraction {100 * s['fused_fraction']:.1f}% of the nodes that compute per model; "
            f"{len(spec.weights)} fused weights")


def _labels(models) -> list[str]:
    """How each model is named in messages: its file name, or its path when file names repeat."""
    paths = [os.fspath(m) if not isinstance(m, onnx.ModelProto) else f"model {k}" for k, m in enumerate(models)]
    names = [os.path.basename(p) for p in paths]
    return names if len(set(names)) == len(names) else paths


def _strip_weights(src: SourceModel) -> onnx.ModelProto:
    """The source graph without its weight data (split puts trained weights back), with its metadata as fusion
    read it (the options of :func:`~onnxfuse.core.semantics.apply_options` included)."""
    m = onnx.ModelProto()
    m.CopyFrom(src.model)
    if src.meta:
        kept = [p for p in m.metadata_props if p.key != METADATA_KEY]
        del m.metadata_props[:]
        m.metadata_props.extend(kept)
        m.metadata_props.add(key=METADATA_KEY, value=json.dumps(src.meta))
    keep = [t for t in m.graph.initializer if t.name not in src.weight_names]
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    return m


def save_array(fa: FusedGraph, out_dir: str | os.PathLike, overwrite: bool = False) -> str:
    """Write the array folder (:class:`onnxfuse.core.array.ArrayDir`): the fused graph, its spec and the weightless
    source graphs, atomically. With ``overwrite``, an array folder there is replaced as a whole (its runs too),
    holding its lock."""
    out_dir = os.fspath(out_dir)
    ArrayDir.create(out_dir, fa.model, fa.spec, [_strip_weights(src) for src in fa.sources], overwrite)
    return out_dir


def fused_initial_weights(model: onnx.ModelProto) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
