"""The one clock of onnxfuse's measurements: :class:`Stopwatch`, seconds by ``time.perf_counter`` (monotonic, the
finest resolution Python has). Benchmarks, array sizing, the measured fusion forms and placement's
executor time with it, so a reported second means the same everywhere."""
from __future__ import annotations

import time

__all__ = ["Stopwatch"]


class Stopwatch:
    """Seconds since it started: ``watch = Stopwatch()`` starts now and ``watch.seconds`` reads the time so far; as
    a ``with`` block (``with Stopwatch() as watch:``) it restarts on entry and stops at exit, so that afterwards
    ``watch.seconds`` is the block's time.

    It waits for nothing: timing work queued on a device, the caller synchronizes before the block and at its
    end, inside it (the last statement), as :func:`~onnxfuse.measure.workloads.interleaved_rounds` does."""

    __slots__ = ("_start", "_stop")

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._stop: float | None = None

    def __enter__(self) -> "Stopwatch":
        self._stop = None
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._stop = time.perf_counter()

    @property
    def seconds(self) -> float:
        """Seconds from the start to the stop (the block's end), or to now while it runs."""
        return (time.perf_counter() if self._stop is None else self._stop) - self._start
