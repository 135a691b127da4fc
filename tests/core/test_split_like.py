"""`split --like` and `state_dicts(like=)` refuse a module whose state_dict is not the array's models' (keys and
shapes), in one line and before anything is written; two identical splits write byte-identical files."""
from __future__ import annotations

import hashlib
import os
import subprocess

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.conftest import EXE, cli, one_error_line
from onnxfuse import fuse_models, save_array
from onnxfuse.exporters import export_module, zoo
from onnxfuse.training.run import TrainConfig, train_array

SHAPE = (8, 1, 8, 8)  # zoo.MLP's in_features=64 and zoo.DigitsCNN both read [N, 1, 8, 8]


@pytest.fixture(scope="module")
def mlp_array(tmp_path_factory):
    """Two zoo.MLPs (hidden 64), fused and trained 3 steps."""
    root = tmp_path_factory.mktemp("mlp")
    paths = []
    for b in range(2):
        torch.manual_seed(b)
        paths.append(str(root / f"m{b}.onnx"))
        export_module(zoo.MLP(), paths[-1], input_shape=SHAPE)
    save_array(fuse_models(paths), root / "array")
    rng = np.random.default_rng(0)
    np.savez(root / "d.npz", input=rng.standard_normal((40,) + SHAPE[1:]).astype(np.float32),
             labels=rng.integers(0, 10, 40))
    train_array(root / "array", str(root / "d.npz"), TrainConfig(steps=3, batch_size=8, runtime="torch",
                                                                 verify_steps=0), progress=False)
    return root / "array"


@pytest.mark.parametrize("like, says", [
    ("onnxfuse.exporters.zoo:DigitsCNN", "fc3.weight"),  # another class: it lacks keys of the array
    ("FILE:wider", "[128, 64]"),  # the same class with other arguments: a shape differs
])
def test_split_like_refuses_a_module_that_is_not_the_arrays_models(mlp_array, tmp_path, capsys, like, says):
    (tmp_path / "factories.py").write_text("from onnxfuse.exporters import zoo\n\n"
                                           "def wider():\n    return zoo.MLP(hidden=128)\n")
    like = like.replace("FILE", str(tmp_path / "factories.py"))
    code, _, err = cli(capsys, "split", mlp_array, "-o", tmp_path / "out", "--like", like)
    line = one_error_line(err)
    assert code == 2 and says in line and "--like" in line, err
    assert not (tmp_path / "out").exists()


def test_state_dicts_like_refuses_a_module_that_is_not_the_arrays_models():
    import onnxfuse
    from onnxfuse.core.errors import ConfigError

    torch.manual_seed(0)
    arr = onnxfuse.fuse([zoo.MLP(), zoo.MLP()], torch.randn(*SHAPE))
    with pytest.raises(ConfigError, match="DigitsCNN") as e:
        arr.state_dicts(like=zoo.DigitsCNN())
    assert "\n" not in str(e.value) and "fc3.weight" in str(e.value)
    with pytest.raises(ConfigError, match=r"\[128, 64\]"):
        arr.state_dicts(like=zoo.MLP(hidden=128))
    sd = arr.state_dicts(like=zoo.MLP())  # the right class is taken as before
    zoo.MLP().load_state_dict(sd[1], strict=True)


def test_split_like_of_the_right_class_still_loads_strictly(mlp_array, tmp_path, capsys):
    code, _, err = cli(capsys, "split", mlp_array, "-o", tmp_path / "out", "--like", "onnxfuse.exporters.zoo:MLP")
    assert code == 0, err
    for b in range(2):
        state = load_file(str(tmp_path / "out" / f"model_{b}.safetensors"))
        zoo.MLP().load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=True)


def test_two_identical_splits_write_identical_bytes(mlp_array, tmp_path):
    """Each split in its own process (safetensors wrote its metadata from a hash map, whose order differs between
    processes): every file of both folders byte for byte, best states included."""
    for out in ("a", "b"):
        proc = subprocess.run([EXE, "split", str(mlp_array), "-o", str(tmp_path / out), "-q"], capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr

    def digests(folder):
        return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in sorted(os.listdir(folder))}

    a, b = digests(tmp_path / "a"), digests(tmp_path / "b")
    assert sorted(a) == ["model_0.onnx", "model_0.safetensors", "model_1.onnx", "model_1.safetensors"]
    assert a == b
    meta = __import__("safetensors").safe_open(str(tmp_path / "a" / "model_0.safetensors"), "np").metadata()
    assert meta["onnxfuse.state"] == "final" and meta["onnxfuse.step"] == "3"
