"""Which initializer of an ONNX file holds each ``state_dict`` entry of a torch module, read from the file as any
exporter wrote it: the module is the truth for what each key is, the file for its value.

Exporters keep a parameter's name, or rewrite it:

- TorchScript with constant folding (its default, in eval and in training mode) folds a Linear's ``W.t()`` into a
  new initializer ``onnx::MatMul_88`` = W^T, read by a MatMul at input 1; in eval mode it folds BatchNorm into
  the Conv before it (``onnx::Conv_16``) and merges initializers of equal value, the merged key becoming an
  ``Identity`` of the kept one (``layers.1.ln.weight = Identity(layers.0.ln.weight)``).
- torch's dynamo exporter's optimizer does the same with names ``val_N``, merging by reading one initializer
  from several nodes; each node records the torch.fx node it came from, whose arguments name the module's
  parameters and buffers (``_dynamo_file.node_references``).

So a key is found (:func:`map_state`): by its name; as the output of an Identity of an initializer; or among the
keys the reading node refers to (the dynamo record), else the keys of the module the node runs in (its name
scope, ``/encoder/layer.0/attention/self/query/MatMul`` in TorchScript), one of the right shape, transposed
for a Linear's weight read by a MatMul, picked by the slot it is read at (a LayerNormalization's input 1 is
``weight``, input 2 ``bias``) when several fit. What is found is a claim about the file, which
``runtime/torch/agreement.py`` checks by running the file beside the module before anything trains.
What is not found is named with why: a BatchNorm counter (counted by onnxfuse from then on), a buffer the export
computed into a constant (the class's own value, checked by that forward), a parameter the forward never reads,
and a parameter the forward reads that the file lost (folded, merged into a computed value): refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from onnxfuse.core._dynamo_file import node_references, read_dynamo_file

__all__ = ["Source", "StateMap", "map_state", "module_keys", "KeyInfo", "node_module", "split_plan"]

# the slot an op reads a module's tensor at, by the tensor's name in the module: the tie-break among keys of one
# module with the shape of the initializer read there (a LayerNorm's weight and bias are both [D])
SLOTS: dict[str, dict[int, str]] = {
    "Conv": {1: "weight", 2: "bias"}, "ConvTranspose": {1: "weight", 2: "bias"},
    "Gemm": {1: "weight", 2: "bias"}, "MatMul": {0: "weight", 1: "weight"}, "Add": {0: "bias", 1: "bias"},
    "LayerNormalization": {1: "weight", 2: "bias"}, "InstanceNormalization": {1: "weight", 2: "bias"},
    "GroupNormalization": {1: "weight", 2: "bias"}, "Gather": {0: "weight"}, "PRelu": {1: "weight"},
    "BatchNormalization": {1: "weight", 2: "bias", 3: "running_mean", 4: "running_var"},
}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class KeyInfo:
    """One entry of the module's state: a ``state_dict`` key, or a non-persistent buffer (not in the state_dict)."""

    key: str
    kind: str  # "parameter" | "buffer"
    shape: tuple[int, ...]
    dtype: str
    persistent: bool = True
    requires_grad: bool = False
    alias_of: str | None = None  # the same tensor as this key (tied): filled from it
    counter: bool = False  # BatchNorm's num_batches_tracked


@dataclass(frozen=True)
class Source:
    """Where a key's value is in the file: initializer ``init``, transposed or not, and how it was found."""

    init: str
    transposed: bool = False
    how: str = "name"  # name | identity | reference | scope | merged

    def describe(self) -> str:
        return f"'{self.init}'" + (" transposed" if self.transposed else "") + (
            "" if self.how == "name" else f" ({self.how})")


