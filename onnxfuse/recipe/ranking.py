"""Which model is best: the metrics models are ranked by, and the one ranking every command uses (``train``'s
final table, ``report`` and report.json, a sweep's results.csv and the value Optuna is told).

A model is ranked by the value of the state you get for it: its kept best state's (``--keep-best METRIC``, the
state ``split --which best`` writes) when the run kept one by the metric ranked by, else its final state's (the
state ``split`` writes); every pointer to a model's checkpoint names that state (``ranked_state``). Since the
final evaluation is one the best state was chosen among, a kept best value is never worse than the final one.
"""
from __future__ import annotations

import math
from typing import Mapping

# the metrics of an evaluation: those a best state is kept by (a train loss is one batch's, too noisy to pick by),
# declared with the records that hold a kept best state's metric
from onnxfuse.core.records import EVAL_METRICS

__all__ = ["METRICS", "EVAL_METRICS", "OFF", "KEEP_BEST_CHOICES", "kept_metric", "default_metric", "better",
           "ranked_state", "score", "rank_key", "best_of"]

# metric -> the direction that is better
METRICS = {"eval_loss": "minimize", "eval_accuracy": "maximize", "train_loss": "minimize"}
OFF = "off"
KEEP_BEST_CHOICES = EVAL_METRICS + (OFF,)


def default_metric(has_eval: bool) -> str:
    """What a run's models are ranked by when nothing else says: eval loss with eval data, else train loss."""
    return "eval_loss" if has_eval else "train_loss"


def kept_metric(keep_best: str | None, has_eval: bool) -> str | None:
    """The metric a run keeps its models' best states by (None: none kept): the ``keep_best`` setting, and when it
    is not given, ``eval_loss`` for a run with eval data."""
    if keep_best is None:
        return default_metric(True) if has_eval else None
    return None if keep_best == OFF else keep_best


def better(value: float, than: float | None, metric: str) -> bool:
    """``value`` is finite and strictly better than ``than`` (None: nothing yet) by ``metric``: a tie keeps the
    earlier state."""
    if not math.isfinite(value):
        return False
    if than is None or not math.isfinite(than):
        return True
    return value < than if METRICS[metric] == "minimize" else value > than


def ranked_state(best: float | None = None) -> str:
    """The state a model is ranked by, and whose files every pointer to its checkpoint names (``split --which``,
    a sweep's ``checkpoint`` column, Optuna's ``onnxfuse.checkpoint``): ``best`` when a best state is kept (its
    value ``best``, by the metric ranked by), else ``final``."""
    return "best" if best is not None and math.isfinite(best) else "final"


def score(final: float, best: float | None = None) -> float:
    """The value a model is ranked by: its kept best state's ``best`` when one is kept (by the metric ranked by),
    else its ``final`` state's (the state :func:`ranked_state` names)."""
    return best if ranked_state(best) == "best" else final


def rank_key(value: float, direction: str, tie) -> tuple:
    """A model's (or trial's) place in a best-first order: by ``value`` in ``direction`` (a metric's, ``METRICS``:
    minimize or maximize), one without a finite value last, ties by ``tie`` (its index or id)."""
    if not math.isfinite(value):
        return (1, 0.0, tie)
    return (0, value if direction == "minimize" else -value, tie)


def best_of(values: Mapping, metric: str):
    """The key of the best of ``values`` ({model or trial: its score}), None when none is finite."""
    if not values:
        return None
    key = min(values, key=lambda k: rank_key(values[k], METRICS[metric], k))
    return key if math.isfinite(values[key]) else None
