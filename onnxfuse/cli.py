"""The `onnxfuse` command: a thin layer over the Python API. Errors print as one line (traceback with --verbose)."""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import logging
import traceback
import warnings

from .errors import ConfigError, OnnxFuseError, TrainingStoppedError, VerificationError, as_user_error
from .training.losses import LOSSES

__all__ = ["main", "build_parser"]


def _numbers(text: str | None, flag: str, cast=float) -> list | None:
    """'0.1' -> [0.1]; '0.1,0.05' -> [0.1, 0.05] (one per model)."""
    if text is None:
        return None
    try:
        return [cast(v) for v in str(text).split(",") if v.strip() != ""]
    except ValueError:
        raise ConfigError(f"{flag}: '{text}' is not a number or a comma-separated list of numbers") from None


def _natural(path: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def _model_files(items: list[str]) -> list[str]:
    """Files as given; a folder stands for its *.onnx files in natural order (model_2 before model_10)."""
    out = []
    for item in items:
        if os.path.isdir(item):
            found = sorted(glob.glob(os.path.join(item, "*.onnx")), key=_natural)
            if not found:
                raise ConfigError(f"folder '{item}' holds no .onnx files")
            out += found
        else:
            out.append(item)
    return out


def cmd_export(args) -> int:
    from ._folder import check_output_location
    from .exporters import export_array, load_factory

    shape = _numbers(args.input_shape, "--input-shape", int)
    if not shape or any(d < 1 for d in shape):
        raise ConfigError(f"--input-shape must be positive integers like 32,3,32,32, got '{args.input_shape}'")
    seeds = _numbers(args.seeds, "--seeds", int)
    module_file = args.factory.rpartition(":")[0]
    check_output_location(args.output, [module_file] if module_file.endswith(".py") else [])
    factory = load_factory(args.factory)
    paths = export_array(factory, args.output, args.count, shape, seeds=seeds, overwrite=args.overwrite,
                         opset=args.opset)
    print(f"exported {len(paths)} models to {args.output}/ (model_0.onnx .. model_{len(paths) - 1}.onnx)")
    return 0


def cmd_fuse(args) -> int:
    from ._folder import check_output_location, is_array, open_array
    from ._io import check_output_dir

    check_output_location(args.output, args.models)
    check_output_dir(args.output, args.overwrite)
    if args.overwrite and is_array(args.output):  # replacing an array: not while another command uses it
        with open_array(args.output, "fuse"):
            return _fuse(args)
    return _fuse(args)


def _fuse(args) -> int:
    from .passes import fuse_models, save_array

    files = _model_files(args.models)
    per_model = [n for n in (args.per_model_inputs or "").split(",") if n]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fa = fuse_models(files, strict=args.strict, per_model_inputs=per_model)
    for w in caught:
        print(f"onnxfuse: warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    save_array(fa, args.output, overwrite=args.overwrite)
    s = fa.spec.summary
    print(f"fused {fa.B} model{'s' if fa.B != 1 else ''} into {args.output}/fused.onnx: {s['nodes']} nodes per "
          f"model -> {s['fused_nodes']} fused nodes ({s['fused']} fused by rules, {s['per_model']} run per model, "
          f"{s['shared']} shared, {s['layout_changes']} layout changes); fused fraction "
          f"{100 * s['fused_fraction']:.1f}%; "
          f"{len(fa.spec.weights)} fused weights")
    return 0


def _train_settings(args) -> dict:
    """The training settings given as flags (only those given: they override the config file)."""
    nums = lambda flag, attr, cast=float: _numbers(getattr(args, attr), flag, cast)  # noqa: E731
    given = {
        "steps": args.steps, "epochs": args.epochs, "batch_size": args.batch_size, "loss": args.loss,
        "optimizer": args.optimizer, "lr": nums("--lr", "lr"), "momentum": nums("--momentum", "momentum"),
        "dampening": nums("--dampening", "dampening"), "weight_decay": nums("--weight-decay", "weight_decay"),
        "eps": nums("--eps", "eps"), "clip_grad_norm": nums("--clip-grad-norm", "clip_grad_norm"),
        "betas": tuple(nums("--betas", "betas")) if args.betas else None,
        "nesterov": True if args.nesterov else None, "amsgrad": True if args.amsgrad else None,
        "seed": args.seed, "device": args.device, "log_every": args.log_every, "data_order": args.data_order,
        "eval_every": args.eval_every, "eval_fraction": args.eval_fraction, "checkpoint_every": args.checkpoint_every,
        "keep_checkpoints": args.keep_checkpoints, "on_diverge": args.on_diverge,
        "halving": _numbers(args.halving, "--halving", int), "halving_keep": args.halving_keep,
        "shuffle": False if args.no_shuffle else None, "per_model_labels": True if args.per_model_labels else None,
        "verify_steps": args.verify_steps,
        "allow_nonfinite_data": True if args.allow_nonfinite_data else None,
    }
    loss_options = {k: v for k, v in (("label_smoothing", args.label_smoothing), ("ignore_index", args.ignore_index),
                                      ("class_axis", args.class_axis)) if v is not None}
    if loss_options:
        given["loss_options"] = loss_options
    if args.schedule:
        sched = {"name": args.schedule}
        for key in ("warmup_steps", "step_size", "gamma", "max_lr", "end_factor"):
            if getattr(args, key) is not None:
                sched[key] = getattr(args, key)
        if args.milestones:
            sched["milestones"] = _numbers(args.milestones, "--milestones", int)
        given["schedule"] = sched
    return {k: v for k, v in given.items() if v is not None}


def _run_config(args, resume: bool = False):
    """(TrainConfig or None, overrides or None, data, eval data) from --config and the flags; with ``resume`` and
    no config file: no TrainConfig, and the flags override the checkpoint's own settings."""
    from .training import TrainConfig

    settings, data, eval_data = {}, args.data, args.eval_data
    if args.config:
        from .training.config import config_to_train_settings, load_config

        cfg_file = load_config(args.config)
        settings, file_data, file_eval = config_to_train_settings(cfg_file, args.array)
        data, eval_data = data or file_data, eval_data or file_eval
    flags = _train_settings(args)
    if resume and not args.config:
        return None, flags, data, eval_data
    settings.update(flags)
    if "batch_size" not in settings:
        raise ConfigError("--batch-size is required (or batch_size in --config)")
    if "steps" not in settings and "epochs" not in settings:
        raise ConfigError("--steps or --epochs is required (or steps/epochs in --config)")
    if data is None:
        raise ConfigError("--data is required (a .npz file or sklearn:<name>), or data.train in --config")
    return TrainConfig.from_dict(settings), None, data, eval_data


def cmd_train(args) -> int:
    from .training import train_array

    cfg, overrides, data, eval_data = _run_config(args, resume=args.resume)
    res = train_array(args.array, data, cfg, progress=not args.quiet, eval_data=eval_data, resume=args.resume,
                      overrides=overrides)
    print(f"trained {len(res.final_loss)} models for {res.steps} steps in {res.elapsed_s:.1f}s "
          f"({res.samples_per_s:,.0f} samples/s); metrics in {res.metrics_path}")
    print(f"{'model':>5}  {'final loss':>10}  {'eval loss':>10}  {'eval acc':>8}  status")
    ev_loss, ev_acc = res.eval.get("loss", {}), res.eval.get("accuracy", {})
    for b, loss in enumerate(res.final_loss):
        st = res.status.get(b)
        print(f"{b:>5}  {loss:>10.4f}  {ev_loss.get(b, float('nan')):>10.4f}  "
              f"{100 * ev_acc.get(b, float('nan')):>7.1f}%  {'' if st is None else st['status'] + ' at step ' + str(st['step'])}")
    return 0


def cmd_check(args) -> int:
    from .training import load_array
    from .training.run import verify_array

    load_array(args.array)  # before --config could build an array there: check writes nothing
    cfg, _, data, eval_data = _run_config(args)
    report = verify_array(args.array, data, cfg, eval_data=eval_data)
    print(report.table())
    print(report.summary())
    if not report.ok:
        raise report.error()
    return 0


def cmd_report(args) -> int:
    from .training.report import format_table, make_report

    summary = make_report(args.array, out_png=args.output)
    print(format_table(summary))
    run = f"; run {summary['run']}" if summary.get("run") else ""
    print(f"plot: {summary['png']} (summary: {summary['json']}{run})")
    return 0


def cmd_split(args) -> int:
    from .split import split_array

    paths = split_array(args.array, args.output, overwrite=args.overwrite, initial=args.initial)
    what = "initial weights" if args.initial else "trained weights"
    print(f"wrote {len(paths)} model{'s' if len(paths) != 1 else ''} ({what}) to {args.output}/ (model_b.onnx for "
          "inference, model_b.safetensors state_dicts)")
    return 0


def cmd_demo(args) -> int:
    from .training.demo import run_demo

    run_demo(args.output, models=args.models, steps=args.steps, progress=not args.quiet)
    return 0


def cmd_bench(args) -> int:
    from .training.bench import run_benchmark

    run_benchmark(B_values=_numbers(args.models, "--models", int), steps=args.steps, warmup=args.warmup,
                  batch_size=args.batch_size, repeats=args.repeats, out=args.json)
    return 0


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The settings of a run, shared by `train` and `check` (which checks the run these flags describe)."""
    p.add_argument("--config", metavar="RUN.yaml", help="settings file (see docs/run.example.yaml); flags override it")
    p.add_argument("--data", help=".npz with one array per graph input (by name) and 'labels' (arrays of per-model "
                   "inputs are [B, n, ...]), or sklearn:<name> (digits, iris, wine, breast_cancer)")
    p.add_argument("--eval-data", help="held-out data, the same forms as --data")
    p.add_argument("--eval-fraction", type=float, help="hold out this fraction of --data for evaluation")
    p.add_argument("--eval-every", type=int, help="evaluate every K steps (0: at the end only)")
    p.add_argument("--loss", choices=list(LOSSES),
                   help="cross-entropy / nll: labels are class indices; mse, l1, bce-with-logits: targets shaped "
                   "like the output; model: the output is the loss (no labels)")
    p.add_argument("--label-smoothing", type=float, help="cross-entropy label smoothing in [0, 1] (default 0)")
    p.add_argument("--ignore-index", type=int,
                   help="cross-entropy / nll: labels with this value count for nothing (default -100)")
    p.add_argument("--class-axis", type=int,
                   help="class axis of the output: 1 for [N, C, ...] (default), -1 for [N, T, V] language models")
    p.add_argument("--per-model-labels", action="store_true",
                   help="'labels' in the data file is [B, n, ...]: one set of labels per model")
    p.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], help="default sgd")
    p.add_argument("--lr", help="learning rate: one value, or one per model (comma-separated); default 1e-3")
    p.add_argument("--momentum", help="SGD momentum, one or one per model (default 0)")
    p.add_argument("--dampening", help="SGD dampening, one or one per model (default 0)")
    p.add_argument("--nesterov", action="store_true", help="SGD Nesterov momentum (per model: --config)")
    p.add_argument("--weight-decay", help="one or one per model (default: AdamW 0.01, otherwise 0, as torch.optim)")
    p.add_argument("--betas", help="Adam/AdamW beta1,beta2 (default 0.9,0.999; per model: --config)")
    p.add_argument("--eps", help="Adam/AdamW eps, one or one per model (default 1e-8)")
    p.add_argument("--amsgrad", action="store_true", help="Adam/AdamW amsgrad (per model: --config)")
    p.add_argument("--clip-grad-norm", help="clip each model's gradient norm to this (one or one per model)")
    p.add_argument("--schedule", choices=["constant", "step", "multistep", "exponential", "cosine", "linear",
                                          "onecycle"], help="learning-rate schedule (torch.optim.lr_scheduler)")
    p.add_argument("--warmup-steps", type=int, help="cosine/linear: linear warm-up steps")
    p.add_argument("--step-size", type=int, help="step: decay every K steps")
    p.add_argument("--gamma", type=float, help="step/multistep/exponential decay factor")
    p.add_argument("--milestones", help="multistep: comma-separated steps")
    p.add_argument("--max-lr", type=float, help="onecycle: peak learning rate")
    p.add_argument("--end-factor", type=float, help="linear: final lr factor (default 0)")
    p.add_argument("--steps", type=int, help="optimizer steps (or --epochs)")
    p.add_argument("--epochs", type=int, help="passes over the data (or --steps)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--no-shuffle", action="store_true", help="take batches in file order")
    p.add_argument("--seed", type=int, help="shuffling seed (default 0)")
    p.add_argument("--data-order", choices=["shared", "per-model", "shards"],
                   help="shared batches (default), an own shuffle per model, or shard b for model b")
    p.add_argument("--on-diverge", choices=["freeze", "stop"],
                   help="a model whose loss or update is not finite: freeze it (default) or stop the run")
    p.add_argument("--halving", help="steps at which successive halving keeps the best half by eval loss")
    p.add_argument("--halving-keep", type=float, help="fraction kept at each halving (default 0.5)")
    p.add_argument("--checkpoint-every", type=int, help="write a checkpoint every K steps (0: never)")
    p.add_argument("--keep-checkpoints", type=int, help="how many checkpoints to keep (default 2)")
    p.add_argument("--device", help="cpu (default) or cuda[:id]")
    p.add_argument("--log-every", type=int, help="write training metrics every K steps (default 1)")
    p.add_argument("--verify-steps", type=int,
                   help="before training, check the first K steps of every model against the model trained "
                   "alone on the same runtime (default 1; 0: skip; a resumed run skips it)")
    p.add_argument("--allow-nonfinite-data", action="store_true",
                   help="train on data with NaN or inf in its inputs or float labels (by default that is an error "
                   "naming the first such value)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onnxfuse", description="Fuse B same-architecture training jobs into one "
                                "ONNX graph and train them together with ONNX Runtime.")
    p.add_argument("-v", "--verbose", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="export B torch models (one per seed) to ONNX")
    e.add_argument("factory", metavar="MODULE:FACTORY", help="e.g. onnxfuse.exporters.zoo:LeNet or models.py:make")
    e.add_argument("--count", type=int, required=True, help="number of models B")
    e.add_argument("--seeds", help="comma-separated seeds, one per model (default 0..B-1)")
    e.add_argument("--input-shape", required=True, help="example input shape, e.g. 32,3,32,32 (batch dim is dynamic)")
    e.add_argument("--opset", type=int, default=17)
    e.add_argument("-o", "--output", required=True, metavar="JOBS_DIR")
    e.add_argument("--overwrite", action="store_true")
    e.set_defaults(func=cmd_export)

    f = sub.add_parser("fuse", help="check B ONNX models are identical up to weights and fuse them")
    f.add_argument("models", nargs="+", metavar="MODEL.onnx", help="ONNX files (a folder means its *.onnx files)")
    f.add_argument("-o", "--output", required=True, metavar="ARRAY_DIR")
    f.add_argument("--strict", action="store_true",
                   help="fail on a node without a fusion rule instead of running it once per model")
    f.add_argument("--per-model-inputs", metavar="NAME,...",
                   help="graph inputs that differ per model (the fused input gains a leading model axis)")
    f.add_argument("--overwrite", action="store_true")
    f.set_defaults(func=cmd_fuse)

    t = sub.add_parser("train", help="train a fused array, each model with its own hyper-parameters")
    t.add_argument("array", metavar="ARRAY_DIR")
    _add_run_flags(t)
    t.add_argument("--resume", action="store_true",
                   help="continue the folder's current run from its newest checkpoint (with its settings and data; "
                   "flags may change only steps/epochs, logging, evaluation, checkpoints and the device)")
    t.add_argument("-q", "--quiet", action="store_true", help="no progress bar, warnings only")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("check", help="check the first training step(s) of every model of an array against the "
                       "model trained alone, without training (the check `train` makes; writes nothing)")
    c.add_argument("array", metavar="ARRAY_DIR")
    _add_run_flags(c)
    c.add_argument("-q", "--quiet", action="store_true", help="warnings only in the log")
    c.set_defaults(func=cmd_check)

    s = sub.add_parser("split", help="write one ONNX model and one safetensors state_dict per model")
    s.add_argument("array", metavar="ARRAY_DIR")
    s.add_argument("-o", "--output", required=True, metavar="MODELS_DIR")
    s.add_argument("--overwrite", action="store_true", help="replace MODELS_DIR (never the array or a folder "
                   "holding it)")
    s.add_argument("--initial", action="store_true",
                   help="split the weights the array was fused with (an untrained array is refused without it)")
    s.set_defaults(func=cmd_split)

    r = sub.add_parser("report", help="summarize an array's metrics.csv: a table, report.png and report.json")
    r.add_argument("array", metavar="ARRAY_DIR")
    r.add_argument("-o", "--output", metavar="PNG", help="where to write the plot (default ARRAY_DIR/report.png)")
    r.set_defaults(func=cmd_report)

    d = sub.add_parser("demo", help="train 8 small CNNs with 8 learning rates on scikit-learn's digits")
    d.add_argument("-o", "--output", default="onnxfuse-demo")
    d.add_argument("--models", type=int, default=8)
    d.add_argument("--steps", type=int, default=300)
    d.add_argument("-q", "--quiet", action="store_true")
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="fused array vs the same models trained one after another (ORT)")
    b.add_argument("--models", default="4,16", help="array sizes B to measure, e.g. 4,16")
    b.add_argument("--steps", type=int, default=50, help="timed steps per model")
    b.add_argument("--warmup", type=int, default=5, help="untimed steps per model before timing")
    b.add_argument("--batch-size", type=int, default=32)
    b.add_argument("--repeats", type=int, default=5,
                   help="rounds of fused / sequential runs back to back; medians of per-round ratios reported")
    b.add_argument("--json", help="also write the results to this JSON file")
    b.set_defaults(func=cmd_bench)
    from .placement._cli import add_place_parser
    add_place_parser(sub)
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
    level = logging.DEBUG if args.verbose else logging.WARNING if getattr(args, "quiet", False) else logging.INFO
    logger = logging.getLogger("onnxfuse")
    logger.setLevel(level)
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("onnxfuse: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    try:
        return args.func(args) or 0
    except TrainingStoppedError as e:  # a run stopped on purpose (--on-diverge stop): its state is saved
        print(f"onnxfuse: {' '.join(str(e).split())}", file=sys.stderr)
        return 3
    except VerificationError as e:  # the array would train a model wrongly: neither bad input nor a crash
        if args.verbose:
            traceback.print_exc()
        print(f"onnxfuse: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 4
    except OnnxFuseError as e:
        if args.verbose:
            traceback.print_exc()
        print(f"onnxfuse: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("onnxfuse: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.verbose:
            traceback.print_exc()
        user = as_user_error(e)  # a full disk, a read-only folder, out of memory: the user's to fix
        if user is not None:
            print(f"onnxfuse: error: {' '.join(str(user).split())}", file=sys.stderr)
            return 2
        # a bug: still one line unless --verbose
        print(f"onnxfuse: internal error: {type(e).__name__}: {' '.join(str(e).split())[:500]} "
              "(run with --verbose for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
