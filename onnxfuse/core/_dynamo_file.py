"""What a file from torch's dynamo exporter (``torch.onnx.export(..., dynamo=True)``, torch's default since 2.9)
says about itself, read from the metadata that exporter writes (no torch needed), and what it means for training:

- The graph signature of the ``torch.export.ExportedProgram`` it came from names each of the module's parameters,
  buffers and constant tensors by its state_dict key, which is the initializer's name (:func:`read_dynamo_file`).
  A buffer (a causal mask) is state, not a parameter: it is not trained (:func:`signature_trainable`).
- Each node carries the torch.fx node it was exported from (``%linear = aten.linear(%x, %p_fc_weight, ...)``), whose
  arguments name the parameters torch reads there. Comparing them with the initializers the node reads shows what
  onnxscript's optimizer (``optimize=True``, the default) did to the parameters: a transpose folded into a new
  initializer (``val_7`` = W.T, read where W was: a weight of its own, trained as torch trains W), initializers
  of equal value merged into one (every LayerNorm weight of a fresh model is ones: they become one tensor, trained
  as one), an all-zero bias dropped (never trained), a parameter folded into a value computed at export.
- A float initializer that stands for no parameter is a constant of the forward's code (ReLU6's bounds as ``Clip``'s
  min and max, attention's scale): not a weight, the same in every model (:func:`exporter_constants`).
- A BatchNorm the module ran in training mode never reaches the file as one: the exporter writes an inference-mode
  BatchNormalization, which its optimizer folds into the Conv, ConvTranspose or Gemm before it.

Only what the metadata shows is acted on: a file without it (another exporter, metadata stripped) keeps every float
initializer a trained weight, as any file without onnxfuse's metadata does.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import onnx

from onnxfuse.core._graph import node_label, outer_reads
from onnxfuse.core._opset import is_training_batchnorm, onnx_opset

__all__ = ["SIGNATURE_KEY", "DynamoFile", "read_dynamo_file", "exporter_constants", "signature_trainable",
           "dynamo_file_warnings", "node_references", "non_persistent_buffers"]

SIGNATURE_KEY = "pkg.torch.export.ExportedProgram.graph_signature"  # on the graph: str(ExportGraphSignature)
RULE_KEY = "pkg.onnxscript.rewriter.rule_name"  # on a node the optimizer rewrote: the rules applied
FX_NODE_KEY = "pkg.torch.onnx.fx_node"  # on a node: the torch.fx node it was exported from
SCOPES_KEY = "pkg.torch.onnx.name_scopes"  # on a node: the module path down to it, e.g. ['', 'encoder', 'encoder.norm2',
# 'layer_norm_1']
# torch.fx names a node after its target: operator.getitem picks one output of a node that has several, which the
# ONNX node exported from that node writes itself (so a getitem has no node of its own and folds nothing)
_GETITEM = re.compile(r"getitem(_\d+)?$")
# one input of the signature: "p_fc1_weight: PARAMETER target='fc1.weight'", "b_mask: BUFFER target='mask'
# persistent=False", "x: USER_INPUT"
_INPUT_SPEC = re.compile(r"^(?P<arg>\S+): (?P<kind>[A-Z_]+)(?: target='(?P<target>[^']*)')?", re.M)
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                onnx.TensorProto.BFLOAT16}
_TRAINING_BATCHNORM = "_native_batch_norm_legit_functional"  # torch.fx's training-mode batch_norm
_SHOWN = 3  # names listed in a warning before "and N more"


@dataclass
class _FxNode:
    """The ONNX nodes exported from one torch.fx node, and what torch reads there."""

    refs: set[str] = field(default_factory=set)  # the parameters (state_dict keys) its arguments name
    module: str = ""  # the path of the module it runs in
    args: set[str] = field(default_factory=set)  # every torch.fx value its arguments name
    reads: set[str] = field(default_factory=set)  # the initializers its ONNX nodes read
    nodes: list = field(default_factory=list)


@dataclass
class DynamoFile:
    """What :func:`read_dynamo_file` found; every name is a state_dict key or an initializer name."""

    kinds: dict[str, str]  # state_dict key -> PARAMETER | BUFFER | CONSTANT_TENSOR
    constants: set[str]  # float initializers that stand for no parameter
    merged: list[str]  # parameters whose nodes read another parameter's initializer instead (equal values merged)
    dropped: list[str]  # parameters torch reads at a node that reads neither them nor any value made of them
    computed: list[str]  # parameters no node reads any more: folded into values computed at export
    lost_batchnorms: list[onnx.NodeProto]  # nodes where a training-mode BatchNorm became an inference-mode one


def _non_differentiable(node: onnx.NodeProto, position: int, opset: int) -> bool:
    """ONNX's schema declares input ``position`` of ``node`` non-differentiable (False when it does not know)."""
    if node.domain not in ("", "ai.onnx"):
        return False
    try:
        formal = onnx.defs.get_schema(node.op_type, opset, "").inputs
    except onnx.defs.SchemaError:
        return False
    if not formal:
        return False
    category = formal[min(position, len(formal) - 1)].differentiation_category
    return category == onnx.defs.OpSchema.DifferentiationCategory.NonDifferentiable


