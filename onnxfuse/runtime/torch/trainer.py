"""The PyTorch runtime: the fused ONNX graph trained by torch autograd, on any device torch supports.

The trainer is a :class:`~onnxfuse.runtime.torch.array_module.FusedArray` (the array as a torch module: the fused
weights as its parameters and buffers, held once) and its ``onnxfuse.optim`` optimizer, the same objects a user's
own loop trains, with two programs over the array's weights, built by the same passes the ONNX Runtime runtime
uses and converted to torch (``torch_graph``); none of the training maths is written twice:

    train    the fused graph + the per-model loss (``add_loss_pass``): outputs loss, per_model_loss and every
             training-mode BatchNorm's new running statistics (torch's own kernel and rule), which the optimizer
             writes for the models whose step it applies
    eval     the fused graph in inference mode (``to_inference``) + the per-model loss

A step is: forward, ``backward`` of the summed loss (each model's gradient is its own: the models share no
weight), and the optimizer's step (``UpdateRule.append_update`` as a graph: clipping, SGD / Adam / AdamW,
fault isolation) — a few dozen kernels for all B models together, no host transfer but the batch in and the B
losses out.
"""
from __future__ import annotations

import copy
import logging

import numpy as np
import onnx

from onnxfuse.core.errors import ConfigError
from onnxfuse.core.passes import FusedGraph
from onnxfuse.core.split import to_inference
from onnxfuse.core.weights import ArraySpec
from onnxfuse.runtime.graph_passes import add_loss_pass, inference_loss_pass
from onnxfuse.recipe.data import Dataset
from onnxfuse.recipe.device import CPU, Device
from onnxfuse.recipe.losses import LABELS, LossSpec, PythonLoss, get_loss
from onnxfuse.recipe.optim import STATE_PREFIX, StepValues, UpdateRule
from onnxfuse.recipe.runtimes import LossScale
from onnxfuse.runtime.protocol import check_feeds, evaluate, parameter_names

__all__ = ["TorchTrainer"]

log = logging.getLogger("onnxfuse.train")


def _device_available(device: Device | str) -> str | None:
    """Why torch cannot train on ``device`` (None: it can)."""
    try:
        return Device.of(device).available()
    except ConfigError as e:
        return str(e)


