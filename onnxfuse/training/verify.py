"""Run-time verification: is the fused array's training each model's own training?

A run checks its own first step(s) (``train_array`` with ``verify_steps``, ``onnxfuse check`` on demand): every
model b is also trained alone, on the same runtime, in a one-model array fused from ``sources/model_0.onnx``, from
the array's own state before the step, on model b's slice of the batch with model b's hyper-parameters; the step's
loss, whether it was applied, the gradient each optimizer received (read from its state:
``Optimizer.received_gradient``) and the buffers are compared by state_dict name, within ``RTOL``,
``ATOL_FRACTION`` and ``LOSS_RTOL``. A model beyond those is measured before it is refused: trained alone again
from inputs nudged by one float32 step (up to ``NUDGES`` draws), it passes within ``SENSITIVITY_FACTOR`` times what
a nudge moves each tensor. What is compared, why the tolerances are what they are, what the check cannot see and
what it was measured to catch: docs/verification.md, "How the check works".
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import onnx

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core.errors import VerificationError
from onnxfuse.core.weights import ArraySpec, pack_weights, unpack_weight

from onnxfuse.recipe.losses import LABELS
from onnxfuse.recipe.optim import STATE_PREFIX, Optimizer, OptimizerConfig, StepValues, UpdateRule
from onnxfuse.runtime.protocol import Runtime

log = logging.getLogger("onnxfuse.train")

__all__ = ["VerifyReport", "ModelCheck", "TensorCheck", "verify_steps", "reference_optimizer", "RTOL", "ATOL_FRACTION",
           "LOSS_RTOL", "LOSS_ATOL", "NUDGES", "SENSITIVITY_FACTOR"]

RTOL = 1e-3
ATOL_FRACTION = 1e-6
LOSS_RTOL = 1e-5
LOSS_ATOL = 1e-7
ROUNDING = 2.0 ** -22  # two float32 roundings (fused and alone) of a parameter, relative to it
# a model's own rounding sensitivity, measured only where the tolerances above fail: NUDGES runs of the model alone
# from its weights and inputs nudged by one float32 step each; a difference passes within SENSITIVITY_FACTOR times
# the largest difference a nudge made (see the module docstring)
NUDGES = 8
SENSITIVITY_FACTOR = 3.0
SKIP_HINT = "To train without this check, pass --verify-steps 0 (verify_steps: 0 in a config file)"


# ------------------------------------------------------------------------------------------------------ results
def _rounding_words(ok: bool, ratio: float, sensitivity: float) -> str:
    return (f"{'within' if ok else 'beyond'} the model's own rounding sensitivity ({ratio:.2g}x of {sensitivity:.3g}: "
            f"what nudging its weights and input by one float32 step moves it alone; at most {SENSITIVITY_FACTOR:g}x "
            f"passes)")


@dataclass
class TensorCheck:
    """One tensor of one model at one step: ``diff`` = ||fused - alone||, ``norm`` = ||alone||."""

    name: str  # the model's original (state_dict) name
    kind: str  # "gradient", "buffer", or "parameter" (an optimizer that cannot say what gradient it received)
    diff: float
    norm: float
    tol: float
    # the largest ||alone, nudged - alone|| of the model's NUDGES runs from weights and inputs nudged by one float32
    # step; None where it was not measured (the model passed the tolerances)
    sensitivity: float | None = None

    @property
    def bound(self) -> float:
        """What passes: the tolerance, or SENSITIVITY_FACTOR times the tensor's own rounding sensitivity."""
        if self.sensitivity is None:
            return self.tol
        return max(self.tol, SENSITIVITY_FACTOR * self.sensitivity)

    @property
    def ok(self) -> bool:
        return self.diff <= self.bound  # False for NaN

    @property
    def within_rounding(self) -> bool:
        """Beyond the tolerance, but within the model's own rounding sensitivity."""
        return self.tol < self.diff <= self.bound

    @property
    def of_rounding(self) -> float:
        """||fused - alone|| as a multiple of the tensor's rounding sensitivity (inf where a nudge moved nothing;
        NaN where it was not measured)."""
        if self.sensitivity is None:
            return float("nan")
        return self.diff / self.sensitivity if self.sensitivity > 0 else float("inf")

    @property
    def rel(self) -> float:
        """||fused - alone|| / ||alone|| (inf where alone is zero and fused is not)."""
        if self.norm > 0:
            return self.diff / self.norm
        return 0.0 if self.diff == 0 else float("inf")

    @property
    def score(self) -> float:
        """How close to failing: diff / bound (>1 fails)."""
        if math.isnan(self.diff):
            return float("inf")
        bound = self.bound
        return self.diff / bound if bound > 0 else (0.0 if self.diff == 0 else float("inf"))

    def describe(self) -> str:
        """How far fused and alone are apart, in words (for an error or a log line)."""
        what = "gradient" if self.kind == "gradient" else "value after the step"
        text = (f"the {what} of '{self.name}' differs by {self.rel:.3g} relative (||fused - alone|| = {self.diff:.3g}, "
                f"tolerance {self.tol:.3g})")
        if self.sensitivity is None or self.diff <= self.tol:
            return text
        return f"{text}, {_rounding_words(self.ok, self.of_rounding, self.sensitivity)}"


