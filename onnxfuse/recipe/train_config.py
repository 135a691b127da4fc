"""``TrainConfig``: every setting of a run (``settings.RUN_SETTINGS`` and the registered optimizers'
hyper-parameters), checked when made, and what a run builds from it (its optimizer configuration, its loss)."""
from __future__ import annotations

from onnxfuse.recipe.losses import LossSpec, get_loss
from onnxfuse.recipe.optim import OptimizerConfig, make_optimizer
from onnxfuse.recipe.settings import OPTIMIZERS, TrainSettings, train_config_model


class _TrainConfigMethods(TrainSettings):
    """What a run does with its settings (the fields come from ``settings.py``)."""

    def optimizer_config(self, B: int) -> OptimizerConfig:
        hyper = {p.name: getattr(self, p.name, None) for p in OPTIMIZERS[self.optimizer].params}
        return make_optimizer(self.optimizer, B, max_norm=self.clip_grad_norm, **hyper)

    def loss_spec(self) -> LossSpec:
        return get_loss(self.loss, per_model_labels=self.per_model_labels or self.data_order != "shared",
                        **self.loss_options)


# Everything a run takes (see ``onnxfuse train --help``): every setting of settings.RUN_SETTINGS and every
# hyper-parameter of the registered optimizers, a scalar or (per model) a list of B; the schedule; the loss options.
# Checked when made: a bad value is one ConfigError line.
TrainConfig = train_config_model(_TrainConfigMethods)
