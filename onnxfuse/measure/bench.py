"""``onnxfuse bench``: the fused array against every way a user could train the same B models, each in its best form.

For each model, B and precision this builds every mode (``bench_modes.py``; the concurrent one in
``bench_concurrent.py``), times them in interleaved rounds on one batch and writes bench.json, bench.csv, bench.md
and bench.png (``bench_report.py``). What each mode is, how the rounds are timed and read, and the results:
docs/benchmarks.md ("How onnxfuse bench measures")."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core._io import atomic_files, claim_output
from onnxfuse.core.errors import ConfigError, shell
from onnxfuse.recipe.device import Device
from onnxfuse.recipe.runtimes import PRECISIONS, RUNTIMES, check_precision
from onnxfuse.runtime._machine import cpu_description, isa_env, isa_in_effect

from onnxfuse.measure.bench_concurrent import Concurrent, cores
from onnxfuse.measure.bench_modes import (BASELINE, CEILING, CEILINGS, COMPILED, FUSED_MODES, MODE_TITLES, MODES,
                                          ORT_MODES, Workload, adamw_step, dense_loss, file_workload, fused_step,
                                          hfta_loss, modes_of_models, peak_mib, runs_in, step_memory,
                                          seq_ort_step,
                                          seq_torch_step, summed, vmap_loss, zoo_workload)
from onnxfuse.measure.bench_report import (machine, scaling_table, table, verdicts, wide_table, write_csv,
                                           write_png)
from onnxfuse.measure.workloads import OnnxFile, interleaved_rounds, is_onnx_file, load_onnx_file

__all__ = ["run_bench", "command", "MODES", "MODE_TITLES", "BASELINE"]


# ------------------------------------------------------------------------------------------------ measurement
@dataclass
class _Inputs:
    """What every mode of one measurement shares: the per-model learning rates, the loss, the batch as the torch
    modes take it and as the ort runtime does (numpy), and where each concurrent process builds its model from."""

    lrs: list[float]
    loss_name: object
    feeds: dict
    host: dict
    sources: list[tuple]


def _inputs(work: Workload) -> _Inputs:
    from onnxfuse.recipe.losses import LABELS, get_loss

    B = len(work.protos)
    feeds = {work.input_name: work.x, LABELS: work.y}
    return _Inputs(lrs=[float(v) for v in np.geomspace(1e-4, 1e-3, B)] if B > 1 else [1e-3],
                   loss_name=get_loss("cross-entropy", class_axis=-1) if work.class_last else "cross-entropy",
                   feeds=feeds,
                   host={k: v.cpu().numpy() for k, v in feeds.items()},  # the ort runtime takes numpy (CPU)
                   sources=([("zoo", work.name, b) for b in range(B)] if work.source == "zoo"
                            else [("onnx", p.SerializeToString()) for p in work.protos]))


def _makers(work: Workload, p: str, first: bool, shared: _Inputs, device, folder: str, threads: int,
            strategy: str, stack: contextlib.ExitStack) -> dict[str, Callable[[], Callable]]:
    """Precision ``p``'s modes, each a function that builds its step; its own copy of the B torch modules (the
    first precision: the workload's)."""
    import torch

    B, n, x, y, last = len(work.protos), work.batch, work.x, work.y, work.class_last
    lrs, loss_name, feeds, host = shared.lrs, shared.loss_name, shared.feeds, shared.host
    seq = work.modules if first else [copy.deepcopy(m) for m in work.modules]
    losses = {"vmap": lambda: vmap_loss(seq, last, x, y),
              "hfta": lambda: hfta_loss(work.name, seq, last, x, y),
              "dense": lambda: dense_loss(work.fresh(), last, x, y, B)}
    make = {"torch": lambda: fused_step(work.protos, lrs, loss_name, "torch", str(device), feeds, folder,
                                        threads, strategy, n, precision=p),
            "torch-compiled": lambda: fused_step(work.protos, lrs, loss_name, "torch", str(device), feeds,
                                                 folder, threads, strategy, n, compile="on", precision=p),
            "ort": lambda: fused_step(work.protos, lrs, loss_name, "ort", "cpu", host,
                                      os.path.join(folder, "ort"), threads, strategy, n),
            "seq-torch": lambda: seq_torch_step(seq, lrs, last, x, y, p),
            "seq-torch-compiled": lambda: seq_torch_step([copy.deepcopy(m) for m in seq], lrs, last, x, y, p,
                                                         compiled=True),
            "seq-ort": lambda: seq_ort_step(work.protos, lrs, loss_name, host, os.path.join(folder, "seq-ort"),
                                            threads),
            # each process gets this process's torch threads split B ways, on as many cores as they are
            "concurrent": lambda: stack.enter_context(Concurrent(shared.sources, x, y, lrs, last, device,
                                                                 max(1, torch.get_num_threads() // B),
                                                                 cores(torch.get_num_threads()), p))}
    return make | {m + suffix: (lambda loss=loss, c=bool(suffix): adamw_step(*loss(), lrs[0], compiled=c,
                                                                            precision=p, device=device))
                   for m, loss in losses.items() for suffix in ("", COMPILED)}


def _measure(work: Workload, steps: int, warmup: int, rounds: int, device, modes: list[str], folder: str,
             threads: int = 0, strategy: str = "default", precisions: Sequence[str] = ("fp32",)) -> list[dict]:
    """Every mode in every precision (the ort runtime's in fp32 only), interleaved in the same rounds; one row per
    precision, its ratios to seq-torch and dense in that precision."""
    import torch

    shared = _inputs(work)
    keys = [(m, p) for p in precisions for m in modes if runs_in(m, p)]  # (mode, precision)
    if any(m.endswith(COMPILED) for m in modes):
        torch._dynamo.reset()  # each measurement compiles its own graphs (no recompile limit across models and B)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    cuda = device.type == "cuda"
    peaks: dict[tuple, float | None] = {k: 0.0 if cuda else None for k in keys}

    def reset_peak(key: tuple) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def read_peak(key: tuple) -> None:
        peaks[key] = max(peaks[key], peak_mib(device))

    with contextlib.ExitStack() as stack:  # the concurrent mode's processes stop however this ends
        make = {p: _makers(work, p, p == precisions[0], shared, device, folder, threads, strategy, stack)
                for p in precisions}
        steppers, setup_s = _build(keys, make)
        threads_now = torch.get_num_threads()
        first_s, first_loss = _first_steps(steppers, keys, warmup, sync)
        times = interleaved_rounds({k: steppers[k] for k in keys}, rounds, steps, sync,
                                   reset_peak if cuda else None, read_peak if cuda else None,
                                   runs_steps={k for k in keys if k[0] == "concurrent"})
        if not cuda:  # after the rounds, untimed: the memory of one step of each mode
            peaks.update(step_memory({k: s for k, s in steppers.items() if k[0] != "concurrent"}))
        for k in keys:
            if k[0] == "concurrent":
                peaks[k] = steppers[k].peak_mib()  # its processes' own
    return [_row(work, p, {m: times[m, q] for m, q in keys if q == p}, steppers, setup_s, first_s, first_loss, peaks,
                 steps, warmup, rounds, device, threads_now) for p in precisions]


def _build(keys: list[tuple], make: dict) -> tuple[dict, dict]:
    """Every mode built before any runs, the concurrent processes last: a mode's building may set the process's
    torch threads (the torch runtime does when ``threads`` is given), which compiled graphs are specialized on and
    the concurrent processes split. The steps, and the seconds each took to build (fusing, sessions, optimizers, processes: not
    timed)."""
    steppers, setup_s = {}, {}
    for mode, p in sorted(keys, key=lambda k: k[0] == "concurrent"):
        with Stopwatch() as setup:
            steppers[mode, p] = make[p][mode]()
        setup_s[mode, p] = setup.seconds
    return steppers, setup_s


def _first_steps(steppers: dict, keys: list[tuple], warmup: int, sync: Callable[[], None]) -> tuple[dict, dict]:
    """Each mode's first step alone (compiling, lazy builds; the first warm-up step) and the rest of its warm-up:
    the first step's seconds and the B models' summed loss before any update (concurrent's: None). A compiled
    fused step that times its forms on its first steps (``TrainStep.FORMS``) takes them here, untimed, with its
    first step's seconds: its rounds time the form it keeps."""
    first_s, first_loss = {}, {}
    for key in keys:
        sync()
        with Stopwatch() as first:
            losses = steppers[key]()
            sync()
        first_loss[key] = summed(losses)
        settled = getattr(steppers[key], "settled", lambda: True)
        with Stopwatch() as choosing:
            for _ in range(32):
                if settled():
                    break
                steppers[key]()
            sync()
        first_s[key] = first.seconds + choosing.seconds
        for _ in range(warmup - 1):
            steppers[key]()
    return first_s, first_loss


def _row(work: Workload, p: str, mine: dict, steppers: dict, setup_s: dict, first_s: dict, first_loss: dict,
         peaks: dict, steps: int, warmup: int, rounds: int, device, threads_now: int) -> dict:
    """Precision ``p``'s row: each mode's samples/s and its ratios (medians of per-round ratios) to seq-torch and
    dense in that precision; ``mine``: each mode's round times."""
    B, n = len(work.protos), work.batch
    cuda = device.type == "cuda"
    samples = B * n * steps
    result = {}
    for mode in mine:
        result[mode] = {
            "samples_s": samples / statistics.median(mine[mode]),
            "over_seq_torch": statistics.median(b / t for t, b in zip(mine[mode], mine[BASELINE])),
            "of_dense": (statistics.median(d / t for t, d in zip(mine[mode], mine[CEILING]))
                         if CEILING in mine else None),
            "round_s": mine[mode], "setup_s": setup_s[mode, p], "first_call_s": first_s[mode, p],
            "first_loss": first_loss[mode, p],
            "peak_mib": peaks[mode, p]}
    if "concurrent" in result:
        result["concurrent"]["threads_per_process"] = steppers["concurrent", p].threads if not cuda else None
    return {"model": work.name, "source": work.source, "B": B, "precision": p, "batch": n,
            "device": str(device), "steps": steps, "warmup": warmup, "rounds": rounds, "threads": threads_now,
            "export_s": work.export_s,
            "peak_mib": max(v for (m, q), v in peaks.items() if q == p) if cuda else peak_mib(device),
            "modes": result, **_verdict(result, mine)}


def _verdict(result: dict, times: dict) -> dict:
    """The row's winner (highest samples/s) and the fused array's best mode as a fraction of the better of dense and
    dense-compiled (the median of per-round ratios), when both are measured."""
    def best(among):
        return max((m for m in among if m in result), key=lambda m: result[m]["samples_s"], default=None)

    fused, ceiling = best(FUSED_MODES), best(CEILINGS)
    of = (statistics.median(c / t for t, c in zip(times[fused], times[ceiling]))
          if fused is not None and ceiling is not None else None)
    return {"winner": best(result), "fused_best": fused, "ceiling_best": ceiling, "fused_of_ceiling": of}


def _ort_unavailable(device) -> str | None:
    if device.type != "cpu":
        return f"the ort modes run on the CPU only (device {device})"
    try:
        import onnxruntime.training  # noqa: F401
    except ImportError as e:
        return f"onnxruntime.training does not import ({e}); pip install '.[cpu]' for the ort modes"
    return None


def _check(models: Sequence[str], Bs: Sequence[int], modes: Sequence[str], batch: int, steps: int, rounds: int,
           warmup: int, precisions: Sequence[str] = ("fp32",)) -> None:
    from onnxfuse.exporters.zoo import ZOO

    for name in models:
        if name not in ZOO and not is_onnx_file(name):
            raise ConfigError(f"models: unknown zoo model '{name}'; choose from: {', '.join(ZOO)}, or give the path "
                              "of an .onnx file")
    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"modes: unknown mode '{mode}'; choose from: {', '.join(MODES)}")
    if not precisions:
        raise ConfigError(f"precisions: give one or more of {', '.join(PRECISIONS)}, comma-separated (e.g. fp32,bf16)")
    for precision in precisions:
        check_precision(precision, where="precisions:")
    if not Bs or any(isinstance(B, bool) or not isinstance(B, (int, np.integer)) or B < 1 for B in Bs):
        raise ConfigError(f"B: array sizes must be integers >= 1, e.g. [1, 8, 16]; got {list(Bs)}")
    for name, v, least in (("batch", batch, 1), ("steps", steps, 1), ("rounds", rounds, 1),
                           ("warmup", warmup, 0)):
        if v < least:
            raise ConfigError(f"{name}: must be at least {least}, got {v}")


