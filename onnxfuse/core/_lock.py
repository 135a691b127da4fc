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
both hold the folder. The lock file is opened without following a symbolic link and must be a regular file: one
that is not (a link to a file elsewhere, which the holder's truncate would empty) is refused in one line.

A folder replaced as a whole (``--overwrite``) takes every onnxfuse folder inside it with it: the output helper
holds each of those too before replacing it (``_io.claim_output``), so that one another command uses is refused,
not deleted under it.

A process may take the lock of a folder it already holds (``train_array`` calls nothing that locks again, but the
demo and user scripts chain locked calls): holds are counted per folder. ``fcntl`` exists on Linux and macOS; on
platforms without it the lock is not taken (one warning). On NFS, ``flock`` works where the client maps it to
POSIX locks (Linux since 2.6.12)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from typing import Iterator

from onnxfuse.core.errors import ArrayBusyError, OutputError, as_user_error

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["LOCK_FILE", "folder_lock", "holds", "locked_folders_around", "locked_folders_inside"]

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
    """The folders above ``path`` that carry a lock file (onnxfuse's folders), outermost first. A lock file that is
    not a regular file (a link, a folder) counts: locking it is refused, saying so."""
    real, found = os.path.realpath(os.fspath(path)), []
    parent = os.path.dirname(real)
    while parent and parent != real:
        if os.path.lexists(os.path.join(parent, LOCK_FILE)):
            found.append(parent)
        real, parent = parent, os.path.dirname(parent)
    return found[::-1]


def _open_lock_file(path: str) -> int:
    """A descriptor of the lock file ``path``, created if absent; refused unless it is a regular file in the folder
    itself. It is opened without following a symbolic link (``O_NOFOLLOW``): the holder truncates and writes the
    file, so a ``.onnxfuse.lock`` linking elsewhere would have any file its user may write emptied. ``O_NONBLOCK``:
    a FIFO put there is refused, not waited on."""
    def refuse(mode: int) -> OutputError:
        fix = f"remove it (rm -r '{path}'; onnxfuse makes a new one) and run the command again"
        if stat.S_ISLNK(mode):
            with contextlib.suppress(OSError):
                fix = f"it links to '{os.readlink(path)}'; {fix}"
            return OutputError(f"the lock file '{path}' is a symbolic link, which onnxfuse never writes through; "
                               f"{fix}")
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "a device")
        return OutputError(f"the lock file '{path}' is {kind}, not a regular file; {fix}")

    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):  # refused before opening: opening a device can do things
            raise refuse(mode)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
        with contextlib.suppress(OSError):  # put there since the check above
            mode = os.lstat(path).st_mode
            if not stat.S_ISREG(mode):
                raise refuse(mode) from e
        raise OutputError(f"cannot create the lock file '{path}' ({e.strerror}); every command that reads or "
                          f"writes an onnxfuse folder needs to write there: make the folder writable") from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise refuse(mode)
    return fd


def locked_folders_inside(path: str | os.PathLike) -> list[str]:
    """The folders inside ``path``, at any depth, that carry a lock file (onnxfuse's folders: arrays, sweeps, an
    output being written), outermost first, in name order; ``path`` itself is not one of them. Symbolic links are
    not followed: replacing ``path`` removes a link, never what it points to."""
    real, found = os.path.realpath(os.fspath(path)), []
    if not os.path.isdir(real):
        return found
    for root, dirs, files in os.walk(real):
        dirs.sort()
        if LOCK_FILE in dirs:  # a folder by that name: not walked into, refused when locked
            dirs.remove(LOCK_FILE)
            files.append(LOCK_FILE)
        if root != real and LOCK_FILE in files:
            found.append(root)
    return found


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
        fd = _open_lock_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_holder(fd))
            os.close(fd)
            raise ArrayBusyError(f"{what} '{folder}' is in use by {holder}; one command at a "
                                 f"time per {what}: wait for it to end, or stop it", holder) from None
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
    try:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps({"pid": os.getpid(), "command": command,
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    except OSError as e:  # a full disk: the holder's record does not fit
        os.close(fd)
        raise (as_user_error(e, path) or e) from e
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
