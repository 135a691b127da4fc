"""A user's own loop's training step of a FusedArray (``onnxfuse.optim.train_step``): the array's graph, the user's
loss function and the optimizer as one :class:`~onnxfuse.runtime.torch.train_step.TrainStep`, the step
``onnxfuse train`` runs."""
from __future__ import annotations

from typing import Callable

from onnxfuse.core.errors import ConfigError, DataError
from onnxfuse.recipe.runtimes import LossScale, check_compile, check_precision
from onnxfuse.runtime.protocol import Observed
from onnxfuse.runtime.torch.train_step import TrainStep, batchnorm_outputs

__all__ = ["ArrayStep", "train_step"]


class ArrayStep:
    """A user's training step of a FusedArray with its ``onnxfuse.optim`` optimizer, as one function (a
    :class:`TrainStep`, the one ``onnxfuse train`` runs):

        step = onnxfuse.optim.train_step(arr, opt, loss_fn)     # loss_fn(output [B, N, ...], *targets) -> [B]
        for x, y in loader:
            step(x, y)                  # forward, loss, gradients, clipping, update, BatchNorm statistics: no read
        seen = step.observe()           # the per-model losses, applied steps and first failures, read when wanted

    ``step(*inputs, *targets)``: the array's inputs in order, then whatever the loss takes after the output. The
    optimizer's groups are read at each call (a torch scheduler on ``opt`` works as with ``opt.step()``).
    ``compile``: ``on`` (default) captures the step with ``torch.compile``, ``off`` runs it eagerly. Fault
    isolation is the run loop's: a model whose loss, gradient or update is not finite is frozen from that step
    on (``observe().failed_at``), until ``restart()``. ``precision``: ``fp32`` (default), ``bf16`` or ``fp16``
    (the forward and the loss under ``torch.autocast``; see ``onnxfuse.runtime.torch.precision``); for fp16
    ``loss_scale`` is each model's initial scale (one value or B) or a ``LossScale``, GradScaler's defaults
    when not given, and ``observe().scale`` each model's scale now."""

    def __init__(self, array, optimizer, loss: Callable, compile: str = "on", precision: str = "fp32",
                 loss_scale=None):
        import copy

        from onnxfuse.runtime.torch.program import TorchOptions

        self.array, self.loss = array, loss
        train = copy.deepcopy(array._graph)
        if precision != "fp32":  # each model's arithmetic alone under autocast (a Linear's bias in its product, ...)
            from onnxfuse.runtime.torch.precision import autocast_graph

            train = autocast_graph(train, array.trainable + array.buffer_names)
        stats, stat_outputs = batchnorm_outputs(train, set(array.buffer_names))
        self.program = array.program(train, outputs=list(array.output_names) + stat_outputs,
                                     options=TorchOptions(update_stats=False))
        self.n_inputs = len(array.input_names)
        self.step = TrainStep(optimizer, self._forward, stats, compile, precision=precision, loss_scale=loss_scale)

    def _forward(self, weights: dict, batch: dict) -> tuple:
        arr = self.array
        inputs = [batch[f"input_{k}"] for k in range(self.n_inputs)]
        targets = [batch[f"target_{k}"] for k in range(len(batch) - self.n_inputs)]
        *outputs, = self.program.onnx(**dict(zip(arr.input_names, inputs)), **weights)
        n = len(arr.output_names)
        out = outputs[0] if n == 1 else tuple(outputs[:n])
        per_model = self.loss(out, *targets)
        if tuple(getattr(per_model, "shape", ())) != (arr.B,):
            raise ConfigError(f"train_step: the loss returned {list(getattr(per_model, 'shape', []))}; it must return "
                            f"one loss per model, shape [{arr.B}]")
        return per_model.sum(), per_model, outputs[n:]

    def __call__(self, *tensors) -> None:
        if len(tensors) < self.n_inputs:
            raise DataError(f"train_step: the array takes {self.n_inputs} input(s) "
                            f"({', '.join(self.array.input_names)}), then the loss's targets; got {len(tensors)}")
        self.array.feeds(tensors[:self.n_inputs], {}, "train_step")  # each input as the graph declares it
        device = self.array.device
        batch = {(f"input_{k}" if k < self.n_inputs else f"target_{k - self.n_inputs}"): t.to(device, non_blocking=True)
                 for k, t in enumerate(tensors)}
        self.step(batch)
        self.array.forwards.add_(1)  # BatchNorm's num_batches_tracked, as a training forward counts it

    def observe(self) -> Observed:
        return self.step.observe()

    def restart(self) -> None:
        self.step.restart()


def train_step(array, optimizer, loss: Callable, compile: str = "on", precision: str = "fp32",
               loss_scale=None) -> ArrayStep:
    """See :class:`ArrayStep`. Its arguments are checked here, the Python API's edge (one ConfigError line)."""
    from onnxfuse.runtime.torch.array_module import check_array

    check_array(array, "train_step")
    if getattr(optimizer, "array", None) is not array:
        raise ConfigError("train_step: the optimizer was not made for this array (give an onnxfuse.optim "
                          "optimizer made for it: onnxfuse.optim.SGD(arr, ...))")
    check_compile(compile, "train_step(compile=)")
    check_precision(precision, where="train_step(precision=)")
    if loss_scale is not None and not isinstance(loss_scale, LossScale):
        each = loss_scale if isinstance(loss_scale, (list, tuple)) else [loss_scale] * array.B
        loss_scale = LossScale(tuple(float(v) for v in each))
    if precision == "fp16" and loss_scale is not None and len(loss_scale.init) != array.B:
        raise ConfigError(f"loss_scale: {len(loss_scale.init)} initial scales for an array of B={array.B} models")
    return ArrayStep(array, optimizer, loss, compile, precision, loss_scale)
