"""Real model code: Hugging Face transformers' GPT-2 (LM head tied to the token embedding) and T5 encoder (shared
embedding under two state_dict keys), built from tiny configs with random weights (nothing is downloaded), and small
torch models with tied weights. Each fuses completely, its fused forward equals each model, it trains like
torch.optim trains each model alone, and its split state_dict loads with ``strict=True``.
"""
from __future__ import annotations

import csv
import functools
import warnings

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.conftest import rel_err, run_onnx
from onnxfuse import NotFusibleError, fuse_models, save_array
from onnxfuse.exporters import export_module
from onnxfuse.core.split import split_array, split_weights
from onnxfuse.recipe.losses import get_loss
from onnxfuse.recipe.optim import make_optimizer
from onnxfuse.training.run import TrainConfig, train_array
from onnxfuse.runtime.trainers import make_trainer

B = 3
N, T = 4, 8  # batch, sequence length
STEPS = 3
OPTIMIZERS = {  # per-model hyper-parameters
    "sgd": dict(lr=[0.05, 0.1, 0.2], momentum=0.9, weight_decay=[0.0, 1e-3, 1e-2]),
    "adamw": dict(lr=[1e-3, 3e-3, 1e-2], weight_decay=[0.0, 1e-2, 1e-1]),
}


def torch_optimizer(kind: str, module: torch.nn.Module, b: int) -> torch.optim.Optimizer:
    cfg = {k: (v[b] if isinstance(v, list) else v) for k, v in OPTIMIZERS[kind].items()}
    return (torch.optim.SGD if kind == "sgd" else torch.optim.AdamW)(module.parameters(), **cfg)


def train_torch(mods, kind, batches, loss_fn) -> np.ndarray:
    """Each module alone with torch.optim on ``batches``; returns the losses [STEPS, B]."""
    losses = np.zeros((len(batches), len(mods)))
    for b, m in enumerate(mods):
        opt = torch_optimizer(kind, m, b)
        for s, (x, y) in enumerate(batches):
            opt.zero_grad()
            loss = loss_fn(m.train()(x), y)
            loss.backward()
            opt.step()
            losses[s, b] = loss.item()
    return losses


def export_models(mods, x, folder) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [str(folder / f"model_{b}.onnx") for b in range(len(mods))]
    for m, p in zip(mods, paths):
        export_module(m, p, example_inputs=(x,))
    return paths


def fuse_completely(paths):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no node may fall back to per-model execution
        fa = fuse_models(paths)
    assert fa.spec.summary["fused_fraction"] == 1.0
    return fa


def assert_fused_forward(fa, mods, x):
    fused = run_onnx(fa.model, {"input": x.numpy()})[0]
    for b, m in enumerate(mods):
        with torch.no_grad():
            assert rel_err(fused[b], m.train()(x).numpy()) < 1e-5, b


def assert_state_matches(kind, split_state, module, initial):
    """Every state_dict key is there and moved; SGD: every tensor within 1e-4 of torch's (norm-wise relative).
    AdamW turns float noise in tiny gradients into full-size steps: it is checked through outputs instead."""
    ref = module.state_dict()
    assert set(split_state) == set(ref)
    for key, r in ref.items():
        assert rel_err(split_state[key], initial[key]) > 1e-5, (key, "did not move")
        if kind == "sgd":
            assert rel_err(split_state[key], r.numpy()) < 1e-4, key


def output_tolerance(kind: str) -> float:
    return 1e-4 if kind == "sgd" else 1e-3


# ---- Hugging Face transformers: GPT-2 (tied LM head) and the T5 encoder (shared embedding)

@functools.cache
def hf():
    """The transformers classes, imported once (a few seconds) and only by the tests that use them."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def gpt2_config():
    return hf().GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=80, n_positions=16, attn_pdrop=0.0,
                           resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def t5_config():
    return hf().T5Config(vocab_size=80, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, dropout_rate=0.0,
                         relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
                         pad_token_id=0, eos_token_id=1)


def gpt2(seed: int) -> torch.nn.Module:
    """GPT2LMHeadModel returning the logits tensor; its state_dict keys are GPT2LMHeadModel's."""
    class GPT2Logits(hf().GPT2LMHeadModel):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids).logits

    torch.manual_seed(seed)
    return GPT2Logits(gpt2_config())


