"""``fuse --like``: the torch class is the truth for a file from any of torch's export routes. Each case of issue 48
is a real export of a module of ``like_models``; the reference is the module itself, trained by torch.optim."""
from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import onnx
import pytest
import torch

import onnxfuse
from tests.conftest import cli, one_error_line, rel_err
from tests.runtime.torch import like_models
from onnxfuse.core.errors import ExportMismatchError
from onnxfuse.runtime.torch.like import adopt_files

SPEC = "tests.runtime.torch.like_models:"
TRAIN = dict(dynamo=False, training=torch.onnx.TrainingMode.TRAINING)
EVAL = dict(dynamo=False)


def export(module, x, fixed=False, **kw) -> onnx.ModelProto:
    buf = io.BytesIO()
    axes = {} if kw.get("dynamo") or fixed else {"dynamic_axes": {"x": {0: "N"}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), buf, input_names=["x"], **axes, **kw)
    return onnx.load_from_string(buf.getvalue())


def trains_as_torch(name: str, module, x, proto, lrs=(0.1, 0.03), steps=4):
    """The array ``fuse --like`` makes of ``proto`` (twice), trained by onnxfuse.optim.SGD, against ``module`` (the
    exported one) trained alone by torch.optim.SGD at each lr; every state_dict key within 1e-4 (relative)."""
    protos, _ = adopt_files([proto] * len(lrs), SPEC + name)
    arr = onnxfuse.FusedArray(onnxfuse.fuse_models(protos)).train()
    opt = onnxfuse.optim.SGD(arr, lr=list(lrs))
    alone = [copy.deepcopy(module).train() for _ in lrs]
    refs = [torch.optim.SGD(m.parameters(), lr=lr) for m, lr in zip(alone, lrs)]
    for _ in range(steps):
        arr(x).float().pow(2).flatten(2).mean(-1).mean(-1).sum().backward()
        opt.step()
        opt.zero_grad()
        for m, o in zip(alone, refs):
            m(x).float().pow(2).mean().backward()
            o.step()
            o.zero_grad()
    for b, m in enumerate(alone):
        got, ref = arr.state_dicts()[b], m.state_dict()
        assert got.keys() == ref.keys()
        for key, value in ref.items():
            if key.endswith("num_batches_tracked"):  # the file holds no count: the steps trained from the fuse
                assert int(got[key]) == steps, (b, key)
            elif not value.is_floating_point() or not value.isfinite().all():  # an edge list, a mask: exact
                assert torch.equal(got[key], value), (b, key)
            else:  # a tensor torch leaves at ~0 (an attention key's bias, whose gradient is 0) by its absolute error
                err = rel_err(got[key].float(), value.float())
                assert err < 1e-4 or (got[key] - value).abs().max() < 1e-6, (b, key, err)
        m.load_state_dict(got, strict=True)
    return arr


@pytest.mark.parametrize("route", [TRAIN, EVAL, dict(dynamo=True), dict(dynamo=True, optimize=False)],
                         ids=["torchscript-train", "torchscript-eval", "dynamo", "dynamo-no-optimize"])
def test_rotary_tables_and_a_causal_mask_train_as_buffers_on_every_route(route):
    torch.manual_seed(0)
    module, x = like_models.Rotary(), torch.randint(0, 50, (2, 8))
    trains_as_torch("Rotary", module, x, export(module, x, **route))


def test_a_window_buffer_trains_as_a_buffer():
    torch.manual_seed(0)
    module, x = like_models.Window(), torch.randn(3, 8)
    trains_as_torch("Window", module, x, export(module, x, **TRAIN))


@pytest.mark.parametrize("route", [EVAL, dict(dynamo=True)], ids=["torchscript-eval", "dynamo"])
def test_a_batchnorm_cnn_whose_export_folded_bn_is_refused_with_the_fix(route):
    module, x = like_models.BNCNN(), torch.randn(2, 1, 8, 8)
    with pytest.raises(ExportMismatchError, match=r"bn1.*training=torch.onnx.TrainingMode.TRAINING"):
        adopt_files([export(module.eval() if route is EVAL else module, x, **route)], SPEC + "BNCNN")
    trains_as_torch("BNCNN", module.train(), x, export(module.train(), x, **TRAIN))  # the route that keeps it


