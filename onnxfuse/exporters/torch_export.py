"""Export torch modules to ONNX for training: BatchNorm in training mode, no constant folding, parameter names
kept as the state_dict keys, and the module's state left exactly as it was before the export."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from typing import Any, Callable, Mapping, Sequence

import onnx
import torch
from onnx import numpy_helper

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core._graph import all_nodes
from onnxfuse.core._io import atomic_dir, atomic_file
from onnxfuse.core._opset import MAX_OPSET, MIN_OPSET  # the opsets onnxfuse reads
from onnxfuse.core.array import model_file
from onnxfuse.core.errors import ConfigError
from onnxfuse.core.semantics import PADDING_ROWS
from onnxfuse.core.source import LIKE_KEY, METADATA_KEY
from onnxfuse.exporters.factory import DEFAULT_OPSET, call_factory, factory_name, load_factory, model_inputs

__all__ = ["export_module", "export_array", "build_array", "load_factory", "build_module", "trace_inputs",
           "example_error", "max_torchscript_opset", "module_extra_state", "DEFAULT_OPSET"]

log = logging.getLogger("onnxfuse.export")


def max_torchscript_opset() -> int:
    """The newest opset torch's TorchScript exporter writes (20 in torch 2.4-2.13)."""
    try:
        from torch.onnx import _constants

        return int(_constants.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET)
    except (ImportError, AttributeError):  # pragma: no cover - other torch versions
        return 20


def check_opset(opset) -> int:
    """``opset`` if onnxfuse reads it and the TorchScript exporter writes it; else one ConfigError line."""
    top = min(max_torchscript_opset(), MAX_OPSET)
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= top:
        raise ConfigError(f"opset={opset!r} is not supported: torch's TorchScript exporter writes opsets up to "
                          f"{max_torchscript_opset()} and onnxfuse reads opsets {MIN_OPSET} to {MAX_OPSET}; give one "
                          f"in {MIN_OPSET}..{top} (default {DEFAULT_OPSET})")
    return opset


