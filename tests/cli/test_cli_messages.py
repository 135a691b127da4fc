"""What the command line and the Python API say (issues 36 and 37): a factory or its arguments never give an
internal error, `--args` takes KEY=VALUE pairs however they are separated, argparse's errors are one line, the
messages say what is wrong, the Python API raises the CLI's errors and never guesses, every option that runs code
says so, and what is printed adds up."""
from __future__ import annotations

import os
import re
import textwrap

import numpy as np
import pytest

from tests.conftest import ROOT, cli, one_error_line

MLP = "onnxfuse.exporters.zoo:MLP"

MODELS = textwrap.dedent("""\
    import torch

    def make_cnn(width=4, p=0.0):
        return torch.nn.Sequential(torch.nn.Conv2d(1, width, 3), torch.nn.Dropout(p), torch.nn.Flatten(),
                                   torch.nn.Linear(width * 25, 10))

    def boom():
        raise ValueError("kaput")

    def needs(width):
        return make_cnn(width)

    number = 3
""")


@pytest.fixture
def models(tmp_path, monkeypatch):
    """tmp_path as the working folder, holding mymodels.py (factories) and broken.py (a SyntaxError)."""
    (tmp_path / "mymodels.py").write_text(MODELS)
    (tmp_path / "broken.py").write_text("def make(:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


# ------------------------------------------------------------------------------- 1. factories, 2. --args
# (factory, extra export arguments, what the one line must hold): every way a factory or its arguments can be wrong
EXPORT_CASES = {
    "raises": ("mymodels:boom", [], "the factory mymodels:boom() raised ValueError: kaput"),
    "syntax_error": ("broken.py:make", [], "broken.py' (of broken.py:make) has a syntax error at line 1"),
    "builtin": ("os:system", [], "'os:system' is a built-in function, not a model factory"),
    "not_callable": ("mymodels:number", [], "'mymodels' has no callable 'number' ('number' is int)"),
    "no_module_name": (":make", [], "':make' is not MODULE:FACTORY"),
    "relative_module": (".mymodels:make", [], "importing '.mymodels' (of .mymodels:make) raised TypeError"),
    "wrong_type": (MLP, ["--args", "hidden=abc"],
                   "the factory onnxfuse.exporters.zoo:MLP(hidden='abc') raised TypeError: "),
    "wrong_type_named": (MLP, ["--args", "hidden=abc"], "hidden='abc' is text where its default is 64 (int)"),
    "missing_argument": ("mymodels:needs", [], "mymodels:needs requires the argument 'width', which is not given"),
    "unparsable_value": ("mymodels:make_cnn", ["--args", "width=8,p=[0.1"],
                         "mymodels:make_cnn: --args: the value of p, '[0.1', does not parse as YAML"),
}


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_a_bad_factory_or_argument_is_one_line_naming_it(case, models, capsys):
    """Each was "internal error" (exit 1) or named the wrong thing: a factory that raises, a SyntaxError in its
    file, os:system, a relative module, hidden=abc (TypeError from torch), --count -3 ("--seeds has 0 values")."""
    factory, extra, says = EXPORT_CASES[case]
    code, _, err = cli(capsys, "export", factory, "--count", 2, "--input-shape", "4,1,7,7", "-o", models / "jobs",
                       *extra)
    line = one_error_line(err)
    assert code == 2 and says in line, line
    assert not (models / "jobs").exists()


@pytest.mark.parametrize("args", [["width=8,p=0.1"], ["width=8 p=0.1"], ["width=8, p=0.1"], ["width=8", "p=0.1"]])
def test_args_take_key_value_pairs_however_they_are_separated(args, models, capsys):
    """`--args width=8,p=0.1` read width as "8,p=0.1" and ended in "internal error: TypeError: not all arguments
    converted during string formatting"."""
    import json

    code, out, err = cli(capsys, "export", "mymodels:make_cnn", "--count", 1, "--input-shape", "4,1,7,7", "-o",
                         models / "jobs", "--args", *args)
    assert code == 0, err
    assert json.loads((models / "jobs" / "jobs.json").read_text())["args"] == {"width": 8, "p": 0.1}


def test_a_value_keeps_its_own_commas():
    from onnxfuse.exporters.factory import factory_args

    assert factory_args(["sizes=[16, 32],p=0.1", "names=a,b", "text='x, y=1'"]) == {
        "sizes": [16, 32], "p": 0.1, "names": "a,b", "text": "x, y=1"}


def test_a_config_factory_that_is_a_builtin_is_one_line(models, capsys):
    """`os:system` as a run config's model.factory was "internal error: TypeError: system() missing required
    argument 'command'"."""
    (models / "run.yaml").write_text("model: {factory: 'os:system', count: 2, input_shape: [4, 48]}\nsteps: 1\n")
    np.savez(models / "d.npz", input=np.zeros((8, 48), np.float32), labels=np.zeros(8, np.int64))
    code, _, err = cli(capsys, "train", models / "array", "--config", models / "run.yaml", "--data",
                       models / "d.npz", "-q")
    line = one_error_line(err)
    assert code == 2 and "'os:system' is a built-in function, not a model factory" in line, line
    assert not (models / "array").exists()


def test_the_python_api_names_the_factory_too(models):
    from onnxfuse import ConfigError
    from onnxfuse.exporters import export_array

    with pytest.raises(ConfigError, match=r"count=-3: give the number of models, at least 1"):
        export_array("mymodels:boom", models / "jobs", -3, [4, 1, 7, 7])  # was "--seeds has 0 values"
    with pytest.raises(ConfigError, match=r"the factory mymodels:boom\(\) raised ValueError: kaput"):
        export_array("mymodels:boom", models / "jobs", 2, [4, 1, 7, 7])
    import mymodels

    with pytest.raises(ConfigError, match=r"the factory mymodels:make_cnn\(width='x'\) raised "):
        export_array(mymodels.make_cnn, models / "jobs", 2, [4, 1, 7, 7], factory_args={"width": "x"})
    assert not (models / "jobs").exists()


# ------------------------------------------------------------------------------------ 3. argparse, one line
ARGPARSE_CASES = [
    (["train", "A", "--steps", "abc"], "onnxfuse train: error: --steps: invalid int value 'abc'"),
    (["train", "A", "--precision", "fp8"], "onnxfuse train: error: --precision: invalid choice: 'fp8'"),
    (["train", "A", "--compile", "maybe"], "onnxfuse train: error: --compile: invalid choice: 'maybe'"),
    (["train", "A", "--keep-best", "train_loss"], "onnxfuse train: error: --keep-best: invalid choice: 'train_loss'"),
    (["train", "A", "--optimizer", "rmsprop"], "onnxfuse train: error: --optimizer: invalid choice: 'rmsprop'"),
    (["train", "A", "--ignore-index", "x"], "onnxfuse train: error: --ignore-index: invalid int value 'x'"),
    (["plan", "M", "--memory-budget", "8", "potatoes"], "onnxfuse plan: error: unrecognized arguments: potatoes"),
    (["export", "m:f", "--count", "-3", "--input-shape", "4", "-o", "j"],
     "onnxfuse export: error: --count: -3 is not allowed; give an integer >= 1"),
    (["sweep", "s.yaml", "-o", "s", "--cpus", "0"], "onnxfuse sweep: error: --cpus: 0 is not allowed"),
    (["demo", "--models", "0"], "onnxfuse demo: error: --models: 0 is not allowed"),
    (["bench", "--threads", "-1"], "onnxfuse bench: error: --threads: -1 is not allowed"),
    (["place", "m.onnx", "-o", "p", "--batch-size", "0"], "onnxfuse place: error: --batch-size: 0 is not allowed"),
    (["export", "m:f"], "onnxfuse export: error: the following arguments are required: --count"),
    (["nosuch"], "onnxfuse: error: COMMAND: invalid choice: 'nosuch'"),
]


@pytest.mark.parametrize("argv, says", ARGPARSE_CASES, ids=[" ".join(a[:3]) for a, _ in ARGPARSE_CASES])
def test_a_command_line_argparse_refuses_is_one_line_pointing_to_help(argv, says, capsys):
    """Each printed the command's whole usage (34 lines for train) before its error; --cpus 0 said "give
    resources.cpus at most 0", demo --models 0 exported 0 models before "--count is 0", bench --threads -1 was
    "internal error: RuntimeError: set_num_threads expects a positive integer", place --batch-size 0 was simulated."""
    from onnxfuse.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    command = "onnxfuse" + (f" {argv[0]}" if argv[0] != "nosuch" else "")
    assert e.value.code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(says) and err.rstrip().endswith(f"(`{command} --help` shows the usage)"), err


def test_every_subcommand_refuses_an_unknown_flag_in_one_line(capsys):
    """The one-line error is the parser class of every subcommand, so a new one has it without asking."""
    from onnxfuse.cli.main import build_parser, main

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for command in sub.choices:
        with pytest.raises(SystemExit) as e:
            main([command, "--no-such-flag"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"onnxfuse {command}: error: "), err


# ------------------------------------------------------------------------ 4, 5. messages, the Python API's errors
SHAPE = (8, 3, 4, 4)  # conftest's MLP: 48 inputs


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """3 MLPs exported (jobs/), fused (array/), and a data file."""
    from tests.conftest import mlp_array

    d = tmp_path_factory.mktemp("messages")
    mlp_array(d, 3, seed0=40, n=32)
    return d


@pytest.fixture
def work(template, tmp_path):
    from tests.conftest import fresh_copy

    return fresh_copy(template, tmp_path)


@pytest.mark.parametrize("flags, keys, precision", [
    (["--loss-scale", "1024"], "--loss-scale: loss_scale applies", "fp32"),
    (["--loss-scale-growth", "3", "--loss-scale-interval", "5"],
     "--loss-scale-growth, --loss-scale-interval: loss_scale_growth, loss_scale_interval apply", "fp32"),
    (["--precision", "bf16", "--loss-scale", "1024"], "--loss-scale, --precision: loss_scale applies", "bf16"),
])
def test_a_loss_scale_outside_fp16_is_refused_like_any_setting_that_does_nothing(flags, keys, precision, work,
                                                                                  capsys):
    """`--loss-scale 1024` under fp32 trained as if it were not given, while `--momentum` under adam is refused."""
    from tests.conftest import snapshot

    before = snapshot(work / "array")
    code, _, err = cli(capsys, "train", work / "array", "--data", work / "data.npz", "--batch-size", 8, "--steps", 1,
                       "-q", *flags)
    line = one_error_line(err)
    assert code == 2 and keys in line and f"to precision fp16 only (its loss scaling), and this run trains in " \
        f"{precision}; remove" in line, line
    assert snapshot(work / "array") == before


def test_a_loss_scale_is_refused_in_the_python_api_and_a_recorded_default_is_not():
    from onnxfuse import ConfigError
    from onnxfuse.recipe.train_config import TrainConfig

    with pytest.raises(ConfigError, match=r"TrainConfig\(loss_scale=\.\.\.\): loss_scale applies to precision fp16"):
        TrainConfig(steps=2, loss_scale=[1024, 2048])
    assert TrainConfig(steps=2, precision="fp16", loss_scale=[1024, 2048]).loss_scale == [1024, 2048]
    # a run's recorded settings hold every field, the default loss scale included: they resume
    again = TrainConfig.resumed(TrainConfig(steps=2).as_dict(), {"steps": 4})
    assert again.steps == 4


def test_fuse_models_takes_a_folder_as_the_cli_does(work):
    """`onnxfuse.fuse_models("jobs")` iterated over the string's characters ("model file 'j' does not exist")."""
    from onnxfuse import ConfigError, fuse_models

    for given in (str(work / "jobs"), work / "jobs", [work / "jobs"]):
        assert fuse_models(given).B == 3
    (work / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"folder '.*empty' holds no .onnx files"):
        fuse_models(str(work / "empty"))


def test_train_array_refuses_a_dict_as_config_in_one_line(work):
    """`train_array(dir, data, {"steps": 2})` ended in "AttributeError: 'dict' object has no attribute 'given'"."""
    from tests.conftest import snapshot
    from onnxfuse import ConfigError
    from onnxfuse.training.run import train_array

    before = snapshot(work / "array")
    with pytest.raises(ConfigError, match=r"^config is a dict, not a TrainConfig; give config=TrainConfig\(\*\*"):
        train_array(work / "array", str(work / "data.npz"), {"steps": 2}, progress=False)
    assert snapshot(work / "array") == before


@pytest.fixture(scope="module")
def nets():
    import torch

    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)) for _ in range(3)]


