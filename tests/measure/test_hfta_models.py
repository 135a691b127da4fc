"""The hand-fused (HFTA-style) models `onnxfuse bench --modes hfta` measures: B zoo models with different weights,
run as one, give each model's outputs, BatchNorm statistics and gradients (float32, as close to float64 as torch's
own), and one AdamW step over the
fused parameters moves each model's weights as torch.optim.AdamW on that model alone does."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from onnxfuse.exporters.zoo import ZOO
from onnxfuse.measure.hfta_models import HFTA_MODELS, hfta_model, unpack
from onnxfuse.training.verify import SENSITIVITY_FACTOR

B, N = 3, 4
MODELS = sorted(HFTA_MODELS)


def _models(name: str) -> list[torch.nn.Module]:
    kwargs = {"dropout": 0.0} if name == "transformer_lm" else {}
    out = []
    for b in range(B):
        torch.manual_seed(100 + b)
        out.append(ZOO[name].factory(**kwargs).train())
    return out


def _batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    e = ZOO[name]
    g = torch.Generator().manual_seed(7)
    shape = (N,) + tuple(e.input_shape[1:])
    if e.input_dtype == "int64":
        return torch.randint(0, e.input_high, shape, generator=g), torch.randint(0, e.num_classes, shape, generator=g)
    return torch.randn(shape, generator=g), torch.randint(0, e.num_classes, (N,), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # cross-entropy over the last axis
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize("name", MODELS)
def test_unpack_gives_back_each_models_state_dict_bit_exact(name):
    mods = _models(name)
    fused = hfta_model(name, mods)
    for b, m in enumerate(mods):
        views, state = unpack(fused, b), m.state_dict()
        assert views.keys() == state.keys()
        for k in state:
            assert torch.equal(views[k], state[k]), (b, k)


# float32's unit roundoff: the floor of a comparison with the exact value, one rounding of each element
U32 = 2.0 ** -24


def _as_close_as_torch(fused: torch.Tensor, alone: torch.Tensor, exact: torch.Tensor, what: str,
                       scale: float | None = None) -> None:
    """The fused model's float32 ``fused`` is as close to the float64 value ``exact`` as torch's own float32 ``alone``
    is: ||fused - exact|| <= SENSITIVITY_FACTOR * max(||alone - exact||, u * scale), verification's rule for a
    model's own rounding sensitivity (onnxfuse/training/verify.py). Two float32 programs with other summation orders
    differ by what rounding moves the model, which an ill-conditioned one amplifies (resnet18's BatchNorm over a
    batch of 4 moves its conv1 gradient by 3 % between two CPUs' kernels): measured, not assumed. ``scale`` (default
    ||exact||) is what the rounded sums were made of: for a gradient, the model's whole gradient, since a tensor
    whose gradient cancels to ~0 (a bias before BatchNorm) keeps the rounding of its terms, and is judged by it."""
    exact = exact.double()
    err, own = (fused.double() - exact).norm(), (alone.double() - exact).norm()
    bound = SENSITIVITY_FACTOR * max(own, U32 * (exact.norm() if scale is None else scale))
    assert err <= bound, f"{what}: {err:.3g} from float64 where torch alone is {own:.3g} (bound {bound:.3g})"


@pytest.mark.parametrize("name", MODELS)
def test_outputs_batchnorm_statistics_and_gradients_equal_each_model_alone(name):
    """Each against float64 (the same models in double), as close as torch's float32 model alone is."""
    mods = _models(name)
    exact = [copy.deepcopy(m).double() for m in mods]
    fused = hfta_model(name, mods)
    x, y = _batch(name)
    x64 = x if name == "transformer_lm" else x.double()

    # forward, train mode: each model's outputs (BatchNorm on batch statistics) and new running statistics
    out = fused(x)
    assert out.shape[:2] == (B, N)
    ref = [m(x) for m in mods]
    ref64 = [m(x64) for m in exact]
    for b, m in enumerate(mods):
        _as_close_as_torch(out[b], ref[b], ref64[b], f"model {b} outputs")
        views = unpack(fused, b)
        params, state64 = dict(m.named_parameters()), exact[b].state_dict()
        for k, v in m.state_dict().items():  # the buffers: running statistics and num_batches_tracked
            if k not in params:
                _as_close_as_torch(views[k], v, state64[k], f"model {b} {k}")
        assert any("running_mean" in k for k in views) == (name == "resnet18")

    # one summed loss: the gradient of each fused block is that model's own gradient
    sum(_loss(out[b], y) for b in range(B)).backward()
    for r in ref + ref64:
        _loss(r, y).backward()
    for b, m in enumerate(mods):
        grads, params64 = unpack(fused, b, grad=True), dict(exact[b].named_parameters())
        whole = torch.cat([p.grad.ravel() for p in params64.values()]).norm()
        for k, p in m.named_parameters():
            _as_close_as_torch(grads[k], p.grad, params64[k].grad, f"model {b} {k} gradient", whole)


@pytest.mark.parametrize("name", MODELS)
def test_one_adamw_step_over_the_fused_parameters_is_one_adamw_per_model(name):
    """In float64: Adam's first step is lr * g / (|g| + eps), so in float32 a gradient within a few eps (1e-8) of
    zero turns float noise in g into a visible part of a step (1 of resnet18's 175k weights moves 1 % of a step
    differently); float64 leaves only the algebra to compare."""
    mods = [m.double() for m in _models(name)]
    originals = copy.deepcopy(mods)
    fused = hfta_model(name, mods)
    x, y = _batch(name)
    x = x if name == "transformer_lm" else x.double()
    out = fused(x)
    sum(_loss(out[b], y) for b in range(B)).backward()
    torch.optim.AdamW(fused.parameters(), lr=1e-3).step()
    for m in mods:
        _loss(m(x), y).backward()
        torch.optim.AdamW(m.parameters(), lr=1e-3).step()
    for b, m in enumerate(mods):
        views = unpack(fused, b)
        for k, v in m.state_dict().items():
            torch.testing.assert_close(views[k], v, rtol=1e-9, atol=1e-9, msg=lambda s: f"model {b} {k}: {s}")
            if v.is_floating_point() and "running" not in k:  # the step moved it (so the test can fail)
                assert not torch.equal(v, originals[b].state_dict()[k]), (b, k)


def test_the_fused_convolution_is_one_grouped_convolution_and_other_models_have_none():
    fused = hfta_model("lenet", _models("lenet"))
    assert fused.conv2.groups == B and fused.conv2.weight.shape == (B * 16, 6, 5, 5)
    assert hfta_model("mobilenetv2", [ZOO["mobilenetv2"].factory()]) is None
    with pytest.raises(ValueError, match="LeNet"):
        hfta_model("lenet", [ZOO["resnet18"].factory()])
