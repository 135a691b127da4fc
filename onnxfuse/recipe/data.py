"""Training data: one array per graph input plus ``labels``, taken in batches of N (shuffled per epoch or in
file order).

A shared array ``[n, ...]`` gives every model of the array the same batch. An array of a *per-model* graph input
(fused with ``per_model_inputs``), and ``labels`` with ``per_model_labels``, has a leading model axis ``[B, n, ...]``:
model b's sample i is ``a[b, i]``, and a batch takes the same sample indices for every model (axis 1)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from onnxfuse.core.errors import DataError, InputFileError

from onnxfuse.recipe.losses import AS_GIVEN, LABELS

__all__ = ["Dataset", "load_npz", "make_dataset", "resolved_label_dtype", "check_kind", "check_finite", "batches", "BatchSampler"]


@dataclass
class Dataset:
    arrays: dict[str, np.ndarray]  # graph input name -> [n, ...] (or [B, n, ...] when per model), and "labels"
    per_model: frozenset[str] = field(default_factory=frozenset)  # names whose arrays have a leading model axis

    def __len__(self) -> int:
        name, a = next(iter(self.arrays.items()))
        return a.shape[1] if name in self.per_model else len(a)

    def batch(self, idx) -> dict[str, np.ndarray]:
        """The arrays at sample indices ``idx`` (an index array or a slice): axis 1 of per-model arrays."""
        return {k: (v[:, idx] if k in self.per_model else v[idx]) for k, v in self.arrays.items()}


_ZIP, _NPY = b"PK", b"\x93NUMPY"  # what an .npz (a zip archive of .npy files) and a single .npy start with


def load_npz(path: str | os.PathLike, what: str = "data file",
             fix: str = "write one with numpy.savez(path, input=..., labels=...)") -> dict[str, np.ndarray]:
    """The arrays of an .npz file by name: the one reader of .npz files (training data, ``place --inputs``). A
    file that is not one is an InputFileError naming ``what`` it is (a flag, "data file"), saying what the file
    is instead and ending with ``fix``."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise InputFileError(f"{what} '{path}' does not exist")
    if os.path.isdir(path):
        raise InputFileError(f"{what} '{path}' is a folder; give an .npz file (numpy.savez)")
    try:
        with open(path, "rb") as f:
            head = f.read(len(_NPY))
        if head.startswith(_NPY):
            raise InputFileError(f"{what} '{path}' is a single .npy array, not an .npz archive of named arrays; "
                                 f"{fix}")
        if not head.startswith(_ZIP):  # np.load would try it as a pickle and blame "pickled data"
            is_what = "empty" if not head else "not an .npz archive (a zip of named arrays)"
            raise InputFileError(f"{what} '{path}' is {is_what}; {fix}")
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except InputFileError:
        raise
    except ValueError as e:
        if "pickle" in str(e).lower():  # an object array: numpy would have to unpickle it
            raise InputFileError(f"{what} '{path}' holds an object array (pickled Python objects), which onnxfuse "
                                 f"does not load; save numeric arrays only: {fix}") from e
        raise InputFileError(f"{what} '{path}' is not a readable .npz file ({type(e).__name__}: {e}); {fix}") from e
    except Exception as e:
        raise InputFileError(f"{what} '{path}' is not a readable .npz file ({type(e).__name__}: {e}); {fix}") from e


def _expected(want: list, per_model: bool, B: int | None) -> str:
    dims = (["B" if B is None else str(B)] if per_model else []) + ["n"] + [str(d) for d in want[1:]]
    return "[" + ", ".join(dims) + "]"