@pytest.mark.parametrize("example, says", [
    ((4, 15), r"torch could not run Sequential with input shape\(s\) \[\[4, 15\]\] \(float32\): mat1 and "),
    ("float64", r"torch could not run Sequential with input shape\(s\) \[\[4, 16\]\] \(float64\)"),
])
def test_fuse_with_a_wrong_example_is_the_clis_error(example, says, nets):
    """Torch's "mat1 and mat2 shapes cannot be multiplied" (RuntimeError) reached the user of onnxfuse.fuse."""
    import torch

    import onnxfuse
    from onnxfuse import ConfigError

    x = torch.randn(4, 16, dtype=torch.float64) if example == "float64" else torch.randn(*example)
    with pytest.raises(ConfigError, match=says):
        onnxfuse.fuse(nets, x)


def test_optim_and_clipping_refuse_a_plain_module(nets):
    """onnxfuse.optim.SGD(plain_module) was "AttributeError: 'Sequential' object has no attribute 'B'"."""
    import onnxfuse
    from onnxfuse import ConfigError

    for make, name in ((lambda: onnxfuse.optim.SGD(nets[0], lr=0.1), "onnxfuse.optim.SGD"),
                       (lambda: onnxfuse.optim.AdamW(nets[0]), "onnxfuse.optim.AdamW"),
                       (lambda: onnxfuse.optim.clip_grad_norm_(nets[0], 1.0), "onnxfuse.optim.clip_grad_norm_")):
        with pytest.raises(ConfigError, match=rf"^{name}: the array given is a Sequential, not a FusedArray; give "
                                              "the array onnxfuse.fuse returns; for a plain torch module use"):
            make()


