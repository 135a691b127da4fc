"""Writing folders atomically: build in a temporary sibling, then rename, so a failure leaves nothing behind; and
reading the files onnxfuse is given, each failure one error naming the file (``load_safetensors``, ``read_onnx``).

Every output goes through ``claim_output`` (``atomic_dir`` for a folder replaced as a whole, ``atomic_file`` for
one file, ``atomic_files`` for several into a folder): it refuses an empty path, holds the folders around the
output, the output and every onnxfuse folder inside a folder it replaces (``_lock.py``), and gives each file it
writes the mode a new file gets under the umask.

The temporary names start with a dot and end in ``.tmp-<random>`` / ``.old-<random>``: a process killed in between
leaves them, and the next command holding what they belong to removes them (``remove_temporaries``)."""
from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import tempfile
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import onnx

from onnxfuse.core._graph import subgraphs
from onnxfuse.core._lock import LOCK_FILE, folder_lock, holds, locked_folders_around, locked_folders_inside
from onnxfuse.core._opset import check_opset_supported
from onnxfuse.core.errors import ArrayBusyError, ConfigError, InputFileError, OutputError, as_user_error

__all__ = ["atomic_dir", "atomic_files", "claim_output", "check_output_path", "check_output_dir",
           "check_output_file", "hold_inside", "remove_temporaries", "atomic_file", "atomic_write_bytes",
           "give_modes", "load_safetensors", "check_tensors", "read_onnx", "read_model", "check_model_contents",
           "check_no_external_data"]

_TEMPORARY = re.compile(r"^\..+\.(tmp|old)-\w+$")  # what atomic_dir and atomic_file create


def _only_marks(path: str) -> bool:
    """A folder that holds nothing but an onnxfuse lock file counts as empty (a command killed while it held a
    new output folder leaves that)."""
    return all(name == LOCK_FILE for name in os.listdir(path))


def check_output_path(path: str | os.PathLike) -> str:
    """``path`` as given, refused when it is empty or only spaces: it would name the current folder (``''``
    resolves to it), which ``--overwrite`` replaces as a whole. Every output check starts here."""
    shown = os.fspath(path)
    if not shown.strip():
        raise ConfigError(f"the output path {shown!r} is {'empty' if not shown else 'only spaces'}: it would "
                          "name the current folder; give the output's path (-o PATH)")
    return shown


def check_output_dir(path: str, overwrite: bool) -> None:
    """Refuse to replace a non-empty folder unless asked to, and a path under a file (checked before any work
    starts)."""
    check_output_path(path)
    _check_parent(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise InputFileError(f"output '{path}' exists and is not a folder; choose another path")
        if not overwrite and not _only_marks(path):
            raise InputFileError(f"output folder '{path}' already exists and is not empty; "
                                 "pass overwrite=True to replace it or choose another folder")


def _check_parent(path: str) -> None:
    parent = os.path.dirname(os.path.normpath(os.path.abspath(path)))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent) if os.path.dirname(parent) != parent else ""
    if parent and not os.path.isdir(parent):
        raise InputFileError(f"output '{path}' cannot be created: '{parent}' is a file, not a folder; "
                             "choose another path")


def check_output_file(path: str) -> None:
    """Refuse a file output (``plan -o``, ``report -o``) that is a folder or lies under a file."""
    check_output_path(path)
    if os.path.isdir(path):
        raise InputFileError(f"output '{path}' is a folder; give a file path")
    _check_parent(path)


