"""Split: the round trip is bit-exact; split ONNX models give the outputs of torch modules loaded from the
split state_dicts."""
from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from safetensors.numpy import load_file

from conftest import MODELS, export_all, make_modules, rel_err, run_onnx
from onnxfuse import fuse_models, save_array
from onnxfuse.core.split import split_array
from onnxfuse.training import TrainConfig, train_array


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
