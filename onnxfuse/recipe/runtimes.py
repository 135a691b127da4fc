"""Runtimes: what trains a fused graph. The run loop (``run.py``), verification, the GAN loop and the benchmarks
are written against :class:`Runtime`; each runtime is one registration in :data:`RUNTIMES`.

A runtime is built from the fused graph, its :class:`ArraySpec`, a loss and a per-model optimizer configuration,
and keeps the same state under the same names whichever it is, so a checkpoint written by one resumes in another:

    weights()           fused parameters and buffers (BatchNorm running statistics) by fused name, model-major
    optimizer_state()   flat [B, P] buffers ``optim.<state>`` (P = parameters per model, in ``trainable`` order)
    load(tensors)       set any of the above by name

``step(feeds, values)`` trains all B models on one batch with this step's per-model coefficients
(:meth:`OptimizerConfig.coefficients`) and returns the per-model losses; ``last_ok`` then says which models' steps
were applied (fault isolation: a model whose loss, gradient, new parameters or new buffers are not finite keeps
its whole state, and is frozen from then on: a rejected model is not stepped again until ``steps`` is set, e.g.
by a resume). ``launch(feeds, values)`` is the same step without reading anything back to the host (the run
loop's: on a GPU the next step is queued while this one runs); ``observe()`` reads the last step's losses, applied
steps and the optimizer step at which each model was first rejected (:class:`Observed`). ``eval_batch(feeds)``
returns the per-model losses and the fused output in inference mode.

``compile`` (:data:`COMPILE_CHOICES`): whether a runtime that can (``RuntimeInfo.compiles``) captures its step
whole; ``auto`` decides from the run's length (``total_steps``).
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Iterable, Iterator, Protocol, Sequence

import numpy as np
import onnx

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core.errors import ConfigError
from onnxfuse.core.weights import ArraySpec

from onnxfuse.recipe.data import Dataset
from onnxfuse.recipe.device import Device
from onnxfuse.recipe.losses import LABELS, LossSpec

if TYPE_CHECKING:  # optim reads the settings, which read this module's table
    from onnxfuse.recipe.optim import OptimizerConfig, StepValues

__all__ = ["Runtime", "RuntimeInfo", "RUNTIMES", "RUNTIME_CHOICES", "COMPILE_CHOICES", "resolve_runtime",
           "make_trainer", "evaluate", "parameter_names", "check_feeds", "Observed", "check_compile", "PRECISIONS",
           "LossScale", "check_precision"]

log = logging.getLogger("onnxfuse.train")

COMPILE_CHOICES = ("auto", "on", "off")
# the arithmetic of the forward and backward (``--precision``): fp32 throughout, or torch.autocast's bf16 / fp16
# with fp32 weights, state and update (a runtime trains in the ones its ``RuntimeInfo.precisions`` lists)
PRECISIONS = ("fp32", "bf16", "fp16")


def check_compile(value: str, where: str = "--compile") -> str:
    if value not in COMPILE_CHOICES:
        raise ConfigError(f"{where} must be one of {', '.join(COMPILE_CHOICES)}, got {value!r}")
    return value


@dataclass
class Observed:
    """A runtime's last step as read on the host: per-model losses [B], which models' steps were applied [B], and
    the optimizer step at which each model was first rejected (0: never) since its step count was last set."""

    losses: np.ndarray
    ok: np.ndarray
    failed_at: np.ndarray
    failed_loss: np.ndarray  # each rejected model's loss at that step
    scale: np.ndarray | None = None  # fp16: each model's loss scale after the step (None: no loss scaling)


@dataclass(frozen=True)
class LossScale:
    """fp16's dynamic loss scaling, torch.amp.GradScaler's semantics with a scale per model: each model's loss is
    multiplied by its ``init`` scale at first; a step whose gradient (of that model) overflows is skipped for that
    model and its scale multiplied by ``backoff``; after ``interval`` steps without overflow its scale is multiplied
    by ``growth``. A model that overflows at a scale of ``MIN`` or less is diverged (its gradient overflows without
    any scale)."""

    init: tuple[float, ...]  # one per model
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000

    INIT: ClassVar[float] = 2.0 ** 16  # GradScaler's init_scale
    MIN: ClassVar[float] = 1.0

    def select(self, keep: Sequence[int]) -> "LossScale":
        return LossScale(tuple(self.init[i] for i in keep), self.growth, self.backoff, self.interval)


def check_precision(precision: str, runtime: "RuntimeInfo | None" = None, where: str = "--precision") -> str:
    """``precision`` is one of :data:`PRECISIONS` and one ``runtime`` trains in (a one-line ConfigError else)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"{where} must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if runtime is not None and precision not in runtime.precisions:
        capable = ", ".join(r.name for r in RUNTIMES.values() if precision in r.precisions)
        raise ConfigError(f"{where} {precision}: the {runtime.name} runtime trains in "
                          f"{', '.join(runtime.precisions)} only; use --runtime {capable}, or --precision fp32")
    return precision


class Runtime(Protocol):
    spec: ArraySpec
    opt: OptimizerConfig
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


