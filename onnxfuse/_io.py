"""Writing folders atomically: build in a temporary sibling, then rename, so a failure leaves nothing behind.

The temporary names start with a dot and end in ``.tmp-<random>`` / ``.old-<random>``: a process killed in between
leaves them, and the next command on an array folder removes them (``ArrayDir.remove_temporaries``)."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

from .errors import InputFileError, as_user_error

__all__ = ["atomic_dir", "check_output_dir", "atomic_write_bytes", "load_safetensors"]


def check_output_dir(path: str, overwrite: bool) -> None:
    """Refuse to replace a non-empty folder unless asked to, and a path under a file (checked before any work
    starts)."""
    parent = os.path.dirname(os.path.normpath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent) if os.path.dirname(parent) != parent else ""
    if parent and not os.path.isdir(parent):
        raise InputFileError(f"output '{path}' cannot be created: '{parent}' is a file, not a folder; "
                             "choose another path")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise InputFileError(f"output '{path}' exists and is not a folder; choose another path")
        if os.listdir(path) and not overwrite:
            raise InputFileError(f"output folder '{path}' already exists and is not empty; "
                                 "pass --overwrite to replace it or choose another folder")


@contextlib.contextmanager
def atomic_dir(path: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary folder; on success it replaces ``path`` in one rename, on error it is removed."""
    shown = path
    path = os.path.abspath(path)
    check_output_dir(path, overwrite)
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    except OSError as e:  # a read-only location, a file where a folder should be, ...
        raise (as_user_error(e, shown) or e) from e
    try:
        yield tmp
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        user = as_user_error(e, shown)  # a full disk or a read-only folder while writing: name the output
        if user is None or user is e:
            raise
        raise user from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private (0700); the output gets a folder's usual mode
        old = None
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
            os.rmdir(old)
            os.rename(path, old)
        os.rename(tmp, path)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise (as_user_error(e, shown) or e) from e
    if old:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write a file through a temporary name and rename it into place."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise (as_user_error(e, path) or e) from e


def load_safetensors(path: str, fix: str) -> dict:
    """The tensors of a safetensors file; a missing, truncated or corrupt file is one InputFileError naming it,
    ending with ``fix`` (what to do about it)."""
    from safetensors.numpy import load_file

    if not os.path.exists(path):
        raise InputFileError(f"'{path}' is missing; {fix}")
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error types for truncated or garbled files
        cause = " ".join(str(e).split())[:120]
        raise InputFileError(f"'{path}' is not readable (truncated or corrupt: {cause}); {fix}") from e
