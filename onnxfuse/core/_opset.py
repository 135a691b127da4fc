"""What an ONNX model's opset decides, read in one place: the model's default-domain opset (:func:`onnx_opset`),
and whether a BatchNormalization node computes batch statistics (:func:`is_training_batchnorm`), which ONNX spells
differently before and from opset 14."""
from __future__ import annotations

import onnx

from onnxfuse.core.errors import InputFileError

__all__ = ["onnx_opset", "is_training_batchnorm", "check_opset_supported", "MIN_OPSET", "MAX_OPSET"]

DEFAULT_DOMAINS = ("", "ai.onnx")  # the default (ONNX) domain's two spellings
# The default-domain opsets onnxfuse reads, declared once (``export --opset`` offers those of them torch writes):
# from 13, the oldest its rules are written for, to the newest the installed onnx package defines (its checker and
# shape inference know every op up to it; a later or made-up version would be fused by guesswork).
MIN_OPSET = 13
MAX_OPSET = onnx.defs.onnx_opset_version()


def onnx_opset(model: onnx.ModelProto, label: str = "the model") -> int:
    """The version of the default (ONNX) domain that ``model`` imports.

    A model that imports no default-domain opset is an InputFileError naming ``label`` (onnx's checker refuses
    such a model, and what its nodes compute depends on that version): there is no default version to assume."""
    for o in model.opset_import:
        if o.domain in DEFAULT_DOMAINS:
            return int(o.version)
    domains = ", ".join(repr(o.domain) for o in model.opset_import) or "none"
    raise InputFileError(f"{label} imports no default-domain ONNX opset (opset_import: {domains}); re-export it "
                         "with an opset (torch.onnx.export sets one)")


def is_training_batchnorm(node: onnx.NodeProto, opset: int) -> bool:
    """``node`` is a BatchNormalization that normalizes with the batch's statistics (training mode).

    From opset 14 the attribute ``training_mode`` says so (default 0); before, a training-mode node is one with
    more than one output used (running mean and variance, saved mean and variance: opsets 9-13 have no
    attribute)."""
    if node.op_type != "BatchNormalization" or node.domain not in DEFAULT_DOMAINS:
        return False
    if opset >= 14:
        return any(a.name == "training_mode" and a.i for a in node.attribute)
    return any(node.output[1:])


def check_opset_supported(model: onnx.ModelProto, label: str) -> None:
    """``model``'s default-domain opset is one onnxfuse reads (``MIN_OPSET`` .. ``MAX_OPSET``); else one
    InputFileError naming ``label``. A model without a default-domain opset passes here (``onnx_opset`` refuses
    it where the version is needed)."""
    for o in model.opset_import:
        if o.domain in DEFAULT_DOMAINS and not MIN_OPSET <= o.version <= MAX_OPSET:
            raise InputFileError(f"{label} imports ONNX opset {o.version}, which onnxfuse does not read: it reads "
                                 f"opsets {MIN_OPSET} to {MAX_OPSET}; re-export the model with an opset in that "
                                 "range (opset= when onnxfuse exports it, torch.onnx.export(..., opset_version=...) otherwise)")