@contextlib.contextmanager
def claim_output(path: str | os.PathLike, command: str, *, overwrite: bool = False, replace: bool = True,
                 is_file: bool = False, mark: bool = False, what: str = "output folder") -> Iterator[str]:
    """Hold what writing the output ``path`` needs, for ``command`` (a word for messages), and yield its real path
    (a symbolic link is followed: the folder it names is written, the link stays).

    The output is checked first (``check_output_dir``; ``replace`` False: a folder written in place, e.g. a
    sweep's, need only be a folder or absent; ``is_file``: ``check_output_file``). Then every onnxfuse folder
    around it (one carrying a lock file) and the output folder itself are locked, so that no other onnxfuse
    command writes, replaces or trains in them meanwhile: a folder that does not exist yet is created to hold its
    lock (and removed again if the command writes nothing into it). Nothing is locked where this process already
    holds the output or a folder around it. Stale temporaries of the output (``.NAME.tmp-*``, ``.NAME.old-*``
    beside it, left by a killed process) are removed under its lock. The lock file goes again when the command
    ends, unless the folder had one (an onnxfuse folder) or ``mark`` (a folder written in place that becomes one: a
    sweep's). ``what`` names the folder in messages.

    A folder to be replaced (``replace``) takes every folder inside it with it: each onnxfuse folder in it (one
    carrying a lock file, at any depth) is held too, so that one another command holds (``train P/A`` while
    ``split -o P --overwrite``) is refused naming that command, before any work (``hold_inside``).
    ``atomic_dir`` holds them again just before the replacing rename, for those that appeared meanwhile."""
    shown = check_output_path(path)
    real = os.path.realpath(shown)
    if is_file:
        check_output_file(shown)
    elif replace:
        check_output_dir(shown, overwrite)
    elif os.path.exists(real) and not os.path.isdir(real):
        raise InputFileError(f"output '{shown}' exists and is not a folder; choose another path")
    else:
        _check_parent(shown)
    if holds(real):
        yield real
        return
    with contextlib.ExitStack() as stack:
        for around in locked_folders_around(real):
            stack.enter_context(folder_lock(around, command, "folder"))
        if is_file:
            yield real
            return
        created = False
        try:
            os.makedirs(real)
            created = True
        except FileExistsError:
            pass
        except OSError as e:  # a read-only location, a file where a folder should be, ...
            raise (as_user_error(e, shown) or e) from e
        try:
            marked = os.path.isfile(os.path.join(real, LOCK_FILE))
            stack.enter_context(folder_lock(real, command, what, remove=not (marked or mark)))
            if replace:
                check_output_dir(real, overwrite)  # again, holding it: another command may have filled it
                stack.enter_context(hold_inside(real, shown, command))
                remove_temporaries(os.path.dirname(real), of=os.path.basename(real))
            yield real
        finally:
            if created and os.path.isdir(real) and _only_marks(real):  # nothing was written into it
                stack.close()
                with contextlib.suppress(OSError):
                    for name in os.listdir(real):
                        os.remove(os.path.join(real, name))
                    os.rmdir(real)


@contextlib.contextmanager
def hold_inside(real: str, shown: str, command: str) -> Iterator[None]:
    """Hold, for ``command``, every onnxfuse folder inside the folder ``real`` (the output ``shown``) that a
    replacing rename would take with it (``locked_folders_inside``); one another process holds is an
    ArrayBusyError naming the output, the folder and its holder, and nothing is held."""
    with contextlib.ExitStack() as stack:
        for inner in locked_folders_inside(real):
            try:
                stack.enter_context(folder_lock(inner, command, "folder"))
            except ArrayBusyError as e:
                if not e.holder:
                    raise
                where = os.path.join(shown, os.path.relpath(inner, real))
                raise ArrayBusyError(f"output folder '{shown}' holds '{where}', which is in use by {e.holder}; "
                                     f"replacing '{shown}' would delete it: wait for that command to end or stop "
                                     "it, or choose another output folder", e.holder) from None
        yield


