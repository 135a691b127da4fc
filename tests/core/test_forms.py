"""Fusion forms (``Rule.forms``) and the strategies that pick them: every form of a node computes what the B models
compute and trains as they train (on both runtimes); the weight layout does not depend on the form; the ``auto``
strategy's measured choice is the fastest combination of forms on a synthetic network."""
from __future__ import annotations

import os
import statistics

import numpy as np
import pytest
import torch
from onnx import helper as h

from tests.conftest import check_fused, graph_model, rand_init, run_onnx, vinfo
from fuzz.grammar import generate, render
from fuzz.harness import check_model, check_source
from onnxfuse import fuse_models
from onnxfuse.core.errors import ConfigError
from onnxfuse.core.passes import FORMS
from onnxfuse.core.rules import RULES
from tests.fuzz.test_regressions import rendered

CONV_FORMS = RULES[("", "Conv")].forms  # the forms of the networks below (the recurrent ones: test_recurrent.py)


def _conv_net(d: int, group: int, bias: bool, transpose: bool):
    """x [N, 2, *S] (shared) -> Conv 2->4 (the dense form of a shared input) -> Conv or ConvTranspose 4->6 with
    ``group`` groups, stride 2 -> Relu."""
    S, K = [5] * d, [3] * d

    def build(r):
        w_shape = [4, 6 // group, *K] if transpose else [6, 4 // group, *K]
        ins = ["h", "w"] + (["b"] if bias else [])
        inits = [rand_init(r, "w0", [4, 2, *[1] * d]), rand_init(r, "w", w_shape)]
        inits += [rand_init(r, "b", [6])] if bias else []
        op = "ConvTranspose" if transpose else "Conv"
        nodes = [h.make_node("Conv", ["x", "w0"], ["h"]),
                 h.make_node(op, ins, ["c"], group=group, strides=[2] * d, pads=[1] * (2 * d)),
                 h.make_node("Relu", ["c"], ["out"])]
        out_s = [2 * (s - 1) + 3 - 2 for s in S] if transpose else [(s + 2 - 3) // 2 + 1 for s in S]
        return graph_model(nodes, [vinfo("x", ["N", 2, *S])], [vinfo("out", ["N", 6, *out_s])], inits)

    return build, {"x": np.random.default_rng(1).standard_normal((3, 2, *S)).astype(np.float32)}


@pytest.mark.parametrize("form", CONV_FORMS)
@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("d,group,bias,transpose", [(1, 2, True, False), (2, 1, False, False), (3, 2, True, False),
                                                    (2, 2, True, True), (1, 1, False, True)])
def test_every_form_computes_what_each_model_computes(form, B, d, group, bias, transpose):
    build, feeds = _conv_net(d, group, bias, transpose)
    fa = check_fused(build, B, feeds, strategy=form)
    assert set(fa.spec.summary["forms"].values()) == {form}
    convs = sum(n.op_type in ("Conv", "ConvTranspose") for n in fa.model.graph.node)
    assert convs == (2 * B if form == "per-model" else 2)


def test_the_weight_layout_does_not_depend_on_the_form():
    """array.json, checkpoints and split read weights by their slots: every form packs them the same way."""
    build, feeds = _conv_net(2, 2, True, False)
    models = [build(np.random.default_rng(b)) for b in range(3)]
    arrays = {form: fuse_models(models, strategy=form) for form in FORMS}
    specs = {form: {n: (w.slot, w.orig_shape, w.sources) for n, w in fa.spec.weights.items()}
             for form, fa in arrays.items()}
    assert len({repr(sorted(s.items())) for s in specs.values()}) == 1
    inits = {form: {t.name: t.raw_data for t in fa.model.graph.initializer if t.name in fa.spec.weights}
             for form, fa in arrays.items()}
    assert all(v == inits[FORMS[0]] for v in inits.values())


# Trained against torch with the fuzz harness (forward, 3 SGD-momentum and 3 AdamW steps, split weights compared):
# regression models made of convolutions and transposed convolutions, and the fixed fuzz seeds with a conv_transpose
# or a grouped 1-D/3-D convolution.
FORM_CASES = ["conv1d_mean_linear", "conv_transpose_output_padding_then_computed_slice",
              "conv_transpose_output_padding_groups_batchnorm"]
FORM_SEEDS = [10, 28, 129, 11, 36]


@pytest.mark.parametrize("name", FORM_CASES)
def test_per_model_form_trains_like_torch(name, runtime):
    out = check_source(rendered(name), seed=3, runtime=runtime, strategy="per-model", Bs=(1, 3))
    assert out.status in ("pass", "runtime"), (out.status, out.B, out.stage, out.message)


@pytest.mark.parametrize("seed", FORM_SEEDS)
def test_per_model_form_of_fuzz_seeds_trains_like_torch(seed, runtime):
    spec = generate(seed)
    out = check_model(spec, Bs=(2, 3), runtime=runtime, strategy="per-model")
    assert out.status in ("pass", "sensitive", "runtime"), (
        f"seed {seed} at B={out.B}, {out.stage}: {out.message}\n{render(spec).source}")


def test_a_strategy_is_checked():
    build, _ = _conv_net(2, 1, True, False)
    models = [build(np.random.default_rng(b)) for b in range(2)]
    with pytest.raises(ConfigError, match="unknown form 'diagonal'"):
        fuse_models(models, strategy="diagonal")
    with pytest.raises(ConfigError, match=r"chose form 'diagonal' for node .*offers: grouped, per-model"):
        fuse_models(models, strategy=lambda g, forms: "diagonal")


def test_cli_fuse_with_a_strategy(tmp_path, capsys):
    from onnxfuse.cli.main import main

    build, _ = _conv_net(2, 2, True, False)
    paths = []
    for b in range(2):
        p = tmp_path / f"m{b}.onnx"
        p.write_bytes(build(np.random.default_rng(b)).SerializeToString())
        paths.append(str(p))
    assert main(["fuse", *paths, "-o", str(tmp_path / "array"), "--strategy", "per-model"]) == 0
    assert "forms: 2 per-model" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["fuse", *paths, "-o", str(tmp_path / "a2"), "--strategy", "diagonal"])
    assert "invalid choice: 'diagonal'" in capsys.readouterr().err


# ---- the auto strategy: measured per node, cached per device, and right about the whole network
def _synthetic(B: int):
    """x [N, 6, 12, 12] shared -> Conv 6->6 1x1 (dense over the shared input) -> Relu -> Conv 6->16 5x5 (LeNet's
    second layer: torch's grouped CPU kernel is slow for it) -> Relu -> GlobalAveragePool -> Flatten -> Gemm 16->4."""
    def build(r):
        inits = [rand_init(r, "w0", [6, 6, 1, 1]), rand_init(r, "b0", [6]), rand_init(r, "w1", [16, 6, 5, 5]),
                 rand_init(r, "b1", [16]), rand_init(r, "wf", [4, 16]), rand_init(r, "bf", [4])]
        nodes = [h.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="c0"), h.make_node("Relu", ["c0"], ["r0"]),
                 h.make_node("Conv", ["r0", "w1", "b1"], ["c1"], name="c1"), h.make_node("Relu", ["c1"], ["r1"]),
                 h.make_node("GlobalAveragePool", ["r1"], ["g"]), h.make_node("Flatten", ["g"], ["f"]),
                 h.make_node("Gemm", ["f", "wf", "bf"], ["out"], transB=1)]
        return graph_model(nodes, [vinfo("x", ["N", 6, 12, 12])], [vinfo("out", ["N", 4])], inits)
    return [build(np.random.default_rng(b)) for b in range(B)]