def read_dynamo_file(proto: onnx.ModelProto) -> DynamoFile | None:
    """The dynamo exporter's record in ``proto`` (None when it has no graph signature: not from that exporter)."""
    specs = _signature_inputs(proto)
    if specs is None:
        return None
    kinds = {m["target"]: m["kind"] for m in specs if m["target"] is not None}
    param_of_arg = {m["arg"]: m["target"] for m in specs if m["kind"] == "PARAMETER"}
    placeholders = {m["arg"] for m in specs}  # the torch.fx graph's inputs: parameters, buffers, user inputs
    params = set(param_of_arg.values())
    floats = {t.name for t in proto.graph.initializer if t.data_type in _FLOAT_TYPES}
    inits = {t.name for t in proto.graph.initializer}
    opset = onnx_opset(proto)

    fx: dict[str, _FxNode] = {}
    untracked: set[str] = set()  # initializers some node without torch.fx metadata (or a subgraph) reads
    at_differentiable: set[str] = set()  # initializers some node reads at an input ONNX may differentiate
    lost_batchnorms = []
    for node in proto.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        for k, t in enumerate(node.input):
            if t in inits and not _non_differentiable(node, k, opset):
                at_differentiable.add(t)
        untracked.update(t for t in outer_reads(node) if t in inits)
        at_differentiable.update(t for t in outer_reads(node) if t in inits)
        line = meta.get(FX_NODE_KEY)
        training_bn = line is not None and _TRAINING_BATCHNORM in line
        if training_bn and ("FuseBatchNormInto" in meta.get(RULE_KEY, "") or (
                node.op_type == "BatchNormalization" and not is_training_batchnorm(node, opset))):
            lost_batchnorms.append(node)
        if line is None:
            untracked.update(t for t in node.input if t in inits)
            continue
        lhs, _, rhs = line.partition(" = ")
        f = fx.setdefault(lhs.split(" ")[0].lstrip("%"), _FxNode())
        scopes = re.findall(r"'([^']*)'", meta.get(SCOPES_KEY, ""))
        f.module = scopes[-2] if len(scopes) >= 2 else ""
        args = set(re.findall(r"%(\w+)", rhs))
        f.args |= args
        f.refs |= {param_of_arg[a] for a in args if a in param_of_arg}
        f.reads.update(t for t in node.input if t in inits)
        f.nodes.append(node)

    folded_bn = {id(n) for n in lost_batchnorms}
    merged: list[str] = []
    dropped: list[str] = []
    stands_for_param: set[str] = set(untracked)  # initializers that may hold a parameter's value
    referenced: set[str] = set()
    any_folded = False
    for f in fx.values():
        referenced |= f.refs
        made = {t for t in f.reads if t not in kinds}  # values the exporter made, read here
        missing = f.refs - f.reads - untracked  # a node without torch.fx metadata may read it for this one
        # a torch.fx value no node computes any more (folded at export) may carry a parameter into this node
        folded_in = any(a not in fx and a not in placeholders and not _GETITEM.match(a) for a in f.args)
        any_folded |= folded_in
        if missing or folded_in:
            stands_for_param |= made
        if any(id(n) in folded_bn for n in f.nodes):
            continue  # a folded BatchNorm's parameters: said by its own warning
        if f.reads & (params - f.refs):  # it reads a parameter torch does not read there: merged with its own
            merged += missing
        elif not made:
            dropped += missing
    # a parameter no node left reads: folded into a value computed at export, when the file shows such a fold; not
    # when its own module reads another parameter of that name instead (tied: torch.export reads one placeholder)
    tied = {p for p in params - referenced for f in fx.values()
            if f.module == p.rpartition(".")[0] and any(q.rpartition(".")[2] == p.rpartition(".")[2] for q in f.refs)}
    computed = sorted(params - referenced - inits - tied) if any_folded else []
    constants = {t for t in floats - set(kinds)
                 if t not in at_differentiable or (t not in stands_for_param and not computed)}
    return DynamoFile(kinds, constants, sorted(set(merged)), sorted(set(dropped)), computed, lost_batchnorms)


