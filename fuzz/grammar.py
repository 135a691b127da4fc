"""A grammar of random valid PyTorch models, written out as Python source.

A model is a :class:`ModelSpec`: an input (float features of some rank, or token ids), a list of :class:`Layer`
choices and a head. :func:`render` turns it into the source of a ``torch.nn.Module`` subclass by walking the layers
with the per-sample shape of the current tensor; a layer that does not apply to the shape it meets (after the
shrinker removed what came before it) is left out, so every sub-list of layers is a valid model. The source is what
the harness executes and what a failure prints, so the printed model is exactly the model that failed.

Every layer kind is one entry of ``KINDS``: ``sample(rng, shape)`` draws its parameters (or None when it does not
apply) and ``emit(p, shape, name, src, dst)`` writes its ``__init__`` and ``forward`` lines and returns the new
shape (or None). Shapes exclude the batch axis: ``(C, L)``, ``(C, H, W)``, ``(C, D, H, W)``, ``(T, D)``, ``(F,)``.
The kinds cover every op family onnxfuse has a fusion rule or a legalization rewrite for.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Layer", "ModelSpec", "Rendered", "KINDS", "generate", "render", "BATCH"]

BATCH = 8
MAX_ELEMS = 3072  # per sample, so that a model trains in milliseconds
MAX_CH = 16


@dataclass
class Layer:
    kind: str
    p: dict


@dataclass
class ModelSpec:
    seed: int
    input: dict  # {"kind": "float", "shape": [...]} or {"kind": "tokens", "T": 8, "vocab": 50}
    layers: list[Layer]
    head: str = "auto"  # auto | regress | classify | lm | lm-tied
    per_model_inputs: bool = False
    frozen_layer: int = -1  # the layer (k-th rendered) whose parameters are frozen (requires_grad=False); -1: none

    def replace(self, **kw) -> "ModelSpec":
        d = dict(seed=self.seed, input=self.input, layers=list(self.layers), head=self.head,
                 per_model_inputs=self.per_model_inputs, frozen_layer=self.frozen_layer)
        d.update(kw)
        return ModelSpec(**d)


@dataclass
class Rendered:
    source: str
    input_shape: tuple  # per sample
    input_kind: str
    output_shape: tuple  # per sample
    loss: str  # cross-entropy | mse
    class_axis: int
    num_classes: int
    kinds: list[str] = field(default_factory=list)  # the layer kinds actually used, in order
    vocab: int = 0
    opset: int = 17  # the opset it is exported at (20 for layers that need it: affine_grid, grid_sample)


@dataclass
class Kind:
    name: str
    sample: Callable  # (rng, shape) -> dict | None
    emit: Callable  # (p, shape, name, src, dst) -> (init lines, forward lines, new shape) | None
    weight: float = 1.0
    nested: bool = False  # holds an inner layer (residual, gating)
    opset: int = 17  # the opset a model holding it is exported at (the ops it exports need this one)


def _elems(shape) -> int:
    return int(math.prod(shape))


def _fits(shape) -> bool:
    return all(d >= 1 for d in shape) and _elems(shape) <= MAX_ELEMS


def _divisors(n: int, cap: int = 64) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def _spatial(shape) -> int:
    """Number of spatial axes when the tensor can be read as [N, C, *S] (1-3), else 0."""
    return len(shape) - 1 if 2 <= len(shape) <= 4 else 0


def _out_len(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


# ---------------------------------------------------------------------------------------------------------------
# convolutions

def _conv_sample(rng, shape):
    if not _spatial(shape):
        return None
    C = shape[0]
    out = rng.choice([4, 8, 12, 16])
    k = rng.choice([1, 2, 3, 3, 5])
    mode = rng.choice(["zeros"] * 6 + ["reflect", "replicate", "circular"])
    pad = rng.choice([0, (k - 1) // 2, 1, "same"])
    stride = rng.choice([1, 1, 2])
    if pad == "same":
        stride = 1
    groups = rng.choice([g for g in _divisors(C) if out % g == 0])
    if rng.random() < 0.2 and out % C == 0:
        groups = C  # depthwise
    return dict(out=out, k=k, stride=stride, pad=pad, dil=rng.choice([1, 1, 2]), groups=groups,
                bias=rng.random() < 0.7, mode=mode)


def _conv_emit(p, shape, n, src, dst):
    d = _spatial(shape)
    if not d or shape[0] % p["groups"] or p["out"] % p["groups"]:
        return None
    S = shape[1:]
    pad = p["pad"]
    if pad == "same":
        if p["mode"] != "zeros" or p["stride"] != 1:
            return None
        out_s = tuple(S)
    else:
        if p["mode"] == "reflect" and any(pad >= s for s in S) or p["mode"] != "zeros" and pad == 0:
            return None
        if p["mode"] == "circular" and any(pad > s for s in S):
            return None
        out_s = tuple(_out_len(s, p["k"], p["stride"], pad, p["dil"]) for s in S)
    new = (p["out"], *out_s)
    if not _fits(new):
        return None
    pad_src = repr(pad)
    init = [f"self.{n} = nn.Conv{d}d({shape[0]}, {p['out']}, {p['k']}, stride={p['stride']}, padding={pad_src}, "
            f"dilation={p['dil']}, groups={p['groups']}, bias={p['bias']}, padding_mode={p['mode']!r})"]
    return init, [f"{dst} = self.{n}({src})"], new


def _convt_sample(rng, shape):
    if not _spatial(shape):
        return None
    C = shape[0]
    out = rng.choice([4, 8, 12])
    k = rng.choice([1, 2, 3, 4])
    stride = rng.choice([1, 2])
    dil = rng.choice([1, 1, 2])
    return dict(out=out, k=k, stride=stride, pad=rng.randint(0, (k - 1) // 2 + 1) if k > 1 else 0, dil=dil,
                out_pad=rng.randint(0, max(stride, dil) - 1),
                groups=rng.choice([g for g in _divisors(C) if out % g == 0]), bias=rng.random() < 0.7)


def _convt_emit(p, shape, n, src, dst):
    d = _spatial(shape)
    if not d or shape[0] % p["groups"] or p["out"] % p["groups"]:
        return None
    if p["out_pad"] >= max(p["stride"], p["dil"]):
        return None
    out_s = tuple((s - 1) * p["stride"] - 2 * p["pad"] + p["dil"] * (p["k"] - 1) + p["out_pad"] + 1 for s in shape[1:])
    new = (p["out"], *out_s)
    if not _fits(new) or any(s > 32 for s in out_s):
        return None
    init = [f"self.{n} = nn.ConvTranspose{d}d({shape[0]}, {p['out']}, {p['k']}, stride={p['stride']}, "
            f"padding={p['pad']}, output_padding={p['out_pad']}, groups={p['groups']}, bias={p['bias']}, "
            f"dilation={p['dil']})"]
    return init, [f"{dst} = self.{n}({src})"], new


# ---------------------------------------------------------------------------------------------------------------
# normalization

def _norm_sample(rng, shape):
    kinds = ["layer"]
    if len(shape) in (1, 2, 3, 4):
        kinds.append("batch")
    if _spatial(shape) and _elems(shape[1:]) > 1:
        kinds += ["instance", "group"]
    kind = rng.choice(kinds)
    return dict(kind=kind, affine=rng.random() < 0.8, momentum=rng.choice([0.1, 0.3]), groups=rng.choice([1, 2, 4]),
                last=rng.choice([1, 1, 2]))


def _norm_emit(p, shape, n, src, dst):
    C = shape[0]
    kind = p["kind"]
    if kind == "batch":
        if len(shape) not in (1, 2, 3, 4):
            return None
        dim = {1: 1, 2: 1, 3: 2, 4: 3}[len(shape)]
        return [f"self.{n} = nn.BatchNorm{dim}d({C}, momentum={p['momentum']}, affine={p['affine']})"], \
            [f"{dst} = self.{n}({src})"], shape
    if kind == "instance":
        d = _spatial(shape)
        if not d or _elems(shape[1:]) < 2:
            return None
        return [f"self.{n} = nn.InstanceNorm{d}d({C}, affine={p['affine']})"], [f"{dst} = self.{n}({src})"], shape
    if kind == "group":
        if not _spatial(shape) or C % p["groups"] or _elems(shape) // p["groups"] < 2:
            return None
        return [f"self.{n} = nn.GroupNorm({p['groups']}, {C}, affine={p['affine']})"], \
            [f"{dst} = self.{n}({src})"], shape
    last = min(p["last"], len(shape))
    dims = list(shape[-last:])
    if _elems(dims) < 2:
        return None
    return [f"self.{n} = nn.LayerNorm({dims}, elementwise_affine={p['affine']})"], [f"{dst} = self.{n}({src})"], shape


# ---------------------------------------------------------------------------------------------------------------
# activations and element-wise maths

_ACTS = {
    "relu": "F.relu({x})", "gelu": "F.gelu({x})", "gelu_tanh": "F.gelu({x}, approximate='tanh')",
    "silu": "F.silu({x})", "hardswish": "F.hardswish({x})", "leaky_relu": "F.leaky_relu({x}, 0.1)",
    "sigmoid": "torch.sigmoid({x})", "tanh": "torch.tanh({x})", "elu": "F.elu({x})",
    "hardsigmoid": "F.hardsigmoid({x})", "softplus": "F.softplus({x})", "mish": "F.mish({x})",
    "relu6": "F.relu6({x})", "selu": "F.selu({x})", "celu": "F.celu({x}, 0.5)", "softsign": "F.softsign({x})",
    "hardtanh": "F.hardtanh({x}, -0.5, 0.5)", "logsigmoid": "F.logsigmoid({x})",
}


def _act_sample(rng, shape):
    kind = rng.choice(list(_ACTS) + ["prelu", "prelu", "softmax", "log_softmax"])
    return dict(kind=kind, dim=rng.randint(1, max(1, len(shape))), shared=rng.random() < 0.3)


def _act_emit(p, shape, n, src, dst):
    kind = p["kind"]
    if kind in _ACTS:
        return [], [f"{dst} = " + _ACTS[kind].format(x=src)], shape
    if kind == "prelu":
        num = 1 if p["shared"] or len(shape) < 1 else shape[0]
        return [f"self.{n} = nn.PReLU({num}, init=0.2)"], [f"{dst} = self.{n}({src})"], shape
    dim = min(p["dim"], len(shape))
    fn = "F.softmax" if kind == "softmax" else "F.log_softmax"
    return [], [f"{dst} = {fn}({src}, dim={dim})"], shape


def _elementwise_sample(rng, shape):
    return dict(kind=rng.choice(["affine_channel", "affine_last", "affine_full", "ratio", "clamp", "square_tanh",
                                 "gauss", "where", "sqrt_abs", "cumsum", "scalar"]),
                dim=rng.randint(1, max(1, len(shape))))


def _elementwise_emit(p, shape, n, src, dst):
    kind = p["kind"]
    if kind.startswith("affine"):
        if kind == "affine_channel" and len(shape) >= 2:
            pshape = [shape[0]] + [1] * (len(shape) - 1)
        elif kind == "affine_full":
            pshape = list(shape)
        else:
            pshape = [shape[-1]]
        init = [f"self.{n}_g = nn.Parameter(1 + 0.1 * torch.randn({pshape}))",
                f"self.{n}_b = nn.Parameter(0.1 * torch.randn({pshape}))"]
        return init, [f"{dst} = {src} * self.{n}_g + self.{n}_b"], shape
    if kind == "cumsum":
        dim = min(p["dim"], len(shape))
        if shape[dim - 1] > 16:
            return None
        return [], [f"{dst} = torch.cumsum({src}, dim={dim}) / {shape[dim - 1]}"], shape
    line = {
        "ratio": "{x} / (1 + {x}.abs())", "clamp": "torch.clamp({x}, -1.0, 1.0)", "square_tanh": "{x} * torch.tanh({x})",
        "gauss": "torch.exp(-{x} * {x})", "where": "torch.where({x} > 0, {x}, 0.1 * {x})",
        "sqrt_abs": "torch.sqrt({x}.abs() + 1.0)", "scalar": "({x} - 0.5) * 2.0",
    }[kind]
    return [], [f"{dst} = " + line.format(x=src)], shape


# ---------------------------------------------------------------------------------------------------------------
# pooling and reductions

def _pool_sample(rng, shape):
    if not _spatial(shape):
        return None
    k = rng.choice([2, 3])
    return dict(kind=rng.choice(["max", "max", "avg", "avg", "adaptive_avg", "adaptive_max", "lp"]), k=k,
                stride=rng.choice([None, 1, 2]), pad=rng.choice([0, 0, k // 2]), ceil=rng.random() < 0.3,
                count_pad=rng.random() < 0.5, half=rng.random() < 0.5)


def _pool_emit(p, shape, n, src, dst):
    d = _spatial(shape)
    if not d:
        return None
    S = shape[1:]
    kind = p["kind"]
    if kind in ("adaptive_avg", "adaptive_max"):
        if kind == "adaptive_max" or not p["half"]:
            out = [1] * d
        elif all(s % 2 == 0 for s in S):
            out = [s // 2 for s in S]
        else:
            return None
        cls = "AdaptiveAvgPool" if kind == "adaptive_avg" else "AdaptiveMaxPool"
        return [f"self.{n} = nn.{cls}{d}d({tuple(out) if d > 1 else out[0]})"], [f"{dst} = self.{n}({src})"], \
            (shape[0], *out)
    k, pad = p["k"], p["pad"]
    stride = p["stride"] or k
    if kind == "lp" and p["half"]:
        stride = k + 1  # LPPool has no padding: only a stride past the kernel lets ceil_mode drop a last window
    if pad > k // 2 or any(s + 2 * pad < k for s in S):
        return None

    def length(s):
        span = s + 2 * pad - k
        o = (-(-span // stride) if p["ceil"] else span // stride) + 1
        if p["ceil"] and (o - 1) * stride >= s + pad:
            o -= 1  # torch: the last window must start inside the input or the left padding
        return o

    out_s = tuple(length(s) for s in S)
    if any(o < 1 for o in out_s):
        return None
    if kind == "lp":
        if d == 3 or pad:
            return None
        init = [f"self.{n} = nn.LPPool{d}d(2, {k}, stride={stride}, ceil_mode={p['ceil']})"]
        return init, [f"{dst} = self.{n}({src})"], (shape[0], *out_s)
    if kind == "max":
        init = [f"self.{n} = nn.MaxPool{d}d({k}, stride={stride}, padding={pad}, ceil_mode={p['ceil']})"]
    else:
        init = [f"self.{n} = nn.AvgPool{d}d({k}, stride={stride}, padding={pad}, ceil_mode={p['ceil']}, "
                f"count_include_pad={p['count_pad']})"]
    return init, [f"{dst} = self.{n}({src})"], (shape[0], *out_s)


def _reduce_sample(rng, shape):
    if not shape:
        return None
    axes = sorted(rng.sample(range(1, len(shape) + 1), rng.randint(1, len(shape))))
    return dict(op=rng.choice(["mean", "mean", "sum", "amax", "amin"]), axes=axes, keep=rng.random() < 0.3)


def _reduce_emit(p, shape, n, src, dst):
    axes = [a for a in p["axes"] if a <= len(shape)]
    if not axes:
        return None
    if p["keep"]:
        new = tuple(1 if k + 1 in axes else s for k, s in enumerate(shape))
    else:
        new = tuple(s for k, s in enumerate(shape) if k + 1 not in axes)
        if not new:
            return None
    scale = f" / {_elems([shape[a - 1] for a in axes])}" if p["op"] == "sum" else ""
    dims = axes[0] if len(axes) == 1 else tuple(axes)
    return [], [f"{dst} = {src}.{p['op']}(dim={dims}, keepdim={p['keep']}){scale}"], new


# ---------------------------------------------------------------------------------------------------------------
# shape manipulation

def _concat_sample(rng, shape):
    if not shape:
        return None
    return dict(axis=rng.randint(1, len(shape)), other=rng.choice(list(_ACTS)))


def _concat_emit(p, shape, n, src, dst):
    a = min(p["axis"], len(shape))
    new = tuple(2 * s if k + 1 == a else s for k, s in enumerate(shape))
    if not _fits(new) or (a == 1 and len(shape) >= 2 and new[0] > MAX_CH * 2):
        return None
    other = _ACTS[p["other"]].format(x=src)
    return [], [f"{dst} = torch.cat([{src}, {other}], dim={a})"], new


def _split_sample(rng, shape):
    if not shape:
        return None
    return dict(axis=rng.randint(1, len(shape)), how=rng.choice(["glu", "swap", "add", "sizes"]))


def _split_emit(p, shape, n, src, dst):
    a = min(p["axis"], len(shape))
    size = shape[a - 1]
    if size < 2:
        return None
    if p["how"] == "sizes":
        first = max(1, size // 3)
        return [], [f"{n}_a, {n}_b = torch.split({src}, [{first}, {size - first}], dim={a})",
                    f"{dst} = torch.cat([{n}_b, {n}_a], dim={a})"], shape
    if size % 2:
        return None
    half = tuple(size // 2 if k + 1 == a else s for k, s in enumerate(shape))
    lines = [f"{n}_a, {n}_b = {src}.chunk(2, dim={a})"]
    if p["how"] == "glu":
        return [], lines + [f"{dst} = {n}_a * torch.sigmoid({n}_b)"], half
    if p["how"] == "add":
        return [], lines + [f"{dst} = {n}_a + {n}_b"], half
    return [], lines + [f"{dst} = torch.cat([{n}_b, {n}_a], dim={a})"], shape


def _slice_sample(rng, shape):
    if not shape:
        return None
    return dict(axis=rng.randint(1, len(shape)), how=rng.choice(["range", "range", "step", "flip", "narrow",
                                                                   "computed", "select", "buffer"]),
                lo=rng.random(), hi=rng.random())


def _slice_emit(p, shape, n, src, dst):
    a = min(p["axis"], len(shape))
    size = shape[a - 1]
    pre = ", ".join([":"] * a)
    if p["how"] == "flip":
        return [], [f"{dst} = {src}.flip({a})"], shape
    if p["how"] == "select":  # a constant index list (Gather with constant indices)
        if size < 2:
            return None
        idx = sorted({int(p["lo"] * size), int(p["hi"] * size) % size, size - 1})
        new = tuple(len(idx) if k + 1 == a else s for k, s in enumerate(shape))
        return [], [f"{dst} = {src}[{pre}, {idx}]"], new
    if p["how"] == "buffer":  # indices from a buffer: a per-model permutation (Gather per model)
        if size < 2:
            return None
        return [f"self.register_buffer('{n}_idx', torch.randperm({size}))"], \
            [f"{dst} = {src}.index_select({a}, self.{n}_idx)"], shape
    if p["how"] == "step":
        if size < 2:
            return None
        new = tuple((s + 1) // 2 if k + 1 == a else s for k, s in enumerate(shape))
        return [], [f"{dst} = {src}[{pre}, ::2]"], new
    if p["how"] == "computed":  # bounds computed from the shape at run time (rotary embeddings do this)
        if size < 2:
            return None
        new = tuple(size - size // 2 if k + 1 == a else s for k, s in enumerate(shape))
        return [], [f"{dst} = {src}[{pre}, {src}.shape[{a}] // 2:]"], new
    lo = int(p["lo"] * (size - 1))
    hi = lo + 1 + int(p["hi"] * (size - 1 - lo))
    if hi - lo == size:
        return None
    new = tuple(hi - lo if k + 1 == a else s for k, s in enumerate(shape))
    if p["how"] == "narrow":
        return [], [f"{dst} = {src}.narrow({a}, {lo}, {hi - lo})"], new
    return [], [f"{dst} = {src}[{pre}, {lo}:{hi}]"], new


def _flatten_sample(rng, shape):
    if len(shape) < 2:
        return None
    return dict(start=rng.randint(1, len(shape) - 1), span=rng.randint(1, len(shape) - 1))


def _flatten_emit(p, shape, n, src, dst):
    if len(shape) < 2:
        return None
    start = min(p["start"], len(shape) - 1)
    end = min(start + p["span"], len(shape))
    new = shape[: start - 1] + (_elems(shape[start - 1 : end]),) + shape[end:]
    return [], [f"{dst} = {src}.flatten({start}, {end})"], new


def _reshape_sample(rng, shape):
    if not shape:
        return None
    return dict(rank=rng.choice([1, 2, 2, 3]), cut=rng.random(),
                how=rng.choice(["shape0", "minus1", "unflatten", "shape0_minus1"]))


def _reshape_emit(p, shape, n, src, dst):
    P = _elems(shape)
    divs = [d for d in _divisors(P) if 1 < d < P] or [1]
    a = divs[int(p["cut"] * len(divs)) % len(divs)]
    if p["rank"] == 1:
        new = (P,)
    elif p["rank"] == 2 or P // a < 4:
        new = (a, P // a)
    else:
        rest = P // a
        bdivs = [d for d in _divisors(rest) if 1 < d < rest] or [1]
        b = bdivs[len(bdivs) // 2]
        new = (a, b, rest // b)
    if new == tuple(shape):
        return None
    dims = ", ".join(str(d) for d in new)
    if p["how"] == "minus1":
        return [], [f"{dst} = {src}.reshape(-1, {dims})"], new
    if p["how"] == "shape0_minus1" and len(new) >= 2:  # -1 next to the batch (Swin's view(N, T, -1))
        head = ", ".join(str(d) for d in new[:-1])
        return [], [f"{dst} = {src}.reshape({src}.shape[0], {head}, -1)"], new
    if p["how"] == "unflatten" and len(shape) == 1 and len(new) >= 2:
        return [], [f"{dst} = {src}.unflatten(1, ({dims}))"], new
    return [], [f"{dst} = {src}.reshape({src}.shape[0], {dims})"], new


def _permute_sample(rng, shape):
    if len(shape) < 2:
        return None
    perm = list(range(1, len(shape) + 1))
    while perm == sorted(perm):
        rng.shuffle(perm)
    return dict(perm=perm, transpose=rng.random() < 0.4)


def _permute_emit(p, shape, n, src, dst):
    r = len(shape)
    if r < 2:
        return None
    if p["transpose"]:
        i, j = sorted({min(p["perm"][0], r), min(p["perm"][-1], r)})
        if i == j:
            i, j = 1, 2
        new = list(shape)
        new[i - 1], new[j - 1] = new[j - 1], new[i - 1]
        return [], [f"{dst} = {src}.transpose({i}, {j})"], tuple(new)
    perm = [a for a in p["perm"] if a <= r]
    perm += [a for a in range(1, r + 1) if a not in perm]
    if perm == sorted(perm):
        return None
    return [], [f"{dst} = {src}.permute(0, {', '.join(map(str, perm))})"], tuple(shape[a - 1] for a in perm)


def _repeat_sample(rng, shape):
    if not shape:
        return None
    return dict(axis=rng.randint(1, len(shape)), how=rng.choice(["repeat", "expand"]))


def _repeat_emit(p, shape, n, src, dst):
    a = min(p["axis"], len(shape))
    new = tuple(s * 2 if k + 1 == a else s for k, s in enumerate(shape))
    if p["how"] == "expand":  # a unit axis broadcast to 3
        if shape[a - 1] != 1:
            return None
        new = tuple(3 if k + 1 == a else s for k, s in enumerate(shape))
        sizes = ", ".join(["-1"] + [str(d) for d in new])
        return [], [f"{dst} = {src}.expand({sizes})"], new
    if not _fits(new):
        return None
    reps = ", ".join(["1"] + ["2" if k + 1 == a else "1" for k in range(len(shape))])
    return [], [f"{dst} = {src}.repeat({reps})"], new


def _resize_sample(rng, shape):
    if not _spatial(shape):
        return None
    return dict(mode=rng.choice(["nearest", "nearest", "linear"]), corners=rng.random() < 0.5)


def _resize_emit(p, shape, n, src, dst):
    d = _spatial(shape)
    new = (shape[0], *[2 * s for s in shape[1:]])
    if not d or not _fits(new) or any(s > 32 for s in new[1:]):
        return None
    if p["mode"] == "nearest":
        return [], [f"{dst} = F.interpolate({src}, scale_factor=2, mode='nearest')"], new
    mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[d]
    return [], [f"{dst} = F.interpolate({src}, scale_factor=2, mode={mode!r}, align_corners={p['corners']})"], new


def _pad_sample(rng, shape):
    if not shape:
        return None
    return dict(mode=rng.choice(["constant", "constant", "reflect", "replicate", "to_multiple"]), a=rng.randint(0, 2),
                b=rng.randint(0, 2))


def _pad_emit(p, shape, n, src, dst):
    d = _spatial(shape)
    if p["mode"] == "to_multiple":  # pads computed from the shape: the last axis up to a multiple of 4 (Swin)
        if not shape or shape[-1] % 4 == 0:
            return None
        new = (*shape[:-1], shape[-1] + (-shape[-1]) % 4)
        return [], [f"{dst} = F.pad({src}, [0, (-{src}.shape[-1]) % 4])"], new
    if not d or p["a"] + p["b"] == 0:
        return None
    if p["mode"] == "reflect" and any(max(p["a"], p["b"]) >= s for s in shape[1:]):
        return None
    pads = [p["a"], p["b"]] * d
    new = (shape[0], *[s + p["a"] + p["b"] for s in shape[1:]])
    if not _fits(new):
        return None
    extra = ", value=0.5" if p["mode"] == "constant" else ""
    return [], [f"{dst} = F.pad({src}, {pads}, mode={p['mode']!r}{extra})"], new


def _pixel_sample(rng, shape):
    if len(shape) != 3:
        return None
    return dict(up=rng.random() < 0.5)


def _pixel_emit(p, shape, n, src, dst):
    if len(shape) != 3:
        return None
    C, H, W = shape
    if p["up"]:
        if C % 4:
            return None
        return [f"self.{n} = nn.PixelShuffle(2)"], [f"{dst} = self.{n}({src})"], (C // 4, 2 * H, 2 * W)
    if H % 2 or W % 2 or 4 * C > MAX_CH * 4:
        return None
    return [f"self.{n} = nn.PixelUnshuffle(2)"], [f"{dst} = self.{n}({src})"], (4 * C, H // 2, W // 2)


# ---------------------------------------------------------------------------------------------------------------
# matrix products

def _linear_sample(rng, shape):
    if not 1 <= len(shape) <= 3:
        return None
    return dict(out=rng.choice([4, 8, 16, 24]), bias=rng.random() < 0.8)


def _linear_emit(p, shape, n, src, dst):
    if not 1 <= len(shape) <= 3:
        return None
    new = (*shape[:-1], p["out"])
    if not _fits(new) or shape[-1] > 512:
        return None
    return [f"self.{n} = nn.Linear({shape[-1]}, {p['out']}, bias={p['bias']})"], [f"{dst} = self.{n}({src})"], new


def _attention_sample(rng, shape):
    if len(shape) != 2:
        return None
    return dict(heads=rng.choice([1, 2, 4]), causal=rng.random() < 0.4, proj=rng.random() < 0.6,
                how=rng.choice(["matmul", "matmul", "einsum", "mha"]))


def _attention_emit(p, shape, n, src, dst):
    if len(shape) != 2:
        return None
    T, D = shape
    h = p["heads"]
    if D % h or D > 64 or T > 32:
        return None
    if p["how"] == "mha":
        init = [f"self.{n} = nn.MultiheadAttention({D}, {h}, batch_first=True)"]
        mask = ""
        if p["causal"]:
            init.append(f"self.register_buffer('{n}_mask', torch.triu(torch.ones({T}, {T}, dtype=torch.bool), 1))")
            mask = f", attn_mask=self.{n}_mask"
        return init, [f"{dst} = self.{n}({src}, {src}, {src}, need_weights=False{mask})[0]"], shape
    dh = D // h
    init = [f"self.{n}_q = nn.Linear({D}, {D})", f"self.{n}_k = nn.Linear({D}, {D}, bias=False)",
            f"self.{n}_v = nn.Linear({D}, {D})"]
    if p["proj"]:
        init.append(f"self.{n}_o = nn.Linear({D}, {D})")
    lines = []
    for t in "qkv":
        lines.append(f"{n}_{t} = self.{n}_{t}({src}).reshape({src}.shape[0], {T}, {h}, {dh}).transpose(1, 2)")
    if p["how"] == "einsum":
        lines.append(f"{n}_s = torch.einsum('nhtd,nhsd->nhts', {n}_q, {n}_k) * {1 / math.sqrt(dh)!r}")
    else:
        lines.append(f"{n}_s = {n}_q @ {n}_k.transpose(-2, -1) * {1 / math.sqrt(dh)!r}")
    if p["causal"]:
        init.append(f"self.register_buffer('{n}_mask', torch.triu(torch.ones({T}, {T}, dtype=torch.bool), 1))")
        lines.append(f"{n}_s = {n}_s.masked_fill(self.{n}_mask, float('-inf'))")
    lines.append(f"{n}_y = (F.softmax({n}_s, dim=-1) @ {n}_v).transpose(1, 2).reshape({src}.shape[0], {T}, {D})")
    lines.append(f"{dst} = self.{n}_o({n}_y)" if p["proj"] else f"{dst} = {n}_y")
    return init, lines, shape


def _tied_sample(rng, shape):
    if not 1 <= len(shape) <= 3:
        return None
    return dict(hidden=rng.choice([4, 8, 16]), twice=rng.random() < 0.4)


def _tied_emit(p, shape, n, src, dst):
    """An autoencoder with tied weights (W then W^T: one parameter in two layouts), or one Linear used twice."""
    if not 1 <= len(shape) <= 3 or shape[-1] > 64:
        return None
    D = shape[-1]
    if p["twice"]:
        return [f"self.{n} = nn.Linear({D}, {D})"], [f"{dst} = self.{n}(torch.tanh(self.{n}({src})))"], shape
    init = [f"self.{n} = nn.Linear({D}, {p['hidden']})"]
    return init, [f"{n}_h = torch.tanh(self.{n}({src}))", f"{dst} = F.linear({n}_h, self.{n}.weight.t())"], shape


def _gram_sample(rng, shape):
    if len(shape) != 2:
        return None
    return dict(einsum=rng.random() < 0.5)


def _gram_emit(p, shape, n, src, dst):
    if len(shape) != 2:
        return None
    T, D = shape
    if p["einsum"]:
        return [], [f"{dst} = torch.einsum('ntd,nsd->nts', {src}, {src}) / {D}"], (T, T)
    return [], [f"{dst} = torch.bmm({src}, {src}.transpose(1, 2)) / {D}"], (T, T)


def _recurrent_sample(rng, shape):
    if len(shape) != 2:
        return None
    return dict(cell=rng.choice(["LSTM", "GRU", "RNN"]), hidden=rng.choice([4, 8, 12]), bi=rng.random() < 0.4,
                relu=rng.random() < 0.3, read=rng.choice(["seq", "seq", "last"]))


def _recurrent_emit(p, shape, n, src, dst):
    """nn.LSTM / GRU / RNN over [T, D] (batch_first, uni- or bidirectional): its sequence output, or the final
    hidden state of each direction."""
    if len(shape) != 2:
        return None
    T, D = shape
    if D > 64 or T > 32:
        return None
    options = ", bidirectional=True" if p["bi"] else ""
    if p["cell"] == "RNN" and p["relu"]:
        options += ", nonlinearity='relu'"
    H = p["hidden"] * (2 if p["bi"] else 1)
    init = [f"self.{n} = nn.{p['cell']}({D}, {p['hidden']}, batch_first=True{options})"]
    if p["read"] == "seq":
        return init, [f"{dst} = self.{n}({src})[0]"], (T, H)
    h = f"{n}_h[0]" if p["cell"] == "LSTM" else f"{n}_h"
    return init, [f"{n}_y, {n}_h = self.{n}({src})",
                  f"{dst} = {h}.transpose(0, 1).reshape({src}.shape[0], 1, {H})"], (1, H)


# ---------------------------------------------------------------------------------------------------------------
# composite layers: an inner layer whose output has the input's shape

_INNER = ("conv", "linear", "act", "norm", "elementwise", "attention")


def _inner_sample(rng, shape):
    for _ in range(6):
        kind = rng.choice(_INNER)
        q = KINDS[kind].sample(rng, shape)
        if q is None:
            continue
        if kind == "conv":
            q.update(out=shape[0], stride=1, pad="same", mode="zeros", groups=rng.choice(_divisors(shape[0])))
        if kind == "linear":
            q.update(out=shape[-1])
        if KINDS[kind].emit(q, shape, "t", "x", "y") is not None:
            return kind, q
    return None


def _residual_sample(rng, shape):
    inner = _inner_sample(rng, shape)
    if inner is None:
        return None
    return dict(inner=inner[0], q=inner[1], join=rng.choice(["add", "add", "mul", "gate", "se"]))


def _residual_emit(p, shape, n, src, dst):
    if p["join"] == "se":  # squeeze-and-excitation: per-channel gates from a global mean
        if not _spatial(shape):
            return None
        d = _spatial(shape)
        axes = tuple(range(2, 2 + d))
        init = [f"self.{n}_fc = nn.Conv{d}d({shape[0]}, {shape[0]}, 1)"]
        return init, [f"{n}_s = torch.sigmoid(self.{n}_fc({src}.mean(dim={axes}, keepdim=True)))",
                      f"{dst} = {src} * {n}_s"], shape
    out = KINDS[p["inner"]].emit(p["q"], shape, f"{n}_f", src, f"{n}_y")
    if out is None or tuple(out[2]) != tuple(shape):
        return None
    init, lines, _ = out
    join = {"add": f"{src} + {n}_y", "mul": f"{src} * {n}_y", "gate": f"{src} * torch.sigmoid({n}_y)"}[p["join"]]
    return init, lines + [f"{dst} = {join}"], shape


# ---------------------------------------------------------------------------------------------------------------
# the ops of graph networks, routing, spatial transformers, noise and quantization (issue 39): drawn from a stream
# of their own (OPS_RATE), so that every earlier seed's model stays what it was

def _message_sample(rng, shape):
    if len(shape) != 2 or shape[0] < 3:
        return None
    V = shape[0]
    how = rng.choice(["add", "add", "amax", "place"])
    E = rng.randint(V, 2 * V) if how != "place" else rng.randint(1, V)
    dst = [rng.randrange(V) for _ in range(E)] if how != "place" else rng.sample(range(V), E)  # place: one each
    return dict(src=[rng.randrange(V) for _ in range(E)], dst=dst, reduce=how)


def _message_emit(p, shape, n, src, dst):
    """Message passing over a fixed graph of the V rows: messages from each edge's source row (a Gather by an
    index buffer), transformed, scatter-added or max-reduced at its target row (ScatterElements), or placed at
    distinct target rows (index_put: ScatterND), as a residual."""
    if len(shape) != 2 or max(p["src"] + p["dst"]) >= shape[0] or shape[1] > 64:
        return None
    V, D = shape
    init = [f"self.register_buffer('{n}_src', torch.tensor({p['src']}))",
            f"self.register_buffer('{n}_dst', torch.tensor({p['dst']}))",
            f"self.{n} = nn.Linear({D}, {D})"]
    index = f"self.{n}_dst.view(1, -1, 1).expand({src}.shape[0], -1, {D})"
    lines = [f"{n}_m = torch.tanh(self.{n}({src}[:, self.{n}_src]))"]
    if p["reduce"] == "place":  # each target row set once (index_put: ScatterND)
        lines += [f"{n}_y = torch.zeros_like({src})", f"{n}_y[:, self.{n}_dst] = {n}_m", f"{dst} = {src} + {n}_y"]
        return init, lines, shape
    if p["reduce"] == "add":
        agg = f"torch.zeros_like({src}).scatter_add(1, {index}, {n}_m)"
    else:
        agg = f"torch.zeros_like({src}).scatter_reduce(1, {index}, {n}_m, reduce='amax', include_self=True)"
    return init, lines + [f"{dst} = {src} + {agg}"], shape


def _route_sample(rng, shape):
    if not shape or shape[-1] < 3:
        return None
    return dict(k=rng.randint(1, min(3, shape[-1] - 1)), how=rng.choice(["values", "gates", "onehot"]))


def _route_emit(p, shape, n, src, dst):
    """Top-k routing along the last axis: the k largest values (TopK), a sparse softmax gate written back at the
    chosen positions (TopK, Softmax, ScatterElements), or a one-hot of the argmax (ArgMax, OneHot) as a mask."""
    if not shape or shape[-1] <= p["k"]:
        return None
    k, D = p["k"], shape[-1]
    if p["how"] == "values":
        return [], [f"{dst} = torch.topk({src}, {k}, dim=-1).values"], (*shape[:-1], k)
    if p["how"] == "gates":
        return [], [f"{n}_v, {n}_i = torch.topk({src}, {k}, dim=-1)",
                    f"{dst} = {src} * torch.zeros_like({src}).scatter(-1, {n}_i, F.softmax({n}_v, dim=-1))"], shape
    # .float(), not .to(x.dtype): the export writes the dtype it traced (float32) either way, which under autocast
    # is another precision than x's; .float() means that alone too
    return [], [f"{dst} = {src} * (1 + F.one_hot({src}.argmax(-1), {D}).float())"], shape


def _grid_sample(rng, shape):
    if len(shape) != 3 or shape[1] < 2 or shape[2] < 2:
        return None
    return dict(affine=rng.random() < 0.5, align=rng.random() < 0.5,
                padding=rng.choice(["zeros", "border", "reflection"]), mode=rng.choice(["bilinear", "nearest"]))


def _grid_emit(p, shape, n, src, dst):
    """A spatial transformer on [C, H, W]: an affine map predicted from the image (affine_grid, opset 20), or a
    learned offset field, then grid_sample."""
    if len(shape) != 3 or _elems(shape) > 1024:
        return None
    C, H, W = shape
    align = p["align"]
    if p["affine"]:
        init = [f"self.{n} = nn.Linear({C * H * W}, 6)",
                f"self.register_buffer('{n}_eye', torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))"]
        lines = [f"{n}_t = self.{n}({src}.flatten(1)).view(-1, 2, 3) * 0.1 + self.{n}_eye",
                 f"{n}_g = F.affine_grid({n}_t, list({src}.shape), align_corners={align})"]
    else:
        init = [f"self.{n} = nn.Parameter(0.05 * torch.randn(1, {H}, {W}, 2))",
                f"self.register_buffer('{n}_base', F.affine_grid(torch.eye(2, 3).unsqueeze(0), [1, 1, {H}, {W}], "
                f"align_corners={align}))"]
        lines = [f"{n}_g = (self.{n}_base + self.{n}).expand({src}.shape[0], -1, -1, -1)"]
    lines.append(f"{dst} = F.grid_sample({src}, {n}_g, mode='{p['mode']}', padding_mode='{p['padding']}', "
                 f"align_corners={align})")
    return init, lines, shape


def _noise_sample(rng, shape):
    return dict(how=rng.choice(["normal", "uniform", "bernoulli"]))


def _noise_emit(p, shape, n, src, dst):
    """Noise drawn inside the graph (RandomNormalLike, RandomUniformLike, Bernoulli), scaled by 0 so that the
    model computes the same function as alone (the draws of two programs are not comparable): what it checks is
    that every model's random node runs and fuses."""
    draw = {"normal": "torch.randn_like({x})", "uniform": "torch.rand_like({x})",
            "bernoulli": "torch.bernoulli(torch.full_like({x}, 0.5))"}[p["how"]].format(x=src)
    return [], [f"{dst} = {src} + 0.0 * {draw}"], shape


