"""The fused array as a ``torch.nn.Module``, for a PyTorch user's own training loop.

    arr = onnxfuse.fuse([net_0, net_1, net_2], torch.randn(1, 1, 8, 8))   # export, check, fuse: no file written
    out = arr(x)                           # [B, N, ...]: model b's output is out[b]
    losses = F.cross_entropy(out.flatten(0, 1), y.repeat(3), reduction="none").view(3, -1).mean(1)
    losses.sum().backward()                # each model's gradient is its own (the models share no weight)
    opt = onnxfuse.optim.AdamW(arr, lr=[1e-3, 3e-4, 1e-4]); opt.step()
    arr.load_into([net_0, net_1, net_2])   # or arr.state_dicts(): B torch state_dicts, strict=True

``fuse`` runs the pipeline the CLI runs (``export_module`` in memory, ``fuse_models``: the identity check and the
fusion, with their errors), then converts the fused graph with ``torch_graph.OnnxModule``: the fused weights are
this module's parameters and buffers (``arr.parameters()``: one tensor per fused weight, model-major, every model's
block in it; see ``onnxfuse.core.weights``). ``arr(*inputs)`` takes the graph inputs in order (or by name): a
shared input as one model takes it, a per-model input (``per_model_inputs``) with a leading model axis ``[B, ...]``;
it returns each graph output stacked, ``[B, ...]`` (one output: a tensor; several: a tuple). ``train()`` and
``eval()`` switch BatchNorm and Dropout as torch modules do (BatchNorm's running statistics update in place during
a training forward, each model's own), ``.to(device)`` moves everything, and ``torch.compile(arr)`` compiles the
interpreter's program.

The run loop's trainer (``torch_runtime.TorchTrainer``) is built on this module and ``onnxfuse.optim``: it runs
other programs over the same state (:meth:`FusedArray.program`: the fused graph with its loss, BatchNorm
statistics returned rather than written) so that one set of tensors is what the user's loop and ``onnxfuse train``
both train.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Sequence

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from onnxfuse.core._opset import onnx_opset
from onnxfuse.core.errors import ConfigError, DataError
from onnxfuse.core._graph import Names
from onnxfuse.core.passes import FusedGraph, fuse_models, save_array
from onnxfuse.core.semantics import padding_lookups
from onnxfuse.core.split import split_weights
from onnxfuse.runtime.graph_passes import weights_as_inputs_pass
from onnxfuse.runtime.torch.precision import DOMAIN, autocast_graph
from onnxfuse.runtime.torch.program import OnnxModule, TorchOptions

__all__ = ["FusedArray", "fuse", "ArrayProgram", "keep_padding_rows", "check_array"]


class ArrayProgram(torch.nn.Module):
    """Another graph over a FusedArray's weights (the fused graph with a loss, say), which reads them as inputs:
    ``program(**feeds)`` runs it with the array's current parameters and buffers, so autograd reaches them."""

    def __init__(self, array: "FusedArray", model: onnx.ModelProto, outputs: Sequence[str] | None,
                 options: TorchOptions | None):
        super().__init__()
        object.__setattr__(self, "_array", array)  # not a submodule: the array's state is the array's
        self.held = array.trainable + array.buffer_names
        self.onnx = OnnxModule(weights_as_inputs_pass(copy.deepcopy(model), self.held), trainable=[], buffers=[],
                               outputs=outputs, options=options).to(array.device)

    def forward(self, **feeds) -> tuple:
        return self.onnx(**feeds, **self._array.onnx_state())