# ------------------------------------------------------------------------------ 6. the Python API never guesses
@pytest.fixture(scope="module")
def arrays(nets):
    """The 3 nets fused with their input shared, and with it per model."""
    import torch

    import onnxfuse

    x = torch.randn(4, 16)
    return onnxfuse.fuse(nets, x), onnxfuse.fuse(nets, x, per_model_inputs=["input"])


def _call_cases():
    import torch

    torch.manual_seed(1)
    return {  # (shared or per-model array, input, what the one line says)
        "shared_given_per_model": (0, torch.randn(3, 5, 16), r"input 'input' has shape \[3, 5, 16\], but the array "
                                   r"takes \[N, 16\]; the models share it .* per_model_inputs=\['input'\]"),
        "wrong_width": (0, torch.randn(5, 15), r"input 'input' has shape \[5, 15\], but the array takes \[N, 16\]$"),
        "no_batch_axis": (0, torch.randn(16), r"input 'input' has shape \[16\], but the array takes \[N, 16\]$"),
        "dtype": (0, torch.randn(5, 16, dtype=torch.float64),
                  r"input 'input' is float64, but the array's graph takes float32; convert it"),
        "per_model_given_shared": (1, torch.randn(5, 16), r"input 'input' has shape \[5, 16\], but the array takes "
                                   r"\[B=3, N, 16\] \(per model\); it is per model"),
        "per_model_wrong_B": (1, torch.randn(2, 5, 16), r"has shape \[2, 5, 16\], but the array takes \[B=3, N, 16\]"),
    }


