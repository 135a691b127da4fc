"""The PyTorch runtime: the fused ONNX graph trained by torch autograd, on any device torch supports.

Three ONNX graphs are built once, by the same passes the ONNX Runtime runtime uses, and converted to torch
(``torch_graph``); none of the training maths is written twice:

    train    the fused graph + the per-model loss (``add_loss_pass``): outputs loss, per_model_loss and every
             training-mode BatchNorm's new running statistics (torch's own kernel and rule)
    update   ``OptimizerConfig.append_update`` (clipping, SGD / Adam / AdamW, fault isolation) as a graph of its own:
             parameters, gradients, coefficients, optimizer state, statistics -> their new values and ``ok``
    eval     the fused graph in inference mode (``to_inference``) + the per-model loss

The weights are graph *inputs* of all three, held once by this trainer: parameters as ``nn.Parameter``s in the
fused layout, buffers and the flat ``[B, P]`` optimizer state as tensors on the device. A step is: forward,
``torch.autograd.grad`` of the summed loss (each model's gradient is its own: the models share no weight), the
update graph, and copying its results into the weights — a few dozen kernels for all B models together, no host
transfer but the batch in and the B losses out.
"""
from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import onnx
from onnx import helper

from onnxfuse.core._opset import is_training_batchnorm, onnx_opset
from onnxfuse.core.errors import ConfigError
from onnxfuse.core.weights import ArraySpec

from onnxfuse.core._builder import GraphBuilder
from onnxfuse.runtime.ort_artifacts import (HYPER_INPUT, add_loss_pass, inference_loss_pass,
                                            weights_as_inputs_pass)
from onnxfuse.recipe.data import Dataset
from onnxfuse.recipe.device import Device
from onnxfuse.recipe.losses import LABELS, LossSpec, get_loss
from onnxfuse.recipe.optim import STATE_PREFIX, OptimizerConfig, StepValues
from onnxfuse.recipe.runtimes import check_feeds, evaluate, parameter_names

__all__ = ["TorchTrainer", "update_graph"]

_FLOAT = onnx.TensorProto.FLOAT


def _batchnorm_outputs(model: onnx.ModelProto, buffers: set[str]) -> tuple[list[str], list[str]]:
    """The running statistics of every training-mode BatchNorm, and the names of the outputs (1 and 2) that hold
    their new values, named where the graph left them unnamed."""
    from onnxfuse.core._graph import Names

    names = Names.of(model.graph)
    opset = onnx_opset(model)
    stats, outputs = [], []
    for node in model.graph.node:
        if not is_training_batchnorm(node, opset) or node.input[3] not in buffers or node.input[4] not in buffers:
            continue
        while len(node.output) < 3:
            node.output.append("")
        for k in (1, 2):
            if not node.output[k]:
                node.output[k] = names.fresh(f"{node.input[2 + k]}_new")
            stats.append(node.input[2 + k])
            outputs.append(node.output[k])
    return stats, outputs


