"""Run a partitioned graph for real: one onnxruntime session per stage, one thread per device.

Each device's thread runs its stages in stage order; a stage waits until every value it reads has been
published (by the caller for graph inputs, by another stage otherwise), runs its session, and publishes its
outputs. Sessions of ``cpu`` devices get their own intra-op thread pool of ``DeviceSpec.threads`` threads; ``cuda``
devices use the CUDA execution provider on their ``device_id`` (values cross devices through host memory as
numpy arrays). Graph optimizations are off, as in the profile: a training-mode graph is computed wrongly by
onnxruntime 1.19's Conv+BatchNorm fusion, and the simulator's costs are measured that way.

onnxruntime is imported inside the functions: ``onnxfuse`` itself never needs it.
"""
from __future__ import annotations

import queue
import statistics
import threading
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import onnx

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core.errors import PlacementError
from onnxfuse.placement.devices import DeviceSpec
from onnxfuse.placement.partition import Partition
from onnxfuse.placement.session import make_session

__all__ = ["make_session", "PipelineRunner", "RunResult", "run_whole", "time_whole", "max_rel_error",
           "run_partition"]


class _Worker:
    """A device's thread: runs the jobs it is given, one after the other, releasing ``done`` after each."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done = job
            try:
                fn()
            finally:
                done.release()

    def submit(self, fn, done: threading.Semaphore) -> None:
        self._jobs.put((fn, done))

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class _Values:
    """Values of one step, published by stages and awaited by others; an error anywhere wakes every waiter."""

    def __init__(self, initial: Mapping[str, np.ndarray]):
        self._values = dict(initial)
        self._cond = threading.Condition()
        self.error: BaseException | None = None

    def get(self, key: str, timeout: float = 600.0) -> np.ndarray:
        with self._cond:
            ok = self._cond.wait_for(lambda: key in self._values or self.error is not None, timeout)
            if self.error is not None:
                raise PlacementError(f"another stage failed: {self.error}")
            if not ok:
                raise PlacementError(f"value '{key}' never arrived within {timeout:.0f}s (internal error)")
            return self._values[key]

    def put(self, items: Mapping[str, np.ndarray]) -> None:
        with self._cond:
            self._values.update(items)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def __getitem__(self, key: str) -> np.ndarray:
        return self._values[key]


@dataclass
class RunResult:
    """Measured steps of a partitioned run: wall seconds per step, the outputs of the last step, and the
    (device, stage, start, end) of each stage in the last step, relative to its start."""

    step_times: list[float]
    outputs: dict[str, np.ndarray]
    spans: list[tuple[int, int, float, float]] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.step_times)

    @property
    def best(self) -> float:
        return min(self.step_times)


class PipelineRunner:
    """Sessions for every stage of a partition, and a thread per device to run a step."""

    def __init__(self, partition: Partition, devices: Sequence[DeviceSpec]):
        if partition.n_devices > len(devices):
            raise PlacementError(f"the partition uses {partition.n_devices} devices but only {len(devices)} are given")
        self.partition = partition
        self.devices = list(devices)
        self.sessions = {id(s): make_session(s.model, devices[s.device]) for s in partition.stages}
        # inputs a stage writes in place (a training graph's InPlaceAccumulator targets): each stage gets its own
        # copy, or a parameter updated by one stage would be read updated by another in the same step
        self.inplace = {id(s): {n.input[0] for n in s.model.graph.node if n.op_type.startswith("InPlaceAccumulator")}
                        for s in partition.stages}
        self.by_device = {d: partition.stages_of(d) for d in sorted({s.device for s in partition.stages})}
        # one long-lived thread per device (a thread pool may run two devices' jobs on one idle thread, one after
        # the other, which is not what a device does)
        self.workers = {d: _Worker(f"onnxfuse-device-{d}") for d in self.by_device}

    def close(self) -> None:
        for w in self.workers.values():
            w.stop()

    def __enter__(self) -> "PipelineRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _device_loop(self, d: int, values: _Values, clock: Stopwatch, spans: list) -> None:
        """Run device d's stages in order; a failure is recorded in ``values`` (waking the other devices)."""
        try:
            for st in self.by_device[d]:
                feeds = {name: values.get(key) for name, key in st.inputs.items()}
                for name in self.inplace[id(st)] & feeds.keys():
                    feeds[name] = np.array(feeds[name], copy=True)
                t_start = clock.seconds
                outs = self.sessions[id(st)].run(list(st.outputs), feeds)
                spans.append((d, st.index, t_start, clock.seconds))
                values.put(dict(zip(st.outputs.values(), outs)))
        except BaseException as e:  # noqa: BLE001 - reported by step()
            if values.error is None:
                values.fail(e)

    def step(self, feeds: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float, list]:
        """One step: (graph outputs, wall seconds, stage spans)."""
        p = self.partition
        missing = [n for n in p.graph_inputs if n not in feeds]
        if missing:
            raise PlacementError(f"no value for graph input '{missing[0]}'")
        initial = dict(feeds)
        for key, (name, b0, b1) in p.input_slices.items():
            initial[key] = np.ascontiguousarray(feeds[name][b0:b1])
        values = _Values(initial)
        spans: list = []
        done = threading.Semaphore(0)
        clock = Stopwatch()  # the stages' spans are seconds on it
        for d, worker in self.workers.items():
            worker.submit(lambda d=d: self._device_loop(d, values, clock, spans), done)
        for _ in self.workers:
            done.acquire()
        wall = clock.seconds
        if values.error is not None:
            raise values.error if isinstance(values.error, PlacementError) else PlacementError(
                f"a stage failed: {' '.join(str(values.error).split())[:300]}") from values.error
        outputs = {}
        for name in p.graph_outputs:
            if name in p.output_concat:
                outputs[name] = np.concatenate([values[k] for k in p.output_concat[name]], axis=0)
            else:
                outputs[name] = values[name]
        return outputs, wall, sorted(spans)


