"""Run checks in a separate worker process, so that a model that crashes a runtime (a floating point exception or
a segmentation fault inside a native kernel) is reported as a failure of that model and the campaign goes on."""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from .grammar import ModelSpec
from .harness import Outcome, check_model

__all__ = ["Worker"]


def _quiet_check(spec: ModelSpec, Bs: tuple, runtime: str, strategy: str = "default", compile: str = "off",
                 precision: str = "fp32") -> Outcome:
    import logging

    try:  # the torch runtime needs no onnxruntime (the torch extra alone)
        import onnxruntime

        onnxruntime.set_default_logger_severity(4)
    except ImportError:
        pass
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    return check_model(spec, Bs=Bs, runtime=runtime, strategy=strategy, compile=compile, precision=precision)


class Worker:
    """``worker.check(spec, Bs, runtime)`` runs :func:`check_model` in a child process (restarted after a crash)."""

    def __init__(self):
        self._pool: ProcessPoolExecutor | None = None

    def check(self, spec: ModelSpec, Bs: tuple = (1, 2, 3), runtime: str = "ort", strategy: str = "default",
              compile: str = "off", precision: str = "fp32") -> Outcome:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            return self._pool.submit(_quiet_check, spec, Bs, runtime, strategy, compile, precision).result()
        except BrokenProcessPool:
            self.close()
            return Outcome("fail", "crash", "the process died (a native crash in torch or onnxruntime)",
                           B=max(Bs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