def command(models: Sequence[str], B: Sequence[int], device: str, modes: Sequence[str], batch: int, steps: int,
            rounds: int, warmup: int, out: str, budget_s: float = 0, threads: int = 0,
            strategy: str = "default", precisions: Sequence[str] = ("fp32",), isa: str = "native") -> str:
    """The `onnxfuse bench` command line that reproduces a run."""
    words = ["onnxfuse", "bench", "--models", ",".join(models), "--B", ",".join(map(str, B)), "--device", device,
             "--modes", ",".join(modes), "--batch", str(batch), "--steps", str(steps), "--rounds", str(rounds),
             "--warmup", str(warmup)]
    words += ["--budget-s", f"{budget_s:g}"] if budget_s else []
    words += ["--threads", str(threads)] if threads else []
    words += ["--strategy", strategy] if strategy != "default" else []
    words += ["--precision", ",".join(precisions)] if list(precisions) != ["fp32"] else []
    words += ["--isa", isa] if isa != "native" else []
    return shell(*words, "-o", out)


# ------------------------------------------------------------------------------------------------------ driver
def run_bench(models: Sequence[str] = ("lenet", "resnet18", "transformer_lm"), B: Sequence[int] = (1, 8, 16),
              device: Device | str = "cpu", modes: Sequence[str] = MODES, batch: int = 32, steps: int = 10,
              rounds: int = 3,
              warmup: int = 3, out: str | os.PathLike = "onnxfuse-bench", budget_s: float = 0, threads: int = 0,
              strategy: str = "default", progress: bool = True, precisions: Sequence[str] = ("fp32",),
              isa: str = "native") -> list[dict]:
    """Measure every mode for every model, B and precision (docs/benchmarks.md); write bench.json, bench.csv,
    bench.md and bench.png to ``out``; return one dict per (model, B, precision) with each mode's samples/s and
    ratios (to the modes in the same precision) under ``row["modes"][mode]``; ``precisions``: of
    :data:`~onnxfuse.recipe.runtimes.PRECISIONS`. ``budget_s`` > 0: no new measurement starts after that many
    seconds. ``strategy``: the fusion strategy of the fused modes (``onnxfuse fuse --strategy``; ``auto`` measures
    each node's forms on the mode's own runtime first, outside the timed rounds). ``isa``: the instruction set
    torch, oneDNN and MKL are held to (``onnxfuse.runtime._machine.ISA_ENV``: native, avx512, avx2, default); they
    read it when they load, so a run under another one than this process's is measured in a process of its own
    (the same command with those variables), whose rows are returned."""
    import torch

    models, Bs = list(models), list(B)
    modes, precisions = list(dict.fromkeys(modes)), list(dict.fromkeys(precisions))
    _check(models, Bs, modes, batch, steps, rounds, warmup, precisions)
    where = Device.of(device, "device: ")
    out = os.fspath(out)
    if not isa_in_effect(isa):
        return _in_own_process(command(models, Bs, str(where), modes, batch, steps, rounds, warmup, out, budget_s,
                                       threads, strategy, precisions, isa), isa, out, progress)
    with claim_output(out, "bench", replace=False):  # its folder: no other command writes there meanwhile
        cmd = command(models, Bs, str(where), modes, batch, steps, rounds, warmup, out, budget_s, threads, strategy,
                      precisions, isa)
        say = print if progress else (lambda *a, **k: None)
        dev = _set_up_process(where, threads)
        notes = []
        modes = _modes_that_run(modes, precisions, dev, notes)
        measured = modes if BASELINE in modes else [BASELINE] + modes  # every ratio is to PyTorch one after another
        files = {name: load_onnx_file(name, batch) for name in models if is_onnx_file(name)}  # all checked before measuring
        runs = modes_of_models(models, measured, files, notes)
        env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
               "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "cpu_count": os.cpu_count(),
               "cpu": cpu_description(), "isa": isa}  # every figure says which CPU (model, instruction set, cores)
        say(f"onnxfuse bench on {device} ({machine(env, dev.type)}), torch {env['torch']} ({env['threads']} threads), batch "
            f"{batch} per model, AdamW, {steps} steps x {rounds} rounds after {warmup} warm-up; modes "
            f"{','.join(measured)}; precision {','.join(precisions)}")
        for note in notes:
            say(note)
        rows = _measure_all(models, Bs, files, runs, dev, batch, steps, warmup, rounds, threads, strategy, precisions,
                            budget_s, notes, say)
        ran = sorted({r["threads"] for r in rows})
        if ran:  # the threads the rounds ran with (set up above: 1 on a CPU unless --threads)
            env["threads"] = ran[0] if len(ran) == 1 else ran
        text = table(rows, measured)
        scaling = scaling_table(rows) if len({r["B"] for r in rows}) > 1 else None
        _write_outputs(out, cmd, env, measured, precisions, notes, rows, dev, text, scaling)
        say(text)
        if scaling is not None:
            say("\nHow the fused array scales with B:\n" + scaling)
        say(f"wrote bench.json, bench.csv, bench.md, bench.png to {out}/")
        return rows


