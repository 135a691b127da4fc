"""What fusion says of a file that does not record its parameters: files tf2onnx 1.17 made from Keras models
(tests/data/tf2onnx, with the script that made them), checked against Keras' own outputs on them."""
from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest
import torch

from tests.conftest import ROOT
from onnxfuse.core.passes import fuse_models
from onnxfuse.core.split import plain_export_note

DATA = os.path.join(ROOT, "tests", "data", "tf2onnx")


def fused(name: str):
    path = os.path.join(DATA, f"{name}.onnx")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        graph = fuse_models([path, path])
    return graph, " ".join(str(w.message) for w in said)


@pytest.mark.parametrize("name", ["cnn", "mlp", "bn_cnn", "lstm", "cnn_bias"])
def test_each_file_computes_what_keras_computed_and_fuses(name):
    from onnxfuse.runtime.torch.program import OnnxModule

    ref = np.load(os.path.join(DATA, "reference.npz"))
    out = OnnxModule(onnx.load(os.path.join(DATA, f"{name}.onnx"))).eval()(torch.from_numpy(ref[f"{name}.x"]))[0]
    assert np.abs(out.detach().numpy() - ref[f"{name}.y"]).max() < 1e-5
    graph, _ = fused(name)
    assert graph.spec.summary["fused_fraction"] == 1.0


@pytest.mark.parametrize("name, says", [
    ("cnn", ["layers without a bias (cnn/conv/Conv2D, cnn/dense/MatMul)", "bias_initializer"]),
    ("mlp", ["layers without a bias (mlp/dense1/MatMul, mlp/dense2/MatMul)"]),
    ("bn_cnn", ["BatchNormalization folded into bn_cnn/conv/Conv2D", "without batch statistics"]),
    ("lstm", ["all-zero recurrent bias", "twice as fast", "'lstm/lstm/zeros/Const:0' (read by"]),
])
def test_what_tf2onnx_did_is_named_in_keras_words(name, says):
    graph, text = fused(name)
    for words in says:
        assert words in text, (words, text)
    assert "torch" not in text.lower() and "--like" not in text and "like=" not in text
    assert graph.spec.summary["guessed"] > 0


def test_the_lstm_zero_state_constant_is_never_trained_and_a_file_with_biases_says_nothing():
    graph, _ = fused("lstm")
    assert graph.spec.weights["lstm/lstm/zeros/Const:0"].role == "frozen"
    _, text = fused("cnn_bias")
    assert text == ""


def test_split_gives_a_keras_user_no_torch_advice():
    note = plain_export_note(None, [onnx.load(os.path.join(DATA, "cnn.onnx"))])
    assert "tf2onnx" in note and "--like" not in note and "torch" not in note
