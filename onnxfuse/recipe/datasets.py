"""Data sources for training runs: scikit-learn's bundled data sets, torch datasets, held-out splits and shards.

Every function returns ``{name: array}`` dicts in the form :func:`training.data.make_dataset` takes: one array
per graph input (``input`` by default) plus ``labels``. A *shared* array is ``[n, ...]``; a *per-model* array has
a leading model axis ``[B, n, ...]`` (model b's sample i is ``a[b, i]``), so its sample axis is axis 1.
"""
from __future__ import annotations

import sys
from typing import Any, Iterable, Sequence

import numpy as np

from onnxfuse.core.errors import ConfigError, DataError

from onnxfuse.recipe.losses import LABELS

__all__ = ["NAMED_DATASETS", "load_named", "is_named", "is_data_factory", "reshape_for_input", "from_torch_dataset",
           "split_holdout", "shard"]

# name -> (scikit-learn loader, description, its file in sklearn/datasets/data); all ship with scikit-learn,
# nothing is downloaded
NAMED_DATASETS = {
    "sklearn:digits": ("load_digits", "1797 8x8 digit images as [n, 1, 8, 8] in [0, 1], 10 classes",
                       "digits.csv.gz"),
    "sklearn:iris": ("load_iris", "150 x 4 features, 3 classes", "iris.csv"),
    "sklearn:wine": ("load_wine", "178 x 13 features, 3 classes", "wine_data.csv"),
    "sklearn:breast_cancer": ("load_breast_cancer", "569 x 30 features, 2 classes", "breast_cancer.csv"),
}
PROGRESS_ABOVE = 10_000  # from_torch_dataset shows a progress bar for more samples than this


def is_named(spec: str) -> bool:
    """Whether ``spec`` names a bundled data set (``sklearn:...``) rather than a file."""
    return isinstance(spec, str) and spec.startswith("sklearn:")


def is_data_factory(spec) -> bool:
    """Whether ``spec`` names a function that makes the data, ``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION``
    (called with no arguments; it returns a torch DataLoader, a torch Dataset or a dict of arrays), rather than
    a file or a bundled data set."""
    if not isinstance(spec, str) or is_named(spec) or spec.endswith(".npz"):
        return False
    module, sep, function = spec.rpartition(":")
    return bool(sep and module) and function.isidentifier()


def load_named(spec: str) -> dict[str, np.ndarray]:
    """A bundled scikit-learn data set as ``{"input": float32, "labels": int64}``.

    ``sklearn:digits`` gives images ``[n, 1, 8, 8]`` scaled to [0, 1]; the tabular sets give their raw features
    ``[n, F]`` (not standardized)."""
    if spec not in NAMED_DATASETS:
        raise ConfigError(f"unknown data set '{spec}'; the bundled ones are: {', '.join(NAMED_DATASETS)}")
    read = _read_bundled(NAMED_DATASETS[spec][2])
    if read is None:
        import sklearn.datasets

        bunch = getattr(sklearn.datasets, NAMED_DATASETS[spec][0])()
        read = bunch.data, bunch.target
    x, y = read
    if spec == "sklearn:digits":
        x = (x.reshape(-1, 8, 8) / 16.0)[:, None]  # pixel values are 0..16
    return {"input": np.ascontiguousarray(x, dtype=np.float32), LABELS: y.astype(np.int64)}