def _quant_sample(rng, shape):
    return dict(scale=rng.choice([0.02, 0.05, 0.1]), zero=rng.choice([0, 128]))


def _quant_emit(p, shape, n, src, dst):
    """Quantization-aware training's fake quantization (QuantizeLinear -> DequantizeLinear, uint8): the
    straight-through gradient where nothing is clamped."""
    return [], [f"{dst} = torch.fake_quantize_per_tensor_affine({src}, {p['scale']}, {p['zero']}, 0, 255)"], shape


def _triangle_sample(rng, shape):
    if len(shape) < 2:
        return None
    return dict(upper=rng.random() < 0.5, k=rng.choice([0, 0, 1, -1]))


def _triangle_emit(p, shape, n, src, dst):
    """A triangle of the last two axes (Trilu), as a causal mask is made."""
    if len(shape) < 2:
        return None
    fn = "torch.triu" if p["upper"] else "torch.tril"
    return [], [f"{dst} = {fn}({src}, {p['k']})"], shape


OPS_KINDS = ("message", "route", "grid", "noise", "quant", "triangle")
OPS_RATE = 0.35  # per model: one layer of OPS_KINDS inserted, from the stream "ops-<seed>"


KINDS: dict[str, Kind] = {k.name: k for k in [
    Kind("conv", _conv_sample, _conv_emit, 3.0),
    Kind("conv_transpose", _convt_sample, _convt_emit, 0.7),
    Kind("norm", _norm_sample, _norm_emit, 2.0),
    Kind("act", _act_sample, _act_emit, 3.0),
    Kind("elementwise", _elementwise_sample, _elementwise_emit, 1.0),
    Kind("pool", _pool_sample, _pool_emit, 1.5),
    Kind("reduce", _reduce_sample, _reduce_emit, 0.8),
    Kind("concat", _concat_sample, _concat_emit, 0.8),
    Kind("split", _split_sample, _split_emit, 0.8),
    Kind("slice", _slice_sample, _slice_emit, 0.8),
    Kind("flatten", _flatten_sample, _flatten_emit, 0.6),
    Kind("reshape", _reshape_sample, _reshape_emit, 0.6),
    Kind("permute", _permute_sample, _permute_emit, 0.8),
    Kind("repeat", _repeat_sample, _repeat_emit, 0.4),
    Kind("resize", _resize_sample, _resize_emit, 0.5),
    Kind("pad", _pad_sample, _pad_emit, 0.5),
    Kind("pixel", _pixel_sample, _pixel_emit, 0.3),
    Kind("linear", _linear_sample, _linear_emit, 2.5),
    Kind("attention", _attention_sample, _attention_emit, 1.5),
    Kind("gram", _gram_sample, _gram_emit, 0.4),
    Kind("tied", _tied_sample, _tied_emit, 0.6),
    Kind("residual", _residual_sample, _residual_emit, 1.5, nested=True),
    # weight 0: never drawn from the seed's main stream (so every other seed's model stays what it was); generate
    # inserts it from a stream of its own (RECURRENT_RATE)
    Kind("recurrent", _recurrent_sample, _recurrent_emit, 0.0),
    # weight 0 too: OPS_RATE inserts one from a stream of its own
    Kind("message", _message_sample, _message_emit, 0.0, opset=18),  # scatter_reduce's reduction max: opset 18
    Kind("route", _route_sample, _route_emit, 0.0),
    Kind("grid", _grid_sample, _grid_emit, 0.0, opset=20),
    Kind("noise", _noise_sample, _noise_emit, 0.0),
    Kind("quant", _quant_sample, _quant_emit, 0.0),
    Kind("triangle", _triangle_sample, _triangle_emit, 0.0),
]}
RECURRENT_RATE = 0.25  # per layer position whose shape is [T, D]: a recurrent layer first
# Training semantics the graph cannot hold (onnxfuse/core/semantics.py), from a stream of their own as well:
PADDING_RATE = 0.5  # a token model's embedding has a padding_idx (a random row, looked up like any other)
FROZEN_RATE = 0.2  # one layer's parameters are frozen (requires_grad=False)


