"""metrics.csv of a run (``Metrics``; the columns are ``METRICS_HEADER``) and the evaluation rows written to it."""
from __future__ import annotations

import csv
import os

from onnxfuse.core._io import atomic_file
from onnxfuse.core.array import complete_lines
from onnxfuse.core.errors import as_user_error
from onnxfuse.recipe.data import Dataset
from onnxfuse.recipe.runtimes import evaluate as evaluate_batches
from onnxfuse.training.run_state import RunState, model_view


# loss_scale: fp16's, the model's after that step (empty in another precision); status: diverged, skipped (fp16:
# the model's gradient overflowed at that step, which it skipped), dropped, ...
METRICS_HEADER = ["step", "model", "split", "loss", "accuracy", "lr", "loss_scale", "elapsed_s", "status", "run"]


class Metrics:
    """metrics.csv of one run: every row carries the run's id. A resumed run keeps its rows up to the checkpoint's
    step and writes the rest again."""

    def __init__(self, path: str, run_id: str, resume_step: int | None):
        self.path, self.run_id = path, run_id
        rows = []
        if resume_step is not None and os.path.exists(path):
            rows = [r for r in csv.DictReader(complete_lines(path))
                    if r.get("run") == run_id and int(r["step"]) <= resume_step]
        # the kept rows go to a temporary file renamed into place: a kill while they are written leaves the old
        # file whole (and the temporary file, which the next command removes)
        with atomic_file(path) as tmp, open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, METRICS_HEADER)
            w.writeheader()
            w.writerows(rows)
        try:
            self.f = open(path, "a", newline="")
        except OSError as e:
            raise (as_user_error(e, path) or e) from e
        self.w = csv.DictWriter(self.f, METRICS_HEADER)

    def write(self, rows: list[dict]) -> None:
        try:
            self.w.writerows([{**r, "run": self.run_id} for r in rows])
            self.f.flush()
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
        ev = run.trainer.evaluate(model_view(data, run), run.config.eval_batch_size)
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
