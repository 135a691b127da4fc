"""A training run (the layer above the runtimes and the measurements): the loop (``run.py``), run-time verification,
the GAN loop and the report of a run. This package also re-exports what a training script needs from the layers
before it (``make_trainer``, ``make_optimizer``, ``TrainConfig``, ...), as ``onnxfuse.training`` always has."""
from __future__ import annotations

from onnxfuse.recipe.data import Dataset, batches, load_npz, make_dataset
from onnxfuse.training.gan import FusedGAN, GANStep
from onnxfuse.recipe.losses import LOSSES, LossSpec, get_loss
from onnxfuse.recipe.optim import OPTIMIZERS, OptimizerConfig, make_optimizer
from onnxfuse.training.run import TrainConfig, TrainingStopped, TrainResult, train_array, verify_array
from onnxfuse.training.verify import VerifyReport
from onnxfuse.recipe.schedules import SCHEDULES, PerModelSchedules
from onnxfuse.recipe.config import config_to_train_settings, expand_per_model, load_config
from onnxfuse.training.report import make_report
from onnxfuse.recipe.runtimes import RUNTIMES, Runtime, make_trainer, resolve_runtime
from onnxfuse.runtime.torch_runtime import TorchTrainer
from onnxfuse.runtime.ort_runtime import FusedTrainer, check_device, load_array

__all__ = [
    "make_trainer", "Runtime", "RUNTIMES", "resolve_runtime", "TorchTrainer", "FusedTrainer", "TrainConfig", "TrainResult", "TrainingStopped", "train_array", "verify_array", "VerifyReport",
    "load_array", "check_device",
    "SCHEDULES", "PerModelSchedules", "load_config", "expand_per_model", "config_to_train_settings", "make_report",
    "OptimizerConfig", "make_optimizer", "OPTIMIZERS", "LOSSES", "LossSpec", "get_loss",
    "Dataset", "batches", "load_npz", "make_dataset", "FusedGAN", "GANStep",
]