@pytest.mark.parametrize("case", ["shared_given_per_model", "wrong_width", "no_batch_axis", "dtype",
                                  "per_model_given_shared", "per_model_wrong_B"])
def test_an_input_that_fits_neither_declaration_is_one_error_naming_it(case, arrays):
    """`arr(x)` with [B, N, 16] for a shared [N, 16] input gave model b x[b] (a silent guess); a wrong width was
    torch's "Expected size for first two dimensions of batch2 tensor", an input without its batch axis [3, 3, 3]
    of garbage. Each is a DataError naming the input, its shape and the shape declared; train_step checks the
    same."""
    import onnxfuse
    from onnxfuse import DataError

    which, x, says = _call_cases()[case]
    arr = arrays[which]
    with pytest.raises(DataError, match=says):
        arr(x)
    opt = onnxfuse.optim.SGD(arr, lr=0.1)
    step = onnxfuse.optim.train_step(arr, opt, lambda out, y: out.float().pow(2).mean((1, 2)), compile="off")
    with pytest.raises(DataError, match=says):
        step(x, None)


def test_inputs_as_declared_run_each_model_on_its_own(arrays, nets):
    import torch

    shared, per_model = arrays
    x = torch.randn(3, 5, 16)
    out_shared, out_each = shared(x[0]), per_model(x)
    for b, net in enumerate(nets):
        assert torch.allclose(out_shared[b], net(x[0]), atol=1e-6)
        assert torch.allclose(out_each[b], net(x[b]), atol=1e-6)


