"""Random ops inside the graph (issue 39): each model draws from its own generator, seeded from its node's seed and
its index in the array, mixed with the run's seed; the draws depend neither on B nor on the model's place, and a
resumed run's generators continue where the checkpoint left them."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn as nn

from tests.conftest import export_all
from onnxfuse import fuse_models, save_array
from onnxfuse.core.rules.random import model_seed
from onnxfuse.runtime.torch.program import OnnxModule

SHAPE = (8, 12)


class NoisyMLP(nn.Module):
    """A hidden layer with Gaussian noise added (RandomNormalLike), which moves what it learns."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(12, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h + 0.3 * torch.randn_like(h))


def _modules(B):
    out = []
    for b in range(B):
        torch.manual_seed(b)
        out.append(NoisyMLP())
    return out


def _seeds(model) -> list[float]:
    return [a.f for n in model.graph.node if n.op_type == "RandomNormalLike" for a in n.attribute if a.name == "seed"]


def test_each_model_draws_its_own_numbers_whatever_b_and_its_place(tmp_path):
    """Three models fused, and models 0 and 2 alone re-fused as the array's survivors (their indices kept): each
    model's random node has the same seed in both, no two models share one, and model 2's draws are the same."""
    paths = export_all(_modules(3), SHAPE, tmp_path / "jobs")
    three = fuse_models(paths)
    two = fuse_models([paths[0], paths[2]], model_ids=[0, 2])
    assert _seeds(three.model) == [model_seed(None, b) for b in range(3)]
    assert _seeds(two.model) == [_seeds(three.model)[0], _seeds(three.model)[2]]

    def draws(fa, b):  # model b's noise: its node alone, run in a module of its own (the run's seed: 0)
        node = [n for n in fa.model.graph.node if n.op_type == "RandomNormalLike"][b]
        from onnx import helper

        g = helper.make_graph([node], "g", [helper.make_tensor_value_info(node.input[0], 1, None)],
                              [helper.make_tensor_value_info(node.output[0], 1, None)])
        mod = OnnxModule(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), trainable=[])
        return mod(**{node.input[0]: torch.zeros(4, 16)})[0]

    assert torch.equal(draws(three, 2), draws(two, 1)) and not torch.equal(draws(three, 0), draws(three, 2))


@pytest.mark.parametrize("runtime", ["torch"])
def test_a_resumed_run_draws_what_the_uninterrupted_one_would(runtime, tmp_path):
    """Train 6 steps with a checkpoint every 3; then the same array from its step-3 checkpoint (the last
    checkpoint and the final state removed, as a kill after it leaves them): the resumed run ends with the
    uninterrupted run's weights bit for bit. Before, the generators restarted from their seeds at the resume.
    And another --seed draws other numbers."""
    from onnxfuse.cli.main import main
    from safetensors.numpy import load_file

    save_array(fuse_models(export_all(_modules(2), SHAPE, tmp_path / "jobs")), tmp_path / "array")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", input=rng.standard_normal((64, 12)).astype(np.float32),
             labels=rng.integers(0, 3, 64))
    shutil.copytree(tmp_path / "array", tmp_path / "other_seed")
    run = ["--data", str(tmp_path / "data.npz"), "--steps", "6", "--checkpoint-every", "3", "--batch-size", "16",
           "--lr", "0.1", "--runtime", runtime, "--compile", "off", "-q"]
    assert main(["train", str(tmp_path / "array"), *run]) == 0
    weights = load_file(str(tmp_path / "array" / "trained" / "weights.safetensors"))
    shutil.rmtree(tmp_path / "array" / "trained")
    shutil.rmtree(tmp_path / "array" / "checkpoints" / "step_00000006")
    assert main(["train", str(tmp_path / "array"), "--resume", "-q"]) == 0
    again = load_file(str(tmp_path / "array" / "trained" / "weights.safetensors"))
    assert weights.keys() == again.keys() and all(np.array_equal(weights[k], again[k]) for k in weights)
    assert main(["train", str(tmp_path / "other_seed"), *run, "--seed", "1"]) == 0
    other = load_file(str(tmp_path / "other_seed" / "trained" / "weights.safetensors"))
    assert not all(np.array_equal(weights[k], other[k]) for k in weights)
