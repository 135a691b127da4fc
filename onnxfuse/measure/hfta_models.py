"""HFTA-style fused PyTorch models: B zoo models rewritten by hand as one model (Wang et al., "Horizontally Fused
Training Array", MLSys 2021), the comparison ``onnxfuse bench --modes hfta`` measures onnxfuse against.

    fused = hfta_model("resnet18", modules)   # B zoo modules of one architecture -> one nn.Module (None: no
    logits = fused(x)                         #   hand-fused version); x the batch all B models see, logits [B, N, ..]
    unpack(fused, b)["layer1.0.conv1.weight"] # model b's state_dict, as views of the fused tensors

The operators (each class opens with its layout):

    Conv2d       B convolutions as one with groups = B * groups, channels packed [N, B*C, H, W]
    BatchNorm2d  BatchNorm2d(B*C) on packed channels: per channel, so exactly B per-model BatchNorms
    Linear       one batched matmul: [B, N, K] @ [B, K, M] + [B, 1, M] (torch.baddbmm)
    LayerNorm    F.layer_norm without affine, then * weight [B, 1.., D] + bias
    Embedding    a gather from [B, V, D]

ReLU, GELU, max pooling and average pooling work per channel or per element and run unchanged on either layout;
Dropout does too (the bench uses p = 0; with p > 0 the masks are drawn differently from B separate models).

The model-level classes repeat the zoo's forward code (onnxfuse/exporters/zoo.py: BatchNorm, ReLU, pooling, residuals,
causal attention) on the packed layouts; their submodules carry the zoo's names, so :func:`unpack` gives model b's
``state_dict`` under the zoo module's own keys. Every fused tensor is a stack of the B models' tensors, model b's
block a view (:meth:`_Packed.block`); :func:`pack` copies the B modules' tensors into those views, so packing and
unpacking are one mapping read in two directions.

Trained with ONE torch.optim.AdamW over the fused parameters (as ``onnxfuse bench`` does, like its vmap mode): one
learning rate for all B models; AdamW is element-wise, so this is B independent AdamW runs at that rate.
"""
from __future__ import annotations

import copy
import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from onnxfuse.exporters import zoo

__all__ = ["hfta_model", "HFTA_MODELS", "pack", "unpack", "Conv2d", "BatchNorm2d", "Linear", "LayerNorm",
           "Embedding", "LeNet", "ResNet18", "TransformerLM"]


# ------------------------------------------------------------------------------------------------- the operators
class _Packed:
    """A fused operator whose every tensor stacks B models' tensors; ``block(name, t, b)`` is model b's block of
    the fused tensor ``t`` (parameter or buffer ``name``, or its gradient) in the zoo module's layout, as a view."""

    B: int

    def block(self, name: str, t: torch.Tensor, b: int) -> torch.Tensor:
        raise NotImplementedError


class Conv2d(nn.Conv2d, _Packed):
    """B Conv2d(Cin, Cout, k, groups=g) as one grouped convolution (HFTA's channel packing).

    Layout: x [N, B*Cin, H, W] channel-packed (model b's channels b*Cin .. (b+1)*Cin - 1); W [B*Cout, Cin/g, kH, kW]
    (model b's filters are rows b*Cout ..); bias [B*Cout]. groups = B*g keeps model b's filters on model b's
    channels: y[:, b*Cout:(b+1)*Cout] = conv(x[:, b*Cin:(b+1)*Cin], W_b) + bias_b."""

    def __init__(self, convs: Sequence[nn.Conv2d]):
        c, B = convs[0], len(convs)
        super().__init__(B * c.in_channels, B * c.out_channels, c.kernel_size, c.stride, c.padding, c.dilation,
                         B * c.groups, c.bias is not None, c.padding_mode)
        self.B = B

    def block(self, name: str, t: torch.Tensor, b: int) -> torch.Tensor:
        return t.chunk(self.B)[b]  # weight and bias: rows b*Cout .. (b+1)*Cout - 1


class BatchNorm2d(nn.BatchNorm2d, _Packed):
    """B BatchNorm2d(C) as one BatchNorm2d(B*C): normalization is per channel, so on channel-packed x [N, B*C, H, W]
    this is exactly the B models' BatchNorms (batch statistics and running statistics alike).

    Layout: weight, bias, running_mean, running_var [B*C] (model b's at b*C ..); num_batches_tracked is one counter,
    the same for every model."""

    def __init__(self, norms: Sequence[nn.BatchNorm2d]):
        n, B = norms[0], len(norms)
        super().__init__(B * n.num_features, n.eps, n.momentum, n.affine, n.track_running_stats)
        self.B = B

    def block(self, name: str, t: torch.Tensor, b: int) -> torch.Tensor:
        return t if name == "num_batches_tracked" else t.chunk(self.B)[b]


