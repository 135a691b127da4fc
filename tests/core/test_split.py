"""Split: the round trip is bit-exact; split ONNX models give the outputs of torch modules loaded from the
split state_dicts."""
from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from safetensors.numpy import load_file

from tests.conftest import MODELS, ROOT, export_all, make_modules, rel_err, run_onnx
from onnxfuse import fuse_models, save_array
from onnxfuse.core.split import split_array
from onnxfuse.training.run import TrainConfig, train_array


def test_split_without_training_is_bit_exact(tmp_path):
    mods = make_modules("cnn_bn", 3)
    fa = fuse_models(export_all(mods, MODELS["cnn_bn"][1], tmp_path / "jobs"))
    save_array(fa, tmp_path / "array")
    split_array(tmp_path / "array", tmp_path / "models", initial=True)
    for b, m in enumerate(mods):
        state = load_file(str(tmp_path / "models" / f"model_{b}.safetensors"))
        sd = m.state_dict()
        assert set(state) == set(sd)
        for k, v in sd.items():
            assert state[k].dtype == v.numpy().dtype and state[k].tobytes() == v.numpy().tobytes(), k
        inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "models" / f"model_{b}.onnx").graph.initializer}
        for k in inits.keys() & sd.keys():
            assert inits[k].tobytes() == sd[k].numpy().tobytes(), k


def test_split_onnx_matches_torch_loaded_from_safetensors(runtime, tmp_path, rng):
    name = "cnn_bn"
    mods = make_modules(name, 3)
    shape = MODELS[name][1]
    save_array(fuse_models(export_all(mods, shape, tmp_path / "jobs")), tmp_path / "array")
    x = rng.standard_normal((64,) + shape[1:]).astype(np.float32)
    np.savez(tmp_path / "data.npz", input=x, labels=rng.integers(0, 10, 64))
    train_array(tmp_path / "array", tmp_path / "data.npz",
                TrainConfig(steps=5, batch_size=16, optimizer="adamw", lr=[1e-3, 1e-2, 3e-2], runtime=runtime),
                progress=False)
    split_array(tmp_path / "array", tmp_path / "models")
    factory = MODELS[name][0]
    xt = rng.standard_normal((10,) + shape[1:]).astype(np.float32)
    for b in range(3):
        m = factory()
        m.load_state_dict({k: torch.from_numpy(v) for k, v in
                           load_file(str(tmp_path / "models" / f"model_{b}.safetensors")).items()}, strict=True)
        assert int(m.bn1.num_batches_tracked) == 5
        with torch.no_grad():
            ref = m.eval()(torch.from_numpy(xt)).numpy()
        out = run_onnx(str(tmp_path / "models" / f"model_{b}.onnx"), {"input": xt})[0]
        assert rel_err(out, ref) < 1e-5
        # training moved the weights away from the initial ones
        assert rel_err(m.fc.weight.detach().numpy(), mods[b].fc.weight.detach().numpy()) > 1e-4


class _Indexed(torch.nn.Module):
    """A relative-position table read through an integer buffer, as Swin's attention reads its
    ``relative_position_index``."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(7, 4))
        self.register_buffer("index", torch.tensor([3, 0, 6, 2, 5]))  # the same in every model, as Swin's

    def forward(self, x):
        return x + self.table[self.index].sum(1)


class _WithIndexed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.attn = torch.nn.Linear(3, 5), _Indexed()

    def forward(self, x):
        return self.attn(self.fc(x))


def test_split_of_a_plain_export_writes_its_integer_buffers(tmp_path):
    """A graph from a plain torch.onnx.export (no onnxfuse metadata) holds the integer buffer as an initializer;
    split writes it, so the split state_dict loads with strict=True and equals the module's."""
    torch.manual_seed(0)
    mods = [_WithIndexed() for _ in range(2)]
    paths = []
    for b, m in enumerate(mods):
        paths.append(str(tmp_path / f"m{b}.onnx"))
        torch.onnx.export(m, (torch.randn(2, 3),), paths[-1], dynamo=False, input_names=["input"],
                          do_constant_folding=False)  # folding would bake table[index] into one constant
    assert "attn.index" in {t.name for t in onnx.load(paths[0]).graph.initializer}
    fa = fuse_models(paths)
    save_array(fa, tmp_path / "array")
    split_array(tmp_path / "array", tmp_path / "models", initial=True)
    for b, m in enumerate(mods):
        state = load_file(str(tmp_path / "models" / f"model_{b}.safetensors"))
        fresh = _WithIndexed()
        fresh.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=True)
        for k, v in m.state_dict().items():
            assert torch.equal(fresh.state_dict()[k], v), k


class _TiedBN(torch.nn.Module):
    """A BatchNorm CNN with a head tied to another layer (GPT-2's lm_head / wte in small)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 4, bias=False)
        self.head.weight = self.fc.weight

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.head(torch.tanh(self.fc(h)))


def make_tied_bn():
    return _TiedBN()


def test_split_like_fills_the_keys_a_plain_export_cannot_hold(tmp_path, capsys):
    """Plain exports of a tied BatchNorm CNN, trained 5 steps: without --like split warns which keys it lacks;
    with --like (CLI) and state_dicts(like=) the files load with strict=True, the tied key equals the trained
    weight it aliases, and num_batches_tracked is torch's after 5 training forwards."""
    import sys

    from tests.conftest import cli

    torch.manual_seed(0)
    mods = [_TiedBN() for _ in range(2)]
    paths = []
    for b, m in enumerate(mods):
        paths.append(str(tmp_path / f"m{b}.onnx"))
        torch.onnx.export(m, (torch.randn(2, 1, 6, 6),), paths[-1], dynamo=False, input_names=["input"],
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    save_array(fuse_models(paths), tmp_path / "array")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", input=rng.standard_normal([40, 1, 6, 6]).astype(np.float32),
             labels=rng.integers(0, 4, 40))
    code, _, err = cli(capsys, "train", tmp_path / "array", "--data", tmp_path / "d.npz", "--steps", 5,
                       "--batch-size", 8, "--runtime", "torch", "--verify-steps", 0, "-q")
    assert code == 0, err
    code, _, err = cli(capsys, "split", tmp_path / "array", "-o", tmp_path / "plain")
    assert code == 0 and "--like MODULE:FACTORY" in err and "num_batches_tracked" in err, err
    (tmp_path / "tied.py").write_text("import sys\nsys.path.insert(0, %r)\nfrom tests.core.test_split import make_tied_bn\n"
                                      % str(ROOT))
    code, _, err = cli(capsys, "split", tmp_path / "array", "-o", tmp_path / "models", "--like",
                       f"{tmp_path / 'tied.py'}:make_tied_bn")
    assert code == 0, err
    for b in range(2):
        state = load_file(str(tmp_path / "models" / f"model_{b}.safetensors"))
        fresh = _TiedBN()
        fresh.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=True)
        assert int(state["bn.num_batches_tracked"]) == 5
        assert np.array_equal(state["head.weight"], state["fc.weight"])
        assert not np.array_equal(state["fc.weight"], mods[b].fc.weight.detach().numpy())  # trained
    sys.modules.pop("tied", None)