def _signature(proto: onnx.ModelProto) -> str | None:
    """The graph signature the dynamo exporter wrote on ``proto``'s graph (None: not from that exporter)."""
    return next((p.value for p in proto.graph.metadata_props if p.key == SIGNATURE_KEY), None)


def _signature_inputs(proto: onnx.ModelProto) -> list[re.Match] | None:
    text = _signature(proto)
    return None if text is None else list(_INPUT_SPEC.finditer(text.split("# outputs", 1)[0]))


def node_references(proto: onnx.ModelProto) -> dict[str, set[str]]:
    """{node name: the module's parameters and buffers (state_dict keys) the torch.fx node it was exported from
    names in its arguments}, for the nodes of a dynamo-exported file that record one ({} for another file)."""
    specs = _signature_inputs(proto) or []
    target = {m["arg"]: m["target"] for m in specs if m["kind"] in ("PARAMETER", "BUFFER") and m["target"]}
    out: dict[str, set[str]] = {}
    for node in proto.graph.node:
        line = next((p.value for p in node.metadata_props if p.key == FX_NODE_KEY), None)
        if line is not None:
            rhs = line.partition(" = ")[2]
            out[node.name] = {target[a] for a in re.findall(r"%(\w+)", rhs) if a in target}
    return out


def non_persistent_buffers(proto: onnx.ModelProto) -> set[str]:
    """The buffers a dynamo-exported file's signature marks ``persistent=False``: not in the module's state_dict
    (transformers' ``position_ids``), so a split must not write them. Empty for another file."""
    return set(re.findall(r"BUFFER target='([^']*)' persistent=False", _signature(proto) or ""))


def exporter_constants(proto: onnx.ModelProto) -> set[str]:
    """Float initializers of a dynamo-exported file that stand for no parameter, buffer or constant tensor of the
    module: read only at inputs ONNX declares non-differentiable (``Clip``'s min and max), or made by the exporter
    where torch reads no parameter (attention's scale). Empty for a file without a graph signature."""
    found = read_dynamo_file(proto)
    return set() if found is None else found.constants


def signature_trainable(found: DynamoFile | None, weights: set[str]) -> set[str] | None:
    """The per-model ``weights`` of a dynamo-exported file (``found``: its record) that training moves: all but the
    module's buffers and constant tensors (a causal mask registered as a buffer is state, not a parameter). None
    without a record."""
    if found is None:
        return None
    return {w for w in weights if found.kinds.get(w, "PARAMETER") == "PARAMETER"}


def _listed(names: list[str]) -> str:
    more = len(names) - _SHOWN
    return ", ".join(names[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def dynamo_file_warnings(found: DynamoFile | None, label: str) -> list[str]:
    """One line for each way the dynamo exporter left model ``label`` (``found``: its record) unable to train as
    torch trains the module (lost training-mode BatchNorm; parameters merged, dropped or folded by its optimizer),
    each saying how to export it instead; [] for a file without that exporter's record, or one it left whole."""
    if found is None:
        return []
    out = []
    if found.lost_batchnorms:
        folded = [n for n in found.lost_batchnorms if n.op_type != "BatchNormalization"]
        where = (f"folded into {'/'.join(sorted({n.op_type for n in folded}))} " if folded else "") + \
            _listed([node_label(n) for n in found.lost_batchnorms])
        out.append(f"{label}: torch's dynamo exporter turned {len(found.lost_batchnorms)} training-mode BatchNorm "
                   f"layer(s) into inference-mode ones ({where}): this array would train without batch statistics, "
                   "unlike torch; export with torch.onnx.export(..., dynamo=False, "
                   "training=torch.onnx.TrainingMode.TRAINING) or `onnxfuse export`, which keep them")
    rewrites = [f"merged with other parameters of equal value: {_listed(found.merged)}"] if found.merged else []
    rewrites += [f"dropped as all zeros: {_listed(found.dropped)}"] if found.dropped else []
    rewrites += [f"folded into values computed at export: {_listed(found.computed)}"] if found.computed else []
    if rewrites:
        out.append(f"{label}: the dynamo exporter's optimizer rewrote parameters of the module ("
                   + "; ".join(rewrites) + "), so this array would not train them as torch does; export with "
                   "torch.onnx.export(..., dynamo=True, optimize=False) (or dynamo=False)")
    return out
