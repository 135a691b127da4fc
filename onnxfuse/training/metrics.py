"""metrics.csv of a run (``Metrics``; the columns are ``METRICS_HEADER``, declared with the row in
``onnxfuse/core/records.py``) and the evaluation rows written to it."""
from __future__ import annotations

import csv
import os

from onnxfuse.core._io import atomic_file
from onnxfuse.core.array import ArrayDir
from onnxfuse.core.errors import as_user_error
from onnxfuse.core.records import METRICS_HEADER
from onnxfuse.recipe.data import Dataset
from onnxfuse.runtime.protocol import evaluate as evaluate_batches
from onnxfuse.training.run_state import RunState, model_view

__all__ = ["METRICS_HEADER", "Metrics", "evaluate", "fmt"]


class Metrics:
    """metrics.csv of one run: every row carries the run's id; ``rows`` counts the run's rows in the file (a
    checkpoint records it). A resumed run keeps the rows its checkpoint counted (``keep``; a checkpoint from before
    they were counted: the rows up to its step, ``resumed_at``) and writes the rest again, so that no row is
    written twice; a fresh run (``resumed_at`` None) starts the file."""

    def __init__(self, array: ArrayDir, run_id: str, resumed_at: int | None, keep: int | None = None):
        self.path, self.run_id = array.metrics_path, run_id
        rows = []
        if resumed_at is not None and os.path.exists(self.path):
            _, read = array.metrics_rows("start a new run without --resume")
            own = [(raw, row) for _, raw, row in read if row.run == run_id]
            rows = [raw for raw, _ in own[:keep]] if keep is not None else \
                [raw for raw, row in own if row.step <= resumed_at]
        self.rows = len(rows)
        # the kept rows go to a temporary file renamed into place: a kill while they are written leaves the old
        # file whole (and the temporary file, which the next command removes)
        with atomic_file(self.path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, METRICS_HEADER, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        try:
            self.f = open(self.path, "a", newline="", encoding="utf-8")
        except OSError as e:
            raise (as_user_error(e, self.path) or e) from e
        self.w = csv.DictWriter(self.f, METRICS_HEADER)

    def write(self, rows: list[dict]) -> None:
        try:
            self.w.writerows([{**r, "run": self.run_id} for r in rows])
            self.f.flush()
            self.rows += len(rows)
        except OSError as e:
            raise (as_user_error(e, self.path) or e) from e

    def close(self) -> None:
        try:
            self.f.close()
        except OSError:  # reported by the write that failed
            pass


def fmt(v) -> str:
    return "" if v is None else f"{v:.7g}"


def evaluate(run: RunState, data, metrics: Metrics, elapsed: float) -> dict:
    """Evaluate the models still in the array on ``data`` (a Dataset in batches of ``eval_batch_size``, or a
    DataLoader's ``LoaderBatches``: one pass over the loader, in its own batches) and write the rows."""
    if data is None:
        return {}
    if isinstance(data, Dataset):
        ev = run.trainer.evaluate(model_view(data, run), run.settings.eval_batch_size)
    else:
        ev = evaluate_batches(run.trainer, data.each(run.models))
    lrs = run.schedules.values(run.active).lr
    metrics.write([{"step": run.step, "model": b, "split": "eval", "loss": fmt(ev["loss"][i]),
                    "accuracy": fmt(ev["accuracy"][i]) if "accuracy" in ev else "", "lr": fmt(lrs[i]),
                    "elapsed_s": f"{elapsed:.4f}", "status": ""} for i, b in enumerate(run.models)])
    run.last_eval_step = run.step
    run.last_eval = {"loss": dict(zip(run.models, ev["loss"].tolist())),
                     **({"accuracy": dict(zip(run.models, ev["accuracy"].tolist()))} if "accuracy" in ev else {})}
    return ev
