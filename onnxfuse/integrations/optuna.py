"""Optuna: ask a study for trials, train them together as fused arrays on Ray, tell the study the results.

    import optuna
    from onnxfuse.integrations.optuna import optimize

    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0))
    optimize(study, "sweep.yaml", n_trials=32, out_dir="study", batch=8)
    optimize(study, "sweep.yaml", n_trials=48, out_dir="study", resume=True)  # 16 more, or the rest after a crash

Each round asks the study for ``batch`` trials (default: ``arrays.size`` of the spec, else 8), runs them as one
sweep (grouped by graph identity, fused, trained on Ray, every file of a sweep), and tells the study each trial's
metric (the spec's ``metric``; the study's direction must agree with it): the value its row of results.csv is
ranked by, its best state's when the sweep keeps them (``results.trial_score``). A trial that diverged or whose
array failed is told as FAIL; its row says why. Each trial's user attributes name the files of the state whose
value it was told (``onnxfuse.state``: best or final; ``onnxfuse.checkpoint``: its weights, ``onnxfuse.onnx``: its
inference model, as absolute paths), so ``study.best_trial.user_attrs["onnxfuse.checkpoint"]`` is the model that
won. The parameters come from ``suggest(trial) -> {space key: value}``, or, without it, from the spec's
``search.space``: a list is ``suggest_categorical``, a range a distribution, ``suggest_float`` / ``suggest_int``
(``log`` as given; no ``search.method`` needed: the study's sampler draws the trials). Optuna's parameter names
are the space keys (``optimizer.lr``, ``seed``).

A sampler that learns from results (TPE) sees a round's results before it suggests the next round: a larger
``batch`` fuses more models per array, a smaller one gives the sampler more rounds.

The study folder ``out_dir`` (written by the driver alone, like a sweep folder):

    study.json            the spec and every trial asked: its id (t000, t001, ... numbered across the rounds), round,
                          parameters and Optuna distributions, and, once told, its state and value
    rounds/round_<k>/     each round's sweep folder (plan, arrays, status, every trial's files)
    trials/<trial>        a link to the trial's folder in its round: ``tensorboard --logdir OUT_DIR/trials`` shows
                          every trial of the study
    results.csv, report.md, report.png   every trial of the study, best first: a sweep's columns and ``round``

``resume=True`` continues the study in ``out_dir`` (the spec is the folder's; one given must be the same):
``n_trials`` counts every trial of the folder. A round that was running when the last call stopped runs only
its arrays that have no result, and no trial is asked for again: a trial the study does not know yet (an
in-memory study of a new process) is added to it as it ended (``add_trial``); one it holds as running (a study
in a database, asked by the call that stopped) is told.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Callable

from onnxfuse.core._io import claim_output
from onnxfuse.core.errors import ConfigError, InputFileError
from onnxfuse.sweep.driver import SweepResult, _connect, run_sweep
from onnxfuse.sweep.folder import SweepDir
from onnxfuse.sweep.results import best_first, collect, trial_score, write_report
from onnxfuse.sweep.spec import Range, SweepSpec, load_spec, parse_spec

__all__ = ["optimize", "suggest_from_space", "STUDY_RECORD"]

STUDY_RECORD, ROUNDS = "study.json", "rounds"
log = logging.getLogger("onnxfuse.sweep")


def suggest_from_space(spec: SweepSpec) -> Callable:
    """``suggest(trial)`` asking Optuna for every key of the spec's ``search.space``: a list is
    ``suggest_categorical``, a range a distribution (``suggest_float`` / ``suggest_int``, ``log`` as given). The
    study's sampler draws the trials: ``search.method``, ``samples`` and ``seed`` (how ``onnxfuse sweep`` draws
    them) are not used, and a spec with method random is told so."""
    search = spec.sections.search
    if search is None:
        raise ConfigError(f"{spec.source}: give optimize() a suggest function, or the spec a search.space")
    if search.method == "random":
        log.warning("%s: search.method random, samples and seed are how `onnxfuse sweep` draws trials; the Optuna "
                    "study's sampler draws them here (a range is a distribution), so they are not used",
                    spec.source)
    space = search.space

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


class _Study:
    """The study folder (see the module docstring): its record, its rounds' sweep folders, its links and report."""

    def __init__(self, path: str | os.PathLike):
        self.folder = SweepDir(path)  # its results.csv / report.md / report.png / trials/ are named as a sweep's
        self.path = self.folder.path
        self.record_path = os.path.join(self.path, STUDY_RECORD)
        self.record: dict = {}

    def round_path(self, k: int) -> str:
        return os.path.join(self.path, ROUNDS, f"round_{k:03d}")

    def load(self) -> None:
        self.record = self.folder.read_json(self.record_path, STUDY_RECORD)

    def save(self) -> None:
        self.folder.write_json(self.record_path, self.record)

    def link(self, k: int, tid: str) -> None:
        """trials/<tid> -> the trial's folder in round k (relative, so that the folder can move)."""
        link, folder = self.folder.trial_path(tid), SweepDir(self.round_path(k)).trial_path(tid)
        if os.path.lexists(link) or not os.path.isdir(folder):  # (a failed trial has no folder)
            return
        os.makedirs(os.path.dirname(link), exist_ok=True)
        with contextlib.suppress(OSError):  # a file system without links: the round's folder has the files
            os.symlink(os.path.relpath(folder, os.path.dirname(link)), link, target_is_directory=True)

    def space(self) -> dict:
        """The searched keys as the study's report.png draws them, from the distributions Optuna sampled (a
        ``suggest`` function's too, under its parameter names): a float or int distribution is a range
        ``{low, high, log}``, a categorical one its list of choices; a key no trial recorded one for, as the spec's
        ``search.space`` has it."""
        from optuna.distributions import CategoricalDistribution, json_to_distribution

        space = dict((self.record["spec"].get("search") or {}).get("space") or {})
        for t in self.record["trials"]:
            for name, text in t["distributions"].items():
                d = json_to_distribution(text)
                space[name] = list(d.choices) if isinstance(d, CategoricalDistribution) else \
                    {"low": d.low, "high": d.high, "log": d.log}
        return space

    def report(self, metric: str, direction: str) -> tuple[dict | None, list[dict]]:
        """The study as one sweep's plan (every round's trials, groups and arrays, and the searched ``space``) and
        its results' rows, best first (None, [] before a round has a plan)."""
        plans, rows = [], []
        for k in sorted({t["round"] for t in self.record["trials"]}):
            sweep = SweepDir(self.round_path(k))
            if not os.path.exists(sweep.plan_path):
                continue
            plan = sweep.read_json(sweep.plan_path, "a round's plan")
            plans.append(plan)
            rows += [{"trial": r["trial"], "round": k, **{c: v for c, v in r.items() if c != "trial"}}
                     for r in collect(sweep, plan)]
        if not plans:
            return None, []
        study_plan = {"trials": [t for p in plans for t in p["trials"]], "metric": metric, "direction": direction,
                      **{key: [x for p in plans for x in p[key]] for key in ("groups", "arrays")}, "halving": None,
                      "space": self.space()}
        return study_plan, best_first(rows, metric, direction)

    def write_report(self, metric: str, direction: str) -> None:
        """results.csv, report.md, report.png of every trial of every round, best first."""
        plan, rows = self.report(metric, direction)
        if plan is not None:
            write_report(self.folder, plan, rows)


