"""``onnxfuse.optim``: per-model optimizers for a :class:`~onnxfuse.runtime.torch.array_module.FusedArray` in the user's
own training loop, and the optimizer ``onnxfuse train`` runs.

    opt = onnxfuse.optim.AdamW(arr, lr=[1e-3, 3e-4, 1e-4], weight_decay=0.01)     # one value, or one per model
    scheds = [torch.optim.lr_scheduler.StepLR(opt.model(b), 10, gamma=g) for b, g in enumerate(gammas)]
    loss = per_model_losses.sum(); loss.backward()        # each model's gradient is its own
    onnxfuse.optim.clip_grad_norm_(arr, max_norm=1.0)     # each model's own norm
    opt.step(); opt.zero_grad(); [s.step() for s in scheds]

    step = onnxfuse.optim.train_step(arr, opt, loss_fn)   # or the whole step as one compiled function, no host read
    step(x, y)                                            # loss_fn(output [B, N, ...], y) -> per-model losses [B]

Each class is a ``torch.optim.Optimizer`` with one parameter group per model: ``opt.param_groups[b]`` holds model
b's hyper-parameters under torch's names (``lr``, ``momentum``, ``betas``, ``weight_decay``...), so torch's
``lr_scheduler`` classes work on it unchanged, on the whole optimizer (``LambdaLR(opt, [f_0, ..., f_B-1])``,
every group its own base lr) or on one model's view ``opt.model(b)`` (one scheduler per model, of any kind). The
groups hold no ``params``: every fused tensor holds all B models (``arr.parameters()``); an optimizer knows them
from its array.

The maths is the update graph ``UpdateRule.append_update`` builds (``onnxfuse/recipe/optim.py``), converted to
torch by ``torch_graph``: the one implementation of SGD, Adam and AdamW that the run loop, the ONNX Runtime
runtime and these classes all use, mirroring torch.optim's single-tensor code operation by operation with every
value per model. Its per-model coefficients are computed on the host from the groups at each step (as torch's
own Python-side scalars are) and sent in one small copy; nothing is read back. The update also isolates faults: a
model whose gradient, new parameters or (when given) loss are not finite keeps its parameters and state, and
``opt.last_ok`` [B] (a tensor on the array's device) says which models' steps were applied.

State (``opt.state``): ``step`` (the optimizer steps taken, one count for all models, torch's per-parameter
``step``) and each state buffer of the optimizer (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``,
``momentum_buffer``) as one ``[B, P]`` tensor, P the parameters of one model in the array's order. ``state_dict()``
/ ``load_state_dict()`` are torch's.
"""
from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from typing import Any, Callable, ClassVar, Sequence

import numpy as np
import onnx
import torch
from onnx import helper

from onnxfuse.core._builder import GraphBuilder
from onnxfuse.core.errors import ConfigError
from onnxfuse.recipe.optim import (HYPER_INPUT, STATE_PREFIX, OptimizerConfig, StepValues, UpdateRule, add_param_group,
                                   append_clip, flat_models, make_optimizer, max_norms, per_model, unflat_models)
from onnxfuse.recipe.settings import OPTIMIZERS as REGISTRY

__all__ = ["FusedOptimizer", "SGD", "Adam", "AdamW", "optimizer_class", "from_config", "clip_grad_norm_",
           "ModelOptimizer", "update_graph", "train_step", "ArrayStep"]

_FLOAT = onnx.TensorProto.FLOAT