# ---------------------------------------------------------------------------------------------------------------
# inputs, heads, generation and rendering

def _sample_input(rng) -> dict:
    r = rng.random()
    if r < 0.3:
        return {"kind": "float", "shape": [rng.choice([3, 4, 8]), rng.choice([8, 12, 16]), rng.choice([8, 12, 16])]}
    if r < 0.55:
        return {"kind": "float", "shape": [rng.choice([2, 3, 6, 8]), rng.choice([16, 24, 32])]}
    if r < 0.65:
        return {"kind": "float", "shape": [rng.choice([2, 3]), 4, rng.choice([4, 6]), rng.choice([4, 6])]}
    if r < 0.8:
        return {"kind": "float", "shape": [rng.choice([6, 16, 24])]}
    return {"kind": "tokens", "T": rng.choice([6, 8]), "vocab": rng.choice([20, 37]), "dim": rng.choice([8, 16])}


def generate(seed: int, max_layers: int = 6) -> ModelSpec:
    """A random model: its input, 1..max_layers layers valid for the shapes they meet, and a head."""
    rng = random.Random(seed)
    inp = _sample_input(rng)
    shape = tuple(inp["shape"]) if inp["kind"] == "float" else (inp["T"], inp["dim"])
    layers: list[Layer] = []
    recurrent = random.Random(f"recurrent-{seed}")  # its own stream: the main one draws what it drew before
    for _ in range(rng.randint(1, max_layers)):
        if len(shape) == 2 and recurrent.random() < RECURRENT_RATE:
            p = _recurrent_sample(recurrent, shape)
            out = _recurrent_emit(p, shape, "t", "x", "x")
            if out is not None:
                layers.append(Layer("recurrent", p))
                shape = tuple(out[2])
        for _attempt in range(12):
            names = list(KINDS)
            kind = rng.choices(names, weights=[KINDS[k].weight for k in names])[0]
            p = KINDS[kind].sample(rng, shape)
            if p is None:
                continue
            out = KINDS[kind].emit(p, shape, "t", "x", "x")
            if out is None:
                continue
            layers.append(Layer(kind, p))
            shape = tuple(out[2])
            break
    ops = random.Random(f"ops-{seed}")  # its own stream: every other draw stays what it was
    if ops.random() < OPS_RATE:
        _insert_ops_layer(ops, inp, layers)
    head = "auto"
    if inp["kind"] == "tokens":
        head = rng.choice(["lm", "lm-tied", "auto"])
    per_model = inp["kind"] == "float" and rng.random() < 0.2
    semantics = random.Random(f"semantics-{seed}")
    if inp["kind"] == "tokens" and semantics.random() < PADDING_RATE:
        inp = {**inp, "padding_idx": semantics.randrange(inp["vocab"])}
    frozen = semantics.randrange(len(layers)) if layers and semantics.random() < FROZEN_RATE else -1
    return ModelSpec(seed, inp, layers, head, per_model_inputs=per_model, frozen_layer=frozen)


