"""The process-wide settings a training process wants, made only when asked: the command line asks (``onnxfuse
train``, ``check``, ``demo``, a sweep's workers: their processes are onnxfuse's own), the Python API does not, so
that ``import onnxfuse``, ``onnxfuse.fuse`` or ``train_array`` leave a user's process as they found it unless the
user calls :func:`tune_process` (or passes ``train_array(..., tune_process=True)``).

What :func:`tune_process` sets, and why each is process-wide:

- torch's CPU threads (``torch.set_num_threads``): one unless asked. torch's OpenMP threads wait for each other
  at every parallel region, and when another process holds one of the cores a step takes 10-50x as long
  (measured on a 2-core machine: a demo step 480 ms with 2 threads, 34 ms with 1). A fixed count also keeps a
  run's results independent of the machine's load (the thread count changes how reductions are split). On CUDA
  the count is left alone unless asked. A run's ``threads`` setting, when given, is applied by its trainer
  whoever runs it: that is asked.
- denormal floats flushed to zero (``torch.set_flush_denormal``): weights or moments of a model that stalled
  make x86 arithmetic many times slower (a demo step took 20x as long); flushing changes values only below
  1e-38. The ONNX Runtime trainer sets the same on its own sessions, which is not process-wide.
- glibc's heap kept at its peak (:func:`keep_heap`)."""
from __future__ import annotations

import contextlib
import ctypes
import functools

__all__ = ["tune_process", "keep_heap", "heap_returned"]


def tune_process(threads: int | None = None, device: object = "cpu") -> None:
    """Set what a training process wants (see the module's docstring): on a CPU ``device``, ``threads`` torch
    threads (default 1), denormals flushed and the heap kept; on CUDA, the threads only when given. A process-wide
    change: the command line makes it, a Python caller asks for it."""
    import torch

    cuda = str(device).startswith("cuda")
    if threads or not cuda:
        torch.set_num_threads(threads or 1)
    torch.set_flush_denormal(True)
    if not cuda:
        keep_heap()


def _libc(name: str):
    """glibc's function ``name``, or None where there is none (not glibc)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):
        return None


def _heap_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """Set glibc's ``malloc`` thresholds: blocks over ``mmap_bytes`` are mapped apart (and returned when freed),
    and free memory over ``trim_bytes`` at the heap's top is returned to the system. Returns whether they were set."""
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, trim_bytes))


KEPT_MMAP, KEPT_TRIM = 32 << 20, 1 << 30  # keep_heap's thresholds


@functools.cache
def keep_heap() -> bool:
    """Keep the memory a step frees for the next step (glibc's ``malloc``; elsewhere nothing changes). A step
    frees its intermediates (MiBs) at its end and allocates them again at the next one; glibc hands freed memory
    at the top of its heap back to the system beyond a threshold it moves itself, and the next step then takes a
    page fault for every 4 KiB page of it again. Measured on a compiled Transformer LM step (B = 16, 1 thread):
    1,800-2,700 page faults and 4-5 ms of kernel time per 50 ms step in some stretches, none in others; a step
    11.8 % behind the compiled torch.func ensemble became even with it. Fixed thresholds (blocks up to 32 MiB
    from the heap, none returned below 1 GiB free) keep a training process at its peak memory instead, as
    jemalloc or tcmalloc would. A process-wide setting, made once; returns whether it was made."""
    return _heap_thresholds(KEPT_MMAP, KEPT_TRIM)


@contextlib.contextmanager
def heap_returned():
    """Meanwhile glibc returns every freed block over 64 KiB to the system, so that the resident memory follows
    what is allocated (a benchmark reads a step's memory so); yields a function that returns what the heap holds
    free now, or None where this is not glibc (nothing changes then). The kept heap's thresholds after."""
    trim = _libc("malloc_trim")
    if trim is None or not _heap_thresholds(64 << 10, 64 << 10):
        yield None
        return
    try:
        yield lambda: trim(0)
    finally:
        _heap_thresholds(KEPT_MMAP, KEPT_TRIM)
