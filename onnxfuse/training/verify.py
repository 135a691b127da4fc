"""Run-time verification: is the fused array's training each model's own training?

A fused array trains B models in one graph. A wrong kernel or a wrong weight mapping trains some model wrongly
without any error (onnxruntime-training 1.19.2's ConvGrad once overran a buffer for grouped 1-D convolutions and
zeroed another parameter's gradient at B >= 2), and a user cannot tell such an array from a right one. So a run
checks its own first step(s) (``train_array`` with ``verify_steps``, ``onnxfuse check`` on demand): every model b
is also trained alone, **on the same runtime**, and the two are compared tensor by tensor by original
(state_dict) name.

*Alone* is a one-model array built from the array's ``sources/model_0.onnx`` by the same pipeline
(``fuse_models``), trained by the same runtime as the array. The B source graphs are identical up to
weights, so ONE such reference is built; for each model b, model b's state is loaded into it (by original name,
through both arrays' weight mappings, whatever slot layouts their rules chose), the step is run with model b's
slice of the batch and model b's hyper-parameters at that step, and its result is read back.

Each checked step t starts the reference from the array's own state before step t (weights, BatchNorm
statistics, optimizer state; at step 1: the initial weights and zero state). Step t is then compared as one
function of identical inputs, for any number of steps: a reference running on by itself would drift from the
array through chaos (Adam turns rounding noise into full-size steps), not through a defect.

What is compared, per model and checked step:

- the step's loss: ``|fused - alone| <= LOSS_RTOL * |alone| + LOSS_ATOL``;
- whether the step was applied (fault isolation rejects a non-finite loss, gradient or update);
- per trainable tensor, the gradient the optimizer received at this step (after clipping and L2 weight decay),
  recovered from the optimizer's own state rather than from the update (each optimizer's registration says how:
  ``Optimizer.received_gradient`` in ``optim.py``; one that does not say has its new parameters compared instead).
  Adam's first update is ~lr*sign(g): where a true gradient is ~0 (a conv bias before BatchNorm) rounding noise
  becomes a full-size step that differs between any two kernels, while the gradient itself differs only by
  rounding::

      Adam, AdamW        g = m_{t-1} + (m_t - m_{t-1}) / (1 - beta1)     exp_avg      (step 1: m_1 / (1 - beta1))
      SGD, momentum      g = (buf_t - mom_c * buf_{t-1}) / damp_c         momentum_buffer       (step 1: buf_1)
      SGD, no state      g = (p_{t-1} - p_t) / lr                         (lr 0: nothing to compare)

  (mom_c, damp_c: the step's coefficients, see ``optim.py``; damp_c = 0, i.e. dampening 1 after step 1, leaves
  the gradient no trace and nothing to compare). A tensor passes when
  ``||fused - alone|| <= RTOL * ||alone|| + ATOL_FRACTION * ||the model's whole gradient, alone||``, for plain SGD
  plus ``2**-22 * ||p|| / lr``, the float32 rounding of the parameters the gradient is read through;
- per buffer (BatchNorm running statistics), its value after the step, by the same rule (``ATOL_FRACTION`` of the
  norm of all the model's buffers).

Dropout draws its masks at random in ONNX Runtime, differently for the array and alone: an array with a Dropout
that drops anything is checked with every Dropout off on both sides (:func:`without_dropout`, in a trainer of its
own, since the run's graph keeps them); the rest of the graph is checked as it trains.

What it cannot see: whatever the array and the reference share. The array's starting weights are read from the
array itself (``sources/`` holds no weights), so an array whose fused weights hold other numbers than the exported
models trains those numbers, correctly; the names ``array.json`` gives model b's tensors are only labels for
``split``; and a kernel that is wrong at B = 1 too is wrong on both sides.

Tolerances. Fused and alone run the same maths through other kernels (a grouped convolution against a plain one,
a batched MatMul against a single one) that sum in other orders. Measured per tensor (LeNet, a CNN with
BatchNorm, the demo's CNN; SGD, Adam, AdamW, clipping, one-cycle; steps 1-3): at most 3.5e-7 relative, and 3e-5
for plain SGD, whose gradient is read through float32 parameters. A defect is of the order of the gradient itself
(the ConvGrad defect: 30% to 100%; a zeroed gradient: 100%). ``RTOL = 1e-3`` sits between the two: ~3000x above
the rounding seen (30x for plain SGD) and ~300x below a defect. ``ATOL_FRACTION = 1e-6`` of the model's whole
gradient lets tensors whose true gradient is ~0 pass: a conv bias before BatchNorm has an exactly zero gradient
and carries rounding noise of ~1e-8 of the model's gradient, where a relative comparison means nothing. The loss
is forward arithmetic from identical weights (~1e-7 relative): ``LOSS_RTOL = 1e-5``. One known source of false
alarms remains: a ReLU input (or a max over a tie) within rounding of zero can flip between two kernels and move a
gradient by more than rounding; at step 1, from identical weights, that is rare, and ``--verify-steps 0`` skips
the check.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import onnx

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core.errors import VerificationError
from onnxfuse.core.weights import ArraySpec, pack_weights, unpack_weight

from onnxfuse.recipe.losses import LABELS
from onnxfuse.recipe.optim import STATE_PREFIX, Optimizer, OptimizerConfig, StepValues
from onnxfuse.recipe.runtimes import Runtime

__all__ = ["VerifyReport", "ModelCheck", "TensorCheck", "verify_steps", "reference_optimizer", "has_random_dropout",
           "without_dropout", "RTOL", "ATOL_FRACTION", "LOSS_RTOL", "LOSS_ATOL"]

RTOL = 1e-3
ATOL_FRACTION = 1e-6
LOSS_RTOL = 1e-5
LOSS_ATOL = 1e-7
ROUNDING = 2.0 ** -22  # two float32 roundings (fused and alone) of a parameter, relative to it
SKIP_HINT = "To train without this check, pass --verify-steps 0 (verify_steps: 0 in a config file)"


# ------------------------------------------------------------------------------------------------------ results
@dataclass
class TensorCheck:
    """One tensor of one model at one step: ``diff`` = ||fused - alone||, ``norm`` = ||alone||."""

    name: str  # the model's original (state_dict) name
    kind: str  # "gradient", "buffer", or "parameter" (an optimizer that cannot say what gradient it received)
    diff: float
    norm: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.diff <= self.tol  # False for NaN

    @property
    def rel(self) -> float:
        """||fused - alone|| / ||alone|| (inf where alone is zero and fused is not)."""
        if self.norm > 0:
            return self.diff / self.norm
        return 0.0 if self.diff == 0 else float("inf")

    @property
    def score(self) -> float:
        """How close to failing: diff / tol (>1 fails)."""
        if math.isnan(self.diff):
            return float("inf")
        return self.diff / self.tol if self.tol > 0 else (0.0 if self.diff == 0 else float("inf"))


@dataclass
class ModelCheck:
    """One model at one checked step."""

    model: int
    step: int
    loss_fused: float
    loss_alone: float
    applied: tuple[bool, bool]  # (in the array, alone): the step passed fault isolation's finite check
    tensors: list[TensorCheck] = field(default_factory=list)

    @property
    def loss_ok(self) -> bool:
        a, r = self.loss_fused, self.loss_alone
        if not (np.isfinite(a) and np.isfinite(r)):
            return bool(np.isnan(a) and np.isnan(r)) or a == r
        return abs(a - r) <= LOSS_RTOL * abs(r) + LOSS_ATOL

    @property
    def worst(self) -> TensorCheck | None:
        return max(self.tensors, key=lambda t: t.score, default=None)

    @property
    def ok(self) -> bool:
        return self.loss_ok and self.applied[0] == self.applied[1] and all(t.ok for t in self.tensors)

    def problem(self) -> str | None:
        """What differs, in words (None when nothing does); a failing tensor first, since it names the place."""
        bad = [t for t in self.tensors if not t.ok]
        parts = []
        if bad:
            t = max(bad, key=lambda t: t.score)
            what = "gradient" if t.kind == "gradient" else "value after the step"
            parts.append(f"the {what} of '{t.name}' differs by {t.rel:.3g} relative (||fused - alone|| = "
                         f"{t.diff:.3g}, tolerance {t.tol:.3g})")
        if not self.loss_ok:
            parts.append(f"the loss is {self.loss_fused:.7g} in the array but {self.loss_alone:.7g} alone")
        if self.applied[0] != self.applied[1]:
            parts.append("the step was " + ("applied in the array but rejected alone" if self.applied[0]
                                            else "rejected in the array but applied alone"))
        if len(bad) > 1:
            parts.append(f"{len(bad)} tensors differ in all")
        return "; ".join(parts) or None


@dataclass
class VerifyReport:
    """The outcome of checking the first ``steps`` steps of every model."""

    steps: int
    checks: list[ModelCheck]  # one per model per checked step
    seconds: float
    dropout_off: bool = False  # checked with every Dropout off (see without_dropout)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def per_model(self) -> list[ModelCheck]:
        """Per model: its first failing step, else the step whose worst tensor came closest to failing."""
        out: dict[int, ModelCheck] = {}
        for c in self.checks:
            best = out.get(c.model)
            if best is None or (best.ok and (not c.ok or _score(c) > _score(best))):
                out[c.model] = c
        return [out[b] for b in sorted(out)]

    def error(self) -> VerificationError | None:
        """The first failing model as one line, or None when every model matches."""
        bad = next((c for c in self.per_model() if not c.ok), None)
        if bad is None:
            return None
        return VerificationError(
            f"verification failed: model {bad.model} trains differently in the fused array than alone (step "
            f"{bad.step}, same runtime, weights, batch and hyper-parameters): {bad.problem()}. The array would "
            f"train it wrongly; please report this with the array folder. {SKIP_HINT}")

    def summary(self) -> str:
        """One line for the log."""
        worst = max(self.per_model(), key=_score)
        where = f"model {worst.model}" + (f", '{worst.worst.name}'" if worst.worst else "")
        rel = worst.worst.rel if worst.worst else 0.0
        steps = "step 1" if self.steps == 1 else f"steps 1-{self.steps}"
        verdict = "every model matches" if self.ok else "MISMATCH"
        dropout = " with Dropout off (its masks are random)" if self.dropout_off else ""
        return (f"verified {steps} of {len(self.per_model())} models against each model trained alone{dropout}: "
                f"{verdict} (largest relative difference {rel:.2g}, {where}) in {self.seconds:.2f}s")

    def table(self) -> str:
        """model, loss fused / alone, worst tensor, its relative difference, verdict."""
        rows = self.per_model()
        width = max([len("worst tensor")] + [len(c.worst.name) for c in rows if c.worst])
        lines = [f"{'model':>5}  {'loss fused':>11}  {'loss alone':>11}  {'worst tensor':<{width}}  "
                 f"{'rel. diff':>9}  verdict"]
        for c in rows:
            w = c.worst
            verdict = "ok" if c.ok else f"MISMATCH at step {c.step}"
            lines.append(f"{c.model:>5}  {c.loss_fused:>11.6g}  {c.loss_alone:>11.6g}  "
                         f"{(w.name if w else '-'):<{width}}  {(w.rel if w else 0.0):>9.2g}  {verdict}")
        return "\n".join(lines)


def _score(c: ModelCheck) -> float:
    return c.worst.score if c.worst else 0.0


# ---------------------------------------------------------------------------------------------------- Dropout
def _constant(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    """The value of ``name`` when it is an initializer or a Constant node's output with a tensor value."""
    for t in model.graph.initializer:
        if t.name == name:
            return onnx.numpy_helper.to_array(t)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            value = next((a for a in node.attribute if a.name == "value"), None)
            return None if value is None else onnx.numpy_helper.to_array(value.t)
    return None


