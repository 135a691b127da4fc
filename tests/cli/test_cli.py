"""The command line end to end, and every bad input: one clear line, exit code 2, nothing written."""
from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from tests.conftest import ROOT, snapshot
from onnxfuse.cli.main import main
from onnxfuse.core.errors import ConfigError


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def array_dir(tmp_path_factory):
    """export (CLI) -> fuse (CLI) for 3 LeNets, and a data file: shared by the tests below."""
    d = tmp_path_factory.mktemp("cli")
    assert main(["export", "onnxfuse.exporters.zoo:LeNet", "--count", "3", "--seeds", "5,6,7",
                 "--input-shape", "4,1,28,28", "-o", str(d / "jobs")]) == 0
    assert main(["fuse", str(d / "jobs"), "-o", str(d / "array")]) == 0
    rng = np.random.default_rng(0)
    np.savez(d / "data.npz", input=rng.standard_normal((40, 1, 28, 28)).astype(np.float32),
             labels=rng.integers(0, 10, 40))
    return d


def test_export_fuse_train_split(array_dir, capsys):
    d = array_dir
    code, out, _ = run_cli(["train", d / "array", "--data", d / "data.npz", "--optimizer", "sgd",
                            "--lr", "0.1,0.05,0.01", "--momentum", "0.9", "--steps", "4", "--batch-size", "8",
                            "--no-shuffle", "-q"], capsys)
    assert code == 0 and "trained 3 models for 4 steps" in out
    rows = list(csv.DictReader(open(d / "array" / "metrics.csv")))
    assert len(rows) == 12 and {r["lr"] for r in rows} == {"0.1", "0.05", "0.01"}
    code, out, _ = run_cli(["split", d / "array", "-o", d / "models"], capsys)
    assert code == 0
    assert sorted(os.listdir(d / "models")) == sorted(f"model_{b}.{e}" for b in range(3) for e in ("onnx", "safetensors"))


