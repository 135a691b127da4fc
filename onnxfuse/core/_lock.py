"""One command at a time per folder onnxfuse writes: an exclusive ``flock`` on the file ``.onnxfuse.lock`` in it.

The folders other commands go on working in, arrays and sweep folders, carry this file from birth, empty while
nobody holds it: it marks them as onnxfuse's, so that a command writing anything *inside* one holds it first
(``_io.claim_output``). Any other folder a command writes (``export``'s, ``split``'s, ``place``'s output) has the
file only while that command holds it. Holding a folder covers everything in it: a process that holds an array
writes its ``trained/`` and checkpoints without taking more locks.

The kernel releases a ``flock`` when its process ends, however it ends (SIGKILL included), so a lock left behind
by a killed process is never in the way: the next command takes it over (and logs it). The holder writes its pid,
command and start time into the file, so that a second process can say who holds the folder; a clean release
empties the file again (a file that still names a holder names a killed one), or removes it where onnxfuse added
it to a folder it did not make. A process that locked the file while the folder was being replaced (an output
renamed into place) sees that the path no longer names its file and locks the new one, so two processes never
both hold the folder.

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

from onnxfuse.core.errors import ArrayBusyError, OutputError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["LOCK_FILE", "folder_lock", "holds", "locked_folders_around"]

LOCK_FILE = ".onnxfuse.lock"

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


def holds(path: str | os.PathLike) -> bool:
    """Whether this process holds ``path`` or a folder around it (holding a folder covers everything in it)."""
    real = os.path.realpath(os.fspath(path))
    return any(real == k or real.startswith(k.rstrip(os.sep) + os.sep) for k in _held)


def locked_folders_around(path: str | os.PathLike) -> list[str]:
    """The folders above ``path`` that carry a lock file (onnxfuse's folders), outermost first."""
    real, found = os.path.realpath(os.fspath(path)), []
    parent = os.path.dirname(real)
    while parent and parent != real:
        if os.path.isfile(os.path.join(parent, LOCK_FILE)):
            found.append(parent)
        real, parent = parent, os.path.dirname(parent)
    return found[::-1]


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, command: str, what: str = "array folder", remove: bool = False
                ) -> Iterator[None]:
    """Hold ``folder``'s lock for ``command`` (a word for messages: train, split, ...); raise
    :class:`ArrayBusyError` naming the holder when another process holds it. The folder must exist. ``what``
    names the kind of folder in messages. ``remove``: the lock file is removed on release (onnxfuse added it to a
    folder it did not make), else it is left empty (the folder's mark)."""
    global _warned
    key = os.path.realpath(os.fspath(folder))
    if fcntl is None:  # pragma: no cover
        if not _warned:
            log.warning("this platform has no fcntl: folders are not locked; run one command per folder")
            _warned = True
        yield
        return
    if key in _held:
        fd, count = _held[key]
        _held[key] = (fd, count + 1)
        try:
            yield
        finally:
            fd, count = _held[key]
            _held[key] = (fd, count - 1)
        return
    path = os.path.join(key, LOCK_FILE)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"cannot create the lock file '{path}' ({e.strerror}); every command that reads or "
                              f"writes an onnxfuse folder needs to write there: make the folder writable") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _holder(fd)
            os.close(fd)
            raise ArrayBusyError(f"{what} '{folder}' is in use by {_describe(info)}; one command at a "
                                 f"time per {what}: wait for it to end, or stop it") from None
        try:  # the folder was replaced while we locked its old file: lock the file that is there now
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    previous = _holder(fd)
    if previous.get("pid"):
        log.info("%s '%s': %s ended without releasing its lock (killed?); taking over", what, folder,
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
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # released cleanly: the file names nobody (one naming a holder names a killed one)
            if remove and os.stat(path).st_ino == os.fstat(fd).st_ino:  # not a replaced folder's new file
                os.remove(path)
        os.close(fd)  # closing the last descriptor releases the flock
