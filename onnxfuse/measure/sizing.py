"""Array sizing: how many models B to fuse into one array on this machine (`onnxfuse plan`).

Method. The model is really fused and trained for a few steps at small probe sizes (default B = 1, 2, 4) on the
chosen runtime and device, each model at batch N; two straight lines are fitted to what the probes measure and
extrapolated to B = 1, 2, 4, ... up to ``max_B``:

    step time    t(B) = a + b*B        a: the per-step overhead every array pays once (launches, the Python loop,
                                       the optimizer's graph walk); b: the per-model work. Least squares over the
                                       probes' median step times (warm-up steps excluded), a >= 0.
    throughput   s(B) = B*N / t(B)     rises towards N/b: fusing pays while a is a large part of t(B)
    memory       m(B) = m0 + m1*B      every tensor of the fused graph is B blocks, the batch is shared

Memory, per device:
  * CUDA (torch runtime): torch.cuda.max_memory_allocated during the warm-up steps, less what was allocated before
    the array was built.
  * CPU, torch runtime: the bytes torch's CPU allocator holds at the peak of one step, read from the torch
    profiler's allocation events (``profile_memory=True``), plus what the trainer holds between steps (weights,
    optimizer state) and the batch. Process RSS is no measure of one array: it only grows over a process's life,
    holds the libraries and the allocator's caches, and cannot be split between probes.
  * Otherwise (the ort runtime): :func:`estimate_step_memory`, counted from the fused training graph's tensor
    shapes (onnx shape inference at batch N): parameters, buffers and optimizer state, the batch, every activation
    the forward writes (kept for the backward: an upper bound), the gradients, and the peak of the optimizer
    update's temporaries (a liveness walk of its graph). It is also computed for every probe, next to the
    measurement, so the two can be compared.
  Memory counts the step's tensors, not the Python process and its libraries: the default budget's safety factor
  leaves room for those.

Recommendation (:func:`choose_B`, a pure function of the predicted curve): among B = 1, 2, 4, ... (``max_B`` last),
the smallest B at which doubling B would raise the predicted samples/s by less than ``MIN_GAIN`` (10 %) -- with
the linear time model, the first power of two above 4.5 * a / b -- unless the doubled B would not fit in the
memory budget (then the largest B that fits) or B reaches ``max_B``.

``size_array(...)`` returns an :class:`ArraySizing` (per-B predictions, the probes, the fits, the recommended B and
why); ``recommend_B(...)`` is the recommended B alone, for a sweep that sizes its arrays.
"""
from __future__ import annotations

import copy
import json
import math
import os
import statistics
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import onnx

from onnxfuse.core._graph import last_readers
from onnxfuse.core._clock import Stopwatch
from onnxfuse.core._io import atomic_write_bytes
from onnxfuse.core._opset import is_training_batchnorm, onnx_opset
from onnxfuse.core._units import parse_size
from onnxfuse.core.errors import ConfigError, as_user_error
from onnxfuse.recipe.device import Device

__all__ = ["ArraySizing", "SizingRow", "Probe", "MemoryEstimate", "size_array", "recommend_B", "choose_B",
           "fit_line", "measure_arrays", "estimate_step_memory", "training_weight_factor", "parse_memory",
           "default_memory_budget",
           "MIN_GAIN", "SAFETY"]

MIN_GAIN = 0.10  # doubling B must add at least 10 % samples/s to be worth it
SAFETY = {"cpu": 0.8, "cuda": 0.9}  # the part of the device's free (CPU) or total (CUDA) memory the default budget is
# Ops whose output torch returns as a view of the input (no memory of its own), and ONNX Runtime often aliases.
_VIEW_OPS = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Shape", "Size"}


