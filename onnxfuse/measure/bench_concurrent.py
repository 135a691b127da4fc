"""The ``concurrent`` mode of ``onnxfuse bench``: the B models as B OS processes training at once on one device,
each with its own torch module and AdamW, as B jobs launched without any tool. On the CPU each process gets this
process's torch threads split B ways, confined to as many cores as the other modes get (docs/benchmarks.md)."""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import time

import numpy as np

from onnxfuse.core.errors import OnnxFuseError
from onnxfuse.measure.bench_modes import peak_mib, seq_torch_step
from onnxfuse.measure.workloads import zoo_module

__all__ = ["Concurrent", "ConcurrentWorkerError", "cores"]


class ConcurrentWorkerError(OnnxFuseError):
    """A process of the concurrent mode failed or exited before it finished its steps."""


def _worker_module(source: tuple):
    """Concurrent model b's torch module: ("zoo", name, b) or ("onnx", the model's serialized ONNX)."""
    if source[0] == "zoo":
        return zoo_module(source[1], source[2])
    import onnx

    from onnxfuse.runtime.torch.program import OnnxModule

    return OnnxModule(onnx.load_from_string(source[1]))


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _concurrent_worker(conn, source: tuple, x: np.ndarray, y: np.ndarray, lr: float, class_last: bool,
                       device: str, threads: int, cores: list[int], precision: str = "fp32") -> None:
    """One process of the concurrent mode: builds its model and AdamW (seq-torch's step for one model, in
    ``precision``), says
    ("ready", None), then for each count received runs that many steps and says ("done", its peak MiB), until
    "stop" (or the pipe closes: the parent is gone). A failure is sent as ("error" or "oom", one line)."""
    import torch

    from onnxfuse.runtime.process import tune_process

    try:
        dev = torch.device(device)
        if dev.type == "cpu" and cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        # the process the bench's other modes run in (bench.run's); on CUDA torch's threads left as they were
        tune_process(threads if dev.type == "cpu" else None, dev.type)
        step = seq_torch_step([_worker_module(source).to(dev).train()], [lr], class_last,
                               torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev), precision)
        conn.send(("ready", None))
        while (steps := conn.recv()) != "stop":
            for _ in range(steps):
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            conn.send(("done", peak_mib(dev)))
    except (EOFError, KeyboardInterrupt):
        pass  # the parent is gone, or the user stopped the run (the parent stops the others)
    except torch.OutOfMemoryError as e:
        conn.send(("oom", _first_line(e)))
    except Exception as e:  # noqa: BLE001 (sent to the parent, which raises it as one line)
        conn.send(("error", _first_line(e)))


def cores(n: int) -> list[int]:
    """The first ``n`` cores this process may run on (all of them where that cannot be asked)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))[:n]


class Concurrent:
    """The concurrent mode's B processes, started and waiting; ``pool(steps)`` runs ``steps`` steps in every
    process at once and returns when all are done; ``close()`` (or leaving ``with``) stops them, killing one that
    does not stop. A process that fails or exits is one ConcurrentWorkerError (torch.OutOfMemoryError for out of
    memory, which the bench notes), and every process is stopped."""

    def __init__(self, sources: list[tuple], x, y, lrs: list[float], class_last: bool, device, threads: int,
                 cores: list[int] | None = None, precision: str = "fp32"):
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if ctx.get_start_method() == "forkserver":
            ctx.set_forkserver_preload(["torch", "onnxfuse.measure.bench_concurrent"])  # imported once, then forked
        self.procs, self.conns, self.peaks, self.threads = [], [], [0.0] * len(sources), threads
        try:
            x, y = x.cpu().numpy(), y.cpu().numpy()
            for b, (source, lr) in enumerate(zip(sources, lrs)):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_concurrent_worker, name=f"onnxfuse-bench-concurrent-{b}", daemon=True,
                                args=(theirs, source, x, y, lr, class_last, str(device), threads, cores or [],
                                      precision))
                p.start()
                theirs.close()
                self.procs.append(p)
                self.conns.append(mine)
            self._collect("ready", "starting")
        except BaseException:
            self.close()
            raise

    def __call__(self, steps: int = 1) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError):  # a process that is gone: _collect says which
                c.send(steps)
        self.peaks = self._collect("done", f"running {steps} step{'s' if steps != 1 else ''}")

    def peak_mib(self) -> float:
        return sum(self.peaks)

    def _collect(self, kind: str, doing: str) -> list:
        """Each process's reply ``kind``, waiting on the pipes and the processes together (one that dies is seen
        at once); a failure stops every process and raises."""
        replies, pending = {}, set(range(len(self.procs)))
        while pending:
            multiprocessing.connection.wait([self.conns[b] for b in pending]
                                            + [self.procs[b].sentinel for b in pending])
            for b in sorted(pending):
                if self.conns[b].poll():
                    try:
                        got, value = self.conns[b].recv()
                    except (EOFError, OSError):  # closed, or reset by a process that was killed
                        got, value = "exit", None
                elif not self.procs[b].is_alive():
                    got, value = "exit", None
                else:
                    continue
                if got == kind:
                    replies[b] = value
                    pending.discard(b)
                    continue
                proc = self.procs[b]
                self.close()  # joins proc too
                if got == "oom":
                    import torch

                    raise torch.OutOfMemoryError(f"concurrent: model {b}'s process: {value}")
                if got == "error":
                    raise ConcurrentWorkerError(f"concurrent mode: model {b}'s process failed while {doing}: {value}; "
                                                "leave 'concurrent' out of modes=, or run modes=['seq-torch'] to see "
                                                "the same model fail in this process")
                raise ConcurrentWorkerError(f"concurrent mode: model {b}'s process exited (exit code "
                                            f"{proc.exitcode}) while {doing}; a negative code is the "
                                            "signal that killed it (-9: often out of memory): measure a smaller B "
                                            "or leave 'concurrent' out of modes=")
        return [replies[b] for b in range(len(self.procs))]

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError, ValueError):
                c.send("stop")
        deadline = time.monotonic() + 10  # for all: a process mid-steps finishes them first
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []

    def __enter__(self) -> "Concurrent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