def _storage_key(t: torch.Tensor) -> tuple:
    """Tensors with equal keys are the same memory viewed the same way: one tensor under two names."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _state_metadata(module: torch.nn.Module, graph_inits: set[str]) -> dict:
    """What each ``state_dict`` entry of ``module`` is, so that ``split`` can write every key back:

    - a graph initializer: ``trainable`` (a parameter with requires_grad) or ``buffers`` (the rest); fused and
      trained, and written from its trained value;
    - ``extra_state[key] = {"kind": "alias", "of": other}``: the same tensor as ``other`` (tied weights, e.g.
      GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``; found by storage identity, as torch's
      ``named_parameters(remove_duplicate=True)`` drops the later names). The graph holds it once, under one
      name; split writes the trained value of ``other`` under ``key`` too;
    - ``extra_state[key]`` with kind ``bn_counter`` (BatchNorm's num_batches_tracked: advanced by the number of
      training steps) or ``constant``: not an initializer of the graph, its value recorded here at export time
      and written back unchanged. That is right for a buffer the exporter turned into a Constant node and for
      a parameter or buffer the forward never reads, since training cannot change them. (A key that shares memory
      with an initializer without being the same tensor, e.g. a slice of it, would be stale: warned about.)
    """
    state = module.state_dict(keep_vars=True)
    trainable = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    counters = {f"{name}.num_batches_tracked" for name, m in module.named_modules()
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats}
    # one tensor, several keys: the key the graph holds (else the first) stands for the others
    canonical: dict[tuple, str] = {}
    for key, t in state.items():
        if t.numel() == 0:
            continue
        k = _storage_key(t)
        if k not in canonical or (key in graph_inits and canonical[k] not in graph_inits):
            canonical[k] = key
    in_graph_storage = {state[k].untyped_storage().data_ptr() for k in graph_inits if k in state}
    meta = {"framework": "torch", "torch_version": torch.__version__, "trainable": [], "buffers": [],
            "extra_state": {}}
    for key, t in state.items():
        first = canonical.get(_storage_key(t), key) if t.numel() else key
        if key in graph_inits:
            meta["trainable" if key in trainable else "buffers"].append(key)
        elif first != key:
            meta["extra_state"][key] = {"kind": "alias", "of": first}
        else:
            if t.numel() and t.untyped_storage().data_ptr() in in_graph_storage:
                warnings.warn(f"state_dict entry '{key}' shares memory with a graph initializer but is not the same "
                              "tensor (a slice or reshaped view of it): split writes its value from export time, "
                              "not the trained one", stacklevel=3)
            arr = t.detach().cpu().numpy()
            meta["extra_state"][key] = {
                "dtype": str(arr.dtype), "shape": list(arr.shape), "value": arr.reshape(-1).tolist(),
                "kind": "bn_counter" if key in counters else "constant",
            }
    return meta


def _padding_rows(module: torch.nn.Module, graph_inits: set[str]) -> dict:
    """``{table: [row]}``: the rows of embedding tables whose lookups pass no gradient to them
    (``nn.Embedding(padding_idx=)``), by the name the graph holds the (maybe tied) table under. The graph reads
    the table with a plain Gather, so fusion records this and both runtimes honour it
    (``onnxfuse/core/semantics.py``).
    What a graph cannot hold and no runtime trains as torch does is refused here, before torch exports anything:
    ``max_norm`` (the forward renormalizes rows in place), ``scale_grad_by_freq`` (the gradient divided by each
    row's count in the batch) and BatchNorm's ``momentum=None`` (a cumulative average, exported as momentum 0)."""
    state = module.state_dict(keep_vars=True)
    in_graph = {_storage_key(state[k]): k for k in graph_inits if k in state and state[k].numel()}
    rows: dict[str, list[int]] = {}
    for name, m in module.named_modules():
        label = f"{type(m).__name__} '{name or type(module).__name__}'"
        if isinstance(m, torch.nn.Embedding):
            if m.max_norm is not None:
                raise ConfigError(f"{label} has max_norm={m.max_norm}: its forward renormalizes the looked-up rows "
                                  "in place, which an ONNX graph cannot hold, so no runtime could train it as torch "
                                  "does; remove max_norm (or clip the rows after each step yourself)")
            if m.scale_grad_by_freq:
                raise ConfigError(f"{label} has scale_grad_by_freq=True: torch divides each row's gradient by its "
                                  "count in the batch, which onnxfuse's runtimes do not; remove it to train this "
                                  "model")
            if m.padding_idx is not None:
                key = in_graph.get(_storage_key(m.weight))
                if key is not None:
                    rows.setdefault(key, []).append(int(m.padding_idx) % m.num_embeddings)
        elif (isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.momentum is None
              and m.track_running_stats):
            raise ConfigError(f"{label} has momentum=None (running statistics as a cumulative average): the export "
                              "writes momentum 0, which would make them the last batch's; give it a momentum "
                              "(torch's default is 0.1)")
    return {k: sorted(set(v)) for k, v in rows.items()}


def module_extra_state(module: torch.nn.Module, graph_keys: set[str]) -> dict:
    """The state ``split`` writes for the keys of ``module``'s state_dict that are not in ``graph_keys`` (the keys
    a split already has): tied aliases, BatchNorm counters (advanced by the steps trained) and constants, as
    :func:`_state_metadata` records them at export. For models from a plain export (``split --like``)."""
    return _state_metadata(module, set(graph_keys))["extra_state"]


def example_error(module: torch.nn.Module, example_inputs: tuple, e: Exception, what: str = "run") -> ConfigError:
    """The one line for a model that fails on its example inputs (torch's "mat1 and mat2 shapes cannot be
    multiplied", a dtype it does not take): the model, the inputs' shapes and dtypes, torch's words, the fix."""
    shapes = [list(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)]
    dtypes = [str(t.dtype).removeprefix("torch.") for t in example_inputs if isinstance(t, torch.Tensor)]
    first = " ".join(str(e).split())[:300]
    return ConfigError(f"torch could not {what} {type(module).__name__} with input shape(s) {shapes} "
                       f"({', '.join(dtypes)}): {first}; give inputs of the shapes and dtypes the model takes, batch "
                       "axis first (input_shape= and input_dtype=, or onnxfuse.fuse's example_inputs; token ids: "
                       "int64)")


def lost_batchnorm_warning(module: torch.nn.Module, ran: Sequence[str], proto: onnx.ModelProto) -> str | None:
    """One line when BatchNorm layers of ``module`` ran in its training-mode export (``ran``: their names) but the
    graph holds Conv/ConvTranspose/Gemm nodes and no BatchNormalization: the exporter folded them into those nodes
    (torch's dynamo exporter does, in training mode too), and the array would train without them; else None."""
    ops = {n.op_type for n in all_nodes(proto.graph)}
    if not ran or "BatchNormalization" in ops or not ops & {"Conv", "ConvTranspose", "Gemm"}:
        return None
    names = ", ".join(f"'{n}'" for n in dict.fromkeys(ran))
    return (f"{type(module).__name__}: its training-mode forward runs BatchNorm layer(s) {names}, but the exported "
            "graph holds no BatchNormalization: the exporter folded them into the Conv/Gemm before them (torch's "
            "dynamo exporter does), so this array would train without them, unlike torch; export with "
            "torch.onnx.export(..., dynamo=False, training=torch.onnx.TrainingMode.TRAINING), which keeps them")


def trace_inputs(input_shape: Sequence[int] | Mapping[str, Sequence[int]],
                   input_dtype: str | Mapping[str, str] | None = None) -> tuple[list[str], tuple[torch.Tensor, ...]]:
    """The graph inputs' names and the tensors the export traces with (``factory.model_inputs`` checks and names
    them): floats random normal (seed 0), integers zeros (a valid index of any embedding table), bools True."""
    shapes, dtypes = model_inputs(input_shape, input_dtype, key="input_shape", dtype_key="input_dtype")
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for name, shape in shapes.items():
        dtype = getattr(torch, dtypes[name])
        if dtype.is_floating_point:
            tensors.append(torch.randn(*shape, generator=gen).to(dtype))
        elif dtype == torch.bool:
            tensors.append(torch.ones(*shape, dtype=dtype))
        else:
            tensors.append(torch.zeros(*shape, dtype=dtype))
    return list(shapes), tuple(tensors)


def export_module(
    module: torch.nn.Module,
    path: str | os.PathLike | None,
    input_shape: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    example_inputs: tuple | None = None,
    input_names: Sequence[str] = ("input",),
    output_names: Sequence[str] = ("output",),
    opset: int = DEFAULT_OPSET,
    dynamic_batch: bool = True,
    input_dtype: str | Mapping[str, str] | None = None,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    record: Mapping[str, Any] | None = None,
) -> onnx.ModelProto:
    """Export ``module`` in training mode to ``path`` (None: in memory only, no file); returns the ModelProto.

    The example inputs are ``example_inputs``, or made from ``input_shape`` and ``input_dtype`` (one shape, or
    ``{name: shape}`` for a model with several inputs, which names the graph inputs; see :func:`trace_inputs`).
    The batch dimension (dim 0 of every input and output) is symbolic ``N`` unless ``dynamic_batch=False``;
    ``dynamic_axes`` ({input or output name: {axis: name}}, torch.onnx's) says instead which are symbolic.
    Exporting runs one training forward, which moves BatchNorm running statistics: the module's state_dict is
    restored afterwards and the ONNX initializers hold the values from before the export. ``record``: more entries
    of the metadata onnxfuse reads (:data:`~onnxfuse.core.source.LIKE_KEY`: the factory the module was built by).
    """
    check_opset(opset)
    _padding_rows(module, set())  # what no runtime can train is refused before torch exports it
    if example_inputs is None:
        if input_shape is None:
            raise ConfigError("export_module needs input_shape or example_inputs")
        names, example_inputs = trace_inputs(input_shape, input_dtype)
        if isinstance(input_shape, Mapping):
            input_names = names
    snapshot = {k: v.detach().clone() for k, v in module.state_dict().items()}
    was_training = module.training
    module.train()
    if dynamic_axes is None:
        dynamic_axes = {n: {0: "N"} for n in list(input_names) + list(output_names)} if dynamic_batch else None
    buf = io.BytesIO()
    ran: list[str] = []  # the BatchNorm layers the exported forward runs
    hooks = [m.register_forward_pre_hook(lambda *_, name=name: ran.append(name))
             for name, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module, example_inputs, buf, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                do_constant_folding=False, opset_version=opset, input_names=list(input_names),
                output_names=list(output_names), dynamic_axes=dynamic_axes,
            )
    except Exception as e:
        raise example_error(module, example_inputs, e, "export") from e
    finally:
        for h in hooks:
            h.remove()
        module.load_state_dict(snapshot)
        module.train(was_training)
    proto = onnx.load_from_string(buf.getvalue())
    lost = lost_batchnorm_warning(module, ran, proto)
    if lost:
        warnings.warn(lost, stacklevel=2)
    for init in proto.graph.initializer:
        if init.name in snapshot:
            init.CopyFrom(numpy_helper.from_array(snapshot[init.name].cpu().numpy(), init.name))
    inits = {i.name for i in proto.graph.initializer}
    meta = {**_state_metadata(module, inits), PADDING_ROWS: _padding_rows(module, inits), **(record or {})}
    proto.metadata_props.add(key=METADATA_KEY, value=json.dumps(meta))
    proto.ir_version = min(proto.ir_version, 10)
    if path is not None:
        with atomic_file(path) as tmp:  # whole or absent; a full disk is one line naming the file
            onnx.save(proto, tmp)
    return proto


def build_module(factory: Callable[..., torch.nn.Module] | str, seed: int, args: Mapping[str, Any] | None = None,
                 where: str = "", name: str | None = None) -> torch.nn.Module:
    """``factory(**args)`` after ``torch.manual_seed(seed)``: one model of an array (``factory.call_factory``: the
    arguments checked against the factory's signature first, and a failing call one ConfigError naming the factory,
    ``name`` or its own ``MODULE:NAME``)."""
    name = name or (factory if isinstance(factory, str) else factory_name(factory))
    torch.manual_seed(seed)
    module = call_factory(factory, args, name, where)
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"{where}the factory {name} returned {type(module).__name__}, not a torch.nn.Module")
    return module


