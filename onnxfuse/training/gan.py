"""Alternating GAN training of B (generator, discriminator) pairs: model b's generator G_b is trained against model
b's discriminator D_b only, each array with its own per-model optimizer hyper-parameters.

One iteration, per model b, is DCGAN's (with the real and fake halves in one discriminator batch):

    fake_b = G_b(z)                                         (BatchNorm on batch statistics)
    D step: loss_D = BCEWithLogits(D_b([real; fake_b]), [1]*N + [0]*N)   fake_b is a constant here
    G step: loss_G = BCEWithLogits(D_b'(G_b(z)), [1]*N)                  D_b' = D_b after its step, not trained

Three ONNX Runtime sessions do it:

- sampler: the fused generator graph in an InferenceSession, its weights graph inputs fed with the generator
  trainer's live parameters; gives ``fake`` [B, N, ...] without touching BatchNorm running statistics.
- discriminator trainer: a :class:`OrtTrainer` of the discriminator array fused with
  ``per_model_inputs=["input"]``, fed ``[B, 2N, ...]`` (the shared real batch repeated per model, then model b's
  fakes) and the shared labels [1]*N + [0]*N.
- generator trainer: a :class:`OrtTrainer` of one graph, fused G followed by fused D (D's input is G's
  ``[B, N, ...]`` output). D's parameters are graph *inputs* of that graph, fed every step with the
  discriminator trainer's live parameters, so only G's parameters are trained. D's BatchNorm running statistics are
  buffers of this trainer: copied in from the discriminator before the step and back after it, so D's statistics
  move twice per iteration, as torch's do (two training-mode forwards of D).

Costs per iteration beyond the two training steps: one extra forward of G (the sampler; torch reuses the fake of
the D step for the G step), the [B, 2N, ...] discriminator batch assembled on the host, and two copies of D's
BatchNorm running statistics. On CPU, parameters are handed between sessions as numpy views of the live buffers (no
copy). On CUDA, ``CheckpointState`` parameters read back as host copies, so every iteration also copies G's and D's
parameters device -> host -> device (the ONNX Runtime training API exposes no per-parameter device buffer).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxfuse.core._opset import is_training_batchnorm, onnx_opset
from onnxfuse.core.errors import ConfigError, DataError
from onnxfuse.core.weights import ArraySpec, FusedWeight

from onnxfuse.recipe.device import Device
from onnxfuse.recipe.losses import LABELS, get_loss
from onnxfuse.recipe.optim import UpdateRule
from onnxfuse.runtime.ort.trainer import OrtTrainer, check_device

__all__ = ["FusedGAN", "GANStep", "generator_step_graph"]

D_PREFIX = "D/"


@dataclass
class GANStep:
    d_loss: np.ndarray  # [B] discriminator losses (mean over the 2N real and fake images)
    g_loss: np.ndarray  # [B] generator losses


def _rename_graph(graph: onnx.GraphProto, rename) -> None:
    for node in graph.node:
        node.name = rename(node.name) if node.name else node.name
        node.input[:] = [rename(t) if t else t for t in node.input]
        node.output[:] = [rename(t) if t else t for t in node.output]
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise ConfigError(f"discriminator node '{node.name}' ({node.op_type}) has a subgraph; FusedGAN supports "
                              "discriminators without control flow")
    for t in graph.initializer:
        t.name = rename(t.name)
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        vi.name = rename(vi.name)


def generator_step_graph(g_model: onnx.ModelProto, g_spec: ArraySpec, d_model: onnx.ModelProto,
                         d_spec: ArraySpec) -> tuple[onnx.ModelProto, ArraySpec, list[str]]:
    """The generator's training graph: fused G, then fused D on G's output, D's parameters as graph inputs.

    Returns (model, spec, D parameter inputs); every D tensor is renamed ``D/<name>``. The spec's weights are G's
    (trainable) plus D's BatchNorm statistics (buffers); its inputs are G's plus D's parameters."""
    if g_spec.B != d_spec.B:
        raise ConfigError(f"the generator array has B={g_spec.B} models but the discriminator array B={d_spec.B}; "
                          "fuse as many discriminators as generators")
    if len(g_spec.inputs) != 1 or len(g_spec.outputs) != 1 or len(d_spec.inputs) != 1 or len(d_spec.outputs) != 1:
        raise ConfigError("FusedGAN needs a generator and a discriminator with one input and one output each (noise "
                          "-> images -> logits)")
    d_in, g_out = d_spec.inputs[0], g_spec.outputs[0]
    if not d_in.get("per_model"):
        raise ConfigError(f"the discriminator array takes its input '{d_in['name']}' shared by all models; fuse it "
                          f"with per_model_inputs=['{d_in['name']}'] (CLI: --per-model-inputs {d_in['name']}) so that "
                          "each discriminator sees its own generator's images")
    if [d for d in g_out["shape"][1:]] != [d for d in d_in["shape"][1:]]:
        raise ConfigError(f"the generator makes images of shape {g_out['shape']} but the discriminator takes "
                          f"{d_in['shape']}")
    g_names = {t.name for t in g_model.graph.initializer} | {n.name for n in g_model.graph.node}
    g_names |= {t for n in g_model.graph.node for t in list(n.input) + list(n.output)}
    if any(name.startswith(D_PREFIX) for name in g_names):
        raise ConfigError(f"the generator graph has names starting with '{D_PREFIX}'; rename them")

    d = onnx.ModelProto()
    d.CopyFrom(d_model)

    def rename(name: str) -> str:
        return g_out["name"] if name == d_in["name"] else D_PREFIX + name

    _rename_graph(d.graph, rename)
    params, _ = d_spec.parameter_names()
    param_set = {D_PREFIX + n for n in params}
    d_inits = [t for t in d.graph.initializer if t.name not in param_set]
    param_inputs = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                    for t in d.graph.initializer if t.name in param_set]

    m = onnx.ModelProto()
    m.CopyFrom(g_model)
    g = m.graph
    g.node.extend(d.graph.node)
    g.initializer.extend(d_inits)
    g.input.extend(param_inputs)
    g.value_info.extend(d.graph.value_info)
    del g.output[:]
    g.output.extend(d.graph.output)
    g.name = "generator_step"

    weights = dict(g_spec.weights)
    for n in d_spec.parameter_names()[1]:  # D's buffers: state of the generator step too, under D/ names
        w = d_spec.weights[n]
        weights[D_PREFIX + n] = FusedWeight(D_PREFIX + n, w.slot, w.orig_shape, w.dtype, w.role, w.sources, w.extra)
    out = dict(d_spec.outputs[0], name=D_PREFIX + d_spec.outputs[0]["name"])
    spec = ArraySpec(
        B=g_spec.B, sources=list(g_spec.sources),
        inputs=list(g_spec.inputs) + [{"name": vi.name, "shape": [d.dim_value for d in vi.type.tensor_type.shape.dim],
                                       "dtype": "float32", "per_model": False} for vi in param_inputs],
        outputs=[out], weights=weights, extra_state=list(g_spec.extra_state), summary={})
    return m, spec, [vi.name for vi in param_inputs]


