"""What every runtime is (the :class:`Runtime` protocol) and what every runtime does the same way: the parameters it
trains, the feeds a step reads, the evaluation of a data set, and what a step reports (:class:`Observed`).

A runtime is built from the fused graph, its :class:`ArraySpec`, a loss and a per-model optimizer configuration,
and keeps the same state under the same names whichever it is, so a checkpoint written by one resumes in another:

    weights()           fused parameters and buffers (BatchNorm running statistics) by fused name, model-major
    optimizer_state()   flat [B, P] buffers ``optim.<state>`` (P = parameters per model, in ``trainable`` order)
    load(tensors)       set any of the above by name

``step(feeds, values)`` trains all B models on one batch with this step's per-model coefficients
(:meth:`UpdateRule.coefficients`) and returns the per-model losses; ``last_ok`` then says which models' steps
were applied (fault isolation: a model whose loss, gradient, new parameters or new buffers are not finite keeps
its whole state, and is frozen from then on: a rejected model is not stepped again until ``steps`` is set, e.g.
by a resume). ``launch(feeds, values)`` is the same step without reading anything back to the host (the run
loop's: on a GPU the next step is queued while this one runs); ``observe()`` reads the last step's losses, applied
steps and the optimizer step at which each model was first rejected (:class:`Observed`). ``eval_batch(feeds)``
returns the per-model losses and the fused output in inference mode. Which class trains for each runtime:
``trainers.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np

from onnxfuse.core.errors import ConfigError
from onnxfuse.core.weights import ArraySpec
from onnxfuse.recipe.data import Dataset
from onnxfuse.recipe.device import Device
from onnxfuse.recipe.losses import LABELS, LossSpec
from onnxfuse.recipe.optim import StepValues, UpdateRule

__all__ = ["Runtime", "Observed", "evaluate", "parameter_names", "check_feeds"]


@dataclass
class Observed:
    """A runtime's last step as read on the host: per-model losses [B], which models' steps were applied [B], and
    the optimizer step at which each model was first rejected (0: never) since its step count was last set."""

    losses: np.ndarray
    ok: np.ndarray
    failed_at: np.ndarray
    failed_loss: np.ndarray  # each rejected model's loss at that step
    scale: np.ndarray | None = None  # fp16: each model's loss scale after the step (None: no loss scaling)


class Runtime(Protocol):
    spec: ArraySpec
    opt: UpdateRule
    loss: LossSpec
    device: Device
    steps: int
    last_ok: np.ndarray
    trainable: list[str]
    buffers: list[str]
    compile: str
    compiled: bool | None  # the step is captured (None: compile="auto" has not decided yet); settable

    def step(self, feeds: dict[str, np.ndarray], values: StepValues | None = None) -> np.ndarray: ...

    def launch(self, feeds: dict[str, np.ndarray], values: StepValues | None = None,
               ahead: Callable[[int], Sequence[StepValues]] | None = None) -> None:
        """One step, without a host read. ``ahead(n)``: this step's values and the next ``n - 1`` steps' (the
        run's schedules), for a runtime that computes a window of steps' coefficients at once (the torch one)."""

    def observe(self) -> Observed: ...

    def eval_batch(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]: ...

    def evaluate(self, data: Dataset, batch_size: int = 256) -> dict[str, np.ndarray]: ...

    def weights(self) -> dict[str, np.ndarray]: ...

    def optimizer_state(self) -> dict[str, np.ndarray]: ...

    def load(self, tensors: dict[str, np.ndarray]) -> None: ...


def parameter_names(spec: ArraySpec) -> tuple[list[str], list[str]]:
    """(trainable parameters, buffers) of an array to train (:meth:`ArraySpec.parameter_names`); an array without
    a trainable parameter is a ConfigError."""
    trainable, buffers = spec.parameter_names()
    if not trainable:
        raise ConfigError("the array has no trainable parameters")
    return trainable, buffers


def _with_sizes(trainer: Runtime, data: Dataset | Iterable[dict], batch_size: int) -> Iterator[tuple[dict, int]]:
    """(batch, its samples per model): a Dataset's slices of ``batch_size``, or the batches given (their size on
    the first graph input's sample axis: axis 1 of a per-model one)."""
    if isinstance(data, Dataset):
        n = len(data)
        for start in range(0, n, batch_size):
            yield data.batch(slice(start, start + batch_size)), min(n, start + batch_size) - start
        return
    first = trainer.spec.inputs[0]
    for batch in data:
        yield batch, int(np.shape(batch[first["name"]])[1 if first.get("per_model") else 0])


def evaluate(trainer: Runtime, data: Dataset | Iterable[dict], batch_size: int = 256) -> dict[str, np.ndarray]:
    """Per-model mean loss over ``data`` in inference mode (BatchNorm on running statistics, Dropout off), and
    for cross-entropy / nll the accuracy: the fraction of labels (every labelled element for [N, C, d...] or
    class-axis -1 outputs) whose argmax class is right, ignored labels left out, as the loss does. ``data``: a
    Dataset, read in batches of ``batch_size``, or the batches themselves (e.g. a DataLoader's, converted)."""
    B, loss = trainer.spec.B, trainer.loss
    loss_sum, weight = np.zeros(B), np.zeros(B)
    correct, counted = np.zeros(B), np.zeros(B)
    axis = loss.resolved_class_axis(trainer.spec.outputs[0]["shape"]) + 1 if loss.classification else None
    for batch, size in _with_sizes(trainer, data, batch_size):
        per_model, scores = trainer.eval_batch(batch)
        if loss.classification:
            # the loss of a batch is a mean over its kept labels: weight it by their count
            labels = np.broadcast_to(np.asarray(batch[LABELS]), scores.shape[:axis] + scores.shape[axis + 1:])
            keep = (labels != loss.ignore_index).reshape(B, -1)
            hits = (scores.argmax(axis) == labels).reshape(B, -1) & keep
            correct += hits.sum(1)
            w = keep.sum(1).astype(np.float64)
            counted += w
        else:
            w = np.full(B, float(size))
        loss_sum += np.where(w > 0, per_model * w, 0.0)
        weight += w
    with np.errstate(invalid="ignore", divide="ignore"):
        out = {"loss": loss_sum / weight}
        if loss.classification:
            out["accuracy"] = correct / counted
    return out


def check_feeds(names: Sequence[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The arrays a step reads, in order; a missing one is a DataError naming what a step needs."""
    from onnxfuse.core.errors import DataError

    missing = [n for n in names if n not in feeds]
    if missing:
        raise DataError(f"the batch has no array '{missing[0]}'; a step needs {', '.join(names)}")
    return [feeds[n] for n in names]
