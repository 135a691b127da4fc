"""Run-time verification and the model's own rounding sensitivity: an ill-conditioned model (torchvision's
regnet_x_400mf, random weights, 32x32, batch 8) differs between the fused array and alone by as much as rounding
alone moves it (on some CPUs beyond the fixed tolerances) and trains; a planted defect is still refused, in that model and in
every zoo model; a correct array of well-conditioned models never pays for the measurement."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tests.conftest import cli, export_all
from tests.training.test_verify import plant_wrong_mapping, plant_zero_gradient
from tests.exporters.test_zoo import _out_shape, export_zoo, zoo_input, zoo_modules
from onnxfuse import fuse_models, save_array
from onnxfuse.core.weights import ArraySpec
from onnxfuse.exporters.zoo import ZOO
from onnxfuse.training.run import TrainConfig
from onnxfuse.training.run import verify_array
from onnxfuse.training.verify import SENSITIVITY_FACTOR, _nudge

B, N = 3, 8


def torchvision_models():
    """``torchvision.models`` (a skip where torchvision is not installed; conftest makes PyPI's wheel importable
    beside torch's CPU build)."""
    return pytest.importorskip("torchvision").models


@pytest.fixture(scope="module")
def regnet(tmp_path_factory):
    """B of torchvision's regnet_x_400mf (built from its config: random weights, no download), fused, and a
    batch of 32x32 images."""
    models = torchvision_models()
    d = tmp_path_factory.mktemp("regnet")
    mods = []
    for b in range(B):
        torch.manual_seed(20 + b)
        mods.append(models.regnet_x_400mf(num_classes=10))
    save_array(fuse_models(export_all(mods, (N, 3, 32, 32), d / "jobs")), d / "array")
    rng = np.random.default_rng(1)
    data = d / "data.npz"
    np.savez(data, input=rng.standard_normal((N, 3, 32, 32)).astype(np.float32), labels=rng.integers(0, 10, N))
    return d, str(d / "array"), str(data)


def test_an_ill_conditioned_model_trains_with_verification_on(regnet, capsys):
    """The issue's case: `onnxfuse train` on the default runtime verifies step 1 and trains. Whether a CPU needs the
    sensitivity fallback depends on its kernels (AVX-512 here beyond the fixed tolerances, an AVX2 EPYC within
    them): the test asserts the outcome, and only that a line which says "within" names the sensitivity."""
    _, array, data = regnet
    code, _, err = cli(capsys, "train", array, "--data", data, "--steps", 1, "--batch-size", N, "--optimizer", "adamw")
    assert code == 0, err
    line = next(line for line in err.splitlines() if "verified" in line)
    assert "every model matches" in line, line
    assert ("within" in line) == ("own rounding sensitivity" in line), line


def test_a_planted_defect_in_the_ill_conditioned_model_is_refused(regnet):
    """A zeroed gradient in block 1 (the tensor of the issue's report, 3% of whose gradient rounding alone moves):
    only model 1 fails, by that tensor, 'beyond' its own rounding sensitivity; the other two pass within theirs."""
    d, array, data = regnet
    tensor = "trunk_output.block1.block1-0.f.a.1.weight"
    planted = str(d / "planted")
    shutil.copytree(array, planted)
    plant_zero_gradient(planted, tensor, 1)
    report = verify_array(planted, data, TrainConfig(batch_size=N, steps=1, optimizer="adamw"))
    checks = report.per_model()
    assert [c.ok for c in checks] == [True, False, True], report.table()
    worst = checks[1].worst
    assert worst.name == tensor and worst.rel == pytest.approx(1.0)
    assert worst.of_rounding > 2 * SENSITIVITY_FACTOR  # well beyond, not at the edge (10x measured)
    message = str(report.error())
    assert "model 1" in message and f"'{tensor}'" in message
    assert "beyond the model's own rounding sensitivity" in message


# ------------------------------------------------------------------------------------------- planted, zoo models
def _zoo_data(name: str, n: int = 16) -> tuple[dict, dict]:
    """A batch for zoo entry ``name`` and the config options of its task's loss."""
    e, rng = ZOO[name], np.random.default_rng(0)
    if e.task in ("generator", "discriminator"):
        return {"input": zoo_input(name, n).numpy(),
                "labels": rng.random((n,) + _out_shape(name)[1:]).astype(np.float32)}, {"loss": "mse"}
    if e.task == "lm":
        return {"input": zoo_input(name, n).numpy(),
                "labels": rng.integers(0, e.num_classes, (n, e.input_shape[1]))}, {"loss_options": {"class_axis": -1}}
    labels = (n, _out_shape(name)[-1]) if e.task == "segmentation" else (n,)
    return {"input": zoo_input(name, n).numpy(), "labels": rng.integers(0, e.num_classes, labels)}, {}


FAST_ZOO = ("mobilenetv3_small", "pointnet_seg", "transformer_lm")  # the rest: make test-all (~30 s)


@pytest.mark.parametrize("name", [n if n in FAST_ZOO else pytest.param(n, marks=pytest.mark.slow) for n in ZOO])
def test_planted_defects_are_still_caught_in_every_zoo_model(name, tmp_path):
    """B = 2 zoo models: the correct array passes without measuring any sensitivity (it pays nothing); model 1's
    first tensor with a zeroed gradient, or its middle tensor read from model 0's weights, fails in model 1 alone,
    naming the tensor."""
    save_array(fuse_models(export_zoo(name, zoo_modules(name, 2), tmp_path)), tmp_path / "array")
    data, options = _zoo_data(name)
    cfg = TrainConfig(batch_size=8, steps=2, optimizer="adamw", lr=[1e-3, 3e-3], **options)
    report = verify_array(tmp_path / "array", data, cfg)
    assert report.ok and not any(c.sensitivity_measured for c in report.checks), report.table()
    spec = ArraySpec.load(str(tmp_path / "array" / "array.json"))
    trainable, _ = spec.parameter_names()
    first, middle = (spec.weights[trainable[i]].sources[1] for i in (0, len(trainable) // 2))
    for plant, tensor in ((plant_zero_gradient, first), (plant_wrong_mapping, middle)):
        planted = tmp_path / plant.__name__
        shutil.copytree(tmp_path / "array", planted)
        plant(str(planted), tensor, 1)
        report = verify_array(planted, data, cfg)
        assert [c.ok for c in report.per_model()] == [True, False], (plant.__name__, report.table())
        assert tensor in {t.name for t in report.per_model()[1].tensors if not t.ok}, plant.__name__
        assert "model 1" in str(report.error())


def test_a_nudge_moves_every_float_by_one_step_and_keeps_zeros():
    x = np.array([1.0, -3.5, 0.0, 1e-30, 7e5, 2.0, -1.0, 0.5], np.float32)
    moved = _nudge(x, np.random.default_rng(0))
    assert moved.dtype == np.float32 and moved[2] == 0.0
    nz = x != 0
    steps = (moved[nz].astype(np.float64) - x[nz]) / np.spacing(np.abs(x[nz])).astype(np.float64)
    assert sorted(set(steps)) == [-1.0, 1.0]  # one float32 step, up or down
    labels = np.arange(4)
    assert np.array_equal(_nudge(labels, np.random.default_rng(0)), labels)  # integers are not nudged