def t5_encoder(seed: int) -> torch.nn.Module:
    """T5EncoderModel returning last_hidden_state; state_dict keys (shared.weight and its alias
    encoder.embed_tokens.weight) are T5EncoderModel's."""
    class T5Hidden(hf().T5EncoderModel):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids).last_hidden_state

    torch.manual_seed(seed)
    return T5Hidden(t5_config())


HF_CASES = {  # factory, the library's own class, its output tensor, fused loss (name, options), labels, torch loss
    "gpt2": (gpt2, lambda: hf().GPT2LMHeadModel(gpt2_config()), lambda out: out.logits,
             ("cross-entropy", {"class_axis": -1}), lambda g, n: torch.randint(0, 80, (n, T), generator=g),
             lambda out, y: torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))),
    "t5_encoder": (t5_encoder, lambda: hf().T5EncoderModel(t5_config()), lambda out: out.last_hidden_state,
                   ("mse", {}), lambda g, n: torch.randn((n, T, 32), generator=g),
                   torch.nn.functional.mse_loss),
}


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(HF_CASES))
def test_transformers_model_fuses_trains_and_splits_like_torch(name, kind, runtime, tmp_path):
    factory, plain, plain_output, (loss, loss_options), make_labels, torch_loss = HF_CASES[name]
    mods = [factory(seed) for seed in range(B)]
    initial = [{k: v.detach().clone().numpy() for k, v in m.state_dict().items()} for m in mods]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 80, (STEPS * N, T), generator=gen)
    y = make_labels(gen, STEPS * N)
    fa = fuse_completely(export_models(mods, x[:N], tmp_path / "jobs"))
    assert_fused_forward(fa, mods, torch.randint(0, 80, (N + 1, T), generator=gen))

    save_array(fa, tmp_path / "array")
    np.savez(tmp_path / "data.npz", input=x.numpy(), labels=y.numpy())
    train_array(tmp_path / "array", str(tmp_path / "data.npz"),
                TrainConfig(batch_size=N, steps=STEPS, loss=loss, loss_options=loss_options, optimizer=kind,
                            shuffle=False, runtime=runtime, **OPTIMIZERS[kind]), progress=False)
    torch_losses = train_torch(mods, kind, [(x[s * N:(s + 1) * N], y[s * N:(s + 1) * N]) for s in range(STEPS)],
                               torch_loss)
    with open(tmp_path / "array" / "metrics.csv") as f:
        fused_losses = {(int(r["step"]), int(r["model"])): float(r["loss"]) for r in csv.DictReader(f)
                        if r["split"] == "train"}
    for s in range(STEPS):
        for b in range(B):
            assert abs(fused_losses[(s + 1, b)] - torch_losses[s, b]) < 1e-4 * max(1.0, torch_losses[s, b]), (s, b)

    split_array(tmp_path / "array", tmp_path / "models")
    x_test = torch.randint(0, 80, (N, T), generator=gen)
    for b, m in enumerate(mods):
        state = load_file(str(tmp_path / "models" / f"model_{b}.safetensors"))
        assert_state_matches(kind, state, m, initial[b])
        fresh = plain()  # the library's own class: strict loading, every key (tied / aliased ones included)
        fresh.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
        with torch.no_grad():
            out = plain_output(fresh.eval()(input_ids=x_test)).numpy()
            ref = m.eval()(x_test).numpy()
        assert rel_err(out, ref) < output_tolerance(kind)
        onnx_out = run_onnx(str(tmp_path / "models" / f"model_{b}.onnx"), {"input": x_test.numpy()})[0]
        assert rel_err(onnx_out, out) < 1e-5


# ---- small torch models with tied weights

class TiedLM(torch.nn.Module):
    """Embedding [V, D] whose table is also the output projection (x @ E^T on [N, T, D]: MatMul + Transpose)."""

    def __init__(self, V: int = 20, D: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        self.mix = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


class TiedBag(torch.nn.Module):
    """Embedding tied to a Gemm (transB) head on the mean embedding: the table [V, D] is read as [V, D] and,
    transposed while packing, as [D, V]."""

    def __init__(self, V: int = 20, D: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        self.head = torch.nn.Linear(D, V)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.embed(ids).mean(1)))


