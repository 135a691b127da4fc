"""Per-model learning-rate schedules, computed with torch.optim.lr_scheduler itself.

Each model gets a one-parameter torch optimizer of its own kind and hyper-parameters and a torch scheduler; at
every step the schedule's current learning rate (and the momentum / beta1 a one-cycle schedule moves) becomes that
model's coefficients in the fused update. So "matching torch.optim.lr_scheduler step for step" holds by
construction: it is torch's code computing the numbers, as a user's own loop would (``optimizer.step()`` then
``scheduler.step()``: step t uses the values after t - 1 scheduler steps).

Schedules, by name (``steps`` = the run's total optimizer steps):

- ``constant``
- ``step``         StepLR(step_size, gamma=0.1)
- ``multistep``    MultiStepLR(milestones, gamma=0.1)
- ``exponential``  ExponentialLR(gamma)
- ``cosine``       [LinearLR warm-up over warmup_steps from warmup_start_factor] then
                   CosineAnnealingLR(t_max = steps - warmup_steps, eta_min=0)
- ``linear``       [the same warm-up] then LinearLR(1 -> end_factor=0 over steps - warmup_steps)
- ``onecycle``     OneCycleLR(max_lr, total_steps=steps, pct_start=0.3, anneal_strategy='cos', div_factor=25,
                   final_div_factor=1e4, three_phase=False, cycle_momentum=True, base_momentum=0.85,
                   max_momentum=0.95): moves SGD's momentum or Adam's beta1 too
"""
from __future__ import annotations

from typing import Sequence

from onnxfuse.errors import ConfigError

from .optim import OptimizerConfig, StepValues

__all__ = ["SCHEDULES", "PerModelSchedules", "check_schedules"]

SCHEDULES = {
    "constant": set(),
    "step": {"step_size", "gamma"},
    "multistep": {"milestones", "gamma"},
    "exponential": {"gamma"},
    "cosine": {"warmup_steps", "warmup_start_factor", "t_max", "eta_min"},
    "linear": {"warmup_steps", "warmup_start_factor", "end_factor", "total"},
    "onecycle": {"max_lr", "pct_start", "anneal_strategy", "div_factor", "final_div_factor", "three_phase",
                 "cycle_momentum", "base_momentum", "max_momentum"},
}
_REQUIRED = {"step": {"step_size"}, "multistep": {"milestones"}, "exponential": {"gamma"}, "onecycle": {"max_lr"}}


def _normalize(spec, B: int) -> list[dict]:
    """None / a name / one dict for all models / a list of B of those -> B dicts with a 'name'."""
    specs = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if len(specs) == 1:
        specs = specs * B
    if len(specs) != B:
        raise ConfigError(f"schedule: {len(specs)} schedules for B={B} models; give one, or one per model")
    out = []
    for b, s in enumerate(specs):
        s = {"name": "constant"} if s is None else ({"name": s} if isinstance(s, str) else dict(s))
        name = s.get("name", "constant")
        if name not in SCHEDULES:
            raise ConfigError(f"schedule (model {b}): unknown schedule '{name}'; choose one of: {', '.join(SCHEDULES)}")
        extra = set(s) - {"name"} - SCHEDULES[name]
        if extra:
            raise ConfigError(f"schedule (model {b}): '{name}' takes no '{sorted(extra)[0]}'; it takes: "
                              f"{', '.join(sorted(SCHEDULES[name])) or 'nothing'}")
        missing = _REQUIRED.get(name, set()) - set(s)
        if missing:
            raise ConfigError(f"schedule (model {b}): '{name}' needs '{sorted(missing)[0]}'")
        out.append(s)
    return out


def check_schedules(spec, B: int, steps: int) -> list[dict]:
    """Validate the schedules (names, parameters, that torch accepts them for ``steps`` steps) before training."""
    specs = _normalize(spec, B)
    from .optim import make_optimizer

    PerModelSchedules(specs, make_optimizer("sgd", B), steps)  # torch raises on bad values; rewrap below
    return specs


