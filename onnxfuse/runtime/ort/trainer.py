"""The ONNX Runtime training session of a fused array: one session call per step for all B models (the run
around it, with schedules, evaluation, checkpoints, is in ``run.py``)."""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
import weakref
from dataclasses import replace
from typing import Sequence

import numpy as np
import onnx

from onnxfuse.core.errors import ORT_CUDA_FIX, ConfigError
from onnxfuse.core.weights import ArraySpec

from onnxfuse.runtime.ort.artifacts import build_artifacts, ort_failure
from onnxfuse.recipe.data import Dataset
from onnxfuse.recipe.device import CPU, Device
from onnxfuse.recipe.losses import LABELS, LossSpec, PythonLoss, get_loss
from onnxfuse.recipe.optim import StepValues, UpdateRule
from onnxfuse.runtime.protocol import Observed, check_feeds, evaluate

__all__ = ["OrtTrainer", "check_device"]


def check_device(device: Device | str) -> Device:
    """``device`` (a Device, or its text: cpu, cuda, cuda:N) as ONNX Runtime can train on it: CUDA needs the
    onnxruntime-training GPU build (the `gpu` extra); else one ConfigError line saying so."""
    device = Device.of(device)
    why = _ort_unavailable(device)
    if why is not None:
        raise ConfigError(why)
    return device


@functools.lru_cache(maxsize=None)  # the providers of the installed build do not change while a process runs
def _ort_unavailable(device: Device) -> str | None:
    if not device.is_cuda:
        return None
    import onnxruntime

    if device.ort_provider()[0] not in onnxruntime.get_available_providers():
        return (f"--device {device}: this onnxruntime-training build has no CUDA support; {ORT_CUDA_FIX}, or "
                "use --device cpu")
    return None


def _readable(path: str) -> list[onnx.ModelProto]:
    """The model at ``path`` (to look up the nodes an error names), or none if it cannot be read."""
    try:
        return [onnx.load(path, load_external_data=False)]
    except Exception:
        return []


