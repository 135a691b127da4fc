"""The torch runtime on a CUDA device: fused training of two zoo models equals each model trained alone by
torch.optim on the same GPU. Skipped where torch sees no CUDA device (``benchmarks/gpu_check.sh`` runs these)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err
from onnxfuse import fuse_models
from onnxfuse.core.split import split_weights
from onnxfuse.recipe.optim import make_optimizer
from onnxfuse.runtime.trainers import make_trainer
from tests.exporters.test_zoo import export_zoo, zoo_input, zoo_modules

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]
B, N, STEPS = 3, 16, 3  # ResNet-18 at batch 16 amplifies rounding differences ~10x per step (measured on CPU)


@pytest.fixture(autouse=True)
def exact_float32():
    """TF32 off: the comparison is of float32 arithmetic, whose rounding the fused and the alone runs share."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ResNet-18 with AdamW is left out: Adam normalizes the tiny gradients of its BatchNorm biases, and after three
# steps rounding alone moves those tensors by 1e-1 relative (its outputs by 5e-3), on CPU as on the GPU
@pytest.mark.parametrize("compile", ["off", "on"])
@pytest.mark.parametrize("name, kind", [("lenet", "adamw"), ("lenet", "sgd"), ("resnet18", "sgd")])
def test_fused_training_on_cuda_equals_each_model_alone(name, kind, compile, tmp_path):
    device = torch.device("cuda")
    mods = zoo_modules(name, B)
    fa = fuse_models(export_zoo(name, mods, tmp_path))
    lrs = [1e-3, 3e-3, 1e-2] if kind == "adamw" else [0.002, 0.005, 0.01]
    extra = {"momentum": 0.9} if kind == "sgd" else {}
    trainer = make_trainer("torch", fa.model, fa.spec, "cross-entropy", make_optimizer(kind, B, lr=lrs, **extra),
                           device="cuda", compile=compile)
    alone = [m.to(device).train() for m in mods]
    opts = [torch.optim.AdamW(m.parameters(), lr=lr) if kind == "adamw" else
            torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m, lr in zip(alone, lrs)]
    gen = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        x = zoo_input(name, N, seed=10 + step)
        y = torch.randint(0, 10, (N,), generator=gen)
        losses = trainer.step({"input": x.to(device), "labels": y.to(device)})
        for b, (m, o) in enumerate(zip(alone, opts)):
            o.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x.to(device)), y.to(device))
            loss.backward()
            o.step()
            assert abs(losses[b] - loss.item()) <= 1e-3 * max(1.0, abs(loss.item())), (step, b)
    assert trainer.last_ok.all()
    # outputs of the trained models in inference mode (BatchNorm on its running statistics) on held-out data
    x = zoo_input(name, N, seed=99)
    _, scores = trainer.eval_batch({"input": x.to(device), "labels": torch.zeros(N, dtype=torch.long).to(device)})
    with torch.no_grad():
        outputs = max(rel_err(scores[b], m.eval()(x.to(device)).cpu().numpy()) for b, m in enumerate(alone))
    split = split_weights(fa.spec, trainer.weights(), steps=STEPS)
    tensors = max(rel_err(split[b][k], v.detach().cpu().numpy()) for b, m in enumerate(alone)
                  for k, v in m.state_dict().items())
    print(f"{name} {kind} compile {compile} after {STEPS} steps: outputs {outputs:.1e}, tensors {tensors:.1e} (worst relative)")
    # cuDNN picks other algorithms for a grouped convolution than for one model's: rounding differs
    assert outputs < 1e-3 and tensors < 1e-3


def test_the_compiled_step_on_cuda_is_graphed_or_not_by_measurement_and_never_synchronizes(tmp_path):
    """LeNet B = 8, compiled: after the CUDA-graph trial (warm-up, capture, replays) the step is replayed or
    launched, whichever was faster, and its steps make no host synchronization (torch's sync debug mode raises on
    one); each model still equals torch.optim alone."""
    device = torch.device("cuda")
    mods = zoo_modules("lenet", 8)
    fa = fuse_models(export_zoo("lenet", mods, tmp_path))
    lrs = [1e-3 * (b + 1) for b in range(8)]
    trainer = make_trainer("torch", fa.model, fa.spec, "cross-entropy", make_optimizer("adamw", 8, lr=lrs),
                           device="cuda", compile="on")
    alone = [m.to(device).train() for m in mods]
    opts = [torch.optim.AdamW(m.parameters(), lr=lr) for m, lr in zip(alone, lrs)]
    gen = torch.Generator().manual_seed(0)
    batches = [(zoo_input("lenet", N, seed=10 + t), torch.randint(0, 10, (N,), generator=gen)) for t in range(16)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    for t, (x, y) in enumerate(batches):
        if t >= 12:  # decided by now (compile, 3 warm-up steps, capture, 5 trials)
            assert trainer.stepper.cuda_graph() in ("on", "off")
            torch.cuda.set_sync_debug_mode("error")
        try:
            trainer.launch({"input": x, "labels": y})
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for m, o in zip(alone, opts):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    print(f"CUDA graph: {trainer.stepper.cuda_graph()}")
    seen = trainer.observe()
    assert seen.ok.all() and (seen.failed_at == 0).all()
    split = split_weights(fa.spec, trainer.weights(), steps=16)
    worst = max(rel_err(split[b][k], v.detach().cpu().numpy()) for b, m in enumerate(alone)
                for k, v in m.state_dict().items())
    assert worst < 1e-3, worst