def _check(study, spec: SweepSpec, n_trials) -> None:
    import optuna

    want = optuna.study.StudyDirection.MINIMIZE if spec.direction == "minimize" else \
        optuna.study.StudyDirection.MAXIMIZE
    if study.direction != want:
        raise ConfigError(f"the study's direction is {study.direction.name.lower()} but the spec's metric "
                          f"{spec.metric} is to {spec.direction}; create the study with direction='{spec.direction}'")
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"n_trials must be a positive integer, got {n_trials!r}")


def _open(out: _Study, spec, resume: bool) -> SweepSpec:
    """The study's spec: a new folder's (its record made, written once the folder is held), or with ``resume`` the
    folder's own (``spec``, when given, must be the same)."""
    if resume:
        if not os.path.isfile(out.record_path):
            raise InputFileError(f"resume: '{out.path}' is not an onnxfuse Optuna study folder (no {STUDY_RECORD}); "
                                 "start the study there with optimize(..., resume=False)")
        out.load()
        saved = out.record
        mine = parse_spec(saved["spec"], saved["source"], saved["base_dir"])
        if spec is not None:
            given = spec if isinstance(spec, SweepSpec) else load_spec(spec)
            if given.as_dict() != mine.as_dict():
                raise ConfigError(f"resume: the spec differs from the one the study in '{out.path}' runs "
                                  f"({STUDY_RECORD}); give spec=None to continue with the study's own")
        return mine
    if spec is None:
        raise ConfigError("give optimize() a sweep spec (or resume=True to continue a study folder)")
    spec = spec if isinstance(spec, SweepSpec) else load_spec(spec)
    if os.path.isdir(out.path) and os.listdir(out.path):
        hint = "continue it with resume=True" if os.path.isfile(out.record_path) else "choose an empty or new folder"
        raise InputFileError(f"out_dir: '{out.path}' is not empty; {hint}")
    out.record = {"spec": spec.as_dict(), "source": spec.source, "base_dir": spec.base_dir, "trials": []}
    return spec