def run_partition(partition: Partition, devices: Sequence[DeviceSpec], feeds: Mapping[str, np.ndarray],
                  warmup: int = 3, repeats: int = 20, fresh_feeds: bool = False) -> RunResult:
    """Time ``repeats`` steps after ``warmup`` untimed ones. ``fresh_feeds`` copies the inputs before every
    step (a training graph updates some of them in place)."""
    with PipelineRunner(partition, devices) as runner:
        times = []
        outputs, spans = {}, []
        for k in range(warmup + repeats):
            step_feeds = {n: np.array(v, copy=True) for n, v in feeds.items()} if fresh_feeds else feeds
            outputs, wall, spans = runner.step(step_feeds)
            if k >= warmup:
                times.append(wall)
    return RunResult(times, outputs, spans)


def run_whole(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], device: DeviceSpec | None = None
              ) -> dict[str, np.ndarray]:
    """The unpartitioned model's outputs (same session settings as the stages)."""
    sess = make_session(model, device)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {n: np.array(v, copy=True) for n, v in feeds.items()})))


def time_whole(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], device: DeviceSpec | None = None,
               warmup: int = 3, repeats: int = 20) -> list[float]:
    """Wall seconds of ``repeats`` session calls of the whole model on one device."""
    sess = make_session(model, device)
    names = [o.name for o in sess.get_outputs()]
    times = []
    for k in range(warmup + repeats):
        with Stopwatch() as call:
            sess.run(names, feeds)
        if k >= warmup:
            times.append(call.seconds)
    return times


def max_rel_error(actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray]) -> float:
    """max over outputs of ||a - e|| / ||e|| (exact match: 0; integer outputs compared exactly)."""
    worst = 0.0
    for name, e in expected.items():
        if name not in actual:
            return float("inf")
        a, e = np.asarray(actual[name]), np.asarray(e)
        if a.shape != e.shape:
            return float("inf")
        a64, e64 = a.astype(np.float64).ravel(), e.astype(np.float64).ravel()
        denom = np.linalg.norm(e64)
        err = np.linalg.norm(a64 - e64) / denom if denom > 0 else np.linalg.norm(a64 - e64)
        worst = max(worst, float(err))
    return worst