def test_per_model_clipping_clips_each_model_by_its_own_norm(arrays, nets):
    """torch.nn.utils.clip_grad_norm_(arr.parameters()) clips all models by one joint norm (docs/python-api.md
    says so); onnxfuse.optim.clip_grad_norm_ by each model's own, as each model clipped alone."""
    import copy

    import torch

    import onnxfuse

    arr = copy.deepcopy(arrays[0])
    alone = [copy.deepcopy(n) for n in nets]
    x = torch.randn(6, 16)
    scale = torch.tensor([1.0, 10.0, 100.0])  # gradients of three sizes
    (arr(x).pow(2).mean((1, 2)) * scale).sum().backward()
    norms = onnxfuse.optim.clip_grad_norm_(arr, 1.0)
    for b, net in enumerate(alone):
        (net(x).pow(2).mean() * scale[b]).backward()
        assert torch.allclose(norms[b], torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0), rtol=1e-5)
    for sd_grads, net in zip(_grads_by_model(arr), alone):
        for name, p in net.named_parameters():
            assert torch.allclose(sd_grads[name], p.grad, atol=1e-6), name
    text = open(os.path.join(ROOT, "docs", "python-api.md")).read()
    assert "torch.nn.utils.clip_grad_norm_(arr.parameters()" in text and "one norm over all B models" in text


def _grads_by_model(arr) -> list[dict]:
    """Each model's gradients by its state_dict key (the fused gradients unpacked as the weights are)."""
    import torch

    from onnxfuse.core.split import split_weights

    grads = {n: (arr.parameter(n).grad if arr.parameter(n).grad is not None else torch.zeros_like(arr.parameter(n)))
             for n in arr.trainable}
    state = {n: t.detach() for n, t in arr.onnx_state().items()}
    dicts = split_weights(arr.spec, {**state, **grads}, 0, None)
    return [{k: torch.as_tensor(v) for k, v in d.items()} for d in dicts]


# -------------------------------------------------------------------------- 7. every option that runs code says so
def test_every_option_that_runs_code_says_so_in_its_help_and_the_guarantees():
    """`train --data path.py:make` and `split --like path.py:make` import and run the file; neither --help said so,
    nor docs/guarantees.md's "What runs code". Every option that takes a MODULE:FUNCTION (its help or metavar says
    MODULE:) carries the one trust note's words, and its command's --help ends with the note."""
    import argparse

    from onnxfuse.cli.main import RUNS_CODE, TRUST_NOTE, build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    runs = {}
    for command, parser in sub.choices.items():
        for action in parser._actions:
            text = f"{action.metavar or ''} {action.help or ''}"
            if "MODULE:" in text or action.dest in ("eval_data", "config"):
                assert RUNS_CODE in " ".join((action.help or "").split()), (command, action.dest)
                runs.setdefault(command, []).append(action.dest)
        if command in runs or command == "sweep":
            assert parser.epilog == TRUST_NOTE, command
    assert {"data", "eval_data", "config"} <= set(runs["train"]) and "like" in runs["split"]
    assert "factory" in runs["export"] and set(runs["check"]) == set(runs["train"])
    guarantees = open(os.path.join(ROOT, "docs", "guarantees.md")).read()
    section = " ".join(guarantees.split("**What runs code.**")[1].split("\n\n")[0].split())
    for named in ("`--data`", "`--eval-data`", "`split --like`", "`sweep --resume DIR`", "`model.factory`",
                  "`data.train`"):
        assert named in section, named