class Linear(nn.Module, _Packed):
    """B Linear(K, M) as one batched matmul (HFTA's Linear).

    Layout: x [B, N.., K] (model-major); weight [B, K, M] (model b's torch weight transposed); bias [B, 1, M].
    y_b = x_b @ W_b^T + bias_b = baddbmm(bias, x [B, N, K], weight [B, K, M]) -> [B, N.., M]."""

    def __init__(self, linears: Sequence[nn.Linear]):
        super().__init__()
        lin, self.B = linears[0], len(linears)
        self.weight = nn.Parameter(torch.empty(self.B, lin.in_features, lin.out_features))
        self.bias = nn.Parameter(torch.empty(self.B, 1, lin.out_features)) if lin.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(self.B, -1, x.shape[-1])  # [B, N.., K] -> [B, N, K]
        y = torch.bmm(flat, self.weight) if self.bias is None else torch.baddbmm(self.bias, flat, self.weight)
        return y.view(*x.shape[:-1], y.shape[-1])

    def block(self, name: str, t: torch.Tensor, b: int) -> torch.Tensor:
        return t[b].T if name == "weight" else t[b, 0]  # weight [K, M] -> torch's [M, K]; bias [1, M] -> [M]


class LayerNorm(nn.Module, _Packed):
    """B LayerNorm(D) as one normalization without affine, then the B affine maps broadcast.

    Layout: x [B, N.., D]; weight, bias [B, D] (viewed as [B, 1.., D]).
    y_b = (x_b - mean) / sqrt(var + eps) * weight_b + bias_b, mean and var over the last axis of each row."""

    def __init__(self, norms: Sequence[nn.LayerNorm]):
        super().__init__()
        n, self.B = norms[0], len(norms)
        if len(n.normalized_shape) != 1:
            raise ValueError(f"LayerNorm over {tuple(n.normalized_shape)}: only the last axis is fused")
        self.eps, D = n.eps, n.normalized_shape[0]
        self.weight = nn.Parameter(torch.empty(self.B, D)) if n.weight is not None else None
        self.bias = nn.Parameter(torch.empty(self.B, D)) if n.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        D = x.shape[-1]
        y = F.layer_norm(x, (D,), eps=self.eps)
        affine = (self.B,) + (1,) * (x.dim() - 2) + (D,)  # [B, 1.., D]
        if self.weight is not None:
            y = y * self.weight.view(affine)
        return y if self.bias is None else y + self.bias.view(affine)

    def block(self, name: str, t: torch.Tensor, b: int) -> torch.Tensor:
        return t[b]


