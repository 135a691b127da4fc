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
                   max_momentum=0.95): moves the hyper-parameter the optimizer lets a schedule move too (its
                   registration's ``cycles``: SGD's momentum, Adam's beta1)
"""
from __future__ import annotations

import collections
import functools
import warnings
from typing import Callable, Mapping, Sequence

from onnxfuse.core.errors import ConfigError

from onnxfuse.recipe.optim import StepValues, UpdateRule
from onnxfuse.recipe.settings import (BOOL, REQUIRED, RUN_SETTINGS, SCHEDULES, Param, check_schedule_entry, choice,
                                      integer, real, register_schedule, step_list)

__all__ = ["SCHEDULES", "PerModelSchedules", "check_schedules"]

# ---- the schedules, each registered once with its parameters (torch's defaults; a None default is derived: t_max
# and total from the run's steps, max_lr from the model's lr) and the function that builds torch's scheduler
GAMMA = Param("gamma", real(gt=0.0), 0.1, "decay factor")
WARMUP = (Param("warmup_steps", integer(ge=0), 0, "steps of a linear warm-up first"),
          Param("warmup_start_factor", real(gt=0.0, le=1.0), 1e-3, "lr factor at the start of the warm-up"))


@register_schedule("constant", help="the optimizer's lr")
def _constant(lrs, opt, s: dict, steps: int):
    return None


@register_schedule("step", (Param("step_size", integer(ge=1), REQUIRED, "decay every K steps"), GAMMA), "StepLR")
def _step(lrs, opt, s: dict, steps: int):
    return lrs.StepLR(opt, step_size=s["step_size"], gamma=s["gamma"])


@register_schedule("multistep", (Param("milestones", step_list(non_empty=True), REQUIRED, "steps at which to decay"),
                                 GAMMA), "MultiStepLR")
def _multistep(lrs, opt, s: dict, steps: int):
    return lrs.MultiStepLR(opt, milestones=list(s["milestones"]), gamma=s["gamma"])


@register_schedule("exponential", (GAMMA.with_default(REQUIRED),), "ExponentialLR")
def _exponential(lrs, opt, s: dict, steps: int):
    return lrs.ExponentialLR(opt, gamma=s["gamma"])


def _warmup_then(lrs, opt, s: dict, steps: int, main: Callable[[int], object]):
    """[LinearLR from warmup_start_factor over warmup_steps] then ``main(steps left)``."""
    warmup = s["warmup_steps"]
    rest = steps - warmup
    if rest < 1:
        raise ValueError(f"warmup_steps {warmup} leaves no steps of the {steps}")
    if not warmup:
        return main(rest)
    warm = lrs.LinearLR(opt, start_factor=s["warmup_start_factor"], end_factor=1.0, total_iters=warmup)
    return lrs.SequentialLR(opt, [warm, main(rest)], milestones=[warmup])


@register_schedule("cosine", WARMUP + (Param("eta_min", real(ge=0.0), 0.0, "the final lr"),
                                       Param("t_max", integer(ge=1), None, "steps of the cosine (default: "
                                             "the steps after the warm-up)")), "[warm-up] then CosineAnnealingLR")
def _cosine(lrs, opt, s: dict, steps: int):
    return _warmup_then(lrs, opt, s, steps, lambda rest: lrs.CosineAnnealingLR(
        opt, T_max=s["t_max"] if s["t_max"] is not None else rest, eta_min=s["eta_min"]))


@register_schedule("linear", WARMUP + (Param("end_factor", real(ge=0.0, le=1.0), 0.0, "final lr factor"),
                                       Param("total", integer(ge=1), None, "steps of the decay (default: the steps "
                                             "after the warm-up)")), "[warm-up] then LinearLR to end_factor")
def _linear(lrs, opt, s: dict, steps: int):
    return _warmup_then(lrs, opt, s, steps, lambda rest: lrs.LinearLR(
        opt, start_factor=1.0, end_factor=s["end_factor"], total_iters=s["total"] if s["total"] is not None else rest))


@register_schedule("onecycle", (
    Param("max_lr", real(gt=0.0), None, "peak learning rate (default: the model's lr)"),
    Param("pct_start", real(gt=0.0, lt=1.0), 0.3, "fraction of the steps spent increasing the lr"),
    Param("div_factor", real(gt=0.0), 25.0, "initial lr = max_lr / div_factor"),
    Param("final_div_factor", real(gt=0.0), 1e4, "final lr = initial lr / final_div_factor"),
    Param("anneal_strategy", choice(("cos", "linear")), "cos", "annealing"),
    Param("three_phase", BOOL, False, "a third phase annihilating the lr"),
    Param("cycle_momentum", BOOL, True, "move the optimizer's momentum (SGD) / beta1 (Adam) inversely to the lr"),
    Param("base_momentum", real(ge=0.0, lt=1.0), 0.85, "lowest momentum"),
    Param("max_momentum", real(ge=0.0, lt=1.0), 0.95, "highest momentum")), "OneCycleLR")
def _onecycle(lrs, opt, s: dict, steps: int):
    kw = {k: v for k, v in s.items() if k not in ("name", "max_lr")}
    return lrs.OneCycleLR(opt, max_lr=s["max_lr"], total_steps=steps, **kw)


def _normalize(spec, B: int) -> list[dict]:
    """None / a name / one dict for all models / a list of B of those -> B dicts with a 'name', checked."""
    specs = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if len(specs) == 1:
        specs = specs * B
    if len(specs) != B:
        raise ConfigError(f"schedule: {len(specs)} schedules for B={B} models; give one, or one per model")
    listed = isinstance(spec, (list, tuple))
    return [dict(check_schedule_entry(s, f"schedule[{b}]" if listed else "schedule", fill=True))
            for b, s in enumerate(specs)]


def check_schedules(spec, B: int, steps: int) -> list[dict]:
    """Validate the schedules (names, parameters, that torch accepts them for ``steps`` steps) before training."""
    specs = _normalize(spec, B)
    from onnxfuse.recipe.optim import make_optimizer

    default = next(s.param.default for s in RUN_SETTINGS if s.name == "optimizer")
    PerModelSchedules(specs, make_optimizer(default, B), steps)  # torch raises on bad values; rewrap below
    return specs


def _full(s: dict, lr: float) -> dict:
    """Every parameter of schedule ``s``: its defaults filled in, onecycle's max_lr the model's lr by default."""
    out = {p.name: p.default for p in SCHEDULES[s["name"]].params if p.default is not REQUIRED}
    out.update(s)
    if "max_lr" in out and out["max_lr"] is None:
        out["max_lr"] = lr
    return out


@functools.cache
def _stand_in_optimizer() -> type:
    """torch.optim.Optimizer as a scheduler's stand-in, built without importing torch._dynamo
    (``optim.add_param_group``)."""
    import torch

    from onnxfuse.recipe.optim import add_param_group

    return type("ScheduleStandIn", (torch.optim.Optimizer,), {"add_param_group": add_param_group})


def moves_momentum(specs: Sequence[Mapping]) -> bool:
    """Whether a schedule of ``specs`` (one per model) moves the optimizer's cycled hyper-parameter (one-cycle's
    momentum): the update then keeps its state for every model (``UpdateRule.momentum_varies``)."""
    return any(s["name"] == "onecycle" and s.get("cycle_momentum", True) for s in specs)


class PerModelSchedules:
    """B torch schedulers; ``values(active)`` is this step's per-model lr and cycled value (the hyper-parameter
    the optimizer's registration lets a schedule move, ``cycles``: SGD's momentum, Adam's beta1), ``advance()``
    moves every schedule one step, ``ahead(active, n)`` gives the next n steps' values at once (the schedulers
    step ahead; ``values`` and ``advance`` then read what they computed). The position is just the number of
    steps taken, so a run resumes by ``advance``-ing a fresh instance that many times.

    Each scheduler drives a stand-in torch optimizer of one parameter that holds only the values a scheduler reads
    and writes: the model's lr and its cycled hyper-parameter under its torch name (``momentum``, or ``betas`` for
    one element of a pair), which is how torch's one-cycle finds what to move."""

    def __init__(self, specs: Sequence[dict], opt: UpdateRule, steps: int):
        import torch

        self.specs, self.cycles, self.taken = list(specs), opt.spec.cycles, 0
        self._ahead: collections.deque = collections.deque()  # (lr, cycled) of steps taken + 0, 1, ... (ahead)
        self.optimizers, self.schedulers = [], []
        name = self.cycles if isinstance(self.cycles, str) or self.cycles is None else self.cycles[0]
        for b, s in enumerate(self.specs):
            defaults = {"lr": opt.hyper["lr"][b]}
            if name is not None:
                value = opt.hyper[name][b]
                defaults[name] = tuple(value) if isinstance(value, (list, tuple)) else value
            o = _stand_in_optimizer()([torch.zeros(1, requires_grad=True)], defaults)
            spec = _full(s, opt.hyper["lr"][b])  # checked already (a run's plan, check_schedules)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": no real steps here
                    sched = SCHEDULES[spec["name"]].build(torch.optim.lr_scheduler, o, spec, steps)
            except (ValueError, TypeError, KeyError) as e:
                raise ConfigError(f"schedule (model {b}) {s}: {' '.join(str(e).split())}") from e
            self.optimizers.append(o)
            self.schedulers.append(sched)

    @property
    def moves_momentum(self) -> bool:
        return moves_momentum(self.specs)

    def values(self, active: Sequence[bool]) -> StepValues:
        lr, second = self._ahead[0] if self._ahead else self._now()
        return StepValues(list(lr), list(second), list(active))

    def ahead(self, active: Sequence[bool], n: int) -> list[StepValues]:
        """This step's values and the next ``n - 1`` steps' (with this activity), computed now: the schedulers
        step ahead and their values wait for ``advance`` (the position stays ``taken``). What lets a runtime
        compute a window of steps' coefficients up front."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while len(self._ahead) < n:
                self._ahead.append(self._now())
                self._step_schedulers()
        return [StepValues(list(lr), list(second), list(active)) for lr, second in list(self._ahead)[:n]]

    def _now(self) -> tuple[tuple, tuple]:
        """The schedulers' values where they are (``taken`` + the steps computed ahead)."""
        groups = [o.param_groups[0] for o in self.optimizers]
        if self.cycles is None:
            second = [None] * len(groups)
        elif isinstance(self.cycles, str):
            second = [g[self.cycles] for g in groups]
        else:
            name, index = self.cycles
            second = [g[name][index] for g in groups]
        return tuple(g["lr"] for g in groups), tuple(second)

    def _step_schedulers(self) -> None:
        for s in self.schedulers:
            if s is not None:
                s.step()

    def advance(self, n: int = 1) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(n):
                if self._ahead:  # computed ahead already: the schedulers are past it
                    self._ahead.popleft()
                else:
                    self._step_schedulers()
                self.taken += 1

    def select(self, keep: Sequence[int]) -> "PerModelSchedules":
        """The schedules of the models ``keep`` (by position), still at the same step."""
        new = object.__new__(PerModelSchedules)
        new.specs = [self.specs[i] for i in keep]
        new.cycles, new.taken = self.cycles, self.taken
        new.optimizers = [self.optimizers[i] for i in keep]
        new.schedulers = [self.schedulers[i] for i in keep]
        new._ahead = collections.deque((tuple(lr[i] for i in keep), tuple(second[i] for i in keep))
                                       for lr, second in self._ahead)
        return new
