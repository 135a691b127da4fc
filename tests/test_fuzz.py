"""The differential fuzzer's fixed seeds: 48 random models (fuzz/grammar.py), each fused at B = 1, 2, 3, trained
on each runtime (onnxruntime-training, PyTorch) and compared with torch (fuzz/harness.py). ``make fuzz N=...
SEED=...`` runs a campaign over other seeds.

The seeds are 0-36 and the 11 seeds a greedy cover of seeds 0-399 added so that every layer kind, every variant of
attention, slicing, padding, reshaping, pooling, normalization and residual joins, every input kind (1-D, 2-D,
3-D images, flat features, token ids with plain and tied language-model heads) and per-model inputs appear."""
from __future__ import annotations

import pytest

from fuzz.campaign import Worker
from fuzz.grammar import generate, render

SEEDS = list(range(37)) + [48, 50, 91, 129, 151, 153, 169, 224, 228, 266, 361]


@pytest.fixture(scope="module")
def worker():
    with Worker() as w:  # one process for the module: a native crash fails its model, not the test session
        yield w


@pytest.mark.parametrize("seed", SEEDS)
def test_fused_model_trains_like_torch(seed, runtime, worker):
    spec = generate(seed)
    out = worker.check(spec, runtime=runtime)
    # sensitive: beyond a bound only as far as torch's own rounding goes; runtime: ONNX Runtime alone does the same
    assert out.status in ("pass", "sensitive", "runtime"), (
        f"seed {seed} at B={out.B}, {out.stage}: {out.message}\n{render(spec).source}\n"
        f"(python -m fuzz --n 1 --seed {seed} --runtime {runtime} shrinks it)")


LOOP_SEEDS = [0, 3, 48, 91, 151, 224, 361]  # image, token and per-model-input models, BatchNorm, attention


@pytest.mark.parametrize("seed", LOOP_SEEDS)
def test_fused_model_trains_like_torch_in_a_users_loop(seed, worker):
    """The array as a torch module in a plain loop (``FusedArray``, ``onnxfuse.optim``, torch's loss per model)
    trains each generated model as torch.optim trains it alone."""
    spec = generate(seed)
    out = worker.check(spec, runtime="loop")
    assert out.status in ("pass", "sensitive"), (
        f"seed {seed} at B={out.B}, {out.stage}: {out.message}\n{render(spec).source}\n"
        f"(python -m fuzz --n 1 --seed {seed} --runtime loop shrinks it)")


def test_the_grammar_covers_every_layer_kind():
    """The fixed seeds exercise every kind of layer the grammar has (a kind no seed reaches is never tested)."""
    from fuzz.grammar import KINDS

    used = {k for s in SEEDS for k in render(generate(s)).kinds}
    assert used == set(KINDS), sorted(set(KINDS) - used)