def _step_times(models, combos: dict, N: int, rounds: int = 7) -> dict:
    """Median seconds of one torch-runtime training step of ``models`` fused in each combination of forms."""
    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.trainers import make_trainer
    from onnxfuse.measure.workloads import interleaved_rounds

    B = len(models)
    feeds = {"x": torch.randn(N, 6, 12, 12), "labels": torch.randint(0, 4, (N,))}
    trainers = {}
    for key, combo in combos.items():
        fa = fuse_models(models, strategy=lambda g, forms, combo=combo: combo[g.node.name])
        trainers[key] = make_trainer("torch", fa.model, fa.spec, "cross-entropy", make_optimizer("sgd", B, lr=0.0),
                                     threads=1)
        trainers[key].step(feeds)
    times = interleaved_rounds({k: (lambda t=t: t.step(feeds)) for k, t in trainers.items()}, rounds, 3)
    return {k: statistics.median(v) for k, v in times.items()}


def test_auto_picks_the_fastest_combination_of_forms(tmp_path, monkeypatch):
    from onnxfuse.measure.forms import cache_path, measured_strategy

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    models, N = _synthetic(16), 32
    said = []
    auto = measured_strategy("torch", "cpu", batch=N, threads=1, progress=said.append)
    fa = fuse_models(models, strategy=auto)
    chosen = fa.spec.summary["forms"]
    assert set(chosen) == {"c0", "c1"} and len(said) == 2 and os.path.exists(cache_path())
    # the measurements are cached per device: a second strategy measures nothing and chooses the same
    again = []
    assert fuse_models(models, strategy=measured_strategy("torch", "cpu", batch=N, threads=1,
                                                          progress=again.append)).spec.summary["forms"] == chosen
    assert again == []
    # the whole network, each of the four combinations of forms, measured side by side
    combos = {(a, b): {"c0": a, "c1": b} for a in CONV_FORMS for b in CONV_FORMS}
    times = _step_times(models, combos, N)
    best = min(times.values())
    mine = times[(chosen["c0"], chosen["c1"])]
    assert mine <= 1.2 * best, (chosen, {k: f"{v * 1e3:.2f} ms" for k, v in times.items()}, auto.costs)


