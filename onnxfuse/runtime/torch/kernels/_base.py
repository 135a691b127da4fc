"""What every kernel builder uses: the registry ``OPS`` (op type -> builder), the :class:`NodeSpec` a builder
reads, the :class:`Kernel` it returns, and small helpers. The builders themselves are one module per op family
beside this one, as the fusion rules are (``core/rules/``)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from onnxfuse.core._graph import node_label
from onnxfuse.core.errors import OnnxFuseError
from onnxfuse.core.registry import Registry


class UnsupportedTorchOpError(OnnxFuseError):
    """A node the torch runtime cannot run (an op type without a builder, or an attribute form it does not cover)."""


class Kernel(NamedTuple):
    fn: Callable[..., Any]
    inputs: tuple[int, ...]  # the node inputs fn takes, in this order (an absent optional input is passed as None)
    host_inputs: tuple[int, ...] = ()  # of those, the ones fn reads as values (.tolist()): best kept on the host
    implicit: tuple[str, ...] = ()  # outer-scope tensors its subgraphs read, passed after the inputs, in this order


@dataclass(frozen=True)
class TorchOptions:
    """Choices that are not ONNX attributes.

    update_stats: a training-mode BatchNorm whose running statistics are buffers of the module updates them in
        place during the forward pass, as ``torch.nn.BatchNorm*`` does; otherwise it leaves them and only returns
        the new values (outputs 1 and 2), for a runtime that writes them itself.
    running_var: "unbiased" (torch's rule, what the ORT runtime's ``batchnorm_pass`` writes: the batch variance
        times n/(n-1)) or "biased" (the ONNX specification's).
    """

    update_stats: bool = True
    running_var: str = "unbiased"


@dataclass
class NodeSpec:
    """What a builder may read: the node, its opset, decoded attributes and the constant inputs."""

    node: onnx.NodeProto
    opset: int
    attrs: dict[str, Any]
    consts: list[torch.Tensor | None]  # per input: its value when it is a constant, else None
    training: bool = True  # built for module.train() (True) or module.eval()
    options: TorchOptions = field(default_factory=TorchOptions)
    writable: tuple[bool, ...] = ()  # per input: a module buffer that this node alone reads (may update in place)
    used_outputs: tuple[bool, ...] = ()  # per output: read by another node or returned
    device: Callable[[], torch.device] = lambda: torch.device("cpu")  # the module's device, for new tensors
    # the generator a random op with ``seed`` draws from (its own stream, kept by the module across programs and
    # checkpoints); None without a seed: torch's global generator, as torch's own random functions draw
    streams: "RandomStreams | None" = None
    # compiles one of the node's subgraphs (If branches, Loop and Scan bodies) into a callable of its inputs and its
    # outer-scope reads (by name) that returns its outputs as a tuple (the module's ``subprogram``)
    subprogram: "Callable[[onnx.GraphProto], SubProgram] | None" = None

    def generator(self) -> torch.Generator | None:
        """The generator this random node draws from on the module's device (None: torch's global one)."""
        seed = self.attr("seed")
        if seed is None or self.streams is None:
            return None
        return self.streams.get(node_label(self.node), float(seed), self.device())

    @classmethod
    def of(cls, node: onnx.NodeProto, opset: int, consts: Sequence[torch.Tensor | None] = (), **kw) -> "NodeSpec":
        attrs = {a.name: _attr_value(a) for a in node.attribute}
        consts = list(consts) + [None] * (len(node.input) - len(consts))
        kw.setdefault("used_outputs", tuple(bool(o) for o in node_outputs(node)))
        return cls(node, opset, attrs, consts, **kw)

    @property
    def n_outputs(self) -> int:
        """Outputs the kernel returns: one tensor when 1, else a tuple of this length (None where unread)."""
        return len(self.used_outputs)

    @property
    def op_type(self) -> str:
        return self.node.op_type

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def has(self, i: int) -> bool:
        return i < len(self.node.input) and bool(self.node.input[i])

    def const(self, i: int) -> torch.Tensor | None:
        return self.consts[i] if self.has(i) else None

    def ints(self, i: int) -> list[int] | None:
        """Constant input i as a list of ints (None when absent or computed at run time)."""
        c = self.const(i)
        return None if c is None else [int(v) for v in c.reshape(-1).tolist()]

    def scalar(self, i: int, default=None):
        """Constant input i as a Python number; ``default`` when absent."""
        if not self.has(i):
            return default
        c = self.const(i)
        return None if c is None else c.reshape(-1)[0].item()

    def fail(self, problem: str, fix: str) -> None:
        raise UnsupportedTorchOpError(
            f"node '{node_label(self.node)}' ({self.op_type}, opset {self.opset}): {problem}. "
            f"To fix this, {fix}")

    def need_const(self, i: int, what: str) -> None:
        if self.has(i) and self.const(i) is None:
            self.fail(f"its {what} (input {i}) is computed at run time, and the torch runtime needs it constant",
                      "make it a constant in the model, or train this array with --runtime ort")


class SubProgram(NamedTuple):
    """A compiled subgraph: ``run(inputs, outer)`` -> its outputs; ``outer``: the outer-scope names it reads."""
    run: Callable[[Sequence[Any], dict[str, Any]], tuple]
    outer: tuple[str, ...]


class RandomStreams:
    """The generators of a module's random nodes that carry a ``seed``: one per node, seeded from the node's seed
    (and ``base``, the run's seed), created on first use on the device drawn on. A model's node in a fused array
    has its own seed (the fusion's per-model random nodes), so what each model draws does not depend on B or on its
    place in the array. ``state()`` / ``load()`` carry them through a checkpoint."""

    def __init__(self, base: int = 0):
        self.base = base
        self.streams: dict[str, torch.Generator] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def get(self, label: str, seed: float, device: torch.device) -> torch.Generator:
        g = self.streams.get(label)
        if g is None or g.device != torch.device(device):
            g = torch.Generator(device=device)
            # the node's seed (a float: ONNX's attribute type) and the run's, hashed: torch's CPU generator keeps
            # only the low 32 bits of a seed, where float seeds such as 3.0 and 4.0 do not differ
            digest = hashlib.blake2b(np.array([seed], np.float64).tobytes() + str(self.base).encode(), digest_size=8)
            g.manual_seed(int.from_bytes(digest.digest(), "little") & (2 ** 63 - 1))
            if label in self._pending:
                g.set_state(self._pending.pop(label))
            self.streams[label] = g
        return g

    def state(self) -> dict[str, torch.Tensor]:
        return {label: g.get_state() for label, g in self.streams.items()} | dict(self._pending)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Restore streams (applied at each stream's next use, when it is created on its device)."""
        self.streams.clear()
        self._pending = dict(state)


def node_outputs(node: onnx.NodeProto) -> list[str]:
    """The outputs a kernel of ``node`` returns: the node's, without trailing absent ones (at least one)."""
    outs = list(node.output)
    while len(outs) > 1 and not outs[-1]:
        outs.pop()
    return outs


Builder = Callable[[NodeSpec], "Kernel | Callable"]
OPS: Registry[Builder] = Registry("torch kernel")

# Ops whose outputs are small shape-like values when their inputs are (torch_graph keeps those on the host).
HOST_OPS = frozenset({
    "Shape", "Size", "Gather", "Concat", "Slice", "Unsqueeze", "Squeeze", "Reshape", "Cast", "Add", "Sub", "Mul",
    "Div", "Mod", "Neg", "Abs", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or",
    "Where", "Max", "Min", "ReduceProd", "ReduceSum", "ReduceMax", "ReduceMin", "Identity", "Floor", "Ceil", "Sqrt",
    "Flatten", "Transpose", "Expand", "Tile", "Sign", "CastLike",
})
# Ops never evaluated at build time even on constant inputs.
RANDOM_OPS = frozenset({"Dropout", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                        "Bernoulli", "Multinomial"})


def op(*op_types: str):
    """Register the decorated builder for ``op_types`` (default domain)."""
    return OPS.register(*op_types)


def supported_ops() -> list[str]:
    return OPS.names()


def _attr_value(a: onnx.AttributeProto) -> Any:
    if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return a  # subgraphs: no builder here reads them
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, onnx.TensorProto):
        return torch.from_numpy(numpy_helper.to_array(v).copy())
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [s.decode() for s in v]
    return v


_DTYPES = {
    onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16, onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT64: torch.int64, onnx.TensorProto.INT32: torch.int32, onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT8: torch.int8, onnx.TensorProto.UINT8: torch.uint8, onnx.TensorProto.BOOL: torch.bool,
    onnx.TensorProto.UINT16: torch.uint16, onnx.TensorProto.UINT32: torch.uint32, onnx.TensorProto.UINT64: torch.uint64,
}


def torch_dtype(elem_type: int) -> torch.dtype:
    if elem_type not in _DTYPES:
        raise UnsupportedTorchOpError(f"ONNX element type {onnx.TensorProto.DataType.Name(elem_type)} has no torch "
                                      "dtype here; use float32 data and int64/bool shape tensors")
    return _DTYPES[elem_type]


def kern(fn, *inputs: int, host: Sequence[int] = ()) -> Kernel:
    return Kernel(fn, tuple(inputs), tuple(host))


def all_inputs(spec: NodeSpec) -> tuple[int, ...]:
    return tuple(range(len(spec.node.input)))


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def identity(x):
    return x


def autocast_lowered(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` as torch.autocast hands them to an op it runs in lower precision (``prelu``, ...): the floating
    ones cast to the autocast dtype while autocast is on for their device, else as they are. For a kernel that
    computes such an op with other torch ops, which autocast would leave in their inputs' precision."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def axes_of(spec: NodeSpec, since: int) -> tuple[list[int] | None, bool]:
    """(axes, given): from the attribute before opset ``since``, from input 1 from then on."""
    if spec.opset < since:
        a = spec.attr("axes")
        return (None if a is None else [int(v) for v in a]), a is not None
    if not spec.has(1):
        return None, False
    spec.need_const(1, "axes")
    return spec.ints(1), True
