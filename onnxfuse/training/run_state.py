"""The mutable state of one run (``RunState``): the current array, possibly shrunk by halving, its trainer and
per-model status (the batches each step gives the models still in it: ``recipe/batches.py``)."""
from __future__ import annotations

import logging
import os
from typing import Sequence

import numpy as np
import onnx

from onnxfuse.core.array import ArrayDir
from onnxfuse.core.errors import InputFileError
from onnxfuse.core.passes import fuse_models, fused_initial_weights
from onnxfuse.core.split import model_steps, split_weights
from onnxfuse.core.weights import ArraySpec
from onnxfuse.recipe.data import Dataset
from onnxfuse.recipe.losses import LossSpec
from onnxfuse.recipe.optim import UpdateRule
from onnxfuse.recipe.schedules import PerModelSchedules
from onnxfuse.recipe.train_config import RunSettings
from onnxfuse.runtime.protocol import Observed, Runtime
from onnxfuse.runtime.trainers import build_trainer, wants_one_model
from onnxfuse.training.best import KeptBest


log = logging.getLogger("onnxfuse.train")


class RunState:
    """The mutable state of one run: the current (possibly shrunk) array and everything needed to checkpoint it."""

    def __init__(self, array_dir: str, settings: RunSettings, fused: onnx.ModelProto, spec: ArraySpec,
                 loss: LossSpec, total_steps: int, workdir: str):
        self.array_dir, self.settings, self.loss, self.total = array_dir, settings, loss, total_steps
        self.array = ArrayDir(array_dir)
        self.workdir = workdir
        self.spec0 = spec  # the original array (all B models)
        self.models = list(range(spec.B))  # original index of each model of the current array
        self.status: dict[int, dict] = {}  # original model -> {"status": ..., "step": ...}
        self.active = [True] * spec.B
        self.dropped: dict[int, dict[str, np.ndarray]] = {}  # original model -> its state_dict when dropped
        # the update rule of the current array: the run's settings (a RunSettings is one), a selection of them
        # after the array shrinks; and each model's schedule at step 0
        self.opt: UpdateRule = settings
        self.schedules = PerModelSchedules(settings.schedules, settings, total_steps)
        self.loss_scale = settings.loss_scale_config()  # fp16: the current array's models' initial scales
        self.fused, self.spec = fused, spec
        self.trainer = self._trainer()
        self.step = 0
        self.last_loss = np.full(spec.B, np.nan)
        self.last_eval: dict = {}
        self.last_eval_step = -1
        self.config_record: dict = settings.as_dict()
        self.run_record: dict = {}  # the run's id, settings hash and data hash (written with every state)
        self.best = KeptBest(settings.keep_best)  # each model's best state so far (--keep-best)

    def _trainer(self) -> Runtime:
        os.makedirs(self.workdir, exist_ok=True)
        folder = os.path.join(self.workdir, f"artifacts_{len(os.listdir(self.workdir))}_b{len(self.models)}")
        settings = self.settings
        return build_trainer(settings.runtime, self.fused, self.spec, self.loss, self.opt, settings.device,
                             workdir=folder, threads=settings.threads or None, compile=settings.compile,
                             total_steps=self.total, precision=settings.precision, loss_scale=self.loss_scale,
                             seed=settings.seed, one_model=self._one_model())

    def _one_model(self) -> tuple[onnx.ModelProto, ArraySpec] | None:
        """The first model of the array fused alone, for the model-by-model form of a compiled step, where a
        trainer would use it (``wants_one_model``); None, said once, where the array's folder has not its source
        graph (the step is then timed in its other forms)."""
        settings = self.settings
        if not wants_one_model(settings.runtime, settings.device, settings.compile):
            return None
        try:
            return self.array.refuse(self.models[:1], split_weights(self.spec, fused_initial_weights(self.fused),
                                                                    models=[0]), fuse_models)
        except InputFileError as e:
            log.info("compiled step: no model-by-model form (%s)", e)
            return None

    # ---- state
    def state(self) -> dict:
        return {"step": self.step, "models": self.models, "active": self.active, "trainer_steps": self.trainer.steps,
                "status": {str(k): v for k, v in self.status.items()}, "compiled": self.trainer.compiled,
                "loss_scales": self.loss_scales(), "random": self.random_state()}

    def random_state(self) -> dict | None:
        """Where the graph's random nodes' generators are (the torch runtime's), None where the runtime keeps none."""
        state = getattr(self.trainer, "random_state", None)
        return state() if state is not None else None

    def loss_scales(self) -> dict | None:
        """fp16: each model's loss scale and steps since its last overflow (the trainer's), None otherwise."""
        scales = getattr(self.trainer, "loss_scales", None)
        return scales() if scales is not None else None

    def per_model_states(self, positions: Sequence[int] | None = None) -> list[dict[str, np.ndarray]]:
        """The state_dict of each model in the array (``positions``: of those only, in that order)."""
        # num_batches_tracked counts the steps each model took: a diverged model's stopped with it
        steps = [model_steps(self.status.get(b), self.trainer.steps) for b in self.models]
        return split_weights(self.spec, self.trainer.weights(), steps=steps, models=positions)

    def keep_decision(self, compiled: bool | None) -> None:
        """A run with ``--compile auto`` keeps the decision it made (a resumed run, a re-fused array): compiled and
        eager steps round differently, and a resumed run goes on as the uninterrupted one would."""
        if compiled is not None and self.settings.compile == "auto":
            self.trainer.compiled = compiled

    def load(self, weights: dict, opt_state: dict) -> None:
        self.trainer.load({**weights, **opt_state})

    # ---- shrinking
    def keep(self, positions: Sequence[int], reason: str) -> None:
        """Re-fuse the array with only the models at ``positions``, with their current weights, optimizer state
        and schedule position; the others are recorded as ``reason`` (e.g. dropped) at this step."""
        positions = list(positions)
        states = self.per_model_states()
        opt_state = self.trainer.optimizer_state()
        for i, b in enumerate(self.models):
            if i not in positions:
                self.dropped[b] = states[i]
                before = self.status.get(b, {})
                self.status[b] = {"status": reason, "step": self.step,
                                  **({"diverged": before["step"]} if before.get("status") == "diverged" else {})}
        survivors = [self.models[i] for i in positions]
        self.fused, self.spec = self.array.refuse(survivors, [states[i] for i in positions], fuse_models)
        self.opt = self.opt.select(positions)
        self.schedules = self.schedules.select(positions)
        steps, compiled, scales = self.trainer.steps, self.trainer.compiled, self.loss_scales()
        self.loss_scale = self.loss_scale.select(positions) if self.loss_scale else None
        self.trainer = self._trainer()
        self.trainer.steps = steps
        self.keep_decision(compiled)
        if scales is not None:
            self.trainer.load_loss_scales(scales, positions)
        self.load({}, {k: v[positions] for k, v in opt_state.items()})
        self.active = [self.active[i] for i in positions]
        self.models = survivors
        self.last_loss = self.last_loss[positions]


def model_view(data: Dataset, run: RunState) -> Dataset:
    """Per-model arrays restricted to the models still in the array."""
    if not data.per_model or len(run.models) == run.spec0.B:
        return data
    return Dataset({k: (v[run.models] if k in data.per_model else v) for k, v in data.arrays.items()}, data.per_model)


def mark_diverged(run: RunState, seen: Observed) -> dict[int, tuple[int, float]]:
    """Models the trainer rejected although active, read at ``run.step`` (``seen``: the trainer's ``observe()``):
    diverged at the run step they were rejected at, frozen from there on. Returns {original model: (that step, its
    loss there)} for the models newly found."""
    events = {}
    offset = run.step - run.trainer.steps  # run steps and optimizer steps advance together between reads
    for i, b in enumerate(run.models):
        if run.active[i] and seen.failed_at[i] > 0:
            step, loss = int(seen.failed_at[i]) + offset, float(seen.failed_loss[i])
            run.active[i] = False
            run.status[b] = {"status": "diverged", "step": step}
            events[b] = (step, loss)
            log.warning("model %d diverged at step %d (loss %s); it is frozen at its last finite state", b, step, loss)
    return events