class FusedArray(torch.nn.Module):
    """B same-architecture models as one torch module (see the module docstring). Made by :func:`fuse`, or from a
    :class:`~onnxfuse.core.passes.FusedGraph` (what ``fuse_models`` returns). ``lazy``: convert the graph for
    ``arr(...)`` at its first call (the torch runtime runs programs of its own over the weights)."""

    def __init__(self, graph: FusedGraph, lazy: bool = False):
        super().__init__()
        self.spec = graph.spec
        self.B = graph.spec.B
        self._graph, self._sources = graph.model, list(graph.sources)
        self.opset = onnx_opset(graph.model)
        self.trainable, self.buffer_names = graph.spec.parameter_names()
        # float32 bits unchanged; under a user's torch.autocast each model's arithmetic alone (autocast_graph)
        held = sum(graph.spec.parameter_names(), [])
        self.module = OnnxModule.from_array(autocast_graph(keep_padding_rows(graph.model, graph.spec), held),
                                            graph.spec, lazy=lazy)
        self.input_names = [i["name"] for i in graph.spec.inputs]
        self.per_model_inputs = [i["name"] for i in graph.spec.inputs if i.get("per_model")]
        self.output_names = [o["name"] for o in graph.spec.outputs]
        # training forwards so far: what BatchNorm's num_batches_tracked counts (state_dicts advance it by this)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))

    # ---- the weights by fused name
    @property
    def device(self) -> torch.device:
        return self.forwards.device

    def op_types(self) -> set[str]:
        """The op types of the fused graph's top level."""
        return {n.op_type for n in self._graph.graph.node}

    def parameter(self, name: str) -> torch.nn.Parameter:
        """The fused parameter ``name`` (a fused weight of ``spec``)."""
        return self.onnx_state()[name]

    def buffer(self, name: str) -> torch.Tensor:
        return self.onnx_state()[name]

    def onnx_state(self) -> dict[str, torch.Tensor]:
        """Every fused parameter and buffer by its fused name (one dict, kept until the tensors are replaced:
        ``.to()``; read at every step, so not rebuilt there)."""
        state = self.__dict__.get("_state")
        if state is None:
            state = self.__dict__["_state"] = self.module.onnx_state()
        return state

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_state", None)
        return super()._apply(fn, *args, **kwargs)

    # ---- running
    def feeds(self, inputs: Sequence, named: dict, caller: str = "the array") -> dict[str, torch.Tensor]:
        """The graph inputs by name from ``arr(*inputs, **named)``, each checked against the graph's declaration
        (:meth:`check_input`): nothing is guessed from a shape."""
        if len(inputs) > len(self.input_names):
            raise DataError(f"{caller} takes {len(self.input_names)} input(s) ({', '.join(self.input_names)}), "
                            f"got {len(inputs)}")
        feeds = dict(zip(self.input_names, inputs))
        for name, value in named.items():
            if name not in self.input_names:
                raise DataError(f"{caller} has no input '{name}'; its inputs: {', '.join(self.input_names)}")
            feeds[name] = value
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise DataError(f"missing input '{missing[0]}'; {caller} takes {', '.join(self.input_names)}")
        sizes: dict[str, tuple[int, str]] = {}  # a named dimension's size, the same in every input (N: the batch)
        for info in self.spec.inputs:
            self.check_input(info, feeds[info["name"]], sizes)
        return feeds

    def check_input(self, info: dict, x, sizes: dict[str, tuple[int, str]]) -> None:
        """``x`` is graph input ``info`` as declared: a tensor of its dtype and shape, ``[N, ...]`` for an input
        the models share and ``[B, N, ...]`` for a per-model one (``per_model_inputs``: model b's is ``x[b]``).
        A named dimension (``N``) may have any size, the same in every input of one call."""
        name, per_model = info["name"], bool(info.get("per_model"))
        if not isinstance(x, torch.Tensor):
            raise DataError(f"input '{name}' is a {type(x).__name__}; give a torch.Tensor")
        dtype = getattr(torch, info.get("dtype") or "", None)
        if isinstance(dtype, torch.dtype) and x.dtype != dtype:
            raise DataError(f"input '{name}' is {str(x.dtype).removeprefix('torch.')}, but the array's graph takes "
                            f"{info['dtype']}; convert it (x.to(torch.{info['dtype']}))")
        declared = info.get("shape")
        if declared is None:  # a graph input of unknown rank: torch's kernels say what they find
            return
        expected = ([self.B] if per_model else []) + list(declared)
        dims = [f"B={self.B}"] * per_model + [str(d) if isinstance(d, int) else (d or "?") for d in declared]
        shown = f"[{', '.join(dims)}]"
        fits = x.dim() == len(expected) and all(
            not isinstance(d, int) or d == n for d, n in zip(expected, x.shape))
        if not fits:
            if not per_model and x.dim() == len(expected) + 1 and x.shape[0] == self.B:
                hint = (f"; the models share it (model b's input is not x[b]): to give each model its own, fuse "
                        f"with per_model_inputs=['{name}']")
            elif per_model and x.dim() == len(expected) - 1:
                hint = "; it is per model (per_model_inputs): give each model's own, stacked on a first axis of B"
            else:
                hint = ""
            raise DataError(f"input '{name}' has shape {list(x.shape)}, but the array takes {shown}"
                            f"{' (per model)' if per_model else ''}{hint}")
        for d, n in zip(expected, x.shape):
            if isinstance(d, str) and d:
                seen = sizes.setdefault(d, (int(n), name))
                if seen[0] != n:
                    raise DataError(f"input '{name}' has shape {list(x.shape)}: its dimension {d} is {int(n)}, but "
                                    f"{seen[0]} in input '{seen[1]}'; the inputs of one call share {d}")

    def forward(self, *inputs, **named):
        feeds = self.feeds(inputs, named)
        if self.training:
            self.forwards.add_(1)
        out = self.module(**feeds)
        return out[0] if len(out) == 1 else out

    def program(self, model: onnx.ModelProto, outputs: Sequence[str] | None = None,
                options: TorchOptions | None = None) -> ArrayProgram:
        """``model`` (a graph over this array's fused weights: the fused graph with passes applied) run with this
        array's tensors as its weights (padding rows kept: :func:`keep_padding_rows`)."""
        return ArrayProgram(self, keep_padding_rows(model, self.spec), outputs, options)

    # ---- per-model state
    @torch.no_grad()
    def state_dicts(self, like: torch.nn.Module | None = None, allow_missing: bool = False
                    ) -> list[dict[str, torch.Tensor]]:
        """B state_dicts of torch tensors on the array's device, every key the source module has (``split``'s),
        for ``module.load_state_dict(sd, strict=True)``: trained weights unpacked, BatchNorm's
        ``num_batches_tracked`` advanced by the training forwards, other state as exported. ``like``: a module
        of the models' architecture, for an array of plain exports (ONNX files without onnxfuse's metadata): its
        keys found in the array (under other names, transposed, tied), from the array's values alone
        (:func:`~onnxfuse.exporters.state_map.split_plan`: a key the array has no value for is refused). A key
        the array records as missing is refused unless ``allow_missing``, which leaves it out."""
        from onnxfuse.core.split import check_missing

        fused = {n: t.detach() for n, t in self.onnx_state().items()}
        device = self.device
        extra, keys = None, None
        if like is not None:
            from onnxfuse.exporters.state_map import split_plan

            extra, keys, _ = split_plan(like, self.spec, self._sources[0].model if self._sources else self._graph,
                                        f"state_dicts(like=): the {type(like).__name__} given")
        check_missing(self.spec, extra, allow_missing)
        dicts = split_weights(self.spec, fused, int(self.forwards), extra)
        return [{k: v if isinstance(v, torch.Tensor) else torch.as_tensor(np.array(v)).to(device)
                 for k, v in d.items() if keys is None or k in keys} for d in dicts]

    def load_into(self, modules: Sequence[torch.nn.Module]) -> None:
        """Copy each model's state into ``modules[b]`` (``load_state_dict(strict=True)``)."""
        modules = list(modules)
        if len(modules) != self.B:
            raise ConfigError(f"load_into: {len(modules)} modules for an array of B={self.B} models")
        for b, (m, sd) in enumerate(zip(modules, self.state_dicts())):
            try:
                m.load_state_dict(sd, strict=True)
            except RuntimeError as e:
                first = " ".join(str(e).split())[:300]
                raise ConfigError(f"load_into: module {b} ({type(m).__name__}) is not model {b}'s architecture: "
                                  f"{first}") from e

    def save(self, out_dir: str | os.PathLike, overwrite: bool = False) -> str:
        """Write an array folder (``onnxfuse fuse``'s) holding the array as it is now: the CLI trains, splits and
        sweeps it from these weights (``onnxfuse train DIR``). The optimizer's state is not part of it."""
        if not self._sources:
            raise ConfigError("this FusedArray has no source graphs to save (it was made from a FusedGraph without "
                              "them); make it with onnxfuse.fuse")
        model = copy.deepcopy(self._graph)
        state = {n: t.detach().cpu().numpy() for n, t in self.onnx_state().items()}
        for init in model.graph.initializer:
            if init.name in state:
                dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
                init.CopyFrom(numpy_helper.from_array(state[init.name].astype(dtype, copy=False), init.name))
        spec = copy.deepcopy(self.spec)
        steps = int(self.forwards)
        for extra in spec.extra_state:
            for e in extra.values():
                if e.get("kind") == "bn_counter":
                    e["value"] = [int(v) + steps for v in e["value"]]
        return save_array(FusedGraph(model, spec, self._sources), out_dir, overwrite)

    def extra_repr(self) -> str:
        return f"B={self.B}, inputs={self.input_names}, outputs={self.output_names}"