@pytest.mark.parametrize("route", [EVAL, dict(dynamo=True, optimize=False)], ids=["torchscript-eval", "dynamo-no-opt"])
def test_bert_trains_as_torch_from_its_eval_and_dynamo_exports(route):
    torch.manual_seed(0)
    module, x = like_models.Bert(), torch.randint(0, 50, (2, 8))
    trains_as_torch("Bert", module, x, export(module, x, **route), steps=2)


def test_bert_from_dynamo_optimize_is_refused_naming_what_it_folded():
    torch.manual_seed(0)
    module, x = like_models.Bert(), torch.randint(0, 50, (2, 8))
    with pytest.raises(ExportMismatchError, match="position_embeddings.*onnxfuse export"):
        adopt_files([export(module, x, dynamo=True)], SPEC + "Bert")


def test_index_add_over_repeated_indices_is_refused_naming_the_node():
    module, x = like_models.IndexAdd(), torch.randn(5, 4)
    with pytest.raises(ExportMismatchError, match="'/ScatterElements'.*scatter_add"):
        adopt_files([export(module, x, fixed=True, **EVAL)], SPEC + "IndexAdd")  # torch refuses it with axes
    with pytest.raises(ExportMismatchError, match="ScatterElements"):  # the in-memory API checks its own export
        onnxfuse.fuse([like_models.IndexAdd(), like_models.IndexAdd()], x)
    onnxfuse.fuse([like_models.EdgeNet(), like_models.EdgeNet()], x)  # scatter_add: exact, accepted


def test_without_like_buffers_are_named_and_a_mask_is_never_trained():
    module, x = like_models.Rotary(), torch.randint(0, 50, (2, 8))
    proto = export(module, x, **EVAL)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        graph = onnxfuse.fuse_models([proto, proto])
    text = " ".join(str(w.message) for w in said)
    assert graph.spec.weights["mask"].role == "frozen" and "'mask' (holds non-finite values" in text
    assert "'cos'" in text and "'sin'" in text and "like=MODULE:FACTORY" in text
    assert graph.spec.summary["guessed"] == sum(fw.role == "param" for fw in graph.spec.weights.values())
    module, x = like_models.Window(), torch.randn(3, 8)
    proto = export(module, x, **TRAIN)
    with pytest.warns(UserWarning, match="'window'"):
        onnxfuse.fuse_models([proto, proto])
    module, x = like_models.BNCNN().eval(), torch.randn(2, 1, 8, 8)
    proto = export(module, x, **EVAL)
    with pytest.warns(UserWarning, match="BatchNorm folded into them"):
        onnxfuse.fuse_models([proto, proto])


def test_the_cli_fuses_with_like_and_split_like_writes_only_the_arrays_values(tmp_path, capsys):
    torch.manual_seed(0)
    module, x = like_models.EdgeNet(), torch.randn(5, 4)
    path = tmp_path / "edge.onnx"
    path.write_bytes(export(module, x, **TRAIN).SerializeToString())
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).normal(size=(8, 5, 4)).astype(np.float32),
             labels=np.zeros((8, 5, 4), np.float32))
    for out, extra in (("plain", []), ("like", ["--like", SPEC + "EdgeNet", "--input-shape", "5,4"])):
        assert cli(capsys, "fuse", path, path, "-o", tmp_path / out, *extra)[0] == 0
    code, _, err = cli(capsys, "split", tmp_path / "plain", "--initial", "-o", tmp_path / "split")
    assert code == 0, err
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "split" / "model_0.safetensors"))
    like_models.EdgeNet().load_state_dict(state, strict=True)  # the integer edge lists are written too
    assert torch.equal(state["src"], module.src)


def test_split_like_refuses_keys_the_array_has_no_value_for(tmp_path, capsys):
    module, x = like_models.BNCNN(), torch.randn(2, 1, 8, 8)
    path = tmp_path / "bn.onnx"
    path.write_bytes(export(module, x, dynamo=True).SerializeToString())
    assert cli(capsys, "fuse", path, path, "-o", tmp_path / "a")[0] == 0
    code, _, err = cli(capsys, "split", tmp_path / "a", "--initial", "-o", tmp_path / "s", "--like", SPEC + "BNCNN")
    assert code == 2 and "bn1." in one_error_line(err) and "no value" in one_error_line(err)
    assert not (tmp_path / "s").exists()