# ------------------------------------------------------------------------------------------------- the budget
def parse_memory(value: str | int | float, name: str = "memory_budget") -> int:
    """'8GiB' -> 8589934592; '512MiB', '2GB' (powers of 1000), '1e9' or an int: bytes (``onnxfuse.core._units``, the
    units placement's ``--memory`` takes)."""
    how = "give bytes or a number with a unit, e.g. 8GiB, 512MiB, 2GB"
    try:
        size = parse_size(value if value is not None else "")
    except ConfigError as e:
        raise ConfigError(f"{name}: {e}; {how}") from None
    if not math.isfinite(size) or size < 1:
        raise ConfigError(f"{name}: must be a positive size, got '{value}'; {how}")
    return int(size)


def _available_ram() -> int | None:
    """MemAvailable (free memory plus what the kernel can reclaim), else free pages; None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil  # optional

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_memory_budget(device: Device | str) -> tuple[int, str]:
    """(bytes, where they come from): CUDA: the device's total memory x 0.9; CPU: the RAM available now x 0.8."""
    device = Device.of(device)
    if device.is_cuda:
        import torch

        total = torch.cuda.get_device_properties(device.torch()).total_memory
        return int(total * SAFETY["cuda"]), f"{SAFETY['cuda']:g} x {device}'s {_size(total)}"
    ram = _available_ram()
    if ram is None:
        raise ConfigError("cannot read the available RAM on this system; give memory_budget= (e.g. 8GiB)")
    return int(ram * SAFETY["cpu"]), f"{SAFETY['cpu']:g} x the {_size(ram)} of RAM available"


