"""Small models for tests, the demo and the benchmarks. Each is a plain ``torch.nn.Module``.

``ZOO`` (at the end) lists small versions of well-known architectures with an example input and their task."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = [
    "LeNet", "CNNBN", "MLP", "DigitsCNN",
    "ResNet18", "MobileNetV2", "MobileNetV3Small", "PointNetCls", "PointNetSeg", "DCGANGenerator",
    "DCGANDiscriminator", "TransformerLM", "BertTiny", "ViTTiny",
    "BasicBlock", "InvertedResidual", "SqueezeExcite", "MobileNetV3Block", "TNet", "SelfAttention", "PreLNBlock",
    "PostLNLayer", "ZooEntry", "ZOO",
]


class LeNet(nn.Module):
    """LeNet-5 style CNN for [N, in_ch, 28, 28] images (uses ``x.view(x.size(0), -1)``)."""

    def __init__(self, in_ch: int = 1, num_classes: int = 10, image: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        side = ((image - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = x.view(x.size(0), -1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class CNNBN(nn.Module):
    """Conv-BatchNorm-ReLU blocks, global average pooling and a linear head, for [N, in_ch, H, W]."""

    def __init__(self, in_ch: int = 3, num_classes: int = 10, width: int = 16):
        super().__init__()
        # No conv bias before BatchNorm: its true gradient is exactly zero, and Adam turns float noise there into
        # full-size steps (in torch as in ONNX Runtime), so such biases cannot be compared tensor by tensor.
        self.conv1 = nn.Conv2d(in_ch, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


class MLP(nn.Module):
    """Flatten then three Linear layers (ReLU, Tanh)."""

    def __init__(self, in_features: int = 64, hidden: int = 64, num_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = torch.flatten(x, 1)
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


class DigitsCNN(nn.Module):
    """A small CNN with BatchNorm for scikit-learn's 8x8 digits ([N, 1, 8, 8], 10 classes): the demo's model."""

    def __init__(self, width: int = 16, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(2 * width * 4 * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))
        x = x.reshape(x.size(0), -1)  # reshape: a channels-last activation (eval on CPU) cannot be viewed
        return self.fc2(torch.relu(self.fc1(x)))


# ---------------------------------------------------------------------------------------------------------------
# Small versions of well-known architectures (CIFAR/MNIST sized). Every default config trains a step in well under
# a second on a 2-core CPU at batch 8. Convs directly before BatchNorm have no bias (see CNNBN).
# ---------------------------------------------------------------------------------------------------------------


def _conv_bn(in_ch: int, out_ch: int, kernel: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(in_ch, out_ch, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(out_ch)]


def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 Conv-BN layers with ReLU and an identity shortcut, or a 1x1 Conv-BN shortcut
    when the stride or the channel count changes. Maps [N, in_ch, H, W] to [N, out_ch, H / stride, W / stride]."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18: a 3x3 Conv-BN-ReLU stem (no max pool), four stages of two :class:`BasicBlock` each
    with ``width``, 2x, 4x and 8x channels (the last three stages downsample by 2 with a 1x1 Conv-BN shortcut),
    global average pooling and a linear head. Input [N, in_ch, H, W] (32x32 for CIFAR; 16x16 works too),
    output logits [N, num_classes]. ``width=8`` gives about 175k parameters (the original uses 64)."""

    def __init__(self, in_ch: int = 3, num_classes: int = 10, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, ch = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            out = width * 2 ** i
            layers.append(nn.Sequential(BasicBlock(ch, out, stride), BasicBlock(out, out, 1)))
            ch = out
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


class InvertedResidual(nn.Module):
    """MobileNetV2 inverted residual: 1x1 expansion Conv-BN-ReLU6 (skipped when ``expand == 1``), 3x3 depthwise
    Conv-BN-ReLU6 (groups = channels), 1x1 linear-bottleneck projection Conv-BN without activation, and an identity
    residual when stride is 1 and the channel count is kept. [N, in_ch, H, W] -> [N, out_ch, H / stride, W / stride]."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, expand: int):
        super().__init__()
        hidden = in_ch * expand
        self.use_res = stride == 1 and in_ch == out_ch
        layers: list[nn.Module] = []
        if expand != 1:
            layers += _conv_bn(in_ch, hidden, 1) + [nn.ReLU6()]
        layers += _conv_bn(hidden, hidden, 3, stride, groups=hidden) + [nn.ReLU6()]
        layers += _conv_bn(hidden, out_ch, 1)
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    """A small CIFAR-style MobileNetV2: a 3x3 Conv-BN-ReLU6 stem (stride 1), :class:`InvertedResidual` stages given
    by ``settings`` (expansion t, channels c, blocks n, first stride s), a 1x1 Conv-BN-ReLU6 to ``last_ch`` channels,
    global average pooling and a linear head. Input [N, in_ch, 32, 32], output logits [N, num_classes]; the
    default config has about 50k parameters."""

    DEFAULT_SETTINGS = ((1, 8, 1, 1), (6, 16, 2, 2), (6, 24, 2, 2), (6, 32, 2, 2))

    def __init__(self, in_ch: int = 3, num_classes: int = 10, stem_ch: int = 16, last_ch: int = 128,
                 settings: tuple[tuple[int, int, int, int], ...] = DEFAULT_SETTINGS):
        super().__init__()
        layers = _conv_bn(in_ch, stem_ch, 3) + [nn.ReLU6()]
        ch = stem_ch
        for t, c, n, s in settings:
            for i in range(n):
                layers.append(InvertedResidual(ch, c, s if i == 0 else 1, t))
                ch = c
        layers += _conv_bn(ch, last_ch, 1) + [nn.ReLU6()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(last_ch, num_classes)

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.classifier(x)


class SqueezeExcite(nn.Module):
    """Squeeze-and-excitation as in MobileNetV3: global average pool, 1x1 Conv (with bias) -> ReLU -> 1x1 Conv
    -> Hardsigmoid, and the input scaled channel-wise by the result. [N, C, H, W] -> [N, C, H, W]."""

    def __init__(self, ch: int, squeeze_ch: int):
        super().__init__()
        self.fc1 = nn.Conv2d(ch, squeeze_ch, 1)
        self.fc2 = nn.Conv2d(squeeze_ch, ch, 1)
        self.act = nn.Hardsigmoid()

    def forward(self, x):
        s = nn.functional.adaptive_avg_pool2d(x, 1)
        s = self.act(self.fc2(torch.relu(self.fc1(s))))
        return x * s


class MobileNetV3Block(nn.Module):
    """MobileNetV3 bneck: 1x1 expansion Conv-BN-act (skipped when ``exp_ch == in_ch``), k x k depthwise Conv-BN-act,
    optional :class:`SqueezeExcite`, 1x1 projection Conv-BN, identity residual when stride is 1 and channels are kept.
    act is ReLU or Hardswish. [N, in_ch, H, W] -> [N, out_ch, H / stride, W / stride]."""

    def __init__(self, in_ch: int, kernel: int, exp_ch: int, out_ch: int, use_se: bool, use_hs: bool, stride: int):
        super().__init__()
        self.use_res = stride == 1 and in_ch == out_ch
        act = nn.Hardswish if use_hs else nn.ReLU
        layers: list[nn.Module] = []
        if exp_ch != in_ch:
            layers += _conv_bn(in_ch, exp_ch, 1) + [act()]
        layers += _conv_bn(exp_ch, exp_ch, kernel, stride, groups=exp_ch) + [act()]
        if use_se:
            layers.append(SqueezeExcite(exp_ch, _make_divisible(exp_ch // 4)))
        layers += _conv_bn(exp_ch, out_ch, 1)
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.block(x) if self.use_res else self.block(x)


class MobileNetV3Small(nn.Module):
    """A small CIFAR-style MobileNetV3-Small: a 3x3 Conv-BN-Hardswish stem (stride 1), five
    :class:`MobileNetV3Block` bnecks (depthwise 3x3/5x5 convs, squeeze-excite with Hardsigmoid, ReLU then Hardswish),
    a 1x1 Conv-BN-Hardswish, global average pooling and a Linear-Hardswish-Linear head. Input [N, in_ch, 32, 32],
    output logits [N, num_classes]; the default config has about 90k parameters."""

    # kernel, expanded channels, out channels, squeeze-excite, hardswish, stride
    DEFAULT_CONFIG = ((3, 16, 16, True, False, 2), (3, 48, 24, False, False, 2), (3, 64, 24, False, False, 1),
                      (5, 96, 40, True, True, 2), (5, 120, 40, True, True, 1))

    def __init__(self, in_ch: int = 3, num_classes: int = 10, stem_ch: int = 16, last_ch: int = 160,
                 hidden: int = 256, config: tuple = DEFAULT_CONFIG):
        super().__init__()
        layers = _conv_bn(in_ch, stem_ch, 3) + [nn.Hardswish()]
        ch = stem_ch
        for k, exp, out, se, hs, s in config:
            layers.append(MobileNetV3Block(ch, k, exp, out, se, hs, s))
            ch = out
        layers += _conv_bn(ch, last_ch, 1) + [nn.Hardswish()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(last_ch, hidden), nn.Hardswish(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.classifier(x)


def _conv1d_bn(in_ch: int, out_ch: int) -> list[nn.Module]:
    return [nn.Conv1d(in_ch, out_ch, 1, bias=False), nn.BatchNorm1d(out_ch)]


class TNet(nn.Module):
    """PointNet's T-Net: a shared per-point MLP (1x1 Conv1d-BN-ReLU), global max pooling over the points,
    Linear-BN-ReLU layers and a Linear to k*k values, reshaped to [N, k, k] and added to the identity.
    Input [N, k, P], output the transform [N, k, k]."""

    def __init__(self, k: int = 3, channels: tuple[int, ...] = (16, 32, 64), fc: tuple[int, ...] = (32, 16)):
        super().__init__()
        self.k = k
        layers: list[nn.Module] = []
        ch = k
        for c in channels:
            layers += _conv1d_bn(ch, c) + [nn.ReLU()]
            ch = c
        self.mlp = nn.Sequential(*layers)
        head: list[nn.Module] = []
        for f in fc:
            head += [nn.Linear(ch, f, bias=False), nn.BatchNorm1d(f), nn.ReLU()]
            ch = f
        self.head = nn.Sequential(*head)
        self.fc = nn.Linear(ch, k * k)
        self.register_buffer("identity", torch.eye(k).reshape(1, k, k), persistent=False)

    def forward(self, x):
        x = torch.amax(self.mlp(x), dim=2)
        x = self.fc(self.head(x))
        return x.view(-1, self.k, self.k) + self.identity


class _PointNetEncoder(nn.Module):
    """PointNet encoder: :class:`TNet` input transform applied with ``torch.bmm``, per-point features from shared
    1x1 Conv1d-BN layers, and a global feature by max pooling over the points. [N, 3, P] -> ([N, C, P], [N, G])."""

    def __init__(self, in_ch: int = 3, point_ch: int = 16, hidden: int = 32, global_ch: int = 128):
        super().__init__()
        self.tnet = TNet(in_ch)
        self.conv1 = nn.Sequential(*_conv1d_bn(in_ch, point_ch), nn.ReLU())
        self.conv2 = nn.Sequential(*_conv1d_bn(point_ch, hidden), nn.ReLU())
        self.conv3 = nn.Sequential(*_conv1d_bn(hidden, global_ch))  # no ReLU before the max pool, as in PointNet

    def forward(self, x):
        trans = self.tnet(x)
        x = torch.bmm(x.transpose(1, 2), trans).transpose(1, 2)
        point_feat = self.conv1(x)
        g = torch.amax(self.conv3(self.conv2(point_feat)), dim=2)
        return point_feat, g


class PointNetCls(nn.Module):
    """A small PointNet classifier: input transform (:class:`TNet` + ``bmm``), shared per-point MLP (Conv1d with
    kernel 1, BatchNorm1d, ReLU), global max pooling over the points and a Linear-BN-ReLU / Linear head.
    Input a point cloud [N, 3, P] (e.g. P = 64), output logits [N, num_classes]."""

    def __init__(self, num_classes: int = 10, in_ch: int = 3, global_ch: int = 128, hidden: int = 64):
        super().__init__()
        self.feat = _PointNetEncoder(in_ch, global_ch=global_ch)
        self.fc1 = nn.Linear(global_ch, hidden, bias=False)
        self.bn1 = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        _, g = self.feat(x)
        return self.fc2(torch.relu(self.bn1(self.fc1(g))))


class PointNetSeg(nn.Module):
    """A small PointNet part/semantic segmentation net: the :class:`PointNetCls` encoder, then the global feature
    repeated over the points and concatenated (channel axis) with the per-point features, and a shared per-point
    Conv1d-BN-ReLU MLP ending in a Conv1d to the class scores. Input [N, 3, P], output logits [N, num_classes, P]."""

    def __init__(self, num_classes: int = 4, in_ch: int = 3, global_ch: int = 128, point_ch: int = 16,
                 hidden: tuple[int, ...] = (64, 32)):
        super().__init__()
        self.feat = _PointNetEncoder(in_ch, point_ch=point_ch, global_ch=global_ch)
        layers: list[nn.Module] = []
        ch = point_ch + global_ch
        for h in hidden:
            layers += _conv1d_bn(ch, h) + [nn.ReLU()]
            ch = h
        self.head = nn.Sequential(*layers, nn.Conv1d(ch, num_classes, 1))

    def forward(self, x):
        n_pts = x.size(2)
        point_feat, g = self.feat(x)
        g = g.unsqueeze(2).repeat(1, 1, n_pts)
        return self.head(torch.cat([g, point_feat], dim=1))


class DCGANGenerator(nn.Module):
    """DCGAN generator: a latent [N, nz, 1, 1] through ConvTranspose2d (4x4, to 4x4 pixels) then stride-2
    ConvTranspose2d layers, each but the last followed by BatchNorm and ReLU, halving the channels as the image
    doubles, and Tanh. Output images [N, nc, image, image] in [-1, 1]; ``image`` is 16 or 32 (any 4 * 2^k)."""

    def __init__(self, nz: int = 16, ngf: int = 16, nc: int = 1, image: int = 16):
        super().__init__()
        ups = (image // 4).bit_length() - 1
        if image < 8 or 4 * 2 ** ups != image:
            raise ValueError(f"image must be 4 * 2^k with k >= 1, got {image}")
        ch = ngf * 2 ** (ups - 1)
        layers: list[nn.Module] = [nn.ConvTranspose2d(nz, ch, 4, 1, 0, bias=False), nn.BatchNorm2d(ch), nn.ReLU()]
        for _ in range(ups - 1):
            layers += [nn.ConvTranspose2d(ch, ch // 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ch // 2), nn.ReLU()]
            ch //= 2
        layers += [nn.ConvTranspose2d(ch, nc, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)

    def forward(self, z):
        return self.main(z)


class DCGANDiscriminator(nn.Module):
    """DCGAN discriminator: stride-2 4x4 Conv2d layers with LeakyReLU(0.2) (BatchNorm after all but the first),
    doubling the channels down to 4x4 pixels, then a 4x4 Conv2d to one value. Input images [N, nc, image, image]
    (``image`` 16 or 32), output one logit per image [N, 1] (no Sigmoid: use BCE with logits)."""

    def __init__(self, nc: int = 1, ndf: int = 16, image: int = 16):
        super().__init__()
        downs = (image // 4).bit_length() - 1
        if image < 8 or 4 * 2 ** downs != image:
            raise ValueError(f"image must be 4 * 2^k with k >= 1, got {image}")
        layers: list[nn.Module] = [nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2)]
        ch = ndf
        for _ in range(downs - 1):
            layers += [nn.Conv2d(ch, ch * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ch * 2), nn.LeakyReLU(0.2)]
            ch *= 2
        layers.append(nn.Conv2d(ch, 1, 4, 1, 0, bias=False))
        self.main = nn.Sequential(*layers)

    def forward(self, x):
        return torch.flatten(self.main(x), 1)


class SelfAttention(nn.Module):
    """Multi-head self-attention written with plain matmuls (as minGPT and HF BERT): Linear q/k/v (k without
    bias), split into heads (view + transpose), ``q @ k^T / sqrt(d)``, an optional additive causal mask (a constant
    buffer of 0 and -inf above the diagonal for sequences up to ``max_len``), softmax, attention dropout, ``@ v``,
    heads merged and an output Linear with residual dropout. [N, T, dim] -> [N, T, dim]."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, causal: bool = False, max_len: int = 0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads, self.head_dim = heads, dim // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.query = nn.Linear(dim, dim)
        # No key bias: it adds q . b_k to a whole row of scores, which softmax cancels, so its true gradient is
        # exactly zero (float noise only, as for a conv bias before BatchNorm; see CNNBN).
        self.key = nn.Linear(dim, dim, bias=False)
        self.value = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.causal = causal
        if causal:
            mask = torch.full((max_len, max_len), float("-inf")).triu(1)
            self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        N, T, C = x.size()
        q = self.query(x).view(N, T, self.heads, self.head_dim).transpose(1, 2)  # [N, H, T, D]
        k = self.key(x).view(N, T, self.heads, self.head_dim).transpose(1, 2)
        v = self.value(x).view(N, T, self.heads, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * self.scale  # [N, H, T, T]
        if self.causal:
            att = att + (self.mask if T == self.mask.size(0) else self.mask[:T, :T])
        att = self.attn_drop(torch.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(N, T, C)
        return self.resid_drop(self.proj(y))


class PreLNBlock(nn.Module):
    """Pre-LayerNorm transformer block (GPT-2 / ViT): ``x + attn(LN(x))`` then ``x + MLP(LN(x))`` with a
    Linear-GELU-Linear-Dropout MLP. [N, T, dim] -> [N, T, dim]."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, dropout: float = 0.0, causal: bool = False,
                 max_len: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout, causal, max_len)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    """A small GPT (minGPT style) causal language model: token embedding plus a learned position embedding
    (``nn.Embedding`` of ``arange(T)``), embedding dropout, ``n_layer`` :class:`PreLNBlock` with causal
    :class:`SelfAttention`, a final LayerNorm and a bias-free LM head (not tied to the embedding).
    Input token ids [N, T] int64 (T <= block_size, values < vocab_size), output logits [N, T, vocab_size].
    ``dropout`` (default 0.1) is used for embeddings, attention weights and residual branches."""

    def __init__(self, vocab_size: int = 64, block_size: int = 16, n_layer: int = 2, n_head: int = 2,
                 n_embd: int = 32, dropout: float = 0.1):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[PreLNBlock(n_embd, n_head, 4 * n_embd, dropout, causal=True,
                                                 max_len=block_size) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        return self.head(self.ln_f(self.blocks(x)))


class PostLNLayer(nn.Module):
    """Post-LayerNorm (BERT) encoder layer: ``LN(x + attn(x))`` then ``LN(x + FFN(x))`` with bidirectional
    :class:`SelfAttention` and a Linear-GELU-Linear-Dropout feed-forward. [N, T, dim] -> [N, T, dim]."""

    def __init__(self, dim: int, heads: int, ffn_dim: int, dropout: float = 0.0, eps: float = 1e-12):
        super().__init__()
        self.attn = SelfAttention(dim, heads, dropout)
        self.ln1 = nn.LayerNorm(dim, eps=eps)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(), nn.Linear(ffn_dim, dim), nn.Dropout(dropout))
        self.ln2 = nn.LayerNorm(dim, eps=eps)

    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ffn(x))


class BertTiny(nn.Module):
    """A tiny BERT sequence classifier (HF BERT style): word + position (+ segment, when ``type_vocab_size > 0``)
    embeddings, LayerNorm and dropout, ``n_layer`` post-LN :class:`PostLNLayer` with bidirectional attention, a
    pooler ``tanh(Linear(h[:, 0]))`` on the first token, dropout and a linear classifier.
    Input token ids [N, T] int64 (T <= max_len, values < vocab_size; optional ``token_type_ids`` [N, T] when
    segments are enabled), output logits [N, num_classes]."""

    def __init__(self, vocab_size: int = 64, max_len: int = 16, hidden: int = 32, n_layer: int = 2, n_head: int = 2,
                 ffn_dim: int = 64, num_classes: int = 2, type_vocab_size: int = 0, dropout: float = 0.1):
        super().__init__()
        self.word_emb = nn.Embedding(vocab_size, hidden)
        self.pos_emb = nn.Embedding(max_len, hidden)
        self.type_emb = nn.Embedding(type_vocab_size, hidden) if type_vocab_size > 0 else None
        self.register_buffer("position_ids", torch.arange(max_len).unsqueeze(0), persistent=False)
        self.emb_ln = nn.LayerNorm(hidden, eps=1e-12)
        self.emb_drop = nn.Dropout(dropout)
        self.layers = nn.Sequential(*[PostLNLayer(hidden, n_head, ffn_dim, dropout) for _ in range(n_layer)])
        self.pooler = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, input_ids, token_type_ids=None):
        T = input_ids.size(1)
        pos = self.position_ids if T == self.position_ids.size(1) else self.position_ids[:, :T]
        x = self.word_emb(input_ids) + self.pos_emb(pos)
        if self.type_emb is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            x = x + self.type_emb(token_type_ids)
        h = self.layers(self.emb_drop(self.emb_ln(x)))
        pooled = torch.tanh(self.pooler(h[:, 0]))
        return self.classifier(self.drop(pooled))


class ViTTiny(nn.Module):
    """A tiny Vision Transformer: patch embedding by a Conv2d with kernel = stride = ``patch``, flattened to
    tokens (``flatten(2).transpose(1, 2)``), a learned class token prepended (``expand`` + ``cat``), a learned
    position embedding added, ``depth`` :class:`PreLNBlock`, a final LayerNorm and a linear head on the class
    token. Input [N, in_ch, image, image] ([N, 3, 32, 32] with patch 8, or [N, 1, 28, 28] with patch 7), output
    logits [N, num_classes]. ``dropout`` defaults to 0 (as ViT/timm)."""

    def __init__(self, image: int = 32, patch: int = 8, in_ch: int = 3, num_classes: int = 10, dim: int = 32,
                 depth: int = 2, heads: int = 2, mlp_dim: int = 64, dropout: float = 0.0):
        super().__init__()
        if image % patch:
            raise ValueError(f"image {image} is not a multiple of patch {patch}")
        num_patches = (image // patch) ** 2
        self.patch_embed = nn.Conv2d(in_ch, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[PreLNBlock(dim, heads, mlp_dim, dropout) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # [N, num_patches, dim]
        cls = self.cls_token.expand(x.size(0), -1, -1)
        x = self.drop(torch.cat([cls, x], dim=1) + self.pos_embed)
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


# ---------------------------------------------------------------------------------------------------------------
# Registry: a small default config per architecture, with an example input (batch 8) and the task it solves.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: ``factory()`` builds the small default config; ``input_shape`` is an example input including
    batch 8, ``input_dtype`` "float32" or "int64" (token ids below ``input_high``, the vocab size; None for float
    inputs); ``task`` one of classification, segmentation, lm, generator, discriminator; ``num_classes`` the number
    of classes (or vocab size) the output scores, None for the generator."""

    name: str
    factory: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    input_dtype: str
    input_high: int | None
    task: str
    num_classes: int | None


ZOO: dict[str, ZooEntry] = {e.name: e for e in (
    ZooEntry("lenet", LeNet, (8, 1, 28, 28), "float32", None, "classification", 10),
    ZooEntry("resnet18", ResNet18, (8, 3, 32, 32), "float32", None, "classification", 10),
    ZooEntry("mobilenetv2", MobileNetV2, (8, 3, 32, 32), "float32", None, "classification", 10),
    ZooEntry("mobilenetv3_small", MobileNetV3Small, (8, 3, 32, 32), "float32", None, "classification", 10),
    ZooEntry("pointnet_cls", PointNetCls, (8, 3, 64), "float32", None, "classification", 10),
    ZooEntry("pointnet_seg", PointNetSeg, (8, 3, 64), "float32", None, "segmentation", 4),
    ZooEntry("dcgan_generator", DCGANGenerator, (8, 16, 1, 1), "float32", None, "generator", None),
    ZooEntry("dcgan_discriminator", DCGANDiscriminator, (8, 1, 16, 16), "float32", None, "discriminator", 1),
    ZooEntry("transformer_lm", TransformerLM, (8, 16), "int64", 64, "lm", 64),
    ZooEntry("bert_tiny", BertTiny, (8, 16), "int64", 64, "classification", 2),
    ZooEntry("vit_tiny", ViTTiny, (8, 3, 32, 32), "float32", None, "classification", 10),
)}
