"""Optuna: ask a study for trials, train them together as fused arrays on Ray, tell the study the results.

    import optuna
    from onnxfuse.integrations.optuna import optimize

    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0))
    optimize(study, "sweep.yaml", n_trials=32, out_dir="study", batch=8)

Each round asks the study for ``batch`` trials (default: ``arrays.size`` of the spec, else 8), runs them as one
sweep (``out_dir/round_000``, ...: grouped by graph identity, fused, trained on Ray, every file of a sweep), and
tells the study each trial's metric (the spec's ``metric``; the study's direction must agree with it): the value
its row of results.csv is ranked by, its best state's when the sweep keeps them (``results.trial_score``). A trial
that diverged or whose array failed is told as FAIL; its sweep row says why. The parameters come from
``suggest(trial) -> {space key: value}``, or, without it, from the spec's ``search.space``: a list is
``suggest_categorical``, a range ``suggest_float`` / ``suggest_int`` (``log`` as given). Optuna's parameter names
are the space keys (``optimizer.lr``, ``model.hidden``, ``seed``).

A sampler that learns from results (TPE) sees a round's results before it suggests the next round: a larger
``batch`` fuses more models per array, a smaller one gives the sampler more rounds.
"""
from __future__ import annotations

import math
import os
from typing import Callable

from onnxfuse.core.errors import ConfigError
from onnxfuse.sweep.driver import SweepResult, _connect, run_sweep
from onnxfuse.sweep.results import trial_score
from onnxfuse.sweep.spec import Range, SweepSpec, load_spec

__all__ = ["optimize", "suggest_from_space"]


def suggest_from_space(spec: SweepSpec) -> Callable:
    """``suggest(trial)`` asking Optuna for every key of the spec's ``search.space``."""
    if spec.sections.search is None:
        raise ConfigError(f"{spec.source}: give optimize() a suggest function, or the spec a search.space")
    space = spec.sections.search.space

    def suggest(trial) -> dict:
        out = {}
        for key, v in space.items():
            if isinstance(v, Range):
                out[key] = (trial.suggest_int(key, int(v.low), int(v.high), log=v.log) if v.integer
                            else trial.suggest_float(key, v.low, v.high, log=v.log))
            else:
                out[key] = trial.suggest_categorical(key, v)
        return out

    return suggest


def optimize(study, spec: str | os.PathLike | SweepSpec, n_trials: int, out_dir: str | os.PathLike,
             suggest: Callable | None = None, batch: int | None = None, address: str | None = None,
             runtime: str | None = None, num_cpus: int | None = None, progress: bool = True) -> list[SweepResult]:
    """Run ``n_trials`` trials of ``study`` as fused arrays (see the module docstring); returns each round's
    sweep result."""
    import optuna

    spec = spec if isinstance(spec, SweepSpec) else load_spec(spec)
    want = optuna.study.StudyDirection.MINIMIZE if spec.direction == "minimize" else \
        optuna.study.StudyDirection.MAXIMIZE
    if study.direction != want:
        raise ConfigError(f"the study's direction is {study.direction.name.lower()} but the spec's metric "
                          f"{spec.metric} is to {spec.direction}; create the study with direction='{spec.direction}'")
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"n_trials must be a positive integer, got {n_trials!r}")
    size = spec.sections.arrays.size
    batch = batch or (size if isinstance(size, int) else 8)
    suggest = suggest or suggest_from_space(spec)
    started = _connect(address, num_cpus)  # one Ray for every round
    results, done, rnd = [], 0, 0
    try:
        while done < n_trials:
            asked = [study.ask() for _ in range(min(batch, n_trials - done))]
            params = [suggest(t) for t in asked]
            res = run_sweep(spec, os.path.join(os.fspath(out_dir), f"round_{rnd:03d}"), trials=params,
                            runtime=runtime, progress=progress)
            rows = {r["trial"]: r for r in res.rows}
            for trial, tid in zip(asked, res.trial_ids):
                row = rows[tid]
                value = trial_score(row, spec.metric)  # what results.csv ranks the trial by
                for k in ("trial", "array", "status", "checkpoint"):
                    trial.set_user_attr(f"onnxfuse.{k}", row[k])
                trial.set_user_attr("onnxfuse.sweep", res.path)
                if row["status"] in ("finished", "stopped") and math.isfinite(value):
                    study.tell(trial, value)
                else:
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
            results.append(res)
            done += len(asked)
            rnd += 1
    finally:
        if started:
            import ray

            ray.shutdown()
    return results
