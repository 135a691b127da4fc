"""The sweep folder: the one module that knows what lives where in it. Everything in it is written by the driver
(the process running `onnxfuse sweep`); workers send their results back through Ray, so the folder needs no
storage shared with them.

Every file is written whole or not at all: a record through a temporary file renamed into place
(``write_bytes``, ``write_json``), a trial's folder as a temporary folder renamed into place
(``replacing``); a write that fails names the file it was writing. The temporaries of a killed driver
(``.<name>.tmp-*``) are removed by the next one (``remove_temporaries``).

    spec.json                    the spec the sweep runs (a resumed sweep reads it, not the YAML file again)
    plan.json                    the trials (id, parameters), the arrays (id, trials, settings), how B was chosen
    models/<trial>.onnx          each trial's model as exported, with its initial weights
    arrays/<array>/result.json   an array's outcome, written last: its presence means the array is done
    arrays/<array>/metrics.csv   the array's metrics (model = the trial's place in the array)
    arrays/<array>/segment_<k>.json, state_<k>.tar   with successive halving: the array's results at rung k, and
                                 its folder there (where its survivors go on from; removed at the end)
    halving.json                 with successive halving: each rung's survivors and the arrays they go on in
                                 (ids r<k>a<j>)
    trials/<trial>/              model.onnx + model.safetensors (its final weights, split out of the array),
                                 best.onnx + best.safetensors (its best state by the metric, when kept),
                                 metrics.csv, and a TensorBoard run: <its parameters>/events.out.tfevents.*
    status.json                  live: every array done / running (pid, node, step) / queued / failed; when the
                                 driver stopped on an error, ``stopped`` says why and when (and no array is running)
    .space-reserve               while a driver runs: space held back so that status.json can still say why it
                                 stopped when the disk fills up (removed to write it, and at the end)
    results.csv, report.md       every trial, best first by the spec's metric
    report.png                   the metric against each searched hyper-parameter; the trials' curves
    .onnxfuse.lock               one driver at a time (see ``onnxfuse/core/_lock.py``)
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Iterator

from onnxfuse.core._io import atomic_dir, atomic_write_bytes, claim_output, remove_temporaries
from onnxfuse.core.array import METRICS, REPORT_PNG  # an array's metrics and plot: the sweep's are named alike
from onnxfuse.core.errors import InputFileError, as_user_error, shell

__all__ = ["SweepDir"]

SPEC, PLAN, STATUS, RESULTS, REPORT_MD = "spec.json", "plan.json", "status.json", "results.csv", "report.md"
MODELS, ARRAYS, TRIALS = "models", "arrays", "trials"
RESULT, HALVING = "result.json", "halving.json"
TRIAL_ONNX, TRIAL_WEIGHTS = "model.onnx", "model.safetensors"
TRIAL_BEST_ONNX, TRIAL_BEST_WEIGHTS = "best.onnx", "best.safetensors"
TRIAL_FILES = {"final": (TRIAL_ONNX, TRIAL_WEIGHTS), "best": (TRIAL_BEST_ONNX, TRIAL_BEST_WEIGHTS)}  # split --which
RESERVE = ".space-reserve"
RESERVE_BYTES = 256 << 10  # status.json of ~1,500 arrays


class SweepDir:
    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.fspath(path))

    def __fspath__(self) -> str:
        return self.path

    def _join(self, *names: str) -> str:
        return os.path.join(self.path, *names)

    spec_path = property(lambda self: self._join(SPEC))
    plan_path = property(lambda self: self._join(PLAN))
    status_path = property(lambda self: self._join(STATUS))
    results_path = property(lambda self: self._join(RESULTS))
    report_md_path = property(lambda self: self._join(REPORT_MD))
    report_png_path = property(lambda self: self._join(REPORT_PNG))

    models_path = property(lambda self: self._join(MODELS))

    def model_path(self, trial: str) -> str:
        return self._join(MODELS, f"{trial}.onnx")

    def array_path(self, array: str) -> str:
        return self._join(ARRAYS, array)

    def result_path(self, array: str) -> str:
        return self._join(ARRAYS, array, RESULT)

    def segment_path(self, array: str, k: int) -> str:
        return self._join(ARRAYS, array, f"segment_{k}.json")

    def state_path(self, array: str, k: int | str) -> str:
        return self._join(ARRAYS, array, f"state_{k}.tar")

    halving_path = property(lambda self: self._join(HALVING))

    def array_metrics_path(self, array: str) -> str:
        return self._join(ARRAYS, array, METRICS)

    def trial_path(self, trial: str) -> str:
        return self._join(TRIALS, trial)

    def trial_file(self, trial: str, name: str) -> str:
        """``name``: one of TRIAL_FILES' names, METRICS, or the TensorBoard run's (a folder and its file)."""
        return self._join(TRIALS, trial, name)

    def relative(self, path: str) -> str:
        return os.path.relpath(path, self.path)

    # ------------------------------------------------------------------------------------------------ state
    def is_sweep(self) -> bool:
        return os.path.isfile(self.spec_path)

    @contextlib.contextmanager
    def locked(self) -> Iterator["SweepDir"]:
        """Hold the sweep folder (created if it does not exist; a path that is a file is one error line)."""
        with claim_output(self.path, "sweep", replace=False, mark=True, what="sweep folder"):
            yield self

    def write_bytes(self, path: str, data: bytes) -> None:
        """``path`` written whole or not at all (temporary file + rename); a failure names ``path``."""
        _makedirs(os.path.dirname(path))
        atomic_write_bytes(path, data)

    def write_json(self, path: str, record) -> None:
        self.write_bytes(path, (json.dumps(record, indent=1, default=_plain) + "\n").encode())

    def replacing(self, folder: str) -> contextlib.AbstractContextManager[str]:
        """A new temporary folder beside ``folder`` to write into; when the block ends, it replaces ``folder``
        (one rename), and when the block fails it is removed and ``folder`` is as it was. A write error names
        ``folder``. (The driver holds the sweep folder, so nothing more is locked.)"""
        return atomic_dir(folder, overwrite=True, command="sweep")

    def remove_temporaries(self) -> list[str]:
        """Remove what a killed driver left half-written (temporary files and folders: never a record); returns
        them."""
        folders = [self.path, self._join(TRIALS), *glob.glob(self._join(ARRAYS, "*"))]
        return [path for folder in folders for path in remove_temporaries(folder)]

    # ------------------------------------------------------------------------------------------------ space
    reserve_path = property(lambda self: self._join(RESERVE))

    def reserve_space(self) -> None:
        """Hold ``RESERVE_BYTES`` of the disk back (real blocks, not a sparse file), so that after the disk fills
        up, ``release_space`` frees enough to write status.json saying so."""
        try:
            with open(self.reserve_path, "wb") as f:
                f.write(b"\0" * RESERVE_BYTES)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(self.reserve_path)
            raise (as_user_error(e, self.reserve_path) or e) from e

    def release_space(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.reserve_path)

    def read_json(self, path: str, what: str):
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            start = shell("onnxfuse", "sweep", "SPEC.yaml", "-o", self.path)
            raise InputFileError(f"'{self.path}' has no {os.path.basename(path)}: it is not a sweep folder that "
                                 f"got past planning; start it with `{start}`") from None
        except (OSError, ValueError) as e:
            raise InputFileError(f"{what} '{path}' is damaged ({type(e).__name__}); delete it to plan again, or "
                                 "start the sweep in a new folder") from None

    def result(self, array: str) -> dict | None:
        """An array's result, None while it has none (a damaged one counts as none: the array runs again)."""
        try:
            with open(self.result_path(array), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None


def _makedirs(folder: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise (as_user_error(e, folder) or e) from e


def _plain(v):
    """numpy scalars, and settings as their record (``TrainConfig.as_dict()``), in records."""
    if hasattr(v, "item"):
        return v.item()
    if hasattr(v, "as_dict"):
        return v.as_dict()
    raise TypeError(f"{type(v).__name__} is not JSON")
