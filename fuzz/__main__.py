"""A fuzz campaign: ``python -m fuzz --n 500 --seed 0 [--out fuzz-out] [--runtime ort|torch|loop|all]
[--precision fp32|bf16|fp16]`` (``make fuzz N=500 SEED=0 RUNTIME=all PRECISION=fp32``).

Generates N random models (seeds SEED .. SEED+N-1), checks each at B = 1, 2, 3 against torch on each runtime
asked for (default all: onnxruntime-training, PyTorch, and a user's own torch loop on the array as a module train
the fused array in turn; ``both``: the first two), shrinks every
failure to a minimal model, and prints a summary: tried, passed, sensitive to rounding, refused with a clear error,
ONNX Runtime alone differs from torch the same way (runtime), invalid (torch could not run the generated model),
failed by cause, each cause with its minimal model's source.
``--out`` gets ``report.json`` and one ``<cause>.py`` per failure cause. Exit status 1 when anything failed.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import Counter, defaultdict

from .grammar import generate, render
from .campaign import Worker
from .harness import REDUCED_RUNTIMES, RUNTIMES, check_precision_runtime
from .shrink import shrink


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100, help="models to generate")
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--out", default="fuzz-out", help="folder for report.json and the minimal failing models")
    ap.add_argument("--no-shrink", action="store_true", help="report failures as generated")
    ap.add_argument("--runtime", choices=RUNTIMES + ("both", "all"), default="all",
                    help="what trains the fused array: ort, torch, loop (FusedArray and onnxfuse.optim in a torch "
                         "loop), both (ort and torch) or all (each model checked on each)")
    from onnxfuse.core.passes import FORMS

    ap.add_argument("--strategy", choices=("default",) + FORMS, default="default",
                    help="the fused form of nodes that offer several (every form must be exact)")
    ap.add_argument("--compile", choices=("off", "on"), default="off",
                    help="on: the torch runtime captures its whole step with torch.compile (onnxfuse train "
                         "--compile on); seconds of compiling per array")
    from onnxfuse.recipe.runtimes import PRECISIONS

    ap.add_argument("--precision", choices=PRECISIONS, default="fp32",
                    help="bf16 / fp16: train under torch.autocast and compare each model with torch.autocast alone "
                         "(on the runtimes that train in it; 'all' means those)")
    args = ap.parse_args(argv)
    runtimes = {"all": RUNTIMES, "both": RUNTIMES[:2]}.get(args.runtime, (args.runtime,))
    if args.precision != "fp32":
        if args.runtime in ("all", "both"):
            runtimes = tuple(rt for rt in runtimes if rt in REDUCED_RUNTIMES[args.precision])
        try:
            for rt in runtimes:
                check_precision_runtime(args.precision, rt)
        except ValueError as e:
            ap.error(str(e))

    from tqdm import tqdm

    try:  # the torch runtime needs no onnxruntime (the torch extra alone)
        import onnxruntime

        onnxruntime.set_default_logger_severity(4)
    except ImportError:
        pass
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    os.makedirs(args.out, exist_ok=True)
    counts: dict[str, Counter] = {rt: Counter() for rt in runtimes}
    causes: dict[tuple[str, str], list] = defaultdict(list)  # (runtime, cause) -> [(seed, spec, outcome)]
    fractions: list[float] = []
    kinds_seen: Counter = Counter()
    t0 = time.time()
    bar = tqdm(range(args.seed, args.seed + args.n), desc="fuzz", unit="model", file=sys.stderr)
    worker = Worker()
    for seed in bar:
        spec = generate(seed)
        kinds_seen.update(render(spec).kinds)
        for rt in runtimes:
            out = worker.check(spec, runtime=rt, strategy=args.strategy, compile=args.compile,
                               precision=args.precision)
            counts[rt][out.status] += 1
            if out.status in ("pass", "sensitive", "runtime") and rt == runtimes[0]:
                fractions.append(out.fused_fraction)
            if out.status in ("fail", "refused", "invalid"):
                causes[rt, out.cause].append((seed, spec, out))
        bar.set_postfix(passed=sum(c["pass"] for c in counts.values()),
                        failed=sum(c["fail"] for c in counts.values()),
                        refused=sum(c["refused"] for c in counts.values()))
    bar.close()

    report = {"seeds": [args.seed, args.seed + args.n - 1], "runtimes": list(runtimes), "strategy": args.strategy,
              "compile": args.compile, "precision": args.precision,
              "counts": {rt: dict(c) for rt, c in counts.items()}, "seconds": round(time.time() - t0),
              "layer_kinds": dict(kinds_seen), "causes": []}
    print()
    for rt, c in counts.items():
        same_as_ort = f"ONNX Runtime alone differs from torch the same way {c['runtime']}, " if rt == "ort" else ""
        print(f"{rt}: tried {args.n}: passed {c['pass']}, sensitive to rounding {c['sensitive']}, {same_as_ort}"
              f"refused {c['refused']}, invalid {c['invalid']}, failed {c['fail']}")
    print(f"({report['seconds']} s)")
    if fractions:
        full = sum(f == 1.0 for f in fractions)
        print(f"fused completely: {full} of {len(fractions)} models that passed; lowest fused fraction "
              f"{min(fractions):.0%}")
    for k, ((rt, cause), items) in enumerate(sorted(causes.items(), key=lambda kv: -len(kv[1]))):
        seed, spec, out = items[0]
        if out.status == "fail" and not args.no_shrink:
            spec, out = shrink(spec, out, lambda s, Bs, rt=rt: worker.check(
                s, Bs, runtime=rt, strategy=args.strategy, compile=args.compile, precision=args.precision))
        src = render(spec).source
        name = os.path.join(args.out, f"cause_{k}.py")
        with open(name, "w") as f:
            f.write(f"# {out.status} on runtime {rt} at B={out.B}, {out.stage}: {out.message}\n# seeds: "
                    f"{[s for s, _, _ in items]}\n{src}")
        report["causes"].append({"runtime": rt, "status": out.status, "cause": cause,
                                 "seeds": [s for s, _, _ in items],
                                 "minimal": {"B": out.B, "stage": out.stage, "message": out.message, "source": name}})
        print(f"\n[{out.status}, {rt}] {len(items)} model(s), seeds {[s for s, _, _ in items][:8]}: {cause}\n"
              f"  minimal (B={out.B}): {out.message}\n" + "\n".join("    " + ln for ln in src.splitlines()[6:]))
    worker.close()
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 1 if any(c["fail"] for c in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
