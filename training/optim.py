"""Per-model optimizers inside the training graph.

ONNX Runtime's optimizer graph takes one scalar learning rate for every parameter. onnxfuse instead appends the
update maths to the training graph as standard ONNX ops, with per-model coefficients fed each step as one small
input ``[K, B, 1]`` (K coefficient rows, B models): no optimizer session, no host copies of parameters.

Every fused parameter is model-major (see ``onnxfuse.weights``), so it is viewed as ``[B, -1]``; all of them
together form one ``[B, P]`` matrix multiplied by ``[B, 1]`` coefficients. Optimizer state (momentum buffer, Adam
moments) lives in flat ``[B, P]`` checkpoint parameters ``optim.<state>`` and, like the parameters, is written in
place with ``com.microsoft`` ``InPlaceAccumulatorV2(overwrite)``.

The maths mirrors torch.optim's single-tensor implementations operation by operation:

SGD   g = grad + wd*p;  buf = mom_c*buf + damp_c*g (step 1: mom_c=0, damp_c=1, i.e. buf = g)
      d = g_c*g + buf_c*buf (nesterov: g + momentum*buf; plain: buf);  p = p - lr*d
AdamW p = p*(1 - lr*wd);  m = m + (1-b1)*(g - m);  v = b2*v + (1-b2)*g*g
      p = p - (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)         with bc_i = 1 - b_i^t
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from onnxfuse.errors import ConfigError

from ._builder import GraphBuilder

__all__ = ["OptimizerConfig", "make_optimizer", "OPTIMIZERS", "HYPER_INPUT", "STATE_PREFIX"]

OPTIMIZERS = ("sgd", "adamw")
HYPER_INPUT = "optim.hyper"
STATE_PREFIX = "optim."


def _per_model(name: str, value, B: int, cast=float) -> list:
    """A scalar applies to every model; a list must have exactly B values."""
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
    if len(values) == 1:
        values = values * B
    if len(values) != B:
        raise ConfigError(f"{name} has {len(values)} values but the array has B={B} models; "
                          "give one value, or one per model")
    try:
        return [cast(v) for v in values]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}: {e}") from e


@dataclass
class OptimizerConfig:
    """One optimizer kind; every hyper-parameter is a list with one value per model."""

    kind: str
    lr: list[float]
    momentum: list[float] = field(default_factory=list)
    dampening: list[float] = field(default_factory=list)
    nesterov: list[bool] = field(default_factory=list)
    weight_decay: list[float] = field(default_factory=list)
    beta1: list[float] = field(default_factory=list)
    beta2: list[float] = field(default_factory=list)
    eps: list[float] = field(default_factory=list)

    @property
    def B(self) -> int:
        return len(self.lr)

    # ---- graph side
    def state_names(self) -> list[str]:
        """The flat [B, P] state buffers this configuration needs (named ``optim.<name>``)."""
        if self.kind == "sgd":
            return ["momentum_buffer"] if any(m != 0 for m in self.momentum) else []
        return ["exp_avg", "exp_avg_sq"]

    def rows(self) -> list[str]:
        if self.kind == "sgd":
            return ["wd", "mom_c", "damp_c", "g_c", "buf_c", "lr"]
        return ["decay", "one_minus_b1", "b2", "one_minus_b2", "sqrt_bc2", "eps", "step_size"]

    def coefficients(self, step: int) -> np.ndarray:
        """The ``[K, B, 1]`` float32 input for optimizer step ``step`` (1-based), computed in float64 like torch's
        Python-side scalars and rounded once."""
        B = self.B
        rows = np.zeros((len(self.rows()), B), dtype=np.float64)
        for b in range(B):
            if self.kind == "sgd":
                m, d, wd, lr = self.momentum[b], self.dampening[b], self.weight_decay[b], self.lr[b]
                first = step == 1
                mom_c, damp_c = (0.0, 1.0) if (first or m == 0) else (m, 1.0 - d)
                g_c, buf_c = (1.0, m) if self.nesterov[b] else (0.0, 1.0)
                rows[:, b] = [wd, mom_c, damp_c, g_c, buf_c, lr]
            else:
                lr, wd, b1, b2, eps = self.lr[b], self.weight_decay[b], self.beta1[b], self.beta2[b], self.eps[b]
                bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
                rows[:, b] = [1.0 - lr * wd, 1.0 - b1, b2, 1.0 - b2, bc2 ** 0.5, eps, lr / bc1]
        return rows.astype(np.float32)[:, :, None]

    def append_update(self, gb: GraphBuilder, params: Sequence[tuple[str, str, Sequence[int]]], hyper: str) -> list[str]:
        """Append the update of every (param, grad, fused shape); returns the InPlaceAccumulatorV2 outputs.

        All parameters are updated as one flat ``[B, P]`` matrix (P = parameters per model): the views
        ``[B, -1]`` of every parameter and gradient are concatenated, the maths runs once, and Split hands each
        parameter its columns back. A handful of kernels instead of ~20 per parameter, and because the
        concatenated gradient depends on every gradient, no parameter is overwritten before the whole backward
        pass has read it. Optimizer state is one flat ``[B, P]`` buffer per kind (``optim.exp_avg`` ...).
        """
        B = self.B
        view = gb.const([B, -1], np.int64, "model_view")
        row = {name: gb.one("Gather", [hyper, gb.const(k, np.int64, "row")], axis=0)
               for k, name in enumerate(self.rows())}
        true = gb.const([True], np.bool_, "overwrite")
        done = []

        def flat(names: list[str]) -> str:
            views = [gb.one("Reshape", [n, view]) for n in names]
            return views[0] if len(views) == 1 else gb.one("Concat", views, axis=1)

        def write(buffer: str, value: str) -> None:
            done.append(gb.one("InPlaceAccumulatorV2", [buffer, value, true], domain="com.microsoft"))

        P, G = flat([p for p, _, _ in params]), flat([g for _, g, _ in params])
        if self.kind == "sgd":
            if any(w != 0 for w in self.weight_decay):
                G = gb.one("Add", [G, gb.one("Mul", [P, row["wd"]])])
            if self.state_names():
                buf = STATE_PREFIX + "momentum_buffer"
                Bn = gb.one("Add", [gb.one("Mul", [buf, row["mom_c"]]), gb.one("Mul", [G, row["damp_c"]])])
                write(buf, Bn)
                D = gb.one("Add", [gb.one("Mul", [G, row["g_c"]]), gb.one("Mul", [Bn, row["buf_c"]])]) \
                    if any(self.nesterov) else Bn
            else:
                D = G
            Pn = gb.one("Sub", [P, gb.one("Mul", [D, row["lr"]])])
        else:
            if any(w != 0 for w in self.weight_decay):
                P = gb.one("Mul", [P, row["decay"]])
            M, V = STATE_PREFIX + "exp_avg", STATE_PREFIX + "exp_avg_sq"
            Mn = gb.one("Add", [M, gb.one("Mul", [gb.one("Sub", [G, M]), row["one_minus_b1"]])])
            Vn = gb.one("Add", [gb.one("Mul", [V, row["b2"]]),
                                gb.one("Mul", [gb.one("Mul", [G, G]), row["one_minus_b2"]])])
            denom = gb.one("Add", [gb.one("Div", [gb.one("Sqrt", [Vn]), row["sqrt_bc2"]]), row["eps"]])
            Pn = gb.one("Sub", [P, gb.one("Mul", [gb.one("Div", [Mn, denom]), row["step_size"]])])
            write(M, Mn)
            write(V, Vn)
        sizes = [int(np.prod(shape)) // B for _, _, shape in params]
        pieces = [Pn] if len(params) == 1 else gb.node("Split", [Pn, gb.const(sizes, np.int64, "sizes")], len(params), axis=1)
        for (p, _, shape), piece in zip(params, pieces):
            write(p, gb.one("Reshape", [piece, gb.const(list(shape), np.int64, "shape")]))
        return done


def make_optimizer(kind: str, B: int, lr=None, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=None,
                   betas=(0.9, 0.999), eps=1e-8) -> OptimizerConfig:
    """Validate hyper-parameters (a scalar for all models or one per model) with torch.optim's defaults:
    SGD lr 1e-3, momentum 0, weight_decay 0; AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2."""
    if kind not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer '{kind}'; choose one of: {', '.join(OPTIMIZERS)}")
    lr = _per_model("--lr", 1e-3 if lr is None else lr, B)
    wd = _per_model("--weight-decay", (0.0 if kind == "sgd" else 1e-2) if weight_decay is None else weight_decay, B)
    for name, vals in (("--lr", lr), ("--weight-decay", wd)):
        bad = [v for v in vals if not np.isfinite(v) or v < 0]
        if bad:
            raise ConfigError(f"{name} must be finite and >= 0, got {bad[0]}")
    if kind == "sgd":
        mom = _per_model("--momentum", momentum, B)
        damp = _per_model("--dampening", dampening, B)
        nest = _per_model("--nesterov", nesterov, B, cast=bool)
        if any(not 0 <= m < 1 or not np.isfinite(m) for m in mom):
            raise ConfigError(f"--momentum must be in [0, 1), got {[m for m in mom if not 0 <= m < 1][0]}")
        for b in range(B):
            if nest[b] and (mom[b] <= 0 or damp[b] != 0):
                raise ConfigError(f"model {b}: Nesterov momentum needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
        return OptimizerConfig("sgd", lr, momentum=mom, dampening=damp, nesterov=nest, weight_decay=wd)
    if isinstance(betas, tuple) and len(betas) == 2 and not isinstance(betas[0], (list, tuple)):
        b1, b2 = _per_model("beta1", betas[0], B), _per_model("beta2", betas[1], B)
    else:
        pairs = list(betas)
        b1, b2 = _per_model("beta1", [p[0] for p in pairs], B), _per_model("beta2", [p[1] for p in pairs], B)
    for name, vals in (("beta1", b1), ("beta2", b2)):
        if any(not 0 <= v < 1 for v in vals):
            raise ConfigError(f"{name} must be in [0, 1)")
    e = _per_model("--eps", eps, B)
    if any(v <= 0 for v in e):
        raise ConfigError("--eps must be > 0")
    return OptimizerConfig("adamw", lr, weight_decay=wd, beta1=b1, beta2=b2, eps=e)