def _read_bundled(name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(data, target) of scikit-learn's bundled file ``name`` read as its loader reads it (float64 features, the
    last column the target), without importing scikit-learn: that imports scipy, seconds in every process that
    trains on one of these (a sweep's workers, before their first step). None where the file is not there or
    not in that form (the loader is used then)."""
    import csv
    import gzip
    import importlib.util
    import os

    found = importlib.util.find_spec("sklearn")  # finds the package without running it
    if found is None or not found.submodule_search_locations:
        return None
    path = os.path.join(list(found.submodule_search_locations)[0], "datasets", "data", name)
    try:
        if name.endswith(".gz"):  # load_digits: np.loadtxt of the whole table
            with gzip.open(path, "rt") as f:
                table = np.loadtxt(f, delimiter=",")
        else:  # load_csv_data: a header (n_samples, n_features, target names), then the rows
            with open(path, encoding="utf-8") as f:
                rows = list(csv.reader(f))
            n, k = int(rows[0][0]), int(rows[0][1])
            table = np.asarray(rows[1:], dtype=np.float64)
            if table.shape != (n, k + 1):
                return None
    except (OSError, ValueError, IndexError):
        return None
    return table[:, :-1], table[:, -1].astype(int)


def reshape_for_input(x: np.ndarray, shape: Sequence, per_model: bool = False) -> np.ndarray:
    """Reshape samples to a graph input's shape when each sample has as many elements (``[n, 64]`` <->
    ``[n, 1, 8, 8]``).

    ``shape`` is the graph input's shape *with* its batch axis first (as in ``ArraySpec.inputs[i]["shape"]``;
    the batch entry is ignored, it may be symbolic). ``per_model`` keeps a leading model axis ``[B, n, ...]``.
    A sample axis with a symbolic size cannot be inferred: ``x`` is returned as it is when its rank fits."""
    x = np.asarray(x)
    lead = 2 if per_model else 1
    if x.ndim < lead:
        raise DataError(f"data of shape {list(x.shape)} has no sample axis to reshape to {list(shape)}")
    sample = list(shape)[1:]
    if not all(isinstance(d, (int, np.integer)) and d > 0 for d in sample):
        if x.ndim == lead + len(sample):
            return x
        raise DataError(f"data of shape {list(x.shape)} does not fit the graph input shape {list(shape)} (its "
                        "symbolic sizes cannot be inferred); reshape the data to the input's rank")
    if list(x.shape[lead:]) == [int(d) for d in sample]:
        return x
    have, want = int(np.prod(x.shape[lead:])), int(np.prod(sample))
    if have != want:
        raise DataError(f"data of shape {list(x.shape)} has {have} values per sample but the graph input shape "
                        f"{list(shape)} needs {want}; the element counts must match to reshape")
    return x.reshape(list(x.shape[:lead]) + [int(d) for d in sample])


def _to_numpy(value: Any) -> np.ndarray:
    """A torch tensor, numpy array, PIL image or Python number as a numpy array."""
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _sample_dict(sample: Any, input_names: Sequence[str], index: int) -> dict[str, np.ndarray]:
    """One dataset item as ``{name: array}``: a dict as it is, or a tuple (inputs..., label)."""
    if isinstance(sample, dict):
        return {str(k): _to_numpy(v) for k, v in sample.items()}
    items = list(sample) if isinstance(sample, (tuple, list)) else [sample]
    n_in = len(input_names)
    if len(items) not in (n_in, n_in + 1):
        raise DataError(f"dataset item {index} has {len(items)} parts but input_names={list(input_names)} expects "
                        f"{n_in} input(s) and an optional label; pass matching input_names")
    names = list(input_names) + ([LABELS] if len(items) == n_in + 1 else [])
    return {name: _to_numpy(v) for name, v in zip(names, items)}


def _progress(indices: Iterable[int], n: int) -> Iterable[int]:
    if n <= PROGRESS_ABOVE:
        return indices
    from tqdm import tqdm

    return tqdm(indices, total=n, unit="sample", desc="reading dataset", file=sys.stderr, dynamic_ncols=True)


def from_torch_dataset(ds: Any, input_names: Sequence[str] = ("input",)) -> dict[str, np.ndarray]:
    """Materialize a map-style dataset (``len(ds)`` and ``ds[i]``, e.g. a ``torch.utils.data.Dataset``) into
    stacked arrays. Items are ``(x, y)`` tuples (``(x1, x2, ..., y)`` with more ``input_names``; the label is
    optional) or dicts of arrays; tensors become numpy arrays, integer labels int64."""
    if isinstance(input_names, str):
        input_names = (input_names,)
    try:
        n = len(ds)
    except TypeError:
        raise DataError(f"{type(ds).__name__} has no len(); pass a map-style dataset (len and [i]), not an "
                        "iterable one") from None
    if n == 0:
        raise DataError(f"{type(ds).__name__} is empty; it needs at least one sample")
    columns: dict[str, list[np.ndarray]] = {}
    for i in _progress(range(n), n):
        sample = _sample_dict(ds[i], input_names, i)
        if columns and set(sample) != set(columns):
            raise DataError(f"dataset item {i} has arrays {sorted(sample)} but item 0 has {sorted(columns)}")
        for k, v in sample.items():
            columns.setdefault(k, []).append(v)
    out = {}
    for k, vals in columns.items():
        shapes = {v.shape for v in vals}
        if len(shapes) != 1:
            raise DataError(f"dataset samples of '{k}' have different shapes {sorted(shapes)[:3]}; "
                            "every sample needs the same shape (resize or pad them)")
        a = np.stack(vals)
        if a.dtype == np.float64:
            a = a.astype(np.float32)
        elif np.issubdtype(a.dtype, np.integer) and k == LABELS:
            a = a.astype(np.int64)
        out[k] = a
    return out


def _num_samples(arrays: dict[str, np.ndarray], per_model: set[str] | frozenset[str]) -> int:
    """The common sample count (axis 1 of per-model arrays, axis 0 of the others)."""
    if not arrays:
        raise DataError("no arrays given; the data needs at least one array")
    n = {k: (np.shape(v)[1] if k in per_model else np.shape(v)[0]) for k, v in arrays.items()}
    if len(set(n.values())) != 1:
        raise DataError(f"arrays have different numbers of samples {n}; every array needs one row per sample "
                        "(axis 1 for per-model arrays)")
    return next(iter(n.values()))


def _take(arrays: dict[str, np.ndarray], idx: np.ndarray, per_model: set[str] | frozenset[str]) -> dict:
    return {k: (np.asarray(v)[:, idx] if k in per_model else np.asarray(v)[idx]) for k, v in arrays.items()}


def split_holdout(arrays: dict[str, np.ndarray], fraction: float, seed: int,
                  per_model: set[str] | frozenset[str] = frozenset()) -> tuple[dict, dict]:
    """A seeded random (train, eval) split: ``round(fraction * n)`` samples (at least 1) go to eval, the others
    to train, each part in the original sample order. Per-model arrays (names in ``per_model``) are split along
    axis 1 with the same indices for every model."""
    fraction = float(fraction)
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"data.eval_fraction = {fraction} must be between 0 and 1 (exclusive), e.g. 0.1")
    n = _num_samples(arrays, per_model)
    n_eval = max(1, int(round(fraction * n)))
    if n_eval >= n:
        raise DataError(f"the data has {n} samples: too few to hold out {fraction:g} of them and keep any for "
                        "training; use more data or a smaller data.eval_fraction")
    order = np.random.default_rng(seed).permutation(n)
    eval_idx, train_idx = np.sort(order[:n_eval]), np.sort(order[n_eval:])
    return _take(arrays, train_idx, per_model), _take(arrays, eval_idx, per_model)


def shard(arrays: dict[str, np.ndarray], B: int, per_model_keys: set[str] | frozenset[str] = frozenset()
          ) -> dict[str, np.ndarray]:
    """Give model b the b-th of B equal consecutive shards: every array becomes per model ``[B, n // B, ...]``
    (the last ``n % B`` samples are dropped). Arrays named in ``per_model_keys`` already are per model
    ``[B, n, ...]``; model b's shard is then taken from its own row."""
    if not isinstance(B, (int, np.integer)) or B < 1:
        raise ConfigError(f"cannot shard data for B={B} models; B must be a positive integer")
    n = _num_samples(arrays, per_model_keys)
    size = n // B
    if size == 0:
        raise DataError(f"the data has {n} samples, fewer than one per model for B={B} shards; use more data or "
                        "data.order: shared")
    out = {}
    for k, v in arrays.items():
        a = np.asarray(v)
        if k in per_model_keys:
            if a.shape[0] != B:
                raise DataError(f"'{k}' is per model but its leading axis is {a.shape[0]}, not B={B}")
            out[k] = np.stack([a[b, b * size:(b + 1) * size] for b in range(B)])
        else:
            out[k] = a[: B * size].reshape((B, size) + a.shape[1:])
    return out
