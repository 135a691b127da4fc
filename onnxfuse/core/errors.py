"""One exception type per kind of bad input; every message names the thing and says how to fix it.

``as_user_error`` recognizes the failures a user causes or fixes that arrive from below as other exceptions (a
full disk, a read-only folder, out of memory, from Python, safetensors or ONNX Runtime) and turns them into
these types, so that the command line reports them as one ``onnxfuse: error:`` line (exit status 2) rather than as
an internal error."""
from __future__ import annotations

import errno
import os
import shlex

__all__ = [
    "OnnxFuseError",
    "InputFileError",
    "NotFusibleError",
    "UnsupportedOpError",
    "UntrainableOpError",
    "ExportMismatchError",
    "ConfigError",
    "DataError",
    "PlacementError",
    "TrainingStoppedError",
    "VerificationError",
    "ArrayBusyError",
    "OutputError",
    "OutOfMemoryError",
    "as_user_error",
    "shell",
    "TORCH_CUDA_FIX",
    "ORT_CUDA_FIX",
]


class OnnxFuseError(Exception):
    """Base class of every error onnxfuse reports to a user (the CLI prints these as one line)."""


class InputFileError(OnnxFuseError):
    """A file or folder given to onnxfuse is missing, unreadable or not what it should be."""


class NotFusibleError(OnnxFuseError):
    """The B models are not the same graph up to weights, or a node cannot be fused as it is."""


class UnsupportedOpError(NotFusibleError):
    """A node's op type has no fusion rule."""

    def __init__(self, node_name: str, op_type: str, model: str, supported: list[str]):
        self.node_name, self.op_type, self.supported = node_name, op_type, supported
        super().__init__(
            f"{model}: node '{node_name}' has op type '{op_type}', which has no fusion rule; "
            f"supported op types: {', '.join(sorted(supported))}. "
            f"To fix this, replace the layer that exports to '{op_type}' or add a rule in onnxfuse/core/rules/."
        )


class UntrainableOpError(NotFusibleError):
    """A node onnxruntime-training cannot differentiate (or run backward on CPU) and that no legalization rewrite
    can turn into a trainable form."""


class ExportMismatchError(NotFusibleError):
    """An ONNX graph does not compute what the torch module it was exported from computes (an exporter's
    mistake, an export in another mode, a file that is not that module's): nothing trains it. ``output``: the
    first graph output that differs; ``node``: the node found to cause it, or ''."""

    def __init__(self, message: str, output: str = "", node: str = ""):
        super().__init__(message)
        self.output, self.node = output, node


class ConfigError(OnnxFuseError):
    """A training or command-line setting is invalid (wrong length, negative, unknown name...)."""


class TrainingStoppedError(OnnxFuseError):
    """A training run stopped early on purpose (e.g. ``--on-diverge stop``); its state up to then is saved."""


class DataError(OnnxFuseError):
    """A data file does not match the graph's inputs."""


class PlacementError(OnnxFuseError):
    """A graph cannot be placed on the given devices (it does not fit their memory, a placement names a missing
    device, a placer does not apply to this graph...)."""


class VerificationError(OnnxFuseError):
    """The fused array's training of some model differs from that model trained alone on the same runtime (the
    run-time check of ``onnxfuse train --verify-steps`` and ``onnxfuse check``): the array would train it wrongly.
    Nothing is written; the CLI exits with status 4."""


class ArrayBusyError(OnnxFuseError):
    """Another process holds the array folder's lock (one command at a time per array folder). ``holder``: who
    holds it, as messages name it (`` `onnxfuse train` (pid 123, started ...)``)."""

    def __init__(self, message: str, holder: str = ""):
        super().__init__(message)
        self.holder = holder


class OutputError(OnnxFuseError):
    """Something cannot be written: the disk is full, the location is read-only or not a folder."""


class OutOfMemoryError(OnnxFuseError):
    """The machine (or the device) ran out of memory."""


# errno -> (what happened, how to fix it); the message names the path when the error carries one
_OS_ERRORS = {
    errno.ENOSPC: ("the disk is full", "free space on it"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space or raise the quota"),
    errno.EFBIG: ("the file is larger than this system allows", "raise the file size limit (ulimit -f)"),
    errno.EROFS: ("the location is read-only", "choose a writable location"),
    errno.EACCES: ("permission denied", "choose a location you may write to, or fix its permissions"),
    errno.EPERM: ("operation not permitted", "choose a location you may write to, or fix its permissions"),
    errno.ENOTDIR: ("a part of the path is a file, not a folder", "choose another path"),
    errno.EISDIR: ("the path is a folder", "give a file path"),
    errno.ENAMETOOLONG: ("the path is too long", "choose a shorter path"),
    errno.ENOENT: ("no such file or folder", "check the path"),
}
# the same conditions as other libraries word them (safetensors: Rust's io::Error; ONNX Runtime: its C++ message)
_TEXT = [("no space left on device", errno.ENOSPC), ("os error 28", errno.ENOSPC), ("storagefull", errno.ENOSPC),
         ("disk quota exceeded", errno.EDQUOT), ("file too large", errno.EFBIG), ("os error 27", errno.EFBIG),
         ("read-only file system", errno.EROFS), ("os error 30", errno.EROFS),
         ("permission denied", errno.EACCES), ("os error 13", errno.EACCES)]
_OOM_TEXT = ("failed to allocate memory", "bad_alloc", "out of memory", "cannot allocate memory")
OOM_FIX = "use a smaller batch_size=, or fewer models per array (fuse fewer, or train them in several arrays)"
# How to get CUDA, said the same way by every message about a build without it (README, "Install": onnxfuse is
# installed from its checkout, not from PyPI)
TORCH_CUDA_FIX = ("install the torch build for your CUDA (pip install torch --index-url "
                  "https://download.pytorch.org/whl/cu130, or your cluster's; README, \"Install\")")
ORT_CUDA_FIX = ("install the GPU build in onnxfuse's checkout: `make install EXTRA=gpu` or `pip install -e \".[gpu]\"` "
                "(CUDA 11.8 + cuDNN 8; README, \"Install\")")


def as_user_error(exc: BaseException, path: str | None = None) -> OnnxFuseError | None:
    """``exc`` as the user error it is (naming ``path``, else the path the error carries), or None for anything
    else (a bug: the CLI reports it as an internal error)."""
    if isinstance(exc, OnnxFuseError):
        return exc
    one_line = " ".join(str(exc).split())
    text = one_line.lower()
    oom = isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM) or \
        (not isinstance(exc, OSError) and any(t in text for t in _OOM_TEXT))
    if oom:  # ONNX Runtime's message opens with the node and source line: quote from the cause on
        at = min([text.find(t) for t in _OOM_TEXT if t in text] or [0])
        detail = f" ({one_line[at:at + 200]})" if one_line else ""
        return OutOfMemoryError(f"out of memory{detail}; {OOM_FIX}")
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None:
        code = next((c for t, c in _TEXT if t in text), None)
    if code not in _OS_ERRORS:
        return None
    what, fix = _OS_ERRORS[code]
    where = path or getattr(exc, "filename", None)  # the caller's name for it (not a temporary file's)
    where = f"'{where}'" if where else "a file"
    return OutputError(f"{where}: {what}; {fix}, then run the command again")


def shell(*words: str | os.PathLike) -> str:
    """A command a message suggests, as one line the shell runs as shown: each word quoted where it needs it (a
    path with a space)."""
    return shlex.join(os.fspath(w) for w in words)