def check_array(array, caller: str) -> "FusedArray":
    """``array`` if it is a FusedArray; else one ConfigError naming ``caller`` (``onnxfuse.optim.SGD``...): a plain
    torch module has no models to keep apart."""
    if not isinstance(array, FusedArray):
        plain = isinstance(array, torch.nn.Module)
        raise ConfigError(f"{caller}: the array given is a {type(array).__name__}, not a FusedArray; give the array "
                          "onnxfuse.fuse returns" + ("; for a plain torch module use torch.optim and "
                                                     "torch.nn.utils.clip_grad_norm_" if plain else ""))
    return array


def keep_padding_rows(model: onnx.ModelProto, spec) -> onnx.ModelProto:
    """``model`` with each lookup of a table that has padding rows (``onnxfuse.core.semantics``) run as the torch
    runtime's ``GatherKeepRows``: the same values, no gradient to those rows through it (``nn.Embedding``'s
    ``padding_idx``). ``model`` itself when no table has any."""
    lookups = {lk.output: lk for lk in padding_lookups(model, spec)}
    if not lookups:
        return model
    model = copy.deepcopy(model)
    names = Names.of(model.graph)
    for node in model.graph.node:
        lk = lookups.get(node.output[0]) if node.op_type == "Gather" and node.domain in ("", "ai.onnx") else None
        if lk is None:
            continue
        rows = names.fresh(f"{lk.table}__padding_rows")
        model.graph.initializer.append(numpy_helper.from_array(np.array(lk.rows, np.int64), rows))
        node.op_type, node.domain = "GatherKeepRows", DOMAIN
        node.input.append(rows)
        del node.attribute[:]  # axis 0, the only one a lookup has
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return model