def _sampler_graph(model: onnx.ModelProto, spec: ArraySpec) -> tuple[onnx.ModelProto, list[str]]:
    """The fused generator with its parameters as graph inputs; returns (model, those inputs).

    BatchNorm stays in training mode (batch statistics). Its running-statistic inputs become zero constants of
    this graph: ONNX Runtime computes the running-statistic outputs in place of those inputs, and a graph input
    fed with a live view of the trainer's buffer would be overwritten."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    by_name = {t.name: t for t in g.initializer}
    opset = onnx_opset(m)
    for k, node in enumerate(g.node):
        if is_training_batchnorm(node, opset):
            for j in (3, 4):
                dummy = f"sampler_dummy_stat_{k}_{j}"
                g.initializer.append(numpy_helper.from_array(np.zeros(by_name[node.input[j]].dims, np.float32), dummy))
                node.input[j] = dummy
    used = {t for n in g.node for t in n.input}
    params = [t for t in g.initializer if t.name in spec.weights and t.name in used]
    keep = [t for t in g.initializer if t.name not in spec.weights]
    g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in params)
    del g.initializer[:]
    g.initializer.extend(keep)
    return m, [t.name for t in params]


class FusedGAN:
    """B generators and B discriminators trained alternately, pair b with pair b (see the module docstring).

    ``generator`` and ``discriminator`` are fused arrays (anything with ``.model`` and ``.spec``, e.g.
    ``fuse_models(...)``); the discriminator must be fused with ``per_model_inputs=["input"]``. ``g_optimizer`` and
    ``d_optimizer`` give each model its own hyper-parameters, e.g.
    ``make_optimizer("adamw", B, lr=[2e-4, 1e-3], betas=(0.5, 0.999), weight_decay=0)`` (Adam)."""

    def __init__(self, generator, discriminator, g_optimizer: UpdateRule, d_optimizer: UpdateRule,
                 device: Device | str = "cpu", workdir: str | None = None, threads: int | None = None):
        import onnxruntime

        self.device = check_device(device)
        self.g_spec, self.d_spec = generator.spec, discriminator.spec
        self.B = self.g_spec.B
        if workdir is None:
            workdir = tempfile.mkdtemp(prefix="onnxfuse-gan-")
            weakref.finalize(self, shutil.rmtree, workdir, True)
        step_model, step_spec, self.d_param_inputs = generator_step_graph(generator.model, self.g_spec,
                                                                          discriminator.model, self.d_spec)
        # (build_artifacts legalizes both graphs: e.g. the generator's ConvTranspose has no CPU gradient kernel)
        bce = get_loss("bce-with-logits")
        self.d_trainer = OrtTrainer(discriminator.model, self.d_spec, bce, d_optimizer, self.device,
                                      os.path.join(workdir, "discriminator"), threads)
        self.g_trainer = OrtTrainer(step_model, step_spec, bce, g_optimizer, self.device,
                                      os.path.join(workdir, "generator"), threads)
        # D's BatchNorm statistics: buffers of both trainers (the generator step's under D/ names)
        _, self.d_stats = self.d_spec.parameter_names()
        so = onnxruntime.SessionOptions()
        so.log_severity_level = 3
        # ORT 1.19's Conv+BatchNorm fusion ignores training_mode: keep the graph as it is
        so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        if threads:
            so.intra_op_num_threads = threads
        sampler, self.sampler_params = _sampler_graph(generator.model, self.g_spec)
        self.sampler = onnxruntime.InferenceSession(sampler.SerializeToString(), so,
                                                    providers=self.device.ort_providers())
        self.z_input = self.g_spec.inputs[0]
        self.iterations = 0

    # ---- data checks
    def _check(self, name: str, a: np.ndarray, want: list, per_model: bool) -> np.ndarray:
        a = np.asarray(a, np.float32)
        lead = [self.B] if per_model else []
        ok = a.ndim == len(lead) + len(want) and list(a.shape[:len(lead)]) == lead and all(
            not isinstance(d, int) or d == s for d, s in zip(want[1:], a.shape[len(lead) + 1:]))
        if not ok:
            dims = ", ".join([str(d) for d in lead] + ["N"] + [str(d) for d in want[1:]])
            raise DataError(f"{name} has shape {list(a.shape)} but the array expects [{dims}]"
                            + (" (one slice per model)" if per_model else ""))
        return np.ascontiguousarray(a)

    def _z(self, z: np.ndarray) -> np.ndarray:
        return self._check("z", z, self.z_input["shape"], bool(self.z_input.get("per_model")))

    # ---- the three steps
    def generate(self, z: np.ndarray) -> np.ndarray:
        """Every generator's images for noise ``z`` ([N, nz, ...] shared, or [B, N, ...] when the generator array
        was fused with a per-model input): [B, N, ...], BatchNorm on batch statistics (training mode), running
        statistics untouched."""
        z = self._z(z)
        state = self.g_trainer.state.parameters
        feeds = {self.z_input["name"]: z}
        feeds.update({n: state[n].data for n in self.sampler_params})
        return self.sampler.run(None, feeds)[0]

    def _copy_stats(self, src: OrtTrainer, dst: OrtTrainer, src_prefix: str, dst_prefix: str) -> None:
        for n in self.d_stats:
            dst.state.parameters[dst_prefix + n] = src.state.parameters[src_prefix + n].data

    def step(self, z: np.ndarray, real: np.ndarray) -> GANStep:
        """One iteration for every pair: a discriminator step on [real; G_b(z)], then a generator step against the
        updated discriminator. ``real`` is [N, ...] (shared) or [B, N, ...]."""
        z = self._z(z)
        fake = self.generate(z)  # [B, N, ...]
        d_in = self.d_spec.inputs[0]
        real = np.asarray(real, np.float32)
        real = self._check("real", real, d_in["shape"], per_model=real.ndim == len(d_in["shape"]) + 1)
        N = fake.shape[1]
        if real.shape[-len(d_in["shape"])] != N:
            raise DataError(f"real has {real.shape[-len(d_in['shape'])]} images but z gives {N} fakes; use equal "
                            "batches")
        d_batch = np.concatenate([np.broadcast_to(real, fake.shape), fake], axis=1)  # [B, 2N, ...]
        out_tail = list(self.d_spec.outputs[0]["shape"][1:])
        d_labels = np.concatenate([np.ones([N] + out_tail, np.float32), np.zeros([N] + out_tail, np.float32)])
        d_loss = self.d_trainer.step({d_in["name"]: d_batch, LABELS: d_labels})

        self._copy_stats(self.d_trainer, self.g_trainer, "", D_PREFIX)
        live = self.d_trainer.state.parameters
        feeds = {self.z_input["name"]: z, LABELS: np.ones([N] + out_tail, np.float32)}
        feeds.update({name: live[name[len(D_PREFIX):]].data for name in self.d_param_inputs})
        g_loss = self.g_trainer.step(feeds)
        self._copy_stats(self.g_trainer, self.d_trainer, D_PREFIX, "")
        self.iterations += 1
        return GANStep(d_loss=d_loss, g_loss=g_loss)

    # ---- results
    def generator_weights(self) -> dict[str, np.ndarray]:
        """Copies of the fused generator weights, by fused name (for ``split_weights(generator.spec, ...)``)."""
        return {n: self.g_trainer.state.parameters[n].data.copy() for n in self.g_spec.weights}

    def discriminator_weights(self) -> dict[str, np.ndarray]:
        return self.d_trainer.weights()

    def split(self) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
        """(B generator state_dicts, B discriminator state_dicts). BatchNorm counters advance as torch's: once per
        iteration in G, twice in D (its D-step and G-step forwards)."""
        from onnxfuse.core.split import split_weights

        return (split_weights(self.g_spec, self.generator_weights(), steps=self.iterations),
                split_weights(self.d_spec, self.discriminator_weights(), steps=2 * self.iterations))