def _in_own_process(cmd: str, isa: str, out: str, progress: bool) -> list[dict]:
    """``cmd`` (an ``onnxfuse bench`` command line) run by this Python with the variables of ``isa``; its rows."""
    import shlex
    import subprocess
    import sys

    argv = [sys.executable, "-m", "onnxfuse", *shlex.split(cmd)[1:]] + ([] if progress else ["-q"])
    shown = None if progress else subprocess.DEVNULL  # its progress and log lines pass through
    done = subprocess.run(argv, env={**os.environ, **isa_env(isa)}, stdout=shown,
                          stderr=None if progress else subprocess.PIPE, text=True)
    if done.returncode:
        import signal

        how = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
               else f"exit {done.returncode}")
        said = (done.stderr or "").strip().splitlines()  # (shown above when progress is)
        raise ConfigError(f"the bench under isa {isa} failed ({how}){': ' + said[-1] if said else ''}")
    with open(os.path.join(out, "bench.json")) as f:
        return json.load(f)["rows"]


def _set_up_process(where: Device, threads: int):
    """The torch device to measure on, this process set up as ``onnxfuse train``'s is, for every mode
    (``runtime/process.tune_process``: ``threads`` torch threads, 1 on a CPU when not given; denormals flushed;
    the kept heap on a CPU), and cuDNN's autotuner on CUDA."""
    import torch

    from onnxfuse.runtime.process import tune_process
    from onnxfuse.runtime.torch.train_step import use_cache

    why = where.available()
    if why is not None:
        raise ConfigError(why)
    dev = where.torch()
    tune_process(threads or None, dev.type)
    use_cache()  # every compiled mode's code in onnxfuse's cache, one folder per instruction set
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
    return dev