class LinearTwice(torch.nn.Module):
    """One Linear applied to a 3-D tensor (MatMul + Transpose) and again to its mean over T (Gemm)."""

    def __init__(self, D: int = 8, K: int = 5):
        super().__init__()
        self.shared = torch.nn.Linear(D, D)
        self.out = torch.nn.Linear(D, K)

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        return self.out(self.shared(h.mean(1)))


TORCH_CASES = {  # module, input, labels, fused loss, torch loss
    "tied_lm": (TiedLM, lambda g, n: torch.randint(0, 20, (n, 6), generator=g),
                lambda g, n: torch.randint(0, 20, (n, 6), generator=g), get_loss("cross-entropy", class_axis=-1),
                lambda out, y: torch.nn.functional.cross_entropy(out.reshape(-1, 20), y.reshape(-1))),
    "tied_bag": (TiedBag, lambda g, n: torch.randint(0, 20, (n, 6), generator=g),
                 lambda g, n: torch.randint(0, 20, (n,), generator=g), "cross-entropy",
                 torch.nn.functional.cross_entropy),
    "linear_twice": (LinearTwice, lambda g, n: torch.randn((n, 6, 8), generator=g),
                     lambda g, n: torch.randint(0, 5, (n,), generator=g), "cross-entropy",
                     torch.nn.functional.cross_entropy),
}


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_tied_weights_fuse_and_train_like_torch(name, kind, runtime, tmp_path):
    cls, make_x, make_y, loss, torch_loss = TORCH_CASES[name]
    mods = []
    for seed in range(B):
        torch.manual_seed(seed)
        mods.append(cls())
    initial = [{k: v.detach().clone().numpy() for k, v in m.state_dict().items()} for m in mods]
    gen = torch.Generator().manual_seed(0)
    fa = fuse_completely(export_models(mods, make_x(gen, N), tmp_path))
    assert len(fa.spec.weights) == len(list(mods[0].parameters()))  # a tied tensor is one fused weight
    assert_fused_forward(fa, mods, make_x(gen, N + 1))
    trainer = make_trainer(runtime, fa.model, fa.spec, loss, make_optimizer(kind, B, **OPTIMIZERS[kind]),
                           workdir=str(tmp_path / "art"))
    batches = [(make_x(gen, N), make_y(gen, N)) for _ in range(STEPS)]
    fused_losses = np.array([trainer.step({"input": x.numpy(), "labels": y.numpy()}) for x, y in batches])
    torch_losses = train_torch(mods, kind, batches, torch_loss)
    assert np.abs(fused_losses - torch_losses).max() < 1e-4 * max(1.0, np.abs(torch_losses).max())
    split = split_weights(fa.spec, trainer.weights(), steps=STEPS)
    x_test = make_x(gen, N)
    for b, m in enumerate(mods):
        assert_state_matches(kind, split[b], m, initial[b])
        loaded = cls()
        loaded.load_state_dict({k: torch.from_numpy(v) for k, v in split[b].items()}, strict=True)
        with torch.no_grad():
            assert rel_err(loaded(x_test).numpy(), m(x_test).numpy()) < output_tolerance(kind), b


def test_weights_tied_in_one_model_only_are_refused(tmp_path):
    """Model 0 ties its head to the embedding, model 1 does not: the graphs look alike op by op, but one fused
    weight cannot stand for one tensor in model 0 and two in model 1."""
    torch.manual_seed(0)
    tied = TiedLM()
    torch.manual_seed(1)
    untied = TiedLM()
    untied.head.weight = torch.nn.Parameter(untied.embed.weight.detach().clone())
    paths = export_models([tied, untied], torch.randint(0, 20, (N, 6)), tmp_path)
    with pytest.raises(NotFusibleError, match="tie weights differently"):
        fuse_models(paths)


