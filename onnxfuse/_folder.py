"""The array folder: what lives where, who may use it, and which run its outputs belong to.

    fused.onnx, array.json, sources/    the array (``onnxfuse fuse``)
    run.json                            the current run: its id, settings hash, data hash, start time
    metrics.csv, checkpoints/, trained/ the current run's outputs, each recording the run's id
    report.png, report.json             ``onnxfuse report`` of the current run
    runs/<run id>/                      earlier runs' outputs, moved aside when a new run trains its first step
    .onnxfuse.lock                      the lock (see ``_lock.py``)

Every command that reads or writes an array folder opens it with :func:`open_array`: it holds the folder's lock
and first removes the temporary folders a killed process left (``.trained.tmp-*``, ``checkpoints/.step_*.tmp-*``):
under the lock nobody else can be writing them.
"""
from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shutil
import time
from typing import Iterator

from ._lock import array_lock
from .errors import InputFileError

__all__ = ["FUSED", "SPEC", "SOURCES", "METRICS", "CHECKPOINTS", "TRAINED", "RUNS", "RUN", "REPORT_PNG",
           "REPORT_JSON", "TRAIN_STATE", "open_array", "is_array", "remove_temporaries", "check_output_location",
           "read_run", "write_run", "move_previous_run", "trained_run", "metrics_runs", "complete_lines",
           "check_one_run", "describe_unfinished"]

FUSED, SPEC, SOURCES = "fused.onnx", "array.json", "sources"
METRICS, CHECKPOINTS, TRAINED, RUNS, RUN = "metrics.csv", "checkpoints", "trained", "runs", "run.json"
REPORT_PNG, REPORT_JSON = "report.png", "report.json"
TRAIN_STATE = "train_state.json"  # in trained/
# a run's outputs, in the order they are moved aside (run.json last: until it moves, the folder still names the
# run whose outputs are left, so a kill in between is finished by the next move)
RUN_OUTPUTS = (TRAINED, CHECKPOINTS, METRICS, REPORT_PNG, REPORT_JSON, RUN)
_TEMPORARY = re.compile(r"^\..+\.(tmp|old)-\w+$")  # what _io.atomic_dir / atomic_write_bytes create


def is_array(path: str | os.PathLike) -> bool:
    path = os.fspath(path)
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, SPEC)) or
                                    os.path.exists(os.path.join(path, FUSED)))


@contextlib.contextmanager
def open_array(array_dir: str | os.PathLike, command: str) -> Iterator[None]:
    """Hold the array folder's lock for ``command`` and clear what killed processes left there."""
    with array_lock(array_dir, command):
        remove_temporaries(array_dir)
        yield


def remove_temporaries(array_dir: str | os.PathLike) -> list[str]:
    """Remove the temporary files and folders of killed processes (call it holding the lock); returns them."""
    removed = []
    for folder in (os.fspath(array_dir), os.path.join(array_dir, CHECKPOINTS)):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if _TEMPORARY.match(name):
                path = os.path.join(folder, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.remove(path)
                removed.append(path)
    return removed


def check_output_location(output: str | os.PathLike, inputs: list[str | os.PathLike], flag: str = "-o") -> None:
    """Refuse an output folder that is, is inside, or contains one of ``inputs`` (checked before anything is
    written or deleted: ``--overwrite`` replaces the output folder as a whole)."""
    out = os.path.realpath(os.fspath(output))
    for item in inputs:
        src = os.path.realpath(os.fspath(item))
        if out == src:
            how = "is"
        elif out.startswith(src.rstrip(os.sep) + os.sep):
            how = "is inside"
        elif src.startswith(out.rstrip(os.sep) + os.sep):
            how = "contains"
        else:
            continue
        raise InputFileError(f"output folder '{output}' {how} the input '{item}': writing it could replace or "
                             f"delete the input; give {flag} a folder outside the inputs")


# ---------------------------------------------------------------------------------------------- run identity
def read_run(array_dir: str | os.PathLike) -> dict | None:
    """The current run's record (run.json), or None when the folder has not trained since runs were recorded."""
    path = os.path.join(array_dir, RUN)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
        record["id"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputFileError(f"'{path}' is not readable ({type(e).__name__}); it names the folder's current run: "
                             f"move it away and train again") from e
    return record


def write_run(array_dir: str | os.PathLike, record: dict) -> None:
    from ._io import atomic_write_bytes

    atomic_write_bytes(os.path.join(array_dir, RUN), json.dumps(record, indent=1).encode())


def _outputs_present(array_dir: str) -> list[str]:
    return [name for name in RUN_OUTPUTS if os.path.lexists(os.path.join(array_dir, name))]


def move_previous_run(array_dir: str | os.PathLike) -> str | None:
    """Move the outputs of the folder's current run (or of a run from before runs were recorded) into
    ``runs/<its id>/``; returns that folder, or None when there was nothing to move."""
    array_dir = os.fspath(array_dir)
    present = _outputs_present(array_dir)
    if not present:
        return None
    record = read_run(array_dir)
    run_id = record["id"] if record else trained_run(array_dir) or \
        "unrecorded-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(max(
            os.path.getmtime(os.path.join(array_dir, n)) for n in present)))
    dest = os.path.join(array_dir, RUNS, run_id)
    os.makedirs(dest, exist_ok=True)
    for name in present:
        target = os.path.join(dest, name)
        if os.path.lexists(target):  # a move a kill interrupted, finished now: the folder's copy is newer
            shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
        os.rename(os.path.join(array_dir, name), target)
    return dest