def update_graph(opt: UpdateRule, params: Sequence[tuple[str, Sequence[int]]],
                 buffers: Sequence[tuple[str, Sequence[int]]], opset: int = 17) -> tuple[onnx.ModelProto, list[str]]:
    """The optimizer step of ``append_update`` as a graph of its own.

    Inputs: every parameter ``p`` and its gradient ``p_grad``; the coefficients ``optim.hyper`` [K, B, 1]; the
    ``per_model_loss`` [B]; the optimizer state ``optim.<state>`` [B, P]; every buffer ``s`` and its new value
    ``s_new``. Outputs: the new value of every written tensor (in the order of the returned names), then ``ok``
    [B, 1] bool. A model that is not ok keeps everything."""
    g = helper.make_graph([], "update", [], [])
    vi = helper.make_tensor_value_info
    B = opt.B
    P = sum(int(np.prod(s)) for _, s in params) // B
    g.input.extend([vi(p, _FLOAT, list(s)) for p, s in params] + [vi(f"{p}_grad", _FLOAT, list(s)) for p, s in params])
    g.input.extend([vi(HYPER_INPUT, _FLOAT, [len(opt.rows()), B, 1]), vi("per_model_loss", _FLOAT, [B])])
    g.input.extend(vi(STATE_PREFIX + s, _FLOAT, [B, P]) for s in opt.state_names())
    g.input.extend([vi(b, _FLOAT, list(s)) for b, s in buffers] + [vi(f"{b}_new", _FLOAT, list(s)) for b, s in buffers])
    gb = GraphBuilder(g, opset, "update/")
    writes, ok = opt.append_update(gb, [(p, f"{p}_grad", s) for p, s in params], HYPER_INPUT, "per_model_loss",
                                   buffers=[(b, f"{b}_new") for b, _ in buffers])
    gb.flush()
    g.output.extend([vi(value, _FLOAT, None) for _, value in writes] + [vi(ok, onnx.TensorProto.BOOL, [B, 1])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    return model, [target for target, _ in writes]


def _clip_graph(B: int, shapes: Sequence[Sequence[int]], opset: int = 17) -> onnx.ModelProto:
    """``append_clip`` as a graph: gradients ``g<i>`` and ``max_norm`` [B, 1] -> the clipped gradients, then each
    model's norm [B, 1]."""
    g = helper.make_graph([], "clip", [], [])
    vi = helper.make_tensor_value_info
    names = [f"g{i}" for i in range(len(shapes))]
    g.input.extend([vi(n, _FLOAT, list(s)) for n, s in zip(names, shapes)] + [vi("max_norm", _FLOAT, [B, 1])])
    gb = GraphBuilder(g, opset, "clip/")
    clipped, norm = append_clip(gb, flat_models(gb, names, B), "max_norm")
    outs = unflat_models(gb, clipped, shapes, B)
    gb.flush()
    g.output.extend([vi(o, _FLOAT, list(s)) for o, s in zip(outs, shapes)] + [vi(norm, _FLOAT, [B, 1])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _module(model: onnx.ModelProto, device: torch.device):
    from onnxfuse.runtime.torch.program import OnnxModule

    return OnnxModule(model, trainable=[], buffers=[]).to(device)


def _check_array(array, caller: str) -> None:
    from onnxfuse.runtime.torch.array_module import check_array

    check_array(array, caller)


def _per_model_values(name: str, value, B: int) -> list:
    """``value`` for each of B models: one value for all, or B values (a pair such as betas: one pair or B)."""
    from onnxfuse.recipe.settings import is_per_model_list

    if is_per_model_list(name, value):
        values = list(value)
        if len(values) != B:
            raise ConfigError(f"{name}: {len(values)} values for an array of B={B} models; give one, or one per model")
        return values
    return [value] * B


class ModelOptimizer(torch.optim.Optimizer):
    """Model b's view of a :class:`FusedOptimizer`, for torch's ``lr_scheduler`` classes: its one parameter group
    *is* the array optimizer's group b (the same dict), so a scheduler built on it moves model b's hyper-parameters.
    Stepping is the array optimizer's: ``opt.step()`` steps every model (the view's ``step`` says so)."""

    def __init__(self, parent: "FusedOptimizer", b: int):  # noqa: D107 - not Optimizer.__init__: no groups of its own
        self.parent, self.index = parent, b
        self.defaults = dict(parent.defaults)
        self.param_groups = [parent.param_groups[b]]
        self.state = parent.state
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    def step(self, closure=None):
        raise ConfigError(f"opt.model({self.index}) is model {self.index}'s view for schedulers; step the array's "
                          "optimizer (opt.step()), which steps every model")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.parent.zero_grad(set_to_none)


class FusedOptimizer(torch.optim.Optimizer):
    """The per-model optimizer ``kind`` (a registered name) of a FusedArray; see the module docstring. Subclasses
    name their ``kind``: :class:`SGD`, :class:`Adam`, :class:`AdamW` (and :func:`optimizer_class` for any
    registered optimizer).

    ``FusedOptimizer(array, lr=..., ..., max_norm=None)``: each hyper-parameter one value for every model or a list
    of B (torch.optim's default when not given); ``max_norm`` clips each model's gradient to its own norm inside the
    step (one value or B; None: off), as ``--clip-grad-norm`` does."""

    kind: ClassVar[str] = ""

    def __init__(self, array, max_norm=None, **hyper):
        _check_array(array, f"onnxfuse.optim.{type(self).__name__}")
        self._setup(array, make_optimizer(self.kind, array.B, max_norm=max_norm, caller=type(self).__name__, **hyper))

    @classmethod
    def _from_config(cls, array, config: UpdateRule) -> "FusedOptimizer":
        opt = cls.__new__(cls)
        opt._setup(array, config)
        return opt

    def _setup(self, array, config: UpdateRule) -> None:
        if config.B != array.B:
            raise ConfigError(f"optimizer configured for {config.B} models but the array has B={array.B}")
        self.array, self.B, self.momentum_varies = array, array.B, config.momentum_varies
        self.hyper_names = list(config.hyper)
        self._base = config  # the terms its update graph always has (see _graph_config)
        defaults = {p.name: p.default for p in config.spec.params}
        groups = [{"params": [], **{name: config.hyper[name][b] for name in self.hyper_names},
                   "max_norm": config.max_norm[b] if config.max_norm else math.inf} for b in range(self.B)]
        super().__init__(groups, {**defaults, "max_norm": math.inf})
        self.state["step"] = 0
        self.active = [True] * self.B  # a model not active keeps its state at every step (the run loop's halving)
        self.last_ok = torch.ones(self.B, dtype=torch.bool, device=array.device)
        self._views: dict[int, ModelOptimizer] = {}
        self._program, self._key, self._values = None, None, None

    # ---- torch.optim.Optimizer
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_views", None) is not None:  # after construction
            raise ConfigError(f"{type(self).__name__} has one parameter group per model of the array (B={self.B}); "
                              "it takes no other group")
        add_param_group(self, param_group)  # torch.optim.Optimizer's, without importing torch._dynamo

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        device = self.array.device
        for k, v in list(self.state.items()):
            if isinstance(v, torch.Tensor):
                self.state[k] = v.to(device=device, dtype=torch.float32)
        for b, view in self._views.items():  # load_state_dict replaces the group dicts
            view.param_groups = [self.param_groups[b]]
            view.state = self.state
        self._key = self._values = None

    def model(self, b: int) -> ModelOptimizer:
        """Model b's view, for a torch ``lr_scheduler`` of its own (the same object at every call)."""
        if not 0 <= b < self.B:
            raise IndexError(f"the array has models 0..{self.B - 1}, not {b}")
        if b not in self._views:
            self._views[b] = ModelOptimizer(self, b)
        return self._views[b]

    # ---- the step
    def _parameters(self) -> list[torch.nn.Parameter]:
        state = self.array.onnx_state()
        return [state[n] for n in self.array.trainable]

    def config(self) -> OptimizerConfig:
        """The optimizer as the groups now say (a scheduler or the user may have changed any value)."""
        groups = self.param_groups
        hyper = {name: per_model([g[name] for g in groups]) for name in self.hyper_names}
        hyper["lr"] = tuple(float(g["lr"]) for g in groups)
        max_norm = max_norms([g["max_norm"] for g in groups])
        return OptimizerConfig(self.kind, hyper, max_norm, self.momentum_varies)

    def set_config(self, config: UpdateRule) -> None:
        """Every model's hyper-parameters and clipping from ``config`` (B models), into the groups."""
        if config.B != self.B or config.kind != self.kind:
            raise ConfigError(f"set_config: a {config.kind} configuration of {config.B} models for a {self.kind} "
                              f"optimizer of {self.B}")
        for b, g in enumerate(self.param_groups):
            g.update({name: config.hyper[name][b] for name in self.hyper_names})
            g["max_norm"] = config.max_norm[b] if config.max_norm else math.inf

    def _graph_config(self, config: UpdateRule) -> OptimizerConfig:
        """The configuration the update graph is built from: ``config``'s terms and every term the optimizer was
        made with (a term a model's values do not use is an exact no-op for it, ``g + 0*p``: the graph stays
        when a value falls to zero, and its state with it)."""
        base = self._base
        hyper = {n: config.hyper[n] if config.uses(n) or not base.uses(n) else base.hyper[n] for n in self.hyper_names}
        max_norm = config.max_norm if config.clips or not base.clips else base.max_norm
        return OptimizerConfig(self.kind, hyper, list(max_norm), self.momentum_varies)

    def set_step_values(self, values: StepValues) -> None:
        """This step's per-model lr, cycled value and activity (the run loop's schedules), into the groups."""
        what = REGISTRY[self.kind].cycles
        name, index = (what, None) if isinstance(what, str) or what is None else what
        for g, lr, second in zip(self.param_groups, values.lr, values.momentum):
            g["lr"] = lr
            if name is not None and second is not None:
                g[name] = second if index is None else tuple(
                    second if i == index else x for i, x in enumerate(g[name]))
        self.active = list(values.active)

    def _build(self, config: UpdateRule, buffers: Sequence[str]) -> None:
        arr = self.array
        params = [(n, list(arr.parameter(n).shape)) for n in arr.trainable]
        shapes = [(n, list(arr.buffer(n).shape)) for n in buffers]
        model, writes = update_graph(config, params, shapes, arr.opset)
        self._program = _module(model, arr.device)
        self._writes = writes
        self.ensure_state(config.state_names())

    def ensure_state(self, names: Sequence[str]) -> None:
        """The state buffers ``names`` exist: each one missing starts at zero, ``[B, P]`` on the array's device (a
        checkpoint of step 0 holds them too)."""
        arr = self.array
        P = sum(arr.parameter(n).numel() for n in arr.trainable) // self.B
        for s in names:
            if s not in self.state:
                self.state[s] = torch.zeros(self.B, P, device=arr.device)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, per_model_loss: torch.Tensor | None = None,
             buffers: dict[str, torch.Tensor] | None = None):
        """One step of every model from the gradients in ``arr.parameters()`` (a parameter without one: zero).
        ``per_model_loss`` [B] (optional) joins the fault check; ``buffers`` {fused buffer name: its new value}
        (the run loop's BatchNorm statistics) are written for the models whose step is applied."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.update(per_model_loss, buffers)
        return loss

    @torch.no_grad()
    def update(self, per_model_loss: torch.Tensor | None = None, buffers: dict[str, torch.Tensor] | None = None
               ) -> None:
        """The step without torch.optim's step hooks and profiler range around it (the run loop's call)."""
        buffers = buffers or {}
        hyper = torch.from_numpy(self.prepare(list(buffers))).to(self.array.device, non_blocking=True)
        params = self._parameters()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        self.last_ok = self.apply(params, grads, hyper, per_model_loss, buffers)
        self.finish()

    def prepare(self, buffers: Sequence[str] = ()) -> np.ndarray:
        """The host half of a step: the update graph for the groups' values as they are now (rebuilt only when a
        term changes) and this step's coefficients, ``[K, B, 1]`` float32 (``UpdateRule.coefficients``).
        ``buffers``: the fused buffers whose new values the step writes (BatchNorm statistics)."""
        return self._coefficients(self._graph_for_groups(buffers), self.state["step"] + 1)

    def window(self, upcoming: Sequence[StepValues], buffers: Sequence[str] = ()) -> np.ndarray:
        """The coefficients of the next steps at once, ``[W, K, B, 1]``, for the steps' values ``upcoming`` (this
        step's first): as many as share the update graph of the first (a step whose values add a term to the
        graph ends the window). The groups are left at the first step's values."""
        rows = []
        for i, values in enumerate(upcoming):
            self.set_step_values(values)
            if i == 0:
                config = self._graph_for_groups(buffers)
            else:
                config, _, key = self._configure(buffers)
                if key != self._key:
                    break
            rows.append(self._coefficients(config, self.state["step"] + 1 + i))
        self.set_step_values(upcoming[0])
        return np.stack(rows)

    def _coefficients(self, config: UpdateRule, step: int) -> np.ndarray:
        """Optimizer step ``step``'s ``[K, B, 1]`` coefficients for ``config`` and the models' activity now."""
        return config.coefficients(step, config.constant_values(self.active))

    def _configure(self, buffers: Sequence[str]) -> tuple[OptimizerConfig, OptimizerConfig, tuple]:
        """The configuration of the groups' values now, the one its update graph is made with, and that graph's
        key."""
        config = self.config()
        graph = self._graph_config(config)
        key = (tuple(graph.state_names()), tuple(n for n in self.hyper_names if graph.uses(n)), graph.clips,
               tuple(buffers), self.array.device)
        return config, graph, key

    def _graph_for_groups(self, buffers: Sequence[str]) -> OptimizerConfig:
        """The configuration of the groups' values now, with the update graph built for it."""
        names = self.hyper_names + ["max_norm"]
        values_now = (tuple(tuple(g[n] for n in names) for g in self.param_groups), tuple(buffers),
                      self.array.device)
        if values_now != self._values:
            config, graph, key = self._configure(buffers)
            if key != self._key:
                self._build(graph, list(buffers))
                self._key = key
            self._values, self._configs = values_now, (config, graph)
        return self._configs[0]

    def apply(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], hyper: torch.Tensor,
              per_model_loss: torch.Tensor | None = None, buffers: dict[str, torch.Tensor] | None = None
              ) -> torch.Tensor:
        """The device half of a step (after :meth:`prepare`), no host read: the update graph over ``params`` (the
        array's trainable tensors, in ``array.trainable`` order), their ``grads`` and the coefficients
        ``hyper``; the new parameters, state and ``buffers`` (fused buffer name: its new value) are written in
        place (into ``params`` and the state tensors). Returns ``ok`` [B]: the models whose step was applied. A
        captured step (``train_step.TrainStep``) calls it inside its graph."""
        arr = self.array
        _, graph = self._configs
        inputs = {HYPER_INPUT: hyper,
                  "per_model_loss": (torch.zeros(self.B, device=hyper.device) if per_model_loss is None
                                     else per_model_loss.detach().float().reshape(self.B))}
        for name, p, g in zip(arr.trainable, params, grads):
            inputs[name] = p.detach()
            inputs[f"{name}_grad"] = g
        for name, value in (buffers or {}).items():
            inputs[name] = arr.buffer(name)
            inputs[f"{name}_new"] = value
        for s in graph.state_names():
            inputs[STATE_PREFIX + s] = self.state[s]
        *new, ok = self._program(**inputs)
        by_name = dict(zip(arr.trainable, params))
        targets = [by_name[t].detach() if t in by_name else self._target(t) for t in self._writes]
        torch._foreach_copy_(targets, new)
        return ok.reshape(-1)

    def finish(self) -> None:
        """The host bookkeeping after a step: the step count, and what torch's schedulers check."""
        self.state["step"] += 1
        for view in self._views.values():
            view._opt_called = True  # what torch's schedulers check before their first step

    def _target(self, name: str) -> torch.Tensor:
        if name.startswith(STATE_PREFIX) and name[len(STATE_PREFIX):] in self.state:
            return self.state[name[len(STATE_PREFIX):]]
        arr = self.array
        return arr.onnx_state()[name]


