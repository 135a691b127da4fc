"""Fusion forms chosen by measurement: the ``auto`` fusion strategy.

Some rules can emit a node in several forms that compute the same thing with the same weight layout (``Rule.forms``:
a convolution as one grouped Conv, or as B Convs on Split blocks). Which is faster depends on the runtime, the device
and the node's shapes: on this repository's 2-core CPU, torch's grouped NCHW convolution took 1.6x the time of the
same FLOPs as one dense convolution for LeNet's second layer, B per-model convolutions 1.0x.

The cost model is a table of measurements. For each node that offers several forms, the B aligned nodes are cut out
as B one-node models (their own weights, the batch dimension set to ``batch``; a per-model input enters through a
trainable scale, so that the backward computes the input's gradient as it does inside a network), fused in each form
and trained for a few steps on the target runtime and device (warm-up excluded, forms interleaved, median). The
cost of a form is its step time; the strategy picks the cheapest. Every (runtime, device, node signature, B, batch)
is measured once and cached in ``$ONNXFUSE_CACHE_DIR/forms.json`` (default ``~/.cache/onnxfuse``), keyed by the
device's name, the thread count and the library versions, so re-fusing the same model costs nothing.

Forms within ``margin`` (5 %) of the default form's cost keep the default: a measured tie is noise.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
from typing import TYPE_CHECKING, Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core._io import atomic_write_bytes
from onnxfuse.runtime._machine import cpu_isa, cpu_model
from onnxfuse.core.errors import ConfigError
from onnxfuse.recipe.device import Device

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup, Strategy

__all__ = ["measured_strategy", "make_strategy", "STRATEGY_CHOICES", "measure_forms", "cache_path"]

_CACHE_ENV = "ONNXFUSE_CACHE_DIR"


def _choices() -> tuple[str, ...]:
    from onnxfuse.core.passes import FORMS

    return ("default", "auto") + FORMS


STRATEGY_CHOICES = _choices()


def cache_path() -> str:
    root = os.environ.get(_CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "onnxfuse")
    return os.path.join(root, "forms.json")


def _device_key(runtime: str, device: Device, threads: int) -> str:
    """What a measurement depends on besides the node: the runtime and its version, the device's name (a CPU's
    with the instruction set torch dispatches to), threads."""
    import torch

    if device.is_cuda:
        name = torch.cuda.get_device_name(device.torch())
    else:
        name = f"{cpu_model()} ({cpu_isa()})"  # another instruction set's kernels are other kernels
    version = torch.__version__
    if runtime == "ort":
        import onnxruntime

        version = onnxruntime.__version__
    return f"{runtime} {version} | {name} | {os.cpu_count()} cpus | {threads} threads"


def _concrete(shape, batch: int, batch_dims: set[str] = frozenset()) -> list[int] | None:
    """A tensor shape with its batch dimension (the first if symbolic, and any named as one of ``batch_dims``, the
    graph inputs' batch: a recurrent op's X [T, N, I]) set to ``batch``; None if another is unknown."""
    if shape is None:
        return None
    out = [batch if (k == 0 and not isinstance(d, int)) or (isinstance(d, str) and d in batch_dims) else d
           for k, d in enumerate(shape)]
    return out if all(isinstance(d, int) and d > 0 for d in out) else None


def _standalone(g: "NodeGroup", batch: int) -> tuple[list[onnx.ModelProto], list[str], dict, list[int]] | None:
    """The B aligned nodes as B one-node models: (models, per-model input names, input shapes, output shape), or
    None when the node cannot be measured alone (an input that is neither a weight nor a float activation of
    known shape)."""
    node = g.node
    out_shape = _concrete(g.output_shape(0), batch, g.batch_dims)
    if out_shape is None:
        return None
    inputs, per_model, shapes, pre = [], [], {}, []
    names = []
    for i, t in enumerate(node.input):
        if not t or g.is_weight(i):
            names.append(t)
            continue
        shape = _concrete(g.input_shape(i), batch, g.batch_dims)
        if shape is None or g.const(i) is not None:
            return None
        x = f"x{i}"
        inputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, shape))
        shapes[x] = shape
        if g.is_shared(i):
            names.append(x)
        else:  # the activation of a network: its gradient is computed too
            per_model.append(x)
            pre.append(helper.make_node("Mul", [x, f"scale{i}"], [f"scaled{i}"]))
            names.append(f"scaled{i}")
    models = []
    for b, nb in enumerate(g.nodes):
        inits = [numpy_helper.from_array(np.ones([1], np.float32), f"scale{i}")
                 for i, t in enumerate(node.input) if t and not g.is_weight(i) and not g.is_shared(i)]
        inits += [numpy_helper.from_array(g.weight_arrays(i)[b], t) for i, t in enumerate(node.input)
                  if t and g.is_weight(i)]
        one = helper.make_node(node.op_type, names, ["y"], domain=nb.domain)
        one.attribute.extend(nb.attribute)
        graph = helper.make_graph(pre + [one], "node", inputs,
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
        models.append(helper.make_model(graph, opset_imports=[helper.make_opsetid("", g.opset)]))
    return models, per_model, shapes, out_shape


def _signature(g: "NodeGroup", batch: int) -> str:
    """The node as the cost model sees it: op, attributes, input shapes, which inputs are weights / shared, B."""
    parts = [g.op_type, str(g.B), str(batch)]
    parts += [f"{a.name}={helper.get_attribute_value(a)!r}" for a in sorted(g.node.attribute, key=lambda a: a.name)]
    for i, t in enumerate(g.node.input):
        kind = "-" if not t else "w" if g.is_weight(i) else "s" if g.is_shared(i) else "x"
        parts.append(f"{kind}{g.input_shape(i) if t else ''}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16] + " " + "|".join(parts[:3])


def measure_forms(models: list[onnx.ModelProto], per_model: list[str], shapes: dict, out_shape: list[int],
                  forms: tuple[str, ...], runtime: str, device: Device | str, threads: int = 0, steps: int = 5,
                  rounds: int = 5, warmup: int = 2, compile: str = "off") -> dict[str, float]:
    """Median seconds of one training step of the one-node ``models`` fused in each form, forms interleaved;
    ``compile="on"``: each form's step as the compiled runtime runs it (its compile is not timed)."""
    import torch

    from onnxfuse.core.passes import fuse_models

    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.trainers import make_trainer
    from onnxfuse.measure.workloads import interleaved_rounds

    B = len(models)
    gen = np.random.default_rng(0)
    feeds = {x: gen.standard_normal(([B] if x in per_model else []) + shapes[x]).astype(np.float32)
             for x in shapes}
    feeds["labels"] = np.zeros(out_shape, np.float32)
    device = Device.of(device)
    if runtime == "torch":
        feeds = {k: torch.from_numpy(v).to(device.torch()) for k, v in feeds.items()}
    steppers = {}
    with tempfile.TemporaryDirectory(prefix="onnxfuse-forms-") as work:
        for form in forms:
            fa = fuse_models(models, labels=[f"model_{b}" for b in range(B)], per_model_inputs=per_model,
                             strategy=form)
            trainer = make_trainer(runtime, fa.model, fa.spec, "mse", make_optimizer("sgd", B, lr=0.0),
                                   device=device, workdir=os.path.join(work, form), threads=threads or None,
                                   compile=compile)
            steppers[form] = trainer
            for _ in range(warmup):
                trainer.step(feeds)
        # the losses each step returns are on the host: the step has finished
        times = interleaved_rounds({f: (lambda t=t: t.step(feeds)) for f, t in steppers.items()}, rounds, steps)
    return {f: statistics.median(v) / steps for f, v in times.items()}


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _save(path: str, key: str, entries: dict) -> None:
    """Merge ``entries`` into the cache under ``key`` (re-read first: another process may have written)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = _load(path)
    data.setdefault(key, {}).update(entries)
    atomic_write_bytes(path, json.dumps(data, indent=1, sort_keys=True).encode())


def measured_strategy(runtime: str = "auto", device: Device | str = "cpu", batch: int = 32, threads: int = 0,
                      margin: float = 0.05, cache: bool = True,
                      progress: Callable[[str], None] | None = None, compile: str = "off") -> "Strategy":
    """The ``auto`` strategy: per node, the form whose measured step on ``runtime``/``device`` at ``batch`` samples
    per model is cheapest (see the module docstring). ``strategy.costs`` holds, per node, each form's seconds.
    ``compile="on"``: the forms are measured compiled (``--compile on``: inductor fuses each form differently),
    cached apart from the eager measurements."""
    from onnxfuse.runtime.trainers import resolve_runtime

    if batch < 1:
        raise ConfigError(f"batch: must be at least 1 for the auto strategy, got {batch}")
    device = Device.of(device, "device: ")
    runtime = resolve_runtime(runtime, device)
    key = _device_key(runtime, device, threads) + (" compiled" if compile == "on" and runtime == "torch" else "")
    path = cache_path()
    known = _load(path).get(key, {}) if cache else {}
    say = progress or (lambda msg: None)

    def strategy(g: "NodeGroup", forms: tuple[str, ...]) -> str:
        sig = _signature(g, batch)
        cost = known.get(sig)
        if cost is None or set(cost) != set(forms):
            cut = _standalone(g, batch)
            if cut is None:
                say(f"{g.name} ({g.op_type}): not measurable alone (unknown shapes), form {forms[0]}")
                return forms[0]
            watch = Stopwatch()
            cost = measure_forms(*cut, forms, runtime, device, threads,
                                 compile=compile if runtime == "torch" else "off")
            known[sig] = cost
            if cache:
                _save(path, key, {sig: cost})
            say(f"{g.name} ({g.op_type}): measured " + ", ".join(f"{f} {c * 1e3:.2f} ms" for f, c in cost.items())
                + f" in {watch.seconds:.1f} s")
        best = min(forms, key=lambda f: cost[f])
        choice = best if cost[best] < (1 - margin) * cost[forms[0]] else forms[0]
        strategy.costs[g.name] = cost
        return choice

    strategy.costs = {}
    return strategy


def make_strategy(name: str, runtime: str = "auto", device: Device | str = "cpu", batch: int = 32, threads: int = 0,
                  progress: Callable[[str], None] | None = None, compile: str = "off") -> "str | Strategy":
    """What ``--strategy NAME`` means: ``auto`` measures (:func:`measured_strategy`; ``compile="on"``: the forms'
    compiled steps); ``default`` or a form name is passed to ``fuse_models`` as it is."""
    if name not in STRATEGY_CHOICES:
        raise ConfigError(f"strategy: unknown strategy '{name}'; choose one of: {', '.join(STRATEGY_CHOICES)}")
    if name == "auto":
        return measured_strategy(runtime, device, batch, threads, progress=progress, compile=compile)
    return name
