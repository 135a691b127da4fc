"""Training a fused array, on the torch or the ONNX Runtime runtime (installed as ``onnxfuse.training``)."""
from __future__ import annotations

from .data import Dataset, batches, load_npz, make_dataset
from .gan import FusedGAN, GANStep
from .losses import LOSSES, LossSpec, get_loss
from .optim import OPTIMIZERS, OptimizerConfig, make_optimizer
from .run import TrainConfig, TrainingStopped, TrainResult, train_array, verify_array
from .verify import VerifyReport
from .schedules import SCHEDULES, PerModelSchedules
from .config import config_to_train_settings, expand_per_model, load_config
from .report import make_report
from .runtime import RUNTIMES, Runtime, make_trainer, resolve_runtime
from .torch_runtime import TorchTrainer
from .trainer import FusedTrainer, check_device, load_array

__all__ = [
    "make_trainer", "Runtime", "RUNTIMES", "resolve_runtime", "TorchTrainer", "FusedTrainer", "TrainConfig", "TrainResult", "TrainingStopped", "train_array", "verify_array", "VerifyReport",
    "load_array", "check_device",
    "SCHEDULES", "PerModelSchedules", "load_config", "expand_per_model", "config_to_train_settings", "make_report",
    "OptimizerConfig", "make_optimizer", "OPTIMIZERS", "LOSSES", "LossSpec", "get_loss",
    "Dataset", "batches", "load_npz", "make_dataset", "FusedGAN", "GANStep",
]
