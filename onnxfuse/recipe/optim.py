"""Per-model optimizers inside the training graph.

ONNX Runtime's optimizer graph takes one scalar learning rate for every parameter. onnxfuse instead appends the
update maths to the training graph as standard ONNX ops, with per-model coefficients fed each step as one small
input ``[K, B, 1]`` (K coefficient rows, B models): no optimizer session, no host copies of parameters.

Every fused parameter is model-major (see ``onnxfuse.core.weights``), so it is viewed as ``[B, -1]``; all of them
together form one ``[B, P]`` matrix multiplied by ``[B, 1]`` coefficients. Optimizer state (momentum buffer, Adam
moments) lives in flat ``[B, P]`` checkpoint parameters ``optim.<state>`` and, like the parameters, is written in
place with ``com.microsoft`` ``InPlaceAccumulatorV2(overwrite)``.

An optimizer is one registration, an :class:`Optimizer`: its hyper-parameters (the CLI flags, config keys and
``TrainConfig`` fields are made from them) and its maths, which mirrors torch.optim's single-tensor implementation
operation by operation, with every value per model (the learning rate, and the momentum or beta1 a schedule such
as one-cycle moves, as they are at this step, so a learning-rate schedule is just other coefficients):

SGD   g = g + wd*p;  buf = mom_c*buf + damp_c*g (step 1: mom_c=0, damp_c=1, i.e. buf = g)
      d = g_c*g + buf_c*buf (nesterov: g + momentum*buf; plain: buf);  p = p - lr*d
Adam  g = g + wd*p (Adam) or p = p*(1 - lr*wd) (AdamW);  m = m + (1-b1)*(g - m);  v = b2*v + (1-b2)*g*g
      vmax = max(vmax, v) (amsgrad);  p = p - (lr/bc1) * m / (sqrt(v or vmax)/sqrt(bc2) + eps),  bc_i = 1 - b_i^t

What every optimizer shares is :meth:`UpdateRule.append_update`'s, around the registered maths:

clip  g = g * min(max_norm / (||g|| + 1e-6), 1)                 (clip_grad_norm_, each model's own norm)

Fault isolation: a model whose loss, gradient, new parameters or new buffers (BatchNorm running statistics) are
not finite, or that the trainer marked inactive, keeps its parameters, optimizer state and buffers
(``Where(ok, new, old)``): its step is rejected as a whole, at the step where anything of it first stops being
finite, so the state it is frozen in is entirely finite. The step's per-model ``ok`` flags are an output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from onnxfuse.core.errors import ConfigError

from onnxfuse.core._builder import GraphBuilder
from onnxfuse.recipe.settings import (BOOL, OPTIMIZERS as _REGISTRY, OptimizerSpec, Param, hyper_params, pair, real,
                                      register_optimizer)

__all__ = ["Optimizer", "UpdateRule", "OptimizerConfig", "make_optimizer", "max_norms", "per_model", "OPTIMIZERS",
           "HYPER_INPUT", "STATE_PREFIX", "StepValues", "register_optimizer", "append_clip", "flat_models",
           "unflat_models", "add_param_group"]

HYPER_INPUT = "optim.hyper"
STATE_PREFIX = "optim."
COMMON_ROWS = ("active", "max_norm")  # the rows append_update itself reads, before each optimizer's own


@dataclass
class StepValues:
    """The per-model values of one step: learning rate, and the hyper-parameter the optimizer lets a schedule
    move (its ``cycles``: SGD's momentum, Adam's beta1; None for an optimizer without one), which a schedule such
    as one-cycle moves too; ``active`` is 0 for a model that must not change (diverged or frozen)."""

    lr: list[float]
    momentum: list  # the value of the optimizer's cycled hyper-parameter (SGD momentum, Adam's beta1), or None
    active: list[bool]


@dataclass
class Optimizer(OptimizerSpec):
    """An optimizer's one registration: its hyper-parameters (``name``, ``params``, ``help``, ``check``: see
    :class:`OptimizerSpec`) and its maths, on the array's flat ``[B, P]`` parameters ``P`` and gradients ``G``
    (already clipped). A subclass states the maths in its docstring and gives:

    ``rows``                    the names of its per-model coefficient rows (fed as ``[K, B, 1]`` each step)
    ``coefficients(step, v)``   one model's values of those rows at optimizer step ``step`` (1-based), in float64,
                                from ``v``: that model's hyper-parameters by name, with this step's ``lr`` and
                                cycled value
    ``state_names(config)``     the flat ``[B, P]`` state buffers ``config`` needs (``optim.<name>``, zero at first)
    ``emit(gb, P, G, row, config)``   append the update: returns the new parameters and ``[(state buffer, its new
                                value)]``; ``row[name]`` is that coefficient row, ``[B, 1]``. A term is emitted when
                                ``config.uses(name)`` (some model's value is non-zero / true) and must be an exact
                                no-op for a model whose value is zero (``g + 0*p``): one graph serves every model
    ``cycles``                  the hyper-parameter a schedule may move with the lr (one-cycle's momentum): a
                                name, ``(name, index)`` for one element of a pair, or None (torch's one-cycle
                                moves a ``momentum``, or the first of ``betas``)
    ``received_gradient(rows, before, after)``  (optional) the gradient one tensor received, recovered from
                                its state, for run-time verification (``verify.py``)

    Registered with ``register_optimizer``, it is accepted by the CLI, config files, ``TrainConfig``, the grid,
    one-cycle and placement with no other edit."""

    rows: ClassVar[tuple[str, ...]] = ()
    cycles: ClassVar[str | tuple[str, int] | None] = None

    def __post_init__(self) -> None:
        if self.param("lr") is None:
            raise TypeError(f"optimizer '{self.name}' needs the lr hyper-parameter (schedules move it): add LR to "
                            "its params")
        clash = set(self.rows) & set(COMMON_ROWS)
        if clash:
            raise TypeError(f"optimizer '{self.name}': row names {sorted(clash)} are append_update's own; rename")

    def state_names(self, config: "OptimizerConfig") -> list[str]:
        return []

    def coefficients(self, step: int, v: dict[str, Any]) -> list[float]:
        raise NotImplementedError

    def emit(self, gb: GraphBuilder, P: str, G: str, row: dict[str, str],
             config: "OptimizerConfig") -> tuple[str, list[tuple[str, str]]]:
        raise NotImplementedError

    def received_gradient(self, rows: dict[str, float], before: dict[str, np.ndarray],
                          after: dict[str, np.ndarray]) -> tuple[np.ndarray, float] | None:
        """One tensor's gradient at this step, from its values ``before`` and ``after`` the step (float64; key
        ``"param"`` and each state buffer's name) and the model's coefficient ``rows``; and the factor by which
        the parameters' float32 rounding reaches it (0 when read from the state, ``1/lr`` when read through the
        parameters). None: nothing to compare. Not overridden: verification compares the new parameters."""
        return None

    def state_slots(self) -> int:
        """State buffers per weight at the default hyper-parameters: what placement plans training memory for."""
        return len(make_optimizer(self.name, 1).state_names())


def _norm(x: np.ndarray) -> float:
    """The 2-norm in float64, without BLAS (see verify.py)."""
    return math.sqrt(float(np.sum(x * x)))


# ---- the optimizers (torch.optim's defaults), each registered once with its hyper-parameters and maths. A
# parameter shared by several optimizers is one Param.
LR = Param("lr", real(ge=0.0), 1e-3, "learning rate", per_model=True)
WEIGHT_DECAY = Param("weight_decay", real(ge=0.0), 0.0, "weight decay (Adam: L2 added to the gradient; AdamW: "
                     "decoupled)", per_model=True)
MOMENTUM = Param("momentum", real(ge=0.0, lt=1.0), 0.0, "momentum", per_model=True)
DAMPENING = Param("dampening", real(ge=0.0, le=1.0), 0.0, "dampening", per_model=True)
NESTEROV = Param("nesterov", BOOL, False, "Nesterov momentum (needs momentum > 0 and dampening 0)", per_model=True)
BETAS = Param("betas", pair(real(ge=0.0, lt=1.0), "a pair [beta1, beta2], each in [0, 1)"), (0.9, 0.999),
              "beta1,beta2 (one pair, or one per model in --config)", per_model=True)
EPS = Param("eps", real(gt=0.0), 1e-8, "eps", per_model=True)
AMSGRAD = Param("amsgrad", BOOL, False, "AMSGrad", per_model=True)


def _nesterov_rule(v: dict) -> str | None:
    if v["nesterov"] and (v["momentum"] <= 0 or v["dampening"] != 0):
        return (f"nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD), got momentum {v['momentum']} "
                f"and dampening {v['dampening']}")
    return None


class SGD(Optimizer):
    """torch.optim.SGD:  g = g + wd*p;  buf = mom_c*buf + damp_c*g (step 1, or momentum 0: buf = g);
    d = g_c*g + buf_c*buf (nesterov: g + momentum*buf, else buf);  p = p - lr*d.
    The momentum buffer exists when some model has momentum, or a schedule moves it."""

    rows = ("wd", "mom_c", "damp_c", "g_c", "buf_c", "lr")
    cycles = "momentum"

    def state_names(self, config):
        return ["momentum_buffer"] if config.momentum_varies or config.uses("momentum") else []

    def coefficients(self, step, v):
        m, d = v["momentum"], v["dampening"]
        mom_c, damp_c = (0.0, 1.0) if (step == 1 or m == 0) else (m, 1.0 - d)
        g_c, buf_c = (1.0, m) if v["nesterov"] else (0.0, 1.0)
        return [v["weight_decay"], mom_c, damp_c, g_c, buf_c, v["lr"]]

    def emit(self, gb, P, G, row, config):
        news = []
        if config.uses("weight_decay"):
            G = gb.one("Add", [G, gb.one("Mul", [P, row["wd"]])])
        if self.state_names(config):
            buf = STATE_PREFIX + "momentum_buffer"
            Bn = gb.one("Add", [gb.one("Mul", [buf, row["mom_c"]]), gb.one("Mul", [G, row["damp_c"]])])
            news.append((buf, Bn))
            D = gb.one("Add", [gb.one("Mul", [G, row["g_c"]]), gb.one("Mul", [Bn, row["buf_c"]])]) \
                if config.uses("nesterov") else Bn
        else:
            D = G
        return gb.one("Sub", [P, gb.one("Mul", [D, row["lr"]])]), news

    def received_gradient(self, rows, before, after):
        """g = (buf_t - mom_c * buf_{t-1}) / damp_c with a momentum buffer (damp_c 0, i.e. dampening 1 after
        step 1: no trace); without one, g = (p_{t-1} - p_t) / lr (lr 0: nothing to compare)."""
        if "momentum_buffer" in before:
            if rows["damp_c"] == 0:
                return None
            return (after["momentum_buffer"] - rows["mom_c"] * before["momentum_buffer"]) / rows["damp_c"], 0.0
        if rows["lr"] == 0:
            return None
        return (before["param"] - after["param"]) / rows["lr"], 1.0 / rows["lr"]


class Adam(Optimizer):
    """torch.optim.Adam:  g = g + wd*p;  m = m + (1-b1)*(g - m);  v = b2*v + (1-b2)*g*g;  vmax = max(vmax, v)
    (amsgrad);  p = p - (lr/bc1) * m / (sqrt(v or vmax)/sqrt(bc2) + eps),  bc_i = 1 - b_i^t.
    AdamW (``decoupled``): p = p*(1 - lr*wd) before the update instead of the L2 term."""

    rows = ("wd", "decay", "one_minus_b1", "b2", "one_minus_b2", "sqrt_bc2", "eps", "step_size", "amsgrad")
    cycles = ("betas", 0)  # one-cycle moves beta1
    decoupled: ClassVar[bool] = False

    def state_names(self, config):
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if config.uses("amsgrad") else [])

    def coefficients(self, step, v):
        lr, wd, (b1, b2), eps = v["lr"], v["weight_decay"], v["betas"], v["eps"]
        bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
        decoupled = self.decoupled
        return [0.0 if decoupled else wd, 1.0 - lr * wd if decoupled else 1.0, 1.0 - b1, b2, 1.0 - b2, bc2 ** 0.5,
                eps, lr / bc1, float(v["amsgrad"])]

    def emit(self, gb, P, G, row, config):
        if not self.decoupled and config.uses("weight_decay"):
            G = gb.one("Add", [G, gb.one("Mul", [P, row["wd"]])])
        P1 = gb.one("Mul", [P, row["decay"]]) if self.decoupled and config.uses("weight_decay") else P
        M, V = STATE_PREFIX + "exp_avg", STATE_PREFIX + "exp_avg_sq"
        Mn = gb.one("Add", [M, gb.one("Mul", [gb.one("Sub", [G, M]), row["one_minus_b1"]])])
        Vn = gb.one("Add", [gb.one("Mul", [V, row["b2"]]), gb.one("Mul", [gb.one("Mul", [G, G]), row["one_minus_b2"]])])
        news = [(M, Mn), (V, Vn)]
        Vd = Vn
        if config.uses("amsgrad"):
            Vmax = STATE_PREFIX + "max_exp_avg_sq"
            Vmn = gb.one("Max", [Vmax, Vn])
            news.append((Vmax, Vmn))
            Vd = gb.one("Where", [gb.one("Greater", [row["amsgrad"], gb.const(0.5)]), Vmn, Vn])
        denom = gb.one("Add", [gb.one("Div", [gb.one("Sqrt", [Vd]), row["sqrt_bc2"]]), row["eps"]])
        return gb.one("Sub", [P1, gb.one("Mul", [gb.one("Div", [Mn, denom]), row["step_size"]])]), news

    def received_gradient(self, rows, before, after):
        """g = m_{t-1} + (m_t - m_{t-1}) / (1 - beta1)  (step 1: m_1 / (1 - beta1))."""
        m0 = before["exp_avg"]
        return m0 + (after["exp_avg"] - m0) / rows["one_minus_b1"], 0.0


class AdamW(Adam):
    decoupled = True


register_optimizer(SGD("sgd", (LR, MOMENTUM, DAMPENING, NESTEROV, WEIGHT_DECAY), "torch.optim.SGD",
                       check=_nesterov_rule))
register_optimizer(Adam("adam", (LR, WEIGHT_DECAY, BETAS, EPS, AMSGRAD), "torch.optim.Adam"))
register_optimizer(AdamW("adamw", (LR, WEIGHT_DECAY.with_default(1e-2), BETAS, EPS, AMSGRAD), "torch.optim.AdamW"))
OPTIMIZERS = tuple(_REGISTRY)  # the built-in names (the registry, settings.OPTIMIZERS, is what grows)


class UpdateRule:
    """The array's update, as the update graph and a trainer read it: which registered optimizer (``kind``), each
    of its hyper-parameters as a tuple with one value per model (``hyper``, :func:`per_model`'s form), each model's
    gradient-clipping coefficient (``max_norm``: its clip_grad_norm, inf for a model not clipped, since
    min(inf / (norm + 1e-6), 1) = 1 leaves the gradient as it is), and whether a schedule moves the optimizer's
    cycled value (``momentum_varies``, one-cycle: its state is then kept for every model). The maths is the
    registration's (``spec``).

    Two things are update rules: a run's settings (``recipe.train_config.RunSettings``, read by the trainer as they
    are) and :class:`OptimizerConfig`, the one the Python API makes (:func:`make_optimizer`) or an array keeps
    after it shrinks (:meth:`select`)."""

    kind: str
    hyper: Mapping[str, tuple]
    max_norm: Sequence[float]
    momentum_varies: bool
    B: int

    @property
    def spec(self) -> Optimizer:
        spec = _REGISTRY.get(self.kind)
        if not isinstance(spec, Optimizer):
            raise ConfigError(f"optimizer '{self.kind}' is not registered with its maths; register an "
                              "onnxfuse.recipe.optim.Optimizer subclass")
        return spec

    @property
    def clips(self) -> bool:
        return any(math.isfinite(m) for m in self.max_norm)

    def uses(self, name: str) -> bool:
        """Whether some model's ``name`` is non-zero / true: the update graph then has that term."""
        return any(bool(v) for v in self.hyper[name])

    def cycled(self) -> list:
        """Each model's configured value of the hyper-parameter a schedule may move (None without one)."""
        what = self.spec.cycles
        if what is None:
            return [None] * self.B
        name, index = (what, None) if isinstance(what, str) else what
        return [v if index is None else v[index] for v in self.hyper[name]]

    def constant_values(self, active: Sequence[bool] | None = None) -> StepValues:
        """The step values of no schedule: each model's configured lr and cycled value; ``active`` (default: every
        model)."""
        return StepValues(list(self.hyper["lr"]), self.cycled(), [True] * self.B if active is None else list(active))

    def model_values(self, b: int, values: StepValues) -> dict[str, Any]:
        """Model b's hyper-parameters by name, with this step's lr and cycled value."""
        v = {name: vals[b] for name, vals in self.hyper.items()}
        v["lr"] = values.lr[b]
        what = self.spec.cycles
        if what is not None:
            name, index = (what, None) if isinstance(what, str) else what
            if index is None:
                v[name] = values.momentum[b]
            else:
                old = tuple(v[name])
                v[name] = old[:index] + (values.momentum[b],) + old[index + 1:]
        return v

    def select(self, keep: Sequence[int]) -> "OptimizerConfig":
        """The configuration of the models ``keep`` (by position), e.g. after an array shrinks."""
        pick = lambda v: [v[i] for i in keep] if v else v  # noqa: E731
        return OptimizerConfig(self.kind, {k: tuple(pick(v)) for k, v in self.hyper.items()},
                               pick(list(self.max_norm)), self.momentum_varies)

    # ---- graph side
    def state_names(self) -> list[str]:
        """The flat [B, P] state buffers this configuration needs (named ``optim.<name>``)."""
        return self.spec.state_names(self)

    def rows(self) -> list[str]:
        return list(COMMON_ROWS) + list(self.spec.rows)

    def coefficients(self, step: int, values: StepValues | None = None) -> np.ndarray:
        """The ``[K, B, 1]`` float32 input for optimizer step ``step`` (1-based), computed in float64 like torch's
        Python-side scalars and rounded once. ``values`` gives this step's lr/momentum/active (default: the
        configured constants, every model active)."""
        B, spec = self.B, self.spec
        values = self.constant_values() if values is None else values
        rows = np.zeros((len(self.rows()), B), dtype=np.float64)
        for b in range(B):
            max_norm = self.max_norm[b] if self.max_norm else np.inf
            own = spec.coefficients(step, self.model_values(b, values))
            rows[:, b] = [float(values.active[b]), max_norm] + list(own)
        return rows.astype(np.float32)[:, :, None]

    def append_update(self, gb: GraphBuilder, params: Sequence[tuple[str, str, Sequence[int]]], hyper: str,
                      per_model_loss: str, buffers: Sequence[tuple[str, str]] = ()) -> tuple[list[tuple[str, str]], str]:
        """Append the update of every (param, grad, fused shape). Returns the writes ``[(tensor, its new value)]``
        (parameters, optimizer state and buffers; a runtime applies them after the step: ONNX Runtime with
        in-place accumulators, the torch runtime by copying) and the ``ok`` tensor [B, 1] (bool): the models whose
        step was applied. ``buffers``: (model-major buffer, the step's new value), e.g. BatchNorm running
        statistics; a rejected model keeps its old value, and a model whose new buffer is not finite is not ok.

        All parameters are updated as one flat ``[B, P]`` matrix (P = parameters per model): the views
        ``[B, -1]`` of every parameter and gradient are concatenated, the registered optimizer's maths runs once
        (``emit``), and Split hands each parameter its columns back. A handful of kernels instead of ~20 per
        parameter, and because the concatenated gradient depends on every gradient, no parameter is overwritten
        before the whole backward pass has read it.
        """
        B = self.B
        view = gb.const([B, -1], np.int64, "model_view")
        row = {name: gb.one("Gather", [hyper, gb.const(k, np.int64, "row")], axis=0)
               for k, name in enumerate(self.rows())}
        writes: list[tuple[str, str]] = []
        P, G = flat_models(gb, [p for p, _, _ in params], B), flat_models(gb, [g for _, g, _ in params], B)
        if self.clips:
            G, _ = append_clip(gb, G, row["max_norm"])
        Pn, news = self.spec.emit(gb, P, G, row, self)  # news: (state buffer, its new value)
        # ok[b]: model b is active and its loss, gradient and new parameters are finite. A non-finite gradient
        # element reaches the new parameters in every update above (even at lr 0: 0 * NaN = NaN), and a sum is
        # non-finite when any term is (inf - inf = NaN): one ReduceSum over the new parameters checks all three.
        check = gb.one("Add", [gb.reduce("ReduceSum", Pn, [1], keepdims=1),
                               gb.one("Reshape", [per_model_loss, gb.const([B, 1], np.int64)])])
        if buffers:
            # x * 0 is 0 for finite x and NaN for inf or NaN: the sum is exact (a large but finite running
            # variance is not flagged), and non-finite exactly where some element is
            zero = gb.const(0.0)
            flags = [gb.reduce("ReduceSum", gb.one("Mul", [gb.one("Reshape", [v, view]), zero]), [1], keepdims=1)
                     for _, v in buffers]
            check = gb.one("Add", [check, flags[0] if len(flags) == 1 else gb.one("Sum", flags)])
        finite = gb.one("Not", [gb.one("Or", [gb.one("IsNaN", [check]), gb.one("IsInf", [check])])])
        ok = gb.one("And", [finite, gb.one("Greater", [row["active"], gb.const(0.5)])])
        for buf, new in news:
            writes.append((buf, gb.one("Where", [ok, new, buf])))
        Pn = gb.one("Where", [ok, Pn, P])
        writes += zip([p for p, _, _ in params], unflat_models(gb, Pn, [shape for _, _, shape in params], B))
        # running statistics are model-major too ([B*C] = [B, C]): a model whose step is rejected keeps its own
        for stat, value in buffers:
            kept = gb.one("Where", [ok, gb.one("Reshape", [value, view]), gb.one("Reshape", [stat, view])])
            writes.append((stat, gb.one("Reshape", [kept, gb.one("Shape", [stat])])))
        return writes, ok


@dataclass
class OptimizerConfig(UpdateRule):
    """An update rule given as values (:class:`UpdateRule`): the Python API's (:func:`make_optimizer`), a shrunk
    array's (:meth:`UpdateRule.select`), a fused optimizer's own (``FusedOptimizer.config``)."""

    kind: str
    hyper: dict[str, tuple]
    max_norm: list[float] = field(default_factory=list)
    momentum_varies: bool = False

    @property
    def B(self) -> int:
        return len(self.hyper["lr"])


def flat_models(gb: GraphBuilder, names: Sequence[str], B: int) -> str:
    """The model-major tensors ``names`` as one ``[B, P]`` matrix: each viewed as ``[B, -1]``, concatenated."""
    view = gb.const([B, -1], np.int64, "model_view")
    views = [gb.one("Reshape", [n, view]) for n in names]
    return views[0] if len(views) == 1 else gb.one("Concat", views, axis=1)


def unflat_models(gb: GraphBuilder, flat: str, shapes: Sequence[Sequence[int]], B: int) -> list[str]:
    """The inverse of :func:`flat_models`: each tensor's columns of ``flat``, in its fused shape."""
    sizes = [int(np.prod(shape)) // B for shape in shapes]
    pieces = [flat] if len(shapes) == 1 else gb.emit("Split", [flat, gb.const(sizes, np.int64, "sizes")],
                                                     len(shapes), axis=1)
    return [gb.one("Reshape", [piece, gb.const(list(shape), np.int64, "shape")]) for shape, piece in zip(shapes, pieces)]


def append_clip(gb: GraphBuilder, G: str, max_norm: str) -> tuple[str, str]:
    """torch's ``clip_grad_norm_`` per model on the flat gradients ``G`` [B, P]: each model's whole gradient scaled
    to at most its ``max_norm`` [B, 1] (inf: unchanged), ``g * min(max_norm / (||g|| + 1e-6), 1)``. Returns the
    clipped gradients and each model's norm before clipping [B, 1]. The one implementation of clipping: the update
    graph and ``onnxfuse.optim.clip_grad_norm_`` both append it."""
    norm = gb.one("Sqrt", [gb.reduce("ReduceSum", gb.one("Mul", [G, G]), [1], keepdims=1)])
    coef = gb.one("Div", [max_norm, gb.one("Add", [norm, gb.const(1e-6)])])
    return gb.one("Mul", [G, gb.one("Min", [coef, gb.const(1.0)])]), norm


def per_model(values: Sequence) -> tuple:
    """Validated per-model values as the one form a run keeps them in: a tuple of B, a pair (betas) a tuple too
    (so that two equal configurations compare equal whichever way they were given)."""
    return tuple(tuple(x) if isinstance(x, list) else x for x in values)


def max_norms(clip: Sequence[float | None]) -> list[float]:
    """Each model's clipping coefficient from its clip_grad_norm: None (not clipped) is inf, which leaves the
    gradient as it is (min(inf / (norm + 1e-6), 1) = 1): the coefficient row's one form of "no clipping"."""
    return [math.inf if c is None else float(c) for c in clip]


def make_optimizer(kind: str, B: int, max_norm=None, *, caller: str = "make_optimizer", **hyper) -> OptimizerConfig:
    """The optimizer ``kind`` for B models (the Python API's): each hyper-parameter a scalar for all models or one
    per model (None or absent: torch.optim's default, see the registrations above), checked as a config file's
    ``optimizer`` section is (``normalize_config``: one hyper-parameter ``kind`` does not take is an error).
    ``max_norm``: clip_grad_norm_ per model (None or inf: off). ``caller`` names the function in messages."""
    from onnxfuse.recipe.config import expand_per_model, normalize_config
    from onnxfuse.recipe.settings import Origins

    unknown = sorted(set(hyper) - set(hyper_params()))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument '{unknown[0]}'")
    given = {k: v for k, v in hyper.items() if v is not None}
    named = {f"optimizer.{k}": f"{caller}({k}=...)" for k in given}
    named.update({"optimizer.name": f"{caller}(kind)", "clip_grad_norm": f"{caller}(max_norm=...)"})
    raw = {"steps": 1, "optimizer": {"name": kind, **given}, "clip_grad_norm": max_norm}
    cfg = expand_per_model(normalize_config(raw, source="", named=named, with_data=False), B, Origins("", named))
    opt = cfg["optimizer"]
    return OptimizerConfig(kind, {k: per_model(v) for k, v in opt.items() if k != "name"},
                           max_norms(cfg["clip_grad_norm"]))


def add_param_group(optimizer, group: dict) -> None:
    """``torch.optim.Optimizer.add_param_group`` without importing torch._dynamo: torch wraps the method in
    ``torch._disable_dynamo``, whose first call imports torch._dynamo (2-5 s on 2 cores, in every process that
    trains: a sweep's workers, before their first step). Where an optimizer is built, nothing is being compiled,
    so the undecorated method is the same code (the fused optimizer, the schedules' stand-ins use it)."""
    import torch

    add = torch.optim.Optimizer.add_param_group
    getattr(add, "__wrapped__", add)(optimizer, group)