def test_split_writes_aliases_from_the_trained_tensor(tmp_path):
    """The exporter records a tied key as an alias (not as a constant holding the value from export time), and
    split writes the trained tensor under both keys."""
    import json

    import onnx

    from onnxfuse.core.source import METADATA_KEY

    torch.manual_seed(0)
    m = TiedLM()
    export_module(m, tmp_path / "m.onnx", example_inputs=(torch.randint(0, 20, (N, 6)),))
    meta = json.loads(next(p.value for p in onnx.load(tmp_path / "m.onnx").metadata_props if p.key == METADATA_KEY))
    alias, target = ("head.weight", "embed.weight") if "embed.weight" in meta["trainable"] else \
        ("embed.weight", "head.weight")
    assert meta["extra_state"][alias] == {"kind": "alias", "of": target}
    fa = fuse_models([str(tmp_path / "m.onnx")])
    initial = {t.name: onnx.numpy_helper.to_array(t) for t in fa.model.graph.initializer}
    state = split_weights(fa.spec, {n: initial[n] + 1.0 for n in fa.spec.weights})[0]  # "trained": all + 1
    assert set(state) == set(m.state_dict())
    assert np.array_equal(state[alias], m.state_dict()[target].numpy() + 1.0)
    assert np.array_equal(state[alias], state[target])


def test_export_warns_about_a_buffer_that_is_a_slice_of_a_parameter(tmp_path):
    """Such a buffer is neither the parameter (an alias) nor independent of it: split could only write its value
    from export time."""
    m = TiedLM()
    m.register_buffer("first_row", m.embed.weight.data[0])
    with pytest.warns(UserWarning, match="'first_row' shares memory with a graph initializer"):
        export_module(m, tmp_path / "m.onnx", example_inputs=(torch.randint(0, 20, (N, 6)),))