class Embedding(nn.Module, _Packed):
    """B Embedding(V, D) as one gather from the stacked tables.

    Layout: ids [N..] int64, the same for every model; weight [B, V, D]; y [B, N.., D], y_b = weight_b[ids]."""

    def __init__(self, embeddings: Sequence[nn.Embedding]):
        super().__init__()
        e, self.B = embeddings[0], len(embeddings)
        if e.padding_idx is not None or e.max_norm is not None:
            raise ValueError("Embedding with padding_idx or max_norm: not fused")
        self.weight = nn.Parameter(torch.empty(self.B, e.num_embeddings, e.embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[:, ids]  # [B, V, D][:, [N..]] -> [B, N.., D]

    def block(self, name: str, t: torch.Tensor, b: int) -> torch.Tensor:
        return t[b]


_OPS: dict[type, Callable[[Sequence[nn.Module]], nn.Module]] = {
    nn.Conv2d: Conv2d, nn.BatchNorm2d: BatchNorm2d, nn.Linear: Linear, nn.LayerNorm: LayerNorm,
    nn.Embedding: Embedding}


def _fuse(modules: Sequence[nn.Module]) -> nn.Module:
    """The fused operator of B aligned leaf modules (Sequential: element by element); a module without weights
    (ReLU, GELU, pooling, Dropout) works on either layout and is kept as it is."""
    first = modules[0]
    if type(first) in _OPS:
        return _OPS[type(first)](modules)
    if isinstance(first, nn.Sequential):
        return nn.Sequential(*[_fuse([m[i] for m in modules]) for i in range(len(first))])
    if next(first.parameters(), None) is None and next(first.buffers(), None) is None:
        return copy.deepcopy(first)
    raise ValueError(f"{type(first).__name__} has weights and no fused operator here")


def _to_model_major(x: torch.Tensor, B: int) -> torch.Tensor:
    """[N, B*C, *S] channel-packed -> [B, N, C*prod(S)]: model b's features flattened as ``x_b.view(N, -1)``."""
    return x.reshape(x.shape[0], B, -1).transpose(0, 1)


# ---------------------------------------------------------------------------------------------------- the models
class LeNet(nn.Module):
    """B :class:`zoo.LeNet`. x [N, Cin, 28, 28] (shared) repeated to [N, B*Cin, 28, 28]; grouped convolutions, ReLU
    and max pooling on packed channels; flattened per model to [B, N, 16*4*4]; batched Linears; logits [B, N, C]."""

    def __init__(self, modules: Sequence[zoo.LeNet]):
        super().__init__()
        self.B = len(modules)
        for name in ("conv1", "conv2", "fc1", "fc2", "fc3", "pool"):
            setattr(self, name, _fuse([getattr(m, name) for m in modules]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.repeat(1, self.B, 1, 1)  # every model sees the same batch
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = _to_model_major(x, self.B)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class BasicBlock(nn.Module):
    """B :class:`zoo.BasicBlock` on channel-packed x [N, B*Cin, H, W] -> [N, B*Cout, H/s, W/s]: the zoo's code with
    grouped convolutions and packed BatchNorms (identity or 1x1 Conv-BN shortcut)."""

    def __init__(self, blocks: Sequence[zoo.BasicBlock]):
        super().__init__()
        for name in ("conv1", "bn1", "conv2", "bn2", "shortcut"):
            setattr(self, name, _fuse([getattr(k, name) for k in blocks]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """B :class:`zoo.ResNet18`. x [N, Cin, H, W] (shared) repeated to [N, B*Cin, H, W]; stem and four stages of
    :class:`BasicBlock` on packed channels; global average pooling [N, B*C, 1, 1] -> [B, N, C]; a batched Linear
    head; logits [B, N, classes]."""

    def __init__(self, modules: Sequence[zoo.ResNet18]):
        super().__init__()
        self.B = len(modules)
        self.conv1 = _fuse([m.conv1 for m in modules])
        self.bn1 = _fuse([m.bn1 for m in modules])
        for name in ("layer1", "layer2", "layer3", "layer4"):
            stages = [getattr(m, name) for m in modules]
            setattr(self, name, nn.Sequential(*[BasicBlock([s[i] for s in stages]) for i in range(len(stages[0]))]))
        self.fc = _fuse([m.fc for m in modules])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.repeat(1, self.B, 1, 1)
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = _to_model_major(F.adaptive_avg_pool2d(x, 1), self.B)
        return self.fc(x)


class SelfAttention(nn.Module):
    """B :class:`zoo.SelfAttention` on model-major x [B, N, T, C] -> [B, N, T, C]: batched Linear q/k/v/proj,
    heads split per model [B, N, H, T, D], scores ``q @ k^T / sqrt(D)`` [B, N, H, T, T] plus the causal mask
    [T, T] (0 and -inf above the diagonal, broadcast), softmax, ``@ v``, heads merged."""

    def __init__(self, attns: Sequence[zoo.SelfAttention]):
        super().__init__()
        a = attns[0]
        self.heads, self.head_dim, self.causal = a.heads, a.head_dim, a.causal
        self.scale = 1.0 / math.sqrt(self.head_dim)
        for name in ("query", "key", "value", "proj", "attn_drop", "resid_drop"):
            setattr(self, name, _fuse([getattr(m, name) for m in attns]))
        if self.causal:
            self.register_buffer("mask", a.mask.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, T, C = x.size()
        heads = (B, N, T, self.heads, self.head_dim)
        q = self.query(x).view(heads).transpose(2, 3)  # [B, N, H, T, D]
        k = self.key(x).view(heads).transpose(2, 3)
        v = self.value(x).view(heads).transpose(2, 3)
        att = (q @ k.transpose(-2, -1)) * self.scale  # [B, N, H, T, T]
        if self.causal:
            att = att + (self.mask if T == self.mask.size(0) else self.mask[:T, :T])
        att = self.attn_drop(torch.softmax(att, dim=-1))
        y = (att @ v).transpose(2, 3).reshape(B, N, T, C)
        return self.resid_drop(self.proj(y))


class PreLNBlock(nn.Module):
    """B :class:`zoo.PreLNBlock` on x [B, N, T, C]: ``x + attn(LN(x))`` then ``x + MLP(LN(x))``, per-model
    LayerNorms and batched Linears."""

    def __init__(self, blocks: Sequence[zoo.PreLNBlock]):
        super().__init__()
        self.ln1 = _fuse([k.ln1 for k in blocks])
        self.attn = SelfAttention([k.attn for k in blocks])
        self.ln2 = _fuse([k.ln2 for k in blocks])
        self.mlp = _fuse([k.mlp for k in blocks])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    """B :class:`zoo.TransformerLM`. Token ids [N, T] (shared) -> token embeddings [B, N, T, C] + position
    embeddings [B, 1, T, C]; :class:`PreLNBlock` s, final LayerNorm and a bias-free batched Linear head on
    model-major activations; logits [B, N, T, vocab]."""

    def __init__(self, modules: Sequence[zoo.TransformerLM]):
        super().__init__()
        self.B, self.block_size = len(modules), modules[0].block_size
        for name in ("tok_emb", "pos_emb", "drop", "ln_f", "head"):
            setattr(self, name, _fuse([getattr(m, name) for m in modules]))
        self.blocks = nn.Sequential(*[PreLNBlock([m.blocks[i] for m in modules])
                                      for i in range(len(modules[0].blocks))])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos).unsqueeze(1))  # [B, N, T, C] + [B, 1, T, C]
        return self.head(self.ln_f(self.blocks(x)))


# ------------------------------------------------------------------------------------------- weights and registry
HFTA_MODELS: dict[str, tuple[type, type]] = {  # zoo name -> (zoo class, its hand-fused class)
    "lenet": (zoo.LeNet, LeNet),
    "resnet18": (zoo.ResNet18, ResNet18),
    "transformer_lm": (zoo.TransformerLM, TransformerLM),
}


def unpack(fused: nn.Module, b: int, grad: bool = False) -> dict[str, torch.Tensor]:
    """Model b's ``state_dict`` (the zoo module's keys) as views of the fused model's tensors; ``grad``: the views
    of their gradients instead (parameters only; None where a parameter has no gradient)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, layer in fused.named_modules():
        if not isinstance(layer, _Packed):
            continue
        tensors = [(n, p.grad if grad else p) for n, p in layer.named_parameters(recurse=False)]
        if not grad:
            tensors += list(layer.named_buffers(recurse=False))
        for name, t in tensors:
            out[f"{prefix}.{name}" if prefix else name] = None if t is None else layer.block(name, t, b)
    return out


def pack(fused: nn.Module, modules: Sequence[nn.Module]) -> None:
    """Copy each module's weights and buffers into its blocks of the fused model (the inverse of :func:`unpack`)."""
    with torch.no_grad():
        for b, m in enumerate(modules):
            state = m.state_dict()
            views = unpack(fused, b)
            if set(views) != set(state):
                raise ValueError(f"model {b} does not match the fused layout: {sorted(set(state) ^ set(views))[:3]} "
                                 "are in one of its state_dict and the fused model's blocks, not in both")
            for name, view in views.items():
                if view.shape != state[name].shape:
                    raise ValueError(f"model {b}: '{name}' is {tuple(state[name].shape)}, model 0's "
                                     f"{tuple(view.shape)}: the B models must have one architecture")
                view.copy_(state[name])


def hfta_model(name: str, modules: Sequence[nn.Module]) -> nn.Module | None:
    """The hand-fused model of B zoo modules ``name`` (one architecture, any weights), holding copies of their
    weights and buffers, with their device, dtype and train/eval mode; None when there is no hand-fused version
    (zoo models other than those in :data:`HFTA_MODELS`). Its forward takes the batch every model sees and returns
    the B outputs stacked, [B, N, ...]."""
    if name not in HFTA_MODELS:
        return None
    zoo_class, fused_class = HFTA_MODELS[name]
    if not modules or not all(type(m) is zoo_class for m in modules):
        raise ValueError(f"hfta_model('{name}') takes {zoo_class.__name__} modules, got "
                         f"{sorted({type(m).__name__ for m in modules}) or 'none'}")
    first = next(modules[0].parameters())
    fused = fused_class(modules).to(device=first.device, dtype=first.dtype)
    pack(fused, modules)
    return fused.train(modules[0].training)