def _value(row: dict, metric: str) -> float | None:
    """What the study is told for a trial's row: its score, or None (FAIL) for a trial without a finite one."""
    value = trial_score(row, metric)  # what results.csv ranks the trial by
    return value if row["status"] in ("finished", "stopped") and math.isfinite(value) else None


def _attrs(row: dict, sweep_path: str) -> dict:
    """The user attributes a trial is told with, from its row of the round's results: its array, status, sweep
    folder and, when it has files, the state it is ranked by (the value told: ``onnxfuse.state``, best or
    final) and that state's files, as paths from anywhere (``onnxfuse.checkpoint``: its weights, a
    ``load_state_dict`` checkpoint; ``onnxfuse.onnx``: its inference model)."""
    attrs = {"onnxfuse.array": row["array"], "onnxfuse.status": row["status"], "onnxfuse.sweep": sweep_path}
    if row["checkpoint"]:
        attrs.update({"onnxfuse.state": row.get("state") or "final",
                      "onnxfuse.checkpoint": os.path.join(sweep_path, row["checkpoint"]),
                      "onnxfuse.onnx": os.path.join(sweep_path, row["onnx"])})
    return attrs


def _known(study, path: str) -> dict:
    """The study's trials that this study folder asked for, by trial id."""
    return {t.user_attrs["onnxfuse.trial"]: t for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("onnxfuse.study") == path and "onnxfuse.trial" in t.user_attrs}


def _sync(study, t: dict, known: dict, asked=None) -> None:
    """Tell the study how trial ``t`` (a record of study.json with its ``told``) ended: through ``asked`` (the
    trial object this call asked for), through a trial it holds as running, or as a trial added."""
    import optuna
    from optuna.distributions import json_to_distribution

    told, state = t["told"], optuna.trial.TrialState
    value = told["value"]
    if asked is None and t["id"] in known:
        if known[t["id"]].state.is_finished():
            return
        # asked by the call that stopped, still running in the study's database: told (and given its attributes)
        # through a trial object of its own
        asked = optuna.trial.Trial(study, known[t["id"]]._trial_id)
    if asked is not None:
        for k, v in told["attrs"].items():
            asked.set_user_attr(k, v)
        if value is None:
            study.tell(asked, state=state.FAIL)
        else:
            study.tell(asked, value)
        return
    study.add_trial(optuna.trial.create_trial(
        params=t["optuna_params"], value=value, state=state.COMPLETE if value is not None else state.FAIL,
        distributions={k: json_to_distribution(d) for k, d in t["distributions"].items()},
        # (a study folder from before the pointers were told named the final weights when the trial was asked)
        user_attrs={**{k: v for k, v in t["attrs"].items() if k != "onnxfuse.checkpoint"}, **told["attrs"]}))


