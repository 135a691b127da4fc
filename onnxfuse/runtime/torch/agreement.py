"""Does an ONNX graph compute what its torch module computes? The module, run by torch, is the truth; the graph is
run as onnxfuse trains it (fused alone by ``fuse_models`` and run by the torch runtime's ``FusedArray``), on the
same sample, in one mode:

- ``training=False``: both in eval mode (BatchNorm on running statistics, Dropout off), deterministic whatever the
  export's mode: the check that a file's weights are the module's (``fuse --like``, ``split --like``);
- ``training=True``: both in training mode with every Dropout off (the graph's nodes removed, torch's dropout
  functions made the identity for the module's forward), so BatchNorm uses batch statistics: the check of a
  graph onnxfuse is about to train (its own export, ``onnxfuse.fuse``'s).

Both leave the module's state (BatchNorm running statistics) and mode as they were. What passes is derived from
the module's own rounding, never tuned: each output may differ by ``FACTOR`` times what float32 rounding moves
the module alone (its float64 run; where the module cannot run in float64, what nudging its weights by one float32
step moves it), and by ``FLOOR`` of its norm (two float32 programs summing in other orders). A graph that differs
beyond that is an :class:`~onnxfuse.core.errors.ExportMismatchError` naming the first output that differs and,
where it can be found, the node that causes it (a Scatter without reduction writing one position twice: torch's
``index_add_`` as the exporters write it, where the last write wins and torch sums).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import onnx
import torch

from onnxfuse.core._graph import node_label
from onnxfuse.core._opset import is_training_batchnorm, onnx_opset
from onnxfuse.core.errors import ConfigError, ExportMismatchError
from onnxfuse.core.source import tensor_shape
from onnxfuse.runtime.graph_passes import without_dropout

__all__ = ["dropout_off", "sample_inputs", "module_outputs", "graph_outputs", "Disagreement", "disagreement",
           "check_agreement", "mismatch", "check_fused", "parameters_read", "forward_parameters", "FACTOR", "FLOOR"]

FACTOR = 8.0  # two float32 programs of one function, each about as far from exact as torch's float32 run is
FLOOR = 2.0 ** -17  # relative: a few roundings of the output itself, summed in another order
SAMPLE_DIM = 4  # a symbolic dimension of the sample (the batch: BatchNorm's statistics need more than one)

# torch's dropout entry points: the identity while ``dropout_off`` holds (nn.Dropout* call these functionals)
_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


@contextlib.contextmanager
def dropout_off():
    """torch's dropout functions pass their input through, and attention's ``dropout_p`` is 0, meanwhile."""
    F = torch.nn.functional
    saved = {n: getattr(F, n) for n in _DROPOUTS}
    sdpa, mha, td = F.scaled_dot_product_attention, F.multi_head_attention_forward, torch.dropout

    def identity(x, *args, **kwargs):
        return x

    def no_drop(f, key: str) -> Callable:
        def call(*args, **kwargs):
            kwargs[key] = 0.0
            return f(*args, **kwargs)
        return call

    try:
        for n in _DROPOUTS:
            setattr(F, n, identity)
        torch.dropout = identity
        F.scaled_dot_product_attention = no_drop(sdpa, "dropout_p")
        F.multi_head_attention_forward = _mha_without_dropout(mha)
        yield
    finally:
        for n, f in saved.items():
            setattr(F, n, f)
        torch.dropout, F.scaled_dot_product_attention, F.multi_head_attention_forward = td, sdpa, mha


def _mha_without_dropout(mha: Callable) -> Callable:
    """``F.multi_head_attention_forward`` with ``dropout_p`` 0, given by position (nn.MultiheadAttention) or name."""
    position = list(inspect.signature(mha).parameters).index("dropout_p")

    def call(*args, **kwargs):
        if len(args) > position:
            args = args[:position] + (0.0,) + args[position + 1:]
        else:
            kwargs["dropout_p"] = 0.0
        return mha(*args, **kwargs)
    return call


# ---------------------------------------------------------------------------------------------------- the sample
def _vocab(proto: onnx.ModelProto, name: str) -> int | None:
    """The rows of the smallest table an integer input ``name`` indexes directly (Gather's indices), if any."""
    inits = {t.name: t for t in proto.graph.initializer}
    rows = [int(inits[n.input[0]].dims[0]) for n in proto.graph.node
            if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == name and n.input[0] in inits
            and inits[n.input[0]].dims]
    return min(rows) if rows else None


def sample_inputs(proto: onnx.ModelProto, shapes: dict[str, Sequence[int]] | Sequence[int] | None = None,
                  seed: int = 0) -> tuple[list[str], tuple[torch.Tensor, ...]]:
    """The graph inputs' names and one sample of each: the shapes given (``shapes`` by input name, or one shape
    for a graph of one input), else the graph's, each symbolic dimension ``SAMPLE_DIM``; floats random normal,
    integers random below the rows of the table they index (zeros where they index none), booleans True."""
    inits = {t.name for t in proto.graph.initializer}
    first = next((vi.name for vi in proto.graph.input if vi.name not in inits), None)
    if shapes is not None and not isinstance(shapes, dict):
        shapes = {first: list(shapes)}
    unknown = sorted(set(shapes or {}) - {vi.name for vi in proto.graph.input})
    if unknown:
        raise ConfigError(f"input_shape: '{unknown[0]}' is not an input of the file; its inputs: "
                          f"{', '.join(vi.name for vi in proto.graph.input if vi.name not in inits)}")
    gen = torch.Generator().manual_seed(seed)
    names, tensors = [], []
    for vi in proto.graph.input:
        if vi.name in inits:
            continue
        shape = list((shapes or {}).get(vi.name) or [d if isinstance(d, int) else SAMPLE_DIM
                                                     for d in (tensor_shape(vi.type) or [])])
        dtype = getattr(torch, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)).name)
        if dtype.is_floating_point:
            x = torch.randn(*shape, generator=gen).to(dtype)
        elif dtype == torch.bool:
            x = torch.ones(*shape, dtype=dtype)
        else:
            vocab = _vocab(proto, vi.name)
            x = torch.randint(0, vocab, shape, generator=gen, dtype=dtype) if vocab else torch.zeros(*shape,
                                                                                                  dtype=dtype)
        names.append(vi.name)
        tensors.append(x)
    return names, tuple(tensors)