def remove_temporaries(folder: str, of: str | None = None) -> list[str]:
    """Remove the temporary files and folders in ``folder`` that ``atomic_dir`` and ``atomic_file`` leave
    when killed (only those of the output named ``of``, when given); call it holding what they belong to. Returns
    the paths removed."""
    removed = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if _TEMPORARY.match(name) and (of is None or name.startswith(f".{of}.")):
            path = os.path.join(folder, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)
            removed.append(path)
    return removed


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False, *, command: str, mark: bool = False
               ) -> Iterator[str]:
    """Yield a temporary folder; on success it replaces ``path`` in one rename, on error it is removed. The output
    is held for ``command`` throughout (``claim_output``), and so is every onnxfuse folder inside the folder it
    replaces (``hold_inside``). ``mark``: the new folder carries the lock file that marks it as an onnxfuse folder
    (an array), so that every later command writing in it holds it first. Every file and folder in it gets the
    mode a new one gets under the umask (``give_modes``), whichever library wrote it."""
    shown = os.fspath(path)
    with claim_output(shown, command, overwrite=overwrite) as real:
        parent = os.path.dirname(real)
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(real)}.tmp-", dir=parent)
            if mark:
                open(os.path.join(tmp, LOCK_FILE), "wb").close()
        except OSError as e:  # a read-only location, a file where a folder should be, ...
            raise (as_user_error(e, shown) or e) from e
        try:
            yield tmp
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            user = _named(e, shown, tmp, shown)  # a full disk or a read-only folder while writing: name the output
            if user is None or user is e:
                raise
            raise user from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with contextlib.ExitStack() as inside:
            try:
                give_modes(tmp)  # mkdtemp's folder is private (0700), safetensors' files too (0600)
                old = None
                if os.path.exists(real):
                    # what appeared inside since the claim is held too (the claim's holds are counted again)
                    inside.enter_context(hold_inside(real, shown, command))
                    old = tempfile.mkdtemp(prefix=f".{os.path.basename(real)}.old-", dir=parent)
                    os.rmdir(old)
                    os.rename(real, old)
                os.rename(tmp, real)
            except BaseException as e:
                shutil.rmtree(tmp, ignore_errors=True)
                if isinstance(e, OSError):
                    raise (as_user_error(e, shown) or e) from e
                raise
            if old:
                shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_files(folder: str | os.PathLike) -> Iterator[Callable[[str], contextlib.AbstractContextManager[str]]]:
    """Write several files into ``folder`` (which the caller holds), all of them or none: a command that writes
    more than one file into a folder it does not replace as a whole (``bench -o``) never leaves the first few.

    Yields ``stage``: ``with stage("bench.json") as path:`` gives the path to write that file at, in a temporary
    folder inside ``folder``; a failure while writing it is the one-line error ``as_user_error`` makes of it,
    naming the file as it will be (``folder/bench.json``). When the block ends every staged file is renamed into
    ``folder`` (replacing one of that name) with the mode a new file gets; when it fails none is, and the
    temporary folder is removed."""
    folder = os.fspath(folder)
    remove_temporaries(folder, of=_FILES)  # a killed writer's
    try:
        tmp = tempfile.mkdtemp(prefix=f".{_FILES}.tmp-", dir=folder)
    except OSError as e:
        raise (as_user_error(e, folder) or e) from e

    @contextlib.contextmanager
    def stage(name: str) -> Iterator[str]:
        final = os.path.join(folder, name)
        try:
            yield os.path.join(tmp, name)
        except Exception as e:
            user = _named(e, final, tmp, folder)
            if user is None or user is e:
                raise
            raise user from e

    try:
        yield stage
        try:
            give_modes(tmp)
            for name in sorted(os.listdir(tmp)):
                os.replace(os.path.join(tmp, name), os.path.join(folder, name))
        except OSError as e:
            raise (as_user_error(e, folder) or e) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _named(e: Exception, path: str, tmp: str, final: str) -> Exception | None:
    """``as_user_error(e, path)``, where a file in the temporary folder ``tmp`` is named by the name it gets in
    ``final`` (an ``atomic_file`` inside it named its own temporary path)."""
    user = as_user_error(e, path)
    if isinstance(user, OutputError) and tmp + os.sep in str(user):
        user = OutputError(str(user).replace(tmp + os.sep, final + os.sep))
    return user


_FILES = "onnxfuse-files"  # atomic_files' temporary folder: .onnxfuse-files.tmp-*


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (os.umask sets it to read it, which
    another thread creating a file at that moment would feel)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def give_modes(path: str) -> None:
    """Give the file ``path``, or the folder ``path`` and every file and folder in it, the mode a new file or
    folder gets under the umask (0666 / 0777 less it, as ``open`` and ``mkdir`` give them), whichever library wrote
    them: safetensors makes its files private (0600). Symbolic links are left alone."""
    umask = _umask()
    if os.path.islink(path):
        return
    if not os.path.isdir(path):
        os.chmod(path, 0o666 & ~umask)
        return
    os.chmod(path, 0o777 & ~umask)
    for root, dirs, files in os.walk(path):
        for names, mode in ((dirs, 0o777), (files, 0o666)):
            for name in names:
                p = os.path.join(root, name)
                if not os.path.islink(p):
                    os.chmod(p, mode & ~umask)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path next to ``path`` (``.<name>.tmp-<pid>``) to write the file at, by any writer (bytes,
    ``onnx.save``, a copy); when the block ends the file is synced to disk and renamed over ``path`` in one step,
    so that a reader finds the old file or the whole new one, never a part, with the mode a new file gets
    (``give_modes``). If the block fails the temporary file is removed and the error goes on (a full disk or a
    read-only folder, from Python or a library such as safetensors, as the one-line error ``as_user_error`` makes
    of it, naming ``path``); what a killed writer leaves, ``remove_temporaries`` removes."""
    path = check_output_path(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        give_modes(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        user = as_user_error(e, path) if isinstance(e, Exception) else None  # safetensors' errors too
        if user is None or user is e:
            raise
        raise user from e


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to the file ``path`` whole or not at all (:func:`atomic_file`)."""
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def load_safetensors(path: str, fix: str, expected: Mapping[str, tuple[Sequence[int], str]] | None = None) -> dict:
    """The tensors of a safetensors file; a missing, truncated or corrupt file is one InputFileError naming it,
    ending with ``fix`` (what to do about it). ``expected`` ({name: (shape, dtype)}): the file must hold exactly
    these tensors (``check_tensors``)."""
    from safetensors.numpy import load_file

    if not os.path.exists(path):
        raise InputFileError(f"'{path}' is missing; {fix}")
    try:
        tensors = load_file(path)
    except Exception as e:  # safetensors raises its own error types for truncated or garbled files
        cause = " ".join(str(e).split())[:120]
        raise InputFileError(f"'{path}' is not readable (truncated or corrupt: {cause}); {fix}") from e
    if expected is not None:
        check_tensors(tensors, expected, path, fix)
    return tensors


