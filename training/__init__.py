"""Training a fused array with ONNX Runtime's training API (installed as ``onnxfuse.training``)."""
from __future__ import annotations

from .data import Dataset, batches, load_npz, make_dataset
from .gan import FusedGAN, GANStep
from .losses import LOSSES, LossSpec, get_loss
from .optim import OPTIMIZERS, OptimizerConfig, make_optimizer
from .trainer import FusedTrainer, TrainConfig, TrainResult, check_device, load_array, train_array

__all__ = [
    "FusedTrainer", "TrainConfig", "TrainResult", "train_array", "load_array", "check_device",
    "OptimizerConfig", "make_optimizer", "OPTIMIZERS", "LOSSES", "LossSpec", "get_loss",
    "Dataset", "batches", "load_npz", "make_dataset", "FusedGAN", "GANStep",
]
