"""Native output (what C++ code writes to file descriptors 1 and 2, which Python's redirections do not reach)."""
from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["native_output_to"]


@contextlib.contextmanager
def native_output_to(fd: int, path: str = os.devnull):
    """Send file descriptor ``fd`` (1: stdout, 2: stderr) to ``path`` while the block runs: ONNX Runtime's gradient
    builder logs every graph transformer to stderr whatever the logger severity, and torch's exporter prints its IR
    graph to stdout when it fails."""
    (sys.stdout if fd == 1 else sys.stderr).flush()
    saved = os.dup(fd)
    with open(path, "wb") as out:
        os.dup2(out.fileno(), fd)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)