def check_tensors(tensors: Mapping[str, np.ndarray], expected: Mapping[str, tuple[Sequence[int], str]], path: str,
                  fix: str) -> None:
    """``tensors`` (read from ``path``) are exactly ``expected``: every name there, none other, each with its
    shape and dtype; else one InputFileError naming the file and the first tensor that is not, ending with
    ``fix``. A file of the right format but the wrong content (edited, or from another array) fails here, not
    as a reshape error deep in training or splitting."""
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputFileError(f"'{path}' has no tensor '{missing[0]}'{more}, which the array needs; {fix}")
    extra = [n for n in tensors if n not in expected]
    if extra:
        raise InputFileError(f"'{path}' holds a tensor '{extra[0]}' the array does not have; {fix}")
    for name, (shape, dtype) in expected.items():
        a = tensors[name]
        if tuple(a.shape) != tuple(shape) or a.dtype != np.dtype(dtype):
            raise InputFileError(f"'{path}': tensor '{name}' is {a.dtype} {list(a.shape)}, but the array's is "
                                 f"{np.dtype(dtype)} {list(shape)}; {fix}")


def read_onnx(path: str | os.PathLike, fix: str = "re-export it") -> onnx.ModelProto:
    """The model in the ONNX file ``path`` with its external data read in: the one loader of ONNX files in
    onnxfuse. Every way the file can be wrong is one InputFileError naming it and ending with ``fix`` (what the
    caller's user should do, e.g. "re-run `onnxfuse fuse`").

    External data is read only from inside the model's own folder (the real path of the folder the .onnx file is
    in), symlinks followed: onnx's own loader refuses ``../x.bin`` and absolute locations but follows a symlink
    wherever it points, so a model could otherwise make onnxfuse read any file its user can read, and
    ``onnxfuse split`` write it out as weights."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise InputFileError(f"model file '{path}' does not exist; {fix}")
    if os.path.isdir(path):
        raise InputFileError(f"'{path}' is a folder, not an ONNX model file; give the .onnx file in it")
    if os.path.getsize(path) == 0:
        raise InputFileError(f"'{path}' is empty (0 bytes), not an ONNX model; {fix}")
    try:
        model = onnx.load(path, load_external_data=False)
    except OSError as e:
        raise InputFileError(f"'{path}' cannot be read ({e.strerror or e}); {fix}") from e
    except Exception as e:  # protobuf's DecodeError, a RuntimeWarning, ...: the bytes are not a ModelProto
        raise InputFileError(f"'{path}' is not a readable ONNX model: it is not ONNX protobuf, or it is truncated "
                             f"({_first_line(e)}); {fix}") from e
    if not model.HasField("graph") or not model.opset_import:
        # protobuf parses many byte strings (a cut at a field boundary, other protobuf messages) without error
        raise InputFileError(f"'{path}' is not a readable ONNX model: it parses as protobuf but has no "
                             f"{'graph' if not model.HasField('graph') else 'opset_import'} (truncated, or not an "
                             f"ONNX file); {fix}")
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    for tensor in _all_tensors(model):
        if tensor.HasField("data_location") and tensor.data_location == onnx.TensorProto.EXTERNAL:
            _read_external(tensor, path, folder, fix)
    check_model_contents(model, f"'{path}'", fix)
    return model


def read_model(model: str | os.PathLike | onnx.ModelProto, label: str | None = None,
               fix: str = "re-export it") -> tuple[onnx.ModelProto, str]:
    """A model its caller names by path (read by :func:`read_onnx`) or hands over in memory (refused by
    :func:`check_no_external_data` while it still points at external data), and the label that names it in
    messages: ``label``, else the file's name, else "model". Not a copy: a caller that changes it copies it."""
    if isinstance(model, onnx.ModelProto):
        label = label or "model"
        check_no_external_data(model, label)
        check_model_contents(model, label, fix)
        return model, label
    path = os.fspath(model)
    return read_onnx(path, fix), label or os.path.basename(path)