# ---------------------------------------------------------------------------------------------- running each side
def _flat(out) -> list[torch.Tensor]:
    """The tensors of a module's output in the order torch's exporters flatten it (tuples, lists, dicts and
    transformers' ModelOutput, None left out)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def forward_parameters(module: torch.nn.Module) -> list[str]:
    """The parameter names of ``module.forward`` ([] where its signature cannot be read)."""
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def _call(module: torch.nn.Module, names: Sequence[str], inputs: tuple) -> object:
    """``module`` on ``inputs``: by keyword when every graph input is a parameter of its forward, else in order."""
    params = forward_parameters(module)
    if names and all(n in params for n in names):
        return module(**dict(zip(names, inputs)))
    return module(*inputs)


@contextlib.contextmanager
def _kept(module: torch.nn.Module, training: bool):
    """``module`` in ``training`` mode meanwhile, its state (running statistics) and mode restored after."""
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    was = module.training
    module.train(training)
    try:
        yield module
    finally:
        with torch.no_grad():
            module.load_state_dict(state)
        module.train(was)


def module_outputs(module: torch.nn.Module, names: Sequence[str], inputs: tuple, training: bool) -> list[torch.Tensor]:
    """The module's outputs on ``inputs`` in ``training`` mode (dropout off), as the exporters flatten them."""
    with _kept(module, training), dropout_off(), torch.no_grad():
        return [t.detach().clone() for t in _flat(_call(module, names, inputs))]