def has_random_dropout(model: onnx.ModelProto) -> bool:
    """Whether a Dropout node of ``model`` may drop something: training mode on (or not known to be off) and a
    ratio that is not a constant 0 (the default ratio is 0.5)."""
    for node in model.graph.node:
        if node.op_type != "Dropout" or len(node.input) < 3 or not node.input[2]:
            continue  # without training_mode, Dropout passes its input through
        training = _constant(model, node.input[2])
        ratio = _constant(model, node.input[1]) if node.input[1] else np.array(0.5)
        if (training is None or bool(training)) and (ratio is None or float(ratio) != 0.0):
            return True
    return False


def without_dropout(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose Dropout nodes pass their input through (training_mode input removed), everything
    else (BatchNorm in training mode included) as it is."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.op_type == "Dropout" and len(node.input) > 2:
            node.input[2] = ""
    return out


# ------------------------------------------------------------------------------------------ the weight mapping
def _pieces(spec: ArraySpec, fused: dict[str, np.ndarray], b: int) -> dict[str, np.ndarray]:
    """Model b's original tensors among ``fused`` (by fused name), keyed by model 0's original name: the key the
    array and its one-model reference (built from model 0's source graph) share."""
    return {fw.sources[0]: unpack_weight(fw, fused[fw.name], b) for fw in spec.weights.values() if fw.name in fused}


def _pack(spec: ArraySpec, pieces: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The fused tensors of a one-model array from its original tensors (keyed by model 0's name)."""
    return {fw.name: pack_weights(fw.slot, [pieces[fw.sources[0]]]) for fw in spec.weights.values()
            if fw.sources[0] in pieces}


def _unflatten(flat: np.ndarray, spec: ArraySpec, order: Sequence[str]) -> dict[str, np.ndarray]:
    """A flat ``[B, P]`` optimizer state as one fused-shaped tensor per parameter: row b is the concatenation of
    every parameter's model-b block in the trainer's parameter order (see ``optim.py``)."""
    out, start = {}, 0
    for name in order:
        fw = spec.weights[name]
        size = int(np.prod(fw.fused_shape)) // spec.B
        out[name] = flat[:, start:start + size].reshape(fw.fused_shape)
        start += size
    return out


def _flatten(fused: dict[str, np.ndarray], spec: ArraySpec, order: Sequence[str]) -> np.ndarray:
    """The inverse of :func:`_unflatten`."""
    return np.ascontiguousarray(np.concatenate([fused[n].reshape(spec.B, -1) for n in order], axis=1))


@dataclass
class _ModelState:
    """One model's tensors, keyed by model 0's original name: weights (parameters and buffers) and optimizer
    state (``optim.<name>`` -> per parameter)."""

    weights: dict[str, np.ndarray]
    optim: dict[str, dict[str, np.ndarray]]


def _read(trainer: Runtime, b: int, weights=None, optim=None) -> _ModelState:
    """Model b's state in ``trainer`` (or in the given copies of its fused weights / optimizer state)."""
    weights = trainer.weights() if weights is None else weights
    optim = trainer.optimizer_state() if optim is None else optim
    per_param = {s: _pieces(trainer.spec, _unflatten(v, trainer.spec, trainer.trainable), b)
                 for s, v in optim.items()}
    return _ModelState(_pieces(trainer.spec, weights, b), per_param)


def _load(reference: Runtime, state: _ModelState) -> None:
    """Write one model's state into the one-model reference, through the reference's own weight mapping."""
    reference.load(_pack(reference.spec, state.weights))
    reference.load({s: _flatten(_pack(reference.spec, pieces), reference.spec, reference.trainable)
                    for s, pieces in state.optim.items()})


# --------------------------------------------------------------------------------------------- the comparison
def reference_optimizer(opt: OptimizerConfig) -> OptimizerConfig:
    """A one-model configuration whose update graph has every term the array's has (weight decay, momentum
    buffer, Nesterov, amsgrad, clipping), so that one reference serves every model: each model's own values are
    fed as coefficients, and a term a model does not use is an exact no-op for it (``g + 0*p``, ``min(inf, 1)``,
    ``buf = 0*buf + 1*g``...), as it is in the array. An optimizer emits a term when some model's value is
    non-zero / true (``OptimizerConfig.uses``), so per hyper-parameter the reference takes the first such value."""
    some = lambda v: [next((x for x in v if x), v[0])]  # noqa: E731
    return OptimizerConfig(opt.kind, {k: some(v) for k, v in opt.hyper.items()},
                           max_norm=[min(opt.max_norm)] if opt.max_norm else [], momentum_varies=opt.momentum_varies)


def _gradients(opt: OptimizerConfig, rows: dict[str, float], before: _ModelState, after: _ModelState,
               params: Sequence[str]) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Per parameter, the gradient the optimizer received at this step, recovered from the state before and
    after it (see the module docstring), in float64; and per parameter the rounding floor of that recovery."""
    grads, floors = {}, {}
    for name in params:
        def values(state: _ModelState) -> dict[str, np.ndarray]:
            out = {s[len(STATE_PREFIX):]: pieces[name].astype(np.float64) for s, pieces in state.optim.items()}
            return {**out, "param": state.weights[name].astype(np.float64)}

        got = opt.spec.received_gradient(rows, values(before), values(after))
        if got is None:  # e.g. lr 0, or dampening 1 after step 1: the gradient leaves no trace
            continue
        grads[name], gain = got
        floors[name] = ROUNDING * _norm(before.weights[name].astype(np.float64)) * gain if gain else 0.0
    return grads, floors


def _norm(x: np.ndarray) -> float:
    """The 2-norm in float64, without BLAS (numpy's BLAS threads fight ONNX Runtime's for the cores: 100x slower)."""
    x = np.asarray(x, np.float64)
    return math.sqrt(float(np.sum(x * x)))


def _compare(fused: dict[str, np.ndarray], alone: dict[str, np.ndarray], floors: dict[str, float], kind: str,
             names: dict[str, str]) -> list[TensorCheck]:
    """Tensor by tensor: ||fused - alone|| against RTOL * ||alone|| + ATOL_FRACTION * ||all of alone|| + floor."""
    norms = {key: _norm(r) for key, r in alone.items()}
    atol = ATOL_FRACTION * math.sqrt(sum(n * n for n in norms.values()))
    return [TensorCheck(names.get(key, key), kind, _norm(np.asarray(fused[key], np.float64) - r), norms[key],
                        RTOL * norms[key] + atol + floors.get(key, 0.0)) for key, r in alone.items()]


def _model_feeds(feeds: dict[str, np.ndarray], per_model: set[str], b: int) -> dict[str, np.ndarray]:
    """Model b's part of a fused batch: its row of every per-model array ([B, N, ...] -> [1, N, ...])."""
    return {k: (np.ascontiguousarray(v[b:b + 1]) if k in per_model else v) for k, v in feeds.items()}


def _model_values(values: StepValues, b: int) -> StepValues:
    return StepValues([values.lr[b]], [values.momentum[b]], [values.active[b]])


@dataclass
class _FusedStep:
    """One step of the array: its inputs, and its state (fused weights, flat optimizer state) around it."""

    number: int  # 1-based
    feeds: dict[str, np.ndarray]
    values: StepValues
    rows: np.ndarray  # [K, B] the optimizer coefficients of the step (float32 values, as the graph used them)
    losses: np.ndarray
    applied: np.ndarray
    before: tuple[dict, dict]
    after: tuple[dict, dict]


def _fused_step(trainer: Runtime, feeds: dict[str, np.ndarray], values: StepValues,
                before: tuple[dict, dict]) -> _FusedStep:
    number = trainer.steps + 1
    rows = trainer.opt.coefficients(number, values)[:, :, 0].astype(np.float64)
    losses = trainer.step(feeds, values)
    return _FusedStep(number, feeds, values, rows, losses, trainer.last_ok.copy(), before,
                      (trainer.weights(), trainer.optimizer_state()))


def _check_model(step: _FusedStep, b: int, trainer: Runtime, reference: Runtime,
                 per_model: set[str]) -> ModelCheck:
    """Model b's part of ``step`` against the same step of model b alone, from the same state."""
    spec, opt = trainer.spec, trainer.opt
    before = _read(trainer, b, *step.before)
    fused_after = _read(trainer, b, *step.after)
    _load(reference, before)
    # the reference's graph has every update term of the array's (reference_optimizer); model b's own values
    # become its coefficients
    reference.opt, reference.steps = opt.select([b]), step.number - 1
    loss_alone = reference.step(_model_feeds(step.feeds, per_model, b), _model_values(step.values, b))
    check = ModelCheck(b, step.number, float(step.losses[b]), float(loss_alone[0]),
                       (bool(step.applied[b]), bool(reference.last_ok[0])))
    if not (step.applied[b] and reference.last_ok[0]):
        return check  # a step rejected in both changed nothing; rejected in one is a mismatch already
    alone_after = _read(reference, 0)
    rows = dict(zip(opt.rows(), step.rows[:, b]))
    params = [spec.weights[n].sources[0] for n in trainer.trainable]
    buffers = [spec.weights[n].sources[0] for n in trainer.buffers]
    names = {fw.sources[0]: fw.sources[b] for fw in spec.weights.values()}
    if type(opt.spec).received_gradient is Optimizer.received_gradient:  # no recovery: the new parameters
        check.tensors = _compare({k: fused_after.weights[k] for k in params},
                                 {k: alone_after.weights[k] for k in params}, {}, "parameter", names)
    else:
        g_fused, _ = _gradients(opt, rows, before, fused_after, params)
        g_alone, floors = _gradients(opt, rows, before, alone_after, params)
        check.tensors = _compare(g_fused, g_alone, floors, "gradient", names)
    check.tensors = (check.tensors
                     + _compare({k: fused_after.weights[k] for k in buffers},
                                {k: alone_after.weights[k] for k in buffers}, {}, "buffer", names))
    return check


def verify_steps(trainer: Runtime, one_model: tuple[onnx.ModelProto, ArraySpec],
                 batches: Sequence[dict[str, np.ndarray]], values: Sequence[StepValues]) -> VerifyReport:
    """Check ``len(batches)`` steps of the array in ``trainer`` (from its current state: step t with ``values[t]``
    on ``batches[t]``) against every model trained alone (see the module docstring). ``one_model`` is the
    one-model array of the array's first source graph (``fuse_models`` of ``sources/model_0.onnx`` with its
    weights); its trainer is built here, with :func:`reference_optimizer`. ``trainer`` is left exactly as it was
    (weights, optimizer state, step count), so a run verified this way goes on bit for bit as one that was not.
    """
    watch = Stopwatch()
    spec = trainer.spec
    per_model = {i["name"] for i in spec.inputs if i.get("per_model")} | (
        {LABELS} if trainer.loss.per_model_labels else set())
    # like with like: a compiled array is checked against a compiled reference ("auto" decides each alone; its
    # first steps, the ones checked, are eager)
    kw = {"compile": trainer.compile} if trainer.compile != "off" else {}
    reference = type(trainer)(*one_model, trainer.loss, reference_optimizer(trainer.opt), device=trainer.device, **kw)
    saved = (trainer.weights(), trainer.optimizer_state())
    saved_steps = trainer.steps
    checks: list[ModelCheck] = []
    try:
        state = saved
        for feeds, step_values in zip(batches, values):
            step = _fused_step(trainer, feeds, step_values, state)
            checks += [_check_model(step, b, trainer, reference, per_model) for b in range(spec.B)]
            state = step.after
    finally:
        trainer.load({**saved[0], **saved[1]})
        trainer.steps = saved_steps
    return VerifyReport(len(batches), checks, watch.seconds)