@dataclass
class StateMap:
    """Every key of the module: found in the file (``found``) or why not."""

    keys: dict[str, KeyInfo]
    found: dict[str, Source] = field(default_factory=dict)
    counters: list[str] = field(default_factory=list)  # num_batches_tracked: counted from the steps trained
    class_buffers: list[str] = field(default_factory=list)  # buffers the export computed into constants
    unread: list[str] = field(default_factory=list)  # parameters not in the file that the forward never reads
    lost: list[str] = field(default_factory=list)  # parameters the forward reads that the file holds no value for
    strays: list[str] = field(default_factory=list)  # float initializers that stand for no key

    def value(self, key: str, inits: Mapping[str, np.ndarray]) -> np.ndarray:
        """Key ``key``'s value in the file whose initializers are ``inits`` (it must be found)."""
        src = self.found[key]
        v = np.asarray(inits[src.init])
        return np.ascontiguousarray(v.T) if src.transposed else v

    def state(self, inits: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """{key: value} of every key found, ties filled from the key they alias."""
        out = {k: self.value(k, inits) for k in self.found}
        for k, info in self.keys.items():
            if info.alias_of is not None and info.alias_of in out and k not in out:
                out[k] = out[info.alias_of]
        return out


def module_keys(module: torch.nn.Module) -> dict[str, KeyInfo]:
    """What each entry of ``module``'s state is: parameter or buffer, persistent, trainable, tied, a counter."""
    params = dict(module.named_parameters(remove_duplicate=False))
    persistent = set(module.state_dict(keep_vars=True))
    counters = {f"{name}.num_batches_tracked".lstrip(".") for name, m in module.named_modules()
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats}
    first: dict[int, str] = {}
    out: dict[str, KeyInfo] = {}
    tensors = {**dict(module.named_buffers(remove_duplicate=False)), **params}
    for key, t in module.state_dict(keep_vars=True).items():
        tensors.setdefault(key, t)
    for key, t in tensors.items():
        ident = id(t)
        alias = first.get(ident)
        first.setdefault(ident, key)
        out[key] = KeyInfo(key, "parameter" if key in params else "buffer", tuple(t.shape),
                           str(t.dtype).removeprefix("torch."), key in persistent,
                           key in params and t.requires_grad, alias if alias != key else None, key in counters)
    return out


def node_module(node: onnx.NodeProto, modules: set[str]) -> str | None:
    """The path of the module ``node`` runs in (a name of ``modules``), from its name scope: the dynamo exporter's
    record, or the TorchScript node name ``/seq/seq.0/Gemm`` whose parts are names relative to the part before or
    from the root; None when the node says nothing that resolves."""
    meta = {p.key: p.value for p in node.metadata_props}
    scopes = meta.get("pkg.torch.onnx.name_scopes")
    if scopes:
        import ast

        try:
            parts = ast.literal_eval(scopes)
        except (ValueError, SyntaxError):
            parts = []
        for path in reversed(parts[:-1]):
            if path in modules:
                return path
        return None
    if not node.name.startswith("/"):
        return None
    path = ""
    for part in node.name.split("/")[1:-1]:
        joined = f"{path}.{part}" if path else part
        if joined in modules:
            path = joined
        elif part in modules:
            path = part
        else:
            return None
    return path or None


def map_state(module: torch.nn.Module, proto: onnx.ModelProto, inits: Mapping[str, np.ndarray] | None = None,
              read: set[str] | None = None) -> StateMap:
    """Find each key of ``module`` in ``proto`` (its initializers' values ``inits``, default the file's own).
    ``read``: the parameters the module's forward reads (a gradient reaches them), which tells a parameter the
    file lost from one no export keeps; None counts every parameter as read."""
    if inits is None:
        inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    keys = module_keys(module)
    smap = StateMap(keys)
    modules = {name for name, _ in module.named_modules() if name}

    def fits(key: str, init: str) -> bool | None:
        """None: the shapes do not fit; else whether the initializer is the key transposed."""
        ks, shape = keys[key].shape, tuple(np.shape(inits[init]))
        if ks == shape:
            return False
        return True if len(ks) == 2 and ks[::-1] == shape else None

    for key, info in keys.items():
        if info.alias_of is None and key in inits and fits(key, key) is False:
            smap.found[key] = Source(key)
    _identities(proto, keys, inits, smap)
    _by_reference(proto, module, keys, modules, inits, smap, fits)
    for key, info in keys.items():
        if key in smap.found or info.alias_of is not None:
            continue
        if info.counter:
            smap.counters.append(key)
        elif info.kind == "buffer":
            if info.persistent:
                smap.class_buffers.append(key)
        elif read is not None and key not in read:
            smap.unread.append(key)
        else:
            smap.lost.append(key)
    used = {s.init for s in smap.found.values()}
    smap.strays = sorted(n for n, v in inits.items() if n not in used and np.issubdtype(np.asarray(v).dtype,
                                                                                     np.floating))
    return smap


def _identities(proto: onnx.ModelProto, keys: dict[str, KeyInfo], inits: Mapping, smap: StateMap) -> None:
    """A key that is a tensor of the graph computed by Identity from an initializer (TorchScript's merge of equal
    values): that initializer."""
    made = {n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "Identity" and n.input and n.output}
    for key in keys:
        if key in smap.found or key not in made:
            continue
        src, seen = made[key], {key}
        while src not in inits and src in made and src not in seen:
            seen.add(src)
            src = made[src]
        if src in inits and tuple(np.shape(inits[src])) == keys[key].shape:
            smap.found[key] = Source(src, how="merged" if src in keys else "identity")


def _by_reference(proto, module, keys, modules, inits, smap, fits) -> None:
    """Each remaining initializer a node reads, matched among the keys that node refers to (the dynamo record)
    or that belong to the module it runs in (its name scope). An initializer already found for another key and
    read here, where that key is not referred to, is a merge: the key read here has the same value."""
    dynamo = read_dynamo_file(proto)
    refs_of = node_references(proto) if dynamo is not None else {}
    linear = {name for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    owner = {s.init: k for k, s in smap.found.items()}
    for node in proto.graph.node:
        refs = refs_of.get(node.name)
        if refs is None:
            where = node_module(node, modules)
            if where is None:
                continue
            refs = {k for k in keys if k.rpartition(".")[0] == where}
        for pos, init in enumerate(node.input):
            if init not in inits or not refs:
                continue
            if init in owner and owner[init] in refs:
                continue  # read where its own key is referred to
            cands = [k for k in sorted(refs) if k not in smap.found and keys[k].alias_of is None
                     and fits(k, init) is not None and np.asarray(inits[init]).dtype.kind == "f" and
                     keys[k].dtype in ("float32", "float64", "float16", "bfloat16")]
            if len(cands) > 1:
                slot = SLOTS.get(node.op_type, {}).get(pos)
                cands = [k for k in cands if k.rpartition(".")[2] == slot]
            if len(cands) != 1:
                continue
            key = cands[0]
            transposed = bool(fits(key, init))
            if not transposed and len(keys[key].shape) == 2 and keys[key].shape[0] == keys[key].shape[1]:
                # a square Linear weight read by a MatMul as its right operand: torch's x @ W^T, folded to W^T
                transposed = node.op_type == "MatMul" and pos == 1 and key.rpartition(".")[0] in linear
            how = "merged" if init in owner else ("reference" if refs_of else "scope")
            smap.found[key] = Source(init, transposed, how)
            owner.setdefault(init, key)


def _listed(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def split_plan(module: torch.nn.Module, spec, source: onnx.ModelProto, name: str
               ) -> tuple[dict, set[str] | None, list[str]]:
    """What ``split --like`` (``FusedArray.state_dicts(like=)``) writes for ``module``'s keys, from the array's
    values alone: ``(extra, keys, notes)``, the extra state to add to each split state (a key the graph holds
    under another name, transposed or not, or a tied key: an ``alias`` of that initializer; BatchNorm's counter:
    the steps trained, as the file holds none), the keys the state_dicts hold (the module's persistent ones; None:
    the array's record, as it is) and what to say of the choices. ``spec``: the array's; ``source``: model 0's
    graph as fused (weights stripped). A key the array has no value for is one ConfigError naming it: never a
    fresh instance's value."""
    from onnxfuse.core.errors import ConfigError
    from onnxfuse.core.source import METADATA_KEY
    from onnxfuse.core.split import check_like, graph_keys

    import json

    meta = json.loads(next((p.value for p in source.metadata_props if p.key == METADATA_KEY), "{}"))
    keys = module_keys(module)
    persistent = {k for k, i in keys.items() if i.persistent}
    fix = "give the class (and factory arguments) the models were made with"
    if "trainable" in meta:  # the array records every key: onnxfuse export, onnxfuse.fuse, fuse --like
        check_like(spec, module.state_dict(), name)
        lacking = sorted(persistent - graph_keys(spec))
        if lacking:
            raise ConfigError(f"{name} has key(s) {_listed(lacking)} that the array's models do not have; {fix}")
        return {}, None, []
    inits = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer}
    inits.update({fw.sources[0]: np.zeros(fw.orig_shape, fw.dtype) for fw in spec.weights.values()})
    smap = map_state(module, source, inits)
    lacking = smap.lost + smap.unread + smap.class_buffers
    if lacking:
        raise ConfigError(f"{name}: the array holds no value for {_listed(sorted(lacking))} (the file it was fused "
                          "from does not: folded into other weights, computed into constants or never exported), and "
                          "split writes only the array's values; fuse with like=MODULE:FACTORY (which checks the "
                          "file against the class) or export with `onnxfuse export`, then train again; or split "
                          "without it")
    extra: dict = {}
    for key, src in smap.found.items():
        if key in persistent and (src.init != key or src.transposed):
            extra[key] = {"kind": "alias", "of": src.init, "transposed": src.transposed}
    for key, info in keys.items():
        if info.alias_of is not None and key in persistent and key not in smap.found:
            src = smap.found.get(info.alias_of, Source(info.alias_of))
            extra[key] = {"kind": "alias", "of": src.init, "transposed": src.transposed}
    notes = []
    for key in smap.counters:
        extra[key] = {"kind": "bn_counter", "dtype": keys[key].dtype, "shape": list(keys[key].shape), "value": [0]}
    if smap.counters:
        notes.append(f"{_listed(smap.counters)}: not in the file; written as the steps this array trained (the "
                     "count before the file was exported is not known)")
    strays = sorted(set(smap.strays) & {fw.sources[0] for fw in spec.weights.values()})
    if strays:
        notes.append(f"weight(s) {_listed(strays)} of the array stand for no key of {type(module).__name__}: in "
                     "the split ONNX files, not in the state_dicts")
    return extra, persistent, notes