def _scheduler(torch, opt, s: dict, steps: int):
    lrs = torch.optim.lr_scheduler
    name = s["name"]
    if name == "constant":
        return None
    if name == "step":
        return lrs.StepLR(opt, step_size=int(s["step_size"]), gamma=float(s.get("gamma", 0.1)))
    if name == "multistep":
        return lrs.MultiStepLR(opt, milestones=[int(m) for m in s["milestones"]], gamma=float(s.get("gamma", 0.1)))
    if name == "exponential":
        return lrs.ExponentialLR(opt, gamma=float(s["gamma"]))
    if name == "onecycle":
        kw = {k: s[k] for k in SCHEDULES["onecycle"] if k in s and k != "max_lr"}
        return lrs.OneCycleLR(opt, max_lr=float(s["max_lr"]), total_steps=steps, **kw)
    warmup = int(s.get("warmup_steps", 0))
    rest = steps - warmup
    if rest < 1:
        raise ValueError(f"warmup_steps {warmup} leaves no steps of the {steps}")
    if name == "cosine":
        main = lrs.CosineAnnealingLR(opt, T_max=int(s.get("t_max", rest)), eta_min=float(s.get("eta_min", 0.0)))
    else:
        main = lrs.LinearLR(opt, start_factor=1.0, end_factor=float(s.get("end_factor", 0.0)),
                            total_iters=int(s.get("total", rest)))
    if not warmup:
        return main
    warm = lrs.LinearLR(opt, start_factor=float(s.get("warmup_start_factor", 1e-3)), end_factor=1.0,
                        total_iters=warmup)
    return lrs.SequentialLR(opt, [warm, main], milestones=[warmup])


class PerModelSchedules:
    """B torch schedulers; ``values(active)`` is this step's per-model lr and momentum/beta1, ``advance()`` moves
    every schedule one step. The position is just the number of steps taken, so a run resumes by ``advance``-ing
    a fresh instance that many times."""

    def __init__(self, specs: Sequence[dict], opt: OptimizerConfig, steps: int):
        import warnings

        import torch

        self.specs, self.kind, self.taken = list(specs), opt.kind, 0
        self.optimizers, self.schedulers = [], []
        for b, s in enumerate(self.specs):
            p = [torch.zeros(1, requires_grad=True)]
            if opt.kind == "sgd":
                o = torch.optim.SGD(p, lr=opt.lr[b], momentum=opt.momentum[b], dampening=opt.dampening[b],
                                    nesterov=opt.nesterov[b])
            else:
                o = torch.optim.Adam(p, lr=opt.lr[b], betas=(opt.beta1[b], opt.beta2[b]))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": no real steps here
                    sched = _scheduler(torch, o, s, steps)
            except (ValueError, TypeError, KeyError) as e:
                raise ConfigError(f"schedule (model {b}) {s}: {' '.join(str(e).split())}") from e
            self.optimizers.append(o)
            self.schedulers.append(sched)

    @property
    def moves_momentum(self) -> bool:
        return any(s["name"] == "onecycle" and s.get("cycle_momentum", True) for s in self.specs)

    def values(self, active: Sequence[bool]) -> StepValues:
        groups = [o.param_groups[0] for o in self.optimizers]
        second = [g["momentum"] if self.kind == "sgd" else g["betas"][0] for g in groups]
        return StepValues([g["lr"] for g in groups], second, list(active))

    def advance(self, n: int = 1) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(n):
                for s in self.schedulers:
                    if s is not None:
                        s.step()
                self.taken += 1

    def select(self, keep: Sequence[int]) -> "PerModelSchedules":
        """The schedules of the models ``keep`` (by position), still at the same step."""
        new = object.__new__(PerModelSchedules)
        new.specs = [self.specs[i] for i in keep]
        new.kind, new.taken = self.kind, self.taken
        new.optimizers = [self.optimizers[i] for i in keep]
        new.schedulers = [self.schedulers[i] for i in keep]
        return new