def test_auto_leaves_a_node_it_cannot_measure_in_the_default_form(tmp_path, monkeypatch):
    """A node whose shapes are not known apart from the batch is not measured: it keeps the default form."""
    from onnxfuse.measure.forms import measured_strategy

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))

    def build(r):
        return graph_model([h.make_node("Conv", ["x", "w"], ["out"], name="c")], [vinfo("x", ["N", 2, "H", "W"])],
                           [vinfo("out", ["N", 3, "H2", "W2"])], [rand_init(r, "w", [3, 2, 3, 3])])

    said = []
    fa = fuse_models([build(np.random.default_rng(b)) for b in range(2)],
                     strategy=measured_strategy("torch", "cpu", batch=4, progress=said.append))
    assert fa.spec.summary["forms"] == {"c": "grouped"} and "not measurable" in said[0]
    out = run_onnx(fa.model, {"x": np.ones((1, 2, 5, 5), np.float32)})[0]
    assert out.shape == (2, 1, 3, 3, 3)  # [B, N, C, H, W]


@pytest.mark.slow  # four compiles, ~45 s on 2 cores
def test_auto_measures_compiled_forms_apart_when_the_array_is_compiled(tmp_path, monkeypatch):
    """``--strategy auto --compile on`` measures each form's compiled step (inductor fuses each form otherwise)
    and caches those costs under their own key, beside the eager ones."""
    import json

    from onnxfuse.measure.forms import cache_path, measured_strategy

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    models = _synthetic(2)[:2]
    said = []
    fa = fuse_models(models, strategy=measured_strategy("torch", "cpu", batch=8, threads=1, progress=said.append,
                                                        compile="on"))
    assert set(fa.spec.summary["forms"]) == {"c0", "c1"} and len(said) == 2 and "measured" in said[0]
    keys = list(json.load(open(cache_path())))
    assert len(keys) == 1 and keys[0].endswith(" compiled")