def trained_run(array_dir: str | os.PathLike) -> str | None:
    """The id of the run whose weights ``trained/`` holds (None: not trained, or trained before ids)."""
    path = os.path.join(array_dir, TRAINED, TRAIN_STATE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return (json.load(f).get("run") or {}).get("id")
    except (OSError, ValueError, AttributeError) as e:
        raise InputFileError(f"'{path}' is not readable ({type(e).__name__}); train again") from e


def metrics_runs(array_dir: str | os.PathLike) -> list[str]:
    """The run ids in metrics.csv's ``run`` column, in order of appearance (empty for files from before ids)."""
    path = os.path.join(array_dir, METRICS)
    if not os.path.exists(path):
        return []
    seen: dict[str, None] = {}
    for row in csv.DictReader(complete_lines(path)):
        if row.get("run"):
            seen.setdefault(row["run"], None)
    return list(seen)


def complete_lines(path: str) -> list[str]:
    """The lines of a file that is appended to, each with its line end: a last line without one was cut short
    (a full disk, a kill) and was never written as far as readers are concerned."""
    with open(path, newline="") as f:
        lines = f.readlines()
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    return lines


def check_one_run(array_dir: str | os.PathLike) -> str | None:
    """Check that run.json, metrics.csv and trained/ belong to one run; return its id (None: no ids recorded).
    A folder written by onnxfuse itself always passes; one assembled by hand, or mixed by two processes before
    the lock existed, does not."""
    array_dir = os.fspath(array_dir)
    record = read_run(array_dir)
    current = record["id"] if record else None
    trained, rows = trained_run(array_dir), metrics_runs(array_dir)
    fix = "train the array again (a new run moves these files aside into runs/)"
    if len(rows) > 1:
        raise InputFileError(f"'{os.path.join(array_dir, METRICS)}' mixes rows of runs {', '.join(rows)}; {fix}")
    if trained and rows and trained != rows[0]:
        raise InputFileError(f"'{os.path.join(array_dir, TRAINED)}' holds the weights of run {trained} but "
                             f"'{os.path.join(array_dir, METRICS)}' the metrics of run {rows[0]}; {fix}")
    for what, run_id in ((TRAINED, trained), (METRICS, rows[0] if rows else None)):
        if current and run_id and run_id != current:
            raise InputFileError(f"'{os.path.join(array_dir, what)}' belongs to run {run_id} but the folder's "
                                 f"current run is {current} ('{os.path.join(array_dir, RUN)}'); {fix}")
    return current or trained or (rows[0] if rows else None)


def describe_unfinished(array_dir: str | os.PathLike) -> str | None:
    """Why a folder has no trained weights when a run was started there (None: no run was)."""
    record = read_run(array_dir)
    if record is None:
        return None
    steps = []
    root = os.path.join(array_dir, CHECKPOINTS)
    if os.path.isdir(root):
        steps = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    where = f"; its newest checkpoint is at step {int(steps[-1][5:])}" if steps else " and left no checkpoint"
    return f"its run {record['id']} (started {record.get('started', '?')}) did not finish{where}"