@dataclass
class ModelCheck:
    """One model at one checked step."""

    model: int
    step: int
    loss_fused: float
    loss_alone: float
    applied: tuple[bool, bool]  # (in the array, alone): the step passed fault isolation's finite check
    tensors: list[TensorCheck] = field(default_factory=list)
    # where the model's rounding sensitivity was measured: the nudged runs compared, and the largest
    # |alone, nudged - alone| of the loss
    nudges: int = 0
    loss_sensitivity: float | None = None

    @property
    def sensitivity_measured(self) -> bool:
        return self.nudges > 0

    @property
    def loss_ok(self) -> bool:
        a, r = self.loss_fused, self.loss_alone
        if not (np.isfinite(a) and np.isfinite(r)):
            return bool(np.isnan(a) and np.isnan(r)) or a == r
        bound = LOSS_RTOL * abs(r) + LOSS_ATOL
        if self.loss_sensitivity is not None:
            bound = max(bound, SENSITIVITY_FACTOR * self.loss_sensitivity)
        return abs(a - r) <= bound

    @property
    def worst(self) -> TensorCheck | None:
        return max(self.tensors, key=lambda t: t.score, default=None)

    @property
    def ok(self) -> bool:
        return self.loss_ok and self.applied[0] == self.applied[1] and all(t.ok for t in self.tensors)

    @property
    def within_rounding(self) -> bool:
        """Passes only by the model's own rounding sensitivity: beyond the tolerances, within what rounding alone
        moves it."""
        return self.ok and self.sensitivity_measured

    @property
    def of_rounding(self) -> float:
        """The largest ||fused - alone|| / (the model's rounding sensitivity) among what is beyond its tolerance
        (the loss included); NaN where the sensitivity was not measured."""
        if not self.sensitivity_measured:
            return float("nan")
        ratios = [t.of_rounding for t in self.tensors if t.diff > t.tol]
        loss_diff = abs(self.loss_fused - self.loss_alone)
        if loss_diff > LOSS_RTOL * abs(self.loss_alone) + LOSS_ATOL:
            ratios.append(loss_diff / self.loss_sensitivity if self.loss_sensitivity > 0 else float("inf"))
        return max(ratios, default=0.0)

    def problem(self) -> str | None:
        """What differs, in words (None when nothing does); a failing tensor first, since it names the place."""
        bad = [t for t in self.tensors if not t.ok]
        parts = []
        if bad:
            parts.append(max(bad, key=lambda t: t.score).describe())
        if not self.loss_ok:
            loss = f"the loss is {self.loss_fused:.7g} in the array but {self.loss_alone:.7g} alone"
            if self.loss_sensitivity is not None:
                diff, sens = abs(self.loss_fused - self.loss_alone), self.loss_sensitivity
                loss += ", " + _rounding_words(False, diff / sens if sens > 0 else float("inf"), sens)
            parts.append(loss)
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
        """Per model: its first failing step, else the first step it passed only within its own rounding
        sensitivity, else the step whose worst tensor came closest to failing."""
        out: dict[int, ModelCheck] = {}
        rank = lambda c: (not c.ok, c.within_rounding)  # noqa: E731
        for c in self.checks:
            best = out.get(c.model)
            if best is None or rank(c) > rank(best) or (rank(c) == rank(best) == (False, False)
                                                         and _score(c) > _score(best)):
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
        sensitive = [c for c in self.per_model() if c.within_rounding]
        if self.ok and sensitive:
            names = ", ".join(str(c.model) for c in sensitive)
            most = max(sensitive, key=lambda c: c.of_rounding)
            verdict += (f", model{'s' if len(sensitive) > 1 else ''} {names} beyond the tolerances but within "
                        f"{'their' if len(sensitive) > 1 else 'its'} own rounding sensitivity (at most "
                        f"{most.of_rounding:.2g}x what {_nudges(most.nudges)} moved model {most.model}; "
                        f"{SENSITIVITY_FACTOR:g}x passes)")
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
            if not c.ok:
                verdict = f"MISMATCH at step {c.step}"
            elif c.within_rounding:
                verdict = f"ok within its rounding sensitivity ({c.of_rounding:.2g}x what {_nudges(c.nudges)} moved)"
            else:
                verdict = "ok"
            lines.append(f"{c.model:>5}  {c.loss_fused:>11.6g}  {c.loss_alone:>11.6g}  "
                         f"{(w.name if w else '-'):<{width}}  {(w.rel if w else 0.0):>9.2g}  {verdict}")
        return "\n".join(lines)