def update_graph(opt: OptimizerConfig, params: Sequence[tuple[str, Sequence[int]]],
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


def _device_available(device: Device | str) -> str | None:
    """Why torch cannot train on ``device`` (None: it can)."""
    try:
        return Device.of(device).available()
    except ConfigError as e:
        return str(e)


class TorchTrainer:
    """The fused array trained by PyTorch. Same interface and state names as :class:`FusedTrainer`."""

    name = "torch"

    def __init__(self, fused: onnx.ModelProto, spec: ArraySpec, loss: str | LossSpec, optimizer: OptimizerConfig,
                 device: Device | str = "cpu", workdir: str | None = None, threads: int | None = None):
        import torch

        from onnxfuse.runtime.torch_graph import OnnxModule, TorchOptions

        if optimizer.B != spec.B:
            raise ConfigError(f"optimizer configured for {optimizer.B} models but the array has B={spec.B}")
        device = Device.of(device)
        why = device.available()
        if why is not None:
            raise ConfigError(why)
        if not device.is_cuda:
            # One thread unless asked: torch's OpenMP threads wait for each other at every parallel region, and
            # when another process holds one of the cores a step takes 10-50x as long (measured on a 2-core machine:
            # a demo step 480 ms with 2 threads, 34 ms with 1). A fixed default also keeps results independent of
            # the machine's load (the thread count changes how reductions are split). A process-wide setting.
            torch.set_num_threads(threads or 1)
        elif threads:
            torch.set_num_threads(threads)
        # Denormal floats (weights or moments of a model that stalled) make x86 arithmetic many times slower (a
        # demo step took 20x as long); flushing them to zero changes values only below 1e-38. The ORT runtime sets
        # the same for its sessions. (A process-wide setting in torch.)
        torch.set_flush_denormal(True)
        self.spec, self.opt, self.loss = spec, optimizer, get_loss(loss)
        self.device = device
        self.torch_device = device.torch()
        self.trainable, self.buffers = parameter_names(spec)
        self.steps = 0
        self.last_ok = np.ones(spec.B, dtype=bool)
        weights = {t.name: t for t in fused.graph.initializer}
        missing = [n for n in self.trainable + self.buffers if n not in weights]
        if missing:
            raise ConfigError(f"the fused graph has no initializer '{missing[0]}' that array.json names; re-run "
                              "`onnxfuse fuse`")
        held = self.trainable + self.buffers

        # train graph: fused + loss; training-mode BatchNorms return their new running statistics (torch's rule,
        # computed by torch's own kernel) as outputs 1 and 2, which the update graph writes for the models whose
        # step is accepted
        train = copy.deepcopy(fused)
        self.stats, stat_outputs = _batchnorm_outputs(train, set(self.buffers))
        train, _ = add_loss_pass(train, spec, self.loss)
        options = TorchOptions(update_stats=False)
        self._train = OnnxModule(weights_as_inputs_pass(train, held), trainable=[], buffers=[],
                                 outputs=["loss", "per_model_loss"] + stat_outputs, options=options)
        # eval graph: inference mode + loss (outputs per_model_loss, the model's output)
        self._eval = OnnxModule(weights_as_inputs_pass(inference_loss_pass(fused, spec, self.loss), held),
                                trainable=[], buffers=[]).eval()
        # update graph
        shapes = {n: list(weights[n].dims) for n in held}
        upd, self._writes = update_graph(optimizer, [(p, shapes[p]) for p in self.trainable],
                                         [(s, shapes[s]) for s in self.stats], onnx_opset(fused))
        self._update = OnnxModule(upd, trainable=[], buffers=[])
        for m in (self._train, self._eval, self._update):
            m.to(self.torch_device)

        # the state, held once
        def tensor(name: str) -> torch.Tensor:
            return torch.from_numpy(onnx.numpy_helper.to_array(weights[name]).copy()).to(self.torch_device)

        self.params = {n: torch.nn.Parameter(tensor(n)) for n in self.trainable}
        self.tensors: dict[str, torch.Tensor] = {n: tensor(n) for n in self.buffers}
        P = sum(int(np.prod(shapes[p])) for p in self.trainable) // spec.B
        for s in optimizer.state_names():
            self.tensors[STATE_PREFIX + s] = torch.zeros(spec.B, P, device=self.torch_device)
        self.optimizer_state_names = [STATE_PREFIX + s for s in optimizer.state_names()]
        self.inputs = [i["name"] for i in spec.inputs] + ([LABELS] if self.loss.has_labels else [])

    unavailable = staticmethod(_device_available)

    # ---- steps
    def _feed(self, feeds: dict[str, np.ndarray]) -> dict:
        import torch

        arrays = check_feeds(self.inputs, feeds)
        return {n: (a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))).to(
            self.torch_device, non_blocking=True) for n, a in zip(self.inputs, arrays)}

    def step(self, feeds: dict[str, np.ndarray], values: StepValues | None = None) -> np.ndarray:
        """One training step of every model; returns the per-model losses [B] (see ``FusedTrainer.step``)."""
        import torch

        self.steps += 1
        hyper = torch.from_numpy(self.opt.coefficients(self.steps, values)).to(self.torch_device, non_blocking=True)
        loss, per_model, *stat_values = self._train(**self._feed(feeds), **self.params, **self.tensors)
        params = list(self.params.values())
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        with torch.no_grad():
            inputs = {HYPER_INPUT: hyper, "per_model_loss": per_model.detach()}
            for name, p, g in zip(self.trainable, params, grads):
                inputs[name] = p.detach()
                inputs[f"{name}_grad"] = torch.zeros_like(p) if g is None else g
            for stat, value in zip(self.stats, stat_values):
                inputs[stat] = self.tensors[stat]
                inputs[f"{stat}_new"] = value
            for s in self.optimizer_state_names:
                inputs[s] = self.tensors[s]
            *new, ok = self._update(**inputs)
            targets = [self.params[t] if t in self.params else self.tensors[t] for t in self._writes]
            torch._foreach_copy_(targets, new)
        self.last_ok = ok.reshape(-1).cpu().numpy().astype(bool)
        return per_model.detach().cpu().numpy()

    def eval_batch(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        import torch

        with torch.no_grad():
            per_model, scores = self._eval(**self._feed(feeds), **self.params, **self.tensors)
        return per_model.cpu().numpy(), scores.cpu().numpy()

    def evaluate(self, data: Dataset, batch_size: int = 256) -> dict[str, np.ndarray]:
        """See :func:`training.runtime.evaluate`."""
        return evaluate(self, data, batch_size)

    # ---- state
    def weights(self) -> dict[str, np.ndarray]:
        out = {n: p.detach().cpu().numpy().copy() for n, p in self.params.items()}
        out.update({n: self.tensors[n].cpu().numpy().copy() for n in self.buffers})
        return out

    def optimizer_state(self) -> dict[str, np.ndarray]:
        return {n: self.tensors[n].cpu().numpy().copy() for n in self.optimizer_state_names}

    def load(self, tensors: dict[str, np.ndarray]) -> None:
        import torch

        with torch.no_grad():
            for name, value in tensors.items():
                target = self.params.get(name, self.tensors.get(name))
                if target is None:
                    raise KeyError(f"the array has no tensor '{name}'")
                target.copy_(torch.as_tensor(np.ascontiguousarray(value)).reshape(target.shape))