def make_dataset(arrays: dict[str, np.ndarray], inputs: list[dict], label_dtype, label_shape: list | None,
                 source: str = "data", B: int | None = None, per_model_labels: bool = False) -> Dataset:
    """Check ``arrays`` against the graph's inputs and the loss's labels; cast to the graph's dtypes.

    ``inputs`` are the array's input descriptions (``ArraySpec.inputs``: name, shape, dtype, per_model);
    ``label_dtype`` None means the loss takes no labels. Per-model arrays (and labels with ``per_model_labels``)
    must be ``[B, n, ...]``."""
    wanted = [dict(i) for i in inputs]
    label_dtype = resolved_label_dtype(label_dtype, arrays.get(LABELS))
    if label_dtype is not None:
        wanted.append({"name": LABELS, "shape": label_shape, "dtype": np.dtype(label_dtype).name,
                       "per_model": per_model_labels})
    out, per_model = {}, set()
    for spec in wanted:
        name, pm = spec["name"], bool(spec.get("per_model", False))
        if name not in arrays:
            have = ", ".join(sorted(arrays)) or "nothing"
            what = "the loss needs it" if name == LABELS else "a graph input"
            raise DataError(f"{source} has no array '{name}' ({what}); it holds: {have}")
        a = np.asarray(arrays[name])
        if spec["shape"] is None:  # labels a Python loss reads: any shape [n, ...] ([B, n, ...] per model)
            spec["shape"] = [None] * (a.ndim - (1 if pm else 0))
        want = list(spec["shape"] or [])
        if pm:
            if B is None:
                raise DataError(f"{source}: '{name}' is per model but the number of models B is unknown")
            if a.ndim != len(want) + 1 or a.shape[0] != B:
                raise DataError(f"{source}: '{name}' is per model and needs a leading model axis of B={B}, "
                                f"{_expected(want, True, B)}; it has shape {list(a.shape)}")
            per_model.add(name)
        body = a.shape[1:] if pm else a.shape
        if len(body) != len(want) or any(isinstance(d, int) and d != s for d, s in zip(want[1:], body[1:])):
            raise DataError(f"{source}: '{name}' has shape {list(a.shape)} but the graph expects "
                            f"{_expected(want, pm, B)}")
        if name == LABELS and np.issubdtype(np.dtype(label_dtype), np.integer) and not np.issubdtype(a.dtype, np.integer):
            raise DataError(f"{source}: 'labels' must hold integer class indices for this loss, got {a.dtype}")
        check_kind(a, spec["dtype"], name, source)
        out[name] = np.ascontiguousarray(a.astype(spec["dtype"], copy=False))
    n = {k: (v.shape[1] if k in per_model else len(v)) for k, v in out.items()}
    if len(set(n.values())) != 1:
        raise DataError(f"{source}: arrays have different numbers of samples {n}; every array needs one row per "
                        "sample (axis 1 for per-model arrays)")
    return Dataset(out, frozenset(per_model))


def resolved_label_dtype(wanted, labels) -> str | None:
    """The dtype a loss's labels are trained with: ``wanted`` (the loss's ``label_dtype``; None: it takes none),
    or for a loss that takes labels as the data gives them (``AS_GIVEN``, a Python loss) the data's own: integers
    as int64, other numbers as float32; None when the data has no labels. ``labels``: the data's (an array or a
    torch tensor), or None."""
    if wanted != AS_GIVEN:
        return None if wanted is None else np.dtype(wanted).name
    if labels is None:
        return None
    kind = getattr(labels, "dtype", np.asarray(labels).dtype)
    integer = (not kind.is_floating_point and not kind.is_complex and str(kind) != "torch.bool") \
        if hasattr(kind, "is_floating_point") else np.dtype(kind).kind in "iu"
    return "int64" if integer else "float32"


_KIND = {"c": "complex numbers", "U": "text", "S": "bytes", "O": "Python objects", "M": "dates", "m": "time spans",
         "V": "records"}


def check_kind(a: np.ndarray, dtype: str, name: str, source: str = "data") -> None:
    """``a`` holds numbers the graph's ``dtype`` reads without losing anything numpy would only warn about: complex
    data cast to float32 dropped its imaginary part (a ComplexWarning, then training on the real part); text or
    objects failed deep in the cast. A DataError naming the file and the array says what to give instead."""
    kind = np.dtype(dtype).kind
    if a.dtype.kind in "biuf" or a.dtype.kind == kind:
        if kind in "iu" and a.dtype.kind == "f" and not np.array_equal(a, np.round(a)):  # token ids given as floats
            raise DataError(f"{source}: '{name}' holds fractions ({a.dtype}), but the graph reads it as "
                            f"{np.dtype(dtype)} (indices); give whole numbers")
        return
    what = _KIND.get(a.dtype.kind, f"{a.dtype} values")
    fix = ("give its real part (x.real), or real and imaginary parts as separate channels" if a.dtype.kind == "c"
           else "give it as numbers")
    raise DataError(f"{source}: '{name}' holds {what} ({a.dtype}), but the graph reads it as {np.dtype(dtype)}; "
                    f"{fix}")


_CHUNK = 1 << 22  # elements checked at a time: the check's own memory stays small for any data size


def check_finite(arrays: dict[str, np.ndarray], dtypes: dict[str, str], source: str = "data") -> None:
    """Raise a :class:`DataError` naming ``source``, the array and the first index at which a floating-point
    array of ``dtypes`` (name -> the dtype the graph reads it as) holds NaN or inf, also after the cast (a
    float64 value beyond float32's range becomes inf). A model fed such a value diverges at its first step, for a
    cause that is the data's, not the model's."""
    for name, dtype in dtypes.items():
        if name not in arrays:
            continue
        a = np.asarray(arrays[name])
        if a.dtype.kind != "f":  # complex data is refused by check_kind, before anything is cast
            continue
        target = np.dtype(dtype) if np.dtype(dtype).kind in "fc" else a.dtype
        flat = a.reshape(-1)
        for start in range(0, flat.size, _CHUNK):
            with np.errstate(over="ignore", invalid="ignore"):
                finite = np.isfinite(flat[start:start + _CHUNK].astype(target, copy=False))
            if not finite.all():
                i = start + int(np.argmin(finite))
                index = [int(k) for k in np.unravel_index(i, a.shape)]
                value = flat[i]
                what = repr(float(value)) if np.isfinite(value) else str(value)
                beyond = f" (beyond the range of {target.name})" if np.isfinite(value) else ""
                raise DataError(f"{source}: '{name}' holds {what}{beyond} at index {index}: every model would "
                                "diverge on it; clean the data, or pass --allow-nonfinite-data "
                                "(allow_nonfinite_data: true in a config file) if the model is meant to read it")


