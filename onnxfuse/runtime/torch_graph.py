"""An ONNX graph (a fused array, before the ORT legalization) as a ``torch.nn.Module`` that torch autograd trains.

    module = OnnxModule.from_array(fa.model, fa.spec)    # or OnnxModule(model, trainable=[...], buffers=[...])
    logits, = module(input=x)                            # graph outputs, a tuple in graph order (output_names)
    module.parameter("conv1.weight")                     # the nn.Parameter of an ONNX initializer

- Trainable initializers are ``nn.Parameter``s in ``module.weights`` (a ParameterDict), buffers (BatchNorm
  running statistics, frozen weights) persistent buffers in ``module.stats``; ONNX names contain dots, so the keys
  are sanitized and ``param_keys`` / ``buffer_keys`` map the ONNX name to its key. Every other initializer, Constant
  node and node computable from them alone is a constant, evaluated once at build time (constant folding).
- Execution is a precomputed list of steps (kernel, input slots, output slots, slots to free) in the graph's
  topological order; a tensor is released as soon as its last reader has run. Kernels come from
  :mod:`torch_ops` (one builder per ONNX op); the forward pass parses no attribute.
- Shape arithmetic (Shape, and int ops over it and constants) runs on the host (CPU tensors), so reading a shape
  into a Reshape never synchronises a device; a host value read as data is copied to the module's device once.
- ``module.train()`` / ``module.eval()`` switch between two programs: training-mode BatchNorm uses batch statistics
  and updates the running ones (torch's rule: :func:`torch_ops.batch_norm`), Dropout drops; in eval mode
  BatchNorm uses the running statistics and Dropout is the identity (as torch modules do).
- Works on any device (``.to(device)``) and with channels-last tensors (kernels never assume contiguity).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import onnx
import torch
from onnx import numpy_helper

from onnxfuse.core._opset import onnx_opset
from onnxfuse.core.source import FLOAT_TYPES, METADATA_KEY

from onnxfuse.runtime.torch_kernels import (HOST_OPS, OPS, RANDOM_OPS, Kernel, NodeSpec, TorchOptions,
                                            UnsupportedTorchOpError, supported_ops)

__all__ = ["OnnxModule", "TorchOptions", "UnsupportedTorchOpError"]

_NONE, _TRASH = 0, 1  # slot 0 always holds None (absent inputs); unread outputs may be written to slot 1


class _Store(torch.nn.Module):
    """A container of buffers under sanitized names."""


class _DeviceRef:
    device = torch.device("cpu")


@dataclass
class _Program:
    steps: list[tuple]  # (fn, input slots, output slot | tuple of slots, slots to free)
    n_slots: int
    template: list  # slot values that never change (None, host constants)
    fills: list[tuple[int, dict, str]]  # slot <- container[key] at each call (parameters, buffers, device consts)
    input_slots: list[int]
    output_slots: list[int]


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
    and returns a tuple in ``output_names`` order (host-side shape values come back as CPU tensors).
    """

    def __init__(self, model: onnx.ModelProto, trainable: Collection[str] | None = None,
                 buffers: Collection[str] | None = None, outputs: Sequence[str] | None = None,
                 options: TorchOptions | None = None):
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
        constants = {n: _tensor(t) for n, t in inits.items() if n not in self.param_keys and n not in self.buffer_keys}
        self._const_keys: dict[str, str] = {}
        self._const_taken: set[str] = set()
        self._programs = {mode: self._compile(g, constants, mode) for mode in (True, False)}

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
        p = self._programs[self.training]
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
        for fn, ins, out, free in p.steps:
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
    def _const_slot_key(self, name: str, value: torch.Tensor) -> str:
        """The buffer key of constant ``name`` on the module's device (registered once, shared by both programs)."""
        if name not in self._const_keys:
            key = _sanitize(name, self._const_taken, self.consts)
            self.consts.register_buffer(key, value, persistent=False)
            self._const_keys[name] = key
        return self._const_keys[name]

    def _compile(self, g: onnx.GraphProto, constants: dict[str, torch.Tensor], training: bool) -> _Program:
        consts = dict(constants)  # grows with folded values
        readers: dict[str, int] = {}
        for n in g.node:
            for i in n.input:
                if i:
                    readers[i] = readers.get(i, 0) + 1
        wanted = set(self.output_names)
        n_slots = 2
        slot_of: dict[str, int] = {}  # runtime values
        host: set[str] = set()
        host_const: dict[str, int] = {}
        dev_const: dict[str, int] = {}
        xfer: dict[str, int] = {}
        template: list[Any] = [None, None]
        fills: list[tuple[int, dict, str]] = []
        steps: list[list] = []

        def new_slot(value=None) -> int:
            nonlocal n_slots
            n_slots += 1
            template.append(value)
            return n_slots - 1

        for name, key in self.param_keys.items():
            slot_of[name] = new_slot()
            fills.append((slot_of[name], self.weights._parameters, key))
        for name, key in self.buffer_keys.items():
            slot_of[name] = new_slot()
            fills.append((slot_of[name], self.stats._buffers, key))
        input_slots = []
        for name in self.input_names:
            slot_of[name] = new_slot()
            input_slots.append(slot_of[name])

        def const_slot(name: str, on_host: bool) -> int:
            table = host_const if on_host else dev_const
            if name not in table:
                if on_host:
                    table[name] = new_slot(consts[name])
                else:
                    table[name] = new_slot()
                    fills.append((table[name], self.consts._buffers, self._const_slot_key(name, consts[name])))
            return table[name]

        device = self._device
        for node in g.node:
            if node.domain not in ("", "ai.onnx") or node.op_type not in OPS:
                where = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
                raise UnsupportedTorchOpError(
                    f"node '{node.name or node.output[0]}' ({where}, opset {self.opset}): op type '{where}' has no "
                    f"torch kernel. To fix this, convert the fused graph before the ORT legalization, export the model "
                    f"without it, train this array with --runtime ort, or add a builder to "
                    f"onnxfuse/training/torch_ops.py (supported: {', '.join(supported_ops())})")
            outs = list(node.output)
            while len(outs) > 1 and not outs[-1]:
                outs.pop()
            used = tuple(bool(o) and (readers.get(o, 0) > 0 or o in wanted) for o in outs)
            writable = tuple(bool(i) and i in self.buffer_keys and readers.get(i, 0) == 1 and i not in wanted
                             for i in node.input)
            spec = NodeSpec.of(node, self.opset, [consts.get(i) if i else None for i in node.input],
                               training=training, options=self.options, writable=writable, used_outputs=used,
                               device=lambda: device.device)
            try:
                kernel = OPS[node.op_type](spec)
            except UnsupportedTorchOpError:
                raise
            except Exception as e:
                raise UnsupportedTorchOpError(f"node '{node.name}' ({node.op_type}, opset {self.opset}): building "
                                              f"its torch kernel failed: {e}") from e
            if not isinstance(kernel, Kernel):
                kernel = Kernel(kernel, tuple(range(len(node.input))))
            present = [node.input[i] if i < len(node.input) and node.input[i] else None for i in kernel.inputs]
            for name in present:
                if name is not None and name not in consts and name not in slot_of:
                    raise ValueError(f"node '{node.name}' ({node.op_type}) reads '{name}', which no earlier node "
                                     "produces: the graph is not topologically sorted (run onnxfuse's toposort_pass)")
            if node.op_type not in RANDOM_OPS and all(n is None or n in consts for n in present):
                try:
                    with torch.no_grad():
                        r = kernel.fn(*[consts[n] if n is not None else None for n in present])
                except Exception as e:
                    raise UnsupportedTorchOpError(f"node '{node.name}' ({node.op_type}, opset {self.opset}): "
                                                  f"evaluating it on its constant inputs failed: {e}") from e
                for o, v in zip(outs, (r,) if len(outs) == 1 else r):
                    if o and v is not None:
                        consts[o] = v
                continue
            on_host = node.op_type in HOST_OPS and all(n is None or n in consts or n in host for n in present)
            ins = []
            for i, name in zip(kernel.inputs, present):
                if name is None:
                    ins.append(_NONE)
                elif name in consts:
                    ins.append(const_slot(name, on_host or i in kernel.host_inputs))
                elif name in host and not on_host and i not in kernel.host_inputs:
                    if name not in xfer:  # a host value read as data: copied to the device once
                        xfer[name] = new_slot()
                        steps.append([lambda t: t.to(device.device), (slot_of[name],), xfer[name], ()])
                    ins.append(xfer[name])
                else:
                    ins.append(slot_of[name])
            out_slots = []
            for o in outs:
                if o:
                    slot_of[o] = new_slot()
                    if on_host:
                        host.add(o)
                    out_slots.append(slot_of[o])
                else:
                    out_slots.append(_TRASH)
            steps.append([kernel.fn, tuple(ins), out_slots[0] if len(outs) == 1 else tuple(out_slots), ()])

        output_slots = []
        for name in self.output_names:
            if name in slot_of:
                output_slots.append(slot_of[name])
            elif name in consts:
                output_slots.append(const_slot(name, False))
            else:
                raise ValueError(f"output '{name}' is not a tensor of the graph")
        # free each intermediate slot after its last reader (or right after its producer when nobody reads it)
        produced = {}
        for k, st in enumerate(steps):
            for s in ((st[2],) if isinstance(st[2], int) else st[2]):
                if s != _TRASH:
                    produced[s] = k
        last = dict(produced)
        for k, st in enumerate(steps):
            for s in st[1]:
                if s in last:
                    last[s] = max(last[s], k)
        keep = set(output_slots)
        frees: dict[int, list[int]] = {}
        for s, k in last.items():
            if s not in keep:
                frees.setdefault(k, []).append(s)
        final = [(fn, ins, out, tuple(frees.get(k, ()))) for k, (fn, ins, out, _) in enumerate(steps)]
        return _Program(final, n_slots, template, fills, input_slots, output_slots)


def _tensor(t: onnx.TensorProto) -> torch.Tensor:
    return torch.from_numpy(numpy_helper.to_array(t).copy())
