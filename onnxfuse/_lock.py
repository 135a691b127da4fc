"""One command at a time per array folder: an exclusive ``flock`` on a lock file in it (``array.py`` names it).

The kernel releases a ``flock`` when its process ends, however it ends (SIGKILL included), so a lock left behind
by a killed process is never in the way: the next command takes it over (and logs it). The holder writes its pid,
command and start time into the file, so that a second process can say who holds the folder. A clean release
removes the file while still holding the lock; a process that locked the file just before it was removed sees
that the path no longer names its file and locks the new one, so two processes never both hold the folder.

A process may take the lock of a folder it already holds (``train_array`` calls nothing that locks again, but the
demo and user scripts chain locked calls): holds are counted per folder. ``fcntl`` exists on Linux and macOS; on
platforms without it the lock is not taken (one warning). On NFS, ``flock`` works where the client maps it to
POSIX locks (Linux since 2.6.12)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Iterator

from .errors import ArrayBusyError, OutputError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["array_lock"]

log = logging.getLogger("onnxfuse")
_held: dict[str, tuple[int, int]] = {}  # real path of the folder -> (fd, holds)
_warned = False


def _holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode(errors="replace").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}


def _describe(info: dict) -> str:
    if not info.get("pid"):
        return "another onnxfuse process (it has not recorded its pid yet)"
    return f"`onnxfuse {info.get('command', '?')}` (pid {info['pid']}, started {info.get('started', '?')})"


@contextlib.contextmanager
def array_lock(array_dir: str | os.PathLike, command: str, lock_name: str, what: str = "array folder"
               ) -> Iterator[None]:
    """Hold the folder's lock, the file ``lock_name`` in it, for ``command`` (a word for messages: train, split,
    ...); raise :class:`ArrayBusyError` naming the holder when another process holds it. The folder must exist.
    ``what`` names the kind of folder in messages (a sweep folder is locked the same way)."""
    global _warned
    key = os.path.realpath(os.fspath(array_dir))
    if fcntl is None:  # pragma: no cover
        if not _warned:
            log.warning("this platform has no fcntl: array folders are not locked; run one command per folder")
            _warned = True
        yield
        return
    if key in _held:
        fd, holds = _held[key]
        _held[key] = (fd, holds + 1)
        try:
            yield
        finally:
            fd, holds = _held[key]
            _held[key] = (fd, holds - 1)
        return
    path = os.path.join(key, lock_name)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"cannot create the lock file '{path}' ({e.strerror}); every command that reads or "
                              "writes an array folder needs to write there: make the folder writable") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _holder(fd)
            os.close(fd)
            raise ArrayBusyError(f"{what} '{array_dir}' is in use by {_describe(info)}; one command at a "
                                 f"time per {what}: wait for it to end, or stop it") from None
        try:  # the holder before us removes the file as it releases it: lock the file that is there now
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    previous = _holder(fd)
    if previous.get("pid"):
        log.info("%s '%s': %s ended without releasing its lock (killed?); taking over", what, array_dir,
                 _describe(previous))
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps({"pid": os.getpid(), "command": command,
                             "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    _held[key] = (fd, 1)
    try:
        yield
    finally:
        del _held[key]
        with contextlib.suppress(OSError):  # released cleanly: no file (a file left behind names a killed holder)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:  # not when the folder was replaced meanwhile (fuse)
                os.remove(path)
        os.close(fd)  # closing the last descriptor releases the flock
