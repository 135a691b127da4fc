"""An ONNX graph (a fused array, before the ORT legalization) as a ``torch.nn.Module`` that torch autograd trains.

    module = OnnxModule.from_array(fa.model, fa.spec)    # or OnnxModule(model, trainable=[...], buffers=[...])
    logits, = module(input=x)                            # graph outputs, a tuple in graph order (output_names)
    module.parameter("conv1.weight")                     # the nn.Parameter of an ONNX initializer

- Trainable initializers are ``nn.Parameter``s in ``module.weights`` (a ParameterDict), buffers (BatchNorm
  running statistics, frozen weights) persistent buffers in ``module.stats``; ONNX names contain dots, so the keys
  are sanitized and ``param_keys`` / ``buffer_keys`` map the ONNX name to its key. Every other initializer, Constant
  node and node computable from them alone is a constant, evaluated once at build time (constant folding).
- Execution is a precomputed list of :class:`Step`s (kernel, input slots, output slots, slots to free, node label)
  in the graph's topological order; a tensor is released as soon as its last reader has run
  (``_graph.last_readers``). Kernels come from :mod:`onnxfuse.runtime.torch.kernels` (one builder per ONNX op);
  the forward pass parses no attribute.
- Shape arithmetic (Shape, and int ops over it and constants) runs on the host (CPU tensors), so reading a shape
  into a Reshape never synchronises a device; a host value read as data is copied to the module's device once.
- ``module.train()`` / ``module.eval()`` switch between two programs: training-mode BatchNorm uses batch statistics
  and updates the running ones (torch's rule: :func:`kernels.norm.batch_norm`), Dropout drops; in eval mode
  BatchNorm uses the running statistics and Dropout is the identity (as torch modules do).
- Works on any device (``.to(device)``) and with channels-last tensors (kernels never assume contiguity).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Collection, NamedTuple, Sequence

import onnx
import torch
from onnx import numpy_helper

from onnxfuse.core._graph import last_readers, node_label, outer_reads, reads
from onnxfuse.core.registry import op_key, op_names
from onnxfuse.core._opset import onnx_opset
from onnxfuse.core.source import FLOAT_TYPES, METADATA_KEY

from onnxfuse.runtime.torch.patterns import torch_forms
from onnxfuse.runtime.torch.kernels import (HOST_OPS, OPS, RANDOM_OPS, Kernel, NodeSpec, RandomStreams, SubProgram,
                                            TorchOptions, UnsupportedTorchOpError, node_outputs, supported_ops)

__all__ = ["OnnxModule", "Step", "TorchOptions", "UnsupportedTorchOpError"]

_NONE, _TRASH = 0, 1  # slot 0 always holds None (absent inputs); unread outputs may be written to slot 1


class _Store(torch.nn.Module):
    """A container of buffers under sanitized names."""


class _DeviceRef:
    device = torch.device("cpu")


class Step(NamedTuple):
    """One call of a program: ``kernel(*[env[i] for i in inputs])`` into ``outputs`` (a slot, or a tuple of slots
    with one per node output), then the slots in ``free`` released; ``label`` names the node it runs (or the copy)."""

    kernel: Callable[..., Any]
    inputs: tuple[int, ...]
    outputs: int | tuple[int, ...]
    free: tuple[int, ...] = ()
    label: str = ""


@dataclass
class _Program:
    steps: list[Step]
    template: list  # slot values that never change (None, host constants); one entry per slot
    fills: list[tuple[int, dict, str]]  # slot <- container[key] at each call (parameters, buffers, device consts)
    input_slots: list[int]
    output_slots: list[int]

    def __post_init__(self):
        # What the forward pass iterates: the steps as plain tuples (kernel, inputs, outputs, free). CPython unpacks
        # an exact tuple without an iterator; a NamedTuple (a subclass) takes the slow path, ~3x the time per step.
        self.calls = [(s.kernel, s.inputs, s.outputs, s.free) for s in self.steps]


def _sanitize(name: str, taken: set[str], owner: torch.nn.Module) -> str:
    key = re.sub(r"\W", "_", name) or "_"
    if key[0].isdigit():
        key = "_" + key
    while key in taken or hasattr(owner, key):
        key += "_"
    taken.add(key)
    return key


def _opset(model: onnx.ModelProto) -> int:
    return onnx_opset(model)


def _metadata(model: onnx.ModelProto) -> dict:
    import json

    for p in model.metadata_props:
        if p.key == METADATA_KEY:
            return json.loads(p.value)
    return {}


class OnnxModule(torch.nn.Module):
    """Run (and train) ONNX graph ``model`` with torch.

    ``trainable``: initializers that become ``nn.Parameter``s (default: the exporter's metadata, else every
    floating-point initializer that is not read as BatchNorm running statistics). ``buffers``: initializers kept as
    module state but not trained (default: metadata, else the BatchNorm running statistics). ``outputs``: the tensor
    names ``forward`` returns (default: the graph outputs; any tensor of the graph may be named, e.g. a
    BatchNorm's running-statistic outputs). ``forward`` takes the graph inputs by name (keywords) or in graph order
    and returns a tuple in ``output_names`` order (host-side shape values come back as CPU tensors). ``lazy``: build
    each mode's program at its first call, not now (a module whose state other programs read, and that may never
    run itself).
    """

    def __init__(self, model: onnx.ModelProto, trainable: Collection[str] | None = None,
                 buffers: Collection[str] | None = None, outputs: Sequence[str] | None = None,
                 options: TorchOptions | None = None, lazy: bool = False):
        super().__init__()
        g = model.graph
        self.opset = _opset(model)
        self.options = options or TorchOptions()
        inits = {t.name: t for t in g.initializer}
        meta = _metadata(model)
        bn_stats = {n.input[i] for n in g.node if n.op_type == "BatchNormalization" for i in (3, 4)
                    if len(n.input) > i}
        if trainable is None:
            trainable = meta["trainable"] if "trainable" in meta else [
                n for n, t in inits.items() if t.data_type in FLOAT_TYPES and n not in bn_stats]
        if buffers is None:
            buffers = meta["buffers"] if "buffers" in meta else [n for n in inits if n in bn_stats]
        trainable = [n for n in trainable if n in inits]
        buffers = [n for n in buffers if n in inits and n not in set(trainable)]
        self.input_names = [i.name for i in g.input if i.name not in inits]
        self.output_names = list(outputs) if outputs is not None else [o.name for o in g.output]

        self.weights = torch.nn.ParameterDict()
        self.stats = _Store()
        self.consts = _Store()
        self.param_keys: dict[str, str] = {}
        self.buffer_keys: dict[str, str] = {}
        taken: set[str] = set()
        for n in trainable:
            key = _sanitize(n, taken, self.weights)
            self.weights[key] = torch.nn.Parameter(_tensor(inits[n]))
            self.param_keys[n] = key
        for n in buffers:
            key = _sanitize(n, taken, self.stats)
            self.stats.register_buffer(key, _tensor(inits[n]))
            self.buffer_keys[n] = key
        self.register_buffer("_probe", torch.empty(0), persistent=False)
        self._device = _DeviceRef()
        self.random_streams = RandomStreams()  # the generators of random nodes with a seed (both programs share them)
        self._subprograms: dict[str, SubProgram] = {}  # compiled subgraphs (If, Loop, Scan), by node and graph
        constants = {n: _tensor(t) for n, t in inits.items() if n not in self.param_keys and n not in self.buffer_keys}
        self._const_keys: dict[str, str] = {}
        self._const_taken: set[str] = set()
        self._source = (g, constants) if lazy else None
        self._programs = {} if lazy else {mode: self._compile(g, constants, mode) for mode in (True, False)}

    @classmethod
    def from_array(cls, model: onnx.ModelProto, spec, **kw) -> "OnnxModule":
        """The module of a fused array: ``spec`` (an ``onnxfuse.core.weights.ArraySpec``) says which fused weights are
        trained (role "param") and which are state (BatchNorm statistics, frozen weights)."""
        trainable, buffers = spec.parameter_names()
        return cls(model, trainable=trainable, buffers=buffers, **kw)

    # ---- access by ONNX name
    def parameter(self, name: str) -> torch.nn.Parameter:
        return self.weights[self.param_keys[name]]

    def buffer(self, name: str) -> torch.Tensor:
        return self.stats._buffers[self.buffer_keys[name]]

    def onnx_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer under its ONNX initializer name."""
        out = {n: self.weights[k] for n, k in self.param_keys.items()}
        out.update({n: self.stats._buffers[k] for n, k in self.buffer_keys.items()})
        return out

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._device.device = self._probe.device
        return out

    # ---- running
    def forward(self, *args, **inputs) -> tuple:
        p = self._programs.get(self.training) or self._lazy_program(self.training)
        env = list(p.template)
        for slot, store, key in p.fills:
            env[slot] = store[key]
        if args:
            inputs.update(zip(self.input_names, args))
        try:
            for slot, name in zip(p.input_slots, self.input_names):
                env[slot] = inputs[name]
        except KeyError as e:
            raise TypeError(f"missing graph input {e}; the graph takes {self.input_names}") from None
        for fn, ins, out, free in p.calls:
            r = fn(*[env[i] for i in ins])
            if out.__class__ is int:
                env[out] = r
            else:
                for o, v in zip(out, r):
                    env[o] = v
            for i in free:
                env[i] = None
        return tuple(env[s] for s in p.output_slots)

    # ---- building
    def _lazy_program(self, training: bool) -> _Program:
        """A ``lazy`` module's program of one mode, built at its first call."""
        if self._source is None:
            raise KeyError(training)
        g, constants = self._source
        self._programs[training] = self._compile(g, constants, training)
        if len(self._programs) == 2:
            self._source = None
        return self._programs[training]

    def subprogram(self, graph: onnx.GraphProto, owner: str) -> SubProgram:
        """``graph`` (a subgraph of node ``owner``: an If branch, a Loop or Scan body) as a module of its own,
        registered as a child (it follows the module's device and train/eval mode): its formal inputs, then the
        outer-scope tensors it reads by name, as inputs; its initializers are constants. Compiled once per
        subgraph, for both programs."""
        key = f"{owner}/{graph.name}"
        if key not in self._subprograms:
            outer = tuple(outer_reads(onnx.helper.make_node("If", [], [], then_branch=graph)))
            inner = onnx.ModelProto()
            inner.CopyFrom(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", self.opset)]))
            g = inner.graph
            g.input.extend(onnx.helper.make_empty_tensor_value_info(name) for name in outer)
            sub = OnnxModule(inner, trainable=[], buffers=[], options=self.options, lazy=True)
            sub._device = self._device  # one device for the module and its subgraphs
            sub.random_streams = self.random_streams
            self.add_module(_sanitize(f"subgraph_{key}", set(dict(self.named_children())), self), sub)
            formal = sub.input_names[:len(sub.input_names) - len(outer)]

            def run(values, env, sub=sub, formal=formal, outer=outer):
                return sub(**dict(zip(formal, values)), **{name: env[name] for name in outer})
            self._subprograms[key] = SubProgram(run, outer)
        return self._subprograms[key]

    def _const_slot_key(self, name: str, value: torch.Tensor) -> str:
        """The buffer key of constant ``name`` on the module's device (registered once, shared by both programs)."""
        if name not in self._const_keys:
            key = _sanitize(name, self._const_taken, self.consts)
            self.consts.register_buffer(key, value.to(self._device.device), persistent=False)
            self._const_keys[name] = key
        return self._const_keys[name]

    def _compile(self, g: onnx.GraphProto, constants: dict[str, torch.Tensor], training: bool) -> _Program:
        """The program of ``g`` in one mode: resolve each node's kernel, fold what constants alone compute, assign
        slots to the rest, then free each slot after its last reader."""
        nodes = torch_forms(g, self.output_names)  # chains torch runs as one op (torch_forms.py)
        build = _ProgramBuilder(self, constants, training, _reader_counts(nodes))
        for node in nodes:
            build.add(node)
        slots = build.slots
        output_slots = [build.result_slot(name) for name in self.output_names]
        steps = _with_frees(build.steps, keep=set(output_slots))
        return _Program(steps, slots.template, slots.fills, slots.input_slots, output_slots)


class _Slots:
    """The layout of a program's environment while it is built: slot 0 holds None (absent inputs), slot 1 takes
    unread outputs, then one slot per parameter, buffer, graph input, runtime value, constant and device copy."""

    def __init__(self, module: OnnxModule):
        self.template: list[Any] = [None, None]  # slot values that never change (None, host constants)
        self.fills: list[tuple[int, dict, str]] = []  # slot <- container[key] at each call
        self.of: dict[str, int] = {}  # runtime values (parameters, buffers, inputs, node outputs)
        self.host: set[str] = set()  # the runtime values computed on the host (shape arithmetic)
        self.constants: dict[tuple[str, bool], int] = {}  # (constant, on the host) -> slot
        self.copies: dict[str, int] = {}  # host value -> the slot of its copy on the module's device
        for name, key in module.param_keys.items():
            self.of[name] = self.fill(module.weights._parameters, key)
        for name, key in module.buffer_keys.items():
            self.of[name] = self.fill(module.stats._buffers, key)
        self.input_slots = [self.new() for _ in module.input_names]
        self.of.update(zip(module.input_names, self.input_slots))

    def new(self, value: Any = None) -> int:
        self.template.append(value)
        return len(self.template) - 1

    def fill(self, store: dict, key: str) -> int:
        slot = self.new()
        self.fills.append((slot, store, key))
        return slot


class _ProgramBuilder:
    """Turns nodes, in topological order, into the steps of one program (``training``: the mode it is for)."""

    def __init__(self, module: OnnxModule, constants: dict[str, torch.Tensor], training: bool,
                 readers: dict[str, int]):
        self.module, self.training, self.readers = module, training, readers
        self.consts = dict(constants)  # grows with folded values
        self.wanted = set(module.output_names)
        self.slots = _Slots(module)
        self.steps: list[Step] = []

    def add(self, node: onnx.NodeProto) -> None:
        """The node's step, or its outputs as constants when constants alone compute it."""
        outs = node_outputs(node)
        kernel = self.kernel(node, outs)
        present = [node.input[i] if i < len(node.input) and node.input[i] else None for i in kernel.inputs]
        present += list(kernel.implicit)  # a subgraph's outer-scope reads
        for name in present:
            if name is not None and name not in self.consts and name not in self.slots.of:
                raise ValueError(f"node '{node_label(node)}' ({node.op_type}) reads '{name}', which no earlier node "
                                 "produces: the graph is not topologically sorted (run onnxfuse's toposort_pass)")
        if node.op_type not in RANDOM_OPS and all(n is None or n in self.consts for n in present):
            self.fold(node, kernel, present, outs)
            return
        on_host = node.op_type in HOST_OPS and all(n is None or n in self.consts or n in self.slots.host
                                                   for n in present)
        ins = tuple(self.input_slot(i, name, kernel, on_host)
                    for i, name in zip(list(kernel.inputs) + [-1] * len(kernel.implicit), present))
        out_slots = tuple(self.new_output_slot(o, on_host) for o in outs)
        self.steps.append(Step(kernel.fn, ins, out_slots[0] if len(outs) == 1 else out_slots, (), node_label(node)))

    def kernel(self, node: onnx.NodeProto, outs: list[str]) -> Kernel:
        """The node's kernel from its builder in ``OPS`` (a builder may return a bare callable of every input)."""
        m = self.module
        builder = OPS.lookup(node)
        if builder is None:
            where = op_names([op_key(node)])[0]
            raise UnsupportedTorchOpError(
                f"node '{node_label(node)}' ({where}, opset {m.opset}): op type '{where}' has no torch kernel. To "
                f"fix this, convert the fused graph before the ORT legalization, export the model without it, train "
                f"this array with --runtime ort, or add a builder to onnxfuse/runtime/torch/kernels/ (supported: "
                f"{', '.join(supported_ops())})")
        used = tuple(bool(o) and (self.readers.get(o, 0) > 0 or o in self.wanted) for o in outs)
        writable = tuple(bool(i) and i in m.buffer_keys and self.readers.get(i, 0) == 1 and i not in self.wanted
                         for i in node.input)
        device = m._device
        spec = NodeSpec.of(node, m.opset, [self.consts.get(i) if i else None for i in node.input],
                           training=self.training, options=m.options, writable=writable, used_outputs=used,
                           device=lambda: device.device, streams=m.random_streams,
                           subprogram=lambda graph: m.subprogram(graph, node_label(node)))
        try:
            kernel = builder(spec)
        except UnsupportedTorchOpError:
            raise
        except Exception as e:
            raise UnsupportedTorchOpError(f"node '{node_label(node)}' ({node.op_type}, opset {m.opset}): building "
                                          f"its torch kernel failed: {e}") from e
        return kernel if isinstance(kernel, Kernel) else Kernel(kernel, tuple(range(len(node.input))))

    def fold(self, node: onnx.NodeProto, kernel: Kernel, present: list[str | None], outs: list[str]) -> None:
        """Evaluate the node once, now, on its constant inputs: its outputs become constants."""
        try:
            with torch.no_grad():
                r = kernel.fn(*[self.consts[n] if n is not None else None for n in present])
        except Exception as e:
            raise UnsupportedTorchOpError(f"node '{node_label(node)}' ({node.op_type}, opset {self.module.opset}): "
                                          f"evaluating it on its constant inputs failed: {e}") from e
        for o, v in zip(outs, (r,) if len(outs) == 1 else r):
            if o and v is not None:
                self.consts[o] = v

    def input_slot(self, i: int, name: str | None, kernel: Kernel, on_host: bool) -> int:
        """The slot the kernel reads node input ``i`` (``name``) from."""
        if name is None:
            return _NONE
        if name in self.consts:
            return self.const_slot(name, on_host or i in kernel.host_inputs)
        slots = self.slots
        if name in slots.host and not on_host and i not in kernel.host_inputs:
            if name not in slots.copies:  # a host value read as data: copied to the device once
                slots.copies[name] = slots.new()
                device = self.module._device
                self.steps.append(Step(lambda t: t.to(device.device), (slots.of[name],), slots.copies[name], (),
                                       f"{name} to the device"))
            return slots.copies[name]
        return slots.of[name]

    def new_output_slot(self, name: str, on_host: bool) -> int:
        """A new slot for node output ``name`` (the trash slot for an absent one)."""
        if not name:
            return _TRASH
        self.slots.of[name] = self.slots.new()
        if on_host:
            self.slots.host.add(name)
        return self.slots.of[name]

    def const_slot(self, name: str, on_host: bool) -> int:
        """The slot of constant ``name``: in the template on the host, else a module buffer on its device."""
        slots = self.slots
        if (name, on_host) not in slots.constants:
            if on_host:
                slots.constants[name, on_host] = slots.new(self.consts[name])
            else:
                key = self.module._const_slot_key(name, self.consts[name])
                slots.constants[name, on_host] = slots.fill(self.module.consts._buffers, key)
        return slots.constants[name, on_host]

    def result_slot(self, name: str) -> int:
        """The slot ``forward`` returns graph output (or any named tensor) ``name`` from."""
        if name in self.slots.of:
            return self.slots.of[name]
        if name in self.consts:
            return self.const_slot(name, False)
        raise ValueError(f"output '{name}' is not a tensor of the graph")


def _reader_counts(nodes: Sequence[onnx.NodeProto]) -> dict[str, int]:
    """value -> how many node inputs read it."""
    readers: dict[str, int] = {}
    for n in nodes:
        for i in reads(n):  # a subgraph's outer-scope reads too
            if i:
                readers[i] = readers.get(i, 0) + 1
    return readers


def _step_io(step: Step) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return step.inputs, (step.outputs,) if step.outputs.__class__ is int else step.outputs


def _with_frees(steps: list[Step], keep: set[int]) -> list[Step]:
    """The steps, each freeing the slots it is the last to need (or produced unread); ``keep``: slots returned."""
    frees: dict[int, list[int]] = {}
    for slot, k in last_readers(steps, keep | {_TRASH}, io=_step_io).items():
        frees.setdefault(k, []).append(slot)
    return [s._replace(free=tuple(frees[k])) if k in frees else s for k, s in enumerate(steps)]


def _tensor(t: onnx.TensorProto) -> torch.Tensor:
    return torch.from_numpy(numpy_helper.to_array(t).copy())