def test_console_script_prints_one_line_without_traceback(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "onnxfuse")
    r = subprocess.run([exe, "fuse", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert "nope.onnx' does not exist" in r.stderr
    assert not (tmp_path / "out").exists()


def _det_model(path):
    """A model with an op that has no fusion rule (Det: it runs once per model)."""
    g = h.make_graph([h.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
                      h.make_node("Det", ["a"], ["y"], name="volume")], "g",
                     [h.make_tensor_value_info("x", TP.FLOAT, [3, 4, 4])], [h.make_tensor_value_info("y", TP.FLOAT, [3])],
                     [nh.from_array(np.ones((4, 4), np.float32), "w")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


@pytest.mark.parametrize("case", ["not_identical", "unsupported_op", "corrupt", "missing"])
def test_fuse_bad_input(case, array_dir, tmp_path, capsys):
    jobs = array_dir / "jobs"
    if case == "not_identical":
        assert main(["export", "onnxfuse.exporters.zoo:MLP", "--count", "1", "--input-shape", "4,1,8,8",
                     "-o", str(tmp_path / "mlp")]) == 0
        capsys.readouterr()
        files, expect = [jobs / "model_0.onnx", tmp_path / "mlp" / "model_0.onnx"], "fuse only models that are"
    elif case == "unsupported_op":
        files = [_det_model(tmp_path / "a.onnx"), _det_model(tmp_path / "b.onnx")]
        expect = "node 'volume' has op type 'Det', which has no fusion rule"
    elif case == "corrupt":
        (tmp_path / "bad.onnx").write_bytes(b"\x08\x07 this is not protobuf \xff\xfe" * 10)
        files, expect = [jobs / "model_0.onnx", tmp_path / "bad.onnx"], "is not a readable ONNX model"
    else:
        files, expect = [jobs / "model_0.onnx", tmp_path / "gone.onnx"], "gone.onnx' does not exist"
    out_dir = tmp_path / "array_out"
    code, _, err = run_cli(["fuse", *files, "-o", out_dir, "--strict"], capsys)
    assert code == 2 and expect in err and err.count("\n") == 1, err
    assert not out_dir.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".array_out")]  # no temporary leftovers


@pytest.mark.parametrize("case", ["lr_length", "missing_input", "missing_data_file", "negative_lr", "bad_labels",
                                  "no_cuda"])
def test_train_bad_input_leaves_array_untouched(case, array_dir, tmp_path, capsys):
    d = array_dir
    data = d / "data.npz"
    lr = "0.1,0.05,0.01"
    if case == "lr_length":
        lr, expect = "0.1,0.05", "--lr: optimizer.lr has 2 values but the array has B=3 models"
    elif case == "missing_input":
        np.savez(tmp_path / "d.npz", image=np.zeros((8, 1, 28, 28), np.float32), labels=np.zeros(8, np.int64))
        data, expect = tmp_path / "d.npz", "has no array 'input'"
    elif case == "missing_data_file":
        data, expect = tmp_path / "none.npz", "none.npz' does not exist"
    elif case == "bad_labels":
        np.savez(tmp_path / "d.npz", input=np.zeros((8, 1, 28, 28), np.float32), labels=np.arange(8) * 2)
        data, expect = tmp_path / "d.npz", "'labels' must be class indices in [0, 10)"
    elif case == "no_cuda":  # the CPU build of onnxruntime-training has no CUDA provider
        import onnxruntime

        if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            pytest.skip("the GPU build is installed")
        expect = "--device cuda: this onnxruntime-training build has no CUDA support"
    else:
        lr, expect = "0.1,-0.05,0.01", "--lr: optimizer.lr[1] = -0.05 must be finite and >= 0"
    before = snapshot(d / "array")
    device = ["--device", "cuda"] if case == "no_cuda" else []
    code, _, err = run_cli(["train", d / "array", "--data", data, "--lr", lr, "--steps", "2", "--batch-size", "4",
                            "-q", *device], capsys)
    assert code == 2 and expect in err and err.count("\n") == 1, err
    assert snapshot(d / "array") == before
    assert not [p for p in os.listdir(d / "array") if p.startswith(".") and p != ".onnxfuse.lock"]  # no temporaries


def test_fuse_refuses_to_overwrite(array_dir, capsys):
    before = snapshot(array_dir / "array")
    code, _, err = run_cli(["fuse", array_dir / "jobs", "-o", array_dir / "array"], capsys)
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert snapshot(array_dir / "array") == before


def test_export_bad_input_shape_is_one_line(tmp_path, capsys):
    code, _, err = run_cli(["export", "onnxfuse.exporters.zoo:LeNet", "--count", "2", "--input-shape", "4,3,28,28",
                            "-o", tmp_path / "jobs"], capsys)
    assert code == 2 and "could not export LeNet with input shape(s) [[4, 3, 28, 28]]" in err
    assert err.count("\n") == 1 and not (tmp_path / "jobs").exists()


def test_fuse_falls_back_per_model_and_reports_it(tmp_path, capsys):
    files = [_det_model(tmp_path / "a.onnx"), _det_model(tmp_path / "b.onnx")]
    code, out, err = run_cli(["fuse", *files, "-o", tmp_path / "arr"], capsys)
    assert code == 0
    assert "onnxfuse: warning: 1 node(s) run once per model instead of fused: volume (Det)" in err
    assert "1 run per model" in out and "fused fraction 50.0%" in out


# ------------------------------------------------------------------------------ one command-line convention
REPEATED_WORD = re.compile(r"\b([A-Za-z]+)[:\s]\s*\1\b", re.I)  # "cosine: cosine:", "the the"


def _parsers(parser, path=("onnxfuse",)):
    """The top parser and every subcommand's, with the command that reaches each."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def _required(sub) -> list[str]:
    """The least a subcommand parses: a value for each positional and each required option."""
    argv = []
    for a in sub._actions:
        if not a.option_strings and a.nargs not in ("?", "*"):
            argv.append("1")
        elif a.option_strings and a.required:
            argv += [a.option_strings[-1], "1"]
    return argv


def test_every_command_takes_q_v_and_help_before_or_after_it(capsys):
    from onnxfuse.cli.main import build_parser

    parser = build_parser()
    commands = [path[1] for path, _ in _parsers(parser) if len(path) == 2]
    assert len(commands) >= 11 and {"export", "fuse", "split", "report", "train", "sweep", "place"} <= set(commands)
    for path, sub in _parsers(parser):
        if len(path) != 2:
            continue
        argv = [path[1], *_required(sub)]
        for given, quiet, verbose in ((argv, False, False), (argv + ["-q", "-v"], True, True),
                                      (["-q", *argv, "--verbose"], True, True), (["--verbose", *argv], False, True),
                                      (["-v", *argv, "--quiet"], True, True)):
            args = parser.parse_args(given)
            assert (args.quiet, args.verbose) == (quiet, verbose), given
        with pytest.raises(SystemExit) as e:
            parser.parse_args([path[1], "--help"])
        shown = capsys.readouterr().out
        assert e.value.code == 0 and "-q, --quiet" in shown and "-v, --verbose" in shown, path
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--version"])
    from onnxfuse import __version__

    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"onnxfuse {__version__}"


def test_every_flag_has_help_that_repeats_no_word():
    from onnxfuse.cli.main import build_parser

    assert REPEATED_WORD.search("cosine: cosine: the final lr") and not REPEATED_WORD.search("cpu, cuda or cuda:N")
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = [(c.dest, c.help) for c in action._choices_actions]
            else:
                helps = [("/".join(action.option_strings) or action.metavar or action.dest, action.help)]
            for name, text in helps:
                where = f"{' '.join(path)} {name}"
                assert text and text != argparse.SUPPRESS and text.strip(), f"{where} has no help"
                assert not REPEATED_WORD.search(text), f"{where}: {REPEATED_WORD.search(text).group(0)!r} in {text!r}"


def test_verbose_after_the_command_shows_the_traceback_and_quiet_only_warnings(array_dir, tmp_path, capsys):
    for argv in (["fuse", tmp_path / "nope.onnx", "-o", tmp_path / "out", "--verbose"],
                 ["-v", "fuse", tmp_path / "nope.onnx", "-o", tmp_path / "out"]):
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and "Traceback" in err and "nope.onnx' does not exist" in err.strip().splitlines()[-1], err
    train = ["train", array_dir / "array", "--data", array_dir / "data.npz", "--steps", "2", "--batch-size", "8",
             "--lr", "0.01"]
    code, out, err = run_cli(train, capsys)
    assert code == 0 and "onnxfuse: " in err  # progress and info lines (verification, the run's id ...)
    code, out, err = run_cli(["-q", *train], capsys)
    assert code == 0 and err == "" and "trained 3 models for 2 steps" in out


# ------------------------------------------------------------------------------ export: token inputs, --args
def test_a_language_model_exports_fuses_and_trains_from_the_command_line(tmp_path, capsys):
    """`onnxfuse export onnxfuse.exporters.zoo:TransformerLM --input-dtype int64 --input-shape 8,16 --count 2`,
    then fuse and train on token data (the first step checked against each model alone, as every train does)."""
    V, T = 24, 16
    code, out, err = run_cli(["export", "onnxfuse.exporters.zoo:TransformerLM", "--input-dtype", "int64",
                              "--input-shape", f"8,{T}", "--count", "2", "-o", tmp_path / "jobs",
                              "--args", f"vocab_size={V}", "n_layer=1", "n_embd=16", "dropout=0"], capsys)
    assert code == 0 and "exported 2 models" in out, err
    model = onnx.load(tmp_path / "jobs" / "model_0.onnx")
    assert model.graph.input[0].type.tensor_type.elem_type == TP.INT64
    assert next(nh.to_array(i).shape for i in model.graph.initializer if i.name == "tok_emb.weight") == (V, 16)
    assert main(["fuse", str(tmp_path / "jobs"), "-o", str(tmp_path / "array"), "-q"]) == 0
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, (48, T + 1))
    np.savez(tmp_path / "tokens.npz", input=tokens[:, :-1], labels=tokens[:, 1:])  # next-token targets
    code, out, err = run_cli(["train", tmp_path / "array", "--data", tmp_path / "tokens.npz", "--class-axis", "-1",
                              "--optimizer", "adamw", "--lr", "0.01,0.001", "--steps", "3", "--batch-size", "8",
                              "-q"], capsys)
    assert code == 0 and "trained 2 models for 3 steps" in out, err


@pytest.mark.parametrize("argv, expect", [
    (["--input-shape", "8,16", "--input-shape", "8,16"], "a model with several inputs needs each named"),
    (["--input-shape", "8,16", "--input-dtype", "int63"], "--input-dtype: 'int63' is not a dtype; give one of"),
    (["--input-shape", "x=8,16", "--input-dtype", "y=int64"], "--input-dtype: 'y' is not an input; the inputs are: x"),
    (["--input-shape", "8,0"], "--input-shape: '8,0' is not [NAME=]D,D,... of positive integers"),
    (["--input-shape", "8,64", "--args", "hidden"], "--args: 'hidden' is not KEY=VALUE"),
    (["--input-shape", "8,64", "--args", "hiden=3"], "MLP takes no argument 'hiden'"),
])
def test_export_bad_inputs_and_args_are_one_line(argv, expect, tmp_path, capsys):
    code, _, err = run_cli(["export", "onnxfuse.exporters.zoo:MLP", "--count", "1", "-o", tmp_path / "jobs", *argv],
                           capsys)
    assert code == 2 and expect in err and err.count("\n") == 1, err
    assert not (tmp_path / "jobs").exists()


def test_several_named_inputs_each_with_its_dtype(tmp_path, capsys):
    code, _, err = run_cli(["export", "onnxfuse.exporters.zoo:BertTiny", "--count", "1", "-o", tmp_path / "jobs",
                            "--input-shape", "input_ids=4,8", "--input-shape", "token_type_ids=4,8",
                            "--input-dtype", "input_ids=int64,token_type_ids=int32", "--args", "type_vocab_size=2"],
                           capsys)
    assert code == 0, err
    inputs = onnx.load(tmp_path / "jobs" / "model_0.onnx").graph.input
    assert [(i.name, i.type.tensor_type.elem_type) for i in inputs[:2]] == [("input_ids", TP.INT64),
                                                                           ("token_type_ids", TP.INT32)]


def _shapes(model: onnx.ModelProto) -> dict:
    return {i.name: tuple(i.dims) for i in model.graph.initializer}


def test_factory_arguments_build_the_model_they_name_from_export_a_config_and_a_spec(tmp_path, capsys):
    """hidden=12 and num_classes=3 (MLP's defaults: 64 and 10), given as `export --args`, a run config's
    model.args and a sweep spec's, each read by exporters/factory.py's one parser (YAML values: 1.2e1 is 12.0)."""
    from onnxfuse.core.array import ArrayDir
    from onnxfuse.exporters.torch_export import build_array
    from onnxfuse.recipe.config import load_config
    from onnxfuse.sweep import parse_spec
    from onnxfuse.sweep.folder import SweepDir
    from onnxfuse.sweep.planning import export_trials

    want = {"fc1.weight": (12, 64), "fc2.weight": (12, 12), "fc3.weight": (3, 12)}
    code, _, err = run_cli(["export", "onnxfuse.exporters.zoo:MLP", "--count", "1", "--input-shape", "4,64",
                            "-o", tmp_path / "jobs", "--args", "hidden=12", "--args", "num_classes=3"], capsys)
    assert code == 0, err
    assert {k: v for k, v in _shapes(onnx.load(tmp_path / "jobs" / "model_0.onnx")).items() if k in want} == want

    (tmp_path / "run.yaml").write_text("model: {factory: onnxfuse.exporters.zoo:MLP, args: {hidden: 12, num_classes: "
                                       "3}, count: 2, input_shape: [4, 64]}\nsteps: 1\n")
    build_array(load_config(tmp_path / "run.yaml")["model"], tmp_path / "array")  # what `train --config` builds
    assert ArrayDir(tmp_path / "array").load_spec().B == 2
    spec = ArrayDir(tmp_path / "array").load_spec()
    assert {w.sources[0]: tuple(w.orig_shape) for w in spec.weights.values() if w.sources[0] in want} == want

    np.savez(tmp_path / "d.npz", input=np.zeros((8, 64), np.float32), labels=np.zeros(8, np.int64))
    sweep = parse_spec({"model": {"factory": "onnxfuse.exporters.zoo:MLP", "input_shape": [4, 64],
                                  "args": {"hidden": 12, "num_classes": 3}},
                        "search": {"space": {"optimizer.lr": [0.1]}}, "data": {"train": str(tmp_path / "d.npz")},
                        "steps": 1}, "spec.yaml")
    folder = SweepDir(tmp_path / "sweep")
    export_trials(sweep, [{"id": "t0", "args": {}, "seed": 0}], folder, progress=False)
    assert {k: v for k, v in _shapes(onnx.load(folder.model_path("t0"))).items() if k in want} == want
    with pytest.raises(ConfigError, match=r"spec.yaml: model.args: '2x' is not a keyword argument's name"):
        parse_spec({**sweep.as_dict(), "model": {"factory": "m:f", "input_shape": [4, 64], "args": {"2x": 1}}},
                   "spec.yaml")


def test_the_cuda_messages_point_at_a_readme_section_there_is():
    from onnxfuse.core.errors import ORT_CUDA_FIX, TORCH_CUDA_FIX

    readme = os.path.join(ROOT, "README.md")
    headings = {line.lstrip("#").strip() for line in open(readme, encoding="utf-8") if line.startswith("#")}
    for fix in (ORT_CUDA_FIX, TORCH_CUDA_FIX):
        assert re.search(r'README, "([^"]+)"', fix).group(1) in headings, fix
    assert "pip install -e" in ORT_CUDA_FIX and "onnxfuse[gpu]" not in ORT_CUDA_FIX  # installed from the checkout