def _score(c: ModelCheck) -> float:
    return c.worst.score if c.worst else 0.0


def _nudges(n: int) -> str:
    return f"{n} nudge{'s' if n > 1 else ''}"


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
def reference_optimizer(opt: UpdateRule) -> OptimizerConfig:
    """A one-model configuration whose update graph has every term the array's has (weight decay, momentum
    buffer, Nesterov, amsgrad, clipping), so that one reference serves every model: each model's own values are
    fed as coefficients, and a term a model does not use is an exact no-op for it (``g + 0*p``, ``min(inf, 1)``,
    ``buf = 0*buf + 1*g``...), as it is in the array. An optimizer emits a term when some model's value is
    non-zero / true (``UpdateRule.uses``), so per hyper-parameter the reference takes the first such value."""
    some = lambda v: [next((x for x in v if x), v[0])]  # noqa: E731
    return OptimizerConfig(opt.kind, {k: some(v) for k, v in opt.hyper.items()},
                           max_norm=[min(opt.max_norm)] if opt.max_norm else [], momentum_varies=opt.momentum_varies)


def _gradients(opt: UpdateRule, rows: dict[str, float], before: _ModelState, after: _ModelState,
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
    """Tensor by tensor: ||fused - alone|| against RTOL * ||alone|| + ATOL_FRACTION * ||all of alone|| + floor.
    Equal entries differ by nothing, infinities included (a causal mask's -inf), and norms count finite entries."""
    alone = {key: np.asarray(r, np.float64) for key, r in alone.items()}
    norms = {key: _norm(np.where(np.isfinite(r), r, 0.0)) for key, r in alone.items()}
    atol = ATOL_FRACTION * math.sqrt(sum(n * n for n in norms.values()))

    def diff(key: str) -> float:
        f, r = np.asarray(fused[key], np.float64), alone[key]
        with np.errstate(invalid="ignore"):
            return _norm(np.where((f == r) | (np.isnan(f) & np.isnan(r)), 0.0, f - r))

    return [TensorCheck(names.get(key, key), kind, diff(key), norms[key],
                        RTOL * norms[key] + atol + floors.get(key, 0.0)) for key in alone]


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


@dataclass
class _Outcome:
    """What one model's step did, as verification compares it: the loss, whether the step was applied, and per
    tensor (model 0's original name) the gradient received (or the new parameter) and each buffer's new value."""

    loss: float
    applied: bool
    params: dict[str, np.ndarray] = field(default_factory=dict)
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)  # per parameter, the rounding floor of its recovery