class TorchTrainer:
    """The fused array trained by PyTorch. Same interface and state names as :class:`OrtTrainer`; ``array`` and
    ``optimizer`` are the FusedArray and ``onnxfuse.optim`` optimizer it trains. Its device, precision and compile
    mode were checked where they were given (``trainers.make_trainer``, a run's ``RunSettings``): none is checked
    here again."""

    name = "torch"

    def __init__(self, fused: onnx.ModelProto, spec: ArraySpec, loss: str | LossSpec, optimizer: UpdateRule,
                 device: Device = CPU, workdir: str | None = None, threads: int | None = None,
                 compile: str = "off", total_steps: int = 0, precision: str = "fp32",
                 loss_scale: LossScale | None = None, seed: int = 0,
                 one_model: tuple[onnx.ModelProto, ArraySpec] | None = None):
        import torch

        from onnxfuse.runtime.torch.array_module import FusedArray
        from onnxfuse.runtime.torch.program import TorchOptions
        from onnxfuse.runtime.torch.optimizers import from_config
        from onnxfuse.runtime.torch.train_step import TrainStep, batchnorm_outputs, graph_key

        if optimizer.B != spec.B:
            raise ConfigError(f"optimizer configured for {optimizer.B} models but the array has B={spec.B}")
        if threads:  # asked (a run's threads setting); the process's other settings: runtime/process.py
            torch.set_num_threads(threads)
        self.spec, self._opt, self.loss = spec, optimizer, get_loss(loss)
        self.device = device
        self.torch_device = device.torch()
        self.trainable, self.buffers = parameter_names(spec)
        self.last_ok = np.ones(spec.B, dtype=bool)
        weights = {t.name for t in fused.graph.initializer}
        missing = [n for n in self.trainable + self.buffers if n not in weights]
        if missing:
            raise ConfigError(f"the fused graph has no initializer '{missing[0]}' that array.json names; re-run "
                              "`onnxfuse fuse`")
        self.array = FusedArray(FusedGraph(fused, spec, []), lazy=True).to(self.torch_device)
        self.optimizer = from_config(self.array, optimizer)

        # train graph: fused + loss; training-mode BatchNorms return their new running statistics (torch's rule,
        # computed by torch's own kernel) as outputs 1 and 2, which the optimizer writes for the models whose step
        # it applies
        if precision != "fp32":  # each model's arithmetic alone under autocast (a Linear's bias in its product, ...)
            from onnxfuse.runtime.torch.precision import autocast_graph

            fused = autocast_graph(fused, sum(spec.parameter_names(), []))
        train = copy.deepcopy(fused)
        self.stats, stat_outputs = batchnorm_outputs(train, set(self.buffers))
        self.graph_inputs = [i["name"] for i in spec.inputs]
        self.python = self.loss if isinstance(self.loss, PythonLoss) else None
        options = TorchOptions(update_stats=False)
        if self.python is None:
            from onnxfuse.runtime.torch.precision import loss_in_fp32

            # in bf16 / fp16 the loss reads the output in float32, as torch.autocast runs its losses
            wide = (lambda m: m) if precision == "fp32" else (lambda m: loss_in_fp32(m, spec.outputs[0]["name"]))
            self._train = self._loss_program(train, spec, stat_outputs, wide, options)
            self._one = self._one_model(one_model, precision, wide, options) if one_model is not None else None
            # eval graph: inference mode + loss (outputs per_model_loss, the model's output)
            self._eval = self.array.program(wide(inference_loss_pass(fused, spec, self.loss))).eval()
            self.inputs = self.graph_inputs + ([LABELS] if self.loss.has_labels else [])
        else:  # the graph's output; the Python function computes the per-model losses from it
            self._one = None  # the function reads the B models' output at once
            output = spec.outputs[0]["name"]
            self._train = self.array.program(train, outputs=[output] + stat_outputs, options=options)
            self._eval = self.array.program(to_inference(copy.deepcopy(fused)), outputs=[output]).eval()
            self.inputs = self.graph_inputs
        # random nodes with a seed (each model's own, from the fusion) mix in the run's seed (RandomStreams)
        for program in (self._train, self._eval):
            program.onnx.random_streams.base = seed
        self.optimizer_state_names = [STATE_PREFIX + s for s in optimizer.state_names()]
        # the workload whose compile and step times are recorded by every mode that compiles (on, auto), and read
        # by auto (train_step.record_key adds the batch's shapes and this machine)
        key = graph_key(fused.SerializeToString(), self.loss.label if self.python else repr(self.loss), optimizer.kind,
                        str(device), precision) if compile != "off" else ""
        self.compile, self.precision = compile, precision
        self.stepper = TrainStep(self.optimizer, self._loss_forward, self.stats, compile, key, total_steps,
                                 precision, loss_scale, self._one)
        self._eval_compiled = None

    unavailable = staticmethod(_device_available)

    def _one_model(self, one: tuple[onnx.ModelProto, ArraySpec], precision: str, wide, options):
        """The model-by-model form's graph (``TrainStep.FORMS``): ``one``, a one-model array of the same graph (model
        0 fused alone), as a loss program over one model's blocks of this array's weights; None (the form is not
        offered, said at debug level) where its weights are not laid out as this array's are, the graph draws at
        random (each model's seed is in the B-model graph only) or its BatchNorm statistics are not the array's."""
        from onnxfuse.runtime.torch.kernels._base import RANDOM_OPS
        from onnxfuse.runtime.torch.train_step import OneModel, batchnorm_outputs

        model, spec = one

        def layout(of: ArraySpec) -> dict:
            return {n: (w.slot, w.role) for n, w in of.weights.items()}

        why = ("its weights are laid out otherwise" if layout(spec) != layout(self.spec)
               else "the graph draws at random" if any(n.op_type in RANDOM_OPS for n in model.graph.node) else None)
        if why is None:
            train = copy.deepcopy(model)
            if precision != "fp32":
                from onnxfuse.runtime.torch.precision import autocast_graph

                train = autocast_graph(train, sum(spec.parameter_names(), []))
            stats, stat_outputs = batchnorm_outputs(train, set(self.buffers))
            why = "its BatchNorm statistics differ" if stats != self.stats else None
        if why is not None:
            log.debug("no model-by-model form of the step: the one-model graph does not match the array (%s)", why)
            return None
        program = self._loss_program(train, spec, stat_outputs, wide, options)
        per_model = {i["name"] for i in spec.inputs if i.get("per_model")} | (
            {LABELS} if self.loss.per_model_labels else set())
        return OneModel(lambda weights, batch: self._loss_forward(weights, batch, program), frozenset(per_model))

    def _loss_program(self, train: onnx.ModelProto, spec: ArraySpec, stat_outputs: list[str], wide, options):
        """``train`` (an array's training graph, edited: ``spec``'s) with its per-model loss, as a program over
        this array's weights returning the summed loss, the per-model losses and ``stat_outputs``; ``wide``: the
        loss read in float32 (reduced precision)."""
        from onnxfuse.runtime.torch.array_module import ArrayProgram, keep_padding_rows

        train, _ = add_loss_pass(train, spec, self.loss)
        return ArrayProgram(self.array, keep_padding_rows(wide(train), spec), ["loss", "per_model_loss"] + stat_outputs,
                            options)

    @property
    def opt(self) -> UpdateRule:
        """The per-model configuration; setting one (verification's model alone) sets the optimizer's groups."""
        return self._opt

    @opt.setter
    def opt(self, config: UpdateRule) -> None:
        self._opt = config
        self.optimizer.set_config(config)

    @property
    def compiled(self) -> bool | None:
        """Whether the step is captured (None: ``auto`` has not decided yet)."""
        decision = self.stepper.decision
        return None if decision is None else decision.compile

    @compiled.setter
    def compiled(self, value: bool) -> None:
        """Take a decision made before (a resumed run's, the array's before halving re-fused it)."""
        from onnxfuse.runtime.torch.train_step import Decision

        self.stepper.decision = Decision(bool(value), "the run's decision before")

    @property
    def steps(self) -> int:
        """The optimizer steps taken (the optimizer's count, which its coefficients use)."""
        return self.optimizer.state["step"]

    @steps.setter
    def steps(self, value: int) -> None:
        """The state is now at optimizer step ``value`` (a resume, a restored state): every model steps again."""
        self.optimizer.state["step"] = int(value)
        self.stepper.restart()

    # ---- steps
    def _feed(self, feeds: dict[str, np.ndarray]) -> dict:
        """The step's tensors on the device: what the graph reads (and the labels), or for a Python loss every
        array of the batch (the function reads any of them)."""
        import torch

        names = self.inputs if self.python is None else self.inputs + [n for n in feeds if n not in self.inputs]
        arrays = check_feeds(names, feeds)
        pin = self.torch_device.type == "cuda"  # from pinned memory the copy is queued, not waited for
        out = {}
        for n, a in zip(names, arrays):
            t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))
            if pin and t.device.type == "cpu":
                t = t.pin_memory()
            out[n] = t.to(self.torch_device, non_blocking=True)
        return out

    def _forward(self, program, batch: dict, weights: dict | None = None) -> tuple:
        """(summed loss, per-model losses [B], the rest of the program's outputs); ``weights``: the fused tensors
        to run with (the step's, which it differentiates), else the array's."""
        run = program if weights is None else (lambda **f: program.onnx(**f, **weights))
        if self.python is None:
            loss, per_model, *rest = run(**{n: batch[n] for n in self.inputs})
            return loss, per_model, rest
        output, *rest = run(**{n: batch[n] for n in self.graph_inputs})
        per_model = self.python.fn(output, batch)
        B = self.spec.B
        if not hasattr(per_model, "shape") or tuple(per_model.shape) != (B,):
            shape = list(per_model.shape) if hasattr(per_model, "shape") else type(per_model).__name__
            raise ConfigError(f"loss {self.python.label} returned {shape}; it must return one loss per model, a "
                              f"tensor of shape [{B}] (the output it reads is [{B}, N, ...])")
        return per_model.sum(), per_model, [output] + rest

    def _loss_forward(self, weights: dict, batch: dict, program=None) -> tuple:
        """The step's forward (``TrainStep``): loss, per-model losses and the new BatchNorm statistics (``program``:
        another loss program than the array's, the model-by-model form's)."""
        loss, per_model, rest = self._forward(self._train if program is None else program, batch, weights)
        return loss, per_model, rest[1:] if self.python is not None else rest

    def launch(self, feeds: dict[str, np.ndarray], values: StepValues | None = None, ahead=None) -> None:
        """One training step of every model, with no host read (``observe`` reads its results). ``ahead``: see
        ``TrainStep.__call__``."""
        values = values if values is not None else self.opt.constant_values()
        self.optimizer.set_step_values(values)
        self.stepper(self._feed(feeds), values, ahead)

    def observe(self):
        """The last step's per-model losses, which models' steps were applied (``last_ok``) and the optimizer step
        at which each model was first rejected (0: never), read from the device."""
        seen = self.stepper.observe()
        self.last_ok = seen.ok.astype(bool)
        return seen

    def step(self, feeds: dict[str, np.ndarray], values: StepValues | None = None) -> np.ndarray:
        """One training step of every model; returns the per-model losses [B] (see ``OrtTrainer.step``)."""
        self.launch(feeds, values)
        return self.observe().losses

    def eval_batch(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        import torch

        with torch.no_grad():
            per_model, scores = self._eval_step()(self._feed(feeds))
        return per_model.float().cpu().numpy(), scores.float().cpu().numpy()

    def _eval_batch(self, batch: dict) -> tuple:
        """In the training step's precision (bf16, fp16: under the same autocast)."""
        from onnxfuse.runtime.torch.precision import autocast

        with autocast(self.precision, self.torch_device):
            if self.python is None:
                return self._eval(**batch)
            _, per_model, (scores,) = self._forward(self._eval, batch)
        return per_model, scores

    def _eval_step(self):
        """The eval step: captured too when the training step is (its own graph; a batch of another shape than
        the first, the last partial one, runs eagerly)."""
        decision = self.stepper.decision
        if decision is None or not decision.compile:
            return self._eval_batch
        if self._eval_compiled is None:
            from onnxfuse.runtime.torch.train_step import batch_shapes, compiled as compile_method

            compiled, first = compile_method(self._eval_batch), {}

            def run(batch: dict):
                shapes = batch_shapes(batch)
                first.setdefault("shapes", shapes)
                return compiled(batch) if shapes == first["shapes"] else self._eval_batch(batch)
            self._eval_compiled = run
        return self._eval_compiled

    def evaluate(self, data: Dataset, batch_size: int = 256) -> dict[str, np.ndarray]:
        """See :func:`training.runtime.evaluate`."""
        return evaluate(self, data, batch_size)

    # ---- state
    def loss_scales(self) -> dict | None:
        """fp16: each model's loss scale and steps since its last overflow (``{"scale": [B], "tracker": [B]}``,
        what a checkpoint records); None in another precision."""
        scaler = self.stepper.scaler
        return None if scaler is None else scaler.state()

    def load_loss_scales(self, state: dict, keep=None) -> None:
        """Set what :meth:`loss_scales` returned (``keep``: this array's models' positions in it)."""
        if self.stepper.scaler is not None:
            self.stepper.scaler.load(state, keep)

    def random_state(self) -> dict:
        """Where each random node's generator is (training and evaluation programs), as text a checkpoint records:
        a resumed run draws what the uninterrupted one would."""
        import base64

        return {name: {label: base64.b64encode(t.numpy().tobytes()).decode() for label, t in
                       program.onnx.random_streams.state().items()}
                for name, program in (("train", self._train), ("eval", self._eval))}

    def load_random_state(self, state: dict) -> None:
        """Put back what :meth:`random_state` returned."""
        import base64

        import torch

        for name, program in (("train", self._train), ("eval", self._eval)):
            program.onnx.random_streams.load({
                label: torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
                for label, text in (state.get(name) or {}).items()})

    def weights(self) -> dict[str, np.ndarray]:
        return {n: t.detach().cpu().numpy().copy() for n, t in self.array.onnx_state().items()}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        self.optimizer.ensure_state(self.opt.state_names())
        return {STATE_PREFIX + s: self.optimizer.state[s].cpu().numpy().copy() for s in self.opt.state_names()}

    def load(self, tensors: dict[str, np.ndarray]) -> None:
        import torch

        self.optimizer.ensure_state(self.opt.state_names())
        state = self.array.onnx_state()
        with torch.no_grad():
            for name, value in tensors.items():
                if name in state:
                    target = state[name]
                elif name.startswith(STATE_PREFIX) and name[len(STATE_PREFIX):] in self.optimizer.state:
                    target = self.optimizer.state[name[len(STATE_PREFIX):]]
                else:
                    raise KeyError(f"the array has no tensor '{name}'")
                target.copy_(torch.as_tensor(np.ascontiguousarray(value)).reshape(target.shape))
