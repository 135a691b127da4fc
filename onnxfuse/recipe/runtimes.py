"""The runtimes a run may choose, as the facts its settings are checked against: each runtime's name and help, the
precisions it trains in (``--precision``) and whether it captures its step whole (``--compile``); and fp16's loss
scaling. Each runtime is one entry in :data:`RUNTIMES`; the class that trains for it is loaded by its function in
``onnxfuse/runtime/trainers.py`` (``TRAINERS``), the layer that may import torch and onnxruntime.

``compile`` (:data:`COMPILE_CHOICES`): whether a runtime that can (``RuntimeInfo.compiles``) captures its step
whole; ``auto`` decides from the run's length (``total_steps``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

from onnxfuse.core.errors import ConfigError

__all__ = ["RuntimeInfo", "RUNTIMES", "RUNTIME_CHOICES", "COMPILE_CHOICES", "PRECISIONS", "LossScale",
           "check_compile", "check_precision", "check_runtime_takes"]

COMPILE_CHOICES = ("auto", "on", "off")
# the arithmetic of the forward and backward (``--precision``): fp32 throughout, or torch.autocast's bf16 / fp16
# with fp32 weights, state and update (a runtime trains in the ones its ``RuntimeInfo.precisions`` lists)
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class LossScale:
    """fp16's dynamic loss scaling, torch.amp.GradScaler's semantics with a scale per model: each model's loss is
    multiplied by its ``init`` scale at first; a step whose gradient (of that model) overflows is skipped for that
    model and its scale multiplied by ``backoff``; after ``interval`` steps without overflow its scale is multiplied
    by ``growth``. A model that overflows at a scale of ``MIN`` or less is diverged (its gradient overflows without
    any scale)."""

    init: tuple[float, ...]  # one per model
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000

    INIT: ClassVar[float] = 2.0 ** 16  # GradScaler's init_scale
    MIN: ClassVar[float] = 1.0

    def select(self, keep: Sequence[int]) -> "LossScale":
        return LossScale(tuple(self.init[i] for i in keep), self.growth, self.backoff, self.interval)


@dataclass(frozen=True)
class RuntimeInfo:
    """One runtime, as the settings know it: its name, its help, whether it captures its step whole (takes
    ``compile=`` and ``total_steps=``) and the ``--precision`` values it trains in (others: ``precision=``,
    ``loss_scale=``)."""

    name: str
    help: str
    compiles: bool = False
    precisions: tuple[str, ...] = ("fp32",)


# Each runtime is one entry. `auto` picks the first entry that can run on the device: the torch runtime trained
# the fused arrays faster than onnxruntime-training on this CPU (README, "Runtimes") and is the only one that
# reaches a current GPU stack.
RUNTIMES: dict[str, RuntimeInfo] = {r.name: r for r in (
    RuntimeInfo("torch", "PyTorch: the fused graph as a torch module, autograd, any device torch supports",
                compiles=True, precisions=PRECISIONS),
    RuntimeInfo("ort", "onnxruntime-training 1.19: CPU, or CUDA 11.8 with the onnxruntime-training GPU build"),
)}
RUNTIME_CHOICES = ("auto",) + tuple(RUNTIMES)


def check_compile(value: str, where: str = "--compile") -> str:
    """``value`` is one of :data:`COMPILE_CHOICES` (a one-line ConfigError else): the Python API's edge
    (``make_trainer``, ``onnxfuse.optim.train_step``)."""
    if value not in COMPILE_CHOICES:
        raise ConfigError(f"{where} must be one of {', '.join(COMPILE_CHOICES)}, got {value!r}")
    return value


def check_precision(precision: str, where: str = "--precision") -> str:
    """``precision`` is one of :data:`PRECISIONS` (a one-line ConfigError else): the Python API's edge."""
    if precision not in PRECISIONS:
        raise ConfigError(f"{where} must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def check_runtime_takes(info: RuntimeInfo, precision: str, compile: str, then: str = "use") -> None:
    """The runtime ``info`` trains in ``precision`` and, asked to compile (``on``), compiles its step: what a run's
    settings ask of the runtime chosen for them, checked once, where it is chosen (``then``: the verb of the fix)."""
    if precision not in info.precisions:
        capable = ", ".join(r.name for r in RUNTIMES.values() if precision in r.precisions)
        raise ConfigError(f"--precision {precision}: the {info.name} runtime trains in "
                          f"{', '.join(info.precisions)} only; use --runtime {capable}, or --precision fp32")
    if compile == "on" and not info.compiles:
        capable = ", ".join(r.name for r in RUNTIMES.values() if r.compiles)
        raise ConfigError(f"--compile on: the {info.name} runtime does not compile its step; {then} --runtime "
                          f"{capable}, or --compile auto / off")