class _Model:
    """Model b of one fused step: reads its side of the array, and runs it alone in the one-model reference."""

    def __init__(self, step: _FusedStep, b: int, trainer: Runtime, reference: Runtime, per_model: set[str]):
        spec, opt = trainer.spec, trainer.opt
        self.step, self.b, self.reference = step, b, reference
        self.opt, self.alone_opt = opt, opt.select([b])
        # an optimizer that does not say what gradient it received has its new parameters compared
        self.recovers = type(opt.spec).received_gradient is not Optimizer.received_gradient
        self.rows = dict(zip(opt.rows(), step.rows[:, b]))
        self.params = [spec.weights[n].sources[0] for n in trainer.trainable]
        self.buffers = [spec.weights[n].sources[0] for n in trainer.buffers]
        self.names = {fw.sources[0]: fw.sources[b] for fw in spec.weights.values()}
        self.before = _read(trainer, b, *step.before)
        self.feeds = _model_feeds(step.feeds, per_model, b)
        self.fused = self.outcome(float(step.losses[b]), bool(step.applied[b]), self.before,
                                  _read(trainer, b, *step.after))

    def outcome(self, loss: float, applied: bool, before: _ModelState, after: _ModelState) -> _Outcome:
        out = _Outcome(loss, applied)
        if not applied:
            return out  # a rejected step changed nothing
        if self.recovers:
            out.params, out.floors = _gradients(self.opt, self.rows, before, after, self.params)
        else:
            out.params = {k: after.weights[k] for k in self.params}
        out.buffers = {k: after.weights[k] for k in self.buffers}
        return out

    def alone(self, before: _ModelState | None = None, feeds: dict[str, np.ndarray] | None = None) -> _Outcome:
        """The step of the model alone from ``before`` on ``feeds`` (default: the array's own state and batch)."""
        before = self.before if before is None else before
        reference = self.reference
        _load(reference, before)
        # the reference's graph has every update term of the array's (reference_optimizer); model b's own values
        # become its coefficients
        reference.opt, reference.steps = self.alone_opt, self.step.number - 1
        loss = reference.step(self.feeds if feeds is None else feeds, _model_values(self.step.values, self.b))
        applied = bool(reference.last_ok[0])
        return self.outcome(float(loss[0]), applied, before, _read(reference, 0) if applied else before)

    def compare(self, alone: _Outcome) -> list[TensorCheck]:
        """The array's outcome against ``alone``, tensor by tensor, against the tolerances."""
        kind = "gradient" if self.recovers else "parameter"
        return (_compare(self.fused.params, alone.params, alone.floors, kind, self.names)
                + _compare(self.fused.buffers, alone.buffers, {}, "buffer", self.names))

    def distances(self, a: _Outcome, b: _Outcome) -> dict[str, float]:
        """||a - b|| per tensor, by model b's name."""
        return {self.names[k]: _norm(np.asarray(a.params[k], np.float64) - np.asarray(b.params[k], np.float64))
                for k in b.params} | {self.names[k]: _norm(np.asarray(a.buffers[k], np.float64) - b.buffers[k])
                                      for k in b.buffers}

    def nudged(self, k: int) -> tuple[_ModelState, dict[str, np.ndarray]]:
        """The model's state and batch with every float weight and input moved by one float32 step, up or down at
        random (draw ``k``, reproducible); zeros stay zero. The optimizer state is left as it is: the gradient is
        read through it."""
        rng = np.random.default_rng([self.step.number, self.b, k])
        weights = {n: _nudge(w, rng) for n, w in self.before.weights.items()}
        return _ModelState(weights, self.before.optim), {n: _nudge(v, rng) for n, v in self.feeds.items()}