def _size(n: float) -> str:
    """1066000 -> '1.0 MiB'."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


# ---------------------------------------------------------------------------------------- the rule (pure maths)
def fit_line(x: Sequence[float], y: Sequence[float], nonnegative_intercept: bool = False) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = intercept + slope * x; with ``nonnegative_intercept`` a negative
    intercept becomes 0 and the slope is refitted through the origin."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(set(x.tolist())) < 2:
        raise ConfigError(f"probe: needs at least two different array sizes to fit a line, got {sorted(set(x))}")
    slope, intercept = np.polyfit(x, y, 1)
    if nonnegative_intercept and intercept < 0:
        intercept, slope = 0.0, float(x @ y / (x @ x))
    return float(intercept), float(slope)


def candidate_sizes(max_B: int) -> list[int]:
    """1, 2, 4, ... up to max_B, and max_B itself."""
    sizes = [1 << k for k in range(max_B.bit_length()) if 1 << k <= max_B]
    return sizes if sizes[-1] == max_B else sizes + [max_B]


def choose_B(Bs: Sequence[int], step_s: Sequence[float], memory: Sequence[float], batch: int, budget: float,
             min_gain: float = MIN_GAIN) -> tuple[int, str]:
    """The recommended B among ascending candidates ``Bs`` (1, 2, 4, ...) with predicted step seconds and memory
    bytes: the smallest B at which doubling B adds less than ``min_gain`` samples/s, the largest B that fits when
    the next one would not, or the last candidate. Returns (B, why).

    A step from B to B' that is not a doubling is judged per doubling: (s(B')/s(B)) ** (1 / log2(B'/B))."""
    if not Bs or list(Bs) != sorted(set(Bs)) or Bs[0] < 1:
        raise ValueError(f"candidate sizes must be ascending distinct integers >= 1, got {list(Bs)}")
    if not len(Bs) == len(step_s) == len(memory):
        raise ValueError("Bs, step_s and memory must have one value per candidate")
    if memory[0] > budget:
        raise ConfigError(f"memory_budget: {_size(budget)} is below the {_size(memory[0])} predicted for B={Bs[0]}; "
                          f"raise memory_budget= to at least {math.ceil(memory[0] / 2 ** 20)}MiB or lower batch=")
    samples = [B * batch / t for B, t in zip(Bs, step_s)]
    for i, B in enumerate(Bs):
        if i + 1 == len(Bs):
            return B, f"B={B} is the largest size considered (--max-B)"
        nxt = Bs[i + 1]
        if memory[i + 1] > budget:
            return B, f"B={nxt} would need {_size(memory[i + 1])}, over the {_size(budget)} memory budget"
        per_doubling = (samples[i + 1] / samples[i]) ** (1 / math.log2(nxt / B))
        if per_doubling < 1 + min_gain:
            return B, (f"B={nxt} would add only {100 * (samples[i + 1] / samples[i] - 1):+.1f}% samples/s "
                       f"(< {100 * min_gain:g}% per doubling)")
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------------------------- the workload
@dataclass
class _Workload:
    name: str
    proto: onnx.ModelProto  # one model, batch dim dynamic
    feeds: dict             # the data input and labels at batch N
    loss: object            # LossSpec


def _zoo_proto(name: str, batch: int, folder: str) -> tuple[onnx.ModelProto, np.ndarray]:
    import torch

    from onnxfuse.exporters import export_module
    from onnxfuse.exporters.zoo import ZOO

    from onnxfuse.measure.workloads import zoo_batch

    x = zoo_batch(name, batch, torch.device("cpu"))[0]
    torch.manual_seed(0)
    proto = export_module(ZOO[name].factory(), os.path.join(folder, f"{name}.onnx"), example_inputs=(x,))
    return proto, x.numpy()


def _file_proto(path: str, batch: int) -> tuple[onnx.ModelProto, np.ndarray]:
    """The file as `onnxfuse bench` checks and feeds it (onnxfuse/measure/workloads.py), at ``batch`` samples."""
    import torch

    from onnxfuse.measure.workloads import file_batch, load_onnx_file

    f = load_onnx_file(path, batch, flag="MODEL")
    if f.fixed_batch and f.input_shape[0] != batch:
        raise ConfigError(f"MODEL '{path}': its batch axis is fixed at {f.input_shape[0]}; pass batch="
                          f"{f.input_shape[0]} or export it with a dynamic batch")
    return f.proto, file_batch(f, torch.device("cpu"))[0].numpy()


def _workload(model: str, batch: int, folder: str) -> _Workload:
    """One ONNX model with a dynamic batch and a batch of N random samples and labels for it (cross-entropy over
    the output's last axis, as `onnxfuse bench` trains: classification [N, C] or a language model [N, T, V])."""
    from onnxfuse.core.passes import fuse_models
    from onnxfuse.exporters.zoo import ZOO

    from onnxfuse.recipe.losses import LABELS, get_loss

    if model in ZOO:
        proto, x = _zoo_proto(model, batch, folder)
        name = model
    elif os.path.isfile(model):
        proto, x = _file_proto(model, batch)
        name = os.path.basename(model)
    else:
        raise ConfigError(f"MODEL '{model}' is neither a zoo model ({', '.join(ZOO)}) nor an ONNX file")
    loss = get_loss("cross-entropy", class_axis=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = fuse_models([proto], labels=["model_0"]).spec
    out_shape = spec.outputs[0]["shape"]
    loss.check_output(out_shape, spec.outputs[0]["name"])
    label_shape = [batch] + list(loss.label_shape(out_shape))[1:]
    if any(not isinstance(d, int) for d in label_shape):
        raise ConfigError(f"MODEL '{model}': output shape {out_shape} has symbolic dims besides the batch; the "
                          "planner needs them static")
    labels = np.random.default_rng(1).integers(0, loss.num_classes(out_shape), label_shape).astype(np.int64)
    return _Workload(name, proto, {spec.inputs[0]["name"]: x, LABELS: labels}, loss)


# -------------------------------------------------------------------------------------------- memory estimate
def training_weight_factor(state_slots: int) -> int:
    """Bytes a training step holds per byte of a trained weight: the weight, its gradient and ``state_slots``
    optimizer state buffers of its size (AdamW 2, SGD with momentum 1, plain SGD 0). The one rule for weights in
    training memory: :func:`estimate_step_memory` (an array's whole step on one device, to choose B) and placement
    (``PlacementGraph.weight_factor``: each device's share of a graph, to fit a placement) both apply it."""
    return 2 + state_slots


@dataclass
class MemoryEstimate:
    """Bytes of one training step of a fused array, counted from its graph (see the module docstring)."""

    held: int         # parameters, buffers, optimizer state
    batch: int        # the step's inputs and labels
    activations: int  # every tensor the forward writes (views excluded): what the backward may keep
    gradients: int    # one gradient per parameter
    update: int       # the peak of the optimizer update's temporaries

    @property
    def total(self) -> int:
        return self.held + self.batch + self.gradients + max(self.activations, self.update)


def _nbytes(vi: onnx.ValueInfoProto) -> int | None:
    t = vi.type.tensor_type
    if not t.HasField("shape") or any(not d.HasField("dim_value") for d in t.shape.dim):
        return None
    itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize if t.elem_type else 4
    return int(np.prod([d.dim_value for d in t.shape.dim], dtype=np.int64)) * itemsize


def _inferred_sizes(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
    sizes = {}
    for vi in list(inferred.value_info) + list(inferred.output) + list(inferred.input):
        n = _nbytes(vi)
        if n is not None:
            sizes[vi.name] = n
    return sizes


def _peak_live(model: onnx.ModelProto, sizes: dict[str, int]) -> int:
    """The most bytes of node outputs alive at once when the nodes run in order and each is freed after its last
    reader (graph outputs stay; graph inputs are counted by the caller)."""
    freed: dict[int, list[str]] = {}  # step -> the node outputs that step is the last to need
    for t, k in last_readers(model.graph.node, keep={o.name for o in model.graph.output}).items():
        freed.setdefault(k, []).append(t)
    live = peak = 0
    for k, node in enumerate(model.graph.node):
        live += sum(sizes.get(o, 0) for o in node.output if o)
        peak = max(peak, live)
        live -= sum(sizes.get(t, 0) for t in freed.get(k, ()))
    return peak


def estimate_step_memory(fused: onnx.ModelProto, spec, loss, optimizer, feeds: dict) -> MemoryEstimate:
    """Count the bytes of one training step of ``fused`` (an :class:`ArraySpec`'s graph) from its tensor shapes
    at the batch ``feeds`` gives: see :class:`MemoryEstimate`.

    Placement's memory plan (``onnxfuse/placement/graph.py``) answers another question, the bytes each device
    holds for the nodes placed on it; it shares this estimate's rule for weights (:func:`training_weight_factor`),
    and differs where a bare graph gives less to go on: every initializer counts as trained (no spec tells
    buffers from parameters), every activation is kept for the whole step and no optimizer update is counted."""
    from onnxfuse.runtime.graph_passes import add_loss_pass
    from onnxfuse.runtime.protocol import parameter_names
    from onnxfuse.runtime.torch.optimizers import update_graph

    trainable, buffers = parameter_names(spec)
    weights = {t.name: t for t in fused.graph.initializer}

    def size(name: str) -> int:
        t = weights[name]
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        return int(np.prod(t.dims, dtype=np.int64)) * itemsize

    params = sum(size(n) for n in trainable)
    gradients = params  # one per parameter, a field of its own beside what is held
    held = params * training_weight_factor(len(optimizer.state_names())) - gradients + sum(size(n) for n in buffers)
    batch = sum(int(np.asarray(a).nbytes) for a in feeds.values())

    train, _ = add_loss_pass(copy.deepcopy(fused), spec, loss)
    for vi in train.graph.input:  # the batch's own dims in place of the symbolic ones
        if vi.name in feeds:
            shape = np.asarray(feeds[vi.name]).shape
            for d, n in zip(vi.type.tensor_type.shape.dim, shape):
                d.Clear()
                d.dim_value = int(n)
    sizes = _inferred_sizes(train)
    activations = sum(sizes.get(o, 0) for n in train.graph.node if n.op_type not in _VIEW_OPS
                      for o in n.output if o)

    shapes = {n: list(weights[n].dims) for n in trainable + buffers}
    opset = onnx_opset(fused)
    stats = [n for n in buffers if any(n in node.input[3:5] for node in fused.graph.node
                                       if is_training_batchnorm(node, opset))]  # what the torch runtime updates
    upd, _ = update_graph(optimizer, [(p, shapes[p]) for p in trainable], [(s, shapes[s]) for s in stats], opset)
    update = _peak_live(upd, _inferred_sizes(upd))
    return MemoryEstimate(held, batch, activations, gradients, update)


# ----------------------------------------------------------------------------------------------- measurement
@dataclass
class Probe:
    """One array really built and trained: its median step time and its memory."""

    B: int
    step_s: float                 # median over the timed steps
    step_times: list[float]       # every timed step, seconds
    memory: int | None            # measured bytes (CUDA allocator, or torch's CPU allocator); None when not measurable
    memory_estimate: int          # estimate_step_memory(...).total
    setup_s: float                # fusing and building the trainer


def _cpu_step_peak(trainer, feeds: dict) -> int:
    """Bytes torch's CPU allocator holds at the peak of one step beyond what it held before it: the allocation
    events of the torch profiler, each counted at its start, as a running sum."""
    from torch.profiler import ProfilerActivity, profile

    # the profiler's C++ side writes a line to file descriptor 2 when it starts and stops: keep the terminal quiet
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                trainer.step(feeds)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    events = sorted((ev.time_range.start, ev.cpu_memory_usage if ev.name == "[memory]" else ev.self_cpu_memory_usage)
                    for ev in prof.events())
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _held_bytes(trainer) -> int:
    return sum(a.nbytes for a in trainer.weights().values()) + sum(a.nbytes for a in trainer.optimizer_state().values())


def measure_arrays(model: str, Bs: Sequence[int], runtime: str = "auto", device: Device | str = "cpu",
                   batch: int = 32, optimizer: str = "adamw", threads: int = 0, warmup: int = 2, steps: int = 5,
                   rounds: int = 2, measure_memory: bool = True) -> list[Probe]:
    """Fuse B copies of ``model`` for each B in ``Bs``, train each ``warmup`` untimed steps then ``rounds`` x
    ``steps`` timed ones (rounds alternate the arrays' order, so that no array always runs first on a machine whose
    speed drifts), and measure its memory (see the module docstring). The B models share weights: the time and
    memory of a step do not depend on their values."""
    import torch

    from onnxfuse.core.passes import fuse_models
    from onnxfuse.measure.workloads import interleaved_rounds

    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.trainers import make_trainer, resolve_runtime

    device = Device.of(device)
    runtime = resolve_runtime(runtime, device)
    cuda = device.is_cuda
    dev = device.torch()
    built: list[tuple[int, object, float, int | None, int]] = []
    with tempfile.TemporaryDirectory(prefix="onnxfuse-plan-") as folder:
        work = _workload(model, batch, folder)
        feeds = ({k: torch.from_numpy(v).to(dev) for k, v in work.feeds.items()} if cuda and runtime == "torch"
                 else work.feeds)

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(dev)

        for B in Bs:
            setup = Stopwatch()
            if cuda:
                sync()
                torch.cuda.reset_peak_memory_stats(dev)
                before = torch.cuda.memory_allocated(dev)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a node run once per model: the array still trains
                fa = fuse_models([work.proto] * B, labels=[f"model_{b}" for b in range(B)])
            opt = make_optimizer(optimizer, B)
            trainer = make_trainer(runtime, fa.model, fa.spec, work.loss, opt, device=device,
                                   workdir=os.path.join(folder, f"B{B}"), threads=threads or None)
            setup_s = setup.seconds
            for _ in range(warmup):
                trainer.step(feeds)
            sync()
            memory = None
            if measure_memory and cuda and runtime == "torch":
                # the batch was put on the device before `before`: count it as the CPU measurement does
                memory = torch.cuda.max_memory_allocated(dev) - before + sum(a.nbytes for a in work.feeds.values())
            elif measure_memory and runtime == "torch":
                memory = _held_bytes(trainer) + sum(a.nbytes for a in work.feeds.values()) + \
                    _cpu_step_peak(trainer, feeds)
            estimate = estimate_step_memory(fa.model, fa.spec, work.loss, opt, work.feeds).total
            built.append((B, trainer, setup_s, memory, estimate))
        # every step timed alone, between syncs: the median is of steps
        times = interleaved_rounds({B: (lambda t=trainer: t.step(feeds)) for B, trainer, *_ in built}, rounds, steps,
                                   sync, each_step=True)
        probes = [Probe(B, statistics.median(times[B]), times[B], memory, estimate, setup_s)
                  for B, _, setup_s, memory, estimate in built]
        built.clear()  # the trainers go before their work folders
    return probes


# ---------------------------------------------------------------------------------------------------- the sizing
@dataclass
class SizingRow:
    """The predicted step of one array size."""

    B: int
    step_s: float
    samples_s: float   # all B models: B * N / step_s
    memory: int        # bytes
    fits: bool         # within the memory budget


@dataclass
class ArraySizing:
    """What `onnxfuse plan` found: the probes, the fitted lines, the prediction per B and the recommended B."""

    model: str
    runtime: str
    device: str
    batch: int
    optimizer: str
    memory_budget: int
    budget_source: str
    memory_source: str                  # what the memory line was fitted to
    probes: list[Probe]
    time_fit: tuple[float, float]       # (a, b): t(B) = a + b*B seconds
    memory_fit: tuple[float, float]     # (m0, m1): m(B) = m0 + m1*B bytes
    rows: list[SizingRow]
    recommended_B: int
    reason: str
    rule: str = (f"the smallest B at which doubling B adds less than {100 * MIN_GAIN:g}% predicted samples/s, "
                 "or the largest B within the memory budget, or --max-B")
    notes: list[str] = field(default_factory=list)

    def predict(self, B: int) -> SizingRow:
        """The fitted lines at any B."""
        (a, b), (m0, m1) = self.time_fit, self.memory_fit
        t, m = a + b * B, int(m0 + m1 * B)
        return SizingRow(B, t, B * self.batch / t, m, m <= self.memory_budget)

    def table(self) -> str:
        """B, predicted step ms, samples/s and memory MiB; the recommended row marked."""
        (a, b), (m0, m1) = self.time_fit, self.memory_fit
        lines = [f"fitted on B={','.join(str(p.B) for p in self.probes)} ({self.runtime}/{self.device}, batch "
                 f"{self.batch}, {self.optimizer}): step = {1e3 * a:.2f} ms + {1e3 * b:.3f} ms x B; memory = "
                 f"{m0 / 2 ** 20:.2f} MiB + {m1 / 2 ** 20:.3f} MiB x B ({self.memory_source}); budget "
                 f"{_size(self.memory_budget)} ({self.budget_source})",
                 f"{'B':>6}  {'step ms':>10}  {'samples/s':>12}  {'memory MiB':>11}",
                 f"{'-' * 6}  {'-' * 10}  {'-' * 12}  {'-' * 11}"]
        for r in self.rows:
            mark = "  <- recommended" if r.B == self.recommended_B else "" if r.fits else "  over budget"
            lines.append(f"{r.B:>6}  {1e3 * r.step_s:>10.2f}  {r.samples_s:>12,.0f}  "
                         f"{r.memory / 2 ** 20:>11,.1f}{mark}")
        return "\n".join(lines)

    def summary(self) -> str:
        r = next(r for r in self.rows if r.B == self.recommended_B)
        return (f"recommended B={self.recommended_B} for {self.model} on {self.runtime}/{self.device} at batch "
                f"{self.batch}: {r.samples_s:,.0f} samples/s, {r.memory / 2 ** 20:,.1f} MiB predicted; {self.reason}")

    def to_json(self) -> dict:
        return asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        """The sizing as JSON (every field, the probes' step times included)."""
        path = os.fspath(path)
        folder = os.path.dirname(path)
        try:
            if folder:
                os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise (as_user_error(e, path) or e) from e
        atomic_write_bytes(path, (json.dumps(self.to_json(), indent=1) + "\n").encode())


def _check_int(name: str, value, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ConfigError(f"{name}: must be an integer >= {least}, got {value!r}")
    return int(value)


def size_array(model: str, runtime: str = "auto", device: Device | str = "cpu", batch: int = 32,
               memory_budget: str | int | float | None = None, probe: Sequence[int] = (1, 2, 4), max_B: int = 1024,
               optimizer: str = "adamw", threads: int = 0, warmup: int = 2, steps: int = 5,
               rounds: int = 2) -> ArraySizing:
    """Predict a fused training step's time and memory per B and recommend B (see the module docstring).

    ``model``: a zoo name (``onnxfuse.exporters.zoo.ZOO``) or an ONNX file with one data input; trained with
    cross-entropy over the output's last axis on random data at batch ``batch`` per model. ``memory_budget``:
    bytes or a size like '8GiB' (default: the device's memory x a safety factor, :func:`default_memory_budget`).
    ``probe``: the array sizes really trained. Bad input is a one-line ConfigError naming the setting."""
    from onnxfuse.runtime.trainers import resolve_runtime

    batch = _check_int("batch", batch)
    max_B = _check_int("max_B", max_B)
    for name, v, least in (("warmup", warmup, 0), ("steps", steps, 1), ("rounds", rounds, 1),
                           ("threads", threads, 0)):
        _check_int(name, v, least)
    probe = sorted({_check_int("probe", B) for B in probe})
    if len(probe) < 2:
        raise ConfigError(f"probe: needs at least two different array sizes to fit a line, e.g. [1, 2, 4]; got {probe}")
    device = Device.of(device, "device: ")
    runtime = resolve_runtime(runtime, device)
    if memory_budget is None:
        budget, budget_source = default_memory_budget(device)
    else:
        budget, budget_source = parse_memory(memory_budget), "--memory-budget"

    probes = measure_arrays(model, probe, runtime, device, batch, optimizer, threads, warmup, steps, rounds)
    notes = []
    measured = all(p.memory is not None for p in probes)
    memory_source = ("torch.cuda.max_memory_allocated" if measured and device.is_cuda else
                     "torch CPU allocator peak (profiler)" if measured else "estimate from the graph's tensor shapes")
    mem = [p.memory if measured else p.memory_estimate for p in probes]
    Bs = [p.B for p in probes]
    a, b = fit_line(Bs, [p.step_s for p in probes], nonnegative_intercept=True)
    m0, m1 = fit_line(Bs, mem)
    if b <= 0:
        seen = ", ".join(f"{p.step_s * 1e3:.1f} ms" for p in probes)
        notes.append(f"the probes' step time did not grow with B ({seen}"
                     "): the per-model cost is below the machine's noise, so throughput is predicted to grow with B "
                     "until the memory budget; probe larger sizes (--probe 1,8,32) for a real estimate")
        b = 1e-12
    if m1 <= 0:
        m1 = max(mem) / max(Bs)  # memory that does not grow with B is noise: grow it as the largest probe's share
        notes.append("the probes' memory did not grow with B; predicted as proportional to B")
    sizing = ArraySizing(model=model, runtime=runtime, device=str(device), batch=batch, optimizer=optimizer,
                          memory_budget=budget, budget_source=budget_source, memory_source=memory_source,
                          probes=probes, time_fit=(a, b), memory_fit=(m0, m1), rows=[], recommended_B=0, reason="",
                          notes=notes)
    rows = []
    for B in candidate_sizes(max_B):
        rows.append(sizing.predict(B))
        if not rows[-1].fits:
            break  # one row over the budget shows where it ends
    sizing.recommended_B, sizing.reason = choose_B([r.B for r in rows], [r.step_s for r in rows],
                                               [r.memory for r in rows], batch, budget)
    sizing.rows = rows
    return sizing


def recommend_B(model: str, **options) -> int:
    """The B :func:`size_array` recommends for ``model`` (same options): for a sweep that sizes its arrays."""
    return size_array(model, **options).recommended_B