def export_array(
    factory: Callable[..., torch.nn.Module] | str,
    out_dir: str | os.PathLike,
    count: int,
    input_shape: Sequence[int] | Mapping[str, Sequence[int]],
    seeds: Sequence[int] | None = None,
    overwrite: bool = False,
    factory_args: Mapping[str, Any] | None = None,
    input_dtype: str | Mapping[str, str] | None = None,
    **export_kwargs,
) -> list[str]:
    """Build ``count`` modules (:func:`build_module`: ``torch.manual_seed(seed)``, then
    ``factory(**factory_args)``; ``factory`` a callable or ``MODULE:FACTORY``) and export each to
    ``out_dir/model_{b}.onnx`` (example inputs from ``input_shape`` and ``input_dtype``: :func:`trace_inputs`).
    Returns the file paths."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"count={count!r}: give the number of models, at least 1")
    seeds = list(range(count)) if seeds is None else list(seeds)
    if len(seeds) != count:
        raise ConfigError(f"seeds: {len(seeds)} values but count={count}; give one seed per model")
    name = factory if isinstance(factory, str) else factory_name(factory)
    factory = load_factory(factory) if isinstance(factory, str) else factory
    check_opset(export_kwargs.get("opset", DEFAULT_OPSET))
    shapes, dtypes = model_inputs(input_shape, input_dtype, key="input_shape", dtype_key="input_dtype")
    out_dir = os.fspath(out_dir)
    with atomic_dir(out_dir, overwrite, command="export") as tmp:
        for b, seed in enumerate(seeds):
            watch = Stopwatch()
            module = build_module(factory, seed, factory_args, name=name)
            built = watch.seconds
            like = {LIKE_KEY: {"factory": name, "args": dict(factory_args or {}), "seed": seed}}
            proto = export_module(module, os.path.join(tmp, model_file(b)), input_shape=input_shape,
                                  input_dtype=input_dtype, record=like, **export_kwargs)
            log.debug("model %d: %s (seed %d) built in %.2f s, exported in %.2f s (%d nodes, opset %d)", b, name,
                      seed, built, watch.seconds - built, len(proto.graph.node), export_kwargs.get("opset",
                                                                                                 DEFAULT_OPSET))
        with open(os.path.join(tmp, "jobs.json"), "w") as f:
            json.dump({"count": count, "seeds": seeds,
                       "input_shape": list(input_shape) if not isinstance(input_shape, Mapping) else shapes,
                       "input_dtype": dtypes, "args": dict(factory_args or {})}, f, indent=1, default=str)
    return [os.path.join(out_dir, model_file(b)) for b in range(count)]


def build_array(model: Mapping[str, Any], array_dir: str | os.PathLike) -> None:
    """The array a run config's ``model`` section describes (``config.normalize_config``: factory, args, count,
    seeds, input_shape, input_dtype, per_model_inputs), exported (one model per seed) and fused into ``array_dir``,
    as ``onnxfuse export`` and ``onnxfuse fuse`` would. Never over an existing folder: one that is not empty (and
    holds no array) is refused."""
    import tempfile

    from onnxfuse.core.passes import fuse_models, save_array

    with tempfile.TemporaryDirectory(prefix="onnxfuse-jobs-") as jobs:
        paths = export_array(model["factory"], os.path.join(jobs, "jobs"), model["count"], model["input_shape"],
                             seeds=model["seeds"], factory_args=model["args"], input_dtype=model["input_dtype"])
        save_array(fuse_models(paths, per_model_inputs=model.get("per_model_inputs") or ()), array_dir)
    log.info("built the array in %s from model.factory %s", os.fspath(array_dir), model["factory"])
