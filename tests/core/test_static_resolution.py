"""Values that are static at fuse time but computed in the exported graph — slice bounds and pads from ``x.shape``,
``nn.MultiheadAttention``'s reshapes, window partitions, ``view(N, T, -1)`` before a LayerNorm — are resolved before
fusion (``resolve_static_pass``), so the nodes that read them fuse instead of running once per model.

Real torch modules, B = 3 with different weights: every node fuses, the fused forward equals each model's own
forward at batch sizes other than the export's, training equals torch.optim on each model alone, and the pass alone
does not change what a model computes at any batch size.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.conftest import rel_err, run_onnx
from onnxfuse import fuse_models
from onnxfuse.exporters import export_module
from onnxfuse.core.passes import resolve_static_pass
from onnxfuse.core.split import split_weights
from onnxfuse.recipe.optim import make_optimizer
from onnxfuse.runtime.trainers import make_trainer

B = 3
STEPS = 4
EXPORT_N = 2  # the batch size of the example input; the tests run other batch sizes


# ---- the cases: each computes a parameter of a Slice / Pad / Reshape / LayerNorm from shapes

def rotate_half(x):  # Llama's rotary embedding (transformers' rotate_half)
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """q * cos + rotate_half(q) * sin over positions arange(T): Slice axes/starts/ends computed from shapes."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def forward(self, x):
        q = self.q(x)
        freqs = torch.outer(torch.arange(x.shape[1], dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return q * emb.cos() + rotate_half(q) * emb.sin()


class SamePad(nn.Module):
    """A valid convolution padded back to the input size: F.pad with pads computed from both shapes."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        ph, pw = x.shape[-2] - y.shape[-2], x.shape[-1] - y.shape[-1]
        return F.pad(y, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))


class Ghost(nn.Module):
    """GhostNet's module (primary conv + cheap depthwise conv, concatenated, cut to the output channels), then a
    crop to half the input size: Slices with computed axes and ends."""

    def __init__(self, out_ch: int = 5):
        super().__init__()
        self.out_ch = out_ch
        self.primary = nn.Conv2d(3, 3, 1)
        self.cheap = nn.Conv2d(3, 3, 3, padding=1, groups=3)
        self.conv = nn.Conv2d(out_ch, 4, 3)

    def forward(self, x):
        x1 = self.primary(x)
        y = torch.cat([x1, self.cheap(x1)], dim=1)[:, : self.out_ch]
        return self.conv(y)[:, :, : x.shape[2] // 2, : x.shape[3] // 2]


class MHA(nn.Module):
    """torch.nn.MultiheadAttention(batch_first=True), as torchvision's ViT uses it."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class Encoder(nn.Module):
    """torch.nn.TransformerEncoderLayer(batch_first=True) (post-LN; width 16: with width 8, onnxruntime-training
    1.19 fails to build the fused post-LN gradient graph, "Duplicate definition of name (ln_ones_grad)", with or
    without resolution) and a Linear head."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.layer(x))


class HeadsLayerNorm(nn.Module):
    """Heads split with view(N, T, H, -1) and merged with reshape(N, T, -1), then a LayerNorm: ONNX's shape
    inference leaves the -1 next to the symbolic batch unknown, so the LayerNorm's dims must be resolved."""

    def __init__(self, d: int = 8, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        n, t, _ = x.size()
        q = self.q(x).view(n, t, self.heads, -1).transpose(1, 2)
        a = torch.softmax(q @ q.transpose(-1, -2), dim=-1) @ q
        return self.norm(a.transpose(1, 2).reshape(n, t, -1))


def _patch_merging_pad(x):  # torchvision.models.swin_transformer
    H, W, _ = x.shape[-3:]
    x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
    return torch.cat([x[..., 0::2, 0::2, :], x[..., 1::2, 0::2, :], x[..., 0::2, 1::2, :], x[..., 1::2, 1::2, :]], -1)


def _shifted_window_attention(x, qkv, proj, bias, window, heads, shift):
    """torchvision's shifted_window_attention (no dropout): pad to whole windows, roll, partition, attention with a
    relative-position bias and the shift mask, merge, roll back, crop — every size derived from x.shape."""
    N, H, W, C = x.shape
    pad_r = (window[1] - W % window[1]) % window[1]
    pad_b = (window[0] - H % window[0]) % window[0]
    x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
    _, pH, pW, _ = x.shape
    shift = [0 if window[0] >= pH else shift[0], 0 if window[1] >= pW else shift[1]]
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    nw = (pH // window[0]) * (pW // window[1])
    x = x.view(N, pH // window[0], window[0], pW // window[1], window[1], C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(N * nw, window[0] * window[1], C)
    q, k, v = qkv(x).reshape(x.size(0), x.size(1), 3, heads, C // heads).permute(2, 0, 3, 1, 4)
    attn = (q * (C // heads) ** -0.5).matmul(k.transpose(-2, -1)) + bias
    if sum(shift) > 0:
        mask = x.new_zeros((pH, pW))
        count = 0
        for h in ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None)):
            for w in ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None)):
                mask[h[0]:h[1], w[0]:w[1]] = count
                count += 1
        mask = mask.view(pH // window[0], window[0], pW // window[1], window[1])
        mask = mask.permute(0, 2, 1, 3).reshape(nw, window[0] * window[1])
        mask = mask.unsqueeze(1) - mask.unsqueeze(2)
        mask = mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
        attn = attn.view(x.size(0) // nw, nw, heads, x.size(1), x.size(1)) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, heads, x.size(1), x.size(1))
    x = proj(F.softmax(attn, dim=-1).matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), C))
    x = x.view(N, pH // window[0], pW // window[1], window[0], window[1], C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(N, pH, pW, C)
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(shift[0], shift[1]), dims=(1, 2))
    return x[:, :H, :W, :].contiguous()


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int = 2, window=(3, 3), shift=(1, 1)):
        super().__init__()
        self.window, self.heads, self.shift = list(window), heads, list(shift)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.table = nn.Parameter(torch.randn((2 * window[0] - 1) * (2 * window[1] - 1), heads) * 0.1)
        coords = torch.stack(torch.meshgrid(torch.arange(window[0]), torch.arange(window[1]), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        rel[:, :, 0] += window[0] - 1
        rel[:, :, 1] += window[1] - 1
        rel[:, :, 0] *= 2 * window[1] - 1
        self.register_buffer("relative_position_index", rel.sum(-1).flatten())  # persistent: a per-model buffer

    def forward(self, x):
        L = self.window[0] * self.window[1]
        bias = self.table[self.relative_position_index].view(L, L, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
        x = x + _shifted_window_attention(self.norm1(x), self.qkv, self.proj, bias, self.window, self.heads,
                                          self.shift)
        return x + self.mlp(self.norm2(x))


class Swin(nn.Module):
    """Patch embedding, a shifted-window block (10x10 -> 5x5 tokens, padded to 6x6 windows), patch merging with
    computed pads and its LayerNorm over 4C, a second block, mean-pooled head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 2, 2)
        self.block1 = SwinBlock(8)
        self.merge_norm = nn.LayerNorm(32)
        self.reduction = nn.Linear(32, 16, bias=False)
        self.block2 = SwinBlock(16, window=(2, 2))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = self.block1(self.embed(x).permute(0, 2, 3, 1))
        x = self.block2(self.reduction(self.merge_norm(_patch_merging_pad(x))))
        return self.head(x.mean((1, 2)))


class BatchArithmetic(nn.Module):
    """Shape arithmetic that involves the batch size stays computed: batch and time merged and split again, a slice
    ending at the batch size, a per-sample scale from arange(N). (Folded with the export's N = 2, any other batch
    size would fail or be wrong.)"""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        n, t, d = x.shape
        y = self.lin(x.reshape(n * t, d)).view(n, t, -1)
        scale = torch.arange(n, dtype=torch.float32).view(-1, 1, 1) + 1.0
        return y[:n, : t - 1] * scale


CASES = {  # name: (factory, example input shape with batch EXPORT_N)
    "rotary": (Rotary, (EXPORT_N, 5, 8)),
    "same_pad": (SamePad, (EXPORT_N, 3, 7, 6)),
    "ghost": (Ghost, (EXPORT_N, 3, 8, 8)),
    "multihead_attention": (MHA, (EXPORT_N, 5, 8)),
    "transformer_encoder_layer": (Encoder, (EXPORT_N, 5, 16)),
    "heads_layernorm": (HeadsLayerNorm, (EXPORT_N, 5, 8)),
    "swin": (Swin, (EXPORT_N, 3, 10, 10)),
    "batch_arithmetic": (BatchArithmetic, (EXPORT_N, 5, 8)),
}


def make(name: str, b: int) -> nn.Module:
    torch.manual_seed(b)
    return CASES[name][0]()


@functools.cache
def exported(name: str, folder: str) -> tuple[list[nn.Module], list[str]]:
    """Model b of case ``name`` (seed b) and its export; exported once per test session."""
    mods = [make(name, b) for b in range(B)]
    paths = [f"{folder}/{name}_{b}.onnx" for b in range(B)]
    for m, p in zip(mods, paths):
        export_module(m, p, example_inputs=(torch.randn(*CASES[name][1]),))
    return mods, paths


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("static"))


def fuse_completely(paths):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no node may run once per model
        fa = fuse_models(paths)
    assert fa.spec.summary["unfused"] == []
    assert fa.spec.summary["fused_fraction"] == 1.0
    return fa


def torch_forward(m: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return m.train()(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("name", list(CASES))
def test_fuses_completely_and_equals_each_model(name, folder):
    mods, paths = exported(name, folder)
    fa = fuse_completely(paths)
    rng = np.random.default_rng(0)
    for n in (1, 5):  # not the export's batch size
        x = rng.standard_normal((n,) + CASES[name][1][1:]).astype(np.float32)
        fused = run_onnx(fa.model, {"input": x})[0]
        for b, m in enumerate(mods):
            assert rel_err(fused[b], torch_forward(m, x)) < 1e-5, (n, b)


@pytest.mark.parametrize("name", ["swin", "multihead_attention", "batch_arithmetic"])
def test_the_pass_alone_computes_what_the_model_computes(name, folder):
    """resolve_static_pass on one export: the same outputs, bit for bit, at every batch size."""
    _, paths = exported(name, folder)
    model = onnx.load(paths[0])
    resolved = resolve_static_pass(model)
    onnx.checker.check_model(resolved, full_check=True)
    assert len(resolved.graph.node) < len(model.graph.node)
    rng = np.random.default_rng(1)
    for n in (1, EXPORT_N, 7):
        x = rng.standard_normal((n,) + CASES[name][1][1:]).astype(np.float32)
        np.testing.assert_array_equal(run_onnx(resolved, {"input": x})[0], run_onnx(model, {"input": x})[0])


class BufferIndex(nn.Module):
    """A persistent integer buffer picks and reorders features (different in every model): a per-model weight, so
    its value must never be folded into the graph."""

    def __init__(self, seed: int):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("perm", torch.randperm(8, generator=torch.Generator().manual_seed(seed))[:5])

    def forward(self, x):
        return self.lin(x)[..., self.perm[: x.shape[-1] // 2]]


def test_per_model_integer_buffers_are_not_folded(tmp_path):
    mods, paths = [], []
    for b in range(B):
        torch.manual_seed(b)
        mods.append(BufferIndex(seed=b))
        paths.append(str(tmp_path / f"m{b}.onnx"))
        export_module(mods[-1], paths[-1], example_inputs=(torch.randn(EXPORT_N, 5, 8),))
    assert len({tuple(m.perm.tolist()) for m in mods}) == B
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # indexing with per-model indices may run once per model; that is fine here
        fa = fuse_models(paths)  # folding a buffer's value would make the B graphs differ
    x = np.random.default_rng(2).standard_normal((3, 5, 8)).astype(np.float32)
    fused = run_onnx(fa.model, {"input": x})[0]
    for b, m in enumerate(mods):
        assert rel_err(fused[b], torch_forward(m, x)) < 1e-5, b


def _ceil_pool_then_shape_reshape(op: str, dims: int, pool_input_is_output: bool) -> onnx.ModelProto:
    """x [N, 2, 3, ...] -> Relu -> r -> <op> (kernel 2, stride 2, pads 1, ceil_mode 1) -> y -> Reshape(y,
    Concat(Shape(y)[0:1], Shape(y)[2:], [-1])): y moved to [N, *S, C] through shape arithmetic that folds at load.
    Each axis of length 3 has 2 windows for torch, 3 for ONNX's shape inference (the third starts at 4 = L + pb)."""
    attrs = dict(kernel_shape=[2] * dims, strides=[2] * dims, pads=[1] * (2 * dims), ceil_mode=1)
    if op == "AveragePool":
        attrs["count_include_pad"] = 0
    nodes = [
        onnx.helper.make_node("Relu", ["x"], ["r"]),
        onnx.helper.make_node(op, ["r"], ["y"], **attrs),
        onnx.helper.make_node("Shape", ["y"], ["s"]),
        onnx.helper.make_node("Slice", ["s", "zero", "one"], ["n"]),
        onnx.helper.make_node("Slice", ["s", "two", "end"], ["spatial"]),
        onnx.helper.make_node("Concat", ["n", "spatial", "minus_one"], ["target"], axis=0),
        onnx.helper.make_node("Reshape", ["y", "target"], ["out"]),
    ]
    ints = {"zero": [0], "one": [1], "two": [2], "end": [dims + 2], "minus_one": [-1]}
    f = onnx.TensorProto.FLOAT
    outputs = [onnx.helper.make_tensor_value_info("out", f, ["N"] + [None] * (dims + 1))]
    if pool_input_is_output:  # its shape is then in the inferred graph outputs, not in value_info
        outputs.append(onnx.helper.make_tensor_value_info("r", f, ["N", 2] + [3] * dims))
    graph = onnx.helper.make_graph(
        nodes, "ceil_pool", [onnx.helper.make_tensor_value_info("x", f, ["N", 2] + [3] * dims)], outputs,
        [onnx.numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


@pytest.mark.parametrize("pool_input_is_output", [False, True])
@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_no_value_is_folded_from_a_window_shape_before_it_is_torchs(op, dims, pool_input_is_output):
    """A ceil-mode pool's output shape is ONNX's until the window pass makes it torch's; a Reshape target folded
    from it in between was stale (fuzz seed 1527: ``[N, -1, 4, 3]`` for a pool output ``[N, 4, 4, 4, 2]``)."""
    from onnxfuse.core.source import load_source

    model = _ceil_pool_then_shape_reshape(op, dims, pool_input_is_output)
    loaded = load_source(model).model
    pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d} if op == "MaxPool" else \
        {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
    kw = dict(ceil_mode=True) if op == "MaxPool" else dict(ceil_mode=True, count_include_pad=False)
    for n in (1, 4):
        x = np.random.default_rng(n).standard_normal((n, 2) + (3,) * dims).astype(np.float32)
        y = pool[dims](torch.relu(torch.from_numpy(x)), 2, 2, 1, **kw)
        expected = y.reshape(n, *y.shape[2:], -1).numpy()
        np.testing.assert_allclose(run_onnx(loaded, {"x": x})[0], expected, rtol=1e-6, atol=1e-6)


TRAIN = {  # name: optimizer and per-model hyper-parameters
    "transformer_encoder_layer": ("sgd", dict(lr=[0.05, 0.1, 0.02], momentum=[0.9, 0.5, 0.0],
                                              weight_decay=[0.0, 1e-3, 1e-2])),
    "rotary": ("adamw", dict(lr=[1e-3, 3e-3, 1e-2], weight_decay=[0.0, 1e-2, 1e-1])),
}


@pytest.mark.parametrize("name", list(TRAIN))
def test_training_equals_torch_optim_on_each_model(name, folder, runtime, tmp_path):
    kind, cfg = TRAIN[name]
    _, paths = exported(name, folder)
    mods = [make(name, b) for b in range(B)]  # the exported weights, in modules of this test's own
    fa = fuse_completely(paths)
    trainer = make_trainer(runtime, fa.model, fa.spec, "mse", make_optimizer(kind, B, **cfg),
                           workdir=str(tmp_path / "art"))
    opts = [torch.optim.SGD(m.parameters(), lr=cfg["lr"][b], momentum=cfg["momentum"][b],
                            weight_decay=cfg["weight_decay"][b]) if kind == "sgd" else
            torch.optim.AdamW(m.parameters(), lr=cfg["lr"][b], weight_decay=cfg["weight_decay"][b])
            for b, m in enumerate(mods)]
    rng = np.random.default_rng(3)
    shape = CASES[name][1]
    for _ in range(STEPS):
        x = rng.standard_normal((6,) + shape[1:]).astype(np.float32)
        y = rng.standard_normal(torch_forward(mods[0], x).shape).astype(np.float32)
        fused_loss = trainer.step({"input": x, "labels": y})
        for b, m in enumerate(mods):
            opts[b].zero_grad()
            loss = F.mse_loss(m.train()(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            opts[b].step()
            assert abs(fused_loss[b] - loss.item()) <= 1e-5 * max(1.0, abs(loss.item())), b
    split = split_weights(fa.spec, trainer.weights(), steps=STEPS)
    for b, m in enumerate(mods):
        for key, ref in m.state_dict().items():
            assert rel_err(split[b][key], ref.numpy()) < 1e-4, (b, key)


# ---- Hugging Face transformers (tiny configs, random weights): slow, since importing transformers takes seconds

class _Output(nn.Module):
    """A transformers model returning one output tensor; ``mask``: pass an all-ones attention mask (transformers 5
    checks position ids for packed sequences with torch.diff otherwise, which the TorchScript exporter lacks)."""

    def __init__(self, model: nn.Module, key: str, mask: bool = False):
        super().__init__()
        self.model, self.key, self.mask = model, key, mask

    def forward(self, x):
        out = self.model(x, attention_mask=torch.ones_like(x)) if self.mask else self.model(x)
        return getattr(out, self.key)


def _hf_case(name: str):
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    if name == "llama":  # rotary embedding, grouped-query attention, RMSNorm
        cfg = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             attn_implementation="eager", use_cache=False)
        return lambda: _Output(tf.LlamaForCausalLM(cfg), "logits", mask=True), lambda n: torch.randint(0, 64, (n, 8))
    if name == "swin":  # window partition with padding, shifted windows, patch merging
        cfg = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=8, depths=[2, 2], num_heads=[2, 2], window_size=4,
                            drop_path_rate=0.0, attn_implementation="eager")
        return lambda: _Output(tf.SwinModel(cfg), "pooler_output"), lambda n: torch.randn(n, 3, 32, 32)
    cfg = tf.ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       attn_implementation="eager")
    return lambda: _Output(tf.ViTModel(cfg), "last_hidden_state"), lambda n: torch.randn(n, 3, 16, 16)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "swin", "vit"])
def test_transformers_models_fuse_completely(name, tmp_path):
    factory, example = _hf_case(name)
    mods, paths = [], []
    for b in range(B):
        torch.manual_seed(b)
        mods.append(factory())
        paths.append(str(tmp_path / f"{name}_{b}.onnx"))
        export_module(mods[-1], paths[-1], example_inputs=(example(EXPORT_N),))
    fa = fuse_completely(paths)
    x = example(EXPORT_N + 1)
    fused = run_onnx(fa.model, {"input": x.numpy()})[0]
    for b, m in enumerate(mods):
        with torch.no_grad():
            assert rel_err(fused[b], m.train()(x).numpy()) < 1e-5, b
