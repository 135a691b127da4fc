"""Planning a sweep, as passes over its trials: export -> group -> size -> arrays.

* export: every trial's model is built (``torch.manual_seed(seed)``, then the factory with ``model.args`` and the
  trial's ``model.*`` values) and exported once to ``models/<trial>.onnx``; trials with the same factory arguments
  and seed share one export (the file is copied).
* group: trials whose graphs the identity check (``onnxfuse.core.identity.check_identical``, the check fusion makes)
  finds identical up to weights, and whose array-wide settings are equal, form a group. The spec's labels are not
  trusted: two ``model.width`` values that give one graph share a group, and a factory that builds different
  graphs for one value splits it.
* size: each group is cut into the fewest arrays of at most B models, of nearly equal sizes (7 trials at B = 4:
  4 + 3). B is ``arrays.size``, or with ``auto`` what array sizing (``onnxfuse/measure/sizing.py``) recommends for the
  group's model, capped by ``arrays.max_size``; the driver runs it on a worker.
* arrays: each array's run settings, its per-model settings one value per trial, checked by
  ``normalize_config`` before anything trains, as the ``TrainConfig`` its worker trains (plan.json holds its
  record).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Callable

from onnxfuse.core._io import atomic_file
from onnxfuse.core.errors import ConfigError, NotFusibleError
from onnxfuse.recipe.train_config import TrainConfig
from onnxfuse.sweep.folder import SweepDir
from onnxfuse.sweep.spec import SweepSpec

__all__ = ["plan_sweep", "array_sizes", "array_settings", "Sizer", "PlanStopped"]

log = logging.getLogger("onnxfuse.sweep")

# [(a group's first model file, its array settings for B = 1)] -> [(B, how it was chosen)], one per group
Sizer = Callable[[list[tuple[str, dict]]], list[tuple[int, str]]]


class PlanStopped(Exception):
    """Planning was asked to stop (``stop``)."""


def array_sizes(n: int, B: int) -> list[int]:
    """n trials in the fewest arrays of at most B models, of sizes differing by at most one (largest first)."""
    k = -(-n // B)
    base, extra = divmod(n, k)
    return [base + 1] * extra + [base] * (k - extra)


def _factory(spec: SweepSpec):
    from onnxfuse.exporters import load_factory
    from onnxfuse.recipe.config import resolve_factory

    return load_factory(resolve_factory(spec.model.factory, spec.base_dir))


def export_trials(spec: SweepSpec, trials: list[dict], sweep: SweepDir, progress: bool,
                  stop: Callable[[], bool] | None = None) -> None:
    """``models/<trial>.onnx`` for every trial that has none yet (a resumed plan keeps what was exported); ``stop()``
    true ends it before the next trial (raising ``PlanStopped``)."""
    from tqdm import tqdm

    from onnxfuse.exporters.factory import factory_args
    from onnxfuse.exporters.torch_export import build_module, export_module

    factory = None
    done: dict[str, str] = {}  # (factory args, seed) -> a file exported for them
    os.makedirs(sweep.models_path, exist_ok=True)
    for t in tqdm(trials, desc="exporting trials", unit="trial", disable=not progress, leave=False):
        if stop is not None and stop():
            raise PlanStopped(f"stopped before exporting trial {t['id']}")
        path = sweep.model_path(t["id"])
        where = f"{spec.source}: trial {t['id']}: "
        args = {**spec.model.args, **factory_args(t["args"], "search.space model.*", where)}
        key = json.dumps([args, t["seed"]], sort_keys=True, default=str)
        if os.path.exists(path):
            done.setdefault(key, path)
            continue
        with atomic_file(path) as tmp:
            if key in done:
                shutil.copyfile(done[key], tmp)
            else:
                factory = factory or _factory(spec)
                module = build_module(factory, t["seed"], args, where)
                export_module(module, tmp, input_shape=spec.model.input_shape, input_dtype=spec.model.input_dtype)
        done[key] = path


def group_trials(trials: list[dict], sweep: SweepDir) -> list[list[dict]]:
    """Trials in groups: one graph up to weights (the identity check) and the same array-wide settings. Each new
    trial is compared with the first trial of every group with its settings; the first match takes it."""
    from onnxfuse.core.identity import check_identical
    from onnxfuse.core.source import load_source

    groups: list[tuple[str, object, list[dict]]] = []  # (settings key, first trial's source, trials)
    for t in trials:
        key = json.dumps(t["array_values"], sort_keys=True, default=str)
        src = load_source(sweep.model_path(t["id"]), t["id"])
        for gkey, first, members in groups:
            if gkey != key:
                continue
            try:
                check_identical([first, src])
            except NotFusibleError:
                continue
            members.append(t)
            break
        else:
            groups.append((key, src, [t]))
    return [members for _, _, members in groups]


def array_settings(spec: SweepSpec, trials: list[dict], runtime: str | None
                   ) -> tuple[TrainConfig, str, str | None]:
    """(settings, training data, eval data) of one array of ``trials``: the spec's run part with the array's
    values (each trial's own per-model value; ``runtime``, the command's ``--runtime``; the CPUs Ray gives the
    array as its threads when the spec sets none), validated once and made the ``TrainConfig`` the array's worker
    trains (plan.json holds its record, ``as_dict()``)."""
    from onnxfuse.recipe.config import expand_per_model
    from onnxfuse.recipe.settings import get_dotted

    values = dict(trials[0]["array_values"])
    for key in trials[0]["per_model"]:
        values[key] = [t["per_model"][key] for t in trials]
    if runtime:
        values["runtime"] = runtime
    if not values.get("threads", get_dotted(spec.run, "threads")):  # the CPUs Ray gives the array
        values["threads"] = max(1, int(spec.cpus))
    ids = ", ".join(t["id"] for t in trials)
    cfg = expand_per_model(spec.normalized(values, f" (trials {ids})"), len(trials))
    return TrainConfig.from_config(cfg), cfg["data"]["train"], cfg["data"]["eval"]


def plan_sweep(spec: SweepSpec, params: list[dict], sweep: SweepDir, size_of: Sizer | None, runtime: str | None,
               progress: bool = True, stop: Callable[[], bool] | None = None, ids: list[str] | None = None) -> dict:
    """The plan of a sweep of the trials ``params`` ({space key: value} each): exported, grouped and cut into
    arrays (see the module docstring). Every array's settings are checked before this returns. ``stop``: see
    ``export_trials`` (the driver makes the plan while Ray starts, and stops it when that fails). ``ids``: the
    trials' ids (default t000, t001, ...; an Optuna study numbers its trials across its rounds)."""
    width = max(3, len(str(len(params) - 1)))
    trials = []
    for i, p in enumerate(params):
        tid = ids[i] if ids else f"t{i:0{width}d}"
        spec.check_params(p, f"{spec.source}: trial {tid}: ")
        kinds = {k: spec.kind(k) for k in p}
        trials.append({"id": tid, "params": p,
                       "args": {k[6:]: v for k, v in p.items() if kinds[k] == "model"},
                       "seed": p.get("seed", spec.model.seed),
                       "per_model": {k: v for k, v in p.items() if kinds[k] == "per-model"},
                       "array_values": {k: v for k, v in p.items() if kinds[k] == "array"}})
    export_trials(spec, trials, sweep, progress, stop)
    groups = group_trials(trials, sweep)
    if spec.sections.arrays.size == "auto":
        if size_of is None:
            raise ConfigError(f"{spec.source}: arrays.size auto needs the planner: give arrays.size a number")
        chosen = size_of([(sweep.model_path(m[0]["id"]), array_settings(spec, m[:1], runtime)[0]) for m in groups])
        chosen = [(max(1, min(B, spec.sections.arrays.max_size)), why) for B, why in chosen]
    else:
        chosen = [(spec.sections.arrays.size, "arrays.size")] * len(groups)
    arrays, group_records = [], []
    for g, (members, (B, why)) in enumerate(zip(groups, chosen)):
        sizes = array_sizes(len(members), B)
        group_records.append({"group": g, "trials": [t["id"] for t in members], "B": B, "B_from": why,
                              "array_values": members[0]["array_values"]})
        start = 0
        for n in sizes:
            part = members[start:start + n]
            start += n
            settings, data, eval_data = array_settings(spec, part, runtime)
            arrays.append({"id": "", "group": g, "trials": [t["id"] for t in part], "settings": settings,
                           "data": data, "eval_data": eval_data,
                           "per_model_inputs": list(spec.model.per_model_inputs)})
    awidth = max(2, len(str(len(arrays) - 1)))
    for k, a in enumerate(arrays):
        a["id"] = f"a{k:0{awidth}d}"
    halving = None
    if spec.halving:
        steps = {a["settings"].steps for a in arrays}
        if max(steps) <= spec.halving[-1]:
            raise ConfigError(f"{spec.source}: halving step {spec.halving[-1]} is not before the last of "
                              f"{max(steps)} steps; halving steps must be < steps")
        halving = {"steps": spec.halving, "keep": spec.halving_keep}
    return {"trials": trials, "groups": group_records, "arrays": arrays, "metric": spec.metric,
            "direction": spec.direction, "halving": halving}