class _Logits(torch.nn.Module):
    """A transformers model's logits as the one output."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, x):
        return self.m(x).logits


def _plain(name: str):
    """(factory, example input) of a tiny transformers model for a plain export; the example's batch of 4 is the
    training batch (the TorchScript exporter bakes it into GPT-2's and Swin's reshapes)."""
    from transformers import (GPT2Config, GPT2LMHeadModel, ResNetConfig, ResNetForImageClassification, SwinConfig,
                              SwinForImageClassification)
    if name == "gpt2":
        return (lambda: _Logits(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                                           n_positions=16)))), torch.randint(0, 50, (4, 8))
    if name == "resnet":
        return (lambda: _Logits(ResNetForImageClassification(ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4)))), torch.randn(4, 3, 32, 32)
    return (lambda: _Logits(SwinForImageClassification(SwinConfig(
        image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=4,
        num_labels=4, drop_path_rate=0.0)))), torch.randn(4, 3, 32, 32)


@pytest.mark.parametrize("name", ["gpt2", "resnet", "swin"])
def test_a_plain_export_splits_completely_like_its_module(name, tmp_path):
    """GPT-2 (tied head), a BatchNorm ResNet and Swin (windowed attention), each exported by
    a plain torch.onnx.export (no onnxfuse metadata), fused and trained 3 steps: split with like= writes every
    key, loads with strict=True, and num_batches_tracked is torch's after 3 training forwards. Without like=
    the keys the graph cannot hold are missing, and split says so."""
    from onnxfuse.core.split import graph_keys, plain_export_note
    from onnxfuse.exporters.torch_export import module_extra_state

    make, x = _plain(name)
    torch.manual_seed(0)
    paths = []
    for b in range(2):
        paths.append(str(tmp_path / f"m{b}.onnx"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(make().train(), (x,), paths[-1], dynamo=False, input_names=["input"],
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    fa = fuse_models(paths)
    save_array(fa, tmp_path / "array")
    assert plain_export_note(fa.spec, [fa.sources[0].model]) is not None
    rng = np.random.default_rng(0)
    data = tmp_path / "d.npz"
    labels = rng.integers(0, 4, (16,) + ((8,) if name == "gpt2" else ()))
    inputs = rng.integers(0, 50, (16, 8)) if name == "gpt2" else rng.standard_normal((16, 3, 32, 32)).astype(np.float32)
    np.savez(data, input=inputs, labels=labels)
    lm = {"loss_options": {"class_axis": -1}} if name == "gpt2" else {}
    train_array(tmp_path / "array", str(data), TrainConfig(steps=3, batch_size=4, lr=[0.01, 0.02], runtime="torch",
                                                           verify_steps=0, **lm), progress=False)
    sd = make().state_dict()
    split_array(tmp_path / "array", tmp_path / "plain")
    lacking = set(sd) - set(load_file(str(tmp_path / "plain" / "model_0.safetensors")))
    assert lacking if name != "swin" else True, name  # GPT-2's tied head, ResNet's num_batches_tracked
    split_array(tmp_path / "array", tmp_path / "models", like=module_extra_state(make(), graph_keys(fa.spec)))
    for b in range(2):
        state = load_file(str(tmp_path / "models" / f"model_{b}.safetensors"))
        m = make()
        m.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()}, strict=True)
        counters = [k for k in sd if k.endswith("num_batches_tracked")]
        assert all(int(state[k]) == 3 for k in counters), counters
        assert (name != "resnet") or counters
        # integer buffers as the module has them (transformers' Swin keeps relative_position_index out of its
        # state_dict; torchvision's has it: test_split's integer-indexed table is that case)
        assert all(np.array_equal(state[k], v.numpy()) for k, v in sd.items() if not v.is_floating_point()
                   and not k.endswith("num_batches_tracked"))


# ---- BERT: an embedding with padding_idx, tied to the MLM decoder

def bert(seed: int) -> torch.nn.Module:
    """BertForMaskedLM returning the logits; its word embeddings have padding_idx 0 and are the decoder's weight."""
    class BertLogits(hf().BertForMaskedLM):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids).logits

    torch.manual_seed(seed)
    return BertLogits(hf().BertConfig(vocab_size=80, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, pad_token_id=0))


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_bert_padding_row_trains_as_torch_trains_it(kind, runtime, tmp_path):
    """The padding row of BERT's word embeddings gets no gradient from its lookups (torch's padding_idx), only the
    tied decoder's and weight decay: through onnxfuse's exporter it moves exactly as torch moves it (before, 5e-3
    of extra norm after 5 AdamW steps)."""
    mods = [bert(seed) for seed in range(B)]
    key = "bert.embeddings.word_embeddings.weight"
    initial = [{k: v.detach().clone().numpy() for k, v in m.state_dict().items()} for m in mods]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(1, 80, (STEPS * N, T), generator=gen)
    x[:, -3:] = 0  # padded sequences
    y = torch.randint(0, 80, (STEPS * N, T), generator=gen)
    fa = fuse_completely(export_models(mods, x[:N], tmp_path / "jobs"))
    assert fa.spec.weights[key].extra["padding_rows"] == [[0]] * B
    opt = make_optimizer(kind, B, **OPTIMIZERS[kind])
    trainer = make_trainer(runtime, fa.model, fa.spec, get_loss("cross-entropy", class_axis=-1), opt,
                           workdir=str(tmp_path / "art"))
    batches = [(x[s * N:(s + 1) * N], y[s * N:(s + 1) * N]) for s in range(STEPS)]
    for xb, yb in batches:
        trainer.step({"input": xb.numpy(), "labels": yb.numpy()})
    train_torch(mods, kind, batches, lambda out, t: torch.nn.functional.cross_entropy(out.reshape(-1, 80),
                                                                                      t.reshape(-1)))
    split = split_weights(fa.spec, trainer.weights(), steps=STEPS)
    for b, m in enumerate(mods):
        moved = split[b][key][0] - initial[b][key][0]
        ref = m.state_dict()[key][0].numpy() - initial[b][key][0]
        assert np.abs(moved - ref).max() <= 1e-3 * np.abs(ref).max(), (b, np.abs(moved - ref).max(), np.abs(ref).max())
        if kind == "sgd":  # every tensor as torch trains it (AdamW: through the padding row alone, see above)
            for k, r in m.state_dict().items():
                assert np.linalg.norm(split[b][k] - r.numpy()) <= 1e-4 * np.linalg.norm(r.numpy()) + 1e-6, (b, k)