def parameters_read(module: torch.nn.Module, names: Sequence[str], inputs: tuple) -> set[str]:
    """The parameters (by state_dict key) the module's eval-mode forward reads: a gradient of its outputs reaches
    them. A module whose outputs carry no gradient reads all (nothing is concluded)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    with _kept(module, False), dropout_off(), torch.enable_grad():
        for p in params.values():
            p.grad = None
        outs = [t for t in _flat(_call(module, names, inputs)) if t.requires_grad and t.is_floating_point()]
        if not outs:
            return set(params)
        sum(o.float().sum() for o in outs).backward()
        read = {k for k, p in params.items() if p.grad is not None}
        for p in params.values():
            p.grad = None
    return read


def graph_outputs(proto: onnx.ModelProto, names: Sequence[str], inputs: tuple, training: bool) -> list[torch.Tensor]:
    """``proto``'s outputs on ``inputs`` as onnxfuse trains it: fused alone and run by the torch runtime, in
    ``training`` mode with every Dropout off."""
    from onnxfuse.core.passes import fuse_models
    from onnxfuse.runtime.torch.program import OnnxModule

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what fusion says of the file is said where the file is fused
        graph = fuse_models([without_dropout(proto)], ["check"])
    run = OnnxModule(graph.model).train(training)
    with torch.no_grad():  # every input is shared by the one model: each output comes back [1, ...]
        out = run(**dict(zip(names, inputs)))
    return [t[0] for t in out]


# ---------------------------------------------------------------------------------------------------- comparing
@dataclass
class Disagreement:
    """The first output that differs: its position and name, how far (relative), what rounding allows."""

    index: int
    name: str
    rel: float
    bound: float
    count: bool = False  # the graph and the module return different numbers of outputs

    def describe(self) -> str:
        if self.count:
            return f"returns {self.index} output(s) where the module returns {self.rel:g}"
        return (f"output '{self.name}' differs from the module's by {self.rel:.3g} (relative; float32 rounding "
                f"allows {self.bound:.2g})")


def _double(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module).double()


def _sensitivity(module: torch.nn.Module, names, inputs: tuple, training: bool, ref: list[torch.Tensor]
                 ) -> list[float]:
    """Per output, how far float32 rounding moves the module alone: ||float32 - float64||, or, where it cannot
    run in float64, ||weights nudged by one float32 step - as is||."""
    try:
        exact = module_outputs(_double(module), names, tuple(x.double() if x.is_floating_point() else x
                                                             for x in inputs), training)
    except Exception:  # a module that builds float32 tensors of its own: nudge instead
        nudged = copy.deepcopy(module)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for t in list(nudged.parameters()) + list(nudged.buffers()):
                if t.is_floating_point():
                    t.mul_(1 + 2.0 ** -23 * torch.randn(t.shape, generator=gen).sign())
        exact = module_outputs(nudged, names, inputs, training)
    return [float(torch.linalg.vector_norm((r.double() - e.double()).nan_to_num())) if r.is_floating_point()
            and e.shape == r.shape else 0.0 for r, e in zip(ref, exact)]


def disagreement(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], sensitivity: Callable[[], list[float]],
                 output_names: Sequence[str]) -> Disagreement | None:
    """The first of ``got`` (the graph's outputs) that differs from ``ref`` (the module's) beyond rounding;
    ``sensitivity()`` (asked only for an output beyond ``FLOOR``) gives each output's, as :func:`_sensitivity`."""
    if len(got) != len(ref):
        return Disagreement(len(got), "", float(len(ref)), 0.0, count=True)
    measured: list[float] = []
    for k, (g, r) in enumerate(zip(got, ref)):
        name = output_names[k] if k < len(output_names) else f"#{k}"
        if tuple(g.shape) != tuple(r.shape):
            return Disagreement(k, name, math.inf, 0.0)
        if not r.is_floating_point():
            if not torch.equal(g.to(r.dtype), r):
                return Disagreement(k, name, 1.0, 0.0)
            continue
        g, r = g.double(), r.double()
        same = (g == r) | (torch.isnan(g) & torch.isnan(r))  # equal infinities and NaNs where both have them
        diff = float(torch.linalg.vector_norm(torch.where(same, 0.0, g - r)))
        norm = float(torch.linalg.vector_norm(torch.where(torch.isfinite(r), r, 0.0)))
        bound = FLOOR * norm
        if not diff <= bound:  # NaN differs
            measured = measured or sensitivity()
            bound = max(bound, FACTOR * measured[k])
        if not diff <= bound:
            return Disagreement(k, name, diff / norm if norm else math.inf, bound / norm if norm else bound)
    return None


def check_agreement(module: torch.nn.Module, proto: onnx.ModelProto, names: Sequence[str], inputs: tuple,
                    training: bool, label: str, fix: str) -> None:
    """``proto`` computes what ``module`` computes on ``inputs`` in ``training`` mode (see the module docstring);
    else one ExportMismatchError naming ``label``, the first output that differs, the node found to cause it
    and ``fix``."""
    ref = module_outputs(module, names, inputs, training)
    got = graph_outputs(proto, names, inputs, training)
    found = disagreement(got, ref, lambda: _sensitivity(module, names, inputs, training, ref),
                         [o.name for o in proto.graph.output])
    if found is not None:
        raise mismatch(found, proto, module, names, inputs, training, label, fix)


def mismatch(found: Disagreement, proto: onnx.ModelProto, module: torch.nn.Module, names, inputs, training: bool,
             label: str, fix: str) -> ExportMismatchError:
    """The one-line error for ``found``: what differs, the node found to cause it, ``fix``."""
    node, cause = _cause(proto, module, names, inputs, training)
    mode = "training mode (Dropout off)" if training else "eval mode"
    return ExportMismatchError(f"{label}: the ONNX graph does not compute what {type(module).__name__} computes in "
                               f"{mode}: {found.describe()}{'; ' + cause if cause else ''}; {fix}",
                               output=found.name, node=node)