def _insert_ops_layer(rng, inp: dict, layers: list[Layer]) -> None:
    """One layer of :data:`OPS_KINDS` at a random position where it applies to the shape it meets (none if it
    applies nowhere)."""
    kind = rng.choice(OPS_KINDS)
    at = rng.randint(0, len(layers))
    shape = tuple(inp["shape"]) if inp["kind"] == "float" else (inp["T"], inp["dim"])
    for layer in layers[:at]:
        out = KINDS[layer.kind].emit(layer.p, shape, "t", "x", "x")
        if out is not None:
            shape = tuple(out[2])
    p = KINDS[kind].sample(rng, shape)
    if p is not None and KINDS[kind].emit(p, shape, "t", "x", "x") is not None:
        layers.insert(at, Layer(kind, p))


def _has_parameters(init_line: str) -> bool:
    if "nn.Parameter" in init_line:
        return True
    module = init_line.split("= nn.", 1)[-1] if "= nn." in init_line else ""
    return bool(module) and not module.startswith(("Pool", "MaxPool", "AvgPool", "Adaptive", "LPPool", "Pixel")) \
        and "affine=False" not in module


def render(spec: ModelSpec) -> Rendered:
    """The module source of ``spec``; layers that do not apply to the shape they meet are left out."""
    init: list[str] = []
    fwd: list[str] = []
    used: list[str] = []
    inp = spec.input
    if inp["kind"] == "tokens":
        in_shape = (inp["T"],)
        padding = f", padding_idx={inp['padding_idx']}" if inp.get("padding_idx") is not None else ""
        init.append(f"self.emb = nn.Embedding({inp['vocab']}, {inp['dim']}{padding})")
        fwd.append("x = self.emb(x)")
        shape = (inp["T"], inp["dim"])
    else:
        in_shape = shape = tuple(inp["shape"])
    frozen: list[str] = []  # the frozen layer's lines
    for layer in spec.layers:
        out = KINDS[layer.kind].emit(layer.p, shape, f"l{len(used)}", "x", "x")
        if out is None:
            continue
        if len(used) == spec.frozen_layer and any(_has_parameters(line) for line in out[0]):
            frozen = out[0]
        init += out[0]
        fwd += out[1]
        shape = tuple(out[2])
        used.append(layer.kind)
    loss, class_axis, K = "mse", 1, 0
    head = spec.head
    if head in ("lm", "lm-tied") and (inp["kind"] != "tokens" or len(shape) != 2):
        head = "auto"
    if head in ("lm", "lm-tied"):
        V, D = inp["vocab"], shape[-1]
        if head == "lm-tied" and D == inp["dim"]:
            fwd.append("x = x @ self.emb.weight.t()")  # the output projection is the embedding (tied)
        else:
            init.append(f"self.head = nn.Linear({D}, {V})")
            fwd.append("x = self.head(x)")
        shape, loss, class_axis, K = (shape[0], V), "cross-entropy", -1, V
    elif head in ("auto", "classify") and len(shape) == 1 and (head == "classify" or spec.seed % 2 == 0):
        K = 5
        init.append(f"self.head = nn.Linear({shape[0]}, {K})")
        fwd.append("x = self.head(x)")
        shape, loss = (K,), "cross-entropy"
    if not any(_has_parameters(line) for line in init if line not in frozen):  # a per-feature scale and shift to train
        init += [f"self.head_g = nn.Parameter(1 + 0.1 * torch.randn({shape[-1]}))",
                 f"self.head_b = nn.Parameter(0.1 * torch.randn({shape[-1]}))"]
        fwd.append("x = x * self.head_g + self.head_b")
    if frozen:  # after every layer is made: the frozen layer's parameters (l3, l3_a, l3_w ...) by name
        init += ["for _name, _p in self.named_parameters():",
                 f"    if _name.split('.')[0].split('_')[0] == 'l{spec.frozen_layer}':",
                 "        _p.requires_grad_(False)"]
    body_init = "\n".join("        " + line for line in init) or "        pass"
    body_fwd = "\n".join("        " + line for line in fwd)
    source = (
        "import math\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n"
        "class FuzzNet(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        f"{body_init}\n\n"
        "    def forward(self, x):\n"
        f"{body_fwd}\n"
        "        return x\n"
    )
    return Rendered(source, in_shape, inp["kind"], shape, loss, class_axis, K, used, inp.get("vocab", 0),
                    max([17] + [KINDS[k].opset for k in used]))
