"""What the command line and the Python API say (issues 36 and 37): a factory or its arguments never give an
internal error, `--args` takes KEY=VALUE pairs however they are separated, argparse's errors are one line, the
messages say what is wrong, the Python API raises the CLI's errors and never guesses, every option that runs code
says so, and what is printed adds up."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from conftest import cli, one_error_line

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

    with pytest.raises(ConfigError, match=r"--count is -3; give the number of models, at least 1"):
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