def _first_line(e: BaseException) -> str:
    return (" ".join(str(e).split())[:120]) or type(e).__name__


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of ``graph``: initializers, sparse initializers, node attributes, and those of subgraphs
    (onnx.external_data_helper's iterators skip sparse tensors, which can be external too)."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        yield from _node_tensors(node)
        for g in subgraphs(node):
            yield from _graph_tensors(g)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    """The tensors ``node``'s own attributes hold (not its subgraphs')."""
    for a in node.attribute:
        if a.HasField("t"):
            yield a.t
        yield from a.tensors
        for sparse in ([a.sparse_tensor] if a.HasField("sparse_tensor") else []) + list(a.sparse_tensors):
            yield from (sparse.values, sparse.indices)


def _all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)
            for g in subgraphs(node):
                yield from _graph_tensors(g)


def check_model_contents(model: onnx.ModelProto, label: str, fix: str) -> None:
    """What onnxfuse reads of a model it is given, checked before any pass reads it, so that a model file cut short
    or edited is one InputFileError naming ``label``, the tensor or input and what is wrong (ending with ``fix``),
    never a reshape error deep in fusion: its default-domain opset is one onnxfuse reads
    (``_opset.check_opset_supported``); every tensor it holds (initializers, constants, sparse parts, in
    subgraphs too) has a known type, no negative dimension and exactly the data its type and shape need; every
    graph input's dimensions are not negative."""
    check_opset_supported(model, label)
    initializers = {t.name for t in model.graph.initializer}
    for tensor in _all_tensors(model):
        what = f"{label}: {'initializer' if tensor.name in initializers else 'tensor'} '{tensor.name}'"
        problem = _tensor_problem(tensor)
        if problem:
            raise InputFileError(f"{what} {problem}; {fix}")
    for vi in model.graph.input:
        t = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in t.shape.dim] \
            if t is not None and t.HasField("shape") else []
        if any(isinstance(d, int) and d < 0 for d in dims):
            raise InputFileError(f"{label}: input '{vi.name}' has shape {dims}: a dimension is negative; give it "
                                 f"a size or a name (dim_param); {fix}")


def _tensor_problem(tensor: onnx.TensorProto) -> str | None:
    """What is wrong with ``tensor``'s data as read (its data in the file itself: external data is read in
    first), or None: a data type onnx does not define, a negative dimension, or fewer or more bytes or values than
    its type and shape need."""
    if tensor.data_type not in onnx.TensorProto.DataType.values():
        return f"has data type {tensor.data_type}, which ONNX does not define"
    type_name = onnx.TensorProto.DataType.Name(tensor.data_type)
    dims = list(tensor.dims)
    if any(d < 0 for d in dims):
        return f"has shape {dims}: a dimension is negative"
    if type_name == "UNDEFINED" or tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None  # no data to count (a sparse tensor's placeholder); external data: checked when read
    count = math.prod(dims)
    if tensor.HasField("raw_data"):
        need = _tensor_bytes(tensor)
        if need is not None and len(tensor.raw_data) != need:
            return (f"has {len(tensor.raw_data)} bytes of data, but a {type_name} tensor of shape {dims} needs "
                    f"{need} (the file is cut short or was edited)")
        return None
    field = onnx.helper.tensor_dtype_to_field(tensor.data_type)
    per_value = 2 if type_name.startswith("COMPLEX") else 1
    values = len(getattr(tensor, field))
    need = (count + 1) // 2 if type_name in _FOUR_BIT else count * per_value
    if values != need:
        return (f"holds {values} values in {field}, but a {type_name} tensor of shape {dims} needs {need} (the "
                "file is cut short or was edited)")
    return None


_FOUR_BIT = ("INT4", "UINT4", "FLOAT4E2M1")  # two values per byte (raw) or per int32_data entry