@dataclass(frozen=True)
class RuntimeInfo:
    """One runtime: its class, named ``module:Class`` so that listing the runtimes imports
    neither torch nor onnxruntime. The class takes ``(fused, spec, loss, optimizer, device=, workdir=,
    threads=)`` (``device``: a ``Device``, or its text) and has a static ``unavailable(device) -> str | None``: why it
    cannot train there (with the fix)."""

    name: str
    target: str
    help: str
    compiles: bool = False  # takes compile= and total_steps= (captures its whole step)
    precisions: tuple[str, ...] = ("fp32",)  # the --precision values it trains in (others: precision=, loss_scale=)

    def load(self) -> type:
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)


# Each runtime is one entry. `auto` picks the first entry that can run on the device: the torch runtime trained
# the fused arrays faster than onnxruntime-training on this CPU (README, "Runtimes") and is the only one that
# reaches a current GPU stack.
RUNTIMES: dict[str, RuntimeInfo] = {r.name: r for r in (
    RuntimeInfo("torch", "onnxfuse.runtime.torch_runtime:TorchTrainer",
                "PyTorch: the fused graph as a torch module, autograd, any device torch supports", compiles=True,
                precisions=PRECISIONS),
    RuntimeInfo("ort", "onnxfuse.runtime.ort_runtime:FusedTrainer",
                "onnxruntime-training 1.19: CPU, or CUDA 11.8 with the onnxruntime-training GPU build"),
)}
RUNTIME_CHOICES = ("auto",) + tuple(RUNTIMES)


def parameter_names(spec: ArraySpec) -> tuple[list[str], list[str]]:
    """(trainable parameters, buffers) of an array to train (:meth:`ArraySpec.parameter_names`); an array without
    a trainable parameter is a ConfigError."""
    trainable, buffers = spec.parameter_names()
    if not trainable:
        raise ConfigError("the array has no trainable parameters")
    return trainable, buffers


def resolve_runtime(runtime: str, device: Device | str, precision: str = "fp32") -> str:
    """The registered runtime for ``runtime`` (a name or ``auto``) on ``device`` in ``precision``; an unavailable
    one is a ConfigError saying why and what to do."""
    device = Device.of(device)
    if runtime == "auto":
        reasons = {}
        for name, info in RUNTIMES.items():
            reasons[name] = (info.load().unavailable(device) if precision in info.precisions else
                             f"trains in {', '.join(info.precisions)} only, not {precision}")
            if reasons[name] is None:
                return name
        raise ConfigError(f"no runtime can train on '{device}': " + "; ".join(f"{n}: {r}" for n, r in reasons.items()))
    if runtime not in RUNTIMES:
        raise ConfigError(f"unknown runtime '{runtime}'; choose one of: {', '.join(RUNTIME_CHOICES)}")
    why = RUNTIMES[runtime].load().unavailable(device)
    if why is not None:
        raise ConfigError(why)
    check_precision(precision, RUNTIMES[runtime])
    return runtime


def make_trainer(runtime: str, fused: onnx.ModelProto, spec: ArraySpec, loss: str | LossSpec,
                 optimizer: OptimizerConfig, device: Device | str = "cpu", workdir: str | None = None,
                 threads: int | None = None, compile: str = "off", total_steps: int = 0, precision: str = "fp32",
                 loss_scale: LossScale | None = None, seed: int = 0) -> Runtime:
    """A trainer of ``fused`` on ``runtime`` (a name or ``auto``); ``compile``: capture the step whole (``on``),
    not (``off``), or decide from ``total_steps`` (``auto``; a runtime that cannot compile does not);
    ``precision`` (:data:`PRECISIONS`) and, for fp16, ``loss_scale`` (default: GradScaler's); ``seed``: the run's,
    which a compiling runtime's random nodes mix into their own seeds (ONNX Runtime's draw from their node's seed
    alone)."""
    device = Device.of(device)
    info = RUNTIMES[resolve_runtime(runtime, device, check_precision(precision))]
    reduced = {"precision": precision, "loss_scale": loss_scale} if precision != "fp32" else {}
    watch = Stopwatch()
    if not info.compiles:
        if check_compile(compile) == "on":
            capable = ", ".join(r.name for r in RUNTIMES.values() if r.compiles)
            raise ConfigError(f"--compile on: the {info.name} runtime does not compile its step; use --runtime "
                              f"{capable}, or --compile auto / off")
        trainer = info.load()(fused, spec, loss, optimizer, device=device, workdir=workdir, threads=threads,
                              **reduced)
    else:
        trainer = info.load()(fused, spec, loss, optimizer, device=device, workdir=workdir, threads=threads,
                              compile=compile, total_steps=total_steps, seed=seed, **reduced)
    log.debug("runtime %s on %s in %s (%s), compile %s: its trainer built in %.2f s", info.name, device, precision,
              "auto: the first registered one that runs there" if runtime == "auto" else "as asked",
              compile if info.compiles else "off (it does not compile)", watch.seconds)
    return trainer


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