def _as_tuple(example_inputs) -> tuple:
    if example_inputs is None:
        return ()
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def _names(given: Sequence[str] | None, n: int, stem: str) -> list[str]:
    if given is not None:
        given = [given] if isinstance(given, str) else list(given)
        if len(given) != n:
            raise ConfigError(f"fuse: {len(given)} {stem} names for {n} {stem}(s)")
        return given
    return [stem] if n == 1 else [f"{stem}_{k}" for k in range(n)]


def _count_outputs(module: torch.nn.Module, example: tuple) -> int:
    """How many tensors ``module`` returns (one eval-mode forward: no running statistic moves); a module that
    cannot run on ``example`` is one ConfigError, as its export would be."""
    from onnxfuse.exporters.torch_export import example_error

    was = module.training
    try:
        module.eval()
        with torch.no_grad():
            out = module(*example)
    except Exception as e:
        raise example_error(module, example, e) from e
    finally:
        module.train(was)
    return len(out) if isinstance(out, (tuple, list)) else 1


def fuse(modules: Sequence[Any], example_inputs=None, *, per_model_inputs: Sequence[str | int] = (),
         strategy: str = "default", input_names: Sequence[str] | None = None,
         output_names: Sequence[str] | None = None, strict: bool = False, opset: int | None = None,
         padding_rows: dict[str, Sequence[int]] | None = None, frozen: Sequence[str] = ()) -> FusedArray:
    """Fuse B models into a :class:`FusedArray`, in memory: torch modules (exported with ``example_inputs``, one
    model's inputs: a tensor or a tuple), ONNX files or ``onnx.ModelProto``s (as ``onnxfuse fuse`` reads them).
    ``per_model_inputs``: the inputs (names, or positions) each model is given its own of (``[B, ...]`` when
    called); ``strategy``: the fused form of nodes offering several (``onnxfuse fuse --strategy``); ``opset``: the
    export's (default ``DEFAULT_OPSET``, the CLI's); ``padding_rows`` / ``frozen``: what a plain export's graph
    cannot say (``fuse_models``'; a torch module's own are recorded by its export). The models must
    be one architecture up to weights (``NotFusibleError`` says where they differ). The array is on the device of
    the first module's parameters (CPU for files). The array computes what each torch module computes on
    ``example_inputs`` (training mode, Dropout off), or ``ExportMismatchError`` names the model and the node
    found to cause the difference (``runtime/torch/agreement.check_fused``): an exporter's mistake trains nothing."""
    from onnxfuse.exporters.torch_export import DEFAULT_OPSET, export_module  # torch.onnx: imported when exporting

    models = list(modules)
    if not models:
        raise ConfigError("fuse: no models given; pass a list of torch modules, ONNX files or ModelProtos")
    example = _as_tuple(example_inputs)
    torch_modules = [m for m in models if isinstance(m, torch.nn.Module)]
    if torch_modules and not example:
        raise ConfigError("fuse: torch modules need example_inputs (one model's inputs, e.g. torch.randn(1, 3, 32, "
                          "32)) to be exported")
    in_names = _names(input_names, len(example), "input") if torch_modules else None
    out_names = _names(output_names, _count_outputs(torch_modules[0], example), "output") if torch_modules else None
    protos, labels = [], []
    for b, m in enumerate(models):
        if isinstance(m, torch.nn.Module):
            protos.append(export_module(m, None, example_inputs=example, input_names=in_names,
                                        output_names=out_names, opset=opset or DEFAULT_OPSET))
            labels.append(f"model {b} ({type(m).__name__})")
        elif isinstance(m, (str, os.PathLike, onnx.ModelProto)):
            protos.append(m)
            labels.append(f"model {b} ({os.path.basename(os.fspath(m))})" if not isinstance(m, onnx.ModelProto)
                          else f"model {b}")
        else:
            raise ConfigError(f"fuse: model {b} is a {type(m).__name__}; give torch modules, ONNX files or "
                              "onnx.ModelProtos")
    chosen, names = [], None
    for p in per_model_inputs:
        if isinstance(p, int) and not isinstance(p, bool):
            names = names or _input_names(protos[0], in_names)
            if not 0 <= p < len(names):
                raise ConfigError(f"fuse: per_model_inputs position {p} is not an input (the models take "
                                  f"{len(names)}: {', '.join(names)})")
            chosen.append(names[p])
        else:
            chosen.append(p)
    graph = fuse_models(protos, labels, strict=strict, per_model_inputs=chosen, strategy=strategy,
                        padding_rows=padding_rows, frozen=frozen)
    arr = FusedArray(graph)
    device = next((p.device for m in torch_modules for p in m.parameters()), None)
    arr = arr.to(device) if device is not None else arr
    if torch_modules:  # the export is checked against the modules: an exporter's mistake trains nothing
        from onnxfuse.runtime.torch.agreement import check_fused

        check_fused(arr, {b: m for b, m in enumerate(models) if isinstance(m, torch.nn.Module)},
                    tuple(x.to(arr.device) if isinstance(x, torch.Tensor) else x for x in example), in_names)
    return arr


def _input_names(model, exported: list[str] | None) -> list[str]:
    """The graph inputs of the first model, in order (initializers aside)."""
    if exported is not None:
        return list(exported)
    from onnxfuse.core.source import load_source

    src = load_source(model, "model 0")
    return [vi.name for vi in src.inputs]
