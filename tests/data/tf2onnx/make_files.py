"""Make the tf2onnx test files in this folder from tiny Keras models.

These files let onnxfuse's tests check how the real tf2onnx exporter writes
Keras models, without installing TensorFlow in the project's environment.
The script is not imported by the tests; it is kept so the files can be
made again.

How to run it (in a separate virtualenv, outside the repo)::

    python3.11 -m venv /work/scratch/tfenv
    /work/scratch/tfenv/bin/pip install "tensorflow-cpu==2.17.1" \
        "tf-keras==2.17.0" "tf2onnx==1.17.0" "onnx==1.17.0" "numpy==1.26.4"
    /work/scratch/tfenv/bin/python tests/data/tf2onnx/make_files.py

Versions the checked-in files were made with: Python 3.11.7,
tensorflow(-cpu) 2.17.1, tf_keras 2.17.0 (Keras 2, selected with
TF_USE_LEGACY_KERAS=1), tf2onnx 1.17.0, onnx 1.17.0, numpy 1.26.4,
protobuf 4.25.9, ml-dtypes 0.4.1.

Notes on the pins:
  * tf2onnx 1.17's ``from_keras`` does not work with Keras 3 (the default
    ``keras`` of TF >= 2.16): it fails with ``KeyError: 'keras_tensor_N'``
    while mapping output names. So the models are built with tf_keras
    (Keras 2) and TF_USE_LEGACY_KERAS=1.
  * onnx >= 1.18 needs ml_dtypes >= 0.5 (``float4_e2m1fn``), but TF 2.17
    pins ml_dtypes 0.4, so onnx is pinned to 1.17.0.

Files written next to this script:
  cnn.onnx       Conv2D(4,3) -> ReLU -> Flatten -> Dense(3); zero biases
                 (Keras' default bias_initializer="zeros").
  cnn_bias.onnx  the same CNN with non-zero (random normal) biases: control.
  mlp.onnx       Dense(8, relu) -> Dense(3), zero biases, input dim 4.
  bn_cnn.onnx    Conv2D(4,3) -> BatchNormalization -> ReLU -> Flatten ->
                 Dense(3); BN's moving stats moved off (0, 1) by calls in
                 training mode before export.
  lstm.onnx      LSTM(5) over [N, 6, 3], last state only -> Dense(2).
  reference.json per file: Keras weights (names, shapes, whether all
                 zero), ONNX initializers (names, shapes, dtypes),
                 producer name/version, opset, input/output names, and the
                 tool versions.
  reference.npz  per file: ``<name>.x`` (a fixed float32 input, N=2),
                 ``<name>.y`` (the Keras model's output on it at export),
                 and ``<name>.keras.<weight name>`` (each Keras weight's
                 value, Keras layout, e.g. ``cnn.keras.conv/kernel:0``).

Re-running gives byte-identical files except lstm.onnx: tf2onnx names the
LSTM's helper constants (const_axes__N, const_ends__N, the scalar zero
``lstm/lstm/zeros/Const:0`` vs ``lstm/lstm/zeros_1/Const:0``) differently
from run to run, even with PYTHONHASHSEED fixed; its weights (W0__60,
R0__61, B0__62) and its function do not change.

All inputs have a dynamic batch dimension (``None`` in the TensorSpec) and
are named ``x``; opset 17.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # noqa: E402
import platform  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402
import tf_keras as keras  # noqa: E402
from onnx import numpy_helper  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OPSET = 17
SEED = 0
L = keras.layers


def _cnn(name, conv_bias_init, dense_bias_init):
    return keras.Sequential(
        [
            keras.Input((8, 8, 1), name="x"),
            L.Conv2D(4, 3, bias_initializer=conv_bias_init, name="conv"),
            L.ReLU(name="relu"),
            L.Flatten(name="flatten"),
            L.Dense(3, bias_initializer=dense_bias_init, name="dense"),
        ],
        name=name,
    )


def build_cnn():
    return _cnn("cnn", "zeros", "zeros")


def build_cnn_bias():
    # Two initializers with different seeds: one seeded initializer object
    # shared by both layers would give both biases the same leading values.
    rn = keras.initializers.RandomNormal
    return _cnn("cnn_bias", rn(stddev=0.5, seed=SEED + 1), rn(stddev=0.5, seed=SEED + 3))


def build_mlp():
    return keras.Sequential(
        [
            keras.Input((4,), name="x"),
            L.Dense(8, activation="relu", name="dense1"),
            L.Dense(3, name="dense2"),
        ],
        name="mlp",
    )


def build_bn_cnn():
    m = keras.Sequential(
        [
            keras.Input((8, 8, 1), name="x"),
            L.Conv2D(4, 3, name="conv"),
            L.BatchNormalization(name="bn"),
            L.ReLU(name="relu"),
            L.Flatten(name="flatten"),
            L.Dense(3, name="dense"),
        ],
        name="bn_cnn",
    )
    # Move BN's moving mean/variance off their initial (0, 1): calls in
    # training mode update only the moving stats (no optimizer step, so the
    # conv/dense weights and biases stay as initialized).
    rng = np.random.RandomState(SEED + 2)
    for _ in range(40):
        xb = (rng.randn(16, 8, 8, 1) * 2.0 + 1.0).astype(np.float32)
        m(xb, training=True)
    return m


def build_lstm():
    return keras.Sequential(
        [
            keras.Input((6, 3), name="x"),
            L.LSTM(5, name="lstm"),  # return_sequences=False: last state
            L.Dense(2, name="dense"),
        ],
        name="lstm",
    )


MODELS = [
    ("cnn", build_cnn, (8, 8, 1)),
    ("mlp", build_mlp, (4,)),
    ("bn_cnn", build_bn_cnn, (8, 8, 1)),
    ("lstm", build_lstm, (6, 3)),
    ("cnn_bias", build_cnn_bias, (8, 8, 1)),
]


def _is_bias(weight_name):
    return weight_name.split("/")[-1].split(":")[0] == "bias"


def main():
    versions = {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_package": "tf_keras",
        "tf2onnx": tf2onnx.__version__,
        "onnx": onnx.__version__,
        "numpy": np.__version__,
    }
    reference = {"versions": versions, "opset": OPSET, "seed": SEED, "files": {}}
    arrays = {}
    for i, (name, build, in_shape) in enumerate(MODELS):
        keras.utils.set_random_seed(SEED + 10 * i)
        model = build()
        x = np.random.RandomState(100 + i).randn(2, *in_shape).astype(np.float32)
        y = model(x, training=False).numpy()
        spec = (tf.TensorSpec((None,) + in_shape, tf.float32, name="x"),)
        path = os.path.join(HERE, name + ".onnx")
        proto, _ = tf2onnx.convert.from_keras(
            model, input_signature=spec, opset=OPSET, output_path=path
        )
        keras_weights = []
        for w in model.weights:
            v = w.numpy()
            arrays[f"{name}.keras.{w.name}"] = v.astype(np.float32)
            keras_weights.append(
                {
                    "name": w.name,
                    "shape": list(v.shape),
                    "is_bias": _is_bias(w.name),
                    "all_zero": bool(np.all(v == 0)),
                    "trainable": bool(w.trainable),
                }
            )
        inits = []
        for t in proto.graph.initializer:
            a = numpy_helper.to_array(t)
            inits.append(
                {
                    "name": t.name,
                    "shape": list(a.shape),
                    "dtype": str(a.dtype),
                    "all_zero": bool(a.size and np.all(a == 0)),
                }
            )
        reference["files"][name + ".onnx"] = {
            "keras_model_name": model.name,
            "keras_weights": keras_weights,
            "zero_biases": [w["name"] for w in keras_weights if w["is_bias"] and w["all_zero"]],
            "onnx_initializers": inits,
            "onnx_nodes": [n.op_type for n in proto.graph.node],
            "inputs": [i_.name for i_ in proto.graph.input],
            "outputs": [o.name for o in proto.graph.output],
            "producer_name": proto.producer_name,
            "producer_version": proto.producer_version,
            "opset_import": {d.domain or "ai.onnx": d.version for d in proto.opset_import},
            "size_bytes": os.path.getsize(path),
        }
        arrays[name + ".x"] = x
        arrays[name + ".y"] = y.astype(np.float32)
        print(f"{name}.onnx: {os.path.getsize(path)} bytes, nodes {reference['files'][name + '.onnx']['onnx_nodes']}")
    with open(os.path.join(HERE, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1, sort_keys=True)
        f.write("\n")
    np.savez(os.path.join(HERE, "reference.npz"), **arrays)


if __name__ == "__main__":
    main()