def batches(n: int, batch_size: int, shuffle: bool, seed: int) -> Iterator[np.ndarray]:
    """Endless index batches: each epoch is a permutation (seeded) or file order; a final partial batch is dropped."""
    if batch_size < 1:
        raise DataError("--batch-size must be at least 1")
    if n < batch_size:
        raise DataError(f"the data has {n} samples, fewer than one batch of {batch_size}; lower --batch-size")
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(n) if shuffle else np.arange(n)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


class BatchSampler:
    """Batches of N sample indices over n samples: each epoch a seeded permutation (or file order), the last
    partial batch of an epoch skipped. With ``per_model`` = B, every model draws its own permutation (seed + b) and
    a batch is ``[B, N]`` indices. ``state_dict()`` / ``load_state_dict()`` capture the exact position (epoch,
    offset, generator state), so a resumed run draws the batches an uninterrupted one would."""

    def __init__(self, n: int, batch_size: int, shuffle: bool, seed: int, per_model: int | None = None):
        if batch_size < 1:
            raise DataError("--batch-size must be at least 1")
        if n < batch_size:
            raise DataError(f"the data has {n} samples, fewer than one batch of {batch_size}; lower --batch-size")
        self.n, self.N, self.shuffle, self.per_model = n, batch_size, shuffle, per_model
        streams = 1 if per_model is None else per_model
        self.rngs = [np.random.default_rng(seed + k) for k in range(streams)]
        self.epoch, self.offset, self.orders = 0, 0, None

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.N

    def _new_epoch(self) -> None:
        self.orders = [r.permutation(self.n) if self.shuffle else np.arange(self.n) for r in self.rngs]
        self.offset = 0

    def next(self) -> np.ndarray:
        if self.orders is None or self.offset + self.N > self.n:
            if self.orders is not None:
                self.epoch += 1
            self._new_epoch()
        idx = [o[self.offset:self.offset + self.N] for o in self.orders]
        self.offset += self.N
        return idx[0] if self.per_model is None else np.stack(idx)

    def keep(self, positions: list[int]) -> None:
        """Keep the streams of the models at ``positions`` (after the array shrinks)."""
        if self.per_model is not None:
            self.rngs = [self.rngs[i] for i in positions]
            self.orders = None if self.orders is None else [self.orders[i] for i in positions]
            self.per_model = len(positions)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "per_model": self.per_model,
                "rngs": [r.bit_generator.state for r in self.rngs],
                "orders": None if self.orders is None else [o.tolist() for o in self.orders]}

    def load_state_dict(self, d: dict) -> None:
        """Restore a :meth:`state_dict`; a value that this sampler cannot hold (a hand-edited or corrupt record:
        another type, a negative or too large position, a generator state numpy refuses, orders that are not
        permutations of the samples) is a ValueError saying which."""
        def count(key: str, top: int) -> int:
            v = d[key]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
                raise ValueError(f"{key} is {v!r}, not an integer from 0 to {top}")
            return v

        epoch, offset = count("epoch", 2 ** 62), count("offset", self.n)
        per_model = d["per_model"]
        if per_model != self.per_model:
            raise ValueError(f"per_model is {per_model!r}, this data order's is {self.per_model!r}")
        states = d["rngs"]
        if not isinstance(states, list) or len(states) != len(self.rngs):
            raise ValueError(f"rngs holds {len(states) if isinstance(states, list) else type(states).__name__} "
                             f"generator states, not {len(self.rngs)}")
        rngs = []
        for state in states:
            r = np.random.default_rng()
            r.bit_generator.state = state  # numpy checks the state (a TypeError or ValueError when wrong)
            rngs.append(r)
        orders = d["orders"]
        if orders is not None:
            if not isinstance(orders, list) or len(orders) != len(rngs):
                raise ValueError("orders is not one list per generator")
            orders = [np.asarray(o, dtype=np.int64) for o in orders]
            if any(o.shape != (self.n,) or not np.array_equal(np.sort(o), np.arange(self.n)) for o in orders):
                raise ValueError(f"orders are not permutations of the {self.n} samples")
        self.epoch, self.offset, self.rngs, self.orders = epoch, offset, rngs, orders
