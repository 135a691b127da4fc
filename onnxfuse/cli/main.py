"""The `onnxfuse` command: a thin layer over the Python API. Errors print as one line (traceback with --verbose)."""
from __future__ import annotations

import argparse
from collections import Counter
import re
import sys
import logging
import traceback
import warnings

from onnxfuse.cli._args import at_least
from onnxfuse.cli._flags import FlagFormatter, one_line
from onnxfuse.cli.train_flags import add_train_flags
from onnxfuse.core._clock import Stopwatch
from onnxfuse.core.errors import (ConfigError, OnnxFuseError, TrainingStoppedError, VerificationError, as_user_error,
                                  shell)
from onnxfuse.core.split import WHICH
from onnxfuse.recipe.runtimes import PRECISIONS, RUNTIME_CHOICES
from onnxfuse.runtime._machine import ISA_ENV

__all__ = ["main", "build_parser", "add_export_parser", "add_fuse_parser", "add_train_parser", "add_check_parser",
           "add_split_parser", "add_report_parser", "add_demo_parser", "add_bench_parser", "add_plan_parser",
           "add_sweep_parser"]


# A MODULE:FUNCTION is imported and called: whoever wrote it runs code as you (docs/guarantees.md, "What runs
# code"). Said once here; every option that takes one says it in its --help with these words (runs_code).
RUNS_CODE = ("imported and called, i.e. run as Python code: use only code from someone you trust, as you would a .py "
             "file")
TRUST_NOTE = ("What runs code: export's factory, train's and check's --data and --eval-data, fuse's and split's "
              "--like, a run "
              "config's or sweep spec's model.factory and data, and the factory a sweep folder records for --resume "
              "are each a MODULE:FUNCTION, " + RUNS_CODE + ". So a config file, a sweep spec and a sweep folder are "
              "code.")


def runs_code(what: str) -> str:
    """The trust note of one option: ``what`` (the code it runs) is imported and called ..."""
    return f"{what} is {RUNS_CODE}"


def _numbers(text: str | None, flag: str, cast=float) -> list | None:
    """'0.1' -> [0.1]; '0.1,0.05' -> [0.1, 0.05] (one per model)."""
    if text is None:
        return None
    try:
        return [cast(v) for v in str(text).split(",") if v.strip() != ""]
    except ValueError:
        raise ConfigError(f"{flag}: '{text}' is not a number or a comma-separated list of numbers") from None


def cmd_export(args) -> int:
    from onnxfuse.core.array import check_output_location
    from onnxfuse.exporters import export_array
    from onnxfuse.exporters.factory import factory_args, inputs_from_flags, model_inputs

    shape, dtype = inputs_from_flags(args.input_shape, args.input_dtype)
    model_inputs(shape, dtype, key="--input-shape", dtype_key="--input-dtype")
    factory_kwargs = factory_args(args.args, "--args", where=f"{args.factory}: ")
    seeds = _numbers(args.seeds, "--seeds", int)
    module_file = args.factory.rpartition(":")[0]
    check_output_location(args.output, [module_file] if module_file.endswith(".py") else [])
    paths = export_array(args.factory, args.output, args.count, shape, seeds=seeds, overwrite=args.overwrite,
                         opset=args.opset, factory_args=factory_kwargs, input_dtype=dtype)
    files = "model_0.onnx" + (f" .. model_{len(paths) - 1}.onnx" if len(paths) > 1 else "")
    print(f"exported {len(paths)} model{'s' if len(paths) != 1 else ''} to {args.output}/ ({files})")
    return 0


def cmd_fuse(args) -> int:
    from onnxfuse.core._io import claim_output
    from onnxfuse.core.array import check_output_location

    check_output_location(args.output, args.models)
    with claim_output(args.output, "fuse", overwrite=args.overwrite):  # no other command writes there meanwhile
        return _fuse(args)


