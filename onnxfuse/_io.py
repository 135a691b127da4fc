"""Writing folders atomically: build in a temporary sibling, then rename, so a failure leaves nothing behind."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

from .errors import InputFileError

__all__ = ["atomic_dir", "check_output_dir", "atomic_write_bytes"]


def check_output_dir(path: str, overwrite: bool) -> None:
    """Refuse to replace a non-empty folder unless asked to (checked before any work starts)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise InputFileError(f"output '{path}' exists and is not a folder; choose another path")
        if os.listdir(path) and not overwrite:
            raise InputFileError(f"output folder '{path}' already exists and is not empty; "
                                 "pass --overwrite to replace it or choose another folder")


@contextlib.contextmanager
def atomic_dir(path: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary folder; on success it replaces ``path`` in one rename, on error it is removed."""
    path = os.path.abspath(path)
    check_output_dir(path, overwrite)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(path):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
        os.rmdir(old)
        os.rename(path, old)
    os.rename(tmp, path)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write a file through a temporary name and rename it into place."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
