"""Per-model losses appended to a fused graph: ``loss = sum_b mean(loss_b)``, so that the gradient of model b's
parameters is exactly the gradient of its own mean loss.

Every loss reads the fused output ``[B] + orig_shape`` (stacked(0)) and labels that are either shared by all models
(``orig label shape``, the default) or per model (``[B] + orig label shape``, ``per_model_labels``), and matches
torch.nn.functional's loss of the same name with its default mean reduction, model by model:

cross-entropy  logits [N, C, d1, ...] (class axis 1, torch's convention) or [N, ..., C] (``class_axis=-1``, e.g.
               language-model logits [N, T, V]); labels = class indices, the output's shape without the class axis.
               Mean over the labels that are not ``ignore_index``; ``label_smoothing`` eps mixes in the uniform
               distribution: l_i = (1-eps) * -logp_i[y_i] + eps/C * sum_c -logp_i[c]  (torch's formula)
nll            as cross-entropy, but the output already is log-probabilities (no smoothing, like torch)
mse, l1        mean of (x - y)^2 / |x - y| over every element; targets shaped like the output
bce-with-logits  mean of max(x, 0) - x*y + log(1 + exp(-|x|)), torch's overflow-free form of
               -[y log sigmoid(x) + (1-y) log(1 - sigmoid(x))]; targets shaped like the output
model          the output (shape [] or [1] per model) already is the loss; no labels

Only ops onnxruntime-training 1.19 can differentiate on CPU are used: SoftmaxCrossEntropyLoss (reduction none,
ignore_index), LogSoftmax, GatherElements (NegativeLogLikelihoodLoss, Softplus and Sign have no gradient builder),
Abs, Relu, Exp, Log and arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
from onnx import helper

from onnxfuse.core.errors import ConfigError

from onnxfuse.core._builder import GraphBuilder

__all__ = ["LOSSES", "LOSS_OPTIONS", "LossKind", "LossSpec", "PythonLoss", "python_loss", "get_loss", "add_loss",
           "LABELS", "AS_GIVEN"]

LABELS = "labels"
LOSS_OPTIONS = ("label_smoothing", "ignore_index", "class_axis")  # what `TrainConfig.loss_options` may set


@dataclass(frozen=True)
class LossKind:
    name: str
    label_dtype: type | None  # None: the loss takes no labels
    description: str

    @property
    def classification(self) -> bool:
        """Labels are class indices along a class axis of the output."""
        return self.name in ("cross-entropy", "nll")


LOSSES = {k.name: k for k in (
    LossKind("cross-entropy", np.int64, "softmax cross-entropy on logits [N, C, ...] (or class axis -1), "
                                        "labels class indices"),
    LossKind("nll", np.int64, "negative log-likelihood of log-probabilities [N, C, ...], labels class indices"),
    LossKind("mse", np.float32, "mean squared error, targets shaped like the output"),
    LossKind("l1", np.float32, "mean absolute error, targets shaped like the output"),
    LossKind("bce-with-logits", np.float32, "binary cross-entropy on logits, targets in [0, 1] shaped like the output"),
    LossKind("model", None, "the model's output ([] or [1]) is its loss; no labels"),
)}


@dataclass(frozen=True)
class LossSpec:
    """A loss with its options, as the training graph is built from it."""

    name: str
    label_smoothing: float = 0.0
    ignore_index: int = -100
    class_axis: int = 1
    per_model_labels: bool = False

    @property
    def kind(self) -> LossKind:
        return LOSSES[self.name]

    @property
    def label_dtype(self) -> type | None:
        return self.kind.label_dtype

    @property
    def has_labels(self) -> bool:
        return self.kind.label_dtype is not None

    @property
    def classification(self) -> bool:
        return self.kind.classification

    def resolved_class_axis(self, out_shape: list) -> int:
        """The class axis of the original output, in [1, rank)."""
        rank = len(out_shape)
        axis = self.class_axis + rank if self.class_axis < 0 else self.class_axis
        if rank < 2 or not 1 <= axis < rank:
            raise ConfigError(f"{self.name}: class axis {self.class_axis} does not fit the model output of shape "
                              f"{out_shape}; the output needs a batch axis and a class axis ([N, C, ...] with "
                              "--class-axis 1, [N, ..., C] with --class-axis -1)")
        return axis

    def label_shape(self, out_shape: list) -> list | None:
        """One model's label shape for original output shape ``out_shape`` (None: no labels)."""
        if not self.has_labels:
            return None
        if self.classification:
            axis = self.resolved_class_axis(out_shape)
            return list(out_shape[:axis]) + list(out_shape[axis + 1:])
        return list(out_shape)

    def num_classes(self, out_shape: list) -> int | None:
        if not self.classification:
            return None
        C = out_shape[self.resolved_class_axis(out_shape)]
        return C if isinstance(C, int) else None

    def check_output(self, out_shape: list, output: str = "output") -> None:
        """Raise ConfigError when this loss cannot read a model output of shape ``out_shape``."""
        if self.name == "model" and [d for d in out_shape if d != 1]:
            raise ConfigError(f"the 'model' loss needs an output that is the loss (shape [] or [1]); '{output}' has "
                              f"shape {out_shape}")
        if self.classification and self.num_classes(out_shape) is None:
            raise ConfigError(f"{self.name}: the class axis {self.class_axis} of output '{output}' (shape "
                              f"{out_shape}) must have a static size")


