"""Per-model optimizers inside the training graph.

ONNX Runtime's optimizer graph takes one scalar learning rate for every parameter. onnxfuse instead appends the
update maths to the training graph as standard ONNX ops, with per-model coefficients fed each step as one small
input ``[K, B, 1]`` (K coefficient rows, B models): no optimizer session, no host copies of parameters.

Every fused parameter is model-major (see ``onnxfuse.weights``), so it is viewed as ``[B, -1]``; all of them
together form one ``[B, P]`` matrix multiplied by ``[B, 1]`` coefficients. Optimizer state (momentum buffer, Adam
moments) lives in flat ``[B, P]`` checkpoint parameters ``optim.<state>`` and, like the parameters, is written in
place with ``com.microsoft`` ``InPlaceAccumulatorV2(overwrite)``.

The maths mirrors torch.optim's single-tensor implementations operation by operation, with every value per model
(the learning rate, momentum and beta1 as they are at this step, so a learning-rate schedule is just other
coefficients):

clip  g = g * min(max_norm / (||g|| + 1e-6), 1)                 (clip_grad_norm_, each model's own norm)
SGD   g = g + wd*p;  buf = mom_c*buf + damp_c*g (step 1: mom_c=0, damp_c=1, i.e. buf = g)
      d = g_c*g + buf_c*buf (nesterov: g + momentum*buf; plain: buf);  p = p - lr*d
Adam  g = g + wd*p (Adam) or p = p*(1 - lr*wd) (AdamW);  m = m + (1-b1)*(g - m);  v = b2*v + (1-b2)*g*g
      vmax = max(vmax, v) (amsgrad);  p = p - (lr/bc1) * m / (sqrt(v or vmax)/sqrt(bc2) + eps),  bc_i = 1 - b_i^t

Fault isolation: a model whose loss, gradient, new parameters or new buffers (BatchNorm running statistics) are
not finite, or that the trainer marked inactive, keeps its parameters, optimizer state and buffers
(``Where(ok, new, old)``): its step is rejected as a whole, at the step where anything of it first stops being
finite, so the state it is frozen in is entirely finite. The step's per-model ``ok`` flags are an output.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from onnxfuse.errors import ConfigError

from ._builder import GraphBuilder
from .settings import BOOL, OPTIMIZERS as _REGISTRY, RUN_SETTINGS, OptimizerSpec, Param, check_optimizer, \
    check_value, pair, real, register_optimizer

__all__ = ["OptimizerConfig", "make_optimizer", "OPTIMIZERS", "HYPER_INPUT", "STATE_PREFIX", "StepValues"]

HYPER_INPUT = "optim.hyper"
STATE_PREFIX = "optim."

# ---- the optimizers and their hyper-parameters (torch.optim's defaults), registered once; the CLI flags, config
# keys, TrainConfig fields and placement's choices are made from these. A parameter shared by several optimizers
# is one Param. The maths of each is OptimizerConfig's code for its name below.
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


register_optimizer(OptimizerSpec("sgd", (LR, MOMENTUM, DAMPENING, NESTEROV, WEIGHT_DECAY), "torch.optim.SGD",
                                 state_slots=1, check=_nesterov_rule))
register_optimizer(OptimizerSpec("adam", (LR, WEIGHT_DECAY, BETAS, EPS, AMSGRAD), "torch.optim.Adam", state_slots=2))
register_optimizer(OptimizerSpec("adamw", (LR, WEIGHT_DECAY.with_default(1e-2), BETAS, EPS, AMSGRAD),
                                 "torch.optim.AdamW", state_slots=2))
OPTIMIZERS = tuple(_REGISTRY)  # the built-in names (the registry, settings.OPTIMIZERS, is what grows)


@dataclass
class StepValues:
    """The per-model values of one step: learning rate, and momentum (SGD) or beta1 (Adam), which a schedule such
    as one-cycle moves too; ``active`` is 0 for a model that must not change (diverged or frozen)."""

    lr: list[float]
    momentum: list[float]  # SGD momentum, or Adam's beta1
    active: list[bool]


@dataclass
class OptimizerConfig:
    """One optimizer kind for the array; every hyper-parameter is a list with one value per model."""

    kind: str
    lr: list[float]
    momentum: list[float] = field(default_factory=list)
    dampening: list[float] = field(default_factory=list)
    nesterov: list[bool] = field(default_factory=list)
    weight_decay: list[float] = field(default_factory=list)
    beta1: list[float] = field(default_factory=list)
    beta2: list[float] = field(default_factory=list)
    eps: list[float] = field(default_factory=list)
    amsgrad: list[bool] = field(default_factory=list)
    max_norm: list[float] = field(default_factory=list)  # gradient clipping; inf = off
    momentum_varies: bool = False  # a schedule moves SGD's momentum (one-cycle): keep a momentum buffer

    @property
    def B(self) -> int:
        return len(self.lr)

    @property
    def clips(self) -> bool:
        return any(np.isfinite(m) for m in self.max_norm)

    def select(self, keep: Sequence[int]) -> "OptimizerConfig":
        """The configuration of the models ``keep`` (by position), e.g. after an array shrinks."""
        pick = lambda v: [v[i] for i in keep] if v else v  # noqa: E731
        return OptimizerConfig(self.kind, pick(self.lr), pick(self.momentum), pick(self.dampening),
                               pick(self.nesterov), pick(self.weight_decay), pick(self.beta1), pick(self.beta2),
                               pick(self.eps), pick(self.amsgrad), pick(self.max_norm), self.momentum_varies)

    # ---- graph side
    def state_names(self) -> list[str]:
        """The flat [B, P] state buffers this configuration needs (named ``optim.<name>``)."""
        if self.kind == "sgd":
            return ["momentum_buffer"] if self.momentum_varies or any(m != 0 for m in self.momentum) else []
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if any(self.amsgrad) else [])

    def rows(self) -> list[str]:
        common = ["active", "max_norm"]
        if self.kind == "sgd":
            return common + ["wd", "mom_c", "damp_c", "g_c", "buf_c", "lr"]
        return common + ["wd", "decay", "one_minus_b1", "b2", "one_minus_b2", "sqrt_bc2", "eps", "step_size",
                         "amsgrad"]

    def coefficients(self, step: int, values: StepValues | None = None) -> np.ndarray:
        """The ``[K, B, 1]`` float32 input for optimizer step ``step`` (1-based), computed in float64 like torch's
        Python-side scalars and rounded once. ``values`` gives this step's lr/momentum/active (default: the
        configured constants, every model active)."""
        B = self.B
        if values is None:
            values = StepValues(list(self.lr), list(self.momentum if self.kind == "sgd" else self.beta1), [True] * B)
        rows = np.zeros((len(self.rows()), B), dtype=np.float64)
        for b in range(B):
            lr, wd, active = values.lr[b], self.weight_decay[b], float(values.active[b])
            max_norm = self.max_norm[b] if self.max_norm else np.inf
            if self.kind == "sgd":
                m, d = values.momentum[b], self.dampening[b]
                first = step == 1
                mom_c, damp_c = (0.0, 1.0) if (first or m == 0) else (m, 1.0 - d)
                g_c, buf_c = (1.0, m) if self.nesterov[b] else (0.0, 1.0)
                rows[:, b] = [active, max_norm, wd, mom_c, damp_c, g_c, buf_c, lr]
            else:
                b1, b2, eps = values.momentum[b], self.beta2[b], self.eps[b]
                bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
                decoupled = self.kind == "adamw"
                rows[:, b] = [active, max_norm, 0.0 if decoupled else wd, 1.0 - lr * wd if decoupled else 1.0,
                              1.0 - b1, b2, 1.0 - b2, bc2 ** 0.5, eps, lr / bc1, float(self.amsgrad[b])]
        return rows.astype(np.float32)[:, :, None]

    def append_update(self, gb: GraphBuilder, params: Sequence[tuple[str, str, Sequence[int]]], hyper: str,
                      per_model_loss: str, buffers: Sequence[tuple[str, str]] = ()) -> tuple[list[tuple[str, str]], str]:
        """Append the update of every (param, grad, fused shape). Returns the writes ``[(tensor, its new value)]``
        (parameters, optimizer state and buffers; a runtime applies them after the step: ONNX Runtime with
        in-place accumulators, the torch runtime by copying) and the ``ok`` tensor [B, 1] (bool): the models whose
        step was applied. ``buffers``: (model-major buffer, the step's new value), e.g. BatchNorm running
        statistics; a rejected model keeps its old value, and a model whose new buffer is not finite is not ok.

        All parameters are updated as one flat ``[B, P]`` matrix (P = parameters per model): the views
        ``[B, -1]`` of every parameter and gradient are concatenated, the maths runs once, and Split hands each
        parameter its columns back. A handful of kernels instead of ~20 per parameter, and because the
        concatenated gradient depends on every gradient, no parameter is overwritten before the whole backward
        pass has read it.
        """
        B = self.B
        view = gb.const([B, -1], np.int64, "model_view")
        row = {name: gb.one("Gather", [hyper, gb.const(k, np.int64, "row")], axis=0)
               for k, name in enumerate(self.rows())}
        writes: list[tuple[str, str]] = []

        def flat(names: list[str]) -> str:
            views = [gb.one("Reshape", [n, view]) for n in names]
            return views[0] if len(views) == 1 else gb.one("Concat", views, axis=1)

        P, G = flat([p for p, _, _ in params]), flat([g for _, g, _ in params])
        if self.clips:  # clip_grad_norm_: scale each model's whole gradient to at most its max_norm
            norm = gb.one("Sqrt", [gb.reduce("ReduceSum", gb.one("Mul", [G, G]), [1], keepdims=1)])
            coef = gb.one("Div", [row["max_norm"], gb.one("Add", [norm, gb.const(1e-6)])])
            G = gb.one("Mul", [G, gb.one("Min", [coef, gb.const(1.0)])])
        news: list[tuple[str, str]] = []  # (state buffer, its new value)
        if self.kind == "sgd":
            if any(w != 0 for w in self.weight_decay):
                G = gb.one("Add", [G, gb.one("Mul", [P, row["wd"]])])
            if self.state_names():
                buf = STATE_PREFIX + "momentum_buffer"
                Bn = gb.one("Add", [gb.one("Mul", [buf, row["mom_c"]]), gb.one("Mul", [G, row["damp_c"]])])
                news.append((buf, Bn))
                D = gb.one("Add", [gb.one("Mul", [G, row["g_c"]]), gb.one("Mul", [Bn, row["buf_c"]])]) \
                    if any(self.nesterov) else Bn
            else:
                D = G
            Pn = gb.one("Sub", [P, gb.one("Mul", [D, row["lr"]])])
        else:
            if self.kind == "adam" and any(w != 0 for w in self.weight_decay):
                G = gb.one("Add", [G, gb.one("Mul", [P, row["wd"]])])
            P1 = gb.one("Mul", [P, row["decay"]]) if self.kind == "adamw" and any(self.weight_decay) else P
            M, V = STATE_PREFIX + "exp_avg", STATE_PREFIX + "exp_avg_sq"
            Mn = gb.one("Add", [M, gb.one("Mul", [gb.one("Sub", [G, M]), row["one_minus_b1"]])])
            Vn = gb.one("Add", [gb.one("Mul", [V, row["b2"]]),
                                gb.one("Mul", [gb.one("Mul", [G, G]), row["one_minus_b2"]])])
            news += [(M, Mn), (V, Vn)]
            Vd = Vn
            if any(self.amsgrad):
                Vmax = STATE_PREFIX + "max_exp_avg_sq"
                Vmn = gb.one("Max", [Vmax, Vn])
                news.append((Vmax, Vmn))
                Vd = gb.one("Where", [gb.one("Greater", [row["amsgrad"], gb.const(0.5)]), Vmn, Vn])
            denom = gb.one("Add", [gb.one("Div", [gb.one("Sqrt", [Vd]), row["sqrt_bc2"]]), row["eps"]])
            Pn = gb.one("Sub", [P1, gb.one("Mul", [gb.one("Div", [Mn, denom]), row["step_size"]])])
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
        sizes = [int(np.prod(shape)) // B for _, _, shape in params]
        pieces = [Pn] if len(params) == 1 else gb.emit("Split", [Pn, gb.const(sizes, np.int64, "sizes")],
                                                       len(params), axis=1)
        for (p, _, shape), piece in zip(params, pieces):
            writes.append((p, gb.one("Reshape", [piece, gb.const(list(shape), np.int64, "shape")])))
        # running statistics are model-major too ([B*C] = [B, C]): a model whose step is rejected keeps its own
        for stat, value in buffers:
            kept = gb.one("Where", [ok, gb.one("Reshape", [value, view]), gb.one("Reshape", [stat, view])])
            writes.append((stat, gb.one("Reshape", [kept, gb.one("Shape", [stat])])))
        return writes, ok


def make_optimizer(kind: str, B: int, max_norm=None, **hyper) -> OptimizerConfig:
    """The optimizer ``kind`` for B models: each hyper-parameter a scalar for all models or one per model (None
    or absent: torch.optim's default, see the registrations above), checked against the registry.
    ``max_norm``: clip_grad_norm_ per model (None: off)."""
    known = {p.name for spec in _REGISTRY.values() for p in spec.params}
    unknown = sorted(set(hyper) - known)
    if unknown:
        raise TypeError(f"make_optimizer() got an unexpected keyword argument '{unknown[0]}'")
    v = check_optimizer(kind, B, hyper)
    clip_setting = next(s.param for s in RUN_SETTINGS if s.name == "clip_grad_norm")
    clip = check_value(clip_setting, max_norm, optional=True)
    clip = clip if isinstance(clip, list) else [clip]
    if len(clip) == 1:
        clip = clip * B
    if len(clip) != B:
        raise ConfigError(f"--clip-grad-norm has {len(clip)} values but the array has B={B} models; give one "
                          f"value, or a list of {B}")
    clip = [np.inf if c is None else float(c) for c in clip]
    if kind == "sgd":
        return OptimizerConfig("sgd", v["lr"], momentum=v["momentum"], dampening=v["dampening"],
                               nesterov=v["nesterov"], weight_decay=v["weight_decay"], max_norm=clip)
    return OptimizerConfig(kind, v["lr"], weight_decay=v["weight_decay"], beta1=[p[0] for p in v["betas"]],
                           beta2=[p[1] for p in v["betas"]], eps=v["eps"], amsgrad=v["amsgrad"], max_norm=clip)