def _modes_that_run(modes: list[str], precisions: list[str], dev, notes: list[str]) -> list[str]:
    """``modes`` but the ort runtime's where it cannot run here; a note for each left out, in full or at a
    precision."""
    why = _ort_unavailable(dev) if set(modes) & set(ORT_MODES) else None
    if why:
        notes.append(f"left out {', '.join(m for m in modes if m in ORT_MODES)}: {why}")
        modes = [m for m in modes if m not in ORT_MODES]
    fp32_only = [m for m in modes if any(not runs_in(m, p) for p in precisions)]
    if fp32_only:
        reduced = [p for p in precisions if not runs_in(fp32_only[0], p)]
        notes.append(f"{', '.join(fp32_only)} left out at {', '.join(reduced)}: the ort runtime trains in "
                     f"{', '.join(RUNTIMES['ort'].precisions)} only")
    return modes


def _measure_all(models: list[str], Bs: list[int], files: dict[str, OnnxFile], runs: dict[str, list[str]], dev,
                 batch: int, steps: int, warmup: int, rounds: int, threads: int, strategy: str,
                 precisions: list[str], budget_s: float, notes: list[str], say) -> list[dict]:
    """Each model at each B, in order, until the budget is spent; a measurement out of memory is a note."""
    import torch

    rows: list[dict] = []
    clock = Stopwatch()
    with tempfile.TemporaryDirectory(prefix="onnxfuse-bench-") as folder:
        for name in models:
            for b in Bs:
                if budget_s and clock.seconds > budget_s:
                    say(f"skipped {name} B={b}: over the {budget_s:g} s budget")
                    notes.append(f"skipped {name} B={b}: over the {budget_s:g} s budget")
                    continue
                try:
                    work = (file_workload(files[name], b, dev) if name in files
                            else zoo_workload(name, b, batch, dev, folder))
                    measured_rows = _measure(work, steps, warmup, rounds, dev, runs[name], folder, threads,
                                             strategy, precisions)
                except torch.OutOfMemoryError as e:
                    say(f"{name} B={b}: out of memory ({str(e).splitlines()[0][:120]})")
                    notes.append(f"{name} B={b}: out of memory")
                    continue
                finally:
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats(dev)
                rows.extend(measured_rows)
                for r in measured_rows:
                    cells = "  ".join(f"{m} {c['samples_s']:,.0f}/s ({c['over_seq_torch']:.2f}x)"
                                      + (f" [first {c['first_call_s']:.1f} s]" if m.endswith(COMPILED) else "")
                                      for m, c in r["modes"].items())
                    say(f"{name:>14} B={b:<3} {r['precision']}  {cells}  peak {r['peak_mib']:,.0f} MiB  "
                        f"won: {r['winner']}", flush=True)
    return rows


