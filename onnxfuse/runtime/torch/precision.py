"""Mixed precision for the torch runtime (``--precision``): what runs in which precision, and fp16's loss scale
per model.

    fp32   everything in float32 (no autocast)
    bf16   the forward (the fused graph and the loss) under ``torch.autocast(device, torch.bfloat16)``: the ops
           autocast lists as lower-precision (convolutions, matmuls, linear) run in bfloat16, the others in the
           precision of their inputs, the ones it lists as float32 in float32, exactly as for each model alone
           under the same autocast; gradients reach the weights in float32
    fp16   the same in float16, with each model's loss multiplied by its own scale (:class:`LossScales`)

The weights, optimizer state and BatchNorm running statistics stay float32 (master weights), and the update is
the fp32 update graph on float32 gradients: autocast casts a weight's copy for the ops that use it, and the
gradient flows back through that cast.

A CPU without native bf16 / fp16 arithmetic (no AVX512_BF16 or AMX: ``runtime._machine.native_low_precision``)
emulates it, converting around every op, and trains several times slower than in fp32: the first bf16 / fp16
step of a process on such a CPU warns once with the slow-down measured here (:func:`warn_if_emulated`).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from typing import Collection, Sequence

import onnx
import torch
from onnx import helper

from onnxfuse.core._graph import Names
from onnxfuse.runtime._machine import NATIVE_FLAGS, cpu_description, native_low_precision

from onnxfuse.recipe.runtimes import LossScale

__all__ = ["DTYPES", "DOMAIN", "autocast", "autocast_graph", "LossScales", "biased_products", "norms_in_fp32",
           "fills_like_their_source",
           "loss_in_fp32", "emulation_slowdown", "warn_if_emulated"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DOMAIN = "onnxfuse.torch"  # the torch runtime's own ops (biased_products' MatMulAdd)


def autocast_graph(model: onnx.ModelProto, state: Collection[str]) -> onnx.ModelProto:
    """The fused graph as the torch runtime runs it, so that under autocast each model computes what it computes
    alone under the same autocast (:func:`biased_products`, :func:`norms_in_fp32`); without autocast it computes
    the same float32 bits as ``model``. ``state``: the array's trained and state tensors (not constants, whatever
    their values now: a LayerNorm's weight starts at ones)."""
    return fills_like_their_source(norms_in_fp32(biased_products(model), state))