def _nudge(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``x`` (a float array) with each non-zero element one step of its own precision up or down: x +- ulp(x)."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        return x
    step = np.spacing(np.abs(x)) * (x != 0)
    return np.where(rng.random(x.shape) < 0.5, x - step, x + step).astype(x.dtype)


def _measure_sensitivity(model: _Model, alone: _Outcome, check: ModelCheck) -> None:
    """Fill in ``check``'s rounding sensitivity of model b: runs of the model alone from its weights and inputs
    nudged by one float32 step (:meth:`_Model.nudged`), each compared with ``alone``. Per tensor: the largest
    distance a nudge made, and at least the median relative distance among the model's tensors of its kind
    (gradients, buffers) times its norm, since a few draws can miss the flip of a ReLU that moved one tensor but
    not the model's typical sensitivity. For the loss: the largest distance. Draws stop once the check passes, or
    after NUDGES: a draw can only raise a sensitivity, so stopping changes no verdict. A nudged step that is
    rejected (non-finite) measures nothing."""
    moved = {t.name: 0.0 for t in check.tensors}
    for k in range(NUDGES):
        nudged = model.alone(*model.nudged(k))
        if not nudged.applied:
            continue
        check.nudges += 1
        check.loss_sensitivity = max(check.loss_sensitivity or 0.0, abs(nudged.loss - alone.loss))
        for name, distance in model.distances(nudged, alone).items():
            moved[name] = max(moved[name], distance)
        typical = {kind: float(np.median([moved[t.name] / t.norm for t in check.tensors if t.kind == kind
                                          and t.norm > 0] or [0.0])) for kind in {t.kind for t in check.tensors}}
        for t in check.tensors:
            t.sensitivity = max(moved[t.name], typical[t.kind] * t.norm)
        if check.ok:
            return


def _check_model(step: _FusedStep, b: int, trainer: Runtime, reference: Runtime,
                 per_model: set[str]) -> ModelCheck:
    """Model b's part of ``step`` against the same step of model b alone, from the same state; where that fails
    the tolerances, with the model's own rounding sensitivity measured (and only there: a model that passes pays
    for one step alone, nothing more)."""
    model = _Model(step, b, trainer, reference, per_model)
    alone = model.alone()
    check = ModelCheck(b, step.number, model.fused.loss, alone.loss, (model.fused.applied, alone.applied))
    if not (model.fused.applied and alone.applied):
        return check  # a step rejected in both changed nothing; rejected in one is a mismatch already
    check.tensors = model.compare(alone)
    if not check.ok:
        _measure_sensitivity(model, alone, check)
    return check


def _reference(trainer: Runtime, one_model: tuple[onnx.ModelProto, ArraySpec]) -> Runtime:
    """The one-model trainer the models are checked against, compiled exactly when the array's checked step ran
    compiled (read after that step: ``auto`` probes its first steps eagerly, and a run that stays eager never
    pays a cold compile of the reference). Like with like: a compiled step's kernels may round or break ties
    (a max-pool's equal maxima) otherwise than eager ones, and a compiled reference makes the same choices."""
    kw = {"compile": "on"} if trainer.compiled else {}
    return type(trainer)(*one_model, trainer.loss, reference_optimizer(trainer.opt), device=trainer.device, **kw)


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
    saved = (trainer.weights(), trainer.optimizer_state())
    saved_steps = trainer.steps
    checks: list[ModelCheck] = []
    references: dict[bool, Runtime] = {}  # by whether the checked step ran compiled (auto may start after a probe)
    try:
        state = saved
        for feeds, step_values in zip(batches, values):
            with Stopwatch() as fused_time:
                step = _fused_step(trainer, feeds, step_values, state)
            compiled = bool(trainer.compiled)
            if compiled not in references:
                references[compiled] = _reference(trainer, one_model)
            reference = references[compiled]
            with Stopwatch() as alone_time:
                checks += [_check_model(step, b, trainer, reference, per_model) for b in range(spec.B)]
            state = step.after
            log.debug("verification, step %d: the array's step %.3f s (%s); the %d models alone and compared "
                      "%.3f s", step.number, fused_time.seconds, "compiled" if compiled else "eager", spec.B,
                      alone_time.seconds)
    finally:
        trainer.load({**saved[0], **saved[1]})
        trainer.steps = saved_steps
    return VerifyReport(len(batches), checks, watch.seconds)