def _write_outputs(out: str, cmd: str, env: dict, measured: list[str], precisions: list[str], notes: list[str],
                   rows: list[dict], dev, text: str, scaling: str | None) -> None:
    """bench.json, bench.csv, bench.md and bench.png: the four files or none (a full disk leaves no bench.json
    alone); ``text``: every mode's table, ``scaling``: the B-scaling table (None: one B measured)."""
    with atomic_files(out) as stage:
        with stage("bench.json") as path, open(path, "w") as f:
            json.dump({"command": cmd, "env": env, "modes": measured, "precisions": precisions, "notes": notes,
                       "rows": rows}, f, indent=1)
        with stage("bench.csv") as path:
            write_csv(path, rows, measured)
        with stage("bench.md") as path, open(path, "w") as f:
            f.write(f"`{cmd}`\n\n{machine(env, dev.type)}, torch {env['torch']} ({env['threads']} threads); "
                    "samples/s over all B models (median round); ratios are medians of per-round "
                    "ratios, each within one precision.\n\n"
                    + "".join(f"- {n}\n" for n in notes) + ("\n" if notes else "") + wide_table(rows, measured)
                    + "\n\nWhich mode won, per model, B and precision:\n\n" + verdicts(rows)
                    + "\n\nEvery mode, with the ratio to the dense ceiling, its first step alone (the compile "
                    "time of a compiled mode; not in samples/s) and peak memory (CUDA's allocator; on a CPU the memory "
                    "one step took above what the process held before it, measured untimed after the rounds, the "
                    "concurrent processes' whole):\n\n" + text + "\n"
                    + ("" if scaling is None else f"\nHow the fused array scales with B:\n\n{scaling}\n"))
        with stage("bench.png") as path:
            write_png(path, rows, measured, env)
