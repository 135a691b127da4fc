"""Training semantics a module has and its ONNX graph cannot hold: recorded at export, kept in ``array.json``,
honoured by both runtimes.

Padding rows. ``nn.Embedding(V, D, padding_idx=p)`` looks row p up like any other, but its lookups pass no gradient
to it (torch's embedding backward skips them); the export is a plain ``Gather``, which passes one. The exporter
records ``{table: [p]}`` under the metadata key ``padding_rows`` (by the name the graph holds the table under; a
tied table's other uses, e.g. an output projection, still send it their gradient, as in torch). Fusion keeps each
model's rows on the fused table (``FusedWeight.extra["padding_rows"]``, one list per model). The lookups of a
fused table are the ``Gather`` nodes (axis 0) that read it in its own layout ``[B*V, ...]`` (directly, or through
the Reshape/Transpose view of a tied table packed in another layout first); model b's row p is fused row
``b*V + p``. The torch runtime runs such a lookup as ``GatherKeepRows`` (its own op: the rows' lookups detached),
the ORT runtime masks those rows of the lookup's ``GatherGrad`` (``runtime/ort/artifacts.padding_rows_pass``). Weight
decay still reaches the row, as torch.optim's does.

Frozen parameters (``requires_grad=False``, a frozen sub-module): the exporter lists only trainable parameters
as ``trainable``, so fusion gives the others the role ``frozen``: state that no runtime updates.

A graph from a plain ``torch.onnx.export`` carries neither fact. :func:`plain_export_warnings` names the lookups
whose padding rows fusion cannot know, and :func:`apply_options` takes both facts as options (``onnxfuse fuse
--padding-rows NAME=ROW --frozen NAME``).

What no graph can hold and no runtime can honour is refused by the exporter: ``nn.Embedding(max_norm=)`` (the
forward renormalizes rows in place), ``scale_grad_by_freq=True`` and BatchNorm's ``momentum=None``.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import onnx

from onnxfuse.core._graph import node_label, producers
from onnxfuse.core.errors import ConfigError
from onnxfuse.core.weights import ArraySpec, FusedWeight

__all__ = ["PADDING_ROWS", "FROZEN", "Lookup", "padding_lookups", "record_semantics", "apply_options",
           "plain_export_warnings", "parse_padding_rows", "row_mask"]

PADDING_ROWS = "padding_rows"  # the exporter's metadata key and the fused weight's ``extra`` key
FROZEN = "frozen"  # metadata key of ``--frozen``'s tensors (the exporter leaves them out of ``trainable`` instead)
_VIEW_OPS = ("Reshape", "Transpose")


@dataclass(frozen=True)
class Lookup:
    """One ``Gather`` of a fused table whose ``rows`` (fused row indices) pass no gradient through it."""

    node: str  # node_label of the Gather
    output: str
    indices: str  # the Gather's indices tensor (unique to it: the fusion's offset indices)
    table: str  # the fused weight
    rows: tuple[int, ...]
    shape: tuple[int, ...]  # the table as the lookup reads it, [B*V, ...] (the fused weight, or a view of it)


def record_semantics(weights: Mapping[str, FusedWeight], metas: Sequence[dict]) -> None:
    """Put what ``metas`` (model b's metadata at b) say on the fused weights: a frozen tensor's role becomes
    ``frozen``; each model's padding rows go on the fused tables read by them."""
    for fw in weights.values():
        if fw.role == "param" and fw.sources[0] in metas[0].get(FROZEN, ()):
            fw.role = "frozen"
        rows = [sorted({int(r) for r in (m.get(PADDING_ROWS) or {}).get(src, ())}) for m, src in zip(metas, fw.sources)]
        if not any(rows) or fw.role != "param":  # a frozen table gets no gradient at all
            continue
        V = fw.orig_shape[0]
        bad = next(((b, r) for b, rs in enumerate(rows) for r in rs if not 0 <= r < V), None)
        if bad is not None:
            raise ConfigError(f"padding row {bad[1]} of '{fw.sources[bad[0]]}' (model {bad[0]}) is outside its "
                              f"{V} rows; give a row in 0..{V - 1}")
        fw.extra[PADDING_ROWS] = rows


def parse_padding_rows(text: str | None) -> dict[str, list[int]]:
    """``--padding-rows 'emb.weight=0,pos.weight=1'``: {table: [rows]} (a table may be named more than once)."""
    out: dict[str, list[int]] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, row = item.strip().rpartition("=")
        try:
            value = int(row)
        except ValueError:
            value = None
        if not sep or not name or value is None:
            raise ConfigError(f"padding_rows: '{item.strip()}' is not NAME=ROW (e.g. "
                              "'embeddings.word_embeddings.weight=0')")
        out.setdefault(name, []).append(value)
    return out


def apply_options(weights: Mapping[str, FusedWeight], metas: Sequence[dict],
                  padding_rows: Mapping[str, Sequence[int]] | None = None, frozen: Sequence[str] = ()) -> None:
    """Write the facts a plain export lacks, given by the user by model 0's initializer names (the same rows and
    the same frozen tensors in every model), into each model's metadata ``metas[b]`` under model b's names:
    ``padding_rows`` {table: rows}, ``frozen`` names or glob patterns of weights not to train. A name that
    matches nothing is an error, not a silent no-op. The metadata is kept with the array's source graphs, so a
    re-fusion (halving, verification's reference) sees the same facts."""
    by_source = {fw.sources[0]: fw for fw in weights.values()}
    for table, rows in (padding_rows or {}).items():
        fw = by_source.get(table)
        if fw is None or fw.role == "buffer" or len(fw.orig_shape) < 2:
            what = "not a weight of the models" if fw is None or fw.role == "buffer" else \
                f"of shape {list(fw.orig_shape)}, not an embedding table"
            tables = sorted(n for n, w in by_source.items() if len(w.orig_shape) == 2)[:5]
            raise ConfigError(f"padding_rows: '{table}' is {what}; name an embedding table [V, D] (the tables "
                              f"here: {', '.join(tables)})")
        for m, src in zip(metas, fw.sources):
            m.setdefault(PADDING_ROWS, {}).setdefault(src, []).extend(int(r) for r in rows)
    for pattern in frozen:
        hits = [fw for name, fw in by_source.items() if fnmatch.fnmatchcase(name, pattern) and fw.role != "buffer"]
        if not hits:
            raise ConfigError(f"frozen: '{pattern}' matches no weight of the models; give initializer names or "
                              "glob patterns (e.g. 'encoder.*')")
        for fw in hits:
            for m, src in zip(metas, fw.sources):
                if src not in m.setdefault(FROZEN, []):
                    m[FROZEN].append(src)


def plain_export_warnings(model: onnx.ModelProto, weight_names: set[str]) -> list[str]:
    """For a graph without onnxfuse's metadata and no options: one warning per embedding lookup (``Gather`` on axis 0
    of a float weight [V, D]), whose padding row fusion cannot know."""
    inits = {t.name: t for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or not node.input:
            continue
        table = node.input[0]
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        t = inits.get(table)
        if (table in weight_names and axis == 0 and t is not None and len(t.dims) == 2
                and t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)):
            out.append(f"'{table}' is looked up by node '{node_label(node)}' in a graph without onnxfuse's metadata: "
                       "if it is an nn.Embedding with padding_idx, torch never trains that row and this array "
                       f"would; pass --padding-rows {table}=ROW (Python: padding_rows=), or export with `onnxfuse "
                       "export` / onnxfuse.fuse, which record it")
    return out


def padding_lookups(model: onnx.ModelProto, spec: ArraySpec) -> list[Lookup]:
    """Every lookup of a fused table with padding rows, and the fused rows it must not train. A table whose lookup
    cannot be found is an internal error: training it would move rows torch keeps."""
    tables = {n: fw for n, fw in spec.weights.items() if fw.extra.get(PADDING_ROWS)}
    if not tables:
        return []
    nodes = list(model.graph.node)
    made = producers(nodes)

    def source_table(name: str) -> str | None:
        """The fused table ``name`` is, or is a Reshape/Transpose view of."""
        while name not in tables and name in made and nodes[made[name][0]].op_type in _VIEW_OPS:
            name = nodes[made[name][0]].input[0]
        return name if name in tables else None

    found: list[Lookup] = []
    for node in model.graph.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
            continue
        if next((a.i for a in node.attribute if a.name == "axis"), 0) != 0:
            continue
        table = source_table(node.input[0])
        if table is None:
            continue
        fw = tables[table]
        V = fw.orig_shape[0]  # the lookup reads the table in its own layout [B*V, ...]: model b's rows from b*V
        rows = tuple(b * V + r for b, rs in enumerate(fw.extra[PADDING_ROWS]) for r in rs)
        shape = (len(fw.sources) * V, *fw.orig_shape[1:])
        found.append(Lookup(node_label(node), node.output[0], node.input[1], table, rows, shape))
    missing = set(tables) - {f.table for f in found}
    if missing:
        raise ConfigError(f"internal error: fused table '{sorted(missing)[0]}' has padding rows but no lookup "
                          "(Gather on axis 0) reads it; train with the padding rows removed from array.json")
    return found


def row_mask(n_rows: int, rows: Sequence[int], rank: int) -> np.ndarray:
    """``[n_rows, 1, ...]`` float32 ones with zeros at ``rows``: a gradient times it leaves those rows zero."""
    mask = np.ones([n_rows] + [1] * (rank - 1), np.float32)
    mask[list(rows)] = 0.0
    return mask