def check_no_external_data(model: onnx.ModelProto, label: str) -> None:
    """A model handed over in memory holds all its data: one with a tensor still stored externally (read with
    ``load_external_data=False``) would have it read by onnx relative to the current folder, unchecked by
    :func:`read_onnx`; refuse it naming the tensor."""
    for tensor in _all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            where = next((e.value for e in tensor.external_data if e.key == "location"), "?")
            raise InputFileError(f"{label}: tensor '{tensor.name}' still has its data in the external file "
                                 f"'{where}' (the model was read with load_external_data=False); give the .onnx "
                                 "file's path instead, or load the model with its data (onnx.load(path))")


def _read_external(tensor: onnx.TensorProto, path: str, folder: str, fix: str) -> None:
    """Read ``tensor``'s external data into ``raw_data``, in place, after checking that it lies inside ``folder``
    (symlinks followed) and is as long as the tensor needs."""
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    where = f"'{path}': tensor '{tensor.name}' has its data in external file '{location}'"
    try:  # os.path.join drops `folder` for an absolute location; realpath then resolves `..` and every symlink
        target = os.path.realpath(os.path.join(folder, location))
    except ValueError as e:  # a NUL byte in the location
        raise InputFileError(f"{where}, which is not a valid path ({e}); {fix}") from e
    if os.path.commonpath([folder, target]) != folder:
        link = os.path.normpath(location)
        if os.path.isabs(location) or link == os.pardir or link.startswith(os.pardir + os.sep):
            how = (f"copy the data file into '{folder}' and set the tensor's location to its name there "
                   "(relative to the model's folder)")
        else:  # a symlink (in the location's path) leads out of the folder
            how = (f"replace the symlink by a copy of '{target}', or inline the data: "
                   f"onnx.save(onnx.load('{path}'), '{path}', save_as_external_data=False)")
        resolves = "" if target == location else f" (it resolves to '{target}')"
        raise InputFileError(f"{where}{resolves}, which is outside the model's folder '{folder}'; onnxfuse reads "
                             f"external data only from inside it. To fix this, {how}; or {fix}")
    if not os.path.exists(target):
        raise InputFileError(f"{where}, which does not exist (looked for '{target}'); put the data file next to "
                             f"the model, or {fix}")
    if not os.path.isfile(target):  # a folder, or a FIFO or device that reading could block on forever
        what = "a folder, not a data file" if os.path.isdir(target) else "not a regular file (a FIFO, socket or device)"
        raise InputFileError(f"{where}, which is {what}; {fix}")
    try:
        offset, length = (int(info[k]) if info.get(k) else None for k in ("offset", "length"))
    except ValueError as e:
        raise InputFileError(f"{where} at offset '{info.get('offset')}' length '{info.get('length')}', which "
                             f"are not whole numbers; {fix}") from e
    offset = offset or 0
    size = os.path.getsize(target)
    if offset < 0 or (length is not None and length < 0) or offset + (length or 0) > size:
        raise InputFileError(f"{where} at offset {offset} length {length}, but that file has {size} bytes "
                             f"(truncated, or not this model's data file); {fix}")
    try:
        with open(target, "rb") as f:  # the resolved path: what was checked is what is read
            f.seek(offset)
            data = f.read(length if length is not None else -1)
    except OSError as e:
        raise InputFileError(f"{where}, which cannot be read ({e.strerror or e}); {fix}") from e
    need = _tensor_bytes(tensor)
    if need is not None and len(data) != need:
        raise InputFileError(f"{where}: {len(data)} bytes at offset {offset}, but a "
                             f"{onnx.TensorProto.DataType.Name(tensor.data_type)} tensor of shape "
                             f"{list(tensor.dims)} needs {need} (truncated, or not this model's data file); {fix}")
    tensor.raw_data = data
    tensor.data_location = onnx.TensorProto.DEFAULT
    del tensor.external_data[:]


def _tensor_bytes(tensor: onnx.TensorProto) -> int | None:
    """The bytes of ``tensor``'s raw data, or None where they do not follow from its type (strings, unknown)."""
    name = onnx.TensorProto.DataType.Name(tensor.data_type) if tensor.data_type in \
        onnx.TensorProto.DataType.values() else ""
    count = math.prod(tensor.dims)  # Python's int: no overflow for absurd dims
    if name in _FOUR_BIT:  # two values per byte
        return (count + 1) // 2
    if name in ("", "UNDEFINED", "STRING"):
        return None
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
