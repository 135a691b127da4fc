"""One training step of a FusedArray and its ``onnxfuse.optim`` optimizer as one function: forward, loss,
gradients, fault isolation, the per-model update and every write (weights, optimizer state, BatchNorm
statistics), with no host read. ``compile`` captures it with ``torch.compile`` (inductor), whole or in two
parts (its convolutions channels-last or NCHW), or model by model, whichever was measured faster
(``TrainStep.FORMS``):

    step = TrainStep(opt, forward, compile="on")     # forward(weights, batch) -> (loss, per_model [B], new buffers)
    step(batch, values)                              # no host read: losses, ok and failures stay on the device
    seen = step.observe()                            # the host read, when the caller wants one (log_every...)

The step is the same function compiled or not (``_body``): the gradient of the summed loss over the trainable
tensors (compiled: ``torch.func.grad``, which dynamo captures; eager: ``torch.autograd.grad``, the same formulas
without functorch's per-op wrappers), the optimizer's update graph (``FusedOptimizer.apply``), then the
bookkeeping on the device:

    active      the host's activity row (the run loop's schedules) AND ``alive``
    alive [B]   models not rejected since this step object began: a model whose step is rejected (a non-finite
                loss, gradient, update or buffer) is frozen in the graph from that step on, as the run loop froze
                it after reading ``ok``, without the read
    failed_at   the optimizer step at which each model was first rejected (0: never), and its loss there
    losses, ok  the last step's per-model losses and applied steps

The coefficients of each step are computed on the host from the optimizer's groups (a few dozen floats:
``FusedOptimizer.prepare``) and written into a persistent device buffer; the batch is copied in by the caller.
A batch of another shape than the one compiled for (a loader's last partial batch) runs the same body eagerly:
it never triggers a recompile. Eager and compiled steps differ by float rounding only (README, "Compiled
steps").

``compile="auto"`` (the run loop's default) decides from the run's length and what was measured on this
machine: see :func:`auto_decision`. Every run that compiles (``on`` and ``auto``) records its compile time and its
steady-state compiled step, and ``auto`` its eager step, in ``compile-times.json`` under the workload's and the
machine's key (:func:`record_key`). Compiled code is cached by inductor under the user's cache folder
(:func:`cache_dir`), so a second run of the same array compiles in seconds.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import time
import types
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from onnxfuse.core._io import atomic_write_bytes
from onnxfuse.recipe.optim import StepValues
from onnxfuse.recipe.runtimes import LossScale
from onnxfuse.runtime.protocol import Observed
from onnxfuse.runtime.torch.precision import LossScales, autocast, warn_if_emulated

__all__ = ["TrainStep", "OneModel", "batchnorm_outputs", "cache_dir", "auto_decision", "graph_key",
           "record_key", "machine_description", "read_times", "times_path", "compiled"]

log = logging.getLogger("onnxfuse.train")

# auto's rule (see auto_decision) where nothing was measured on this machine yet: the speed-up a compiled step is
# assumed to give and the compile time assumed (measured on a 2-core AVX-512 CPU: 1.5-2.2x, 18-96 s cold; on a
# 2-core AVX2 EPYC compiled steps were not faster at all, which is why a measured figure replaces these)
ASSUMED_SPEEDUP = 1.5
ASSUMED_COMPILE_S = 60.0
EAGER_PROBE_STEPS = 3  # auto times this many eager steps before deciding (the first builds the update graph)
COMPILED_PROBE_STEPS = 4  # steps timed after the compiling one (the first dropped): the steady-state compiled step
TIMES_FILE = "compile-times.json"  # in cache_dir(): {record_key: {compile_s, compiled_step_s, eager_step_s, ...}}


def cache_dir() -> str:
    """The folder of onnxfuse's compile cache: ``$ONNXFUSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/onnxfuse``, else
    ``~/.cache/onnxfuse``; inductor's cache is its ``inductor/`` (unless ``TORCHINDUCTOR_CACHE_DIR`` is set)."""
    root = os.environ.get("ONNXFUSE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "onnxfuse")
    return root


def use_cache() -> None:
    """Inductor's cache in ours, one folder per instruction set torch dispatches to, unless the user named one
    (torch sets the variable to its default, a folder under /tmp, the first time it looks: that one is replaced).
    Inductor's cache does not tell them apart: a step compiled natively on an AVX-512 CPU, then loaded from the
    cache by a process held to AVX2 (``ATEN_CPU_CAPABILITY=avx2``), crashed it with a segmentation fault."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from onnxfuse.runtime._machine import cpu_isa

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        isa = re.sub(r"[^a-z0-9]+", "-", cpu_isa().lower()).strip("-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir(), "inductor", isa)


# ---- compile and step times measured before, for auto
def times_path() -> str:
    """The record of measured compile and step times (:data:`TIMES_FILE` in :func:`cache_dir`)."""
    return os.path.join(cache_dir(), TIMES_FILE)


def read_times() -> dict:
    """``{record_key: {"compile_s", "compiled_step_s", "eager_step_s", "machine"}}`` as recorded (each figure only
    once measured); empty when there is no record or it cannot be read."""
    try:
        with open(times_path()) as f:
            times = json.load(f)
    except (OSError, ValueError):
        return {}
    return times if isinstance(times, dict) else {}


def _record_time(key: str, **values: float | str | list) -> None:
    times = read_times()
    rounded = {k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()}
    times[key] = {**times.get(key, {}), **rounded}
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        atomic_write_bytes(times_path(), json.dumps(times, indent=1, sort_keys=True).encode())
    except OSError as e:  # a cache that cannot be written only costs auto its memory
        log.debug("could not record compile time in %s: %s", times_path(), e)


def machine_description(device: torch.device) -> str:
    """What a step time depends on besides the workload: the CPU (model, instruction set, cores) and torch's thread
    count; on CUDA the GPU too ("AMD EPYC (AVX2), 2 cores, 1 thread")."""
    from onnxfuse.runtime._machine import cpu_description

    threads = torch.get_num_threads()
    host = f"{cpu_description()}, {threads} thread{'s' if threads != 1 else ''}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, host {host}"
    return host


def record_key(workload: str, batch: dict[str, torch.Tensor], device: torch.device) -> str:
    """The key of a step's times in the record: its ``workload`` (the trainer's :func:`graph_key` of the graph,
    loss, optimizer, device and precision), the batch's shapes the step is compiled for, and this machine
    (:func:`machine_description`): a time measured on another CPU, thread count or batch says nothing here."""
    return graph_key(workload, batch_shapes(batch), machine_description(device))


@dataclass(frozen=True)
class Decision:
    compile: bool
    why: str


def auto_decision(remaining_steps: int, eager_step_s: float, known: dict | None) -> Decision:
    """``--compile auto``: the predicted end-to-end time of the remaining steps both ways,

        eager     remaining_steps * eager_step_s
        compiled  compile_s + remaining_steps * compiled_step_s

    compiling when the compiled one is shorter. ``eager_step_s`` is measured now (auto's probe); ``compile_s`` and
    ``compiled_step_s`` are this workload's as last measured on this machine (``known``: its entry in
    :data:`TIMES_FILE`, written by any run that compiled it; a cached compile is the warm one), and where one is
    missing, :data:`ASSUMED_COMPILE_S` and ``eager_step_s / ASSUMED_SPEEDUP``. A compiled step measured here that
    is not faster than the eager steps measured here (now, or recorded beside it) never compiles, however long the
    run: the speed-up on one CPU is no promise on another."""
    known = known or {}
    ms = 1000.0
    compiled_step_s = known.get("compiled_step_s")
    if compiled_step_s is not None:
        eager_seen = [eager_step_s] + ([known["eager_step_s"]] if known.get("eager_step_s") else [])
        if compiled_step_s >= min(eager_seen):
            before = f", {known['eager_step_s'] * ms:.1f} ms before" if len(eager_seen) > 1 else ""
            return Decision(False, f"compiled steps measured here took {compiled_step_s * ms:.1f} ms, not faster "
                                   f"than the eager steps measured here ({eager_step_s * ms:.1f} ms now{before}) "
                                   f"on {known.get('machine', 'this machine')}")
    compile_s = known.get("compile_s", ASSUMED_COMPILE_S)
    if compiled_step_s is None:
        compiled_step_s = eager_step_s / ASSUMED_SPEEDUP
    eager_total = remaining_steps * eager_step_s
    compiled_total = compile_s + remaining_steps * compiled_step_s
    if "compile_s" in known and "compiled_step_s" in known:
        source = "measured here before"
    elif "compile_s" in known or "compiled_step_s" in known:  # a compiled run that stopped before timing its steps
        source = f"the {'compile time' if 'compile_s' in known else 'compiled step'} measured here before, " \
                 f"the other assumed"
    else:
        source = f"assumed: nothing compiled on this machine yet, {ASSUMED_COMPILE_S:.0f} s and {ASSUMED_SPEEDUP}x"
    why = (f"{remaining_steps} steps of {eager_step_s * ms:.1f} ms eager: {eager_total:.1f} s; compiled: "
           f"{compile_s:.1f} s compile + {remaining_steps} steps of {compiled_step_s * ms:.1f} ms = "
           f"{compiled_total:.1f} s ({source})")
    return Decision(compiled_total < eager_total, why)


class OneModel(NamedTuple):
    """What the ``model-by-model`` form of a step needs (``TrainStep.FORMS``): ``forward(weights, batch)``, the
    loss graph of a one-model array of the same graph (``forward``'s outputs for B = 1, over one model's block of
    each fused weight and buffer), and the batch's inputs that hold one slice per model (``[B, ...]``: per-model
    inputs and labels). The graph must draw nothing at random: model b's own seeds are in the B-model graph
    only."""

    forward: Callable
    per_model_inputs: frozenset


class TrainStep:
    """See the module docstring. ``forward(weights, batch)``: the loss graph over ``weights`` (every fused
    parameter and buffer by fused name) returning ``(loss, per_model_loss [B], [new value of each of
    buffers])``; ``buffers``: the fused buffers the step writes from it (BatchNorm statistics, applied only for
    the models whose step is). ``key``: the workload in the record of compile and step times (:func:`record_key`;
    empty: nothing recorded)."""

    WINDOW = 64  # steps whose coefficients are computed at once when the caller knows them ahead (hold_window)
    #: how a compiled step is made: ``whole`` (forward, backward and update one graph: torch.func.grad inside
    #: torch.compile; no Python between them, fastest for small steps: LeNet's compiled step 1.7x the other form),
    #: ``partitioned`` (the loss compiled with AOTAutograd's forward/backward partition, which chooses the
    #: activations the backward keeps, autograd between, the update compiled on its own: ResNet-18's step 17 %
    #: faster), ``model-by-model`` (each model's forward and backward in turn, through the graph of a one-model
    #: array of the same graph compiled once, on its own slices of the weights and the batch, then the one update
    #: of all B: where the fused kernels are slower than B dense ones, a CPU's grouped convolutions with a few
    #: channels per model, ResNet-18's step 1.3x faster on an AVX2 EPYC; offered where the trainer has that
    #: graph, see :class:`OneModel`) or ``partitioned-nchw`` (partitioned, with inductor's convolutions left in
    #: NCHW: it turns a graph with convolutions channels-last, where oneDNN's grouped convolutions with a few
    #: channels per group are slower than NCHW's blocked ones on an AVX-512 EPYC, ResNet-18's step 10 % faster
    #: there; offered for graphs with a convolution, see :data:`FORM_OPTIONS`). A run that records its times
    #: tries the forms offered on a CPU and keeps the fastest (see ``_next_form``).
    FORMS = ("whole", "partitioned", "model-by-model", "partitioned-nchw")
    #: the other forms are tried when the whole step takes at least this long: below it the Python between a
    #: partitioned step's parts costs more than the activations it can save (LeNet at B = 16: 31 ms whole,
    #: 55 ms partitioned), and trying would cost every small array a second compile
    TRY_FORMS_FROM_S = 0.1

    def __init__(self, optimizer, forward: Callable, buffers: Sequence[str] = (), compile: str = "off",
                 key: str = "", total_steps: int = 0, precision: str = "fp32", loss_scale: LossScale | None = None,
                 one_model: "OneModel | None" = None):
        self.opt, self.array, self.forward = optimizer, optimizer.array, forward
        # the model-by-model form needs one model's graph, and each model's own loss (fp16 scales the B losses apart)
        self.one = one_model if precision != "fp16" else None
        offered = {"model-by-model": self.one is not None, "partitioned-nchw": has_convolution(self.array)}
        self.forms = tuple(f for f in self.FORMS if offered.get(f, True)) or ("whole",)
        self.buffers = list(buffers)
        # compile, precision and loss_scale were checked where they were given: a run's settings, train_step()
        self.mode, self.precision = compile, precision
        self.key, self.total_steps = key, total_steps
        B, device = self.array.B, self.array.device
        warn_if_emulated(self.precision, device)  # bf16 / fp16 on a CPU that converts every element: once
        if precision == "fp16":
            loss_scale = loss_scale or LossScale((LossScale.INIT,) * B)
        self.scaler = LossScales(loss_scale, device) if precision == "fp16" else None
        self.alive = torch.ones(B, dtype=torch.bool, device=device)
        self.failed_at = torch.zeros(B, dtype=torch.int64, device=device)
        self.failed_loss = torch.zeros(B, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.losses = torch.zeros(B, device=device)
        self.ok = torch.ones(B, dtype=torch.bool, device=device)
        self._hyper: torch.Tensor | None = None
        # the coefficients of a window of steps, held on the device (see hold_window): rows for steps window_first...
        self._table, self._window, self._window_first = None, [], 0
        self._counted = None  # the optimizer step the device count was last set from (None: not yet)
        self._compiled, self._shapes, self._graphed = None, None, None
        self.form = "whole"  # the compiled step's form (FORMS); measured forms' steady steps, seconds:
        self._form_s: dict[str, float] = {}
        self._forms: dict[str, Callable] = {}  # each form compiled so far
        self._compiled_apply = None  # the update compiled apart (every form's but the whole one's)
        self._compiled_key, self._guarded = None, True  # what the compiled step's update graph is (see _call_compiled)
        self._eager_times: list[float] = []
        self._compiled_times: list[float] = []
        self._record: str | None = None  # the record's key, from the first batch (record_key)
        self.decision: Decision | None = Decision(True, "--compile on") if self.mode == "on" else (
            Decision(False, "--compile off") if self.mode == "off" else None)
        self.compile_s = 0.0

    # ---- the step
    def _loss(self, params: list[torch.Tensor], batch: dict[str, torch.Tensor]) -> tuple:
        """The summed loss of the trainable ``params`` (each model's scaled by its own loss scale in fp16), with
        the per-model losses and the new buffer values."""
        arr, scaler = self.array, self.scaler
        held = {n: arr.buffer(n) for n in arr.buffer_names}
        with autocast(self.precision, arr.device):
            loss, per_model, news = self.forward({**held, **dict(zip(arr.trainable, params))}, batch)
        if scaler is not None:  # each model's loss times its own scale
            loss = scaler.scaled(per_model)
        return loss, (per_model.detach(), [v.detach() for v in news])

    def _gradients(self, params: list[torch.Tensor], batch: dict[str, torch.Tensor], loss_of=None) -> tuple:
        """``(gradients, per_model, news)``: by ``torch.func.grad`` where dynamo captures the step whole, else by
        autograd on leaf views of the weights (func.grad's wrappers cost ~30% on a CNN), through ``loss_of``
        (the loss, compiled on its own in the partitioned form)."""
        if torch.compiler.is_compiling():  # what dynamo captures: the gradient as a function transform
            grads, (per_model, news) = torch.func.grad(lambda ps: self._loss(ps, batch), has_aux=True)(list(params))
            return grads, per_model, news
        with torch.enable_grad():
            leaves = [p.detach().requires_grad_(True) for p in params]
            loss, (per_model, news) = (loss_of or self._loss)(leaves, batch)
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)], per_model, news

    def _body(self, params: list[torch.Tensor], batch: dict[str, torch.Tensor], hyper: torch.Tensor) -> None:
        grads, per_model, news = self._gradients(params, batch)
        self._apply(params, grads, per_model, news, hyper)

    def _partitioned(self, params: list[torch.Tensor], batch: dict[str, torch.Tensor], hyper: torch.Tensor,
                     loss_of: Callable) -> None:
        """The step with its loss (``loss_of``: ``_loss`` compiled) and its update compiled apart (the
        ``partitioned`` forms): AOTAutograd splits the loss into a forward and a backward graph and chooses the
        activations the backward keeps, autograd runs the backward between them."""
        grads, per_model, news = self._gradients(params, batch, loss_of)
        self._compiled_apply(params, grads, per_model, news, hyper)

    def _model_by_model(self, params: list[torch.Tensor], batch: dict[str, torch.Tensor], hyper: torch.Tensor
                        ) -> None:
        """The step with each model's loss and gradient computed in turn (the ``model-by-model`` form): model b's
        graph (``OneModel``, compiled once: every model's has the same shapes) on its block of each fused weight
        and buffer (block b of the model-major axis 0: a view) and its slice of the per-model inputs, autograd
        for its backward; the B gradients, losses and new statistics concatenated back into the fused layout,
        then the one compiled update of all models."""
        arr, one = self.array, self.one
        lens, buffer_lens = self._blocks
        held = {n: (arr.buffer(n), L) for n, L in buffer_lens.items()}
        grads: list[list[torch.Tensor]] = [[] for _ in params]
        losses, news = [], [[] for _ in self.buffers]
        for b in range(arr.B):
            mine = {n: t.narrow(0, b * L, L) for n, (t, L) in held.items()}
            feeds = {n: t.narrow(0, b, 1) if n in one.per_model_inputs else t for n, t in batch.items()}
            with torch.enable_grad():
                leaves = [p.narrow(0, b * L, L).detach().requires_grad_(True) for p, L in zip(params, lens)]
                loss, (per_model, new) = self._compiled_one(leaves, mine, feeds)
                got = torch.autograd.grad(loss, leaves, allow_unused=True)
            for parts, g, leaf in zip(grads, got, leaves):
                parts.append(torch.zeros_like(leaf) if g is None else g)
            losses.append(per_model)
            for parts, v in zip(news, new):
                parts.append(v)
        self._compiled_apply(params, [torch.cat(g) for g in grads], torch.cat(losses), [torch.cat(v) for v in news],
                             hyper)

    def _one_loss(self, leaves: list[torch.Tensor], buffers: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]
                  ) -> tuple:
        """One model's loss (the model-by-model form's): its graph over its blocks ``leaves`` (trainable) and
        ``buffers``, with its per-model loss and new buffer values."""
        with autocast(self.precision, self.array.device):
            loss, per_model, news = self.one.forward({**buffers, **dict(zip(self.array.trainable, leaves))}, batch)
        return loss, (per_model.detach(), [v.detach() for v in news])

    def _apply(self, params: list[torch.Tensor], grads: list[torch.Tensor], per_model: torch.Tensor,
               news: list[torch.Tensor], hyper: torch.Tensor) -> None:
        """The update of the models whose step is applied, and the bookkeeping on the device."""
        arr, scaler = self.array, self.scaler
        B = arr.B
        active = (hyper[0].reshape(B) > 0.5) & self.alive
        stepping = active
        if scaler is not None:  # a model whose scaled gradient overflowed skips this step (GradScaler.step)
            grads, found = scaler.unscale(grads)
            stepping = active & ~found
        hyper = torch.cat([stepping.to(hyper.dtype).reshape(1, B, 1), hyper[1:]])
        ok = self.opt.apply(params, grads, hyper, per_model, dict(zip(self.buffers, news)))
        rejected = stepping & ~ok
        if scaler is not None:
            skipped = active & found
            rejected = rejected | (skipped & (scaler.at_minimum() | ~self._forward_stats(news, skipped)))
            scaler.update(found, active)
        self.count.add_(1)
        first = rejected & (self.failed_at == 0)
        self.failed_at.copy_(torch.where(first, self.count, self.failed_at))
        self.failed_loss.copy_(torch.where(first, per_model.float(), self.failed_loss))
        self.alive.logical_and_(~rejected)
        self.ok.copy_(ok)
        self.losses.copy_(per_model.float())

    def _forward_stats(self, news: Sequence[torch.Tensor], skipped: torch.Tensor) -> torch.Tensor:
        """A skipped step's BatchNorm statistics: the forward ran, and torch writes a module's running statistics
        in its forward whatever the scaler then does, so they are written for the ``skipped`` models too (the
        update graph writes them only with a step it applies). Returns [B]: the models whose new statistics are
        finite (a skipped model whose are not keeps its own and is diverged)."""
        B, arr = self.array.B, self.array
        finite = torch.ones(B, dtype=torch.bool, device=skipped.device)
        for new in news:
            finite = finite & new.reshape(B, -1).isfinite().all(1)
        write = (skipped & finite).reshape(B, 1)
        for name, new in zip(self.buffers, news):
            stat = arr.buffer(name)
            stat.copy_(torch.where(write, new.reshape(B, -1).to(stat.dtype), stat.reshape(B, -1)).reshape(stat.shape))
        return finite

    def __call__(self, batch: dict[str, torch.Tensor], values: StepValues | None = None,
                 ahead: Callable[[int], Sequence[StepValues]] | None = None) -> None:
        """One step of every model on ``batch`` (device tensors) with the optimizer's groups as they are (the
        caller sets this step's values first: ``opt.set_step_values``). No host read.

        ``values`` and ``ahead`` (the run loop's schedules): this step's values, and ``ahead(n)`` the values of
        this step and the next ``n - 1``. The coefficients of ``WINDOW`` steps are then computed at once and held
        on the device (``hold_window``); a step whose values are the window's copies its row into the step's input
        on the device, with no host computation. Without them (a user's loop, where a torch scheduler may move
        the groups at any time) each step's coefficients are computed from the groups."""
        opt = self.opt
        step = opt.state["step"]
        row = self._window_row(step, values, ahead)
        if row is None:
            self._hold(torch.from_numpy(opt.prepare(self.buffers)))
        else:
            self._hyper.copy_(self._table[row], non_blocking=True)
        if self._counted != step:  # a new object, or the optimizer's count was set (a resumed run)
            self.count.fill_(step)
        params = [p.detach() for p in opt._parameters()]
        with torch.no_grad():
            self._run(params, batch)
        opt.finish()
        self._counted = step + 1

    def _input(self, shape: Sequence[int]) -> torch.Tensor:
        """The step's persistent coefficient input ``[K, B, 1]`` (a fixed address: what a captured step reads),
        made again only when K changes (the update graph gained a term)."""
        if self._hyper is None or tuple(self._hyper.shape) != tuple(shape):
            self._hyper = torch.empty(tuple(shape), device=self.array.device)
        return self._hyper

    def _hold(self, coefficients: torch.Tensor) -> None:
        """One step's ``coefficients`` (host) into the step's input; from a pinned host buffer on a GPU, so the
        copy is queued behind the running step instead of waiting for it."""
        self._input(coefficients.shape).copy_(coefficients.pin_memory() if self._hyper.is_cuda else coefficients,
                                              non_blocking=True)

    def _window_row(self, step: int, values, ahead) -> int | None:
        """The row of the coefficient table that holds step ``step + 1`` with ``values`` (holding the next
        window when the table does not), or None: computed on the host for this step alone."""
        if values is None or ahead is None:
            return None
        row = step + 1 - self._window_first
        if not (0 <= row < len(self._window) and self._window[row] == values):
            self.hold_window(ahead(self.WINDOW))
            row = 0
        return row if self._window and self._window[row] == values else None

    def hold_window(self, upcoming: Sequence[StepValues]) -> None:
        """The coefficients of the steps ``upcoming`` (the next step's values first) computed at once
        (``FusedOptimizer.window``: as many as share one update graph) and copied to the device in one copy."""
        table = torch.from_numpy(self.opt.window(upcoming, self.buffers))
        cuda = self._input(table.shape[1:]).is_cuda
        self._table = table.pin_memory().to(self.array.device, non_blocking=True) if cuda else table
        self._window, self._window_first = list(upcoming[:len(table)]), self.opt.state["step"] + 1

    def _run(self, params: list[torch.Tensor], batch: dict[str, torch.Tensor]) -> None:
        if self.key and self._record is None:
            self._record = record_key(self.key, batch, self.array.device)
        if self.decision is None:  # auto: time a few eager steps, then decide
            self._probe(params, batch)
            return
        if not self.decision.compile:
            self._body(params, batch, self._hyper)
            return
        shapes = batch_shapes(batch)
        if self._compiled is None:
            self._compile(params, batch, shapes)
            return
        if shapes != self._shapes:  # e.g. a loader's partial last batch: the same body, eagerly, no recompile
            self._body(params, batch, self._hyper)
            return
        if self._graphed is not None:
            self._graphed(params, batch, self._hyper)
            if self._record and not self._compiled_times and self._graphed.step_s is not None:
                self._compiled_times.append(self._graphed.step_s)  # the faster of replayed and launched
                self._recorded_compiled_step()
            return
        if self._record and len(self._compiled_times) < COMPILED_PROBE_STEPS:  # what auto's next decision uses
            self._sync()
            t0 = time.perf_counter()
            self._call_compiled(params, batch)
            self._sync()
            self._compiled_times.append(time.perf_counter() - t0)
            if len(self._compiled_times) == 1 and self.opt._key == self._compiled_key:
                self._guarded = False  # another form's first call compiled it under guards
            if len(self._compiled_times) == COMPILED_PROBE_STEPS:
                self._recorded_compiled_step()
            return
        self._call_compiled(params, batch)

    def _recorded_compiled_step(self) -> None:
        """The steady-state compiled step into the record (the median of the timed steps after the first); a step
        not faster than the eager one measured here before says so: ``--compile off`` (or ``auto``) is faster."""
        if self._next_form(float(np.median(self._compiled_times[1:] or self._compiled_times))):
            return  # the next form is timed first
        step_s = self._form_s[self.form]
        eager_s = read_times().get(self._record, {}).get("eager_step_s")
        _record_time(self._record, compiled_step_s=step_s, form=self.form,
                     tried=sorted(self._recorded_forms() | set(self._form_s)),
                     machine=machine_description(self.array.device))
        log.info("compiled step: %.1f ms (recorded for --compile auto in %s)", step_s * 1000, times_path())
        if self.mode == "on" and eager_s is not None and step_s >= eager_s:
            log.warning("--compile on: compiled steps (%.1f ms) are not faster than the eager steps measured here "
                        "(%.1f ms) on %s; --compile auto or off would be faster", step_s * 1000, eager_s * 1000,
                        machine_description(self.array.device))

    def _call_compiled(self, params, batch) -> None:
        """The compiled step, without dynamo's guards while nothing it was specialized for can have changed.

        dynamo checks ~200 guards at every call (each input tensor's shape, strides and dtype, the objects the
        step reads): 1.2 ms of a 50 ms Transformer LM step on this CPU, 0.25 ms with them skipped. What the step
        is specialized for is known here: the batch's shapes (checked by ``_run``), the optimizer's update graph
        (its key, checked here) and the fixed shapes of the array's weights, state and buffers. While these are
        the ones it was compiled for, the guards are skipped (dynamo's ``skip_guard_eval_unsafe`` stance); once
        the update graph changes (a hyper-parameter's term appears), dynamo guards every call again and
        recompiles what needs it."""
        if self._guarded or self.opt._key != self._compiled_key:
            self._guarded = True
            self._compiled(params, batch, self._hyper)
            return
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            self._compiled(params, batch, self._hyper)

    def _probe(self, params, batch) -> None:
        self._sync()
        t0 = time.perf_counter()
        self._body(params, batch, self._hyper)
        self._sync()
        self._eager_times.append(time.perf_counter() - t0)
        if len(self._eager_times) < EAGER_PROBE_STEPS:
            return
        eager = float(np.median(self._eager_times[1:]))  # the first eager step builds the update graph
        log.debug("--compile auto timed %d eager steps: %s ms (the first builds the update graph)",
                  len(self._eager_times), ", ".join(f"{t * 1000:.1f}" for t in self._eager_times))
        remaining = max(self.total_steps - (self.opt.state["step"] + 1), 0)
        known = read_times().get(self._record) if self._record else None
        self.decision = auto_decision(remaining, eager, known)
        # a decision with no step left to make it for (verification's steps, `onnxfuse check`) is no news
        log.log(logging.INFO if remaining else logging.DEBUG, "--compile auto: %s the step: %s",
                "compiling" if self.decision.compile else "not compiling", self.decision.why)
        if self._record:
            _record_time(self._record, eager_step_s=eager, machine=machine_description(self.array.device))

    def _compile(self, params, batch, shapes) -> None:
        use_cache()
        self._shapes = shapes
        known = read_times().get(self._record, {}) if self._record else {}
        self.form = known["form"] if known.get("form") in self.forms else self.forms[0]
        self._compiled = self._compiled_form(self.form)
        self._sync()
        t0 = time.perf_counter()
        self._compiled(params, batch, self._hyper)  # the first call compiles
        self._compiled_key, self._guarded = self.opt._key, False
        self._sync()
        self.compile_s = time.perf_counter() - t0
        log.info("compiled the training step in %.1f s", self.compile_s)
        if self._record:
            _record_time(self._record, compile_s=self.compile_s, machine=machine_description(self.array.device))
        if self.array.device.type == "cuda":
            self._graphed = _CudaGraphed(self._compiled, self.array.device)

    @property
    def settled(self) -> bool:
        """Whether the step's form is chosen: eager or compiled, and a compiled step's form (FORMS) measured or
        recorded; steps after it run as every later one will (a benchmark's timed steps start there)."""
        if self.decision is None or (self.decision.compile and self._compiled is None):
            return False
        return not self.decision.compile or not self._record or len(self._compiled_times) >= COMPILED_PROBE_STEPS

    def _compiled_form(self, form: str) -> Callable:
        """The step compiled in ``form`` (compiled on its first call)."""
        if form not in self._forms:
            if form != "whole" and self._compiled_apply is None:
                self._compiled_apply = compiled(self._apply)
            if form.startswith("partitioned"):
                self._forms[form] = functools.partial(self._partitioned,
                                                      loss_of=compiled(self._loss, **FORM_OPTIONS.get(form, {})))
            elif form == "model-by-model":
                self._compiled_one = compiled(self._one_loss)
                arr = self.array
                # each model's block length in every trainable tensor and every buffer (the array's own)
                self._blocks = ([arr.spec.weights[n].block_len for n in arr.trainable],
                                {n: arr.spec.weights[n].block_len for n in arr.buffer_names})
                self._forms[form] = self._model_by_model
            else:
                self._forms[form] = compiled(self._body)
        return self._forms[form]

    def _next_form(self, step_s: float) -> bool:
        """After ``form``'s steady step was timed: on a CPU, with no form recorded for this workload yet, compile
        the next form and time it too (returns True), else keep the fastest measured and record it (False)."""
        self._form_s[self.form] = step_s
        tried = self._recorded_forms()
        untried = [f for f in self.forms if f not in self._form_s and f not in tried]
        worth = self._form_s.get("whole", step_s) >= self.TRY_FORMS_FROM_S
        if untried and worth and self.array.device.type == "cpu":
            self.form, self._compiled_times = untried[0], []
            self._compiled = self._compiled_form(self.form)
            self._guarded = True  # the new form's first call compiles under guards
            return True
        best = min(self._form_s, key=self._form_s.get)
        if best != self.form:
            self.form, self._compiled = best, self._forms[best]
        if len(self._form_s) > 1:
            log.info("compiled step forms: %s; keeping %s", ", ".join(
                f"{f} {t * 1000:.1f} ms" for f, t in self._form_s.items()), best)
        return False

    def _recorded_forms(self) -> set[str]:
        """The forms timed for this workload before (the record's; one made before the model-by-model form existed
        timed the two before it)."""
        known = read_times().get(self._record, {}) if self._record else {}
        return set(known.get("tried", self.FORMS[:2] if "form" in known else ()))

    def _sync(self) -> None:
        _sync(self.array.device)

    def cuda_graph(self) -> str | None:
        """What became of the CUDA graph: "on", "off" (measured slower, or capture failed), None (not tried)."""
        return None if self._graphed is None else self._graphed.state

    # ---- the host's view
    def observe(self) -> Observed:
        """The losses, applied steps and failures as the device holds them now (the one host read)."""
        held = (self.losses, self.ok, self.failed_at, self.failed_loss) + (
            (self.scaler.scale,) if self.scaler is not None else ())
        read = [t.to("cpu", non_blocking=True) for t in held]
        self._sync()
        return Observed(*(t.numpy().copy() for t in read))

    def restart(self) -> None:
        """Every model alive again, no failure recorded: the state the caller set (a resume, a restored state)
        is where the step count begins again."""
        self.alive.fill_(True)
        self.failed_at.zero_()
        self._counted = None


def batch_shapes(batch: dict[str, torch.Tensor]) -> dict:
    """What a compiled function was specialized for: each input's shape and dtype (static shapes)."""
    return {n: (tuple(t.shape), t.dtype) for n, t in batch.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _CudaGraphed:
    """The compiled step, captured in a CUDA graph when that is measured faster (on a GPU the small kernels of a
    fused step are bound by their launches; a graph replays them all in one).

    Every call is a real training step: the first ``WARMUP`` run the compiled step on a side stream (what capture
    needs) and are timed; the next one is captured, with its batch copied into static buffers, and replayed; the
    next ``TRIALS`` replay the graph, timed. The faster of the two then runs every later step (a graph replays the
    same kernels on the same tensors: the results are the same either way). A capture that fails leaves the
    compiled step as it was, and says why. The weights, optimizer state and the step's own buffers are updated in
    place, so their addresses are the graph's; the batch is copied into the graph's buffers at each step."""

    WARMUP, TRIALS = 3, 5

    def __init__(self, fn: Callable, device: torch.device):
        self.fn, self.device = fn, device
        self.state, self.times = "warmup", {"plain": [], "graph": []}
        self.step_s: float | None = None  # the chosen way's median step, once decided
        self.graph, self.static, self.stream = None, None, torch.cuda.Stream(device)

    def __call__(self, params: list, batch: dict, hyper: torch.Tensor) -> None:
        if self.state == "off":
            self.fn(params, batch, hyper)
        elif self.state == "on":
            self._replay(batch)
        elif self.state == "warmup":
            self.times["plain"].append(self._timed(lambda: self._side(params, batch, hyper)))
            if len(self.times["plain"]) >= self.WARMUP:
                self.state = "capture"
        elif self.state == "capture":
            self._capture(params, batch, hyper)
        else:  # trial
            self.times["graph"].append(self._timed(lambda: self._replay(batch)))
            if len(self.times["graph"]) >= self.TRIALS:
                plain, graph = (float(np.median(self.times[k][1:] or self.times[k])) for k in ("plain", "graph"))
                self.state = "on" if graph < plain else "off"
                self.step_s = min(graph, plain)
                log.info("CUDA graph: step %.2f ms replayed vs %.2f ms launched: %s", graph * 1e3, plain * 1e3,
                         "replaying it" if self.state == "on" else "launching the kernels")

    def _side(self, params, batch, hyper) -> None:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self.fn(params, batch, hyper)
        current.wait_stream(self.stream)

    def _capture(self, params, batch, hyper) -> None:
        try:
            self.static = {n: t.clone() for n, t in batch.items()}
            graph = torch.cuda.CUDAGraph()
            _sync(self.device)
            with torch.cuda.graph(graph, stream=self.stream):
                self.fn(params, self.static, hyper)
        except Exception as e:  # noqa: BLE001 - any capture failure: the step runs as it did
            _sync(self.device)
            self.state, self.graph = "off", None
            self.step_s = float(np.median(self.times["plain"][1:] or self.times["plain"]))
            log.info("the step could not be captured in a CUDA graph (%s); it runs without one",
                     " ".join(str(e).split())[:200])
            self.fn(params, batch, hyper)
            return
        self.graph, self.state = graph, "trial"
        graph.replay()  # this step: capturing recorded it, replaying runs it

    def _replay(self, batch) -> None:
        for n, t in batch.items():
            self.static[n].copy_(t, non_blocking=True)
        self.graph.replay()

    def _timed(self, fn) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        fn()
        _sync(self.device)
        return time.perf_counter() - t0


#: inductor's options of a compiled step form (``TrainStep.FORMS``) beyond every form's own (:func:`compiled`)
FORM_OPTIONS = {"partitioned-nchw": {"layout_optimization": False}}


def has_convolution(array) -> bool:
    """Whether the fused graph of ``array`` convolves (what inductor's layout optimization turns channels-last)."""
    return any("Conv" in op for op in array.op_types())


def compiled(method, **options):
    """``torch.compile`` of a bound method, under a code object of its own: dynamo keeps its compiled entries
    per code object, at most 8 for one function (``recompile_limit``) before it silently runs it eagerly, so every
    array's step (a fuzz campaign's, a sweep's re-fused arrays) gets its own. ``options``: inductor's, for this
    function only (:data:`FORM_OPTIONS`)."""
    fn = method.__func__
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    # a graph break inside the step (an op the interpreter runs on the host) leaves torch.func.grad's own wrapper
    # as a frame of its own, shared by every array: let it hold more than 8 compiled entries before dynamo gives
    # up on it (process-wide, a limit raised only: seen in a fuzz campaign's 600 arrays)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # random ops (Dropout) draw from torch's generator as eager kernels do (inductor's option, for this function
    # only): a compiled run's masks are an eager run's, and a resumed run's RNG state means the same in both
    return torch.compile(types.MethodType(own, method.__self__), dynamic=False,
                         options={"fallback_random": True, **options})


def graph_key(*parts) -> str:
    """A short hash naming a graph and what it was compiled for (auto's record)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else repr(p).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:20]


def batchnorm_outputs(model, buffers: set[str]) -> tuple[list[str], list[str]]:
    """The running statistics of every training-mode BatchNorm of ``model`` (an ONNX ModelProto, edited), and the
    names of the outputs (1 and 2) that hold their new values, named where the graph left them unnamed: a step
    reads them and writes them for the models whose step it applies."""
    from onnxfuse.core._graph import Names
    from onnxfuse.core._opset import is_training_batchnorm, onnx_opset

    names = Names.of(model.graph)
    opset = onnx_opset(model)
    stats, outputs = [], []
    for node in model.graph.node:
        if not is_training_batchnorm(node, opset) or node.input[3] not in buffers or node.input[4] not in buffers:
            continue
        while len(node.output) < 3:
            node.output.append("")
        for k in (1, 2):
            if not node.output[k]:
                node.output[k] = names.fresh(f"{node.input[2 + k]}_new")
            stats.append(node.input[2 + k])
            outputs.append(node.output[k])
    return stats, outputs