AS_GIVEN = "as given"  # a label dtype: the data's own (integers as int64, other numbers as float32)


@dataclass(frozen=True)
class PythonLoss(LossSpec):
    """A loss written in Python, for the torch runtime: ``fn(output, batch) -> [M]``. ``output`` is the array's
    output stacked ``[M, N, ...]`` (M the models of the call: B, 1 while verification trains a model alone, fewer
    after successive halving); ``batch`` the step's arrays by name (graph inputs and, when the data has them,
    ``labels``) as torch tensors on the device; it returns each model's loss, ``[M]``, each a function of that
    model's output alone (the sum over models is what is differentiated, so each gradient stays its model's).
    Labels are taken as the data gives them (integers as int64, other numbers as float32), shared ``[N, ...]`` or
    per model ``[M, N, ...]`` (``per_model_labels``). Evaluation reports the loss only (no accuracy)."""

    fn: Callable | None = field(default=None, compare=False)

    @property
    def kind(self) -> LossKind:
        return LossKind("python", AS_GIVEN, f"the Python function {self.label}")  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        """The function's name, as a run records it."""
        return f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', type(self.fn).__name__)}"

    @property
    def classification(self) -> bool:
        return False

    def label_shape(self, out_shape: list) -> list | None:
        return None  # any: the function reads them

    def check_output(self, out_shape: list, output: str = "output") -> None:
        pass


def python_loss(fn: Callable, per_model_labels: bool = False) -> PythonLoss:
    """``fn`` (see :class:`PythonLoss`) as a run's loss; a callable is checked here, once."""
    if not callable(fn):
        raise ConfigError(f"loss= takes a loss name or a Python function (output, batch) -> [B] losses, got "
                          f"{type(fn).__name__}")
    return PythonLoss("python", per_model_labels=bool(per_model_labels), fn=fn)


def get_loss(name: str | LossSpec, label_smoothing: float = 0.0, ignore_index: int = -100, class_axis: int = 1,
             per_model_labels: bool = False) -> LossSpec:
    """Validate a loss name and its options (torch's defaults: no smoothing, ignore_index -100, class axis 1).
    A LossSpec is returned as it is."""
    if isinstance(name, LossSpec):
        return name
    if name not in LOSSES:
        raise ConfigError(f"unknown loss '{name}'; choose one of: {', '.join(LOSSES)}")
    kind = LOSSES[name]
    try:
        label_smoothing, ignore_index, class_axis = float(label_smoothing), int(ignore_index), int(class_axis)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"loss options: {e}") from e
    if not 0.0 <= label_smoothing <= 1.0:
        raise ConfigError(f"--label-smoothing must be in [0, 1], got {label_smoothing}")
    if label_smoothing and name != "cross-entropy":
        raise ConfigError(f"--label-smoothing applies to cross-entropy only, not to '{name}' (as in torch)")
    if class_axis == 0:
        raise ConfigError("--class-axis 0 is the batch axis; use 1 ([N, C, ...]) or -1 ([N, ..., C])")
    if per_model_labels and not kind.label_dtype:
        raise ConfigError(f"the '{name}' loss takes no labels, so --per-model-labels does not apply")
    return LossSpec(name, label_smoothing, ignore_index, class_axis, bool(per_model_labels))