def biased_products(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` where each ``MatMul -> Add(bias)`` (the bias an initializer, the product read by the
    Add alone) is one ``MatMulAdd`` node (domain :data:`DOMAIN`, the torch runtime's: ``torch.baddbmm``).

    Under autocast, ``nn.Linear`` (torch's ``linear``) adds its bias inside the product and rounds once to bf16 /
    fp16; the fused graph computes a Linear as a batched MatMul and an Add. Run as two ops, the product rounds to
    bf16 and the Add then either rounds again (a bias cast to bf16: every output element is off by up to an ulp,
    as far from the model alone as fp32 is) or promotes to fp32 (a float32 bias: every later op runs in fp32
    where the model alone runs in bf16). ``baddbmm`` is the Linear's arithmetic (the same values as ``linear``
    up to summation order, measured) and autocast lowers it as it lowers ``linear``."""
    model = copy.deepcopy(model)
    graph = model.graph
    weights = {t.name for t in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for i in node.input:
            readers[i] = readers.get(i, 0) + 1
    for o in graph.output:
        readers[o.name] = readers.get(o.name, 0) + 1
    products = {n.output[0]: n for n in graph.node if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")}
    names = Names.of(graph)
    merged, nodes = set(), []
    for node in graph.node:
        if node.op_type == "Add" and node.domain in ("", "ai.onnx") and len(node.input) == 2:
            for k in (0, 1):
                bias, product = node.input[k], node.input[1 - k]
                matmul = products.get(product)
                if bias in weights and matmul is not None and readers.get(product) == 1:
                    node = helper.make_node("MatMulAdd", [*matmul.input, bias], list(node.output), domain=DOMAIN,
                                            name=names.fresh(f"{matmul.name or product}/with_bias"))
                    merged.add(id(matmul))
                    break
        nodes.append(node)
    if merged:
        del graph.node[:]
        graph.node.extend(n for n in nodes if id(n) not in merged)
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


NORMS = ("LayerNormalization", "InstanceNormalization", "GroupNormalization")
_SHAPE_OPS = ("Reshape", "Transpose", "Unsqueeze", "Squeeze", "Flatten", "Identity")


def norms_in_fp32(model: onnx.ModelProto, state: Collection[str]) -> onnx.ModelProto:
    """A copy of ``model`` where each normalization whose affine the fusion moved out of it (``LayerNorm(x, 1, 0)
    -> [shape ops] -> Mul(weight) [-> shape ops] -> Add(bias)``: a fused LayerNorm's or GroupNorm's per-model
    affine) runs in float32 from its input to its bias and is cast back to its input's dtype once: ``Cast(x, FLOAT)``
    before the normalization, ``CastLike(.., x)`` after the affine.

    A bf16 / fp16 input to ``nn.LayerNorm`` or ``nn.GroupNorm`` on its own is normalized, scaled and shifted in
    float32 and rounded once (torch's mixed-dtype kernels); the fused chain would round the normalized values
    before the affine, then promote to float32 at the float32 weight (every later op in float32 where the model
    alone runs bf16). Without autocast both casts leave float32 as it is: the same bits as the graph without them.

    A LayerNorm read by its Mul and Add directly is one ``LayerNormAffine`` node instead (domain :data:`DOMAIN`):
    under autocast each model's ``F.layer_norm`` with its own weight and bias, torch's mixed-dtype kernel itself,
    whose gradient of the weight and bias from a bf16 input is not float32's (measured on this CPU: 3 % apart)."""
    model = copy.deepcopy(model)
    graph = model.graph
    readers: dict[str, list] = {}
    for node in graph.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    outputs = {o.name for o in graph.output}

    def sole_reader(name):
        r = readers.get(name, [])
        return r[0] if len(r) == 1 and name not in outputs else None

    def follow(name):  # through shape ops read alone: (the value, its sole reader)
        node = sole_reader(name)
        while node is not None and node.op_type in _SHAPE_OPS and node.input[0] == name:
            name, node = node.output[0], sole_reader(node.output[0])
        return name, node

    constant = _constant_values(graph, set(state))
    names = Names.of(graph)
    casts, fused = [], []
    for norm in [n for n in graph.node if n.op_type in NORMS and n.domain in ("", "ai.onnx")]:
        if len(norm.input) < 3 or not constant(norm.input[1], 1.0) or not constant(norm.input[2], 0.0):
            continue
        _, mul = follow(norm.output[0])
        if mul is None or mul.op_type != "Mul":
            continue
        end = mul.output[0]
        _, add = follow(end)
        if add is not None and add.op_type == "Add":
            end = add.output[0]
        x = norm.input[0]
        if constant(mul.input[1], 1.0) and (add is None or constant(add.input[1], 0.0)):
            # no affine (ones and zeros): identities, which would promote a bf16 normalization to float32
            for node in (mul, add) if add is not None else (mul,):
                identity = helper.make_node("Identity", [node.input[0]], list(node.output), name=node.name)
                node.CopyFrom(identity)
            continue
        if (norm.op_type == "LayerNormalization" and add is not None and mul.input[0] == norm.output[0]
                and add.input[0] == mul.output[0] and not any(norm.output[1:])):
            attrs = {a.name: helper.get_attribute_value(a) for a in norm.attribute if a.name in ("axis", "epsilon")}
            fused.append((norm, mul, add, helper.make_node(
                "LayerNormAffine", [x, mul.input[1], add.input[1]], [end], domain=DOMAIN,
                name=names.fresh(f"{norm.name or x}/with_affine"), **attrs)))
            continue
        wide_x, wide_end = names.fresh(f"{x}_fp32"), names.fresh(f"{end}_fp32")
        producer = next(n for n in graph.node if end in n.output)
        producer.output[:] = [wide_end if o == end else o for o in producer.output]
        norm.input[0] = wide_x
        casts.append((norm, helper.make_node("Cast", [x], [wide_x], to=onnx.TensorProto.FLOAT,
                                             name=names.fresh(f"{norm.name or x}/in_fp32"))))
        casts.append((producer, helper.make_node("CastLike", [wide_end, x], [end],
                                                 name=names.fresh(f"{norm.name or x}/affine_rounded_once"))))
    for anchor, cast in casts:  # the input's Cast before its normalization, the CastLike after its producer
        at = list(graph.node).index(anchor)
        graph.node.insert(at if cast.op_type == "Cast" else at + 1, cast)
    for norm, mul, add, node in fused:  # LayerNorm -> Mul -> Add as one node where the Add was: the weight and
        add.CopyFrom(node)                # bias it reads may be made after the LayerNorm (an Unsqueeze of a merged
        for old in (norm, mul):           # weight's Identity), never after the Add
            graph.node.remove(old)
    if fused and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def fills_like_their_source(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` in which what torch's ``*_like`` functions exported takes its source's dtype again:
    ``ConstantOfShape(Shape(x))`` of a float value (``zeros_like``, ``ones_like``, ``full_like``) is followed by
    ``CastLike(., x)``, and ``RandomNormalLike`` / ``RandomUniformLike`` of a float x lose the ``dtype`` the export
    traced (ONNX then takes x's).

    The exporter writes the dtype it saw (float32); under autocast x may be bf16 / fp16, where ``torch.zeros_like(x)``
    is too: the fill would promote the ops it meets to float32 (or a scatter into it would refuse bf16 updates),
    where the model alone stays in bf16. Without autocast x is float32 and the casts leave it as it is."""
    model = copy.deepcopy(model)
    graph = model.graph
    made = {o: n for n in graph.node for o in n.output}
    names = Names.of(graph)
    after = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type in ("RandomNormalLike", "RandomUniformLike"):
            dtype = next((a for a in node.attribute if a.name == "dtype"), None)
            if dtype is not None and dtype.i == onnx.TensorProto.FLOAT:
                node.attribute.remove(dtype)
            continue
        if node.op_type != "ConstantOfShape" or not node.input:
            continue
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        if value is None or value.data_type not in _FLOATS:
            continue  # a fill of ints or bools, or one without value (no *_like export writes that)
        source = _shape_source(node.input[0], made)
        if source is None:
            continue
        out, wide = node.output[0], names.fresh(f"{node.output[0]}_fill")
        node.output[0] = wide
        after.append((node, helper.make_node("CastLike", [wide, source], [out],
                                             name=names.fresh(f"{node.name or out}/like_its_source"))))
    for anchor, cast in after:
        graph.node.insert(list(graph.node).index(anchor) + 1, cast)
    return model


# what a shape is computed with from Shape(x) (the fusion's Shape rule slices the fused tensor's shape per model)
_SHAPE_ARITHMETIC = ("Slice", "Gather", "Concat", "Squeeze", "Unsqueeze", "Cast", "Identity", "Mul", "Div", "Add",
                     "Sub", "Reshape")


def _shape_source(name: str, made: dict, depth: int = 0) -> str | None:
    """The one tensor x whose ``Shape`` the shape ``name`` is computed from (through shape arithmetic), else None."""
    node = made.get(name)
    if node is None or depth > 8:
        return None
    if node.op_type == "Shape":
        return node.input[0]
    if node.op_type not in _SHAPE_ARITHMETIC:
        return None
    found = {_shape_source(i, made, depth + 1) for i in node.input if i and i in made}
    found.discard(None)
    return found.pop() if len(found) == 1 else None


_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)


def _constant_values(graph: onnx.GraphProto, state: set):
    """``is_filled(name, v)``: whether ``name`` is a constant whose every element is ``v`` (an initializer not in
    ``state``, a Constant node, or shape ops / Tile / Expand of one)."""
    from onnx import numpy_helper

    values = {t.name: t for t in graph.initializer if t.name not in state}
    made = {o: n for n in graph.node for o in n.output}

    def filled(name, v, depth=0):
        if name in values:
            return bool((numpy_helper.to_array(values[name]) == v).all())
        node = made.get(name)
        if node is None or depth > 8:
            return False
        if node.op_type == "Constant":
            attr = next((a for a in node.attribute if a.name == "value"), None)
            return attr is not None and bool((numpy_helper.to_array(attr.t) == v).all())
        if node.op_type in _SHAPE_OPS + ("Tile", "Expand"):
            return filled(node.input[0], v, depth + 1)
        return False
    return filled


def loss_in_fp32(model: onnx.ModelProto, output: str) -> onnx.ModelProto:
    """A copy of ``model`` whose nodes reading ``output`` (the fused model's output: the loss graph's nodes) read it
    cast to float32. torch.autocast runs its losses (``cross_entropy``, ``nll_loss``, ``mse_loss``, ``l1_loss``,
    ``binary_cross_entropy_with_logits``) in float32; the loss graph is ONNX ops (LogSoftmax, ...), which would
    run in the bf16 / fp16 of the logits."""
    model = copy.deepcopy(model)
    graph = model.graph
    readers = [n for n in graph.node if output in n.input]
    if not readers:
        return model
    names = Names.of(graph)
    wide = names.fresh(f"{output}_fp32")
    at = next(k for k, n in enumerate(graph.node) if output in n.input)
    for node in readers:
        node.input[:] = [wide if i == output else i for i in node.input]
    graph.node.insert(at, helper.make_node("Cast", [output], [wide], to=onnx.TensorProto.FLOAT,
                                           name=names.fresh(f"{output}/loss_in_fp32")))
    return model


def autocast(precision: str, device: torch.device):
    """The context the forward runs in for ``precision`` (``torch.autocast``; fp32: none)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


@functools.cache
def emulation_slowdown(precision: str) -> float:
    """How many times a float32 step's time a small training step takes under ``torch.autocast("cpu", dtype)``
    here: a 3x3 convolution and a matmul, forward and backward, at torch's thread count now; the fastest of 3
    timed runs each way, after one untimed. Measured once per process (~0.2 s where the dtype is emulated)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, 16, 16, generator=generator)
    kernel = torch.randn(32, 16, 3, 3, generator=generator, requires_grad=True)
    weight = torch.randn(512, 128, generator=generator, requires_grad=True)

    def step(p: str) -> float:
        t0 = time.perf_counter()
        with torch.enable_grad(), autocast(p, torch.device("cpu")):
            y = torch.nn.functional.conv2d(x, kernel, padding=1).reshape(128, 512) @ weight
        y.float().square().mean().backward()
        return time.perf_counter() - t0

    def fastest(p: str) -> float:
        return min([step(p) for _ in range(4)][1:])  # the first run allocates and picks kernels

    return fastest(precision) / fastest("fp32")


_WARNED: set[str] = set()  # the precisions warned about in this process


def warn_if_emulated(precision: str, device: torch.device) -> None:
    """On a CPU device without native ``precision`` arithmetic, warn once per process with the slow-down measured
    here (:func:`emulation_slowdown`); fp32, a GPU, or a CPU with AVX512_BF16 / AMX: nothing."""
    if precision == "fp32" or device.type != "cpu" or precision in _WARNED:
        return
    dtype_name = str(DTYPES[precision]).removeprefix("torch.")
    if native_low_precision(dtype_name):
        return
    _WARNED.add(precision)
    factor = emulation_slowdown(precision)
    # the probe's steps (a convolution and a matmul), not the run's: a model of other ops converts less or more
    # (the demo's LeNet array: 3.2x on an AVX2 EPYC where the probe measures ~17x), so the line says which it timed
    measured = (f"a convolution and a matmul ran {factor:.1f}x slower in {precision} than in float32 here (a whole "
                f"step's factor differs: onnxfuse bench --precision fp32,{precision} times yours); use --precision fp32"
                if factor >= 1 else
                f"a convolution and a matmul ran {1 / factor:.1f}x faster in {precision} than in float32 here even so")
    logging.getLogger("onnxfuse.train").warning(
        "this CPU (%s) has no native %s (no %s): %s", cpu_description(), dtype_name,
        "/".join(NATIVE_FLAGS[dtype_name]), measured)


class LossScales:
    """torch.amp.GradScaler with one scale per model (``LossScale`` holds the settings), on the device:

        scaled(per_model)   the summed loss to differentiate, each model's loss times its scale
        unscale(grads)      each model's gradients divided by its scale, and ``found`` [B]: whose gradient
                            overflowed (a non-finite element, as GradScaler checks the scaled gradients)
        update(found, active)  GradScaler.update for each active model: overflow multiplies the scale by
                            ``backoff`` and restarts the count; ``interval`` steps without one multiply it by
                            ``growth`` (when the result is finite). A model not active keeps its scale.

    The arithmetic is GradScaler's: the inverse scale is ``1 / scale`` in float64 rounded to float32, the
    gradients are multiplied by it in float32, and a new scale is the float64 product rounded to float32."""

    def __init__(self, config: LossScale, device: torch.device):
        self.config = config
        self.scale = torch.tensor(config.init, dtype=torch.float32, device=device)
        self.tracker = torch.zeros(len(config.init), dtype=torch.int32, device=device)

    @property
    def B(self) -> int:
        return self.scale.numel()

    def scaled(self, per_model: torch.Tensor) -> torch.Tensor:
        return (per_model.float() * self.scale).sum()

    def unscale(self, grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        B = self.B
        inv = self.scale.double().reciprocal().float().reshape(B, 1)
        finite, out = None, []
        for g in grads:  # model-major: model b's part of every fused tensor is row b of its [B, -1] view
            rows = g.reshape(B, -1)
            ok = rows.isfinite().all(1)
            finite = ok if finite is None else finite & ok
            out.append((rows * inv).reshape(g.shape))
        return out, ~finite

    def update(self, found: torch.Tensor, active: torch.Tensor) -> None:
        c = self.config
        scale, tracker = self.scale, self.tracker
        count = tracker + 1
        grows = count == c.interval
        grown = (scale.double() * c.growth).float()
        grown = torch.where(grown.isfinite(), grown, scale)
        backed = (scale.double() * c.backoff).float()
        new_scale = torch.where(found, backed, torch.where(grows, grown, scale))
        new_tracker = torch.where(found | grows, torch.zeros_like(tracker), count)
        self.scale.copy_(torch.where(active, new_scale, scale))
        self.tracker.copy_(torch.where(active, new_tracker, tracker))

    def at_minimum(self) -> torch.Tensor:
        """[B]: the models whose scale is at ``LossScale.MIN`` or below (an overflow there is a divergence)."""
        return self.scale <= LossScale.MIN

    # ---- state (a checkpoint's record: plain lists, exact for float32 values)
    def state(self) -> dict:
        return {"scale": self.scale.cpu().tolist(), "tracker": self.tracker.cpu().tolist()}

    def load(self, state: dict, keep: Sequence[int] | None = None) -> None:
        """The state ``state()`` returned (``keep``: the positions of this array's models in it)."""
        scale, tracker = state["scale"], state["tracker"]
        if keep is not None:
            scale, tracker = [scale[i] for i in keep], [tracker[i] for i in keep]
        self.scale.copy_(torch.tensor(scale, dtype=torch.float32))
        self.tracker.copy_(torch.tensor(tracker, dtype=torch.int32))
