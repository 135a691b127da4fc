"""The array folder: the one module that knows what lives where in it, who may use it, and which run its outputs
belong to. Every other module asks :class:`ArrayDir`; none spells a file name of the folder.

    fused.onnx, array.json              the array (``onnxfuse fuse``): the fused graph and its weight mapping;
                                        fused.onnx is standard ONNX, any ONNX runtime runs it
    fused.own-ops.pb                    only when the fused graph holds onnxfuse's own ops (the recurrent rule's
                                        batched form, the torch runtime's op): that graph without its weights
                                        (they are fused.onnx's, under the same names); fused.onnx holds standard
                                        nodes computing the same values in its place (``standard_onnx``)
    sources/model_<b>.onnx              model b's graph without its weights (split and re-fusion put weights back)
    run.json                            the current run (whose outputs these are): its id, settings and data
                                        hashes, start time, settings
    started.json                        the last run started, until it trains its first step (then it is
                                        run.json): what ``train --resume`` continues, from its start
    metrics.csv                         the current run's metrics, every row with the run's id
    checkpoints/step_<t>/               a state folder (below) + state.json, the current run's only
    trained/                            a state folder + train_state.json: the current run's final state
    best/model_<b>_step_<t>.safetensors model b's state_dict at step t, its best by the run's --keep-best metric
                                        then; written once, never changed (which file is each model's best: the
                                        "best" record of trained/train_state.json and of each checkpoint)
    report.png, report.json             ``onnxfuse report`` of the current run
    runs/<run id>/                      earlier runs' outputs, moved aside when a new run trains its first step
    .onnxfuse.lock                      the lock, and the mark of a folder onnxfuse made (see ``_lock.py``)

A *state folder* (``trained/`` and every checkpoint) holds ``weights.safetensors`` (the fused weights of the array
as it was then: a run that shrank it by successive halving re-fused the survivors), ``optimizer_state.safetensors``,
``array.json`` describing that array, and ``dropped/model_<b>.safetensors``: the state_dict of every model dropped
so far, at the step it was dropped.

Every command that reads or writes an array folder holds it with :meth:`ArrayDir.locked`: it holds the folder's
lock and first removes the temporary folders a killed process left (``.trained.tmp-*``,
``checkpoints/.step_*.tmp-*``): under the lock nobody else can be writing them.

Every record is checked when read (``records.py``: its schema, the model indices against B), and every file a
record names (a best state) is read only from inside the folder: a file edited by hand, cut short or pointing
elsewhere is one InputFileError line naming it.

This module is the core's: it imports neither torch nor onnxruntime. Re-fusing a subset of the models is done with
the fusion the caller hands in (``onnxfuse.fuse_models``): ``passes.py`` saves arrays through this module, so
importing it back would be a cycle (the engine is handed the rule table for the same reason).
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from onnxfuse.core._io import (atomic_dir, atomic_file, atomic_write_bytes, check_tensors, load_safetensors,
                               read_onnx, remove_temporaries)
from onnxfuse.core._graph import reads
from onnxfuse.core._lock import folder_lock
from onnxfuse.core.errors import InputFileError, shell
from onnxfuse.core.standard import own_ops, standard_onnx
from onnxfuse.core.records import (CheckpointRecord, RunRecord, TrainStateRecord, invalid, read_metrics_rows,
                                   read_record, record_json)
from onnxfuse.core.weights import ArraySpec

__all__ = ["ArrayDir", "TrainedState", "load_array", "check_output_location", "model_file", "model_weights_file"]

# the array
FUSED, SPEC, SOURCES = "fused.onnx", "array.json", "sources"
OWN_OPS = "fused.own-ops.pb"  # the fused graph with onnxfuse's own ops, when it has any; not a .onnx file
# a run's outputs
METRICS, CHECKPOINTS, TRAINED, RUNS, RUN = "metrics.csv", "checkpoints", "trained", "runs", "run.json"
STARTED = "started.json"  # the last run started, until its first step (then it is run.json)
BEST = "best"
REPORT_PNG, REPORT_JSON = "report.png", "report.json"
# a state folder (trained/, checkpoints/step_<t>/)
WEIGHTS, OPTIMIZER_STATE, DROPPED = "weights.safetensors", "optimizer_state.safetensors", "dropped"
TRAIN_STATE, CHECKPOINT_STATE = "train_state.json", "state.json"  # in trained/, in a checkpoint
ORT_CHECKPOINT, SCRATCH = "ort_checkpoint", "artifacts"  # onnxruntime's own checkpoint; its artifacts while training
# a run's outputs, in the order they are moved aside (run.json last: until it moves, the folder still names the
# run whose outputs are left, so a kill in between is finished by the next move)
RUN_OUTPUTS = (TRAINED, CHECKPOINTS, BEST, METRICS, REPORT_PNG, REPORT_JSON, RUN)
_STEP = "step_"
_DROPPED_FILE = re.compile(r"^model_(\d+)\.safetensors$")
_BEST_FILE = re.compile(r"^model_\d+_step_\d+\.safetensors$")
# what to do about a record that does not read
_RETRAIN = "train the array again"
_RUN_FIX = "it names the folder's current run: move it away and train again"


def model_file(b: int) -> str:
    """Model b's ONNX file: in an array's ``sources/``, an exported array of models, a split's output."""
    return f"model_{b}.onnx"


