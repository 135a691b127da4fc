"""One sweep, two ways, side by side: every trial its own Ray task (arrays.size 1, what a plain Ray Tune or a
job-per-trial sweep does) against trials fused into arrays (arrays.size B). Same spec otherwise, same local Ray;
the two are run in interleaved rounds and the medians reported.

    python benchmarks/sweep_bench.py --model DigitsCNN --trials-per-arch 8 --steps 100 --B 8 --cpus 2 --rounds 2

Wall time is the whole `run_sweep` call (Ray start, export, planning, training, writing the results); "arrays"
is the time from the first array submitted to the last result, as the driver's status shows it.

``--startup``: how fast a sweep starts. docs/sweep.example.yaml's sweep cut to 6 trials (model.hidden 32, 64 x
three learning rates) of 80 steps, run as a user runs it (`python -m onnxfuse sweep SPEC -o DIR -q --cpus 2`, a new
process and a new local Ray each time); reports the time from the command's start to the first training step of
any array (each array's result.json records when its first step ended) and to the command's end, medians of
``--rounds``. Several ``--repo NAME=DIR`` (checkouts of onnxfuse) are run in interleaved rounds:

    python benchmarks/sweep_bench.py --startup --rounds 5 --repo before=/tmp/old-checkout --repo after=.

``--ray-running``: the same with a Ray started once before the rounds (``ray start --head --block``, in a temporary
folder of its own, stopped at the end) that every sweep uses (``RAY_ADDRESS``, no ``--cpus``); ``NAME=DIR@ray``:
that checkout's runs alone use it, so a new local Ray and a running one are compared in the same rounds:

    python benchmarks/sweep_bench.py --startup --rounds 5 --repo before=/tmp/old --repo after=. --repo "ray=.@ray"
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def spec(model: str, per_arch: int, steps: int, size: int, cpus: int) -> dict:
    lrs = [0.03, 0.01, 0.003, 0.001, 0.0003, 0.0001, 0.02, 0.005][:max(1, per_arch // 2)]
    return {"model": {"factory": f"onnxfuse.exporters.zoo:{model}", "input_shape": [32, 1, 8, 8]},
            "search": {"space": {"model.width": [8, 16], "optimizer.lr": lrs, "seed": [0, 1]}},
            "arrays": {"size": size}, "resources": {"cpus": 1},
            "data": {"train": "sklearn:digits", "eval_fraction": 0.2}, "optimizer": {"name": "adamw"},
            "steps": steps, "batch_size": 32, "eval_every": steps}


def startup_spec(steps: int) -> dict:
    """docs/sweep.example.yaml's sweep cut to 6 trials (2 graphs x 3 learning rates: 2 arrays of 3) of ``steps``."""
    return {"model": {"factory": "onnxfuse.exporters.zoo:MLP", "input_shape": [32, 1, 8, 8],
                      "args": {"in_features": 64}},
            "search": {"space": {"model.hidden": [32, 64], "optimizer.lr": [0.01, 0.003, 0.001]}},
            "metric": "eval_loss", "arrays": {"size": 4}, "resources": {"cpus": 1},
            "data": {"train": "sklearn:digits", "eval_fraction": 0.2}, "loss": "cross-entropy",
            "optimizer": {"name": "adamw", "weight_decay": 0.01}, "steps": steps, "batch_size": 32,
            "eval_every": steps // 2}


@contextlib.contextmanager
def _running_ray(cpus: int, tmp: str):
    """A local Ray for the rounds (its address), started once; its processes go with the `ray start --block` that
    started them (this stops it: never `ray stop`, which stops every Ray on the machine)."""
    import signal
    import subprocess

    temp = os.path.join(tmp, "ray")
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    proc = subprocess.Popen([ray, "start", "--head", "--block", "--num-cpus", str(cpus), "--temp-dir", temp,
                             "--include-dashboard", "false", "--disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        found = os.path.join(temp, "ray_current_cluster")
        for _ in range(1200):
            if os.path.exists(found) and open(found).read().strip():
                break
            if proc.poll() is not None:
                raise SystemExit("ray start --head failed")
            time.sleep(0.1)
        time.sleep(2)  # its agents up
        yield open(found).read().strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def startup(args) -> int:
    """--startup: time to the first step and to the end of `onnxfuse sweep`, per checkout, interleaved rounds."""
    import subprocess

    import yaml

    repos = dict(r.split("=", 1) if "=" in r else (r, r) for r in (args.repo or ["this=."]))
    on_ray = {name: args.ray_running or d.endswith("@ray") for name, d in repos.items()}
    repos = {name: d.removesuffix("@ray") for name, d in repos.items()}
    runs: dict[str, list[dict]] = {name: [] for name in repos}
    with tempfile.TemporaryDirectory() as tmp, _running_ray(args.cpus, tmp) if any(on_ray.values()) else \
            contextlib.nullcontext() as address:
        spec = os.path.join(tmp, "spec.yaml")
        with open(spec, "w") as f:
            yaml.safe_dump(startup_spec(args.steps), f)
        for r in range(args.rounds):
            for name in (list(repos) if r % 2 == 0 else list(reversed(repos))):
                repo, out = os.path.abspath(repos[name]), os.path.join(tmp, f"{name}_{r}")
                env = {**os.environ, "PYTHONPATH": repo,
                       **({"RAY_ADDRESS": address, "RAY_AUTH_MODE": "token"} if on_ray[name] else {})}
                ray_flags = [] if on_ray[name] else ["--cpus", str(args.cpus)]
                t0 = time.time()
                proc = subprocess.run([sys.executable, "-m", "onnxfuse", "sweep", spec, "-o", out, "-q", *ray_flags],
                                      cwd=repo, env=env, capture_output=True, text=True)
                total = time.time() - t0
                if proc.returncode != 0:
                    raise SystemExit(f"{name}: onnxfuse sweep failed ({proc.returncode}): {proc.stderr[-2000:]}")
                results = [json.load(open(os.path.join(out, "arrays", a, "result.json")))
                           for a in sorted(os.listdir(os.path.join(out, "arrays")))]
                run = {"first_step_s": min(x["first_step_at"] for x in results) - t0, "total_s": total,
                       "task_start_s": min(x["started_at"] for x in results) - t0, "arrays": len(results)}
                runs[name].append(run)
                print(f"round {r} {name}: first step at {run['first_step_s']:.1f} s (first task started at "
                      f"{run['task_start_s']:.1f} s), done at {total:.1f} s, {len(results)} arrays", flush=True)
    keys = ("first_step_s", "task_start_s", "total_s")
    med = {name: {k: statistics.median(x[k] for x in v) for k in keys} for name, v in runs.items()}
    print(f"\n6 trials x {args.steps} steps, `onnxfuse sweep -q`, medians of {args.rounds}:\n"
          "| code | Ray | time to first step | first array task started | total |\n|---|---|---:|---:|---:|")
    for name, m in med.items():
        ray = f"running ({args.cpus} CPUs)" if on_ray[name] else f"new (--cpus {args.cpus})"
        print(f"| {name} | {ray} | {m['first_step_s']:.1f} s | {m['task_start_s']:.1f} s | {m['total_s']:.1f} s |")
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "repos": repos, "on_ray": on_ray, "runs": runs, "median": med}, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="DigitsCNN")
    ap.add_argument("--trials-per-arch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-o", "--output", default="sweep-bench.json")
    ap.add_argument("--startup", action="store_true", help="time to the first step instead (see the docstring)")
    ap.add_argument("--repo", action="append", metavar="NAME=DIR", help="--startup: a checkout to time (repeatable)")
    ap.add_argument("--ray-running", action="store_true", help="--startup: every sweep on one Ray started before")
    args = ap.parse_args()
    if args.startup:
        if args.steps == 100:
            args.steps = 80
        return startup(args)

    from onnxfuse.sweep import parse_spec, run_sweep

    runs: dict[int, list[dict]] = {1: [], args.B: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for size in (1, args.B) if r % 2 == 0 else (args.B, 1):
                s = parse_spec(spec(args.model, args.trials_per_arch, args.steps, size, args.cpus), "bench")
                out = os.path.join(tmp, f"r{r}_B{size}")
                t0 = time.perf_counter()
                res = run_sweep(s, out, num_cpus=args.cpus, progress=False)
                wall = time.perf_counter() - t0
                results = [json.load(open(os.path.join(out, "arrays", a, "result.json")))
                           for a in sorted(os.listdir(os.path.join(out, "arrays")))]
                train = sum(x["elapsed_s"] for x in results)
                best = min(float(x["eval_loss"]) for x in res.rows)
                runs[size].append({"wall_s": wall, "array_s_sum": train, "arrays": res.arrays,
                                   "trials": len(res.rows), "best_eval_loss": best})
                print(f"round {r} arrays.size {size}: {res.arrays} arrays, {wall:.1f} s wall, "
                      f"{train:.1f} s summed array time", flush=True)
    med = {size: {k: statistics.median(x[k] for x in v) for k in ("wall_s", "array_s_sum")}
           for size, v in runs.items()}
    print("\n| arrays.size | arrays | wall (median) | summed array time (median) |\n|---|---:|---:|---:|")
    for size, v in runs.items():
        print(f"| {size} | {v[0]['arrays']} | {med[size]['wall_s']:.1f} s | {med[size]['array_s_sum']:.1f} s |")
    print(f"\nfused (B = {args.B}) / one trial per task: wall {med[args.B]['wall_s'] / med[1]['wall_s']:.2f}x, "
          f"summed array time {med[args.B]['array_s_sum'] / med[1]['array_s_sum']:.2f}x "
          f"({runs[1][0]['trials']} trials, {args.model}, {args.steps} steps, {args.cpus} CPUs)")
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "runs": {str(k): v for k, v in runs.items()}, "median": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
