"""Which class trains a fused graph for each runtime, and making one.

Each runtime of ``onnxfuse/recipe/runtimes.py``'s ``RUNTIMES`` (its name, what it trains in) has its class here, in
:data:`TRAINERS` (their modules import torch and onnxruntime only when a trainer is made). :func:`resolve_runtime`
chooses the runtime, ``auto`` included, once: where a run's settings are made (``onnxfuse/training/prepare.py``:
``RunSettings``) or where the Python API is called (:func:`make_trainer`); :func:`build_trainer` makes the trainer
of arguments checked there, calling its class by name, and checks nothing again.
"""
from __future__ import annotations

import logging

import onnx

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core.errors import ConfigError
from onnxfuse.core.weights import ArraySpec
from onnxfuse.recipe.device import Device
from onnxfuse.recipe.losses import LossSpec
from onnxfuse.recipe.optim import UpdateRule
from onnxfuse.recipe.runtimes import (RUNTIME_CHOICES, RUNTIMES, LossScale, check_compile, check_precision,
                                      check_runtime_takes)
from onnxfuse.runtime.ort.trainer import OrtTrainer
from onnxfuse.runtime.protocol import Runtime
from onnxfuse.runtime.torch.trainer import TorchTrainer

__all__ = ["TRAINERS", "resolve_runtime", "build_trainer", "make_trainer", "wants_one_model"]

log = logging.getLogger("onnxfuse.train")


# the class that trains for each runtime of RUNTIMES (tests/recipe/test_settings_once.py: the same names)
TRAINERS: dict[str, type[Runtime]] = {"torch": TorchTrainer, "ort": OrtTrainer}


def resolve_runtime(runtime: str, device: Device | str, precision: str = "fp32", compile: str = "off",
                    then: str = "use") -> str:
    """The registered runtime for ``runtime`` (a name or ``auto``) on ``device``, in ``precision``, compiling as
    ``compile`` asks; an unavailable one is a ConfigError saying why and what to do (``then``: the verb of the
    fix). The one place a runtime is chosen."""
    device = Device.of(device)
    if runtime == "auto":
        reasons = {}
        for name, info in RUNTIMES.items():
            reasons[name] = (TRAINERS[name].unavailable(device) if precision in info.precisions else
                             f"trains in {', '.join(info.precisions)} only, not {precision}")
            if reasons[name] is None:
                check_runtime_takes(info, precision, compile, then)
                return name
        raise ConfigError(f"no runtime can train on '{device}': " + "; ".join(f"{n}: {r}" for n, r in reasons.items()))
    if runtime not in RUNTIMES:
        raise ConfigError(f"unknown runtime '{runtime}'; choose one of: {', '.join(RUNTIME_CHOICES)}")
    why = TRAINERS[runtime].unavailable(device)
    if why is not None:
        raise ConfigError(why)
    check_runtime_takes(RUNTIMES[runtime], precision, compile, then)
    return runtime


def build_trainer(runtime: str, fused: onnx.ModelProto, spec: ArraySpec, loss: str | LossSpec,
                  optimizer: UpdateRule, device: Device, workdir: str | None = None,
                  threads: int | None = None, compile: str = "off", total_steps: int = 0, precision: str = "fp32",
                  loss_scale: LossScale | None = None, seed: int = 0,
                  one_model: tuple[onnx.ModelProto, ArraySpec] | None = None) -> Runtime:
    """A trainer of ``fused`` on the registered runtime ``runtime``, from arguments checked where they were given
    (a run's settings, :func:`make_trainer`): nothing is checked here. ``compile``, ``total_steps``, ``seed`` and
    ``one_model`` (a model of the array fused alone, for the model-by-model form of a compiled step) go to
    the runtime that compiles, ``precision`` and ``loss_scale`` to the one that trains in reduced precision
    (``RUNTIMES``: the torch runtime)."""
    watch = Stopwatch()
    common = {"device": device, "workdir": workdir, "threads": threads}
    match runtime:  # each runtime's class, called by its name (what it takes: its entry of RUNTIMES)
        case "torch":
            trainer = TorchTrainer(fused, spec, loss, optimizer, **common, compile=compile, total_steps=total_steps,
                                   precision=precision, loss_scale=loss_scale, seed=seed, one_model=one_model)
        case "ort":
            trainer = OrtTrainer(fused, spec, loss, optimizer, **common)
    log.debug("runtime %s on %s in %s, compile %s: its trainer built in %.2f s", runtime, device, precision,
              compile if RUNTIMES[runtime].compiles else "off (it does not compile)", watch.seconds)
    return trainer


def make_trainer(runtime: str, fused: onnx.ModelProto, spec: ArraySpec, loss: str | LossSpec,
                 optimizer: UpdateRule, device: Device | str = "cpu", workdir: str | None = None,
                 threads: int | None = None, compile: str = "off", total_steps: int = 0, precision: str = "fp32",
                 loss_scale: LossScale | None = None, seed: int = 0,
                 one_model: tuple[onnx.ModelProto, ArraySpec] | None = None) -> Runtime:
    """A trainer of ``fused`` on ``runtime`` (a name or ``auto``), the Python API's: its arguments are checked
    here, once. ``compile``: capture the step whole (``on``), not (``off``), or decide from ``total_steps``
    (``auto``; a runtime that cannot compile does not); ``precision`` (``PRECISIONS``) and, for fp16,
    ``loss_scale`` (default: GradScaler's); ``seed``: the run's, which a compiling runtime's random nodes mix into
    their own seeds (ONNX Runtime's draw from their node's seed alone)."""
    device = Device.of(device)
    check_compile(compile)
    name = resolve_runtime(runtime, device, check_precision(precision), "on" if compile == "on" else "off")
    return build_trainer(name, fused, spec, loss, optimizer, device, workdir, threads, compile, total_steps,
                         precision, loss_scale, seed, one_model)


def wants_one_model(runtime: str, device: Device | str, compile: str) -> bool:
    """Whether a trainer would use a one-model graph (``one_model``: a model of the array fused alone): the torch
    runtime compiling on a CPU, where a compiled step times its forms (``TrainStep.FORMS``), the model-by-model form
    among them."""
    return runtime == "torch" and compile != "off" and not Device.of(device).is_cuda
