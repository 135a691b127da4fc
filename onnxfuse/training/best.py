"""Each model's best state by one eval metric (``--keep-best``), kept beside its final one: what
``split --which best`` writes.

At every evaluation, each model whose metric is strictly better than its best so far (``ranking.better``: a tie
keeps the earlier state) has its state_dict written to ``best/model_<b>_step_<t>.safetensors``: a new file,
written whole (temporary file + rename) and never changed afterwards. Only the models that improved are written,
so B models' best states at B different steps cost one file each, not a copy of the array per step.

Which file is each model's best, its step and its value is a small record (:class:`KeptBest`) held by the run and
written into every checkpoint's state.json and into trained/train_state.json, each of which is itself written
atomically. A resumed run continues from its checkpoint's record, the best states an uninterrupted run had at that
step, so it ends with the same ones; a file that no record names (a model that improved again, an evaluation a
killed run made after its last checkpoint) is removed after each checkpoint and at the end of the run.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from onnxfuse.core.array import ArrayDir
from onnxfuse.core.errors import InputFileError
from onnxfuse.core.split import model_steps
from onnxfuse.recipe.ranking import better

__all__ = ["KeptBest", "keep_best", "prune_best"]

log = logging.getLogger("onnxfuse.train")

EVALUATED = {"eval_loss": "loss", "eval_accuracy": "accuracy"}  # a metric -> its entry in an evaluation


@dataclass
class KeptBest:
    """The best states a run keeps: by ``metric`` (None: none kept), since step ``since`` (0; later when a resumed
    run began keeping them, or keeps them by another metric), and per original model ``{"step": the step its
    state is from, "value": its metric there, "steps": the optimizer steps it had taken, "file": in best/}``."""

    metric: str | None
    since: int = 0
    models: dict[int, dict] = field(default_factory=dict)

    def record(self) -> dict | None:
        """The record a checkpoint and trained/ hold (JSON: model ids as strings), None when none is kept."""
        if self.metric is None:
            return None
        return {"metric": self.metric, "since": self.since, "models": {str(b): e for b, e in sorted(self.models.items())}}

    def files(self) -> set[str]:
        return {e["file"] for e in self.models.values()}

    @classmethod
    def resumed(cls, record: dict | None, metric: str | None, step: int, array: ArrayDir, checkpoint: str
                ) -> "KeptBest":
        """What a run resumed at ``step`` from ``checkpoint`` keeps: the checkpoint's ``record`` when it kept its
        best states by ``metric``; else it starts keeping them there (a checkpoint from before best states, or
        ``--keep-best`` changed on resume)."""
        if metric is None:
            return cls(None)
        if not record or record.get("metric") != metric:
            if record:
                log.warning("--keep-best %s: run kept its best states by %s until step %d; from there on they are "
                            "kept by %s", metric, record.get("metric"), step, metric)
            return cls(metric, since=step)
        models = {int(b): e for b, e in record["models"].items()}
        fix = "remove that checkpoint folder to resume from the one before it, or start a new run without --resume"
        for b, e in models.items():
            path = array.best_state_path(e["file"], fix)
            if not os.path.isfile(path):
                raise InputFileError(f"checkpoint '{checkpoint}' names model {b}'s best state '{path}', which is "
                                     f"missing; {fix}")
        return cls(metric, int(record.get("since", 0)), models)


class EvaluatedRun(Protocol):
    """What :func:`keep_best` reads of a run (``run_state.RunState`` is one; this module does not import it, as
    that module holds a :class:`KeptBest`)."""

    array: ArrayDir
    best: KeptBest
    models: list[int]
    status: dict[int, dict]
    step: int
    trainer: object  # its ``steps``: the optimizer steps taken

    def per_model_states(self, positions: Sequence[int] | None = None) -> list[dict[str, np.ndarray]]: ...


def keep_best(run: EvaluatedRun, ev: dict) -> None:
    """After the evaluation ``ev`` of the models in the array (``ev[...][i]``: ``run.models[i]``'s): write the
    state of each model better than its best so far, and record it."""
    kept = run.best
    values = ev.get(EVALUATED.get(kept.metric, ""))
    if values is None:
        return
    improved = [i for i, b in enumerate(run.models)
                if better(float(values[i]), (kept.models.get(b) or {}).get("value"), kept.metric)]
    if not improved:
        return
    for i, state in zip(improved, run.per_model_states(improved)):
        b = run.models[i]
        status = run.status.get(b)
        step = model_steps(status, run.step)  # a diverged model's state is from the step before it diverged
        name = ArrayDir.best_file(b, step)
        run.array.write_best_state(name, state)
        kept.models[b] = {"step": step, "value": float(values[i]), "steps": model_steps(status, run.trainer.steps),
                          "file": name}


def prune_best(array: ArrayDir, kept: KeptBest) -> None:
    """Remove the best-state files that neither ``kept`` nor a record still on disk (each checkpoint's and
    trained/'s) names."""
    keep = kept.files()
    try:
        records = [array.checkpoint_record(path, "").get("best") for path in array.checkpoints()]
        records.append(array.kept_best())
    except (OSError, InputFileError):  # an unreadable record may name any file: keep them all
        return
    for record in records:
        keep |= {e["file"] for e in ((record or {}).get("models") or {}).values()}
    array.prune_best(keep)