# ---------------------------------------------------------------------------------- 8. output that adds up
def _det_jobs(folder):
    """Two models x [N, 4, 4] @ W -> Det: Det has no fusion rule, so it runs once per model."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir()
    for b in range(2):
        g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
                               helper.make_node("Det", ["m"], ["y"], name="det")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
                              [numpy_helper.from_array((np.eye(4) * (b + 1)).astype(np.float32), "w")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        onnx.save(m, str(folder / f"model_{b}.onnx"))
    return folder


@pytest.mark.parametrize("case", ["mlp", "cnn_grouped", "cnn_per_model", "det_per_model"])
def test_the_fuse_summary_adds_up(case, tmp_path, capsys):
    """"19 nodes per model -> 17 fused nodes (13 fused by rules, 0 run per model, 6 shared, 2 layout changes)":
    the parts summed to 21 and counted two different things. Each part now adds up to its total: the nodes of one
    model by what became of them, the fused graph's nodes (after clean-up) by what emitted them."""
    import onnx

    from tests.conftest import export_all, make_modules

    if case == "mlp":
        jobs, flags = export_all(make_modules("mlp", 2), SHAPE, tmp_path / "jobs"), []
    elif case == "det_per_model":
        jobs, flags = [_det_jobs(tmp_path / "jobs")], []
    else:
        assert cli(capsys, "export", "onnxfuse.exporters.zoo:DigitsCNN", "--count", 3, "--input-shape", "4,1,8,8",
                   "-o", tmp_path / "jobs", "-q")[0] == 0
        jobs, flags = [tmp_path / "jobs"], ["--strategy", "per-model" if case == "cnn_per_model" else "grouped"]
    code, out, err = cli(capsys, "fuse", *jobs, "-o", tmp_path / "array", *flags)
    assert code == 0, err
    from onnxfuse.core.array import ArrayDir

    s = ArrayDir(tmp_path / "array").load_spec().summary
    assert s["fused"] + s["per_model"] + s["shared"] == s["nodes"]
    assert sum(s["fused_nodes_from"].values()) == s["fused_nodes"] == len(
        onnx.load(str(tmp_path / "array" / "fused.onnx")).graph.node)
    assert (s["per_model"] > 0) == (case == "det_per_model") == (s["fused_nodes_from"]["per_model"] > 0)
    line = out.splitlines()[0]
    total, parts, fused_total, fused_parts = re.search(
        r": (\d+) nodes per model \(([^)]*)\) -> (\d+) fused nodes \(([^)]*)\)", line).groups()
    assert sum(int(p.split()[0]) for p in parts.split(", ")) == int(total) == s["nodes"], line
    assert sum(int(p.split()[0]) for p in fused_parts.split(", ")) == int(fused_total), line
    doc = " ".join(open(os.path.join(ROOT, "docs", "cli.md")).read().split())
    for term in ("*fused by rules*", "*run per model*", "*shared*", "*by rules*", "*per-model copies*",
                 "*layout conversions*", "*output renames*"):
        assert term in doc, term


def test_no_compile_decision_is_announced_for_steps_that_only_verify(work, capsys):
    """`onnxfuse check --verify-steps 3` (and a run's verification) logged "--compile auto: not compiling the step:
    0 steps of ... ms ...": a decision for no remaining step. It is a debug line (-v) now; a run's own decision,
    for the steps it trains, is still said."""
    check = ["check", work / "array", "--data", work / "data.npz", "--batch-size", 8, "--steps", 20,
             "--verify-steps", 3, "--runtime", "torch"]
    code, out, err = cli(capsys, *check)
    assert code == 0 and "--compile auto" not in err, err
    code, out, err = cli(capsys, "-v", *check)
    assert code == 0 and "--compile auto: not compiling the step: 0 steps of" in err, err
    code, out, err = cli(capsys, "train", work / "array", "--data", work / "data.npz", "--batch-size", 8, "--steps",
                         20, "--runtime", "torch")
    said = [line for line in err.splitlines() if "--compile auto" in line]
    assert code == 0 and len(said) == 1 and re.search(r"not compiling the step: 1\d steps of", said[0]), err


def test_verbose_shows_each_stage_with_its_time_and_decision(work, models, capsys):
    """`-v` added nothing to a successful train (3 log.debug calls in the package): now export, fuse (each node's
    form), the data, the runtime, verification, compile auto and checkpoints each say what they did, and how long
    it took; without -v none of it."""
    def said(*args):
        code, _, err = cli(capsys, *args)
        assert code == 0, err
        return " ".join(err.replace("\r", "\n").split())

    export = ["export", "mymodels:make_cnn", "--count", 2, "--input-shape", "4,1,7,7", "-o", models / "jobs2"]
    err = said("-v", *export)
    assert "model 0: mymodels:make_cnn (seed 0) built in" in err and "exported in" in err and "export done in" in err
    err = said("fuse", models / "jobs2", "-o", models / "arr2", "-v")
    for part in ("read 2 models in", "identity check: the 2 models are one graph", "fused by the rules in",
                 "form of node '/0/Conv': grouped (the rule's first, --strategy default)", "clean-up,", "fuse done in"):
        assert part in err, part
    train = ["train", work / "array", "--data", work / "data.npz", "--batch-size", 8, "--steps", 6,
             "--checkpoint-every", 3, "--runtime", "torch"]
    err = said(*train, "-v")
    for part in ("data: ", "(32 samples), no eval data; 6 steps of 8 samples per model", "runtime torch on cpu",
                 "verification, step 1: the array's step", "--compile auto timed 3 eager steps",
                 "--compile auto: not compiling the step", "checkpoint at step 3", "train done in"):
        assert part in err, part
    quiet = said(*train)
    assert "timed" not in quiet and "data: " not in quiet and "runtime torch" not in quiet