# ---------------------------------------------------------------------------------------------------- why
def _cause(proto: onnx.ModelProto, module: torch.nn.Module, names, inputs, training: bool) -> tuple[str, str]:
    """(node, words) for what makes ``proto`` differ from ``module``, where a known cause is found; ('', '')."""
    scatter = _repeated_scatter(proto, names, inputs)
    if scatter is not None:
        return scatter
    opset = onnx_opset(proto)
    bns = [n for n in proto.graph.node if n.op_type == "BatchNormalization"]
    torch_bns = [name for name, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if training and torch_bns and not bns:
        return "", (f"the module's BatchNorm layer(s) ({', '.join(torch_bns[:3])}) are not in the graph: an eval-mode "
                    "or dynamo export folds them into the Conv before them")
    frozen = [n for n in bns if not is_training_batchnorm(n, opset)]
    if training and frozen:
        return node_label(frozen[0]), (f"its BatchNormalization '{node_label(frozen[0])}' runs on running statistics "
                                       "in training mode too (an inference-mode export)")
    return "", ""


def _repeated_scatter(proto: onnx.ModelProto, names, inputs) -> tuple[str, str] | None:
    """A ScatterElements / ScatterND without reduction whose indices on ``inputs`` write one position twice:
    ONNX leaves which write wins undefined (the last one, in practice), torch's ``index_add_`` sums them."""
    from onnxfuse.runtime.torch.program import OnnxModule

    scatters = [n for n in proto.graph.node if n.op_type in ("ScatterElements", "ScatterND")
                and next((a.s for a in n.attribute if a.name == "reduction"), b"none") in (b"none", b"")]
    if not scatters:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe = OnnxModule(proto, trainable=[], outputs=[n.input[1] for n in scatters]).eval()
            with torch.no_grad():
                indices = probe(**dict(zip(names, inputs)))
    except Exception:  # the raw file does not run alone: no node is named
        return None
    for node, idx in zip(scatters, indices):
        idx = idx.cpu().numpy()
        if node.op_type == "ScatterND":
            rows = idx.reshape(-1, idx.shape[-1]) if idx.ndim else idx.reshape(1, -1)
        else:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0) % max(idx.ndim, 1)
            where = np.indices(idx.shape).reshape(idx.ndim, -1).T.copy()
            where[:, axis] = idx.reshape(-1)
            rows = where
        repeats = len(rows) - len(np.unique(rows, axis=0))
        if repeats:
            return node_label(node), (
                f"its node '{node_label(node)}' ({node.op_type} without a reduction) writes {repeats} value(s) to "
                "positions another value of it also writes, where only the last write is kept; torch's "
                "index_add_ sums them (the exporters write index_add_ so); write the model with scatter_add / "
                "index_put_(..., accumulate=True), which export a summing Scatter")
    return None


# ---------------------------------------------------------------------------------------------------- an array
def check_fused(arr, modules: dict[int, torch.nn.Module], example: tuple, input_names: Sequence[str]) -> None:
    """``onnxfuse.fuse``'s check of its own export: array ``arr`` (a FusedArray; ``modules``: model b's torch
    module by b, per-model inputs stacked) computes what each module computes on ``example`` (one model's inputs),
    in training mode with Dropout
    off (in eval mode where a module cannot run a training forward on it: BatchNorm on a batch of one); else one
    ExportMismatchError naming the model and the node found to cause it. The array's state and mode are kept."""
    from onnxfuse.core.passes import FusedGraph
    from onnxfuse.runtime.graph_passes import has_random_dropout

    training = True
    try:
        refs = {b: module_outputs(m, input_names, example, True) for b, m in modules.items()}
    except Exception:
        training = False
        refs = {b: module_outputs(m, input_names, example, False) for b, m in modules.items()}
    check = arr
    if has_random_dropout(arr._graph):
        check = type(arr)(FusedGraph(without_dropout(arr._graph), arr.spec, arr._sources)).to(arr.device)
        check.load_state_dict(arr.state_dict())
    feeds = {n: (x.expand(arr.B, *x.shape) if n in arr.per_model_inputs else x) for n, x in zip(input_names, example)}
    with _kept(check, training), torch.no_grad():
        out = check(**feeds)
    out = out if isinstance(out, tuple) else (out,)
    for b, module in modules.items():
        got, ref = [t[b] for t in out], refs[b]
        found = disagreement(got, ref, lambda: _sensitivity(module, input_names, example, training, ref),
                             arr.output_names)
        if found is not None:
            proto = arr._sources[b].model if arr._sources else arr._graph
            raise mismatch(found, proto, module, input_names, example, training, f"onnxfuse.fuse: model {b} "
                           f"({type(module).__name__})", "the array is not made (torch's exporter wrote a graph that "
                           "computes something else)")