def _ask(study, out: _Study, k: int, n: int, suggest: Callable, width: int) -> tuple[list, list[dict]]:
    """``n`` trials asked for round ``k``: the Optuna trials, and their records (ids after the folder's last)."""
    from optuna.distributions import distribution_to_json

    asked, new = [], []
    for _ in range(n):
        a = study.ask()
        tid = f"t{len(out.record['trials']) + len(new):0{width}d}"
        attrs = {"onnxfuse.trial": tid, "onnxfuse.study": out.path, "onnxfuse.round": k}
        for name, v in attrs.items():
            a.set_user_attr(name, v)
        params = suggest(a)
        asked.append(a)
        new.append({"id": tid, "round": k, "number": a.number, "params": params, "optuna_params": a.params,
                    "distributions": {p: distribution_to_json(d) for p, d in a.distributions.items()},
                    "attrs": attrs, "told": None})
    return asked, new


def _run_round(study, out: _Study, spec: SweepSpec, trials: list[dict], known: dict, asked: list | None,
               runtime, progress) -> SweepResult:
    """One round's sweep (continued where a stopped call left it, when its folder has one), its trials told and
    recorded, the study's report written."""
    k = trials[0]["round"]
    path = out.round_path(k)
    if SweepDir(path).is_sweep():
        res = run_sweep(None, path, resume=True, runtime=runtime, progress=progress)
    else:
        res = run_sweep(spec, path, trials=[t["params"] for t in trials], trial_ids=[t["id"] for t in trials],
                        runtime=runtime, progress=progress)
    rows = {r["trial"]: r for r in res.rows}
    for i, t in enumerate(trials):
        out.link(k, t["id"])
        row = rows[t["id"]]
        t["told"] = {"value": _value(row, spec.metric), "attrs": _attrs(row, res.path)}
        _sync(study, t, known, asked[i] if asked else None)
    out.save()
    out.write_report(spec.metric, spec.direction)
    return res


def optimize(study, spec: str | os.PathLike | SweepSpec | None, n_trials: int, out_dir: str | os.PathLike,
             suggest: Callable | None = None, batch: int | None = None, address: str | None = None,
             runtime: str | None = None, num_cpus: int | None = None, progress: bool = True,
             resume: bool = False) -> list[SweepResult]:
    """Run ``study`` to ``n_trials`` trials in the study folder ``out_dir`` as fused arrays (see the module
    docstring); ``resume``: continue the study folder there. Returns the sweep result of each round this call
    ran (or finished)."""
    out = _Study(out_dir)
    spec = _open(out, spec, resume)
    _check(study, spec, n_trials)
    results: list[SweepResult] = []
    with claim_output(out.path, "optuna", replace=False, mark=True, what="study folder"):
        if not resume:
            out.save()
        size = spec.sections.arrays.size
        batch = batch or (size if isinstance(size, int) else 8)
        suggest = suggest or suggest_from_space(spec)
        trials = out.record["trials"]
        known = _known(study, out.path)
        for t in trials:  # what the folder holds and the study does not (a new process's in-memory study)
            if t["told"] is not None:
                _sync(study, t, known)
        pending = [t for t in trials if t["told"] is None]  # the round a stopped call was running
        started = _connect(address, num_cpus) if pending or len(trials) < n_trials else False  # one Ray, all rounds
        try:
            if pending:
                results.append(_run_round(study, out, spec, pending, known, None, runtime, progress))
            width = max(3, len(str(max(n_trials, len(trials)) - 1)))
            while len(trials) < n_trials:
                k = 1 + max((t["round"] for t in trials), default=-1)
                asked, new = _ask(study, out, k, min(batch, n_trials - len(trials)), suggest, width)
                trials += new
                out.save()  # before the round runs: a stopped call's round is continued, never asked again
                results.append(_run_round(study, out, spec, new, known, asked, runtime, progress))
        finally:
            if started:
                import ray

                ray.shutdown()
    return results