def test_split_inference_models_carry_no_unused_initializer(models, capfd):
    """Split model_b.onnx files of a Dropout model made onnxruntime warn "Removing initializer
    '/1/Constant_1_output_0'" on every load: the Constant node of the Dropout's training-mode flag, unused once it
    is off. Each split graph holds only what its outputs need, and computes what the module computes in eval mode."""
    import onnx
    import onnxruntime as ort
    import torch

    import mymodels

    assert cli(capfd, "export", "mymodels:make_cnn", "--count", 2, "--input-shape", "4,1,7,7", "-o",
               models / "jobs", "--args", "width=4,p=0.5", "-q")[0] == 0
    assert cli(capfd, "fuse", models / "jobs", "-o", models / "arr", "-q")[0] == 0
    assert cli(capfd, "split", models / "arr", "--initial", "-o", models / "split", "-q")[0] == 0
    capfd.readouterr()
    x = np.random.default_rng(0).standard_normal((5, 1, 7, 7)).astype(np.float32)
    for b in range(2):
        path = str(models / "split" / f"model_{b}.onnx")
        g = onnx.load(path).graph
        read = {t for n in g.node for t in n.input} | {o.name for o in g.output}
        assert [i.name for i in g.initializer if i.name not in read] == []
        assert [n.name for n in g.node if not any(o in read for o in n.output)] == []  # a Constant nothing reads
        options = ort.SessionOptions()
        options.log_severity_level = 2  # warnings and up, as a user loads it
        out = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
        torch.manual_seed(b)
        module = mymodels.make_cnn(width=4, p=0.5).eval()
        assert np.allclose(out, module(torch.from_numpy(x)).detach().numpy(), atol=1e-5)
    assert "Removing initializer" not in capfd.readouterr().err


def test_a_metric_measured_in_reduced_precision_says_so(work, capsys):
    """Under --precision bf16 the table's accuracy (99.2 %) was not what the split model scores in fp32 (99.0 %),
    and nothing said which precision a metric was measured in: the table's metric columns and best line, and
    report.json, say bf16; an fp32 run's table is as before."""
    import json

    train = ["train", work / "array", "--data", work / "data.npz", "--batch-size", 8, "--steps", 2, "--eval-fraction",
             0.25, "--eval-every", 1, "--keep-best", "eval_accuracy", "-q", "--runtime", "torch"]
    code, out, err = cli(capsys, *train, "--precision", "bf16")
    assert code == 0, err
    header, *_, best = out.splitlines()[1:]
    for column in ("train loss (bf16)", "eval loss (bf16)", "eval acc (bf16)", "best eval accuracy (bf16) @step"):
        assert column in header, header
    assert best.startswith("best: model ") and "eval_accuracy (bf16) " in best, best
    code, out, _ = cli(capsys, "report", work / "array")
    assert code == 0 and "eval acc (bf16)" in out
    assert json.loads((work / "array" / "report.json").read_text())["precision"] == "bf16"
    code, out, err = cli(capsys, *train)
    assert code == 0 and "(bf16)" not in out and "eval acc " in out.splitlines()[1], out


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_run_sweep_refuses_a_cpu_count_ray_cannot_start_with(bad, tmp_path):
    """run_sweep(num_cpus=0) in Python: one ConfigError naming num_cpus, before Ray starts (it said 'give
    resources.cpus at most 0'); the CLI refuses --cpus 0 when it parses."""
    from onnxfuse.core.errors import ConfigError
    from onnxfuse.sweep import run_sweep

    with pytest.raises(ConfigError, match=r"num_cpus=.*at least one CPU"):
        run_sweep(None, tmp_path / "sweep", num_cpus=bad)
    assert not (tmp_path / "sweep").exists()