class OrtTrainer:
    """The ORT training Module of one fused array. ``step(feeds)`` trains all B models on one batch.

    ``loss`` is a loss name, or a :class:`LossSpec` with options from ``get_loss(name, label_smoothing=...,
    ignore_index=..., class_axis=..., per_model_labels=...)``. Feeds are numpy arrays by graph input name plus
    ``labels`` (unless the loss is ``model``); per-model inputs and per-model labels are ``[B, N, ...]``."""

    def __init__(self, fused: onnx.ModelProto, spec: ArraySpec, loss: str | LossSpec, optimizer: UpdateRule,
                 device: Device = CPU, workdir: str | None = None, threads: int | None = None):
        import onnxruntime
        from onnxruntime.training.api import CheckpointState, Module

        if optimizer.B != spec.B:
            raise ConfigError(f"optimizer configured for {optimizer.B} models but the array has B={spec.B}")
        self.spec, self.opt, self.loss = spec, optimizer, get_loss(loss)
        if isinstance(self.loss, PythonLoss):
            raise ConfigError(f"the loss {self.loss.label} is a Python function, which the ort runtime cannot run "
                              "(its training graph is ONNX); train with --runtime torch")
        self.device = device  # one it runs on: checked where the runtime was chosen (trainers.resolve_runtime)
        if workdir is None:  # a folder of our own: removed with the trainer
            workdir = tempfile.mkdtemp(prefix="onnxfuse-artifacts-")
            weakref.finalize(self, shutil.rmtree, workdir, True)
        self.workdir = workdir
        os.makedirs(self.workdir, exist_ok=True)
        self.art = build_artifacts(fused, spec, self.loss, optimizer, self.workdir, device=self.device)
        try:
            self.state = CheckpointState.load_checkpoint(self.art.checkpoint)
        except Exception as e:  # out of memory; anything else is ORT's own failure
            raise ort_failure(e, fused, self.device, "loading the initial checkpoint") from e
        so = onnxruntime.SessionOptions()
        so.log_severity_level = 4  # a failing kernel raises (out of memory, ...): no second report in ORT's log
        # Denormal floats (e.g. weights of a model that stalled) make x86 arithmetic many times slower; flushing
        # them to zero changes values only below 1e-38.
        so.add_session_config_entry("session.set_denormal_as_zero", "1")
        if threads:
            so.intra_op_num_threads = threads
        try:
            self.module = Module(self.art.training_model, self.state, self.art.eval_model, device=str(self.device),
                                 session_options=so)
        except Exception as e:  # a kernel ORT has not for a node, out of memory...: one error naming the node
            raise ort_failure(e, fused, self.device, "starting the training session",
                              graphs=_readable(self.art.training_model)) from e
        self.module.train()
        self.steps = 0
        self.compile, self.compiled = "off", False  # the step is the session's: nothing to capture
        self.last_ok, self._losses = np.ones(spec.B, dtype=bool), np.full(spec.B, np.nan, dtype=np.float32)
        # what the graphs take each step, in order (the 'model' loss has no labels input)
        self.inputs = [n for n in self.art.eval_inputs if n != LABELS or self.loss.has_labels]

    def _args(self, arrays: Sequence[np.ndarray]):
        if self.device.is_cuda:
            from onnxruntime import OrtValue

            return [OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), "cuda", self.device.device_id)
                    for a in arrays]
        return list(arrays)

    @staticmethod
    def _np(x) -> np.ndarray:
        return x if isinstance(x, np.ndarray) else x.numpy()

    def _feeds(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return check_feeds(self.inputs, feeds)

    def step(self, feeds: dict[str, np.ndarray], values: StepValues | None = None) -> np.ndarray:
        """One training step of every model; returns the per-model losses [B]. ``values``: this step's per-model
        lr / momentum (or beta1) / active flags (default: the configured constants). ``last_ok`` then holds which
        models' steps were applied (False: inactive, or a non-finite loss, gradient or update); a model rejected
        while active is not stepped again until ``steps`` is set (see ``runtimes``)."""
        self._steps += 1  # not the setter: that restarts the freeze
        values = values if values is not None else self.opt.constant_values()
        active = np.asarray(values.active, dtype=bool) & self._alive
        arrays = self._feeds(feeds) + [self.opt.coefficients(self.steps, replace(values, active=active.tolist()))]
        _, per_model, _, ok = self.module(*self._args(arrays))
        self.last_ok = self._np(ok).reshape(-1).astype(bool)
        self._losses = self._np(per_model).copy()
        first = active & ~self.last_ok & (self._failed_at == 0)
        self._failed_at[first] = self.steps
        self._failed_loss[first] = self._losses[first]
        self._alive &= ~(active & ~self.last_ok)
        return self._losses

    def launch(self, feeds: dict[str, np.ndarray], values: StepValues | None = None, ahead=None) -> None:
        """``step`` (this runtime's step reads its results back anyway, and computes each step's coefficients
        on the host: ``ahead`` is not used)."""
        self.step(feeds, values)

    def observe(self) -> Observed:
        return Observed(self._losses.copy(), self.last_ok.copy(), self._failed_at.copy(), self._failed_loss.copy())

    @property
    def steps(self) -> int:
        return self._steps

    @steps.setter
    def steps(self, value: int) -> None:
        """The state is now at optimizer step ``value`` (a resume, a restored state): every model steps again."""
        B = self.spec.B
        self._steps, self._alive = int(value), np.ones(B, dtype=bool)
        self._failed_at, self._failed_loss = np.zeros(B, dtype=np.int64), np.zeros(B, dtype=np.float32)

    def eval_batch(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Per-model losses [B] and the fused output of one batch with the eval graph (BatchNorm on running
        statistics, Dropout off)."""
        self.module.eval()
        try:
            outs = self.module(*self._args(self._feeds(feeds)))
        finally:
            self.module.train()
        return self._np(outs[0]), self._np(outs[1])

    def evaluate(self, data: Dataset, batch_size: int = 256) -> dict[str, np.ndarray]:
        """See :func:`training.runtime.evaluate`."""
        return evaluate(self, data, batch_size)

    def weights(self) -> dict[str, np.ndarray]:
        """Copies of the fused weights (parameters and buffers), by fused name."""
        return {n: self.state.parameters[n].data.copy() for n in self.art.trainable + self.art.buffers}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        return {n: self.state.parameters[n].data.copy() for n in self.art.optimizer_state}

    def load(self, tensors: dict[str, np.ndarray]) -> None:
        """Set parameters, buffers or optimizer state by name."""
        for name, value in tensors.items():
            self.state.parameters[name].data = np.ascontiguousarray(value)

    @property
    def trainable(self) -> list[str]:
        return self.art.trainable

    @property
    def buffers(self) -> list[str]:
        return self.art.buffers

    @staticmethod
    def unavailable(device: Device | str) -> str | None:
        """Why this runtime cannot train on ``device`` (None: it can)."""
        try:
            return _ort_unavailable(Device.of(device))
        except ConfigError as e:
            return str(e)

    def save_checkpoint(self, path: str) -> None:
        from onnxruntime.training.api import CheckpointState

        CheckpointState.save_checkpoint(self.state, path)