def model_weights_file(b: int) -> str:
    """Model b's state_dict (safetensors): in ``trained/dropped/`` and a split's output, next to its ONNX file."""
    return f"model_{b}.safetensors"


@dataclass
class TrainedState:
    """What an array's current run left in ``trained/`` (or, ``initial``, the array as fused).

    ``weights`` are the fused weights of the array ``spec`` describes: the surviving array when the run shrank it
    (None when ``trained/`` has no array.json of its own: the folder's array). ``models`` is the original index of
    each of its models, ``steps`` the optimizer steps the array took, ``status`` every stopped model's
    ``{"status": diverged|dropped, "step": t}`` by original index (a string)."""

    weights: dict[str, np.ndarray]
    spec: ArraySpec | None
    models: list[int] | None
    steps: int = 0
    status: dict = field(default_factory=dict)
    run: str | None = None  # the run's id
    best: dict | None = None  # the best states the run kept (see ArrayDir.kept_best)


class ArrayDir:
    """An array folder on disk (``onnxfuse fuse``'s output, ``train``'s, ``split``'s and ``place``'s input)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"ArrayDir({self.path!r})"

    # ------------------------------------------------------------------------------------------ where things are
    def _join(self, *names: str) -> str:
        return os.path.join(self.path, *names)

    @property
    def fused_path(self) -> str:
        return self._join(FUSED)

    @property
    def own_ops_path(self) -> str:
        """The fused graph with onnxfuse's own ops, without weights (only in an array whose graph has such ops)."""
        return self._join(OWN_OPS)

    @property
    def spec_path(self) -> str:
        return self._join(SPEC)

    def source_path(self, b: int) -> str:
        return self._join(SOURCES, model_file(b))

    @property
    def metrics_path(self) -> str:
        return self._join(METRICS)

    @property
    def run_path(self) -> str:
        return self._join(RUN)

    @property
    def started_path(self) -> str:
        """The record of the last run started, while it has not trained its first step."""
        return self._join(STARTED)

    @property
    def trained_path(self) -> str:
        return self._join(TRAINED)

    @property
    def train_state_path(self) -> str:
        """trained/'s record: the run's identity, settings and final state (:meth:`write_train_state`)."""
        return self._join(TRAINED, TRAIN_STATE)

    @property
    def checkpoints_path(self) -> str:
        return self._join(CHECKPOINTS)

    def checkpoint_path(self, step: int) -> str:
        return self._join(CHECKPOINTS, f"{_STEP}{step:08d}")

    @property
    def best_path(self) -> str:
        return self._join(BEST)

    @property
    def report_png_path(self) -> str:
        return self._join(REPORT_PNG)

    @property
    def report_json_path(self) -> str:
        return self._join(REPORT_JSON)

    @property
    def label(self) -> str:
        """How messages and reports name the array's graph: ``<folder name>/fused.onnx``."""
        return f"{os.path.basename(os.path.abspath(self.path))}/{FUSED}"

    # ------------------------------------------------------------------------------------------- what a path is
    @staticmethod
    def is_array(path: str | os.PathLike) -> bool:
        """``path`` is a folder holding an array (its array.json or its fused.onnx)."""
        path = os.fspath(path)
        return os.path.isdir(path) and (os.path.exists(os.path.join(path, SPEC)) or
                                        os.path.exists(os.path.join(path, FUSED)))

    @classmethod
    def holding(cls, path: str | os.PathLike) -> "ArrayDir | None":
        """The array folder ``path`` is, or whose fused.onnx it is; None for any other path."""
        path = os.fspath(path)
        if cls.is_array(path):
            return cls(path)
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isfile(path) and cls.is_array(folder):
            return cls(folder)
        return None

    @classmethod
    def of_fused(cls, path: str | os.PathLike) -> "ArrayDir | None":
        """The array whose fused graph ``path`` is (``ARRAY_DIR/fused.onnx`` with array.json beside it), else None."""
        path = os.fspath(path)
        folder = cls(os.path.dirname(os.path.abspath(path)))
        if os.path.basename(path) == FUSED and os.path.exists(folder.spec_path):
            return folder
        return None

    def graph_path(self) -> str:
        """fused.onnx, for a command given the folder where it wants a graph (``onnxfuse place ARRAY_DIR``)."""
        if not os.path.exists(self.fused_path):
            raise InputFileError(f"'{self.path}' is a folder without {FUSED}; give an ONNX file or an array folder")
        return self.fused_path

    # ------------------------------------------------------------------------------------------------- the lock
    @contextlib.contextmanager
    def locked(self, command: str) -> Iterator["ArrayDir"]:
        """Hold the folder's lock for ``command`` (a word for messages) and clear what killed processes left."""
        with folder_lock(self.path, command):
            self.remove_temporaries()
            yield self

    def remove_temporaries(self) -> list[str]:
        """Remove the temporary files and folders of killed processes (call it holding the lock); returns them."""
        return [p for folder in (self.path, self.checkpoints_path, self.best_path) for p in remove_temporaries(folder)]

    # ------------------------------------------------------------------------------------------------ the array
    @classmethod
    def create(cls, path: str | os.PathLike, model: onnx.ModelProto, spec: ArraySpec,
               sources: Sequence[onnx.ModelProto], overwrite: bool = False) -> "ArrayDir":
        """Write an array atomically: the fused ``model``, its ``spec`` and the weightless ``sources`` (model b's
        graph). With ``overwrite``, a folder there is replaced as a whole (an array's runs too), holding its lock.

        fused.onnx is ``model`` in standard ONNX (``standard_onnx``: onnxfuse's own ops written as standard nodes);
        a ``model`` that has such ops is also written as it is, without its weights, to fused.own-ops.pb, which
        :meth:`load_fused` puts back together: every reader of the folder gets ``model``, any other tool opens
        fused.onnx."""
        array = cls(path)
        standard = standard_onnx(model)  # before the folder is claimed: a failure leaves nothing behind
        with atomic_dir(array.path, overwrite, command="fuse", mark=True) as tmp:
            onnx.save(standard, os.path.join(tmp, FUSED))
            if own_ops(model):
                onnx.save(_without_weights(model), os.path.join(tmp, OWN_OPS))
            spec.save(os.path.join(tmp, SPEC))
            os.makedirs(os.path.join(tmp, SOURCES))
            for b, src in enumerate(sources):
                onnx.save(src, os.path.join(tmp, SOURCES, model_file(b)))
        return array

    def check_exists(self) -> None:
        """The folder is there (a file or nothing there is an InputFileError saying which)."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise InputFileError(f"'{self.path}' is a file, not an array folder; give the folder `onnxfuse fuse` "
                                 "wrote (a data file is given as data=)")
        if not os.path.isdir(self.path):
            raise InputFileError(f"array folder '{self.path}' does not exist; create it with `onnxfuse fuse`")

    def load_spec(self) -> ArraySpec:
        return ArraySpec.load(self.spec_path)

    def load_fused(self) -> onnx.ModelProto:
        """The fused graph as fusion made it: fused.onnx, or in an array whose graph has onnxfuse's own ops,
        fused.own-ops.pb with fused.onnx's weights (each under its name, in fused.onnx's order)."""
        fix = "re-run `onnxfuse fuse`"
        standard = read_onnx(self.fused_path, fix)
        if not os.path.exists(self.own_ops_path):
            return standard
        model = read_onnx(self.own_ops_path, fix)
        if model.graph.initializer:
            raise InputFileError(f"'{self.own_ops_path}' holds initializers; onnxfuse writes it without any (its "
                                 f"weights are {FUSED}'s): {fix}")
        wanted = _names_read(model.graph)
        model.graph.initializer.extend(t for t in standard.graph.initializer if t.name in wanted)
        defined = ({i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
                   | {o for n in model.graph.node for o in n.output})
        missing = sorted(wanted - defined - {""})
        if missing:
            raise InputFileError(f"'{self.own_ops_path}' reads '{missing[0]}', which neither it nor {FUSED} holds: "
                                 f"the two files are not one array's; {fix}")
        return model

    def load(self) -> tuple[onnx.ModelProto, ArraySpec]:
        """The fused model and its spec; a missing folder or file is an InputFileError saying how to make it."""
        self.check_exists()
        spec = self.load_spec()
        return self.load_fused(), spec

    def load_source(self, b: int, why: str = "") -> onnx.ModelProto:
        """Model b's graph without its weights (``why``: what needs it, for the message when it is missing)."""
        return read_onnx(self.source_path(b), f"{why + ': ' if why else ''}re-run `onnxfuse fuse`")

    def refuse(self, models: Sequence[int], states: Sequence[Mapping[str, np.ndarray]], fuse: Callable,
               why: str = "") -> tuple[onnx.ModelProto, ArraySpec]:
        """The fused array of ``models`` (original indices), each with its state_dict from ``states``: their
        weightless source graphs with those tensors put back, fused by ``fuse`` (``onnxfuse.fuse_models``) into
        exactly the graph ``onnxfuse fuse`` makes for them. Its spec keeps each model's extra state (buffers that
        are not initializers). ``fuse``'s warnings are not repeated: `onnxfuse fuse` reported them."""
        spec = self.load_spec()
        protos = []
        for b, state in zip(models, states):
            proto = self.load_source(b, why)
            used = {t for n in proto.graph.node for t in n.input}
            have = {t.name for t in proto.graph.initializer}
            proto.graph.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(v), k)
                                           for k, v in state.items() if k in used and k not in have)
            protos.append(proto)
        per_model = [i["name"] for i in spec.inputs if i.get("per_model")]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fa = fuse(protos, labels=[spec.sources[b] for b in models], per_model_inputs=per_model,
                      model_ids=list(models))  # each model keeps its index (a random op's own seed)
        fa.spec.extra_state = [spec.extra_state[b] for b in models]
        return fa.model, fa.spec

    # ---------------------------------------------------------------------------------------------- trained state
    def trained(self, initial: bool = False) -> TrainedState:
        """The current run's trained weights and state (``trained/``); with ``initial``, the weights the array was
        fused with. An array without trained weights is an InputFileError saying why (never trained, or its run
        unfinished)."""
        if initial:
            model, spec = self.load_fused(), self.load_spec()
            weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in spec.weights}
            check_tensors(weights, spec.fused_tensors(), self.fused_path, "re-run `onnxfuse fuse`")
            return TrainedState(weights, None, None)
        trained = self.trained_path
        if not os.path.isdir(trained):
            unfinished = self.describe_unfinished()
            if unfinished:
                raise InputFileError(f"'{self.path}' has no trained weights: {unfinished}; continue it with "
                                     f"`{shell('onnxfuse', 'train', self.path, '--resume')}` (or train again), or "
                                     "pass initial=True to split the initial weights")
            raise InputFileError(f"'{self.path}' has not been trained (no {TRAINED}/): train it with `onnxfuse "
                                 "train` first, or pass initial=True to split the initial weights")
        fix = "train the array again (or resume its run), or pass initial=True to split the initial weights"
        state_file = os.path.join(trained, TRAIN_STATE)
        spec = ArraySpec.load(os.path.join(trained, SPEC)) if os.path.exists(os.path.join(trained, SPEC)) else None
        holds = spec or self.load_spec()  # the array trained/ holds: the surviving one, or the folder's
        state = self.train_state(fix)
        if state is None:
            raise InputFileError(f"'{state_file}' is missing; {fix}")
        models = state["models"]
        if models is not None and len(models) != holds.B:
            raise invalid(state_file, f"models {models} are not the original index of each of the {holds.B} models "
                                      f"of the array {TRAINED}/ holds", fix)
        weights = load_safetensors(os.path.join(trained, WEIGHTS), fix, holds.fused_tensors())
        return TrainedState(weights, spec, models, state["steps"], state["status"], (state["run"] or {}).get("id"),
                            state["best"])

    def train_state(self, fix: str = _RETRAIN) -> dict | None:
        """trained/'s record (``records.TrainStateRecord``), checked against the array (``fix``: what to do when
        it is not valid); None when there is none."""
        try:
            state = read_record(self.train_state_path, TrainStateRecord, fix, self.known_B())
        except FileNotFoundError:
            return None
        self._check_best(state["best"], self.train_state_path, fix)
        return state

    def dropped_state(self, b: int, fix: str) -> dict[str, np.ndarray]:
        """The state_dict model b had when the current run dropped it (``fix``: what to do when it is lost)."""
        return load_safetensors(os.path.join(self.trained_path, DROPPED, model_weights_file(b)), fix,
                                self.load_spec().model_tensors(b))

    def kept_best(self) -> dict | None:
        """The best states the current run's ``trained/`` kept (``{"metric", "since", "models": {b: {"step",
        "value", "steps", "file"}}}``, b a string), None when it kept none (or is not there)."""
        return (self.train_state() or {}).get("best")

    # ------------------------------------------------------------------------------------------------ best states
    @staticmethod
    def best_file(b: int, step: int) -> str:
        """The name, in ``best/``, of model b's state at step t."""
        return f"model_{b}_step_{step:08d}.safetensors"

    def write_best_state(self, name: str, state: Mapping[str, np.ndarray]) -> None:
        """A best state's file, written whole (temporary file + rename) into ``best/``."""
        from safetensors.numpy import save_file

        os.makedirs(self.best_path, exist_ok=True)
        with atomic_file(self.best_state_path(name)) as tmp:
            save_file({k: np.ascontiguousarray(v).reshape(np.shape(v)) for k, v in state.items()}, tmp)

    def best_state(self, b: int, name: str, fix: str) -> dict[str, np.ndarray]:
        """Model b's best state ``best/<name>`` (a name a checked record gave: :meth:`_check_best`), checked
        against the array's model b (``fix``: what to do when it is missing or damaged); read only from inside the
        folder."""
        return load_safetensors(self.best_state_path(name, fix), fix, self.load_spec().model_tensors(b))

    def best_state_path(self, name: str, fix: str = f"make {BEST}/ a folder of the array's own") -> str:
        """``best/<name>``, refused when it leads out of the array folder (``best/`` a link elsewhere): a best
        state is read, written and removed only inside the folder."""
        return self._inside(os.path.join(self.best_path, name), fix)

    def _check_best(self, kept: Mapping | None, record: str, fix: str) -> None:
        """Every best state the record at ``record`` names is model b's file of its step in ``best/``
        (:meth:`best_file`): a name, never a path."""
        for b, entry in ((kept or {}).get("models") or {}).items():
            want = self.best_file(int(b), entry["step"])
            if entry["file"] != want:
                raise invalid(record, f"best.models.{b}.file is {entry['file']!r}, not model {b}'s best state of step "
                                      f"{entry['step']} ({want!r}, a file in {BEST}/)", fix)

    def _inside(self, path: str, fix: str) -> str:
        """``path``, when it is inside the array folder with symbolic links followed; else an InputFileError."""
        root, real = os.path.realpath(self.path), os.path.realpath(path)
        if not real.startswith(root.rstrip(os.sep) + os.sep):
            raise InputFileError(f"'{path}' leads out of the array folder '{self.path}' (to '{real}'); onnxfuse reads "
                                 f"and writes an array's state only inside it: {fix}")
        return path

    def prune_best(self, keep: set[str]) -> None:
        """Remove the best-state files no record in ``keep`` names (a model that improved again, an evaluation of a
        killed run after its last checkpoint)."""
        for name in os.listdir(self.best_path) if os.path.isdir(self.best_path) else []:
            if _BEST_FILE.match(name) and name not in keep:
                os.remove(self.best_state_path(name))

    # a state folder: trained/ or a checkpoint, written into the temporary folder the caller renames into place
    @staticmethod
    def write_state(folder: str, weights: Mapping[str, np.ndarray], optimizer_state: Mapping[str, np.ndarray],
                    spec: ArraySpec, dropped: Mapping[int, Mapping[str, np.ndarray]]) -> None:
        """The fused ``weights`` and ``optimizer_state`` of the array ``spec`` describes, and every dropped model's
        state_dict by original index."""
        from safetensors.numpy import save_file

        save_file(dict(weights), os.path.join(folder, WEIGHTS))
        if optimizer_state:
            save_file(dict(optimizer_state), os.path.join(folder, OPTIMIZER_STATE))
        spec.save(os.path.join(folder, SPEC))
        if dropped:
            os.makedirs(os.path.join(folder, DROPPED))
            for b, sd in dropped.items():
                # reshape: ascontiguousarray makes a 0-d tensor (num_batches_tracked) 1-d
                save_file({k: np.ascontiguousarray(v).reshape(np.shape(v)) for k, v in sd.items()},
                          os.path.join(folder, DROPPED, model_weights_file(b)))

    @staticmethod
    def read_state(folder: str, fix: str, original: ArraySpec, optimizer: Sequence[str] | None = None
                   ) -> tuple[dict, dict, dict[int, dict]]:
        """(weights, optimizer state, dropped models' state_dicts) of a state folder, each tensor checked against
        the array it belongs to (the folder's own array.json; a dropped model against ``original``, the spec of
        the array folder it was dropped from; ``optimizer``: the names the optimizer state must have, else any,
        each ``[B, P]`` float32); a missing, corrupt or mismatched file is an InputFileError ending with ``fix``."""
        spec = ArrayDir.state_spec(folder)
        dropped, dropped_dir = {}, os.path.join(folder, DROPPED)
        for name in sorted(os.listdir(dropped_dir)) if os.path.isdir(dropped_dir) else []:
            match = _DROPPED_FILE.match(name)
            if match:
                b = int(match.group(1))
                if b >= original.B:
                    raise InputFileError(f"'{os.path.join(dropped_dir, name)}' names model {b}, but the array has "
                                         f"{original.B} models; {fix}")
                dropped[b] = load_safetensors(os.path.join(dropped_dir, name), fix, original.model_tensors(b))
        weights = load_safetensors(os.path.join(folder, WEIGHTS), fix, spec.fused_tensors())
        opt_file = os.path.join(folder, OPTIMIZER_STATE)
        opt_state = load_safetensors(opt_file, fix) if optimizer or os.path.exists(opt_file) else {}
        check_tensors(opt_state, {n: (spec.optimizer_shape(), "float32")
                                  for n in (opt_state if optimizer is None else optimizer)}, opt_file, fix)
        return weights, opt_state, dropped

    @staticmethod
    def state_spec(folder: str) -> ArraySpec:
        """The array a state folder's weights belong to."""
        return ArraySpec.load(os.path.join(folder, SPEC))

    @staticmethod
    def ort_checkpoint_path(folder: str) -> str:
        """Where in a state folder the training runtime writes its own checkpoint."""
        return os.path.join(folder, ORT_CHECKPOINT)

    @staticmethod
    def scratch_path(folder: str) -> str:
        """The training runtime's working folder inside a state folder being written (removed when the run ends)."""
        return os.path.join(folder, SCRATCH)

    @staticmethod
    def write_train_state(folder: str, *, steps: int, models: Sequence[int], status: Mapping, run: Mapping,
                          **details) -> None:
        """``train_state.json`` of ``trained/`` (``records.TrainStateRecord``): what split needs (the optimizer
        steps the array took, the original index of each model of the surviving array, each stopped model's
        status, the run's identity) and the run's JSON-ready ``details``."""
        record = {"steps": steps, "models": list(models), "status": dict(status), **details, "run": dict(run)}
        with open(os.path.join(folder, TRAIN_STATE), "wb") as f:
            f.write(record_json(record, TrainStateRecord, indent=1))

    # ------------------------------------------------------------------------------------------------ checkpoints
    def checkpoints(self) -> list[str]:
        """The checkpoint folders, oldest first (step numbers are zero-padded)."""
        return sorted(glob.glob(os.path.join(self.checkpoints_path, _STEP + "*")))

    @staticmethod
    def checkpoint_step(path: str) -> int:
        return int(os.path.basename(path)[len(_STEP):])

    @staticmethod
    def checkpoint_record_path(folder: str) -> str:
        """A checkpoint's own record (its step, models, sampler, settings and run), beside its state."""
        return os.path.join(folder, CHECKPOINT_STATE)

    @classmethod
    def write_checkpoint_record(cls, folder: str, record: Mapping) -> None:
        """A checkpoint's record (``records.CheckpointRecord``), beside its state in ``folder``."""
        with open(cls.checkpoint_record_path(folder), "wb") as f:
            f.write(record_json(record, CheckpointRecord))

    def checkpoint_record(self, folder: str, fix: str) -> dict:
        """The record of the checkpoint ``folder``, checked against the array and the folder's step (``fix``:
        what to do when it is not valid); FileNotFoundError when it has none."""
        path = self.checkpoint_record_path(folder)
        record = read_record(path, CheckpointRecord, fix, self.known_B())
        if record["step"] != self.checkpoint_step(folder):
            raise invalid(path, f"step {record['step']} is not its folder's ({self.checkpoint_step(folder)})", fix)
        self._check_best(record["best"], path, fix)
        return record

    def prune_checkpoints(self, keep: int) -> None:
        """Keep the newest ``keep`` checkpoints. Each older one is renamed first: a kill during the removal leaves a
        temporary name (removed by the next command), never a half-deleted checkpoint."""
        for old in self.checkpoints()[:-keep]:
            doomed = os.path.join(self.checkpoints_path, f".{os.path.basename(old)}.old-{os.getpid()}")
            os.rename(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ run identity
    def read_run(self) -> dict | None:
        """The current run's record (run.json: ``records.RunRecord``), or None when the folder has not trained
        since runs were recorded."""
        return self._read_run_record(self.run_path, _RUN_FIX)

    def write_run(self, record: Mapping) -> None:
        """Make ``record`` the folder's current run (its outputs are that run's from here on): the run started
        last is the current one now."""
        atomic_write_bytes(self.run_path, record_json(record, RunRecord, indent=1))
        self.restore_started(None)

    def read_started(self) -> dict | None:
        """The record of the last run started while it has not trained its first step (None: no such run; the
        last run started is the current one, run.json)."""
        return self._read_run_record(self.started_path, "it names the run started last: remove it to let "
                                                         "resume=True continue the folder's current run")

    def write_started(self, record: Mapping) -> bytes | None:
        """Record a run that starts, written whole before it changes anything in the folder; returns the record
        it replaces (its bytes, None if there was none), for :meth:`restore_started`."""
        before = None
        if os.path.isfile(self.started_path) and not os.path.islink(self.started_path):
            with open(self.started_path, "rb") as f:
                before = f.read()
        atomic_write_bytes(self.started_path, record_json(record, RunRecord, indent=1))
        return before

    def restore_started(self, before: bytes | None) -> None:
        """Put back the record of the run started last as it was (``before``: what :meth:`write_started`
        returned; None: no such record), for a run that failed before changing anything."""
        if before is not None:
            atomic_write_bytes(self.started_path, before)
        elif os.path.lexists(self.started_path):
            os.remove(self.started_path)

    def _read_run_record(self, path: str, fix: str) -> dict | None:
        try:
            return read_record(path, RunRecord, fix, self.known_B())
        except FileNotFoundError:
            return None

    def known_B(self) -> int | None:
        """The array's B, to check model indices against (None in a folder without array.json: a folder of
        metrics alone, as ``report`` reads)."""
        return self.load_spec().B if os.path.exists(self.spec_path) else None

    def _outputs_present(self) -> list[str]:
        return [name for name in RUN_OUTPUTS if os.path.lexists(self._join(name))]

    def move_previous_run(self) -> str | None:
        """Move the outputs of the folder's current run (or of a run from before runs were recorded) into
        ``runs/<its id>/``; returns that folder, or None when there was nothing to move."""
        present = self._outputs_present()
        if not present:
            return None
        record = self.read_run()
        run_id = record["id"] if record else self.trained_run() or \
            "unrecorded-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(max(
                os.path.getmtime(self._join(n)) for n in present)))
        dest = self._join(RUNS, run_id)
        os.makedirs(dest, exist_ok=True)
        for name in present:
            target = os.path.join(dest, name)
            if os.path.lexists(target):  # a move a kill interrupted, finished now: the folder's copy is newer
                shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
            os.rename(self._join(name), target)
        return dest

    def trained_run(self) -> str | None:
        """The id of the run whose weights ``trained/`` holds (None: not trained, or trained before ids)."""
        return ((self.train_state() or {}).get("run") or {}).get("id")

    def metrics_rows(self, fix: str = _RETRAIN):
        """metrics.csv's header and rows, each checked (``records.read_metrics_rows``; the model indices against
        the array's B)."""
        return read_metrics_rows(self.metrics_path, self.known_B(), fix)

    def metrics_runs(self) -> list[str]:
        """The run ids in metrics.csv's ``run`` column, in order of appearance (empty for files from before ids)."""
        if not os.path.exists(self.metrics_path):
            return []
        seen: dict[str, None] = {}
        for _, _, row in self.metrics_rows()[1]:
            if row.run:
                seen.setdefault(row.run, None)
        return list(seen)

    def check_one_run(self) -> str | None:
        """Check that run.json, metrics.csv and trained/ belong to one run; return its id (None: no ids recorded).
        A folder written by onnxfuse itself always passes; one assembled by hand, or mixed by two processes before
        the lock existed, does not."""
        record = self.read_run()
        current = record["id"] if record else None
        trained, rows = self.trained_run(), self.metrics_runs()
        fix = "train the array again (a new run moves these files aside into runs/)"
        if len(rows) > 1:
            raise InputFileError(f"'{self.metrics_path}' mixes rows of runs {', '.join(rows)}; {fix}")
        if trained and rows and trained != rows[0]:
            raise InputFileError(f"'{self.trained_path}' holds the weights of run {trained} but "
                                 f"'{self.metrics_path}' the metrics of run {rows[0]}; {fix}")
        for path, run_id in ((self.trained_path, trained), (self.metrics_path, rows[0] if rows else None)):
            if current and run_id and run_id != current:
                raise InputFileError(f"'{path}' belongs to run {run_id} but the folder's current run is {current} "
                                     f"('{self.run_path}'); {fix}")
        return current or trained or (rows[0] if rows else None)

    def describe_unfinished(self) -> str | None:
        """Why a folder has no trained weights when a run was started there (None: no run was)."""
        record = self.read_run()
        if record is None:
            return None
        steps = self.checkpoints()
        where = f"; its newest checkpoint is at step {self.checkpoint_step(steps[-1])}" if steps else \
            " and left no checkpoint"
        return f"its run {record['id']} (started {record['started'] or '?'}) did not finish{where}"


def load_array(array_dir: str | os.PathLike) -> tuple[onnx.ModelProto, ArraySpec]:
    """The fused model and spec of the array in ``array_dir`` (:meth:`ArrayDir.load`)."""
    return ArrayDir(array_dir).load()


def _without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without its initializers (fused.own-ops.pb: the weights are fused.onnx's)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.initializer[:]
    return out


def _names_read(graph: onnx.GraphProto) -> set[str]:
    """Every name ``graph``'s nodes (their subgraphs too) and outputs read."""
    return {t for n in graph.node for t in reads(n)} | {o.name for o in graph.output}


def check_output_location(output: str | os.PathLike, inputs: Sequence[str | os.PathLike], flag: str = "-o") -> None:
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

