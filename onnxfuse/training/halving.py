"""Successive halving inside a run: at each rung keep the best ``halving_keep`` of the models by eval loss."""
from __future__ import annotations

import logging
import math

import numpy as np

from onnxfuse.recipe.batches import BatchSource
from onnxfuse.training.metrics import Metrics
from onnxfuse.training.run_state import RunState


log = logging.getLogger("onnxfuse.train")


def halve(run: RunState, ev: dict) -> list[int]:
    """Successive halving: keep the best ``halving_keep`` of the models by eval loss (diverged ones last)."""
    loss = np.where(np.isfinite(ev["loss"]) & np.array(run.active), ev["loss"], np.inf)
    k = max(1, math.ceil(len(run.models) * run.settings.halving_keep))
    order = sorted(range(len(run.models)), key=lambda i: (loss[i], i))
    keep = sorted(order[:k])
    dropped = [run.models[i] for i in range(len(run.models)) if i not in keep]
    log.info("step %d: successive halving keeps models %s, drops %s", run.step, [run.models[i] for i in keep], dropped)
    run.keep(keep, "dropped")
    return keep


def halving_rung(run: RunState, ev: dict, source: BatchSource, metrics: Metrics, elapsed: float) -> None:
    """A rung at this step: halve the array by ``ev`` (this step's evaluation), draw batches for the survivors
    only, and record the dropped models in metrics.csv."""
    before = list(run.models)
    source.keep(halve(run, ev))
    metrics.write([{"step": run.step, "model": b, "split": "train", "loss": "", "accuracy": "", "lr": "",
                    "elapsed_s": f"{elapsed:.4f}", "status": "dropped"} for b in before if b not in run.models])