def add_loss(b: GraphBuilder, loss: LossSpec, output: str, orig_shape: list, B: int
             ) -> tuple[str, str, onnx.ValueInfoProto | None]:
    """Append the loss of fused output ``output`` ([B] + orig_shape, stacked(0)). Returns (loss, per_model_loss,
    labels input or None when the loss takes none)."""
    per_model = "per_model_loss"
    loss = get_loss(loss)
    loss.check_output(orig_shape, output)
    labels = None
    if loss.has_labels:
        lshape = loss.label_shape(orig_shape)
        dtype = onnx.TensorProto.INT64 if loss.classification else onnx.TensorProto.FLOAT
        labels = helper.make_tensor_value_info(LABELS, dtype, ([B] if loss.per_model_labels else []) + lshape)
    if loss.classification:
        _classification(b, loss, output, orig_shape, B, per_model)
    elif loss.name == "model":
        b.one("Reshape", [output, b.const([B], np.int64)], output=per_model)
    else:
        # shared labels [N, ...] broadcast against [B, N, ...]; per-model labels are [B, N, ...] already
        diff = b.one("Sub", [output, LABELS])
        if loss.name == "mse":
            elem = b.one("Mul", [diff, diff])
        elif loss.name == "l1":
            elem = b.one("Abs", [diff])  # gradient sign(x - y), 0 at 0 as torch's
        else:  # bce-with-logits: relu(x) - x*y + log(1 + exp(-|x|))
            soft = b.one("Log", [b.one("Add", [b.const(1.0), b.one("Exp", [b.one("Neg", [b.one("Abs", [output])])])])])
            elem = b.one("Add", [b.one("Sub", [b.one("Relu", [output]), b.one("Mul", [output, LABELS])]), soft])
        per_row = b.one("Reshape", [elem, b.const([B, -1], np.int64)])
        b.reduce("ReduceMean", per_row, [1], keepdims=0, output=per_model)
    total = b.reduce("ReduceSum", per_model, [0], keepdims=0, output="loss")
    return total, per_model, labels


def _classification(b: GraphBuilder, loss: LossSpec, output: str, orig_shape: list, B: int, per_model: str) -> str:
    """cross-entropy / nll per model: [B] = sum(l_i * keep_i) / sum(keep_i) over the model's labels.

    Layout: the fused scores [B, N, ..., C, ...] are viewed as [B, R, C] (class axis moved last by a Transpose when
    it is not last already, R = every other element of one model), the labels as [B, R] (shared ones expanded).
    """
    axis = loss.resolved_class_axis(orig_shape)
    C = orig_shape[axis]
    rank = len(orig_shape) + 1  # fused rank
    fused_axis = axis + 1
    scores = output
    if fused_axis != rank - 1:
        perm = [d for d in range(rank) if d != fused_axis] + [fused_axis]
        scores = b.one("Transpose", [scores], perm=perm)
    scores = b.one("Reshape", [scores, b.const([B, -1, C], np.int64)])  # [B, R, C]
    if loss.per_model_labels:
        labels = b.one("Reshape", [LABELS, b.const([B, -1], np.int64)])
    else:  # [N, ...] -> [1, R] -> [B, R]: model b's rows line up with its scores
        labels = b.one("Expand", [b.one("Reshape", [LABELS, b.const([1, -1], np.int64)]), b.const([B, 1], np.int64)])
    keep = b.one("Not", [b.one("Equal", [labels, b.const(loss.ignore_index, np.int64)])])
    keep_f = b.one("Cast", [keep], to=onnx.TensorProto.FLOAT)
    if loss.name == "cross-entropy" and loss.label_smoothing == 0.0:
        # SoftmaxCrossEntropyLoss gives 0 (and gradient 0) at ignored labels; rows of model b are b*R .. (b+1)*R-1
        flat = b.one("Reshape", [scores, b.const([-1, C], np.int64)])
        flat_labels = b.one("Reshape", [labels, b.const([-1], np.int64)])
        ce, _log_prob = b.emit("SoftmaxCrossEntropyLoss", [flat, flat_labels], 2, reduction="none",
                               ignore_index=loss.ignore_index)
        elem = b.one("Reshape", [ce, b.const([B, -1], np.int64)])
    else:
        logp = b.one("LogSoftmax", [scores], axis=2) if loss.name == "cross-entropy" else scores
        # ignored labels pick class 0 (any valid index); their term is multiplied by 0 below
        safe = b.one("Where", [keep, labels, b.const(0, np.int64)])
        picked = b.one("GatherElements", [logp, b.one("Reshape", [safe, b.const([B, -1, 1], np.int64)])], axis=2)
        nll = b.one("Neg", [b.one("Reshape", [picked, b.const([B, -1], np.int64)])])  # [B, R]
        eps = loss.label_smoothing
        if eps:
            # (1-eps) * -logp[y] + eps/C * sum_c -logp[c]
            smooth = b.reduce("ReduceSum", logp, [2], keepdims=0)
            elem = b.one("Sub", [b.one("Mul", [nll, b.const(1.0 - eps)]), b.one("Mul", [smooth, b.const(eps / C)])])
        else:
            elem = nll
        elem = b.one("Mul", [elem, keep_f])
    total = b.reduce("ReduceSum", elem, [1], keepdims=0)
    count = b.reduce("ReduceSum", keep_f, [1], keepdims=0)
    return b.one("Div", [total, count], output=per_model)  # 0/0 = nan when every label is ignored, as torch