def _fuse(args) -> int:
    from onnxfuse.core.array import ArrayDir
    from onnxfuse.core.passes import fuse_models, model_files, save_array, summary_line
    from onnxfuse.core.semantics import parse_padding_rows
    from onnxfuse.measure.forms import make_strategy

    files, labels = model_files(args.models), None
    per_model = [n for n in (args.per_model_inputs or "").split(",") if n]
    say = None if args.quiet else (lambda msg: print(f"onnxfuse: {msg}", file=sys.stderr))
    if args.like:
        files, labels = _adopted(args, files, say)
    elif args.args or args.input_shape:
        raise ConfigError(f"{'--args' if args.args else '--input-shape'} is for --like's factory; give --like "
                          "MODULE:FACTORY, or leave it out")
    strategy = make_strategy(args.strategy, args.runtime, args.device, args.batch, args.threads, progress=say,
                             compile=args.compile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fa = fuse_models(files, labels, strict=args.strict, per_model_inputs=per_model, strategy=strategy,
                         padding_rows=parse_padding_rows(args.padding_rows),
                         frozen=[n for n in (args.frozen or "").split(",") if n])
    for w in caught:
        print(f"onnxfuse: warning: {one_line(w.message, args.command)}", file=sys.stderr)
    save_array(fa, args.output, overwrite=args.overwrite)
    s, fused = fa.spec.summary, ArrayDir(args.output).fused_path
    print(f"fused {fa.B} model{'s' if fa.B != 1 else ''} into {fused}: {summary_line(fa.spec)}")
    chosen = Counter(s.get("forms", {}).values())
    if chosen:
        print("forms: " + ", ".join(f"{n} {form}" for form, n in sorted(chosen.items())))
    return 0


def _adopted(args, files: list, say) -> tuple[list, list[str]]:
    """``fuse --like``: each file as the module's (``runtime/torch/like.py``), with what was taken from where."""
    import os

    from onnxfuse.exporters.factory import factory_args, inputs_from_flags
    from onnxfuse.runtime.torch.like import adopt_files

    if args.padding_rows or args.frozen:
        raise ConfigError(f"{'--padding-rows' if args.padding_rows else '--frozen'} and --like: the class says which "
                          "rows and weights are kept (padding_idx, requires_grad); leave the flag out")
    shapes = inputs_from_flags(args.input_shape, None)[0] if args.input_shape else None
    labels = [os.path.basename(os.fspath(f)) for f in files]
    protos, notes = adopt_files(files, args.like, factory_args(args.args, "--args", where=f"{args.like}: "), shapes,
                                labels)
    for note in notes:
        if say:
            say(note)
    return protos, labels


def _run_config(args, build: bool = True):
    """(TrainConfig or None, overrides or None, data, eval data) from --config and the flags: the flags, as a
    config mapping, over the file's, validated as one (the file's rules hold for flags too). ``build``: the array
    the file's model section describes is built where ARRAY_DIR has none. With --resume and no config file: no
    TrainConfig, and the flags override the checkpoint's own settings (validated over them by the run)."""
    from onnxfuse.cli.train_flags import flags_to_raw
    from onnxfuse.recipe.settings import raw_to_flat
    from onnxfuse.recipe.train_config import run_config

    flags, named = flags_to_raw(args)
    if getattr(args, "resume", False) and not args.config:
        return None, raw_to_flat(flags), args.data, args.eval_data
    config, data, eval_data, model = run_config(args.array, flags, named, args.config)
    if model is not None and build:
        from onnxfuse.exporters.torch_export import build_array

        build_array(model, args.array)
    return config, None, data, eval_data


def cmd_train(args) -> int:
    from onnxfuse.training.run import train_array
    from onnxfuse.training.report import format_table, summarize_array

    config, overrides, data, eval_data = _run_config(args)
    res = train_array(args.array, data, config, progress=not args.quiet, eval_data=eval_data, resume=args.resume,
                      overrides=overrides, tune_process=True)
    print(res.summary())
    print(format_table(summarize_array(args.array)))  # the table `onnxfuse report` prints
    return 0


def cmd_check(args) -> int:
    from onnxfuse.core.array import load_array
    from onnxfuse.training.run import verify_array

    load_array(args.array)  # check writes nothing: the array is there, not built from --config's model section
    config, _, data, eval_data = _run_config(args, build=False)
    report = verify_array(args.array, data, config, eval_data=eval_data, tune_process=True)
    print(report.table())
    print(report.summary())
    if not report.ok:
        raise report.error()
    return 0


def cmd_report(args) -> int:
    from onnxfuse.training.report import format_table, make_report

    summary = make_report(args.array, out_png=args.output)
    print(format_table(summary))
    run = f"; run {summary['run']}" if summary.get("run") else ""
    print(f"plot: {summary['png']} (summary: {summary['json']}{run})")
    return 0


def cmd_split(args) -> int:
    from onnxfuse.core.split import split_array

    like, keys = None, None
    if args.like:
        from onnxfuse.core.array import ArrayDir
        from onnxfuse.exporters.state_map import split_plan
        from onnxfuse.exporters.torch_export import build_module

        array = ArrayDir(args.array)
        array.check_exists()
        like, keys, notes = split_plan(build_module(args.like, 0), array.load_spec(), array.load_source(0),
                                       f"--like {args.like}")
        for note in notes:
            logging.getLogger("onnxfuse").info(note)
    else:
        from onnxfuse.core.array import ArrayDir
        from onnxfuse.core.split import plain_export_note

        array = ArrayDir(args.array)
        array.check_exists()
        note = plain_export_note(array.load_spec(), [array.load_source(0)])
        if note:
            logging.getLogger("onnxfuse").warning(note)
    paths = split_array(args.array, args.output, overwrite=args.overwrite, initial=args.initial, like=like,
                        which=args.which, keys=keys, allow_missing=args.allow_missing)
    what = "initial weights" if args.initial else f"each model's {args.which} state"
    print(f"wrote {len(paths)} model{'s' if len(paths) != 1 else ''} ({what}) to {args.output}/ (model_b.onnx for "
          "inference, model_b.safetensors state_dicts)")
    return 0


def cmd_demo(args) -> int:
    from onnxfuse.cli.demo import run_demo

    run_demo(args.output, models=args.models, steps=args.steps, progress=not args.quiet, runtime=args.runtime,
             precision=args.precision)
    return 0


def cmd_bench(args) -> int:
    from onnxfuse.measure.bench import run_bench

    run_bench(models=[m for m in args.models.split(",") if m], B=_numbers(args.B, "--B", int), device=args.device,
              modes=[m for m in args.modes.split(",") if m], batch=args.batch, steps=args.steps, rounds=args.rounds,
              warmup=args.warmup, out=args.output, budget_s=args.budget_s, threads=args.threads,
              strategy=args.strategy, precisions=[p for p in args.precision.split(",") if p], progress=not args.quiet,
              isa=args.isa)
    return 0


def cmd_plan(args) -> int:
    import contextlib

    from onnxfuse.core._io import claim_output
    from onnxfuse.measure.sizing import size_array

    # -o is checked and held before the probes train (no other command writes there meanwhile)
    with claim_output(args.output, "plan", is_file=True) if args.output is not None else contextlib.nullcontext():
        sizing = size_array(args.model, runtime=args.runtime, device=args.device, batch=args.batch,
                            memory_budget=args.memory_budget, probe=_numbers(args.probe, "--probe", int),
                            max_B=args.max_B, optimizer=args.optimizer, threads=args.threads)
        print(sizing.table())
        for note in sizing.notes:
            print(f"note: {note}")
        print(sizing.summary())
        if args.output is not None:
            sizing.save(args.output)
            print(f"wrote {args.output}")
    return 0


def cmd_sweep(args) -> int:
    from onnxfuse.sweep import run_sweep
    from onnxfuse.sweep.results import table

    if args.resume and (args.spec or args.output):
        raise ConfigError("--resume SWEEP_DIR continues a sweep with the spec in its folder; give neither SPEC.yaml "
                          "nor -o")
    if not args.resume and (not args.spec or not args.output):
        raise ConfigError("give a sweep spec and where to write it: onnxfuse sweep SPEC.yaml -o SWEEP_DIR (or "
                          "--resume SWEEP_DIR)")
    folder = args.resume or args.output
    try:
        res = run_sweep(None if args.resume else args.spec, folder, resume=bool(args.resume), address=args.address,
                        runtime=args.runtime, num_cpus=args.cpus, progress=not args.quiet)
    except KeyboardInterrupt:
        print(f"onnxfuse: interrupted; finished arrays are kept: `{shell('onnxfuse', 'sweep', '--resume', folder)}` "
              "runs the rest",
              file=sys.stderr)
        return 130
    print(table(res.rows, limit=args.top))
    print(res.summary())
    return 5 if res.failed else 0


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The settings of a run, shared by `train` and `check` (which checks the run these flags describe)."""
    p.add_argument("--config", metavar="RUN.yaml", help="settings file (see docs/run.example.yaml); flags override it. "
                   f"{runs_code('Its model.factory and a MODULE:FUNCTION in its data section')}")
    p.add_argument("--data", help=".npz with one array per graph input (by name) and 'labels' (arrays of per-model "
                   "inputs are [B, n, ...]), sklearn:<name> (digits, iris, wine, breast_cancer), or MODULE:FUNCTION "
                   "(path.py:make) returning a torch DataLoader, a Dataset or a dict of arrays: "
                   f"{runs_code('the function')}")
    p.add_argument("--eval-data", help="held-out data, the same forms as --data; "
                   f"{runs_code('a MODULE:FUNCTION')}")
    add_train_flags(p)  # every training setting, made from onnxfuse/recipe/settings.py (the registries included)


def _add_common_flags(p: argparse.ArgumentParser, default) -> None:
    """The flags of every command, given before or after the subcommand: ``-q`` and ``-v``. A subcommand's parser
    parses into a namespace of its own and copies it over the top parser's, so there they default to SUPPRESS
    (not given: not copied; the top parser's False stays)."""
    p.add_argument("-q", "--quiet", action="store_true", default=default,
                   help="only warnings and errors on stderr: no progress bars or progress lines (results still print)")
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="debug log lines, and the traceback of an error")


class _Parser(argparse.ArgumentParser):
    """A command line argparse cannot read is one line (argparse prints the whole usage first), exit status 2:
    ``onnxfuse train: error: --steps: invalid int value 'abc' (`onnxfuse train --help` shows the usage)``."""

    def error(self, message: str):
        message = re.sub(r"^argument ([^:]+): ", r"\1: ", " ".join(message.split()))
        message = re.sub(r"(invalid \w+ value): '", r"\1 '", message)
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` shows the usage)\n")

    def parse_known_args(self, args=None, namespace=None):
        """Arguments a subcommand does not take are its error (named by it), not the top parser's."""
        parsed, extras = super().parse_known_args(args, namespace)
        command = getattr(parsed, "command", None)
        if extras and command and self._subparsers is not None:
            for action in self._subparsers._group_actions:
                if command in getattr(action, "choices", {}):
                    action.choices[command].error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


class _CommandParser(_Parser):
    """The parser of every subcommand (``add_subparsers(parser_class=...)``): the common flags come with it, so a
    new subcommand has them without asking."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        _add_common_flags(self, argparse.SUPPRESS)


def _array_arg(p: argparse.ArgumentParser, more: str = "") -> None:
    p.add_argument("array", metavar="ARRAY_DIR", help=f"an array folder, as `onnxfuse fuse -o` writes it{more}")


def _factory_args_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--args", nargs="+", action="extend", metavar="KEY=VALUE",
                   help="the factory's keyword arguments, KEY=VALUE pairs separated by spaces or commas, each value "
                   "read as YAML (16, 0.1, 1e-3, true, [16, 32], text), e.g. --args vocab_size=128 dropout=0 or "
                   "--args width=8,p=0.1 (a run config's and a sweep spec's model.args)")


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `export` subcommand."""
    from onnxfuse.exporters.factory import DEFAULT_OPSET, INPUT_DTYPES

    p = subparsers.add_parser("export", help="export B torch models (one per seed) to ONNX", epilog=TRUST_NOTE)
    p.add_argument("factory", metavar="MODULE:FACTORY", help="e.g. onnxfuse.exporters.zoo:LeNet or models.py:make; "
                   f"{runs_code('it')}")
    _factory_args_flag(p)
    p.add_argument("--count", type=at_least(1), required=True, help="number of models B")
    p.add_argument("--seeds", help="comma-separated seeds, one per model (default 0..B-1): torch.manual_seed(seed) "
                   "before each model is built")
    p.add_argument("--input-shape", action="append", required=True, metavar="[NAME=]D,D,...",
                   help="an example input's shape, batch axis first (it stays dynamic), e.g. 32,3,32,32; once per "
                   "argument of the forward when it takes several, each named (the graph inputs' names, in the "
                   "forward's order): --input-shape input_ids=8,16 --input-shape mask=8,16 (one unnamed input is "
                   "'input')")
    p.add_argument("--input-dtype", metavar="DTYPE|NAME=DTYPE,...",
                   help=f"the example inputs' dtype, one of {', '.join(INPUT_DTYPES)} (default float32; int64 for "
                   "token ids), or one per input by name: input_ids=int64,mask=bool. Integers are traced as zeros, "
                   "bools as True")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="the ONNX opset torch's TorchScript exporter "
                   f"writes (default {DEFAULT_OPSET})")
    p.add_argument("-o", "--output", required=True, metavar="JOBS_DIR",
                   help="the folder for model_0.onnx .. model_{B-1}.onnx and jobs.json (a new folder)")
    p.add_argument("--overwrite", action="store_true", help="replace JOBS_DIR")
    p.set_defaults(func=cmd_export)
    return p


def add_fuse_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `fuse` subcommand."""
    from onnxfuse.measure.forms import STRATEGY_CHOICES

    p = subparsers.add_parser("fuse", help="check B ONNX models are identical up to weights and fuse them",
                              epilog=TRUST_NOTE)
    p.add_argument("models", nargs="+", metavar="MODEL.onnx", help="ONNX files (a folder means its *.onnx files)")
    p.add_argument("-o", "--output", required=True, metavar="ARRAY_DIR",
                   help="the array folder to write (fused.onnx, array.json, sources/; a new folder)")
    p.add_argument("--strict", action="store_true",
                   help="fail on a node without a fusion rule instead of running it once per model")
    p.add_argument("--per-model-inputs", metavar="NAME,...",
                   help="graph inputs that differ per model (the fused input gains a leading model axis)")
    p.add_argument("--padding-rows", metavar="TABLE=ROW,...",
                   help="for plain torch.onnx.export files: embedding rows whose lookups pass no gradient, as "
                   "nn.Embedding(padding_idx=ROW) keeps them (onnxfuse export records these itself)")
    p.add_argument("--frozen", metavar="NAME,...",
                   help="for plain torch.onnx.export files: weights (names or glob patterns, e.g. 'encoder.*') "
                   "that are not trained, as requires_grad=False keeps them (onnxfuse export records these itself)")
    p.add_argument("--like", metavar="MODULE:FACTORY",
                   help="the torch module the files were exported from (path.py:make, as export takes it), built "
                   "with --args: the truth of what each weight is (parameters, buffers, ties, padding rows, "
                   "requires_grad); each file's weights are loaded into it and its forward checked against the "
                   "module's, and the array trains the module as onnxfuse's exporter writes it; "
                   f"{runs_code('the factory')}")
    _factory_args_flag(p)
    p.add_argument("--input-shape", action="append", metavar="[NAME=]D,D,...",
                   help="with --like: the sample the files are checked on (default the files' shapes, each "
                   "symbolic dimension 4), as export takes it")
    p.add_argument("--strategy", choices=STRATEGY_CHOICES, default="default",
                   help="the form of nodes that can be fused in several ways (convolutions: grouped or per-model; "
                   "LSTM, GRU, RNN: batched, per-model or block-diagonal): "
                   "default (each rule's first), a form for every such node, or auto: per node, the form measured "
                   "fastest on --runtime/--device at --batch samples per model (measured once per device, cached)")
    p.add_argument("--runtime", choices=RUNTIME_CHOICES, default="auto", help="the runtime auto measures on")
    p.add_argument("--device", default="cpu", help="the device auto measures on (cpu, cuda, cuda:N)")
    p.add_argument("--batch", type=at_least(1), default=32, help="samples per model per step auto measures with")
    p.add_argument("--threads", type=at_least(0), default=0, help="CPU threads auto measures with (0: the runtime's "
                   "default)")
    p.add_argument("--compile", choices=("off", "on"), default="off",
                   help="auto measures the forms' compiled steps (for arrays trained with --compile on)")
    p.add_argument("--overwrite", action="store_true", help="replace ARRAY_DIR")
    p.set_defaults(func=cmd_fuse)
    return p


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `train` subcommand."""
    p = subparsers.add_parser("train", help="train a fused array, each model with its own hyper-parameters",
                              epilog=TRUST_NOTE)
    _array_arg(p, " (--config's model section builds one where there is none)")
    _add_run_flags(p)
    p.add_argument("--resume", action="store_true",
                   help="continue the folder's current run from its newest checkpoint (with its settings and data; "
                   "flags may change only steps/epochs, logging, evaluation, checkpoints and the device)")
    p.set_defaults(func=cmd_train)
    return p


def add_check_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `check` subcommand."""
    p = subparsers.add_parser("check", help="check the first training step(s) of every model of an array against the "
                              "model trained alone, without training (the check `train` makes; writes nothing)",
                              epilog=TRUST_NOTE)
    _array_arg(p)
    _add_run_flags(p)
    p.set_defaults(func=cmd_check)
    return p


def add_split_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `split` subcommand."""
    p = subparsers.add_parser("split", help="write one ONNX model and one safetensors state_dict per model",
                              epilog=TRUST_NOTE)
    _array_arg(p, ", trained by `onnxfuse train`")
    p.add_argument("-o", "--output", required=True, metavar="MODELS_DIR",
                   help="the folder for model_b.onnx and model_b.safetensors (a new folder)")
    p.add_argument("--overwrite", action="store_true", help="replace MODELS_DIR (never the array or a folder "
                   "holding it)")
    p.add_argument("--initial", action="store_true",
                   help="split the weights the array was fused with (an untrained array is refused without it)")
    p.add_argument("--which", choices=WHICH, default="final",
                   help="each model's final state, or its best one by the run's --keep-best metric (default final); "
                   "each file's metadata says which, from which step (and by which metric value)")
    p.add_argument("--like", metavar="MODULE:FACTORY",
                   help="the models' torch module (path.py:make, as export takes it): write its state_dict keys, "
                        "found in a plain export's graph under other names or tied, from the array's values alone "
                        "(a key the array has no value for is refused; BatchNorm's num_batches_tracked: the steps "
                        f"trained); {runs_code('the factory')}")
    p.add_argument("--allow-missing", action="store_true",
                   help="write the split without the keys the array records it has no value for (parameters its "
                        "files lacked that the forward never reads), to load with strict=False")
    p.set_defaults(func=cmd_split)
    return p


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `report` subcommand."""
    p = subparsers.add_parser("report", help="summarize an array's metrics.csv: a table, report.png and report.json")
    _array_arg(p, ", trained by `onnxfuse train` (its metrics.csv)")
    p.add_argument("-o", "--output", metavar="PNG", help="where to write the plot (default ARRAY_DIR/report.png)")
    p.set_defaults(func=cmd_report)
    return p


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `demo` subcommand."""
    p = subparsers.add_parser("demo", help="train 8 small CNNs with 8 learning rates on scikit-learn's digits")
    p.add_argument("-o", "--output", default="onnxfuse-demo",
                   help="the demo's folder: the data, the jobs, the array and the split models (default "
                   "onnxfuse-demo)")
    p.add_argument("--models", type=at_least(1), default=8, help="how many CNNs, with learning rates from 0.001 to 1 "
                   "(default 8)")
    p.add_argument("--steps", type=at_least(1), default=300, help="training steps (default 300)")
    p.add_argument("--runtime", choices=RUNTIME_CHOICES, default="auto", help="what trains the array (default: auto)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="train in fp32, or bf16 / fp16 under autocast (the torch runtime)")
    p.set_defaults(func=cmd_demo)
    return p


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `bench` subcommand."""
    from onnxfuse.measure.bench import BASELINE, MODE_TITLES, MODES
    from onnxfuse.measure.forms import STRATEGY_CHOICES

    p = subparsers.add_parser("bench", help="the fused array vs every way to train the same models, each in its best "
                              "form: PyTorch one after another, B processes at once, onnxruntime-training one after "
                              "another, a torch.func ensemble, an HFTA-style hand-fused model, one model at batch B*N, "
                              "eager and compiled")
    p.add_argument("--models", default="lenet,resnet18,transformer_lm",
                   help="zoo models or .onnx files (one data input, one output), comma-separated")
    p.add_argument("--B", default="1,8,16", help="array sizes to measure, e.g. 1,8,16,32")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (the ort modes run on the CPU only)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated, default all (the compiled ones add their compile time to the run, not to "
                   "their samples/s): " + ", ".join(f"{m} ({t}{': always measured' if m == BASELINE else ''})"
                                                    for m, t in MODE_TITLES.items()))
    p.add_argument("--batch", type=at_least(1), default=32, help="samples per model per step")
    p.add_argument("--steps", type=at_least(1), default=10, help="timed steps per round")
    p.add_argument("--rounds", type=at_least(1), default=3, help="rounds alternating the modes; medians reported")
    p.add_argument("--warmup", type=at_least(0), default=3, help="untimed steps per mode before the rounds")
    p.add_argument("--budget-s", type=float, default=0, help="start no new measurement after this many seconds")
    p.add_argument("--threads", type=at_least(0), default=0, help="CPU threads of every mode, both runtimes (0: each "
                   "one's default: 1 for the torch runtime, onnxruntime's own)")
    p.add_argument("--strategy", choices=STRATEGY_CHOICES, default="default",
                   help="the fusion strategy of the fused modes (see `onnxfuse fuse --strategy`)")
    p.add_argument("--isa", choices=list(ISA_ENV), default="native",
                   help="the instruction set torch, oneDNN and MKL are held to while measuring: native (what this CPU "
                   "has), avx512, avx2 (as a CPU with that much and no more), default (torch's unvectorized kernels); "
                   "recorded in bench.json and the tables")
    p.add_argument("--precision", default="fp32",
                   help=f"comma-separated, of {', '.join(PRECISIONS)} (default fp32): every mode in each, the forward "
                   "and loss under torch.autocast for bf16 / fp16, fp16 with GradScaler loss scaling (the ort modes: "
                   "fp32 only); ratios within one precision")
    p.add_argument("-o", "--output", default="onnxfuse-bench",
                   help="folder for bench.json, bench.csv, bench.md, bench.png")
    p.set_defaults(func=cmd_bench)
    return p


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `plan` subcommand."""
    p = subparsers.add_parser("plan", help="predict a fused training step's time and memory per B from a few small "
                              "arrays really trained, and recommend B (onnxfuse/measure/sizing.py)")
    p.add_argument("model", metavar="MODEL", help="a zoo model (e.g. lenet) or an ONNX file with one data input")
    p.add_argument("--runtime", choices=RUNTIME_CHOICES, default="auto", help="what trains the array")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--batch", type=at_least(1), default=32, help="samples per model per step")
    p.add_argument("--memory-budget", metavar="SIZE", help="e.g. 8GiB, 512MiB or bytes (default: 0.9 x the GPU's "
                   "memory, 0.8 x the RAM available)")
    p.add_argument("--max-B", type=at_least(1), default=1024, help="largest array size considered")
    p.add_argument("--probe", default="1,2,4", help="array sizes really trained to fit the predictions")
    p.add_argument("--optimizer", default="adamw", help="the optimizer whose state the arrays hold")
    p.add_argument("--threads", type=at_least(0), default=0, help="CPU threads (0: the runtime's default)")
    p.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan as JSON")
    p.set_defaults(func=cmd_plan)
    return p


def add_sweep_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `sweep` subcommand."""
    p = subparsers.add_parser("sweep", help="run a hyper-parameter sweep: trials grouped into fused arrays by graph "
                              "identity, trained on Ray (a local one by default); see docs/sweep.example.yaml",
                              epilog=TRUST_NOTE)
    p.add_argument("spec", nargs="?", metavar="SPEC.yaml", help="the sweep spec")
    p.add_argument("-o", "--output", metavar="SWEEP_DIR", help="where the sweep's files go (a new or empty folder)")
    p.add_argument("--resume", metavar="SWEEP_DIR", help="continue the sweep in SWEEP_DIR: run only the arrays "
                   "with no result (or a failed one)")
    p.add_argument("--address", help="a running Ray cluster (e.g. HEAD_IP:6379, or auto); default: start a "
                   "local Ray on this machine")
    p.add_argument("--cpus", type=at_least(1), help="CPUs of the local Ray (default: all of this machine's)")
    p.add_argument("--runtime", choices=RUNTIME_CHOICES, help="what trains the arrays (default: the spec's)")
    p.add_argument("--top", type=at_least(1), default=20, help="trials shown in the table (all are in results.csv)")
    p.set_defaults(func=cmd_sweep)
    return p


def build_parser() -> argparse.ArgumentParser:
    from onnxfuse.cli.place import add_place_parser
    from onnxfuse.core._version import __version__

    p = _Parser(prog="onnxfuse", description="Fuse B same-architecture training jobs into one "
                                "ONNX graph and train them together (PyTorch or ONNX Runtime).")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="print onnxfuse's version and exit")
    _add_common_flags(p, False)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_CommandParser, metavar="COMMAND",
                           help="`onnxfuse COMMAND --help` says more")
    for add in (add_export_parser, add_fuse_parser, add_train_parser, add_check_parser, add_split_parser,
                add_report_parser, add_demo_parser, add_bench_parser, add_plan_parser, add_sweep_parser,
                add_place_parser):
        add(sub)
    return p


class _StderrHandler(logging.StreamHandler):
    """Log lines go to sys.stderr as it is when they are written (a caller, or a test, may have replaced it since
    the first command of the process set the handler up)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logger = logging.getLogger("onnxfuse")
    logger.setLevel(level)
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(FlagFormatter("onnxfuse: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    watch = Stopwatch()
    try:
        code = args.func(args) or 0
        logger.debug("%s done in %.1f s", args.command, watch.seconds)
        return code
    except TrainingStoppedError as e:  # a run stopped on purpose (--on-diverge stop): its state is saved
        print(f"onnxfuse: {one_line(e, args.command)}", file=sys.stderr)
        return 3
    except VerificationError as e:  # the array would train a model wrongly: neither bad input nor a crash
        if args.verbose:
            traceback.print_exc()
        print(f"onnxfuse: error: {one_line(e, args.command)}", file=sys.stderr)
        return 4
    except OnnxFuseError as e:
        if args.verbose:
            traceback.print_exc()
        print(f"onnxfuse: error: {one_line(e, args.command)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("onnxfuse: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.verbose:
            traceback.print_exc()
        user = as_user_error(e)  # a full disk, a read-only folder, out of memory: the user's to fix
        if user is not None:
            print(f"onnxfuse: error: {one_line(user, args.command)}", file=sys.stderr)
            return 2
        # a bug: still one line unless --verbose
        print(f"onnxfuse: internal error: {type(e).__name__}: {' '.join(str(e).split())[:500]} "
              "(run with --verbose for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
