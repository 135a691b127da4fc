"""What the benchmarks train (`onnxfuse bench`, `onnxfuse plan`, the `auto` fusion strategy, benchmarks/) and how
they time it: B zoo models with their export and a random batch of their task, or an ONNX file, checked once, with
B perturbed copies of its weights and a batch; rounds that alternate what they compare."""
from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass
from typing import Callable, Collection, Hashable, Mapping

import numpy as np

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core.errors import ConfigError

__all__ = ["zoo_module", "zoo_modules", "zoo_batch", "zoo_protos", "OnnxFile", "is_onnx_file", "load_onnx_file",
           "file_protos", "file_batch", "interleaved_rounds"]


def interleaved_rounds(steppers: Mapping[Hashable, Callable[[], object]], rounds: int, steps: int,
                       sync: Callable[[], None] = lambda: None, before: Callable[[Hashable], None] | None = None,
                       after: Callable[[Hashable], None] | None = None, each_step: bool = False,
                       runs_steps: Collection[Hashable] = ()) -> dict[Hashable, list[float]]:
    """Seconds that ``steps`` calls of each stepper take, one entry per round (``each_step``: every call timed
    alone, ``steps`` entries per round). Every other round runs the steppers in reverse order, so that none always
    runs first on a machine whose speed drifts; ``sync`` waits for queued device work before and after each timing
    (the one after inside it); ``before``/``after`` run around a stepper's turn (e.g. a memory peak's reset and
    reading), untimed. A stepper whose key is in ``runs_steps`` takes the count and runs that many steps itself,
    called once per timing (e.g. B processes that each run their steps at once). The benchmarks', array sizing's and
    the measured forms' one timing loop."""
    keys = list(steppers)
    times: dict[Hashable, list[float]] = {k: [] for k in keys}
    timings, calls = (steps, 1) if each_step else (1, steps)
    for r in range(rounds):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            if before is not None:
                before(k)
            for _ in range(timings):
                sync()
                with Stopwatch() as watch:
                    if k in runs_steps:
                        steppers[k](calls)
                    else:
                        for _ in range(calls):
                            steppers[k]()
                    sync()
                times[k].append(watch.seconds)
            if after is not None:
                after(k)
    return times


def zoo_module(name: str, b: int):
    """Zoo model b of an array: the zoo module built after ``torch.manual_seed(b)``, dropout 0."""
    import torch

    from onnxfuse.exporters.zoo import ZOO

    factory = ZOO[name].factory
    kwargs = {"dropout": 0.0} if "dropout" in inspect.signature(factory).parameters else {}
    torch.manual_seed(b)
    return factory(**kwargs)


def zoo_modules(name: str, B: int) -> list:
    return [zoo_module(name, b) for b in range(B)]


def zoo_batch(name: str, n: int, device):
    """N random samples and labels of the zoo model's task (next-token labels, one per position, for an LM)."""
    import torch

    from onnxfuse.exporters.zoo import ZOO

    e = ZOO[name]
    shape = (n,) + tuple(e.input_shape[1:])
    if e.input_dtype == "int64":
        x, y = torch.randint(0, e.input_high, shape), torch.randint(0, e.num_classes, shape)
    else:
        x, y = torch.randn(shape), torch.randint(0, e.num_classes, (n,))
    return x.to(device), y.to(device)


def zoo_protos(name: str, mods: list, n: int, folder: str) -> list:
    """One export, one ONNX model per module carrying that module's weights."""
    import torch
    from onnx import numpy_helper

    from onnxfuse.core._io import read_onnx
    from onnxfuse.exporters import export_module

    path = os.path.join(folder, f"{name}.onnx")
    export_module(copy.deepcopy(mods[0]), path, example_inputs=(zoo_batch(name, n, torch.device("cpu"))[0],))
    base = read_onnx(path, "run the command again")
    protos = []
    for m in mods:
        state = {k: v.detach().cpu().numpy() for k, v in m.state_dict().items()}
        p = copy.deepcopy(base)
        for t in p.graph.initializer:
            if t.name in state:
                t.CopyFrom(numpy_helper.from_array(state[t.name].astype(numpy_helper.to_array(t).dtype), t.name))
        protos.append(p)
    return protos


@dataclass
class OnnxFile:
    """An ONNX file given as a model to measure (bench's --models, plan's MODEL), checked once: its graph as read,
    its one data input and what to feed it."""

    path: str
    proto: object  # onnx.ModelProto
    input_name: str
    input_shape: list[int]  # at the batch it is measured at
    high: int | None  # an int64 input: token ids below this (its embedding table's rows); None: a float input
    label_shape: list[int]  # the output's shape without its last axis (the classes)
    classes: int
    fixed_batch: bool  # the graph's batch axis is a number, not a symbol: measured at that batch, no dense mode


def is_onnx_file(name: str) -> bool:
    from onnxfuse.exporters.zoo import ZOO

    return name not in ZOO and (name.lower().endswith(".onnx") or os.path.exists(name))


def _bn_statistics(proto) -> set[str]:
    return {n.input[i] for n in proto.graph.node if n.op_type == "BatchNormalization" for i in (3, 4)
            if len(n.input) > i}


