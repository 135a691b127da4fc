"""Training data: one array per graph input plus ``labels``, taken in batches of N (shuffled per epoch or in
file order). Every model of the array sees the same batch."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from onnxfuse.errors import DataError, InputFileError

__all__ = ["Dataset", "load_npz", "batches"]


@dataclass
class Dataset:
    arrays: dict[str, np.ndarray]  # graph input name -> [n, ...], and "labels"

    def __len__(self) -> int:
        return len(self.arrays["labels"])


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise InputFileError(f"data file '{path}' does not exist")
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except Exception as e:
        raise InputFileError(f"'{path}' is not a readable .npz file ({type(e).__name__}: {e})") from e


def make_dataset(arrays: dict[str, np.ndarray], inputs: list[dict], label_dtype, label_shape: list,
                 source: str = "data") -> Dataset:
    """Check ``arrays`` against the graph's inputs and the loss's labels; cast to the graph's dtypes."""
    out = {}
    for spec in inputs + [{"name": "labels", "shape": label_shape, "dtype": np.dtype(label_dtype).name}]:
        name = spec["name"]
        if name not in arrays:
            have = ", ".join(sorted(arrays)) or "nothing"
            raise DataError(f"{source} has no array '{name}' (the graph input{'s' if name != 'labels' else ''} "
                            f"need it); it holds: {have}")
        a = np.asarray(arrays[name])
        want = spec["shape"] or []
        if a.ndim != len(want) or any(isinstance(d, int) and d != s for d, s in zip(want[1:], a.shape[1:])):
            expected = "[n" + "".join(f", {d}" for d in want[1:]) + "]"
            raise DataError(f"{source}: '{name}' has shape {list(a.shape)} but the graph expects {expected}")
        if name == "labels" and np.issubdtype(np.dtype(label_dtype), np.integer) and not np.issubdtype(a.dtype, np.integer):
            raise DataError(f"{source}: 'labels' must hold integer class indices for this loss, got {a.dtype}")
        out[name] = np.ascontiguousarray(a.astype(spec["dtype"], copy=False))
    n = {k: len(v) for k, v in out.items()}
    if len(set(n.values())) != 1:
        raise DataError(f"{source}: arrays have different lengths {n}; every array needs one row per sample")
    return Dataset(out)


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