_CLASSES: dict[str, type[FusedOptimizer]] = {}


def optimizer_class(kind: str) -> type[FusedOptimizer]:
    """The FusedOptimizer class of a registered optimizer (``onnxfuse.recipe.optim.register_optimizer``)."""
    if kind not in REGISTRY:
        raise ConfigError(f"unknown optimizer '{kind}'; registered: {', '.join(REGISTRY)}")
    if kind not in _CLASSES:
        spec = REGISTRY[kind]
        name = spec.help.rsplit(".", 1)[-1] if spec.help.startswith("torch.optim.") else kind
        _CLASSES[kind] = type(name, (FusedOptimizer,), {
            "kind": kind, "__module__": __name__, "__qualname__": name,
            "__doc__": f"Per-model {spec.help} of a FusedArray (see FusedOptimizer)."})
    return _CLASSES[kind]


def from_config(array, config: UpdateRule) -> FusedOptimizer:
    """The optimizer a run configured (an ``UpdateRule``: per-model values, clipping; a run's settings are one), on ``array``."""
    return optimizer_class(config.kind)._from_config(array, config)


SGD, Adam, AdamW = (optimizer_class(k) for k in ("sgd", "adam", "adamw"))

_CLIP_PROGRAMS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


@torch.no_grad()
def clip_grad_norm_(array, max_norm) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` for each model of ``array`` on its own: model b's whole gradient (over every
    parameter) is scaled to at most ``max_norm`` (one value, or B; inf: unchanged), in place. Returns each model's
    norm before clipping, [B] on the array's device. The maths is ``append_clip``'s, the update graph's."""
    _check_array(array, "onnxfuse.optim.clip_grad_norm_")
    B, device = array.B, array.device
    limits = max_norms(_per_model_values("max_norm", max_norm, B))
    if any(m < 0 or math.isnan(m) for m in limits):
        raise ConfigError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
    params = [array.parameter(n) for n in array.trainable]
    shapes = [tuple(p.shape) for p in params]
    cached = _CLIP_PROGRAMS.get(array)
    if cached is None or cached[0] != (shapes, device):
        cached = ((shapes, device), _module(_clip_graph(B, shapes, array.opset), device))
        _CLIP_PROGRAMS[array] = cached
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    limit = torch.tensor(limits, dtype=torch.float32).reshape(B, 1).to(device, non_blocking=True)
    *clipped, norm = cached[1](*grads, limit)
    have = [(p.grad, c) for p, c in zip(params, clipped) if p.grad is not None]
    if have:
        torch._foreach_copy_([g for g, _ in have], [c for _, c in have])
    return norm.reshape(B)


from onnxfuse.runtime.torch.array_step import ArrayStep, train_step  # noqa: E402  (the compiled step over these classes)