def file_protos(f: OnnxFile, B: int) -> list:
    """Model 0: the file's weights; model b > 0: every trained float weight plus Gaussian noise of 1 % of that
    weight's standard deviation, drawn from seed b (BatchNorm statistics and non-finite constants stay)."""
    from onnx import numpy_helper

    from onnxfuse.core.source import weight_names

    trained = weight_names(f.proto) - _bn_statistics(f.proto)
    protos = [copy.deepcopy(f.proto)]
    for b in range(1, B):
        rng = np.random.default_rng(b)
        p = copy.deepcopy(f.proto)
        for t in p.graph.initializer:
            if t.name not in trained:
                continue
            w = numpy_helper.to_array(t)
            if w.size and np.isfinite(w).all():
                noise = rng.standard_normal(w.shape) * (0.01 * float(w.std()))
                t.CopyFrom(numpy_helper.from_array((w + noise).astype(w.dtype), t.name))
        protos.append(p)
    return protos


def file_batch(f: OnnxFile, device):
    import torch

    x = torch.randint(0, f.high, f.input_shape) if f.high is not None else torch.randn(f.input_shape)
    return x.to(device), torch.randint(0, f.classes, f.label_shape).to(device)


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def load_onnx_file(path: str, batch: int, flag: str = "models") -> OnnxFile:
    """Read and check an ONNX file to measure (``flag``: where it was given): one data input (float, or int64 ids
    that index an embedding initializer), one output whose last axis holds classes, torch eager runs it, B = 2
    perturbed copies fuse. Every failure is one ConfigError naming the file."""
    import onnx
    import torch

    from onnxfuse.core.passes import fuse_models
    from onnxfuse.core._io import read_onnx
    from onnxfuse.core.errors import OnnxFuseError
    from onnxfuse.core.source import load_source, weight_names

    from onnxfuse.recipe.losses import get_loss
    from onnxfuse.runtime.torch.program import OnnxModule

    try:
        proto = read_onnx(path)  # read once: load_source resolves a copy, torch eager runs the graph as read
        src = load_source(copy.deepcopy(proto), label=path)
    except OnnxFuseError as e:
        raise ConfigError(f"{flag}: {e}") from e
    ins, outs = [i.name for i in src.inputs], [o.name for o in src.outputs]
    if len(ins) != 1 or len(outs) != 1:
        raise ConfigError(f"{flag}: {path} has {_count(len(ins), 'data input')} ({', '.join(ins)}) and "
                          f"{_count(len(outs), 'output')} ({', '.join(outs)}); onnxfuse measures a model with one of "
                          "each (the batch and the class scores)")
    if not weight_names(src.model):
        raise ConfigError(f"{flag}: {path} has no weights (no floating-point initializer) to train; give a model "
                          "exported with its parameters")
    name, shape, dtype = ins[0], src.shapes.get(ins[0]), src.dtypes.get(ins[0])
    if not shape or any(not isinstance(d, int) for d in shape[1:]):
        raise ConfigError(f"{flag}: {path}: input '{name}' has shape {shape}; onnxfuse needs the batch axis first "
                          "and static sizes after it")
    fixed = isinstance(shape[0], int)
    input_shape = [shape[0] if fixed else batch] + shape[1:]
    inits = {t.name: t for t in src.model.graph.initializer}
    if dtype == onnx.TensorProto.FLOAT:
        high = None
    elif dtype == onnx.TensorProto.INT64:
        tables = [int(inits[n.input[0]].dims[0]) for n in src.model.graph.node
                  if n.op_type == "Gather" and n.input[1] == name and n.input[0] in inits]
        if not tables:
            raise ConfigError(f"{flag}: {path}: input '{name}' is int64 but indexes no embedding initializer (a "
                              "Gather from a weight), so the range of its values is unknown; onnxfuse feeds float "
                              "inputs or token ids read by an embedding")
        high = min(tables)
    else:
        raise ConfigError(f"{flag}: {path}: input '{name}' is {onnx.TensorProto.DataType.Name(dtype)}; onnxfuse "
                          "feeds float32 inputs or int64 token ids")
    # run model 0 once in torch eager: an op onnxfuse's converter lacks shows now, and the output's shape gives
    # the labels
    try:
        with torch.no_grad():
            out = OnnxModule(copy.deepcopy(proto))(
                torch.randint(0, high, input_shape) if high is not None else torch.randn(input_shape))[0]
    except (OnnxFuseError, RuntimeError) as e:
        raise ConfigError(f"{flag}: {path}: running it in torch eager failed: "
                          f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}") from e
    if out.dim() < 2 or not out.is_floating_point():
        raise ConfigError(f"{flag}: {path}: output '{outs[0]}' is {out.dtype} of shape {list(out.shape)}; onnxfuse "
                          "trains cross-entropy over the output's last axis, which needs float scores [N, .., classes]")
    f = OnnxFile(path, proto, name, input_shape, high, list(out.shape[:-1]), int(out.shape[-1]), fixed)
    try:
        fa = fuse_models(file_protos(f, 2), labels=["model_0", "model_1"])
    except OnnxFuseError as e:
        raise ConfigError(f"{flag}: {path} does not fuse: {(str(e).strip().splitlines() or [''])[0]}") from e
    try:
        get_loss("cross-entropy", class_axis=-1).check_output(fa.spec.outputs[0]["shape"] or [], outs[0])
    except ConfigError as e:
        raise ConfigError(f"{flag}: {path}: {e}") from e
    return f


